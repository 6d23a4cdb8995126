"""The engine's load reporter: changes only, merged, at most one message per interval."""

from __future__ import annotations

import time

import zmq

from switchboard.engine.load_reporter import LoadReporter
from switchboard.wire import zmq_channel
from switchboard.wire.engine_msgs import EngineLoad


def _recv_all(pull: zmq.Socket, until: EngineLoad, timeout_s: float = 10.0) -> list[EngineLoad]:
    received: list[EngineLoad] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pull.poll(100):
            received.append(zmq_channel.decode(pull.recv(), EngineLoad))
            if received[-1] == until:
                return received
    raise AssertionError(f"never received {until}; got {received}")


def test_reports_changes_merges_bursts_and_sends_the_last_one() -> None:
    ctx = zmq.Context()
    pull = zmq_channel.make_socket(ctx, zmq.PULL, "tcp://127.0.0.1:0", bind=True)
    reporter = LoadReporter(ctx, zmq_channel.bound_address(pull), 3, "e3", interval_s=0.2)
    reporter.start()
    try:
        reporter.update(1, 0, 0.0)
        assert _recv_all(pull, EngineLoad(3, 1, 0, 0.0, "e3")) == [EngineLoad(3, 1, 0, 0.0, "e3")]
        for waiting in range(50):  # a burst within one interval
            reporter.update(waiting, 1, 0.25)
        last = EngineLoad(3, 49, 1, 0.25, "e3")
        burst = _recv_all(pull, last)
        assert len(burst) < 50  # merged, not one message per change
        assert burst[-1] == last
        sent = reporter.num_sent
        reporter.update(49, 1, 0.25)  # unchanged: nothing to send
        assert not pull.poll(500) and reporter.num_sent == sent
    finally:
        reporter.stop()
        pull.close(linger=0)
        ctx.term()
    assert not reporter.is_alive()
