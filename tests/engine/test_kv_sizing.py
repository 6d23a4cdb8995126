"""KV sizing (max_model_len fitted to the cache) and the scheduler side of sleeping, no model."""

from __future__ import annotations

import logging

import pytest
from test_scheduler import BS, driver, expected_tokens, make_request, make_scheduler, prompt

from switchboard.engine.kv_sizing import check_num_blocks, fit_max_model_len
from switchboard.wire.engine_msgs import EventType


def test_max_model_len_defaults_to_the_models_positions_when_the_cache_holds_them():
    assert fit_max_model_len(None, 512, kv_capacity_tokens=4096) == 512
    assert fit_max_model_len(300, 512, kv_capacity_tokens=4096) == 300


def test_max_model_len_is_capped_by_the_models_positions(caplog):
    with caplog.at_level(logging.WARNING):
        assert fit_max_model_len(1000, 512, kv_capacity_tokens=4096) == 512
    assert "exceeds the model's 512 positions" in caplog.text


def test_max_model_len_is_auto_fitted_down_to_the_kv_capacity_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING):
        assert fit_max_model_len(None, 512, kv_capacity_tokens=160) == 160
    assert "auto-fitted down to 160" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert fit_max_model_len(400, 512, kv_capacity_tokens=160) == 160
    assert "auto-fitted" in caplog.text


def test_a_cache_without_blocks_fails_the_start_with_a_hint():
    assert check_num_blocks(3, 16, "test") == 3
    with pytest.raises(RuntimeError, match="kv-cache-memory-bytes"):
        check_num_blocks(0, 16, "the workers' memory budget")


def test_preempt_all_puts_running_requests_back_and_they_finish_identically():
    """What sleep does to the scheduler: every running request is preempted, the prefix cache
    is reset (the device memory is gone), and after waking they recompute and finish with the
    same tokens."""
    sched = make_scheduler(num_blocks=32, max_model_len=64)
    d = driver(sched)
    prompts = {"a": prompt(9, 100), "b": prompt(6, 300), "c": prompt(5, 600)}
    for name, p in prompts.items():
        sched.add_request(make_request(name, p, max_tokens=6))
    for _ in range(3):
        d.step()
    assert sched.num_running == 3
    assert sched.preempt_all() == 3
    assert sched.num_running == 0 and sched.num_waiting == 3
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    assert sched.reset_prefix_cache()
    assert [r.request_id for r in sched.waiting] == ["a", "b", "c"]  # arrival order kept
    d.worker.states.clear()  # a sleeping worker drops every request's state ...
    d.worker.slots = [[None] * BS for _ in range(sched.kv.num_blocks)]  # ... and the KV
    d.run()
    for name, p in prompts.items():
        assert d.tokens(name) == expected_tokens(p, 6), name
        assert d.finish(name).num_preemptions == 1
        types = [e.type for o in d.outputs[name] if o.events for e in o.events]
        assert types.count(EventType.PREEMPTED) == 1
    assert sched.preempt_all() == 0  # idle: nothing to do
