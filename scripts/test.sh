#!/usr/bin/env bash
# Installs switchboard with its test extras into .venv, then runs the linters and the whole
# test suite (slow multi-process tests included). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh test
.venv/bin/ruff check .
.venv/bin/ruff format --check .
exec .venv/bin/python -m pytest -ra "$@"
