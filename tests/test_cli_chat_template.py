"""`--chat-template FILE` of `switchboard serve` / `gateway`: it reaches the gateway's model
config as an absolute path, and a missing or broken file is refused before anything starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from switchboard import cli
from switchboard.cli import serve


def _check(command: str, *flags: str, model: str = "/m"):
    parser = cli.make_parser()
    args = parser.parse_args([command, "--model", model, *flags])
    serve.check_chat_template(parser, args, model)
    return serve.build_configs(args, model)


@pytest.mark.parametrize("command", ["serve", "gateway"])
def test_chat_template_reaches_the_gateway_config(
    command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "chat.jinja").write_text("{{ messages[0].content }}")
    monkeypatch.chdir(tmp_path)
    gateway, _ = _check(command, "--chat-template", "chat.jinja", model=str(tmp_path))
    assert gateway.model.chat_template == str(tmp_path / "chat.jinja")
    gateway, _ = _check(command)
    assert gateway.model.chat_template == ""  # the checkpoint's, if it has one


def test_engine_has_no_chat_template_flag(capsys: pytest.CaptureFixture[str]) -> None:
    # Engines never see chat messages: only the gateway renders them.
    with pytest.raises(SystemExit):
        cli.make_parser().parse_args(
            ["engine", "--gateway-address", "gw:1", "--chat-template", "x.jinja"]
        )
    assert "unrecognized arguments: --chat-template" in capsys.readouterr().err


def test_missing_or_broken_files_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        _check("serve", "--chat-template", str(tmp_path / "nope.jinja"))
    assert "no such file" in capsys.readouterr().err
    (tmp_path / "bad.jinja").write_text("{% if %}")
    with pytest.raises(SystemExit):
        _check("serve", "--chat-template", str(tmp_path / "bad.jinja"), model=str(tmp_path))
    assert "syntax error, line 1" in capsys.readouterr().err
