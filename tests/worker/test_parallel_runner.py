"""Tensor and pipeline parallelism at the model-runner level: the same requests driven through
TP=2, PP=2 and TP=2 x PP=2 runners (gloo processes) give exactly the single-process tokens,
greedy and seeded, with logprobs matching closely.

Checkpoints cover Llama (GQA), Llama with a tied embedding, three layers (uneven stages), one KV
head (replicated across TP ranks) and a vocabulary not divisible by TP, Qwen2 (q/k/v biases) and
GPT-2 (fused c_attn, LayerNorm, tied head).
"""

from __future__ import annotations

import functools

import pytest
import torch

from switchboard.config import ModelConfig
from switchboard.worker.model_runner import ModelRunner
from tests.parallel_ranks import (
    BLOCK_SIZE,
    NUM_BLOCKS,
    drive_runner,
    generate_with_runner,
    planned_requests,
    run_on_ranks,
)
from tests.tiny_checkpoint import tiny_checkpoint_dir

pytestmark = pytest.mark.slow

CHECKPOINTS = {
    "llama": ("llama", {}),
    "llama-tied-odd": (
        "llama",
        {"tie_word_embeddings": True, "num_layers": 3, "num_kv_heads": 1, "vocab_size": 1001},
    ),
    "qwen2": ("qwen2", {}),
    "gpt2": ("gpt2", {}),
}


@functools.cache
def model_dirs() -> dict[str, str]:
    return {name: tiny_checkpoint_dir(family, **kw) for name, (family, kw) in CHECKPOINTS.items()}


@functools.cache
def single_process_outputs(name: str) -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks run (and workers do)
    try:
        runner = ModelRunner(ModelConfig(model=model_dirs()[name]), torch.device("cpu"))
        runner.load_model()
        runner.initialize_kv_cache(NUM_BLOCKS, BLOCK_SIZE)
        return drive_runner(runner, planned_requests())
    finally:
        torch.set_num_threads(threads)


def assert_same_outputs(name: str, got: dict, expected: dict) -> None:
    for request in planned_requests():
        rid = request.request_id
        assert got[rid]["tokens"] == expected[rid]["tokens"], (name, rid)
        for kind in ("logprobs", "prompt_logprobs"):
            assert len(got[rid][kind]) == len(expected[rid][kind]), (name, rid, kind)
            for (ids, values), (expected_ids, expected_values) in zip(
                got[rid][kind], expected[rid][kind], strict=True
            ):
                assert ids == expected_ids, (name, rid, kind)
                torch.testing.assert_close(values, expected_values, rtol=1e-4, atol=1e-4)
    assert expected["logprobs"]["logprobs"] and expected["logprobs"]["prompt_logprobs"]


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2), (2, 2)])
def test_parallel_runners_match_one_process(tp: int, pp: int) -> None:
    names = list(CHECKPOINTS)
    per_rank = run_on_ranks(generate_with_runner, tp, pp, [model_dirs()[n] for n in names])
    output_rank = (pp - 1) * tp
    for i, name in enumerate(names):
        expected = single_process_outputs(name)
        # The output rank answers the engine; every other rank must have appended the same
        # tokens (else its next step would compute something else).
        assert_same_outputs(name, per_rank[output_rank][i], expected)
        for rank in range(tp * pp):
            for request in planned_requests():
                rid = request.request_id
                assert per_rank[rank][i][rid]["tokens"] == expected[rid]["tokens"], (rank, name)


def test_each_rank_caches_only_its_layers_and_kv_heads() -> None:
    # llama-tied-odd: 3 layers, 1 KV head of dim 16 (64 hidden / 4 heads).
    name = "llama-tied-odd"
    per_rank = run_on_ranks(generate_with_runner, 2, 2, [model_dirs()[name]])
    shapes = [rank_outputs[0]["kv_cache_shape"] for rank_outputs in per_rank]
    # [2, blocks, block size, KV heads, head dim] x layers: stage 0 holds 2 layers, stage 1 one;
    # the single KV head is replicated on both TP ranks.
    block = (2, NUM_BLOCKS, BLOCK_SIZE, 1, 16)
    assert [tuple(shape[0]) for shape in shapes] == [block] * 4
    assert [shape[1] for shape in shapes] == [2, 2, 1, 1]
