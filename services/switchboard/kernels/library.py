"""The kernels' one shared library: built from ``csrc/`` once per machine, loaded once per process,
every function's ctypes signature declared here (``SIGNATURES``, as ``csrc/kernels.h`` declares
them).

The library holds the work pool the kernels split their loops over (``csrc/work_pool.c``) and
every kernel. It is loaded with ``RTLD_GLOBAL``, so a library built apart from it (a test's) can
call ``switchboard_parallel_for`` and share the same threads. ``SWITCHBOARD_WORK_POOL=openmp``
makes every loop an OpenMP ``parallel for`` instead (the behaviour before the pool, kept for
comparison); the first load decides it for the process's life.

Each kernel module asks for the library through :func:`load_switched` with its own off switch:
(the library, "in use"), or (None, why not). A failed build is logged once (at info without a
compiler: a slim image is expected to have none) and not retried.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from switchboard.kernels.build import NativeBuildError, NoCompiler, build_and_load

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).with_name("csrc")
# The translation units of the library (their headers are SOURCE_DIR's *.h).
SOURCES = (
    "work_pool.c",
    "paged_decode.c",
    "fused_ops.c",
    "fused_ops_bf16.c",
    "small_batch_gemm.c",
    "quant_gemm.c",
    "quant_dot.c",
    "quant_dot_pack.c",
    "bf16_gemm.c",
    "bf16_amx.c",
    "decode_stack.c",
    "lora_delta.c",
)

_I64, _F32, _INT, _PTR = ctypes.c_int64, ctypes.c_float, ctypes.c_int, ctypes.c_void_p
# The LoRA kernels' adapter of each row: each row's slot, the slots, their ranks, the largest
# rank (``lora_delta.slot_arguments``)
_SLOT_ARGUMENTS = [_PTR, _I64, _PTR, _I64]
# name -> (result type, argument types); None = void
SIGNATURES: dict[str, tuple[Any, list[Any]]] = {
    "switchboard_work_pool_use_openmp": (None, [_INT]),
    "switchboard_work_pool_helpers": (_INT, []),
    "switchboard_work_pool_hold": (None, [_INT]),
    "switchboard_work_pool_sleeps": (_I64, []),
    "paged_decode_f32": (_INT, [_PTR, _I64, *[_PTR] * 4, *[_I64] * 7, _F32, _I64]),
    "paged_decode_bf16kv": (_INT, [_PTR, _I64, *[_PTR] * 4, *[_I64] * 7, _F32, _I64]),
    "rms_norm_f32": (None, [_PTR, _I64, _PTR, _PTR, _I64, _I64, _F32]),
    "rotary_f32": (None, [_PTR, _I64, _I64, _I64, _I64, _PTR, _PTR]),
    "silu_and_mul_f32": (None, [_PTR, _I64, _PTR, _I64, _I64]),
    "write_kv_f32": (_INT, [_PTR, _I64, _PTR, _I64, _PTR, _I64, _I64, _PTR, _PTR, _I64]),
    "write_kv_bf16": (_INT, [_PTR, _I64, _PTR, _I64, _PTR, _I64, _I64, _PTR, _PTR, _I64]),
    "argmax_rows_f32": (None, [_PTR, _I64, _I64, _I64, _PTR]),
    "rms_norm_bf16": (None, [_PTR, _I64, _PTR, _PTR, _I64, _I64, _F32]),
    "rotary_bf16": (None, [_PTR, _I64, _I64, _I64, _I64, _PTR, _PTR]),
    "silu_and_mul_bf16": (None, [_PTR, _I64, _PTR, _I64, _I64]),
    "bf16_rows_to_f32": (None, [_PTR, _I64, _PTR, _I64, _I64]),
    "f32_rows_to_bf16": (None, [_PTR, _I64, _PTR, _I64, _I64]),
    "add_f32": (None, [_PTR, _I64, _PTR, _I64, _PTR, _I64, _I64]),
    "add_bf16": (None, [_PTR, _I64, _PTR, _I64, _PTR, _I64, _I64]),
    "small_batch_max_rows": (_INT, []),
    "small_batch_pack": (None, [_PTR, _PTR, _I64, _I64]),
    "small_batch_linear": (_INT, [_PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64]),
    "quant_gemm_max_rows": (_INT, []),
    "quant_pack": (None, [*[_PTR] * 4, *[_I64] * 3]),
    "quant_linear": (_INT, [_PTR, _I64, _PTR, _PTR, _PTR, *[_I64] * 4]),
    "quant_dot_variants": (_INT, []),
    "quant_dot_select": (_INT, [_INT]),
    "quant_dot_max_rows": (_INT, []),
    "quant_dot_pack": (_I64, [*[_PTR] * 4, *[_I64] * 3]),
    "quant_dot_linear": (_INT, [_PTR, _I64, _PTR, _PTR, _PTR, *[_I64] * 4]),
    "quant_dot4_pack": (_I64, [*[_PTR] * 4, *[_I64] * 4]),
    "quant_dot4_linear": (_INT, [_PTR, _I64, _PTR, _PTR, _PTR, *[_I64] * 4]),
    "bf16_gemm_variants": (_INT, []),
    "bf16_gemm_select": (_INT, [_INT]),
    "bf16_gemm_max_rows": (_INT, []),
    "bf16_pack": (None, [_PTR, _PTR, _I64, _I64]),
    "bf16_linear": (_INT, [_PTR, _I64, _PTR, _PTR, _PTR, *[_I64] * 3]),
    "decode_stack_f32": (
        _INT,
        [_PTR, _I64, _I64, _PTR, *[_I64] * 5, _F32, _F32, *[_PTR] * 5, *[_I64] * 4]
        + [_PTR, *_SLOT_ARGUMENTS, _PTR, _F32, _PTR],
    ),
    "lora_delta_f32": (
        _INT,
        [_PTR, _I64, _PTR, *[_I64] * 4, _PTR, _PTR, *_SLOT_ARGUMENTS, _I64, _PTR],
    ),
}

_POOL_VARIABLE = "SWITCHBOARD_WORK_POOL"
_library: ctypes.CDLL | None = None
_failure: str | None = None  # why the build or load failed (not retried)
_pool_status = "not loaded"


def pool_variant() -> str:
    """``pool`` (the default) or ``openmp``, from ``SWITCHBOARD_WORK_POOL``."""
    return "openmp" if os.environ.get(_POOL_VARIABLE, "auto") == "openmp" else "pool"


def load() -> ctypes.CDLL:
    """The library, built on first use on this machine and loaded once per process. Raises
    :class:`NativeBuildError` (:class:`NoCompiler` without a compiler)."""
    global _library, _failure, _pool_status
    if _library is not None:
        return _library
    if _failure is not None:
        raise NativeBuildError(_failure)
    try:
        library = build_and_load(
            "switchboard_kernels",
            [SOURCE_DIR / name for name in SOURCES],
            "CPU kernels",
            SOURCE_DIR,
            mode=ctypes.RTLD_GLOBAL,
        )
    except NativeBuildError as exc:
        _failure = str(exc)
        _pool_status = f"unavailable: {exc}"
        log = logger.info if isinstance(exc, NoCompiler) else logger.warning
        log("CPU kernels unavailable: %s", exc)
        raise
    for name, (result, arguments) in SIGNATURES.items():
        function = getattr(library, name)
        function.restype = result
        function.argtypes = arguments
    openmp = pool_variant() == "openmp"
    library.switchboard_work_pool_use_openmp(int(openmp))
    _pool_status = (
        f"OpenMP parallel for ({_POOL_VARIABLE}=openmp)"
        if openmp
        else "in use (threads claim chunks; no end-of-loop barrier)"
    )
    _library = library
    return library


def load_switched(variable: str, off: str) -> tuple[ctypes.CDLL | None, str]:
    """What a kernel module's ``load()`` does first: (the library, "in use"), or (None, why
    not): switched off by ``variable=off`` in the environment, or the build failed."""
    if os.environ.get(variable, "auto") == off:
        return None, f"off ({variable}={off})"
    try:
        return load(), "in use"
    except NativeBuildError as exc:
        return None, f"unavailable: {exc}"


class SwitchedFunction:
    """One library function a kernel module calls, behind the module's off switch
    (``variable=off`` in the environment, as :func:`load_switched`): ``function`` while loaded,
    ``status`` always."""

    def __init__(self, name: str, variable: str) -> None:
        self.name, self.variable = name, variable
        self.function: Callable[..., Any] | None = None
        self.status = "not loaded"

    def load(self) -> bool:
        """Take the function from the library; True when it is in use. Idempotent."""
        if self.function is not None:
            return True
        loaded, self.status = load_switched(self.variable, "off")
        if loaded is None:
            return False
        self.function = getattr(loaded, self.name)
        return True

    def unload(self) -> None:
        self.function, self.status = None, "not loaded"


def load_panel_kernel(variable: str, pack: str, linear: str, max_rows: str) -> tuple[Any, int, str]:
    """What a panel matmul module's ``load()`` does (the float32 and the quantized small-batch
    kernels): ((pack, linear) functions, rows at a time, status); (None, 0, why not) when the
    kernel is not usable (no AVX2 and FMA on the CPU or in the build, switched off by
    ``variable=off``, or no library)."""
    from switchboard.kernels.build import cpu_flags

    if not {"avx2", "fma"} <= cpu_flags():
        return None, 0, "unavailable: the CPU has no AVX2 and FMA"
    loaded, status = load_switched(variable, "off")
    if loaded is None:
        return None, 0, status
    rows = int(getattr(loaded, max_rows)())
    if rows == 0:
        return None, 0, "unavailable: the compiler built it without AVX2 and FMA"
    functions = (getattr(loaded, pack), getattr(loaded, linear))
    return functions, rows, f"in use ({rows} rows at a time)"


def pool_status() -> str:
    return _pool_status


def hold_pool(on: bool) -> None:
    """A step on every thread starts (True) or ends: meanwhile the pool's helpers wait for its
    next loop spinning (up to a millisecond), not asleep (``csrc/work_pool.c``)."""
    if _library is not None:
        _library.switchboard_work_pool_hold(int(on))


def pool_sleeps() -> int:
    """Times a helper of the work pool has gone to sleep in this process."""
    return int(_library.switchboard_work_pool_sleeps()) if _library is not None else 0


def pool_helpers_started() -> int:
    """Helper threads the work pool has started in this process (0 before its first parallel
    loop, and always with the OpenMP variant)."""
    return int(_library.switchboard_work_pool_helpers()) if _library is not None else 0
