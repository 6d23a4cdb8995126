"""Build C sources into a shared library with the machine's compiler once, cache it, and load it.

``cc -O3 -march=native -fno-trapping-math -fopenmp``, each source apart and as many at once as
the process has cores, then linked: the code is valid only on CPUs like this
one, so the cached library is keyed by the sources (and the headers beside them), the flags, the
compiler's version and the CPU model and feature flags (under ``<cache>/kernels/``).
``-fopenmp`` links ``libgomp.so.1``, the runtime torch has already loaded (its ``omp simd``
loops, and its thread count, which ``torch.set_num_threads`` sets).
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
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from switchboard.config import cache_root

logger = logging.getLogger(__name__)

# -fno-trapping-math: the kernels never test floating-point exception flags, and with them
# assumed observable GCC would not vectorise a loop holding a float-to-int conversion behind a
# select (every loop that calls ``exp_f32``: SiLU-and-mul, the attention softmax ran one element
# at a time). It changes no value computed, unlike -ffast-math. -Bsymbolic: a kernel's calls to
# another kernel of the same library (the decode stack's) bind to it, not to a namesake loaded
# earlier into the process's global symbols.
COMPILE_FLAGS = ["-O3", "-march=native", "-fno-trapping-math", "-fopenmp", "-fPIC"]
LINK_FLAGS = ["-fopenmp", "-shared", "-Wl,-Bsymbolic"]
FLAGS = [*COMPILE_FLAGS, *LINK_FLAGS[1:]]  # both in one command (a library of one source)


class NativeBuildError(Exception):
    """No compiler, or the sources did not compile or load; the message says which."""


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


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def build_and_load(
    name: str,
    sources: Sequence[Path],
    what: str,
    include_dir: Path,
    mode: int = ctypes.DEFAULT_MODE,
) -> ctypes.CDLL:
    """The library built from ``sources`` (``#include "..."`` finds the headers of
    ``include_dir``), cached as ``<name>_<key>.so`` and loaded with ``mode``
    (``ctypes.RTLD_GLOBAL``: its symbols serve libraries loaded later); ``what`` names it in the
    log. Raises :class:`NativeBuildError` (:class:`NoCompiler` without a compiler)."""
    cc = compiler()
    if cc is None:
        raise NoCompiler("no C compiler (cc/gcc) on PATH")
    try:
        return ctypes.CDLL(str(_build(cc, name, sources, include_dir, what)), mode=mode)
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        raise NativeBuildError(detail.strip()[:500]) from exc


def _source_key(cc: str, sources: Sequence[Path], include_dir: Path) -> str:
    version = subprocess.run(
        [cc, "--version"], capture_output=True, text=True, check=True, timeout=30
    ).stdout
    texts = [f"{path.name}\0{path.read_text()}" for path in sources]
    texts += [f"{path.name}\0{path.read_text()}" for path in sorted(include_dir.glob("*.h"))]
    return hashlib.sha256(
        "\0".join([*texts, " ".join(FLAGS), version, cpu_identity()]).encode()
    ).hexdigest()[:16]


def _build(cc: str, name: str, sources: Sequence[Path], include_dir: Path, what: str) -> Path:
    target = cache_root() / "kernels" / f"{name}_{_source_key(cc, sources, include_dir)}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    jobs = _parallel_jobs(len(sources))
    logger.info(
        "building %s from %d C sources, %d at a time (once: cached for this CPU and these sources)",
        what,
        len(sources),
        jobs,
    )
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        objects = [Path(tmp) / f"{i}_{source.stem}.o" for i, source in enumerate(sources)]
        # one compiler a source, as many at once as this process may use cores: the sources
        # compile apart anyway (no link-time optimisation), so the library is the same
        compile_command = [cc, *COMPILE_FLAGS, "-I", str(include_dir), "-c"]
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            # list(): raises the first failure
            list(
                pool.map(
                    lambda src, obj: _run([*compile_command, str(src), "-o", str(obj)]),
                    sources,
                    objects,
                )
            )
        built = Path(tmp) / target.name
        _run([cc, *LINK_FLAGS, *map(str, objects), "-o", str(built), "-lm"])
        os.replace(built, target)  # atomic: a concurrent worker sees all of it or nothing
    logger.info("%s built in %.1f s: %s", what, time.monotonic() - started, target)
    return target


def _run(command: list[str]) -> None:
    subprocess.run(command, capture_output=True, text=True, check=True, timeout=300)


def _parallel_jobs(sources: int) -> int:
    """Compilers at once: the cores this process may run on (its affinity, a container's
    cpuset), at most one a source."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(cores, sources))
