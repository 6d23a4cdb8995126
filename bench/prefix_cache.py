"""Prefix caching on vs off through the gRPC API: requests that share a long system prompt.

    python bench/prefix_cache.py [--model DIR] [--requests 24] [--concurrency 4]
                                 [--system-tokens 1024] [--max-tokens 16]

Starts two real servers (`switchboard serve`) one after the other, the same in every way but
``--no-enable-prefix-caching`` on the second, and sends each the same workload: every request
is the same system prompt followed by its own short question, greedy, ``--max-tokens`` output
tokens, ``--concurrency`` requests in flight. A first request (not measured) warms each server
up (and, with caching on, computes the shared prefix once, as the first user of a deployment
would). Prompts are sent as token ids so the shared prefix is exactly the same tokens.

Printed: time to first token measured by the client (p50, p90), output tokens per second and
requests per second over the whole run, the share of prompt tokens the server reports as
served from the prefix cache (``Usage.cached_prompt_tokens``), and the ratio on/off.

The default model is a small random-weight Llama built on the fly (the test suite's tiny
checkpoint, made a little larger so that a prefill costs something and with 2,048 positions);
``--model DIR`` benchmarks a real checkpoint instead.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the test helpers: tiny checkpoint and server start-up

from switchboard.api.v1 import generation_service_pb2 as pb  # noqa: E402
from switchboard.api.v1 import generation_service_pb2_grpc as pb_grpc  # noqa: E402
from tests.e2e.server import start_server  # noqa: E402
from tests.tiny_checkpoint import tiny_llama_dir  # noqa: E402

TINY = dict(  # ~7M parameters: tiny, but a 1,000-token prefill is real work on a CPU
    hidden_size=256,
    num_layers=4,
    num_heads=8,
    num_kv_heads=4,
    intermediate_size=768,
    max_position_embeddings=2048,
)
TINY_KV_BLOCKS = "1024"  # 16,384 tokens: the concurrent requests plus the cached prefix
RPC_TIMEOUT_S = 600.0
SYSTEM_TEXT = (
    "You are the support assistant of a small software company. Answer in plain words, cite "
    "the relevant section of the manual, never invent features, and say so when you do not "
    "know. The manual covers installation, configuration files, command line flags, logging, "
    "upgrades between versions, backups and restoring them, and the licence terms. "
)
QUESTIONS = [
    "How do I install it on a laptop?",
    "Where is the configuration file kept?",
    "Which flag turns on verbose logging?",
    "Can I upgrade without stopping the service?",
    "How often should backups run?",
    "How do I restore yesterday's backup?",
    "What does the licence allow?",
    "Why does the service not start after an upgrade?",
]


@dataclass
class Sample:
    ttft_s: float
    completion_tokens: int
    prompt_tokens: int
    cached_prompt_tokens: int


@dataclass
class RunResult:
    samples: list[Sample]
    wall_s: float

    def ttft_ms(self, q: float) -> float:
        values = sorted(s.ttft_s for s in self.samples)
        return 1e3 * statistics.quantiles(values, n=100, method="inclusive")[int(q * 100) - 1]

    @property
    def tokens_per_s(self) -> float:
        return sum(s.completion_tokens for s in self.samples) / self.wall_s

    @property
    def requests_per_s(self) -> float:
        return len(self.samples) / self.wall_s

    @property
    def cached_share(self) -> float:
        prompt = sum(s.prompt_tokens for s in self.samples)
        return sum(s.cached_prompt_tokens for s in self.samples) / prompt


def tokenize(stub: pb_grpc.GenerationServiceStub, text: str, special: bool) -> list[int]:
    request = pb.TokenizeRequest(text=text, add_special_tokens=special)
    return list(stub.Tokenize(request, timeout=RPC_TIMEOUT_S).token_ids)


def build_prompts(stub: pb_grpc.GenerationServiceStub, args: argparse.Namespace) -> list[list[int]]:
    """``--requests + 1`` prompts (the first is the warm-up): system prompt + own question."""
    max_model_len = stub.Tokenize(pb.TokenizeRequest(text=""), timeout=RPC_TIMEOUT_S).max_model_len
    questions = [tokenize(stub, "\nQuestion: " + q, special=False) for q in QUESTIONS]
    room = max_model_len - args.max_tokens - max(len(q) for q in questions) - 1
    system_tokens = min(args.system_tokens, room)
    system = tokenize(stub, SYSTEM_TEXT, special=True)
    paragraph = tokenize(stub, SYSTEM_TEXT, special=False)
    while len(system) < system_tokens:
        system += paragraph
    system = system[:system_tokens]
    prompts = []
    for i in range(args.requests + 1):
        # A request number keeps every prompt distinct even when the questions repeat.
        number = tokenize(stub, f" (ticket {i})", special=False)
        prompts.append(system + questions[i % len(questions)] + number)
    return prompts


def greedy_request(prompt: list[int], max_tokens: int) -> pb.GenerateRequest:
    """Token ids in, exactly ``max_tokens`` greedy tokens streamed back as ids."""
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt))
    request.sampling.temperature = 0.0
    request.stopping.max_tokens = max_tokens
    request.stopping.ignore_eos = True
    request.output.kind = pb.OUTPUT_KIND_DELTA
    request.output.return_token_ids = True
    return request


def one_request(stub: pb_grpc.GenerationServiceStub, prompt: list[int], max_tokens: int) -> Sample:
    request = greedy_request(prompt, max_tokens)
    started = time.perf_counter()
    ttft = None
    last = None
    for response in stub.Generate(request, timeout=RPC_TIMEOUT_S):
        if ttft is None and any(o.token_ids for o in response.outputs):
            ttft = time.perf_counter() - started
        last = response
    assert last is not None and ttft is not None, "no tokens came back"
    usage = last.usage
    return Sample(ttft, usage.completion_tokens, usage.prompt_tokens, usage.cached_prompt_tokens)


def run_workload(target: str, args: argparse.Namespace) -> tuple[RunResult, int]:
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        prompts = build_prompts(stub, args)
        one_request(stub, prompts[0], args.max_tokens)  # warm-up, not measured
        started = time.perf_counter()
        with ThreadPoolExecutor(args.concurrency) as pool:
            samples = list(pool.map(lambda p: one_request(stub, p, args.max_tokens), prompts[1:]))
        return RunResult(samples, time.perf_counter() - started), len(prompts[1])


def serve_and_run(
    model_dir: str, caching: bool, args: argparse.Namespace, workdir: Path
) -> tuple[RunResult, int]:
    server_args = ["--enable-prefix-caching" if caching else "--no-enable-prefix-caching"]
    server_args += ["--max-num-seqs", str(max(args.concurrency, 1))]
    if args.model is None:
        server_args += ["--num-gpu-blocks-override", TINY_KV_BLOCKS]
    server_args += args.server_arg
    logs = workdir / ("on" if caching else "off")
    logs.mkdir(parents=True, exist_ok=True)
    server = start_server(model_dir, logs, *server_args)
    try:
        return run_workload(server.target, args)
    finally:
        code = server.stop()
        if code != 0:
            print(server.log()[-3000:], file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint directory (default: tiny)")
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--system-tokens", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument(
        "--server-arg", action="append", default=[], help="extra `serve` argument (repeatable)"
    )
    args = parser.parse_args()
    if args.requests < 2:
        parser.error("--requests must be at least 2")

    model_dir = args.model or tiny_llama_dir(**TINY)
    with tempfile.TemporaryDirectory(prefix="bench-prefix-") as tmp:
        on, prompt_len = serve_and_run(model_dir, True, args, Path(tmp))
        off, _ = serve_and_run(model_dir, False, args, Path(tmp))

    print(
        f"model {args.model or 'tiny random Llama ' + str(TINY)}\n"
        f"{args.requests} requests, {args.concurrency} in flight, prompts of ~{prompt_len} "
        f"tokens sharing a system prompt, {args.max_tokens} output tokens each, greedy"
    )
    header = (
        f"{'prefix caching':<14} | {'TTFT p50 ms':>11} | {'TTFT p90 ms':>11} | "
        f"{'output tok/s':>12} | {'req/s':>6} | {'cached prompt':>13}"
    )
    print(header)
    print("-" * len(header))
    for name, result in (("on", on), ("off", off)):
        print(
            f"{name:<14} | {result.ttft_ms(0.5):>11.1f} | {result.ttft_ms(0.9):>11.1f} | "
            f"{result.tokens_per_s:>12.1f} | {result.requests_per_s:>6.2f} | "
            f"{result.cached_share:>12.0%}"
        )
    print(
        f"{'on / off':<14} | {on.ttft_ms(0.5) / off.ttft_ms(0.5):>11.2f} | "
        f"{on.ttft_ms(0.9) / off.ttft_ms(0.9):>11.2f} | "
        f"{on.tokens_per_s / off.tokens_per_s:>12.2f} | "
        f"{on.requests_per_s / off.requests_per_s:>6.2f} |"
    )


if __name__ == "__main__":
    main()
