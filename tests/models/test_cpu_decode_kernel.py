"""The C decode-attention kernel reads the paged cache in place and gives what the torch path
(gather + SDPA) gives: grouped heads, ragged contexts, padded block tables, sliding windows."""

from __future__ import annotations

import random
import shutil

import pytest
import torch

from switchboard.models import attention, cpu_decode_kernel
from switchboard.models.attention import (
    AttentionMetadata,
    DecodeBatch,
    gathered_decode_attention,
    new_kv_cache,
    paged_attention,
)
from tests.models.paged_reference import dense_attention, lay_out_step

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler"
)


@pytest.fixture(scope="module")
def kernel_cache(tmp_path_factory):
    """One cache for the file: the first test compiles the kernel, the others load it."""
    return tmp_path_factory.mktemp("kernel-cache")


@pytest.fixture
def kernel(kernel_cache, monkeypatch):
    monkeypatch.setenv("SWITCHBOARD_CACHE", str(kernel_cache))
    monkeypatch.delenv("SWITCHBOARD_CPU_ATTENTION", raising=False)
    cpu_decode_kernel.unload()
    assert cpu_decode_kernel.load(), cpu_decode_kernel.status()
    assert list((kernel_cache / "kernels").glob("paged_decode_*.so"))
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


def _mixed_step(shapes: list[tuple[int, int]], seed: int):
    """A step of ``(tokens cached, tokens this step)`` sequences (decodes first): the cache,
    metadata, this step's q/k/v and each sequence's whole k/v."""
    heads, kv_heads, dim, block = 4, 2, 8, 4
    torch.manual_seed(seed)
    free = list(range(200))
    random.Random(seed).shuffle(free)
    cache = new_kv_cache(200, block, kv_heads, dim, torch.float32, "cpu")
    full = [
        (torch.randn(c + n, kv_heads, dim), torch.randn(c + n, kv_heads, dim)) for c, n in shapes
    ]
    tables = [[free.pop() for _ in range(-(-(c + n) // block))] for c, n in shapes]
    queries, keys, values, slots, spans = lay_out_step(cache, shapes, full, tables, heads)
    decodes = [i for i, (_, n) in enumerate(shapes) if n == 1]
    width = max(len(tables[i]) for i in decodes)
    decode = DecodeBatch(
        block_table=torch.tensor([tables[i] + [0] * (width - len(tables[i])) for i in decodes]),
        context_lens=torch.tensor([sum(shapes[i]) for i in decodes]),
        max_context_len=max(sum(shapes[i]) for i in decodes),
    )
    metadata = AttentionMetadata(torch.tensor(slots), decode=decode, prefills=spans)
    return cache, metadata, (queries, keys, values), full


@pytest.mark.parametrize("window", [None, 4])
def test_prompt_tokens_are_kernel_rows_of_their_own_context(kernel, monkeypatch, window):
    """A float32 CPU step with prompt chunks goes to the kernel in one call, every prompt token
    a row that sees the keys up to its own position: decodes, new prompts of one length and of
    another, a chunk after a cached prefix all equal dense causal attention, window or not."""
    calls = []
    real = cpu_decode_kernel.paged_decode
    monkeypatch.setattr(
        cpu_decode_kernel, "paged_decode", lambda q, *a: calls.append(q.shape[0]) or real(q, *a)
    )
    shapes = [(9, 1), (2, 1), (0, 6), (0, 6), (6, 5), (0, 7)]
    cache, metadata, (queries, keys, values), full = _mixed_step(shapes, seed=3)
    out = paged_attention(
        torch.cat(queries), torch.cat(keys), torch.cat(values), cache, metadata, 8**-0.5, window
    )
    expected = torch.cat(
        [dense_attention(q, k, v, window) for q, (k, v) in zip(queries, full, strict=True)]
    )
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert calls == [sum(n for _, n in shapes)]
    block_table, context_lens = metadata.token_rows
    assert context_lens.tolist() == [10, 3] + [*range(1, 7)] * 2 + [*range(7, 12), *range(1, 8)]
    assert block_table.shape == (26, 3)


def test_a_prompt_chunk_with_a_long_context_takes_sdpa(kernel, monkeypatch):
    """A chunk whose context (cached tokens and its own) passes ``KERNEL_MAX_CONTEXT`` is
    attended by SDPA (it reuses each key across queries), here a short chunk after a cached
    prefix; the decodes of that step still go to the kernel."""
    calls = []
    real = cpu_decode_kernel.paged_decode
    monkeypatch.setattr(
        cpu_decode_kernel, "paged_decode", lambda q, *a: calls.append(q.shape[0]) or real(q, *a)
    )
    monkeypatch.setattr(attention, "KERNEL_MAX_CONTEXT", 6)
    shapes = [(5, 1), (0, 6), (4, 3)]
    cache, metadata, (queries, keys, values), full = _mixed_step(shapes, seed=4)
    out = paged_attention(
        torch.cat(queries), torch.cat(keys), torch.cat(values), cache, metadata, 8**-0.5
    )
    expected = torch.cat(
        [dense_attention(q, k, v) for q, (k, v) in zip(queries, full, strict=True)]
    )
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert calls == [1]  # the decode row only
    assert metadata.token_rows == ()
