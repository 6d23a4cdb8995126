"""What one engine's prefix cache holds, as the router sees it: the block hashes
(``wire/block_hash.py``) it matches a prompt's chain against (``prefix_routing.py``).

Two sources, one table:

* the prompts this gateway routed there (``RoutedPrefixes``): known the moment a request is
  sent, before the engine has computed anything, but only approximate (evictions are guessed,
  other gateways' prompts and the engine's own output blocks unknown);
* the engine's KV events (``--kv-events-config``; ``cache_events.py`` follows them into
  ``follow_events``/``apply``): exact — a block the engine evicts leaves the table,
  ``AllBlocksCleared`` (a reset, sleep, an engine start) empties it, the answers' blocks and
  every gateway's prompts are in it — but a prompt counts only once its prefill ran.

While events are followed a block matches when the engine reported it stored, or when this
gateway routed it there and no event about it has come since (its prefill has not run yet: a
burst of requests with the same new prefix still goes where the first went). Without events
the routed prompts alone decide. A reset this gateway asked for (``reset_prefix_cache``,
``sleep``) empties both at once, whether or not events come.
"""

from __future__ import annotations

from switchboard.gateway.engines.routed_prefixes import RoutedPrefixes
from switchboard.wire.block_hash import BlockHash
from switchboard.wire.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch


class PrefixTable:
    def __init__(self, capacity_blocks: int) -> None:
        self.routed = RoutedPrefixes(capacity_blocks)
        self.cached: set[BlockHash] | None = None  # the engine's own report (None: no events)

    @property
    def exact(self) -> bool:
        """The engine's KV events are followed."""
        return self.cached is not None

    def __len__(self) -> int:
        return len(self.routed) + len(self.cached or ())

    def match(self, hashes: list[BlockHash]) -> int:
        """How many of ``hashes`` (a prompt's chain) lead it here: the cached prefix, in blocks."""
        cached = self.cached
        if cached is None:
            return self.routed.match(hashes)
        routed = self.routed
        for i, block_hash in enumerate(hashes):
            if block_hash not in cached and not routed.holds(block_hash):
                return i
        return len(hashes)

    def record(self, hashes: list[BlockHash]) -> None:
        """A prompt with these block hashes was sent here."""
        self.routed.record(hashes)

    def follow_events(self, snapshot: list[BlockHash]) -> None:
        """From now on the engine's events say what it holds, starting from ``snapshot``
        (every block it held when its next event batch was numbered ``next_seq``)."""
        self.cached = set(snapshot)

    def unfollow(self) -> None:
        """The events stopped (their socket broke, batches were lost): back to the routed
        prompts alone until they are followed again."""
        self.cached = None

    def apply(self, batch: KVEventBatch) -> None:
        cached = self.cached
        if cached is None:
            return
        for event in batch.events:
            if isinstance(event, BlockStored):
                cached.update(event.block_hashes)
                self.routed.discard(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                cached.difference_update(event.block_hashes)
                self.routed.discard(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                self.clear()

    def clear(self) -> None:
        """The engine's prefix cache was emptied."""
        self.routed.clear()
        if self.cached is not None:
            self.cached.clear()
