"""The engine's own overhead per step: one ``schedule()`` + ``update_from_output()`` with 64, 256
and 1,024 running decoding requests, no model, prefix caching on and off.

    python bench/scheduler.py [--steps 200] [--block-size 16] [--prompt-len 64]

The runner output of each step (one token per request, as a worker would answer) is built
outside the timed region. The median over the measured steps is printed, in microseconds; the
steps include the 1 in ``block_size`` where every request needs a new block (and, with caching
on, hashes and registers the block it just filled).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

from switchboard.config import CacheConfig, SchedulerConfig
from switchboard.engine.request import Request
from switchboard.engine.scheduler import Scheduler
from switchboard.wire.engine_msgs import EngineCoreRequest, SamplingParams
from switchboard.wire.step_msgs import ModelRunnerOutput, SchedulerOutput

SIZES = (64, 256, 1024)


def fake_runner_output(out: SchedulerOutput, step: int) -> ModelRunnerOutput:
    ids = list(out.num_scheduled_tokens)
    return ModelRunnerOutput(
        out.step_id, ids, [[(step * 7 + i) % 30000 + 100] for i in range(len(ids))]
    )


def build(num_requests: int, args: argparse.Namespace, caching: bool) -> Scheduler:
    max_model_len = args.prompt_len + args.warmup + args.steps + 8
    blocks_per_request = -(-max_model_len // args.block_size)
    sched = Scheduler(
        SchedulerConfig(
            max_num_seqs=num_requests,
            max_num_batched_tokens=max(2048, num_requests * args.prompt_len),
        ),
        CacheConfig(block_size=args.block_size, enable_prefix_caching=caching),
        num_blocks=num_requests * blocks_per_request + 1,
        max_model_len=max_model_len,
    )
    params = SamplingParams(max_tokens=10**9, ignore_eos=True)
    for i in range(num_requests):
        prompt = [(i * 131 + j) % 30000 + 100 for j in range(args.prompt_len)]
        engine_request = EngineCoreRequest(f"req-{i}", prompt, sampling_params=params)
        sched.add_request(
            Request.from_engine_core_request(
                engine_request, args.block_size, time.monotonic_ns(), hash_blocks=caching
            )
        )
    return sched


def measure(
    num_requests: int, args: argparse.Namespace, caching: bool
) -> tuple[float, float, float]:
    """Median schedule µs, median update µs and mean step µs over the measured steps."""
    sched = build(num_requests, args, caching)
    schedule_us: list[float] = []
    update_us: list[float] = []
    gc.collect()
    gc.freeze()  # like the engine's freeze_gc_heap(): the set-up is permanent
    for step in range(args.warmup + args.steps):
        t0 = time.perf_counter_ns()
        out = sched.schedule()
        t1 = time.perf_counter_ns()
        runner_output = fake_runner_output(out, step)
        t2 = time.perf_counter_ns()
        sched.update_from_output(out, runner_output)
        t3 = time.perf_counter_ns()
        if step >= args.warmup:
            assert len(out.num_scheduled_tokens) == num_requests
            schedule_us.append((t1 - t0) / 1e3)
            update_us.append((t3 - t2) / 1e3)
    gc.unfreeze()
    steps_us = [a + b for a, b in zip(schedule_us, update_us, strict=True)]
    return statistics.median(schedule_us), statistics.median(update_us), statistics.mean(steps_us)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    args = parser.parse_args()

    rows = []
    for n in SIZES:
        on = measure(n, args, caching=True)
        off = measure(n, args, caching=False)
        rows.append((n, on, off))

    print(
        f"schedule()+update_from_output(), decoding requests, median of {args.steps} steps, "
        f"block size {args.block_size}, prompt {args.prompt_len} tokens"
    )
    print("medians, except 'mean': the mean step includes the steps that allocate a block")
    header = (
        f"{'running':>7} | {'schedule µs':>11} | {'update µs':>9} | {'step µs':>7} | "
        f"{'µs/req':>6} | {'mean µs':>7} | {'no-cache step':>13} | {'no-cache mean':>13} | "
        f"{'on/off':>6}"
    )
    print(header)
    print("-" * len(header))
    for n, (sched_on, upd_on, mean_on), (sched_off, upd_off, mean_off) in rows:
        step_on, step_off = sched_on + upd_on, sched_off + upd_off
        print(
            f"{n:>7} | {sched_on:>11.0f} | {upd_on:>9.0f} | {step_on:>7.0f} | "
            f"{step_on / n:>6.2f} | {mean_on:>7.0f} | {step_off:>13.0f} | {mean_off:>13.0f} | "
            f"{mean_on / mean_off:>6.2f}"
        )
    print("on/off = mean step with prefix caching on / off")


if __name__ == "__main__":
    main()
