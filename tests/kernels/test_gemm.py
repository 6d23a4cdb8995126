"""The oneDNN linear path computes what F.linear computes, and steps aside where it should."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from switchboard.kernels import gemm

pytestmark = pytest.mark.skipif(
    gemm._onednn_linear is None, reason="this torch build has no oneDNN linear"
)


@pytest.fixture
def onednn_on():
    before = gemm.onednn_enabled()
    assert gemm.use_onednn(True)
    yield
    gemm.use_onednn(before)


@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_f_linear_to_rounding(onednn_on, rows, bias):
    torch.manual_seed(rows)
    x = torch.randn(rows, 576)
    weight = torch.randn(1536, 576)
    b = torch.randn(1536) if bias else None
    with torch.inference_mode():
        assert rows * 576 * 1536 >= gemm.ONEDNN_MIN_MACS
        # 576-term float32 sums of magnitude ~25: the kernels differ in summation order only
        torch.testing.assert_close(
            gemm.linear(x, weight, b), F.linear(x, weight, b), rtol=1e-5, atol=1e-4
        )


def test_non_contiguous_input(onednn_on):
    x = torch.randn(64, 1024)[:, ::2]
    weight = torch.randn(800, 512)
    with torch.inference_mode():
        torch.testing.assert_close(
            gemm.linear(x, weight), F.linear(x, weight), rtol=1e-5, atol=1e-4
        )


def test_small_products_and_other_inputs_take_f_linear(onednn_on, monkeypatch):
    calls = []
    monkeypatch.setattr(gemm, "_onednn_linear", lambda *a: calls.append(a) or F.linear(*a[:3]))
    with torch.inference_mode():
        gemm.linear(torch.randn(1, 16), torch.randn(16, 16))  # far below the threshold
        gemm.linear(torch.randn(2, 64, 576), torch.randn(1536, 576))  # 3-D
        gemm.linear(torch.randn(64, 576, dtype=torch.float64), torch.randn(1536, 576).double())
        assert calls == []
        gemm.linear(torch.randn(64, 576), torch.randn(1536, 576))
        assert len(calls) == 1


def test_can_be_turned_off(onednn_on, monkeypatch):
    monkeypatch.setattr(gemm, "_onednn_linear", lambda *a: pytest.fail("oneDNN was called"))
    gemm.use_onednn(False)
    assert not gemm.onednn_enabled()
    with torch.inference_mode():
        gemm.linear(torch.randn(64, 576), torch.randn(1536, 576))
