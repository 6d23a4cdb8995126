"""Constants the client side needs too: importable with the client install (no msgspec, torch)."""

DEFAULT_GRPC_PORT = 50051
DEFAULT_HTTP_PORT = 8000  # the OpenAI-compatible HTTP API (as vLLM)
