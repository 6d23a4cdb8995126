"""Fixtures shared across test folders."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture
def paged_decode_loaded(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The C paged-decode kernel loaded fresh for the test (and unloaded after)."""
    from switchboard.kernels import paged_decode

    monkeypatch.delenv("SWITCHBOARD_CPU_ATTENTION", raising=False)
    paged_decode.unload()
    assert paged_decode.load(), paged_decode.status()
    yield
    paged_decode.unload()
