"""The report of bench/vs_vllm.py: two markdown tables side by side, switchboard / vLLM per model
and level (throughput, latency percentiles, CPU share per process, API RSS, errors), how long
each server took to be ready, and the JSON file with every raw number.

Not run by itself.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from vs_vllm_run import SERVERS, ModelPlan

ROLE_SHORT = {  # process name (before the first "_") -> table name
    "launcher": "main", "Gateway": "GW", "EngineCore": "EC", "Worker": "W", "Coordinator": "CO",
    "APIServer": "API",
}  # fmt: skip


def _num(x: float | None) -> str:
    if x is None:
        return "-"
    if isinstance(x, int):
        return str(x)
    return f"{x:.2f}" if x < 10 else f"{x:.1f}" if x < 100 else f"{x:.0f}"


def _pair(a: dict[str, Any] | None, b: dict[str, Any] | None, key: str) -> str:
    return f"{_num(a.get(key) if a else None)} / {_num(b.get(key) if b else None)}"


def _tok_s(level: dict[str, Any] | None) -> str:
    if level is None:
        return "-"
    errors = f" ({level['errors']} err)" if level["errors"] else ""
    return f"{level['output_tok_s']:.1f}{errors}"


def _cpu(level: dict[str, Any] | None) -> str:
    """ "total: GW 35 EC 60 W 98": CPU % per process (under 1 % left out)."""
    if level is None:
        return "-"
    cpu: dict[str, float] = level["cpu_pct"]
    roles = [name.split("_", 1)[0] for name in cpu]
    order = {role: i for i, role in enumerate(ROLE_SHORT)}
    parts = []
    for name in sorted(cpu, key=lambda n: (order.get(n.split("_")[0], len(order)), n)):
        role, _, rank = name.partition("_")
        if cpu[name] >= 1:
            rank = f":{rank}" if roles.count(role) > 1 else ""
            parts.append(f"{ROLE_SHORT.get(role, name)}{rank} {cpu[name]:.0f}")
    return f"{sum(cpu.values()):.0f}: " + " ".join(parts)


def _table(head: list[str], rows: list[list[str]]) -> None:
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print()


def print_tables(plans: list[ModelPlan], runs: dict[str, dict[str, Any]], sweep: bool) -> None:
    lead_head = ["model", *(["prompt"] if sweep else []), "c"]
    speed, tails = [], []
    for plan in plans:
        by: dict[str, dict[tuple[int, int], dict[str, Any]]] = {}
        for kind in SERVERS:
            levels = (runs[plan.label].get(kind) or {}).get("levels", [])
            by[kind] = {(lv["input_len"], lv["concurrency"]): lv for lv in levels}
        for input_len, c, _ in plan.levels:
            sb, vl = by["switchboard"].get((input_len, c)), by["vllm"].get((input_len, c))
            ratio = "-"
            if sb and vl and vl["output_tok_s"] > 0:
                ratio = f"{sb['output_tok_s'] / vl['output_tok_s']:.2f}"
            lead = [plan.label, *([str(input_len)] if sweep else []), str(c)]
            pair = [_pair(sb, vl, key) for key in ("ttft_ms_p50", "itl_ms_p50")]
            speed.append([*lead, _tok_s(sb), _tok_s(vl), ratio, *pair, _cpu(sb), _cpu(vl)])
            keys = ("ttft_ms_p99", "itl_ms_p99", "e2e_ms_p50", "api_rss_mb", "errors")
            tails.append([*lead, *(_pair(sb, vl, key) for key in keys)])
    sides = "ms sb / vLLM"
    _table(
        [*lead_head, "sb tok/s", "vLLM tok/s", "ratio", f"TTFT p50 {sides}", f"ITL p50 {sides}",
         "CPU % sb", "CPU % vLLM"],
    speed)  # fmt: skip
    _table(
        [*lead_head, f"TTFT p99 {sides}", f"ITL p99 {sides}", f"e2e p50 {sides}",
         "API RSS MB sb / vLLM", "errors sb / vLLM"],
    tails)  # fmt: skip
    print(
        "CPU %: of one core, summed over the server's processes, then each: GW gateway, "
        "EC engine core, W worker, main switchboard's launcher, API vLLM's API server."
    )
    for plan in plans:
        ready = []
        for kind, run in runs[plan.label].items():
            state = f"{run['ready_s']:.1f} s" if run["ready_s"] is not None else "not ready"
            error = f" ({run['error'].splitlines()[0][:200]})" if run["error"] else ""
            ready.append(f"{kind} {state}{error}")
        print(f"- {plan.label} ({plan.path}) ready after: " + ", ".join(ready))
        for note in plan.notes:
            print(f"  - {note}")


def write_json(
    path: Path, args: argparse.Namespace, plans: list[ModelPlan], runs: dict[str, dict[str, Any]]
) -> None:
    """The arguments, the CPUs this process may use, and per model its plan and every run."""
    record = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "cpus": len(os.sched_getaffinity(0)),
        "models": [dataclasses.asdict(plan) | {"runs": runs[plan.label]} for plan in plans],
    }
    path.write_text(json.dumps(record, indent=1))
    print(f"\nraw numbers: {path}")
