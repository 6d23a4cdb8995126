"""What both runners (decoder and encoder) do to load their model and describe it to the engine."""

from __future__ import annotations

import logging

import torch

from switchboard.config import ModelConfig
from switchboard.kernels import bf16_gemm, gemm, small_batch_gemm
from switchboard.models.hf_config import TransformerConfig, load_transformer_config
from switchboard.models.loader import load_model, resolve_dtype
from switchboard.models.parallel import SINGLE_PROCESS, ParallelState
from switchboard.models.prepack import prepack_weights
from switchboard.models.quantized import Quantization, asks_quantized, quantize_weights
from switchboard.wire.step_msgs import ModelSummary

logger = logging.getLogger(__name__)


def load_runner_model(
    model_config: ModelConfig,
    device: torch.device,
    parallel: ParallelState = SINGLE_PROCESS,
    log_prefix: str = "",
) -> tuple[torch.nn.Module, TransformerConfig, torch.dtype, Quantization]:
    """Resolve the dtype (logged: what was asked for, what the checkpoint has), then load the
    checkpoint's share for ``parallel`` and quantize its matrices as asked. Returns (model, its
    config, the dtype it runs in, the quantization applied)."""
    config = load_transformer_config(model_config.model)
    quantized = asks_quantized(model_config.model, model_config.quantization)
    dtype = resolve_dtype(model_config.dtype, config, device, quantized)
    logger.info(
        "%sdtype %s (requested %r, checkpoint %s, device %s)",
        log_prefix,
        dtype_name(dtype),
        model_config.dtype,
        config.checkpoint_dtype,
        device.type,
    )
    resolve_kv_cache_dtype(model_config.kv_cache_dtype, dtype, device)  # refused before loading
    model, config = load_model(model_config.model, device, dtype, parallel)
    quantization = quantize_weights(
        model, model_config.model, model_config.quantization, device, dtype, parallel
    )
    packed, seconds = prepack_weights(model)
    if packed and dtype == torch.bfloat16:
        logger.info(
            "%sbfloat16 panels of %d weight matrices in %.2f s; bfloat16 small-batch kernel %s",
            log_prefix,
            packed,
            seconds,
            bf16_gemm.status(),
        )
    elif packed:
        logger.info(
            "%spacked %d weight matrices for oneDNN in %.2f s; small-batch matmul kernel %s",
            log_prefix,
            packed,
            seconds,
            small_batch_gemm.status(),
        )
    return model, config, dtype, quantization


_KV_CACHE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def resolve_kv_cache_dtype(requested: str, dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The KV cache's dtype for ``--kv-cache-dtype`` (auto: the model's ``dtype``). Raises
    ValueError for an unknown name, or a dtype other than the model's off the CPU (only the CPU
    attention paths convert between them)."""
    if requested == "auto":
        return dtype
    if requested not in _KV_CACHE_DTYPES:
        raise ValueError(
            f"unknown KV cache dtype {requested!r}; use auto, {', '.join(_KV_CACHE_DTYPES)}"
        )
    chosen = _KV_CACHE_DTYPES[requested]
    if chosen != dtype and device.type != "cpu":
        raise ValueError(
            f"--kv-cache-dtype {requested} with a {dtype_name(dtype)} model on {device.type}: "
            "a KV cache dtype other than the model's runs on CPU only"
        )
    return chosen


def model_summary(
    config: TransformerConfig,
    dtype: torch.dtype,
    kv_cache_bytes_per_token: int,
    device: torch.device,
    quantization: Quantization,
) -> ModelSummary:
    return ModelSummary(
        num_layers=config.num_layers,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        vocab_size=config.vocab_size,
        max_position_embeddings=config.max_position_embeddings,
        dtype=dtype_name(dtype),
        kv_cache_bytes_per_token=kv_cache_bytes_per_token,
        device_type=device.type,
        quantization=quantization.describe(),
        few_rows_limit=gemm.few_rows_limit(dtype) if device.type == "cpu" else 0,
    )


def require_config(config: TransformerConfig | None) -> TransformerConfig:
    if config is None:
        raise RuntimeError("the model is not loaded yet (call load_model first)")
    return config


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
