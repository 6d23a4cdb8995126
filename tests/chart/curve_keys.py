"""The chart's CURVE keys as a cluster would make and mount them: the rendered hook Job's
command run against tests/chart/kube_api_stub.py, and a pod's Secret volume projected into a
directory, item by item, as the kubelet lays it out."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import Any

import pytest

from switchboard import cli
from switchboard.cli import curve_secret
from tests.chart.chart_render import argv, container, find
from tests.chart.kube_api_stub import KubeApiStub

HOOK = "curve-keys"


def hook(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = find(docs, kind, HOOK)
    assert found is not None, f"no {kind} of the keys hook"
    return found


def run_keys_job(
    docs: list[dict[str, Any]], api: KubeApiStub, monkeypatch: pytest.MonkeyPatch
) -> str:
    """Run the rendered Job's container command (`switchboard keys kubernetes-secret ...`) in
    this process, as its pod would: in-cluster environment, the service account's files.
    Returns what it printed; a failure raises SystemExit with the command's message."""
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(api.port))
    monkeypatch.setattr(curve_secret, "SERVICE_ACCOUNT_DIR", str(api.service_account))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(argv(container(docs, "Job", HOOK))) == 0
    return out.getvalue()


def curve_volume(docs: list[dict[str, Any]], kind: str, component: str) -> dict[str, Any]:
    pod = find(docs, kind, component)["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "curve-keys"]
    return volume["secret"]


def project_keys(
    docs: list[dict[str, Any]], kind: str, component: str, data: dict[str, bytes], dest: Path
) -> Path:
    """The directory the pod would see at curve.mountPath: each item of its Secret volume
    written at its path (a missing key fails, as the kubelet would refuse to start the pod)."""
    for item in curve_volume(docs, kind, component)["items"]:
        assert item["key"] in data, f"{component}: the Secret has no {item['key']}"
        path = dest / item["path"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data[item["key"]])
    return dest
