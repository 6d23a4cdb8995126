"""Calling a worker method named by an :class:`RpcCall`, safely.

Only names on the target's allow-list can be called. A call's positional arguments are decoded
straight into the types the method is annotated with (``dispatch_encoded``: the per-step
``SchedulerOutput``); any other call's arrive as plain msgpack values and are converted to those
types (``msgspec.convert``). Either way no pickle is ever on the wire.
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

from switchboard.wire.codec import RPC_ARGUMENTS, RPC_CALL_HEAD, Codec, DecodeError
from switchboard.wire.step_msgs import RpcCall, RpcCallHead, RpcReply

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
        return _failed(call.method, call.call_id, rank, exc)


def dispatch_encoded(
    target: object, allowed: frozenset[str], payload: bytes, rank: int
) -> tuple[RpcCallHead, RpcReply]:
    """``dispatch`` of an encoded :class:`RpcCall`; returns the call's head with the reply.
    Positional arguments are decoded straight into the types the method is annotated with
    (the per-step ``execute_model``: no plain values to convert); anything else, or arguments
    that do not decode so, takes ``dispatch``'s path, and its errors."""
    head = RPC_CALL_HEAD.decode(payload)
    typed = None
    method = getattr(target, head.method, None) if head.method in allowed else None
    if method is not None and not head.kwargs:
        codec = _positional_codec(getattr(method, "__func__", method))
        try:
            typed = None if codec is None else codec.decode(head.args)
        except DecodeError:
            typed = None
    if method is None or typed is None:
        args = RPC_ARGUMENTS.decode(head.args)
        call = RpcCall(head.call_id, head.method, args, head.kwargs, head.output_rank)
        return head, dispatch(target, allowed, call, rank)
    try:
        return head, RpcReply(call_id=head.call_id, rank=rank, result=method(*typed))
    except Exception as exc:  # noqa: BLE001 - every failure must reach the engine
        return head, _failed(head.method, head.call_id, rank, exc)


def _failed(method: str, call_id: int, rank: int, exc: Exception) -> RpcReply:
    logger.error("RPC %s (call %d) failed:\n%s", method, call_id, traceback.format_exc())
    return RpcReply(call_id=call_id, rank=rank, error=f"{type(exc).__name__}: {exc}")


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
def _positional_codec(function: Callable[..., Any]) -> Codec[tuple[Any, ...]] | None:
    """A codec of all of a method's arguments after ``self``, each as annotated, in order
    (None where one is unannotated or not a plain positional parameter). Looked up once."""
    signature, hints = _signature_and_hints(function)
    parameters = list(signature.parameters.values())[1:]
    if not parameters or any(
        p.kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD or p.name not in hints
        for p in parameters
    ):
        return None
    return Codec(tuple[tuple(hints[p.name] for p in parameters)])  # type: ignore[misc,arg-type]


@cache
def _signature_and_hints(function: Callable[..., Any]) -> tuple[inspect.Signature, dict]:
    """Looked up once per method: ``inspect.signature`` costs more than a decode step's
    conversion itself."""
    hints = typing.get_type_hints(function)
    hints.pop("return", None)
    return inspect.signature(function), hints
