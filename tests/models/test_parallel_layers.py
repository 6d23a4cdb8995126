"""Tensor-parallel layers against dense ones (2 gloo processes), and the share arithmetic."""

from __future__ import annotations

import pytest

from switchboard.models.parallel import ParallelState, Shard
from tests.parallel_ranks import compare_parallel_layers, run_on_ranks


@pytest.mark.slow
def test_parallel_layers_match_dense_layers_on_two_ranks() -> None:
    for rank, diffs in enumerate(run_on_ranks(compare_parallel_layers, 2, 1)):
        assert diffs["lm head shape"] == 0.0
        for layer, diff in diffs.items():
            assert diff < 1e-5, (rank, layer, diff)


def test_single_process_holds_everything() -> None:
    single = ParallelState()
    assert single.split(12, "heads") == Shard(0, 12, 12)
    assert single.kv_head_shard(3) == Shard(0, 3, 3)
    assert single.vocab_shard(1001) == Shard(0, 1001, 1001)
    assert single.stage_layers(5) == range(5)
    assert single.output_rank == 0 and single.is_first_stage and single.is_last_stage


def test_heads_split_evenly_and_refuse_a_remainder() -> None:
    rank1 = ParallelState(tp_rank=1, tp_size=2)
    assert rank1.split(4, "heads") == Shard(2, 2, 4)
    assert rank1.split(4, "heads").scaled(16) == Shard(32, 32, 64)
    with pytest.raises(ValueError, match=r"the number of attention heads \(9\) is not divisible"):
        rank1.split(9, "the number of attention heads")


def test_fewer_kv_heads_than_ranks_are_replicated() -> None:
    # 2 KV heads on 4 ranks: ranks 0,1 hold head 0 and ranks 2,3 head 1 -- the KV head their
    # query heads (8 heads: 2 per rank, 4 per KV head) use.
    assert [ParallelState(tp_rank=r, tp_size=4).kv_head_shard(2) for r in range(4)] == [
        Shard(0, 1, 2),
        Shard(0, 1, 2),
        Shard(1, 1, 2),
        Shard(1, 1, 2),
    ]
    assert ParallelState(tp_rank=1, tp_size=2).kv_head_shard(4) == Shard(2, 2, 4)
    with pytest.raises(ValueError, match="neither a divisor nor a multiple"):
        ParallelState(tp_rank=0, tp_size=4).kv_head_shard(3)


def test_vocabulary_rows_are_padded_on_the_last_rank() -> None:
    assert ParallelState(tp_rank=0, tp_size=2).vocab_shard(1001) == Shard(0, 501, 1001)
    assert ParallelState(tp_rank=1, tp_size=2).vocab_shard(1001) == Shard(501, 501, 1001)


def test_pipeline_stages_take_contiguous_layers_earlier_ones_more() -> None:
    stages = [ParallelState(pp_rank=p, pp_size=3).stage_layers(8) for p in range(3)]
    assert stages == [range(0, 3), range(3, 6), range(6, 8)]
    grid = ParallelState(tp_rank=1, tp_size=2, pp_rank=2, pp_size=3)
    assert (grid.rank, grid.world_size, grid.output_rank) == (5, 6, 4)
    with pytest.raises(ValueError, match="2 layers cannot fill -pp 3 stages"):
        ParallelState(pp_rank=0, pp_size=3).stage_layers(2)
