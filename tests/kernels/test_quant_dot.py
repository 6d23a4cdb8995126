"""The quantized small-batch matmul's integer dot product kernel (the default), each variant
forced in turn (``SWITCHBOARD_QUANT_GEMM``): the panels give back the weight exactly; a product
is the exact integer sums of the rows rounded to int8 per block (as computed here in float64)
to float32 rounding, and within the rounding of the rows of the float32 product; every variant
gives the same floats; 4-bit formats packed as 4 bits compute what 8 do, float16 scales what
float32 ones do, and so do panels without offsets; each row independent
of its neighbours; 16- and 32-input blocks, a bias,
strided and empty inputs; the pick by the CPU's flags and the override."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from switchboard.kernels import gemm, quant_gemm
from switchboard.kernels.build import cpu_flags
from switchboard.kernels.quant_formats import QuantRows, decode_gguf, stack_rows
from tests.gguf_blocks import KERNEL_TYPES, gguf_blocks

VARIANTS = list(quant_gemm.DOT_VARIANTS)


def test_this_machine_runs_every_variant_its_flags_allow():
    runnable = quant_gemm.dot_variants()
    assert "avx2" in runnable  # this machine has AVX2 and cc
    assert ("vnni512" in runnable) == ({"avx512bw", "avx512_vnni"} <= cpu_flags())


@pytest.fixture(params=VARIANTS)
def variant(request):
    if request.param not in quant_gemm.dot_variants():
        pytest.skip(f"this CPU does not run {request.param}")
    quant_gemm.unload()
    assert quant_gemm.load(request.param), quant_gemm.status()
    yield request.param
    quant_gemm.unload()


def _random_rows(out_features: int, in_features: int, block: int, seed: int) -> QuantRows:
    rng = np.random.default_rng(seed)
    blocks = in_features // block
    q = rng.integers(-128, 128, size=(out_features, in_features), dtype=np.int8)
    scale = rng.uniform(0.001, 0.02, size=(out_features, blocks)).astype(np.float32)
    offset = rng.uniform(-0.5, 0.5, size=(out_features, blocks)).astype(np.float32)
    return QuantRows(q, scale, offset, block, "test")


def _rounded_rows_product(x: torch.Tensor, rows: QuantRows, bias: torch.Tensor | None):
    """What the kernel computes, in float64: x rounded to int8 per block (d = the block's
    largest magnitude / 127 in float32, to nearest even), the exact sums of q * xq, then
    d * (scale * sum + offset * sum of xq) over the blocks."""
    count, inputs = x.shape
    block = rows.block
    xb = x.view(count, inputs // block, block)
    d = xb.abs().amax(dim=2) / 127
    inverse = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    xq = torch.round(xb * inverse[:, :, None]).double()
    q = torch.from_numpy(rows.q).double().view(rows.shape[0], inputs // block, block)
    sums = torch.einsum("mbk,nbk->mnb", xq, q)
    scale = torch.from_numpy(rows.scale).double()
    offset = torch.zeros_like(scale) if rows.offset is None else torch.from_numpy(rows.offset)
    y = d.double()[:, None, :] * (scale[None] * sums + offset.double()[None] * xq.sum(2)[:, None])
    y = y.sum(dim=2)
    return (y if bias is None else y + bias.double()).float()


FOUR_BIT_TYPES = ("Q4_0", "Q4_1", "Q4_K")  # q spans 16 values: packed as 4 bits
HALF_SCALE_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")  # float16 scales (and offsets)
NO_OFFSET_TYPES = ("Q8_0", "Q5_0", "Q6_K")  # w = scale * q, 8 bits: the panels hold none


@pytest.mark.parametrize("type_name", KERNEL_TYPES)
def test_packing_keeps_every_gguf_types_values(variant, type_name):
    rng = np.random.default_rng(sum(map(ord, type_name)))
    rows = decode_gguf(gguf_blocks(type_name, 37, 512, rng), type_name)
    panels = quant_gemm.pack(rows)
    bits = 4 if type_name in FOUR_BIT_TYPES else 8
    assert panels.dot and panels.bits == bits
    # GGUF stores these types' scale (and Q4_1's offset) as float16: the panels do too
    assert panels.half_scales or type_name not in HALF_SCALE_TYPES
    assert panels.offsets == (type_name not in NO_OFFSET_TYPES)
    size = quant_gemm.panel_bytes(37, 512, rows.block, bits, panels.half_scales, panels.offsets)
    assert panels.nbytes == size
    assert torch.equal(quant_gemm.unpack(panels), torch.from_numpy(rows.dequantize()))


@pytest.mark.parametrize("type_name", KERNEL_TYPES)
def test_compact_factors_compute_what_float32_ones_do(variant, type_name, monkeypatch):
    """Float16 factors, or no offsets, are taken only where they are exact, so every float is
    the same."""
    rng = np.random.default_rng(11)
    rows = decode_gguf(gguf_blocks(type_name, 41, 256, rng), type_name)
    chosen = quant_gemm.pack(rows)
    monkeypatch.setenv("SWITCHBOARD_QUANT_HALF_SCALES", "off")
    full = quant_gemm.pack(rows)
    assert not full.half_scales and full.offsets and full.bits == chosen.bits
    if type_name in HALF_SCALE_TYPES:
        assert chosen.half_scales and chosen.nbytes < full.nbytes
    for count in (1, 2, 5, 9):
        x = torch.randn(count, 256)
        bias = torch.randn(41)
        assert torch.equal(quant_gemm.linear(x, chosen, bias), quant_gemm.linear(x, full, bias))


def test_scales_float16_does_not_hold_stay_float32(variant):
    rows = _random_rows(33, 64, 32, 3)  # uniform random float32 scales: not float16
    rows.scale[5, 1] = 1e-30  # below float16's smallest subnormal
    panels = quant_gemm.pack(rows)
    assert not panels.half_scales and panels.offsets
    assert panels.nbytes == quant_gemm.panel_bytes(33, 64, 32, 8)
    scaled_only = QuantRows(rows.q, rows.scale, None, 32, "test")
    without_offsets = quant_gemm.pack(scaled_only)
    assert not without_offsets.half_scales and not without_offsets.offsets
    x = torch.randn(3, 64)
    expected = _rounded_rows_product(x, scaled_only, None)
    got = quant_gemm.linear(x, without_offsets)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    half = rows.scale.astype(np.float16).astype(np.float32)  # now every one is exact,
    half[5, 1] = 2.0**-24  # a subnormal float16 among them
    offset = rows.offset.astype(np.float16).astype(np.float32)
    exact = QuantRows(rows.q, half, offset, 32, "test")
    panels = quant_gemm.pack(exact)
    assert panels.half_scales
    assert torch.equal(quant_gemm.unpack(panels), torch.from_numpy(exact.dequantize()))


@pytest.mark.parametrize("type_name", FOUR_BIT_TYPES)
def test_four_bits_compute_what_eight_do(variant, type_name, monkeypatch):
    """The same integer sums; Q4_0's -8 moves from the sums into the offset (a float rounding
    apart), the others give the same floats."""
    rng = np.random.default_rng(5)
    rows = decode_gguf(gguf_blocks(type_name, 50, 256, rng), type_name)
    four = quant_gemm.pack(rows)
    monkeypatch.setenv("SWITCHBOARD_QUANT_4BIT", "off")
    eight = quant_gemm.pack(rows)
    assert (four.bits, eight.bits) == (4, 8)
    for count in (1, 2, 3, 9):
        x = torch.randn(count, 256)
        got, expected = quant_gemm.linear(x, four), quant_gemm.linear(x, eight)
        if type_name == "Q4_0":
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(got, expected)
        torch.testing.assert_close(got, _rounded_rows_product(x, rows, None), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block", [16, 32])
def test_four_bit_sums_at_their_largest(variant, block):
    """4-bit values at 15 times inputs rounded to +-127 everywhere: the largest sums a block can
    have (the avx2 variant sums a block's 4-bit products in 16 bits before widening them)."""
    q = np.full((40, 128), 15, dtype=np.int8)
    q[7, :] = 0  # q spans 0..15: packed as 4 bits, u = q
    scale = np.full((40, 128 // block), 0.01, dtype=np.float32)
    rows = QuantRows(q, scale, np.zeros_like(scale), block, "test")
    panels = quant_gemm.pack(rows)
    assert panels.bits == 4
    signs = torch.tensor([1.0, -1.0, 1.0, -1.0] * 32)
    x = torch.stack([torch.ones(128), -torch.ones(128), signs, 3 * torch.ones(128)] * 4)
    for count in (1, 2, 3, 4, 5, 6, 7, 16):
        expected = _rounded_rows_product(x[:count], rows, None)
        assert float(expected[0, 0]) == pytest.approx(0.01 * 15 * 128)
        torch.testing.assert_close(quant_gemm.linear(x[:count], panels), expected)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 13, 21])
@pytest.mark.parametrize(
    ("out_features", "in_features", "block"), [(1, 32, 32), (17, 64, 16), (100, 96, 32)]
)
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_integer_sums_of_the_rounded_rows(
    variant, rows, out_features, in_features, block, with_bias
):
    torch.manual_seed(rows)
    weight_rows = _random_rows(out_features, in_features, block, rows)
    panels = quant_gemm.pack(weight_rows)
    bias = torch.randn(out_features) if with_bias else None
    x = torch.randn(rows, in_features)
    got = quant_gemm.linear(x, panels, bias)
    expected = _rounded_rows_product(x, weight_rows, bias)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # and the float32 product on the dequantized weight, within the rows' rounding: per input
    # at most half a step (d / 2) times the weight's size, summed
    exact = F.linear(x, quant_gemm.unpack(panels), bias)
    weight_size = float(quant_gemm.unpack(panels).abs().max())
    bound = in_features * float(x.abs().max()) / 254 * weight_size
    assert float((got - exact).abs().max()) <= bound


def test_the_variants_give_the_same_floats():
    """Every variant this CPU runs gives the floats of the first: 8- and 4-bit panels, blocks
    of 16 and 32, rows from one to several groups of each variant's."""
    runnable = quant_gemm.dot_variants()
    if len(runnable) < 2:
        pytest.skip("one variant runs here")
    torch.manual_seed(0)
    x, bias = torch.randn(40, 256), torch.randn(70)
    rng = np.random.default_rng(3)
    weights = [_random_rows(70, 256, block, block) for block in (16, 32)]
    weights.append(decode_gguf(gguf_blocks("Q4_1", 70, 256, rng), "Q4_1"))
    counts = (1, 2, 3, 4, 5, 9, 11, 13, 16, 17, 30, 40)
    results: dict[str, list[torch.Tensor]] = {}
    for name in runnable:
        assert quant_gemm.load(name)
        results[name] = []
        for rows in weights:
            panels = quant_gemm.pack(rows)
            assert panels.bits == (4 if rows.format == "Q4_1" else 8)
            results[name] += [quant_gemm.linear(x[:n], panels, bias) for n in counts]
    quant_gemm.unload()
    first = results[runnable[0]]
    for name in runnable[1:]:
        for mine, theirs in zip(results[name], first, strict=True):
            assert torch.equal(mine, theirs), name


def test_a_row_does_not_depend_on_its_neighbours(variant):
    torch.manual_seed(0)
    rows = 2 * quant_gemm.max_rows() + 3  # groups of max_rows, and a part group
    panels = quant_gemm.pack(_random_rows(200, 320, 32, 0))
    x = torch.randn(rows, 320)
    together = quant_gemm.linear(x, panels)
    for row in range(rows):
        assert torch.equal(quant_gemm.linear(x[row : row + 1], panels)[0], together[row])


def test_a_large_step_takes_the_kernel_too(variant):
    """gemm.linear sends products of every size on dot product panels to the kernel: a row's
    result is the same in a step of one row and in one longer than a decode step (a prompt
    chunk beside it), so greedy output does not depend on the load."""
    torch.manual_seed(0)
    panels = quant_gemm.pack(_random_rows(48, 64, 32, 2))
    weight = quant_gemm.unpack(panels)
    x = torch.randn(gemm.SMALL_BATCH_MAX_ROWS + 5, 64)
    together = gemm.linear(x, weight, panels=panels)
    assert torch.equal(together, quant_gemm.linear(x, panels))
    for row in (0, x.shape[0] - 1):
        assert torch.equal(gemm.linear(x[row : row + 1], weight, panels=panels)[0], together[row])


def test_strided_rows_no_rows_zero_rows_and_wrong_inputs(variant):
    weight_rows = _random_rows(40, 64, 32, 1)
    panels = quant_gemm.pack(weight_rows)
    wide = torch.randn(3, 128)
    wide[1] = 0.0  # a row of zeros: d = 0, no division by it
    for x in (wide[:, ::2], wide[:, :64]):  # a column stride (copied), a row stride (in place)
        torch.testing.assert_close(
            quant_gemm.linear(x, panels), _rounded_rows_product(x, weight_rows, None)
        )
    assert not quant_gemm.linear(wide[1:2, :64], panels).any()
    assert quant_gemm.linear(torch.randn(0, 64), panels).shape == (0, 40)
    with pytest.raises(ValueError, match="32 inputs for a weight of 64"):
        quant_gemm.linear(torch.randn(2, 32), panels)


def test_fused_rows_of_different_blocks(variant):
    rng = np.random.default_rng(3)
    fused = stack_rows(
        [
            decode_gguf(gguf_blocks("Q4_K", 32, 256, rng), "Q4_K"),
            decode_gguf(gguf_blocks("Q6_K", 16, 256, rng), "Q6_K"),
        ]
    )
    panels = quant_gemm.pack(fused)
    assert torch.equal(quant_gemm.unpack(panels), torch.from_numpy(fused.dequantize()))
    x = torch.randn(3, 256)
    torch.testing.assert_close(
        quant_gemm.linear(x, panels), _rounded_rows_product(x, fused, None), rtol=1e-5, atol=1e-4
    )


def test_the_pick_and_the_override(monkeypatch):
    quant_gemm.unload()
    monkeypatch.delenv("SWITCHBOARD_QUANT_GEMM", raising=False)
    assert quant_gemm.load()
    assert quant_gemm.variant() == quant_gemm.dot_variants()[0]  # the fastest this CPU runs
    assert "integer dot products" in quant_gemm.status()
    monkeypatch.setenv("SWITCHBOARD_QUANT_GEMM", "exact")
    assert quant_gemm.load() and quant_gemm.variant() == quant_gemm.EXACT
    assert not quant_gemm.pack(_random_rows(4, 32, 32, 0)).dot
    monkeypatch.setenv("SWITCHBOARD_QUANT_GEMM", "avx2")
    assert quant_gemm.load() and quant_gemm.variant() == "avx2"
    monkeypatch.setenv("SWITCHBOARD_QUANT_GEMM", "fastest")
    with pytest.raises(ValueError, match="SWITCHBOARD_QUANT_GEMM='fastest': use auto, off"):
        quant_gemm.load()
    quant_gemm.unload()
