"""Every message of both wires round-trips with *every* field away from its default.

The instances are built from the structs' own type information, so a field appended later
(the contracts grow by appending) is covered without touching this test."""

from __future__ import annotations

from typing import Any

import msgspec
import msgspec.inspect as mi
import pytest

from switchboard.wire import codec, engine_msgs, step_msgs, zmq_channel


def _wire_structs(module: Any) -> list[type[msgspec.Struct]]:
    base = module._Wire
    return [
        value
        for value in vars(module).values()
        if isinstance(value, type) and issubclass(value, base) and value is not base
    ]


def _default(field: mi.Field) -> Any:
    if field.default is not msgspec.NODEFAULT:
        return field.default
    if field.default_factory is not msgspec.NODEFAULT:
        return field.default_factory()
    return msgspec.NODEFAULT


def _value(kind: mi.Type, avoid: Any = msgspec.NODEFAULT) -> Any:
    """A value of ``kind`` that is not ``avoid`` (the field's default)."""
    if isinstance(kind, mi.UnionType):
        kinds = [k for k in kind.types if not isinstance(k, mi.NoneType)]
        return _value(kinds[0], avoid)
    if isinstance(kind, mi.BoolType):
        return avoid is not True
    if isinstance(kind, mi.IntType):
        return 7 if avoid != 7 else 8
    if isinstance(kind, mi.FloatType):
        return 0.25 if avoid != 0.25 else 0.5
    if isinstance(kind, mi.StrType):
        return "x" if avoid != "x" else "y"
    if isinstance(kind, mi.BytesType):
        return b"\x01\x02"
    if isinstance(kind, mi.ListType):
        return [_value(kind.item_type)]
    if isinstance(kind, mi.DictType):
        return {_value(kind.key_type): _value(kind.value_type)}
    if isinstance(kind, mi.EnumType):
        members = list(kind.cls)
        return next(m for m in reversed(members) if m != avoid)
    if isinstance(kind, mi.StructType):
        return _instance(kind.cls)
    if isinstance(kind, mi.AnyType):
        return {"k": [1, "v"]}
    if isinstance(kind, mi.RawType):  # a value left encoded
        return msgspec.Raw(msgspec.msgpack.encode([1, "v"]))
    raise AssertionError(f"no sample value for {kind}: extend this test")


def _instance(cls: type[msgspec.Struct]) -> msgspec.Struct:
    info = mi.type_info(cls)
    return cls(**{f.name: _value(f.type, _default(f)) for f in info.fields})


MESSAGES = [
    pytest.param(module, cls, id=f"{module.__name__.rsplit('.', 1)[1]}.{cls.__name__}")
    for module in (engine_msgs, step_msgs)
    for cls in _wire_structs(module)
]


def test_both_contracts_have_messages() -> None:
    assert len(_wire_structs(engine_msgs)) >= 10 and len(_wire_structs(step_msgs)) >= 6


@pytest.mark.parametrize(("module", "cls"), MESSAGES)
def test_message_round_trips_with_every_field_set(module: Any, cls: type) -> None:
    message = _instance(cls)
    for field in mi.type_info(cls).fields:  # the sample really is away from every default
        assert getattr(message, field.name) != _default(field), field.name
    data = zmq_channel.encode(message)
    assert isinstance(msgspec.msgpack.decode(data), list), "array_like: fields by position"
    assert zmq_channel.decode(data, cls) == message


def test_enums_on_the_wire_are_values_not_names() -> None:
    for kind in (engine_msgs.FinishReason, engine_msgs.EventType):
        for member in kind:
            assert msgspec.msgpack.decode(zmq_channel.encode(member)) == int(member)


def test_an_rpc_call_reads_as_its_head_with_the_arguments_left_encoded() -> None:
    call = _instance(step_msgs.RpcCall)
    head = codec.RPC_CALL_HEAD.decode(codec.RPC_CALL.encode(call))
    assert (head.call_id, head.method, head.kwargs, head.output_rank) == (
        call.call_id,
        call.method,
        call.kwargs,
        call.output_rank,
    )
    assert codec.RPC_ARGUMENTS.decode(head.args) == call.args
    bare = codec.RPC_CALL_HEAD.decode(codec.RPC_CALL.encode(step_msgs.RpcCall(1, "ping")))
    assert codec.RPC_ARGUMENTS.decode(bare.args) == [] and bare.output_rank == 0
