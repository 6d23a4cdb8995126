"""The InferencePools docs/helm.md shows: valid under the Gateway API Inference Extension's
published CRD schema (vendored, tests/chart/vendor/), and selecting this chart's gateway pods on
the ports they serve (the HTTP API, the gRPC port)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from tests.chart.chart_render import RELEASE, REPO, find, manifests

CRD = Path(__file__).parent / "vendor" / "gateway-api-inference-extension"
CRD_FILE = CRD / "inference.networking.k8s.io_inferencepools.yaml"
HELM_DOC = REPO / "docs" / "helm.md"


def pool_schema() -> dict[str, Any]:
    crd = yaml.safe_load(CRD_FILE.read_text())
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return v1["schema"]["openAPIV3Schema"]


def documented_pools() -> list[dict[str, Any]]:
    blocks = re.findall(r"```yaml\n(.*?)```", HELM_DOC.read_text(), flags=re.DOTALL)
    docs = [yaml.safe_load(block) for block in blocks]
    return [doc for doc in docs if isinstance(doc, dict) and doc.get("kind") == "InferencePool"]


def test_the_vendored_crd_is_the_published_one_with_its_licence() -> None:
    crd = yaml.safe_load(CRD_FILE.read_text())
    assert crd["spec"]["group"] == "inference.networking.k8s.io"
    assert crd["spec"]["names"]["kind"] == "InferencePool"
    assert "Apache License" in (CRD / "LICENSE").read_text()


@pytest.mark.parametrize("protocol", ["http", "kubernetes.io/h2c"])
def test_the_documented_pool_is_valid_and_selects_the_gateways(protocol: str) -> None:
    pools = {pool["spec"].get("appProtocol", "http"): pool for pool in documented_pools()}
    pool = pools[protocol]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    jsonschema.validate(pool, pool_schema())
    # the schema's own rules (CEL, not JSON Schema): unique port numbers, a port for a Service
    numbers = [port["number"] for port in pool["spec"]["targetPorts"]]
    assert len(set(numbers)) == len(numbers)
    assert "number" in pool["spec"]["endpointPickerRef"]["port"]

    docs = manifests({"metrics": {"enabled": True}})
    gateway = find(docs, "Deployment", "gateway")
    assert gateway is not None
    template = gateway["spec"]["template"]
    labels = template["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert labels["app.kubernetes.io/instance"] == RELEASE
    (container,) = template["spec"]["containers"]
    served = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert numbers == [served["grpc" if protocol == "kubernetes.io/h2c" else "http"]]


def test_a_misspelt_pool_fails_the_schema() -> None:
    pool = documented_pools()[0]
    pool["spec"]["targetPorts"] = [{"number": 0}]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(pool, pool_schema())
    pool["spec"]["targetPorts"] = [{"number": 8000}]
    pool["spec"]["appProtocol"] = "grpc"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(pool, pool_schema())
