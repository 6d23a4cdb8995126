"""A socket that fails to bind or connect is closed, so its context can still terminate."""

from __future__ import annotations

import threading

import pytest
import zmq

from switchboard.wire import zmq_channel


def _terminates(ctx: zmq.Context) -> bool:
    done = threading.Event()

    def term() -> None:
        ctx.term()
        done.set()

    threading.Thread(target=term, daemon=True).start()
    return done.wait(10)


def test_a_bind_to_an_address_in_use_leaves_no_socket_open() -> None:
    ctx = zmq.Context()
    holder = zmq_channel.make_socket(ctx, zmq.ROUTER, "tcp://127.0.0.1:0", bind=True)
    address = zmq_channel.bound_address(holder)
    with pytest.raises(zmq.ZMQError) as failed:
        zmq_channel.make_socket(ctx, zmq.ROUTER, address, bind=True)
    assert failed.value.errno == zmq.EADDRINUSE
    holder.close()
    assert _terminates(ctx), "the failed socket was left open: term() waits for it"


def test_a_bad_address_leaves_no_socket_open() -> None:
    ctx = zmq.Context()
    with pytest.raises(zmq.ZMQError) as failed:  # its traceback keeps the socket referenced
        zmq_channel.make_socket(ctx, zmq.DEALER, "tcp://no port here", bind=False)
    assert failed.value.errno == zmq.EINVAL
    assert _terminates(ctx), "the failed socket was left open: term() waits for it"
