"""The built-in default model (SmolLM2-135M-Instruct: Q4_1 layers, a Q8_0 embedding tied to
the LM head) served quantized, as ``auto`` does, against its float32 weights, on three prompts
batched and prefilled in chunks, 32 greedy tokens each: with the default kernel (integer dot
products, the rows quantized to int8) the float32 tokens except where its best two nearly tie,
and log-probabilities within the stated bound; with ``SWITCHBOARD_QUANT_GEMM=exact`` the same
tokens and the same logits bit for bit.

Slow: it needs the converted model in the real cache (``resolve_model(None)`` fetches and
converts it once per machine) and runs a 30-layer model on CPU twice.
"""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer

from switchboard.checkpoint import resolve_model
from switchboard.kernels import quant_gemm
from tests.models.near_ties import agreed_tokens
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


@pytest.fixture(scope="module")
def float32_tokens() -> list[DrivenRequest]:
    with pytest.MonkeyPatch.context() as monkeypatch:
        return _greedy(resolve_model(None), "none", monkeypatch)[1]


# The default kernel's rounding of the rows to 8 bits (in the layers: the LM head's share is
# small) moves SmolLM2's five best log-probabilities by up to 0.37 on these prompts (the best
# one's by 0.18), and parts a sequence where the float32 model's best two were 0.22 apart
TIE = 0.5


def test_with_integer_dot_products_greedy_agrees_except_near_ties(monkeypatch, float32_tokens):
    monkeypatch.setenv("SWITCHBOARD_QUANT_GEMM", "auto")
    quantization, quantized = _greedy(resolve_model(None), "auto", monkeypatch)
    assert quantization == "gguf Q4_1, Q8_0"
    assert quant_gemm.variant() in quant_gemm.DOT_VARIANTS
    assert agreed_tokens(quantized, float32_tokens, TIE, TIE) >= MAX_TOKENS


def test_exact_kernel_decodes_its_float32_tokens_and_logits(monkeypatch, float32_tokens):
    monkeypatch.setenv("SWITCHBOARD_QUANT_GEMM", "exact")
    quantization, quantized = _greedy(resolve_model(None), "auto", monkeypatch)
    assert quantization == "gguf Q4_1, Q8_0"
    for ours, theirs in zip(quantized, float32_tokens, strict=True):
        assert ours.output == theirs.output, ours.request_id
        assert all(map(torch.equal, ours.logprobs, theirs.logprobs)), ours.request_id
