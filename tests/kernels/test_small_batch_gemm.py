"""The small-batch matmul kernel: what F.linear computes (to rounding) for one row to several
groups of ``max_rows`` rows (12 over two panels with AVX-512, else 6; more rows in groups of
nearly equal size), any shape, with or without a bias; each row's result independent of the rows
beside it; ``gemm.linear`` sends products of at most ``gemm.SMALL_BATCH_MAX_ROWS`` rows on a
packed weight with panels to it; it can be turned off."""

from __future__ import annotations

import ctypes
import subprocess

import pytest
import torch
import torch.nn.functional as F

from switchboard.kernels import gemm, library, small_batch_gemm
from switchboard.kernels.build import FLAGS, compiler, cpu_flags


@pytest.fixture
def kernel():
    small_batch_gemm.unload()
    assert small_batch_gemm.load(), small_batch_gemm.status()  # this machine has AVX2 and cc
    yield
    small_batch_gemm.unload()


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 21, 32])
@pytest.mark.parametrize(("out_features", "in_features"), [(1, 1), (15, 7), (17, 64), (96, 33)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_f_linear(kernel, rows, out_features, in_features, with_bias):
    torch.manual_seed(rows * 1000 + out_features + in_features)
    weight = torch.randn(out_features, in_features)
    bias = torch.randn(out_features) if with_bias else None
    x = torch.randn(rows, in_features)
    panels = small_batch_gemm.pack(weight)
    assert panels.data.numel() == -(-out_features // 16) * 16 * in_features
    assert panels.out_features == out_features
    got = small_batch_gemm.linear(x, panels, bias)
    torch.testing.assert_close(got, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


def test_a_row_does_not_depend_on_its_neighbours(kernel):
    torch.manual_seed(0)
    rows = 2 * small_batch_gemm.max_rows() + 3  # groups of max_rows, and a part group
    weight, x = torch.randn(200, 300), torch.randn(rows, 300)
    panels = small_batch_gemm.pack(weight)
    together = small_batch_gemm.linear(x, panels)
    for row in range(rows):
        alone = small_batch_gemm.linear(x[row : row + 1], panels)
        assert torch.equal(alone[0], together[row])  # bit for bit


@pytest.mark.slow
@pytest.mark.skipif("avx512f" not in cpu_flags(), reason="the AVX2 build is the library here")
def test_the_avx2_build_gives_the_same_floats(kernel, tmp_path):
    """Built without AVX-512 (6 rows a group over one panel, two AVX2 vectors), the kernel gives
    the AVX-512 code's floats bit for bit (12 rows over two panels): whole and partial last
    panels, an odd and an even number of panels, one group of rows and several."""
    cc = compiler()
    assert cc is not None
    built = tmp_path / "avx2.so"
    source = str(library.SOURCE_DIR / "small_batch_gemm.c")
    subprocess.run(
        [cc, *FLAGS, "-mno-avx512f", "-I", str(library.SOURCE_DIR), source, "-o", str(built)],
        check=True,
        timeout=300,
    )
    avx2 = ctypes.CDLL(str(built))  # its work pool is the loaded library's (RTLD_GLOBAL)
    for name in ("small_batch_max_rows", "small_batch_linear"):
        result, arguments = library.SIGNATURES[name]
        function = getattr(avx2, name)
        function.restype, function.argtypes = result, arguments
    assert avx2.small_batch_max_rows() == 6
    assert small_batch_gemm.max_rows() == 12
    torch.manual_seed(3)
    for out_features, in_features in ((7, 5), (16, 40), (40, 24), (48, 33), (250, 64)):
        weight, bias = torch.randn(out_features, in_features), torch.randn(out_features)
        panels = small_batch_gemm.pack(weight)
        for rows in (1, 2, 5, 6, 7, 12, 13, 25, 40):
            x = torch.randn(rows, in_features)
            for b in (None, bias):
                y = torch.empty(rows, out_features)
                code = avx2.small_batch_linear(
                    x.data_ptr(), in_features, panels.data.data_ptr(),
                    b.data_ptr() if b is not None else None, y.data_ptr(),
                    rows, in_features, out_features,
                )  # fmt: skip
                assert code == 0
                assert torch.equal(y, small_batch_gemm.linear(x, panels, b))


def test_strided_rows_and_no_rows(kernel):
    torch.manual_seed(1)
    weight = torch.randn(40, 24)
    panels = small_batch_gemm.pack(weight)
    wide = torch.randn(3, 48)
    x = wide[:, ::2]  # a column stride of 2: copied
    torch.testing.assert_close(small_batch_gemm.linear(x, panels), F.linear(x, weight))
    x = wide[:, :24]  # a row stride of 48: read in place
    torch.testing.assert_close(small_batch_gemm.linear(x, panels), F.linear(x, weight))
    assert small_batch_gemm.linear(torch.randn(0, 24), panels).shape == (0, 40)
    assert small_batch_gemm.max_rows() in (6, 8, 12)


@pytest.mark.skipif(gemm._onednn_reorder is None, reason="this torch build cannot pack weights")
def test_gemm_linear_takes_it_up_to_its_rows(kernel, monkeypatch):
    torch.manual_seed(2)
    weight, bias = torch.randn(64, 32), torch.randn(64)
    packed = gemm.pack(weight)
    panels = small_batch_gemm.pack(weight)
    real_linear, calls = small_batch_gemm.linear, []
    monkeypatch.setattr(
        small_batch_gemm, "linear", lambda x, *a: calls.append(x.shape[0]) or real_linear(x, *a)
    )
    sizes = (1, 4, 5, 8, 9, 17, gemm.SMALL_BATCH_MAX_ROWS, gemm.SMALL_BATCH_MAX_ROWS + 1)
    for rows in sizes:
        x = torch.randn(rows, 32)
        got = gemm.linear(x, packed, bias, panels)
        torch.testing.assert_close(got, F.linear(x, weight, bias), rtol=1e-5, atol=1e-4)
        if rows <= gemm.SMALL_BATCH_MAX_ROWS:
            assert torch.equal(got, real_linear(x, panels, bias))
    assert calls == list(sizes[:-1])  # beyond its rows: oneDNN
    gemm.linear(torch.randn(3, 32), packed, bias)
    assert calls == list(sizes[:-1])  # no panels: oneDNN
    x3 = torch.randn(1, 2, 32)  # leading dims are flattened and restored
    assert gemm.linear(x3, packed, None, panels).shape == (1, 2, 64)


def test_a_float32_step_stays_on_it_up_to_its_rows_and_not_without_it(kernel):
    # what the worker reports to the engine, which shares steps in no more tokens
    assert gemm.few_rows_limit(torch.float32) == gemm.SMALL_BATCH_MAX_ROWS
    small_batch_gemm.unload()
    assert gemm.few_rows_limit(torch.float32) == 0


def test_can_be_turned_off(monkeypatch):
    small_batch_gemm.unload()
    monkeypatch.setenv("SWITCHBOARD_SMALL_BATCH_GEMM", "off")
    assert not small_batch_gemm.load()
    assert "off" in small_batch_gemm.status()
    assert not small_batch_gemm.packable(torch.randn(8, 8))
    with pytest.raises(ValueError, match="small-batch pack needs the kernel loaded"):
        small_batch_gemm.pack(torch.randn(8, 8))


def test_without_a_compiler_onednn_keeps_every_size(without_compiler):
    small_batch_gemm.unload()
    assert not small_batch_gemm.load()
    assert small_batch_gemm.status().startswith("unavailable")
    small_batch_gemm.unload()
