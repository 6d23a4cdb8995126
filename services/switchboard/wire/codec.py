"""The codecs of every wire: one typed msgpack codec per message, built once, here.

The roles never build a msgspec encoder or decoder of their own; they call these. Each
:class:`Codec` decodes to exactly one type (a typed ``msgspec.msgpack.Decoder``, the fastest
way msgspec has) and encodes with the one shared encoder. msgspec's encoders and decoders are
thread-safe and keep no state between calls, so one instance serves every thread of a process.

Wire 1, gateway <-> engine core (frames in ``zmq_channel``):

* :data:`ENGINE_CORE_REQUEST`, :data:`ABORT_IDS`, :data:`UTILITY_CALL`, :data:`DP_WAVE`: the
  bodies of the gateway's request frames (``zmq_channel.parse_request_frames``);
* :data:`ENGINE_READY`, :data:`ENGINE_CORE_OUTPUTS`, :data:`ENGINE_DEAD`: what the engine
  sends; its output thread encodes each step's outputs into reused buffers
  (:meth:`Codec.encode_into`).

Beside wire 1: :data:`ENGINE_LOAD` (engine -> coordinator), :data:`LOAD_REPORT` (coordinator
-> gateways), :data:`GATEWAY_HELLO` / :data:`GATEWAY_ADDRESSES` (the TCP handshake).

Wire 2, engine core <-> workers: :data:`RPC_CALL` (on the shared-memory ring; every worker
reads each as :data:`RPC_CALL_HEAD` and decodes the arguments into the types its method
takes), :data:`RPC_REPLY` (back on a ZeroMQ PULL), and :data:`WORKER_STARTUP`, the
JSON a worker process is started with.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

import msgspec
from msgspec import DecodeError as DecodeError  # re-exported: roles catch it from here

from switchboard.wire.engine_msgs import (
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineDead,
    EngineLoad,
    EngineReady,
    GatewayAddresses,
    GatewayHello,
    LoadReport,
    UtilityCall,
)
from switchboard.wire.step_msgs import RpcCall, RpcCallHead, RpcReply, WorkerStartup

T = TypeVar("T")
Buffer = bytes | bytearray | memoryview

# Stateless apart from its (default) options: shared by every codec and every thread.
_ENCODER = msgspec.msgpack.Encoder()


def encode(msg: object) -> bytes:
    """Any wire value as msgpack (for bodies whose type varies; a :class:`Codec` otherwise)."""
    return _ENCODER.encode(msg)


def decode(data: Buffer, kind: type[T]) -> T:
    """msgpack as ``kind``; a codec built once is faster for a type decoded often."""
    return msgspec.msgpack.decode(data, type=kind)


class Codec(Generic[T]):
    """The msgpack codec of one message type, reusable across calls and threads.

    ``encode``, ``encode_into`` and ``decode`` are msgspec's own bound methods, not wrappers:
    a call costs what calling msgspec directly does (the worker decodes a call every step).
    ``encode_into`` writes into a caller's ``bytearray`` (resized as needed), so a sender that
    reuses its buffers allocates nothing per message. ``decode`` raises :data:`DecodeError`
    (``msgspec.ValidationError`` is a subclass) on bytes that are not a ``T``.
    """

    __slots__ = ("encode", "encode_into", "decode")

    encode: Callable[[T], bytes]
    encode_into: Callable[[T, bytearray], None]
    decode: Callable[[Buffer], T]

    def __init__(self, kind: type[T]) -> None:
        self.encode = _ENCODER.encode
        self.encode_into = _ENCODER.encode_into
        self.decode = msgspec.msgpack.Decoder(kind).decode


class JsonCodec(Generic[T]):
    """The JSON codec of one message type (text: a process's command line)."""

    __slots__ = ("_encoder", "_decoder")

    def __init__(self, kind: type[T]) -> None:
        self._encoder = msgspec.json.Encoder()
        self._decoder = msgspec.json.Decoder(kind)

    def encode(self, msg: T) -> str:
        return self._encoder.encode(msg).decode()

    def decode(self, text: str | Buffer) -> T:
        return self._decoder.decode(text)


# ---- wire 1: gateway -> engine request bodies ----------------------------------------------
ENGINE_CORE_REQUEST = Codec(EngineCoreRequest)  # ADD
ABORT_IDS: Codec[list[str]] = Codec(list[str])  # ABORT: the request ids
UTILITY_CALL = Codec(UtilityCall)  # UTILITY
DP_WAVE: Codec[list[int]] = Codec(list[int])  # START_DP_WAVE

# ---- wire 1: engine -> gateway --------------------------------------------------------------
ENGINE_READY = Codec(EngineReady)
ENGINE_CORE_OUTPUTS = Codec(EngineCoreOutputs)
ENGINE_DEAD = Codec(EngineDead)

# ---- load reports and the TCP handshake -----------------------------------------------------
ENGINE_LOAD = Codec(EngineLoad)
LOAD_REPORT = Codec(LoadReport)
GATEWAY_HELLO = Codec(GatewayHello)
GATEWAY_ADDRESSES = Codec(GatewayAddresses)

# ---- wire 2: engine core <-> workers --------------------------------------------------------
RPC_CALL = Codec(RpcCall)
RPC_CALL_HEAD = Codec(RpcCallHead)  # the same bytes, the arguments left encoded
RPC_ARGUMENTS: Codec[list[Any]] = Codec(list[Any])  # an RpcCallHead's args, as plain values
RPC_REPLY = Codec(RpcReply)
WORKER_STARTUP = JsonCodec(WorkerStartup)
