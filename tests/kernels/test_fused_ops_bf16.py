"""The fused CPU layer operations on bfloat16 tensors give the values of the layers' torch code in
bfloat16 (RMSNorm within one bfloat16 step: its sum of squares in another order); the KV-cache
write stores float32 keys and values into a bfloat16 cache as ``Tensor.to`` rounds them; the
bfloat16 <-> float32 conversions and the residual add give torch's values bit for bit."""

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


def _awkward_floats(rows: int, cols: int) -> torch.Tensor:
    """Random floats of every scale, with the values rounding to bfloat16 must get right: ties
    to even, the largest finite values, infinities, NaNs (of both signs and with payloads),
    subnormals and signed zeros."""
    torch.manual_seed(rows * cols)
    x = torch.randn(rows, cols) * torch.exp2(torch.randint(-130, 128, (rows, cols)).float())
    bits = x.view(torch.int32).flatten()
    specials = [
        0x3F808000, 0x3F818000, 0x3F807FFF, 0x7F7FFFFF, 0x7F7F8000, 0x7F800000,
        -0x00800000, 0x7FC00000, 0x7F800001, -0x00400001, 0x00000001, 0x00008000,
        -0x80000000, 0, 0x3F80FFFF, 0x4049_0FDB,
    ]  # fmt: skip
    count = min(len(specials), bits.numel())
    bits[:count] = torch.tensor(specials[:count], dtype=torch.int32)
    return x


def _assert_same_bits(got: torch.Tensor, expected: torch.Tensor, bits: torch.dtype) -> None:
    """Bit for bit, but a NaN's bits: torch's vectorized and scalar code give NaNs different
    bits (0xffff, 0x7fc0), the kernels torch's scalar NaN."""
    assert torch.equal(got.isnan(), expected.isnan())
    keep = ~expected.isnan()
    assert torch.equal(got[keep].view(bits), expected[keep].view(bits))


@pytest.mark.parametrize(("rows", "cols"), [(1, 7), (3, 40), (64, 768), (130, 2048)])
def test_conversions_give_tensor_to_values(kernels, rows, cols):
    """float32 -> bfloat16 rounds as ``Tensor.to``, bfloat16 -> float32 is exact; rows read
    with a row stride."""
    wide = _awkward_floats(rows, cols + 5)
    x = wide[:, :cols]  # a row stride past the row
    narrowed = fused_ops.to_dtype(x, BF16)
    assert narrowed.dtype == BF16
    _assert_same_bits(narrowed, x.to(BF16), torch.int16)
    back = fused_ops.to_dtype(wide.to(BF16)[:, :cols], torch.float32)
    _assert_same_bits(back, x.to(BF16).float(), torch.int32)


def test_other_conversions_are_torchs():
    x = torch.randn(4, 6)
    assert fused_ops.to_dtype(x, torch.float32) is x
    assert torch.equal(fused_ops.to_dtype(x, torch.float16), x.half())
    assert torch.equal(fused_ops.to_dtype(x.t(), BF16), x.t().to(BF16))  # a column stride
    assert fused_ops.to_dtype(torch.empty(0, 6), BF16).shape == (0, 6)


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize(("rows", "cols"), [(1, 9), (96, 768), (200, 576)])
def test_add_is_torchs_sum(kernels, dtype, rows, cols):
    a = _awkward_floats(rows, cols).to(dtype)
    b = _awkward_floats(cols, rows).t().contiguous().to(dtype)[:, :cols]
    got = fused_ops.add(a[:, :cols], b)
    assert got.dtype == dtype
    _assert_same_bits(got, a[:, :cols] + b, torch.int32 if dtype == torch.float32 else torch.int16)
