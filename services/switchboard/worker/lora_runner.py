"""The model runner's LoRA side: which adapter each request runs with, and the step's batch.

A request's adapter arrives once, with the request (``NewRequest.lora_name``); each step the
runner hands the manager every scheduled request's adapter and token count in row order, and
the manager makes those adapters resident and sets the per-row slots the projections read. The
step's batch goes on the step's attention metadata (``metadata.lora``), where the model reads
it (the one-call decode stack adds the deltas itself, or leaves the step to the layers).
"""

from __future__ import annotations

from typing import Any

import torch

from switchboard.config.lora import LoraConfig
from switchboard.models.hf_config import TransformerConfig
from switchboard.models.lora.adapter import AdapterError
from switchboard.models.lora.manager import LoraLimits, LoraManager
from switchboard.models.parallel import ParallelState
from switchboard.wire.step_msgs import SchedulerOutput
from switchboard.worker.step_inputs import StepInputs


def lora_requests(runner: object) -> LoraRequests:
    """The runner's LoRA side; AdapterError where it has none."""
    if not hasattr(runner, "lora"):
        raise AdapterError("this model (an encoder) takes no LoRA adapters")
    lora = runner.lora
    if lora is None:
        raise AdapterError("LoRA adapters are off: start the server with --enable-lora")
    assert isinstance(lora, LoraRequests)
    return lora


def add_lora(runner: object, name: str, path: str) -> dict[str, Any]:
    try:
        return {"adapter": lora_requests(runner).manager.add(name, path)}
    except AdapterError as exc:
        return {"error": str(exc)}


class LoraRequests:
    def __init__(self, manager: LoraManager) -> None:
        self.manager = manager
        self.adapter_of: dict[str, str] = {}  # request id -> adapter name (adapter rows only)

    @classmethod
    def for_model(
        cls,
        model: torch.nn.Module,
        config: TransformerConfig,
        lora: LoraConfig,
        parallel: ParallelState,
        previous: LoraRequests | None = None,
    ) -> LoraRequests:
        """Stacks on ``model``'s projections; a model loaded again (after a deep sleep) keeps
        the adapters ``previous`` knew."""
        limits = LoraLimits(lora.max_loras, lora.max_lora_rank, lora.cpu_loras)
        manager = LoraManager(model, config, limits, parallel)
        if previous is not None:
            manager.known.update(previous.manager.known)
        return cls(manager)

    def apply(self, step: SchedulerOutput) -> None:
        for request_id in step.finished_request_ids:
            self.adapter_of.pop(request_id, None)
        for new in step.new_requests:
            if new.lora_name:
                self.adapter_of[new.request_id] = new.lora_name
            else:
                self.adapter_of.pop(new.request_id, None)

    def prepare(self, step: SchedulerOutput, inputs: StepInputs, device: torch.device) -> None:
        """Make the step's adapters resident and put each row's slot on the step's metadata."""
        rows = []
        if self.adapter_of:
            rows = [
                (self.adapter_of.get(request_id, ""), step.num_scheduled_tokens[request_id])
                for request_id in inputs.request_ids
            ]
        inputs.metadata.lora = self.manager.prepare(rows, device)

    def finish(self) -> None:
        self.manager.finish()
