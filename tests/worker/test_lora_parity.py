"""LoRA adapters against transformers + peft: the same greedy tokens for every adapter, in one
batch that mixes base-model requests and two adapters.

The adapters are written by peft (``tests/tiny_lora.py``) with random non-zero ``lora_B``, on
tiny random Llama, Qwen2 and GPT-2 checkpoints; rank 8 on every projection and rank 16 (rsLoRA)
on a subset that splits the fused q/k/v and gate/up projections (GPT-2: ``c_attn``, one module
over the fused q/k/v, and the MLP's ``c_proj`` but not the attention's). The runner is driven
by the toy scheduler of the runner's parity tests: requests join at different steps, prefill
whole or in chunks, and decode together with requests of the base model and of the other adapter.
"""

from __future__ import annotations

import pytest
import torch

from switchboard.config import ModelConfig
from switchboard.config.lora import LoraConfig
from switchboard.wire.step_msgs import SchedulerOutput
from switchboard.worker.model_runner import ModelRunner
from tests.tiny_checkpoint import tiny_checkpoint_dir
from tests.tiny_lora import load_peft_reference, peft_generate, tiny_lora_dir
from tests.worker.test_model_runner_parity import (
    BLOCK_SIZE,
    NUM_BLOCKS,
    PROMPTS,
    DrivenRequest,
    ToyScheduler,
)

ADAPTERS = {
    "all-r8": dict(rank=8, alpha=16.0, seed=1),
    "some-r16": dict(
        rank=16,
        alpha=8.0,
        targets=["q_proj", "v_proj", "up_proj", "down_proj"],
        use_rslora=True,
        seed=2,
    ),
}
# GPT-2's Conv1D projections; PEFT's "c_proj" is both attn.c_proj and mlp.c_proj
GPT2_ADAPTERS = {
    "all-r8": dict(rank=8, alpha=16.0, targets=["c_attn", "c_proj", "c_fc"], seed=1),
    "some-r16": dict(rank=16, alpha=8.0, targets=["c_attn", "mlp.c_proj"], use_rslora=True, seed=2),
}


class AdapterScheduler(ToyScheduler):
    """The toy scheduler, sending each request's adapter with it."""

    def __init__(self, runner: ModelRunner, chunk_size: int | None, adapters: dict[str, str]):
        super().__init__(runner, chunk_size, seed=3)
        self.adapters = adapters  # request id -> adapter name ("" = base)

    def _schedule(self, request: DrivenRequest, step: SchedulerOutput) -> None:
        super()._schedule(request, step)
        for new in step.new_requests:
            if new.request_id == request.request_id:
                new.lora_name = self.adapters[request.request_id]


def lora_runner(model_dir: str, max_loras: int, **adapters: str) -> ModelRunner:
    lora = LoraConfig(enable_lora=True, max_loras=max_loras, max_lora_rank=16)
    runner = ModelRunner(ModelConfig(model=model_dir, lora=lora), torch.device("cpu"))
    runner.load_model()
    runner.initialize_kv_cache(NUM_BLOCKS, BLOCK_SIZE)
    assert runner.lora is not None
    for name, path in adapters.items():
        runner.lora.manager.add(name, path)
    return runner


@pytest.fixture(scope="module", params=["llama", "qwen2", "gpt2"])
def family(request) -> tuple[str, dict[str, str], object]:
    base_dir = tiny_checkpoint_dir(request.param)
    settings = GPT2_ADAPTERS if request.param == "gpt2" else ADAPTERS
    adapters = {name: tiny_lora_dir(base_dir, **kwargs) for name, kwargs in settings.items()}
    return base_dir, adapters, load_peft_reference(base_dir, adapters)


@pytest.mark.parametrize("chunk_size", [None, 5], ids=["whole-prefill", "chunked-prefill"])
def test_one_batch_of_base_and_two_adapters_matches_peft(family, chunk_size):
    base_dir, adapter_dirs, reference = family
    runner = lora_runner(base_dir, max_loras=2, **adapter_dirs)
    names = ["", "all-r8", "some-r16"]
    requests, adapter_of = [], {}
    for i, (prompt_name, prompt) in enumerate(PROMPTS.items()):
        for j, adapter in enumerate(names):
            request_id = f"{prompt_name}/{adapter or 'base'}"
            requests.append(DrivenRequest(request_id, prompt, max_tokens=8, join_step=i + j))
            adapter_of[request_id] = adapter
    AdapterScheduler(runner, chunk_size, adapter_of).run(requests)
    outputs: dict[str, dict[str, list[int]]] = {}
    for request in requests:
        adapter = adapter_of[request.request_id]
        expected = peft_generate(reference, adapter, request.prompt, request.max_tokens)
        assert request.output == expected, request.request_id
        outputs.setdefault(request.request_id.split("/")[0], {})[adapter] = request.output
    # the adapters change what the model says: a test of no-op adapters would prove nothing
    changed = [p for p, by in outputs.items() if len({tuple(t) for t in by.values()}) == 3]
    assert len(changed) >= 3, outputs


def test_more_adapters_than_slots_take_turns(family):
    """One slot: each step runs one adapter (and the base), so the adapters are swapped in and
    out between steps; every request still gets its own adapter's tokens."""
    base_dir, adapter_dirs, reference = family
    runner = lora_runner(base_dir, max_loras=1, **adapter_dirs)
    prompt = PROMPTS["odd"]
    for adapter in ["all-r8", "some-r16", "all-r8", ""]:
        request = DrivenRequest(f"r-{adapter}", prompt, max_tokens=6)
        AdapterScheduler(runner, None, {request.request_id: adapter}).run([request])
        assert request.output == peft_generate(reference, adapter, prompt, 6), adapter


def test_adapters_survive_a_reload_of_the_weights(family):
    """A deep sleep drops the weights and wake_up loads them again: the adapters known before
    are served after, read again from their directories."""
    base_dir, adapter_dirs, reference = family
    runner = lora_runner(base_dir, max_loras=2, **adapter_dirs)
    runner.model = None
    runner.load_model()
    assert runner.lora is not None and runner.lora.manager.names() == sorted(adapter_dirs)
    prompt = PROMPTS["one-block"]
    request = DrivenRequest("after-reload", prompt, max_tokens=6)
    AdapterScheduler(runner, None, {request.request_id: "some-r16"}).run([request])
    assert request.output == peft_generate(reference, "some-r16", prompt, 6)
