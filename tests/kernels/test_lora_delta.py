"""The LoRA delta kernel: what the per-adapter shrink and expand in torch add (to rounding), for
rows of several adapters and of the base model in any order, fused projections whose parts
write their own columns, slots of a rank below the largest; each row's floats independent of
the rows beside it; a row's slot out of range refused with a clear error."""

from __future__ import annotations

import pytest
import torch

from switchboard.kernels import lora_delta
from switchboard.kernels.lora_delta import SlotMatrices

SLOTS, MAX_RANK = 3, 8


@pytest.fixture
def kernel():
    lora_delta.unload()
    assert lora_delta.load(), lora_delta.status()
    yield
    lora_delta.unload()
    lora_delta.load()


def _slots(
    in_features: int, columns: list[int], ranks: list[int], seed: int
) -> tuple[SlotMatrices, torch.Tensor]:
    """Random slots laid out as models/lora/stacks.py lays them out: part p's A rows and B rows
    from p * MAX_RANK, as many as the slot's rank, B only in the part's columns."""
    generator = torch.Generator().manual_seed(seed)
    parts = len(columns) - 1
    a = torch.zeros(SLOTS, parts * MAX_RANK, in_features)
    b = torch.zeros(SLOTS, parts * MAX_RANK, columns[-1])
    for slot, rank in enumerate(ranks):
        for p in range(parts):
            rows = slice(p * MAX_RANK, p * MAX_RANK + rank)
            a[slot, rows] = torch.randn(rank, in_features, generator=generator)
            b[slot, rows, columns[p] : columns[p + 1]] = torch.randn(
                rank, columns[p + 1] - columns[p], generator=generator
            )
    matrices = SlotMatrices(a, b, MAX_RANK, torch.tensor(columns))
    return matrices, torch.tensor(ranks, dtype=torch.int64)


def _reference(x: torch.Tensor, matrices: SlotMatrices, row_slots: torch.Tensor) -> torch.Tensor:
    delta = torch.zeros(x.shape[0], matrices.b.shape[2], dtype=torch.float64)
    for row, slot in enumerate(row_slots.tolist()):
        if slot >= 0:
            shrink = x[row].double() @ matrices.a[slot].double().t()
            delta[row] = shrink @ matrices.b[slot].double()
    return delta


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 9, 32])
@pytest.mark.parametrize(
    ("in_features", "columns"),
    [(16, [0, 16]), (33, [0, 24, 32, 40]), (64, [0, 50, 100]), (7, [0, 130])],
    ids=["one-part", "q-k-v", "gate-up", "narrow-in"],
)
def test_adds_each_rows_adapter_delta(kernel, rows, in_features, columns):
    matrices, ranks = _slots(in_features, columns, [8, 3, 5], seed=rows + in_features)
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=generator)
    y = torch.randn(rows, columns[-1], generator=generator)
    row_slots = torch.randint(-1, SLOTS, (rows,), generator=generator)
    expected = y.double() + _reference(x, matrices, row_slots)
    lora_delta.add_delta(x, y, matrices, row_slots, ranks)
    torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-4)


def test_base_rows_are_untouched_and_strided_rows_read_in_place(kernel):
    matrices, ranks = _slots(20, [0, 12, 30], [8, 8, 8], seed=1)
    wide_x, wide_y = torch.randn(6, 50), torch.randn(6, 70)
    x, y = wide_x[:, 5:25], wide_y[:, 10:40]  # row strides of 50 and 70
    before = wide_y.clone()
    row_slots = torch.tensor([-1, 2, -1, 0, 0, -1])
    lora_delta.add_delta(x, y, matrices, row_slots, ranks)
    base = row_slots == -1
    assert torch.equal(wide_y[base], before[base])
    assert torch.equal(wide_y[:, :10], before[:, :10]) and torch.equal(
        wide_y[:, 40:], before[:, 40:]
    )
    expected = before[:, 10:40].double() + _reference(x, matrices, row_slots)
    torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-4)


def test_a_row_does_not_depend_on_its_neighbours(kernel):
    """A row's delta is the same floats whether its slot's group holds 1 row or 4."""
    matrices, ranks = _slots(40, [0, 16, 24, 32], [8, 6, 2], seed=2)
    x = torch.randn(11, 40)
    row_slots = torch.tensor([0, 1, 0, 0, 2, 0, 1, -1, 0, 0, 2])
    together = torch.zeros(11, 32)
    lora_delta.add_delta(x, together, matrices, row_slots, ranks)
    for row in range(11):
        alone = torch.zeros(1, 32)
        lora_delta.add_delta(x[row : row + 1], alone, matrices, row_slots[row : row + 1], ranks)
        assert torch.equal(alone[0], together[row])


def test_a_slot_out_of_range_is_refused(kernel):
    matrices, ranks = _slots(8, [0, 8], [8, 8, 8], seed=3)
    y = torch.zeros(2, 8)
    with pytest.raises(RuntimeError, match="slot is out of range"):
        lora_delta.add_delta(torch.randn(2, 8), y, matrices, torch.tensor([0, SLOTS]), ranks)
    assert torch.equal(y, torch.zeros(2, 8))
