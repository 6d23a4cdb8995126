#!/usr/bin/env bash
# Installs switchboard with its test extras into .venv, then runs the linters, the type checker
# and the whole test suite (slow multi-process tests included). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh test
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy  # configured in pyproject.toml: what it checks and how strictly
exec .venv/bin/python -m pytest -ra "$@"
