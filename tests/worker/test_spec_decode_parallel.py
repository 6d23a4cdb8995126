"""Speculative decoding under tensor and pipeline parallelism (gloo processes): every rank
appends the tokens the output rank accepted, and they are the single-process tokens."""

from __future__ import annotations

import pytest
import torch

from switchboard.config import ModelConfig
from switchboard.wire.engine_msgs import SamplingParams
from switchboard.worker.model_runner import ModelRunner
from tests.parallel_ranks import run_on_ranks
from tests.tiny_checkpoint import tiny_checkpoint_dir
from tests.worker.spec_decode_loop import (
    BLOCK_SIZE,
    PARALLEL_NUM_BLOCKS,
    PARALLEL_PROMPTS,
    loop_on_rank,
    run_loop,
)
from tests.worker.test_spec_decode_runner import ALLOWED, NGRAM

pytestmark = pytest.mark.slow


def test_tp_and_pp_accept_the_single_process_tokens() -> None:
    model_dir = tiny_checkpoint_dir("llama")
    params = SamplingParams(
        temperature=0.8, top_k=4, seed=3, max_tokens=24, allowed_token_ids=ALLOWED
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks run
    try:
        runner = ModelRunner(ModelConfig(model=model_dir), torch.device("cpu"))
        runner.load_model()
        runner.initialize_kv_cache(PARALLEL_NUM_BLOCKS, BLOCK_SIZE)
        expected = run_loop(runner, PARALLEL_PROMPTS, params, "", num_blocks=PARALLEL_NUM_BLOCKS)
    finally:
        torch.set_num_threads(threads)
    per_rank = run_on_ranks(loop_on_rank, 2, 2, model_dir, NGRAM, params)
    assert per_rank[2]["accepted"] > 0  # the output rank (last stage, TP rank 0)
    for rank, got in enumerate(per_rank):
        for rid in PARALLEL_PROMPTS:
            assert got["tokens"][rid] == expected.tokens(rid), (rank, rid)
