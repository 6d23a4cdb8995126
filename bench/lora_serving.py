"""Served LoRA throughput: switchboard vs vLLM's CPU build, c clients on the base model and
spread over 1, 4 and 8 adapters.

    python bench/lora_serving.py [--model DIR] [--requests 128] [--concurrency 32]
                                 [--rank 16] [--skip-vllm] [--json OUT]

Run it with the project's venv (.venv/bin/python). Writes 8 random adapters of ``--rank`` on
every projection (q/k/v/o/gate/up/down, PEFT's format, non-zero B: bench/lora.py's
``make_adapter``) to a temp dir, then, one server at a time, starts switchboard (``--enable-lora
--lora-modules a0=DIR ... a7=DIR --max-loras 8 --max-lora-rank R``) and vLLM (the same flags,
through bench/vllm_side.py's launcher), both float32 with a 2 GiB KV cache and seed 0. Each is
warmed up with a short request on the base model and on every adapter (an adapter's first use
loads it), then runs four phases over OpenAI ``/v1/completions`` (streaming, greedy,
ignore_eos): a closed loop of ``--concurrency`` clients sends ``--requests`` requests of
``--input-len`` random token ids and ``--output-len`` output tokens, with ``model`` = the base
model (phase "base"), then the adapters a0, a0..a3, a0..a7 in turn. Prints per phase each
server's output tok/s, switchboard / vLLM, and each server's phase / its own base phase, with
the load average. A vLLM that refuses LoRA (or a flag) is reported with what it said and the run
goes on with switchboard alone.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import shlex
import signal
import sys
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import vllm_http  # bench/vllm_http.py and the modules below: beside this file
import vllm_side
from lora import make_adapter
from server_procs import free_port, start, stop_all, switchboard_command, vllm_ready, wait_ready
from serving_clients import (
    HOST,
    OpenAIClient,
    RequestResult,
    Send,
    closed_loop,
    make_prompts,
    summarize,
)

MAX_LORAS = 8
PHASES = {"base": 0, "1 adapter": 1, "4 adapters": 4, "8 adapters": 8}
MAX_MODEL_LEN = 512
ANCHOR = Path("~/.cache/vllm-anchor")


class SpreadClient(OpenAIClient):
    """An OpenAIClient whose requests name ``models`` in turn (round robin over all clients)."""

    def __init__(self, port: int, models: list[str], max_tokens: int) -> None:
        super().__init__(port, models[0], max_tokens)
        self.turns = itertools.cycle(models)

    async def sender(self) -> tuple[Send, Callable[[], Awaitable[None]]]:
        send, close = await super().sender()

        async def spread(prompt: list[int]) -> RequestResult:
            # send() reads self.model before its first await, so no other client's turn
            # can come in between
            self.model = next(self.turns)
            return await send(prompt)

        return spread, close


async def served_base(port: int, adapters: dict[str, str]) -> str:
    """The base model's name as the server lists it in GET /v1/models (switchboard: the
    checkpoint directory's name, vLLM: the path it was given)."""
    conn = vllm_http.HttpConnection(HOST, port)
    try:
        body = b"".join([piece async for piece in conn.request("GET", "/v1/models")])
    finally:
        await conn.close()
    names = [entry["id"] for entry in json.loads(body)["data"]]
    bases = [name for name in names if name not in adapters]
    if len(bases) != 1:
        raise RuntimeError(f"cannot tell the base model among {names}")
    return str(bases[0])


def server_command(
    kind: str, args: argparse.Namespace, adapters: dict[str, str], port: int, grpc_port: int
) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of ``kind``, its OpenAI API on ``port`` (switchboard's
    gRPC on ``grpc_port``)."""
    lora = ["--enable-lora", "--lora-modules", *(f"{n}={d}" for n, d in adapters.items())]
    lora += ["--max-loras", str(MAX_LORAS), "--max-lora-rank", str(args.rank)]
    if kind == "switchboard":
        cmd = [
            *switchboard_command(), "serve", "--model", args.model, "--host", HOST,
            "--port", str(grpc_port), "--http-port", str(port), "--dtype", "float32",
            "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory-bytes", str(2 * 2**30),
            "--seed", "0", *lora,
        ]  # fmt: skip
        return cmd, dict(os.environ)
    model = vllm_side.checkpoint_view(args.model, args.vllm_cache)
    cmd = vllm_side.command(args.vllm_venv, model, port, MAX_MODEL_LEN, "float32") + lora
    return cmd, vllm_side.environment(args.vllm_cache)


async def run_server(
    kind: str, args: argparse.Namespace, adapters: dict[str, str], log_dir: Path
) -> dict[str, Any]:
    """Start ``kind``, warm it up, run the phases, stop it; a failure is recorded, not raised."""
    port, grpc_port = free_port(), free_port()
    cmd, env = server_command(kind, args, adapters, port, grpc_port)
    log = log_dir / f"{kind}.log"
    out: dict[str, Any] = {"command": cmd, "log": str(log), "error": None, "phases": {}}
    shown = shlex.join(c if len(c) < 80 else "LAUNCHER" for c in cmd)
    print(f"{kind}: {shown}  (log {log})", file=sys.stderr, flush=True)
    # ready: switchboard's gRPC health, vLLM's OpenAI API
    server = start(kind, cmd, env, log, grpc_port if kind == "switchboard" else port)
    try:
        out["ready_s"] = await wait_ready(server)
        while not await vllm_ready(port):  # switchboard: gRPC is up, wait for its HTTP API
            if server.proc.poll() is not None:
                raise RuntimeError(f"{kind} exited; {log}:\n{server.tail()}")
            await asyncio.sleep(0.5)
        print(f"{kind} ready after {out['ready_s']:.1f} s", file=sys.stderr, flush=True)
        names, base = list(adapters), await served_base(port, adapters)
        warm = SpreadClient(port, [base, *names], 8)
        prompts = make_prompts(1 + len(names), args.input_len, args.vocab, "warm-up")
        results, _ = await closed_loop(warm, prompts, 1 + len(names), args.request_timeout)
        # a failure here (an adapter refused) shows again in the phases: go on to them
        out["warm_up_errors"] = [r.error for r in results if r.error]
        for error in out["warm_up_errors"]:
            print(f"{kind} warm-up: {error}", file=sys.stderr, flush=True)
        for phase, count in PHASES.items():
            client = SpreadClient(port, names[:count] or [base], args.output_len)
            prompts = make_prompts(args.requests, args.input_len, args.vocab, f"{phase}")
            results, wall = await closed_loop(
                client, prompts, args.concurrency, args.request_timeout
            )
            out["phases"][phase] = summary = summarize(results, wall, args.output_len)
            print(
                f"{kind} {phase}: {summary['output_tok_s']:.1f} tok/s, {summary['errors']} "
                f"errors, {summary['short_outputs']} short, {wall:.1f} s",
                file=sys.stderr,
                flush=True,
            )
            if summary["first_error"]:
                print(f"  first error: {summary['first_error']}", file=sys.stderr)
    except Exception as e:  # noqa: BLE001 - reported; the other server still runs
        out["error"] = f"{type(e).__name__}: {e}"
        print(f"{kind} failed: {out['error']}", file=sys.stderr, flush=True)
    finally:
        server.stop()
    return out


def rate(run: dict[str, Any] | None, phase: str) -> float | None:
    summary = (run or {}).get("phases", {}).get(phase)
    if not summary or summary["errors"]:
        return None
    return float(summary["output_tok_s"])


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}" if a and b else "-"


def print_table(args: argparse.Namespace, runs: dict[str, dict[str, Any]]) -> None:
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    print(
        f"\n{Path(args.model).name}, c = {args.concurrency}, {args.requests} requests a phase, "
        f"prompt {args.input_len}, output {args.output_len}, rank {args.rank}, "
        f"load average {load}"
    )
    sb, vllm = runs.get("switchboard"), runs.get("vllm")
    head = f"{'phase':<12}{'sb tok/s':>10}{'vLLM tok/s':>12}{'sb/vLLM':>9}"
    print(head + f"{'sb/base':>9}{'vLLM/base':>11}")
    for phase in PHASES:
        s, v = rate(sb, phase), rate(vllm, phase)
        cells = f"{s:>10.1f}" if s else f"{'-':>10}"
        cells += f"{v:>12.1f}" if v else f"{'-':>12}"
        cells += f"{ratio(s, v):>9}{ratio(s, rate(sb, 'base')):>9}"
        print(f"{phase:<12}{cells}{ratio(v, rate(vllm, 'base')):>11}")
    for kind, run in runs.items():
        if run["error"]:
            print(f"\n{kind} cannot: {run['error']}")
        for phase, summary in run["phases"].items():
            if summary["errors"]:
                print(f"{kind} {phase}: {summary['errors']} errors: {summary['first_error']}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default=str(ANCHOR / "llama-100m"), help="a Llama checkpoint dir")
    p.add_argument("--requests", type=int, default=128, help="per phase")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--vllm-venv", type=Path, default=ANCHOR / "vllm-venv")
    p.add_argument("--vllm-cache", type=Path, default=ANCHOR, help="vLLM's compile cache")
    p.add_argument("--skip-vllm", action="store_true")
    p.add_argument("--log-dir", type=Path, default=None, help="server logs (default: a temp dir)")
    p.add_argument("--json", type=Path, default=None, metavar="OUT", help="write all raw numbers")
    args = p.parse_args(argv)
    args.model = str(Path(args.model).expanduser())
    args.vllm_venv, args.vllm_cache = args.vllm_venv.expanduser(), args.vllm_cache.expanduser()
    if min(args.requests, args.concurrency, args.rank, args.input_len, args.output_len) < 1:
        p.error("--requests, --concurrency, --rank and the lengths must be at least 1")
    if args.input_len + args.output_len > MAX_MODEL_LEN:
        p.error(f"--input-len + --output-len must fit max-model-len {MAX_MODEL_LEN}")
    if not (Path(args.model) / "config.json").is_file():
        p.error(f"--model {args.model}: no config.json there")
    if not args.skip_vllm and not (args.vllm_venv / "bin" / "python").exists():
        p.error(f"no vLLM at {args.vllm_venv}: bench/vs_vllm.py --setup (or --skip-vllm)")
    args.vocab = int(json.loads((Path(args.model) / "config.json").read_text())["vocab_size"])
    return args


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through the finally blocks that stop the servers


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    kinds = ["switchboard"] + ([] if args.skip_vllm else ["vllm"])
    runs: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-lora-serving-") as root:
        adapters = {f"a{i}": make_adapter(args.model, root, i, args.rank) for i in range(MAX_LORAS)}
        log_dir = (args.log_dir or Path(tempfile.mkdtemp(prefix="lora-serving-"))).expanduser()
        log_dir.mkdir(parents=True, exist_ok=True)
        try:
            for kind in kinds:  # an event loop each: nothing one client left can touch the other
                runs[kind] = asyncio.run(run_server(kind, args, adapters, log_dir))
        finally:
            stop_all()
    print_table(args, runs)
    if args.json:
        report = {"args": {k: str(v) for k, v in vars(args).items()}, "runs": runs}
        report["load_average"] = os.getloadavg()
        args.json.write_text(json.dumps(report, indent=2))
    sb = runs["switchboard"]
    return 1 if sb["error"] or any(phase["errors"] for phase in sb["phases"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
