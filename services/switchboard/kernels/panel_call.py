"""One call of a panel kernel's ``linear`` (the float32, bfloat16 and quantized small-batch
kernels share its C signature): ``x`` laid out as the kernel reads it, ``y`` allocated."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def call_panel_linear(
    kernel: Callable[..., int],
    x: torch.Tensor,
    panel_data: torch.Tensor,
    out_features: int,
    bias: torch.Tensor | None,
    *extra: Any,
) -> tuple[torch.Tensor, int]:
    """``(y, code)`` for ``y = x @ W^T + b``, ``x`` ``[rows, in]`` float32 on CPU; ``code`` is
    the kernel's (0: done); no call for zero rows (a step whose prefill chunk samples nothing).
    ``extra``: arguments after the common ones (the quantized kernel's block size)."""
    rows, in_features = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    if bias is not None:
        bias = bias.contiguous()
    y = torch.empty(rows, out_features, dtype=torch.float32)
    if rows == 0:
        return y, 0
    code = kernel(
        x.data_ptr(),
        x.stride(0),
        panel_data.data_ptr(),
        None if bias is None else bias.data_ptr(),
        y.data_ptr(),
        rows,
        in_features,
        out_features,
        *extra,
    )
    return y, code
