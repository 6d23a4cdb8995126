"""The Python steps of bench/gpu_check.sh (run on the GPU machine; see that script).

gpu_check.py wait      --port P --timeout S         gRPC health until SERVING
gpu_check.py parity    --port P --model DIR --out F greedy ids: server vs transformers
gpu_check.py sweep     --port P --levels 1 8 ...    closed-loop gRPC streams per level
gpu_check.py hf-static --model DIR --levels ...     transformers generate, static batches
gpu_check.py table     --dir RESULTS                the markdown table of the JSON files
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

PARITY_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
]
PARITY_TOKENS = 32
MUST_MATCH = 8  # bfloat16 on both sides: the first tokens must agree, later ones may drift


def _wait(args: argparse.Namespace) -> int:
    from server_procs import sb_ready

    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        if asyncio.run(sb_ready(args.port)):
            print(f"ready after {args.timeout - (deadline - time.monotonic()):.1f}s")
            return 0
        time.sleep(1.0)
    print("not ready")
    return 1


def _server_greedy(port: int, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    import grpc

    from switchboard.api.v1 import generation_service_pb2 as pb
    from switchboard.api.v1 import generation_service_pb2_grpc as pb_grpc

    async def one(stub: Any, ids: list[int]) -> list[int]:
        request = pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=ids),
            sampling=pb.SamplingParams(temperature=0.0),
            stopping=pb.StoppingCriteria(max_tokens=max_tokens, ignore_eos=True),
            output=pb.OutputOptions(return_token_ids=True),
        )
        out: list[int] = []
        async for response in stub.Generate(request, timeout=60):
            for item in response.outputs:
                out.extend(item.token_ids)
        return out

    async def run() -> list[list[int]]:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.GenerationServiceStub(channel)
            return list(await asyncio.gather(*(one(stub, p) for p in prompts)))

    return asyncio.run(run())


def _hf_model(model_dir: str) -> tuple[Any, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to("cuda")
    return tokenizer, model.eval()


def _parity(args: argparse.Namespace) -> int:
    import torch

    tokenizer, model = _hf_model(args.model)
    prompts = [tokenizer(p)["input_ids"] for p in PARITY_PROMPTS]
    served = _server_greedy(args.port, prompts, PARITY_TOKENS)
    rows = []
    for prompt, got in zip(prompts, served, strict=True):
        with torch.inference_mode():
            ids = torch.tensor([prompt], device="cuda")
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=PARITY_TOKENS,
                min_new_tokens=PARITY_TOKENS,
                do_sample=False,
            )
        want = out[0, len(prompt) :].tolist()
        same = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)
        rows.append(
            {"prompt_len": len(prompt), "matching_prefix": len(want) if same is None else same}
        )
    ok = all(r["matching_prefix"] >= MUST_MATCH for r in rows)
    result = {"tokens": PARITY_TOKENS, "must_match": MUST_MATCH, "rows": rows, "ok": ok}
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    return 0 if ok else 1


def _sweep(args: argparse.Namespace) -> int:
    from serving_clients import SbClient, closed_loop, make_prompts, summarize

    levels: dict[str, Any] = {}
    for level in args.levels:
        prompts = make_prompts(max(16, 2 * level), args.prompt_len, 40000, f"gpu-{level}")
        client = SbClient(args.port, args.output_len)

        async def run(c: SbClient = client, p: list[list[int]] = prompts, n: int = level) -> Any:
            try:
                return await closed_loop(c, p, n, args.level_timeout)
            finally:
                await c.close()

        results, wall = asyncio.run(run())
        levels[str(level)] = summarize(results, wall, args.output_len)
        print(level, json.dumps(levels[str(level)]), flush=True)
        Path(args.out).write_text(json.dumps(levels, indent=1))
    return 0


def _hf_static(args: argparse.Namespace) -> int:
    import torch

    _, model = _hf_model(args.model)
    levels: dict[str, Any] = {}
    for batch in args.levels:
        ids = torch.randint(4, 40000, (batch, args.prompt_len), device="cuda")
        kwargs = dict(
            attention_mask=torch.ones_like(ids),
            max_new_tokens=args.output_len,
            min_new_tokens=args.output_len,
            do_sample=False,
        )
        with torch.inference_mode():
            model.generate(
                ids[:, :8],
                **{
                    **kwargs,
                    "attention_mask": torch.ones_like(ids[:, :8]),
                    "max_new_tokens": 2,
                    "min_new_tokens": 2,
                },
            )
            torch.cuda.synchronize()
            started = time.perf_counter()
            model.generate(ids, **kwargs)
            torch.cuda.synchronize()
        wall = time.perf_counter() - started
        levels[str(batch)] = {"wall_s": wall, "output_tok_s": batch * args.output_len / wall}
        print(batch, json.dumps(levels[str(batch)]), flush=True)
        Path(args.out).write_text(json.dumps(levels, indent=1))
    return 0


def _table(args: argparse.Namespace) -> int:
    folder = Path(args.dir)

    def load(name: str) -> dict[str, Any]:
        path = folder / name
        return json.loads(path.read_text()) if path.exists() else {}

    parity, sweep, hf = load("parity.json"), load("sweep.json"), load("hf_static.json")
    lines = ["# gpu_check", ""]
    if parity:
        prefixes = [r["matching_prefix"] for r in parity["rows"]]
        verdict = "ok" if parity["ok"] else "MISMATCH"
        lines.append(f"greedy parity vs transformers: {verdict}, matching prefix {prefixes}")
    else:
        lines.append("greedy parity vs transformers: not run (see parity.log)")
    lines += [
        "",
        "| concurrency / batch | switchboard out tok/s | TTFT p50 ms | ITL p50 ms | errors |"
        " transformers static out tok/s |",
        "|---|---|---|---|---|---|",
    ]
    for level in sorted({*sweep, *hf}, key=int):
        s, h = sweep.get(level, {}), hf.get(level, {})

        def cell(d: dict[str, Any], *keys: str, scale: float = 1.0) -> str:
            for key in keys:
                if isinstance(d.get(key), (int, float)):
                    return f"{d[key] * scale:.1f}"
            return "-"

        lines.append(
            f"| {level} | {cell(s, 'output_tok_s')} "
            f"| {cell(s, 'ttft_ms_p50')} | {cell(s, 'itl_ms_p50')} | {s.get('errors', '-')} "
            f"| {cell(h, 'output_tok_s')} |"
        )
    print("\n".join(lines))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("wait")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--timeout", type=float, default=240)
    p = sub.add_parser("parity")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    for name in ("sweep", "hf-static"):
        p = sub.add_parser(name)
        if name == "sweep":
            p.add_argument("--port", type=int, required=True)
            p.add_argument("--level-timeout", type=float, default=60)
        else:
            p.add_argument("--model", required=True)
        p.add_argument("--levels", type=int, nargs="+", required=True)
        p.add_argument("--prompt-len", type=int, default=128)
        p.add_argument("--output-len", type=int, default=64)
        p.add_argument("--out", required=True)
    p = sub.add_parser("table")
    p.add_argument("--dir", required=True)
    args = parser.parse_args(argv)
    handlers = {"wait": _wait, "parity": _parity, "sweep": _sweep, "hf-static": _hf_static}
    return handlers.get(args.command, _table)(args)


if __name__ == "__main__":
    sys.exit(main())
