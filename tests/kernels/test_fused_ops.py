"""The fused CPU layer operations: RMSNorm and SiLU-and-mul to float32 rounding of torch's, the
rotary embedding bit for bit (in place, on a view into the fused QKV output), the KV-cache write
slot for slot (bounds-checked), small and large inputs (the large ones on torch's threads),
other inputs left to torch, and an off switch."""

from __future__ import annotations

import pytest
import torch

from switchboard.kernels import fused_ops
from switchboard.models.attention import new_kv_cache, write_kv
from switchboard.models.layers import RMSNorm, apply_rotary, silu_and_mul


@pytest.fixture
def kernels():
    fused_ops.unload()
    assert fused_ops.load(), fused_ops.status()  # this machine has a C compiler
    yield
    fused_ops.unload()


def _torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    variance = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(variance + eps))


def _torch_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


@pytest.mark.parametrize(("rows", "hidden"), [(1, 8), (3, 576), (8, 1000), (300, 576)])
def test_rms_norm_matches_torch(kernels, rows, hidden):
    torch.manual_seed(rows + hidden)
    x, weight = torch.randn(rows, hidden) * 3, torch.randn(hidden)
    got = fused_ops.rms_norm(x, weight, 1e-6)
    assert got is not None
    torch.testing.assert_close(got, _torch_rms_norm(x, weight, 1e-6), rtol=2e-6, atol=2e-6)
    wide = torch.randn(rows, hidden + 5)[:, :hidden]  # rows at a stride: read in place
    got = fused_ops.rms_norm(wide, weight, 1e-6)
    assert got is not None
    torch.testing.assert_close(got, _torch_rms_norm(wide, weight, 1e-6), rtol=2e-6, atol=2e-6)


def test_rms_norm_module_uses_it_and_matches(kernels):
    norm = RMSNorm(64, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64))
    x = torch.randn(5, 64)
    torch.testing.assert_close(norm(x), _torch_rms_norm(x, norm.weight, 1e-5))


@pytest.mark.parametrize(("tokens", "heads"), [(1, 2), (7, 9), (600, 8)])
def test_rotary_in_place_on_a_qkv_view_is_bit_identical(kernels, tokens, heads):
    torch.manual_seed(tokens * heads)
    head_dim, kv_heads = 64, 3
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim)
    cos, sin = torch.randn(tokens, head_dim // 2), torch.randn(tokens, head_dim // 2)
    query = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    key = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, -1)
    value_before = qkv[:, (heads + kv_heads) * head_dim :].clone()
    expected_q, expected_k = _torch_rotary(query, cos, sin), _torch_rotary(key, cos, sin)
    assert apply_rotary(query, cos, sin) is query  # in place
    assert apply_rotary(key, cos, sin) is key
    assert torch.equal(query, expected_q) and torch.equal(key, expected_k)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim :], value_before)  # untouched


@pytest.mark.parametrize(("rows", "intermediate"), [(1, 8), (8, 1536), (40, 2048)])
def test_silu_and_mul_matches_torch(kernels, rows, intermediate):
    torch.manual_seed(rows)
    gate_up = torch.randn(rows, 2 * intermediate) * 6  # exp's range, both tails
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # e^x clamped: still exact
    gate, up = gate_up.chunk(2, dim=-1)
    expected = torch.nn.functional.silu(gate) * up
    got = fused_ops.silu_and_mul(gate_up)
    assert got is not None
    torch.testing.assert_close(got, expected, rtol=2e-6, atol=1e-6)
    torch.testing.assert_close(silu_and_mul(gate_up), expected, rtol=2e-6, atol=1e-6)


def test_write_kv_fills_the_same_slots_as_index_copy(kernels):
    torch.manual_seed(0)
    tokens, kv_heads, head_dim, heads = 5, 3, 16, 6
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim)  # key/value: views at a stride
    key = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, -1)
    value = qkv[:, (heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
    slots = torch.tensor([17, 3, 40, 41, 0])
    cache = new_kv_cache(4, 16, kv_heads, head_dim, torch.float32, "cpu")
    expected = cache.clone()
    expected[0].view(-1, kv_heads, head_dim).index_copy_(0, slots, key)
    expected[1].view(-1, kv_heads, head_dim).index_copy_(0, slots, value)
    write_kv(cache, key, value, slots)
    assert torch.equal(cache, expected)
    before = cache.clone()
    with pytest.raises(IndexError, match="outside the KV cache"):
        fused_ops.write_kv(cache, key, value, torch.tensor([1, 2, 64, 3, 4]))  # 64 slots
    assert torch.equal(cache, before)  # nothing written


@pytest.mark.parametrize("vocab", [1, 7, 16, 23, 31, 32, 33, 100, 1000, 16000, 49152])
def test_argmax_rows_is_torchs_answer(kernels, vocab):
    torch.manual_seed(vocab)
    x = torch.randn(9, vocab)
    if vocab >= 16:
        x[1] = 0.0  # all equal: the first
        x[2, 3] = x[2, -1] = x[2].max() + 1  # a tie for the largest: the first of the two
        if vocab >= 64:
            x[2, 41] = x[2, 3]  # ... in lanes of two chains: still the first
        x[3] = float("-inf")
        x[4, 5] = float("inf")
        x[5, -2] = float("nan")  # a NaN wins, wherever it is
        x[6, 9] = x[6, 12] = float("nan")  # the first NaN
        x[7, -1] = x[7].max() + 1  # the largest in the tail past the last eight
        x[8] = -0.0
        x[8, 10] = 0.0  # equal to -0.0: the first stays
    got = fused_ops.argmax_rows(x)
    assert got is not None and got.dtype == torch.int64
    assert torch.equal(got, x.argmax(dim=-1))
    strided = torch.randn(5, vocab + 3)[:, :vocab]  # rows at a stride
    assert torch.equal(fused_ops.argmax_rows(strided), strided.argmax(dim=-1))


def test_the_greedy_sampler_picks_with_it(kernels):
    from switchboard.worker import sampler

    logits = torch.randn(4, 300)
    assert torch.equal(sampler.greedy_tokens(logits), logits.argmax(dim=-1))
    assert fused_ops.argmax_rows(torch.randn(0, 300)) is None  # nothing to pick: torch's


def test_other_inputs_are_left_to_torch(kernels):
    x = torch.randn(4, 16, dtype=torch.float64)
    assert fused_ops.rms_norm(x, torch.randn(16, dtype=torch.float64), 1e-6) is None
    assert fused_ops.rms_norm(torch.randn(4, 16).t(), torch.randn(4), 1e-6) is None
    assert fused_ops.argmax_rows(torch.randn(4, 16, dtype=torch.float64)) is None
    assert fused_ops.argmax_rows(torch.randn(16, 4).t()) is None  # columns at a stride
    assert not fused_ops.rotary_(torch.randn(2, 3, 8).transpose(0, 1), *torch.randn(2, 3, 4))
    half = torch.randn(2, 3, 8, dtype=torch.float16)
    cos, sin = torch.randn(2, 4, dtype=torch.float16), torch.randn(2, 4, dtype=torch.float16)
    expected = _torch_rotary(half, cos, sin)
    assert torch.equal(apply_rotary(half, cos, sin), expected)  # torch's path, a new tensor
    assert fused_ops.rms_norm(torch.randn(4, 16), torch.randn(16, dtype=torch.bfloat16), 1) is None


def test_can_be_turned_off(monkeypatch):
    fused_ops.unload()
    monkeypatch.setenv("SWITCHBOARD_FUSED_OPS", "off")
    assert not fused_ops.load()
    assert "off" in fused_ops.status()
    assert fused_ops.rms_norm(torch.randn(2, 8), torch.randn(8), 1e-6) is None
    assert not fused_ops.rotary_(torch.randn(2, 3, 8), torch.randn(2, 4), torch.randn(2, 4))
    assert fused_ops.silu_and_mul(torch.randn(2, 8)) is None
    assert fused_ops.argmax_rows(torch.randn(2, 8)) is None
