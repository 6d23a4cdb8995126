"""The quantized small-batch matmul's exact kernel (``SWITCHBOARD_QUANT_GEMM=exact``; the default
integer dot product kernel: test_quant_dot.py): every GGUF type it takes packed exactly (the
panels give back gguf's own dequantization bit for bit), its products those of the float32
small-batch kernel on the dequantized weight bit for bit (and x @ w.T to rounding) for one row
to several groups of rows, any output size, with or without a bias; each row independent of its
neighbours; the same floats from the AVX2 build; int8 made from float32 weights; a clear error
for other types; an off switch."""

from __future__ import annotations

import ctypes
import subprocess

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from switchboard.kernels import library, quant_gemm, small_batch_gemm
from switchboard.kernels.build import FLAGS, compiler, cpu_flags
from switchboard.kernels.quant_formats import (
    QuantRows,
    UnsupportedQuantType,
    decode_gguf,
    quantize_int8,
    stack_rows,
)
from tests.gguf_blocks import KERNEL_TYPES, gguf_blocks


@pytest.fixture
def kernels():
    quant_gemm.unload()
    small_batch_gemm.unload()
    assert quant_gemm.load(quant_gemm.EXACT), quant_gemm.status()  # this machine has AVX2 and cc
    assert small_batch_gemm.load(), small_batch_gemm.status()
    yield
    quant_gemm.unload()
    small_batch_gemm.unload()


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal bit for bit, -0.0 taken as 0.0 (adding a zero offset turns one into the other)."""
    return a.shape == b.shape and np.array_equal((a + 0.0).view(np.int32), (b + 0.0).view(np.int32))


@pytest.mark.parametrize("type_name", KERNEL_TYPES)
def test_packing_gives_back_ggufs_dequantization(kernels, type_name):
    rng = np.random.default_rng(len(type_name) + sum(map(ord, type_name)))
    blocks = gguf_blocks(type_name, 37, 512, rng)  # 37 rows: three panels, the last partial
    reference = dequantize(blocks, GGMLQuantizationType[type_name])
    rows = decode_gguf(blocks, type_name)
    assert rows.block == (16 if type_name == "Q6_K" else 32)
    assert _same_bits(rows.dequantize(), reference)
    panels = quant_gemm.pack(rows)
    assert panels.nbytes == quant_gemm.panel_bytes(37, 512, rows.block)
    assert (panels.out_features, panels.in_features, panels.format) == (37, 512, type_name)
    assert _same_bits(quant_gemm.unpack(panels).numpy(), reference)


def _random_rows(out_features: int, in_features: int, block: int, seed: int) -> QuantRows:
    rng = np.random.default_rng(seed)
    blocks = in_features // block
    q = rng.integers(-128, 128, size=(out_features, in_features), dtype=np.int8)
    scale = rng.uniform(0.001, 0.02, size=(out_features, blocks)).astype(np.float32)
    offset = rng.uniform(-0.5, 0.5, size=(out_features, blocks)).astype(np.float32)
    return QuantRows(q, scale, offset, block, "test")


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 21, 32])
@pytest.mark.parametrize(
    ("out_features", "in_features", "block"), [(1, 32, 32), (17, 64, 16), (100, 96, 32)]
)
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_float32_kernels_floats_on_the_dequantized_weight(
    kernels, rows, out_features, in_features, block, with_bias
):
    torch.manual_seed(rows)
    panels = quant_gemm.pack(_random_rows(out_features, in_features, block, rows))
    weight = quant_gemm.unpack(panels)
    bias = torch.randn(out_features) if with_bias else None
    x = torch.randn(rows, in_features)
    got = quant_gemm.linear(x, panels, bias)
    assert torch.equal(got, small_batch_gemm.linear(x, small_batch_gemm.pack(weight), bias))
    torch.testing.assert_close(got, F.linear(x, weight, bias), rtol=1e-5, atol=1e-4)


def test_a_row_does_not_depend_on_its_neighbours(kernels):
    torch.manual_seed(0)
    rows = 2 * quant_gemm.max_rows() + 3  # groups of max_rows, and a part group
    panels = quant_gemm.pack(_random_rows(200, 320, 32, 0))
    x = torch.randn(rows, 320)
    together = quant_gemm.linear(x, panels)
    for row in range(rows):
        assert torch.equal(quant_gemm.linear(x[row : row + 1], panels)[0], together[row])


def test_strided_rows_no_rows_and_wrong_inputs(kernels):
    panels = quant_gemm.pack(_random_rows(40, 64, 32, 1))
    wide = torch.randn(3, 128)
    weight = quant_gemm.unpack(panels)
    for x in (wide[:, ::2], wide[:, :64]):  # a column stride (copied), a row stride (in place)
        torch.testing.assert_close(quant_gemm.linear(x, panels), F.linear(x, weight))
    assert quant_gemm.linear(torch.randn(0, 64), panels).shape == (0, 40)
    with pytest.raises(ValueError, match="32 inputs for a weight of 64"):
        quant_gemm.linear(torch.randn(2, 32), panels)


def test_fused_rows_of_different_blocks_take_the_finer(kernels):
    rng = np.random.default_rng(3)
    q4 = decode_gguf(gguf_blocks("Q4_K", 32, 256, rng), "Q4_K")
    q6 = decode_gguf(gguf_blocks("Q6_K", 16, 256, rng), "Q6_K")
    fused = stack_rows([q4, q6])
    assert (fused.block, fused.format, fused.shape) == (16, "mixed", (48, 256))
    expected = np.concatenate([q4.dequantize(), q6.dequantize()])
    assert _same_bits(quant_gemm.unpack(quant_gemm.pack(fused)).numpy(), expected)


def test_int8_from_float32_weights():
    rng = np.random.default_rng(4)
    weight = rng.standard_normal((24, 96)).astype(np.float32)
    weight[3, 32:64] = 0.0  # a block of zeros: scale 0, no division by it
    rows = quantize_int8(weight)
    assert (rows.block, rows.format, rows.offset) == (32, "int8", None)
    assert int(np.abs(rows.q.astype(np.int32)).max()) == 127
    error = np.abs(rows.dequantize() - weight).reshape(24, 3, 32).max(axis=2)
    assert np.all(error <= rows.scale / 2 * (1 + 1e-5))  # rounding to the nearest step
    assert not rows.dequantize()[3, 32:64].any()


def test_other_gguf_types_are_refused_by_name():
    with pytest.raises(UnsupportedQuantType, match="GGUF type Q2_K is not one .* Q4_K"):
        decode_gguf(np.zeros((2, 84), np.uint8), "Q2_K")
    with pytest.raises(UnsupportedQuantType, match="GGUF type F16"):
        decode_gguf(np.zeros((2, 64), np.uint8), "F16")


def test_can_be_turned_off(monkeypatch):
    quant_gemm.unload()
    monkeypatch.setenv("SWITCHBOARD_QUANT_GEMM", "off")
    assert not quant_gemm.load()
    assert "off" in quant_gemm.status()
    with pytest.raises(ValueError, match="quantized pack needs the kernel loaded"):
        quant_gemm.pack(quantize_int8(np.ones((4, 32), np.float32)))
    quant_gemm.unload()


@pytest.mark.slow
@pytest.mark.skipif("avx512f" not in cpu_flags(), reason="the AVX2 build is the library here")
def test_the_avx2_build_gives_the_same_floats(kernels, tmp_path):
    """Built without AVX-512 (6 rows at a time, two AVX2 vectors a panel), the kernel still
    computes the float32 kernel's floats on the dequantized weight."""
    cc = compiler()
    assert cc is not None
    built = tmp_path / "avx2.so"
    sources = [str(library.SOURCE_DIR / name) for name in ("quant_gemm.c", "small_batch_gemm.c")]
    subprocess.run(
        [cc, *FLAGS, "-mno-avx512f", "-I", str(library.SOURCE_DIR), *sources, "-o", str(built)],
        check=True,
        timeout=300,
    )
    avx2 = ctypes.CDLL(str(built))  # its work pool is the loaded library's (RTLD_GLOBAL)
    for name in ("quant_gemm_max_rows", "quant_pack", "quant_linear"):
        result, arguments = library.SIGNATURES[name]
        function = getattr(avx2, name)
        function.restype, function.argtypes = result, arguments
    assert avx2.quant_gemm_max_rows() == 6
    for block in (16, 32):
        rows = _random_rows(50, 128, block, block)
        panels = quant_gemm.pack(rows)
        fp32_panels = small_batch_gemm.pack(quant_gemm.unpack(panels))
        for count in (1, 2, 3, 4, 5, 7, 13):
            x, bias = torch.randn(count, 128), torch.randn(50)
            y = torch.empty(count, 50)
            code = avx2.quant_linear(
                x.data_ptr(), 128, panels.data.data_ptr(), bias.data_ptr(), y.data_ptr(),
                count, 128, 50, block,
            )  # fmt: skip
            assert code == 0
            assert torch.equal(y, quant_gemm.linear(x, panels, bias))
            assert torch.equal(y, small_batch_gemm.linear(x, fp32_panels, bias))
