"""Every option of every `switchboard` command says what it does and what it defaults to, so
`switchboard <command> --help` is enough to run one."""

from __future__ import annotations

import argparse

import pytest

from switchboard import cli

COMMANDS = [
    "serve",
    "gateway",
    "engine",
    "coordinator",
    "keys",
    "generate",
    "chat",
    "topology",
    "ps",
]


def _commands() -> dict[str, argparse.ArgumentParser]:
    parser = cli.make_parser()
    (subparsers,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return {"switchboard": parser, **subparsers.choices}


def _options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [
        action
        for action in parser._actions
        if not isinstance(action, (argparse._HelpAction, argparse._SubParsersAction))
    ]


def test_every_command_is_checked() -> None:
    assert set(_commands()) == {"switchboard", *COMMANDS}


@pytest.mark.parametrize("name", ["switchboard", *COMMANDS])
def test_every_option_has_help_that_shows_its_default(name: str) -> None:
    parser = _commands()[name]
    assert parser.formatter_class is cli.HelpFormatter
    formatter = parser._get_formatter()
    assert _options(parser), name
    for action in _options(parser):
        flag = "/".join(action.option_strings) or action.dest
        assert action.help and action.help.strip(), f"{name} {flag}: no help text"
        shown = formatter._expand_help(action)  # the text --help prints, defaults filled in
        if action.option_strings and not action.required:
            assert "default" in shown, f"{name} {flag}: help does not show the default"
        # A bare None or "" says nothing: the text must say what unset means.
        assert "(default: None)" not in shown and "(default: )" not in shown, f"{name} {flag}"


@pytest.mark.parametrize("name", COMMANDS)
def test_help_prints(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.make_parser().parse_args([name, "--help"])
    assert exit_info.value.code == 0
    assert "default" in capsys.readouterr().out
