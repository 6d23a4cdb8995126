"""What every config is: a frozen msgspec struct, handed to a child process as JSON."""

from typing import TypeVar

import msgspec

from switchboard.common.flags import Flag, Group


class Config(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Base of every config. Subclasses inherit these options; each restates ``frozen=True``
    because type checkers do not see a msgspec option inherited."""


C = TypeVar("C", bound=Config)


def encode_config(config: Config) -> str:
    return msgspec.json.encode(config).decode()


def decode_config(text: str | bytes, kind: type[C]) -> C:
    return msgspec.json.decode(text, type=kind)


def curve_keys_flag(group: Group) -> Flag:
    """``--curve-keys-dir`` of every role: CURVE on every tcp:// socket, the keys directory
    (wire/curve.py); "" = plain TCP."""
    return Flag(
        "CURVE on every tcp:// ZeroMQ socket, keys from this directory (`switchboard keys "
        "generate DIR`; docs/architecture.md, Trust) (default: none: plain TCP, unauthenticated)",
        group,
        metavar="DIR",
        path=True,
    )
