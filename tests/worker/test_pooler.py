"""Pooling arithmetic: every pooling type, chunk by chunk, Matryoshka cut, normalization."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from switchboard.wire.engine_msgs import PoolingParams, PoolingType
from switchboard.worker.pooler import PoolingState, finish_vector, pool_sequence

HIDDEN = torch.randn(7, 16, generator=torch.Generator().manual_seed(0))

EXPECTED = {
    PoolingType.LAST: HIDDEN[-1],
    PoolingType.CLS: HIDDEN[0],
    PoolingType.MEAN: HIDDEN.mean(0),
    PoolingType.MAX: HIDDEN.max(0).values,
    PoolingType.MEAN_SQRT_LEN: HIDDEN.sum(0) / math.sqrt(HIDDEN.shape[0]),
}


@pytest.mark.parametrize("kind", list(PoolingType))
def test_each_pooling_type_without_normalization(kind: PoolingType) -> None:
    vector = pool_sequence(HIDDEN, PoolingParams(kind, normalize=False))
    torch.testing.assert_close(torch.tensor(vector), EXPECTED[kind])


@pytest.mark.parametrize("kind", list(PoolingType))
@pytest.mark.parametrize("chunks", [[7], [1, 6], [3, 3, 1], [1] * 7])
def test_chunks_pool_like_the_whole_sequence(kind: PoolingType, chunks: list[int]) -> None:
    state = PoolingState(PoolingParams(kind, normalize=True))
    start = 0
    for n in chunks:
        state.add(HIDDEN[start : start + n])
        start += n
    expected = F.normalize(EXPECTED[kind], dim=0)
    torch.testing.assert_close(torch.tensor(state.finish()), expected)


def test_dimensions_cut_then_normalize() -> None:
    vector = finish_vector(HIDDEN[0], PoolingParams(PoolingType.LAST, True, dimensions=4))
    assert len(vector) == 4
    torch.testing.assert_close(torch.tensor(vector), F.normalize(HIDDEN[0, :4], dim=0))
    assert math.isclose(sum(v * v for v in vector), 1.0, rel_tol=1e-6)


def test_dimensions_without_normalization_only_cut() -> None:
    vector = finish_vector(HIDDEN[0], PoolingParams(PoolingType.LAST, False, dimensions=5))
    torch.testing.assert_close(torch.tensor(vector), HIDDEN[0, :5])


def test_half_precision_hidden_states_pool_in_float32() -> None:
    vector = pool_sequence(HIDDEN.to(torch.bfloat16), PoolingParams(PoolingType.MEAN, False))
    torch.testing.assert_close(
        torch.tensor(vector), HIDDEN.to(torch.bfloat16).float().mean(0), atol=1e-6, rtol=1e-6
    )


def test_nothing_to_pool_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="no tokens"):
        PoolingState(PoolingParams()).finish()
