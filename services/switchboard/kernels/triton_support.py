"""What this process's Triton can do, asked without importing it: ``triton`` is a test extra,
not a serving dependency, and the CPU serving path never imports it."""

from __future__ import annotations

import importlib.util
import os


def available() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpreted() -> bool:
    """``TRITON_INTERPRET=1``: the kernels run on CPU tensors through Triton's interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
