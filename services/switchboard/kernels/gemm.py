"""The one matmul every linear layer calls: ``y = x W^T + b``, on the fastest kernel at hand.

On CPU, float32, ``F.linear`` goes to MKL, which on AMD processors (and on small batches
anywhere) runs far below the FMA peak: measured on a 2-core AVX2 EPYC, SmolLM2's LM head
``[32 x 576] @ [576 x 49152]`` took 24-34 ms through MKL and 14-25 ms through oneDNN
(``torch.ops.mkldnn._linear_pointwise``, the kernel inductor's CPU freezing uses), at one and two
threads. oneDNN's fixed cost per call (~10 us: it looks its primitive up) makes it slower on tiny
products, so it takes over above ``ONEDNN_MIN_MACS`` multiply-adds and MKL keeps the rest.

oneDNN is faster again on a weight it has laid out for itself once (``pack``: its blocked
layout, chosen for a batch of ``PACK_BATCH_HINT`` rows, works for any number of rows): a packed
weight streams through the cache in the order the kernel reads it. Measured one thread,
30 SmolLM2-sized layers plus the LM head with cold weights: 8 rows 64 -> 37 ms, 32 rows
122 -> 88 ms, one row 37 -> 35 ms. A packed weight is opaque (``is_mkldnn``): only oneDNN can
use it, so ``linear`` sends every product on one to oneDNN whatever its size (measured faster
than MKL on tiny-llama's small products too).

A layer may also hold its weight as the small-batch kernel's panels (``small_batch_gemm.pack``,
passed to ``linear``): a product of at most ``SMALL_BATCH_MAX_ROWS`` rows (decode) then goes to
that kernel, which reads the weight at the memory's speed (``small_batch_gemm.py``). Quantized
panels (``quant_gemm.pack``) take the same products to the quantized kernel, which reads a
quarter to a third of the bytes (``quant_gemm.py``), whatever the weight's own layout; larger
products keep the float32 weight, except on the integer dot product kernel's panels, which take
every product (``_dot_panels``: a row's result then never depends on the step's size).

The kernels compute the same float32 products in a different order: results agree to
rounding, not bit for bit. ``use_onednn(False)`` (or ``SWITCHBOARD_GEMM=torch``) turns the
oneDNN path off for the whole process; weights packed before that keep using oneDNN.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

from switchboard.kernels import bf16_gemm, fused_ops, quant_gemm, small_batch_gemm
from switchboard.kernels.build import cpu_flags

# A layer's weight laid out for a kernel of few rows: float32, quantized or bfloat16.
MatmulPanels = small_batch_gemm.Panels | quant_gemm.QuantPanels | bf16_gemm.Bf16Panels

# Products of at least this many multiply-adds (rows x in x out) go to oneDNN: below it, the
# per-call lookup costs more than the faster kernel saves (measured 1x256x512: MKL 12 us,
# oneDNN 20 us; 1x576x960: MKL 45 us, oneDNN 35 us).
ONEDNN_MIN_MACS = 300_000
# The batch oneDNN lays a packed weight out for; 8, 32 and 128 measured alike from 8 rows up.
PACK_BATCH_HINT = 32
# Products of at most this many rows on a weight with small-batch panels go to that kernel
# (``small_batch_gemm.max_rows()`` rows at a time over each panel). It runs on the kernels' work
# pool, so such a step, LM head included, never waits at an OpenMP barrier (``csrc/work_pool.c``).
# With AVX-512, oneDNN's wider kernels are as fast from 16 rows (0.95-1.0x): 128. With AVX2
# alone the kernel measured 5-17 % faster than oneDNN at 128 to 1,024 rows (tiny-llama's and
# SmolLM2's layer shapes, one and two threads, a 2-core Zen 3 EPYC): 512, which covers a step
# that shares its budget among requests (prompt chunks and decodes, ``config.py``). The one-call
# decode stack takes as many rows (``decode_stack.MAX_ROWS``): both paths give the same floats.
# Quantized panels take the same products (the quantized kernel computes the float32 kernel's
# sums on the dequantized weights).
SMALL_BATCH_MAX_ROWS = 128 if "avx512f" in cpu_flags() else 512
# Products of at most ``bf16_max_rows()`` rows on a bfloat16 weight with its panels go to the
# bfloat16 kernel (``bf16_gemm.py``), the rest to torch's bfloat16 matmul (oneDNN). Without AMX
# that matmul was 3-5x slower than the kernel at 1 to 32 rows (SmolLM2's matrices, AVX-512 BF16
# EPYC, 2 threads: 110 / 142 / 247 ms against 22 / 24 / 64 ms), so the kernel takes what the
# float32 one does. With AMX the kernel's own amx variant runs on the tiles oneDNN uses, its
# panels packed once where oneDNN's matmul takes the plain weight each call: 1.2-10x faster than
# oneDNN at 1 to 64 rows on the three benchmark models' matrices, within 0.7-0.95x of it at 128
# (one thread, an Intel Xeon with AMX), and it keeps a step in the one-call decode stack. Only
# where AMX is there but another variant is loaded (switched by ``SWITCHBOARD_BF16_GEMM``) does
# oneDNN take the steps past ``AMX_ONEDNN_ROWS``, where its tiles beat the AVX-512 kernel.
AMX_ONEDNN_ROWS = 16
# The amx variant takes the layer-by-layer path's products of up to this many rows: a step of
# decodes beside a prompt chunk (64 + 128 rows at 64 streams) ran 1.2-1.6x as fast on it as on
# oneDNN in process (SmolLM2, llama-100m, tiny-llama in bfloat16; docs/benchmarks.md,
# "bfloat16 on AMX tiles"), and so does the one-call stack of a model whose matrices are all
# bfloat16 (decode_stack.py); the CPU step budget keeps SMALL_BATCH_MAX_ROWS.
AMX_KERNEL_MAX_ROWS = 256
# read once: bf16_max_rows() is asked on every bfloat16 product of the layer-by-layer path
CPU_HAS_AMX = "amx_bf16" in cpu_flags()


def bf16_max_rows() -> int:
    """The most rows a bfloat16 product runs on the bfloat16 kernel (past them: oneDNN)."""
    if CPU_HAS_AMX:
        return AMX_KERNEL_MAX_ROWS if bf16_gemm.variant() == "amx" else AMX_ONEDNN_ROWS
    return SMALL_BATCH_MAX_ROWS


_onednn_linear: Callable[..., torch.Tensor] | None = None
_onednn_reorder: Callable[..., torch.Tensor] | None = None
_mkldnn = torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
if _mkldnn and hasattr(torch.ops.mkldnn, "_linear_pointwise"):
    _onednn_linear = torch.ops.mkldnn._linear_pointwise.default
    _onednn_reorder = getattr(torch.ops.mkldnn, "_reorder_linear_weight", None)
_enabled = _onednn_linear is not None and os.environ.get("SWITCHBOARD_GEMM", "auto") != "torch"


def few_rows_limit(dtype: torch.dtype) -> int:
    """The rows the CPU step budget follows: the most a step of a ``dtype`` model may have and
    still run on the kernel for few rows in the one-call decode stack; past them the step goes
    layer by layer, its products to oneDNN (no faster a row in float32, slower in bfloat16
    without AMX). bfloat16 with the amx variant: 128 too, though the stack takes up to
    ``bf16_max_rows()`` (the decodes of many streams beside the budget's prompt tokens); a
    budget of 256 lengthened the time to first token (SmolLM2, 32 streams: p50 325 -> 464 ms).
    0: no such kernel is loaded, or it keeps fewer rows than the float32 one (bfloat16 on AMX
    without the kernel's amx variant, where oneDNN's tiles win past them)."""
    if dtype == torch.bfloat16:
        if bf16_gemm.max_rows() == 0 or bf16_max_rows() < SMALL_BATCH_MAX_ROWS:
            return 0
        return SMALL_BATCH_MAX_ROWS
    return SMALL_BATCH_MAX_ROWS if dtype == torch.float32 and small_batch_gemm.max_rows() else 0


def use_onednn(enabled: bool) -> bool:
    """Turn the oneDNN path on or off; returns whether it is on (off when unavailable)."""
    global _enabled
    _enabled = enabled and _onednn_linear is not None
    return _enabled


def onednn_enabled() -> bool:
    return _enabled


def packable(weight: torch.Tensor) -> bool:
    """Whether ``pack`` applies: oneDNN on, a dense float32 CPU matrix."""
    return (
        _enabled
        and _onednn_reorder is not None
        and weight.dim() == 2
        and weight.layout == torch.strided
        and weight.dtype == torch.float32
        and weight.device.type == "cpu"
    )


def pack(weight: torch.Tensor) -> torch.Tensor:
    """A copy of ``weight`` ``[out, in]`` in oneDNN's own layout, for ``linear`` (check
    ``packable`` first)."""
    if not packable(weight) or _onednn_reorder is None:
        raise ValueError("pack needs oneDNN and a dense float32 CPU matrix")
    with torch.no_grad():
        return _onednn_reorder(weight.detach().contiguous(), PACK_BATCH_HINT)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    panels: MatmulPanels | None = None,
    float32_sums: bool = False,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` through oneDNN where that is faster; ``weight`` may be a
    ``pack``-ed one, and ``panels`` the same weight laid out for a small-batch kernel.
    ``float32_sums``: a product the bfloat16 kernel computes comes back as its float32 sums
    (the logits: not rounded to bfloat16 and widened again)."""
    onednn = _onednn_linear
    if isinstance(panels, bf16_gemm.Bf16Panels):
        return _bf16_linear(x, weight, bias, panels, float32_sums)
    quantized = isinstance(panels, quant_gemm.QuantPanels)
    if weight.is_mkldnn or quantized:
        rows = x.reshape(-1, x.shape[-1])
        if (
            panels is not None
            and (rows.shape[0] <= SMALL_BATCH_MAX_ROWS or _dot_panels(panels))
            and rows.dtype == torch.float32
        ):
            if isinstance(panels, quant_gemm.QuantPanels):
                y = quant_gemm.linear(rows, panels, bias)
            else:
                y = small_batch_gemm.linear(rows, panels, bias)
            return y if x.dim() == 2 else y.reshape(*x.shape[:-1], y.shape[-1])
        if weight.is_mkldnn:
            assert onednn is not None  # only oneDNN packs a weight
            y = onednn(rows, weight, bias, "none", [], "")
            return y if x.dim() == 2 else y.reshape(*x.shape[:-1], y.shape[-1])
    if (
        _enabled
        and onednn is not None
        and x.dim() == 2
        and x.dtype == torch.float32
        and x.device.type == "cpu"
        and x.shape[0] * weight.shape[0] * weight.shape[1] >= ONEDNN_MIN_MACS
    ):
        return onednn(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def _dot_panels(panels: MatmulPanels) -> bool:
    """Whether ``panels`` are the integer dot product kernel's: they take products of any
    number of rows. Their sums round each row to int8, which differs from the float32 product by
    more than float rounding, so a row sent to oneDNN in a large step (a prompt chunk beside it)
    would get other logits than the same row in a small one: greedy output would depend on what
    else the step held. The kernel also runs a prompt faster than oneDNN's float32 product
    (measured SmolLM2's matrices at 2,048 rows, 2 threads, AVX-512 VNNI EPYC: 3.5-10.8 ms
    against 6.4-16.9 ms; ``avx2`` 6.8-16.5 ms, as fast as oneDNN)."""
    return isinstance(panels, quant_gemm.QuantPanels) and panels.dot


def _bf16_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    panels: bf16_gemm.Bf16Panels,
    float32_sums: bool,
) -> torch.Tensor:
    """A bfloat16 weight's product: the kernel for few rows (float32 sums, rounded to ``x``'s
    dtype as torch's matmul rounds them, unless ``float32_sums``), torch's matmul otherwise."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] > bf16_max_rows() or bf16_gemm.max_rows() == 0:
        return F.linear(x, weight, bias)
    y = bf16_gemm.linear(fused_ops.to_dtype(rows, torch.float32), panels, bias)
    if not float32_sums:
        y = fused_ops.to_dtype(y, x.dtype)
    return y if x.dim() == 2 else y.reshape(*x.shape[:-1], y.shape[-1])
