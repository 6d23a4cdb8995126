"""One worker's decode step, in process: the forward pass plus sampling, without the wires.

    python bench/worker_step.py MODEL_DIR [--batch 1 8 32] [--context 96] [--steps 50]
                                [--threads N] [--paths torch onednn packed] [--profile]
                                [--dtype bfloat16] [--prompt-beside 32]

Builds a :class:`ModelRunner` on ``MODEL_DIR``, prefills ``--batch`` requests of ``--context``
random tokens, then times greedy decode steps (what ``execute_model`` does for a running
batch). Prints the median step time per batch size for three matmul paths side by side
(``kernels/gemm.py``): torch's ``F.linear`` on dense weights, oneDNN on dense weights, and oneDNN
on weights packed at load (what the worker serves with; ``--paths packed`` times it alone);
``--profile`` adds torch's operator table of the packed path for the last batch size. The
weights are not quantized (``quantization="none"``; ``bench/quant_decode.py`` compares quantized
ones); ``--dtype`` as the server's (default float32). ``--prompt-beside N``: every timed step
also prefills a new N-token prompt, as most steps of a closed loop of many streams do.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from switchboard.config import ModelConfig
from switchboard.kernels import gemm
from switchboard.wire.engine_msgs import SamplingParams
from switchboard.wire.step_msgs import CachedRequest, NewRequest, SchedulerOutput
from switchboard.worker.model_runner import ModelRunner

CPU = torch.device("cpu")

BLOCK_SIZE = 16
PATHS = ("torch", "onednn", "packed")  # the matmul paths timed side by side


def prompt_blocks(tokens: int) -> int:
    return -(-tokens // BLOCK_SIZE)


def decode_steps(
    runner: ModelRunner,
    batch: int,
    context: int,
    steps: int,
    profiler: torch.profiler.profile | None = None,
    prompt_beside: int = 0,
) -> list[float]:
    """Prefill ``batch`` requests, then time ``steps`` decode steps (seconds each); a
    ``profiler`` given runs over the decode steps only. ``prompt_beside``: each timed step also
    prefills a new request's prompt of that many tokens (released after the step), as a step of
    a closed loop of many streams often does."""
    rng = random.Random(0)
    vocab = runner.summary().vocab_size
    blocks_per_request = -(-(context + steps + 1) // BLOCK_SIZE)
    step_id = 0
    new = []
    for i in range(batch):
        first = i * blocks_per_request
        new.append(
            NewRequest(
                request_id=f"r{i}",
                prompt_token_ids=[rng.randrange(vocab) for _ in range(context)],
                sampling_params=SamplingParams(temperature=0.0, max_tokens=steps + 1),
                block_ids=list(range(first, first + blocks_per_request)),
                num_computed_tokens=0,
            )
        )
    beside_blocks = list(
        range(batch * blocks_per_request, batch * blocks_per_request + prompt_blocks(prompt_beside))
    )
    runner.execute_model(
        SchedulerOutput(
            step_id=step_id,
            new_requests=new,
            num_scheduled_tokens={r.request_id: context for r in new},
            total_num_scheduled_tokens=batch * context,
        )
    )
    times = []
    if profiler is not None:
        profiler.start()
    for k in range(steps):
        step_id += 1
        computed = context + k
        scheduled = {r.request_id: 1 for r in new}
        prompts = []
        if prompt_beside:
            prompts = [
                NewRequest(
                    request_id=f"p{k}",
                    prompt_token_ids=[rng.randrange(vocab) for _ in range(prompt_beside)],
                    sampling_params=SamplingParams(temperature=0.0, max_tokens=1),
                    block_ids=beside_blocks,
                    num_computed_tokens=0,
                )
            ]
            scheduled[f"p{k}"] = prompt_beside
        step = SchedulerOutput(
            step_id=step_id,
            new_requests=prompts,
            cached_requests=[CachedRequest(r.request_id, [], computed) for r in new],
            num_scheduled_tokens=scheduled,
            total_num_scheduled_tokens=sum(scheduled.values()),
        )
        started = time.perf_counter()
        runner.execute_model(step)
        times.append(time.perf_counter() - started)
        if prompts:
            step_id += 1
            runner.execute_model(SchedulerOutput(step_id=step_id, finished_request_ids=[f"p{k}"]))
    if profiler is not None:
        profiler.stop()
    runner.execute_model(
        SchedulerOutput(step_id=step_id + 1, finished_request_ids=[r.request_id for r in new])
    )
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--context", type=int, default=96)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS))
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument(
        "--prompt-beside",
        type=int,
        default=0,
        metavar="TOKENS",
        help="each timed step also prefills a new prompt of TOKENS tokens",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    blocks = max(args.batch) * -(-(args.context + args.steps + 1) // BLOCK_SIZE)
    blocks += prompt_blocks(args.prompt_beside)
    kernels: dict[str, tuple[ModelRunner, bool]] = {}
    if {"torch", "onednn"} & set(args.paths):
        gemm.use_onednn(False)  # loaded with oneDNN off, the weights stay dense
        dense = ModelRunner(
            ModelConfig(model=args.model, quantization="none", dtype=args.dtype), CPU
        )
        dense.load_model()
        dense.initialize_kv_cache(blocks, BLOCK_SIZE)
        kernels |= {"torch": (dense, False), "onednn": (dense, True)}
    gemm.use_onednn(True)
    packed = ModelRunner(ModelConfig(model=args.model, quantization="none", dtype=args.dtype), CPU)
    packed.load_model()
    packed.initialize_kv_cache(blocks, BLOCK_SIZE)
    kernels["packed"] = (packed, True)
    kernels = {path: kernels[path] for path in PATHS if path in args.paths}

    print(
        f"{args.model}: {args.threads} torch threads, context {args.context}, "
        f"attention backend {packed.attention_backend.name}"
    )
    heads = {"torch": "torch GEMM ms", "onednn": "oneDNN ms", "packed": "packed ms"}
    ratio = "torch" in kernels and "packed" in kernels
    print(
        f"{'batch':>5} | "
        + " | ".join(f"{heads[path]:>13}" for path in kernels)
        + (f" | {'torch/packed':>12}" if ratio else "")
    )
    for batch in args.batch:
        ms = {}
        for kernel, (runner, onednn) in kernels.items():
            gemm.use_onednn(onednn)
            decode_steps(runner, batch, args.context, 5, None, args.prompt_beside)  # warm-up
            steps = decode_steps(runner, batch, args.context, args.steps, None, args.prompt_beside)
            ms[kernel] = statistics.median(steps) * 1e3
        print(
            f"{batch:>5} | "
            + " | ".join(f"{ms[path]:>13.2f}" for path in kernels)
            + (f" | {ms['torch'] / ms['packed']:>12.2f}" if ratio else "")
        )
    if args.profile:
        prof = torch.profiler.profile()
        decode_steps(packed, args.batch[-1], args.context, 20, prof)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
