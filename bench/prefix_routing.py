"""Prefix-aware routing vs power of two choices across DP engines, on multi-turn conversations.

    python bench/prefix_routing.py [--workload capacity|small] [--repeat 2] [--model DIR]
        [-dp 2] [--conversations N] [--turns N] [--rounds N] [--system-tokens N]
        [--document-tokens N|LOW-HIGH] [--user-tokens N|LOW-HIGH] [--max-tokens N|LOW-HIGH]
        [--think-ms MS] [--[no-]stagger] [--kv-share F | --kv-blocks N] [--server-arg ARG ...]
        [--variant NAME=ARGS ...]

Starts one real server (`switchboard serve -dp N`) per policy and run, the same in every way
but ``--routing-policy`` (prefix, then power-of-two, alternated ``--repeat`` times), and runs
the same workload on each: ``--conversations`` conversation slots at once, each on its own
gRPC channel (so the server's gateways share them), each sending ``--rounds`` turns of
conversations ``--turns`` turns long, one after the other. Every prompt is a system prompt
shared by all conversations, then the conversation so far (its first message, each later
user message and the tokens the server answered), then a new user message; a conversation
sends its next turn when the last one has ended and ``--think-ms`` (exponentially distributed,
0: none) have passed. Prompts are token ids, greedy, the answer's length drawn per turn (the
same in every run). A few unrelated requests warm each server up first.

The workloads (each flag overrides its preset):

* ``capacity`` (default): what a production router is for — many conversations in flight and
  more context than one engine's KV cache holds. 32 slots, conversations of 8 turns, 16 turns a
  slot; a 64-token system prompt, a first message of 128-256 tokens, then 48-128 user tokens
  and 48-80 answer tokens a turn, 1 s think time. The slots start staggered (slot j mid-way
  through a conversation at turn j mod 8, its history cold on every engine), so the context in
  flight stays about the same all run. Each engine's KV cache (``--num-gpu-blocks-override``)
  is ``--kv-share`` (0.6) of that context (the conversations' blocks averaged over their
  turns): less than one engine would need, more than half. Power of two choices sends each
  conversation to both engines over its turns, so each engine caches all of them and evicts
  what the next turn needs; prefix routing keeps a conversation on one engine, whose cache then
  holds its half.
* ``small``: the earlier workload: 16 conversations x 6 turns, all starting together, a
  128-token system prompt, 128 user and 64 output tokens a turn, no think time, 800 KV blocks
  per engine (they hold everything): routing can only save the turns power of two choices
  sends to the other engine.

Printed: the KV sizing, the machine's load average before and after, then per policy the share
of prompt tokens served from the prefix cache (``Usage.cached_prompt_tokens``), client-side
time to first token (p50, p90), output tokens per second over the whole run, and the ratios
prefix / power-of-two. Every run's requests are pooled per policy; each run's line goes to
stderr as it ends. Then where the hits went (``bench/routing_report.py``): the workload's
ideal hit rate (every turn serving its whole previous turn from cache) and each turn's
shortfall put down to its cause — sent to another engine than its previous turn, evicted on
its own engine, a first turn — from the engine each response names.

``--variant NAME=ARGS`` (repeatable) compares other servers with power of two choices instead
of the default prefix routing, all alternated: ARGS are ``serve`` arguments, ``KEY=VALUE``
words environment variables (``--variant "cap32=--routing-policy prefix
--prefix-routing-max-imbalance 32"``).

The default model is a small random-weight Llama built on the fly (as bench/prefix_cache.py).
The conversations themselves are drawn in ``bench/routing_workload.py``.
"""

from __future__ import annotations

import argparse
import os
import random
import shlex
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the test helpers: tiny checkpoint and server start-up

from bench.prefix_cache import TINY, RunResult  # noqa: E402
from bench.routing_report import Breakdown, Turn, print_breakdown, print_table  # noqa: E402
from bench.routing_workload import PRESETS, Workload, generate, sizing  # noqa: E402
from switchboard.api.v1 import generation_service_pb2_grpc as pb_grpc  # noqa: E402
from tests.e2e.server import start_server  # noqa: E402
from tests.tiny_checkpoint import tiny_llama_dir  # noqa: E402

WARMUP_REQUESTS = 4


def run_workload(target: str, workload: Workload) -> tuple[RunResult, list[Turn]]:
    args = workload.args
    with grpc.insecure_channel(target) as channel:  # warm-up, not measured, not shared
        stub = pb_grpc.GenerationServiceStub(channel)
        warm = [workload.tokens(random.Random(-i - 1), 64) for i in range(WARMUP_REQUESTS)]
        with ThreadPoolExecutor(WARMUP_REQUESTS) as pool:
            list(pool.map(lambda p: generate(stub, p, 4), warm))
    turns: list[Turn] = []
    lock = threading.Lock()

    def one(slot: int) -> None:
        mine: list[Turn] = []
        workload.run_slot(target, slot, mine)
        with lock:
            turns.extend(mine)

    started = time.perf_counter()
    with ThreadPoolExecutor(args.conversations) as pool:
        list(pool.map(one, range(args.conversations)))
    wall_s = time.perf_counter() - started
    return RunResult([t.sample for t in turns], wall_s), turns


def serve_and_run(
    model_dir: str, variant: Variant, workload: Workload, kv_blocks: int, workdir: Path
) -> tuple[RunResult, list[Turn]]:
    args = workload.args
    server_args = ["-dp", str(args.data_parallel_size), *variant.server_args]
    server_args += ["--max-num-seqs", str(max(args.conversations, 1))]
    server_args += ["--num-gpu-blocks-override", str(kv_blocks), *args.server_arg]
    logs = workdir / variant.name
    logs.mkdir(parents=True, exist_ok=True)
    saved = dict(os.environ)
    os.environ.update(dict(variant.env))
    try:
        server = start_server(model_dir, logs, *server_args, ready_timeout=600.0)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    result = None
    try:
        result = run_workload(server.target, workload)
    finally:
        if server.stop() != 0 or result is None:
            print(server.log()[-3000:], file=sys.stderr)
    return result


@dataclass(frozen=True)
class Variant:
    """A server to compare: its name, ``serve`` arguments and environment."""

    name: str
    server_args: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()


def variant(text: str) -> Variant:
    """``NAME=ARGS``: ARGS are ``serve`` arguments, ``KEY=VALUE`` words environment variables."""
    name, _, rest = text.partition("=")
    words = shlex.split(rest)
    env = tuple((k, v) for k, _, v in (w.partition("=") for w in words if _is_env(w)))
    return Variant(name, tuple(w for w in words if not _is_env(w)), env)


def _is_env(word: str) -> bool:
    return "=" in word and not word.startswith("-")


BASELINE = Variant("power-of-two", ("--routing-policy", "power-of-two"))
DEFAULT_VARIANTS = (Variant("prefix", ("--routing-policy", "prefix")), BASELINE)


def span(text: str) -> tuple[int, int]:
    """``N`` or ``LOW-HIGH``."""
    low, _, high = text.partition("-")
    return int(low), int(high or low)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=sorted(PRESETS), default="capacity")
    parser.add_argument("--model", default=None, help="checkpoint directory (default: tiny)")
    parser.add_argument("-dp", "--data-parallel-size", type=int, default=2)
    parser.add_argument("--conversations", type=int, help="at once (preset)")
    parser.add_argument("--turns", type=int, help="per conversation (preset)")
    parser.add_argument("--rounds", type=int, help="turns each slot sends a run (preset)")
    parser.add_argument("--system-tokens", type=int, help="shared system prompt (preset)")
    parser.add_argument("--document-tokens", type=span, help="first user message (preset)")
    parser.add_argument("--user-tokens", type=span, help="later ones: N or LOW-HIGH (preset)")
    parser.add_argument(
        "--stagger",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="slots start mid-conversation (preset)",
    )
    parser.add_argument("--max-tokens", type=span, help="answer per turn: N or LOW-HIGH (preset)")
    parser.add_argument("--think-ms", type=float, help="mean think time per turn (preset)")
    parser.add_argument("--vocab", type=int, default=1000, help="token ids drawn below this")
    parser.add_argument(
        "--kv-share",
        type=float,
        default=0.6,
        help="each engine's KV blocks as a share of all conversations' longest contexts",
    )
    parser.add_argument("--kv-blocks", type=int, help="KV blocks per engine (overrides share)")
    parser.add_argument(
        "--repeat", type=int, default=2, help="runs per policy, alternated (the machine's noise)"
    )
    parser.add_argument(
        "--server-arg", action="append", default=[], help="extra `serve` argument (repeatable)"
    )
    parser.add_argument(
        "--variant",
        type=variant,
        action="append",
        help="a server to compare with power of two choices instead of the default prefix "
        "routing: NAME=ARGS, ARGS its `serve` arguments and KEY=VALUE environment variables "
        "(repeatable; all alternated)",
    )
    args = parser.parse_args()
    args.variants = [*(args.variant or DEFAULT_VARIANTS[:1]), BASELINE]
    preset = PRESETS[args.workload]
    fields = ("conversations", "turns", "rounds", "system_tokens", "document_tokens")
    for name in (*fields, "user_tokens", "max_tokens", "stagger", "think_ms"):
        if getattr(args, name) is None:
            setattr(args, name, getattr(preset, name))
    if args.kv_blocks is None:
        args.kv_blocks = preset.kv_blocks
    longest = args.system_tokens + args.document_tokens[1] - args.user_tokens[1]
    longest += args.turns * (args.user_tokens[1] + args.max_tokens[1])
    if args.model is None and longest > TINY["max_position_embeddings"]:
        parser.error(f"the last turn's prompt (up to {longest} tokens) exceeds the tiny model's")
    return args


def main() -> None:
    args = parse_args()
    model_dir = args.model or tiny_llama_dir(**TINY)
    workload = Workload(args)
    size = sizing(workload)
    load_before = os.getloadavg()
    runs: dict[str, list[RunResult]] = {v.name: [] for v in args.variants}
    turns: dict[str, list[Turn]] = {v.name: [] for v in args.variants}
    with tempfile.TemporaryDirectory(prefix="bench-routing-") as tmp:
        for _ in range(args.repeat):
            for variant in args.variants:
                result, run_turns = serve_and_run(
                    model_dir, variant, workload, size.kv_blocks, Path(tmp)
                )
                runs[variant.name].append(result)
                turns[variant.name] += run_turns
                print(
                    f"  {variant.name}: hit rate {result.cached_share:.1%}, TTFT p50 "
                    f"{result.ttft_ms(0.5):.0f} ms, {result.tokens_per_s:.1f} tok/s, "
                    f"load {os.getloadavg()[0]:.1f}",
                    file=sys.stderr,
                )
    load_after = os.getloadavg()
    # Every run's requests pooled: percentiles over all of them, tokens over the summed time.
    results = {
        name: RunResult([s for r in rs for s in r.samples], sum(r.wall_s for r in rs))
        for name, rs in runs.items()
    }
    document, user, answer = args.document_tokens, args.user_tokens, args.max_tokens
    start = "staggered" if args.stagger else "all at turn 1"
    print(
        f"model {args.model or 'tiny random Llama ' + str(TINY)}, -dp {args.data_parallel_size}, "
        f"{args.repeat} run(s) per variant, alternated; load average "
        f"{load_before[0]:.1f} before, {load_after[0]:.1f} after\n"
        f"workload {args.workload}: {args.conversations} conversations at once ({start}), "
        f"{args.turns} turns each, {args.rounds} turns per slot; a {args.system_tokens}-token "
        f"system prompt shared by all, a first message of {document[0]}-{document[1]} tokens, "
        f"then {user[0]}-{user[1]} user tokens a turn, {answer[0]}-{answer[1]} output tokens a "
        f"turn, think time {args.think_ms:g} ms, greedy\n{size.describe(args.data_parallel_size)}"
    )
    for v in args.variants:
        print(f"  {v.name}: serve {' '.join(v.server_args)} {' '.join('='.join(e) for e in v.env)}")
    print_table(results, BASELINE.name)
    print()
    print_breakdown({name: Breakdown(ts) for name, ts in turns.items()})


if __name__ == "__main__":
    main()
