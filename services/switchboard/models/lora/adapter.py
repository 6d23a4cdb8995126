"""One LoRA adapter read from a PEFT directory and checked against the base model.

A PEFT adapter directory holds ``adapter_config.json`` (``r``, ``lora_alpha``,
``target_modules``, ``use_rslora``, ...) and ``adapter_model.safetensors`` with, per adapted
projection, ``...layers.{i}.self_attn.q_proj.lora_A.weight`` (``[r, in]``) and
``...lora_B.weight`` (``[out, r]``); which projections a family has and how its tensors are
named is its :class:`AdapterLayout` (``models/lora/families.py``). The delta it adds to the
projection's output is ``x A^T B^T * scaling`` with ``scaling = lora_alpha / r``
(``lora_alpha / sqrt(r)`` with rsLoRA).

Everything an adapter could get wrong is refused here, on the CPU, before any resident weight
is touched: a rank above the server's maximum, DoRA or trained biases (not plain LoRA), a
projection the model does not have, a shape that does not match the base model (an adapter
trained for another model), a file that is not a readable safetensors file.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


class AdapterError(ValueError):
    """An adapter that cannot be served; the message names the adapter and the problem."""


@dataclass(frozen=True)
class ProjectionShape:
    """A base-model projection an adapter may target: its full input and output sizes."""

    in_features: int
    out_features: int


@dataclass(frozen=True)
class AdapterLayout:
    """A model family's adapter tensors: the projections they may target, by the module name
    the adapter's keys use (``q_proj``; ``attn.c_proj`` where a bare name is ambiguous), in
    order, and the pattern of a tensor's name (groups: layer index, module, ``A`` or ``B``)."""

    projections: dict[str, ProjectionShape]
    tensor_name: re.Pattern[str]

    def targets(self, target: str) -> bool:
        """Whether PEFT's ``target_modules`` entry ``target`` names one of the projections
        (PEFT matches a name's dotted suffix: ``c_proj`` is both ``attn.c_proj`` and
        ``mlp.c_proj``)."""
        return any(key == target or key.endswith("." + target) for key in self.projections)


@dataclass
class LoraAdapter:
    name: str
    path: str
    rank: int
    scaling: float
    order: tuple[str, ...]  # the family's projections, in order
    # layer index -> PEFT module name -> (A [rank, in], B [out, rank]), float32 on the CPU
    layers: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(
            a.numel() * a.element_size() + b.numel() * b.element_size()
            for pairs in self.layers.values()
            for a, b in pairs.values()
        )

    @property
    def modules(self) -> list[str]:
        found = {module for pairs in self.layers.values() for module in pairs}
        return [module for module in self.order if module in found]


def read_adapter(
    name: str,
    path: str,
    layout: AdapterLayout,
    num_layers: int,
    max_rank: int,
) -> LoraAdapter:
    """Read and check the adapter in directory ``path``; raises :class:`AdapterError`."""
    where = f"LoRA adapter {name!r} ({path})"
    projections = layout.projections
    settings = _read_config(where, path)
    rank, scaling = _check_config(where, settings, layout, max_rank)
    tensors = _read_tensors(where, path)
    adapter = LoraAdapter(name, path, rank, scaling, tuple(projections))
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = layout.tensor_name.match(key)
        if match is None:
            raise AdapterError(
                f"{where}: tensor {key!r} is not the lora_A/lora_B matrix of a layer's "
                f"projection ({', '.join(projections)})"
            )
        layer, module, half = int(match.group(1)), match.group(2), match.group(3)
        if module not in projections:
            raise AdapterError(f"{where}: target module {module!r}: the model has no such layer")
        if layer >= num_layers:
            raise AdapterError(f"{where}: tensor {key!r}: the model has {num_layers} layers")
        halves.setdefault((layer, module), {})[half] = tensor
    if not halves:
        raise AdapterError(f"{where}: {WEIGHTS_FILE} holds no LoRA matrices")
    for (layer, module), pair in sorted(halves.items()):
        a, b = _check_pair(where, layer, module, pair, projections[module], rank)
        adapter.layers.setdefault(layer, {})[module] = (a, b)
    return adapter


def _read_config(where: str, path: str) -> dict[str, object]:
    if not os.path.isdir(path):
        raise AdapterError(f"{where}: no such directory")
    config_path = os.path.join(path, CONFIG_FILE)
    try:
        with open(config_path, encoding="utf-8") as file:
            settings = json.load(file)
    except FileNotFoundError:
        raise AdapterError(f"{where}: no {CONFIG_FILE}") from None
    except (OSError, ValueError) as exc:
        raise AdapterError(f"{where}: {CONFIG_FILE} is not readable JSON: {exc}") from None
    if not isinstance(settings, dict):
        raise AdapterError(f"{where}: {CONFIG_FILE} is not a JSON object")
    return settings


def _check_config(
    where: str,
    settings: Mapping[str, object],
    layout: AdapterLayout,
    max_rank: int,
) -> tuple[int, float]:
    """(rank, scaling) of a plain LoRA adapter whose settings this server can serve."""
    peft_type = settings.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise AdapterError(f"{where}: peft_type {peft_type!r}; only LORA adapters are served")
    if settings.get("use_dora"):
        raise AdapterError(f"{where}: use_dora is true; DoRA adapters are not supported")
    if settings.get("bias", "none") not in ("none", None):
        raise AdapterError(f"{where}: bias {settings.get('bias')!r}; only bias 'none' is served")
    for unsupported in ("modules_to_save", "rank_pattern", "alpha_pattern"):
        if settings.get(unsupported):
            raise AdapterError(f"{where}: {unsupported} is set; it is not supported")
    rank = settings.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise AdapterError(f"{where}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise AdapterError(f"{where}: rank {rank} is above --max-lora-rank {max_rank}")
    alpha = settings.get("lora_alpha", rank)
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise AdapterError(f"{where}: lora_alpha must be a number, got {alpha!r}")
    targets = settings.get("target_modules")
    if isinstance(targets, list):
        for target in targets:
            if not layout.targets(target):
                raise AdapterError(
                    f"{where}: target module {target!r}: the model has no such layer "
                    f"(it has {', '.join(layout.projections)})"
                )
    scaling = alpha / math.sqrt(rank) if settings.get("use_rslora") else alpha / rank
    return rank, float(scaling)


def _read_tensors(where: str, path: str) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    weights_path = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(weights_path):
        raise AdapterError(f"{where}: no {WEIGHTS_FILE}")
    try:
        return load_file(weights_path, device="cpu")
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise AdapterError(f"{where}: {WEIGHTS_FILE} is corrupt or unreadable: {exc}") from None


def _check_pair(
    where: str,
    layer: int,
    module: str,
    pair: Mapping[str, torch.Tensor],
    shape: ProjectionShape,
    rank: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    label = f"layer {layer} {module}"
    if "A" not in pair or "B" not in pair:
        missing = "lora_A" if "A" not in pair else "lora_B"
        raise AdapterError(f"{where}: {label} has no {missing} matrix")
    a, b = pair["A"], pair["B"]
    if not (a.is_floating_point() and b.is_floating_point()):
        raise AdapterError(f"{where}: {label}: LoRA matrices must be floating point")
    expected_a, expected_b = (rank, shape.in_features), (shape.out_features, rank)
    if tuple(a.shape) != expected_a or tuple(b.shape) != expected_b:
        raise AdapterError(
            f"{where}: {label}: shape mismatch with the base model: lora_A "
            f"{list(a.shape)} and lora_B {list(b.shape)}, expected {list(expected_a)} and "
            f"{list(expected_b)} (rank {rank}; an adapter trained for another base model?)"
        )
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        raise AdapterError(f"{where}: {label}: the matrices hold NaN or infinite values")
    return a.float().contiguous(), b.float().contiguous()
