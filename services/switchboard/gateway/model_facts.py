"""What the gateway knows about the served model: from the checkpoint directory, then READY.

The checkpoint gives the end-of-sequence ids and the sampling defaults (generation_config.json);
the engine's READY gives the facts that may differ from configuration (max_model_len after
fitting the KV cache, vocabulary size, dtype, quantization), and those win once an engine is
ready.

Sampling defaults follow vLLM: the knobs generation_config.json sets (temperature, top_p, top_k,
min_p, repetition_penalty, and max_new_tokens as a cap on max_tokens) fill the request fields a
client leaves unset; a field the client sets always wins. Like vLLM, ``do_sample`` is not read:
a checkpoint that sets ``temperature`` samples by default. A value outside its valid range is
dropped with a warning rather than making every request fail.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from collections.abc import Callable
from typing import Any

from switchboard.common.model_tasks import ModelTasks, read_model_tasks
from switchboard.config import ModelConfig
from switchboard.gateway.lora_names import LoraNames
from switchboard.wire.engine_msgs import EngineReady

logger = logging.getLogger(__name__)

# Sampling knobs whose unset value comes from generation_config.json (as in vLLM), each with
# the rule a value must follow to be used.
_DEFAULT_KNOBS: dict[str, Callable[[float], bool]] = {
    "temperature": lambda v: v >= 0,
    "top_p": lambda v: 0 < v <= 1,
    "top_k": lambda v: v >= -1 and float(v).is_integer(),
    "min_p": lambda v: 0 <= v <= 1,
    "repetition_penalty": lambda v: v > 0,
}
# generation_config.json name -> our name, for knobs that are named differently.
_RENAMED_KNOBS = {"max_new_tokens": "max_tokens"}


def sampling_defaults_from(generation_config: dict[str, Any]) -> dict[str, float | int]:
    """The request defaults a generation_config.json supplies: knob -> value.

    ``max_tokens`` (from ``max_new_tokens``) caps the default output length; the others are
    used as is. ``top_k`` and ``max_tokens`` are ints, the rest floats.
    """
    defaults: dict[str, float | int] = {}
    for knob, is_valid in _DEFAULT_KNOBS.items():
        value = generation_config.get(knob)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            logger.warning("generation_config.json: %s=%r is not a number; ignored", knob, value)
        elif not math.isfinite(value) or not is_valid(value):
            logger.warning("generation_config.json: %s=%r is out of range; ignored", knob, value)
        else:
            defaults[knob] = int(value) if knob == "top_k" else float(value)
    for source, knob in _RENAMED_KNOBS.items():
        value = generation_config.get(source)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            defaults[knob] = value
        elif value is not None:
            logger.warning("generation_config.json: %s=%r is not >= 1; ignored", source, value)
    return defaults


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
    sampling_defaults: dict[str, float | int]  # see sampling_defaults_from
    tasks: ModelTasks = ModelTasks()  # generate and/or embed, and the pooling defaults
    # the weights kept quantized for decode, as an engine reports it ("" until one does)
    quantization: str = ""
    # the LoRA adapters served beside it (one object, shared by every copy of these facts)
    loras: LoraNames = dataclasses.field(default_factory=LoraNames)

    @classmethod
    def from_checkpoint(cls, model: ModelConfig, tokenizer_vocab_size: int = 0) -> ModelFacts:
        config = _read_json(os.path.join(model.model, "config.json"))
        generation_config = _read_json(os.path.join(model.model, "generation_config.json"))
        eos: list[int] = []
        for source in (config, generation_config):
            eos += [t for t in _token_ids(source.get("eos_token_id")) if t not in eos]
        bos = generation_config.get("bos_token_id", config.get("bos_token_id"))
        max_positions = config.get("max_position_embeddings") or config.get("n_positions")
        max_model_len = model.max_model_len or int(max_positions or 0)
        vocab_size = int(config.get("vocab_size") or tokenizer_vocab_size)
        defaults = sampling_defaults_from(generation_config)
        if defaults:
            logger.info("request defaults from generation_config.json: %s", defaults)
        return cls(
            name=model.name,
            model_path=model.model,
            max_model_len=max_model_len,
            vocab_size=vocab_size,
            eos_token_ids=tuple(eos),
            bos_token_id=bos if isinstance(bos, int) else None,
            dtype=model.dtype
            if model.dtype != "auto"
            else str(config.get("dtype") or config.get("torch_dtype") or ""),
            generation_config=generation_config,
            sampling_defaults=defaults,
            tasks=read_model_tasks(model.model),
            loras=LoraNames(model.lora),
        )

    def with_engine(self, ready: EngineReady) -> ModelFacts:
        """The engine's facts win: it fitted max_model_len to its KV cache."""
        return dataclasses.replace(
            self,
            max_model_len=ready.max_model_len or self.max_model_len,
            vocab_size=ready.vocab_size or self.vocab_size,
            dtype=ready.dtype or self.dtype,
            quantization=ready.quantization or self.quantization,
        )
