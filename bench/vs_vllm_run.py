"""One server through one model's plan, for bench/vs_vllm.py: launch it (switchboard or vLLM,
the same model, dtype, KV cache size and seed), time it to ready, then per level warm up once
per prompt length, run the closed loop while sampling the server's CPU, and collect the
numbers; a failure is recorded and the server stopped either way.

Not run by itself.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import shlex
import sys
from pathlib import Path
from typing import Any

import vllm_side  # bench/vllm_side.py, beside this file
from server_procs import TreeSampler, free_port, start, switchboard_command, wait_ready
from serving_clients import HOST, SbClient, VllmClient, closed_loop, make_prompts, summarize

SERVERS = ("switchboard", "vllm")
API_PROCESS = {"switchboard": "Gateway_0", "vllm": "APIServer"}


@dataclasses.dataclass
class ModelPlan:
    label: str
    path: str
    vocab: int
    max_model_len: int
    levels: list[tuple[int, int, int]]  # (prompt length, concurrency, requests)
    notes: list[str]


async def run_server(
    kind: str, plan: ModelPlan, args: argparse.Namespace, log_dir: Path
) -> dict[str, Any]:
    port = free_port()
    if kind == "switchboard":
        cmd = [
            *switchboard_command(), "serve", "--model", plan.path, "--host", HOST,
            "--port", str(port), "--dtype", "float32", "--max-model-len", str(plan.max_model_len),
            "--kv-cache-memory-bytes", str(2 * 2**30), "--seed", "0", *shlex.split(args.sb_args),
        ]  # fmt: skip
        env = dict(os.environ)
        client: SbClient | VllmClient = SbClient(port, args.output_len)
    else:
        cmd = vllm_side.command(args.vllm_venv, plan.path, port, plan.max_model_len)
        env = vllm_side.environment(args.vllm_cache)
        client = VllmClient(port, plan.path, args.output_len)
    log = log_dir / f"{kind}_{plan.label}.log"
    out: dict[str, Any] = {"command": cmd, "log": str(log), "ready_s": None, "levels": []}
    out["error"] = None
    shown = [c if len(c) < 80 else "LAUNCHER" for c in cmd]
    print(f"[{plan.label}] {kind}: {shlex.join(shown)}  (log {log})", file=sys.stderr, flush=True)
    server = start(kind, cmd, env, log, port)
    try:
        out["ready_s"] = await wait_ready(server)
        print(f"[{plan.label}] {kind} ready after {out['ready_s']:.1f} s", file=sys.stderr)
        warmed: set[int] = set()
        for index, (input_len, concurrency, requests) in enumerate(plan.levels):
            if input_len not in warmed:  # not measured: first-request costs of this length
                warmed.add(input_len)
                client.max_tokens = min(8, args.output_len)
                warm = make_prompts(2, input_len, plan.vocab, f"warm-up:{input_len}")
                await closed_loop(client, warm, 2, args.request_timeout)
                client.max_tokens = args.output_len
            key = f"{args.seed}:{index}:{input_len}:{concurrency}"
            prompts = make_prompts(requests, input_len, plan.vocab, key)
            sampler = TreeSampler(server.proc.pid, kind)
            results, wall = await closed_loop(client, prompts, concurrency, args.request_timeout)
            cpu, rss, client_cpu = sampler.finish()
            server.track()
            level = {"input_len": input_len, "output_len": args.output_len}
            level |= {"concurrency": concurrency, **summarize(results, wall, args.output_len)}
            level |= {"cpu_pct": cpu, "rss_mb": rss, "client_cpu_pct": client_cpu}
            level["api_rss_mb"] = rss.get(API_PROCESS[kind])
            out["levels"].append(level)
            print(
                f"[{plan.label}] {kind} prompt {input_len} c={concurrency}: "
                f"{level['output_tok_s']:.1f} tok/s, {level['errors']} errors, "
                f"{level['short_outputs']} short, {wall:.1f} s",
                file=sys.stderr,
                flush=True,
            )
            if level["first_error"]:
                print(f"  first error: {level['first_error']}", file=sys.stderr)
            if server.proc.poll() is not None:
                raise RuntimeError(f"{kind} exited during the run; {log}:\n{server.tail()}")
    except Exception as e:  # noqa: BLE001 - reported; the other server still runs
        out["error"] = f"{type(e).__name__}: {e}"
        print(f"[{plan.label}] {kind} failed: {out['error']}", file=sys.stderr, flush=True)
    finally:
        await client.close()
        server.stop()
    return out


def run_all(
    args: argparse.Namespace, plans: list[ModelPlan], log_dir: Path
) -> dict[str, dict[str, Any]]:
    """Each server's run in an event loop of its own, so nothing one client left in a loop
    (grpc.aio's poller, open connections) can touch the other's timings. Known issue: vLLM's
    c = 1 latencies from this client are sometimes a burst at the end of each request (TTFT
    near e2e, ITL ~0.01 ms) where a plain http.client reader of the same server sees events
    ~3 ms apart; its throughput is unaffected (tokens over wall time)."""
    skip = {"switchboard": args.skip_sb, "vllm": args.skip_vllm}
    kinds = [kind for kind in SERVERS if not skip[kind]]
    runs: dict[str, dict[str, Any]] = {}
    for plan in plans:
        runs[plan.label] = {}
        for kind in kinds:
            runs[plan.label][kind] = asyncio.run(run_server(kind, plan, args, log_dir))
    return runs
