"""The CUDA-only paths, as far as they run on CPU: decode-graph buckets and padding, replay of
the static buffers (recorded eagerly, Triton interpreted), the CUDA dtype default, uploads."""

from __future__ import annotations

import importlib
import os
import sys
from types import SimpleNamespace

import pytest
import torch

from switchboard.models.attention import (
    REFERENCE,
    AttentionMetadata,
    DecodeBatch,
    new_kv_cache,
    paged_attention,
)
from switchboard.models.loader import resolve_dtype
from switchboard.worker import cuda_graphs
from switchboard.worker.step_inputs import upload


def test_buckets_and_picking():
    assert cuda_graphs.decode_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert cuda_graphs.decode_buckets(3) == [1, 2, 3]
    buckets = cuda_graphs.decode_buckets(256)
    assert buckets[-1] == 256 and len(buckets) == 4 + 16
    assert cuda_graphs.pick_bucket(1, buckets) == 1
    assert cuda_graphs.pick_bucket(5, buckets) == 8
    assert cuda_graphs.pick_bucket(17, buckets) == 32
    assert cuda_graphs.pick_bucket(257, buckets) is None


def test_padding_points_extra_rows_at_the_scratch_block():
    padded = cuda_graphs.pad_decode(
        torch.tensor([7, 8]),
        torch.tensor([3, 20]),
        torch.tensor([35, 52]),
        torch.tensor([[2, 0], [1, 3]]),
        torch.tensor([4, 21]),
        bucket=4,
        width=3,
        scratch_block=9,
        block_size=16,
    )
    assert padded.input_ids.tolist() == [7, 8, 0, 0]
    assert padded.positions.tolist() == [3, 20, 0, 0]
    assert padded.slot_mapping.tolist() == [35, 52, 144, 144]
    assert padded.block_table.tolist() == [[2, 0, 9], [1, 3, 9], [9, 9, 9], [9, 9, 9]]
    assert padded.context_lens.tolist() == [4, 21, 1, 1]
    with pytest.raises(ValueError, match="do not fit"):
        cuda_graphs.pad_decode(
            *[torch.zeros(5, dtype=torch.long)] * 3,
            torch.zeros(5, 1),
            torch.ones(5),
            bucket=4,
            width=3,
            scratch_block=9,
            block_size=16,
        )


def test_graphs_only_on_cuda_with_triton_and_one_worker(monkeypatch):
    triton_like = SimpleNamespace(name="triton")
    assert cuda_graphs.enabled(torch.device("cuda"), triton_like, 1)
    assert not cuda_graphs.enabled(torch.device("cpu"), triton_like, 1)
    assert not cuda_graphs.enabled(torch.device("cuda"), REFERENCE, 1)
    assert not cuda_graphs.enabled(torch.device("cuda"), triton_like, 2)
    monkeypatch.setenv("SWITCHBOARD_CUDA_GRAPHS", "0")
    assert not cuda_graphs.enabled(torch.device("cuda"), triton_like, 1)


def test_auto_dtype_on_cuda_is_bfloat16_unless_the_checkpoint_is_float16():
    from switchboard.models.cpu_dtype import cpu_auto_dtype

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    for checkpoint in ("float32", None, "bfloat16"):
        config = SimpleNamespace(checkpoint_dtype=checkpoint)
        assert resolve_dtype("auto", config, cuda) == torch.bfloat16  # type: ignore[arg-type]
    # on CPU: float32, but bfloat16 for a bfloat16 checkpoint where this CPU runs it faster
    for checkpoint in ("float32", None):
        config = SimpleNamespace(checkpoint_dtype=checkpoint)
        assert resolve_dtype("auto", config, cpu) == torch.float32  # type: ignore[arg-type]
    on_cpu, _ = cpu_auto_dtype(torch.bfloat16, quantized=False)
    config = SimpleNamespace(checkpoint_dtype="bfloat16")
    assert resolve_dtype("auto", config, cpu) == on_cpu  # type: ignore[arg-type]
    config = SimpleNamespace(checkpoint_dtype="float16")
    assert resolve_dtype("auto", config, cuda) == torch.float16  # type: ignore[arg-type]
    assert resolve_dtype("float32", config, cuda) == torch.float32  # type: ignore[arg-type]


def test_upload_on_cpu_is_the_tensor_itself():
    tensor = torch.arange(4)
    assert upload(tensor, torch.device("cpu")) is tensor


def _interpreted_triton():
    """The Triton backend's module, its kernels decorated for the interpreter."""
    os.environ["TRITON_INTERPRET"] = "1"
    pytest.importorskip("triton")
    name = "switchboard.kernels.triton_paged_attention"
    if name in sys.modules:
        importlib.reload(sys.modules[name])
    return importlib.import_module("switchboard.models.triton_backend")


def test_replayed_decode_equals_eager_and_leaves_other_blocks_alone():
    """A one-layer attention "model" through DecodeGraphs (bucket 4 for 3 rows): the real rows
    match the reference backend run eagerly, the padded row wrote only the scratch block."""
    triton_backend = _interpreted_triton()
    torch.manual_seed(0)
    block, kv_heads, heads, dim, num_blocks = 16, 2, 4, 16, 8
    vocab = 50
    q_table = torch.randn(vocab, heads, dim)
    k_table = torch.randn(vocab, kv_heads, dim)
    v_table = torch.randn(vocab, kv_heads, dim)
    cache = new_kv_cache(num_blocks + 1, block, kv_heads, dim, torch.float32, "cpu")
    cache[:, :num_blocks].normal_()  # earlier tokens

    def forward(ids, positions, metadata):
        return paged_attention(q_table[ids], k_table[ids], v_table[ids], cache, metadata, 0.25)

    backend = triton_backend.TritonBackend()
    graphs = cuda_graphs.DecodeGraphs(
        forward,
        backend,
        [1, 2, 4],
        width=4,
        scratch_block=num_blocks,
        block_size=block,
        device=torch.device("cpu"),
    )
    graphs.capture(cuda_graphs.eager_recorder)
    tables = [[3, 5], [0, 0], [7, 1]]  # 3 rows: contexts 20, 1, 32 (the last ends a block)
    lens = [20, 1, 32]
    slots = [tables[i][(n - 1) // block] * block + (n - 1) % block for i, n in enumerate(lens)]
    metadata = AttentionMetadata(
        torch.tensor(slots),
        decode=DecodeBatch(torch.tensor(tables), torch.tensor(lens), max(lens)),
    )
    ids, positions = torch.tensor([4, 9, 11]), torch.tensor([n - 1 for n in lens])
    before = cache.clone()
    replayed = graphs.run(ids, positions, metadata)
    assert replayed is not None and replayed.shape == (3, heads * dim)
    after = cache.clone()
    cache.copy_(before)
    eager = forward(ids, positions, metadata)
    torch.testing.assert_close(replayed, eager, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(after[:, :num_blocks], cache[:, :num_blocks])  # same writes
    # A step with a prefill, or too wide a table, or too many rows: eager (None)
    wide = DecodeBatch(torch.zeros(1, 5, dtype=torch.long), torch.tensor([1]), 1)
    assert graphs.run(ids[:1], positions[:1], AttentionMetadata(torch.tensor([0]), wide)) is None
    many = DecodeBatch(torch.zeros(5, 1, dtype=torch.long), torch.ones(5, dtype=torch.long), 1)
    assert graphs.run(ids, positions, AttentionMetadata(torch.zeros(5).long(), many)) is None
