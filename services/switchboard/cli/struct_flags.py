"""Parsers built from the flags that struct fields declare (``switchboard.common.flags``), and the
structs built back from what was parsed: nothing here names a flag."""

from __future__ import annotations

import argparse
import functools
import os
import types
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar, get_args, get_origin

import msgspec

from switchboard.common.flags import FIELD_DEFAULT, Accepts, Flag, Group

S = TypeVar("S", bound=msgspec.Struct)


@dataclass(frozen=True)
class FieldFlag:
    """One field's flag, with what the field says about its values."""

    field: str
    kind: type  # of the flag's value: int, float, str, bool or list (of str)
    field_default: Any
    flag: Flag

    @property
    def option(self) -> str:
        return self.flag.option(self.field)

    @property
    def dest(self) -> str:
        return self.option.lstrip("-").replace("-", "_")

    @property
    def default(self) -> Any:
        """The command line's default."""
        if self.flag.switch:
            return False
        return self.field_default if self.flag.default is FIELD_DEFAULT else self.flag.default


@functools.cache
def field_flags(struct: type[msgspec.Struct]) -> tuple[FieldFlag, ...]:
    """The flags ``struct``'s own fields declare, in field order."""
    found = []
    for info in msgspec.structs.fields(struct):
        if get_origin(info.type) is not Annotated:
            continue
        annotation, *metadata = get_args(info.type)
        flags = [item for item in metadata if isinstance(item, Flag)]
        if not flags:
            continue
        if info.default_factory is not msgspec.NODEFAULT:
            default = info.default_factory()
        else:
            default = None if info.default is msgspec.NODEFAULT else info.default
        found.append(FieldFlag(info.name, _value_kind(annotation), default, flags[0]))
    return tuple(found)


def _value_kind(annotation: Any) -> type:
    """``int | None`` -> int, ``list[str]`` -> list."""
    if isinstance(annotation, types.UnionType):
        (kind,) = [arg for arg in get_args(annotation) if arg is not type(None)]
        return _value_kind(kind)
    origin = get_origin(annotation)
    return origin if isinstance(origin, type) else annotation


@dataclass(frozen=True)
class Layout:
    """A command's flags: the structs that declare them, and the --help sections that show
    them, in order. Within a section the flags follow ``structs``' order, then field order; a
    section in ``plain`` is shown among the command's own options, without a title."""

    structs: tuple[type[msgspec.Struct], ...]
    sections: tuple[Group, ...]
    plain: frozenset[Group] = frozenset()


def add_flags(parser: argparse.ArgumentParser, layout: Layout) -> None:
    for group in layout.sections:
        section = parser if group in layout.plain else parser.add_argument_group(group.value)
        for struct in layout.structs:
            for field in field_flags(struct):
                if field.flag.group is group:
                    _add_argument(section, field)


def _add_argument(section: argparse._ActionsContainer, field: FieldFlag) -> None:
    flag = field.flag
    kwargs: dict[str, Any] = {"help": flag.help}
    if flag.metavar is not None:
        kwargs["metavar"] = flag.metavar
    if flag.required:
        kwargs["required"] = True
    else:
        kwargs["default"] = field.default
    if flag.switch or (field.kind is bool and not field.default):
        kwargs["action"] = "store_true"
    elif field.kind is bool:
        kwargs["action"] = argparse.BooleanOptionalAction  # on by default: --no-... turns it off
    elif field.kind is list and flag.many:
        kwargs["action"], kwargs["nargs"] = "extend", "+"
    elif field.kind is list:
        kwargs["action"] = "append"
    elif isinstance(field.kind, type) and issubclass(field.kind, msgspec.Struct):
        kwargs["type"] = _JsonStruct(field.kind)
    elif field.kind is not str:
        kwargs["type"] = field.kind if flag.accepts is None else _Within(field.kind, flag.accepts)
    if flag.choices:
        kwargs["choices"] = list(flag.choices)
    section.add_argument(*flag.aliases, field.option, **kwargs)


class _Within:
    """An argparse ``type`` that converts and refuses what ``accepts`` does not take, so the
    error names the flag before anything starts."""

    def __init__(self, kind: type, accepts: Accepts) -> None:
        self.kind = kind
        self.accepts = accepts
        self.__name__ = kind.__name__  # argparse's "invalid int value: 'x'"

    def __repr__(self) -> str:
        return f"{self.__name__} ({self.accepts.rule()})"

    def __call__(self, text: str) -> Any:
        value = self.kind(text)
        if self.accepts.refuses(value):
            raise argparse.ArgumentTypeError(f"must be {self.accepts.rule()}, not {text}")
        return value


class _JsonStruct:
    """An argparse ``type`` for a struct-valued flag: its JSON, decoded and checked, so that a
    bad key or value is refused by name before anything starts."""

    def __init__(self, kind: type[msgspec.Struct]) -> None:
        self.kind = kind
        self.__name__ = "JSON"

    def __call__(self, text: str) -> Any:
        try:
            return msgspec.json.decode(text, type=self.kind)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None


def build(struct: type[S], args: argparse.Namespace, **given: Any) -> S:
    """``struct`` with ``given`` as given, every other field whose flag the command has from
    ``args`` (a value of None leaves the field its default), and every nested struct built the
    same way."""
    flags = {field.field: field for field in field_flags(struct)}
    values: dict[str, Any] = {}
    for info in msgspec.structs.fields(struct):
        if info.name in given:
            continue
        field = flags.get(info.name)
        if field is not None:
            if hasattr(args, field.dest):
                value = _config_value(field.flag, getattr(args, field.dest))
                if value is not None:
                    values[info.name] = value
        elif isinstance(info.type, type) and issubclass(info.type, msgspec.Struct):
            values[info.name] = build(info.type, args)
    return struct(**values, **given)


def _config_value(flag: Flag, value: Any) -> Any:
    if flag.to_config is not None:
        value = flag.to_config(value)
    if flag.path and value:
        value = os.path.abspath(value)
    return value
