"""Tensor and pipeline parallelism: which share of the model this process holds, and the
collectives (``torch.distributed``) that join the shares.

An engine's workers form a grid of ``pp_size`` pipeline stages × ``tp_size`` tensor ranks::

    rank = pp_rank * tp_size + tp_rank

    stage 0:  rank 0 … tp-1        embedding + layers [0, L0)      ── hidden ──>
    stage 1:  rank tp … 2tp-1      layers [L0, L1)                 ── hidden ──>
    …
    last:     rank (pp-1)·tp …     layers […, L) + norm + LM head + sampling
              └─ output_rank: the first rank of the last stage answers the engine

Within a stage the ranks split every layer (attention heads, MLP columns, vocabulary) and
join partial results with an all-reduce over the stage's TP group. Between stages rank
``(p, t)`` sends the final hidden states of its layers to ``(p + 1, t)``: each TP rank holds
the whole (all-reduced) hidden state, so no gather is needed. The residual stream is folded
into the hidden state by our decoder layers, so it is the only activation that travels.

``ParallelState()`` is the single process: every collective is skipped and every shard is the
whole tensor, so a model built with it computes exactly what it did before parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Shard:
    """The part of a dimension of ``full`` units this rank keeps: ``[start, start + size)``."""

    start: int
    size: int
    full: int

    def scaled(self, factor: int) -> Shard:
        """The same shard in finer units (heads -> features: ``factor`` = head_dim)."""
        return Shard(self.start * factor, self.size * factor, self.full * factor)

    @property
    def stop(self) -> int:
        return self.start + self.size


@dataclass(frozen=True)
class ParallelState:
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    # This stage's TP ranks (a torch.distributed ProcessGroup); None = the default group,
    # which is the TP group when there is one stage.
    tp_group: Any = None

    def __post_init__(self) -> None:
        if not (0 <= self.tp_rank < self.tp_size and 0 <= self.pp_rank < self.pp_size):
            raise ValueError(f"bad parallel ranks: {self}")

    # -- who is who -------------------------------------------------------------------------

    @property
    def rank(self) -> int:
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def output_rank(self) -> int:
        """The rank that samples for the engine: the first rank of the last stage."""
        return (self.pp_size - 1) * self.tp_size

    # -- what this rank holds ---------------------------------------------------------------

    def split(self, full: int, what: str) -> Shard:
        """An even TP split of ``full`` units; refuses a size that does not divide."""
        if full % self.tp_size:
            raise ValueError(
                f"tensor parallelism: {what} ({full}) is not divisible by -tp {self.tp_size}"
            )
        size = full // self.tp_size
        return Shard(self.tp_rank * size, size, full)

    def kv_head_shard(self, num_kv_heads: int) -> Shard:
        """This rank's KV heads. With fewer KV heads than TP ranks, each KV head is replicated
        on ``tp_size / num_kv_heads`` consecutive ranks (as vLLM does): those ranks' query heads
        are exactly the ones that share it."""
        if num_kv_heads >= self.tp_size:
            return self.split(num_kv_heads, "the number of key/value heads")
        if self.tp_size % num_kv_heads:
            raise ValueError(
                f"tensor parallelism: -tp {self.tp_size} is neither a divisor nor a multiple "
                f"of the number of key/value heads ({num_kv_heads})"
            )
        replicas = self.tp_size // num_kv_heads
        return Shard(self.tp_rank // replicas, 1, num_kv_heads)

    def vocab_shard(self, vocab_size: int) -> Shard:
        """This rank's rows of the embedding and LM head: ``ceil(vocab / tp)`` per rank, the
        last rank's tail padded (padding rows are zero and their logits are dropped)."""
        size = -(-vocab_size // self.tp_size)
        return Shard(self.tp_rank * size, size, vocab_size)

    def stage_layers(self, num_layers: int) -> range:
        """The decoder layers of this pipeline stage; earlier stages take one more layer each
        when the count does not divide (the last stage also has the LM head)."""
        if num_layers < self.pp_size:
            raise ValueError(
                f"pipeline parallelism: {num_layers} layers cannot fill -pp {self.pp_size} stages"
            )
        base, extra = divmod(num_layers, self.pp_size)
        start = self.pp_rank * base + min(self.pp_rank, extra)
        return range(start, start + base + (1 if self.pp_rank < extra else 0))

    # -- collectives ------------------------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over this stage's TP ranks (in place)."""
        if self.tp_size > 1:
            dist.all_reduce(tensor, group=self.tp_group)
        return tensor

    def all_gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate every TP rank's ``tensor`` along the last dimension, in rank order."""
        if self.tp_size == 1:
            return tensor
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.tp_size)]
        dist.all_gather(parts, tensor, group=self.tp_group)
        return torch.cat(parts, dim=-1)

    def send_to_next_stage(self, tensor: torch.Tensor) -> None:
        dist.send(tensor.contiguous(), dst=self.rank + self.tp_size)

    def recv_from_previous_stage(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        tensor = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(tensor, src=self.rank - self.tp_size)
        return tensor

    def broadcast_from_output_rank(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank gets the output rank's ``tensor`` (same shape and dtype everywhere)."""
        if self.world_size > 1:
            dist.broadcast(tensor, src=self.output_rank)
        return tensor

    def min_over_ranks(self, value: int, device: torch.device) -> int:
        """The smallest ``value`` of all ranks (every rank gets it)."""
        if self.world_size == 1:
            return value
        tensor = torch.tensor([value], dtype=torch.long, device=device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
        return int(tensor.item())


SINGLE_PROCESS = ParallelState()
