"""What ``--dtype auto`` serves on CPU: bfloat16 where this CPU runs it faster than float32 and
nothing is lost by it, else float32.

bfloat16 halves the bytes a decode step reads, and with AVX-512 BF16 (``avx512_bf16``) or AMX
(``amx_bf16``) the CPU multiplies bfloat16 pairs natively: there the bfloat16 path (the
``bf16_gemm`` kernel for decode, oneDNN's bfloat16 matmul for prefill) measured faster than
float32 (``bench/dtype_decode.py``; docs/operations.md). Without them bfloat16 is widened to
float32 in software and prefill is slower: float32.

auto still keeps float32 where bfloat16 would lose something: a float32 checkpoint (float32 is
exact; ``--dtype bfloat16`` asks for the speed), and weights served quantized (their kernels
read fewer bytes than bfloat16 and compute in float32). So auto picks bfloat16 for a bfloat16
or float16 checkpoint (most on the hub) on such a CPU.
"""

from __future__ import annotations

import torch

from switchboard.kernels import bf16_gemm

_HALF = (torch.bfloat16, torch.float16)


def cpu_auto_dtype(checkpoint: torch.dtype | None, quantized: bool) -> tuple[torch.dtype, str]:
    """(the dtype, why) for ``--dtype auto`` on CPU; ``checkpoint`` is the checkpoint's own
    dtype (None: it names none), ``quantized`` whether its weights will be served quantized."""
    flag = bf16_gemm.faster_than_float32()
    if flag is None:
        return torch.float32, (
            "this CPU has no AVX-512 BF16 or AMX, where bfloat16 measured faster "
            f"(bfloat16 decode kernel: {bf16_gemm.status()})"
        )
    if quantized:
        return torch.float32, "the weights are served quantized (their kernels run in float32)"
    if checkpoint not in _HALF:
        name = "float32" if checkpoint is None else str(checkpoint).removeprefix("torch.")
        return torch.float32, (
            f"the checkpoint is {name}: float32 is exact; --dtype bfloat16 would be faster on "
            f"this CPU ({flag})"
        )
    return torch.bfloat16, f"this CPU has {flag}, where bfloat16 measured faster than float32"
