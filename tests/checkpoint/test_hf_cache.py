"""Model ids (`org/name`) are found in the local Hugging Face cache, never downloaded; `serve
MODEL` (vLLM's positional form) and `--model` are the same thing."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from switchboard import cli
from switchboard.checkpoint import hub_model_id, resolve_model
from switchboard.checkpoint.hf_cache import hub_cache_dir

CACHE_VARIABLES = ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME")


def _snapshot(cache: Path, repo_id: str, commit: str, *, ref: bool = True) -> Path:
    """A model in the hub layout: blobs, a snapshot of links into them, refs/main."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    blob = repo / "blobs" / f"{commit}-config"
    blob.parent.mkdir(parents=True, exist_ok=True)
    blob.write_text('{"model_type": "llama"}')
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").symlink_to(os.path.relpath(blob, snapshot))
    if ref:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(commit)
    return snapshot


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for variable in CACHE_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    cache = tmp_path / "hf" / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.chdir(tmp_path)  # "org/name" must not be a folder here
    return cache


def test_refs_main_picks_the_snapshot(hub: Path) -> None:
    _snapshot(hub, "org/name", "a" * 40, ref=False)
    main = _snapshot(hub, "org/name", "b" * 40)
    assert resolve_model("org/name") == str(main)
    assert hub_model_id("org/name", str(main)) == "org/name"


def test_without_refs_main_the_newest_snapshot_is_used(hub: Path) -> None:
    old = _snapshot(hub, "org/name", "a" * 40, ref=False)
    new = _snapshot(hub, "org/name", "b" * 40, ref=False)
    os.utime(old, (time.time() - 100, time.time() - 100))
    assert resolve_model("org/name") == str(new)


def test_an_id_without_an_org_works_too(hub: Path) -> None:
    snapshot = _snapshot(hub, "gpt2", "c" * 40)
    assert resolve_model("gpt2") == str(snapshot)


def test_a_missing_model_names_where_it_looked(hub: Path) -> None:
    _snapshot(hub, "org/other", "a" * 40)
    with pytest.raises(FileNotFoundError) as error:
        resolve_model("org/name")
    message = str(error.value)
    assert str(hub / "models--org--name" / "snapshots") in message
    assert "$HF_HUB_CACHE" in message and "never downloads" in message


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"HF_HUB_CACHE": "/a"}, "/a"),
        ({"HUGGINGFACE_HUB_CACHE": "/b"}, "/b"),
        ({"HF_HOME": "/c", "XDG_CACHE_HOME": "/x"}, "/c/hub"),
        ({"XDG_CACHE_HOME": "/x"}, "/x/huggingface/hub"),
        ({}, str(Path.home() / ".cache" / "huggingface" / "hub")),
    ],
)
def test_cache_location_follows_huggingface_hub(
    env: dict[str, str], expected: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for variable in CACHE_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert str(hub_cache_dir()[0]) == expected


def test_a_local_directory_wins_over_the_cache(hub: Path, tmp_path: Path) -> None:
    _snapshot(hub, "org/name", "a" * 40)
    local = tmp_path / "org" / "name"
    local.mkdir(parents=True)
    (local / "config.json").write_text("{}")
    assert resolve_model("org/name") == str(local.resolve())
    assert hub_model_id("org/name", str(local)) is None


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> list:
    calls: list = []
    monkeypatch.setattr(
        "switchboard.supervisor.launcher.serve", lambda g, e, **_: calls.append((g, e)) or 0
    )
    return calls


@pytest.mark.parametrize("form", [["org/name"], ["--model", "org/name"]])
def test_serve_takes_the_model_positionally_or_as_a_flag(
    form: list[str], hub: Path, served: list
) -> None:
    snapshot = _snapshot(hub, "org/name", "d" * 40)
    assert cli.main(["serve", *form, "--port", "1"]) == 0
    gateway, engine = served[0]
    assert engine.model.model == gateway.model.model == str(snapshot)
    assert gateway.model.name == "org/name"  # served under its id, not the commit hash


def test_an_explicit_served_model_name_is_kept(hub: Path, served: list) -> None:
    _snapshot(hub, "org/name", "d" * 40)
    assert cli.main(["serve", "org/name", "--served-model-name", "mine"]) == 0
    assert served[0][0].model.name == "mine"


def test_two_different_models_are_refused(hub: Path, served: list) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", "org/a", "--model", "org/b"])
    assert exit_info.value.code == 2 and served == []


def test_a_model_not_in_the_cache_is_a_clear_usage_error(
    hub: Path, served: list, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", "org/missing"])
    assert exit_info.value.code == 2 and served == []
    assert "models--org--missing" in capsys.readouterr().err
