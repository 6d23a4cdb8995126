"""LoRA on wire 1: ``EngineCoreRequest.lora_request`` and the LoRA UTILITY calls.

``lora_request`` is a map in vLLM's ``LoRARequest`` spelling: ``{"lora_name": NAME}`` (an
older or other peer may add ``lora_int_id`` / ``lora_path``; the engine reads the name only:
the adapter's directory is what ``add_lora`` registered under it, never a path a request
names). None or absent: the base model.

UTILITY calls (``engine/utility.py``): ``add_lora(name, path)`` -> the adapter's description
(name, path, rank, scaling, target_modules); ``remove_lora(name)`` -> None; ``list_loras()``
-> ``{name: path}``. They fail with a message naming the adapter and the problem.
"""

from __future__ import annotations

from typing import Any

LORA_NAME_KEY = "lora_name"


def lora_request(name: str) -> dict[str, Any] | None:
    """The ``lora_request`` of a request for adapter ``name`` ("" = the base model)."""
    return {LORA_NAME_KEY: name} if name else None


MAX_LORA_NAME_CHARS = 256


def lora_name_of(lora_request: dict[str, Any] | None) -> str:
    """The adapter a request names ("" = the base model); ValueError for a malformed map."""
    if lora_request is None:
        return ""
    return check_lora_request(lora_request)


def check_lora_request(lora_request: object) -> str:
    """The adapter name of a ``lora_request`` map; ValueError saying what is wrong."""
    name = lora_request.get(LORA_NAME_KEY) if isinstance(lora_request, dict) else None
    if not isinstance(name, str) or not 0 < len(name) <= MAX_LORA_NAME_CHARS:
        raise ValueError(f"must carry {LORA_NAME_KEY!r}: 1 to {MAX_LORA_NAME_CHARS} characters")
    return name
