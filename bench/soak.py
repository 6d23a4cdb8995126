"""A soak: mixed traffic on `switchboard serve -dp 2 --api-servers 2` while a random role is
killed with -9 every interval, then a report of what was lost and what leaked.

    python bench/soak.py [--model DIR] [--duration 1800] [--kill-interval-s 60] [--clients 4]
                         [--seed 0] [--json PATH]

The model defaults to the tests' tiny random Llama with a chat template (built here, no
download). Traffic (bench/soak_traffic.py): gRPC streams, HTTP completions and chat (SSE and
not), structured output, cancels and bad requests, each checked against what an undisturbed run
gave. Chaos (bench/soak_chaos.py): every ``--kill-interval-s`` one of the server's processes —
a gateway, an engine core, a worker or the coordinator, found by its title among the
supervisor's descendants — gets SIGKILL, in a seeded random order that kills each role once per
round; the next kill waits until the killed role is serving again.

The report (stdout, and ``--json``):

* requests by kind and outcome; ``lost``: every request that did not end as it should, other
  than those that ended UNAVAILABLE saying how many tokens they had delivered, and than
  attempts cut by a gateway's death that a retry on a fresh connection completed (a killed
  gateway cannot answer its clients; bench/soak_traffic.py says exactly what is retried);
* every kill, and how long the role took to be back; ``roles_back``: every role of the start
  is running again at the end and both gateways are ready;
* RSS (MiB) and open files of every role at the start and the end;
* leaks: ring segments of killed engines still in /dev/shm while the server runs, every shared
  memory segment the server's processes mapped still there after it stopped, and files left
  in its run directory; and the supervisor's exit code.

Exit 0 when nothing was lost, nothing leaked, every role came back and the server stopped with
0; 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/tiny_checkpoint.py

import server_procs  # noqa: E402  (bench/ is not a package)
import soak_chaos  # noqa: E402
import soak_traffic  # noqa: E402

HOST = "127.0.0.1"
DP = 2
API_SERVERS = 2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="checkpoint directory (default: a tiny random Llama)")
    parser.add_argument("--duration", type=float, default=1800.0, help="seconds of traffic")
    parser.add_argument("--kill-interval-s", type=float, default=60.0)
    parser.add_argument("--clients", type=int, default=4, help="client threads")
    parser.add_argument("--seed", type=int, default=0, help="kill order and request mix")
    parser.add_argument("--json", type=Path, help="write the report here too")
    return parser.parse_args(argv)


def tiny_model() -> str:
    from tests.tiny_checkpoint import TINY_CHAT_TEMPLATE, tiny_llama_dir

    return tiny_llama_dir(chat_template=TINY_CHAT_TEMPLATE)


def model_name(http_url: str) -> str:
    with urllib.request.urlopen(f"{http_url}/v1/models", timeout=30) as reply:
        return str(json.loads(reply.read())["data"][0]["id"])


def start_server(model: str, workdir: Path, run_base: Path) -> tuple[server_procs.Server, int, int]:
    grpc_port = server_procs.free_port()
    http_port = server_procs.free_port_run(API_SERVERS, avoid={grpc_port})  # one a gateway
    cmd = [
        *server_procs.switchboard_command(), "serve", "--model", model,
        "--host", HOST, "--port", str(grpc_port), "--http-port", str(http_port),
        "-dp", str(DP), "--api-servers", str(API_SERVERS),
        "--kv-cache-memory-bytes", str(16 << 20),
    ]  # fmt: skip
    env = dict(os.environ, SWITCHBOARD_RPC_BASE_PATH=str(run_base), PYTHONUNBUFFERED="1")
    server = server_procs.start("switchboard", cmd, env, workdir / "server.log", grpc_port)
    asyncio.run(server_procs.wait_ready(server))
    return server, grpc_port, http_port


def all_back(chaos: soak_chaos.Chaos, start_roles: dict[str, int], timeout_s: float) -> list[str]:
    """The roles of the start not running (or a gateway not ready) after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        current = chaos.watch.snapshot()
        missing = [role for role in start_roles if role not in current]
        missing += [url for url in chaos.http_urls if not soak_chaos.ready(url)]
        if not missing or time.monotonic() > deadline:
            return missing
        time.sleep(0.5)


def run(args: argparse.Namespace) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="soak-"))
    run_base = Path(tempfile.mkdtemp(prefix="sb-soak-"))  # short: ipc:// paths < 107 bytes
    model = args.model or tiny_model()
    server, grpc_port, http_port = start_server(model, workdir, run_base)
    report: dict[str, Any] = {"seed": args.seed, "duration_s": args.duration, "log": str(workdir)}
    try:
        http_urls = [f"http://{HOST}:{http_port + i}" for i in range(API_SERVERS)]
        fronts = soak_traffic.Fronts(
            f"{HOST}:{grpc_port}", [http_port + i for i in range(API_SERVERS)]
        )
        fronts.model = model_name(http_urls[0])
        refs = soak_traffic.References()
        refs.make(fronts)
        watch = soak_chaos.ServerWatch(server.proc.pid, server.log)
        start_roles = watch.snapshot()
        report["start"] = watch.usage()
        rng = random.Random(args.seed)

        def announce(kill: soak_chaos.Kill) -> None:
            print(f"[soak] kill -9 {kill.role} (pid {kill.pid})", flush=True)

        chaos = soak_chaos.Chaos(watch, http_urls, args.kill_interval_s, rng, announce)
        traffic = soak_traffic.Traffic(
            fronts, refs, args.clients, args.seed, chaos.gateway_outage_during
        )
        began = time.monotonic()
        traffic.start()
        chaos.start()
        time.sleep(max(0.0, args.duration - (time.monotonic() - began)))
        chaos.stop()  # waits for the last killed role to be back
        traffic.stop()
        report["wall_s"] = round(time.monotonic() - began, 1)
        report["traffic"] = traffic.summary()
        report["kills"] = [
            {
                "role": k.role,
                "pid": k.pid,
                "back_after_s": None if k.back_after_s is None else round(k.back_after_s, 1),
            }
            for k in chaos.kills
        ]
        report["not_back"] = all_back(chaos, start_roles, soak_chaos.BACK_TIMEOUT_S)
        report["roles_back"] = not report["not_back"]
        report["end"] = watch.usage()
        report["orphaned_ring_segments"] = watch.orphaned_segments()
    finally:
        server.stop()
    report["exit_code"] = server.proc.returncode
    report["leftover_segments"] = watch.leftover_segments() if "end" in report else []
    report["leftover_run_files"] = sorted(str(p.relative_to(run_base)) for p in run_base.rglob("*"))
    shutil.rmtree(run_base, ignore_errors=True)
    report["passed"] = passed(report)
    return report


def passed(report: dict[str, Any]) -> bool:
    return (
        not report["traffic"]["lost"]
        and report["roles_back"]
        and not report["orphaned_ring_segments"]
        and not report["leftover_segments"]
        and not report["leftover_run_files"]
        and report["exit_code"] == 0
    )


def print_report(report: dict[str, Any]) -> None:
    traffic = report["traffic"]
    print(f"\nsoak: {report['wall_s']} s, seed {report['seed']}, log in {report['log']}")
    print(f"requests: {traffic['requests']} ({traffic['ok']} ok), by kind {traffic['by_kind']}")
    print(f"retried after a gateway kill: {traffic['retried_after_a_gateway_kill']}")
    print(f"UNAVAILABLE saying what they delivered: {len(traffic['reported_unavailable'])}")
    print(f"lost: {len(traffic['lost'])}", *traffic["lost"][:20], sep="\n  ")
    for kill in report["kills"]:
        print(f"kill -9 {kill['role']} (pid {kill['pid']}): back after {kill['back_after_s']} s")
    print(f"roles back: {report['roles_back']} (missing: {report['not_back']})")
    print(f"{'role':24} {'RSS MiB start':>14} {'end':>8} {'files start':>12} {'end':>6}")
    for role, start in report["start"].items():
        end = report["end"].get(role, {})
        print(
            f"{role:24} {start['rss_mib'] or 0:14.0f} {end.get('rss_mib') or 0:8.0f} "
            f"{start['open_files'] or 0:12d} {end.get('open_files') or 0:6d}"
        )
    print(f"orphaned ring segments while serving: {report['orphaned_ring_segments']}")
    print(f"shared memory left after the stop: {report['leftover_segments']}")
    print(f"files left in the run directory: {report['leftover_run_files']}")
    print(f"server exit code: {report['exit_code']}; {'PASSED' if report['passed'] else 'FAILED'}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        report = run(args)
    finally:
        server_procs.stop_all()
    print_report(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
