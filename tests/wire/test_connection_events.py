"""A connecting socket's monitor: a working connection that drops is LOST, the next one that
completes its handshake is BACK; a connection refused at the handshake is neither."""

from __future__ import annotations

import os
import time
from pathlib import Path

import zmq

from switchboard.wire import curve, zmq_channel
from switchboard.wire.connection_events import ConnectionEvents, PeerChange

TIMEOUT_MS = 10_000


def next_change(events: ConnectionEvents, timeout_s: float = 10.0) -> PeerChange | None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if events.monitor.poll(100):
            change = events.change(events.monitor.recv_multipart())
            if change is not None:
                return change
    return None


def test_a_peer_that_restarts_at_the_same_address_is_lost_then_back() -> None:
    ctx = zmq.Context()
    server = zmq_channel.make_socket(ctx, zmq.ROUTER, "tcp://127.0.0.1:0", bind=True)
    address = zmq_channel.bound_address(server)
    events: ConnectionEvents[zmq.SyncSocket] = ConnectionEvents()
    client = zmq_channel.make_socket(
        ctx, zmq.DEALER, address, bind=False, before_connect=events.watch
    )
    try:
        client.send(b"hello")
        server.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
        assert server.recv_multipart()[1] == b"hello"  # working
        server.close(linger=0)
        assert next_change(events) is PeerChange.LOST
        server = zmq_channel.make_socket(ctx, zmq.ROUTER, address, bind=True)
        assert next_change(events) is PeerChange.BACK
    finally:
        events.close()
        client.close(linger=0)
        server.close(linger=0)
        ctx.term()


def test_a_key_the_peer_refuses_is_never_lost_nor_back(tmp_path: Path) -> None:
    """The client retries and is refused each time (ZAP): no change, however many retries."""
    keys, stranger = str(tmp_path / "keys"), str(tmp_path / "stranger")
    curve.generate(keys, engines=1)
    curve.generate(stranger, engines=1)
    ctx = zmq.Context()
    authenticator = curve.start_authenticator(ctx, [os.path.join(keys, curve.ALLOWED_ENGINES)])
    server = zmq_channel.make_socket(
        ctx,
        zmq.ROUTER,
        "tcp://127.0.0.1:0",
        bind=True,
        curve=curve.server_keys(keys, curve.GATEWAY),
    )
    pair = curve.server_keys(stranger, "engine-0")  # a pair the server does not admit
    refused = curve.CurveKeys(
        pair.public, pair.secret, curve.server_keys(keys, curve.GATEWAY).public
    )
    events: ConnectionEvents[zmq.SyncSocket] = ConnectionEvents()
    client = zmq_channel.make_socket(
        ctx,
        zmq.DEALER,
        zmq_channel.bound_address(server),
        bind=False,
        curve=refused,
        before_connect=events.watch,
    )
    drops = 0
    try:
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline and drops < 3:
            if events.monitor.poll(100):
                frames = events.monitor.recv_multipart()
                assert events.change(frames) is None
                drops += 1  # only drops: the handshake never succeeds
        assert drops >= 1, "the client was refused and retried"
    finally:
        events.close()
        client.close(linger=0)
        server.close(linger=0)
        authenticator.stop()
        ctx.term()
