"""Pooling requests in the decoder runner: chunked prefill, no sampling, beside generation.

The reference is transformers' own final hidden state (after the last norm) of the tiny Llama.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from switchboard.config import ModelConfig
from switchboard.wire.engine_msgs import PoolingParams, PoolingType, SamplingParams
from switchboard.wire.step_msgs import CachedRequest, NewRequest, SchedulerOutput
from switchboard.worker.model_runner import ModelRunner
from tests.tiny_checkpoint import tiny_llama_dir

BLOCK_SIZE = 4
MEAN_PROMPT = [0, *range(40, 53)]  # 14 tokens, pooled in chunks of 6 + 5 + 3
LAST_PROMPT = [0, 900, 3, 77, 512]
GENERATE_PROMPT = [0, 5, 9, 33]


@pytest.fixture(scope="module")
def model_dir() -> str:
    return tiny_llama_dir()


@pytest.fixture(scope="module")
def reference_hidden(model_dir: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def hidden(prompt: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model.model(torch.tensor([prompt])).last_hidden_state[0]

    return hidden


def test_pooling_requests_are_pooled_not_sampled(model_dir: str, reference_hidden) -> None:
    runner = ModelRunner(ModelConfig(model=model_dir), torch.device("cpu"))
    runner.load_model()
    runner.initialize_kv_cache(32, BLOCK_SIZE)
    mean = PoolingParams(PoolingType.MEAN, normalize=True)
    last = PoolingParams(PoolingType.LAST, normalize=False, dimensions=16)
    greedy = SamplingParams(temperature=0.0, max_tokens=4)
    step1 = SchedulerOutput(
        1,
        new_requests=[
            NewRequest("mean", MEAN_PROMPT, SamplingParams(), [0, 1, 2, 3], 0, 0, mean),
            NewRequest("last", LAST_PROMPT, SamplingParams(), [4, 5], 0, 0, last),
            NewRequest("gen", GENERATE_PROMPT, greedy, [6, 7], 0),
        ],
        num_scheduled_tokens={"mean": 6, "last": 5, "gen": 4},
        total_num_scheduled_tokens=15,
    )
    out1 = runner.execute_model(step1)
    assert set(out1.pooled_outputs) == {"last"}
    sampled = dict(zip(out1.request_ids, out1.sampled_token_ids, strict=True))
    assert sampled["mean"] == [] and sampled["last"] == [] and len(sampled["gen"]) == 1

    step2 = SchedulerOutput(
        2,
        cached_requests=[CachedRequest("mean", [], 6), CachedRequest("gen", [], 4)],
        num_scheduled_tokens={"mean": 5, "gen": 1},
        total_num_scheduled_tokens=6,
        finished_request_ids=["last"],
    )
    out2 = runner.execute_model(step2)
    assert out2.pooled_outputs == {}
    step3 = SchedulerOutput(
        3,
        cached_requests=[CachedRequest("mean", [], 11)],
        num_scheduled_tokens={"mean": 3},
        total_num_scheduled_tokens=3,
    )
    out3 = runner.execute_model(step3)
    assert out3.sampled_token_ids == [[]]

    expected_mean = F.normalize(reference_hidden(MEAN_PROMPT).mean(0), dim=0)
    torch.testing.assert_close(torch.tensor(out3.pooled_outputs["mean"]), expected_mean)
    expected_last = reference_hidden(LAST_PROMPT)[-1, :16]
    torch.testing.assert_close(
        torch.tensor(out1.pooled_outputs["last"]), expected_last, atol=1e-5, rtol=1e-5
    )


def test_a_pooling_request_must_start_at_its_first_token(model_dir: str) -> None:
    runner = ModelRunner(ModelConfig(model=model_dir), torch.device("cpu"))
    runner.load_model()
    runner.initialize_kv_cache(8, BLOCK_SIZE)
    step = SchedulerOutput(
        1,
        new_requests=[
            NewRequest("p", LAST_PROMPT, SamplingParams(), [0, 1], 4, 0, PoolingParams())
        ],
        num_scheduled_tokens={"p": 1},
        total_num_scheduled_tokens=1,
    )
    with pytest.raises(ValueError, match="would not be pooled"):
        runner.execute_model(step)
