"""Decode attention of one layer: the C kernel against torch's gather + SDPA path, in process.

    python bench/decode_attention.py [--threads 2] [--reps 30]
    python bench/decode_attention.py --out-of-cache [--cache-mb 768]

For the attention shapes of the benchmark models (tiny-llama: 8 heads of 32 over 4 KV heads;
llama-100m and SmolLM2: 12 or 9 heads of 64 over 4 or 3), a float32 and a bfloat16 KV cache,
64 requests at short contexts (32-160 tokens, as a closed loop of 32-token prompts and 128
output tokens has them) and at 400-800, and one request at 1,000-2,000: the median time of a
layer's attention over ``--reps`` calls, each path, and their ratio (above 1: the kernel is
faster), with the cache bytes the kernel read per second. Blocks of 16 tokens, scattered. The
CPU's model name and its AVX-512 flag head the table (the kernel's AVX-512 path runs where the
CPU has it).

``--out-of-cache`` times the kernel where a served cache is: larger than the CPU's caches, each
call on other blocks (block tables drawn over a cache of ``--cache-mb``), the cache in memory
advised into 2 MiB pages against the same values in memory advised out of them (4 KiB pages), the
two alternated call by call.
"""

from __future__ import annotations

import argparse
import math
import mmap
import statistics
import time
from collections.abc import Callable

import torch

from switchboard.kernels import huge_pages, paged_decode
from switchboard.kernels.build import cpu_flags
from switchboard.models.attention import DecodeBatch, gathered_decode_attention

BLOCK = 16
SHAPES = [  # label, requests, heads, kv heads, head size, shortest and longest context
    ("tiny-llama", 64, 8, 4, 32, 32, 160),
    ("llama-100m", 64, 12, 4, 64, 32, 160),
    ("llama-100m", 64, 12, 4, 64, 400, 800),
    ("SmolLM2", 64, 9, 3, 64, 32, 160),
    ("llama-100m", 1, 12, 4, 64, 1000, 2000),
]


def median_s(reps: int, fn: Callable[..., object], *args: object) -> float:
    fn(*args)
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def cache_in(huge: bool, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed cache in memory advised into huge pages (``huge``) or out of them."""
    numel = math.prod(shape)
    if huge:
        memory = huge_pages.advised_memory(numel * dtype.itemsize)
    else:
        memory = mmap.mmap(-1, numel * dtype.itemsize, flags=mmap.MAP_PRIVATE)
        if hasattr(mmap, "MADV_NOHUGEPAGE"):
            memory.madvise(mmap.MADV_NOHUGEPAGE)
    return torch.frombuffer(memory, dtype=dtype, count=numel).view(shape)


def out_of_cache(reps: int, cache_mb: int) -> None:
    """The kernel on caches larger than the CPU's: in 2 MiB pages against 4 KiB pages."""
    print("| model | requests | context | cache | MB | 2 MiB pages us | 4 KiB pages us | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    generator = torch.Generator().manual_seed(0)
    for label, rows, heads, kv_heads, dim, shortest, longest in SHAPES[1:4]:
        max_blocks = -(-longest // BLOCK)
        lens = torch.randint(shortest, longest + 1, (rows,), generator=generator)
        query = torch.randn(rows, heads, dim, generator=generator)
        for dtype in (torch.float32, torch.bfloat16):
            block_bytes = 2 * BLOCK * kv_heads * dim * dtype.itemsize
            tables = max(2, (cache_mb << 20) // (block_bytes * rows * max_blocks))
            blocks = tables * rows * max_blocks
            shape = (2, blocks, BLOCK, kv_heads, dim)
            huge, small = cache_in(True, shape, dtype), cache_in(False, shape, dtype)
            for i in range(blocks):  # the same values in both, block by block
                values = torch.randn(2, BLOCK, kv_heads, dim, generator=generator).to(dtype)
                huge[:, i] = values
                small[:, i] = values
            order = torch.randperm(blocks, generator=generator).reshape(tables, rows, max_blocks)
            times: dict[str, list[float]] = {"huge": [], "small": []}
            for rep in range(2 * reps):
                for name, cache in (("huge", huge), ("small", small)):
                    table = order[(2 * rep + (name == "small")) % tables]
                    started = time.perf_counter()
                    paged_decode.paged_decode(query, cache, table, lens, dim**-0.5, None)
                    times[name].append(time.perf_counter() - started)
            h, s = statistics.median(times["huge"]), statistics.median(times["small"])
            print(
                f"| {label} | {rows} | {shortest}-{longest} | {str(dtype).removeprefix('torch.')} "
                f"| {huge.numel() * huge.element_size() >> 20} | {h * 1e6:.0f} | {s * 1e6:.0f} "
                f"| {s / h:.2f} |"
            )
            del huge, small


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--out-of-cache", action="store_true")
    parser.add_argument("--cache-mb", type=int, default=768)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not paged_decode.load():
        raise SystemExit(f"the kernel did not load: {paged_decode.status()}")
    with open("/proc/cpuinfo") as f:
        model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "?")
    print(f"CPU {model}; AVX-512: {'avx512f' in cpu_flags()}; {args.threads} threads")
    if args.out_of_cache:
        out_of_cache(args.reps, args.cache_mb)
        return
    print("| model | requests | context | cache | kernel us | torch us | torch / kernel | GB/s |")
    print("|---|---|---|---|---|---|---|---|")
    generator = torch.Generator().manual_seed(0)
    for label, rows, heads, kv_heads, dim, shortest, longest in SHAPES:
        max_blocks = -(-longest // BLOCK)
        lens = torch.randint(shortest, longest + 1, (rows,), generator=generator)
        table = torch.randperm(rows * max_blocks, generator=generator).reshape(rows, max_blocks)
        batch = DecodeBatch(table, lens, int(lens.max()))
        query = torch.randn(rows, heads, dim, generator=generator)
        for dtype in (torch.float32, torch.bfloat16):
            cache = torch.randn(2, rows * max_blocks, BLOCK, kv_heads, dim, generator=generator)
            cache = cache.to(dtype)
            scale = dim**-0.5
            kernel = median_s(
                args.reps, paged_decode.paged_decode, query, cache, table, lens, scale, None
            )
            reference = median_s(
                args.reps, gathered_decode_attention, query, cache, batch, scale, None
            )
            read = int(lens.sum()) * kv_heads * dim * 2 * cache.element_size()
            print(
                f"| {label} | {rows} | {shortest}-{longest} | {str(dtype).removeprefix('torch.')} "
                f"| {kernel * 1e6:.0f} | {reference * 1e6:.0f} | {reference / kernel:.2f} "
                f"| {read / kernel / 1e9:.1f} |"
            )


if __name__ == "__main__":
    main()
