"""Constrained-decoding libraries on the default model's vocabulary: llguidance vs xgrammar.

    python bench/structured.py [--model DIR] [--batch 1,16,64] [--steps 40]

What the engine pays per library, on SmolLM2-135M-Instruct's 49,152-token tokenizer:

* ``tokenizer``: building the library's token table from ``tokenizer.json`` (once per engine);
* ``compile``: one typical JSON schema (nested object, array, enum, pattern), cold;
* ``mask/step``: one request's next-token bitmask, median and max over the steps of emitting a
  valid document token by token (``--steps`` tokens);
* ``batch B``: the bitmasks of B requests in one step (each at its own position in the
  document), the way the engine computes them every step: llguidance's ``LLExecutor`` (threads,
  GIL released) and xgrammar's ``BatchGrammarMatcher``; median of 5 steps, every request
  advancing one token between them (a new state each time: no mask is reused).

xgrammar is optional here (``PYTHONPATH`` a ``pip install --no-deps --target`` of it): its
wheel requires torch and imports it at ``import xgrammar``, which the torch-free engine core and
gateway cannot do; it is measured only to show what choosing llguidance costs or saves.
Times in milliseconds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

DEFAULT_MODEL = os.path.expanduser("~/.cache/switchboard/models/SmolLM2-135M-Instruct")

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z0-9.]+@[a-z0-9]+\\.[a-z]{2,4}$"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
DOCUMENT = (
    '{"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "role": "admin", '
    '"tags": ["math", "engines", "poetry"], "address": {"city": "London", "zip": "W1"}}'
)


REPEATS = 5  # batch steps measured (median); every matcher advances one token between them


def _position(i: int, ids: list[int]) -> int:
    """Where request ``i`` of a batch is in the document (REPEATS tokens left after it)."""
    return i % (len(ids) - REPEATS)


def _ms(seconds: float) -> float:
    return seconds * 1e3


def bench_llguidance(model: str, vocab: int, eos: list[int], batches: list[int], steps: int):
    import llguidance
    import llguidance.numpy as lnp
    from tokenizers import Tokenizer

    text = open(os.path.join(model, "tokenizer.json"), encoding="utf-8").read()
    started = time.perf_counter()
    tok = llguidance.LLTokenizer(text, n_vocab=vocab, eos_token=eos)
    t_tok = time.perf_counter() - started
    ids = (
        Tokenizer.from_file(os.path.join(model, "tokenizer.json"))
        .encode(DOCUMENT, add_special_tokens=False)
        .ids[:steps]
    )
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    started = time.perf_counter()
    matcher = llguidance.LLMatcher(tok, grammar)
    t_compile = time.perf_counter() - started
    assert not matcher.is_error(), matcher.get_error()
    mask = lnp.allocate_token_bitmask(1, vocab)
    per_step = []
    for token in ids:
        started = time.perf_counter()
        lnp.fill_next_token_bitmask(matcher, mask)
        per_step.append(time.perf_counter() - started)
        assert matcher.consume_token(token), matcher.get_error()
    executor = llguidance.LLExecutor()
    batch_ms = {}
    for size in batches:
        matchers = []
        template = llguidance.LLMatcher(tok, grammar)
        for i in range(size):
            m = template.deep_copy()
            m.consume_tokens(ids[: _position(i, ids)])
            matchers.append(m)
        masks = lnp.allocate_token_bitmask(size, vocab)
        times = []
        for rep in range(REPEATS):
            started = time.perf_counter()
            lnp.fill_next_token_bitmask_par(
                executor, [(m, i) for i, m in enumerate(matchers)], masks
            )
            times.append(time.perf_counter() - started)
            for i, m in enumerate(matchers):  # a new state for the next step
                assert m.consume_token(ids[_position(i, ids) + rep])
        batch_ms[size] = _ms(statistics.median(times))
    return t_tok, t_compile, per_step, batch_ms


def bench_xgrammar(model: str, vocab: int, eos: list[int], batches: list[int], steps: int):
    import transformers
    import xgrammar as xgr

    hf = transformers.AutoTokenizer.from_pretrained(model)
    started = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=eos)
    t_tok = time.perf_counter() - started
    ids = hf.encode(DOCUMENT, add_special_tokens=False)[:steps]
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    started = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA))
    t_compile = time.perf_counter() - started
    matcher = xgr.GrammarMatcher(compiled)
    mask = xgr.allocate_token_bitmask(1, vocab)
    per_step = []
    for token in ids:
        started = time.perf_counter()
        matcher.fill_next_token_bitmask(mask, 0)
        per_step.append(time.perf_counter() - started)
        assert matcher.accept_token(token)
    batcher = xgr.BatchGrammarMatcher()
    batch_ms = {}
    for size in batches:
        matchers = []
        for i in range(size):
            m = xgr.GrammarMatcher(compiled)
            for token in ids[: _position(i, ids)]:
                m.accept_token(token)
            matchers.append(m)
        masks = xgr.allocate_token_bitmask(size, vocab)
        times = []
        for rep in range(REPEATS):
            started = time.perf_counter()
            batcher.batch_fill_next_token_bitmask(matchers, masks)
            times.append(time.perf_counter() - started)
            for i, m in enumerate(matchers):  # a new state for the next step
                assert m.accept_token(ids[_position(i, ids) + rep])
        batch_ms[size] = _ms(statistics.median(times))
    return t_tok, t_compile, per_step, batch_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--batch", default="1,16,64")
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    batches = [int(b) for b in args.batch.split(",")]
    config = json.load(open(os.path.join(args.model, "config.json"), encoding="utf-8"))
    vocab = int(config["vocab_size"])
    eos = config.get("eos_token_id", 0)
    eos = eos if isinstance(eos, list) else [eos]
    print(f"model {args.model}: vocab {vocab}, {os.cpu_count()} CPUs")
    rows = []
    for name, fn in (("llguidance", bench_llguidance), ("xgrammar", bench_xgrammar)):
        try:
            t_tok, t_compile, per_step, batch_ms = fn(args.model, vocab, eos, batches, args.steps)
        except ImportError as exc:
            print(f"{name}: not importable ({exc}); skipped", file=sys.stderr)
            continue
        rows.append(
            [
                name,
                f"{_ms(t_tok):.0f}",
                f"{_ms(t_compile):.1f}",
                f"{_ms(statistics.median(per_step)):.3f}",
                f"{_ms(max(per_step)):.2f}",
            ]
            + [f"{batch_ms[b]:.2f}" for b in batches]
        )
    header = ["library", "tokenizer", "compile", "mask/step p50", "mask/step max"] + [
        f"batch {b}" for b in batches
    ]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    print("  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True)))
    for row in rows:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))


if __name__ == "__main__":
    main()
