"""Loading a Hugging Face checkpoint directory into one of our model families.

A checkpoint is ``config.json`` plus either one ``model.safetensors`` or several shards
listed in ``model.safetensors.index.json``. The model is built directly on the target device
in the target dtype with uninitialised parameters (no random init, no second copy), then
filled tensor by tensor; a parameter the checkpoint does not fill is an error.

Under tensor or pipeline parallelism (``parallel``) each worker builds only its share of the
model and keeps only its slice of each tensor (read one tensor at a time), and skips the tensors
of other pipeline stages.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Iterator
from typing import Protocol

import torch
from safetensors import safe_open
from torch import nn

from switchboard.kernels import bf16_gemm
from switchboard.models.attention import AttentionMetadata
from switchboard.models.bert import BertModel
from switchboard.models.cpu_dtype import cpu_auto_dtype
from switchboard.models.gpt2 import GPT2LMHeadModel
from switchboard.models.hf_config import TransformerConfig, load_transformer_config
from switchboard.models.llama import LlamaForCausalLM
from switchboard.models.mistral import MistralForCausalLM
from switchboard.models.parallel import SINGLE_PROCESS, ParallelState
from switchboard.models.qwen2 import Qwen2ForCausalLM

logger = logging.getLogger(__name__)

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


class CausalLM(Protocol):
    """What the model runner (``worker/model_runner.py``) needs from a decoder family: calling
    the model runs ``forward`` (``nn.Module.__call__``), then ``compute_logits`` on the last
    pipeline stage."""

    config: TransformerConfig

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
        intermediate: torch.Tensor | None = None,
    ) -> torch.Tensor: ...

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
        intermediate: torch.Tensor | None = None,
    ) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


# What a model family is (Qwen2 and Mistral are Llamas).
ModelFamily = LlamaForCausalLM | GPT2LMHeadModel | BertModel
# Hugging Face architecture name -> our implementation.
MODEL_FAMILIES: dict[str, type[ModelFamily]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "BertModel": BertModel,  # an encoder: serves embeddings only (model_tasks.py)
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "GPT2LMHeadModel": GPT2LMHeadModel,
}
# For configs without "architectures": model_type -> architecture name.
_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mistral": "MistralForCausalLM",
    "gpt2": "GPT2LMHeadModel",
}


def model_family(config: TransformerConfig) -> type[ModelFamily]:
    name = config.architecture
    if name not in MODEL_FAMILIES:
        name = _MODEL_TYPES.get(config.model_type, name)
    if name not in MODEL_FAMILIES:
        raise ValueError(
            f"unsupported architecture {config.architecture!r} (model_type "
            f"{config.model_type!r}); supported: {', '.join(sorted(MODEL_FAMILIES))}"
        )
    return MODEL_FAMILIES[name]


def as_causal_lm(model: nn.Module) -> CausalLM:
    """``model`` as the model runner drives it: a decoder family (each is a CausalLM). The
    worker hands encoders (``model_tasks``) to the encoder runner, so this never raises for a
    family in ``MODEL_FAMILIES``."""
    if not isinstance(model, (LlamaForCausalLM, GPT2LMHeadModel)):  # Qwen2, Mistral: Llamas
        raise TypeError(f"{type(model).__name__} is not a causal LM (it has no logits)")
    return model


def resolve_dtype(
    requested: str, config: TransformerConfig, device: torch.device, quantized: bool = False
) -> torch.dtype:
    """``auto`` on CPU: bfloat16 for a half-precision checkpoint not served ``quantized`` where
    the CPU runs bfloat16 faster, else float32 (``cpu_dtype.py``; always logged, with why);
    on CUDA bfloat16, unless the checkpoint is float16 (kept) or the GPU lacks bfloat16
    (float16); on another accelerator the checkpoint's dtype (``dtype``/``torch_dtype`` in
    config.json), float32 if it names none.
    Logs the reason whenever the choice is not simply the one asked for."""
    if requested != "auto":
        if requested not in _DTYPES:
            raise ValueError(f"unknown dtype {requested!r}; use auto, float32, float16, bfloat16")
        slow_bf16 = requested == "bfloat16" and not bf16_gemm.faster_than_float32()
        if device.type == "cpu" and requested == "float16":
            logger.warning("dtype float16 on CPU is slow; --dtype auto would not use it")
        elif device.type == "cpu" and slow_bf16:
            logger.warning("dtype bfloat16 on this CPU is slower than float32 (no AVX-512 BF16)")
        return _DTYPES[requested]
    checkpoint = _DTYPES.get(str(config.checkpoint_dtype).removeprefix("torch."))
    if device.type == "cpu":
        dtype, why = cpu_auto_dtype(checkpoint, quantized)
        logger.info("dtype auto: %s on CPU (%s)", str(dtype).removeprefix("torch."), why)
        return dtype
    if device.type == "cuda" and checkpoint != torch.float16:
        # bfloat16 on CUDA for float32 checkpoints and those that name no dtype too: tensor
        # cores, half the memory traffic, and the range float32 weights were trained in.
        if not _cuda_bf16(device):
            logger.warning("dtype auto: float16, since %s has no bfloat16 support", device)
            return torch.float16
        if checkpoint != torch.bfloat16:
            logger.info(
                "dtype auto: bfloat16 on CUDA (the checkpoint's dtype is %r)",
                config.checkpoint_dtype,
            )
        return torch.bfloat16
    if checkpoint is None:
        logger.info(
            "dtype auto: float32 (the checkpoint's dtype %r is not float32/float16/bfloat16)",
            config.checkpoint_dtype,
        )
        return torch.float32
    if checkpoint == torch.bfloat16 and device.type == "cuda" and not _cuda_bf16(device):
        logger.warning("dtype auto: float16, since %s has no bfloat16 support", device)
        return torch.float16
    return checkpoint


def _share_description(parallel: ParallelState, num_layers: int) -> str:
    if parallel.world_size == 1:
        return ""
    layers = parallel.stage_layers(num_layers)
    return (
        f" on this worker: TP rank {parallel.tp_rank} of {parallel.tp_size}, PP stage "
        f"{parallel.pp_rank} of {parallel.pp_size} with layers {layers.start}..{layers.stop - 1}"
    )


def _cuda_bf16(device: torch.device) -> bool:
    if not torch.cuda.is_available():  # only planning (tests): assume a current GPU
        return True
    with torch.cuda.device(device):
        return torch.cuda.is_bf16_supported()


def resolve_device(requested: str, local_rank: int = 0) -> torch.device:
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda":
        return torch.device("cuda", local_rank)
    return torch.device(requested)


def safetensors_files(model_dir: str) -> list[str]:
    index_path = os.path.join(model_dir, SAFETENSORS_INDEX)
    if os.path.isfile(index_path):
        with open(index_path, encoding="utf-8") as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        return [os.path.join(model_dir, name) for name in sorted(set(weight_map.values()))]
    single = os.path.join(model_dir, SAFETENSORS_SINGLE)
    if os.path.isfile(single):
        return [single]
    raise FileNotFoundError(
        f"no {SAFETENSORS_SINGLE} or {SAFETENSORS_INDEX} in {model_dir!r} "
        "(only safetensors checkpoints are supported)"
    )


def iterate_weights(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint, one at a time (CPU, checkpoint dtype)."""
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, f.get_tensor(name)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def load_model(
    model_dir: str,
    device: torch.device,
    dtype: torch.dtype,
    parallel: ParallelState = SINGLE_PROCESS,
) -> tuple[nn.Module, TransformerConfig]:
    started = time.monotonic()
    config = load_transformer_config(model_dir)
    family = model_family(config)
    extra: dict[str, ParallelState] = {}
    if parallel.world_size > 1:
        if not getattr(family, "supports_parallel", False):
            raise ValueError(
                f"{config.architecture} does not support tensor or pipeline parallelism "
                f"(-tp {parallel.tp_size} -pp {parallel.pp_size}); run it with -tp 1 -pp 1"
            )
        extra["parallel"] = parallel
    with torch.device(device), _default_dtype(dtype):
        model = family(config, device=device, **extra)
    loaded = model.load_weights(iterate_weights(model_dir))
    missing = sorted(set(dict(model.named_parameters())) - loaded)
    if missing:
        raise ValueError(f"checkpoint {model_dir!r} lacks weights for: {', '.join(missing[:8])}")
    model.eval()
    num_params = sum(p.numel() for p in model.parameters())
    logger.info(
        "loaded %s (%s, %.1fM parameters%s) on %s as %s in %.1f s",
        model_dir,
        config.architecture,
        num_params / 1e6,
        _share_description(parallel, config.num_layers),
        device,
        str(dtype).removeprefix("torch."),
        time.monotonic() - started,
    )
    return model, config
