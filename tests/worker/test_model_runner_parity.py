"""The model runner against transformers: same greedy tokens, same logprobs.

A small in-test scheduler drives the runner with real SchedulerOutput deltas: requests join at
different steps, prefill whole or in chunks, take their blocks from a shuffled free list (so
block tables are not contiguous), decode, finish and hand their blocks back.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch

from switchboard.config import ModelConfig
from switchboard.models.cpu_kernel_attention import KERNEL_MAX_CONTEXT
from switchboard.wire.engine_msgs import SamplingParams
from switchboard.wire.step_msgs import CachedRequest, NewRequest, SchedulerOutput
from switchboard.worker.model_runner import ModelRunner, StepLogits
from tests.tiny_checkpoint import tiny_llama_dir

BLOCK_SIZE = 4
NUM_BLOCKS = 96
PROMPTS = {
    "short": [0, 17],
    "one-block": [0, 5, 9, 33],
    "several-blocks": [0, *range(40, 63)],  # 24 tokens = 6 blocks before decoding
    "odd": [0, 900, 3, 3, 3, 77, 512, 8, 1000, 64, 2],
    "long": [0, *[(7 * i) % 1000 + 3 for i in range(45)]],
}
LONG_PROMPT = [0, *[(13 * i) % 1000 + 3 for i in range(299)]]


@dataclass
class DrivenRequest:
    request_id: str
    prompt: list[int]
    max_tokens: int
    join_step: int = 0
    output: list[int] = field(default_factory=list)
    logprobs: list[torch.Tensor] = field(default_factory=list)  # log_softmax per sampled token
    block_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    sent: bool = False

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output


class ToyScheduler:
    """Just enough of a scheduler to produce realistic deltas for the runner."""

    def __init__(self, runner: ModelRunner, chunk_size: int | None, seed: int = 0) -> None:
        self.runner = runner
        self.chunk_size = chunk_size
        self.free_blocks = list(range(NUM_BLOCKS))
        random.Random(seed).shuffle(self.free_blocks)

    def run(self, requests: list[DrivenRequest], max_steps: int = 200) -> None:
        finished: list[str] = []
        for step_id in range(max_steps):
            active = [
                r for r in requests if r.join_step <= step_id and len(r.output) < r.max_tokens
            ]
            if not active and not finished:
                if all(len(r.output) >= r.max_tokens for r in requests):
                    return
                continue
            step = SchedulerOutput(step_id=step_id, finished_request_ids=finished)
            for request in active:
                self._schedule(request, step)
            step.total_num_scheduled_tokens = sum(step.num_scheduled_tokens.values())
            result = self.runner.forward_step(step)
            if isinstance(result, StepLogits):
                for request_id, logits in zip(
                    result.inputs.sampled_request_ids, result.logits, strict=True
                ):
                    by_id = {r.request_id: r for r in requests}
                    by_id[request_id].logprobs.append(torch.log_softmax(logits, -1))
            output = self.runner.sample_step(result)
            finished = []
            by_id = {r.request_id: r for r in requests}
            for request_id, sampled in zip(
                output.request_ids, output.sampled_token_ids, strict=True
            ):
                request = by_id[request_id]
                request.num_computed += step.num_scheduled_tokens[request_id]
                request.output.extend(sampled)
                if len(request.output) >= request.max_tokens:
                    self.free_blocks.extend(request.block_ids)
                    finished.append(request_id)
        raise AssertionError("requests did not finish")

    def _schedule(self, request: DrivenRequest, step: SchedulerOutput) -> None:
        remaining = len(request.tokens) - request.num_computed
        n = remaining if self.chunk_size is None else min(remaining, self.chunk_size)
        needed = -(-(request.num_computed + n) // BLOCK_SIZE) - len(request.block_ids)
        new_blocks = [self.free_blocks.pop() for _ in range(max(needed, 0))]
        request.block_ids.extend(new_blocks)
        if not request.sent:
            request.sent = True
            step.new_requests.append(
                NewRequest(
                    request_id=request.request_id,
                    prompt_token_ids=list(request.prompt),
                    sampling_params=SamplingParams(temperature=0.0, max_tokens=request.max_tokens),
                    block_ids=list(request.block_ids),
                    num_computed_tokens=0,
                )
            )
        else:
            step.cached_requests.append(
                CachedRequest(request.request_id, new_blocks, request.num_computed)
            )
        step.num_scheduled_tokens[request.request_id] = n


def reference_generate(model, prompt: list[int], max_tokens: int) -> tuple[list[int], list]:
    input_ids = torch.tensor([prompt])
    out = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),  # else a pad id in the prompt is masked
        max_new_tokens=max_tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    tokens = out.sequences[0, len(prompt) :].tolist()
    return tokens, [torch.log_softmax(step[0].float(), -1) for step in out.logits]


def make_runner(
    model_dir: str, num_blocks: int = NUM_BLOCKS, quantization: str = "auto", **options: str
) -> ModelRunner:
    """``options``: more ModelConfig fields (dtype, kv_cache_dtype)."""
    config = ModelConfig(model=model_dir, quantization=quantization, **options)  # type: ignore[arg-type]
    runner = ModelRunner(config, torch.device("cpu"))
    runner.load_model()
    runner.initialize_kv_cache(num_blocks, BLOCK_SIZE)
    return runner


def load_reference(model_dir: str):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.generation_config.eos_token_id = None  # compare full lengths; we never stop here
    return model


def assert_same_as_reference(requests: list[DrivenRequest], reference) -> None:
    for request in requests:
        expected, expected_logprobs = reference_generate(
            reference, request.prompt, request.max_tokens
        )
        assert request.output == expected, request.request_id
        for ours, theirs in zip(request.logprobs, expected_logprobs, strict=True):
            top = theirs.topk(5)
            torch.testing.assert_close(ours[top.indices], top.values, atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def tiny_dir() -> str:
    return tiny_llama_dir()


@pytest.fixture(scope="module")
def reference(tiny_dir):
    return load_reference(tiny_dir)


@pytest.mark.parametrize("chunk_size", [None, 7], ids=["whole-prefill", "chunked-prefill"])
def test_one_request_at_a_time_matches_transformers(tiny_dir, reference, chunk_size):
    runner = make_runner(tiny_dir)
    for name, prompt in PROMPTS.items():
        request = DrivenRequest(name, prompt, max_tokens=12)
        ToyScheduler(runner, chunk_size).run([request])
        assert_same_as_reference([request], reference)


@pytest.mark.parametrize("chunk_size", [None, 5], ids=["whole-prefill", "chunked-prefill"])
def test_batched_requests_joining_at_different_steps_match_transformers(
    tiny_dir, reference, chunk_size
):
    runner = make_runner(tiny_dir)
    requests = [
        DrivenRequest(name, prompt, max_tokens=10 + 3 * i, join_step=2 * i)
        for i, (name, prompt) in enumerate(PROMPTS.items())
    ]
    ToyScheduler(runner, chunk_size, seed=1).run(requests)
    assert_same_as_reference(requests, reference)
    assert runner.requests == {}  # every finished request's state was dropped


@pytest.mark.parametrize("chunk_size", [None, 100], ids=["whole-prefill", "chunked-prefill"])
def test_a_prompt_past_the_kernels_context_matches_transformers(tiny_dir, reference, chunk_size):
    # 300 tokens: chunks of many tokens over a context past KERNEL_MAX_CONTEXT take SDPA, in a
    # step the one-call decode stack declines (it once left their attention rows unwritten)
    assert len(LONG_PROMPT) > KERNEL_MAX_CONTEXT
    runner = make_runner(tiny_dir)
    request = DrivenRequest("past-the-kernel", LONG_PROMPT, max_tokens=8)
    ToyScheduler(runner, chunk_size).run([request])
    assert_same_as_reference([request], reference)


def test_prefill_in_two_chunks_samples_only_after_the_last(tiny_dir):
    runner = make_runner(tiny_dir)
    prompt = PROMPTS["several-blocks"]
    params = SamplingParams(temperature=0.0)
    first = SchedulerOutput(
        step_id=0,
        new_requests=[NewRequest("r", prompt, params, [10, 11, 12], 0)],
        num_scheduled_tokens={"r": 12},
        total_num_scheduled_tokens=12,
    )
    second = SchedulerOutput(
        step_id=1,
        cached_requests=[CachedRequest("r", [13, 14, 15], 12)],
        num_scheduled_tokens={"r": len(prompt) - 12},
        total_num_scheduled_tokens=len(prompt) - 12,
    )
    assert runner.execute_model(first).sampled_token_ids == [[]]
    output = runner.execute_model(second)
    assert output.request_ids == ["r"] and len(output.sampled_token_ids[0]) == 1


@pytest.mark.parametrize(
    "variant",
    [
        {"tie_word_embeddings": True},
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            "rope_theta": 500000.0,
        },
    ],
    ids=["tied-embeddings", "llama3-rope"],
)
def test_checkpoint_variants_match_transformers(variant):
    model_dir = tiny_llama_dir(seed=3, **variant)
    runner = make_runner(model_dir)
    requests = [
        DrivenRequest(name, prompt, max_tokens=8, join_step=i)
        for i, (name, prompt) in enumerate(PROMPTS.items())
    ]
    ToyScheduler(runner, chunk_size=6).run(requests)
    assert_same_as_reference(requests, load_reference(model_dir))
