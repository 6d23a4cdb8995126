"""CURVE is on by default: every role gets ``--curve-keys-dir`` and a Secret volume with only
its own files, laid out as `switchboard keys generate` writes them (wire/curve.py), from the
chart-made Secret or ``curve.secretName``; only ``curve.insecure: true`` turns it off, and the
notes say what that costs."""

from __future__ import annotations

import subprocess
import sys

import helm_python
import pytest

from switchboard.cli import make_parser
from tests.chart.chart_render import BIG_VALUES, argv, container, find, manifests, render
from tests.chart.curve_keys import curve_volume

MOUNT = "/etc/switchboard/curve"
CHART_SECRET = "demo-switchboard-curve"
ROLES = [("Deployment", "gateway"), ("StatefulSet", "engine"), ("Deployment", "coordinator")]
GENERATION = "switchboard.io/curve-generation"


def _values(dp: int, **curve: object) -> dict:
    return {**BIG_VALUES, "dataParallelSize": dp, "curve": curve}


def _keys(docs: list[dict], kind: str, component: str, secret: str) -> dict[str, str]:
    """The Secret's items the pod mounts, path -> key."""
    volume = curve_volume(docs, kind, component)
    assert volume["secretName"] == secret
    (mount,) = [m for m in container(docs, kind, component)["volumeMounts"]
                if m["name"] == "curve-keys"]  # fmt: skip
    assert mount["mountPath"] == MOUNT and mount["readOnly"] is True
    return {item["path"]: item["key"] for item in volume["items"]}


def _pod_annotations(docs: list[dict], kind: str, component: str) -> dict[str, str]:
    return find(docs, kind, component)["spec"]["template"]["metadata"].get("annotations", {})


@pytest.mark.parametrize("secret", ["", "sb-curve"], ids=["chart-made", "own-secret"])
def test_each_role_mounts_only_its_keys_and_gets_the_flag(secret: str) -> None:
    docs = manifests(_values(2, secretName=secret))
    name = secret or CHART_SECRET
    assert _keys(docs, "Deployment", "gateway", name) == {
        "gateway.key": "gateway.key",
        "gateway.key_secret": "gateway.key_secret",
        "coordinator.key": "coordinator.key",
        "allowed-engines/engine-0.key": "engine-0.key",
        "allowed-engines/engine-1.key": "engine-1.key",
    }
    assert _keys(docs, "StatefulSet", "engine", name) == {
        "gateway.key": "gateway.key",
        "coordinator.key": "coordinator.key",
        "engine-0.key_secret": "engine-0.key_secret",
        "engine-1.key_secret": "engine-1.key_secret",
    }
    assert _keys(docs, "Deployment", "coordinator", name) == {
        "coordinator.key": "coordinator.key",
        "coordinator.key_secret": "coordinator.key_secret",
        "allowed-gateways/gateway.key": "gateway.key",
        "allowed-engines/engine-0.key": "engine-0.key",
        "allowed-engines/engine-1.key": "engine-1.key",
    }
    parser = make_parser()
    for kind, component in ROLES:
        args, _ = parser.parse_known_args(argv(container(docs, kind, component)))
        assert args.curve_keys_dir == MOUNT, component
        # Chart-made keys: a rotation (curve.generation) changes every pod template.
        assert (GENERATION in _pod_annotations(docs, kind, component)) == (not secret)
    # The hook Job makes the chart's Secret only.
    assert (find(docs, "Job", "curve-keys") is None) == bool(secret)


def test_defaults_are_keyed_and_pod_annotations_stay() -> None:
    docs = manifests({"gateway": {"podAnnotations": {"team": "llm"}}})
    assert "coordinator.key" not in _keys(docs, "Deployment", "gateway", CHART_SECRET)
    assert _pod_annotations(docs, "Deployment", "gateway") == {"team": "llm", GENERATION: "1"}
    assert _pod_annotations(docs, "StatefulSet", "engine") == {GENERATION: "1"}
    bumped = manifests({"curve": {"generation": 7}})
    assert _pod_annotations(bumped, "StatefulSet", "engine") == {GENERATION: "7"}


def test_insecure_means_no_keys_no_job_and_a_warning() -> None:
    values = _values(2, insecure=True)
    docs = manifests(values)
    assert find(docs, "Job", "curve-keys") is None
    for doc in docs:
        pod = doc.get("spec", {}).get("template", {}).get("spec", {})
        assert all(v["name"] != "curve-keys" for v in pod.get("volumes", []))
        for c in pod.get("containers", []):
            assert "--curve-keys-dir" not in c.get("args", [])
    notes = render(values)["switchboard/templates/NOTES.txt"]
    assert "WARNING: curve.insecure=true" in notes and "unauthenticated" in notes
    assert "WARNING" not in render()["switchboard/templates/NOTES.txt"]
    with pytest.raises(Exception, match="cannot use curve.secretName"):
        render({"curve": {"insecure": True, "secretName": "sb-curve"}})


@pytest.mark.parametrize(
    ("curve", "where"),
    [
        ({"enabled": False}, "enabled"),  # the old switch: off needs curve.insecure now
        ({"insecure": "yes"}, "/curve/insecure"),
        ({"generation": 0}, "/curve/generation"),
        ({"generation": "2"}, "/curve/generation"),
        ({"secretName": "My_Keys"}, "/curve/secretName"),
        ({"mountPath": "etc/keys"}, "/curve/mountPath"),
        ({"job": {"activeDeadlineSeconds": 5}}, "/curve/job/activeDeadlineSeconds"),
    ],
)
def test_schema_rejects_bad_curve_values(curve: dict, where: str) -> None:
    with pytest.raises(helm_python.HelmValuesError) as error:
        render({"curve": curve})
    assert where in str(error.value)


def test_rendered_yaml_passes_yamllint(tmp_path) -> None:
    files = []
    for i, values in enumerate((_values(2), _values(2, insecure=True))):
        for name, text in render(values).items():
            if name.endswith(".yaml") and text.strip():
                path = tmp_path / f"{i}-{name.rsplit('/', 1)[1]}"
                path.write_text(text)
                files.append(str(path))
    result = subprocess.run(
        [sys.executable, "-m", "yamllint", "-d", "relaxed", *files],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
