"""Loading and unloading LoRA adapters while serving, on every engine core at once.

Both go to every live engine (each data-parallel rank holds its own copy) as UTILITY calls,
run by each engine between two steps: running requests go on. The gateway serves the name
only once every engine holds the adapter; a load that some engine refuses is undone on the
others and reported with that engine's reason (INVALID_ARGUMENT: rank above the maximum, a
target module the model lacks, a shape mismatch with the base model, a corrupt file ...).

Unloading an adapter that requests still use is refused (FAILED_PRECONDITION, HTTP 409) with
the requests named, and the engines that had already let it go get it back: the adapter stays
served whole. The name stops being served the moment the unload is asked for, so no new request
can start with it meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import grpc

from switchboard.gateway.api_errors import ApiError, invalid_argument, unavailable
from switchboard.gateway.engines.types import EngineHandle
from switchboard.gateway.lora_names import LoraNames
from switchboard.gateway.pipeline.request_bounds import check_model_name
from switchboard.gateway.state import GatewayState

logger = logging.getLogger(__name__)

LORA_TIMEOUT_S = 120.0  # reading and checking an adapter on every worker
IN_USE_REASON = "LORA_ADAPTER_IN_USE"
_PASSED_THROUGH = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


class LoraAdmin:
    def __init__(self, state: GatewayState) -> None:
        self._state = state

    @property
    def _names(self) -> LoraNames:
        return self._state.facts.loras

    async def load(self, name: str, path: str) -> dict[str, Any]:
        names = self._check_enabled()
        if not name:
            raise invalid_argument("lora_name", "lora_name: an adapter needs a name")
        check_model_name(name)
        if not path:
            raise invalid_argument("lora_path", "lora_path: the adapter's directory is missing")
        if name == self._state.facts.name:
            raise invalid_argument("lora_name", f"lora_name {name!r} is the base model's name")
        if name in names.adapters:
            raise ApiError(
                grpc.StatusCode.ALREADY_EXISTS,
                f"LoRA adapter {name!r} is already loaded (from {names.adapters[name]})",
                reason="LORA_ADAPTER_EXISTS",
                field="lora_name",
            )
        engines = self._engines()
        outcomes = await self._on_each(engines, "add_lora", [name, path])
        failed = [(e, o) for e, o in outcomes if isinstance(o, BaseException)]
        if failed:
            loaded = [e for e, o in outcomes if not isinstance(o, BaseException)]
            await self._on_each(loaded, "remove_lora", [name])  # undo: all or nothing
            raise _refusal(failed[0][1], "lora_path")
        names.adapters[name] = path
        logger.info("LoRA adapter %r loaded from %s on %d engine(s)", name, path, len(engines))
        described = outcomes[0][1]
        return dict(described) if isinstance(described, dict) else {"name": name}

    async def unload(self, name: str) -> None:
        names = self._check_enabled()
        if name not in names.adapters:
            raise ApiError(
                grpc.StatusCode.NOT_FOUND,
                f"LoRA adapter {name!r} is not loaded",
                reason="LORA_ADAPTER_NOT_FOUND",
                field="lora_name",
            )
        engines = self._engines()
        path = names.adapters.pop(name)  # no new request starts with it from now on
        outcomes = await self._on_each(engines, "remove_lora", [name])
        failed = [(e, o) for e, o in outcomes if isinstance(o, BaseException)]
        if failed:
            removed = [e for e, o in outcomes if not isinstance(o, BaseException)]
            await self._on_each(removed, "add_lora", [name, path])  # served whole again
            names.adapters[name] = path
            raise _refusal(failed[0][1], "lora_name", in_use=True)
        logger.info("LoRA adapter %r unloaded from %d engine(s)", name, len(engines))

    def adapters(self) -> dict[str, str]:
        return dict(self._names.adapters)

    def _check_enabled(self) -> LoraNames:
        names = self._names
        if not names.enabled:
            raise ApiError(
                grpc.StatusCode.FAILED_PRECONDITION,
                "LoRA adapters are off: start the server with --enable-lora",
                reason="LORA_DISABLED",
            )
        return names

    def _engines(self) -> list[EngineHandle]:
        live = self._state.engines.live_engines
        if not live:
            raise unavailable("no engine core is ready")
        return live

    async def _on_each(
        self, engines: list[EngineHandle], method: str, args: list[Any]
    ) -> list[tuple[EngineHandle, Any]]:
        calls = (
            self._state.engines.call_utility(engine, method, args, LORA_TIMEOUT_S)
            for engine in engines
        )
        results = await asyncio.gather(*calls, return_exceptions=True)
        return list(zip(engines, results, strict=True))


def _refusal(error: BaseException, field: str, in_use: bool = False) -> ApiError:
    """An engine's refusal as the caller's error: the engine's reason, the right code."""
    if not isinstance(error, ApiError):
        return ApiError(grpc.StatusCode.INTERNAL, f"LoRA call failed: {error}")
    if error.code in _PASSED_THROUGH:
        return error
    message = error.message.split(" method failed: ", 1)[-1]  # the engine's own words
    if in_use:
        return ApiError(
            grpc.StatusCode.FAILED_PRECONDITION, message, reason=IN_USE_REASON, field=field
        )
    return invalid_argument(field, message, reason="LORA_ADAPTER_REFUSED")
