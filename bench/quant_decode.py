"""Decode steps on quantized weights against float32: one worker, in process.

    python bench/quant_decode.py [MODEL_DIR] [--batch 1 8] [--context 96] [--steps 30]
                                 [--rounds 5] [--threads N] [--mode gguf]

Loads ``MODEL_DIR`` (default: the built-in SmolLM2-135M-Instruct, whose GGUF file is Q4_1 with
a Q8_0 embedding) three times: float32 throughout (``none``), quantized (``--mode``: ``gguf``
for a checkpoint converted from a GGUF file, else ``int8``), and quantized but with a float32
logits matrix (the LM head's panels float32; the question whether to quantize it). Then, per
batch size, runs ``--rounds`` rounds of ``--steps`` greedy decode steps on each in turn
(alternating, so that other load on the machine falls on all three alike) and prints the median
step time of each and the ratio float32 / quantized: ours vs the float32 path.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from worker_step import BLOCK_SIZE, decode_steps  # noqa: E402  (bench/ is not a package)

from switchboard.checkpoint import resolve_model  # noqa: E402
from switchboard.config import ModelConfig  # noqa: E402
from switchboard.kernels import small_batch_gemm  # noqa: E402
from switchboard.worker.model_runner import ModelRunner  # noqa: E402


def load(model_dir: str, quantization: str, blocks: int) -> ModelRunner:
    config = ModelConfig(model=model_dir, quantization=quantization)
    runner = ModelRunner(config, torch.device("cpu"))
    runner.load_model()
    runner.initialize_kv_cache(blocks, BLOCK_SIZE)
    return runner


def with_float32_head(runner: ModelRunner) -> ModelRunner:
    head = runner.model.logits_head()  # type: ignore[union-attr]
    head.small_batch = small_batch_gemm.pack(head.weight)
    return runner


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", nargs="?", default=None)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--context", type=int, default=96)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--mode", choices=("gguf", "int8"), default="gguf")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model)
    blocks = max(args.batch) * -(-(args.context + args.steps + 1) // BLOCK_SIZE)
    runners = {
        "float32": load(model_dir, "none", blocks),
        "quantized": load(model_dir, args.mode, blocks),
        "fp32 head": with_float32_head(load(model_dir, args.mode, blocks)),
    }
    print(
        f"{model_dir}: {args.threads} torch threads, context {args.context}, "
        f"quantization {runners['quantized'].quantization.describe()}, "
        f"{args.rounds} alternating rounds of {args.steps} steps"
    )
    print(
        f"{'batch':>5} | {'float32 ms':>10} | {'quantized ms':>12} | "
        f"{'quantized, fp32 head ms':>23} | {'float32/quantized':>17}"
    )
    for batch in args.batch:
        times: dict[str, list[float]] = {name: [] for name in runners}
        for runner in runners.values():
            decode_steps(runner, batch, args.context, 3)  # warm-up
        for _ in range(args.rounds):
            for name, runner in runners.items():
                times[name] += decode_steps(runner, batch, args.context, args.steps)
        ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        print(
            f"{batch:>5} | {ms['float32']:>10.2f} | {ms['quantized']:>12.2f} | "
            f"{ms['fp32 head']:>23.2f} | {ms['float32'] / ms['quantized']:>17.2f}"
        )


if __name__ == "__main__":
    main()
