"""The one matmul every linear layer calls: ``y = x W^T + b``, on the fastest kernel at hand.

On CPU, float32, ``F.linear`` goes to MKL, which on AMD processors (and on small batches
anywhere) runs far below the FMA peak: measured on a 2-core AVX2 EPYC, SmolLM2's LM head
``[32 x 576] @ [576 x 49152]`` took 24-34 ms through MKL and 14-25 ms through oneDNN
(``torch.ops.mkldnn._linear_pointwise``, the kernel inductor's CPU freezing uses), at one and two
threads. oneDNN's fixed cost per call (~10 us: it looks its primitive up) makes it slower on tiny
products, so it takes over above ``ONEDNN_MIN_MACS`` multiply-adds and MKL keeps the rest.

Both kernels compute the same float32 products in a different order: results agree to
rounding, not bit for bit. ``use_onednn(False)`` (or ``SWITCHBOARD_GEMM=torch``) turns the
oneDNN path off for the whole process.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

# Products of at least this many multiply-adds (rows x in x out) go to oneDNN: below it, the
# per-call lookup costs more than the faster kernel saves (measured 1x256x512: MKL 12 us,
# oneDNN 20 us; 1x576x960: MKL 45 us, oneDNN 35 us).
ONEDNN_MIN_MACS = 300_000

_onednn_linear = None
if torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"):
    _onednn_linear = torch.ops.mkldnn._linear_pointwise.default
_enabled = _onednn_linear is not None and os.environ.get("SWITCHBOARD_GEMM", "auto") != "torch"


def use_onednn(enabled: bool) -> bool:
    """Turn the oneDNN path on or off; returns whether it is on (off when unavailable)."""
    global _enabled
    _enabled = enabled and _onednn_linear is not None
    return _enabled


def onednn_enabled() -> bool:
    return _enabled


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for 2-D ``x``, through oneDNN where that is faster."""
    if (
        _enabled
        and x.dim() == 2
        and x.dtype == torch.float32
        and x.device.type == "cpu"
        and x.shape[0] * weight.shape[0] * weight.shape[1] >= ONEDNN_MIN_MACS
    ):
        return _onednn_linear(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)
