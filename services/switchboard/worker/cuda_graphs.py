"""CUDA graphs for decode steps: one graph per batch-size bucket, captured at start-up.

A decode-only step (every scheduled request has one token) of ``size`` rows is padded up to
the smallest bucket >= ``size`` and replayed; a step with a prefill chunk, more rows than the
largest bucket or a longer block table than was captured runs eagerly. Padded rows are harmless:
their token is 0 at position 0, their K/V go to a scratch block that no request owns (the KV
cache gets one extra block, the last) and they attend over that block alone.

The graphs are only replayable when nothing in the forward pass reads a tensor on the host or
changes shape with the step's data: the Triton backend's decode kernel (block table and context
lengths are device tensors, the block-table width is fixed at capture) and one worker
(TP = PP = 1). The runner captures only then (``enabled``); ``SWITCHBOARD_CUDA_GRAPHS=0`` turns
them off, ``SWITCHBOARD_CUDA_GRAPH_MAX_BATCH`` (default 256) sets the largest bucket.

The padding and bucket logic are plain functions (tested on CPU); ``DecodeGraphs`` also runs on
CPU with ``record=eager_recorder`` in the tests: the same static buffers, replayed by calling the
model instead of a graph.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from switchboard.models.attention import AttentionBackend, AttentionMetadata, DecodeBatch

logger = logging.getLogger(__name__)

ENV_ENABLED = "SWITCHBOARD_CUDA_GRAPHS"
ENV_MAX_BATCH = "SWITCHBOARD_CUDA_GRAPH_MAX_BATCH"
DEFAULT_MAX_BATCH = 256

# The forward pass over static inputs -> its (static) output.
Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]
# Records one bucket's forward; returns (replay, static output).
Recorder = Callable[[Callable[[], torch.Tensor]], tuple[Callable[[], None], torch.Tensor]]


def enabled(device: torch.device, backend: AttentionBackend, world_size: int) -> bool:
    if os.environ.get(ENV_ENABLED, "1").strip() in ("0", "false", "off", "no"):
        return False
    return device.type == "cuda" and backend.name == "triton" and world_size == 1


def max_batch_from_env() -> int:
    return max(1, int(os.environ.get(ENV_MAX_BATCH, DEFAULT_MAX_BATCH)))


def decode_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to ``max_batch`` (itself included)."""
    buckets = [b for b in (1, 2, 4, 8) if b <= max_batch]
    buckets += range(16, max_batch + 1, 16)
    if buckets[-1] != max_batch:
        buckets.append(max_batch)
    return sorted(set(buckets))


def pick_bucket(size: int, buckets: list[int]) -> int | None:
    """The smallest bucket that holds ``size`` rows; None when none does (run eagerly)."""
    for bucket in buckets:
        if bucket >= size:
            return bucket
    return None


@dataclass
class PaddedDecode:
    """A decode step's inputs padded to ``bucket`` rows and ``width`` block-table columns."""

    input_ids: torch.Tensor  # [bucket] long
    positions: torch.Tensor  # [bucket] long
    slot_mapping: torch.Tensor  # [bucket] long
    block_table: torch.Tensor  # [bucket, width] int32
    context_lens: torch.Tensor  # [bucket] int32


def pad_decode(
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    bucket: int,
    width: int,
    scratch_block: int,
    block_size: int,
) -> PaddedDecode:
    """Pad ``size`` decode rows to ``bucket``: extra rows hold token 0 at position 0, write their
    K/V into the scratch block's first slot and attend over that one slot; block-table columns
    past the rows' own point at the scratch block too (never read: beyond each context)."""
    size, columns = block_table.shape
    if size > bucket or columns > width:
        raise ValueError(f"{size} rows x {columns} blocks do not fit {bucket} x {width}")
    device = input_ids.device
    table = torch.full((bucket, width), scratch_block, dtype=torch.int32, device=device)
    table[:size, :columns] = block_table
    lens = torch.ones(bucket, dtype=torch.int32, device=device)
    lens[:size] = context_lens
    slots = torch.full((bucket,), scratch_block * block_size, dtype=torch.long, device=device)
    slots[:size] = slot_mapping
    ids = torch.zeros(bucket, dtype=torch.long, device=device)
    ids[:size] = input_ids
    pos = torch.zeros(bucket, dtype=torch.long, device=device)
    pos[:size] = positions
    return PaddedDecode(ids, pos, slots, table, lens)


def is_decode_only(metadata: AttentionMetadata) -> bool:
    return metadata.decode is not None and not metadata.prefills


def cuda_graph_recorder() -> Recorder:
    """Capture on the current CUDA device (after one warm-up run on a side stream, which also
    compiles the Triton kernels outside the capture). All buckets share one memory pool."""
    pool = torch.cuda.graph_pool_handle()

    def record(run: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            run()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            output = run()
        return graph.replay, output

    return record


def eager_recorder(run: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
    """For tests on CPU: "replay" = run the forward again over the same static buffers, into
    the same output tensor."""
    output = run()

    def replay() -> None:
        output.copy_(run())

    return replay, output


class DecodeGraphs:
    """Static input buffers sized for the largest bucket, one recorded forward per bucket."""

    def __init__(
        self,
        forward: Forward,
        backend: AttentionBackend,
        buckets: list[int],
        width: int,
        scratch_block: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.forward = forward
        self.backend = backend
        self.buckets = buckets
        self.width = width
        self.scratch_block = scratch_block
        self.block_size = block_size
        largest = buckets[-1]
        self.input_ids = torch.zeros(largest, dtype=torch.long, device=device)
        self.positions = torch.zeros(largest, dtype=torch.long, device=device)
        self.slot_mapping = torch.full(
            (largest,), scratch_block * block_size, dtype=torch.long, device=device
        )
        self.block_table = torch.full(
            (largest, width), scratch_block, dtype=torch.int32, device=device
        )
        self.context_lens = torch.ones(largest, dtype=torch.int32, device=device)
        self._replays: dict[int, tuple[Callable[[], None], torch.Tensor]] = {}

    def capture(self, record: Recorder) -> float:
        """Record every bucket, largest first (so the smaller ones reuse its memory pool).
        Returns the seconds it took."""
        started = time.monotonic()
        for bucket in reversed(self.buckets):
            metadata = self._static_metadata(bucket)
            self._replays[bucket] = record(
                lambda b=bucket, m=metadata: self.forward(  # type: ignore[misc]
                    self.input_ids[:b], self.positions[:b], m
                )
            )
        return time.monotonic() - started

    def _static_metadata(self, bucket: int) -> AttentionMetadata:
        from switchboard.models.triton_backend import TritonPrepared

        table = self.block_table[:bucket]
        lens = self.context_lens[:bucket]
        decode = DecodeBatch(
            block_table=table.long(),  # unused by the Triton path; shapes for the record
            context_lens=lens.long(),
            max_context_len=self.width * self.block_size,
        )
        metadata = AttentionMetadata(self.slot_mapping[:bucket], decode=decode)
        metadata.backend = self.backend
        metadata.prepared = TritonPrepared(decode_block_table=table, decode_context_lens=lens)
        return metadata

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor | None:
        """The step's hidden states ``[size, hidden]`` from a replay (a view of the graph's
        output, valid until the next replay), or None: run it eagerly."""
        if not is_decode_only(metadata) or not self._replays:
            return None
        decode = metadata.decode
        assert decode is not None
        size, columns = decode.block_table.shape
        bucket = pick_bucket(size, self.buckets)
        if bucket is None or columns > self.width or bucket not in self._replays:
            return None
        padded = pad_decode(
            input_ids,
            positions,
            metadata.slot_mapping,
            decode.block_table,
            decode.context_lens,
            bucket,
            self.width,
            self.scratch_block,
            self.block_size,
        )
        self.input_ids[:bucket].copy_(padded.input_ids)
        self.positions[:bucket].copy_(padded.positions)
        self.slot_mapping[:bucket].copy_(padded.slot_mapping)
        self.block_table[:bucket].copy_(padded.block_table)
        self.context_lens[:bucket].copy_(padded.context_lens)
        replay, output = self._replays[bucket]
        replay()
        return output[:size]
