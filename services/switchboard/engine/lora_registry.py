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

An engine restarted by the supervisor serves the adapters it served before, not only
``--lora-modules``: every load and unload writes the engine's adapters to a file in the run
directory the supervisor gives it (:func:`adapters_file`), and a restarted engine loads what
that file lists instead (an adapter that no longer loads is logged and dropped: the engine
comes back without it rather than not at all). The gateways keep serving the names they knew.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from typing import Any, Protocol

from switchboard.config import EngineConfig
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


def adapters_file(run_dir: str, data_parallel_rank: int) -> str | None:
    """Where an engine keeps its adapters across its restarts: in the run directory the
    supervisor gives it (``run_dir``; "" for an engine on its own: no file), one per DP rank."""
    if not run_dir:
        return None
    return os.path.join(run_dir, f"lora-adapters-dp{data_parallel_rank}.json")


class EngineLoras:
    def __init__(self, config: LoraConfig, saved_file: str | None = None) -> None:
        """``saved_file``: where the adapters are written on every change and read at start
        (:func:`adapters_file`; None: nowhere)."""
        self.config = config
        self.saved_file = saved_file
        self.workers: _Workers | None = None  # set by start, once the workers are up
        self.adapters: dict[str, str] = {}  # name -> directory, every worker holds it

    @classmethod
    def for_engine(cls, config: EngineConfig) -> EngineLoras:
        return cls(config.model.lora, adapters_file(config.run_dir, config.data_parallel_rank))

    def start(self, workers: _Workers) -> None:
        """Load ``--lora-modules`` on ``workers``, a bad one raising with its reason; after a
        restart, the adapters the engine served before instead."""
        self.workers = workers
        saved = self._read_saved()
        if saved is None:
            for name, path in parse_lora_modules(self.config.lora_modules).items():
                self.add(name, path)
            return
        for name, path in saved.items():
            try:
                self.add(name, path)
            except LoraError as exc:
                logger.warning("LoRA adapter %r not loaded again after a restart: %s", name, exc)
        logger.info("LoRA adapters after a restart: %s", ", ".join(sorted(self.adapters)) or "none")
        self._save()  # without the ones that failed

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
        self._save()
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
        self._save()

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

    def _read_saved(self) -> dict[str, str] | None:
        """The adapters a previous run of this engine served; None: no previous run (or LoRA
        off, or an unreadable file, logged)."""
        if not self.config.enable_lora or self.saved_file is None:
            return None
        try:
            with open(self.saved_file) as file:
                saved = json.load(file)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            logger.warning(
                "LoRA adapters of the previous run unreadable (%s): using --lora-modules", exc
            )
            return None
        if not isinstance(saved, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in saved.items()
        ):
            logger.warning("LoRA adapters of the previous run malformed: using --lora-modules")
            return None
        return saved

    def _save(self) -> None:
        """Write the adapters where a restarted engine reads them (a whole file or none)."""
        if self.saved_file is None:
            return
        partial = f"{self.saved_file}.partial"
        try:
            with open(partial, "w") as file:
                json.dump(self.adapters, file)
            os.replace(partial, self.saved_file)
        except OSError as exc:  # the adapters are served; only a restart would lose them
            logger.warning("LoRA adapters not saved for a restart: %s", exc)
