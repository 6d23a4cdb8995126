"""What a proposed row costs, measured from the engine's steps, and the proposals it leaves:
long ones where a row is cheap beside the step, none where a batch makes rows dear, the same
tokens either way."""

from __future__ import annotations

import math

import pytest
from fake_worker import Driver, FakeWorker
from test_scheduler import BS, make_request, prompt
from test_speculation import NGRAM, cyclic_token, make_scheduler, proposed_tokens

from switchboard.engine.speculation.step_cost import (
    MAX_ROW_SHARE,
    MIN_STEPS,
    PRIOR_ROW_SHARE,
    AcceptanceRate,
    Evidence,
    StepCost,
    acceptance,
    worth_proposing,
)
from switchboard.wire.engine_msgs import SamplingParams
from switchboard.wire.step_msgs import NewRequest, SchedulerOutput


def fitted(fixed: float, per_row: float, rows: list[int]) -> StepCost:
    cost = StepCost()
    for n in rows:
        cost.observe(n, fixed + per_row * n)
    return cost


def test_the_fit_finds_a_row_s_share_of_the_step() -> None:
    assert StepCost().row_share() == PRIOR_ROW_SHARE
    sizes = [1, 5, 9, 2, 4, 1, 9, 3, 6, 1] * 3
    assert fitted(0.005, 0.00125, sizes).row_share() == pytest.approx(0.25)
    # the prior until enough steps, and while every step had the same rows
    assert fitted(0.005, 0.00125, sizes[: MIN_STEPS - 1]).row_share() == PRIOR_ROW_SHARE
    assert fitted(0.005, 0.00125, [4] * 40).row_share() == PRIOR_ROW_SHARE
    # rows that cost nothing, and steps that cost nothing but their rows
    assert fitted(0.005, 0.0, sizes).row_share() == pytest.approx(0.0, abs=1e-9)
    assert fitted(-0.001, 0.001, sizes).row_share() == MAX_ROW_SHARE  # at most the fixed part
    assert fitted(0.001, 0.005, sizes).row_share() == MAX_ROW_SHARE
    # a drifting machine: the recent steps weigh most
    cost = fitted(0.005, 0.005, sizes * 4)
    for n in sizes * 10:
        cost.observe(n, 0.005 + 0.00125 * n)
    assert cost.row_share() == pytest.approx(0.25, rel=0.05)


def test_proposals_are_cut_to_those_that_raise_tokens_per_second() -> None:
    # a row a quarter of the fixed part: one request makes 1 token per 1.25, so a proposal
    # pays while p ** i > 0.2; four make 4 per 2, a proposal then needs p ** i > 0.5
    assert worth_proposing(0.8, 1, 0.25, 8) == 7
    assert worth_proposing(0.8, 4, 0.25, 8) == 3
    assert worth_proposing(0.8, 16, 0.25, 8) == 0
    assert worth_proposing(0.99, 16, 0.25, 8) == 8
    assert worth_proposing(0.8, 1, 0.25, 4) == 4  # never past what the request may propose
    assert worth_proposing(0.5, 1, 0.0, 6) == 6  # free rows
    assert worth_proposing(0.99, 1, math.inf, 6) == 0
    assert worth_proposing(1.0, 8, 0.25, 5) == 5
    assert acceptance(0, 0) == 0.75  # the prior: 3 of 4
    assert acceptance(30, 2) == pytest.approx(33 / 36)


def test_a_new_request_starts_from_the_acceptance_of_the_others() -> None:
    rate = AcceptanceRate()
    assert rate.rate() == rate.prior() == 0.75
    for _ in range(50):  # the others' proposals all accepted
        rate.record(4, 4)
    assert rate.prior() > 0.97
    assert acceptance(0, 0, rate.prior()) == rate.prior()
    for _ in range(300):  # then all rejected: the old verdicts fade, the prior stays hopeful
        rate.record(4, 0)
    assert rate.rate() < 0.15 and rate.prior() == 0.75


def test_a_request_s_failures_fade_with_its_output() -> None:
    """Rejected proposals lower a request's rate until it is not worth proposing; as it goes on
    without proposals its verdicts fade back to the prior, and it tries again."""
    evidence = Evidence()
    for tokens in (5, 6, 7, 8):
        evidence.record(4, 0, tokens)
    low = evidence.rate(8, 0.75)
    assert low < 0.5
    assert worth_proposing(low, 4, 0.25, 4) == 0  # four decoding at a quarter: needs 1 in 2
    later = evidence.rate(8 + 30, 0.75)
    assert later > 0.7 and worth_proposing(later, 4, 0.25, 4) > 0
    evidence.record(4, 4, 38)  # accepted: counts at once
    assert evidence.rate(38, 0.75) > later


def test_a_step_s_time_is_a_sample_only_for_decodes_and_their_proposals() -> None:
    sched = make_scheduler()
    speculator = sched.speculator
    assert speculator is not None
    decodes = SchedulerOutput(
        step_id=1,
        num_scheduled_tokens={"a": 3, "b": 1},
        total_num_scheduled_tokens=4,
        scheduled_spec_decode_tokens={"a": [5, 6]},
    )
    chunk = SchedulerOutput(
        step_id=2, num_scheduled_tokens={"a": 1, "c": 8}, total_num_scheduled_tokens=9
    )
    new = NewRequest("d", [1], SamplingParams(max_tokens=4), [0], 0)
    admitted = SchedulerOutput(
        step_id=3, new_requests=[new], num_scheduled_tokens={"d": 1}, total_num_scheduled_tokens=1
    )
    for step in (decodes, chunk, admitted, SchedulerOutput(step_id=4)):
        speculator.observe_step(step, 0.01)
    assert speculator.cost.steps == 1


def drive(requests: list[tuple[str, list[int], int]], cost: StepCost | None) -> Driver:
    sched = make_scheduler(NGRAM if cost is not None else "")
    if cost is not None:
        assert sched.speculator is not None
        sched.speculator.cost = cost
    d = Driver(sched, FakeWorker(BS, sched.kv.num_blocks, cyclic_token), ahead=True)
    for rid, prompt_ids, max_tokens in requests:
        sched.add_request(make_request(rid, prompt_ids, max_tokens))
    d.run()
    return d


def test_where_rows_are_dear_a_batch_proposes_nothing_and_one_request_a_little() -> None:
    """Rows as dear as the step's fixed part: four decoding requests (a new one expects 3 of 4
    proposals accepted) propose nothing and the engine schedules their steps ahead, as without
    speculation; one request alone proposes two tokens at first (longer as they are accepted);
    the tokens are those of no speculation. Where rows are cheap the same request proposes up
    to its full length."""
    dear = fitted(0.005, 0.005, [1, 2, 3, 4, 5, 6, 7, 8, 9] * 2)
    assert dear.row_share() == pytest.approx(1.0)
    batch = [(f"r{i}", prompt(5, 11 + 10 * i), 30) for i in range(4)]
    d = drive(batch, dear)
    off = drive(batch, None)
    assert proposed_tokens(d) == 0
    assert len(d.sched_outputs) == len(off.sched_outputs)
    for rid, *_ in batch:
        assert d.tokens(rid) == off.tokens(rid)
    alone = [("a", [11, 12, 13, 14, 15, 16, 17] * 2, 40)]
    d = drive(alone, dear)
    lengths = [len(p) for out in d.sched_outputs for p in out.scheduled_spec_decode_tokens.values()]
    assert lengths[0] == 2  # then longer as every proposal is accepted
    assert d.tokens("a") == drive(alone, None).tokens("a")
    cheap = fitted(0.005, 0.0002, [1, 2, 3, 4, 5, 6, 7, 8, 9] * 2)
    d = drive(alone, cheap)
    lengths = [len(p) for out in d.sched_outputs for p in out.scheduled_spec_decode_tokens.values()]
    assert max(lengths) == 4  # num_speculative_tokens
