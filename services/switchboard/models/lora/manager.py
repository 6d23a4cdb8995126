"""The adapters a model serves: which are known, which have a CPU copy, which are resident.

* known: name -> directory, from ``add`` until ``remove``; only known names can be requested.
* CPU copies: the checked matrices of at most ``max_cpu_loras`` adapters, least recently used
  dropped first (a dropped one is read again from its directory when next needed).
* resident: ``max_loras`` slots in every projection's :class:`LoraStack`. A step asks for its
  adapters (the scheduler keeps them to at most ``max_loras``); an adapter not resident takes a
  free slot or the least recently used one this step does not need.

Pipeline stages: every stage checks the whole adapter (the same refusals everywhere) and
loads only its own layers' matrices.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import nn

from switchboard.kernels import lora_delta
from switchboard.kernels.lora_delta import StackLora
from switchboard.models.hf_config import TransformerConfig
from switchboard.models.lora.adapter import AdapterError, LoraAdapter, read_adapter
from switchboard.models.lora.families import adapter_layout, attach_stacks
from switchboard.models.lora.stacks import ActiveBatch, LoraBatch, LoraStack
from switchboard.models.parallel import ParallelState

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoraLimits:
    max_loras: int  # adapters resident at once (in one step)
    max_lora_rank: int
    max_cpu_loras: int  # CPU copies kept


class LoraManager:
    def __init__(
        self,
        model: nn.Module,
        config: TransformerConfig,
        limits: LoraLimits,
        parallel: ParallelState,
    ) -> None:
        self.model = model
        self.config = config
        self.limits = limits
        self.layout = adapter_layout(model, config)
        self.active = ActiveBatch()
        if _device(model).type == "cpu":
            lora_delta.load()
        self.stacks = attach_stacks(
            model, limits.max_loras, limits.max_lora_rank, parallel, self.active
        )
        self.slot_ranks = torch.zeros(limits.max_loras, dtype=torch.int64)
        # what the one-call decode stack reads of the slots (None: it cannot add the deltas)
        self.stack_fields = _stack_fields(self.stacks, config, parallel)
        self.known: dict[str, str] = {}
        self.cpu: OrderedDict[str, LoraAdapter] = OrderedDict()
        self.slots: list[str | None] = [None] * limits.max_loras
        self.slot_order: list[int] = list(range(limits.max_loras))  # least recently used first
        resident = sum(stack.nbytes for stacks in self.stacks.values() for stack in stacks)
        logger.info(
            "LoRA: %d resident slots of rank <= %d (%.1f MiB), %d CPU copies",
            limits.max_loras,
            limits.max_lora_rank,
            resident / 2**20,
            limits.max_cpu_loras,
        )

    # -- the adapters known -----------------------------------------------------------------

    def add(self, name: str, path: str) -> dict[str, object]:
        """Read and check the adapter (nothing resident changes); raises AdapterError."""
        if not name:
            raise AdapterError("a LoRA adapter needs a name")
        if name in self.known and self.known[name] != path:
            raise AdapterError(
                f"LoRA adapter {name!r} is already loaded from {self.known[name]}; unload it first"
            )
        adapter = self._read(name, path)
        self.known[name] = path
        self._keep_cpu_copy(adapter)
        self._evict_slot(name)  # a reload of the same name: the resident copy may be stale
        logger.info(
            "LoRA adapter %r loaded from %s: rank %d, %s (%.1f MiB)",
            name,
            path,
            adapter.rank,
            ", ".join(adapter.modules),
            adapter.nbytes / 2**20,
        )
        return describe(adapter)

    def remove(self, name: str) -> None:
        if name not in self.known:
            raise AdapterError(f"LoRA adapter {name!r} is not loaded")
        del self.known[name]
        self.cpu.pop(name, None)
        self._evict_slot(name)
        logger.info("LoRA adapter %r unloaded", name)

    def names(self) -> list[str]:
        return sorted(self.known)

    # -- a step ------------------------------------------------------------------------------

    def prepare(
        self, row_adapters: list[tuple[str, int]], device: torch.device
    ) -> LoraBatch | None:
        """The step's batch, which the projections' hooks read until :meth:`finish`:
        ``row_adapters`` is each request's adapter ("" = base) and token count, in row order.
        None (no adapter row): the hooks do nothing at all."""
        names = {name for name, _ in row_adapters if name}
        if not names:
            self.active.current = None
            return None
        slot_of = self._make_resident(names)
        slots = [slot_of[name] if name else -1 for name, _ in row_adapters]
        counts = [count for _, count in row_adapters]
        token_slots = torch.repeat_interleave(torch.tensor(slots), torch.tensor(counts))
        stack = None
        if self.stack_fields is not None and lora_delta.in_use():
            fields, held = self.stack_fields
            rank = self.limits.max_lora_rank
            stack = StackLora(fields, held, rank, self.slot_ranks, token_slots)
        batch = LoraBatch(token_slots, device, self.slot_ranks, stack)
        self.active.current = batch
        return batch

    def finish(self) -> None:
        """The step is done: no stale batch for what runs next (a graph capture, say)."""
        self.active.current = None

    def _make_resident(self, names: set[str]) -> dict[str, int]:
        if len(names) > self.limits.max_loras:
            raise RuntimeError(
                f"a step asks for {len(names)} LoRA adapters; --max-loras is "
                f"{self.limits.max_loras}"
            )
        slot_of = {name: slot for slot, name in enumerate(self.slots) if name in names}
        for name in sorted(names - slot_of.keys()):
            if name not in self.known:
                raise KeyError(f"LoRA adapter {name!r} is not loaded")
            free = [slot for slot in self.slot_order if self.slots[slot] not in names]
            slot = next((s for s in free if self.slots[s] is None), free[0])
            self._load_slot(slot, self._cpu_copy(name))
            slot_of[name] = slot
        for slot in slot_of.values():  # most recently used last
            self.slot_order.remove(slot)
            self.slot_order.append(slot)
        return slot_of

    def _load_slot(self, slot: int, adapter: LoraAdapter) -> None:
        for layer_index, stacks in self.stacks.items():
            pairs = adapter.layers.get(layer_index, {})
            for stack in stacks:
                stack.load(slot, pairs, adapter.scaling)
        self.slots[slot] = adapter.name
        self.slot_ranks[slot] = adapter.rank

    def _evict_slot(self, name: str) -> None:
        for slot, resident in enumerate(self.slots):
            if resident == name:
                self.slots[slot] = None

    # -- CPU copies --------------------------------------------------------------------------

    def _read(self, name: str, path: str) -> LoraAdapter:
        return read_adapter(
            name, path, self.layout, self.config.num_layers, self.limits.max_lora_rank
        )

    def _cpu_copy(self, name: str) -> LoraAdapter:
        adapter = self.cpu.get(name)
        if adapter is None:
            adapter = self._read(name, self.known[name])
        self._keep_cpu_copy(adapter)
        return adapter

    def _keep_cpu_copy(self, adapter: LoraAdapter) -> None:
        self.cpu[adapter.name] = adapter
        self.cpu.move_to_end(adapter.name)
        while len(self.cpu) > self.limits.max_cpu_loras:
            self.cpu.popitem(last=False)


def describe(adapter: LoraAdapter) -> dict[str, object]:
    return {
        "name": adapter.name,
        "path": adapter.path,
        "rank": adapter.rank,
        "scaling": adapter.scaling,
        "target_modules": adapter.modules,
    }


def _device(model: nn.Module) -> torch.device:
    parameter = next(model.parameters(), None)
    return torch.device("cpu") if parameter is None else parameter.device


def _stack_fields(
    stacks: dict[int, list[LoraStack]], config: TransformerConfig, parallel: ParallelState
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None:
    """Per layer the addresses of the A and B of qkv, o, gate_up and down for the one-call decode
    stack, and the tensors they point into; None where it cannot use them: more than one
    process (the stack runs one), a projection the C kernel cannot take, or fused parts other
    than the q, k, v and gate, up columns the stack derives from the layer's shape."""
    if parallel.world_size != 1 or not stacks:
        return None
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    expected_columns = (
        [0, q, q + kv, q + 2 * kv],
        [0, config.hidden_size],
        [0, config.intermediate_size, 2 * config.intermediate_size],
        [0, config.hidden_size],
    )
    rows, held = [], []
    for index in sorted(stacks):
        row = []
        for stack, columns in zip(stacks[index], expected_columns, strict=True):
            kernel = stack.kernel
            if kernel is None or kernel.columns.tolist() != columns:
                return None
            row += [kernel.a.data_ptr(), kernel.b.data_ptr()]
            held += [kernel.a, kernel.b]
        rows.append(row)
    return torch.tensor(rows, dtype=torch.int64), tuple(held)
