#!/usr/bin/env bash
# Creates .venv (if missing) and installs switchboard into it, with the test extras if asked.
# Usage: scripts/bootstrap.sh [test]
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
extras=""
[ "${1:-}" = "test" ] && extras="[test]"
# torch is pinned to 2.13.0 in pyproject.toml: that version is a CPU wheel; an unpinned torch
# would pull a multi-GB CUDA build.
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".${extras}" 2>&1 \
  | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import switchboard, torch; print('switchboard', switchboard.__version__, '| torch', torch.__version__)"
