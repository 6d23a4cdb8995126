"""The built-in default model (SmolLM2-135M-Instruct, converted from its GGUF) through our model
runner against transformers on the same checkpoint: identical greedy tokens, top-5 logprobs
within 1e-4 (float32, the quantized decode matmuls' exact kernel), with the requests batched and
their prompts prefilled in chunks.

Slow: it needs the converted model in the real cache (``resolve_model(None)`` fetches and
converts it once per machine) and runs a 30-layer model on CPU.
"""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer

from switchboard.checkpoint import resolve_model
from tests.worker.test_model_runner_parity import (
    DrivenRequest,
    ToyScheduler,
    assert_same_as_reference,
    make_runner,
)

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "<|im_start|>user\nName three colours of the rainbow.<|im_end|>\n<|im_start|>assistant\n",
]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def smollm2_dir() -> str:
    return resolve_model(None)


def test_default_model_matches_transformers(smollm2_dir, monkeypatch):
    from transformers import LlamaForCausalLM

    # decode on the GGUF blocks with the exact kernel (the float32 floats); the default kernel
    # rounds the rows to int8 and agrees except near-ties (test_default_model_quantized.py)
    monkeypatch.setenv("SWITCHBOARD_QUANT_GEMM", "exact")
    tokenizer = Tokenizer.from_file(f"{smollm2_dir}/tokenizer.json")
    requests = [
        DrivenRequest(f"prompt-{i}", tokenizer.encode(text).ids, MAX_TOKENS, join_step=i)
        for i, text in enumerate(PROMPTS)
    ]
    runner = make_runner(smollm2_dir)
    ToyScheduler(runner, chunk_size=8).run(requests)
    del runner

    reference = LlamaForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    reference.generation_config.eos_token_id = None  # compare all 16 tokens
    assert_same_as_reference(requests, reference)
