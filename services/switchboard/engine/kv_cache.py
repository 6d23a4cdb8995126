"""The paged KV cache as the scheduler sees it: per-request block tables over a block pool.

A request's block table lists the blocks that hold its tokens' KV in order: token ``t`` lives in
block ``block_table[t // block_size]`` at offset ``t % block_size``. Blocks are allocated as
tokens need slots; a prefix-cache hit puts shared blocks at the head of a new table.

When a block's tokens have been computed (after the forward pass, in ``cache_blocks``) the block
is registered under its chained hash, so a block is never offered to another request before its
KV exists, whatever order a worker computes one step's requests in.
"""

from __future__ import annotations

import logging

from switchboard.engine.block_pool import BlockPool, KVCacheBlock
from switchboard.engine.request import Request
from switchboard.wire.kv_events import MEDIUM_GPU, BlockStored

logger = logging.getLogger(__name__)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[str, list[KVCacheBlock]] = {}
        self._block_ids: dict[str, list[int]] = {}  # the same tables as ids (what workers see)
        self._num_registered: dict[str, int] = {}  # leading blocks already in the prefix cache
        # Prefix-cache counters (tokens), cumulative since start-up.
        self.prefix_queries = 0
        self.prefix_hits = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table (empty if it holds none); do not mutate."""
        return self._block_ids.get(request_id, [])

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of the request's tokens: (blocks, number of tokens).

        At most ``num_tokens - 1`` tokens: the last token is always recomputed because the
        sampler needs its logits. Takes no reference (``allocate_slots`` does).
        """
        if not self.enable_caching:
            return [], 0
        request.update_block_hashes()
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        get = self.pool.get_cached_block
        for block_hash in request.block_hashes[:max_blocks]:
            block = get(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count an admitted request's lookup (not retries of one that did not fit)."""
        self.prefix_queries += num_tokens
        self.prefix_hits += num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
    ) -> list[int] | None:
        """Make room for ``num_new_tokens`` more tokens after the request's computed ones (and
        after ``new_computed_blocks``, the prefix hit of a request being admitted).

        Returns the ids of the blocks added to its table (possibly none), or None with nothing
        changed when too few blocks are free.
        """
        rid = request.request_id
        table = self.block_tables.get(rid)
        hits = new_computed_blocks or []
        num_hit = len(hits)
        num_held = (len(table) if table is not None else 0) + num_hit
        num_tokens = request.num_computed_tokens + num_hit * self.block_size + num_new_tokens
        num_needed = -(-num_tokens // self.block_size) - num_held
        if num_needed <= 0 and not num_hit:
            return []
        num_needed = max(num_needed, 0)
        num_revived = sum(b.ref_cnt == 0 for b in hits) if num_hit else 0
        if num_needed + num_revived > self.pool.num_free_blocks:
            return None
        if table is None:
            table = self.block_tables[rid] = []
            ids = self._block_ids[rid] = []
            self._num_registered[rid] = 0
        else:
            ids = self._block_ids[rid]
        added: list[KVCacheBlock] = []
        if num_hit:
            self.pool.touch(hits)
            added.extend(hits)
            # Hits are registered already: registration resumes after them.
            self._num_registered[rid] += num_hit
        if num_needed:
            added.extend(self.pool.get_new_blocks(num_needed))
        table.extend(added)
        new_ids = [b.block_id for b in added]
        ids.extend(new_ids)
        return new_ids

    def cache_blocks(self, request: Request, num_computed_tokens: int | None = None) -> None:
        """Register the request's full blocks whose KV is computed (call after a step):
        those within ``num_computed_tokens`` (default: the request's; less while a later step
        is in flight)."""
        if not self.enable_caching:
            return
        rid = request.request_id
        table = self.block_tables.get(rid)
        if table is None:
            return
        start = self._num_registered[rid]
        if num_computed_tokens is None:
            num_computed_tokens = request.num_computed_tokens
        end = min(num_computed_tokens // self.block_size, len(table))
        if end <= start:
            return
        request.update_block_hashes()
        end = min(end, len(request.block_hashes))
        hashes = request.block_hashes
        events = self.pool.events
        run_start = -1  # the first block of the run of newly registered ones (KV events)
        for i in range(start, end):
            block = table[i]
            stored = block.block_hash is None and self.pool.cache_block(block, hashes[i])
            if events is None:
                continue
            if stored and run_start < 0:
                run_start = i
            elif not stored and run_start >= 0:
                events.append(self._stored_event(request, run_start, i))
                run_start = -1
        if events is not None and run_start >= 0:
            events.append(self._stored_event(request, run_start, end))
        self._num_registered[rid] = end

    def _stored_event(self, request: Request, start: int, end: int) -> BlockStored:
        """Blocks ``start..end-1`` of ``request``, newly in the prefix cache, as one event."""
        size = self.block_size
        return BlockStored(
            block_hashes=request.block_hashes[start:end],
            parent_block_hash=request.block_hashes[start - 1] if start else None,
            token_ids=request.all_token_ids[start * size : end * size],
            block_size=size,
            lora_id=None,
            medium=MEDIUM_GPU,
            lora_name=None,
        )

    def free(self, request: Request) -> None:
        """Release the request's blocks (tail first, so a cached chain is evicted tail first)."""
        rid = request.request_id
        table = self.block_tables.pop(rid, None)
        if table is None:
            return
        del self._block_ids[rid]
        del self._num_registered[rid]
        self.pool.free_blocks(reversed(table))

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()
