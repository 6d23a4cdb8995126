"""Matmuls of a few rows (decode at low concurrency) at the memory's speed: a C kernel.

A decode step of one request multiplies one row by every weight matrix: the work is reading
the weights, and oneDNN's kernels (``gemm.py``) read them at about half the memory's speed on a
2-core EPYC. This kernel streams each weight once, in panels of 16 output columns laid out for
it (:class:`Panels`, made once at load by ``pack``), and keeps the rows' sums in registers: two
AVX2 vectors per row, ``max_rows()`` (6) rows at a time, or with AVX-512 one vector per row and
panel, 12 rows over two panels at a time; more rows go in groups over each panel while it is in
the core's cache, so the weight is still read once. Measured on that machine (it has AVX-512),
two threads, a SmolLM2-135M-shaped stack (30 layers and the LM head, cold weights), ms:

    rows            1      2      4      6      8
    oneDNN packed   25.7   29.7   23.6   22.9   27.7
    this kernel     17.1   17.8   20.0   22.0   24.3

and 2.5x / 2.3x / 1.6x / 1.5x / 1.6x faster on tiny-llama's small matrices. There (AVX-512),
from about eight rows oneDNN is as fast (16 / 32 / 64 rows: 0.95x / 0.97x / 1.00x);
On an Intel Xeon with AVX-512 (two 512-bit FMA units a core) the AVX2 code ran at half the
multiply-add rate the core has; the AVX-512 code (``csrc/small_batch_gemm_512.h``, the same
floats) made tiny-llama's 32- and 64-row decode steps 1.4-1.6x faster in process.
``gemm.linear`` uses this up to ``gemm.SMALL_BATCH_MAX_ROWS`` rows (128; 512 with AVX2 alone,
where it measured faster than oneDNN up to 1,024 rows), the one-call decode layer stack
(``decode_stack.py``) likewise: its loops run on the kernels' work pool, never waiting at an
OpenMP barrier for a thread another process holds off its core.

The kernel prefetches each panel's lines 2 KB ahead of its loop (``PREFETCH_AHEAD``, measured
there and in docs/operations.md).

Every output is one fused multiply-add chain over the inputs in order, so a row's result does
not depend on which rows share the call (batch-invariant). The panels are a second copy of
each weight beside oneDNN's (the memory the weights take doubles); ``SWITCHBOARD_SMALL_BATCH_GEMM
=off`` does without it. C in ``csrc/small_batch_gemm.c``, in the kernels' one library
(``library.py``); it needs AVX2 and FMA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from switchboard.kernels.panel_call import call_panel_linear
from switchboard.kernels.panel_kernel import PanelKernel

PANEL = 16
_kernel = PanelKernel(__name__, torch.float32)


@dataclass(frozen=True)
class Panels:
    """A weight ``[out_features, in]`` laid out for the kernel: ``data`` is a flat float32
    tensor of ``[ceil(out_features / 16), in, 16]``, zero-padded past ``out_features``."""

    data: torch.Tensor
    out_features: int


def load() -> bool:
    """Load the kernel (built once per machine); True when it is in use. Idempotent."""
    if _kernel.loaded:
        return True
    return _kernel.load_fixed(
        "SWITCHBOARD_SMALL_BATCH_GEMM",
        "small_batch_pack",
        "small_batch_linear",
        "small_batch_max_rows",
    )


def status() -> str:
    return _kernel.status


def max_rows() -> int:
    """Rows one call takes, read from the library at load (12 with AVX-512, else 6); 0 while
    the kernel is not loaded."""
    return _kernel.max_rows


def unload() -> None:
    """Back to oneDNN alone (tests compare the two)."""
    _kernel.unload()


def packable(weight: torch.Tensor) -> bool:
    return _kernel.packable(weight)


def pack(weight: torch.Tensor) -> Panels:
    """``weight`` ``[out, in]`` as the kernel's panels."""
    why = "small-batch pack needs the kernel loaded and a dense float32 CPU matrix"
    if not packable(weight):
        raise ValueError(why)
    pack_function = _kernel.pack_function(why)
    out_features, in_features = weight.shape
    dense = weight.detach().contiguous()
    data = torch.empty(-(-out_features // PANEL) * PANEL * in_features, dtype=torch.float32)
    pack_function(dense.data_ptr(), data.data_ptr(), out_features, in_features)
    return Panels(data, out_features)


def linear(x: torch.Tensor, panels: Panels, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W^T + b`` for ``x`` ``[rows, in]`` float32 on CPU (``max_rows()`` at a time)."""
    y, code = call_panel_linear(
        _kernel.linear_function(), x, panels.data, panels.out_features, bias
    )
    if code != 0:
        raise ValueError(f"small-batch matmul: {x.shape[0]} rows")
    return y
