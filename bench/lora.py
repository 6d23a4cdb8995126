"""LoRA decode throughput, in process: c requests spread over 0, 1, 4 and 8 adapters.

    python bench/lora.py [MODEL_DIR] [--concurrency 32] [--rank 16] [--context 64]
                         [--steps 32] [--rounds 5] [--threads N]

Builds a :class:`ModelRunner` with ``--enable-lora`` (``--max-loras 8``) on ``MODEL_DIR`` (default:
a seeded random Llama of 8 layers, hidden 512, written by the tests' checkpoint writer), writes 8
random adapters of ``--rank`` on every projection in PEFT's format, prefills ``--concurrency``
requests of ``--context`` random tokens and times greedy decode steps. The requests are spread
round-robin over 1, 4 or 8 adapters, or all on the base model, and over 4 adapters with the
deltas in torch (the path before the C delta kernel: off the one-call decode stack); a runner
without ``--enable-lora`` is the baseline. Each variant has its own runner and their decode steps
alternate (step k of each, in an order rotated every step, then step k + 1 of each), so a busy
machine slows them alike; a round
(``--rounds``) is a prefill and ``--steps`` decode steps of each. Prints each variant's median
and best (over the rounds) of its median step's tokens per second, the median of its per-round
ratios to the baseline and the ratio of the bests, and the load average. The
engine, the wires and the gateway are the same whatever the adapters, so the forward pass is
what differs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file

from switchboard.config import ModelConfig
from switchboard.config.lora import LoraConfig
from switchboard.kernels import lora_delta
from switchboard.models.hf_config import load_transformer_config
from switchboard.models.lora.families import llama_layout
from switchboard.wire.engine_msgs import SamplingParams
from switchboard.wire.step_msgs import CachedRequest, NewRequest, SchedulerOutput
from switchboard.worker.model_runner import ModelRunner

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the test helpers' checkpoint
from tests.tiny_checkpoint import tiny_llama_dir  # noqa: E402

BLOCK_SIZE = 16
MAX_LORAS = 8
LLAMA_30M = dict(num_layers=8, hidden_size=512, num_heads=8, num_kv_heads=4)
LLAMA_30M.update(intermediate_size=1536, vocab_size=16000, max_position_embeddings=1024)


def make_model() -> str:
    """A seeded random Llama of ~30M parameters (the test helpers' checkpoint writer)."""
    return tiny_llama_dir(**LLAMA_30M)


def make_adapter(model_dir: str, root: str, index: int, rank: int) -> str:
    """A PEFT directory with random A and B on every projection of every layer."""
    config = load_transformer_config(model_dir)
    generator = torch.Generator().manual_seed(index)
    tensors = {}
    for layer in range(config.num_layers):
        for module, shape in llama_layout(config).projections.items():
            part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{part}.{module}"
            a = torch.randn(rank, shape.in_features, generator=generator) * 0.02
            b = torch.randn(shape.out_features, rank, generator=generator) * 0.02
            tensors[f"{prefix}.lora_A.weight"] = a
            tensors[f"{prefix}.lora_B.weight"] = b
    path = os.path.join(root, f"adapter-{index}")
    os.makedirs(path)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    settings = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": list(llama_layout(config).projections),
    }
    with open(os.path.join(path, "adapter_config.json"), "w") as file:
        json.dump(settings, file)
    return path


def prefill(runner: ModelRunner, adapters: list[str], args) -> list[NewRequest]:
    """Prefill ``--concurrency`` requests (adapter i % len(adapters), or the base model)."""
    rng = random.Random(0)
    vocab = runner.summary().vocab_size
    per_request = -(-(args.context + args.steps + 1) // BLOCK_SIZE)
    new = [
        NewRequest(
            request_id=f"r{i}",
            prompt_token_ids=[rng.randrange(vocab) for _ in range(args.context)],
            sampling_params=SamplingParams(temperature=0.0, max_tokens=args.steps + 1),
            block_ids=list(range(i * per_request, (i + 1) * per_request)),
            num_computed_tokens=0,
            lora_name=adapters[i % len(adapters)] if adapters else "",
        )
        for i in range(args.concurrency)
    ]
    scheduled = {r.request_id: args.context for r in new}
    runner.execute_model(SchedulerOutput(0, new, [], scheduled, sum(scheduled.values())))
    return new


def decode_step_s(runner: ModelRunner, requests: list[NewRequest], k: int, context: int) -> float:
    """The seconds of decode step ``k`` (every request one token)."""
    step = SchedulerOutput(
        k + 1,
        cached_requests=[CachedRequest(r.request_id, [], context + k) for r in requests],
        num_scheduled_tokens={r.request_id: 1 for r in requests},
        total_num_scheduled_tokens=len(requests),
    )
    started = time.perf_counter()
    runner.execute_model(step)
    return time.perf_counter() - started


def finish(runner: ModelRunner, requests: list[NewRequest], step_id: int) -> None:
    finished = [r.request_id for r in requests]
    runner.execute_model(SchedulerOutput(step_id, finished_request_ids=finished))


def rotated(items: range, k: int) -> list[int]:
    return [*items[k % len(items) :], *items[: k % len(items)]]


@contextlib.contextmanager
def torch_delta(on: bool) -> Iterator[None]:
    """The deltas in torch, off the one-call decode stack (the path before the C kernel)."""
    if on:
        lora_delta.unload()
    try:
        yield
    finally:
        lora_delta.load()


def runner_for(model_dir: str, lora: LoraConfig, args) -> ModelRunner:
    runner = ModelRunner(
        ModelConfig(model=model_dir, quantization="none", lora=lora), torch.device("cpu")
    )
    runner.load_model()
    per_request = -(-(args.context + args.steps + 1) // BLOCK_SIZE)
    runner.initialize_kv_cache(args.concurrency * per_request, BLOCK_SIZE)
    return runner


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", nargs="?")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as root:
        model_dir = args.model_dir or make_model()
        adapters = {f"a{i}": make_adapter(model_dir, root, i, args.rank) for i in range(MAX_LORAS)}
        variants = [("base model, LoRA off", runner_for(model_dir, LoraConfig(), args), [])]
        lora = LoraConfig(enable_lora=True, max_loras=MAX_LORAS, max_lora_rank=args.rank)
        for count in (0, 1, 4, 8, -4):  # a runner each, so their steps can alternate
            runner = runner_for(model_dir, lora, args)
            assert runner.lora is not None
            for name, path in adapters.items():
                runner.lora.manager.add(name, path)
            label = f"{count} adapter(s)" if count > 0 else "base model, LoRA on"
            if count < 0:
                label = f"{-count} adapter(s), torch"
            variants.append((label, runner, list(adapters)[: abs(count)]))
        rates: dict[str, list[float]] = {label: [] for label, _, _ in variants}
        for _ in range(args.rounds):
            requests = [prefill(runner, names, args) for _, runner, names in variants]
            times: list[list[float]] = [[] for _ in variants]
            for k in range(args.steps):  # step k of every variant, one after the other
                for v in rotated(range(len(variants)), k):  # no variant always first
                    label, runner, _ = variants[v]
                    with torch_delta(label.endswith("torch")):
                        times[v].append(decode_step_s(runner, requests[v], k, args.context))
            for (label, runner, _), batch, spent in zip(variants, requests, times, strict=True):
                rates[label].append(args.concurrency / statistics.median(spent))
                finish(runner, batch, args.steps + 1)
    print(
        f"decode, c = {args.concurrency}, rank {args.rank}, context {args.context}, "
        f"{torch.get_num_threads()} threads, {args.rounds} rounds alternated, "
        f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}"
    )
    baseline = rates[variants[0][0]]
    print(f"{'requests on':<24}{'median tok/s':>13}{'x base':>8}{'best tok/s':>12}{'x base':>8}")
    for label, rate in rates.items():
        median, best = statistics.median(rate), max(rate)
        # each round's ratio to the baseline of the same round, then their median
        median_ratio = statistics.median(r / b for r, b in zip(rate, baseline, strict=True))
        best_ratio = best / max(baseline)
        print(f"{label:<24}{median:>13.1f}{median_ratio:>8.2f}{best:>12.1f}{best_ratio:>8.2f}")


if __name__ == "__main__":
    main()
