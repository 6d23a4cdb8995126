"""CURVE on wire 1's tcp:// sockets: who may talk to a gateway or a coordinator.

On one machine (``switchboard serve``) every socket is ``ipc://`` in a 0700 run directory, and
the file system is the access control. Across hosts (``switchboard gateway|engine|coordinator``)
the sockets are TCP and anyone who reaches a port could speak wire 1; with ``--curve-keys-dir``
every tcp:// socket runs ZeroMQ's CURVE (encrypted, the server authenticated by its public key)
and every binding side runs a ZAP handler (``zmq.auth`` in a thread of its own) that admits
only the client public keys in its allow-list directories. A client without an admitted key
never completes the handshake: nothing it sends is delivered, nothing is answered.

The keys directory (``switchboard keys generate DIR --engines N``; each ``NAME.key`` file holds a
public key, ``NAME.key_secret`` the pair)::

    gateway.key  gateway.key_secret          the gateways' pair (server to engines, client
                                             of the coordinator's PUB)
    coordinator.key  coordinator.key_secret  the coordinator's pair (server)
    engine-<r>.key  engine-<r>.key_secret    engine rank r's pair (client); an engine uses
                                             engine-<r>, else engine.key_secret
    allowed-engines/engine-<r>.key           engines a gateway (and the coordinator) admits
    allowed-gateways/gateway.key             gateways the coordinator admits

Each role reads only what it needs (the Helm chart mounts only that): a gateway its pair,
``allowed-engines/`` and ``coordinator.key``; an engine its pair, ``gateway.key`` and
``coordinator.key``; the coordinator its pair and both allow-lists. The allow-lists are read
again at every connection, so a key added or removed takes effect without a restart.

A ZAP-admitted connection carries the key's file name as its ``User-Id``: a gateway admits a
READY for rank r only from the key ``engine-<r>`` (or a key not named for a rank), so one
engine's key cannot take over another rank.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

logger = logging.getLogger(__name__)

GATEWAY = "gateway"
COORDINATOR = "coordinator"
ALLOWED_ENGINES = "allowed-engines"
ALLOWED_GATEWAYS = "allowed-gateways"
ZAP_DOMAIN = "switchboard"
_ENGINE_KEY_NAME = re.compile(r"engine-(\d+)")


class CurveKeyError(ValueError):
    """A keys directory that lacks a file a role needs, or a file that is not a key."""


@dataclass(frozen=True)
class CurveKeys:
    """What one socket needs: its own pair, and for a client the server's public key."""

    public: bytes
    secret: bytes
    server_public: bytes = b""  # b"": this socket is the server (it binds, ZAP checks clients)

    def apply(self, sock: zmq.Socket[Any]) -> None:
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.secret)
        if self.server_public:
            sock.setsockopt(zmq.CURVE_SERVERKEY, self.server_public)
        else:
            sock.setsockopt(zmq.CURVE_SERVER, 1)
            sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())


def _public(keys_dir: str, name: str) -> bytes:
    path = os.path.join(keys_dir, f"{name}.key")
    try:
        public, _ = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise CurveKeyError(f"CURVE: cannot read the public key {path}: {exc}") from None
    return public


def _pair(keys_dir: str, name: str) -> tuple[bytes, bytes]:
    path = os.path.join(keys_dir, f"{name}.key_secret")
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise CurveKeyError(f"CURVE: cannot read the key pair {path}: {exc}") from None
    if not secret:
        raise CurveKeyError(f"CURVE: {path} holds no secret key")
    return public, secret


def server_keys(keys_dir: str, name: str) -> CurveKeys:
    return CurveKeys(*_pair(keys_dir, name))


def client_keys(keys_dir: str, name: str, server_name: str) -> CurveKeys:
    public, secret = _pair(keys_dir, name)
    return CurveKeys(public, secret, _public(keys_dir, server_name))


def engine_key_name(keys_dir: str, rank: int) -> str:
    """``engine-<rank>`` when that pair is there, else ``engine``."""
    name = f"engine-{rank}"
    if os.path.exists(os.path.join(keys_dir, f"{name}.key_secret")):
        return name
    return "engine"


def rank_of_key(user_id: str) -> int | None:
    """The rank a key is named for (``engine-3`` -> 3), None for any other name."""
    match = _ENGINE_KEY_NAME.fullmatch(user_id)
    return int(match.group(1)) if match else None


class AllowList:
    """ZAP credentials provider: a client key is admitted when a ``*.key`` file in one of the
    directories holds it. Read again at each connection (keys can be rotated live)."""

    def __init__(self, directories: list[str]) -> None:
        self.directories = directories
        self._denied: set[bytes] = set()

    def names(self) -> dict[bytes, str]:
        """Admitted public key (z85) -> the name of its file (without ``.key``)."""
        found: dict[bytes, str] = {}
        for directory in self.directories:
            try:
                entries = sorted(os.listdir(directory))
            except OSError:
                continue
            for entry in entries:
                if not entry.endswith(".key"):
                    continue
                try:
                    public, _ = zmq.auth.load_certificate(os.path.join(directory, entry))
                except (OSError, ValueError):
                    continue
                found.setdefault(public, entry[: -len(".key")])
        return found

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.names():
            return True
        if key not in self._denied:  # one line per unknown key, not one per retry
            self._denied.add(key)
            logger.warning(
                "CURVE: refused a client whose public key %s is in none of %s",
                key.decode(errors="replace"),
                self.directories,
            )
        return False


class _Authenticator(ThreadAuthenticator):
    """Gives an admitted connection its key's file name as ``User-Id``."""

    allow_list: AllowList

    def curve_user_id(self, client_public_key: bytes) -> str:
        key = z85.encode(client_public_key)
        return self.allow_list.names().get(key, key.decode())


def start_authenticator(ctx: zmq.Context[Any], allow_dirs: list[str]) -> ThreadAuthenticator:
    """The ZAP handler of ``ctx`` (one per context), in its own thread: it admits the keys in
    ``allow_dirs``. Must run before a CURVE server socket of ``ctx`` accepts a connection;
    works for a ``zmq.asyncio.Context`` too (its sockets are plain ones in its own thread)."""
    auth = _Authenticator(ctx)
    auth.allow_list = AllowList(allow_dirs)
    auth.start()
    auth.configure_curve_callback(ZAP_DOMAIN, auth.allow_list)
    known = len(auth.allow_list.names())
    logger.info("CURVE on: admitting %d client key(s) from %s", known, allow_dirs)
    if not known:
        logger.warning("CURVE: the allow-list %s is empty: no client can connect", allow_dirs)
    return auth


def warn_unauthenticated(role: str) -> None:
    logger.warning(
        "%s: tcp:// wire without CURVE keys (--curve-keys-dir): unauthenticated and "
        "unencrypted, anyone reaching its ports can speak it",
        role,
    )


def generate(keys_dir: str, engines: int = 1) -> list[str]:
    """Write a keys directory (see the module docstring); returns the files written. Secret
    files are 0600, the directory 0700. Refuses to overwrite an existing pair."""
    root = Path(keys_dir)
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    names = [GATEWAY, COORDINATOR, *(f"engine-{r}" for r in range(engines))]
    for name in names:
        if (root / f"{name}.key_secret").exists():
            raise CurveKeyError(f"{root / name}.key_secret exists: not overwriting it")
    written = []
    for name in names:
        public, secret = zmq.auth.create_certificates(root, name)
        os.chmod(secret, 0o600)
        written += [public, secret]
    for sub, prefix in ((ALLOWED_ENGINES, "engine-"), (ALLOWED_GATEWAYS, GATEWAY)):
        (root / sub).mkdir(mode=0o755, exist_ok=True)
        for name in names:
            if name.startswith(prefix):
                target = root / sub / f"{name}.key"
                shutil.copyfile(root / f"{name}.key", target)
                written.append(str(target))
    return written
