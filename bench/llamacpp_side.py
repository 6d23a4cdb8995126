"""The llama.cpp half of bench/vs_vllm.py: installing llama.cpp's own server (the ``xllamacpp``
wheel, prebuilt for CPU: the C++ server with continuous batching, in a Python process) into a
venv of its own, and the command line that starts it on a GGUF file. Its OpenAI-compatible
``/v1/completions`` is driven by the same client as vLLM's (bench/vllm_http.py), one connection
per request: the server closes kept-alive connections between requests.

Not run by itself: ``python bench/vs_vllm.py --setup`` installs, ``--gguf`` measures.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from vllm_side import installed_version  # bench/vllm_side.py, beside this file

XLLAMACPP_PACKAGE = "xllamacpp==2026.10.11549"

# argv: GGUF PORT SLOTS THREADS CTX_PER_SLOT. One slot per concurrent request (its KV cache
# CTX_PER_SLOT tokens), every CPU for both prefill and decode, warmed up before it listens.
# Prints "READY <address>"; SIGTERM stops it.
LAUNCHER = """\
import signal
import sys
import threading

import xllamacpp

gguf, port, slots, threads, ctx = sys.argv[1], *map(int, sys.argv[2:6])
params = xllamacpp.CommonParams()
params.model.path = gguf
params.n_parallel = slots
params.n_ctx = ctx * slots
params.n_batch = 2048
params.cpuparams.n_threads = threads
params.cpuparams_batch.n_threads = threads
params.port = port
params.hostnames = ["127.0.0.1"]
params.warmup = True
server = xllamacpp.Server(params)
print("READY", server.listening_address, flush=True)
stop = threading.Event()
signal.signal(signal.SIGTERM, lambda *_: stop.set())
signal.signal(signal.SIGINT, lambda *_: stop.set())
stop.wait()
"""


def setup_venv(venv: Path) -> None:
    """Create ``venv`` with the xllamacpp wheel in it; skipped when already there."""
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    if installed_version(python, "xllamacpp") != XLLAMACPP_PACKAGE.split("==")[1]:
        print("+ pip install", XLLAMACPP_PACKAGE, flush=True)
        subprocess.run([str(python), "-m", "pip", "install", XLLAMACPP_PACKAGE], check=True)
    subprocess.run([str(python), "-c", "import xllamacpp; print('xllamacpp ok')"], check=True)


# a slot's KV cache: at least this many tokens, else the longest request's in steps of 256
MIN_SLOT_TOKENS = 1024


def slot_tokens(longest_request: int) -> int:
    """The tokens of one slot's KV cache for requests of up to ``longest_request`` tokens
    (prompt and output): the server refuses a request longer than its slot."""
    return max(MIN_SLOT_TOKENS, -(-longest_request // 256) * 256)


def command(venv: Path, gguf: str, port: int, slots: int, ctx_per_slot: int) -> list[str]:
    threads = len(os.sched_getaffinity(0))
    return [
        str(venv / "bin" / "python"), "-c", LAUNCHER,
        gguf, str(port), str(slots), str(threads), str(ctx_per_slot),
    ]  # fmt: skip


def environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
