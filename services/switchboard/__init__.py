"""switchboard: an LLM serving system (gRPC gateway, engine cores, workers)."""

__version__ = "0.1.0"
