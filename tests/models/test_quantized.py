"""Quantized weights for decode: a model converted from a GGUF file of each type the kernels take
(and a Q4_K_M-like mix) greedy-decodes as on its float32 weights: with the exact kernel the same
logits bit for bit (its decode matmuls are the float32 kernel's on the very same values), with
the default integer dot product kernel (the rows rounded to int8) the same tokens except
near-ties; int8 made at load agrees with float32 except near-ties; a tied head on a later
pipeline stage reads the embedding's blocks; tensor parallelism, another device or dtype fall
back to float32; a type the kernel does not take stays float32 under ``auto`` and is refused by
name under ``gguf``; the one-call decode stack runs quantized panels as the layers do."""

from __future__ import annotations

import logging
from math import sqrt
from pathlib import Path

import pytest
import torch

from switchboard.checkpoint import convert_gguf_to_hf
from switchboard.kernels import decode_stack, quant_gemm
from switchboard.kernels.quant_gemm import QuantPanels
from switchboard.models.loader import load_model
from switchboard.models.parallel import SINGLE_PROCESS, ParallelState
from switchboard.models.quantized import quantize_weights
from tests.checkpoint.tiny_llama_gguf import write_tiny_llama_gguf
from tests.gguf_blocks import KERNEL_TYPES
from tests.models.near_ties import agreed_tokens
from tests.models.test_decode_stack import (
    BLOCK_RANGE,
    _head_calls,
    _run,
    _stack_calls,
    _steps,
)
from tests.tiny_checkpoint import tiny_checkpoint_dir, tiny_llama_dir
from tests.worker.test_model_runner_parity import DrivenRequest, ToyScheduler, make_runner

CPU = torch.device("cpu")
PROMPTS = [[1, 5, 40, 77, 100], [1, 9], [1, *range(20, 40)]]  # ids in the tiny GGUF vocabulary


def _converted(root: Path, **gguf: object) -> str:
    write_tiny_llama_gguf(root / "model.gguf", **gguf)  # type: ignore[arg-type]
    (root / "hf").mkdir()
    convert_gguf_to_hf(root / "model.gguf", root / "hf")
    return str(root / "hf")


def _k_sizes(type_name: str) -> dict[str, int]:
    """The K types' blocks are 256 inputs wide."""
    return {"hidden_size": 256, "intermediate_size": 512} if type_name.endswith("_K") else {}


def _trained_like(type_name: str) -> dict[str, float | int]:
    """The sizes for ``type_name`` and the layers' values of a trained model's size (1 / sqrt
    of the inputs): with values of about 1 the tiny model's activations grow to hundreds."""
    sizes = _k_sizes(type_name)
    return {**sizes, "layer_spread": 1 / sqrt(sizes.get("hidden_size", 64))}


def _greedy(model_dir: str, quantization: str, monkeypatch, tokens: int = 10):
    runner = make_runner(model_dir, quantization=quantization)
    requests = [
        DrivenRequest(f"r{i}", prompt, tokens, join_step=i) for i, prompt in enumerate(PROMPTS)
    ]
    ToyScheduler(runner, chunk_size=6).run(requests)
    return runner, requests


# The default kernel rounds the rows to 8 bits per block (about 1 % of a product here, the
# layers being 64 inputs wide). Measured on these models, as fractions of a step's range of
# log-probabilities (45-380): sequences parted where the float32 model's best two were at most
# 0.3 % apart, and the five best moved by up to 5.3 % (Q6_K; the others 3 %)
DOT_TIE, DOT_MOVED = 0.01, 0.1


def _agrees(quantized, float32, kernel: str) -> None:
    """Exact: the float32 tokens and logits bit for bit; dot products: except near-ties."""
    if kernel == quant_gemm.EXACT:
        for ours, theirs in zip(quantized, float32, strict=True):
            assert ours.output == theirs.output
            assert all(map(torch.equal, ours.logprobs, theirs.logprobs))
        return
    assert agreed_tokens(quantized, float32, DOT_TIE, DOT_MOVED, relative=True) >= 10


KERNELS = [quant_gemm.EXACT, "auto"]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("type_name", KERNEL_TYPES)
def test_each_gguf_type_decodes_as_float32(tmp_path, monkeypatch, type_name, kernel):
    monkeypatch.setenv("SWITCHBOARD_QUANT_GEMM", kernel)
    model_dir = _converted(tmp_path, matrix_type=type_name, **_trained_like(type_name))
    _, float32 = _greedy(model_dir, "none", monkeypatch)
    runner, quantized = _greedy(model_dir, "auto", monkeypatch)
    assert runner.summary().quantization == f"gguf {type_name}"
    qkv = runner.model.model.layers[0].self_attn.qkv_proj.small_batch
    assert isinstance(qkv, QuantPanels) and qkv.dot == (kernel != quant_gemm.EXACT)
    assert isinstance(runner.model.logits_head().small_batch, QuantPanels)
    _agrees(quantized, float32, kernel)


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_mix_of_types_in_one_fused_layer(tmp_path, monkeypatch, kernel):
    """Q4_K with Q6_K values and down projections (llama.cpp's Q4_K_M): the fused QKV layer
    holds 32- and 16-input blocks, kept as 16-input ones."""
    monkeypatch.setenv("SWITCHBOARD_QUANT_GEMM", kernel)
    mix = {"attn_v": "Q6_K", "ffn_down": "Q6_K", "token_embd": "Q8_0"}
    model_dir = _converted(tmp_path, matrix_type="Q4_K", kind_types=mix, **_trained_like("Q4_K"))
    _, float32 = _greedy(model_dir, "none", monkeypatch)
    runner, quantized = _greedy(model_dir, "gguf", monkeypatch)
    assert runner.summary().quantization == "gguf Q4_K, Q6_K"  # QKV's panels are "mixed"
    layer = runner.model.model.layers[0]
    assert (layer.self_attn.qkv_proj.small_batch.block, layer.mlp.down_proj.small_batch.block) == (
        16,
        16,
    )
    assert layer.mlp.gate_up_proj.small_batch.block == 32
    _agrees(quantized, float32, kernel)


# int8 per 32 inputs moves the tiny model's log-probabilities by up to about 0.2 (its vocabulary
# of 1,024 is flat: the best two tokens are often closer than that)
INT8_ERROR = 0.25


@pytest.mark.parametrize("kernel", KERNELS)
def test_int8_agrees_with_float32_except_near_ties(monkeypatch, kernel):
    monkeypatch.setenv("SWITCHBOARD_QUANT_GEMM", kernel)
    model_dir = tiny_llama_dir()
    _, float32 = _greedy(model_dir, "none", monkeypatch, tokens=16)
    runner, quantized = _greedy(model_dir, "int8", monkeypatch, tokens=16)
    assert runner.summary().quantization == "int8"
    agreed = agreed_tokens(quantized, float32, INT8_ERROR, INT8_ERROR)
    assert agreed >= 12  # not parted at once


def _model(model_dir: str, parallel: ParallelState = SINGLE_PROCESS):
    model, _ = load_model(model_dir, CPU, torch.float32, parallel)
    return model


def test_a_tied_head_on_a_later_pipeline_stage_reads_the_embeddings_blocks(tmp_path):
    model_dir = _converted(tmp_path, matrix_type="Q8_0", tied=True)
    last_stage = _model(model_dir, ParallelState(pp_rank=1, pp_size=2))
    done = quantize_weights(last_stage, model_dir, "gguf", CPU, torch.float32, last_stage.parallel)
    head = last_stage.logits_head()
    assert head is last_stage.lm_head and isinstance(head.small_batch, QuantPanels)
    assert done.matrices == 1 + 4  # the head and the stage's one layer
    assert torch.equal(head.weight, _model(model_dir).model.embed_tokens.weight)


def test_float32_where_quantized_panels_do_not_apply(tmp_path, caplog):
    model_dir = _converted(tmp_path, matrix_type="Q4_0")
    caplog.set_level(logging.INFO, "switchboard.models.quantized")
    tensor_parallel = ParallelState(tp_rank=0, tp_size=2)
    cases = [
        (
            _model(model_dir, tensor_parallel),
            CPU,
            torch.float32,
            tensor_parallel,
            "tensor-parallel",
        ),
        (_model(model_dir), CPU, torch.bfloat16, ParallelState(), "on cpu in torch.bfloat16"),
        (_model(model_dir), torch.device("cuda"), torch.float32, ParallelState(), "on cuda"),
    ]
    for model, device, dtype, parallel, reason in cases:
        for mode in ("auto", "gguf", "int8"):
            assert quantize_weights(model, model_dir, mode, device, dtype, parallel).mode == "none"
            assert reason in caplog.records[-1].getMessage()
        assert not any(isinstance(m.small_batch, QuantPanels) for m in _linears(model))


def _linears(model: torch.nn.Module) -> list:
    return [m for m in model.modules() if hasattr(m, "small_batch")]


def test_a_type_the_kernel_does_not_take(tmp_path, caplog):
    kinds = {"ffn_down": "Q2_K"}
    model_dir = _converted(tmp_path, matrix_type="Q4_K", kind_types=kinds, **_k_sizes("Q4_K"))
    model = _model(model_dir)
    caplog.set_level(logging.INFO, "switchboard.models.quantized")
    done = quantize_weights(model, model_dir, "auto", CPU, torch.float32, ParallelState())
    assert done.float32_matrices == tuple(
        f"model.layers.{n}.mlp.down_proj.weight (Q2_K)" for n in (0, 1)
    )
    assert done.matrices == 2 * 3 + 1
    assert "model.layers.0.mlp.down_proj.weight (Q2_K)" in caplog.records[-1].getMessage()
    assert model.model.layers[0].mlp.down_proj.small_batch is None  # float32 panels: prepack's
    with pytest.raises(
        ValueError, match=r"tensor model.layers.0.mlp.down_proj.weight: GGUF type Q2_K"
    ):
        quantize_weights(_model(model_dir), model_dir, "gguf", CPU, torch.float32, ParallelState())


def test_gguf_needs_gguf_blocks_and_modes_are_checked():
    model_dir = tiny_llama_dir()
    model = _model(model_dir)
    with pytest.raises(ValueError, match="carries no GGUF blocks .* use int8 or none"):
        quantize_weights(model, model_dir, "gguf", CPU, torch.float32, ParallelState())
    assert (
        quantize_weights(model, model_dir, "auto", CPU, torch.float32, ParallelState()).mode
        == "none"
    )
    with pytest.raises(ValueError, match="unknown quantization 'q4'; use auto, none, gguf, int8"):
        quantize_weights(model, model_dir, "q4", CPU, torch.float32, ParallelState())


@pytest.mark.parametrize("kernel", [quant_gemm.EXACT, *quant_gemm.DOT_VARIANTS])
def test_the_decode_stack_takes_quantized_panels(monkeypatch, kernel):
    """Decode steps of one row to several register groups: the one-call stack gives the
    layer-by-layer path's logits bit for bit on quantized panels too, each kernel's."""
    if kernel != quant_gemm.EXACT and kernel not in quant_gemm.dot_variants():
        pytest.skip(f"this CPU does not run {kernel}")
    monkeypatch.setenv("SWITCHBOARD_QUANT_GEMM", kernel)
    assert quant_gemm.load(), quant_gemm.status()
    model_dir = tiny_checkpoint_dir("llama")
    calls, heads = _stack_calls(monkeypatch), _head_calls(monkeypatch)
    for rows in (1, 3, 2 * quant_gemm.max_rows() + 1):
        stacked = make_runner(model_dir, num_blocks=rows * BLOCK_RANGE, quantization="int8")
        layered = make_runner(model_dir, num_blocks=rows * BLOCK_RANGE, quantization="int8")
        layers = stacked.model.model.layers
        assert all(isinstance(layer.mlp.down_proj.small_batch, QuantPanels) for layer in layers)
        assert isinstance(stacked.model.logits_head().small_batch, QuantPanels)
        assert quant_gemm.variant() == kernel
        steps = _steps(rows, stacked.summary().vocab_size, decode_steps=3, seed=rows)
        calls.clear()
        heads.clear()
        got = _run(stacked, steps, True, monkeypatch)
        prompt_tokens = steps[0].total_num_scheduled_tokens  # short prompts: the stack's too
        assert calls == [prompt_tokens <= decode_stack.MAX_ROWS] + [True] * 3
        assert heads[-3:] == [True] * 3  # the decode steps end with the quantized head
        for a, b in zip(got, _run(layered, steps, False, monkeypatch), strict=True):
            assert torch.equal(a, b)
