#!/usr/bin/env bash
# The bfloat16 AMX matmul of two revisions in one process, alternated call set by call set
# (bench/amx_matmul_ab.c says what is measured); on a CPU with AMX-BF16 only:
#
#   bench/amx_matmul_ab.sh BASE_REV [MODEL ROWS SETS ROUNDS]...
#   bench/amx_matmul_ab.sh HEAD~1 llama-100m 64 14 41 llama-100m 128 14 41 head 64 2 11
#   bench/amx_matmul_ab.sh HEAD tiles      # what the tiles give a core, no matmul
#
# Without cases: llama-100m's layer matrices at 16, 32, 64 and 128 rows with its whole model's
# worth of weights cycled (14 sets, read from memory), 41 rounds each. Threads: OMP_NUM_THREADS
# (default 2, as the worker on a 2-core machine). Each line's ratio is this tree's time over
# the base's.
set -eu -o pipefail

BASE="${1:?usage: bench/amx_matmul_ab.sh BASE_REV [MODEL ROWS SETS ROUNDS]...}"
shift
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CSRC=services/switchboard/kernels/csrc
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
git -C "$ROOT" archive "$BASE" "$CSRC" | tar -x -C "$WORK"
CC="${CC:-cc}"
FLAGS=(-O3 -march=native -fno-trapping-math -fopenmp)
"$CC" "${FLAGS[@]}" -I "$WORK/$CSRC" -Dbf16_amx_linear=lin_a -Dbf16_amx_ready=ready_a \
    -c "$WORK/$CSRC/bf16_amx.c" -o "$WORK/base.o"
"$CC" "${FLAGS[@]}" -I "$ROOT/$CSRC" -Dbf16_amx_linear=lin_b -Dbf16_amx_ready=ready_b \
    -c "$ROOT/$CSRC/bf16_amx.c" -o "$WORK/tree.o"
"$CC" "${FLAGS[@]}" -I "$ROOT/$CSRC" "$ROOT/bench/amx_matmul_ab.c" "$ROOT/$CSRC/work_pool.c" \
    "$WORK/base.o" "$WORK/tree.o" -o "$WORK/amx_matmul_ab"

if [ $# -eq 0 ]; then
    set -- llama-100m 16 14 41 llama-100m 32 14 41 llama-100m 64 14 41 llama-100m 128 14 41
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
echo "base $BASE against this tree, $OMP_NUM_THREADS threads ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //'))"
if [ "${1:-}" = tiles ]; then
    "$WORK/amx_matmul_ab" tiles
    exit 0
fi
while [ $# -ge 4 ]; do
    "$WORK/amx_matmul_ab" "$1" "$2" "$3" "$4"
    shift 4
done
