"""Engine monotonic -> gateway wall clock: the READY anchor, corrected by causality bounds."""

from __future__ import annotations

import logging

import pytest

from switchboard.gateway.engines.engine_clock import EngineClock

WALL = 1_700_000_000_000_000_000  # the gateway's wall clock at the anchor
MONO = 42_000_000_000  # the engine's monotonic clock at the anchor
MS = 1_000_000


def test_the_anchor_places_engine_stamps_on_the_wall_clock() -> None:
    clock = EngineClock("e", WALL, MONO)
    assert clock.to_wall_ns(MONO) == WALL
    assert clock.to_wall_ns(MONO + 5 * MS) == WALL + 5 * MS


def test_consistent_observations_do_not_move_a_correct_anchor() -> None:
    clock = EngineClock("e", WALL, MONO)
    clock.not_before(MONO + 10 * MS, WALL + 9 * MS)  # sent 1 ms before the engine queued it
    clock.not_after(MONO + 20 * MS, WALL + 21 * MS)  # received 1 ms after the engine stamped it
    assert clock.to_wall_ns(MONO) == WALL


def test_an_engine_wall_clock_that_runs_ahead_is_pulled_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The engine's wall clock is 5 s ahead of the gateway's: its anchor claims WALL + 5 s.
    clock = EngineClock("e", WALL + 5_000 * MS, MONO)
    with caplog.at_level(logging.WARNING):
        clock.not_after(MONO + 10 * MS, WALL + 11 * MS)  # received 1 ms after it was stamped
    assert clock.to_wall_ns(MONO + 10 * MS) == WALL + 11 * MS  # no later than its receipt
    assert "wall clock is about" in caplog.text


def test_an_engine_wall_clock_that_lags_is_pushed_forward() -> None:
    clock = EngineClock("e", WALL - 5_000 * MS, MONO)
    clock.not_before(MONO + 10 * MS, WALL + 9 * MS)  # the engine queued it after it was sent
    assert clock.to_wall_ns(MONO + 10 * MS) == WALL + 9 * MS
    clock.not_after(MONO + 20 * MS, WALL + 20 * MS + MS // 2)
    assert WALL + 9 * MS <= clock.to_wall_ns(MONO + 10 * MS) <= WALL + 10 * MS + MS // 2


def test_contradicting_bounds_keep_the_newest() -> None:
    clock = EngineClock("e", WALL, MONO)
    clock.not_before(MONO, WALL + 100 * MS)  # offset >= WALL - MONO + 100 ms
    clock.not_after(MONO, WALL - 100 * MS)  # offset <= WALL - MONO - 100 ms: a stepped clock
    assert clock.to_wall_ns(MONO) == WALL - 100 * MS
