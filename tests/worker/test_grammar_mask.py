"""The worker's side of structured output: the step's packed bitmask applied to the logits of
the constrained rows only, before sampling (unit, and through the model runner on the tiny
checkpoint)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from switchboard.wire.engine_msgs import SamplingParams
from switchboard.wire.step_msgs import NewRequest, SchedulerOutput
from switchboard.worker.grammar_mask import apply_grammar_bitmask, unpack_bitmask
from tests.parallel_ranks import run_on_ranks, sample_under_grammar_mask
from tests.tiny_checkpoint import tiny_llama_dir
from tests.worker.test_model_runner_parity import make_runner

VOCAB = 1024


def pack(allowed_rows: list[list[int]], vocab: int = VOCAB) -> bytes:
    """The engine's layout: ceil(vocab / 32) little-endian int32 words per row."""
    words = (vocab + 31) // 32
    bits = np.zeros((len(allowed_rows), words * 32), dtype=np.uint8)
    for row, allowed in enumerate(allowed_rows):
        bits[row, allowed] = 1
    return np.packbits(bits, axis=1, bitorder="little").view("<i4").tobytes()


def test_unpack_matches_the_engines_layout_and_pads_past_the_mask() -> None:
    allowed = unpack_bitmask(pack([[0, 31, 32, 1000], [5]], vocab=1000), 2, 1030)
    assert allowed.shape == (2, 1030)
    assert allowed[0].nonzero()[:, 0].tolist() == [0, 31, 32, 1000]
    assert not allowed[:, 1024:].any()  # past the mask's 32 words: never allowed
    assert allowed[1].nonzero()[:, 0].tolist() == [5]
    top_bit = unpack_bitmask(pack([[31, 63]], vocab=64), 1, 64)  # the sign bit of each word
    assert top_bit[0].nonzero()[:, 0].tolist() == [31, 63]


def test_only_constrained_rows_are_masked_and_by_request_id() -> None:
    logits = torch.randn(3, VOCAB)
    before = logits.clone()
    mask = pack([[7, 9], [100]])  # rows for "c" then "a"
    apply_grammar_bitmask(logits, mask, ["c", "a"], ["a", "b", "c"])
    assert torch.isfinite(logits[0]).nonzero()[:, 0].tolist() == [100]
    assert torch.equal(logits[1], before[1])  # "b" is free
    assert torch.isfinite(logits[2]).nonzero()[:, 0].tolist() == [7, 9]
    assert logits[2, 7] == before[2, 7]


def test_a_mask_row_of_a_request_not_sampled_here_is_skipped() -> None:
    logits = torch.randn(1, VOCAB)
    apply_grammar_bitmask(logits, pack([[3], [4]]), ["gone", "a"], ["a"])
    assert torch.isfinite(logits[0]).nonzero()[:, 0].tolist() == [4]


def test_runner_samples_within_the_mask_and_leaves_free_requests_alone() -> None:
    tiny = tiny_llama_dir()
    greedy = SamplingParams(temperature=0.0, max_tokens=4)
    prompt = [0, 17, 42, 99, 7]

    def step(bitmask: bytes, ids: list[str]) -> dict[str, int]:
        runner = make_runner(tiny)
        out = runner.execute_model(
            SchedulerOutput(
                step_id=1,
                new_requests=[
                    NewRequest("free", prompt, greedy, [1, 2], 0),
                    NewRequest("held", prompt, greedy, [3, 4], 0),
                ],
                num_scheduled_tokens={"free": 5, "held": 5},
                total_num_scheduled_tokens=10,
                grammar_bitmask=bitmask,
                structured_request_ids=ids,
            )
        )
        return {rid: t[0] for rid, t in zip(out.request_ids, out.sampled_token_ids, strict=True)}

    plain = step(b"", [])
    assert plain["free"] == plain["held"]  # same prompt, greedy
    forced = [t for t in (500, 501) if t != plain["held"]]
    masked = step(pack(forced), ["held"])
    assert masked["held"] in forced
    assert masked["free"] == plain["free"]


@pytest.mark.slow
def test_tp2_pp2_ranks_all_append_the_masked_token() -> None:
    tiny = tiny_llama_dir()
    [plain] = run_on_ranks(sample_under_grammar_mask, 1, 1, tiny, b"")
    forced = [t for t in (500, 501) if t != plain["held"]]
    per_rank = run_on_ranks(sample_under_grammar_mask, 2, 2, tiny, pack(forced))
    for rank, tokens in enumerate(per_rank):
        assert tokens["held"] in forced, rank
        assert tokens["free"] == plain["free"], rank
    assert len({tokens["held"] for tokens in per_rank}) == 1
