"""The soak's short version (bench/soak.py): 75 s of mixed traffic on -dp 2
--api-servers 2 while a role is killed with -9 every 12 s (seeded: an engine core first, then a
gateway, the coordinator, the other engine, a worker, as far as the time goes), and its report
asserted: no request lost, every killed role back, nothing leaked, a clean stop.

What counts as lost is bench/soak_traffic.py's rule: anything that did not end as it should,
except a stream that ended UNAVAILABLE saying how many tokens it had delivered, and an attempt
cut by a gateway's death that a retry on a fresh connection (the other gateway, or the
restarted one) completed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def test_a_short_soak_loses_nothing_and_leaks_nothing(tmp_path: Path) -> None:
    report_path = tmp_path / "soak.json"
    run = subprocess.run(
        [
            sys.executable, str(REPO / "bench/soak.py"),
            "--duration", "75", "--kill-interval-s", "12", "--clients", "3", "--seed", "1",
            "--json", str(report_path),
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )  # fmt: skip
    print(run.stdout[-4000:])
    assert report_path.exists(), run.stdout[-4000:] + run.stderr[-4000:]
    report = json.loads(report_path.read_text())
    traffic = report["traffic"]
    assert traffic["lost"] == [], traffic["lost"]
    for kind in ("stream", "completion", "chat", "structured", "cancel", "bad"):
        assert traffic["by_kind"][kind].get("ok", 0) > 0, (kind, traffic["by_kind"])
    kills = report["kills"]
    assert len(kills) >= 2, kills  # the first two: an engine core and a gateway (seed 1)
    assert all(kill["back_after_s"] is not None for kill in kills), kills
    assert report["roles_back"], report["not_back"]
    assert set(report["end"]) == set(report["start"])  # every role, restarted or not
    assert report["orphaned_ring_segments"] == []
    assert report["leftover_segments"] == []
    assert report["leftover_run_files"] == []
    assert report["exit_code"] == 0
    assert report["passed"] and run.returncode == 0
