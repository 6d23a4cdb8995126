"""ipc:// sockets are only as private as their directory: the run directory is made 0700
whatever the umask, and a directory others may enter is refused by whoever binds in it."""

from __future__ import annotations

import os
import stat

import pytest

from switchboard.config import new_run_dir
from switchboard.wire.zmq_channel import check_private_dir


def test_the_run_dir_is_0700_whatever_the_umask(tmp_path) -> None:
    old = os.umask(0)
    try:
        path = new_run_dir(str(tmp_path))
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o700
    check_private_dir(path)


@pytest.mark.parametrize("mode", [0o755, 0o770, 0o701])
def test_a_dir_others_may_enter_is_refused(tmp_path, mode: int) -> None:
    path = tmp_path / "run"
    path.mkdir()
    os.chmod(path, mode)
    with pytest.raises(ValueError, match="0700"):
        check_private_dir(str(path))


def test_a_symlink_is_refused(tmp_path) -> None:
    target = tmp_path / "real"
    target.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(target)
    with pytest.raises(ValueError, match="not a directory"):
        check_private_dir(str(link))
