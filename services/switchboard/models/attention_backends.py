"""Which attention backend a worker runs (see ``attention.py``, "Backends").

``SWITCHBOARD_ATTENTION_BACKEND`` = ``auto`` (default) | ``reference`` | ``cpu-kernel`` |
``triton``:

- ``auto``: on CPU the C decode kernel's backend when the kernel loads (a compiler at hand, not
  switched off by ``SWITCHBOARD_CPU_ATTENTION=torch``), else the reference; on CUDA the Triton
  backend when ``triton`` imports, else the reference; on any other device the reference.
- ``reference``: plain torch (``attention.py``), on any device.
- ``cpu-kernel``: the C decode kernel (``cpu_kernel_attention.py``); an error at start-up off
  CPU or when the kernel does not load.
- ``triton``: the Triton kernels (``triton_backend.py``); an error at start-up when triton is
  missing or the device is not CUDA (set ``TRITON_INTERPRET=1`` to run them on CPU tensors, as
  the tests do). Imported only when chosen: triton is a test extra, not a serving dependency.
"""

from __future__ import annotations

import logging
import os

import torch

from switchboard.kernels import paged_decode, triton_support
from switchboard.models.attention import REFERENCE, AttentionBackend
from switchboard.models.cpu_kernel_attention import CPU_KERNEL, CPU_KERNEL_EVERY_CHUNK

logger = logging.getLogger(__name__)

ENV_VAR = "SWITCHBOARD_ATTENTION_BACKEND"
CHOICES = ("auto", "reference", "cpu-kernel", "triton")


def backend_name(device: torch.device, requested: str | None = None) -> str:
    """The backend for ``device``: ``requested`` (else the env var, else ``auto``) resolved."""
    return backend_choice(device, requested)[0]


def backend_choice(device: torch.device, requested: str | None = None) -> tuple[str, str]:
    """(backend name, why: a phrase for the worker's log line). On CPU this loads the C decode
    kernel (built once per machine) to know whether it can run."""
    requested = (requested or os.environ.get(ENV_VAR) or "auto").strip().lower()
    if requested not in CHOICES:
        raise ValueError(f"{ENV_VAR}={requested!r}: use one of {', '.join(CHOICES)}")
    if requested == "reference":
        return "reference", f"{ENV_VAR}=reference"
    if requested == "cpu-kernel":
        if device.type != "cpu":
            raise ValueError(f"{ENV_VAR}=cpu-kernel runs on CPU, not {device}")
        if not paged_decode.load():
            raise ValueError(
                f"{ENV_VAR}=cpu-kernel but the CPU decode kernel is {paged_decode.status()}"
            )
        return "cpu-kernel", f"{ENV_VAR}=cpu-kernel"
    if requested == "triton":
        if not triton_support.available():
            raise ValueError(f"{ENV_VAR}=triton but triton is not installed")
        if device.type != "cuda" and not triton_support.interpreted():
            raise ValueError(
                f"{ENV_VAR}=triton needs a CUDA device (or TRITON_INTERPRET=1), not {device}"
            )
        return "triton", f"{ENV_VAR}=triton"
    if device.type == "cpu":
        if paged_decode.load():
            return "cpu-kernel", "CPU, the C decode kernel loaded"
        return "reference", f"the CPU decode kernel is {paged_decode.status()}"
    if device.type != "cuda":
        return "reference", f"no attention kernels for {device.type}"
    if not triton_support.available():
        return "reference", "triton is not installed (pip install triton for the CUDA kernels)"
    return "triton", f"{device} with triton installed"


def select_backend(
    device: torch.device, requested: str | None = None, rounded_rows: bool = False
) -> AttentionBackend:
    """The backend, imported only when chosen (triton is optional), and one log line saying
    which and why. ``rounded_rows``: the model's matmuls round each row to 8 bits (integer dot
    products): on CPU every prompt chunk then takes the kernel (``CPU_KERNEL_EVERY_CHUNK``), so a
    request's tokens never depend on how its prompt was chunked."""
    name, why = backend_choice(device, requested)
    if name == "triton":
        from switchboard.models.triton_backend import TritonBackend

        backend: AttentionBackend = TritonBackend()
        logger.info("attention backend: triton (%s); CUDA graphs for decode steps", why)
        return backend
    graphs = "; CUDA graphs off (they need the Triton kernels)" if device.type == "cuda" else ""
    if name == "cpu-kernel" and rounded_rows:
        graphs = "; every prompt chunk on the kernel: the matmuls round rows to 8 bits"
    logger.info("attention backend: %s (%s)%s", name, why, graphs)
    if name != "cpu-kernel":
        return REFERENCE
    return CPU_KERNEL_EVERY_CHUNK if rounded_rows else CPU_KERNEL
