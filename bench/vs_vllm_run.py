"""One server through one model's plan, for bench/vs_vllm.py: launch it (switchboard or vLLM,
the same model, dtype, KV cache size and seed; llama.cpp on the model's GGUF file), time it to
ready, then per level warm up once per prompt length, run the closed loop while sampling the
server's CPU, and collect the numbers; a failure is recorded and the server stopped either way.

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

import grpc
import llamacpp_side  # bench/llamacpp_side.py and the modules below: beside this file
import vllm_side
from server_procs import TreeSampler, free_port, start, switchboard_command, wait_ready
from serving_clients import (
    HOST,
    Client,
    OpenAIClient,
    SbClient,
    closed_loop,
    make_prompts,
    summarize,
)

from switchboard.api.v1 import model_service_pb2 as model_pb
from switchboard.api.v1 import model_service_pb2_grpc as model_grpc

SERVERS = ("switchboard", "vllm", "llamacpp")
API_PROCESS = {"switchboard": "Gateway_0", "vllm": "APIServer", "llamacpp": "llama-server"}


@dataclasses.dataclass
class ModelPlan:
    label: str
    path: str
    vocab: int
    max_model_len: int
    levels: list[tuple[int, int, int]]  # (prompt length, concurrency, requests)
    notes: list[str]
    gguf: str | None = None  # the GGUF file llama.cpp serves (None: no llama.cpp column)


async def run_server(
    kind: str, plan: ModelPlan, args: argparse.Namespace, log_dir: Path
) -> dict[str, Any]:
    port = free_port()
    cmd, env, client = _launch(kind, plan, args, port)
    log = log_dir / f"{kind}_{plan.label}.log"
    out: dict[str, Any] = {"command": cmd, "log": str(log), "ready_s": None, "levels": []}
    out["error"] = None
    shown = [c if len(c) < 80 else "LAUNCHER" for c in cmd]
    print(f"[{plan.label}] {kind}: {shlex.join(shown)}  (log {log})", file=sys.stderr, flush=True)
    server = start(kind, cmd, env, log, port)
    try:
        out["ready_s"] = await wait_ready(server)
        out["runs_as"] = await _runs_as(kind, port, args.dtype, plan)
        print(
            f"[{plan.label}] {kind} ready after {out['ready_s']:.1f} s ({out['runs_as']})",
            file=sys.stderr,
        )
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


def _launch(
    kind: str, plan: ModelPlan, args: argparse.Namespace, port: int
) -> tuple[list[str], dict[str, str], Client]:
    """The server's command line and environment, and the client that talks to it."""
    if kind == "switchboard":
        cmd = [
            *switchboard_command(), "serve", "--model", plan.path, "--host", HOST,
            "--port", str(port), "--dtype", args.dtype, "--max-model-len", str(plan.max_model_len),
            "--kv-cache-memory-bytes", str(2 * 2**30), "--seed", "0", *shlex.split(args.sb_args),
        ]  # fmt: skip
        return cmd, dict(os.environ), SbClient(port, args.output_len)
    if kind == "vllm":
        model = vllm_side.checkpoint_view(plan.path, args.vllm_cache)
        cmd = vllm_side.command(args.vllm_venv, model, port, plan.max_model_len, args.dtype)
        env = vllm_side.environment(args.vllm_cache)
        return cmd, env, OpenAIClient(port, model, args.output_len)
    assert plan.gguf is not None
    slots = max(c for _, c, _ in plan.levels)
    longest = max(n for n, _, _ in plan.levels) + args.output_len
    cmd = llamacpp_side.command(
        args.llamacpp_venv, plan.gguf, port, slots, llamacpp_side.slot_tokens(longest)
    )
    client = OpenAIClient(port, plan.label, args.output_len, reconnect=True)
    return cmd, llamacpp_side.environment(), client


async def _runs_as(kind: str, port: int, dtype: str, plan: ModelPlan) -> str:
    """How the server runs the model: switchboard says it (GetModelInfo: the dtype and the
    quantization its worker resolved); vLLM runs the dtype asked for, llama.cpp the GGUF's."""
    if kind == "vllm":
        return f"dtype {dtype}"
    if kind == "llamacpp":
        return f"{Path(plan.gguf or '').name} as it is"
    async with grpc.aio.insecure_channel(f"{HOST}:{port}") as channel:
        stub = model_grpc.ModelServiceStub(channel)
        info = await stub.GetModelInfo(model_pb.GetModelInfoRequest(), timeout=10)
    return f"dtype {info.dtype}, quantization {info.quantization}"


def run_all(
    args: argparse.Namespace, plans: list[ModelPlan], log_dir: Path
) -> dict[str, dict[str, Any]]:
    """Each server's run in an event loop of its own, so nothing one client left in a loop
    (grpc.aio's poller, open connections) can touch the other's timings. Known issue: vLLM's
    c = 1 latencies from this client are sometimes a burst at the end of each request (TTFT
    near e2e, ITL ~0.01 ms) where a plain http.client reader of the same server sees events
    ~3 ms apart; its throughput is unaffected (tokens over wall time)."""
    skip = {"switchboard": args.skip_sb, "vllm": args.skip_vllm, "llamacpp": args.skip_llamacpp}
    kinds = [kind for kind in SERVERS if not skip[kind]]
    runs: dict[str, dict[str, Any]] = {}
    for plan in plans:
        runs[plan.label] = {}
        for kind in kinds:
            if kind == "llamacpp" and plan.gguf is None:
                continue
            runs[plan.label][kind] = asyncio.run(run_server(kind, plan, args, log_dir))
    return runs
