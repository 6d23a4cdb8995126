"""Prefix-cache block hashes: SHA-256 chained over raw little-endian token bytes.

A block's hash names the whole prefix that ends with it, so two requests can share a KV block
exactly when their tokens up to the end of that block are equal (and their salts are)::

    hash(block 0) = SHA-256( ROOT_HASH      | tokens[0:B]  as uint32 LE | extra keys )
    hash(block i) = SHA-256( hash(block i-1) | tokens[iB:(i+1)B] as uint32 LE )

``B`` is the block size; only full blocks get a hash. The extra keys of block 0 are
``0x01 | uint32 LE length | utf-8 cache_salt`` when the request has a salt, then
``0x02 | uint32 LE length | utf-8 adapter name`` when it runs with a LoRA adapter (its KV
differs from the base model's and every other adapter's), nothing otherwise: the parent hash
and the tokens have fixed lengths, so the encoding is unambiguous, and the salt (and adapter)
flow into every later block through the chain. Nothing is pickled, so any language can compute
the same hashes (e.g. a router that routes by prefix affinity), and a cryptographic hash
means a client cannot craft collisions to read another tenant's KV.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array

BlockHash = bytes  # a 32-byte SHA-256 digest

# The parent of every first block: fixed, so that hashes agree across engines and restarts.
ROOT_HASH: BlockHash = hashlib.sha256(b"switchboard/prefix-cache/v1").digest()

_SALT_TAG = b"\x01"
_LORA_TAG = b"\x02"
_TOKEN_BYTES = 4

if array("I").itemsize != _TOKEN_BYTES:  # pragma: no cover - every mainstream ABI has 4
    raise ImportError("array('I') is not 4 bytes wide on this platform")


def token_bytes(token_ids: list[int]) -> bytes:
    """Token ids as uint32 little-endian bytes (ValueError if one does not fit)."""
    try:
        packed = array("I", token_ids)
    except OverflowError as exc:
        raise ValueError(f"token ids must be in [0, 2**32): {exc}") from None
    if sys.byteorder != "little":  # pragma: no cover - no big-endian CI
        packed.byteswap()
    return packed.tobytes()


def first_block_extra_keys(cache_salt: str | None, lora_name: str = "") -> bytes:
    """The extra keys mixed into block 0 only."""
    keys = b""
    if cache_salt:
        salt = cache_salt.encode()
        keys += _SALT_TAG + struct.pack("<I", len(salt)) + salt
    if lora_name:
        name = lora_name.encode()
        keys += _LORA_TAG + struct.pack("<I", len(name)) + name
    return keys


def hash_block(parent: BlockHash, block_token_bytes: bytes, extra_keys: bytes = b"") -> BlockHash:
    return hashlib.sha256(parent + block_token_bytes + extra_keys).digest()


def extend_block_hashes(
    block_hashes: list[BlockHash],
    token_ids: list[int],
    block_size: int,
    cache_salt: str | None,
    lora_name: str = "",
) -> None:
    """Append the hashes of the full blocks of ``token_ids`` not yet in ``block_hashes``."""
    start = len(block_hashes)
    end = len(token_ids) // block_size
    if end <= start:
        return
    data = token_bytes(token_ids[start * block_size : end * block_size])
    parent = block_hashes[-1] if block_hashes else ROOT_HASH
    stride = block_size * _TOKEN_BYTES
    for i in range(end - start):
        extra = first_block_extra_keys(cache_salt, lora_name) if start + i == 0 else b""
        parent = hash_block(parent, data[i * stride : (i + 1) * stride], extra)
        block_hashes.append(parent)
