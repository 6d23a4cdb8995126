"""Matmuls of a few rows (decode) on quantized weights: a C kernel that dequantizes in registers.

At one request a decode step's time is reading the weights (``small_batch_gemm.py``). Kept as
int8 values with a float32 scale and offset per block of 16 or 32 inputs
(``quant_formats.QuantRows``: GGUF's Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K exactly,
or int8 made from float32 weights), a weight is 1.25 bytes a value (1.5 with 16-input blocks)
instead of 4. The kernel (``csrc/quant_gemm.c``) reads the weight in panels of 16 output
columns like the float32 small-batch kernel, ``max_rows`` rows at a time (8 with AVX-512's
registers, else 6), accumulates x * q per block in registers and folds in scale * sum +
offset * (the block's sum of x) at the block's end. Rows' results do not depend on the rows
beside them (batch-invariant); they agree with ``x @ w.T`` on the dequantized weight to
float32 rounding, not bit for bit. Needs AVX2 and FMA; ``SWITCHBOARD_QUANT_GEMM=off`` turns it off
(the weights then stay float32).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from switchboard.kernels import library
from switchboard.kernels.panel_call import call_panel_linear
from switchboard.kernels.quant_formats import QuantRows

PANEL = 16
# Rows one call takes over each cached panel (8 with AVX-512, else 6); 0 while not loaded.
max_rows = 0

_pack: Callable[..., Any] | None = None
_linear: Callable[..., Any] | None = None
_status = "not loaded"


@dataclass(frozen=True)
class QuantPanels:
    """A weight ``[out_features, in_features]`` laid out for the kernel: ``data`` is uint8,
    per panel of 16 output columns ``in_features / block`` blocks of int8 q ``[block, 16]``,
    16 float32 scales and 16 float32 offsets; zero past ``out_features``."""

    data: torch.Tensor
    out_features: int
    in_features: int
    block: int
    format: str  # the GGUF type, "int8", or "mixed"

    @property
    def nbytes(self) -> int:
        return self.data.numel()


def panel_bytes(out_features: int, in_features: int, block: int) -> int:
    panels = -(-out_features // PANEL)
    return panels * (in_features // block) * (block * PANEL + 2 * PANEL * 4)


def load() -> bool:
    """Load the kernel (built once per machine); True when it is in use. Idempotent."""
    global _pack, _linear, _status, max_rows
    if _linear is not None:
        return True
    functions, rows, _status = library.load_panel_kernel(
        "SWITCHBOARD_QUANT_GEMM", "quant_pack", "quant_linear", "quant_gemm_max_rows"
    )
    if functions is None:
        return False
    (_pack, _linear), max_rows = functions, rows
    return True


def status() -> str:
    return _status


def unload() -> None:
    global _pack, _linear, _status, max_rows
    _pack = _linear = None
    max_rows = 0
    _status = "not loaded"


def pack(rows: QuantRows) -> QuantPanels:
    """``rows`` (a weight ``[out, in]``) as the kernel's panels."""
    if _pack is None:
        raise ValueError("quantized pack needs the kernel loaded (quant_gemm.load())")
    out_features, in_features = rows.shape
    if rows.block not in (16, 32) or in_features % rows.block:
        raise ValueError(f"blocks of {rows.block} do not tile {in_features} inputs")
    q = torch.from_numpy(rows.q)
    scale = torch.from_numpy(rows.scale)
    offset = None if rows.offset is None else torch.from_numpy(rows.offset)
    data = torch.empty(panel_bytes(out_features, in_features, rows.block), dtype=torch.uint8)
    _pack(
        q.data_ptr(),
        scale.data_ptr(),
        None if offset is None else offset.data_ptr(),
        data.data_ptr(),
        out_features,
        in_features,
        rows.block,
    )
    return QuantPanels(data, out_features, in_features, rows.block, rows.format)


def unpack(panels: QuantPanels) -> torch.Tensor:
    """The float32 weight ``[out, in]`` the panels hold: ``scale * q + offset`` per block."""
    block, in_features = panels.block, panels.in_features
    count, blocks = -(-panels.out_features // PANEL), in_features // block
    raw = panels.data.view(count, blocks, block * PANEL + 8 * PANEL)
    q = raw[:, :, : block * PANEL].contiguous().view(torch.int8).view(count, blocks, block, PANEL)
    factors = raw[:, :, block * PANEL :].contiguous().view(torch.float32)
    scale = factors.view(count, blocks, 2, PANEL)[:, :, 0, None, :]
    offset = factors.view(count, blocks, 2, PANEL)[:, :, 1, None, :]
    w = scale * q.to(torch.float32) + offset  # [count, blocks, block, 16]
    w = w.permute(0, 3, 1, 2).reshape(count * PANEL, in_features)
    return w[: panels.out_features].contiguous()


def linear(x: torch.Tensor, panels: QuantPanels, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W^T + b`` for ``x`` ``[rows, in]`` float32 on CPU."""
    assert _linear is not None, "quant_gemm.linear before load()"
    rows, in_features = x.shape
    if in_features != panels.in_features:
        raise ValueError(f"{in_features} inputs for a weight of {panels.in_features}")
    y, code = call_panel_linear(_linear, x, panels.data, panels.out_features, bias, panels.block)
    if code != 0:
        raise MemoryError(f"quantized matmul of {rows} rows: out of memory")
    return y
