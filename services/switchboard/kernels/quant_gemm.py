"""Matmuls of a few rows (decode) on quantized weights: C kernels that read them as they are.

At one request a decode step's time is reading the weights (``small_batch_gemm.py``). Kept as
int8 values with a float32 scale and offset per block of 16 or 32 inputs
(``quant_formats.QuantRows``: GGUF's Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K exactly,
or int8 made from float32 weights), a weight is 1.25 bytes a value (1.5 with 16-input blocks)
instead of 4. Two kernels read them in panels of 16 output columns, a few rows at a time:

- integer dot products (``csrc/quant_dot.c``, the default): the rows are quantized to int8 per
  block as llama.cpp does, and per block the sum of q * x is an exact integer sum
  (``_mm512_dpbusd_epi32`` with AVX-512 VNNI, ``_mm256_maddubs_epi16`` with AVX2), folded in
  as d * (scale * sum + offset * sum of x). The result differs from the float32 product on the
  dequantized weight by the rows' 8-bit rounding; greedy output keeps the float32 model's tokens
  except where its top two logits nearly tie (tests/models/test_default_model_quantized.py).
  Variants, picked by the CPU's flags: ``amx`` (AMX-INT8 tiles for groups of 12 to 16 rows,
  vnni512's code for fewer: the same floats), ``vnni512`` (AVX-512 VNNI), ``avx2``.
- ``exact`` (``csrc/quant_gemm.c``): each weight dequantized in registers and the float32
  small-batch kernel's multiply-add chains run on it: bit for bit the float32 kernel's floats
  on the dequantized weight, at about half the speed at one row (a convert, a multiply and an
  add per weight).

The dot product kernel's panels hold a matrix's scales and offsets as float16 where every one
of them is a float16 exactly (GGUF's Q8_0, Q4_0 and Q4_1 store them so), and no offsets where
all are zero (Q8_0): bit for bit the same products on a sixth fewer bytes at 4 bits and 15 %
fewer for Q8_0 (``SWITCHBOARD_QUANT_HALF_SCALES=off``: float32 scales and offsets always, for
comparison).

``SWITCHBOARD_QUANT_GEMM`` = ``off`` (no kernel: the weights stay float32), ``exact``, or a dot
product variant's name overrides the pick; ``auto`` (the default) is the fastest dot product
variant the CPU runs. Either way a row's result does not depend on the rows beside it
(batch-invariant). Needs AVX2 and FMA.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from switchboard.kernels import huge_pages, library
from switchboard.kernels.build import cpu_flags
from switchboard.kernels.panel_call import call_panel_linear
from switchboard.kernels.panel_kernel import PanelKernel, runnable_variants
from switchboard.kernels.quant_formats import QuantRows

PANEL = 16
_VARIABLE = "SWITCHBOARD_QUANT_GEMM"
_NIBBLES_VARIABLE = "SWITCHBOARD_QUANT_4BIT"
_HALF_SCALES_VARIABLE = "SWITCHBOARD_QUANT_HALF_SCALES"
# csrc/kernels.h's flags of a block size: the panels' factors as float16, the offsets left out
HALF_SCALES = 256
NO_OFFSETS = 512
EXACT = "exact"
# dot product variant -> (the C side's number, the CPU flags it needs), fastest first
_AVX2 = frozenset({"avx2", "fma"})
_VNNI512 = _AVX2 | {"avx512f", "avx512bw", "avx512_vnni"}
DOT_VARIANTS: dict[str, tuple[int, frozenset[str]]] = {
    "amx": (3, _VNNI512 | {"amx_tile", "amx_int8"}),
    "vnni512": (2, _VNNI512),
    "avx2": (1, _AVX2),
}
_kernel = PanelKernel(__name__)


@dataclass(frozen=True)
class QuantPanels:
    """A weight ``[out_features, in_features]`` laid out for a kernel: ``data`` is uint8, per
    panel of 16 output columns ``in_features / block`` blocks of the values ``[block, 16]``
    (int8 q, input-major) or, for the dot product kernel (``dot``), ``[block / 4, 16, 4]``
    (uint8 q + 128) or 4 bits (``bits``), then 16 scales and 16 offsets (none: ``offsets``
    False), float32 or float16 (``half_scales``; both dot product panels only); zero past
    ``out_features``."""

    data: torch.Tensor
    out_features: int
    in_features: int
    block: int
    format: str  # the GGUF type, "int8", or "mixed"
    dot: bool = False
    bits: int = 8  # 4: the dot product kernel's values as 4 bits ``[block / 8, 16, 4]`` bytes,
    # input k in the low half and k + block / 2 in the high half (q - its least, in 0..15)
    half_scales: bool = False
    offsets: bool = True

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    @property
    def kernel_block(self) -> int:
        """The block size as the C kernels take it, with the factors' layout flags."""
        return _layout_block(self.block, self.half_scales, self.offsets)


def _layout_block(block: int, half_scales: bool, offsets: bool) -> int:
    return block | (HALF_SCALES if half_scales else 0) | (0 if offsets else NO_OFFSETS)


def panel_bytes(
    out_features: int,
    in_features: int,
    block: int,
    bits: int = 8,
    half_scales: bool = False,
    offsets: bool = True,
) -> int:
    panels = -(-out_features // PANEL)
    factor_bytes = (2 if offsets else 1) * PANEL * (2 if half_scales else 4)
    return panels * (in_features // block) * (block * PANEL * bits // 8 + factor_bytes)


def nibbles_allowed() -> bool:
    """Whether the dot product kernel packs weights whose q span at most 16 values as 4 bits
    (``SWITCHBOARD_QUANT_4BIT=off``: 8 bits, for comparison)."""
    return os.environ.get(_NIBBLES_VARIABLE, "auto") != "off"


def half_scales_allowed() -> bool:
    """Whether dot product panels take the compact layouts of their factors where those hold
    them exactly: float16 scales and offsets, no offsets (``SWITCHBOARD_QUANT_HALF_SCALES=off``:
    always float32 scales and offsets, for comparison)."""
    return os.environ.get(_HALF_SCALES_VARIABLE, "auto") != "off"


def dot_variants() -> list[str]:
    """The dot product variants this machine runs: compiled into the library and in the CPU's
    flags, fastest first (empty without the library or without AVX2 and FMA)."""
    loaded, _ = library.load_switched(_VARIABLE, "off")
    if loaded is None:
        return []
    return runnable_variants(DOT_VARIANTS, int(loaded.quant_dot_variants()), cpu_flags())


def load(wanted: str | None = None) -> bool:
    """Load a kernel: ``wanted`` (``exact`` or a dot product variant; None:
    ``SWITCHBOARD_QUANT_GEMM``, else the fastest dot product variant); True when in use.
    Idempotent for the same choice."""
    choice = wanted or os.environ.get(_VARIABLE, "auto")
    if choice not in ("auto", "off", EXACT, *DOT_VARIANTS):
        raise ValueError(f"{_VARIABLE}={choice!r}: use auto, off, exact, {', '.join(DOT_VARIANTS)}")
    if choice == "off":
        _kernel.unload(f"off ({_VARIABLE}=off)")
        return False
    if choice == "auto":
        runnable = dot_variants()
        choice = runnable[0] if runnable else EXACT
    if _kernel.loaded and _kernel.variant == choice:
        return True
    _kernel.unload()
    if choice == EXACT:
        if not _kernel.load_fixed(
            _VARIABLE, "quant_pack", "quant_linear", "quant_gemm_max_rows", EXACT
        ):
            return False
        _kernel.status = f"in use (exact float32 sums, {_kernel.max_rows} rows at a time)"
        return True
    if choice not in dot_variants():
        _kernel.status = (
            f"unavailable: variant {choice} (this CPU runs {', '.join(dot_variants())})"
        )
        return False
    loaded = library.load()
    rows = _kernel.select(
        loaded.quant_dot_select,
        loaded.quant_dot_pack,
        loaded.quant_dot_linear,
        DOT_VARIANTS[choice][0],
        choice,
        f"in use (integer dot products, {choice}, {{rows}} rows at a time)",
    )
    return rows > 0  # compiled, as dot_variants() said


def status() -> str:
    return _kernel.status


def max_rows() -> int:
    """Rows one call takes over each cached panel; 0 while not loaded."""
    return _kernel.max_rows


def variant() -> str:
    """The kernel loaded: ``EXACT`` or a ``DOT_VARIANTS`` name; empty while not loaded."""
    return _kernel.variant


def unload() -> None:
    _kernel.unload()


def pack(rows: QuantRows) -> QuantPanels:
    """``rows`` (a weight ``[out, in]``) as the loaded kernel's panels."""
    pack_function = _kernel.pack_function(
        "quantized pack needs the kernel loaded (quant_gemm.load())"
    )
    out_features, in_features = rows.shape
    if rows.block not in (16, 32) or in_features % rows.block:
        raise ValueError(f"blocks of {rows.block} do not tile {in_features} inputs")
    q = torch.from_numpy(rows.q)
    scale = torch.from_numpy(rows.scale)
    offset = None if rows.offset is None else torch.from_numpy(rows.offset)
    dot = _kernel.variant != EXACT
    least = int(rows.q.min()) if rows.q.size else 0
    bits = 4 if dot and nibbles_allowed() and int(rows.q.max(initial=0)) - least < 16 else 8

    def packed(half_scales: bool, offsets: bool) -> QuantPanels | None:
        """The panels, or None where that layout does not hold every scale and offset."""
        size = panel_bytes(out_features, in_features, rows.block, bits, half_scales, offsets)
        data = torch.empty(size, dtype=torch.uint8)
        pointers = (
            q.data_ptr(),
            scale.data_ptr(),
            None if offset is None else offset.data_ptr(),
            data.data_ptr(),
            out_features,
            in_features,
            _layout_block(rows.block, half_scales, offsets),
        )
        if bits == 4:
            inexact = library.load().quant_dot4_pack(*pointers, least)
        else:
            inexact = pack_function(*pointers)
        if inexact:
            return None
        data = huge_pages.copy_of(data)  # a step reads every panel: fewer TLB misses
        return QuantPanels(
            data, out_features, in_features, rows.block, rows.format, dot, bits, half_scales,
            offsets,
        )  # fmt: skip

    # the most compact layout that holds the factors exactly: 4 bits move q's least into the
    # offsets, so none are left only where it is 0
    layouts = [(False, True)]
    if dot and half_scales_allowed():
        offsets = rows.offset is not None or (bits == 4 and least != 0)
        layouts = list(dict.fromkeys([(True, offsets), (False, offsets), (False, True)]))
    for half_scales, offsets in layouts:
        panels = packed(half_scales, offsets)
        if panels is not None:
            return panels
    raise AssertionError("float32 scales and offsets hold every factor")


def unpack(panels: QuantPanels) -> torch.Tensor:
    """The float32 weight ``[out, in]`` the panels hold: ``scale * q + offset`` per block."""
    block, in_features = panels.block, panels.in_features
    count, blocks = -(-panels.out_features // PANEL), in_features // block
    value_bytes = block * PANEL * panels.bits // 8
    factor_dtype = torch.float16 if panels.half_scales else torch.float32
    parts = 2 if panels.offsets else 1  # scales, then offsets
    raw = panels.data.view(count, blocks, value_bytes + parts * PANEL * factor_dtype.itemsize)
    values = raw[:, :, :value_bytes].contiguous()
    if panels.bits == 4:  # [block / 8, 16, 4] of two halves' nibbles -> [block / 4, 16, 4]
        values = torch.cat([values & 0x0F, values >> 4], dim=2)
    if panels.dot:  # [block / 4, 16, 4] of q + 128 (or 4 bits) -> [block, 16] of q
        if panels.bits == 8:
            values = values ^ 0x80
        values = values.view(count, blocks, block // 4, PANEL, 4).transpose(3, 4)
    q = values.contiguous().view(torch.int8).view(count, blocks, block, PANEL)
    factors = raw[:, :, value_bytes:].contiguous().view(factor_dtype).to(torch.float32)
    scale = factors.view(count, blocks, parts, PANEL)[:, :, 0, None, :]
    w = scale * q.to(torch.float32)  # [count, blocks, block, 16]
    if panels.offsets:
        w = w + factors.view(count, blocks, parts, PANEL)[:, :, 1, None, :]
    w = w.permute(0, 3, 1, 2).reshape(count * PANEL, in_features)
    return w[: panels.out_features].contiguous()


def linear(x: torch.Tensor, panels: QuantPanels, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W^T + b`` for ``x`` ``[rows, in]`` float32 on CPU, by the kernel the panels were
    packed for (the dot product kernel: the variant loaded last)."""
    _kernel.linear_function()  # asserts it is loaded
    rows, in_features = x.shape
    if in_features != panels.in_features:
        raise ValueError(f"{in_features} inputs for a weight of {panels.in_features}")
    loaded = library.load()
    kernel = (
        loaded.quant_linear
        if not panels.dot
        else loaded.quant_dot4_linear
        if panels.bits == 4
        else loaded.quant_dot_linear
    )
    y, code = call_panel_linear(
        kernel, x, panels.data, panels.out_features, bias, panels.kernel_block
    )
    if code != 0:
        raise MemoryError(f"quantized matmul of {rows} rows failed ({code})")
    return y
