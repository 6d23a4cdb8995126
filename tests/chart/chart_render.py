"""Render charts/switchboard offline with the Helm SDK (helm-python-sdk: Helm v4 as a C
library) and pick containers out of the manifests, for the chart tests."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import helm_python
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "switchboard"
RELEASE = "demo"
NAMESPACE = "llm"
KUBE_VERSION = "1.33.0"  # kubernetes-validate's schemas; the chart needs >= 1.30

# DP = 2 (a coordinator), TP = 2 on GPUs, metrics with a ServiceMonitor, tracing.
BIG_VALUES: dict[str, Any] = {
    "dataParallelSize": 2,
    "engine": {"tensorParallelSize": 2, "pipelineParallelSize": 2, "gpu": {"enabled": True},
               "runtimeClassName": "nvidia", "shm": {"sizeLimit": "8Gi"},
               "maxNumSeqs": 64, "kvCacheMemoryBytes": 1 << 30},
    "metrics": {"enabled": True, "port": 9100, "serviceMonitor": {"enabled": True}},
    "tracing": {"enabled": True, "endpoint": "http://jaeger-collector.observability:4317",
                "traceContent": True,
                "extraEnv": [{"name": "OTEL_RESOURCE_ATTRIBUTES", "value": "env=test"}]},
    "gateway": {"replicas": 3, "service": {"type": "LoadBalancer"}, "enableAdmin": True},
    "model": {"servedModelName": "tiny", "maxModelLen": 512},
}  # fmt: skip


def render(values: dict[str, Any] | None = None, release: str = RELEASE) -> dict[str, str]:
    """``{template path: manifest text}`` of the chart under ``values`` (schema-checked)."""
    with helm_python.Chart.load(str(CHART)) as chart:
        return chart.render(copy.deepcopy(values or {}), name=release, namespace=NAMESPACE)


def manifests(values: dict[str, Any] | None = None, release: str = RELEASE) -> list[dict[str, Any]]:
    """Every rendered Kubernetes object (NOTES.txt left out)."""
    docs = []
    for path, text in render(values, release).items():
        if path.endswith(".yaml"):
            docs.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return docs


def find(docs: list[dict[str, Any]], kind: str, component: str) -> dict[str, Any] | None:
    for doc in docs:
        labels = doc["metadata"].get("labels", {})
        if doc["kind"] == kind and labels.get("app.kubernetes.io/component") == component:
            return doc
    return None


def container(docs: list[dict[str, Any]], kind: str, component: str) -> dict[str, Any]:
    workload = find(docs, kind, component)
    assert workload is not None, f"no {kind} for {component}"
    (only,) = workload["spec"]["template"]["spec"]["containers"]
    return only


def argv(c: dict[str, Any]) -> list[str]:
    """The container's command line without the program: what `switchboard` parses."""
    assert c["command"][0] == "switchboard"
    return [*c["command"][1:], *c.get("args", [])]
