"""The C decode-attention kernel reads the paged cache in place and gives what the torch path
(gather + SDPA) gives: grouped heads, ragged contexts, padded block tables, sliding windows; it
can be switched off, and does not load without a compiler."""

from __future__ import annotations

import pytest
import torch

from switchboard.kernels import paged_decode
from switchboard.models.attention import DecodeBatch, gathered_decode_attention
from tests.paged_decode_kernel import needs_compiler

pytestmark = needs_compiler


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
    [
        (4, 8, 32),
        (3, 9, 64),
        (2, 8, 64),
        (2, 2, 16),
        (2, 4, 128),
        (4, 4, 32),
        (1, 2, 20),
        (2, 4, 256),
    ],
)
@pytest.mark.parametrize(
    ("context_lens", "window"),
    [
        ([37], None),
        ([5, 16, 17, 90], None),
        ([50, 3, 64], 8),
        ([1, 2], None),
        ([40, 40], 40),
        # long contexts: keys in parts, merged (a window's first part starts inside a span)
        ([700, 40, 513], None),
        ([700, 600], 300),
    ],
)
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_matches_the_torch_path(
    paged_decode_loaded, kv_heads, heads, head_dim, context_lens, window, cache_dtype
):
    """Float32 and bfloat16 caches (each of the kernel's ways to read them: widened per key,
    or a block at a time into lane order where the CPU has AVX-512, the keys and values of two
    to four query heads a KV head read once for all of them there) against torch's path over
    the same cache."""
    torch.manual_seed(len(context_lens) * head_dim)
    num_blocks = 64 if max(context_lens) <= 64 * 16 else 128
    cache = torch.randn(2, num_blocks, 16, kv_heads, head_dim).to(cache_dtype)
    batch = decode_batch(context_lens, num_blocks, 16, seed=heads)
    query = torch.randn(len(context_lens), heads, head_dim)
    scale = head_dim**-0.5
    expected = gathered_decode_attention(query, cache, batch, scale, window)
    got = paged_decode.paged_decode(
        query, cache, batch.block_table, batch.context_lens, scale, window
    )
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_can_be_switched_off(monkeypatch):
    monkeypatch.setenv("SWITCHBOARD_CPU_ATTENTION", "torch")
    paged_decode.unload()
    assert not paged_decode.load()
    assert "off" in paged_decode.status()
    assert not paged_decode.usable_for(torch.zeros(1, 2, 4), torch.zeros(2, 1, 1, 2, 4))


def test_without_a_compiler_it_does_not_load(without_compiler):
    paged_decode.unload()
    assert not paged_decode.load()
    assert paged_decode.status().startswith("unavailable")
    paged_decode.unload()


@pytest.mark.parametrize(
    ("kv_heads", "heads", "head_dim"), [(3, 9, 64), (2, 4, 128), (1, 2, 20), (4, 8, 32), (2, 6, 16)]
)
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("group", [9, 21])
@pytest.mark.parametrize("first_len", [455, 30])
def test_rows_that_share_their_keys_get_the_floats_of_each_row_alone(
    paged_decode_loaded, kv_heads, heads, head_dim, cache_dtype, window, group, first_len
):
    """A decode with its proposed tokens, or a prompt chunk (rows of one block table, one
    position after another), is attended as a group that reads each key once for several of its
    rows: every row's output is bit for bit what the row gets alone, beside other requests'
    rows or not. Long contexts (attended in parts) and short ones; head sizes whose query
    heads weigh the values in pairs alone (32, 16) as well."""
    torch.manual_seed(head_dim + kv_heads)
    cache = torch.randn(2, 64, 16, kv_heads, head_dim).to(cache_dtype)
    chunk = torch.randperm(64)[:30]  # one request's blocks, rows ending at 455, 456, ...
    other = torch.randperm(64)[:3]
    rows = group + 1
    table = torch.stack([chunk] * group + [torch.cat([other, torch.zeros(27, dtype=torch.long)])])
    context_lens = torch.tensor([first_len + i for i in range(group)] + [40])
    query = torch.randn(rows, heads, head_dim)
    scale = head_dim**-0.5
    together = paged_decode.paged_decode(query, cache, table, context_lens, scale, window)
    for row in range(rows):
        alone = paged_decode.paged_decode(
            query[row : row + 1],
            cache,
            table[row : row + 1],
            context_lens[row : row + 1],
            scale,
            window,
        )
        assert torch.equal(together[row], alone[0]), row
    # and the group's rows in a step of their own, split among the tasks differently
    chunk_only = paged_decode.paged_decode(
        query[:5], cache, table[:5], context_lens[:5], scale, window
    )
    assert torch.equal(chunk_only, together[:5])
    expected = gathered_decode_attention(
        query, cache.float(), decode_batch_of(table, context_lens), scale, window
    )
    torch.testing.assert_close(together, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 300])
def test_a_long_context_in_parts_gets_the_same_floats_alone_in_a_group_and_on_any_threads(
    paged_decode_loaded, cache_dtype, window
):
    """Rows whose keys span several parts (attended part by part, then merged): a group whose
    rows cross from two parts to three, each row alone, and one thread against two."""
    torch.manual_seed(7)
    cache = torch.randn(2, 128, 16, 3, 64).to(cache_dtype)
    blocks = torch.randperm(128)[:40]
    rows = 12
    table = blocks.repeat(rows, 1)
    context_lens = torch.tensor([505 + i for i in range(rows)])  # 505 .. 516: past 512
    query = torch.randn(rows, 9, 64)
    together = paged_decode.paged_decode(query, cache, table, context_lens, 0.125, window)
    alone = torch.cat(
        [
            paged_decode.paged_decode(
                query[r : r + 1], cache, table[r : r + 1], context_lens[r : r + 1], 0.125, window
            )
            for r in range(rows)
        ]
    )
    assert torch.equal(together, alone)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = paged_decode.paged_decode(query, cache, table, context_lens, 0.125, window)
        one_alone = paged_decode.paged_decode(
            query[:1], cache, table[:1], context_lens[:1], 0.125, window
        )
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one_thread, together) and torch.equal(one_alone[0], alone[0])
    # rows of different requests, enough to keep the threads busy a row a task (its parts one
    # after the other in that task), against each alone (its parts tasks of their own)
    others = torch.stack([torch.randperm(128)[:40] for _ in range(5)])
    lens = torch.tensor([700, 300, 516, 257, 90])
    batch = paged_decode.paged_decode(query[:5], cache, others, lens, 0.125, window)
    for r in range(5):
        single = paged_decode.paged_decode(
            query[r : r + 1], cache, others[r : r + 1], lens[r : r + 1], 0.125, window
        )
        assert torch.equal(batch[r], single[0]), r
    expected = gathered_decode_attention(
        query, cache.float(), decode_batch_of(table, context_lens), 0.125, window
    )
    torch.testing.assert_close(together, expected, atol=1e-5, rtol=1e-5)


def decode_batch_of(table: torch.Tensor, context_lens: torch.Tensor) -> DecodeBatch:
    return DecodeBatch(
        block_table=table,
        context_lens=context_lens,
        max_context_len=int(context_lens.max()),
        all_full_length=False,
    )


def test_a_group_over_a_long_context_takes_fewer_rows_a_task_with_the_same_floats(
    paged_decode_loaded,
):
    """Past ~30,000 tokens a task takes fewer rows of a group (its scores are rows x heads x
    context floats); the rows still get their floats alone."""
    torch.manual_seed(0)
    num_blocks = 4400
    cache = torch.randn(2, num_blocks, 16, 1, 8)
    rows = 10
    table = torch.randperm(num_blocks).repeat(rows, 1)
    context_lens = torch.tensor([70_000 + i for i in range(rows)])
    query = torch.randn(rows, 2, 8)
    together = paged_decode.paged_decode(query, cache, table, context_lens, 8**-0.5, None)
    for row in range(rows):
        alone = paged_decode.paged_decode(
            query[row : row + 1],
            cache,
            table[row : row + 1],
            context_lens[row : row + 1],
            8**-0.5,
            None,
        )
        assert torch.equal(together[row], alone[0]), row
