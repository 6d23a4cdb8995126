#!/usr/bin/env bash
# The quantized matmul kernels of two revisions in alternating processes, on the default model:
#
#   bench/kernels_ab.sh BASE_REV [PAIRS]     # e.g. bench/kernels_ab.sh HEAD~2 3
#
# Per pair, BASE_REV's tree (a `git archive` under a temporary folder, imported through
# PYTHONPATH; its kernels build into their own cache entry) then this working tree, each
# running bench/quant_decode.py twice at one row: a pass over every matrix on one thread timed
# by its CPU time (the kernels alone, little moved by other load), then whole decode steps on
# the torch threads (wall time: what a served token costs); and this tree's
# bench/verify_step.py on one thread by its CPU time: steps of 1, 2, 5 and 9 rows after
# VERIFY_CONTEXT (default 300) tokens, the cost of speculative decoding's verify rows. The lines
# alternate, so load on the machine falls on both alike; compare medians and fastest per column.
set -eu -o pipefail

BASE="${1:?usage: bench/kernels_ab.sh BASE_REV [PAIRS]}"
PAIRS="${2:-2}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
TREE="$(mktemp -d)"
trap 'rm -rf "$TREE"' EXIT
git -C "$ROOT" archive "$BASE" services bench | tar -x -C "$TREE"

run() { # LABEL SERVICES_DIR BENCH_DIR
    local load
    load="$(cut -d' ' -f1 /proc/loadavg)"
    echo "$1 (load $load) matmuls, 1 thread, CPU ms: $(PYTHONPATH="$2" "$PYTHON" \
        "$3/quant_decode.py" --batch 1 --kernels vnni512 avx2 --rounds 3 --steps 20 \
        --matmuls --threads 1 --cpu-time | tail -1)"
    echo "$1 (load $load) decode steps, wall ms:    $(PYTHONPATH="$2" "$PYTHON" \
        "$3/quant_decode.py" --batch 1 --kernels vnni512 --rounds 5 --steps 20 | tail -1)"
    echo "$1 (load $load) verify steps, 1 thread, CPU: $(PYTHONPATH="$2" "$PYTHON" \
        "$ROOT/bench/verify_step.py" --threads 1 --cpu-time --context "${VERIFY_CONTEXT:-300}" \
        --rows 1 2 5 9 --steps 20 | tail -1)"
}

echo "columns: batch | per kernel: median ms (ratio to the first) fastest ms"
for _ in $(seq "$PAIRS"); do
    run "base $BASE" "$TREE/services" "$TREE/bench"
    run "this tree " "$ROOT/services" "$ROOT/bench"
done
