"""What one engine's prefix cache probably holds, as this gateway sees it: the block hashes of
the prompts it routed there (``wire/block_hash.py``, the hashes the engine keys its cache by),
most recent last, at most as many as the engine has KV blocks.

An approximation, as SGLang's router keeps one: the engine may have evicted sooner (its output
blocks take room too, other gateways' requests as well), and it also holds other gateways'
prompts, which this table does not know. Both only make a routing choice worse, never wrong:
the engine serves whatever it really holds from cache and computes the rest. With the
engine's KV events followed (``prefix_table.py``) it holds only the prompts sent and not yet
reported stored.
"""

from __future__ import annotations

from collections import OrderedDict

from switchboard.wire.block_hash import BlockHash


class RoutedPrefixes:
    def __init__(self, capacity_blocks: int) -> None:
        self.capacity_blocks = max(1, capacity_blocks)
        self._recent: OrderedDict[BlockHash, None] = OrderedDict()  # least recent first

    def __len__(self) -> int:
        return len(self._recent)

    def match(self, hashes: list[BlockHash]) -> int:
        """How many of ``hashes`` (a prompt's chain) lead it here: the cached prefix, in blocks."""
        recent = self._recent
        for i, block_hash in enumerate(hashes):
            if block_hash not in recent:
                return i
        return len(hashes)

    def holds(self, block_hash: BlockHash) -> bool:
        return block_hash in self._recent

    def record(self, hashes: list[BlockHash]) -> None:
        """The prompt with these block hashes was sent here. Its tail is made the least recent
        (the engine too frees a chain tail first), so that forgetting cuts a chain from its end
        and the rest still matches."""
        recent = self._recent
        for block_hash in reversed(hashes):
            recent[block_hash] = None
            recent.move_to_end(block_hash)
        while len(recent) > self.capacity_blocks:
            recent.popitem(last=False)

    def discard(self, hashes: list[BlockHash]) -> None:
        recent = self._recent
        for block_hash in hashes:
            recent.pop(block_hash, None)

    def clear(self) -> None:
        self._recent.clear()
