"""Scheduler behaviour without a model: driven by a fake worker that consumes the real deltas."""

from __future__ import annotations

import itertools

import pytest
from fake_worker import Driver, FakeWorker, default_token

from switchboard.config import CacheConfig, SchedulerConfig
from switchboard.engine.request import Request, RequestStatus
from switchboard.engine.scheduler import Scheduler
from switchboard.wire.engine_msgs import (
    EngineCoreRequest,
    EventType,
    FinishReason,
    SamplingParams,
)
from switchboard.wire.step_msgs import ModelRunnerOutput

BS = 4
_arrival = itertools.count(1)


def make_scheduler(
    num_blocks: int = 64,
    max_model_len: int = 128,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 64,
    long_prefill_token_threshold: int = 0,
    policy: str = "fcfs",
    caching: bool = True,
    shared_step_tokens: int = 0,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            shared_step_tokens=shared_step_tokens,
            long_prefill_token_threshold=long_prefill_token_threshold,
            scheduling_policy=policy,
        ),
        CacheConfig(block_size=BS, enable_prefix_caching=caching),
        num_blocks,
        max_model_len,
    )


def make_request(
    rid: str,
    prompt: list[int],
    max_tokens: int = 8,
    priority: int = 0,
    salt: str | None = None,
    client_index: int = 0,
    **params,
) -> Request:
    engine_request = EngineCoreRequest(
        rid,
        prompt,
        sampling_params=SamplingParams(max_tokens=max_tokens, **params),
        cache_salt=salt,
        client_index=client_index,
        priority=priority,
    )
    return Request.from_engine_core_request(engine_request, BS, next(_arrival))


def driver(scheduler: Scheduler, token_fn=default_token, ahead: bool = False) -> Driver:
    return Driver(scheduler, FakeWorker(BS, scheduler.kv.num_blocks, token_fn), ahead)


def prompt(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


def expected_tokens(prompt_ids: list[int], n: int) -> list[int]:
    tokens = list(prompt_ids)
    for _ in range(n):
        tokens.append(default_token("", tokens))
    return tokens[len(prompt_ids) :]


# ---------------------------------------------------------------- basics


def test_single_request_runs_to_max_tokens_and_frees_its_blocks():
    sched = make_scheduler()
    d = driver(sched)
    sched.add_request(make_request("a", prompt(10), max_tokens=5))
    steps = d.run()
    assert steps == 5  # one prefill step, then one token per step
    assert d.tokens("a") == expected_tokens(prompt(10), 5)
    last = d.finish("a")
    assert last.finish_reason == FinishReason.LENGTH
    assert sched.kv.usage() == 0.0
    assert not sched.has_unfinished_requests()
    assert sched.has_finished_requests()  # the workers still have to hear about it
    assert sched.schedule().finished_request_ids == ["a"]


def test_events_queued_and_scheduled_are_delivered_once_on_first_output():
    sched = make_scheduler()
    d = driver(sched)
    sched.add_request(make_request("a", prompt(6), max_tokens=3))
    d.run()
    first, *rest = d.outputs["a"]
    assert [e.type for e in first.events] == [EventType.QUEUED, EventType.SCHEDULED]
    assert first.events[0].timestamp_ns <= first.events[1].timestamp_ns
    assert all(o.events is None for o in rest)


def test_batching_respects_token_budget_and_max_num_seqs():
    sched = make_scheduler(max_num_seqs=3, max_num_batched_tokens=20)
    d = driver(sched)
    for i in range(6):
        sched.add_request(make_request(f"r{i}", prompt(9, 10 * i), max_tokens=4))
    d.run()
    for out in d.sched_outputs:
        assert out.total_num_scheduled_tokens <= 20
        assert len(out.num_scheduled_tokens) <= 3
    first = d.sched_outputs[0]
    # 9 + 9 fit, the third gets the remaining 2 tokens as a first chunk
    assert list(first.num_scheduled_tokens.values()) == [9, 9, 2]
    for i in range(6):
        assert d.tokens(f"r{i}") == expected_tokens(prompt(9, 10 * i), 4)


def test_continuous_batching_admits_new_requests_between_steps():
    sched = make_scheduler()
    d = driver(sched)
    sched.add_request(make_request("a", prompt(5), max_tokens=6))
    d.step()
    d.step()
    sched.add_request(make_request("b", prompt(5, 300), max_tokens=2))
    d.step()
    assert set(d.sched_outputs[-1].num_scheduled_tokens) == {"a", "b"}
    d.run()
    assert d.tokens("a") == expected_tokens(prompt(5), 6)
    assert d.tokens("b") == expected_tokens(prompt(5, 300), 2)


def test_outputs_are_grouped_by_client_index():
    sched = make_scheduler()
    d = driver(sched)
    sched.add_request(make_request("a", prompt(5), client_index=0))
    sched.add_request(make_request("b", prompt(5, 200), client_index=1))
    by_client = d.step()
    assert {c: [o.request_id for o in outs] for c, outs in by_client.items()} == {
        0: ["a"],
        1: ["b"],
    }


# ---------------------------------------------------------------- chunked prefill


def test_long_prompt_is_chunked_while_decoding_request_gets_a_token_every_step():
    sched = make_scheduler(max_num_batched_tokens=16, max_model_len=256, num_blocks=80)
    d = driver(sched)
    sched.add_request(make_request("dec", prompt(3, 500), max_tokens=30))
    d.step()
    sched.add_request(make_request("long", prompt(100), max_tokens=2))
    while sched.requests["long"].num_output_tokens == 0:
        d.step()
        assert d.sched_outputs[-1].num_scheduled_tokens["dec"] == 1
        assert d.sched_outputs[-1].total_num_scheduled_tokens <= 16
    chunks = [o.num_scheduled_tokens["long"] for o in d.sched_outputs[1:]]
    assert chunks == [15] * 6 + [10]
    d.run()
    assert d.tokens("long") == expected_tokens(prompt(100), 2)
    assert d.tokens("dec") == expected_tokens(prompt(3, 500), 30)


def test_decoding_requests_go_before_a_prefill_that_is_ahead_in_the_running_list():
    sched = make_scheduler(
        max_num_batched_tokens=16, long_prefill_token_threshold=8, max_model_len=256, num_blocks=80
    )
    d = driver(sched)
    sched.add_request(make_request("long", prompt(100), max_tokens=2))
    d.step()  # alone: no cap, a 16-token chunk
    sched.add_request(make_request("dec", prompt(3, 500), max_tokens=30))
    d.step()  # "long" capped at 8, "dec" admitted with its 3 prompt tokens
    assert d.sched_outputs[-1].num_scheduled_tokens == {"long": 8, "dec": 3}
    while sched.requests["long"].num_output_tokens == 0:
        d.step()
        assert list(d.sched_outputs[-1].num_scheduled_tokens.items())[0] == ("dec", 1)
    d.run()
    assert d.tokens("long") == expected_tokens(prompt(100), 2)
    assert d.tokens("dec") == expected_tokens(prompt(3, 500), 30)


def test_long_prefill_threshold_caps_one_requests_chunk_when_others_are_eligible():
    sched = make_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=8)
    d = driver(sched)
    sched.add_request(make_request("a", prompt(30), max_tokens=1))
    sched.add_request(make_request("b", prompt(30, 200), max_tokens=1))
    d.step()
    assert d.sched_outputs[0].num_scheduled_tokens == {"a": 8, "b": 8}
    d.run()
    assert d.tokens("a") == expected_tokens(prompt(30), 1)

    alone = make_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=8)
    d2 = driver(alone)
    alone.add_request(make_request("c", prompt(30), max_tokens=1))
    d2.step()
    assert d2.sched_outputs[0].num_scheduled_tokens == {"c": 30}  # nobody else to wait


def test_shared_step_tokens_limit_a_step_only_while_several_requests_are_in():
    alone = make_scheduler(max_num_batched_tokens=64, shared_step_tokens=8)
    d = driver(alone)
    alone.add_request(make_request("lone", prompt(30), max_tokens=2))
    d.step()
    assert d.sched_outputs[0].num_scheduled_tokens == {"lone": 30}  # the whole budget

    crowd = make_scheduler(max_num_batched_tokens=64, shared_step_tokens=8, max_num_seqs=16)
    d = driver(crowd)
    for i in range(3):
        crowd.add_request(make_request(f"r{i}", prompt(6, 100 * i), max_tokens=3))
    d.step()
    assert d.sched_outputs[0].num_scheduled_tokens == {"r0": 6, "r1": 2}  # 8 tokens in all
    d.run()
    for i in range(3):
        assert d.tokens(f"r{i}") == expected_tokens(prompt(6, 100 * i), 3)


def test_a_crowd_of_decodes_past_a_quarter_of_the_shared_budget_still_leaves_prompts_room():
    sched = make_scheduler(max_num_batched_tokens=64, shared_step_tokens=8, max_num_seqs=32)
    d = driver(sched)
    for i in range(2):
        sched.add_request(make_request(f"run{i}", prompt(1, 100 + i), max_tokens=20))
    d.step()
    sched.add_request(make_request("few", prompt(12, 200), max_tokens=2))
    d.step()  # 2 decodes: a quarter of the shared budget; the prompt gets the rest
    decodes = {f"run{i}": 1 for i in range(2)}
    assert d.sched_outputs[-1].num_scheduled_tokens == decodes | {"few": 6}
    d.run()
    for i in range(2, 7):
        sched.add_request(make_request(f"run{i}", prompt(1, 100 + i), max_tokens=20))
    d.step()
    sched.add_request(make_request("late", prompt(12, 300), max_tokens=2))
    d.step()  # 5 decodes: past a quarter of it, so a whole shared budget beside them
    decodes = {f"run{i}": 1 for i in range(2, 7)}
    assert d.sched_outputs[-1].num_scheduled_tokens == decodes | {"late": 8}
    d.run()
    assert d.tokens("few") == expected_tokens(prompt(12, 200), 2)
    assert d.tokens("late") == expected_tokens(prompt(12, 300), 2)


# ---------------------------------------------------------------- prefix caching


def test_prefix_hit_shares_blocks_and_reports_cached_tokens():
    sched = make_scheduler()
    d = driver(sched)
    shared = prompt(32)
    sched.add_request(make_request("a", shared + [1, 2, 3], max_tokens=20))
    d.step()
    d.step()
    sched.add_request(make_request("b", shared + [7, 8], max_tokens=3))
    d.step()
    new_b = d.sched_outputs[-1].new_requests[0]
    assert new_b.request_id == "b"
    assert new_b.num_computed_tokens == 32
    assert new_b.block_ids[:8] == sched.kv.block_ids("a")[:8]
    assert d.sched_outputs[-1].num_scheduled_tokens["b"] == 2  # only the unshared tail
    d.run()
    assert d.outputs["b"][0].num_cached_tokens == 32
    assert all(o.num_cached_tokens == 0 for o in d.outputs["b"][1:])
    assert d.outputs["a"][0].num_cached_tokens == 0
    assert d.tokens("b") == expected_tokens(shared + [7, 8], 3)
    stats = sched.make_stats()
    assert stats.prefix_cache_hits == 32
    assert stats.prefix_cache_queries == 35 + 34


def test_prefix_hit_after_the_owner_finished_and_last_token_is_recomputed():
    sched = make_scheduler()
    d = driver(sched)
    p = prompt(40)  # exactly 10 blocks
    sched.add_request(make_request("a", p, max_tokens=2))
    d.run()
    assert sched.kv.usage() == 0.0  # freed, but the blocks stay cached
    sched.add_request(make_request("b", p, max_tokens=2))
    d.step()
    new_b = d.sched_outputs[-1].new_requests[0]
    assert new_b.num_computed_tokens == 36  # the last block is recomputed for its logits
    assert d.sched_outputs[-1].num_scheduled_tokens["b"] == 4
    d.run()
    assert d.tokens("b") == d.tokens("a")


def test_generated_tokens_become_cacheable():
    sched = make_scheduler()
    d = driver(sched)
    p = prompt(6)
    sched.add_request(make_request("a", p, max_tokens=12))
    d.run()
    continued = p + d.tokens("a")  # 18 tokens: 4 full blocks, 2 of them from outputs
    sched.add_request(make_request("b", continued, max_tokens=1))
    d.step()
    assert d.sched_outputs[-1].new_requests[0].num_computed_tokens == 16


def test_requests_sent_together_with_one_prompt_compute_it_once():
    """n > 1 siblings arrive in one step: the first computes the prompt, the others wait that
    step and then take every full block from the prefix cache."""
    sched = make_scheduler()
    d = driver(sched)
    shared = prompt(30)  # 7 full blocks + 2 tokens
    for i in range(3):
        sched.add_request(make_request(f"{i}_r", shared, max_tokens=4, seed=i))
    sched.add_request(make_request("other", prompt(6, 500), max_tokens=2))  # behind them
    d.step()
    assert d.sched_outputs[-1].num_scheduled_tokens == {"0_r": 30}
    d.step()
    step = d.sched_outputs[-1]
    assert {r.request_id: r.num_computed_tokens for r in step.new_requests} == {
        "1_r": 28,
        "2_r": 28,
        "other": 0,
    }
    assert step.num_scheduled_tokens == {"0_r": 1, "1_r": 2, "2_r": 2, "other": 6}
    d.run()
    assert [d.outputs[f"{i}_r"][0].num_cached_tokens for i in range(3)] == [0, 28, 28]
    assert all(d.tokens(f"{i}_r") == expected_tokens(shared, 4) for i in range(3))


def test_a_sibling_waits_for_each_shared_chunk_of_a_long_prompt():
    sched = make_scheduler(max_num_batched_tokens=16, max_model_len=128)
    d = driver(sched)
    shared = prompt(40)
    sched.add_request(make_request("a", shared, max_tokens=2))
    sched.add_request(make_request("b", shared, max_tokens=2))
    for _ in range(3):  # 16 + 16 + 8 prompt tokens, all "a"'s
        d.step()
        assert list(d.sched_outputs[-1].num_scheduled_tokens) == ["a"]
    d.step()
    assert d.sched_outputs[-1].new_requests[0].num_computed_tokens == 36
    d.run()
    assert d.tokens("b") == d.tokens("a") == expected_tokens(shared, 2)


def test_nothing_waits_without_a_shared_prefix_or_when_prompt_logprobs_need_every_position():
    sched = make_scheduler()
    d = driver(sched)
    sched.add_request(make_request("a", prompt(12), max_tokens=2))
    sched.add_request(make_request("b", prompt(12), max_tokens=2, prompt_logprobs=1))
    sched.add_request(make_request("c", prompt(12, 300), max_tokens=2))
    d.step()
    assert d.sched_outputs[-1].num_scheduled_tokens == {"a": 12, "b": 12, "c": 12}
    d.run()


def test_different_cache_salt_never_shares_blocks():
    sched = make_scheduler()
    d = driver(sched)
    p = prompt(20)
    sched.add_request(make_request("a", p, max_tokens=1, salt="tenant-1"))
    d.run()
    sched.add_request(make_request("b", p, max_tokens=1, salt="tenant-2"))
    sched.add_request(make_request("c", p, max_tokens=1))
    d.step()
    assert [r.num_computed_tokens for r in d.sched_outputs[-1].new_requests] == [0, 0]
    d.run()
    sched.add_request(make_request("d", p, max_tokens=1, salt="tenant-1"))
    d.step()
    assert d.sched_outputs[-1].new_requests[0].num_computed_tokens == 16


def test_prefix_caching_off_never_hits():
    sched = make_scheduler(caching=False)
    d = driver(sched)
    p = prompt(20)
    sched.add_request(make_request("a", p, max_tokens=1))
    d.run()
    sched.add_request(make_request("b", p, max_tokens=1))
    d.step()
    assert d.sched_outputs[-1].new_requests[0].num_computed_tokens == 0
    assert sched.requests.get("b") is None or sched.requests["b"].block_hashes == []


def test_reset_prefix_cache_forgets_cached_blocks():
    sched = make_scheduler()
    d = driver(sched)
    p = prompt(20)
    sched.add_request(make_request("a", p, max_tokens=3))
    d.step()
    assert sched.reset_prefix_cache() is False  # "a" holds blocks
    d.run()
    assert sched.reset_prefix_cache() is True
    sched.add_request(make_request("b", p, max_tokens=1))
    d.step()
    assert d.sched_outputs[-1].new_requests[0].num_computed_tokens == 0


# ---------------------------------------------------------------- preemption and priority


def _preemption_scheduler(policy: str) -> Scheduler:
    # 10 blocks of 4 = 40 slots; three requests of 8 + 12 tokens need 15 blocks at the end
    return make_scheduler(num_blocks=10, max_model_len=40, policy=policy, caching=False)


def test_fcfs_preempts_the_newest_and_the_victim_resumes_with_its_outputs():
    sched = _preemption_scheduler("fcfs")
    d = driver(sched)
    prompts = {"a": prompt(8, 100), "b": prompt(8, 300), "c": prompt(8, 600)}
    for name, p in prompts.items():
        sched.add_request(make_request(name, p, 12))
    d.run()
    victims = [rid for o in d.sched_outputs for rid in o.finished_request_ids if rid in prompts]
    assert victims[0] == "c"  # the newest
    preempting = next(o for o in d.sched_outputs if "c" in o.finished_request_ids)
    assert "c" not in preempting.num_scheduled_tokens
    resumed = [r for o in d.sched_outputs for r in o.new_requests if r.request_id == "c"][1]
    assert resumed.num_output_tokens > 0
    assert resumed.prompt_token_ids[:8] == prompts["c"]
    assert resumed.prompt_token_ids[8:] == d.tokens("c")[: resumed.num_output_tokens]
    assert resumed.num_computed_tokens == 0  # prefix caching is off here: full recompute
    for name, p in prompts.items():
        assert d.tokens(name) == expected_tokens(p, 12), name
    types = [e.type for o in d.outputs["c"] if o.events for e in o.events]
    i = types.index(EventType.PREEMPTED)
    assert types[:i] == [EventType.QUEUED, EventType.SCHEDULED]
    assert types[i + 1] == EventType.SCHEDULED  # stamped again on resume
    assert d.outputs["c"][-1].num_preemptions == types.count(EventType.PREEMPTED)
    assert sched.make_stats().num_preemptions >= 1


def test_priority_policy_preempts_the_lowest_priority_even_if_older():
    sched = _preemption_scheduler("priority")
    d = driver(sched)
    sched.add_request(make_request("low", prompt(8), 12, priority=5))
    sched.add_request(make_request("high", prompt(8, 300), 12, priority=0))
    sched.add_request(make_request("mid", prompt(8, 600), 12, priority=1))
    d.run()
    first_victims = next(o.finished_request_ids for o in d.sched_outputs if o.finished_request_ids)
    assert first_victims == ["low"]
    assert d.tokens("low") == expected_tokens(prompt(8), 12)
    assert d.tokens("high") == expected_tokens(prompt(8, 300), 12)
    assert d.outputs["low"][-1].num_preemptions >= 1
    assert d.outputs["high"][-1].num_preemptions == 0


def test_victim_already_scheduled_in_the_step_is_withdrawn_and_resumes_from_the_cache():
    sched = make_scheduler(num_blocks=4, max_model_len=16, policy="priority")
    d = driver(sched)
    sched.add_request(make_request("low", prompt(5), 4, priority=5))  # 2 blocks
    sched.add_request(make_request("high", prompt(7, 300), 3, priority=0))  # 2 blocks
    d.step()
    d.step()
    d.step()  # "low" is scheduled first, then "high" needs a 3rd block: "low" is the victim
    out = d.sched_outputs[-1]
    assert out.num_scheduled_tokens == {"high": 1}
    assert out.total_num_scheduled_tokens == 1
    assert out.finished_request_ids == ["low"]
    d.run()
    resumed = [r for o in d.sched_outputs for r in o.new_requests if r.request_id == "low"][1]
    assert resumed.num_computed_tokens == 4  # its first block survived in the prefix cache
    assert resumed.num_output_tokens == 2
    assert d.tokens("low") == expected_tokens(prompt(5), 4)
    assert d.tokens("high") == expected_tokens(prompt(7, 300), 3)


def test_priority_orders_the_waiting_queue_then_by_arrival():
    sched = make_scheduler(max_num_seqs=1, policy="priority")
    d = driver(sched)
    for rid, prio in [("p3", 3), ("p1a", 1), ("p2", 2), ("p1b", 1), ("p0", 0)]:
        sched.add_request(make_request(rid, prompt(4), 1, priority=prio))
    d.run()
    order = [o.new_requests[0].request_id for o in d.sched_outputs if o.new_requests]
    assert order == ["p0", "p1a", "p1b", "p2", "p3"]


def test_fcfs_ignores_priority():
    sched = make_scheduler(max_num_seqs=1, policy="fcfs")
    d = driver(sched)
    for rid, prio in [("a", 3), ("b", 0)]:
        sched.add_request(make_request(rid, prompt(4), 1, priority=prio))
    d.run()
    order = [o.new_requests[0].request_id for o in d.sched_outputs if o.new_requests]
    assert order == ["a", "b"]


def test_urgent_waiting_request_preempts_a_lower_priority_running_one():
    sched = make_scheduler(max_num_seqs=1, policy="priority")
    d = driver(sched)
    sched.add_request(make_request("batch", prompt(4), 10, priority=5))
    d.step()
    d.step()
    sched.add_request(make_request("urgent", prompt(4, 200), 2, priority=0))
    sched.add_request(make_request("same", prompt(4, 300), 2, priority=5))
    d.step()
    out = d.sched_outputs[-1]
    assert out.finished_request_ids == ["batch"]
    assert [r.request_id for r in out.new_requests] == ["urgent"]
    d.run()
    assert d.tokens("batch") == expected_tokens(prompt(4), 10)
    admitted = [r.request_id for o in d.sched_outputs for r in o.new_requests]
    assert admitted == ["batch", "urgent", "batch", "same"]  # equal priority does not preempt


# ---------------------------------------------------------------- stop conditions


def scripted(tokens_by_request: dict[str, list[int]]):
    def token_fn(rid: str, token_ids: list[int]) -> int:
        return tokens_by_request[rid].pop(0)

    return token_fn


@pytest.mark.parametrize("ahead", [False, True], ids=["in-turn", "ahead"])
def test_stop_conditions(ahead):
    """Scheduled ahead, a request the length ends is never given a token past its end (its
    script would run out); one a stop token ends computes one more that is never shown."""
    sched = make_scheduler(max_model_len=12)
    d = driver(
        sched,
        scripted(
            {
                "eos": [5, 6, 2, 7],
                "ignore": [2, 2, 2],
                "min": [2, 2, 2, 9],
                "stop_id": [5, 42, 7],
                "len": [5, 6, 7],
                "model_len": [5] * 20,
            }
        ),
        ahead=ahead,
    )
    eos = dict(eos_token_ids=[2])
    sched.add_request(make_request("eos", prompt(3), 10, **eos))
    sched.add_request(make_request("ignore", prompt(3), 3, ignore_eos=True, **eos))
    sched.add_request(make_request("min", prompt(3), 10, min_tokens=3, **eos))
    sched.add_request(make_request("stop_id", prompt(3), 10, stop_token_ids=[42, 43]))
    sched.add_request(make_request("len", prompt(3), 3))
    sched.add_request(make_request("model_len", prompt(8), 100))
    d.run()
    result = {
        rid: (d.tokens(rid), d.finish(rid).finish_reason, d.finish(rid).stop_reason)
        for rid in d.outputs
    }
    assert result == {
        "eos": ([5, 6, 2], FinishReason.STOP, None),
        "ignore": ([2, 2, 2], FinishReason.LENGTH, None),
        "min": ([2, 2, 2], FinishReason.STOP, None),  # the third 2 is past min_tokens
        "stop_id": ([5, 42], FinishReason.STOP, 42),
        "len": ([5, 6, 7], FinishReason.LENGTH, None),
        "model_len": ([5, 5, 5, 5], FinishReason.LENGTH, None),  # 8 + 4 = max_model_len
    }
    assert all(o.finish_reason is None for outs in d.outputs.values() for o in outs[:-1])


def test_prompt_of_max_model_len_gets_one_token():
    sched = make_scheduler(max_model_len=16)
    d = driver(sched)
    sched.add_request(make_request("a", prompt(16), 10))
    d.run()
    assert len(d.tokens("a")) == 1
    assert d.finish("a").finish_reason == FinishReason.LENGTH


def test_extra_sampled_tokens_after_a_stop_are_dropped():
    sched = make_scheduler()
    sched.add_request(make_request("a", prompt(4), 10, stop_token_ids=[9]))
    out = sched.schedule()
    by_client = sched.update_from_output(out, ModelRunnerOutput(out.step_id, ["a"], [[5, 9, 7]]))
    (o,) = by_client[0]
    assert o.new_token_ids == [5, 9]
    assert o.finish_reason == FinishReason.STOP and o.stop_reason == 9


# ---------------------------------------------------------------- aborts


def test_abort_waiting_and_running_requests_frees_blocks_without_output():
    sched = make_scheduler(max_num_seqs=1)
    d = driver(sched)
    sched.add_request(make_request("run", prompt(10), 10))
    sched.add_request(make_request("wait", prompt(10, 200), 10))
    d.step()
    assert sched.num_running == 1 and sched.num_waiting == 1
    assert sched.kv.usage() > 0
    sched.finish_requests(["wait", "run", "unknown"], FinishReason.ABORT)
    sched.finish_requests(["run"], FinishReason.ABORT)  # idempotent
    assert sched.kv.usage() == 0.0
    assert sched.num_running == 0 and sched.num_waiting == 0
    assert not sched.has_unfinished_requests()
    out = sched.schedule()
    assert out.finished_request_ids == ["run"]  # the worker never heard of "wait"
    assert out.num_scheduled_tokens == {}
    assert [o.request_id for o in d.outputs.get("run", [])] == ["run"]  # only the first token


def test_token_sampled_for_a_request_aborted_during_the_step_is_discarded():
    sched = make_scheduler()
    d = driver(sched)
    sched.add_request(make_request("a", prompt(4), 10))
    sched.add_request(make_request("b", prompt(4, 200), 10))
    out = sched.schedule()
    runner_out = d.worker.execute(out)
    sched.finish_requests("a", FinishReason.ABORT)
    by_client = sched.update_from_output(out, runner_out)
    assert [o.request_id for o in by_client[0]] == ["b"]
    assert sched.schedule().finished_request_ids == ["a"]


def test_preempted_request_can_be_aborted_while_waiting():
    sched = _preemption_scheduler("fcfs")
    d = driver(sched)
    for name in ("a", "b", "c"):
        sched.add_request(make_request(name, prompt(8, 100 * ord(name)), 12))
    while not any(r.status == RequestStatus.PREEMPTED for r in sched.waiting):
        d.step()
    victim = next(iter(sched.waiting))
    sched.finish_requests([victim.request_id], FinishReason.ABORT)
    d.run()
    assert victim.request_id not in d.sched_outputs[-1].finished_request_ids
    assert sched.kv.usage() == 0.0


# ---------------------------------------------------------------- deltas


def test_cached_requests_carry_only_new_blocks():
    sched = make_scheduler()
    d = driver(sched)
    sched.add_request(make_request("a", prompt(6), 10))  # 6 tokens: 2 blocks
    d.step()
    assert d.sched_outputs[0].new_requests[0].block_ids == sched.kv.block_ids("a")[:2]
    d.run()
    later = [o.cached_requests[0] for o in d.sched_outputs[1:]]
    # positions 6..14 are computed one per step; a new block is needed at 8 and at 12
    assert [len(c.new_block_ids) for c in later] == [0, 0, 1, 0, 0, 0, 1, 0, 0]
    assert [c.num_computed_tokens for c in later] == list(range(6, 15))


def test_request_not_scheduled_for_a_while_gets_all_missed_blocks():
    sched = make_scheduler(max_num_batched_tokens=4)
    d = driver(sched)
    sched.add_request(make_request("a", prompt(3), 20))
    d.step()
    sched.add_request(make_request("b", prompt(30, 200), 1))
    d.run()  # the fake worker asserts the block tables stay complete


# ---------------------------------------------------------------- scheduling never changes outputs


WORKLOAD = [
    ("w0", prompt(23), 9, 2),
    ("w1", prompt(23)[:16] + [7, 7, 7], 12, 0),  # shares 4 blocks with w0
    ("w2", prompt(5, 400), 20, 1),
    ("w3", prompt(37, 700), 5, 0),
    ("w4", prompt(23), 9, 3),  # same prompt as w0
    ("w5", prompt(2, 900), 15, 1),
]


def _run_workload(
    add_all_first: bool = True, ahead: bool = False, **config
) -> dict[str, list[int]]:
    sched = make_scheduler(**config)
    d = driver(sched, ahead=ahead)
    for i, (rid, p, max_tokens, priority) in enumerate(WORKLOAD):
        sched.add_request(make_request(rid, p, max_tokens, priority=priority))
        if not add_all_first:
            d.run()
        elif i % 2:
            d.step()
    d.run()
    assert sched.kv.usage() == 0.0
    if config.get("num_blocks") == 12:
        assert sched.make_stats().num_preemptions > 0
    return {rid: d.tokens(rid) for rid, *_ in WORKLOAD}


@pytest.mark.parametrize(
    "config",
    [
        dict(add_all_first=False),  # each alone
        dict(),
        dict(max_num_batched_tokens=3),  # many chunks
        dict(max_num_batched_tokens=7, long_prefill_token_threshold=2),
        dict(num_blocks=12, max_model_len=48),  # preemptions
        dict(num_blocks=12, max_model_len=48, policy="priority"),
        dict(policy="priority", max_num_seqs=2),
        dict(caching=False, num_blocks=12, max_model_len=48),
    ],
    ids=[
        "alone",
        "together",
        "tiny-budget",
        "threshold",
        "preempt",
        "preempt-prio",
        "prio",
        "nocache",
    ],
)
@pytest.mark.parametrize("ahead", [False, True], ids=["in-turn", "ahead"])
def test_outputs_do_not_depend_on_how_the_work_was_sliced(config, ahead):
    """Also when each step is scheduled before the last one's output is applied (the engine's
    async scheduling): the fake worker checks every position's KV on the way."""
    expected = {rid: expected_tokens(p, n) for rid, p, n, _ in WORKLOAD}
    assert _run_workload(ahead=ahead, **config) == expected


# ---------------------------------------------------------------- stats and validation


def test_stats():
    sched = make_scheduler(num_blocks=40, max_num_seqs=1)
    d = driver(sched)
    sched.add_request(make_request("a", prompt(16), 4))
    sched.add_request(make_request("b", prompt(16), 4))
    d.step()
    stats = sched.make_stats()
    assert (stats.num_running_reqs, stats.num_waiting_reqs) == (1, 1)
    assert stats.kv_cache_usage == pytest.approx(4 / 40)
    assert stats.step_num_tokens == 16
    d.run()
    info = sched.get_stats()
    assert info["num_running"] == 0 and info["num_waiting"] == 0
    assert info["prefix_cache_hits"] == 12
    assert info["prefix_cache_queries"] == 32
    assert info["prefix_cache_hit_rate"] == pytest.approx(12 / 32)
    assert info["num_preemptions"] == 0


def test_invalid_requests_and_configs_are_rejected():
    sched = make_scheduler(max_model_len=16)
    with pytest.raises(ValueError):
        sched.add_request(make_request("long", prompt(17)))
    with pytest.raises(ValueError):
        sched.add_request(make_request("empty", []))
    sched.add_request(make_request("dup", prompt(3)))
    with pytest.raises(ValueError):
        sched.add_request(make_request("dup", prompt(3)))
    with pytest.raises(ValueError):
        make_scheduler(num_blocks=3, max_model_len=16)
    with pytest.raises(ValueError):
        make_scheduler(policy="lottery")


# ---------------------------------------------------------------- resumed streams


def test_a_resumed_request_continues_after_its_delivered_output():
    """EngineCoreRequest.output_token_ids (a stream cut off by another engine's death): they
    count as output (max_tokens) and are not sent again; the rest equals an undisturbed run."""
    full = expected_tokens(prompt(6), 7)
    sched = make_scheduler()
    d = driver(sched)
    resumed = EngineCoreRequest(
        "a", prompt(6), sampling_params=SamplingParams(max_tokens=7), output_token_ids=full[:3]
    )
    request = Request.from_engine_core_request(resumed, BS, next(_arrival))
    assert request.num_output_tokens == 3
    sched.add_request(request)
    d.run()
    assert d.tokens("a") == full[3:]
    assert d.finish("a").finish_reason == FinishReason.LENGTH
