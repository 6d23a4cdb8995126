"""The gRPC services the gateway serves: generation (Generate, Tokenize, …), embeddings, the
model service and the admin service. Each is thin: the pipeline and the engine client do the
work."""
