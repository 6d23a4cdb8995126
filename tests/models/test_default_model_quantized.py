"""The built-in default model (SmolLM2-135M-Instruct: Q4_1 layers, a Q8_0 embedding tied to
the LM head) served quantized, as ``auto`` does, against its float32 weights: the same 32
greedy tokens and the same logits on three prompts, batched and prefilled in chunks.

Slow: it needs the converted model in the real cache (``resolve_model(None)`` fetches and
converts it once per machine) and runs a 30-layer model on CPU twice.
"""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer

from switchboard.checkpoint import resolve_model
from tests.models.test_default_model_parity import PROMPTS
from tests.worker.test_model_runner_parity import DrivenRequest, ToyScheduler, make_runner

pytestmark = pytest.mark.slow

MAX_TOKENS = 32


def _greedy(model_dir: str, quantization: str, monkeypatch) -> tuple[str, list[DrivenRequest]]:
    tokenizer = Tokenizer.from_file(f"{model_dir}/tokenizer.json")
    requests = [
        DrivenRequest(f"prompt-{i}", tokenizer.encode(text).ids, MAX_TOKENS, join_step=i)
        for i, text in enumerate(PROMPTS)
    ]
    runner = make_runner(model_dir, quantization=quantization)
    ToyScheduler(runner, chunk_size=8).run(requests)
    return runner.summary().quantization, requests


def test_quantized_default_model_decodes_its_float32_tokens(monkeypatch):
    model_dir = resolve_model(None)
    _, float32 = _greedy(model_dir, "none", monkeypatch)
    quantization, quantized = _greedy(model_dir, "auto", monkeypatch)
    assert quantization == "gguf Q4_1, Q8_0"
    for ours, theirs in zip(quantized, float32, strict=True):
        assert ours.output == theirs.output, ours.request_id
        assert all(map(torch.equal, ours.logprobs, theirs.logprobs)), ours.request_id
