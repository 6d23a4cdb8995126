"""The resident adapters of one projection, and the delta they add to a step's rows.

A projection (``qkv_proj``, ``o_proj``, ``gate_up_proj``, ``down_proj``; GPT-2's ``c_attn``,
``c_proj``, ``c_fc``, ``c_proj``) gets a
:class:`LoraStack`: for each of the ``max_loras`` resident slots, its adapter's ``A`` matrices
(one per part of a fused projection: q/k/v, gate/up) stacked into one ``[parts * max_rank,
in]`` matrix and its ``B`` matrices (scaling folded in) into one ``[parts * max_rank, out]``
matrix, each part's ``B`` in its own output columns. A step groups its rows by slot once
(:class:`LoraBatch`), and every projection then adds, for each slot in use, the grouped
shrink/expand of punica / S-LoRA (segment-wise)::

    rows   = the step's rows of that adapter (index_select; all rows: no copy)
    shrink = x[rows] @ A_slot^T              [rows, parts * rank]
    out[rows] += shrink @ B_slot             (index_add_, into the base projection's output)

so the work is proportional to each row's own adapter's rank: a batch of the base model and
several adapters is one forward pass with, per projection, two small matmuls per adapter in
use. Base rows are in no group and get nothing added. On the CPU in float32 one C call per
projection does all of it (``kernels/lora_delta.py``: the rows grouped by slot in C), and the
one-call decode stack makes the same call (the step's :class:`LoraBatch` carries what it reads,
``stack``), so a decode step with adapter rows stays in that stack.

The delta is added by a forward hook on the projection, after the base path has run however
it runs (oneDNN, the small-batch or quantized panels). Tensor parallelism: a column-parallel
projection keeps ``A`` whole and this rank's rows of ``B``; a row-parallel one keeps this
rank's input columns of ``A``, so ``shrink`` is a partial sum, all-reduced (``rank`` numbers
per part per row) before the expand; every rank groups the same rows, so the collectives line
up. The C kernel takes a row-parallel projection only without tensor parallelism (the
all-reduce sits between its shrink and its expand).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F
from torch import nn

from switchboard.kernels import lora_delta
from switchboard.kernels.lora_delta import SlotMatrices, StackLora
from switchboard.models.parallel import ParallelState, Shard
from switchboard.models.parallel_layers import ColumnParallelLinear, RowParallelLinear

# PEFT's module names for the parts of the fused projections.
_PART_MODULES = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "gate": "gate_proj", "up": "up_proj"}


@dataclass(frozen=True)
class OutputPart:
    """A part of a projection's output that one PEFT module's ``B`` writes."""

    module: str  # PEFT's name: q_proj, ..., down_proj
    offset: int  # where it starts in this rank's output
    rows: Shard  # this rank's rows of that module's full output


class LoraBatch:
    """A step's adapter rows, read by every projection: each row's slot (and, for the C kernel,
    each slot's rank), and for the torch path the rows grouped by slot (made on first use)."""

    def __init__(
        self,
        token_slots: torch.Tensor,
        device: torch.device,
        slot_ranks: torch.Tensor | None = None,
        stack: StackLora | None = None,
    ) -> None:
        """``token_slots``: each row's slot (-1: the base model), int64 on the CPU;
        ``slot_ranks``: each slot's rank (None: every slot's the largest); ``stack``: what the
        one-call decode stack reads (None: the stack cannot add these rows' deltas)."""
        self.num_rows = int(token_slots.shape[0])
        self.token_slots = token_slots
        self.slot_ranks = slot_ranks
        self.device = device
        self.stack = stack

    @cached_property
    def groups(self) -> list[tuple[int, torch.Tensor | None]]:
        """(slot, its rows' indices or None for every row), for the torch path."""
        groups: list[tuple[int, torch.Tensor | None]] = []
        for slot in sorted(set(self.token_slots.tolist()) - {-1}):
            rows = (self.token_slots == slot).nonzero().squeeze(1)
            whole = rows.shape[0] == self.num_rows
            groups.append((slot, None if whole else rows.to(self.device)))
        return groups


class ActiveBatch:
    """The step's :class:`LoraBatch`, read by every stack's hook; None: no adapter row."""

    def __init__(self) -> None:
        self.current: LoraBatch | None = None


class LoraStack:
    def __init__(
        self,
        parts: list[OutputPart],
        in_features: int,
        out_features: int,
        inputs: Shard | None,  # row-parallel: this rank's input columns of A
        num_slots: int,
        max_rank: int,
        parallel: ParallelState,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.parts = parts
        self.inputs = inputs
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.parallel = parallel
        rows = len(parts) * max_rank
        self.a = torch.zeros(num_slots, rows, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(num_slots, rows, out_features, dtype=dtype, device=device)
        self.kernel = self._kernel_matrices(out_features)

    def _kernel_matrices(self, out_features: int) -> SlotMatrices | None:
        """The slots as the C kernel reads them; None where it cannot run this projection: not
        float32 on the CPU, the all-reduce of a row-parallel one between its two matmuls, or
        parts that do not tile the output in order."""
        if not lora_delta.usable(self.a, self.b, self.max_rank):
            return None
        if self.inputs is not None and self.parallel.tp_size > 1:
            return None
        columns = [part.offset for part in self.parts] + [out_features]
        sizes = [part.rows.size for part in self.parts]
        ends = [offset + size for offset, size in zip(columns, sizes, strict=False)]
        if columns[0] != 0 or ends != columns[1:]:
            return None
        self.full_ranks = torch.full((self.num_slots,), self.max_rank, dtype=torch.int64)
        return SlotMatrices(self.a, self.b, self.max_rank, torch.tensor(columns))

    @property
    def nbytes(self) -> int:
        return (self.a.numel() + self.b.numel()) * self.a.element_size()

    def load(
        self, slot: int, pairs: Mapping[str, tuple[torch.Tensor, torch.Tensor]], scaling: float
    ) -> None:
        """Put an adapter's matrices for this projection (PEFT module -> (A, B), full shapes)
        into ``slot``; parts it does not adapt get zeros."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        for index, part in enumerate(self.parts):
            pair = pairs.get(part.module)
            if pair is None:
                continue
            a, b = pair
            first, rank = index * self.max_rank, a.shape[0]
            if self.inputs is not None:
                a = a[:, self.inputs.start : self.inputs.stop]
            b = b[part.rows.start : part.rows.stop] * scaling
            self.a[slot, first : first + rank].copy_(a)
            columns = slice(part.offset, part.offset + part.rows.size)
            self.b[slot, first : first + rank, columns].copy_(b.t())

    def add_delta(self, x: torch.Tensor, output: torch.Tensor, batch: LoraBatch) -> None:
        """``output`` ``[rows, out]`` += each adapter row's delta, in place."""
        kernel = self.kernel
        if kernel is not None and lora_delta.in_use() and x.stride(1) == output.stride(1) == 1:
            ranks = self.full_ranks if batch.slot_ranks is None else batch.slot_ranks
            lora_delta.add_delta(x, output, kernel, batch.token_slots, ranks)
            return
        for slot, rows in batch.groups:
            selected = x if rows is None else x.index_select(0, rows)
            shrink = F.linear(selected, self.a[slot])
            if self.inputs is not None and self.parallel.tp_size > 1:
                shrink = self.parallel.all_reduce(shrink)
            delta = shrink @ self.b[slot]
            if rows is None:
                output.add_(delta)
            else:
                output.index_add_(0, rows, delta)


def column_stack(
    layer: ColumnParallelLinear,
    num_slots: int,
    max_rank: int,
    parallel: ParallelState,
    modules: Mapping[str, str] = _PART_MODULES,
) -> LoraStack:
    """A stack on a column-parallel projection whose shards PEFT adapts one by one: ``modules``
    maps each shard to its PEFT module (q -> q_proj)."""
    parts = [
        OutputPart(modules[name], layer.shard_offsets[name], shard)
        for name, shard in layer.shard_slices.items()
    ]
    return _column_parts_stack(layer, parts, num_slots, max_rank, parallel)


def fused_stack(
    layer: ColumnParallelLinear,
    module: str,
    num_slots: int,
    max_rank: int,
    parallel: ParallelState,
) -> LoraStack:
    """A stack on a column-parallel projection of several shards that PEFT adapts as one
    module (GPT-2's ``c_attn``: one ``A``, one ``B`` over q, k and v). Unsplit, it is one part;
    split over TP ranks, each shard is a part with this rank's rows of its piece of ``B`` (and
    its own copy of ``A``)."""
    shards = list(layer.shard_slices.values())
    full = sum(shard.full for shard in shards)
    if all(shard.size == shard.full for shard in shards):
        return _column_parts_stack(
            layer, [OutputPart(module, 0, Shard(0, full, full))], num_slots, max_rank, parallel
        )
    parts, before = [], 0
    for name, shard in layer.shard_slices.items():
        rows = Shard(before + shard.start, shard.size, full)
        parts.append(OutputPart(module, layer.shard_offsets[name], rows))
        before += shard.full
    return _column_parts_stack(layer, parts, num_slots, max_rank, parallel)


def _column_parts_stack(
    layer: ColumnParallelLinear,
    parts: list[OutputPart],
    num_slots: int,
    max_rank: int,
    parallel: ParallelState,
) -> LoraStack:
    return LoraStack(
        parts,
        layer.in_features,
        layer.out_features,
        None,
        num_slots,
        max_rank,
        parallel,
        _dtype(layer),
        _device(layer),
    )


def row_stack(
    layer: RowParallelLinear, module: str, num_slots: int, max_rank: int, parallel: ParallelState
) -> LoraStack:
    out = layer.out_features
    return LoraStack(
        [OutputPart(module, 0, Shard(0, out, out))],
        layer.inputs.size,
        out,
        layer.inputs,
        num_slots,
        max_rank,
        parallel,
        _dtype(layer),
        _device(layer),
    )


def attach(layer: nn.Module, stack: LoraStack, active: ActiveBatch) -> None:
    """Add ``stack``'s deltas to ``layer``'s output whenever the step has adapter rows."""

    def add_delta(module: nn.Module, args: tuple[torch.Tensor, ...], output: torch.Tensor):
        batch = active.current
        if batch is None:
            return None
        x = args[0]
        stack.add_delta(x.reshape(-1, x.shape[-1]), output.view(-1, output.shape[-1]), batch)
        return output

    layer.register_forward_hook(add_delta)


def _dtype(layer: nn.Module) -> torch.dtype:
    weight = layer.weight
    assert isinstance(weight, torch.Tensor)
    return weight.dtype  # a oneDNN-packed weight keeps its dtype


def _device(layer: nn.Module) -> torch.device:
    weight = layer.weight
    assert isinstance(weight, torch.Tensor)
    return weight.device
