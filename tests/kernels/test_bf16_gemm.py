"""The bfloat16 small-batch kernel: each variant this machine runs against torch's bfloat16 matmul
on the same bfloat16 weights and against the exact sums; the variants against each other and a
row's result whatever rows share the call (batch-invariant); the pick by the CPU's flags, the
fallbacks a CPU without a variant's instructions takes, and the off switch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from switchboard.kernels import bf16_gemm, gemm

# (rows, inputs, outputs): one row to several register groups, odd inputs (a zero-padded pair),
# outputs that are not a whole number of 16-column panels, SmolLM2's shapes, many rows
SHAPES = [
    (1, 576, 960),
    (2, 64, 48),
    (3, 577, 33),
    (8, 576, 1536),
    (13, 1536, 576),
    (33, 96, 17),
    (70, 301, 50),  # amx: K in blocks (64, 64 and 23 pairs, the last ending mid-tile)
]
EPS32 = 2.0**-24  # float32's unit roundoff
EPS_BF16 = 2.0**-8  # bfloat16's


@pytest.fixture
def restore_kernel(monkeypatch):
    """The kernel as the process loads it, after the test (its patches undone first)."""
    yield
    monkeypatch.undo()
    bf16_gemm.unload()
    bf16_gemm.load()


def _problem(rows: int, inputs: int, outputs: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, inputs, generator=generator)
    weight = (torch.randn(outputs, inputs, generator=generator) * 0.05).to(torch.bfloat16)
    bias = torch.randn(outputs, generator=generator)
    return x, weight, bias


def _sum_bound(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Summing K exact products in float32 errs by at most K * u * sum |x_k w_k| (the products
    of two bfloat16 values are exact in float32; each of the K additions rounds once)."""
    xb = x.to(torch.bfloat16).double().abs()
    return x.shape[1] * EPS32 * (xb @ weight.double().abs().T)


@pytest.mark.parametrize("variant", list(bf16_gemm.VARIANTS))
@pytest.mark.parametrize(("rows", "inputs", "outputs"), SHAPES)
def test_each_variant_against_torch_and_the_exact_sums(
    variant, rows, inputs, outputs, restore_kernel
):
    if variant not in bf16_gemm.available():
        pytest.skip(f"this CPU does not run {variant}")
    assert bf16_gemm.load(variant), bf16_gemm.status()
    x, weight, bias = _problem(rows, inputs, outputs)
    y = bf16_gemm.linear(x, bf16_gemm.pack(weight), bias)
    exact = x.to(torch.bfloat16).double() @ weight.double().T + bias.double()
    bound = _sum_bound(x, weight)
    assert ((y.double() - exact).abs() <= bound + 1e-30).all()
    # torch's bfloat16 matmul sums in float32 too, then rounds its output to bfloat16: within
    # half a bfloat16 step of the exact sum plus its own summation error
    theirs = F.linear(x.to(torch.bfloat16), weight).double() + bias.double()
    tolerance = EPS_BF16 * (exact - bias.double()).abs() + 2 * bound + 1e-30
    assert ((y.double() - theirs).abs() <= tolerance).all()


def test_the_variants_agree_and_are_batch_invariant(restore_kernel):
    x, weight, bias = _problem(40, 320, 80, seed=1)
    results = {}
    for variant in bf16_gemm.available():
        assert bf16_gemm.load(variant)
        panels = bf16_gemm.pack(weight)
        y = bf16_gemm.linear(x, panels, bias)
        # a row's result whatever rows share the call (amx: one group of rows, two, and K in
        # blocks past two)
        for rows in (1, 2, 5, 8, 16, 17, 33):
            assert torch.equal(bf16_gemm.linear(x[:rows], panels, bias), y[:rows]), variant
        results[variant] = y
    assert results, "no variant runs here: the kernel needs AVX2 and FMA"
    first = next(iter(results.values()))
    bound = 2 * _sum_bound(x, weight)
    for y in results.values():
        assert ((y.double() - first.double()).abs() <= bound + 1e-30).all()


def _cpu_without(monkeypatch, *missing: str) -> None:
    flags = bf16_gemm.cpu_flags() - set(missing)
    monkeypatch.setattr(bf16_gemm, "cpu_flags", lambda: flags)


def test_a_cpu_without_avx512_bf16_gets_the_widening_variants(monkeypatch, restore_kernel):
    if "avx2" not in bf16_gemm.cpu_flags():
        pytest.skip("the kernel needs AVX2")
    runnable = bf16_gemm.available()
    flags = bf16_gemm.cpu_flags()
    expected = "amx" if "amx" in runnable else "dpbf16" if "avx512_bf16" in flags else runnable[0]
    bf16_gemm.unload()
    assert bf16_gemm.load() and bf16_gemm.variant() == expected
    _cpu_without(monkeypatch, "amx_bf16")
    bf16_gemm.unload()
    expected = "dpbf16" if "avx512_bf16" in flags else bf16_gemm.available()[0]
    assert bf16_gemm.load() and bf16_gemm.variant() == expected
    _cpu_without(monkeypatch, "amx_bf16", "avx512_bf16")
    bf16_gemm.unload()
    assert bf16_gemm.load() and bf16_gemm.variant() != "dpbf16"
    assert not bf16_gemm.load("dpbf16")  # asked for, but the CPU lacks it
    assert "this CPU runs" in bf16_gemm.status()
    _cpu_without(monkeypatch, "avx512_bf16", "avx512f")
    bf16_gemm.unload()
    assert bf16_gemm.load() and bf16_gemm.variant() == "avx2"
    assert bf16_gemm.max_rows() == 4


def test_a_bfloat16_step_stays_on_it_up_to_its_rows_unless_onednn_has_amx_and_it_not(
    monkeypatch, restore_kernel
):
    """With AMX and the kernel's amx variant, or without AMX, a bfloat16 step of up to the
    float32 kernel's rows runs on the kernel (and in the decode stack; the amx variant takes the
    layers' products up to AMX_KERNEL_MAX_ROWS); with AMX but another variant, oneDNN's tiles
    take the steps past 16 rows."""
    if not bf16_gemm.load():
        pytest.skip(f"the bfloat16 kernel is not loaded here: {bf16_gemm.status()}")
    all_rows = gemm.SMALL_BATCH_MAX_ROWS
    monkeypatch.setattr(gemm, "CPU_HAS_AMX", False)
    assert gemm.few_rows_limit(torch.bfloat16) == gemm.bf16_max_rows() == all_rows
    monkeypatch.undo()
    if "amx" in bf16_gemm.available():
        assert bf16_gemm.load("amx")
        assert gemm.few_rows_limit(torch.bfloat16) == all_rows
        assert gemm.bf16_max_rows() == gemm.AMX_KERNEL_MAX_ROWS
        assert bf16_gemm.load("dpbf16")
        assert gemm.bf16_max_rows() == gemm.AMX_ONEDNN_ROWS
        assert gemm.few_rows_limit(torch.bfloat16) == 0
    monkeypatch.setattr(gemm, "CPU_HAS_AMX", True)
    bf16_gemm.unload()
    assert gemm.few_rows_limit(torch.bfloat16) == 0
    assert bf16_gemm.load("avx2")
    assert gemm.bf16_max_rows() == gemm.AMX_ONEDNN_ROWS


def test_without_avx2_or_switched_off_bfloat16_layers_use_torch(monkeypatch, restore_kernel):
    x, weight, bias = _problem(4, 64, 32)
    bf16_gemm.load()
    panels = bf16_gemm.pack(weight) if bf16_gemm.max_rows() else None
    _cpu_without(monkeypatch, "avx2", "fma")
    bf16_gemm.unload()
    assert not bf16_gemm.load()
    assert bf16_gemm.status().startswith("unavailable")
    monkeypatch.setenv("SWITCHBOARD_BF16_GEMM", "off")
    assert not bf16_gemm.load()
    assert bf16_gemm.status() == "off (SWITCHBOARD_BF16_GEMM=off)"
    if panels is not None:  # a layer packed before: its products go to torch now
        xb = x.to(torch.bfloat16)
        assert torch.equal(
            gemm.linear(xb, weight, bias.to(torch.bfloat16), panels),
            F.linear(xb, weight, bias.to(torch.bfloat16)),
        )
    monkeypatch.setenv("SWITCHBOARD_BF16_GEMM", "fastest")
    with pytest.raises(ValueError, match="SWITCHBOARD_BF16_GEMM='fastest'"):
        bf16_gemm.load()


def test_a_bfloat16_layer_rounds_its_output_as_torch_does(restore_kernel):
    if not bf16_gemm.load():
        pytest.skip(bf16_gemm.status())
    x, weight, bias = _problem(3, 128, 64)
    xb, bb = x.to(torch.bfloat16), bias.to(torch.bfloat16)
    y = gemm.linear(xb, weight, bb, bf16_gemm.pack(weight))
    assert y.dtype == torch.bfloat16
    ours = bf16_gemm.linear(xb.float(), bf16_gemm.pack(weight), bb.float())
    assert torch.equal(y, ours.to(torch.bfloat16))
