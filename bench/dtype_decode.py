"""Decode steps in float32 against bfloat16 on CPU: one worker per dtype, in process.

    python bench/dtype_decode.py [MODEL_DIR ...] [--batch 1 8 32] [--context 96] [--steps 20]
                                 [--rounds 5] [--threads N] [--kv-cache-dtype auto]

Loads each ``MODEL_DIR`` (default: the built-in SmolLM2-135M-Instruct; ``default`` names it
among others) twice, ``--quantization none`` (the dtypes alone): in float32 and in bfloat16
(the bfloat16 small-batch kernel, the decode stack, the KV cache in ``--kv-cache-dtype``).
Then, per batch size, runs ``--rounds`` rounds of a prefill of ``batch`` prompts of
``--context`` tokens and ``--steps`` greedy decode steps on each in turn (alternating, so that
other load on the machine falls on both alike), and prints the median decode step, the median
prefill, and the ratios float32 / bfloat16 (above 1: bfloat16 is faster). The CPU's model
name and its bfloat16 flags head the table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from worker_step import BLOCK_SIZE, decode_steps  # noqa: E402  (bench/ is not a package)

from switchboard.checkpoint import resolve_model  # noqa: E402
from switchboard.config import ModelConfig  # noqa: E402
from switchboard.kernels import bf16_gemm  # noqa: E402
from switchboard.kernels.build import cpu_flags  # noqa: E402
from switchboard.worker.model_runner import ModelRunner  # noqa: E402

DTYPES = ("float32", "bfloat16")


def cpu_line() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            model = next(
                (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "?"
            )
    except OSError:
        model = "?"
    flags = sorted(f for f in cpu_flags() if "bf16" in f or f.startswith("amx"))
    return f"CPU {model}; bfloat16 flags: {', '.join(flags) or 'none'}"


def load(model_dir: str, dtype: str, kv_cache_dtype: str, blocks: int) -> ModelRunner:
    config = ModelConfig(
        model=model_dir, dtype=dtype, quantization="none", kv_cache_dtype=kv_cache_dtype
    )
    runner = ModelRunner(config, torch.device("cpu"))
    runner.load_model()
    runner.initialize_kv_cache(blocks, BLOCK_SIZE)
    return runner


def timed(runner: ModelRunner, batch: int, context: int, steps: int) -> tuple[list[float], float]:
    """(each decode step's seconds, the prefill's and the rest's seconds)."""
    started = time.perf_counter()
    decodes = decode_steps(runner, batch, context, steps)
    return decodes, time.perf_counter() - started - sum(decodes)


def compare(model_dir: str, args: argparse.Namespace) -> None:
    blocks = max(args.batch) * -(-(args.context + args.steps + 1) // BLOCK_SIZE)
    runners = {dtype: load(model_dir, dtype, args.kv_cache_dtype, blocks) for dtype in DTYPES}
    kv = runners["bfloat16"].kv_cache_dtype
    print(
        f"\n{model_dir}: {args.threads} torch threads, context {args.context}, KV cache of the "
        f"bfloat16 model {str(kv).removeprefix('torch.')}, bfloat16 kernel "
        f"{bf16_gemm.status()}, {args.rounds} alternating rounds of {args.steps} steps"
    )
    print(
        f"{'rows':>4} | {'f32 decode ms':>13} | {'bf16 decode ms':>14} | {'f32/bf16':>8} | "
        f"{'f32 prefill ms':>14} | {'bf16 prefill ms':>15} | {'f32/bf16':>8}"
    )
    for batch in args.batch:
        decode: dict[str, list[float]] = {dtype: [] for dtype in DTYPES}
        prefill: dict[str, list[float]] = {dtype: [] for dtype in DTYPES}
        for runner in runners.values():
            decode_steps(runner, batch, args.context, 3)  # warm-up
        for _ in range(args.rounds):
            for dtype, runner in runners.items():
                steps, rest = timed(runner, batch, args.context, args.steps)
                decode[dtype] += steps
                prefill[dtype].append(rest)
        d = {dtype: statistics.median(t) * 1e3 for dtype, t in decode.items()}
        p = {dtype: statistics.median(t) * 1e3 for dtype, t in prefill.items()}
        print(
            f"{batch:>4} | {d['float32']:>13.2f} | {d['bfloat16']:>14.2f} | "
            f"{d['float32'] / d['bfloat16']:>8.2f} | {p['float32']:>14.1f} | "
            f"{p['bfloat16']:>15.1f} | {p['float32'] / p['bfloat16']:>8.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("models", nargs="*", default=["default"])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--context", type=int, default=96)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--kv-cache-dtype", choices=("auto", "float32", "bfloat16"), default="auto")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(cpu_line())
    for model in args.models:
        compare(resolve_model(None if model == "default" else model), args)


if __name__ == "__main__":
    main()
