"""Rate-limited warnings (common/log_limits.py): a burst per cause and window, then a count."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from switchboard.common.log_limits import WarningLimit, report_suppressed

LOGGER = "tests.log_limits"


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


def test_a_burst_per_cause_then_the_count(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    limit = WarningLimit(logging.getLogger(LOGGER), burst=3, window_s=60.0, clock=clock)
    with caplog.at_level(logging.WARNING, LOGGER):
        logged = [limit.warning("bad frame", "bad frame %d", i) for i in range(10)]
        assert logged == [True] * 3 + [False] * 7
        assert limit.warning("bad key", "bad key")  # another cause has its own burst
        assert limit.suppressed("bad frame") == 7 and limit.suppressed("bad key") == 0
        clock.now += 12.5
        limit.report()
    assert lines(caplog) == [
        "bad frame 0",
        "bad frame 1",
        "bad frame 2",
        "bad key",
        "suppressed 7 similar warnings (bad frame) in the last 12.5 s",
    ]
    assert limit.suppressed("bad frame") == 0


def test_a_new_window_lets_a_new_burst_through(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    limit = WarningLimit(logging.getLogger(LOGGER), burst=2, window_s=10.0, clock=clock)
    with caplog.at_level(logging.WARNING, LOGGER):
        assert [limit.warning("c", "one"), limit.warning("c", "two")] == [True, True]
        clock.now += 10.0  # nothing was suppressed: the next line opens a fresh window
        assert [limit.warning("c", "three"), limit.warning("c", "four")] == [True, True]
        assert not limit.warning("c", "five")
        limit.report()
        assert limit.warning("c", "six")  # reported: the cause starts afresh
        limit.report()  # nothing suppressed: no line
    assert lines(caplog) == [
        "one",
        "two",
        "three",
        "four",
        "suppressed 1 similar warning (c) in the last 0.0 s",
        "six",
    ]


def test_the_window_end_reports_the_count_without_further_warnings(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A flood that stops is still counted: the window's end says so by itself."""
    limit = WarningLimit(logging.getLogger(LOGGER), burst=1, window_s=0.2)
    reported = threading.Event()

    class Watch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage().startswith("suppressed"):
                reported.set()

    watch = Watch()
    logging.getLogger(LOGGER).addHandler(watch)
    try:
        with caplog.at_level(logging.WARNING, LOGGER):
            for _ in range(50):
                limit.warning("flood", "flood")
            assert reported.wait(10.0), "no count at the window's end"
            # the record reaches this handler first, caplog's (on the root) just after, from the
            # limiter's thread: wait for it there too
            deadline = time.monotonic() + 10.0
            while len(lines(caplog)) < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
    finally:
        logging.getLogger(LOGGER).removeHandler(watch)
    found = lines(caplog)
    assert found[0] == "flood" and found[1].startswith("suppressed 49 similar warnings (flood)")
    assert len(found) == 2


def test_report_suppressed_covers_every_limit(caplog: pytest.LogCaptureFixture) -> None:
    limits = [WarningLimit(logging.getLogger(LOGGER), burst=0) for _ in range(2)]
    with caplog.at_level(logging.WARNING, LOGGER):
        for i, limit in enumerate(limits):
            limit.warning(f"cause {i}", "never shown")
        report_suppressed()
    found = sorted(lines(caplog))
    assert len(found) == 2
    for i, line in enumerate(found):
        assert line.startswith(f"suppressed 1 similar warning (cause {i}) in the last ")
