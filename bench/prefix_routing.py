"""Prefix-aware routing vs power of two choices across DP engines, on multi-turn conversations.

    python bench/prefix_routing.py [--model DIR] [-dp 2] [--conversations 16] [--turns 6]
                                   [--system-tokens 128] [--user-tokens 128] [--max-tokens 64]
                                   [--kv-blocks 800] [--repeat 2] [--server-arg ARG ...]

Starts two real servers (`switchboard serve -dp N`) one after the other, the same in every way
but ``--routing-policy`` (prefix, then power-of-two), and runs the same workload on each:
``--conversations`` conversations at once, each on its own gRPC channel (so the server's
gateways share them), each ``--turns`` turns long. Every prompt is a system prompt shared by
all conversations, then the conversation so far (each earlier turn's user message and the
tokens the server answered), then a new user message of ``--user-tokens`` random tokens; a
conversation sends its next turn when the last one ends. Prompts are token ids, greedy,
``--max-tokens`` output tokens each. A few unrelated requests warm each server up first.

Printed per policy: the share of prompt tokens the server served from its prefix cache
(``Usage.cached_prompt_tokens``), client-side time to first token (p50, p90), output tokens per
second over the whole run, and the ratios prefix / power-of-two. ``--repeat`` runs each policy
that many times, alternating, and pools their requests (a shared machine's noise). ``--kv-blocks``
sizes each engine's KV cache (``--num-gpu-blocks-override``); the default holds a little more
than half of all the conversations at their longest: what prefix routing asks of each engine,
where power of two choices sends every conversation to both.

The default model is a small random-weight Llama built on the fly (as bench/prefix_cache.py).
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the test helpers: tiny checkpoint and server start-up

from bench.prefix_cache import TINY, RunResult, Sample, greedy_request  # noqa: E402
from switchboard.api.v1 import generation_service_pb2_grpc as pb_grpc  # noqa: E402
from tests.e2e.server import start_server  # noqa: E402
from tests.tiny_checkpoint import tiny_llama_dir  # noqa: E402

RPC_TIMEOUT_S = 600.0
POLICIES = ("prefix", "power-of-two")
WARMUP_REQUESTS = 4


def generate(
    stub: pb_grpc.GenerationServiceStub, prompt: list[int], max_tokens: int
) -> tuple[Sample, list[int]]:
    """One streamed request: its sample and the tokens it answered."""
    request = greedy_request(prompt, max_tokens)
    started = time.perf_counter()
    ttft = None
    answer: list[int] = []
    last = None
    for response in stub.Generate(request, timeout=RPC_TIMEOUT_S):
        for output in response.outputs:
            if output.token_ids and ttft is None:
                ttft = time.perf_counter() - started
            answer += output.token_ids
        last = response
    assert last is not None and ttft is not None, "no tokens came back"
    usage = last.usage
    sample = Sample(ttft, usage.completion_tokens, usage.prompt_tokens, usage.cached_prompt_tokens)
    return sample, answer


class Workload:
    """The same conversations for every server: a seed per conversation and turn."""

    def __init__(self, args: argparse.Namespace, vocab: int) -> None:
        self.args = args
        self.vocab = vocab
        self.system = self.tokens(random.Random(0), args.system_tokens)

    def tokens(self, rng: random.Random, n: int) -> list[int]:
        return [rng.randrange(3, self.vocab) for _ in range(n)]

    def conversation(self, target: str, index: int, samples: list[Sample]) -> None:
        args = self.args
        with grpc.insecure_channel(target) as channel:  # its own connection: any gateway
            stub = pb_grpc.GenerationServiceStub(channel)
            history = list(self.system)
            for turn in range(args.turns):
                history += self.tokens(random.Random(index * 1000 + turn + 1), args.user_tokens)
                sample, answer = generate(stub, history, args.max_tokens)
                samples.append(sample)
                history += answer


def run_workload(target: str, workload: Workload) -> RunResult:
    args = workload.args
    with grpc.insecure_channel(target) as channel:  # warm-up, not measured, not shared
        stub = pb_grpc.GenerationServiceStub(channel)
        warm = [workload.tokens(random.Random(-i - 1), 64) for i in range(WARMUP_REQUESTS)]
        with ThreadPoolExecutor(WARMUP_REQUESTS) as pool:
            list(pool.map(lambda p: generate(stub, p, 4), warm))
    samples: list[Sample] = []
    lock = threading.Lock()

    def one(index: int) -> None:
        mine: list[Sample] = []
        workload.conversation(target, index, mine)
        with lock:
            samples.extend(mine)

    started = time.perf_counter()
    with ThreadPoolExecutor(args.conversations) as pool:
        list(pool.map(one, range(args.conversations)))
    return RunResult(samples, time.perf_counter() - started)


def serve_and_run(model_dir: str, policy: str, workload: Workload, workdir: Path) -> RunResult:
    args = workload.args
    server_args = ["-dp", str(args.data_parallel_size), "--routing-policy", policy]
    server_args += ["--max-num-seqs", str(max(args.conversations, 1))]
    if args.kv_blocks:
        server_args += ["--num-gpu-blocks-override", str(args.kv_blocks)]
    server_args += args.server_arg
    logs = workdir / policy
    logs.mkdir(parents=True, exist_ok=True)
    server = start_server(model_dir, logs, *server_args, ready_timeout=600.0)
    result = None
    try:
        result = run_workload(server.target, workload)
    finally:
        if server.stop() != 0 or result is None:
            print(server.log()[-3000:], file=sys.stderr)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint directory (default: tiny)")
    parser.add_argument("-dp", "--data-parallel-size", type=int, default=2)
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--system-tokens", type=int, default=128)
    parser.add_argument("--user-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=1000, help="token ids drawn below this")
    parser.add_argument(
        "--kv-blocks", type=int, default=800, help="KV blocks per engine (0: sized by memory)"
    )
    parser.add_argument(
        "--repeat", type=int, default=2, help="runs per policy, alternated (the machine's noise)"
    )
    parser.add_argument(
        "--server-arg", action="append", default=[], help="extra `serve` argument (repeatable)"
    )
    args = parser.parse_args()
    longest = args.system_tokens + args.turns * (args.user_tokens + args.max_tokens)
    if args.model is None and longest > TINY["max_position_embeddings"]:
        parser.error(f"the last turn's prompt ({longest} tokens) exceeds the tiny model's 2048")

    model_dir = args.model or tiny_llama_dir(**TINY)
    workload = Workload(args, args.vocab)
    runs: dict[str, list[RunResult]] = {policy: [] for policy in POLICIES}
    with tempfile.TemporaryDirectory(prefix="bench-routing-") as tmp:
        for _ in range(args.repeat):
            for policy in POLICIES:
                runs[policy].append(serve_and_run(model_dir, policy, workload, Path(tmp)))
    # Every run's requests pooled: percentiles over all of them, tokens over the summed time.
    results = {
        policy: RunResult([s for r in rs for s in r.samples], sum(r.wall_s for r in rs))
        for policy, rs in runs.items()
    }

    print(
        f"model {args.model or 'tiny random Llama ' + str(TINY)}, -dp {args.data_parallel_size}, "
        f"{args.kv_blocks or 'memory-sized'} KV blocks per engine, {args.repeat} run(s) per "
        "policy, alternated\n"
        f"{args.conversations} conversations at once x {args.turns} turns: a {args.system_tokens}"
        f"-token system prompt shared by all, {args.user_tokens} user tokens and "
        f"{args.max_tokens} output tokens per turn (last prompt ~{longest} tokens), greedy"
    )
    header = (
        f"{'routing':<16} | {'prefix hit rate':>15} | {'TTFT p50 ms':>11} | "
        f"{'TTFT p90 ms':>11} | {'output tok/s':>12}"
    )
    print(header)
    print("-" * len(header))
    for name, result in results.items():
        print(
            f"{name:<16} | {result.cached_share:>15.1%} | {result.ttft_ms(0.5):>11.1f} | "
            f"{result.ttft_ms(0.9):>11.1f} | {result.tokens_per_s:>12.1f}"
        )
    on, off = results["prefix"], results["power-of-two"]
    print(
        f"{'prefix / p-of-2':<16} | {on.cached_share / off.cached_share:>15.2f} | "
        f"{on.ttft_ms(0.5) / off.ttft_ms(0.5):>11.2f} | "
        f"{on.ttft_ms(0.9) / off.ttft_ms(0.9):>11.2f} | "
        f"{on.tokens_per_s / off.tokens_per_s:>12.2f}"
    )


if __name__ == "__main__":
    main()
