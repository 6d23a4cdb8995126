"""Which attention backend a worker runs (see ``attention.py``, "Backends").

``SWITCHBOARD_ATTENTION_BACKEND`` = ``auto`` (default) | ``reference`` | ``triton``:

- ``auto``: on CUDA the Triton backend when ``triton`` imports, else the reference one; on any
  other device the reference backend (torch, with the CPU C decode kernel on CPU).
- ``reference``: always the torch path.
- ``triton``: the Triton kernels; an error at start-up when triton is missing or the device is
  not CUDA (set ``TRITON_INTERPRET=1`` to run them on CPU tensors, as the tests do).
"""

from __future__ import annotations

import importlib.util
import logging
import os

import torch

from switchboard.models.attention import REFERENCE, AttentionBackend

logger = logging.getLogger(__name__)

ENV_VAR = "SWITCHBOARD_ATTENTION_BACKEND"
CHOICES = ("auto", "reference", "triton")


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def backend_name(device: torch.device, requested: str | None = None) -> str:
    """The backend for ``device``: ``requested`` (else the env var, else ``auto``) resolved."""
    return backend_choice(device, requested)[0]


def backend_choice(device: torch.device, requested: str | None = None) -> tuple[str, str]:
    """(backend name, why: a phrase for the worker's log line)."""
    requested = (requested or os.environ.get(ENV_VAR) or "auto").strip().lower()
    if requested not in CHOICES:
        raise ValueError(f"{ENV_VAR}={requested!r}: use one of {', '.join(CHOICES)}")
    if requested == "reference":
        return "reference", f"{ENV_VAR}=reference"
    if requested == "triton":
        if not triton_available():
            raise ValueError(f"{ENV_VAR}=triton but triton is not installed")
        if device.type != "cuda" and not triton_interpreted():
            raise ValueError(
                f"{ENV_VAR}=triton needs a CUDA device (or TRITON_INTERPRET=1), not {device}"
            )
        return "triton", f"{ENV_VAR}=triton"
    if device.type != "cuda":
        return "reference", f"the Triton kernels are for CUDA devices, this is {device.type}"
    if not triton_available():
        return "reference", "triton is not installed (pip install triton for the CUDA kernels)"
    return "triton", f"{device} with triton installed"


def select_backend(device: torch.device, requested: str | None = None) -> AttentionBackend:
    """The backend, imported only when chosen (triton is optional), and one log line saying
    which and why."""
    name, why = backend_choice(device, requested)
    if name == "triton":
        from switchboard.models.triton_attention import TritonBackend

        backend: AttentionBackend = TritonBackend()
        logger.info("attention backend: triton (%s); CUDA graphs for decode steps", why)
        return backend
    graphs = "; CUDA graphs off (they need the Triton kernels)" if device.type == "cuda" else ""
    logger.info("attention backend: reference (%s)%s", why, graphs)
    return REFERENCE
