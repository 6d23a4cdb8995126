"""Wire 1 transport: ZeroMQ sockets and frames (bodies: ``codec``), zero-copy tensor frames.

Frame layouts (see ``engine_msgs`` for the bodies)::

    gateway ROUTER -> engine DEALER   [identity][type byte][body][tensor frame]...
                                       (the DEALER receives it without the identity frame)
    engine DEALER -> gateway ROUTER   [body: EngineReady]            (first message; again
                                                                      when the gateway restarts)
    engine PUSH -> gateway PULL       [body: EngineCoreOutputs][tensor frame]...
                                      | [b"ENGINE_CORE_DEAD"][body: EngineDead]  (last message;
                                        older engines send the first frame alone)

A tensor travels as a frame of raw bytes after the body; the body holds a ``TensorRef``
(dtype, shape, frame index) in its place, so large data is never copied into msgpack.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import stat
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import zmq

from switchboard.wire.codec import (
    ABORT_IDS,
    DP_WAVE,
    ENGINE_CORE_OUTPUTS,
    ENGINE_CORE_REQUEST,
    ENGINE_DEAD,
    ENGINE_READY,
    UTILITY_CALL,
    Buffer,
    Codec,
    DecodeError,
)
from switchboard.wire.codec import decode as decode  # re-exported: frame bodies of any type
from switchboard.wire.codec import encode as encode
from switchboard.wire.curve import CurveKeys
from switchboard.wire.engine_msgs import (
    ENGINE_CORE_DEAD,
    EngineCoreOutputs,
    EngineDead,
    EngineReady,
    RequestType,
)

logger = logging.getLogger(__name__)

# A socket of a plain context (zmq.SyncSocket) or of an asyncio one (zmq.asyncio.Socket).
S = TypeVar("S", bound="zmq.Socket[Any]")

_REQUEST_TYPES = {t.value: t for t in RequestType}
# The body codec of each frame type a gateway may send; ABORT carries a list of request ids.
_BODY_CODECS: dict[RequestType, Codec[Any] | None] = {
    RequestType.ADD: ENGINE_CORE_REQUEST,
    RequestType.ABORT: ABORT_IDS,
    RequestType.UTILITY: UTILITY_CALL,
    RequestType.START_DP_WAVE: DP_WAVE,
    RequestType.WAKEUP: None,
}


class BadFrame(ValueError):
    """A frame that does not follow the wire-1 contract; it is logged and dropped."""


def make_socket(
    ctx: zmq.Context[S],
    socket_type: int,
    address: str,
    *,
    bind: bool,
    identity: bytes | None = None,
    linger_ms: int = 0,
    curve: CurveKeys | None = None,
    before_connect: Callable[[S], object] | None = None,
) -> S:
    """A socket with unbounded queues (HWM 0): dropping a request or output silently is worse
    than using memory, and both sides drain continuously. ``curve``: the socket's CURVE keys,
    applied to a tcp:// address (ipc:// is guarded by its directory's permissions).
    ``before_connect``: called with the socket before it binds or connects (a monitor attached
    then sees every connection: ``connection_events.py``)."""
    sock = ctx.socket(socket_type)
    try:
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.LINGER, linger_ms)
        if identity is not None:
            sock.setsockopt(zmq.IDENTITY, identity)
        if address.startswith("tcp://") and ":[" in address:
            sock.setsockopt(zmq.IPV6, 1)
        if curve is not None and address.startswith("tcp://"):
            curve.apply(sock)
        if before_connect is not None:
            before_connect(sock)
        if bind:
            sock.bind(address)
        else:
            sock.connect(address)
    except BaseException:
        # A socket left open (an address in use, a bad key) would make the context's term()
        # wait for it forever.
        sock.close(linger=0)
        raise
    return sock


def check_private_dir(path: str) -> None:
    """ValueError unless ``path`` is a directory of this user that no one else may enter
    (no group or other permission bits): where ipc:// sockets may be bound."""
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode):
        raise ValueError(f"run directory {path} is not a directory")
    if info.st_uid != os.getuid():
        raise ValueError(f"run directory {path} belongs to uid {info.st_uid}, not to us")
    if info.st_mode & 0o077:
        raise ValueError(
            f"run directory {path} has mode {stat.S_IMODE(info.st_mode):04o}; ipc:// sockets "
            "need 0700 (no access for group or others)"
        )


def tcp_address(host: str, port: int) -> str:
    """``tcp://host:port``, with an IPv6 address in brackets."""
    try:
        if ipaddress.ip_address(host).version == 6:
            return f"tcp://[{host}]:{port}"
    except ValueError:
        pass
    return f"tcp://{host}:{port}"


def bound_address(sock: zmq.Socket[Any]) -> str:
    """The address the kernel really bound (``tcp://host:0`` becomes a real port)."""
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


def engine_identity(data_parallel_rank: int, nonce: bytes = b"") -> bytes:
    """An engine DEALER's routing id: its rank, and with CURVE a nonce per incarnation (the
    gateway's ROUTER then refuses a second peer with an id in use instead of handing it over)."""
    return data_parallel_rank.to_bytes(2, "little") + nonce


def request_frames(
    request_type: RequestType, body: Any, tensor_frames: Sequence[Buffer] = ()
) -> list[Buffer]:
    """Frames 1.. of a gateway -> engine message (the ROUTER prepends the identity)."""
    return [request_type.value, encode(body), *tensor_frames]


def parse_request_frames(frames: Sequence[Buffer]) -> tuple[RequestType, Any, list[memoryview]]:
    """Decode frames received on an engine's DEALER; raise BadFrame on any contract breach."""
    if len(frames) < 2:
        raise BadFrame(f"expected at least 2 frames (type, body), got {len(frames)}")
    type_byte = bytes(frames[0])
    request_type = _REQUEST_TYPES.get(type_byte)
    if request_type is None or request_type not in _BODY_CODECS:
        raise BadFrame(f"unknown request type byte {type_byte!r}")
    body_codec = _BODY_CODECS[request_type]
    try:
        body = None if body_codec is None else body_codec.decode(frames[1])
    except DecodeError as exc:  # ValidationError is a subclass
        raise BadFrame(f"malformed {request_type.name} body: {exc}") from exc
    return request_type, body, [memoryview(f) for f in frames[2:]]


def engine_dead_frames(engine_index: int, engine_id: str = "") -> list[bytes]:
    """An engine's last word: ``ENGINE_CORE_DEAD`` and which engine says it."""
    return [ENGINE_CORE_DEAD, ENGINE_DEAD.encode(EngineDead(engine_index, engine_id))]


def _is_engine_dead(frames: Sequence[Buffer]) -> bool:
    return len(frames) in (1, 2) and bytes(frames[0]) == ENGINE_CORE_DEAD


def parse_engine_dead(frames: Sequence[Buffer]) -> EngineDead | None:
    """Which engine an ``ENGINE_CORE_DEAD`` message names; None for the one-frame form (or a
    second frame that does not decode: the death still counts, the sender is unknown)."""
    if not _is_engine_dead(frames) or len(frames) == 1:
        return None
    try:
        return ENGINE_DEAD.decode(frames[1])
    except DecodeError:
        logger.warning("ENGINE_CORE_DEAD with an undecodable engine frame")
        return None


def parse_output_frames(
    frames: Sequence[Buffer],
) -> tuple[EngineCoreOutputs | None, list[memoryview]]:
    """Decode frames received on a gateway's PULL. ``None`` means the engine died (see
    ``parse_engine_dead`` for which one)."""
    if _is_engine_dead(frames):
        return None, []
    try:
        outputs = ENGINE_CORE_OUTPUTS.decode(frames[0])
    except DecodeError as exc:
        raise BadFrame(f"malformed EngineCoreOutputs: {exc}") from exc
    return outputs, [memoryview(f) for f in frames[1:]]


def parse_ready(data: Buffer) -> EngineReady:
    try:
        return ENGINE_READY.decode(data)
    except DecodeError as exc:
        raise BadFrame(f"malformed READY: {exc}") from exc
