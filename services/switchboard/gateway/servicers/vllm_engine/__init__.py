"""``vllm.grpc.engine.VllmEngine``, the engine contract inference routers speak (SMG's gRPC
mode, the Gateway API Inference Extension's endpoint picker), from the ``smg-grpc-proto``
stubs, served beside ``switchboard.v1`` through the same request path."""
