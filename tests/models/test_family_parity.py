"""Every model family against transformers, through the model runner: identical greedy tokens
and top-5 logprobs within 1e-4 (float32), one request at a time and batched.

Each family gets a tiny random checkpoint written by transformers itself (tests/tiny_checkpoint.py),
and the runner is driven by the same toy scheduler as the Llama parity tests: prompts that fill
several KV blocks, requests joining at different steps, whole and chunked prefills, shuffled
block tables. The sliding-window variants use a window shorter than the prompts.
"""

from __future__ import annotations

import pytest
import torch

from tests.tiny_checkpoint import tiny_checkpoint_dir
from tests.worker.test_model_runner_parity import (
    PROMPTS,
    DrivenRequest,
    ToyScheduler,
    assert_same_as_reference,
    make_runner,
)

# (family, builder arguments): each a checkpoint shape the family must get exactly right.
VARIANTS = {
    "qwen2": ("qwen2", {}),
    "qwen2-sliding-window": ("qwen2", {"sliding_window": 6, "max_window_layers": 1}),
    "qwen2-tied": ("qwen2", {"tie_word_embeddings": True, "seed": 1}),
    "mistral-sliding-window": ("mistral", {}),
    "mistral-no-window-head-dim": ("mistral", {"sliding_window": None, "head_dim": 8}),
    "gpt2": ("gpt2", {}),
    "gpt2-untied-exact-gelu": (
        "gpt2",
        {"tie_word_embeddings": False, "activation_function": "gelu"},
    ),
}


def load_reference(model_dir: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.generation_config.eos_token_id = None  # compare full lengths; we never stop here
    return model.eval()


@pytest.fixture(scope="module", params=list(VARIANTS))
def checkpoint(request) -> tuple[str, object]:
    family, kwargs = VARIANTS[request.param]
    model_dir = tiny_checkpoint_dir(family, **kwargs)
    return model_dir, load_reference(model_dir)


def test_one_request_at_a_time_matches_transformers(checkpoint):
    model_dir, reference = checkpoint
    runner = make_runner(model_dir)
    for name, prompt in PROMPTS.items():
        request = DrivenRequest(name, prompt, max_tokens=12)
        ToyScheduler(runner, chunk_size=None).run([request])
        assert_same_as_reference([request], reference)


def test_batched_requests_with_chunked_prefill_match_transformers(checkpoint):
    model_dir, reference = checkpoint
    runner = make_runner(model_dir)
    requests = [
        DrivenRequest(name, prompt, max_tokens=10 + 3 * i, join_step=2 * i)
        for i, (name, prompt) in enumerate(PROMPTS.items())
    ]
    ToyScheduler(runner, chunk_size=5, seed=1).run(requests)
    assert_same_as_reference(requests, reference)
    assert runner.requests == {}
