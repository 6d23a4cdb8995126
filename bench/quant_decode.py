"""Decode steps on quantized weights against float32: one worker, in process.

    python bench/quant_decode.py [MODEL_DIR] [--batch 1 2 4 8] [--context 96] [--steps 30]
                                 [--rounds 5] [--threads N] [--mode gguf]
                                 [--kernels float32 exact vnni512 avx2 vnni512-fp32head]

Loads ``MODEL_DIR`` (default: the built-in SmolLM2-135M-Instruct, whose GGUF file is Q4_1 with
a Q8_0 embedding) once per ``--kernels`` entry: ``float32`` throughout (``none``), quantized
(``--mode``: ``gguf`` for a checkpoint converted from a GGUF file, else ``int8``) with the
quantized matmul kernel of that name (``exact``: float32 sums, bit for bit the float32 path;
``vnni512``, ``avx2``: integer dot products; ``SWITCHBOARD_QUANT_GEMM``), NAME-8bit: 4-bit
formats kept as 8 bits (``SWITCHBOARD_QUANT_4BIT=off``), NAME-f32scales: float32 scales and
offsets in every panel (``SWITCHBOARD_QUANT_HALF_SCALES=off``), and NAME-fp32head: with a float32
logits matrix (the question whether to quantize it). Then, per batch
size, runs ``--rounds`` rounds of ``--steps`` greedy decode steps on each in turn (alternating,
so that other load on the machine falls on all alike) and prints the median step time of each
and each one's speed-up over the first. Variants this CPU cannot run are skipped. ``--matmuls``
times the matmul kernels alone instead of whole steps: one pass over every matrix of the model
(each through its kernel's C function) per sample.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from worker_step import BLOCK_SIZE, decode_steps  # noqa: E402  (bench/ is not a package)

from switchboard.checkpoint import resolve_model  # noqa: E402
from switchboard.config import ModelConfig  # noqa: E402
from switchboard.kernels import library, quant_gemm, small_batch_gemm  # noqa: E402
from switchboard.worker.model_runner import ModelRunner  # noqa: E402


def load(model_dir: str, quantization: str, blocks: int) -> ModelRunner:
    config = ModelConfig(model=model_dir, quantization=quantization)
    runner = ModelRunner(config, torch.device("cpu"))
    runner.load_model()
    runner.initialize_kv_cache(blocks, BLOCK_SIZE)
    return runner


def load_with_kernel(model_dir: str, kernel: str, mode: str, blocks: int) -> ModelRunner:
    """A runner whose quantized matrices are packed for ``kernel`` (float32: none)."""
    if kernel == "float32":
        return load(model_dir, "none", blocks)
    name, _, suffix = kernel.partition("-")
    os.environ["SWITCHBOARD_QUANT_GEMM"] = name
    os.environ["SWITCHBOARD_QUANT_4BIT"] = "off" if suffix == "8bit" else "auto"
    os.environ["SWITCHBOARD_QUANT_HALF_SCALES"] = "off" if suffix == "f32scales" else "auto"
    runner = load(model_dir, mode, blocks)
    return with_float32_head(runner) if suffix == "fp32head" else runner


def select(kernel: str) -> None:
    """Make ``kernel``'s dot product variant the one the library runs (one at a time)."""
    name = kernel.partition("-")[0]
    if name != "float32":
        quant_gemm.load(name)


def matmul_pass(runner: ModelRunner, rows: int, clock: Callable[[], float]) -> float:
    """Seconds for one product of ``rows`` random rows with every matrix of the model, each
    through its small-batch kernel's C function (ctypes), as a decode step reads them."""
    calls = []
    for module in runner.model.modules():  # type: ignore[union-attr]
        panels = getattr(module, "small_batch", None)
        if panels is None:
            continue
        out_features, in_features = panels.out_features, module.weight.shape[1]
        x, y = torch.randn(rows, in_features), torch.empty(rows, out_features)
        lib = library.load()
        if isinstance(panels, quant_gemm.QuantPanels):
            kernel = lib.quant_linear
            if panels.dot:
                kernel = lib.quant_dot4_linear if panels.bits == 4 else lib.quant_dot_linear
            extra: tuple[int, ...] = (panels.kernel_block,)
        else:
            kernel, extra = lib.small_batch_linear, ()
        args = (x.data_ptr(), in_features, panels.data.data_ptr(), None, y.data_ptr(), rows,
                in_features, out_features, *extra)  # fmt: skip
        calls.append((kernel, args, x, y))
    started = clock()
    for kernel, args, _, _ in calls:
        kernel(*args)
    return clock() - started


def with_float32_head(runner: ModelRunner) -> ModelRunner:
    head = runner.model.logits_head()  # type: ignore[union-attr]
    head.small_batch = small_batch_gemm.pack(head.weight)
    return runner


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", nargs="?", default=None)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--context", type=int, default=96)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--mode", choices=("gguf", "int8"), default="gguf")
    parser.add_argument(
        "--kernels",
        nargs="+",
        default=["float32", "exact", "vnni512-8bit", "vnni512", "avx2"],
        help="float32, exact, vnni512, avx2; NAME-8bit: 4-bit formats as 8 bits; "
        "NAME-fp32head: with a float32 logits matrix; NAME-f32scales: float32 scales and "
        "offsets in the panels where float16 ones would do",
    )
    parser.add_argument(
        "--matmuls",
        action="store_true",
        help="time the matmul kernels alone: one pass of --batch rows over every matrix",
    )
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="with --matmuls --threads 1: the thread's CPU time, not wall time (a loaded machine)",
    )
    args = parser.parse_args()
    if args.cpu_time and not (args.matmuls and args.threads == 1):
        parser.error("--cpu-time needs --matmuls and --threads 1")
    clock = time.thread_time if args.cpu_time else time.perf_counter
    torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model)
    blocks = max(args.batch) * -(-(args.context + args.steps + 1) // BLOCK_SIZE)
    runnable = {"float32", quant_gemm.EXACT, *quant_gemm.dot_variants()}
    kernels = [k for k in args.kernels if k.partition("-")[0] in runnable]
    runners = {k: load_with_kernel(model_dir, k, args.mode, blocks) for k in kernels}
    quantized = next((r for k, r in runners.items() if k != "float32"), None)
    print(
        f"{model_dir}: {args.threads} torch threads, context {args.context}, "
        f"quantization {quantized.quantization.describe() if quantized else 'none'}, "
        f"{args.rounds} alternating rounds of {args.steps} "
        f"{'passes over the matrices' if args.matmuls else 'steps'}; median ms "
        f"(speed-up over {kernels[0]}) and the fastest"
    )
    print(f"{'batch':>5} | " + " | ".join(f"{k:>24}" for k in kernels))
    for batch in args.batch:
        times: dict[str, list[float]] = {name: [] for name in runners}
        for name, runner in runners.items():
            select(name)
            decode_steps(runner, batch, args.context, 3)  # warm-up
        for _ in range(args.rounds):
            for name, runner in runners.items():
                select(name)
                if args.matmuls:
                    times[name] += [matmul_pass(runner, batch, clock) for _ in range(args.steps)]
                else:
                    times[name] += decode_steps(runner, batch, args.context, args.steps)
        ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        best = {name: min(t) * 1e3 for name, t in times.items()}
        first = ms[kernels[0]]
        cells = [f"{ms[k]:.2f} ({first / ms[k]:.2f}x) {best[k]:.2f}" for k in kernels]
        print(f"{batch:>5} | " + " | ".join(f"{c:>24}" for c in cells))


if __name__ == "__main__":
    main()
