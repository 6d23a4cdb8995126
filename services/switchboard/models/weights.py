"""Copying checkpoint tensors into a model's parameters, fused layers included.

A family names its parameters like the checkpoint, except for fused layers: several checkpoint
matrices (``q_proj``/``k_proj``/``v_proj``) live stacked in one :class:`MergedLinear`
(``qkv_proj``). ``stacked`` maps a checkpoint module name to ``(fused module name, shard)``;
a fused parameter counts as loaded once every one of its shards was.

Tensor- and pipeline-parallel models (``parallel_layers``) plug in two ways: a module with a
``load_param(param_name, tensor)`` method takes its own slice of the full checkpoint tensor, and
tensors under a :class:`MissingLayer` (a layer of another pipeline stage) are skipped.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import torch
from torch import nn

from switchboard.models.layers import MergedLinear
from switchboard.models.parallel_layers import MissingLayer, ParallelLMHead

# checkpoint module name -> (our fused module name, shard name): the Llama-style layout.
LLAMA_STACKED_MODULES: dict[str, tuple[str, str]] = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}


def load_named_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    stacked: Mapping[str, tuple[str, str]],
) -> set[str]:
    """Copy each ``(name, tensor)`` into its parameter; returns the parameter names filled.

    A name with no place in the model, or a shape that differs, is an error naming both.
    """
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    elsewhere = tuple(path + "." for path, m in modules.items() if isinstance(m, MissingLayer))
    loaded: set[str] = set()
    for name, tensor in weights:
        if name.startswith(elsewhere):
            continue  # another pipeline stage holds it
        module_path, _, param_name = name.rpartition(".")
        parent, _, module_name = module_path.rpartition(".")
        if module_name in stacked:
            fused_name, shard = stacked[module_name]
            fused_path = f"{parent}.{fused_name}" if parent else fused_name
            fused = modules.get(fused_path)
            if not isinstance(fused, MergedLinear):
                raise KeyError(f"checkpoint tensor {name!r} has no place in {type(model).__name__}")
            fused.load_shard(shard, param_name, tensor)
            loaded.add(f"{fused_path}.{param_name}#{shard}")
            continue
        if name not in params:
            raise KeyError(f"checkpoint tensor {name!r} has no place in {type(model).__name__}")
        load_param = getattr(modules.get(module_path), "load_param", None)
        if load_param is not None:  # a parallel layer: it keeps only its own slice
            load_param(param_name, tensor)
            loaded.add(name)
            continue
        param = params[name]
        if param.shape != tensor.shape:
            raise ValueError(
                f"{name}: checkpoint shape {tuple(tensor.shape)}, model shape {tuple(param.shape)}"
            )
        with torch.no_grad():
            param.copy_(tensor)
        loaded.add(name)
    return _collapse_shards(loaded, modules)


def with_tied_lm_head(
    weights: Iterable[tuple[str, torch.Tensor]],
    tied: bool,
    lm_head: nn.Module | None,
    embedding_name: str,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint tensors with the LM head sorted out: a tied checkpoint's ``lm_head.*``
    copy of the embedding is dropped, and where this stage holds its own head matrix for a tied
    head (``lm_head`` is a :class:`ParallelLMHead`) the embedding ``embedding_name`` is also
    handed on as ``lm_head.weight``."""
    separate_tied_head = tied and isinstance(lm_head, ParallelLMHead)
    for name, tensor in weights:
        if tied and name.startswith("lm_head."):
            continue
        if separate_tied_head and name == embedding_name:
            yield "lm_head.weight", tensor  # the last stage's copy of the tied matrix
        yield name, tensor


def _collapse_shards(loaded: set[str], modules: dict[str, nn.Module]) -> set[str]:
    """Count a fused parameter as loaded once every one of its shards was."""
    result = {name for name in loaded if "#" not in name}
    shards_seen: dict[str, set[str]] = {}
    for name in loaded - result:
        param_path, shard = name.split("#")
        shards_seen.setdefault(param_path, set()).add(shard)
    for param_path, shards in shards_seen.items():
        module = modules[param_path.rpartition(".")[0]]
        assert isinstance(module, MergedLinear)  # only MergedLinear.load_shard makes shards
        if shards == set(module.shard_sizes):
            result.add(param_path)
    return result
