"""Tests of the C paged-decode kernel need a C compiler (the fixture that loads the kernel,
``paged_decode_loaded``, is in tests/conftest.py)."""

from __future__ import annotations

import shutil

import pytest

needs_compiler = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler"
)
