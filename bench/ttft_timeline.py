"""Where switchboard's time to first token goes under a closed loop: each request's TTFT cut at
the points both ends know, and server variants compared in alternated rounds.

    python bench/ttft_timeline.py --model DIR                        # one server, c = 32
    python bench/ttft_timeline.py --model DIR --dtype bfloat16 \\
        --variant base= --variant big="--max-num-batched-tokens 2048" --rounds 4
    python bench/ttft_timeline.py --model DIR --channels both       # the client's connections
    git worktree add /tmp/base BASE && python bench/ttft_timeline.py --model DIR \\
        --variant base= --source base=/tmp/base --variant new=     # a code change

Every variant's server is started once (`switchboard serve`, the flags bench/vs_vllm.py gives it,
plus the variant's), then the rounds alternate between them (A, B, A, B ...: the machine may be
shared, so each variant sees the same spells of load); a round is one closed loop of
--concurrency clients over --requests requests (32-token prompts, 128 output tokens, greedy,
ignore_eos, as bench/vs_vllm.py), after one warm-up loop per server. The clients share one gRPC
channel (one HTTP/2 connection, as bench/vs_vllm.py's), or each has its own (``--channels
per-client``, as the OpenAI clients' connections); ``--channels both`` alternates the two.

Per request, from the client's wall clock and the RequestMetrics of the last message (all
stamps on one machine, one wall clock):

    send     -> arrival    the client's send to the gateway's servicer (client and gRPC in)
    arrival  -> queued     checks, the ADD to the engine, its input thread and busy loop
    queued   -> scheduled  waiting in the engine's queue for a step with room
    scheduled-> token      the step(s) computing the prompt, until the engine stamps its output
    token    -> client     the output thread, the gateway's stream, gRPC out, the client

The report gives each phase's median (and the TTFT's p50 / p90) per variant and round, then the
median over rounds, output tok/s, and CPU microseconds per output token (from /proc): the
gateway's, and all the server's processes' with this client's (on a shared machine steadier
than the rates). ``--source LABEL=DIR`` runs a variant's server from another checkout, for code
changes. Run with the project's venv (.venv/bin/python).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import shlex
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc
from server_procs import (
    TreeSampler,
    free_port,
    start,
    stop_all,
    switchboard_command,
    wait_ready,
)
from serving_clients import HOST, make_prompts, pct

from switchboard.api.v1 import generation_service_pb2 as pb
from switchboard.api.v1 import generation_service_pb2_grpc as pb_grpc

PHASES = (
    "send->arrival",
    "arrival->queued",
    "queued->scheduled",
    "scheduled->token",
    "token->client",
)


@dataclasses.dataclass
class Timeline:
    sent: float  # the client's wall clock
    ttft_s: float
    phases: tuple[float, ...]  # as PHASES, seconds
    tokens: int


async def one_request(
    stub: pb_grpc.GenerationServiceStub, prompt: list[int], max_tokens: int
) -> Timeline:
    request = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=prompt),
        sampling=pb.SamplingParams(temperature=0.0),
        stopping=pb.StoppingCriteria(max_tokens=max_tokens, ignore_eos=True),
        output=pb.OutputOptions(return_token_ids=True),
    )
    sent = time.time()
    first = None
    tokens = 0
    last = None
    async for response in stub.Generate(request):
        if n := sum(len(out.token_ids) for out in response.outputs):
            if first is None:
                first = time.time()
            tokens += n
        last = response
    assert first is not None and last is not None, "a request gave no token"
    m = last.metrics
    arrival = m.arrival_time.ToNanoseconds() / 1e9
    ttft = m.time_to_first_token.ToNanoseconds() / 1e9
    queue = m.queue_time.ToNanoseconds() / 1e9
    prefill = m.prefill_time.ToNanoseconds() / 1e9
    phases = (arrival - sent, ttft - queue - prefill, queue, prefill, first - (arrival + ttft))
    return Timeline(sent, first - sent, phases, tokens)


def own_channel(target: str) -> grpc.aio.Channel:
    """A channel with a connection of its own: channels with the same target and options
    otherwise share one connection from gRPC's process-wide subchannel pool."""
    return grpc.aio.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])


async def closed_loop(
    port: int,
    prompts: list[list[int]],
    concurrency: int,
    max_tokens: int,
    channels: str = "shared",
) -> tuple[list[Timeline], float]:
    """``channels``: "shared", one gRPC channel for every client; "per-client", one each."""
    todo = iter(prompts)
    out: list[Timeline] = []
    target = f"{HOST}:{port}"
    async with grpc.aio.insecure_channel(target) as shared:

        async def client() -> None:
            channel = own_channel(target) if channels == "per-client" else shared
            stub = pb_grpc.GenerationServiceStub(channel)
            try:
                for prompt in todo:
                    out.append(await one_request(stub, prompt, max_tokens))
            finally:
                if channel is not shared:
                    await channel.close()

        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        return out, time.perf_counter() - t0


def summary(
    timelines: list[Timeline], wall: float, cpu: dict[str, float], client_cpu: float
) -> dict[str, float]:
    """``cpu``: the server's processes' CPU seconds in the round by name, ``client_cpu`` this
    process's; as CPU microseconds per output token, the gateway's and everyone's."""
    ttfts = [t.ttft_s * 1e3 for t in timelines]
    row = {"ttft_p50": pct(ttfts, 50) or 0.0, "ttft_p90": pct(ttfts, 90) or 0.0}
    for i, name in enumerate(PHASES):
        row[name] = statistics.median(t.phases[i] * 1e3 for t in timelines)
    tokens = sum(t.tokens for t in timelines)
    row["tok_s"] = tokens / wall
    gateway = sum(v for name, v in cpu.items() if name.startswith("Gateway"))
    row["gw_us"] = gateway / tokens * 1e6
    row["all_us"] = (sum(cpu.values()) + client_cpu) / tokens * 1e6
    return row


def _cpu(sampler: TreeSampler) -> tuple[dict[str, float], float]:
    """CPU seconds since ``sampler`` started: per server process name, and this process's."""
    cpu, _, client = sampler.finish()
    span = (time.perf_counter() - sampler.wall0) / 100  # x CPU % = CPU seconds
    return {name: pct * span for name, pct in cpu.items()}, client * span


def _print_row(label: str, row: dict[str, float]) -> None:
    cells = [f"{row['ttft_p50']:7.1f}", f"{row['ttft_p90']:7.1f}"]
    cells += [f"{row[name]:8.1f}" for name in PHASES] + [f"{row['tok_s']:8.0f}"]
    cells += [f"{row['gw_us']:6.0f}", f"{row['all_us']:6.0f}"]
    print(f"{label:<24}" + " ".join(cells), flush=True)


def _header() -> None:
    names = [
        "p50",
        "p90",
        *(name.split("->")[1][:8] for name in PHASES),
        "tok/s",
        "gw us",
        "us/tok",
    ]
    widths = [7, 7, *(8 for _ in PHASES), 8, 6, 6]
    cells = " ".join(f"{n:>{w}}" for n, w in zip(names, widths, strict=True))
    print(f"{'ms (phase medians)':<24}" + cells)


async def run(args: argparse.Namespace) -> int:
    log_dir = Path(tempfile.mkdtemp(prefix="ttft-timeline-"))
    servers = {}
    for label, extra in args.variant:
        port = free_port()
        cmd = [
            *switchboard_command(), "serve", "--model", args.model, "--host", HOST,
            "--port", str(port), "--http-port", "0", "--dtype", args.dtype,
            "--max-model-len", "2048",
            "--kv-cache-memory-bytes", str(2 * 2**30), "--seed", "0", *shlex.split(extra),
        ]  # fmt: skip
        log = log_dir / f"{label}.log"
        print(f"{label}: {shlex.join(cmd)}  (log {log})", file=sys.stderr, flush=True)
        env = dict(os.environ)
        if label in args.source:  # that checkout's package first on the server's path
            services = str(Path(args.source[label]).expanduser() / "services")
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [services, env.get("PYTHONPATH")]))
        server = start("switchboard", cmd, env, log, port)
        await wait_ready(server)
        warm = make_prompts(2, args.input_len, args.vocab, f"warm-up:{label}")
        await closed_loop(port, warm, 2, 8)
        server.track()
        servers[label] = server
    modes = ["shared", "per-client"] if args.channels == "both" else [args.channels]
    # (row label, server label, client channels): each server once per client mode
    runs = [
        (label if len(modes) == 1 else f"{label}/{mode}", label, mode)
        for label in servers
        for mode in modes
    ]
    rows: dict[str, list[dict[str, float]]] = {run[0]: [] for run in runs}
    _header()
    dumped: list[dict[str, object]] = []
    for r in range(args.rounds):
        for label, server, mode in runs if r % 2 == 0 else reversed(runs):
            prompts = make_prompts(args.requests, args.input_len, args.vocab, f"{r}:{label}")
            sampler = TreeSampler(servers[server].proc.pid, "switchboard")
            timelines, wall = await closed_loop(
                servers[server].port, prompts, args.concurrency, args.output_len, mode
            )
            rows[label].append(summary(timelines, wall, *_cpu(sampler)))
            if args.dump:
                dumped.append({"variant": label, "round": r, "requests": [
                    dataclasses.asdict(t) for t in sorted(timelines, key=lambda t: t.sent)
                ]})  # fmt: skip
            _print_row(f"round {r} {label}", rows[label][-1])
        print(f"  (load average {os.getloadavg()[0]:.1f})", flush=True)
    if args.dump:
        args.dump.write_text(json.dumps(dumped))
    print("median over rounds:")
    for label, label_rows in rows.items():
        _print_row(
            label, {k: statistics.median(row[k] for row in label_rows) for k in label_rows[0]}
        )
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", required=True, help="checkpoint directory")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="LABEL=FLAGS",
        help="a server with these extra `switchboard serve` flags (repeat; default: one, base)",
    )
    p.add_argument(
        "--source",
        action="append",
        default=[],
        metavar="LABEL=DIR",
        help="run that variant's server from the checkout DIR (e.g. a `git worktree` of the "
        "base commit), this one's otherwise: code changes in alternated rounds",
    )
    p.add_argument(
        "--channels",
        choices=["shared", "per-client", "both"],
        default="shared",
        help="the clients' gRPC channels: one for all, one each, or both in alternated rounds",
    )
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--requests", type=int, default=96, help="per round")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--dump", type=Path, default=None, help="every request's timeline, JSON")
    args = p.parse_args(argv)
    args.variant = [spec.partition("=")[::2] for spec in args.variant or ["base="]]
    args.source = dict(spec.partition("=")[::2] for spec in args.source)
    config = json.loads((Path(args.model).expanduser() / "config.json").read_text())
    args.vocab = int(config["vocab_size"])
    args.model = str(Path(args.model).expanduser())
    return args


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through the finally that stops the servers


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        return asyncio.run(run(args))
    finally:
        stop_all()


if __name__ == "__main__":
    sys.exit(main())
