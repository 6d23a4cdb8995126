"""A command-line flag, declared on the config field it sets.

A field with a flag reads ``name: Annotated[type, Flag(help=..., group=...)] = default``: its
type, its default and its help are written once, there. ``switchboard.cli.struct_flags`` builds
the server commands' parsers from these declarations and maps the parsed values back onto the
configs. A flag that sets no config field (the supervisor's restart policy, the gateway's
secrets, addresses put together from several flags) is declared the same way on a struct of its
command (``cli/serve.py``, ``cli/role_commands.py``).

A ``Flag`` rides in ``Annotated`` rather than in ``msgspec.Meta(description=...)``: a flag needs
more than a description (its section of --help, a short form, choices, the values it accepts),
and msgspec leaves metadata it does not know alone, where ``Meta`` bounds would also be enforced
on every config a child decodes (a config's 0 often means "auto" where the flag takes only 1 and
up). Standard library only: ``config`` imports it and every role imports ``config``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


class Group(enum.Enum):
    """The sections of the server commands' --help, by title."""

    CHAT_TEMPLATE = "chat template"  # serve and gateway only: listed among the plain options
    MODEL = "model"
    GATEWAY = "gateway"
    SCHEDULER = "scheduler and KV cache"
    PARALLEL = "parallelism and workers"
    FAILURES = "failures and stopping (docs/operations.md, Failure)"
    OBSERVABILITY = "observability (docs/observability.md)"
    SECURITY = "security (gRPC and HTTP fronts)"
    ENGINES_ELSEWHERE = "engines on other hosts"  # switchboard gateway
    GATEWAYS_ELSEWHERE = "gateways on other hosts"  # switchboard engine
    COORDINATOR = "coordinator"  # switchboard coordinator: listed among the plain options


@dataclass(frozen=True)
class Accepts:
    """The values a number flag takes; others are refused as the command line is parsed.
    ``says`` completes "must be ..." where the bounds alone do not say what the values mean."""

    low: float
    high: float | None = None
    low_excluded: bool = False
    says: str = ""

    def refuses(self, value: float) -> bool:
        too_low = value <= self.low if self.low_excluded else value < self.low
        return too_low or (self.high is not None and value > self.high)

    def rule(self) -> str:
        if self.says:
            return self.says
        if self.high is not None:
            return f"in {'(' if self.low_excluded else '['}{self.low}, {self.high}]"
        if self.low_excluded:
            return "positive" if self.low == 0 else f"more than {self.low}"
        return f"at least {self.low}"


AT_LEAST_0 = Accepts(0)
AT_LEAST_1 = Accepts(1)
POSITIVE = Accepts(0, low_excluded=True)
NO_CAP_OR_MORE = Accepts(0, says="at least 0 (0: no cap)")


class _FieldDefault:
    def __repr__(self) -> str:
        return "the field's default"


FIELD_DEFAULT: Any = _FieldDefault()


@dataclass(frozen=True)
class Flag:
    """How the command line sets one field. The flag's value type is the field's (``X | None``:
    X; ``bool``: a switch, with ``--no-...`` when it defaults to on; ``list[str]``: repeatable).
    A parsed value of None (a flag left at a default of None, or None from ``to_config``) leaves
    the field its own default."""

    help: str
    group: Group
    name: str = ""  # the option; "" = --the-field-name
    aliases: tuple[str, ...] = ()  # short forms, e.g. -tp
    choices: tuple[str, ...] = ()
    metavar: str | None = None
    default: Any = FIELD_DEFAULT  # the command line's default, where it differs from the field's
    required: bool = False
    accepts: Accepts | None = None
    path: bool = False  # a file or directory: the config holds it absolute
    switch: bool = False  # a flag without a value for a field that is not a bool
    many: bool = False  # list[str]: one flag takes several values (``--f a b``), and repeats
    to_config: Callable[[Any], Any] | None = None  # the parsed value -> the field's

    def option(self, field_name: str) -> str:
        return self.name or "--" + field_name.replace("_", "-")
