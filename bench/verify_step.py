"""A speculative verify step's cost against its rows, in process (no wires): one request after
``--context`` tokens, a decode step of 1 row against verify steps of ``1 + k`` rows (its token
and ``k`` proposed ones), the variants alternated step by step.

    .venv/bin/python bench/verify_step.py                       # the default model
    .venv/bin/python bench/verify_step.py --context 20 400 --rows 1 5 9 --steps 30 --profile
    .venv/bin/python bench/verify_step.py --threads 1 --cpu-time    # on a machine others share

Prints the median step time per row count and its ratio to one row (``execute_model``: forward,
LM head, sampling). The proposals are random tokens (rejected: a rejected row costs what an
accepted one does), so each step adds one token to the context: ``--steps`` times the row counts
tokens over the run. ``--cpu-time`` times the process's CPU time instead of the wall clock: with
``--threads 1`` a measure of the work that others' load on a shared machine hardly moves.
``--profile`` adds torch's operator table of the largest row count. ``--phases`` splits each
row count's median step into its parts, each timed around its call: the one-call decode stack
(the decoder layers; in a step of one decode row also the final norm and the LM head, which the
stack then computes), the LM head, the step's inputs and the sampling; what is left is the rest
of ``execute_model`` (Python, the embedding, the final norm).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch

import switchboard.worker.model_runner as model_runner_module
from switchboard.checkpoint import resolve_model
from switchboard.config import ModelConfig
from switchboard.kernels import decode_stack
from switchboard.wire.engine_msgs import SamplingParams
from switchboard.wire.step_msgs import CachedRequest, NewRequest, SchedulerOutput
from switchboard.worker.model_runner import ModelRunner

BLOCK_SIZE = 16
REQUEST = "r0"


class VerifySteps:
    """One request prefilled with ``context`` random tokens; steps of any row count after it."""

    def __init__(self, runner: ModelRunner, context: int, max_tokens: int) -> None:
        self.runner, self.step_id = runner, 0
        rng = random.Random(0)
        self.vocab = runner.summary().vocab_size
        self.blocks = -(-(context + max_tokens) // BLOCK_SIZE)
        blocks = self.blocks
        self.rng = rng
        prefill = runner.execute_model(
            SchedulerOutput(
                step_id=self._next_id(),
                new_requests=[
                    NewRequest(
                        request_id=REQUEST,
                        prompt_token_ids=[rng.randrange(self.vocab) for _ in range(context)],
                        sampling_params=SamplingParams(temperature=0.0, max_tokens=1 << 20),
                        block_ids=list(range(blocks)),
                        num_computed_tokens=0,
                    )
                ],
                num_scheduled_tokens={REQUEST: context},
                total_num_scheduled_tokens=context,
            )
        )
        self.num_tokens = context + len(prefill.sampled_token_ids[0])

    def _next_id(self) -> int:
        self.step_id += 1
        return self.step_id

    def step(self, rows: int, clock: Callable[[], float] = time.perf_counter) -> float:
        """Seconds of one step of ``rows`` rows (the request's token and ``rows - 1``
        proposals, random: rejected, as a rejected step costs what an accepted one does)."""
        proposals = [self.rng.randrange(self.vocab) for _ in range(rows - 1)]
        if self.num_tokens + rows > self.blocks * BLOCK_SIZE:
            raise ValueError("more steps than the request's blocks hold")
        step = SchedulerOutput(
            step_id=self._next_id(),
            cached_requests=[CachedRequest(REQUEST, [], self.num_tokens - 1)],
            num_scheduled_tokens={REQUEST: rows},
            total_num_scheduled_tokens=rows,
            scheduled_spec_decode_tokens={REQUEST: proposals} if proposals else {},
        )
        started = clock()
        output = self.runner.execute_model(step)
        seconds = clock() - started
        self.num_tokens += len(output.sampled_token_ids[0])
        return seconds


class Phases:
    """Seconds spent in each timed call since the last ``take()``, on ``clock`` (the steps')."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.seconds: dict[str, float] = {}

    def take(self) -> dict[str, float]:
        taken, self.seconds = self.seconds, {}
        return taken

    @contextmanager
    def timing(self, owner: Any, attribute: str, label: str) -> Iterator[None]:
        """``owner.attribute`` (a function or bound method) timed while inside."""
        original = getattr(owner, attribute)

        def timed(*args: Any, **kwargs: Any) -> Any:
            started = self.clock()
            try:
                return original(*args, **kwargs)
            finally:
                spent = self.clock() - started
                self.seconds[label] = self.seconds.get(label, 0.0) + spent

        setattr(owner, attribute, timed)
        try:
            yield
        finally:
            setattr(owner, attribute, original)


PHASES = ("decode stack", "LM head", "step inputs", "sampling")


@contextmanager
def phases_of(runner: ModelRunner, phases: Phases) -> Iterator[None]:
    """The parts of ``runner``'s steps timed into ``phases`` while inside."""
    assert runner.model is not None
    with (
        phases.timing(decode_stack, "_call", PHASES[0]),
        phases.timing(runner.model, "compute_logits", PHASES[1]),
        phases.timing(model_runner_module, "build_step_inputs", PHASES[2]),
        phases.timing(runner, "_sample_step", PHASES[3]),
    ):
        yield


def print_phases(rows: int, steps: list[float], parts: list[dict[str, float]]) -> None:
    step = statistics.median(steps) * 1e3
    cells = []
    for label in PHASES:
        ms = statistics.median(part.get(label, 0.0) for part in parts) * 1e3
        cells.append(f"{label} {ms:.2f}")
    print(f"  {rows} rows: step {step:.2f} ms = " + ", ".join(cells) + " ms + the rest")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="default: the built-in default model")
    parser.add_argument("--context", type=int, nargs="+", default=[20, 400])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 5, 9])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--cpu-time", action="store_true", help="time CPU, not the wall clock")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--phases", action="store_true", help="each step's parts, timed")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.cpu_time else time.perf_counter
    runner = ModelRunner(ModelConfig(model=resolve_model(args.model)), torch.device("cpu"))
    runner.load_model()
    # a step adds one token, or more where random proposals happen to be accepted
    max_tokens = ((args.steps + 3) * len(args.rows) + 10) * max(args.rows)
    blocks = -(-(max(args.context) + max_tokens) // BLOCK_SIZE)
    runner.initialize_kv_cache(blocks + 1, BLOCK_SIZE)
    print(f"attention backend {runner.attention_backend.name}, {torch.get_num_threads()} threads")
    for context in args.context:
        steps = VerifySteps(runner, context, max_tokens)
        times: dict[int, list[float]] = {rows: [] for rows in args.rows}
        for _ in range(3):  # warm-up
            for rows in args.rows:
                steps.step(rows)
        phases = Phases(clock)
        parts: dict[int, list[dict[str, float]]] = {rows: [] for rows in args.rows}
        with phases_of(runner, phases) if args.phases else nullcontext():
            for _ in range(args.steps):
                for rows in args.rows:
                    phases.take()
                    times[rows].append(steps.step(rows, clock))
                    parts[rows].append(phases.take())
        one = statistics.median(times[args.rows[0]])
        cells = []
        for rows in args.rows:
            ms = statistics.median(times[rows]) * 1e3
            cells.append(f"{rows} rows {ms:.2f} ms ({ms / one / 1e3:.2f}x)")
        print(f"context {context}: " + ", ".join(cells))
        if args.phases:
            for rows in args.rows:
                print_phases(rows, times[rows], parts[rows])
        if args.profile:
            with torch.profiler.profile() as prof:
                for _ in range(10):
                    steps.step(max(args.rows))
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
        runner.execute_model(
            SchedulerOutput(step_id=steps._next_id(), finished_request_ids=[REQUEST])
        )


if __name__ == "__main__":
    main()
