"""What a JSON-schema constraint costs a live server: output tokens/s with and without it.

    python bench/structured_serving.py [--model DIR] [--concurrency 1 8] [--requests 16]
                                       [--max-tokens 64]

Starts ``switchboard serve`` on the model (default: the built-in SmolLM2-135M-Instruct), then
per concurrency runs a closed loop of chat requests ("describe a person") free and constrained
to a JSON schema (``structured_output.json_schema``), alternating twice (free, constrained, free,
constrained; each reported as the mean of its two runs); greedy, ``--max-tokens`` each. Output
tok/s is every output token over the wall time of the level (a constrained answer may end
sooner, with STOP, once its document is complete: the rate is per token, so that is fair). Also
the grammar's compile cost as the server sees it: time to first token of the first request with
a new schema (cold: compiled) and of a second one with the same schema (cached), next to an
unconstrained request's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))

import server_procs  # noqa: E402  (bench/ is not a package)

from switchboard.api.v1 import generation_service_pb2 as pb  # noqa: E402
from switchboard.api.v1 import generation_service_pb2_grpc as pb_grpc  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 30},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 30},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
    },
    "required": ["name", "age", "city", "hobbies"],
    "additionalProperties": False,
}
QUESTION = "Describe a made-up person: name, age, city and hobbies, as JSON."


def _request(max_tokens: int, schema: dict | None, salt: int) -> pb.GenerateRequest:
    request = pb.GenerateRequest(
        messages=[pb.ChatMessage(role="user", content=f"{QUESTION} ({salt})")]
    )
    request.sampling.temperature = 0.0
    request.stopping.max_tokens = max_tokens
    request.output.return_token_ids = True
    if schema is not None:
        request.structured_output.json_schema = json.dumps(schema)
    return request


async def _one(stub: pb_grpc.GenerationServiceStub, request: pb.GenerateRequest) -> tuple:
    sent = time.perf_counter()
    first = None
    tokens = 0
    async for response in stub.Generate(request, timeout=300):
        n = sum(len(o.token_ids) for o in response.outputs)
        if n and first is None:
            first = time.perf_counter() - sent
        tokens += n
    return tokens, first or 0.0


async def _level(stub, concurrency: int, requests: int, max_tokens: int, schema) -> float:
    queue = list(range(requests))
    total = 0

    async def client() -> None:
        nonlocal total
        while queue:
            salt = queue.pop()
            tokens, _ = await _one(stub, _request(max_tokens, schema, salt))
            total += tokens

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return total / (time.perf_counter() - started)


async def run(args: argparse.Namespace) -> None:
    port = server_procs.free_port()
    model = args.model or "default"
    cmd = [*server_procs.switchboard_command(), "serve", "--host", "127.0.0.1", "--port",
           str(port), "--http-port", "-1", "--seed", "0"]  # fmt: skip
    if model != "default":
        cmd += ["--model", model]
    log = Path(tempfile.mkdtemp(prefix="sb-structured-")) / "server.log"
    server = server_procs.start("switchboard", cmd, dict(os.environ), log, port)
    try:
        ready_s = await server_procs.wait_ready(server)
        print(f"server ready after {ready_s:.1f} s (log {log})")
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.GenerationServiceStub(channel)
            await _one(stub, _request(8, None, -1))  # warm-up
            _, free_ttft = await _one(stub, _request(8, None, -2))
            fresh = dict(SCHEMA, description=f"run {time.time_ns()}")  # never seen: compiled
            _, cold_ttft = await _one(stub, _request(8, fresh, -3))
            _, cached_ttft = await _one(stub, _request(8, fresh, -4))
            rows = []
            for c in args.concurrency:
                free, constrained = [], []
                for _ in range(2):  # A B A B: a machine whose load drifts hits both alike
                    free.append(await _level(stub, c, args.requests, args.max_tokens, None))
                    constrained.append(
                        await _level(stub, c, args.requests, args.max_tokens, SCHEMA)
                    )
                rows.append((c, sum(free) / 2, sum(constrained) / 2))
    finally:
        server.stop()
    print()
    print("| c | free tok/s | JSON-schema tok/s | ratio |")
    print("|---|---|---|---|")
    for c, free, constrained in rows:
        print(f"| {c} | {free:.1f} | {constrained:.1f} | {constrained / free:.2f} |")
    print()
    print(
        f"TTFT ms: unconstrained {free_ttft * 1e3:.0f}, new schema (compiled) "
        f"{cold_ttft * 1e3:.0f}, same schema again (cached) {cached_ttft * 1e3:.0f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="", help="a model directory (default: built-in)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--requests", type=int, default=16, help="per level")
    parser.add_argument("--max-tokens", type=int, default=64)
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
