"""The engine's LoRA adapters: the names it serves, the workers that hold them, the rules.

The engine never reads an adapter itself (it imports no torch): ``add_lora`` asks every worker
to read and check the directory (``worker.add_lora``), and the name is registered only when
they accepted it, so a request can only name an adapter every worker holds. A request naming
an unknown adapter fails alone, with a message naming it.

Unloading an adapter that requests are using (running, waiting, or compiling a grammar) is
refused, naming them: waiting would leave the caller hanging for as long as the longest of
them runs, and pulling the adapter from under them would either fail them or silently switch
them to the base model. The caller can abort them or retry.

Scheduling: at most ``--max-loras`` distinct adapters run at once (:func:`adapter_may_join`),
the number of resident slots the workers have, so every step's adapters fit.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any, Protocol

from switchboard.config.lora import LoraConfig, parse_lora_modules

logger = logging.getLogger(__name__)


class _HasAdapter(Protocol):
    request_id: str
    lora_name: str


class _Workers(Protocol):
    def collective_rpc(self, method: str, args: tuple[Any, ...] | list[Any] = ...) -> Any: ...


class LoraError(ValueError):
    """A LoRA call refused; the message names the adapter and why."""


def adapter_may_join(request: _HasAdapter, running: Iterable[_HasAdapter], max_loras: int) -> bool:
    """Whether ``request``'s adapter may run beside the running requests' adapters."""
    adapters = {r.lora_name for r in running if r.lora_name}
    return request.lora_name in adapters or len(adapters) < max_loras


def adapters_of(requests: Iterable[_HasAdapter]) -> list[str]:
    """The distinct adapters of these requests, sorted (the stats' lists)."""
    return sorted({r.lora_name for r in requests if r.lora_name})


class EngineLoras:
    def __init__(self, config: LoraConfig) -> None:
        self.config = config
        self.workers: _Workers | None = None  # set by start, once the workers are up
        self.adapters: dict[str, str] = {}  # name -> directory, every worker holds it

    def start(self, workers: _Workers) -> None:
        """Load ``--lora-modules`` on ``workers``; a bad one raises with its reason."""
        self.workers = workers
        for name, path in parse_lora_modules(self.config.lora_modules).items():
            self.add(name, path)

    def add(self, name: str, path: str) -> dict[str, Any]:
        self._check_enabled()
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise LoraError("add_lora needs an adapter name and a directory")
        if self.adapters.get(name) not in (None, path):
            raise LoraError(
                f"LoRA adapter {name!r} is already loaded from {self.adapters[name]}; "
                "unload it first"
            )
        answer = self._workers().collective_rpc("add_lora", (name, path))
        if answer.get("error"):
            raise LoraError(answer["error"])
        self.adapters[name] = path
        return dict(answer["adapter"])

    def remove(self, name: str, requests: Iterable[_HasAdapter]) -> None:
        self._check_enabled()
        if name not in self.adapters:
            raise LoraError(f"LoRA adapter {name!r} is not loaded")
        users = sorted(r.request_id for r in requests if r.lora_name == name)
        if users:
            shown = ", ".join(repr(u) for u in users[:5]) + (" ..." if len(users) > 5 else "")
            raise LoraError(
                f"LoRA adapter {name!r} is in use by {len(users)} request(s): {shown}; "
                "unload it when they are done"
            )
        self._workers().collective_rpc("remove_lora", (name,))
        del self.adapters[name]

    def names(self) -> dict[str, str]:
        return dict(self.adapters)

    def refusal(self, request: _HasAdapter) -> str | None:
        """Why a request cannot run here (None: it can)."""
        name = request.lora_name
        if not name or name in self.adapters:
            return None
        if not self.config.enable_lora:
            return f"LoRA adapter {name!r} requested but this engine serves no adapters"
        return f"LoRA adapter {name!r} is not loaded"

    def _workers(self) -> _Workers:
        if self.workers is None:
            raise LoraError("the engine's workers are not started")
        return self.workers

    def _check_enabled(self) -> None:
        if not self.config.enable_lora:
            raise LoraError("LoRA adapters are off: start the server with --enable-lora")
