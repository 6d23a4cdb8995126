"""The coordinator in-process: engine loads in (PUSH), one merged report out (SUB)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import zmq

from switchboard.config import CoordinatorConfig
from switchboard.coordinator.load_table import Coordinator
from switchboard.wire import zmq_channel
from switchboard.wire.engine_msgs import EngineLoad, LoadReport

TIMEOUT_MS = 10_000


class Running:
    def __init__(self, coordinator: Coordinator) -> None:
        self.coordinator = coordinator
        self.ctx = zmq.Context()
        self.push = zmq_channel.make_socket(
            self.ctx, zmq.PUSH, coordinator.input_address, bind=False
        )
        self.sub = zmq_channel.make_socket(
            self.ctx, zmq.SUB, coordinator.publish_address, bind=False
        )
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)

    def report(self) -> LoadReport:
        return zmq_channel.decode(self.sub.recv(), LoadReport)

    def report_where(self, predicate) -> LoadReport:
        deadline = time.monotonic() + TIMEOUT_MS / 1000
        while time.monotonic() < deadline:
            report = self.report()
            if predicate(report):
                return report
        raise AssertionError("no matching report")

    def close(self) -> None:
        self.push.close(linger=0)
        self.sub.close(linger=0)
        self.ctx.term()


@pytest.fixture
def running() -> Iterator[Running]:
    config = CoordinatorConfig(
        input_address="tcp://127.0.0.1:0",
        publish_address="tcp://127.0.0.1:0",
        num_engines=2,
        publish_interval_s=0.05,
        keepalive_interval_s=0.2,
    )
    coordinator = Coordinator(config)
    stop = threading.Event()
    thread = threading.Thread(target=coordinator.run, args=(stop.is_set,), daemon=True)
    thread.start()
    peers = Running(coordinator)
    yield peers
    peers.close()
    stop.set()
    thread.join(5)
    assert not thread.is_alive()
    coordinator.close()


def test_keepalive_reports_arrive_without_changes(running: Running) -> None:
    first = running.report()  # keep-alive, even with no engine heard from yet
    second = running.report()
    assert first.engines == [] and second.sequence > first.sequence


def test_latest_load_of_every_engine_is_published_in_rank_order(running: Running) -> None:
    running.push.send(zmq_channel.encode(EngineLoad(1, 3, 2, 0.5, "e1")))
    running.push.send(zmq_channel.encode(EngineLoad(0, 0, 1, 0.1, "e0")))
    running.push.send(zmq_channel.encode(EngineLoad(1, 0, 4, 0.7, "e1")))  # replaces the first
    report = running.report_where(
        lambda r: (
            [e.engine_index for e in r.engines] == [0, 1] and r.engines[1].num_running_reqs == 4
        )
    )
    assert report.engines == [EngineLoad(0, 0, 1, 0.1, "e0"), EngineLoad(1, 0, 4, 0.7, "e1")]


def test_a_bad_message_is_dropped(running: Running, caplog: pytest.LogCaptureFixture) -> None:
    running.push.send(b"\xc1junk")
    running.push.send(zmq_channel.encode(EngineLoad(2, 1, 1)))
    report = running.report_where(lambda r: len(r.engines) == 1)
    assert report.engines[0].engine_index == 2
    assert "Dropped a bad EngineLoad" in caplog.text
