"""Quantized weights as the quantized matmul kernel takes them: int8 values with, per block of
``block`` inputs (16 or 32) and output row, a float32 scale and offset: ``w = scale * q + offset``.

GGUF's block formats all fit that one shape exactly (``decode_gguf``): Q8_0 (q, offset 0),
Q4_0 (q - 8), Q5_0 (q - 16), Q4_1 and Q5_1 (q, the block's min as offset), Q4_K and Q5_K (per
32-input sub-block the scale d * sc and the offset -dmin * m, both computed in float32 as gguf's
own dequantization does) and Q6_K (per 16-input sub-block d * sc, q - 32). ``scale * q + offset``
in float32 then gives back what ``gguf.quants.dequantize`` does, bit for bit. ``quantize_int8``
makes the same shape from float32 weights (per 32 inputs, symmetric, as Q8_0 does but with a
float32 scale). numpy only: the conversion of a checkpoint and the worker both read it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import Q4_K as GGUF_Q4_K


class UnsupportedQuantType(ValueError):
    """A GGUF tensor type the quantized kernel does not take."""


@dataclass(frozen=True)
class QuantRows:
    """A weight ``[rows, inputs]`` as ``scale * q + offset`` per block of ``block`` inputs."""

    q: np.ndarray  # int8 [rows, inputs]
    scale: np.ndarray  # float32 [rows, inputs // block]
    offset: np.ndarray | None  # float32 like scale; None: all zero
    block: int
    format: str  # "Q4_1", "int8", ... ("mixed" for rows of several)

    @property
    def shape(self) -> tuple[int, int]:
        rows, inputs = self.q.shape
        return rows, inputs

    def with_block(self, block: int) -> QuantRows:
        """The same values in blocks of ``block`` (a divisor of this one's)."""
        if block == self.block:
            return self
        repeat = self.block // block
        offset = None if self.offset is None else np.repeat(self.offset, repeat, axis=1)
        return QuantRows(self.q, np.repeat(self.scale, repeat, axis=1), offset, block, self.format)

    def dequantize(self) -> np.ndarray:
        """float32 ``[rows, inputs]``: ``scale * q + offset`` (two roundings, no fused op)."""
        rows, inputs = self.shape
        values = self.q.reshape(rows, -1, self.block).astype(np.float32)
        w = self.scale[:, :, None] * values
        if self.offset is not None:
            w = w + self.offset[:, :, None]
        return w.reshape(rows, inputs)


def stack_rows(parts: Sequence[QuantRows]) -> QuantRows:
    """Several weights' rows, one after another (a fused layer's), in the finest block."""
    block = min(part.block for part in parts)
    parts = [part.with_block(block) for part in parts]
    offsets = None
    if any(part.offset is not None for part in parts):
        offsets = np.concatenate(
            [
                part.offset if part.offset is not None else np.zeros_like(part.scale)
                for part in parts
            ]
        )
    formats = {part.format for part in parts}
    return QuantRows(
        np.concatenate([part.q for part in parts]),
        np.concatenate([part.scale for part in parts]),
        offsets,
        block,
        formats.pop() if len(formats) == 1 else "mixed",
    )


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 at byte ``start`` of every block, as float32 [blocks, 1]."""
    return blocks[:, start : start + 2].copy().view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, group: int) -> np.ndarray:
    """Low then high nibbles of each ``group`` bytes, as gguf lays 4-bit values out."""
    n = qs.shape[0]
    halves = qs.reshape(n, -1, 1, group) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (halves & np.uint8(0x0F)).reshape(n, -1)


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0 / Q5_1: bit i of the block's 32-bit word is value i's fifth bit."""
    words = qh.copy().view(np.uint32).reshape(-1, 1)
    return ((words >> np.arange(32, dtype=np.uint32).reshape(1, 32)) & 1).astype(np.uint8)


# Each returns (q [blocks, values], scale [blocks, sub-blocks], offset or None) for the raw
# blocks [blocks, bytes] of one type.
_Decoded = tuple[np.ndarray, np.ndarray, np.ndarray | None]


def _q8_0(blocks: np.ndarray) -> _Decoded:
    return blocks[:, 2:].copy().view(np.int8), _f16(blocks, 0), None


def _q4_0(blocks: np.ndarray) -> _Decoded:
    q = _nibbles(blocks[:, 2:], 16).astype(np.int8) - np.int8(8)
    return q, _f16(blocks, 0), None


def _q4_1(blocks: np.ndarray) -> _Decoded:
    return _nibbles(blocks[:, 4:], 16).astype(np.int8), _f16(blocks, 0), _f16(blocks, 2)


def _q5_0(blocks: np.ndarray) -> _Decoded:
    q = (_nibbles(blocks[:, 6:], 16) | (_fifth_bits(blocks[:, 2:6]) << np.uint8(4))).astype(
        np.int8
    ) - np.int8(16)
    return q, _f16(blocks, 0), None


def _q5_1(blocks: np.ndarray) -> _Decoded:
    q = _nibbles(blocks[:, 8:], 16) | (_fifth_bits(blocks[:, 4:8]) << np.uint8(4))
    return q.astype(np.int8), _f16(blocks, 0), _f16(blocks, 2)


def _k_scales(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: per 32-value sub-block d * sc and -(dmin * m), in float32 as gguf does."""
    sc, m = GGUF_Q4_K.get_scale_min(blocks[:, 4:16])
    scale = _f16(blocks, 0) * sc.astype(np.float32)
    return scale, -(_f16(blocks, 2) * m.astype(np.float32))


def _q4_k(blocks: np.ndarray) -> _Decoded:
    scale, offset = _k_scales(blocks)
    return _nibbles(blocks[:, 16:], 32).astype(np.int8), scale, offset


def _q5_k(blocks: np.ndarray) -> _Decoded:
    scale, offset = _k_scales(blocks)
    n = blocks.shape[0]
    qh = blocks[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    high = (qh & np.uint8(1)).reshape(n, -1)
    return (_nibbles(blocks[:, 48:], 32) | (high << np.uint8(4))).astype(np.int8), scale, offset


def _q6_k(blocks: np.ndarray) -> _Decoded:
    n = blocks.shape[0]
    low = _nibbles(blocks[:, :128], 64).reshape(n, -1, 32)
    qh = blocks[:, 128:192].reshape(n, -1, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(
        1, 1, 4, 1
    )
    high = (qh & np.uint8(3)).reshape(n, -1, 32)
    q = ((low | (high << np.uint8(4))).astype(np.int8) - np.int8(32)).reshape(n, -1)
    scale = _f16(blocks, 208) * blocks[:, 192:208].copy().view(np.int8).astype(np.float32)
    return q, scale, None


# GGUF type -> (its decoder, the inputs a scale covers)
_DECODERS: dict[GGMLQuantizationType, tuple[Callable[[np.ndarray], _Decoded], int]] = {
    GGMLQuantizationType.Q8_0: (_q8_0, 32),
    GGMLQuantizationType.Q4_0: (_q4_0, 32),
    GGMLQuantizationType.Q4_1: (_q4_1, 32),
    GGMLQuantizationType.Q5_0: (_q5_0, 32),
    GGMLQuantizationType.Q5_1: (_q5_1, 32),
    GGMLQuantizationType.Q4_K: (_q4_k, 32),
    GGMLQuantizationType.Q5_K: (_q5_k, 32),
    GGMLQuantizationType.Q6_K: (_q6_k, 16),
}
SUPPORTED_GGUF_TYPES = tuple(t.name for t in _DECODERS)


def decode_gguf(data: np.ndarray, type_name: str) -> QuantRows:
    """A GGUF tensor's raw blocks ``[rows, bytes per row]`` (uint8) of type ``type_name``
    (``Q4_1``, ...) as :class:`QuantRows`; :class:`UnsupportedQuantType` for other types."""
    qtype = GGMLQuantizationType.__members__.get(type_name)
    if qtype not in _DECODERS:
        raise UnsupportedQuantType(
            f"GGUF type {type_name} is not one the quantized kernel takes "
            f"(it takes {', '.join(SUPPORTED_GGUF_TYPES)})"
        )
    decoder, block = _DECODERS[qtype]
    values_per_block, bytes_per_block = GGML_QUANT_SIZES[qtype]
    rows, row_bytes = data.shape
    if row_bytes % bytes_per_block:
        raise ValueError(f"{row_bytes} bytes a row is not whole {type_name} blocks")
    inputs = row_bytes // bytes_per_block * values_per_block
    q, scale, offset = decoder(np.ascontiguousarray(data).reshape(-1, bytes_per_block))
    return QuantRows(
        np.ascontiguousarray(q.reshape(rows, inputs)),
        np.ascontiguousarray(scale.reshape(rows, inputs // block), dtype=np.float32),
        None if offset is None else np.ascontiguousarray(offset.reshape(rows, -1), np.float32),
        block,
        type_name,
    )


INT8_BLOCK = 32


def quantize_int8(weight: np.ndarray) -> QuantRows:
    """float32 ``[rows, inputs]`` (inputs a multiple of 32) as int8 per 32 inputs, symmetric:
    scale = the block's largest magnitude / 127, q = round(w / scale)."""
    rows, inputs = weight.shape
    blocks = weight.reshape(rows, inputs // INT8_BLOCK, INT8_BLOCK).astype(np.float32)
    scale = np.abs(blocks).max(axis=2) / np.float32(127)
    with np.errstate(divide="ignore", invalid="ignore"):
        inverse = np.where(scale == 0, np.float32(0), np.float32(1) / scale)
    q = np.clip(np.rint(blocks * inverse[:, :, None]), -127, 127).astype(np.int8)
    return QuantRows(q.reshape(rows, inputs), scale.astype(np.float32), None, INT8_BLOCK, "int8")
