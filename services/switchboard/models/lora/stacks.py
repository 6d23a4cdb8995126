"""The resident adapters of one projection, side by side, and the delta they add in a step.

A projection (``qkv_proj``, ``o_proj``, ``gate_up_proj``, ``down_proj``) gets a
:class:`LoraStack`: the ``max_loras`` resident slots' ``A`` matrices stacked into one
``[slices * slots * max_rank, in]`` matrix and their ``B`` matrices (scaling folded in) into
one ``[slices * slots * max_rank, out]`` matrix, a fused projection's parts (q/k/v, gate/up)
each in its own output columns. A step's rows then take their deltas in two matmuls for every
adapter at once (the shrink/expand of punica / S-LoRA, in its dense form)::

    shrink = x @ A_all^T                   [tokens, slices * slots * rank]
    shrink *= mask                         keeps each row's own slot's columns (base rows: none)
    delta  = shrink @ B_all                [tokens, out]

The wasted work is the other slots' columns of ``shrink``: ``slots * rank`` numbers per row,
small beside the projection itself; in exchange every shape is fixed, nothing loops over the
adapters, and a step mixing the base model and several adapters is one pass.

The delta is added by a forward hook on the projection, after the base path has run however
it runs (oneDNN, the small-batch or quantized panels). Tensor parallelism: a column-parallel
projection keeps ``A`` whole and this rank's rows of ``B``; a row-parallel one keeps this
rank's input columns of ``A``, so ``shrink`` is a partial sum, all-reduced (``slots * rank``
numbers per row) before the expand.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

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
    """Which slot each row of a step uses (-1: the base model), as the masks the stacks apply."""

    def __init__(
        self, token_slots: torch.Tensor, num_slots: int, max_rank: int, dtype: torch.dtype
    ):
        columns = torch.arange(num_slots, device=token_slots.device).repeat_interleave(max_rank)
        self._mask = (token_slots[:, None] == columns[None, :]).to(dtype)
        self._by_parts: dict[int, torch.Tensor] = {1: self._mask}

    def mask(self, num_parts: int) -> torch.Tensor:
        """``[tokens, num_parts * slots * rank]``: one copy of the slot mask per part."""
        mask = self._by_parts.get(num_parts)
        if mask is None:
            mask = self._by_parts[num_parts] = self._mask.repeat(1, num_parts)
        return mask


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
        rows = len(parts) * num_slots * max_rank
        self.a = torch.zeros(rows, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(rows, out_features, dtype=dtype, device=device)

    @property
    def nbytes(self) -> int:
        return (self.a.numel() + self.b.numel()) * self.a.element_size()

    def load(
        self, slot: int, pairs: Mapping[str, tuple[torch.Tensor, torch.Tensor]], scaling: float
    ) -> None:
        """Put an adapter's matrices for this projection (PEFT module -> (A, B), full shapes)
        into ``slot``; parts it does not adapt get zeros."""
        for index, part in enumerate(self.parts):
            first = (index * self.num_slots + slot) * self.max_rank
            self.a[first : first + self.max_rank].zero_()
            self.b[first : first + self.max_rank].zero_()
            pair = pairs.get(part.module)
            if pair is None:
                continue
            a, b = pair
            rank = a.shape[0]
            if self.inputs is not None:
                a = a[:, self.inputs.start : self.inputs.stop]
            b = b[part.rows.start : part.rows.stop] * scaling
            self.a[first : first + rank].copy_(a)
            columns = slice(part.offset, part.offset + part.rows.size)
            self.b[first : first + rank, columns].copy_(b.t())

    def delta(self, x: torch.Tensor, batch: LoraBatch) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        shrink = F.linear(rows, self.a)
        if self.inputs is not None and self.parallel.tp_size > 1:
            shrink = self.parallel.all_reduce(shrink)
        return (shrink * batch.mask(len(self.parts))) @ self.b


def column_stack(
    layer: ColumnParallelLinear, num_slots: int, max_rank: int, parallel: ParallelState
) -> LoraStack:
    parts = [
        OutputPart(_PART_MODULES[name], layer.shard_offsets[name], shard)
        for name, shard in layer.shard_slices.items()
    ]
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
    """Add ``stack``'s delta to ``layer``'s output whenever the step has adapter rows."""

    def add_delta(module: nn.Module, args: tuple[torch.Tensor, ...], output: torch.Tensor):
        batch = active.current
        if batch is None:
            return None
        delta = stack.delta(args[0], batch)
        return output + delta.view(output.shape)

    layer.register_forward_hook(add_delta)


def _dtype(layer: nn.Module) -> torch.dtype:
    weight = layer.weight
    assert isinstance(weight, torch.Tensor)
    return weight.dtype  # a oneDNN-packed weight keeps its dtype


def _device(layer: nn.Module) -> torch.device:
    weight = layer.weight
    assert isinstance(weight, torch.Tensor)
    return weight.device
