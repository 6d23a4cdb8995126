"""A restarted coordinator rebuilds its table from the engines' reporters, idle ones included."""

from __future__ import annotations

import logging
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator

import pytest
import zmq

from switchboard.config import CoordinatorConfig
from switchboard.coordinator.load_table import Coordinator
from switchboard.engine.load_reporter import LoadReporter
from switchboard.wire import zmq_channel
from switchboard.wire.engine_msgs import EngineLoad, LoadReport

TIMEOUT_S = 10.0


class RunningCoordinator:
    def __init__(self, config: CoordinatorConfig) -> None:
        self.coordinator = Coordinator(config)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self.coordinator.run, args=(self._stop.is_set,), daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        assert not self._thread.is_alive()
        self.coordinator.close()


@pytest.fixture
def config() -> Iterator[CoordinatorConfig]:
    run_dir = tempfile.mkdtemp(prefix="sb-co-")  # ipc:// paths must stay short
    yield CoordinatorConfig(
        input_address=f"ipc://{run_dir}/coordinator-input",
        publish_address=f"ipc://{run_dir}/coordinator-publish",
        num_engines=2,
        publish_interval_s=0.05,
        keepalive_interval_s=0.2,
    )
    shutil.rmtree(run_dir, ignore_errors=True)


def report_covering(sub: zmq.Socket, ranks: list[int]) -> LoadReport:
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        if sub.poll(100):
            report = zmq_channel.decode(sub.recv(), LoadReport)
            if [load.engine_index for load in report.engines] == ranks:
                return report
    raise AssertionError(f"no report covering engines {ranks}")


def test_a_restarted_coordinator_hears_from_every_engine_again(
    config: CoordinatorConfig, caplog: pytest.LogCaptureFixture
) -> None:
    """The engines report once and go idle; the coordinator dies and a new one binds the same
    addresses: each engine's reporter sends its load again when it reconnects, so the new
    table covers both without a single change of load, and the coordinator says so."""
    ctx = zmq.Context()
    first = RunningCoordinator(config)
    reporters = [
        LoadReporter(ctx, config.input_address, rank, f"e{rank}", interval_s=0.05)
        for rank in (0, 1)
    ]
    sub = zmq_channel.make_socket(ctx, zmq.SUB, config.publish_address, bind=False)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    second = None
    try:
        for reporter in reporters:
            reporter.start()
        reporters[0].update(2, 3, 0.25)
        reporters[1].update(0, 1, 0.5)
        expected = [EngineLoad(0, 2, 3, 0.25, "e0"), EngineLoad(1, 0, 1, 0.5, "e1")]
        assert report_covering(sub, [0, 1]).engines == expected
        first.stop()
        with caplog.at_level(logging.INFO):
            second = RunningCoordinator(config)
            assert report_covering(sub, [0, 1]).engines == expected
        assert "Load table complete: all 2 engines reported" in caplog.text
    finally:
        for reporter in reporters:
            reporter.stop()
        sub.close(linger=0)
        if second is not None:
            second.stop()
        ctx.term()
