"""The router's per-engine prefix table fed by a real cache manager's KV events (stores,
evictions, a reset): it matches what the engine's cache holds, plus what was sent there and not
yet computed; without events, and after a reset this gateway asked for, it forgets."""

from __future__ import annotations

import random

from switchboard.engine.kv_cache import KVCacheManager
from switchboard.gateway.engines.prefix_table import PrefixTable
from switchboard.wire.block_hash import extend_block_hashes
from switchboard.wire.kv_events import KVEventBatch, decode_batch, encode_batch
from tests.engine.test_kv_cache import BS, compute, make_request


def chain(tokens: list[int]) -> list[bytes]:
    hashes: list[bytes] = []
    extend_block_hashes(hashes, tokens, BS, None)
    return hashes


def cached_prefix(kv: KVCacheManager, tokens: list[int]) -> int:
    """How many of the prompt's blocks the engine's cache holds, as its own hit lookup says."""
    _, num_hit = kv.get_computed_blocks(make_request("probe", tokens + [0]))
    return num_hit // BS


class Engine:
    """A cache manager whose events reach a table through the wire codec, batch by batch."""

    def __init__(self, num_blocks: int) -> None:
        self.kv = KVCacheManager(num_blocks=num_blocks, block_size=BS)
        self.kv.pool.events = []
        self.table = PrefixTable(num_blocks)
        self.table.follow_events(sorted(self.kv.pool.cached_hashes()))

    def serve(self, name: str, tokens: list[int]) -> None:
        request = make_request(name, tokens)
        compute(self.kv, request)
        self.kv.free(request)
        self.publish()

    def publish(self) -> None:
        events = self.kv.pool.events
        assert events is not None
        self.table.apply(decode_batch(encode_batch(KVEventBatch(0.0, list(events), 0))))
        events.clear()


def test_the_table_follows_stores_and_evictions_exactly() -> None:
    engine = Engine(num_blocks=24)
    rng = random.Random(5)
    system = [rng.randrange(1000) for _ in range(3 * BS)]
    conversations = {c: list(system) for c in range(6)}
    for turn in range(5):
        for c, history in conversations.items():
            history += [rng.randrange(1000) for _ in range(rng.randrange(BS, 3 * BS))]
            engine.serve(f"{c}-{turn}", history)
        for history in conversations.values():  # evictions included: the cache is small
            assert engine.table.match(chain(history)) == cached_prefix(engine.kv, history)
    assert engine.table.cached == set(engine.kv.pool.cached_hashes())
    assert len(engine.kv.pool.cached_hashes()) < sum(len(chain(h)) for h in conversations.values())


def test_a_prompt_sent_but_not_yet_computed_matches_until_an_event_speaks_of_it() -> None:
    engine = Engine(num_blocks=8)
    prompt = list(range(100, 100 + 4 * BS))
    engine.table.record(chain(prompt))  # routed there; its prefill has not run
    assert engine.table.match(chain(prompt)) == 4
    engine.serve("p", prompt)  # stored: the events hold it now
    assert engine.table.match(chain(prompt)) == 4 and not len(engine.table.routed)
    for i in range(3):  # other prompts evict it
        engine.serve(f"q{i}", list(range(1000 * (i + 1), 1000 * (i + 1) + 4 * BS)))
    assert cached_prefix(engine.kv, prompt) == 0
    assert engine.table.match(chain(prompt)) == 0


def test_a_reset_clears_the_table_by_event_and_by_request() -> None:
    engine = Engine(num_blocks=16)
    prompt = list(range(7, 7 + 3 * BS))
    engine.serve("a", prompt)
    engine.table.record(chain(list(range(900, 900 + 2 * BS))))  # sent, not computed
    assert engine.kv.reset_prefix_cache()
    engine.publish()  # AllBlocksCleared
    assert engine.table.match(chain(prompt)) == 0 and len(engine.table) == 0
    engine.serve("b", prompt)
    assert engine.table.match(chain(prompt)) == 3
    engine.table.clear()  # the gateway's own reset_prefix_cache succeeded
    assert engine.table.match(chain(prompt)) == 0


def test_without_events_the_routed_prompts_alone_decide() -> None:
    engine = Engine(num_blocks=16)
    served = list(range(50, 50 + 3 * BS))
    engine.serve("a", served)
    engine.table.unfollow()  # the event stream broke
    assert engine.table.match(chain(served)) == 0  # the engine's report is no longer trusted
    sent = list(range(400, 400 + 2 * BS))
    engine.table.record(chain(sent))
    assert engine.table.match(chain(sent + [1] * BS)) == 2
    engine.table.apply(KVEventBatch(0.0, [], 0))  # an event while not following: ignored
    assert not engine.table.exact
