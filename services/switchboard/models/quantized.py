"""Keep a loaded model's matrices quantized for decode-sized matmuls (CPU, float32 models).

At one request a decode step reads every weight once and does little else with it: the step
takes the time the weights take to read. With quantized panels (``kernels/quant_gemm.py``) a
matrix's products of at most ``gemm.SMALL_BATCH_MAX_ROWS`` rows (decode steps, the one-call
decode stack included) read 0.75-1.5 bytes a weight instead of 4. The default kernel (integer
dot products) takes every product, prefill too: it is faster there than oneDNN's float32 one, and
a row's logits then never depend on how many rows its step holds, so greedy output does not
change with the load. Under ``exact`` larger products (prefill) keep the float32 matrix and
oneDNN, equal to rounding. The panels go where the float32
small-batch panels would (a layer's ``small_batch``; ``prepack.py`` then leaves them alone).

The modes (``--quantization``, ``ModelConfig.quantization``):

- ``gguf``: the checkpoint's own GGUF blocks (a checkpoint converted from a GGUF file carries
  them: ``checkpoint/gguf_blocks.py``): Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K. They are
  the very values of the float32 weights. The default kernel multiplies them with the rows
  quantized to int8 (integer dot products, as llama.cpp does): greedy output is the float32
  model's except where its top two logits nearly tie; ``SWITCHBOARD_QUANT_GEMM=exact`` gives
  the float32 kernel's floats exactly, slower (``kernels/quant_gemm.py``). A matrix of another
  block type is an error naming it and its type.
- ``int8``: any checkpoint: every matrix quantized at load, per 32 inputs, symmetric
  (``quant_formats.quantize_int8``): weight-only, approximate.
- ``auto`` (the default): ``gguf`` where the checkpoint carries GGUF blocks, a matrix of a type
  the kernel does not take staying float32 (logged); else ``none``.
- ``none``: float32 throughout.

The logits matrix is quantized with the others: for SmolLM2-135M (its Q8_0 embedding, tied) it
is about a fifth of the weights a step reads (``bench/quant_decode.py`` measures the difference).
Quantized panels need the float32 CPU path and one tensor-parallel rank (a rank's slice of a
block-quantized matrix is not a matrix of whole blocks in general): elsewhere ``auto`` and the
explicit modes fall back to float32 with one log line. The panels are a second copy beside the
float32 weights, which the embedding lookup (and prefill under ``exact``) still read.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from switchboard.checkpoint.gguf_blocks import has_gguf_blocks, read_gguf_blocks
from switchboard.kernels import quant_gemm
from switchboard.kernels.quant_formats import (
    QuantRows,
    UnsupportedQuantType,
    decode_gguf,
    quantize_int8,
    stack_rows,
)
from switchboard.models.layers import Linear, MergedLinear
from switchboard.models.parallel import ParallelState
from switchboard.models.parallel_layers import RowParallelLinear, VocabParallelEmbedding
from switchboard.models.weights import LLAMA_STACKED_MODULES

logger = logging.getLogger(__name__)

MODES = ("auto", "none", "gguf", "int8")
# The modules whose matrix can take quantized panels (their ``small_batch``).
_Target = Linear | RowParallelLinear | VocabParallelEmbedding


@dataclass(frozen=True)
class Quantization:
    """What ``quantize_weights`` did."""

    mode: str  # "none", "gguf" or "int8"
    formats: tuple[str, ...] = ()  # the matrices' types ("Q4_1", "Q8_0", "int8")
    matrices: int = 0
    nbytes: int = 0
    float32_matrices: tuple[str, ...] = ()  # checkpoint names left float32 (types not taken)
    rounded_rows: bool = False  # the panels' kernel rounds each row to 8 bits (dot products)

    def describe(self) -> str:
        """For the model summary: ``none``, ``int8``, ``gguf Q4_1, Q8_0``."""
        return f"gguf {', '.join(self.formats)}" if self.mode == "gguf" else self.mode


NONE = Quantization("none")


def check_mode(requested: str) -> str:
    if requested not in MODES:
        raise ValueError(f"unknown quantization {requested!r}; use {', '.join(MODES)}")
    return requested


def asks_quantized(model_dir: str, requested: str) -> bool:
    """Whether ``requested`` (one of ``MODES``) quantizes this checkpoint's weights where the
    kernel applies (auto: a checkpoint carrying GGUF blocks)."""
    mode = check_mode(requested)
    return mode != "none" and (mode != "auto" or has_gguf_blocks(model_dir))


def quantize_weights(
    model: nn.Module,
    model_dir: str,
    requested: str,
    device: torch.device,
    dtype: torch.dtype,
    parallel: ParallelState,
) -> Quantization:
    """Give ``model``'s matrices quantized panels as ``requested`` (one of ``MODES``); logs one
    line saying what it did. Call after the checkpoint is loaded, before ``prepack_weights``."""
    mode = check_mode(requested)
    if mode == "auto":
        mode = "gguf" if has_gguf_blocks(model_dir) else "none"
    if mode == "none":
        return NONE
    if mode == "gguf" and not has_gguf_blocks(model_dir):
        raise ValueError(
            f"quantization gguf: {model_dir} carries no GGUF blocks (only a checkpoint "
            "converted from a .gguf file does); use int8 or none"
        )
    unusable = _why_not_quantized(device, dtype, parallel)
    if unusable is not None:
        logger.info("weights: float32, not quantized (%s)", unusable)
        return NONE
    started = time.monotonic()
    if mode == "gguf":
        rows, kept_float32 = _gguf_rows(model, model_dir, strict=requested == "gguf")
    else:
        rows, kept_float32 = _int8_rows(model), ()
    formats: set[str] = set()
    nbytes = 0
    rounded_rows = False
    for module, quant_rows in rows:
        panels = quant_gemm.pack(quant_rows)
        module.small_batch = panels
        formats.update(_formats(quant_rows))
        nbytes += panels.nbytes
        rounded_rows = rounded_rows or panels.dot
    done = Quantization(mode, tuple(sorted(formats)), len(rows), nbytes, kept_float32, rounded_rows)
    logger.info(
        "weights: %s kept quantized for %s (%d matrices, %.1f MiB, in %.1f s; %s)%s%s",
        f"{', '.join(done.formats)} blocks" if mode == "gguf" else "int8 (made at load)",
        "decode and prefill" if rounded_rows else "decode",
        done.matrices,
        nbytes / 2**20,
        time.monotonic() - started,
        _kernel_text(),
        "" if rounded_rows else "; prefill float32",
        f"; float32 (types the kernel does not take): {', '.join(kept_float32)}"
        if kept_float32
        else "",
    )
    return done


def _kernel_text() -> str:
    """Which quantized matmul kernel the decode steps use, for the load's log line."""
    if quant_gemm.variant() == quant_gemm.EXACT:
        return "matmuls: exact float32 sums (SWITCHBOARD_QUANT_GEMM=exact)"
    return (
        f"matmuls: integer dot products, {quant_gemm.variant()}, rows quantized to int8 per "
        "block (SWITCHBOARD_QUANT_GEMM=exact: float32 sums)"
    )


def _why_not_quantized(
    device: torch.device, dtype: torch.dtype, parallel: ParallelState
) -> str | None:
    if device.type != "cpu" or dtype != torch.float32:
        return (
            f"quantized matmuls run on CPU in float32, this model runs on {device.type} in {dtype}"
        )
    if parallel.tp_size > 1:
        return "a tensor-parallel rank's slice of a quantized matrix is not whole blocks"
    if not quant_gemm.load():
        return f"the quantized matmul kernel is {quant_gemm.status()}"
    return None


def _formats(rows: QuantRows) -> set[str]:
    return {rows.format} if rows.format != "mixed" else set()


def _targets(model: nn.Module) -> Iterator[tuple[str, _Target]]:
    """(path, module) of every matrix that can take quantized panels: the linear layers, and
    the logits matrix (the LM head, or the embedding it is tied to)."""
    for path, module in model.named_modules():
        if isinstance(module, (Linear, RowParallelLinear)):
            yield path, module
    head = _logits_head(model)
    if head is not None:
        yield next(path for path, module in model.named_modules() if module is head), head


def _logits_head(model: nn.Module) -> VocabParallelEmbedding | None:
    logits_head = getattr(model, "logits_head", None)
    if logits_head is None:
        return None  # an encoder
    try:
        head = logits_head()
    except RuntimeError:
        return None  # a pipeline stage before the last
    return head if isinstance(head, VocabParallelEmbedding) else None


def _int8_rows(model: nn.Module) -> list[tuple[_Target, QuantRows]]:
    """Every matrix whose inputs are whole blocks of 32, quantized from its float32 weight."""
    rows = []
    for _, module in _targets(model):
        weight = module.weight
        if weight.dim() == 2 and weight.shape[1] % 32 == 0:
            rows.append((module, quantize_int8(weight.detach().float().numpy())))
    return rows


def _checkpoint_names(path: str, module: _Target) -> list[str]:
    """The checkpoint matrices ``module`` (at ``path``) holds, in its row order."""
    if not isinstance(module, MergedLinear):
        return [f"{path}.weight"]
    parent, _, fused = path.rpartition(".")
    prefix = f"{parent}." if parent else ""
    by_shard = {
        shard: name
        for name, (fused_name, shard) in LLAMA_STACKED_MODULES.items()
        if fused_name == fused
    }
    return [f"{prefix}{by_shard.get(shard, shard)}.weight" for shard in module.shard_sizes]


def _gguf_rows(
    model: nn.Module, model_dir: str, strict: bool
) -> tuple[list[tuple[_Target, QuantRows]], tuple[str, ...]]:
    """Each matrix whose checkpoint tensors all have GGUF blocks, as those blocks (rows of a
    fused layer stacked in its order); and the names left float32 for their type (``strict``:
    an error instead)."""
    targets = [(module, _checkpoint_names(path, module)) for path, module in _targets(model)]
    tied = _tied_names(model)
    wanted = {tied.get(name, name) for _, names in targets for name in names}
    blocks = read_gguf_blocks(model_dir, wanted)
    rows: list[tuple[_Target, QuantRows]] = []
    kept_float32: list[str] = []
    for module, names in targets:
        sources = [tied.get(name, name) for name in names]
        if not all(source in blocks for source in sources):
            continue  # a float32 (or float16) matrix in the GGUF file: nothing to keep
        parts = []
        for source in sources:
            try:
                parts.append(decode_gguf(blocks[source].data, blocks[source].type_name))
            except UnsupportedQuantType as exc:
                if strict:
                    raise ValueError(f"quantization gguf: tensor {source}: {exc}") from exc
                kept_float32.append(f"{source} ({blocks[source].type_name})")
        if len(parts) == len(sources):
            rows.append((module, parts[0] if len(parts) == 1 else stack_rows(parts)))
    return rows, tuple(kept_float32)


def _tied_names(model: nn.Module) -> Mapping[str, str]:
    """A tied LM head held apart from the embedding (a later pipeline stage's) reads the
    embedding's blocks: {its name: the embedding's}."""
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "tie_word_embeddings", False):
        return {"lm_head.weight": "model.embed_tokens.weight"}
    return {}
