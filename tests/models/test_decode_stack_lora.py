"""The one-call decode stack with rows of LoRA adapters: a decode step mixing base-model rows and
two adapters stays in the stack and gives the layer-by-layer path's logits bit for bit (the
projections' hooks call the same C delta kernel), and the torch delta's to rounding with the
same greedy tokens; without the C delta kernel such a step goes to the layers."""

from __future__ import annotations

import pytest
import torch

from switchboard.config import ModelConfig
from switchboard.config.lora import LoraConfig
from switchboard.kernels import decode_stack, lora_delta
from switchboard.wire.step_msgs import SchedulerOutput
from switchboard.worker.model_runner import ModelRunner
from tests.models.test_decode_stack import _run, _stack_calls, _steps
from tests.tiny_checkpoint import tiny_checkpoint_dir
from tests.tiny_lora import tiny_lora_dir
from tests.worker.test_model_runner_parity import BLOCK_SIZE

ROWS = 6  # base, r8, r16, base, r8, r16
ADAPTERS = ["", "all-r8", "some-r16"]


def _runner(model_dir: str, adapters: dict[str, str]) -> ModelRunner:
    lora = LoraConfig(enable_lora=True, max_loras=2, max_lora_rank=16)
    runner = ModelRunner(ModelConfig(model=model_dir, lora=lora), torch.device("cpu"))
    runner.load_model()
    runner.initialize_kv_cache(ROWS * 10, BLOCK_SIZE)
    assert runner.lora is not None
    for name, path in adapters.items():
        runner.lora.manager.add(name, path)
    return runner


def _adapter_steps(vocab: int, decode_steps: int) -> list[SchedulerOutput]:
    steps = _steps(ROWS, vocab, decode_steps, seed=11)
    for i, new in enumerate(steps[0].new_requests):
        new.lora_name = ADAPTERS[i % len(ADAPTERS)]
    return steps


@pytest.fixture(scope="module")
def checkpoint() -> tuple[str, dict[str, str]]:
    base_dir = tiny_checkpoint_dir("qwen2")  # QKV biases: the delta lands after the bias
    adapters = {
        "all-r8": tiny_lora_dir(base_dir, rank=8, alpha=16.0, seed=1),
        "some-r16": tiny_lora_dir(
            base_dir, rank=16, alpha=8.0, targets=["q_proj", "v_proj", "up_proj"], seed=2
        ),
    }
    return base_dir, adapters


def test_adapter_rows_stay_in_the_stack_bit_identical_to_the_layers(checkpoint, monkeypatch):
    base_dir, adapters = checkpoint
    stacked, layered = _runner(base_dir, adapters), _runner(base_dir, adapters)
    assert lora_delta.status() == "in use", lora_delta.status()
    steps = _adapter_steps(stacked.summary().vocab_size, decode_steps=3)
    calls = _stack_calls(monkeypatch)
    got = _run(stacked, steps, True, monkeypatch)
    # the prompt step (~135 rows) goes to the stack where it takes that many rows (512 with AVX2
    # alone), else to the layers
    prompt_rows = steps[0].total_num_scheduled_tokens
    assert calls == [prompt_rows <= decode_stack.MAX_ROWS] + [True] * 3
    expected = _run(layered, steps, False, monkeypatch)
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)


def test_equal_to_the_torch_delta_to_rounding(checkpoint, monkeypatch):
    base_dir, adapters = checkpoint
    stacked = _runner(base_dir, adapters)
    steps = _adapter_steps(stacked.summary().vocab_size, decode_steps=3)
    got = _run(stacked, steps, True, monkeypatch)
    torch_delta = _runner(base_dir, adapters)
    calls = _stack_calls(monkeypatch)
    lora_delta.unload()
    try:
        expected = _run(torch_delta, steps, True, monkeypatch)
    finally:
        assert lora_delta.load()
    assert calls == []  # no C delta: the model leaves the adapter rows to the layers
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        assert torch.equal(a.argmax(-1), b.argmax(-1))
    # the adapters change the logits: the same prompts on the base model give others on the
    # adapter rows and the same on the base rows
    stacked.execute_model(
        SchedulerOutput(step_id=99, finished_request_ids=[f"r{i}" for i in range(ROWS)])
    )
    base = _run(stacked, _steps(ROWS, stacked.summary().vocab_size, 3, seed=11), True, monkeypatch)
    assert torch.equal(base[-1][0::3], got[-1][0::3])
    for row in (1, 2, 4, 5):
        assert not torch.allclose(base[-1][row], got[-1][row], atol=1e-3), row
