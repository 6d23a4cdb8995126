"""The Triton paged-attention backend against the reference backend, on CPU tensors through
Triton's interpreter (``TRITON_INTERPRET=1``, set here before triton is imported; the kernels
are decorated at import, so the module is reloaded if something imported it without it)."""

from __future__ import annotations

import importlib
import os
import random
import sys

import pytest

os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

import torch  # noqa: E402

from switchboard.models.attention import (  # noqa: E402
    REFERENCE,
    AttentionMetadata,
    DecodeBatch,
    new_kv_cache,
    paged_attention,
)
from switchboard.models.attention_backends import backend_name, select_backend  # noqa: E402
from tests.models.paged_reference import lay_out_step  # noqa: E402

if "switchboard.kernels.triton_paged_attention" in sys.modules:
    importlib.reload(sys.modules["switchboard.kernels.triton_paged_attention"])
from switchboard.kernels import triton_paged_attention  # noqa: E402
from switchboard.models import triton_backend  # noqa: E402

BLOCK = 16
DIM = 16
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def _step(kv_heads: int, heads: int, dtype: torch.dtype, shapes, seed: int):
    """A step over ``shapes`` = (tokens cached, tokens this step) per request, decodes first."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    num_blocks = sum(-(-(c + n) // BLOCK) for c, n in shapes) + 3
    free = list(range(num_blocks))
    rng.shuffle(free)
    cache = new_kv_cache(num_blocks, BLOCK, kv_heads, DIM, torch.float32, "cpu")
    full = [
        (torch.randn(c + n, kv_heads, DIM), torch.randn(c + n, kv_heads, DIM)) for c, n in shapes
    ]
    tables = [[free.pop() for _ in range(-(-(c + n) // BLOCK))] for c, n in shapes]
    queries, keys, values, slots, spans = lay_out_step(cache, shapes, full, tables, heads)
    decodes = [i for i, (_, n) in enumerate(shapes) if n == 1]
    decode = None
    if decodes:
        lens = [shapes[i][0] + 1 for i in decodes]
        width = max(len(tables[i]) for i in decodes)
        decode = DecodeBatch(
            block_table=torch.tensor([tables[i] + [0] * (width - len(tables[i])) for i in decodes]),
            context_lens=torch.tensor(lens),
            max_context_len=max(lens),
            all_full_length=min(lens) == max(lens),
        )
    metadata = AttentionMetadata(torch.tensor(slots), decode=decode, prefills=spans)
    tensors = [torch.cat(x).to(dtype) for x in (queries, keys, values)]
    return cache.to(dtype), tensors, metadata


def _compare(kv_heads, heads, dtype, shapes, window=None, seed=0):
    cache, (q, k, v), metadata = _step(kv_heads, heads, dtype, shapes, seed)
    expected = paged_attention(q, k, v, cache.clone(), REFERENCE.prepare(metadata), 0.25, window)
    backend = triton_backend.TritonBackend()
    metadata.prepared = None
    got = paged_attention(q, k, v, cache.clone(), backend.prepare(metadata), 0.25, window)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)


# Ragged contexts crossing block boundaries (16): decodes at 1, 16, 17, 40 tokens.
DECODES = [(0, 1), (15, 1), (16, 1), (39, 1)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("kv_heads", "heads"), [(2, 4), (2, 2)])
def test_decode_matches_the_reference(kv_heads, heads, dtype):
    _compare(kv_heads, heads, dtype, DECODES)


def test_decode_sliding_window_matches_the_reference():
    _compare(2, 4, torch.float32, DECODES, window=20, seed=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("kv_heads", "heads"), [(2, 4), (1, 1)])
def test_prefill_chunks_with_cached_context_match_the_reference(kv_heads, heads, dtype):
    # decodes, a fresh prefill over two tiles, a chunk after a cached prefix of 21 tokens
    _compare(kv_heads, heads, dtype, [(5, 1), (30, 1), (0, 19), (21, 12)], seed=2)


def test_prefill_sliding_window_matches_the_reference():
    _compare(2, 4, torch.float32, [(0, 20), (18, 9)], window=7, seed=3)


def test_prefill_tiles_cover_every_row():
    assert triton_paged_attention.prefill_tiles([3, 16, 17], 16) == ([0, 1, 2, 2], [0, 0, 0, 16])


def test_auto_selects_triton_only_on_cuda(monkeypatch):
    monkeypatch.delenv("SWITCHBOARD_ATTENTION_BACKEND", raising=False)
    assert backend_name(torch.device("cpu")) != "triton"
    assert backend_name(torch.device("cuda")) == "triton"
    monkeypatch.setenv("SWITCHBOARD_ATTENTION_BACKEND", "reference")
    assert backend_name(torch.device("cuda")) == "reference"
    monkeypatch.setenv("SWITCHBOARD_ATTENTION_BACKEND", "triton")
    assert select_backend(torch.device("cpu")).name == "triton"  # interpreted
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="CUDA"):
        backend_name(torch.device("cpu"))
    monkeypatch.setenv("SWITCHBOARD_ATTENTION_BACKEND", "bogus")
    with pytest.raises(ValueError, match="bogus"):
        backend_name(torch.device("cpu"))
