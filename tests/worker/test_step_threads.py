"""A CPU worker's step threads (worker/step_threads.py): a step of many streams and few tokens
on one thread while that size of step is short there, back on all for good once it is not;
every other step on all; the same tokens either way."""

from __future__ import annotations

import logging
import time

import pytest
import torch

from switchboard.wire.engine_msgs import SamplingParams
from switchboard.wire.step_msgs import CachedRequest, NewRequest, SchedulerOutput
from switchboard.worker.step_threads import (
    HOLD_MIN_STEP_S,
    HOLD_MIN_STREAMS,
    MAX_TOKENS,
    MIN_STREAMS,
    SHORT_STEP_S,
    WINDOW,
    StepThreads,
)
from tests.tiny_checkpoint import tiny_llama_dir
from tests.worker.test_model_runner_parity import BLOCK_SIZE, make_runner


class Machine:
    """A clock, and the thread count as torch.set_num_threads would hold it."""

    def __init__(self, threads: int) -> None:
        self.now = 0.0
        self.threads = threads
        self.changes: list[int] = []

    def clock(self) -> float:
        return self.now

    def set(self, n: int) -> None:
        assert n != self.threads, "set only on a change"
        self.threads = n
        self.changes.append(n)

    def policy(self) -> StepThreads:
        return StepThreads(self.threads, self.set, self.clock)


def run_steps(
    policy: StepThreads,
    machine: Machine,
    streams: int,
    tokens: int,
    steps: int,
    seconds: dict[int, float],
) -> list[int]:
    """``steps`` steps of ``streams`` requests and ``tokens`` tokens, each taking
    ``seconds[threads]``; the threads of each."""
    used = []
    for _ in range(steps):
        policy.begin(streams, tokens)
        used.append(machine.threads)
        machine.now += seconds[machine.threads]
        policy.end()
    return used


SHORT = {2: 0.5 * SHORT_STEP_S, 1: 0.6 * SHORT_STEP_S}
LONG = {2: 0.8 * SHORT_STEP_S, 1: 1.5 * SHORT_STEP_S}


def test_short_steps_of_many_streams_run_on_one_thread() -> None:
    machine = Machine(2)
    policy = machine.policy()
    assert run_steps(policy, machine, MIN_STREAMS, MIN_STREAMS, 50, SHORT) == [1] * 50
    assert run_steps(policy, machine, 40, 64, 20, SHORT) == [1] * 20
    assert policy.one_thread_sizes() == [16, 64]  # tokens rounded up to a power of two
    assert machine.changes == [1]  # set once, not at every step


def test_a_size_long_on_one_thread_goes_back_to_all_for_good(
    caplog: pytest.LogCaptureFixture,
) -> None:
    machine = Machine(2)
    policy = machine.policy()
    with caplog.at_level(logging.INFO, logger="switchboard.worker.step_threads"):
        used = run_steps(policy, machine, 32, 32, 30, LONG)
    assert used == [1] * WINDOW + [2] * (30 - WINDOW)  # measured, then back
    said = [record.getMessage() for record in caplog.records]
    assert said == [  # what an operator reads: the size tried, then sent back, once each
        "steps of 16+ streams and up to 32 tokens: on one thread while under 6 ms",
        "steps of up to 32 tokens take 9.0 ms of CPU on one thread: back on all 2",
    ]
    assert run_steps(policy, machine, 32, 32, 10, SHORT) == [2] * 10  # for good
    assert run_steps(policy, machine, 32, 60, 10, SHORT) == [1] * 10  # another size: its own
    assert policy.one_thread_sizes() == [64]


def test_one_slow_step_among_short_ones_does_not_send_a_size_back() -> None:
    machine = Machine(2)
    policy = machine.policy()
    run_steps(policy, machine, 32, 32, 3, SHORT)
    run_steps(policy, machine, 32, 32, 1, {2: 1.0, 1: 1.0})  # preempted once: the median holds
    assert run_steps(policy, machine, 32, 32, 20, SHORT) == [1] * 20


def test_few_streams_large_steps_and_single_thread_workers_use_every_thread() -> None:
    machine = Machine(2)
    policy = machine.policy()
    assert run_steps(policy, machine, MIN_STREAMS - 1, 20, 10, SHORT) == [2] * 10
    assert run_steps(policy, machine, 1, 200, 10, SHORT) == [2] * 10  # one long prompt's chunk
    assert run_steps(policy, machine, 64, MAX_TOKENS + 1, 10, SHORT) == [2] * 10
    assert machine.changes == [] and policy.one_thread_sizes() == []
    alone = Machine(1)
    single = alone.policy()
    assert run_steps(single, alone, 32, 32, 10, {1: 0.1 * SHORT_STEP_S}) == [1] * 10
    assert alone.changes == []


def held_steps(
    policy: StepThreads, machine: Machine, streams: int, steps: int, cpu_s: float
) -> list[bool]:
    """Whether each of ``steps`` steps of ``streams`` requests (200 tokens: on every thread),
    each taking ``cpu_s``, held the work pool."""
    held = []
    for _ in range(steps):
        policy.begin(streams, 200)
        held.append(policy.holds_pool)
        machine.now += cpu_s
        policy.end()
    return held


def test_long_steps_of_several_streams_on_every_thread_hold_the_pool() -> None:
    """What the worker holds the work pool's helpers awake for (between a step's loops): a
    step of ``HOLD_MIN_STREAMS`` or more requests on more than one thread once the steps on
    every thread average ``HOLD_MIN_STEP_S`` of CPU time or more; not one user's, not short
    ones."""
    machine = Machine(2)
    policy = machine.policy()
    assert held_steps(policy, machine, HOLD_MIN_STREAMS, 10, 0.5 * HOLD_MIN_STEP_S) == [False] * 10
    long = held_steps(policy, machine, HOLD_MIN_STREAMS, 10, 4 * HOLD_MIN_STEP_S)
    assert not long[0] and long[-3:] == [True] * 3  # held once the average is long
    assert held_steps(policy, machine, 1, 3, 4 * HOLD_MIN_STEP_S) == [False] * 3  # one user
    short = held_steps(policy, machine, HOLD_MIN_STREAMS, 20, 0.25 * HOLD_MIN_STEP_S)
    assert short[0] and short[-10:] == [False] * 10  # short again: no longer held
    policy.begin(32, 32)
    assert not policy.holds_pool and machine.threads == 1  # one thread: nothing to hold
    policy.end()
    alone = Machine(1)
    single = alone.policy()
    assert held_steps(single, alone, 32, 10, 4 * HOLD_MIN_STEP_S) == [False] * 10


def test_time_off_the_core_does_not_count_against_a_size() -> None:
    """The default clock is the thread's CPU time: a step whose thread waits off its core (as
    when another process preempts it on a full machine) stays on one thread however long it
    lasts; steps that spend the CPU go back to every thread."""
    machine = Machine(2)
    policy = StepThreads(machine.threads, machine.set)  # the default clock
    for _ in range(WINDOW + 2):
        policy.begin(32, 32)
        assert machine.threads == 1
        time.sleep(2 * SHORT_STEP_S)  # long in wall time, no CPU
        policy.end()
    assert policy.one_thread_sizes() == [32]
    for _ in range(WINDOW):
        policy.begin(32, 64)
        assert machine.threads == 1
        spent = time.thread_time() + 1.5 * SHORT_STEP_S
        while time.thread_time() < spent:  # the CPU a long step takes
            pass
        policy.end()
    assert policy.one_thread_sizes() == [32]  # 64 back on every thread, 32 still on one
    policy.begin(32, 64)
    assert machine.threads == 2


def test_use_all_restores_every_thread() -> None:
    machine = Machine(2)
    policy = machine.policy()
    run_steps(policy, machine, 32, 32, 2, SHORT)
    assert machine.threads == 1
    policy.use_all()
    assert machine.threads == 2
    changes = len(machine.changes)
    policy.use_all()
    assert len(machine.changes) == changes  # nothing to change the second time


def greedy_tokens(runner_threads: StepThreads | None, model_dir: str) -> list[list[int]]:
    """MIN_STREAMS requests prefilled, then decoded 12 steps; each request's tokens."""
    runner = make_runner(model_dir, num_blocks=MIN_STREAMS * 6, dtype="bfloat16")
    runner.step_threads = runner_threads
    blocks = 6
    prompts = [
        [0, *[(7 * i + 11 * r) % 900 + 3 for i in range(1 + r % 3)]] for r in range(MIN_STREAMS)
    ]
    new = [
        NewRequest(
            request_id=f"r{r}",
            prompt_token_ids=prompt,
            sampling_params=SamplingParams(temperature=0.0, max_tokens=14),
            block_ids=list(range(r * blocks, (r + 1) * blocks)),
            num_computed_tokens=0,
        )
        for r, prompt in enumerate(prompts)
    ]
    assert len(new) == MIN_STREAMS and BLOCK_SIZE * blocks > max(map(len, prompts)) + 14
    scheduled = {r.request_id: len(r.prompt_token_ids) for r in new}
    out = runner.execute_model(
        SchedulerOutput(
            step_id=0,
            new_requests=new,
            num_scheduled_tokens=scheduled,
            total_num_scheduled_tokens=sum(scheduled.values()),
        )
    )
    tokens = dict(zip(out.request_ids, map(list, out.sampled_token_ids), strict=True))
    for step_id in range(1, 13):
        cached = [
            CachedRequest(r.request_id, [], len(r.prompt_token_ids) + len(tokens[r.request_id]) - 1)
            for r in new
        ]
        out = runner.execute_model(
            SchedulerOutput(
                step_id=step_id,
                cached_requests=cached,
                num_scheduled_tokens={r.request_id: 1 for r in new},
                total_num_scheduled_tokens=len(new),
            )
        )
        for i, request_id in enumerate(out.request_ids):
            tokens[request_id].extend(out.sampled_token_ids[i])
    return [tokens[r.request_id] for r in new]


def test_the_same_tokens_on_one_thread_as_on_all() -> None:
    model_dir = tiny_llama_dir()
    threads = max(2, torch.get_num_threads())
    before = torch.get_num_threads()
    counts: list[int] = []

    def set_threads(n: int) -> None:
        counts.append(n)
        torch.set_num_threads(n)

    try:
        torch.set_num_threads(threads)
        reference = greedy_tokens(None, model_dir)
        # a clock that never moves: every step short, so the decode steps run on one thread
        adaptive = StepThreads(threads, set_threads, lambda: 0.0)
        assert greedy_tokens(adaptive, model_dir) == reference
        assert counts == [1]  # every step (16 streams, few tokens) on one thread, from the first
    finally:
        torch.set_num_threads(before)
