"""Where switchboard keeps files: its cache folder, a server's private run directory and the
ipc:// sockets in it."""

import os
import tempfile
import uuid
from pathlib import Path

# sun_path in struct sockaddr_un holds 108 bytes including the terminating NUL.
_MAX_IPC_PATH_BYTES = 107


def cache_root() -> Path:
    """The folder switchboard keeps downloads, converted checkpoints and built kernels in:
    $SWITCHBOARD_CACHE, else $XDG_CACHE_HOME/switchboard, else ~/.cache/switchboard."""
    if explicit := os.environ.get("SWITCHBOARD_CACHE"):
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "switchboard"


def new_run_dir(base: str | None = None) -> str:
    """A private directory for one server's ipc:// sockets; the launcher removes it at exit.
    Created 0700 (whatever the umask) and checked: its sockets are only as private as it."""
    base = base or os.environ.get("SWITCHBOARD_RPC_BASE_PATH") or tempfile.gettempdir()
    path = os.path.join(base, f"switchboard-{uuid.uuid4().hex[:12]}")
    os.makedirs(path, mode=0o700)  # fails if it exists: never one someone else made
    os.chmod(path, 0o700)
    from switchboard.wire.zmq_channel import check_private_dir

    check_private_dir(path)
    return path


def ipc_address(run_dir: str, name: str) -> str:
    """``ipc://`` of a socket file in ``run_dir``; ValueError when the path cannot be bound."""
    path = os.path.join(run_dir, name)
    if len(path.encode()) > _MAX_IPC_PATH_BYTES:
        raise ValueError(
            f"ipc socket path {path!r} is longer than {_MAX_IPC_PATH_BYTES} bytes; "
            "use a shorter run directory"
        )
    return f"ipc://{path}"
