"""The default torch thread count: an equal share of the usable CPUs per worker on the host."""

from __future__ import annotations

import os

import pytest

from switchboard.worker.threads import auto_torch_threads, torch_threads, usable_cpus


def test_a_configured_count_wins():
    assert torch_threads(3, workers_on_host=8, cpus=2) == 3


@pytest.mark.parametrize(
    ("cpus", "workers", "expected"),
    [(2, 1, 2), (2, 2, 1), (2, 4, 1), (64, 1, 64), (64, 4, 16), (16, 3, 5)],
)
def test_auto_shares_the_cpus_equally_and_never_gives_zero(cpus, workers, expected):
    assert auto_torch_threads(workers, cpus) == expected
    assert torch_threads(0, workers, cpus) == expected


def test_usable_cpus_is_the_affinity_mask_without_a_quota(tmp_path):
    affinity = len(os.sched_getaffinity(0))
    missing = tmp_path / "no-such-file"
    assert usable_cpus(str(missing)) == affinity
    unlimited = tmp_path / "cpu.max"
    unlimited.write_text("max 100000\n")
    assert usable_cpus(str(unlimited)) == affinity


def test_a_cgroup_quota_caps_the_count(tmp_path):
    cpu_max = tmp_path / "cpu.max"
    cpu_max.write_text("50000 100000\n")  # half a CPU: still one thread
    assert usable_cpus(str(cpu_max)) == 1
    cpu_max.write_text(f"{1000 * 100000} 100000\n")  # more than the machine has
    assert usable_cpus(str(cpu_max)) == len(os.sched_getaffinity(0))


def test_a_malformed_quota_is_ignored(tmp_path):
    cpu_max = tmp_path / "cpu.max"
    cpu_max.write_text("garbage\n")
    assert usable_cpus(str(cpu_max)) == len(os.sched_getaffinity(0))
