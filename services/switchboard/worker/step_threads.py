"""How many of its threads a CPU worker's step splits its loops over: one for a short step of
many streams, all for the rest.

Splitting a step's loops over the worker's threads (``kernels/csrc/work_pool.c``) pays when the
loops are long. A small model's are not: tiny-llama's decode step of 32 rows took 2.13 ms on two
threads against 2.66 on one (bfloat16, AMX, in process): a fifth of the time for the whole of a
second core. And a step of many rows is a step of many streams, whose gateway, engine core and
clients need that core: every hop of their requests waits for it. Served on 2 cores at 32
streams arriving steadily, this policy gave tiny-llama bfloat16 time to first token p50 55.0
-> 23.2 ms and 9 % more tokens a second for 15 % less CPU a token (in closed-loop waves, every
stream starting at once, within noise: docs/benchmarks.md, "Threads a step").

So a step of at least ``MIN_STREAMS`` requests and at most ``MAX_TOKENS`` tokens runs on one
thread while that size of step (its tokens rounded up to a power of two) is short there: the
median of its last ``WINDOW`` steps under ``SHORT_STEP_S`` of the thread's CPU time. Not wall
time: on a machine whose cores are full (the case this is for) the thread is preempted in the
middle of steps, and served at 32 steady streams tiny-llama's 2.7 ms steps of 32 rows measured
19.4 ms of wall time after 20 s, which sent them back to every thread for good. A size whose
steps take longer on one thread goes back to all of them for good (a 100M-parameter model's
steps of 32 rows took 26 ms on one thread and 16 on two: its loops split well). Steps of
fewer streams (their processes leave the other core free, and a step of one stream, a decode
or a long prompt's chunk, is latency a user sees) and larger steps always use every thread.

A step of ``HOLD_MIN_STREAMS`` or more requests on every thread also holds the work pool's
helpers awake between its loops (``holds_pool``: they spin up to a millisecond instead of
sleeping 15 us after each loop and being woken for the next) while the steps on every thread
are long: their moving average of the calling thread's CPU time at least ``HOLD_MIN_STEP_S``.
The wake-ups a hold saves are a step's loops (~150 in a SmolLM2 step); what it costs is the
second core through every gap between them, which the gateway, the engine core and the clients
need more the shorter the steps: one user's steps (4-5 ms) and tiny-llama's at the turn of a
wave of 32 streams (8-15 streams, 2-3 ms) went slower held, SmolLM2's of 64 streams (~50 ms)
faster.

The threads only change how the work is divided: each output is computed by one chunk whoever
runs it, so the floats are the same either way (work_pool.c).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from collections.abc import Callable

logger = logging.getLogger(__name__)

# Steps of at least MIN_STREAMS requests and at most MAX_TOKENS tokens may run on one thread;
# others always use every thread.
MIN_STREAMS = 16
MAX_TOKENS = 256
# Steps on every thread of at least this many requests hold the work pool's helpers awake
# between their loops (kernels/csrc/work_pool.c) while those steps' average CPU time is at least
# HOLD_MIN_STEP_S: 4-5 % more tokens a second for SmolLM2 at 64 streams; one stream's steps 6 %
# slower held, tiny-llama's time to first token at 32 streams longer.
HOLD_MIN_STREAMS = 8
HOLD_MIN_STEP_S = 8e-3
# Weight of a step in the moving average of the steps on every thread.
HOLD_AVERAGE_WEIGHT = 0.25
# A size whose steps take at least this much of one thread's CPU time (median) goes back to all
# threads.
SHORT_STEP_S = 6e-3
# Steps of a size measured on one thread before it may go back, and kept for the median.
WINDOW = 4


class StepThreads:
    """Sets each step's thread count (``set_threads``) and times its one-thread steps.

    ``threads``: the worker's thread count (its most); with fewer than two there is nothing to
    choose and every step runs on them. ``clock``: seconds; by default the calling thread's CPU
    time (a one-thread step runs all its loops on the thread that calls ``begin`` and ``end``)."""

    def __init__(
        self,
        threads: int,
        set_threads: Callable[[int], None],
        clock: Callable[[], float] = time.thread_time,
    ) -> None:
        self.threads = threads
        self._set_threads = set_threads
        self._clock = clock
        self._current = threads
        self._times: dict[int, deque[float]] = {}  # one-thread step seconds, by size
        self._long: set[int] = set()  # sizes back on every thread
        # the step running: its one-thread size (None: on every thread), its start, whether
        # its loops use more than one thread
        self._timing: tuple[int | None, float, bool] | None = None
        self._holds = False  # the step running holds the work pool's helpers awake
        self._all_threads_step_s = 0.0  # moving average of the CPU time of steps on every thread

    def begin(self, streams: int, tokens: int) -> None:
        """A step of ``streams`` requests and ``tokens`` tokens starts: set its threads."""
        size = self._size(streams, tokens)  # None: on every thread
        wanted = self.threads if size is None else 1
        if wanted != self._current:
            self._set_threads(wanted)
            self._current = wanted
        self._timing = (size, self._clock(), wanted > 1)
        self._holds = (
            wanted > 1
            and streams >= HOLD_MIN_STREAMS
            and self._all_threads_step_s >= HOLD_MIN_STEP_S
        )

    def end(self) -> None:
        """The step ``begin`` started is done."""
        if self._timing is None:
            return
        size, started, on_every_thread = self._timing
        self._timing = None
        seconds = self._clock() - started
        if on_every_thread:
            self._all_threads_step_s += HOLD_AVERAGE_WEIGHT * (seconds - self._all_threads_step_s)
        if size is None:
            return
        times = self._times.get(size)
        if times is None:
            times = self._times[size] = deque(maxlen=WINDOW)
            logger.info(
                "steps of %d+ streams and up to %d tokens: on one thread while under %.0f ms",
                MIN_STREAMS,
                size,
                SHORT_STEP_S * 1e3,
            )
        times.append(seconds)
        if len(times) == WINDOW and statistics.median(times) >= SHORT_STEP_S:
            self._long.add(size)
            logger.info(
                "steps of up to %d tokens take %.1f ms of CPU on one thread: back on all %d",
                size,
                statistics.median(times) * 1e3,
                self.threads,
            )

    @property
    def holds_pool(self) -> bool:
        """Whether the step ``begin`` started holds the work pool's helpers awake between its
        loops: one of ``HOLD_MIN_STREAMS`` or more requests, on more than one thread, after
        steps on every thread of ``HOLD_MIN_STEP_S`` of CPU time on average."""
        return self._holds

    def use_all(self) -> None:
        """Every thread from now on (for a step not run between ``begin`` and ``end``)."""
        self._timing = None
        if self._current != self.threads:
            self._set_threads(self.threads)
            self._current = self.threads

    def one_thread_sizes(self) -> list[int]:
        """The sizes of step that run on one thread now (measured, and short there)."""
        return sorted(size for size in self._times if size not in self._long)

    def _size(self, streams: int, tokens: int) -> int | None:
        """The size a step runs on one thread as, or None (every thread)."""
        if self.threads < 2 or streams < MIN_STREAMS or tokens > MAX_TOKENS:
            return None
        size = 1 << (tokens - 1).bit_length()
        return None if size in self._long else size
