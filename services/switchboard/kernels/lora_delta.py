"""The LoRA delta of a projection for a step's rows over several adapters, in C.

A step that mixes rows of the base model and of several adapters adds, after each adapted
projection, ``y[r] += (x[r] A_s^T) B_s`` for every row ``r`` of an adapter in slot ``s``
(``models/lora/stacks.py`` holds the slots' ``A`` and ``B``). ``csrc/lora_delta.c`` groups the
rows by slot, up to four at a time so each row of ``A`` and ``B`` is read once for them, skips
the rank rows past each slot's own rank and, in a fused projection (q/k/v, gate/up), the output
columns each part's ``B`` leaves at zero; the groups run on the kernels' work pool. One call per
projection replaces the torch path's ``index_select`` / two matmuls / ``index_add_`` per
adapter, and the one-call decode stack (``decode_stack.py``) makes the same call after each of
its four matmuls (:class:`StackLora`), so a decode step with adapter rows stays in C.

float32 on the CPU only; ``SWITCHBOARD_LORA_DELTA=off`` leaves every delta to torch (and the
decode steps with adapter rows to the layer-by-layer path).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from switchboard.kernels import library

MAX_RANK = 512  # the C side's LORA_MAX_RANK: rank rows per part

_delta = library.SwitchedFunction("lora_delta_f32", "SWITCHBOARD_LORA_DELTA")

# lora_delta_f32's codes
_ERRORS = {
    -1: "out of scratch memory",
    -3: "a row's adapter slot is out of range",
    -4: f"a rank above {MAX_RANK}",
}


def load() -> bool:
    """Load the kernel; True when in use. Idempotent."""
    return _delta.load()


def status() -> str:
    return _delta.status


def unload() -> None:
    """Back to torch (tests compare the two)."""
    _delta.unload()


def in_use() -> bool:
    return _delta.function is not None


@dataclass(frozen=True)
class SlotMatrices:
    """One projection's resident adapters as the kernel reads them: ``a`` ``[slots, parts *
    max_rank, in]``, ``b`` ``[slots, parts * max_rank, out]`` (the scaling folded in), and
    part ``p``'s output columns ``[columns[p], columns[p + 1])``."""

    a: torch.Tensor
    b: torch.Tensor
    max_rank: int
    columns: torch.Tensor  # int64 [parts + 1]


def usable(a: torch.Tensor, b: torch.Tensor, max_rank: int) -> bool:
    """Whether the kernel can take matrices like these (and is loaded)."""
    return (
        _delta.function is not None
        and max_rank <= MAX_RANK
        and all(
            t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()
            for t in (a, b)
        )
    )


def add_delta(
    x: torch.Tensor,
    y: torch.Tensor,
    matrices: SlotMatrices,
    row_slots: torch.Tensor,
    slot_ranks: torch.Tensor,
) -> None:
    """``y`` ``[rows, out]`` += each adapter row's delta, in place; ``x`` ``[rows, in]``;
    ``row_slots`` int64 ``[rows]`` (-1: the base model), ``slot_ranks`` int64 ``[slots]``."""
    delta = _delta.function
    assert delta is not None
    rows, in_features = x.shape
    out_features = y.shape[1]
    if x.stride(1) != 1 or y.stride(1) != 1:
        raise ValueError("lora_delta: rows must be contiguous")
    code = delta(
        x.data_ptr(),
        x.stride(0),
        y.data_ptr(),
        y.stride(0),
        rows,
        in_features,
        out_features,
        matrices.a.data_ptr(),
        matrices.b.data_ptr(),
        *slot_arguments(row_slots, matrices.a.shape[0], slot_ranks, matrices.max_rank),
        matrices.columns.shape[0] - 1,
        matrices.columns.data_ptr(),
    )
    if code != 0:
        raise RuntimeError(f"lora_delta failed ({code}): {_ERRORS.get(code, 'unknown')}")


def slot_arguments(
    row_slots: torch.Tensor, slots: int, slot_ranks: torch.Tensor, max_rank: int
) -> tuple[int, int, int, int]:
    """The adapter of each row as both C kernels (this one and the decode stack) take it, in
    their order: each row's slot (int64, -1: the base model), the slots, each slot's rank
    (int64) and the largest rank."""
    return row_slots.data_ptr(), slots, slot_ranks.data_ptr(), max_rank


@dataclass(frozen=True)
class StackLora:
    """A step's adapter rows as the one-call decode stack reads them: per layer the ``A`` and
    ``B`` of qkv, o, gate_up and down (``fields`` ``[layers, 8]`` addresses, into the tensors
    ``held``), each row's slot and each slot's rank. The fused projections' parts are q, k, v
    and gate, up, in the base layer's column order (the stack derives their columns)."""

    fields: torch.Tensor  # [layers, 8] int64
    held: tuple[torch.Tensor, ...]  # what fields points into
    max_rank: int
    slot_ranks: torch.Tensor  # int64 [slots]
    row_slots: torch.Tensor  # int64 [rows]

    @property
    def slots(self) -> int:
        return int(self.slot_ranks.shape[0])


def error(code: int) -> str:
    """What the decode stack's LoRA code ``code`` means."""
    return _ERRORS.get(code, f"code {code}")
