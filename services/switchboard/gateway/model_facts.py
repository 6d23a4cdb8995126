"""What the gateway knows about the served model: from the checkpoint directory, then READY.

The checkpoint gives the end-of-sequence ids and the sampling defaults (generation_config.json);
the engine's READY gives the facts that may differ from configuration (max_model_len after
fitting the KV cache, vocabulary size, dtype), and those win once an engine is ready.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any

from switchboard.config import ModelConfig
from switchboard.wire.engine_msgs import EngineReady

logger = logging.getLogger(__name__)

# Sampling knobs whose unset value comes from generation_config.json (as in vLLM).
_DEFAULT_KNOBS = ("temperature", "top_p", "top_k")


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _token_ids(value: Any) -> list[int]:
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int)]
    return []


@dataclasses.dataclass(frozen=True)
class ModelFacts:
    name: str
    model_path: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    dtype: str
    generation_config: dict[str, Any]  # the checkpoint's generation_config.json, as is
    sampling_defaults: dict[str, float | int]  # temperature / top_p / top_k from it

    @classmethod
    def from_checkpoint(cls, model: ModelConfig, tokenizer_vocab_size: int = 0) -> ModelFacts:
        config = _read_json(os.path.join(model.model, "config.json"))
        generation_config = _read_json(os.path.join(model.model, "generation_config.json"))
        eos: list[int] = []
        for source in (config, generation_config):
            eos += [t for t in _token_ids(source.get("eos_token_id")) if t not in eos]
        bos = generation_config.get("bos_token_id", config.get("bos_token_id"))
        max_model_len = model.max_model_len or int(config.get("max_position_embeddings") or 0)
        vocab_size = int(config.get("vocab_size") or tokenizer_vocab_size)
        defaults = {
            knob: generation_config[knob]
            for knob in _DEFAULT_KNOBS
            if isinstance(generation_config.get(knob), int | float)
        }
        return cls(
            name=model.name,
            model_path=model.model,
            max_model_len=max_model_len,
            vocab_size=vocab_size,
            eos_token_ids=tuple(eos),
            bos_token_id=bos if isinstance(bos, int) else None,
            dtype=model.dtype if model.dtype != "auto" else str(config.get("torch_dtype", "")),
            generation_config=generation_config,
            sampling_defaults=defaults,
        )

    def with_engine(self, ready: EngineReady) -> ModelFacts:
        """The engine's facts win: it fitted max_model_len to its KV cache."""
        return dataclasses.replace(
            self,
            max_model_len=ready.max_model_len or self.max_model_len,
            vocab_size=ready.vocab_size or self.vocab_size,
            dtype=ready.dtype or self.dtype,
        )
