"""The kernels' work pool: every item of a loop runs exactly once, whatever the sizes, grains and
thread counts; calls made at the same time from two threads each complete (one on its own
thread); helpers start on first use and sleep when idle (no CPU), and spin between a held
step's loops until it is released; the OpenMP variant behind the
same entry point gives the kernels the same floats."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from switchboard.kernels import library, small_batch_gemm
from switchboard.kernels.build import build_and_load


@pytest.fixture(scope="module")
def count_items():
    library.load()  # first: the test kernel's switchboard_parallel_for is the library's
    counting = build_and_load(
        "work_pool_test_counting",
        [Path(__file__).with_name("counting_kernel.c")],
        "work pool test kernel",
        library.SOURCE_DIR,
    )
    function = counting.count_items
    function.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
    function.restype = None
    meet = counting.meet_two_threads
    meet.argtypes = [ctypes.c_int64]
    meet.restype = ctypes.c_int
    function.meet_two_threads = meet
    return function


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def _counts_after(count_items, n: int, min_grain: int) -> torch.Tensor:
    counts = torch.zeros(max(n, 1), dtype=torch.int32)
    count_items(counts.data_ptr(), n, min_grain)
    return counts[:n]


@pytest.mark.parametrize("num_threads", [1, 2, 4])
def test_every_item_runs_exactly_once(count_items, threads, num_threads):
    threads(num_threads)
    for n in (0, 1, 2, 7, 16, 33, 1000, 40_000):
        for min_grain in (0, 1, 3, 64, 100_000):
            counts = _counts_after(count_items, n, min_grain)
            assert torch.equal(counts, torch.ones(n, dtype=torch.int32)), (n, min_grain)
    if num_threads > 1:
        assert library.pool_helpers_started() >= num_threads - 1


def test_many_loops_in_a_row_lose_no_item(count_items, threads):
    threads(2)
    counts = torch.zeros(257, dtype=torch.int32)
    for _ in range(3000):  # generations follow each other faster than a helper wakes
        count_items(counts.data_ptr(), 257, 1)
    assert torch.equal(counts, torch.full((257,), 3000, dtype=torch.int32))


def test_calls_from_two_threads_at_once_each_complete(count_items, threads):
    threads(2)
    results: dict[int, torch.Tensor] = {}

    def loop(key: int) -> None:
        counts = torch.zeros(5000, dtype=torch.int32)
        for _ in range(200):  # ctypes lets go of the GIL: the calls overlap
            count_items(counts.data_ptr(), 5000, 1)
        results[key] = counts

    callers = [threading.Thread(target=loop, args=(k,)) for k in range(2)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join(timeout=120)
    assert sorted(results) == [0, 1]
    for counts in results.values():
        assert torch.equal(counts, torch.full((5000,), 200, dtype=torch.int32))


def test_idle_helpers_take_no_cpu(count_items, threads):
    threads(2)
    for _ in range(100):
        _counts_after(count_items, 10_000, 1)
    time.sleep(0.2)  # past the helpers' spin: asleep on the futex
    started = time.process_time()
    time.sleep(1.0)
    assert time.process_time() - started < 0.1


# In a process of its own: one helper (the other tests start more, which would share the cores).
_HELD_SCRIPT = """
import ctypes, sys, time
from pathlib import Path
import torch
from switchboard.kernels import library
from switchboard.kernels.build import build_and_load
torch.set_num_threads(2)
library.load()
kernel = build_and_load(
    "work_pool_test_counting", [Path(sys.argv[1])], "work pool test kernel", library.SOURCE_DIR
).count_items
kernel.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
counts = torch.zeros(10_000, dtype=torch.int32)
kernel(counts.data_ptr(), 10_000, 1)  # the helper starts
time.sleep(0.05)  # and falls asleep
library.hold_pool(True)
before = library.pool_sleeps()
for _ in range(50):
    kernel(counts.data_ptr(), 10_000, 1)
    gap = time.perf_counter() + 100e-6  # between the step's loops
    while time.perf_counter() < gap:
        pass
between = library.pool_sleeps() - before
started = time.process_time()
time.sleep(0.5)  # a long gap, still held
long_gap = time.process_time() - started
library.hold_pool(False)
assert torch.equal(counts, torch.full((10_000,), 51, dtype=torch.int32))
print(between, long_gap, library.pool_sleeps() - before)
"""


def test_a_held_step_keeps_its_helpers_awake_between_its_loops() -> None:
    """While a step on every thread is under way its helper waits for the next loop spinning
    through gaps far longer than its usual 15 us (no wake-up a loop), but not through a long
    one (torch's own threads may need the core): asleep after a millisecond, held or not."""
    done = subprocess.run(
        [sys.executable, "-c", _HELD_SCRIPT, str(Path(__file__).with_name("counting_kernel.c"))],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    between, long_gap, slept = done.stdout.split()
    assert int(between) <= 2  # 50 loops 100 us apart
    assert float(long_gap) < 0.1
    assert int(slept) > int(between)  # it did sleep in the long gap


def test_a_sleeping_helper_is_woken_for_each_loop(count_items, threads):
    """A loop of two chunks that wait for each other completes only with a second thread in
    it: after the helper fell asleep, and in loops that follow each other at once (a helper
    woken once and not yet running must still come)."""
    threads(2)
    _counts_after(count_items, 1000, 1)  # the helper has started
    for _ in range(3):
        time.sleep(0.2)  # past the helper's spin: asleep on the futex
        assert count_items.meet_two_threads(60_000) == 1
        for _ in range(20):
            assert count_items.meet_two_threads(60_000) == 1


def test_status_names_the_variant():
    library.load()
    assert library.pool_variant() == "pool"
    assert library.pool_status().startswith("in use")


_OPENMP_SCRIPT = """
import sys, torch
from switchboard.kernels import library, small_batch_gemm
torch.set_num_threads(2)
assert small_batch_gemm.load(), small_batch_gemm.status()
print(library.pool_status())
torch.manual_seed(0)
weight, x = torch.randn(300, 96), torch.randn(21, 96)
torch.save(small_batch_gemm.linear(x, small_batch_gemm.pack(weight)), sys.argv[1])
"""


def test_the_openmp_variant_gives_the_same_floats(tmp_path: Path, threads):
    out = tmp_path / "openmp.pt"
    env = dict(os.environ, SWITCHBOARD_WORK_POOL="openmp")
    done = subprocess.run(
        [sys.executable, "-c", _OPENMP_SCRIPT, str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "OpenMP" in done.stdout
    threads(2)
    small_batch_gemm.unload()
    assert small_batch_gemm.load(), small_batch_gemm.status()
    torch.manual_seed(0)
    weight, x = torch.randn(300, 96), torch.randn(21, 96)
    ours = small_batch_gemm.linear(x, small_batch_gemm.pack(weight))
    assert torch.equal(ours, torch.load(out))
