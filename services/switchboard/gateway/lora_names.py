"""The LoRA adapters this gateway serves by name, and which one a request asks for.

A request asks for an adapter by naming it as its ``model`` (OpenAI's way, and vLLM's) or in
``GenerateRequest.lora_adapter``. A name that is neither the served model nor a loaded adapter
is NOT_FOUND, naming it: a request never silently runs on the base model instead.

Names come from ``--lora-modules`` at start, from the load/unload calls that went through
this gateway (``gateway/lora_admin.py``) and from the engines (``gateway/lora_lookup.py``). The
engines hold the adapters themselves and refuse a request for one they do not hold (one
unloaded through another gateway): the request is NOT_FOUND (``AdapterNotLoaded``) and this
gateway forgets the name, so a stale name here fails one request, never misroutes it.
"""

from __future__ import annotations

import grpc

from switchboard.config.lora import LoraConfig, parse_lora_modules
from switchboard.gateway.api_errors import ApiError, invalid_argument, model_not_found


class AdapterNotLoaded(ApiError):
    """NOT_FOUND: the engine did not hold the adapter ``name`` a request ran with."""

    def __init__(self, name: str, field: str) -> None:
        super().__init__(
            grpc.StatusCode.NOT_FOUND,
            f"LoRA adapter {name!r} is not loaded",
            reason="LORA_ADAPTER_NOT_FOUND",
            field=field,
        )
        self.name = name


class LoraNames:
    def __init__(self, config: LoraConfig | None = None) -> None:
        config = config or LoraConfig()
        self.enabled = config.enable_lora
        self.max_loras = config.max_loras
        self.adapters: dict[str, str] = {}  # name -> directory
        if config.enable_lora:
            self.adapters.update(parse_lora_modules(config.lora_modules))

    def choose(self, model: str, lora_adapter: str, served: str) -> str:
        """The adapter a request runs with ("" = the base model); ApiError for an unknown
        name (NOT_FOUND) or two different adapters asked for (INVALID_ARGUMENT)."""
        by_model = "" if not model or model == served else model
        if by_model and by_model not in self.adapters:
            raise model_not_found(model, self.served(served))
        if lora_adapter and lora_adapter not in self.adapters:
            raise ApiError(
                model_not_found(lora_adapter, served).code,
                f"LoRA adapter {lora_adapter!r} is not loaded"
                + (f" (loaded: {sorted(self.adapters)})" if self.adapters else "")
                + ("" if self.enabled else "; the server runs without --enable-lora"),
                reason="LORA_ADAPTER_NOT_FOUND",
                field="lora_adapter",
            )
        if by_model and lora_adapter and by_model != lora_adapter:
            raise invalid_argument(
                "lora_adapter",
                f"lora_adapter {lora_adapter!r} and model {model!r} name different adapters",
            )
        return lora_adapter or by_model

    def forget(self, name: str) -> None:
        """The engines no longer hold ``name``: the next request naming it asks them again."""
        self.adapters.pop(name, None)

    def served(self, base: str) -> str:
        """The names a request may use, for a NOT_FOUND message."""
        return ", ".join([base, *sorted(self.adapters)]) if self.adapters else base
