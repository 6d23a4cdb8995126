"""The CPU kernel attention backend: float32 CPU steps go to the C decode kernel (decodes, and
prompt tokens as rows of their own context while every chunk is short), anything else to the
torch reference; the reference backend never calls the kernel; ``auto`` picks this backend on
CPU when the kernel loads, the reference when it does not."""

from __future__ import annotations

import logging
import random

import pytest
import torch

from switchboard.kernels import paged_decode
from switchboard.models import cpu_kernel_attention
from switchboard.models.attention import (
    REFERENCE,
    AttentionMetadata,
    DecodeBatch,
    new_kv_cache,
    paged_attention,
)
from switchboard.models.attention_backends import backend_choice, select_backend
from switchboard.models.cpu_kernel_attention import CPU_KERNEL, CPU_KERNEL_EVERY_CHUNK, stack_rows
from tests.models.paged_reference import dense_attention, lay_out_step
from tests.paged_decode_kernel import needs_compiler

pytestmark = needs_compiler


@pytest.fixture
def kernel_calls(paged_decode_loaded, monkeypatch) -> list[int]:
    """The rows of every call to the kernel."""
    calls: list[int] = []
    real = paged_decode.paged_decode
    monkeypatch.setattr(
        paged_decode, "paged_decode", lambda q, *a: calls.append(q.shape[0]) or real(q, *a)
    )
    return calls


def _decode_step():
    cache = torch.randn(2, 8, 4, 2, 8)
    decode = DecodeBatch(torch.tensor([[1, 2], [3, 0]]), torch.tensor([6, 3]), 6)
    metadata = AttentionMetadata(torch.tensor([9, 14]), decode=decode)
    new = torch.randn(2, 2, 8)
    return torch.randn(2, 4, 8), new, cache, metadata


def test_float32_on_cpu_takes_the_kernel_the_reference_never_does(kernel_calls):
    query, new, cache, metadata = _decode_step()
    got = paged_attention(query, new, new, cache, CPU_KERNEL.prepare(metadata), 0.3)
    assert kernel_calls == [2]
    expected = paged_attention(query, new, new, cache, REFERENCE.prepare(metadata), 0.3)
    metadata.backend = None  # no backend: the reference
    assert torch.equal(paged_attention(query, new, new, cache, metadata, 0.3), expected)
    assert kernel_calls == [2]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    paged_attention(  # float64: the torch path
        query.double(),
        new.double(),
        new.double(),
        cache.double(),
        CPU_KERNEL.prepare(metadata),
        0.3,
    )
    assert kernel_calls == [2]


def test_auto_picks_the_kernel_on_cpu_and_says_why(paged_decode_loaded, monkeypatch, caplog):
    monkeypatch.delenv("SWITCHBOARD_ATTENTION_BACKEND", raising=False)
    with caplog.at_level(logging.INFO, logger="switchboard.models.attention_backends"):
        assert select_backend(torch.device("cpu")) is CPU_KERNEL
    assert "attention backend: cpu-kernel (" in caplog.text
    assert backend_choice(torch.device("cpu"), "reference")[0] == "reference"
    assert backend_choice(torch.device("cpu"), "cpu-kernel")[0] == "cpu-kernel"
    assert backend_choice(torch.device("meta"))[0] == "reference"
    with pytest.raises(ValueError, match="runs on CPU"):
        backend_choice(torch.device("meta"), "cpu-kernel")


def test_without_the_kernel_auto_is_the_reference(monkeypatch):
    monkeypatch.delenv("SWITCHBOARD_ATTENTION_BACKEND", raising=False)
    monkeypatch.setenv("SWITCHBOARD_CPU_ATTENTION", "torch")
    paged_decode.unload()
    name, why = backend_choice(torch.device("cpu"))
    assert (name, why) == (
        "reference",
        "the CPU decode kernel is off (SWITCHBOARD_CPU_ATTENTION=torch)",
    )
    with pytest.raises(ValueError, match="cpu-kernel but the CPU decode kernel is off"):
        backend_choice(torch.device("cpu"), "cpu-kernel")
    paged_decode.unload()


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


def assert_rows_decoded_alone(
    out: torch.Tensor,
    query: torch.Tensor,
    cache: torch.Tensor,
    chunk,
    first_row: int,
    first_len: int,
) -> None:
    """Each of ``chunk``'s rows in ``out`` (from ``first_row``, seeing ``first_len`` keys, one
    more each) is bit for bit the kernel's answer for that row decoded alone."""
    for i in range(chunk.num_tokens):
        alone = paged_decode.paged_decode(
            query[first_row + i : first_row + i + 1],
            cache,
            chunk.block_ids[None].contiguous(),
            torch.tensor([first_len + i]),
            8**-0.5,
            None,
        )
        assert torch.equal(out[first_row + i], alone.reshape(-1))


@pytest.mark.parametrize("window", [None, 4])
def test_prompt_tokens_are_kernel_rows_of_their_own_context(kernel_calls, window):
    """A float32 CPU step with prompt chunks goes to the kernel in one call, every prompt token
    a row that sees the keys up to its own position: decodes, new prompts of one length and of
    another, a chunk after a cached prefix all equal dense causal attention, window or not."""
    shapes = [(9, 1), (2, 1), (0, 6), (0, 6), (6, 5), (0, 7)]
    cache, metadata, (queries, keys, values), full = _mixed_step(shapes, seed=3)
    out = paged_attention(
        torch.cat(queries),
        torch.cat(keys),
        torch.cat(values),
        cache,
        CPU_KERNEL.prepare(metadata),
        8**-0.5,
        window,
    )
    expected = torch.cat(
        [dense_attention(q, k, v, window) for q, (k, v) in zip(queries, full, strict=True)]
    )
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert kernel_calls == [sum(n for _, n in shapes)]
    assert metadata.prepared.rows is not None
    block_table, context_lens = metadata.prepared.rows
    assert context_lens.tolist() == [10, 3] + [*range(1, 7)] * 2 + [*range(7, 12), *range(1, 8)]
    assert block_table.shape == (26, 3)


def test_a_prompt_chunk_with_a_long_context_takes_sdpa(kernel_calls, monkeypatch):
    """A chunk whose context (cached tokens and its own) passes ``KERNEL_MAX_CONTEXT`` is
    attended by SDPA (it reuses each key across queries), here a short chunk after a cached
    prefix; the decodes of that step still go to the kernel, and so does a chunk the kernel would
    take in a step of its own."""
    monkeypatch.setattr(cpu_kernel_attention, "KERNEL_MAX_CONTEXT", 6)
    monkeypatch.setattr(cpu_kernel_attention, "KERNEL_ANY_CONTEXT_MAX_TOKENS", 2)
    shapes = [(5, 1), (0, 6), (4, 3)]
    cache, metadata, (queries, keys, values), full = _mixed_step(shapes, seed=4)
    out = paged_attention(
        torch.cat(queries),
        torch.cat(keys),
        torch.cat(values),
        cache,
        CPU_KERNEL.prepare(metadata),
        8**-0.5,
    )
    expected = torch.cat(
        [dense_attention(q, k, v) for q, (k, v) in zip(queries, full, strict=True)]
    )
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    # the decode and the new prompt of a short context; SDPA the chunk after the cached prefix
    assert kernel_calls == [1 + 6]
    assert metadata.prepared.built and metadata.prepared.rows is None


def test_a_step_the_decode_stack_declines_still_attends_every_row(kernel_calls, monkeypatch):
    """The decode stack asks for the step's rows first (a Llama-family model on CPU); when a
    chunk takes SDPA it declines, and the layers' attention must still find the step's split
    between the kernel and SDPA: every output row written, none left as uninitialised memory
    (that was NaN or stale floats in the prompt's hidden states, and wrong tokens after)."""
    monkeypatch.setattr(cpu_kernel_attention, "KERNEL_MAX_CONTEXT", 6)
    monkeypatch.setattr(cpu_kernel_attention, "KERNEL_ANY_CONTEXT_MAX_TOKENS", 2)
    shapes = [(5, 1), (0, 6), (4, 3)]
    cache, metadata, (queries, keys, values), full = _mixed_step(shapes, seed=4)
    query = torch.cat(queries)
    prepared = CPU_KERNEL.prepare(metadata)
    assert stack_rows(prepared, query.shape[0]) is None
    out = paged_attention(query, torch.cat(keys), torch.cat(values), cache, prepared, 8**-0.5)
    expected = torch.cat(
        [dense_attention(q, k, v) for q, (k, v) in zip(queries, full, strict=True)]
    )
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert kernel_calls == [1 + 6]


def test_the_every_chunk_backend_sends_no_chunk_to_sdpa(kernel_calls, monkeypatch):
    """For a model that rounds rows to 8 bits, every chunk is kernel rows whatever its context
    (the step above, where a chunk took SDPA): one kernel call for the whole step, and each
    prompt token's floats those of a step where it is prefilled in a chunk of its own."""
    monkeypatch.setattr(cpu_kernel_attention, "KERNEL_MAX_CONTEXT", 6)
    monkeypatch.setattr(cpu_kernel_attention, "KERNEL_ANY_CONTEXT_MAX_TOKENS", 2)
    shapes = [(5, 1), (0, 6), (4, 3)]
    cache, metadata, (queries, keys, values), full = _mixed_step(shapes, seed=4)
    query = torch.cat(queries)
    out = paged_attention(
        query,
        torch.cat(keys),
        torch.cat(values),
        cache,
        CPU_KERNEL_EVERY_CHUNK.prepare(metadata),
        8**-0.5,
    )
    expected = torch.cat(
        [dense_attention(q, k, v) for q, (k, v) in zip(queries, full, strict=True)]
    )
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert kernel_calls == [1 + 6 + 3]
    # the chunk of 3 tokens after 4 cached: each alone, a row of its own
    assert_rows_decoded_alone(out, query, cache, metadata.prefills[1], first_row=7, first_len=5)


def test_a_chunk_past_the_prompt_takes_the_kernel_whatever_its_context(kernel_calls, monkeypatch):
    """A chunk that recomputes generated tokens (a resumed or preempted request) is kernel rows
    even where its context would send it to SDPA: each row's floats are those of the decode
    step that first made it, so the request goes on with the tokens it would have made."""
    monkeypatch.setattr(cpu_kernel_attention, "KERNEL_MAX_CONTEXT", 6)
    monkeypatch.setattr(cpu_kernel_attention, "KERNEL_ANY_CONTEXT_MAX_TOKENS", 2)
    shapes = [(5, 1), (0, 6), (4, 3)]
    cache, metadata, (queries, keys, values), full = _mixed_step(shapes, seed=4)
    metadata.prefills[1].past_prompt = True
    query = torch.cat(queries)
    out = paged_attention(
        query, torch.cat(keys), torch.cat(values), cache, CPU_KERNEL.prepare(metadata), 8**-0.5
    )
    assert kernel_calls == [1 + 6 + 3]
    assert_rows_decoded_alone(out, query, cache, metadata.prefills[1], first_row=7, first_len=5)


def test_a_few_tokens_after_a_long_context_take_the_kernel(kernel_calls, monkeypatch):
    """A chunk of at most ``KERNEL_ANY_CONTEXT_MAX_TOKENS`` tokens (a decode with its proposed
    tokens, speculative decoding) is kernel rows whatever its context."""
    monkeypatch.setattr(cpu_kernel_attention, "KERNEL_MAX_CONTEXT", 6)
    shapes = [(5, 1), (40, 5)]
    cache, metadata, (queries, keys, values), full = _mixed_step(shapes, seed=5)
    out = paged_attention(
        torch.cat(queries),
        torch.cat(keys),
        torch.cat(values),
        cache,
        CPU_KERNEL.prepare(metadata),
        8**-0.5,
    )
    expected = torch.cat(
        [dense_attention(q, k, v) for q, (k, v) in zip(queries, full, strict=True)]
    )
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert kernel_calls == [6]


def test_a_few_tokens_beside_a_chunk_that_takes_sdpa_stay_kernel_rows(kernel_calls, monkeypatch):
    """In a step whose longer chunk goes to SDPA, a chunk of a few tokens (a decode with its
    proposals) is still kernel rows with the decodes, its floats those of a step without the
    longer chunk: what shares a step does not change a request's tokens."""
    monkeypatch.setattr(cpu_kernel_attention, "KERNEL_MAX_CONTEXT", 6)
    monkeypatch.setattr(cpu_kernel_attention, "KERNEL_ANY_CONTEXT_MAX_TOKENS", 3)
    shapes = [(5, 1), (40, 3), (4, 5)]
    cache, metadata, (queries, keys, values), full = _mixed_step(shapes, seed=6)
    query = torch.cat(queries)
    out = paged_attention(
        query, torch.cat(keys), torch.cat(values), cache, CPU_KERNEL.prepare(metadata), 8**-0.5
    )
    expected = torch.cat(
        [dense_attention(q, k, v) for q, (k, v) in zip(queries, full, strict=True)]
    )
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert kernel_calls == [1 + 3]  # the decode and the short chunk; SDPA the longer one
    chunk = metadata.prefills[0]
    alone = paged_decode.paged_decode(
        query[1:4],
        cache,
        chunk.block_ids.expand(3, -1).contiguous(),
        torch.tensor([41, 42, 43]),
        8**-0.5,
        None,
    )
    assert torch.equal(out[1:4], alone.reshape(3, -1))
