"""Speculative decoding on the built-in default model (SmolLM2-135M-Instruct): asked to copy a
paragraph it was given, the model copies it, the n-gram proposals are mostly accepted, and the
greedy tokens are the same as without speculation.

Slow: it needs the converted model in the real cache and runs a 30-layer model on CPU.
"""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer

from switchboard.checkpoint import resolve_model
from switchboard.wire.engine_msgs import SamplingParams
from tests.worker.spec_decode_loop import run_loop
from tests.worker.test_model_runner_parity import make_runner

pytestmark = pytest.mark.slow

NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4})
NUM_BLOCKS = 128
PARAGRAPH = (
    "The Analytical Engine was a proposed digital mechanical general-purpose computer designed "
    "by the English mathematician and computer pioneer Charles Babbage. It was first described "
    "in 1837 as the successor to Babbage's Difference Engine, which was a design for a simpler "
    "mechanical calculator."
)
TEXT = f"Document:\n{PARAGRAPH}\n\nThe same document, copied word for word:\nThe Analytical"


def test_greedy_tokens_are_the_same_and_proposals_accepted():
    model_dir = resolve_model(None)
    tokenizer = Tokenizer.from_file(f"{model_dir}/tokenizer.json")
    prompts = {"copy": tokenizer.encode(TEXT).ids}
    params = SamplingParams(temperature=0.0, max_tokens=40)
    runner = make_runner(model_dir, NUM_BLOCKS)
    off = run_loop(runner, prompts, params, "", num_blocks=NUM_BLOCKS, max_model_len=512)
    on = run_loop(runner, prompts, params, NGRAM, num_blocks=NUM_BLOCKS, max_model_len=512)
    assert on.tokens("copy") == off.tokens("copy")
    assert on.num_accepted_tokens > on.num_draft_tokens // 2
    assert on.steps < off.steps * 2 // 3
