"""The sampling step for a batch of 256 requests: mixed parameters vs all-greedy.

    python bench/sampler.py [--batch 256] [--vocab 49152] [--steps 30] [--device cpu|cuda]

A "sampling step" is what the worker does after the forward pass: build the batch's sampling
tensors from the requests' state (``build_sampling_batch``) and pick one token per row
(``sample``), including logprobs where asked. Every request has a 512-token prompt and 128
output tokens of history (what penalties and bad words look at).

Logits are "LM-like": a low random background and 64 likely tokens per row, so a top-p nucleus
holds tens of tokens, as it does for a language model. The last row uses flat random logits
instead, where a 0.95 nucleus spans thousands of tokens: the worst case (a full sort per row).
Medians over ``--steps`` steps, in milliseconds; the ratio is to the all-greedy batch.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
from collections.abc import Callable

import torch

from switchboard.wire.engine_msgs import SamplingParams
from switchboard.worker.sampler import new_request_generator, sample
from switchboard.worker.sampling_inputs import build_sampling_batch
from switchboard.worker.step_inputs import RequestState

PROMPT_LEN = 512
OUTPUT_LEN = 128


def greedy(row: int, rng: random.Random, vocab: int) -> SamplingParams:
    return SamplingParams(temperature=0.0)


def random_top_p(row: int, rng: random.Random, vocab: int) -> SamplingParams:
    return SamplingParams(temperature=0.8, top_p=0.95)


def random_plain(row: int, rng: random.Random, vocab: int) -> SamplingParams:
    return SamplingParams(temperature=1.0)


def mixed(row: int, rng: random.Random, vocab: int) -> SamplingParams:
    """Eight kinds of request, round robin: what a busy server mixes in one batch."""
    kind = row % 8
    if kind == 0:
        return SamplingParams(temperature=0.0)
    if kind == 1:
        return SamplingParams(temperature=0.7, top_k=50, top_p=0.9)
    if kind == 2:
        return SamplingParams(temperature=1.0, min_p=0.05, seed=row)
    if kind == 3:
        return SamplingParams(temperature=0.8, presence_penalty=0.5, frequency_penalty=0.3)
    if kind == 4:
        return SamplingParams(temperature=0.0, repetition_penalty=1.2, logprobs=5)
    if kind == 5:
        bias = {rng.randrange(vocab): rng.uniform(-5, 5) for _ in range(20)}
        return SamplingParams(temperature=0.9, top_p=0.8, logit_bias=bias)
    if kind == 6:
        words = [[rng.randrange(vocab) for _ in range(rng.randint(1, 3))] for _ in range(10)]
        return SamplingParams(
            temperature=0.6, bad_words_token_ids=words, min_tokens=OUTPUT_LEN + 10,
            eos_token_ids=[2], stop_token_ids=[5, 6],
        )  # fmt: skip
    return SamplingParams(
        temperature=1.0, allowed_token_ids=rng.sample(range(vocab), 1000), logprobs=0
    )


def make_states(
    make_params: Callable[[int, random.Random, int], SamplingParams],
    args: argparse.Namespace,
    device: torch.device,
) -> list[RequestState]:
    rng = random.Random(0)
    states = []
    for row in range(args.batch):
        params = make_params(row, rng, args.vocab)
        tokens = [rng.randrange(args.vocab) for _ in range(PROMPT_LEN + OUTPUT_LEN)]
        states.append(
            RequestState(
                request_id=f"r{row}",
                token_ids=tokens,
                block_ids=[],
                num_computed_tokens=len(tokens),
                sampling_params=params,
                generator=None
                if params.seed is None
                else new_request_generator(params.seed, OUTPUT_LEN),
                num_prompt_tokens=PROMPT_LEN,
            )
        )
    return states


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def make_logits(args: argparse.Namespace, device: torch.device, flat: bool) -> torch.Tensor:
    if flat:
        return torch.randn(args.batch, args.vocab, device=device) * 3
    logits = torch.randn(args.batch, args.vocab, device=device) * 2 - 10
    head = torch.randint(args.vocab, (args.batch, 64), device=device)
    boost = torch.rand(args.batch, 64, device=device) * 8 + 2
    return logits.scatter_(1, head, boost)


def measure(states: list[RequestState], args: argparse.Namespace, device: torch.device, flat: bool):
    logits = make_logits(args, device, flat)
    build_ms, sample_ms = [], []
    for step in range(args.warmup + args.steps):
        work = logits.clone()
        synchronize(device)
        started = time.perf_counter()
        batch = build_sampling_batch(states, args.vocab, device)
        synchronize(device)
        built = time.perf_counter()
        result = sample(work, batch)
        token_ids = result.token_ids.tolist()  # the worker needs them on the host
        done = time.perf_counter()
        for state, token_id in zip(states, token_ids, strict=True):
            state.append_output_token(token_id)  # history grows as in serving
        if step >= args.warmup:
            build_ms.append((built - started) * 1e3)
            sample_ms.append((done - built) * 1e3)
    return statistics.median(build_ms), statistics.median(sample_ms)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=49152)  # SmolLM2's
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    torch.manual_seed(0)
    gc.collect()
    scenarios = {  # name: (parameters per row, flat logits)
        "all greedy": (greedy, False),
        "all temperature": (random_plain, False),
        "all temperature+top_p": (random_top_p, False),
        "mixed (8 kinds)": (mixed, False),
        "top_p, flat logits": (random_top_p, True),
    }
    print(
        f"sampling step, batch {args.batch}, vocab {args.vocab}, device {device}, "
        f"{torch.get_num_threads()} threads, median of {args.steps} steps (ms)"
    )
    header = f"{'batch':<24}{'build':>9}{'sample':>9}{'total':>9}{'x greedy':>10}"
    print(header)
    print("-" * len(header))
    baseline = None
    for name, (make_params, flat) in scenarios.items():
        states = make_states(make_params, args, device)
        build_ms, sample_ms = measure(states, args, device, flat)
        total = build_ms + sample_ms
        baseline = baseline or total
        print(f"{name:<24}{build_ms:>9.2f}{sample_ms:>9.2f}{total:>9.2f}{total / baseline:>10.1f}")
    print(
        "mixed = round robin of: greedy | top_k+top_p | min_p+seed | presence+frequency | "
        "repetition+logprobs 5 | logit_bias x20 | bad words x10 + min_tokens | "
        "allowed_token_ids x1000 + logprobs 0"
    )


if __name__ == "__main__":
    main()
