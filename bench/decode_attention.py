"""Decode attention of one layer: the C kernel against torch's gather + SDPA path, in process.

    python bench/decode_attention.py [--threads 2] [--reps 30]

For the attention shapes of the benchmark models (tiny-llama: 8 heads of 32 over 4 KV heads;
llama-100m and SmolLM2: 12 or 9 heads of 64 over 4 or 3), a float32 and a bfloat16 KV cache,
64 requests at short contexts (32-160 tokens, as a closed loop of 32-token prompts and 128
output tokens has them) and at 400-800, and one request at 1,000-2,000: the median time of a
layer's attention over ``--reps`` calls, each path, and their ratio (above 1: the kernel is
faster), with the cache bytes the kernel read per second. Blocks of 16 tokens, scattered. The
CPU's model name and its AVX-512 flag head the table (the kernel's AVX-512 path runs where the
CPU has it).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from switchboard.kernels import paged_decode
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not paged_decode.load():
        raise SystemExit(f"the kernel did not load: {paged_decode.status()}")
    with open("/proc/cpuinfo") as f:
        model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "?")
    print(f"CPU {model}; AVX-512: {'avx512f' in cpu_flags()}; {args.threads} threads")
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
