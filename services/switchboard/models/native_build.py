"""Build a small C kernel with the machine's compiler once, cache it, and load it.

``cc -O3 -march=native -fno-trapping-math -fopenmp``: the code is valid only on CPUs like this
one, so the cached library is keyed by the source, the flags, the compiler's version and the
CPU model and feature flags (under ``<cache>/kernels/``). ``-fopenmp`` links ``libgomp.so.1``,
the runtime torch has already loaded (its ``omp simd`` loops, and its thread count, which
``torch.set_num_threads`` sets). The kernels split their loops over the work pool
(``work_pool.py``), which ``load_library`` loads first.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from switchboard.config import cache_root

logger = logging.getLogger(__name__)

# -fno-trapping-math: the kernels never test floating-point exception flags, and with them
# assumed observable GCC would not vectorise a loop holding a float-to-int conversion behind a
# select (every loop that calls ``exp_f32`` below: SiLU-and-mul, the attention softmax ran one
# element at a time). It changes no value computed, unlike -ffast-math.
FLAGS = ["-O3", "-march=native", "-fno-trapping-math", "-fopenmp", "-fPIC", "-shared"]

# e^x in float32 that the compiler vectorises inside an ``omp simd`` loop (libm's expf is a
# call per element unless built with -ffast-math, which would loosen every other line of a
# kernel). Cody-Waite reduction to r in [-ln2/2, ln2/2] and Cephes' degree-5 polynomial:
# within 2 ulp of the exact value; the input is clamped to [-87.3, 88.3], where e^x is a
# normal float (below, the true value underflows to about 1e-38 instead of 0).
VECTOR_EXP_C = r"""
#include <stdint.h>
#include <string.h>
static inline float exp_f32(float x) {
    x = x < -87.3f ? -87.3f : (x > 88.3f ? 88.3f : x);
    /* round to nearest: adding 1.5 * 2^23 leaves no fraction bits */
    const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}
"""


class NativeBuildError(Exception):
    """No compiler, or the source did not compile or load; the message says which."""


class NoCompiler(NativeBuildError):
    """No C compiler on this host (a slim image): expected, not a fault."""


def _cpuinfo_lines() -> list[str]:
    """The CPU model and feature-flag lines of /proc/cpuinfo, once each ([] where unreadable)."""
    try:
        with open("/proc/cpuinfo") as f:
            return sorted({ln for ln in f if ln.startswith(("model name", "flags"))})
    except OSError:
        return []


def cpu_identity() -> str:
    """The CPU model and feature flags: ``-march=native`` code is only valid on their like."""
    return "".join(_cpuinfo_lines()) or platform.processor() or platform.machine()


def cpu_flags() -> set[str]:
    """The CPU's feature flags (``avx2``, ``fma``, ...); empty where /proc/cpuinfo is unreadable."""
    return {flag for ln in _cpuinfo_lines() if ln.startswith("flags") for flag in ln.split()[2:]}


def load_library(
    name: str, source: str, what: str, switch: tuple[str, str]
) -> tuple[ctypes.CDLL | None, str]:
    """What every kernel module's ``load()`` does first: (the library, "in use"), or (None, why
    not) — switched off by the environment (``switch``: the variable and its "off" value),
    no compiler (logged at info: a slim image is expected to have none), or a failed build
    (logged as a warning)."""
    variable, off = switch
    if os.environ.get(variable, "auto") == off:
        return None, f"off ({variable}={off})"
    # The kernels' loops run on the pool's threads: its symbols must be loaded before theirs.
    # (Imported here: work_pool builds itself with this module.)
    from switchboard.models import work_pool

    try:
        work_pool.load()
        return build_and_load(name, source, what), "in use"
    except NativeBuildError as exc:
        status = f"unavailable: {exc}"
        log = logger.info if isinstance(exc, NoCompiler) else logger.warning
        log("%s %s", what, status)
        return None, status


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def build_and_load(
    name: str, source: str, what: str, mode: int = ctypes.DEFAULT_MODE
) -> ctypes.CDLL:
    """The library built from ``source`` (cached as ``<name>_<key>.so``), loaded with ``mode``
    (``ctypes.RTLD_GLOBAL``: its symbols serve libraries loaded later); ``what`` names it in the
    log. Raises :class:`NativeBuildError`."""
    cc = compiler()
    if cc is None:
        raise NoCompiler("no C compiler (cc/gcc) on PATH")
    try:
        return ctypes.CDLL(str(_build(cc, name, source, what)), mode=mode)
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        raise NativeBuildError(detail.strip()[:500]) from exc


def _build(cc: str, name: str, source: str, what: str) -> Path:
    version = subprocess.run(
        [cc, "--version"], capture_output=True, text=True, check=True, timeout=30
    ).stdout
    key = hashlib.sha256(
        "\0".join([source, " ".join(FLAGS), version, cpu_identity()]).encode()
    ).hexdigest()[:16]
    target = cache_root() / "kernels" / f"{name}_{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        source_path = Path(tmp) / f"{name}.c"
        source_path.write_text(source)
        built = Path(tmp) / target.name
        subprocess.run(
            [cc, *FLAGS, str(source_path), "-o", str(built), "-lm"],
            capture_output=True,
            text=True,
            check=True,
            timeout=120,
        )
        os.replace(built, target)  # atomic: a concurrent worker sees all of it or nothing
    logger.info("%s built in %.1f s: %s", what, time.monotonic() - started, target)
    return target
