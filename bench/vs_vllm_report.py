"""The report of bench/vs_vllm.py: two markdown tables, switchboard / vLLM / llama.cpp side by
side per model and level (throughput and switchboard's ratio to each anchor, latency
percentiles, CPU share per process, API RSS, errors), how long each server took to be ready and
how it ran the model, and the JSON file with every raw number.

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
    "APIServer": "API", "llama-server": "LC",
}  # fmt: skip
SHOWN = {"switchboard": "sb", "vllm": "vLLM", "llamacpp": "llama.cpp"}


def _num(x: float | None) -> str:
    if x is None:
        return "-"
    if isinstance(x, int):
        return str(x)
    return f"{x:.2f}" if x < 10 else f"{x:.1f}" if x < 100 else f"{x:.0f}"


def _sides(levels: list[dict[str, Any] | None], key: str) -> str:
    return " / ".join(_num(level.get(key) if level else None) for level in levels)


def _tok_s(level: dict[str, Any] | None) -> str:
    if level is None:
        return "-"
    errors = f" ({level['errors']} err)" if level["errors"] else ""
    return f"{level['output_tok_s']:.1f}{errors}"


def _ratio(sb: dict[str, Any] | None, anchor: dict[str, Any] | None) -> str:
    if sb and anchor and anchor["output_tok_s"] > 0:
        return f"{sb['output_tok_s'] / anchor['output_tok_s']:.2f}"
    return "-"


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


def _nth(
    by: dict[str, dict[tuple[int, int], list[dict[str, Any]]]],
    kind: str,
    key: tuple[int, int],
    n: int,
) -> dict[str, Any] | None:
    """The ``n``-th run of level ``key`` (prompt length, c) by ``kind``; None if it has none."""
    runs_of = by.get(kind, {}).get(key, [])
    return runs_of[n] if n < len(runs_of) else None


def print_tables(
    plans: list[ModelPlan], runs: dict[str, dict[str, Any]], sweep: bool, dtype: str
) -> None:
    """Throughput with switchboard's ratio to each anchor that ran, then the tails."""
    kinds = [k for k in SERVERS if any(k in runs[plan.label] for plan in plans)]
    anchors = [k for k in kinds if k != "switchboard"]
    lead_head = ["model", *(["prompt"] if sweep else []), "c"]
    speed, tails = [], []
    for plan in plans:
        # a level given twice (--concurrency 1 1 1: repeated runs) has a row per run, in order
        by: dict[str, dict[tuple[int, int], list[dict[str, Any]]]] = {}
        for kind in kinds:
            by[kind] = {}
            for lv in (runs[plan.label].get(kind) or {}).get("levels", []):
                by[kind].setdefault((lv["input_len"], lv["concurrency"]), []).append(lv)
        seen: dict[tuple[int, int], int] = {}
        for input_len, c, _ in plan.levels:
            key = (input_len, c)
            n = seen[key] = seen.get(key, -1) + 1
            row = [_nth(by, kind, key, n) for kind in kinds]
            sb = _nth(by, "switchboard", key, n)
            lead = [plan.label, *([str(input_len)] if sweep else []), str(c)]
            against = []
            for kind in anchors:
                anchor = _nth(by, kind, key, n)
                against += [_tok_s(anchor), _ratio(sb, anchor)]
            pair = [_sides(row, key) for key in ("ttft_ms_p50", "itl_ms_p50")]
            speed.append([*lead, _tok_s(sb), *against, *pair, *(_cpu(level) for level in row)])
            keys = ("ttft_ms_p99", "itl_ms_p99", "e2e_ms_p50", "api_rss_mb", "errors")
            tails.append([*lead, *(_sides(row, key) for key in keys)])
    names = [SHOWN[kind] for kind in kinds]
    sides = " / ".join(names)
    anchor_head = [h for kind in anchors for h in (f"{SHOWN[kind]} tok/s", "ratio")]
    print(f"dtype {dtype} (switchboard and vLLM); llama.cpp: its GGUF file's own types\n")
    _table(
        [*lead_head, "sb tok/s", *anchor_head, f"TTFT p50 ms {sides}", f"ITL p50 ms {sides}",
         *(f"CPU % {name}" for name in names)],
        speed,
    )  # fmt: skip
    _table(
        [*lead_head, f"TTFT p99 ms {sides}", f"ITL p99 ms {sides}", f"e2e p50 ms {sides}",
         f"API RSS MB {sides}", f"errors {sides}"],
        tails,
    )  # fmt: skip
    print(
        "ratio: switchboard's tok/s over the anchor's on its left. CPU %: of one core, summed "
        "over the server's processes, then each: GW gateway, EC engine core, W worker, main "
        "switchboard's launcher, API vLLM's API server, LC llama.cpp's server."
    )
    for plan in plans:
        ready = []
        for kind, run in runs[plan.label].items():
            state = f"{run['ready_s']:.1f} s" if run["ready_s"] is not None else "not ready"
            runs_as = f" ({run['runs_as']})" if run.get("runs_as") else ""
            error = f" ({run['error'].splitlines()[0][:200]})" if run["error"] else ""
            ready.append(f"{SHOWN[kind]} {state}{runs_as}{error}")
        print(f"- {plan.label} ({plan.path}) ready after: " + ", ".join(ready))
        if plan.gguf:
            print(f"  - llama.cpp's file: {plan.gguf}")
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
