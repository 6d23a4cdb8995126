"""Tensor-parallel layers (Megatron-style) and the stand-in for another stage's layers.

::

    x ─> ColumnParallelLinear ─> y[:, my columns]  ─> (local math: heads, activation)
                                                     ─> RowParallelLinear ─> partial y ─> all-reduce

A column-parallel linear keeps rows ``[start, stop)`` of each stacked checkpoint matrix (q, k
and v separately, so a rank holds whole heads); its output stays split and needs no
communication. A row-parallel linear keeps the matching input columns; each rank's product is a
partial sum, all-reduced over the TP group, and the bias is added once, after the sum.

The vocabulary is split by rows: the embedding looks up only the ids in its rows (zero
elsewhere) and all-reduces; the LM head computes its rows' logits and all-gathers them.

With one TP rank every shard is the whole tensor and no collective runs: the layers compute
exactly what ``Linear``/``MergedLinear``/``VocabEmbedding`` do.

Each layer loads its checkpoint tensors through ``load_param``/``load_shard``, which take this
rank's slice of the full tensor and check the full shape.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from switchboard.kernels.gemm import MatmulPanels, linear
from switchboard.models.hf_config import TransformerConfig
from switchboard.models.layers import MergedLinear
from switchboard.models.parallel import ParallelState, Shard


class MissingLayer(nn.Module):
    """Stands in for a module that another pipeline stage holds: no parameters, and the
    weight loader skips the checkpoint tensors under its name."""

    def forward(self, *args: object, **kwargs: object) -> torch.Tensor:
        raise RuntimeError("this layer lives on another pipeline stage")


class ColumnParallelLinear(MergedLinear):
    """Stacked checkpoint matrices (``shards``: name -> this rank's rows of it), each split
    across TP ranks along its output dimension. Output: ``[..., sum of shard sizes]``."""

    def __init__(self, in_features: int, shards: dict[str, Shard], bias: bool) -> None:
        super().__init__(in_features, {name: s.size for name, s in shards.items()}, bias=bias)
        self.shard_slices = dict(shards)

    def load_shard(self, shard: str, param_name: str, tensor: torch.Tensor) -> None:
        part = self.shard_slices[shard]
        if tensor.shape[0] != part.full:
            raise ValueError(f"shard {shard!r} has {tensor.shape[0]} rows, expected {part.full}")
        super().load_shard(shard, param_name, tensor[part.start : part.stop])

    def load_param(self, param_name: str, tensor: torch.Tensor) -> None:
        """A checkpoint tensor for the whole layer: only for a layer of one shard."""
        if len(self.shard_slices) != 1:
            raise ValueError(f"a layer of shards {list(self.shard_slices)} loads shard by shard")
        self.load_shard(next(iter(self.shard_slices)), param_name, tensor)


class RowParallelLinear(nn.Module):
    """``y = all_reduce(x[:, my inputs] W[:, my inputs]^T) + b``; ``inputs`` is this rank's
    share of the input features (the column-parallel layer before it produced exactly those)."""

    def __init__(
        self, inputs: Shard, out_features: int, bias: bool, parallel: ParallelState
    ) -> None:
        super().__init__()
        self.inputs = inputs
        self.out_features = out_features
        self.parallel = parallel
        self.weight = nn.Parameter(torch.empty(out_features, inputs.size))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        # the weight laid out for a small-batch matmul kernel, beside oneDNN's (``prepack.py``;
        # quantized: ``quantized.py``)
        self.small_batch: MatmulPanels | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.parallel.tp_size == 1:  # one fused op, as a plain linear computes it
            return linear(x, self.weight, self.bias, self.small_batch)
        y = self.parallel.all_reduce(linear(x, self.weight, None, self.small_batch))
        return y if self.bias is None else y + self.bias

    def load_param(self, param_name: str, tensor: torch.Tensor) -> None:
        if param_name == "bias":
            _copy_checked(self.bias, tensor, "bias")
            return
        expected = (self.out_features, self.inputs.full)
        if tuple(tensor.shape) != expected:
            raise ValueError(f"weight: checkpoint shape {tuple(tensor.shape)}, expected {expected}")
        _copy_checked(self.weight, tensor[:, self.inputs.start : self.inputs.stop], "weight")

    def extra_repr(self) -> str:
        return f"in={self.inputs.size}/{self.inputs.full}, out={self.out_features}"


class VocabParallelEmbedding(nn.Module):
    """Token embedding split by vocabulary rows across TP ranks."""

    def __init__(self, vocab_size: int, hidden_size: int, parallel: ParallelState) -> None:
        super().__init__()
        self.rows = parallel.vocab_shard(vocab_size)
        self.vocab_size = vocab_size
        self.parallel = parallel
        self.weight = nn.Parameter(torch.empty(self.rows.size, hidden_size))
        # A matmul-ready copy when this matrix also computes the logits (``models/prepack.py``),
        # and the logits matrix laid out for the small-batch matmul kernel.
        self.packed_logits_weight: torch.Tensor | None = None
        self.small_batch: MatmulPanels | None = None

    def logits_weight(self) -> torch.Tensor:
        """The matrix the logits multiply by: the packed copy when there is one."""
        packed = self.packed_logits_weight
        return self.weight if packed is None else packed

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.parallel.tp_size == 1:
            return F.embedding(token_ids, self.weight)
        mine = (token_ids >= self.rows.start) & (token_ids < self.rows.stop)
        local_ids = torch.where(mine, token_ids - self.rows.start, 0)
        embedded = F.embedding(local_ids, self.weight).masked_fill_(~mine[:, None], 0.0)
        return self.parallel.all_reduce(embedded)

    def load_param(self, param_name: str, tensor: torch.Tensor) -> None:
        expected = (self.vocab_size, self.weight.shape[1])
        if tuple(tensor.shape) != expected:
            raise ValueError(f"weight: checkpoint shape {tuple(tensor.shape)}, expected {expected}")
        mine = tensor[self.rows.start : min(self.rows.stop, self.vocab_size)]
        with torch.no_grad():
            self.weight[: mine.shape[0]].copy_(mine)
            self.weight[mine.shape[0] :].zero_()  # padding rows of the last rank

    def extra_repr(self) -> str:
        return f"rows={self.rows.start}..{self.rows.stop} of {self.vocab_size}"


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection, split by vocabulary rows like the embedding (and loadable from
    it when the checkpoint ties the two)."""


def stage_layer_list(
    num_layers: int, parallel: ParallelState, build: Callable[[int], nn.Module]
) -> tuple[nn.ModuleList, list[nn.Module]]:
    """Every layer index gets a module, so parameter names match the checkpoint's: this
    pipeline stage's layers are ``build(index)``, the others :class:`MissingLayer`. Returns
    (all of them, this stage's in order)."""
    mine = parallel.stage_layers(num_layers)
    layers = nn.ModuleList(build(i) if i in mine else MissingLayer() for i in range(num_layers))
    return layers, [layers[i] for i in mine]


def stage_lm_head(config: TransformerConfig, parallel: ParallelState) -> nn.Module | None:
    """The LM head this pipeline stage holds: a :class:`MissingLayer` before the last stage;
    None where it is tied to this same stage's embedding (logits use the embedding matrix);
    else its own matrix (untied, or a copy of a tied embedding that another stage holds)."""
    if not parallel.is_last_stage:
        return MissingLayer()
    if config.tie_word_embeddings and parallel.is_first_stage:
        return None
    return ParallelLMHead(config.vocab_size, config.hidden_size, parallel)


def previous_stage_hidden(intermediate: torch.Tensor | None) -> torch.Tensor:
    """What a pipeline stage other than the first starts from: the previous stage's output."""
    if intermediate is None:
        raise ValueError("a later pipeline stage needs the previous stage's hidden states")
    return intermediate


def vocab_parallel_logits(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    parallel: ParallelState,
    vocab_size: int,
    small_batch: MatmulPanels | None = None,
) -> torch.Tensor:
    """Float32 logits ``[rows, vocab]`` from this rank's vocabulary rows ``weight`` (and their
    small-batch panels): every TP rank's part, gathered in rank order, padding dropped."""
    local = linear(hidden, weight, None, small_batch, float32_sums=True)
    if parallel.tp_size == 1:
        return local.float()
    return parallel.all_gather_last_dim(local)[:, :vocab_size].float()


def _copy_checked(param: nn.Parameter | None, tensor: torch.Tensor, name: str) -> None:
    if param is None:
        raise KeyError(f"checkpoint has a {name} this layer does not have")
    if param.shape != tensor.shape:
        raise ValueError(
            f"{name}: checkpoint shape {tuple(tensor.shape)}, model shape {tuple(param.shape)}"
        )
    with torch.no_grad():
        param.copy_(tensor)
