"""Fixtures of the kernel tests."""

from __future__ import annotations

import pytest

from switchboard.kernels import library


@pytest.fixture
def without_compiler(tmp_path, monkeypatch):
    """A process whose kernel library is not loaded yet and whose compiler does not exist: the
    next load fails as on a slim image. The loaded library is back afterwards."""
    monkeypatch.setenv("SWITCHBOARD_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setattr(library, "_library", None)
    monkeypatch.setattr(library, "_failure", None)
    monkeypatch.setattr(library, "_pool_status", library.pool_status())
