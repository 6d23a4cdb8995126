"""Typed access to the key/value metadata of a GGUF file (the header before the tensors)."""

from __future__ import annotations

from typing import Any

from gguf import GGUFReader

_MISSING = object()


def field(reader: GGUFReader, key: str, default: Any = _MISSING) -> Any:
    """The value stored under `key` as a Python value (str, int, float, bool or list).

    Raises KeyError naming the key when it is absent and no default is given, so a GGUF file
    that lacks a required fact fails with a message that says which one.
    """
    entry = reader.fields.get(key)
    if entry is None:
        if default is _MISSING:
            raise KeyError(f"GGUF metadata has no {key!r}")
        return default
    return entry.contents()


def arch_field(reader: GGUFReader, name: str, default: Any = _MISSING) -> Any:
    """A per-architecture key such as `llama.block_count` (`name` without the prefix)."""
    arch = field(reader, "general.architecture")
    return field(reader, f"{arch}.{name}", default)
