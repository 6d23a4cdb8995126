"""charts/switchboard: helm lint, rendering under default and big values, every object valid
against the Kubernetes schema (strict), and what the templates promise (probes, GPUs, shm,
discovery, coordinator, dashboard)."""

from __future__ import annotations

import json
import subprocess
import sys

import helm_python
import kubernetes_validate
import pytest

from tests.chart.chart_render import (
    BIG_VALUES,
    CHART,
    KUBE_VERSION,
    NAMESPACE,
    REPO,
    container,
    find,
    manifests,
    render,
)

READINESS = "switchboard.v1.GenerationService"
CRD_KINDS = {"ServiceMonitor"}  # not in the core schemas; checked by shape below


def test_helm_lint_strict_is_clean() -> None:
    for values in ({}, BIG_VALUES):
        report = helm_python.lint(str(CHART), values, strict=True, kube_version=f"v{KUBE_VERSION}")
        assert report["errors"] == [], report
        # severity 1 = info ("icon is recommended"); 2 warning, 3 error
        assert all(m["severity"] < 2 for m in report["messages"]), report


OPEN = {
    "curve": {"secretName": "own-keys"},
    "networkPolicy": {
        "ingress": [
            {"namespaceSelector": {"matchLabels": {"team": "apps"}},
             "podSelector": {"matchExpressions": [{"key": "role", "operator": "Exists"}]}},
            {"ipBlock": {"cidr": "10.0.0.0/8", "except": ["10.1.0.0/16"]}},
        ],
    },
}  # fmt: skip


@pytest.mark.parametrize(
    "values",
    [{}, BIG_VALUES, OPEN, {"curve": {"insecure": True}, "networkPolicy": {"enabled": False}}],
    ids=["defaults", "dp2-tp2-pp2-gpu", "own-keys-wider-ingress", "insecure-open"],
)
def test_every_object_is_valid_kubernetes(values: dict) -> None:
    docs = manifests(values)
    assert docs
    for doc in docs:
        assert doc["metadata"]["namespace"] == NAMESPACE
        if doc["kind"] in CRD_KINDS:
            continue
        kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)


def yamllint(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "yamllint", *args], capture_output=True, text=True, timeout=60
    )


def test_values_and_rendered_yaml_pass_yamllint(tmp_path) -> None:
    # values.yaml and Chart.yaml are written by hand: no warnings either.
    config = "{extends: relaxed, rules: {line-length: {max: 100}}}"
    result = yamllint("-s", "-d", config, str(CHART / "values.yaml"), str(CHART / "Chart.yaml"))
    assert result.returncode == 0, result.stdout + result.stderr
    # Rendered manifests keep Helm's layout (indentation, blank lines): errors only, such as
    # duplicate keys or broken syntax, which the Kubernetes schema check would not see.
    files = []
    for i, values in enumerate(({}, BIG_VALUES)):
        for name, text in render(values).items():
            if name.endswith(".yaml") and text.strip():
                path = tmp_path / f"{i}-{name.rsplit('/', 1)[1]}"
                path.write_text(text)
                files.append(str(path))
    result = yamllint("-d", "relaxed", *files)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    ("values", "where"),
    [
        ({"dataParallelSize": 0}, "/dataParallelSize"),
        ({"engine": {"tensorParallelSize": 0}}, "/engine/tensorParallelSize"),
        ({"gateway": {"port": 70000}}, "/gateway/port"),
        ({"model": {"dtype": "int4"}}, "/model/dtype"),
        ({"model": {"path": "relative/dir"}}, "/model/path"),
        ({"engine": {"shm": {"sizeLimit": "lots"}}}, "/engine/shm/sizeLimit"),
        ({"tracing": {"enabled": True}}, "/tracing/endpoint"),
        ({"gateway": {"replica": 2}}, "replica"),  # a typo is refused, not ignored
        ({"gateway": {"probes": "tcp"}}, "/gateway/probes"),
        ({"gateway": {"http": {"port": 0}}}, "/gateway/http/port"),
    ],
)
def test_schema_rejects_bad_values(values: dict, where: str) -> None:
    with pytest.raises(helm_python.HelmValuesError) as error:
        render(values)
    assert where in str(error.value)


def test_default_topology() -> None:
    docs = manifests()
    kinds = sorted((d["kind"], d["metadata"]["name"]) for d in docs)
    assert kinds == [
        ("ConfigMap", "demo-switchboard-dashboard"),
        ("Deployment", "demo-switchboard-gateway"),
        ("Job", "demo-switchboard-curve-keys"),  # a hook: the CURVE keys Secret
        ("NetworkPolicy", "demo-switchboard-engine"),
        ("NetworkPolicy", "demo-switchboard-gateway"),
        ("PodDisruptionBudget", "demo-switchboard-engine"),
        ("PodDisruptionBudget", "demo-switchboard-gateway"),
        ("Role", "demo-switchboard-curve-keys"),
        ("RoleBinding", "demo-switchboard-curve-keys"),
        ("Service", "demo-switchboard-engine"),
        ("Service", "demo-switchboard-gateway"),
        ("Service", "demo-switchboard-gateway-discovery"),
        ("ServiceAccount", "demo-switchboard-curve-keys"),
        ("StatefulSet", "demo-switchboard-engine"),
    ]  # DP = 1: no coordinator; metrics off: no ServiceMonitor
    engine = find(docs, "StatefulSet", "engine")
    assert engine["spec"]["replicas"] == 1
    assert "nvidia.com/gpu" not in json.dumps(engine)


def test_gateway_pods_probe_grpc_health_and_drain() -> None:
    gateway = container(manifests(), "Deployment", "gateway")
    port = gateway["ports"][0]["containerPort"]
    assert gateway["ports"][0]["name"] == "grpc"
    assert gateway["readinessProbe"]["grpc"] == {"port": port, "service": READINESS}
    assert gateway["livenessProbe"]["grpc"] == {"port": port, "service": ""}
    assert gateway["startupProbe"]["grpc"] == {"port": port, "service": ""}
    sleep_s = gateway["lifecycle"]["preStop"]["sleep"]["seconds"]
    pod = find(manifests(), "Deployment", "gateway")["spec"]["template"]["spec"]
    args = gateway["args"]
    grace_s = float(args[args.index("--shutdown-grace") + 1])
    assert pod["terminationGracePeriodSeconds"] >= sleep_s + grace_s  # preStop, then the drain
    assert gateway["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod["securityContext"]["runAsNonRoot"] is True


def _client_service(docs: list[dict]) -> dict:
    (service,) = [d for d in docs if d["metadata"]["name"] == "demo-switchboard-gateway"
                  and d["kind"] == "Service"]  # fmt: skip
    return service


def test_gateway_serves_http_and_can_be_probed_over_it() -> None:
    docs = manifests()
    gateway = container(docs, "Deployment", "gateway")
    ports = {p["name"]: p["containerPort"] for p in gateway["ports"]}
    assert ports["http"] == 8000
    args = gateway["args"]
    assert args[args.index("--http-port") + 1] == "8000"
    service = _client_service(docs)
    assert {"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP",
            "appProtocol": "http"} in service["spec"]["ports"]  # fmt: skip

    gateway = container(manifests({"gateway": {"probes": "http"}}), "Deployment", "gateway")
    assert gateway["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert gateway["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert gateway["startupProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert "grpc" not in gateway["readinessProbe"]

    off = manifests({"gateway": {"http": {"enabled": False}}})
    gateway = container(off, "Deployment", "gateway")
    assert "http" not in {p["name"] for p in gateway["ports"]}
    assert gateway["args"][gateway["args"].index("--http-port") + 1] == "-1"
    assert "http" not in {p["name"] for p in _client_service(off)["spec"]["ports"]}
    with pytest.raises(Exception, match="needs gateway.http.enabled"):
        render({"gateway": {"probes": "http", "http": {"enabled": False}}})


def test_engines_find_every_gateway_through_a_headless_service() -> None:
    docs = manifests()
    discovery = next(
        d for d in docs if d["metadata"]["name"] == "demo-switchboard-gateway-discovery"
    )
    assert discovery["spec"]["clusterIP"] == "None"
    # gateways turn ready only after an engine joins: not-ready pods must be listed too
    assert discovery["spec"]["publishNotReadyAddresses"] is True
    assert (
        discovery["spec"]["selector"]
        == find(docs, "Deployment", "gateway")["spec"]["selector"]["matchLabels"]
    )
    engine = container(docs, "StatefulSet", "engine")
    address = engine["args"][engine["args"].index("--gateway-address") + 1]
    assert address == f"demo-switchboard-gateway-discovery.{NAMESPACE}.svc:50052"


def test_big_values_engines_coordinator_gpus_metrics_tracing() -> None:
    docs = manifests(BIG_VALUES)
    statefulset = find(docs, "StatefulSet", "engine")
    assert statefulset["spec"]["replicas"] == 2  # one pod per DP rank
    pod = statefulset["spec"]["template"]["spec"]
    assert pod["runtimeClassName"] == "nvidia"
    engine = pod["containers"][0]
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == 4  # TP x PP
    assert engine["resources"]["limits"]["memory"] == "8Gi"  # the defaults' limits stay
    args = engine["args"]
    assert args[args.index("--device") + 1] == "cuda"
    coordinator = f"demo-switchboard-coordinator.{NAMESPACE}.svc"
    assert args[args.index("--coordinator-address") + 1] == f"{coordinator}:50053"
    shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}
    assert {"name": "dshm", "mountPath": "/dev/shm"} in engine["volumeMounts"]

    gateway = container(docs, "Deployment", "gateway")
    gargs = gateway["args"]
    assert gargs[gargs.index("--coordinator-address") + 1] == f"{coordinator}:50054"
    assert gargs[gargs.index("--metrics-port") + 1] == "9100"
    assert "--trace-content" in gargs
    env = {e["name"]: e["value"] for e in gateway["env"]}
    assert env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] == BIG_VALUES["tracing"]["endpoint"]
    assert env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == "grpc"
    assert env["OTEL_RESOURCE_ATTRIBUTES"] == "env=test"

    cargs = container(docs, "Deployment", "coordinator")["args"]
    assert cargs[cargs.index("--data-parallel-size") + 1] == "2"
    service = find(docs, "Service", "coordinator")
    assert [p["port"] for p in service["spec"]["ports"]] == [50053, 50054]
    monitor = find(docs, "ServiceMonitor", "gateway")
    assert monitor["spec"]["endpoints"][0]["port"] == "metrics"
    (service,) = [d for d in docs if d["metadata"]["name"] == "demo-switchboard-gateway"
                  and d["kind"] == "Service"]  # fmt: skip
    metrics_ports = [p for p in service["spec"]["ports"] if p["name"] == "metrics"]
    assert metrics_ports and metrics_ports[0]["port"] == 9100


def test_dashboard_configmap_is_the_docs_dashboard() -> None:
    chart_copy = (CHART / "dashboards" / "switchboard.json").read_bytes()
    assert chart_copy == (REPO / "docs" / "grafana" / "switchboard.json").read_bytes(), (
        "charts/switchboard/dashboards/switchboard.json differs from docs/grafana/: copy it"
    )
    configmap = find(manifests(), "ConfigMap", "dashboard")
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(configmap["data"]["switchboard.json"]) == json.loads(chart_copy)


def test_notes_tell_how_to_reach_the_gateway() -> None:
    notes = render()["switchboard/templates/NOTES.txt"]
    assert "port-forward service/demo-switchboard-gateway 50051" in notes
    assert "loadBalancer" in render(BIG_VALUES)["switchboard/templates/NOTES.txt"]


def test_the_gateway_grace_period_must_cover_the_drain() -> None:
    """terminationGracePeriodSeconds < preStop sleep + --shutdown-grace: the kubelet would
    SIGKILL streams the gateway is still draining; the chart refuses it."""
    with pytest.raises(Exception, match="must cover preStopSleepSeconds"):
        manifests({"gateway": {"terminationGracePeriodSeconds": 20, "shutdownGraceSeconds": 30}})
    pod = find(manifests({"gateway": {"shutdownGraceSeconds": 5}}), "Deployment", "gateway")
    args = pod["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--shutdown-grace") + 1] == "5"


def test_the_grpc_port_is_h2c_to_gateways_and_routers_unless_tls() -> None:
    ports = {p["name"]: p for p in _client_service(manifests())["spec"]["ports"]}
    assert ports["grpc"]["appProtocol"] == "kubernetes.io/h2c"
    tls = _client_service(manifests({"tls": {"enabled": True, "secretName": "certs"}}))
    assert {p["name"]: p for p in tls["spec"]["ports"]}["grpc"]["appProtocol"] == "grpc"
