"""The server commands' flags are the ones their structs' fields declare: each is on the commands
whose --help shows its section, sets its field in the configs those commands run with, and
refuses a value it does not accept as the command line is parsed."""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest

from switchboard import cli
from switchboard.cli import role_commands, serve, server_commands
from switchboard.cli.struct_flags import FieldFlag, Layout, build, field_flags
from switchboard.config import Config, CoordinatorConfig

LAYOUTS: dict[str, Layout] = {
    "serve": serve.SERVE,
    "gateway": role_commands.GATEWAY,
    "engine": role_commands.ENGINE,
    "coordinator": role_commands.COORDINATOR,
    "topology": server_commands.TOPOLOGY,
}
REQUIRED = {"engine": ["--gateway-address", "gw:1"]}
# Flags whose field value is not the flag's value as given.
FIELD_VALUES = {"--disable-log-stats": 0.0}


def _parsers() -> dict[str, argparse.ArgumentParser]:
    parser = cli.make_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def _shown(layout: Layout) -> Iterator[tuple[type[msgspec.Struct], FieldFlag]]:
    for struct in layout.structs:
        for field in field_flags(struct):
            if field.flag.group in layout.sections:
                yield struct, field


def _changed(field: FieldFlag) -> tuple[list[str], Any]:
    """Words that set ``field``'s flag to something other than its default, and the value the
    field should then hold."""
    option = field.option
    if field.flag.switch:
        return [option], FIELD_VALUES[option]
    if field.kind is bool:
        return ([f"--no-{option[2:]}"], False) if field.default else ([option], True)
    if field.flag.choices:
        choice = next(c for c in field.flag.choices if c != field.default)
        return [option, choice], choice
    if field.kind is list:
        return [option, "k1", option, "k2"], ["k1", "k2"]
    if field.kind is str:
        where = "some/where"
        return [option, where], os.path.abspath(where) if field.flag.path else where
    if issubclass(field.kind, msgspec.Struct):  # JSON, e.g. --kv-events-config
        value = field.kind()
        return [option, msgspec.json.encode(value).decode()], value
    value = {int: 7, float: 0.5}[field.kind]
    return [option, str(value)], value


def _structs(config: msgspec.Struct) -> Iterator[msgspec.Struct]:
    yield config
    for info in msgspec.structs.fields(config):
        value = getattr(config, info.name)
        if isinstance(value, msgspec.Struct):
            yield from _structs(value)


@pytest.mark.parametrize("command", list(LAYOUTS))
def test_every_declared_flag_is_on_the_commands_that_show_its_section(command: str) -> None:
    layout = LAYOUTS[command]
    options = {o for action in _parsers()[command]._actions for o in action.option_strings}
    shown = {field.option for _, field in _shown(layout)}
    declared = {field.option for struct in layout.structs for field in field_flags(struct)}
    assert shown <= options
    assert not (declared - shown) & options


@pytest.mark.parametrize("command", ["serve", "gateway", "engine", "coordinator"])
def test_every_flag_sets_its_field(command: str) -> None:
    parser = _parsers()[command]
    checked = 0
    for struct, field in _shown(LAYOUTS[command]):
        if field.field == "model":
            continue  # the resolved checkpoint directory, not the flag's words
        words, expected = _changed(field)
        if field.option == "--gateway-address":
            words, expected = REQUIRED["engine"], "gw:1"
        args = parser.parse_args([*REQUIRED.get(command, []), *words])
        if not issubclass(struct, Config):  # a flag that sets no config field
            assert getattr(build(struct, args), field.field) == expected, field.option
        elif command == "coordinator":
            config = build(CoordinatorConfig, args, input_address="", publish_address="")
            assert getattr(config, field.field) == expected, field.option
        else:
            holders = [
                s
                for config in serve.build_configs(args, "/m")
                for s in _structs(config)
                if isinstance(s, struct)
            ]
            assert holders, f"{command} {field.option}: no {struct.__name__} is built"
            assert {repr(getattr(s, field.field)) for s in holders} == {repr(expected)}, (
                f"{command} {field.option}"
            )
        checked += 1
    assert checked >= 3


def test_switch_and_cli_only_defaults_leave_the_config_as_declared() -> None:
    gateway, engine = serve.build_configs(_parsers()["serve"].parse_args([]), "/m")
    assert gateway.gateway.log_stats_interval_s == 10.0  # --disable-log-stats not given
    assert gateway.gateway.http_port == 8000  # the command line's default, not the config's
    assert gateway.resume_timeout_s == 60.0
    assert engine.parallel.api_servers == engine.parallel.data_parallel_size == 1  # DP
    assert engine.scheduler.max_num_batched_tokens == 0  # by device
    gateway, _ = serve.build_configs(_parsers()["serve"].parse_args(["--no-resume"]), "/m")
    assert gateway.resume_timeout_s == 0.0


@pytest.mark.parametrize(
    ("words", "error"),
    [
        (["serve", "--max-num-seqs", "0"], "argument --max-num-seqs: must be at least 1, not 0"),
        (["serve", "--gpu-memory-utilization", "1.5"], "must be in (0, 1], not 1.5"),
        (["serve", "--http-port", "-2"], "must be a port, 0 (a free port) or -1 (no HTTP API)"),
        (["serve", "--step-timeout-s", "0"], "argument --step-timeout-s: must be positive"),
        (["serve", "--max-inflight-requests", "-1"], "must be at least 0 (0: no cap)"),
        (["serve", "--max-num-seqs", "many"], "argument --max-num-seqs: invalid int value"),
        (["topology", "-tp", "0"], "argument -tp/--tensor-parallel-size: must be at least 1"),
        (["coordinator", "-dp", "0"], "argument -dp/--data-parallel-size: must be at least 1"),
    ],
)
def test_refused_values_are_named_before_anything_starts(
    words: list[str], error: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.make_parser().parse_args(words)
    assert exit_info.value.code == 2
    assert error in capsys.readouterr().err
