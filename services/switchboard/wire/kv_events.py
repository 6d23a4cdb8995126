"""KV-cache events, as vLLM publishes them (``vllm/distributed/kv_events.py``), so that vLLM's
own consumers (llm-d's precise prefix-cache scorer, Dynamo's KV router, vLLM's example
subscriber) read an engine's stream unchanged.

The publisher wire (ZeroMQ), one publisher per engine core (DP rank)::

    PUB     multipart [topic, seq, payload]        seq: 8-byte big-endian, 0, 1, 2, ...
    ROUTER  request   [b"", start_seq]             (a DEALER; a REQ adds the b"" itself)
            replies   [b"", seq, payload] ...      every buffered batch with seq >= start_seq
                      [b"", END_SEQ, b""]          END_SEQ: -1 as 8 signed big-endian bytes

``payload`` is a msgpack ``KVEventBatch``: an array ``[ts, events, data_parallel_rank]``
(``array_like`` as vLLM declares it); each event is a map tagged by its class name,
``{"type": "BlockStored", "block_hashes": [...], ...}`` (vLLM declares the events ``tag=True``
and not array-like). A block hash is the 32-byte SHA-256 digest of ``wire/block_hash.py``
(vLLM's ``ExternalBlockHash`` is ``bytes | int``; its default ``sha256`` hashes are bytes too).
"""

from __future__ import annotations

import msgspec

from switchboard.wire.block_hash import BlockHash

MEDIUM_GPU = "GPU"  # vLLM's name for the engine's own KV cache (on a CPU worker too)
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the events; msgpack writes ``"type": <class name>`` in each."""


class BlockStored(KVCacheEvent):
    """Full blocks newly in the prefix cache, a chain: ``block_hashes[0]``'s parent is
    ``parent_block_hash`` (None: it is a first block), each next block's parent is the one
    before it. ``token_ids`` are the blocks' tokens, ``block_size`` per block."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    # No default: vLLM's recent decoders require the key (older ones ignore it).
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    """Blocks evicted from the prefix cache (their KV slots reused)."""

    block_hashes: list[BlockHash]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    """Every cached block forgotten: a prefix-cache reset, sleep, or an engine (re)starting."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float  # time.time() when the batch was made
    events: list[KVEvent]
    data_parallel_rank: int | None = None


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    return _encoder.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """Raises ``msgspec.DecodeError`` (a ``ValueError``) on a malformed payload."""
    return _decoder.decode(payload)


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


def decode_seq(frame: bytes) -> int:
    if len(frame) != 8:
        raise ValueError(f"a sequence number is 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)


def offset_endpoint(endpoint: str, data_parallel_rank: int) -> str:
    """The endpoint of DP rank ``data_parallel_rank``, as vLLM derives it: a tcp:// port plus
    the rank, an inproc:// (or ipc://) name with ``_dp<rank>`` appended; rank 0 as given."""
    if data_parallel_rank == 0:
        return endpoint
    if endpoint.startswith(("inproc://", "ipc://")):
        return f"{endpoint}_dp{data_parallel_rank}"
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        return f"{base}:{int(port) + data_parallel_rank}"
    raise ValueError(f"endpoint {endpoint!r}: must be tcp://, ipc:// or inproc://")


def binds(endpoint: str) -> bool:
    """vLLM's rule for the PUB socket: bind a wildcard or local endpoint, connect otherwise
    (a publisher that connects out to a collector)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))
