"""A JSON request body, typed: a wrong type is a 400 naming the parameter (every route's)."""

from __future__ import annotations

import json
from typing import Any

from switchboard.gateway.api_errors import invalid_argument

_UINT32_MAX = (1 << 32) - 1


def parse_body(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as error:
        raise invalid_argument("body", f"the request body is not valid JSON: {error}") from None
    if not isinstance(body, dict):
        raise invalid_argument("body", "the request body must be a JSON object")
    return body


class JsonBody:
    """Typed reads of one JSON body; a wrong type is a 400 naming the parameter."""

    def __init__(self, body: dict[str, Any]) -> None:
        self.body = body

    def _get(self, name: str, types: tuple[type, ...], what: str) -> Any:
        value = self.body.get(name)
        if value is None:
            return None
        if isinstance(value, bool) and bool not in types:
            raise invalid_argument(name, f"{name} must be {what}, got {value!r}")
        if not isinstance(value, types):
            raise invalid_argument(name, f"{name} must be {what}, got {value!r}")
        return value

    def number(self, name: str) -> float | None:
        value = self._get(name, (int, float), "a number")
        return None if value is None else float(value)

    def integer(self, name: str) -> int | None:
        return self._get(name, (int,), "an integer")

    def int_in(self, name: str, bits: int) -> int | None:
        """A signed integer of ``bits`` bits (the proto field's)."""
        value = self.integer(name)
        if value is not None and not -(1 << (bits - 1)) <= value < 1 << (bits - 1):
            raise invalid_argument(name, f"{name} is out of range: {value}")
        return value

    def uint(self, name: str) -> int | None:
        value = self.integer(name)
        if value is not None and not 0 <= value <= _UINT32_MAX:
            raise invalid_argument(name, f"{name} must be a non-negative integer, got {value}")
        return value

    def boolean(self, name: str) -> bool | None:
        return self._get(name, (bool,), "a boolean")

    def string(self, name: str) -> str | None:
        return self._get(name, (str,), "a string")

    def object(self, name: str) -> dict[str, Any] | None:
        return self._get(name, (dict,), "an object")

    def array(self, name: str) -> list[Any] | None:
        return self._get(name, (list,), "an array")

    def uint_list(self, name: str) -> list[int]:
        values = self.array(name) or []
        for value in values:
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise invalid_argument(name, f"{name} must be an array of token ids")
        return values

    def str_list(self, name: str) -> list[str]:
        value = self.body.get(name)
        if value is None:
            return []
        if isinstance(value, str):
            return [value]
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return value
        raise invalid_argument(name, f"{name} must be a string or an array of strings")


def is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
