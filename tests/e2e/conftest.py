"""Fixtures shared by the end-to-end tests."""

from __future__ import annotations

import pytest

from tests.tiny_checkpoint import tiny_llama_dir


@pytest.fixture(scope="session")
def tiny_model() -> str:
    """The default tiny Llama checkpoint (``tests/tiny_checkpoint.py``), built once per session.
    Servers and references only read it."""
    return tiny_llama_dir()
