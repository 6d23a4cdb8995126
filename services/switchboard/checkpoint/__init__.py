"""Checkpoints on disk: locate, fetch and convert them (numpy only; never imports torch).

The CLI launcher calls `resolve_model(--model)` once and hands the resulting directory to the
gateway (tokenizer files) and the workers (config.json + model.safetensors).
"""

from switchboard.checkpoint.default_model import (
    DEFAULT_MODEL_NAME,
    cache_root,
    default_model_dir,
    hub_model_id,
    resolve_model,
)
from switchboard.checkpoint.gguf_to_hf import convert_gguf_to_hf

__all__ = [
    "DEFAULT_MODEL_NAME",
    "cache_root",
    "convert_gguf_to_hf",
    "default_model_dir",
    "hub_model_id",
    "resolve_model",
]
