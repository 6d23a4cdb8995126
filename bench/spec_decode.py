"""Speculative decoding (n-gram or draft-model proposals) on vs off, on the built-in default
model, in one run.

    .venv/bin/python bench/spec_decode.py                      # c = 1, 4, 16; both workloads
    .venv/bin/python bench/spec_decode.py --concurrency 1 --output-len 64 --json out.json
    .venv/bin/python bench/spec_decode.py --spec '{"method": "ngram", "num_speculative_tokens": 6}'
    .venv/bin/python bench/spec_decode.py --draft DIR          # a draft model instead of n-gram
    .venv/bin/python bench/spec_decode.py --draft self         # the model as its own draft
    .venv/bin/python bench/spec_decode.py --base-rev HEAD~1    # and "on" as the revision before

``--draft self`` makes the default model its own draft: every proposal is accepted, but the
draft costs as much as the model, so it measures the mechanism's cost, never a speed-up (the
default model has no smaller sibling with its tokenizer here).

Servers side by side, the same flags but ``--speculative-config``: off and on (default
``{"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 4,
"prompt_lookup_min": 1}``: a request's proposals start at 4 tokens and grow to 8 while all are
accepted; several ``--spec`` values, and ``--draft``, are each a server of their
own, so variants compare in one run: ``--spec A B --draft DIR``). Each level (a workload at a
concurrency c: a closed loop of c clients, each sending its next request when its last one ends,
greedy) runs on one server, then the next, ``--rounds`` times in alternation, and each side's
best round is reported: on a machine others share, the load drifts over minutes, and
alternating keeps every side under the same drift. Only one server computes at a time. The
workloads:

* **repetitive**, built from real text (this repository's own documents and code): summarise a
  document quoting its sentences, edit a piece of code (rename a function and give the whole code
  back), reformat a JSON record. The model copies long runs of its prompt: n-gram proposals are
  accepted;
* **random**: prompts of random token ids (the vs_vllm kit's workload) with ``ignore_eos``,
  greedy. Meant as output that repeats nothing, but the default model's greedy answers to such
  prompts fall into loops, which the proposer copies;
* **sampled**: the same prompts sampled at temperature 1 (a seed per request, the same on and
  off: a seeded request's tokens are the same with speculation on or off): the answers do not
  loop, proposals are rarely accepted, so the cost of trying shows.

Printed per workload and c: output tok/s off and on, their ratio, the acceptance rate (accepted /
proposed tokens, from the responses' usage) and whether every output was token-identical on and
off. Output tok/s: all output tokens of the level over its wall time (prompts'
prefill included); decode-only: each request's tokens after its first over its time after its
first (switchboard's side, streamed), the speed-up of decoding itself at c = 1. With
``--vllm-venv`` (vLLM's CPU build, as bench/vs_vllm.py installs it) the same levels run on two
vLLM servers after (``vllm serve`` with and without the same ``--speculative-config``; its
acceptance from its /metrics).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import vllm_http  # bench/vllm_http.py and the modules below: beside this file
import vllm_side
from server_procs import (
    free_port,
    revision_tree,
    start,
    stop_all,
    switchboard_command,
    wait_ready,
    with_services,
)
from serving_clients import HOST, make_prompts

from switchboard.api.v1 import generation_service_pb2 as pb
from switchboard.api.v1 import generation_service_pb2_grpc as pb_grpc

REPO = Path(__file__).resolve().parent.parent
DEFAULT_SPEC = json.dumps(
    {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
)
VOCAB = 49152  # SmolLM2's
RANDOM_PROMPT_LEN = 128
SAMPLED_TEMPERATURE = 1.0


@dataclass
class Workload:
    prompts: list[Any]
    ignore_eos: bool
    temperature: float = 0.0  # above 0: each request seeded with its index in the level


def chat(user: str) -> str:
    """SmolLM2's chat format, one user turn."""
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


def document_excerpts() -> list[str]:
    """Paragraphs of this repository's documentation: real prose to summarise and quote."""
    paragraphs = []
    for name in ("README.md", "docs/architecture.md", "docs/operations.md"):
        path = REPO / name
        if path.exists():
            for block in path.read_text().split("\n\n"):
                text = " ".join(block.split())
                if 400 <= len(text) <= 1200 and not text.startswith(("|", "#", "```")):
                    paragraphs.append(text)
    return paragraphs


def code_excerpts() -> list[tuple[str, str]]:
    """(function source, its name) from this repository's code: real code to edit."""
    found = []
    for name in ("engine/stop_check.py", "wire/block_hash.py", "worker/logprobs.py"):
        source = (REPO / "services/switchboard" / name).read_text()
        for chunk in source.split("\n\n\ndef ")[1:]:
            body = "def " + chunk.split("\n\n\n")[0]
            if 300 <= len(body) <= 1500:
                found.append((body, body[4 : body.index("(")]))
    return found


def json_records() -> list[str]:
    """Records of real values: the served model's config and this repository's defaults."""
    from switchboard.checkpoint import resolve_model
    from switchboard.config import CacheConfig, SchedulerConfig
    from switchboard.config.struct import encode_config

    model_config = json.loads((Path(resolve_model(None)) / "config.json").read_text())
    return [
        encode_config(SchedulerConfig()),
        encode_config(CacheConfig()),
        json.dumps({k: v for k, v in model_config.items() if not isinstance(v, dict)}),
    ]


def repetitive_prompts() -> list[str]:
    """Each task in SmolLM2's chat format, with the answer's first words given (a model of 135M
    parameters does the task then, where asked alone it often writes about something else):
    the answer goes on copying from the prompt, as a larger model's answer would."""
    documents, edits, records = [], [], []
    for text in document_excerpts()[:6]:
        first_words = " ".join(text.split()[:4])
        documents.append(
            chat(
                "Summarise this document in two sentences, quoting its most important "
                f"sentence word for word.\n\nDocument:\n{text}"
            )
            + f'The document says: "{first_words}'
        )
    for code, name in code_excerpts()[:6]:
        edits.append(
            chat(
                f"Rename the function `{name}` to `{name}_v2` and give back the whole code, "
                f"unchanged otherwise.\n\n```python\n{code}\n```"
            )
            + f"```python\ndef {name}_v2("
        )
    for record in json_records():
        records.append(
            chat(f"Reformat this JSON record with one key per line, indented by 2:\n{record}")
            + '```json\n{\n  "'
        )
    # interleaved, so that every level has each kind of task
    return [p for kinds in zip(documents, edits, records * 2, strict=False) for p in kinds]


@dataclass
class Result:
    token_ids: list[int] = field(default_factory=list)
    draft_tokens: float = 0
    accepted_tokens: float = 0
    decode_s: float | None = None  # first token to last (None: not streamed)


class SbGenerate:
    """Completions (greedy, or sampled with a seed) from switchboard's GenerationService
    (gRPC), with each one's proposed and accepted tokens from its usage."""

    def __init__(self, port: int) -> None:
        self.channel = grpc.aio.insecure_channel(f"{HOST}:{port}")
        self.stub = pb_grpc.GenerationServiceStub(self.channel)

    async def __call__(
        self,
        prompt: str | list[int],
        max_tokens: int,
        ignore_eos: bool,
        temperature: float = 0.0,
        seed: int | None = None,
    ) -> Result:
        request = pb.GenerateRequest(
            sampling=pb.SamplingParams(temperature=temperature, seed=seed),
            stopping=pb.StoppingCriteria(max_tokens=max_tokens, ignore_eos=ignore_eos),
            output=pb.OutputOptions(return_token_ids=True),
        )
        if isinstance(prompt, str):
            request.text = prompt
        else:
            request.token_ids.ids.extend(prompt)
        result = Result()
        first = 0.0
        async for response in self.stub.Generate(request):
            for output in response.outputs:
                if output.token_ids and not result.token_ids:
                    first = time.perf_counter()
                result.token_ids += output.token_ids
            if response.HasField("usage"):
                result.draft_tokens = response.usage.spec_draft_tokens
                result.accepted_tokens = response.usage.spec_accepted_tokens
        result.decode_s = time.perf_counter() - first if result.token_ids else None
        return result

    async def spec_counters(self) -> tuple[float, float]:
        return 0.0, 0.0  # counted per response instead

    async def close(self) -> None:
        await self.channel.close()


class VllmGenerate:
    """Completions (greedy, or sampled with a seed) from vLLM's /v1/completions (not streamed:
    the token ids at the end); its speculative counters come from /metrics, read around each
    level."""

    def __init__(self, port: int, model: str) -> None:
        self.port, self.model = port, model

    async def _request(self, method: str, path: str, body: bytes = b"") -> bytes:
        conn = vllm_http.HttpConnection(HOST, self.port)
        try:
            return b"".join([piece async for piece in conn.request(method, path, body)])
        finally:
            await conn.close()

    async def __call__(
        self,
        prompt: str | list[int],
        max_tokens: int,
        ignore_eos: bool,
        temperature: float = 0.0,
        seed: int | None = None,
    ) -> Result:
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "ignore_eos": ignore_eos,
            "return_token_ids": True,
        }
        if seed is not None:
            body["seed"] = seed
        path = "/v1/completions"
        reply = json.loads(await self._request("POST", path, json.dumps(body).encode()))
        return Result(token_ids=list(reply["choices"][0].get("token_ids") or []))

    async def spec_counters(self) -> tuple[float, float]:
        """(draft tokens, accepted tokens) so far; (0, 0) without speculation."""
        text = (await self._request("GET", "/metrics")).decode()
        names = (
            "vllm:spec_decode_num_draft_tokens_total",
            "vllm:spec_decode_num_accepted_tokens_total",
        )
        totals = [0.0, 0.0]
        for line in text.splitlines():
            for i, name in enumerate(names):
                if line.startswith(name):
                    totals[i] += float(line.rsplit(" ", 1)[1])
        return totals[0], totals[1]

    async def close(self) -> None:
        pass


Generate = SbGenerate | VllmGenerate


async def closed_loop(
    generate: Generate, prompts: list[Any], concurrency: int, max_tokens: int, workload: Workload
) -> tuple[list[Result], float]:
    results: list[Result | None] = [None] * len(prompts)
    todo = iter(range(len(prompts)))
    sampled = workload.temperature > 0.0

    async def client() -> None:
        for i in todo:
            results[i] = await generate(
                prompts[i],
                max_tokens,
                workload.ignore_eos,
                workload.temperature,
                i if sampled else None,
            )

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    wall = time.perf_counter() - started
    return [r for r in results if r is not None], wall


def level_prompts(base: list[Any], concurrency: int, min_requests: int) -> list[Any]:
    """Two rounds of the closed loop, at least ``min_requests``, cycling through the workload's
    prompts."""
    n = max(min_requests, 2 * concurrency)
    return [base[i % len(base)] for i in range(n)]


async def start_server(
    kind: str, label: str, variant: Variant, args: argparse.Namespace, log_dir: Path
) -> tuple[Any, Generate]:
    """A switchboard or vLLM server, ready, and its generate function."""
    spec, services = variant
    port = free_port()
    if kind == "switchboard":
        cmd = [
            *switchboard_command(), "serve", "--host", HOST, "--port", str(port),
            "--http-port", "-1", "--seed", "0", "--max-model-len", "2048",
        ]  # fmt: skip
        env = with_services(dict(os.environ), services)
        model = args.model_dir
    else:
        # vLLM gets the converted checkpoint without the GGUF file's raw blocks (vs_vllm.py)
        model = vllm_side.checkpoint_view(args.model_dir, args.vllm_cache)
        cmd = vllm_side.command(args.vllm_venv, model, port, 2048, "float32")
        env = vllm_side.environment(args.vllm_cache)
    if spec:
        cmd += ["--speculative-config", spec]
    log = log_dir / f"{kind}_{label}.log"
    shown = " ".join(c if len(c) < 120 else "LAUNCHER" for c in cmd)
    print(f"[{kind} {label}] {shown}  (log {log})", file=sys.stderr, flush=True)
    server = start(kind, cmd, env, log, port)
    await wait_ready(server)
    if kind == "switchboard":
        return server, SbGenerate(port)
    return server, VllmGenerate(port, model)


async def run_level(
    generate: Generate, workload: Workload, c: int, args: argparse.Namespace
) -> dict[str, Any]:
    level = level_prompts(workload.prompts, c, args.min_requests)
    before = await generate.spec_counters()
    results, wall = await closed_loop(generate, level, c, args.output_len, workload)
    after = await generate.spec_counters()
    tokens = sum(len(r.token_ids) for r in results)
    timed = [r for r in results if r.decode_s]
    decode_s = sum(r.decode_s or 0.0 for r in timed)
    return {
        "tok_s": tokens / wall,
        # each request's tokens after its first over the time after its first (c = 1: the
        # decode speed without the prompt's prefill); None where the client cannot see it
        "decode_tok_s": sum(len(r.token_ids) - 1 for r in timed) / decode_s if timed else None,
        "tokens": tokens,
        "wall_s": wall,
        "draft_tokens": sum(r.draft_tokens for r in results) + after[0] - before[0],
        "accepted_tokens": sum(r.accepted_tokens for r in results) + after[1] - before[1],
        "outputs": [r.token_ids for r in results],
    }


async def run_both(
    kind: str, args: argparse.Namespace, workloads: dict[str, Workload], log_dir: Path
) -> dict[str, dict[str, Any]]:
    """Every level on both servers of ``kind``, alternated ``--rounds`` times; each side's
    best round (with every round's tok/s under ``rounds``)."""
    servers = []
    variants = spec_variants(args.specs)
    if args.base_rev and kind == "switchboard":
        base = revision_tree(REPO, args.base_rev, log_dir)
        variants.update({f"{label}@base": (spec, base) for label, (spec, _) in variants.items()})
    best: dict[str, dict[str, Any]] = {"off": {}, **{label: {} for label in variants}}
    try:
        for label, variant in {"off": ("", None), **variants}.items():
            servers.append(await start_server(kind, label, variant, args, log_dir))
        sides = {label: generate for label, (_, generate) in zip(best, servers, strict=True)}
        for generate in sides.values():
            await generate(chat("Hello"), 8, False)  # warm-up
        for name, workload in workloads.items():
            for c in args.concurrency:
                key = f"{name}/{c}"
                for round_ in range(args.rounds):
                    for label, generate in sides.items():
                        level = await run_level(generate, workload, c, args)
                        kept = best[label].get(key)
                        rounds = [*(kept["rounds"] if kept else []), level["tok_s"]]
                        if kept is None or level["tok_s"] > kept["tok_s"]:
                            best[label][key] = kept = level
                        kept["rounds"] = rounds
                        print(
                            f"[{kind} {label}] {name} c={c} round {round_ + 1}: "
                            f"{level['tok_s']:.1f} tok/s",
                            file=sys.stderr,
                            flush=True,
                        )
    finally:
        for server, generate in servers:
            await generate.close()
            server.stop()
    return best


# a server's --speculative-config ("": off) and the code it runs (None: this tree, else a
# revision's services folder)
Variant = tuple[str, Path | None]


def spec_variants(specs: list[str]) -> dict[str, Variant]:
    """Each --speculative-config to measure, by its label: "on", or "on1", "on2" ..."""
    if len(specs) == 1:
        return {"on": (specs[0], None)}
    return {f"on{i + 1}": (spec, None) for i, spec in enumerate(specs)}


def print_table(off: dict[str, Any], on: dict[str, Any]) -> None:
    print(
        f"{'workload':<11} {'c':>3} {'off tok/s':>10} {'on tok/s':>10} {'on/off':>7} "
        f"{'accepted':>9} {'identical':>9} {'decode-only on/off':>19}"
    )
    for key, base in off.items():
        name, c = key.split("/")
        spec = on[key]
        rate = spec["accepted_tokens"] / spec["draft_tokens"] if spec["draft_tokens"] else 0.0
        same = "yes" if base["outputs"] == spec["outputs"] else "NO"
        decode = "-"
        if base.get("decode_tok_s") and spec.get("decode_tok_s"):
            off_s, on_s = base["decode_tok_s"], spec["decode_tok_s"]
            decode = f"{off_s:.1f} -> {on_s:.1f} {on_s / off_s:.2f}x"
        print(
            f"{name:<11} {c:>3} {base['tok_s']:>10.1f} {spec['tok_s']:>10.1f} "
            f"{spec['tok_s'] / base['tok_s']:>6.2f}x {rate:>8.0%} {same:>9} {decode:>19}"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--output-len", type=int, default=96)
    parser.add_argument(
        "--spec",
        nargs="+",
        help="--speculative-config when on (several: each a server of its own, all alternated "
        f"with off; default {DEFAULT_SPEC})",
    )
    parser.add_argument(
        "--draft",
        help="a draft model's checkpoint directory ('self': the model itself); with --spec, a "
        "variant more, else instead of the default n-gram config",
    )
    parser.add_argument("--draft-tokens", type=int, default=4, help="its num_speculative_tokens")
    parser.add_argument("--workloads", nargs="+", default=["repetitive", "random", "sampled"])
    parser.add_argument("--rounds", type=int, default=2, help="alternations per level")
    parser.add_argument("--min-requests", type=int, default=6, help="requests per level")
    parser.add_argument("--json", type=Path, help="write every number here")
    parser.add_argument(
        "--base-rev",
        help="also each on variant served from this git revision (LABEL@base), alternated "
        "with the rest: a change to speculation against the code before it, in one run",
    )
    parser.add_argument(
        "--vllm-venv", type=Path, help="then vLLM's CPU build too, from this venv (vs_vllm.py)"
    )
    parser.add_argument(
        "--vllm-cache", type=Path, default=Path("~/.cache/switchboard/vllm-cpu-cache")
    )
    args = parser.parse_args()
    from switchboard.checkpoint import resolve_model

    args.model_dir = resolve_model(None)
    args.specs = list(args.spec or ([] if args.draft else [DEFAULT_SPEC]))
    if args.draft:
        draft_dir = args.model_dir if args.draft == "self" else args.draft
        args.specs.append(
            json.dumps({"model": draft_dir, "num_speculative_tokens": args.draft_tokens})
        )
    random_prompts = make_prompts(8, RANDOM_PROMPT_LEN, VOCAB, "spec-decode")
    all_workloads = {
        "repetitive": Workload(repetitive_prompts(), ignore_eos=False),
        "random": Workload(random_prompts, ignore_eos=True),
        "sampled": Workload(random_prompts, ignore_eos=True, temperature=SAMPLED_TEMPERATURE),
    }
    workloads = {name: all_workloads[name] for name in args.workloads}
    kinds = ["switchboard"]
    if args.vllm_venv:
        kinds.append("vllm")
        args.vllm_venv, args.vllm_cache = args.vllm_venv.expanduser(), args.vllm_cache.expanduser()
    log_dir = Path(tempfile.mkdtemp(prefix="spec-decode-bench-"))
    results = {}
    try:
        for kind in kinds:
            results[kind] = asyncio.run(run_both(kind, args, workloads, log_dir))
    finally:
        stop_all()
    print(
        f"\noutput up to {args.output_len} tokens, greedy (sampled: temperature "
        f"{SAMPLED_TEMPERATURE}, seeded); best of {args.rounds} alternated rounds"
    )
    for kind, both in results.items():
        for label in both:
            if label == "off":
                continue
            spec = spec_variants(args.specs)[label.removesuffix("@base")][0]
            served = f" (git revision {args.base_rev})" if label.endswith("@base") else ""
            print(f"\n{kind}, {label}{served}: --speculative-config '{spec}'")
            print_table(both["off"], both[label])
    if args.json:
        specs = {label: spec for label, (spec, _) in spec_variants(args.specs).items()}
        args.json.write_text(json.dumps({"specs": specs, **results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
