"""The pool of fixed-size KV blocks: reference counts, the free lists and the prefix-cache map.

Every block is in exactly one of three places::

    in use (ref_cnt > 0) ----free, no hash----> plain free stack   (reused first, LIFO)
         ^   ^           ----free, hashed-----> cached free LRU    (evicted oldest first)
         |   +--prefix hit (touch)-------------------------+
         +------------------allocate-----------------------+ (plain stack first, then the
                                                               LRU head, dropping its hash)

A hashed block keeps its KV after it is freed so that a later request with the same prefix can
take it back (``touch``); it is evicted only when a block is really needed and no plain free
block is left. The free lists are a Python list and an ``OrderedDict`` (O(1) pop, append and
removal from the middle, all in C) instead of vLLM's hand-made doubly linked list.

With KV events on (``events`` a list), every change of the set of cached hashes is recorded
there in order, as vLLM's events (``wire/kv_events.py``): the cache manager records the blocks
it registers, the pool what it evicts and clears; the engine publishes them after each step.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable

from switchboard.wire.block_hash import BlockHash
from switchboard.wire.kv_events import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, KVEvent

logger = logging.getLogger(__name__)


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None  # set while registered in the prefix cache

    def __repr__(self) -> str:
        return f"KVCacheBlock({self.block_id}, ref_cnt={self.ref_cnt})"


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        # Top of the stack (the end) is reused next; block 0 first at start for locality.
        self._free_plain: list[KVCacheBlock] = self.blocks[::-1]
        self._free_cached: OrderedDict[int, KVCacheBlock] = OrderedDict()  # oldest first
        self._cached: dict[BlockHash, KVCacheBlock] = {}
        self.num_evictions = 0
        self.events: list[KVEvent] | None = None  # a list: KV events are recorded there

    @property
    def num_free_blocks(self) -> int:
        """Blocks that an allocation can take, evictable cached blocks included."""
        return len(self._free_plain) + len(self._free_cached)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def usage(self) -> float:
        """Fraction of blocks in use by requests (0..1); evictable cached blocks count as free."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def cached_hashes(self) -> list[BlockHash]:
        return list(self._cached)

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self._cached.get(block_hash)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits, pulling free ones out of the LRU."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free_cached[block.block_id]
            block.ref_cnt += 1

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """n blocks with ref_cnt 1; the caller checked ``num_free_blocks``."""
        if n > self.num_free_blocks:
            raise RuntimeError(f"asked for {n} blocks, {self.num_free_blocks} free")
        taken: list[KVCacheBlock] = []
        plain = self._free_plain
        for _ in range(n):
            if plain:
                block = plain.pop()
            else:
                _, block = self._free_cached.popitem(last=False)
                self._evict(block)
            block.ref_cnt = 1
            taken.append(block)
        return taken

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference each, in the given order (pass a chain tail first: the tail of
        a cached prefix is then evicted before its head)."""
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self._free_plain.append(block)
                else:
                    self._free_cached[block.block_id] = block

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash) -> bool:
        """Register a computed full block; False if another block already holds this hash
        (the duplicate stays unregistered and is recycled as a plain block when freed)."""
        if block_hash in self._cached:
            return False
        block.block_hash = block_hash
        self._cached[block_hash] = block
        return True

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (e.g. after new weights). Refused (False) while any block
        is in use, because running requests would keep registering blocks of the old state."""
        in_use = self.num_blocks - self.num_free_blocks
        if in_use:
            logger.warning("prefix cache not reset: %d blocks are still in use", in_use)
            return False
        for block in self._free_cached.values():
            block.block_hash = None
            self._free_plain.append(block)
        self._free_cached.clear()
        self._cached.clear()
        if self.events is not None:
            self.events.append(AllBlocksCleared())
        logger.info("prefix cache reset")
        return True

    def _evict(self, block: KVCacheBlock) -> None:
        """A block of ``_free_cached``: registered, so it has a hash."""
        assert block.block_hash is not None
        del self._cached[block.block_hash]
        if self.events is not None:
            last = self.events[-1] if self.events else None
            if isinstance(last, BlockRemoved):  # one event for a run of evictions
                last.block_hashes.append(block.block_hash)
            else:
                self.events.append(BlockRemoved([block.block_hash], MEDIUM_GPU))
        block.block_hash = None
        self.num_evictions += 1
