"""Speculative decoding in the scheduler, driven by the fake worker (which verifies proposals the
way the real one does and checks the KV of every position it reads): the same tokens with and
without speculation, proposals accepted where the text repeats, rejected positions never taken
for computed ones, and the limits (max_tokens, max_model_len, stops) held."""

from __future__ import annotations

import json

import pytest
from fake_worker import Driver, FakeWorker, default_token
from test_scheduler import BS, make_request, prompt

from switchboard.config import CacheConfig, SchedulerConfig
from switchboard.config.speculative import parse_speculative_config
from switchboard.engine.scheduler import Scheduler
from switchboard.engine.speculation import speculator as speculator_module
from switchboard.engine.speculation.ngram import propose_ngram
from switchboard.engine.speculation.speculator import MAX_DRY_LOOKUPS, MAX_MISSES
from switchboard.wire.engine_msgs import FinishReason, StructuredOutputParams

NGRAM = json.dumps(
    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
)
CYCLE = [11, 12, 13, 14, 15, 16, 17]


def cyclic_token(request_id: str, token_ids: list[int]) -> int:
    """Text that repeats itself: what an n-gram proposer predicts once it has seen a cycle."""
    return CYCLE[len(token_ids) % len(CYCLE)]


def make_scheduler(
    speculative_config: str = NGRAM,
    num_blocks: int = 64,
    max_model_len: int = 128,
    caching: bool = True,
    max_num_batched_tokens: int = 64,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_seqs=16,
            max_num_batched_tokens=max_num_batched_tokens,
            speculative_config=speculative_config,
        ),
        CacheConfig(block_size=BS, enable_prefix_caching=caching),
        num_blocks,
        max_model_len,
    )


def run(
    speculative_config: str,
    requests: list[tuple[str, list[int], int, dict]],
    token_fn=cyclic_token,
    ahead: str = "",
    **scheduler_kwargs,
) -> tuple[Driver, Scheduler]:
    """``ahead``: "" one step at a time, "engine" scheduling ahead as the engine does (not
    after a step with proposals), "always" ahead of every step (a request whose proposals are
    in flight then sits the step out)."""
    sched = make_scheduler(speculative_config, **scheduler_kwargs)
    worker = FakeWorker(BS, sched.kv.num_blocks, token_fn)
    d = Driver(sched, worker, ahead=bool(ahead), always_ahead=ahead == "always")
    for rid, prompt_ids, max_tokens, params in requests:
        sched.add_request(make_request(rid, prompt_ids, max_tokens, **params))
    d.run()
    assert sched.kv.usage() == 0.0 and not sched.requests
    return d, sched


def proposed_tokens(d: Driver) -> int:
    return sum(len(p) for out in d.sched_outputs for p in out.scheduled_spec_decode_tokens.values())


REQUESTS = [
    ("a", prompt(6), 40, {}),
    ("b", [11, 12, 13, 14, 15], 33, {}),
    ("c", prompt(9, start=300), 25, {"eos_token_ids": [999]}),
]


@pytest.mark.parametrize("token_fn", [cyclic_token, default_token])
@pytest.mark.parametrize("ahead", ["", "engine", "always"])
def test_the_same_tokens_with_and_without_speculation(token_fn, ahead):
    off, _ = run("", REQUESTS, token_fn, ahead)
    on, sched = run(NGRAM, REQUESTS, token_fn, ahead)
    for rid, _, max_tokens, _ in REQUESTS:
        assert on.tokens(rid) == off.tokens(rid)
        assert len(on.tokens(rid)) == max_tokens
    stats = sched.make_stats()
    assert stats.spec_decode_num_draft_tokens == proposed_tokens(on)
    if token_fn is cyclic_token and ahead != "always":  # repetitive: most are accepted
        assert stats.spec_decode_num_accepted_tokens > stats.spec_decode_num_draft_tokens // 2
        assert len(on.sched_outputs) < len(off.sched_outputs) * 2 // 3
    assert stats.spec_decode_accepted_per_position[0] <= stats.spec_decode_num_drafts


def test_outputs_carry_the_request_s_proposed_and_accepted_tokens():
    d, sched = run(NGRAM, [("a", prompt(5), 30, {})])
    outputs = d.outputs["a"]
    assert sum(o.num_draft_tokens for o in outputs) == proposed_tokens(d) > 0
    accepted = sum(o.num_accepted_tokens for o in outputs)
    assert accepted == sched.make_stats().spec_decode_num_accepted_tokens > 0
    for o in outputs:  # each output: the accepted proposals and one token of the model's own
        if o.num_draft_tokens and o.finish_reason is None:
            assert len(o.new_token_ids) == o.num_accepted_tokens + 1


@pytest.mark.parametrize("ahead", ["", "engine"])
@pytest.mark.parametrize("max_tokens", [1, 2, 3, 9, 10])
def test_never_a_token_or_a_computed_position_past_max_tokens_or_max_model_len(max_tokens, ahead):
    requests = [("a", [11, 12, 13, 14, 15, 16, 17, 11, 12], max_tokens, {})]
    d, _ = run(NGRAM, requests, ahead=ahead)
    assert len(d.tokens("a")) == max_tokens
    assert d.finish("a").finish_reason == FinishReason.LENGTH
    computed = sum(out.num_scheduled_tokens.get("a", 0) for out in d.sched_outputs)
    assert computed <= 9 + max_tokens - 1  # the last token is sampled, never computed
    for max_model_len in (12, 20):
        edge = [("edge", prompt(7, start=11), 50, {})]
        d, _ = run(NGRAM, edge, ahead=ahead, max_model_len=max_model_len)
        assert len(d.tokens("edge")) == max_model_len - 7
        computed = sum(out.num_scheduled_tokens.get("edge", 0) for out in d.sched_outputs)
        assert computed <= max_model_len - 1


@pytest.mark.parametrize("ahead", ["", "engine"])
def test_a_stop_token_among_accepted_proposals_ends_the_request_there(ahead):
    requests = [("a", [11, 12, 13, 14, 15, 16, 17], 40, {"stop_token_ids": [16]})]
    d, sched = run(NGRAM, requests, ahead=ahead)
    off, _ = run("", requests, ahead=ahead)
    assert d.tokens("a") == off.tokens("a") == [11, 12, 13, 14, 15, 16]
    assert d.finish("a").finish_reason == FinishReason.STOP
    assert d.finish("a").stop_reason == 16
    assert sched.make_stats().spec_decode_num_accepted_tokens > 0  # ended inside proposals


@pytest.mark.parametrize("ahead", ["", "engine"])
def test_preemption_and_prefix_caching_keep_the_tokens(ahead):
    # Few blocks: requests preempt each other and resume from the prefix cache.
    shared = [11, 12, 13, 14, 15, 16, 17, 11]
    requests = [(f"r{i}", shared + [100 + i], 30, {}) for i in range(4)]
    off, _ = run("", requests, ahead=ahead, num_blocks=24, max_model_len=64)
    on, sched = run(NGRAM, requests, ahead=ahead, num_blocks=24, max_model_len=64)
    assert sched.counters.num_preemptions > 0
    assert sched.kv.prefix_hits > 0
    for rid, *_ in requests:
        assert on.tokens(rid) == off.tokens(rid)


@pytest.mark.parametrize("ahead", ["", "engine"])
def test_no_proposals_while_prefilling_in_chunks(ahead):
    # A 40-token prompt in chunks of 8: the fake worker refuses proposals before the end.
    requests = [("long", [11, 12, 13, 14, 15, 16, 17] * 5 + [11] * 5, 20, {})]
    off, _ = run("", requests, ahead=ahead, max_num_batched_tokens=8)
    on, _ = run(NGRAM, requests, ahead=ahead, max_num_batched_tokens=8)
    assert on.tokens("long") == off.tokens("long")
    assert proposed_tokens(on) > 0


@pytest.mark.parametrize("ahead", ["", "engine"])
def test_requests_that_speculation_would_change_never_propose(ahead):
    grammar = StructuredOutputParams("regex", "[a-z]+")
    params = [
        {"presence_penalty": 0.5},
        {"frequency_penalty": 0.5},
        {"repetition_penalty": 1.2},
        {"bad_words_token_ids": [[13, 14]]},
    ]
    requests = [(f"p{i}", [11, 12, 13, 14, 15], 20, p) for i, p in enumerate(params)]
    d, _ = run(NGRAM, requests, ahead=ahead)
    assert proposed_tokens(d) == 0
    sched = make_scheduler()
    request = make_request("g", [11, 12, 13], 20, structured_output=grammar)
    request.grammar = object()  # any grammar: the engine's matcher cannot roll back
    assert not sched.speculator.will_propose(request)  # type: ignore[union-attr]


@pytest.mark.parametrize("ahead", ["", "engine"])
def test_min_tokens_holds_proposals_back_until_reached(ahead):
    requests = [("a", [11, 12, 13, 14, 15, 16, 17], 30, {"min_tokens": 12})]
    d, _ = run(NGRAM, requests, ahead=ahead)
    first = next(i for i, out in enumerate(d.sched_outputs) if out.scheduled_spec_decode_tokens)
    before = sum(out.num_scheduled_tokens.get("a", 0) for out in d.sched_outputs[:first])
    assert before >= 7 + 12 - 1  # prompt + min_tokens outputs computed first


def test_a_request_whose_proposals_keep_failing_stops_proposing():
    # default_token never repeats: proposals (from single-token matches) are all rejected.
    requests = [("a", [5, 6, 5, 6, 5, 6, 5, 6], 120, {})]
    d, sched = run(NGRAM, requests, default_token, max_model_len=256)
    steps_with_proposals = sum(1 for out in d.sched_outputs if out.scheduled_spec_decode_tokens)
    decode_steps = len(d.sched_outputs) - 1
    assert sched.make_stats().spec_decode_num_accepted_tokens == 0
    # pauses of 8, 16, 32, 64 output tokens after MAX_MISSES misses each
    assert steps_with_proposals <= 5 * MAX_MISSES
    assert steps_with_proposals < decode_steps // 4


def test_a_request_whose_lookups_find_nothing_never_holds_a_step_back(monkeypatch):
    # Every output token is new: a lookup never finds a match. The lookups are made in steps
    # scheduled ahead (from the tokens the engine has), so none makes the engine wait for the
    # request's latest token; after MAX_DRY_LOOKUPS dry ones in a row the request pauses them.
    def unseen_token(request_id: str, token_ids: list[int]) -> int:
        return 5000 + len(token_ids)

    sched = make_scheduler(max_model_len=256)
    worker = FakeWorker(BS, sched.kv.num_blocks, unseen_token)
    d = Driver(sched, worker, ahead=True)
    sched.add_request(make_request("a", prompt(8), 120))
    held_back: list[bool] = []
    lookups: list[int] = []  # the request's tokens in flight at each lookup
    wants = sched.wants_latest_tokens

    def spied_wants() -> bool:
        held_back.append(wants())
        return held_back[-1]

    def spied_lookup(token_ids, index, num_tokens, min_n, max_n):
        lookups.append(sched.requests["a"].num_pending_samples)
        return propose_ngram(token_ids, index, num_tokens, min_n, max_n)

    sched.wants_latest_tokens = spied_wants  # type: ignore[method-assign]
    monkeypatch.setattr(speculator_module, "propose_ngram", spied_lookup)
    d.run()
    assert proposed_tokens(d) == 0
    assert d.tokens("a") == [unseen_token("a", [0] * n) for n in range(8, 128)]
    assert len(held_back) > 100 and not any(held_back)
    # dry streaks, each followed by a pause (8, 16, 32, 64 output tokens)
    assert 2 * MAX_DRY_LOOKUPS < len(lookups) <= 5 * MAX_DRY_LOOKUPS
    # each in a step scheduled ahead, while the engine did not have the request's latest token
    assert set(lookups) == {1}


def test_proposals_looked_up_ahead_of_a_token_in_flight_are_verified_and_accepted():
    # Text that repeats: after a step without proposals the next is scheduled ahead, and the
    # request proposes what follows the lookup's guess of the token in flight.
    sched = make_scheduler()
    worker = FakeWorker(BS, sched.kv.num_blocks, cyclic_token)
    d = Driver(sched, worker, ahead=True)
    sched.add_request(make_request("a", prompt(6), 60))
    propose, accept = sched.speculator.propose, sched.speculator.accept
    proposed_ahead: dict[str, bool] = {}
    verdicts: list[tuple[bool, int, int]] = []  # (proposed ahead, proposed, accepted)

    def spied_propose(request, max_tokens, decoding=1, pending=0):
        drafts = propose(request, max_tokens, decoding, pending)
        proposed_ahead[request.request_id] = bool(drafts) and pending > 0
        return drafts

    def spied_accept(request, num_proposed, num_accepted):
        verdicts.append((proposed_ahead[request.request_id], num_proposed, num_accepted))
        accept(request, num_proposed, num_accepted)

    sched.speculator.propose = spied_propose  # type: ignore[method-assign]
    sched.speculator.accept = spied_accept  # type: ignore[method-assign]
    d.run()
    off, _ = run("", [("a", prompt(6), 60, {})], cyclic_token)
    assert d.tokens("a") == off.tokens("a")
    ahead = [accepted for was_ahead, _, accepted in verdicts if was_ahead]
    assert ahead and sum(ahead) > 0
    # the steps after those that verified proposals waited for them: every proposal settled
    assert sum(n for _, n, _ in verdicts) == proposed_tokens(d)


def test_the_config_is_vllm_s_json_and_bad_values_are_refused():
    config = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 3}')
    assert config is not None
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (5, 5)
    config = parse_speculative_config(
        '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'
    )
    assert config is not None and (config.prompt_lookup_min, config.prompt_lookup_max) == (4, 4)
    assert parse_speculative_config("") is None
    for bad, says in [
        ("{", "not JSON"),
        ('{"method": "eagle", "num_speculative_tokens": 2}', "not supported"),
        ('{"method": "ngram"}', "num_speculative_tokens"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "lookup": 3}', "lookup"),
        ('{"model": "", "num_speculative_tokens": 2}', "needs"),
        (
            '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, '
            '"prompt_lookup_max": 2}',
            "prompt_lookup_min",
        ),
    ]:
        with pytest.raises(ValueError, match=says):
            parse_speculative_config(bad)


def test_the_flag_reaches_the_engine_and_a_bad_one_stops_serve(capsys):
    from switchboard import cli
    from switchboard.cli import serve

    args = cli.make_parser().parse_args(["serve", "--model", "/m", "--speculative-config", NGRAM])
    assert serve.build_configs(args, "/m")[1].scheduler.speculative_config == NGRAM
    parser = cli.make_parser()
    bad = ["serve", "--model", "/m", "--speculative-config", '{"method": "ngram"}']
    with pytest.raises(SystemExit) as exit_info:
        serve.prepare(parser, parser.parse_args(bad))
    assert exit_info.value.code == 2
    assert "num_speculative_tokens" in capsys.readouterr().err


def test_the_proposal_length_follows_what_was_accepted():
    sched = make_scheduler()
    speculator = sched.speculator
    assert speculator is not None
    request = make_request("a", [11, 12, 13] * 4 + [11, 12], 40)
    state = speculator.state(request)
    assert state.proposal_len() == 4  # a request starts at FIRST_LEN (4, the full length here)
    lengths = []
    # all accepted: twice as many next, up to num_speculative_tokens; else one past the accepted
    for proposed, accepted in ((4, 0), (1, 1), (2, 2), (4, 4), (4, 2), (3, 0), (1, 1), (2, 2)):
        state.record(proposed, accepted, 0)
        lengths.append(state.proposal_len())
    assert lengths == [1, 2, 4, 4, 3, 1, 2, 4]
    request.append_output_token(13)
    assert len(speculator.propose(request, 10)) == 4


def test_the_ngram_proposer_takes_the_longest_most_recent_match():
    from switchboard.engine.speculation.ngram import TokenIndex, propose_ngram

    def propose(tokens, k=4, low=1, high=3):
        return propose_ngram(tokens, TokenIndex(), k, low, high)

    assert propose([1, 2, 3, 1, 2]) == [3, 1, 2, 3]  # the copy continues past the end
    assert propose([7, 2, 9, 5, 8, 2, 4, 4, 8, 2]) == [4, 4, 8, 2]  # "8 2" beats the later "2"
    assert propose([5, 2, 6, 1, 2]) == [6, 1, 2, 6]  # one token suffices with min 1
    assert propose([5, 2, 6, 1, 2], low=2) == []
    assert propose([1, 2, 3, 4]) == []  # the last token never occurred before
    assert propose([1, 2, 3, 1, 2], k=2) == [3, 1]


def test_a_resumed_stream_proposes_from_its_earlier_output_too():
    """A request resumed after an engine death arrives with its output so far: the lookup sees
    prompt and output alike, and the tokens are those of the first engine."""
    from switchboard.engine.request import Request
    from switchboard.wire.engine_msgs import EngineCoreRequest, SamplingParams

    first, _ = run(NGRAM, [("a", [11, 12, 13], 30, {})])
    tokens = first.tokens("a")
    outputs: dict[str, list[int]] = {}
    for config in ("", NGRAM):
        sched = make_scheduler(config)
        d = Driver(sched, FakeWorker(BS, sched.kv.num_blocks, cyclic_token))
        resumed = EngineCoreRequest(
            "a", [11, 12, 13], sampling_params=SamplingParams(max_tokens=30)
        )
        resumed.output_token_ids = tokens[:10]
        sched.add_request(Request.from_engine_core_request(resumed, BS, 1))
        d.run()
        outputs[config] = d.tokens("a")
        if config:
            assert proposed_tokens(d) > 0
    assert outputs[""] == outputs[NGRAM] == tokens[10:]


def test_no_proposals_while_more_requests_run_than_disable_by_batch_size():
    config = json.dumps({**json.loads(NGRAM), "disable_by_batch_size": 2})
    requests = [("a", prompt(5, 11), 10, {}), ("b", prompt(5, 20), 30, {}), ("c", [11] * 4, 30, {})]
    d, _ = run(config, requests)
    off, _ = run("", requests)
    assert proposed_tokens(d) > 0  # once "a" ended, two run and propose
    first = next(i for i, out in enumerate(d.sched_outputs) if out.scheduled_spec_decode_tokens)
    assert all("a" not in out.num_scheduled_tokens for out in d.sched_outputs[first:])
    for rid, *_ in requests:
        assert d.tokens(rid) == off.tokens(rid)
    parsed = parse_speculative_config(NGRAM)
    assert parsed is not None and parsed.disable_by_batch_size == 8  # the default
