"""Calling a worker method named by an :class:`RpcCall`, safely.

Only names on the target's allow-list can be called. Arguments arrive as plain msgpack values
and are converted to the types the method is annotated with (``msgspec.convert``), so a
``SchedulerOutput`` arrives as a struct without any pickle on the wire.
"""

from __future__ import annotations

import inspect
import logging
import traceback
import typing
from collections.abc import Callable
from functools import cache
from typing import Any

import msgspec

from switchboard.wire.step_msgs import RpcCall, RpcReply

logger = logging.getLogger(__name__)


def dispatch(target: object, allowed: frozenset[str], call: RpcCall, rank: int) -> RpcReply:
    """Run ``call`` on ``target``; an exception becomes ``RpcReply(error=...)``."""
    try:
        if call.method not in allowed:
            raise AttributeError(f"{call.method!r} is not a worker RPC method")
        method = getattr(target, call.method)
        args, kwargs = convert_arguments(method, call.args, call.kwargs)
        return RpcReply(call_id=call.call_id, rank=rank, result=method(*args, **kwargs))
    except Exception as exc:  # noqa: BLE001 - every failure must reach the engine
        logger.error(
            "RPC %s (call %d) failed:\n%s", call.method, call.call_id, traceback.format_exc()
        )
        return RpcReply(call_id=call.call_id, rank=rank, error=f"{type(exc).__name__}: {exc}")


def convert_arguments(
    method: Callable[..., Any], args: list[Any], kwargs: dict[str, Any]
) -> tuple[list[Any], dict[str, Any]]:
    # The signature is the plain function's (cached per function), so a bound method's
    # instance is bound as its first argument and left out of what is returned.
    leading = (method.__self__,) if inspect.ismethod(method) else ()
    signature, hints = _signature_and_hints(getattr(method, "__func__", method))
    bound = signature.bind(*leading, *args, **kwargs)
    for name, value in bound.arguments.items():
        if name in hints:
            bound.arguments[name] = msgspec.convert(value, hints[name])
    return list(bound.args)[len(leading) :], dict(bound.kwargs)


@cache
def _signature_and_hints(function: Callable[..., Any]) -> tuple[inspect.Signature, dict]:
    """Looked up once per method: ``inspect.signature`` costs more than a decode step's
    conversion itself."""
    hints = typing.get_type_hints(function)
    hints.pop("return", None)
    return inspect.signature(function), hints
