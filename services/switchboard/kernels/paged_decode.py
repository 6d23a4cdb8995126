"""Decode attention on CPU that reads the paged KV cache in place (``csrc/paged_decode.c``).

The torch path (``models/attention.py``, ``gathered_decode_attention``) gathers every request's
whole context out of the cache into a new tensor, per layer per step, before attending; on a
2-core EPYC that copy was the largest cost after the matmuls (18 % of a tiny-llama decode step at
8 requests). This kernel walks each request's block table instead and reads every key and value
once, where it lies. The call releases the GIL; its tasks run on the kernels' work pool (as many
threads as torch's). The CPU attention backend (``models/cpu_kernel_attention.py``) calls it.
Without a compiler, or with ``SWITCHBOARD_CPU_ATTENTION=torch``, it does not load; ``status()``
says why.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from switchboard.kernels import fused_ops, library

_kernel: Callable[..., Any] | None = None  # the library's paged_decode_f32
_kernel_bf16kv: Callable[..., Any] | None = None  # the same over a bfloat16 cache
# the cache's dtypes the kernel reads (keys and values widened to float32 in registers)
CACHE_DTYPES = (torch.float32, torch.bfloat16)
_status = "not loaded"


def load() -> bool:
    """Load the kernel (built once per machine); True when it is in use. Idempotent."""
    global _kernel, _kernel_bf16kv, _status
    if _kernel is not None:
        return True
    loaded, _status = library.load_switched("SWITCHBOARD_CPU_ATTENTION", "torch")
    if loaded is None:
        return False
    _kernel, _kernel_bf16kv = loaded.paged_decode_f32, loaded.paged_decode_bf16kv
    return True


def status() -> str:
    return _status


def unload() -> None:
    """Back to torch's path (tests compare the two)."""
    global _kernel, _kernel_bf16kv, _status
    _kernel = _kernel_bf16kv = None
    _status = "not loaded"


def usable_for(query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    return (
        _kernel is not None
        and query.device.type == "cpu"
        and query.dtype in CACHE_DTYPES
        and kv_cache.dtype in CACHE_DTYPES
        and kv_cache.is_contiguous()
        and query.shape[1] % kv_cache.shape[3] == 0
    )


def paged_decode(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """``[size, heads, head_dim]`` attention output of one query token per row, in the query's
    dtype (computed in float32; a bfloat16 query or cache is widened): row ``i`` attends over
    the first ``context_lens[i]`` positions of its blocks (``block_table[i]``), no further back
    than ``sliding_window``."""
    kernel = _kernel_bf16kv if kv_cache.dtype == torch.bfloat16 else _kernel
    assert kernel is not None, "paged_decode before load()"
    dtype = query.dtype
    if query.stride(2) != 1 or query.stride(1) != query.shape[2]:  # rows may be strided
        query = query.contiguous()
    if dtype != torch.float32:  # a view of rows of heads x head_dim, widened in the kernel
        query = fused_ops.to_dtype(query.flatten(1), torch.float32).view(query.shape)
    block_table = block_table.contiguous()
    context_lens = context_lens.contiguous()
    size, heads, head_dim = query.shape
    _, num_blocks, block_size, kv_heads, _ = kv_cache.shape
    out = torch.empty(size, heads, head_dim, dtype=torch.float32)
    code = kernel(
        query.data_ptr(),
        query.stride(0),
        kv_cache.data_ptr(),
        block_table.data_ptr(),
        context_lens.data_ptr(),
        out.data_ptr(),
        size,
        heads,
        kv_heads,
        head_dim,
        num_blocks,
        block_size,
        block_table.shape[1],
        scale,
        sliding_window or 0,
    )
    if code != 0:
        raise MemoryError("CPU decode-attention kernel: out of scratch memory")
    if dtype == torch.float32:
        return out
    return fused_ops.to_dtype(out.view(size, heads * head_dim), dtype).view(out.shape)
