"""One user's stream (c = 1) on server variants in alternated rounds: inter-token latency and
each process's CPU per token.

    .venv/bin/python bench/one_user.py                                  # this tree, 6 rounds
    .venv/bin/python bench/one_user.py --rev base=HEAD~1 --variant new= --rounds 8
    .venv/bin/python bench/one_user.py --variant a= --variant b="SWITCHBOARD_WORK_POOL=openmp"

Every variant's server is started once (`switchboard serve` on --model, default the kit's
``~/.cache/vllm-anchor/smollm2-q4_1.gguf``, with bench/vs_vllm.py's flags), then the rounds
alternate between them (A, B, B, A, A, B ...: on a machine others share, the load drifts, and
alternating keeps every variant under the same drift); only one server computes at a time. A
round is --requests requests of --output-len tokens one after the other (32-token random
prompts, greedy, ignore_eos: bench/vs_vllm.py's c = 1 workload).

A variant is LABEL=ENV: environment assignments (``K=V K2=V2``) for its server; ``--rev
LABEL=REV`` serves git revision REV of this repository instead (its services/ under a
temporary folder, first on PYTHONPATH; its kernels build into a cache entry of their own).
--llamacpp-venv adds llama.cpp's server on the same GGUF file as one more variant.

Printed per round and variant: ITL p50 and p90 (ms, the gaps between streamed tokens), output
tok/s, and CPU ms per output token of each process of the server tree and of this client (utime
+ stime from /proc); then per variant the median of each over the rounds, and the load average.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import llamacpp_side
from server_procs import (
    TreeSampler,
    free_port,
    revision_tree,
    start,
    stop_all,
    switchboard_command,
    wait_ready,
    with_services,
)
from serving_clients import OpenAIClient, SbClient, closed_loop, make_prompts, pct

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = "~/.cache/vllm-anchor/smollm2-q4_1.gguf"
VOCAB = 49152  # SmolLM2's; prompts are random ids below it
REQUEST_TIMEOUT_S = 300.0


def server_plan(
    label: str, env_spec: str, services: Path | None, args: argparse.Namespace, port: int
) -> tuple[str, list[str], dict[str, str]]:
    env = dict(os.environ)
    for assignment in shlex.split(env_spec):
        key, _, value = assignment.partition("=")
        env[key] = value
    env = with_services(env, services)
    cmd = [
        *switchboard_command(), "serve", "--model", args.model, "--host", "127.0.0.1",
        "--port", str(port), "--http-port", "0", "--max-model-len", "2048",
        "--kv-cache-memory-bytes", str(2 * 2**30), "--seed", "0", *shlex.split(args.sb_args),
    ]  # fmt: skip
    return "switchboard", cmd, env


async def run(args: argparse.Namespace) -> int:
    log_dir = Path(tempfile.mkdtemp(prefix="one-user-"))
    variants: list[tuple[str, str, Path | None]] = [
        (label, env, None) for label, env in args.variant
    ]
    for label, rev in args.rev:
        variants.append((label, "", revision_tree(ROOT, rev, log_dir)))
    if not variants:
        variants = [("this", "", None)]
    servers = {}
    clients = {}
    for label, env_spec, services in variants:
        port = free_port()
        kind, cmd, env = server_plan(label, env_spec, services, args, port)
        log = log_dir / f"{label}.log"
        print(f"{label}: {env_spec} {shlex.join(cmd)}  (log {log})", file=sys.stderr, flush=True)
        servers[label] = start(kind, cmd, env, log, port)
        await wait_ready(servers[label])
        clients[label] = SbClient(port, args.output_len)
    if args.llamacpp_venv:
        port = free_port()
        slot = llamacpp_side.slot_tokens(args.input_len + args.output_len)
        cmd = llamacpp_side.command(args.llamacpp_venv, args.model, port, 1, slot)
        log = log_dir / "llamacpp.log"
        servers["llama.cpp"] = start("llamacpp", cmd, llamacpp_side.environment(), log, port)
        await wait_ready(servers["llama.cpp"])
        clients["llama.cpp"] = OpenAIClient(port, "model", args.output_len, reconnect=True)
    for label, client in clients.items():  # warm-up
        await closed_loop(client, make_prompts(2, args.input_len, VOCAB, f"warm:{label}"), 1, 600)
    rows: dict[str, list[dict[str, float]]] = {label: [] for label in clients}
    print(f"{'':<22}{'ITL p50':>8}{'p90':>7}{'tok/s':>8}   CPU ms per token")
    for r in range(args.rounds):
        order = list(clients) if r % 2 == 0 else list(reversed(clients))
        for label in order:
            server = servers[label]
            sampler = TreeSampler(server.proc.pid, server.kind)
            perf = start_perf(sampler) if args.perf else None
            prompts = make_prompts(args.requests, args.input_len, VOCAB, f"{r}:{label}")
            results, wall = await closed_loop(
                clients[label], prompts, args.concurrency, REQUEST_TIMEOUT_S
            )
            cpu, _, client_cpu = sampler.finish()
            counts = finish_perf(perf) if perf is not None else {}
            errors = [res.error for res in results if res.error]
            if errors:
                raise RuntimeError(f"{label}: {errors[0]}")
            itl = [x * 1e3 for res in results for x in res.itls_s]
            tokens = sum(res.tokens for res in results)
            row = {
                "itl_p50": pct(itl, 50) or 0.0,
                "itl_p90": pct(itl, 90) or 0.0,
                "tok_s": tokens / wall,
            }
            per_token = wall / tokens * 1e3 / 100  # CPU % -> ms per token
            for name, share in sorted(cpu.items()):
                if share > 0.5:
                    row[f"cpu:{name}"] = share * per_token
            row["cpu:client"] = client_cpu * per_token
            for event, count in counts.items():
                row[f"perf:{event}"] = count / tokens
            rows[label].append(row)
            print_row(f"round {r} {label}", row)
        print(f"  (load average {os.getloadavg()[0]:.2f})", flush=True)
    print("median over rounds:")
    for label, label_rows in rows.items():
        keys = {k for row in label_rows for k in row}
        print_row(
            label,
            {k: statistics.median(row.get(k, 0.0) for row in label_rows) for k in sorted(keys)},
        )
    return 0


PERF_EVENTS = ("context-switches", "cpu-migrations", "syscalls:sys_enter_futex")


def start_perf(sampler: TreeSampler) -> subprocess.Popen[str] | None:
    """`perf stat` on the server's worker process (its threads together), until finish_perf."""
    workers = [pid for pid, name in sampler.names.items() if name.startswith("Worker")]
    if not workers:
        return None
    cmd = ["perf", "stat", "-x", ",", "-e", ",".join(PERF_EVENTS), "-p", str(workers[0])]
    return subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)


def finish_perf(perf: subprocess.Popen[str]) -> dict[str, float]:
    """The counts of start_perf's events (an event perf could not count is left out)."""
    perf.send_signal(signal.SIGINT)
    _, err = perf.communicate()
    counts = {}
    for line in err.splitlines():
        fields = line.split(",")
        if len(fields) > 2 and fields[2] in PERF_EVENTS and fields[0].isdigit():
            counts[fields[2].rpartition(":")[2].replace("sys_enter_", "")] = float(fields[0])
    return counts


def print_row(label: str, row: dict[str, float]) -> None:
    cpu = " ".join(f"{k[4:]} {v:.2f}" for k, v in row.items() if k.startswith("cpu:"))
    cpu += "".join(f" {k[5:]} {v:.1f}" for k, v in row.items() if k.startswith("perf:"))
    print(
        f"{label:<22}{row['itl_p50']:8.2f}{row['itl_p90']:7.2f}{row['tok_s']:8.1f}   {cpu}",
        flush=True,
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default=DEFAULT_MODEL, help="a GGUF file or checkpoint directory")
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="LABEL=ENV",
        help="a server of this tree with these environment assignments (repeat)",
    )
    p.add_argument(
        "--rev",
        action="append",
        default=[],
        metavar="LABEL=REV",
        help="a server of git revision REV (repeat)",
    )
    p.add_argument("--llamacpp-venv", default=None, help="add llama.cpp's server on --model")
    p.add_argument("--sb-args", default="", help="more `switchboard serve` flags, every variant")
    p.add_argument(
        "--perf",
        action="store_true",
        help="count the worker's context switches, migrations and futex calls (perf stat)",
    )
    p.add_argument(
        "--concurrency", type=int, default=1, help="closed-loop clients (the same check at more)"
    )
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--requests", type=int, default=4, help="per round")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    args = p.parse_args(argv)
    args.variant = [spec.partition("=")[::2] for spec in args.variant]
    args.rev = [spec.partition("=")[::2] for spec in args.rev]
    args.model = str(Path(args.model).expanduser())
    if args.llamacpp_venv:
        args.llamacpp_venv = Path(args.llamacpp_venv).expanduser()
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return asyncio.run(run(args))
    finally:
        stop_all()


if __name__ == "__main__":
    sys.exit(main())
