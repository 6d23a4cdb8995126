"""The C decode-attention kernel reads the paged cache in place and gives what the torch path
(gather + SDPA) gives: grouped heads, ragged contexts, padded block tables, sliding windows."""

from __future__ import annotations

import shutil

import pytest
import torch

from switchboard.models import cpu_decode_kernel
from switchboard.models.attention import (
    AttentionMetadata,
    DecodeBatch,
    gathered_decode_attention,
    paged_attention,
)

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler"
)


@pytest.fixture
def kernel(tmp_path, monkeypatch):
    monkeypatch.setenv("SWITCHBOARD_CACHE", str(tmp_path))
    monkeypatch.delenv("SWITCHBOARD_CPU_ATTENTION", raising=False)
    cpu_decode_kernel.unload()
    assert cpu_decode_kernel.load(), cpu_decode_kernel.status()
    assert list((tmp_path / "kernels").glob("paged_decode_*.so"))
    yield
    cpu_decode_kernel.unload()


def decode_batch(context_lens: list[int], num_blocks: int, block_size: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    max_blocks = -(-max(context_lens) // block_size)
    table = torch.randint(0, num_blocks, (len(context_lens), max_blocks), generator=generator)
    for row, length in enumerate(context_lens):  # padding as build_step_inputs writes it
        table[row, -(-length // block_size) :] = 0
    return DecodeBatch(
        block_table=table,
        context_lens=torch.tensor(context_lens),
        max_context_len=max(context_lens),
        all_full_length=min(context_lens) == max(context_lens),
    )


@pytest.mark.parametrize(
    ("kv_heads", "heads", "head_dim"),
    [(4, 8, 32), (3, 9, 64), (2, 2, 16), (2, 4, 128), (4, 4, 32), (1, 2, 20), (2, 4, 256)],
)
@pytest.mark.parametrize(
    ("context_lens", "window"),
    [([37], None), ([5, 16, 17, 90], None), ([50, 3, 64], 8), ([1, 2], None), ([40, 40], 40)],
)
def test_matches_the_torch_path(kernel, kv_heads, heads, head_dim, context_lens, window):
    torch.manual_seed(len(context_lens) * head_dim)
    cache = torch.randn(2, 64, 16, kv_heads, head_dim)
    batch = decode_batch(context_lens, 64, 16, seed=heads)
    query = torch.randn(len(context_lens), heads, head_dim)
    scale = head_dim**-0.5
    expected = gathered_decode_attention(query, cache, batch, scale, window)
    got = cpu_decode_kernel.paged_decode(
        query, cache, batch.block_table, batch.context_lens, scale, window
    )
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_paged_attention_takes_the_kernel_for_float32_on_cpu(kernel, monkeypatch):
    calls = []
    real = cpu_decode_kernel.paged_decode
    monkeypatch.setattr(cpu_decode_kernel, "paged_decode", lambda *a: calls.append(1) or real(*a))
    cache = torch.zeros(2, 8, 4, 2, 8)
    batch = decode_batch([3, 5], 8, 4, seed=0)
    metadata = AttentionMetadata(torch.tensor([1, 2]), decode=batch)
    new = torch.randn(2, 2, 8)
    paged_attention(torch.randn(2, 4, 8), new, new, cache, metadata, 0.3)
    assert calls == [1]
    paged_attention(  # float64: the torch path
        torch.randn(2, 4, 8).double(), new.double(), new.double(), cache.double(), metadata, 0.3
    )
    assert calls == [1]


def test_can_be_switched_off(tmp_path, monkeypatch):
    monkeypatch.setenv("SWITCHBOARD_CPU_ATTENTION", "torch")
    cpu_decode_kernel.unload()
    assert not cpu_decode_kernel.load()
    assert "off" in cpu_decode_kernel.status()
    assert not cpu_decode_kernel.usable_for(torch.zeros(1, 2, 4), torch.zeros(2, 1, 1, 2, 4))


def test_without_a_compiler_the_torch_path_stays(tmp_path, monkeypatch):
    monkeypatch.setenv("SWITCHBOARD_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    cpu_decode_kernel.unload()
    assert not cpu_decode_kernel.load()
    assert cpu_decode_kernel.status().startswith("unavailable")
    cpu_decode_kernel.unload()
