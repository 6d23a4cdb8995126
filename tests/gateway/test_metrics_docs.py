"""The Grafana dashboard and docs/observability.md name only metrics the gateway exports, and
the docs name every one it exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from switchboard.gateway.engines.types import EngineHandle
from switchboard.gateway.observability.metrics import GatewayMetrics
from switchboard.wire.engine_msgs import ITERATION_TOKENS_BUCKETS, EngineReady, SchedulerStats

ROOT = Path(__file__).resolve().parents[2]
# A metric name, not a label name (those are followed by =, =~, != or !~).
METRIC_NAME = re.compile(r"\b((?:switchboard|vllm):[a-z0-9_]+|gen_ai_[a-z0-9_]+)\b(?!\s*[=!~])")
SUFFIXES = ("_bucket", "_count", "_sum")


def exported_samples() -> set[str]:
    stats = SchedulerStats(iteration_tokens_counts=[0] * (len(ITERATION_TOKENS_BUCKETS) + 1))
    ready = EngineReady("e0", 0, 64, 10, 16, 160, 0, 0)
    engines = [
        EngineHandle(identity=b"x", ready=ready, scheduler_stats=stats, exports_engine_stats=True)
    ]
    metrics = GatewayMetrics("m", 64, lambda: engines)
    requests = metrics.requests  # make every labelled series appear once
    requests.first_token("0", 0.1, 1, 0)
    requests.tokens("0", 2, 0.01)
    phases = {"queue": 0.1, "prefill": 0.1, "decode": 0.1, "inference": 0.2}
    requests.finished("0", ["stop"], 1.0, phases, 1, 3)
    requests.gen_ai("", 1.0, 0.1, 0.1, 1, 3)
    requests.stalls.labels(*requests.labels("0")).inc()
    text = generate_latest(metrics.registry).decode()
    return {
        sample.name
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if METRIC_NAME.fullmatch(sample.name)
    }


def family(name: str) -> str:
    for suffix in SUFFIXES:
        if name.endswith(suffix):
            return name.removesuffix(suffix)
    return name


def test_the_dashboard_queries_exported_metrics_only() -> None:
    exported = exported_samples()
    dashboard = json.loads((ROOT / "docs/grafana/switchboard.json").read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    used = {name for expr in exprs for name in METRIC_NAME.findall(expr)}
    assert used and used <= exported, used - exported


def test_the_docs_name_every_exported_metric() -> None:
    docs = (ROOT / "docs/observability.md").read_text()
    documented = set(METRIC_NAME.findall(docs))
    missing = {family(name) for name in exported_samples()} - documented
    assert not missing, missing
