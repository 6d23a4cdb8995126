"""Prefix-aware routing across DP engines: a conversation's next turn follows its cached
prefix; a prefix every engine holds, a short gain or a busy holder leave the choice to load
(running requests weighed lighter than waiting ones when asked)."""

from __future__ import annotations

import random

from switchboard.gateway.engines.membership import EngineMembership
from switchboard.gateway.engines.prefix_routing import PrefixRouting
from switchboard.gateway.engines.routed_prefixes import RoutedPrefixes
from switchboard.gateway.engines.types import EngineHandle
from switchboard.wire.block_hash import extend_block_hashes
from switchboard.wire.engine_msgs import EngineCoreRequest, EngineLoad, EngineReady

BLOCK = 16
ROUTING = PrefixRouting(min_match_tokens=2 * BLOCK, max_imbalance=4)


def handle(rank: int, num_blocks: int = 1024) -> EngineHandle:
    ready = EngineReady(f"e{rank}", rank, 4096, num_blocks, BLOCK, num_blocks * BLOCK, 0, 0)
    return EngineHandle(identity=bytes([rank, 0]), ready=ready)


def request(tokens: list[int], salt: str | None = None) -> EngineCoreRequest:
    return EngineCoreRequest("r", tokens, cache_salt=salt)


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 50_000) for _ in range(n)]


def test_each_conversation_sticks_to_the_engine_that_served_its_last_turn() -> None:
    live = [handle(0), handle(1)]
    rng = random.Random(3)
    system = tokens(0, 3 * BLOCK)  # shared by every conversation
    history = {c: system + tokens(100 + c, 40) for c in range(8)}
    first: dict[int, EngineHandle] = {}
    for c in range(8):  # each conversation stays in flight: its engine's load grows
        first[c] = ROUTING.choose(live, request(history[c]), rng)
        first[c].num_requests += 1
    # One engine held the system prompt at first: it was followed only while that engine was
    # no busier than the other, which then took conversations too (and held it as well).
    assert abs(live[0].num_requests - live[1].num_requests) <= 2
    for turn in range(4):
        for c in range(8):
            history[c] += tokens(1000 * turn + c, 50)
            assert ROUTING.choose(live, request(history[c]), rng) is first[c]


def test_a_prefix_every_engine_holds_gains_nothing_and_load_decides() -> None:
    live = [handle(0), handle(1)]
    system = tokens(0, 8 * BLOCK)
    for engine in live:
        engine.prefix_table.record(_hashes(system + tokens(engine.ready.data_parallel_rank, 20)))
    live[0].num_requests = 3  # e0 busier: the same prefix is cheaper on e1
    picks = {
        ROUTING.choose(live, request(system + tokens(9, 30)), random.Random(s)).engine_id
        for s in range(20)
    }
    assert picks == {"e1"}


def test_a_gain_below_the_minimum_is_not_followed() -> None:
    live = [handle(0), handle(1)]
    short = tokens(5, BLOCK)  # one block: below the two-block minimum
    live[0].prefix_table.record(_hashes(short))
    live[0].num_requests = 1
    assert ROUTING.choose(live, request(short + tokens(6, 40)), random.Random(0)).engine_id == "e1"


def test_a_holder_busier_than_the_threshold_is_passed_over() -> None:
    live = [handle(0), handle(1)]
    prompt = tokens(7, 10 * BLOCK)
    live[0].prefix_table.record(_hashes(prompt))
    live[0].num_requests = 4  # at the threshold, and 160 >= 32 * 5: still followed
    assert ROUTING.choose(live, request(prompt + [1]), random.Random(0)).engine_id == "e0"
    live[0].num_requests = 5  # past it: load decides, whatever the gain
    assert ROUTING.choose(live, request(prompt + [1]), random.Random(0)).engine_id == "e1"


def test_each_request_of_imbalance_asks_for_a_longer_gain() -> None:
    live = [handle(0), handle(1)]
    prompt = tokens(9, 3 * BLOCK)  # a 48-token gain: enough alone, not for one more request
    live[0].prefix_table.record(_hashes(prompt))
    assert ROUTING.choose(live, request(prompt + [1]), random.Random(0)).engine_id == "e0"
    live[0].num_requests = 1  # e0 now one request busier: 48 < 32 * 2
    assert ROUTING.choose(live, request(prompt + [1]), random.Random(0)).engine_id == "e1"


def test_a_salted_prompt_matches_only_its_own_salt() -> None:
    live = [handle(0), handle(1)]
    prompt = tokens(8, 10 * BLOCK)
    live[0].prefix_table.record(_hashes(prompt, "tenant-a"))
    live[0].num_requests = 1
    assert ROUTING.choose(live, request(prompt, "tenant-a"), random.Random(0)).engine_id == "e0"
    assert ROUTING.choose(live, request(prompt, "tenant-b"), random.Random(0)).engine_id == "e1"


def test_the_table_forgets_least_recent_chains_from_their_tail() -> None:
    table = RoutedPrefixes(capacity_blocks=6)
    old, new = _hashes(tokens(1, 4 * BLOCK)), _hashes(tokens(2, 4 * BLOCK))
    table.record(old)
    table.record(new)
    assert len(table) == 6
    assert table.match(new) == 4
    assert table.match(old) == 2  # its two tail blocks went first: the head still matches


def test_running_requests_weigh_less_than_waiting_ones_when_asked() -> None:
    prompt = tokens(11, 10 * BLOCK)  # a 160-token gain on e0
    light = PrefixRouting(min_match_tokens=2 * BLOCK, max_imbalance=4, running_weight=0.25)

    def chosen(routing: PrefixRouting, waiting: int, running: int) -> str:
        live = [handle(0), handle(1)]
        live[0].prefix_table.record(_hashes(prompt))
        live[0].load = EngineLoad(0, num_waiting_reqs=waiting, num_running_reqs=running)
        live[1].load = EngineLoad(1, num_waiting_reqs=0, num_running_reqs=0)
        return routing.choose(live, request(prompt + [1]), random.Random(0)).engine_id

    # Counted whole, six running requests are past the bound; at a quarter, 1.5 asks for
    # 32 * 2.5 = 80 tokens of gain: followed.
    assert chosen(ROUTING, waiting=0, running=6) == "e1"
    assert chosen(light, waiting=0, running=6) == "e0"
    # Waiting requests count whole at any weight.
    assert chosen(light, waiting=6, running=0) == "e1"


def test_membership_routes_by_prefix_only_when_asked() -> None:
    def membership(routing: PrefixRouting | None) -> EngineMembership:
        m = EngineMembership(
            heartbeat_timeout_s=10.0,
            resume_timeout_s=0.0,
            on_changed=lambda: None,
            on_dead=lambda _engine, _why: None,
            prefix_routing=routing,
        )
        m.engines = {0: handle(0), 1: handle(1)}
        return m

    prompt = request(tokens(4, 10 * BLOCK))
    routed = membership(ROUTING)
    chosen = routed.choose(None, prompt)
    assert all(routed.choose(None, prompt) is chosen for _ in range(10))
    plain = membership(None)
    assert {plain.choose(None, prompt).engine_id for _ in range(40)} == {"e0", "e1"}
    assert not any(len(e.prefix_table) for e in plain.engines.values())


def _hashes(token_ids: list[int], salt: str | None = None) -> list[bytes]:
    hashes: list[bytes] = []
    extend_block_hashes(hashes, token_ids, BLOCK, salt)
    return hashes
