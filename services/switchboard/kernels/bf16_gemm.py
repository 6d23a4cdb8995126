"""Matmuls of a few rows (decode) on bfloat16 weights: a C kernel, float32 in and out.

At decode sizes a step's time is reading the weights (``small_batch_gemm.py``); bfloat16 halves
the bytes. The kernel (``csrc/bf16_gemm.c``) reads each weight once in panels of 16 output
columns with the inputs in pairs (:class:`Bf16Panels`), rounds the rows to bfloat16 as torch's
bfloat16 matmul takes them, and sums the exact products in float32. Its variants, compiled
where the build machine's CPU flags have their instructions and picked at load by the CPU's
flags (``/proc/cpuinfo``), fastest first:

    amx      AMX-BF16: ``TDPBF16PS`` on 16-row tiles (``csrc/bf16_amx.c``), where Linux grants
             the process the tiles; any number of rows, 16 a group
    dpbf16   AVX-512 BF16: ``_mm512_dpbf16_ps`` (a pair of products per lane)
    avx512   AVX-512F: each bfloat16 widened to float32 in registers (a shift), then FMAs
    avx2     the same on AVX2 halves

``SWITCHBOARD_BF16_GEMM`` = ``off`` (no kernel: the bfloat16 layers use torch's matmul) or a
variant's name (that one, where compiled and the CPU has it) overrides the pick. Within a
variant a row's result does not depend on the rows beside it (batch-invariant); the variants
agree to float32 rounding of the sums (the same exact products, added in one order).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from switchboard.kernels import library
from switchboard.kernels.build import cpu_flags
from switchboard.kernels.panel_call import call_panel_linear
from switchboard.kernels.panel_kernel import PanelKernel, runnable_variants

logger = logging.getLogger(__name__)

PANEL = 16
_VARIABLE = "SWITCHBOARD_BF16_GEMM"
# name -> (the C side's number, the CPU flags it needs), fastest first; every variant is built
# only where AVX2 and FMA are
_AVX2 = frozenset({"avx2", "fma"})
VARIANTS: dict[str, tuple[int, frozenset[str]]] = {
    "amx": (4, _AVX2 | {"amx_tile", "amx_bf16"}),
    "dpbf16": (3, _AVX2 | {"avx512f", "avx512_bf16"}),
    "avx512": (2, _AVX2 | {"avx512f"}),
    "avx2": (1, _AVX2),
}
_kernel = PanelKernel(__name__, torch.bfloat16)


@dataclass(frozen=True)
class Bf16Panels:
    """A weight ``[out_features, in_features]`` laid out for the kernel: ``data`` is int32,
    ``[ceil(out / 16), ceil(in / 2), 16]`` pairs of bfloat16 (input 2k in the low half), zero
    past the weight."""

    data: torch.Tensor
    out_features: int
    in_features: int


def available() -> list[str]:
    """The variants this machine can run: compiled into the library and in the CPU's flags,
    fastest first (empty without the library)."""
    loaded, _ = library.load_switched(_VARIABLE, "off")
    if loaded is None:
        return []
    return runnable_variants(VARIANTS, int(loaded.bf16_gemm_variants()), cpu_flags())


def load(wanted: str | None = None) -> bool:
    """Load the kernel with ``wanted`` (a variant's name; None: ``SWITCHBOARD_BF16_GEMM``, else
    the fastest this CPU runs); True when it is in use. Idempotent for the same choice."""
    choice = wanted or os.environ.get(_VARIABLE, "auto")
    if choice == "off":
        _kernel.unload(f"off ({_VARIABLE}=off)")
        return False
    runnable = available()
    if choice != "auto" and choice not in VARIANTS:
        raise ValueError(f"{_VARIABLE}={choice!r}: use auto, off, {', '.join(VARIANTS)}")
    if not runnable:
        _kernel.status = "unavailable: no library, or the CPU has no AVX2 and FMA"
        return False
    name = runnable[0] if choice == "auto" else choice
    if name not in runnable:
        _kernel.status = f"unavailable: variant {name} (this CPU runs {', '.join(runnable)})"
        return False
    if _kernel.loaded and _kernel.variant == name:
        return True
    loaded = library.load()
    number, status = VARIANTS[name][0], f"in use ({name}, {{rows}} rows at a time)"
    if not _kernel.select(
        loaded.bf16_gemm_select, loaded.bf16_pack, loaded.bf16_linear, number, name, status
    ):
        # compiled, as available() said: not reached
        _kernel.status = f"unavailable: variant {name} not compiled"
        return False
    return True


# The CPU flags with which a bfloat16 model measured faster than float32, decode and prefill
# (``bench/dtype_decode.py``): AVX-512 BF16 (a 2-core EPYC, docs/operations.md) and AMX (a 2-core
# Xeon, this kernel's amx variant: decode steps of 32 and 64 rows 1.9-2.7x as fast as float32's
# on tiny-llama, llama-100m and SmolLM2, one row 1.0-1.6x). Without either, bfloat16 is widened
# in software: no faster than float32 where a step is bound by compute.
FASTER_THAN_FLOAT32 = ("amx_bf16", "avx512_bf16")


def faster_than_float32() -> str | None:
    """The flag of this CPU's with which bfloat16 runs faster than float32 (``amx_bf16`` or
    ``avx512_bf16``), when the kernel's dpbf16 variant runs here; else None."""
    flags = cpu_flags()
    if "dpbf16" not in available():
        return None
    return next((flag for flag in FASTER_THAN_FLOAT32 if flag in flags), None)


def status() -> str:
    return _kernel.status


def max_rows() -> int:
    """Rows one call takes over each cached panel (16 with AMX, 8 with AVX-512, 4 with AVX2);
    0 while not loaded."""
    return _kernel.max_rows


def variant() -> str:
    """The variant loaded (a ``VARIANTS`` name); empty while not loaded."""
    return _kernel.variant


def unload() -> None:
    _kernel.unload()


def packable(weight: torch.Tensor) -> bool:
    return _kernel.packable(weight)


def pack(weight: torch.Tensor) -> Bf16Panels:
    """``weight`` ``[out, in]`` (bfloat16) as the kernel's panels."""
    why = "bf16 pack needs the kernel loaded and a dense bfloat16 CPU matrix"
    if not packable(weight):
        raise ValueError(why)
    pack_function = _kernel.pack_function(why)
    out_features, in_features = weight.shape
    dense = weight.detach().contiguous()
    data = torch.empty(-(-out_features // PANEL) * PANEL * -(-in_features // 2), dtype=torch.int32)
    pack_function(dense.data_ptr(), data.data_ptr(), out_features, in_features)
    return Bf16Panels(data, out_features, in_features)


def linear(x: torch.Tensor, panels: Bf16Panels, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W^T + b`` for ``x`` ``[rows, in]`` float32 on CPU (rounded to bfloat16 first),
    float32 out; ``bias`` float32."""
    kernel = _kernel.linear_function()
    rows, in_features = x.shape
    if in_features != panels.in_features:
        raise ValueError(f"{in_features} inputs for a weight of {panels.in_features}")
    if bias is not None:
        bias = bias.to(torch.float32)
    y, code = call_panel_linear(kernel, x, panels.data, panels.out_features, bias)
    if code != 0:
        raise MemoryError(f"bf16 matmul of {rows} rows failed ({code})")
    return y
