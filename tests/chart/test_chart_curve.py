"""curve.enabled: every role gets ``--curve-keys-dir`` and a Secret volume with only its own
files, laid out as `switchboard keys generate` writes them (wire/curve.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from switchboard.cli import make_parser
from tests.chart.chart_render import BIG_VALUES, argv, container, find, manifests, render

CURVE = {"curve": {"enabled": True, "secretName": "sb-curve"}}
MOUNT = "/etc/switchboard/curve"


def _values(dp: int) -> dict:
    return {**BIG_VALUES, "dataParallelSize": dp, **CURVE}


def _keys(docs: list[dict], kind: str, component: str) -> dict[str, str]:
    """The Secret's items the pod mounts, path -> key."""
    pod = find(docs, kind, component)["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "curve-keys"]
    assert volume["secret"]["secretName"] == "sb-curve"
    (mount,) = [m for m in container(docs, kind, component)["volumeMounts"]
                if m["name"] == "curve-keys"]  # fmt: skip
    assert mount["mountPath"] == MOUNT and mount["readOnly"] is True
    return {item["path"]: item["key"] for item in volume["secret"]["items"]}


def test_each_role_mounts_only_its_keys_and_gets_the_flag() -> None:
    docs = manifests(_values(2))
    gateway = _keys(docs, "Deployment", "gateway")
    assert gateway == {
        "gateway.key": "gateway.key",
        "gateway.key_secret": "gateway.key_secret",
        "coordinator.key": "coordinator.key",
        "allowed-engines/engine-0.key": "engine-0.key",
        "allowed-engines/engine-1.key": "engine-1.key",
    }
    engine = _keys(docs, "StatefulSet", "engine")
    assert engine == {
        "gateway.key": "gateway.key",
        "coordinator.key": "coordinator.key",
        "engine-0.key_secret": "engine-0.key_secret",
        "engine-1.key_secret": "engine-1.key_secret",
    }
    coordinator = _keys(docs, "Deployment", "coordinator")
    assert coordinator == {
        "coordinator.key": "coordinator.key",
        "coordinator.key_secret": "coordinator.key_secret",
        "allowed-gateways/gateway.key": "gateway.key",
        "allowed-engines/engine-0.key": "engine-0.key",
        "allowed-engines/engine-1.key": "engine-1.key",
    }
    parser = make_parser()
    for kind, component in [("Deployment", "gateway"), ("StatefulSet", "engine"),
                            ("Deployment", "coordinator")]:  # fmt: skip
        args, _ = parser.parse_known_args(argv(container(docs, kind, component)))
        assert args.curve_keys_dir == MOUNT, component


def test_dp1_has_no_coordinator_key_and_off_means_no_volume() -> None:
    docs = manifests(_values(1))
    assert "coordinator.key" not in _keys(docs, "Deployment", "gateway")
    for doc in manifests(BIG_VALUES):
        pod = doc.get("spec", {}).get("template", {}).get("spec", {})
        assert all(v["name"] != "curve-keys" for v in pod.get("volumes", []))
        for c in pod.get("containers", []):
            assert "--curve-keys-dir" not in c.get("args", [])


def test_enabled_needs_a_secret_name() -> None:
    with pytest.raises(Exception, match="secretName"):
        render({"curve": {"enabled": True}})


def test_rendered_yaml_passes_yamllint(tmp_path) -> None:
    files = []
    for name, text in render(_values(2)).items():
        if name.endswith(".yaml") and text.strip():
            path = tmp_path / name.rsplit("/", 1)[1]
            path.write_text(text)
            files.append(str(path))
    result = subprocess.run(
        [sys.executable, "-m", "yamllint", "-d", "relaxed", *files],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
