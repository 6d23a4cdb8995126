"""The fused CPU layer operations on bfloat16 tensors give the values of the layers' torch code in
bfloat16 (RMSNorm within one bfloat16 step: its sum of squares in another order); the KV-cache
write stores float32 keys and values into a bfloat16 cache as ``Tensor.to`` rounds them."""

from __future__ import annotations

import pytest
import torch

from switchboard.kernels import fused_ops
from switchboard.models.attention import new_kv_cache, write_kv
from switchboard.models.layers import RMSNorm, apply_rotary, silu_and_mul

BF16 = torch.bfloat16


@pytest.fixture
def kernels():
    fused_ops.unload()
    assert fused_ops.load(), fused_ops.status()
    yield
    fused_ops.unload()
    fused_ops.load()


def _torch_path(op, *args):
    """``op(*args)`` through the layers' torch code (kernels unloaded for the call)."""
    fused_ops.unload()
    try:
        return op(*args)
    finally:
        fused_ops.load()


@pytest.mark.parametrize(("rows", "hidden"), [(1, 8), (3, 576), (300, 576)])
def test_rms_norm_in_bfloat16(kernels, rows, hidden):
    torch.manual_seed(rows)
    norm = RMSNorm(hidden, 1e-5)
    norm.weight.data = torch.randn(hidden)
    norm = norm.to(BF16)
    x = torch.randn(rows, hidden).to(BF16) * 3
    assert fused_ops.rms_norm(x, norm.weight, norm.eps) is not None
    ours, theirs = norm(x), _torch_path(norm, x)
    assert ours.dtype == BF16
    step = theirs.float().abs() * 2.0**-7  # one bfloat16 step (8 significant bits)
    assert ((ours.float() - theirs.float()).abs() <= step).all()
    assert (ours == theirs).float().mean() > 0.99  # the same value but for rare sum orders


@pytest.mark.parametrize(("tokens", "heads"), [(1, 3), (7, 9), (200, 9)])
def test_rotary_and_silu_in_bfloat16_are_bit_identical(kernels, tokens, heads):
    torch.manual_seed(tokens)
    qkv = torch.randn(tokens, (heads + 4) * 64).to(BF16)
    query = qkv[:, : heads * 64].view(tokens, heads, 64)  # a view at the fused output's stride
    cos, sin = torch.randn(tokens, 32).to(BF16), torch.randn(tokens, 32).to(BF16)
    expected = _torch_path(apply_rotary, query.clone(), cos, sin)
    assert fused_ops.rotary_(query, cos, sin)  # in place
    assert torch.equal(query, expected)
    gate_up = torch.randn(tokens, 2 * 96).to(BF16) * 4
    ours = silu_and_mul(gate_up)
    assert ours.dtype == BF16 and torch.equal(ours, _torch_path(silu_and_mul, gate_up))


def test_write_kv_into_a_bfloat16_cache_rounds_as_tensor_to(kernels):
    torch.manual_seed(0)
    key, value = torch.randn(5, 3, 16), torch.randn(5, 3, 16)
    key[0, 0, 0], value[1, 1, 1] = float("nan"), float("inf")
    slots = torch.tensor([17, 3, 40, 41, 0])
    cache = new_kv_cache(4, 16, 3, 16, BF16, "cpu")
    expected = cache.clone()
    expected[0].view(-1, 3, 16).index_copy_(0, slots, key.to(BF16))
    expected[1].view(-1, 3, 16).index_copy_(0, slots, value.to(BF16))
    assert fused_ops.write_kv(cache, key, value, slots)
    _assert_same(cache, expected)
    torch_cache = new_kv_cache(4, 16, 3, 16, BF16, "cpu")
    _torch_path(write_kv, torch_cache, key, value, slots)  # the torch path converts too
    _assert_same(torch_cache, expected)


def _assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    """Equal values, NaNs where NaNs are (torch's NaN bits vary with its code path)."""
    assert torch.equal(a.isnan(), b.isnan())
    assert torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))
