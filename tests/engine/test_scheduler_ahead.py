"""Scheduling a step while the one before it still computes (the engine's async scheduling):
the next step counts on the tokens in flight, and what ends a request meanwhile still ends it
within one step, with nothing shown past its end."""

from __future__ import annotations

from fake_worker import default_token
from test_scheduler import driver, expected_tokens, make_request, make_scheduler, prompt

from switchboard.engine.request import RequestStatus
from switchboard.wire.engine_msgs import FinishReason


def test_the_next_step_is_scheduled_on_the_token_in_flight():
    sched = make_scheduler()
    d = driver(sched)
    sched.add_request(make_request("a", prompt(5), 4))
    request = sched.requests["a"]
    first, first_out = d.submit()  # the prompt; it samples the first token
    assert request.num_pending_samples == 1
    second, second_out = d.submit()  # before the first token is known here
    assert second.num_scheduled_tokens == {"a": 1}
    assert [c.num_computed_tokens for c in second.cached_requests] == [5]
    assert request.num_pending_samples == 2
    d.apply(first, first_out)
    assert request.num_pending_samples == 1 and len(request.output_token_ids) == 1
    d.apply(second, second_out)
    assert request.num_pending_samples == 0
    d.run()
    assert d.tokens("a") == expected_tokens(prompt(5), 4)


def test_a_token_that_may_end_the_request_by_length_is_waited_for():
    sched = make_scheduler(max_model_len=32)
    d = driver(sched, ahead=True)
    sched.add_request(make_request("one", prompt(5), 1))  # its first token is its last
    sched.add_request(make_request("edge", prompt(30), 10))  # 30 + 2 = max_model_len
    d.run()
    assert len(d.tokens("one")) == 1 and len(d.tokens("edge")) == 2
    computed = {"one": 0, "edge": 0}
    for step in d.sched_outputs:
        for rid, n in step.num_scheduled_tokens.items():
            computed[rid] += n
    assert computed == {"one": 5, "edge": 31}  # not one token past the end
    assert sched.kv.usage() == 0.0


def test_a_stop_token_ends_the_request_and_the_token_computed_ahead_is_dropped():
    sched = make_scheduler()
    script = {"a": [7, 2, 9, 9]}
    d = driver(sched, lambda rid, ids: script[rid].pop(0), ahead=True)
    sched.add_request(make_request("a", prompt(4), 10, eos_token_ids=[2]))
    d.run()
    assert d.tokens("a") == [7, 2]
    assert d.finish("a").finish_reason == FinishReason.STOP
    assert script["a"] == [9]  # one more token was computed ahead, and not shown
    assert sched.schedule().finished_request_ids == ["a"]  # the workers drop its state
    assert sched.kv.usage() == 0.0 and not sched.requests


def test_an_abort_with_two_steps_in_flight_drops_both_outputs():
    sched = make_scheduler()
    d = driver(sched)
    sched.add_request(make_request("a", prompt(4), 10))
    sched.add_request(make_request("b", prompt(4, 200), 10))
    first = d.submit()
    second = d.submit()
    sched.finish_requests("a", FinishReason.ABORT)  # arrives while both compute
    d.apply(*first)
    d.apply(*second)
    assert "a" not in d.outputs and len(d.tokens("b")) == 2
    assert sched.kv.usage() > 0  # b's blocks only
    third = d.submit()
    assert third[0].finished_request_ids == ["a"]
    d.apply(*third)
    d.run()
    assert d.tokens("b") == expected_tokens(prompt(4, 200), 10)
    assert sched.kv.usage() == 0.0


def test_a_request_preempted_with_a_token_in_flight_resumes_without_it():
    sched = make_scheduler(num_blocks=4, max_model_len=16)  # blocks of 4 tokens
    d = driver(sched)
    sched.add_request(make_request("old", prompt(4), 8))
    sched.add_request(make_request("new", prompt(4, 200), 8))
    d.apply(*d.submit())  # both prefilled, one block each
    in_flight = d.submit()  # both decode into their second block: 4 blocks used
    assert sched.kv.num_free_blocks == 0
    victim = sched.requests["new"]
    resumed = d.submit()  # "old" needs no block yet; "new" is not the one it evicts either
    for _ in range(8):  # "old" grows into a third block: "new", the newest, is evicted
        if victim.status == RequestStatus.PREEMPTED:
            break
        d.apply(*in_flight)
        in_flight, resumed = resumed, d.submit()
    assert victim.status == RequestStatus.PREEMPTED
    assert victim.num_pending_samples == 0
    d.apply(*in_flight)
    d.apply(*resumed)
    d.run()
    assert d.tokens("old") == expected_tokens(prompt(4), 8)
    assert d.tokens("new") == expected_tokens(prompt(4, 200), 8)
    assert sched.make_stats().num_preemptions >= 1
    assert sched.kv.usage() == 0.0


def test_a_constrained_request_waits_for_its_token_before_the_next_mask():
    sched = make_scheduler()
    d = driver(sched)
    sched.add_request(make_request("free", prompt(4), 4))
    sched.add_request(make_request("json", prompt(4, 200), 4))
    sched.requests["json"].grammar = _AnyToken()  # the mask of its next token needs the last
    first = d.submit()
    second, _ = ahead = d.submit()
    assert second.num_scheduled_tokens == {"free": 1}
    d.apply(*first)
    d.apply(*ahead)
    third, _ = d.submit()
    assert "json" in third.num_scheduled_tokens


class _AnyToken:
    """A grammar that takes any token and never completes."""

    is_terminated = False

    def accept(self, token_id: int) -> bool:
        return True


def test_ahead_and_in_turn_give_the_same_tokens():
    runs = {}
    for ahead in (False, True):
        sched = make_scheduler(max_num_batched_tokens=6)
        d = driver(sched, default_token, ahead=ahead)
        for i in range(3):
            sched.add_request(make_request(f"r{i}", prompt(9, 100 * (i + 1)), 6))
        d.run()
        runs[ahead] = {rid: d.tokens(rid) for rid in ("r0", "r1", "r2")}
        assert sched.kv.usage() == 0.0
    assert runs[True] == runs[False]


def test_requests_waiting_for_a_step_are_told_from_those_waiting_for_a_slot():
    """``has_admissible_waiting``: the engine does not schedule a step ahead while it is true
    (a burst of arrivals joins the next step instead of the one after)."""
    sched = make_scheduler(max_num_seqs=2)
    d = driver(sched)
    assert not sched.has_admissible_waiting()
    sched.add_request(make_request("a", prompt(5), 8))
    assert sched.has_admissible_waiting()  # arrived, a slot free
    d.submit()
    assert not sched.has_admissible_waiting()  # admitted
    sched.add_request(make_request("b", prompt(6), 8))
    sched.add_request(make_request("c", prompt(6), 8))
    assert sched.has_admissible_waiting()
    step, _ = d.submit()
    assert set(step.num_scheduled_tokens) == {"a", "b"}
    assert sched.num_waiting == 1 and not sched.has_admissible_waiting()  # c waits for a slot
