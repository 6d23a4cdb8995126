"""Qwen2, Mistral and GPT-2 configs and checkpoints: what is read, how weights are laid out,
old checkpoint styles, dtypes, and sliding-window attention against dense attention."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from switchboard.models.attention import (
    AttentionMetadata,
    DecodeBatch,
    new_kv_cache,
    paged_attention,
)
from switchboard.models.gpt2 import GPT2LMHeadModel
from switchboard.models.hf_config import parse_transformer_config
from switchboard.models.loader import load_model, model_family
from switchboard.models.mistral import MistralForCausalLM
from switchboard.models.qwen2 import Qwen2ForCausalLM
from tests.models.paged_reference import dense_attention, lay_out_step
from tests.tiny_checkpoint import tiny_checkpoint_dir

CPU = torch.device("cpu")
LLAMA_STYLE = {
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "max_position_embeddings": 256,
}


def test_gpt2_config_keys_and_defaults():
    config = parse_transformer_config(
        {
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "vocab_size": 50257,
            "n_embd": 768,
            "n_layer": 12,
            "n_head": 12,
            "n_positions": 1024,
            "n_inner": None,
            "layer_norm_epsilon": 1e-5,
        }
    )
    assert (config.hidden_size, config.num_layers, config.num_heads) == (768, 12, 12)
    assert config.num_kv_heads == 12 and config.head_dim == 64
    assert config.max_position_embeddings == 1024
    assert config.intermediate_size == 4 * 768  # n_inner None
    assert config.layer_norm_eps == 1e-5 and config.hidden_act == "gelu_new"
    assert config.tie_word_embeddings  # GPT-2's default, left out of the hub's config.json
    assert model_family(config) is GPT2LMHeadModel


def qwen2(**extra):
    return parse_transformer_config({"model_type": "qwen2", **LLAMA_STYLE, **extra})


def test_qwen2_sliding_window_is_off_unless_switched_on():
    # transformers < 5 style, as Qwen2.5 ships it: a window size but use_sliding_window false.
    assert qwen2(sliding_window=32768, use_sliding_window=False).sliding_window is None
    assert qwen2(sliding_window=32768).sliding_window is None  # the switch defaults to off
    config = qwen2(sliding_window=16, use_sliding_window=True, max_window_layers=2)
    assert config.sliding_window == 16
    assert [config.layer_sliding_window(i) for i in range(4)] == [None, None, 16, 16]
    assert model_family(config) is Qwen2ForCausalLM  # from model_type: no "architectures"


def test_explicit_layer_types_win_and_unknown_ones_are_refused():
    types = ["sliding_attention", "full_attention"] * 2
    config = qwen2(sliding_window=8, use_sliding_window=True, layer_types=types)
    assert [config.layer_sliding_window(i) for i in range(4)] == [8, None, 8, None]
    with pytest.raises(ValueError, match="layer_types"):
        qwen2(layer_types=["full_attention", "chunked_attention"] * 2)


def test_mistral_window_covers_every_layer():
    config = parse_transformer_config({"model_type": "mistral", **LLAMA_STYLE, "sliding_window": 8})
    assert [config.layer_sliding_window(i) for i in range(4)] == [8] * 4
    assert model_family(config) is MistralForCausalLM
    no_window = parse_transformer_config({"model_type": "mistral", **LLAMA_STYLE})
    assert no_window.sliding_window is None


@pytest.fixture(scope="module")
def gpt2_dir() -> str:
    return tiny_checkpoint_dir("gpt2")


def test_gpt2_conv1d_weights_are_transposed_and_c_attn_split(gpt2_dir):
    model, config = load_model(gpt2_dir, CPU, torch.float32)
    tensors = load_file(os.path.join(gpt2_dir, "model.safetensors"))
    attn = model.transformer.h[1].attn
    torch.testing.assert_close(attn.c_attn.weight, tensors["transformer.h.1.attn.c_attn.weight"].T)
    torch.testing.assert_close(attn.c_attn.bias, tensors["transformer.h.1.attn.c_attn.bias"])
    torch.testing.assert_close(
        model.transformer.h[0].mlp.c_fc.weight, tensors["transformer.h.0.mlp.c_fc.weight"].T
    )
    assert model.lm_head is None  # tied to wte
    hidden = torch.randn(2, config.hidden_size)
    torch.testing.assert_close(
        model.compute_logits(hidden), hidden @ tensors["transformer.wte.weight"].T
    )


def test_gpt2_checkpoint_without_prefix_and_with_mask_buffers_loads_the_same(gpt2_dir, tmp_path):
    """The hub's original gpt2 names its tensors ``h.0.attn.c_attn.weight``, ``wte.weight`` …
    and stores the causal-mask buffers ``attn.bias`` / ``attn.masked_bias``."""
    path = str(tmp_path / "old-gpt2")
    shutil.copytree(gpt2_dir, path)
    file = os.path.join(path, "model.safetensors")
    tensors = {name.removeprefix("transformer."): t for name, t in load_file(file).items()}
    for i in range(2):
        tensors[f"h.{i}.attn.bias"] = torch.tril(torch.ones(1, 1, 512, 512))
        tensors[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    save_file(tensors, file)
    old, _ = load_model(path, CPU, torch.float32)
    new, _ = load_model(gpt2_dir, CPU, torch.float32)
    old_params, new_params = dict(old.named_parameters()), dict(new.named_parameters())
    assert old_params.keys() == new_params.keys()
    for name, param in new_params.items():
        torch.testing.assert_close(old_params[name], param, atol=0, rtol=0, msg=name)


def test_a_missing_gpt2_weight_is_an_error_naming_it(gpt2_dir, tmp_path):
    path = str(tmp_path / "broken")
    shutil.copytree(gpt2_dir, path)
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    del tensors["transformer.wpe.weight"]
    save_file(tensors, file)
    with pytest.raises(ValueError, match=r"transformer\.wpe\.weight"):
        load_model(path, CPU, torch.float32)


@pytest.mark.parametrize("family", ["qwen2", "mistral", "gpt2"])
def test_every_family_loads_in_half_precision(family):
    model, config = load_model(tiny_checkpoint_dir(family), CPU, torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    logits = model.compute_logits(torch.randn(2, config.hidden_size, dtype=torch.bfloat16))
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


def test_auto_dtype_follows_the_checkpoint_on_an_accelerator(tmp_path):
    from switchboard.models.cpu_dtype import cpu_auto_dtype
    from switchboard.models.loader import resolve_dtype

    config = qwen2(torch_dtype="bfloat16")
    # on CPU: bfloat16 only where this CPU runs it faster (models/cpu_dtype.py), else float32
    on_cpu, _ = cpu_auto_dtype(torch.bfloat16, quantized=False)
    assert resolve_dtype("auto", config, CPU) == on_cpu
    assert resolve_dtype("auto", qwen2(), CPU) == torch.float32  # a float32 checkpoint stays so
    assert resolve_dtype("auto", config, torch.device("cuda", 0)) == torch.bfloat16
    assert resolve_dtype("auto", qwen2(dtype="float16"), torch.device("cuda", 0)) == torch.float16
    # a checkpoint that names no dtype (or float32): bfloat16 on CUDA (tests/worker/test_gpu_paths)
    assert resolve_dtype("auto", qwen2(), torch.device("cuda", 0)) == torch.bfloat16


# -- sliding-window attention against dense attention ------------------------------------------

HEADS, KV_HEADS, DIM, BLOCK, WINDOW = 4, 2, 8, 4, 5


def test_sliding_window_masks_decode_and_prefill_like_dense_attention():
    torch.manual_seed(0)
    cache = new_kv_cache(32, BLOCK, KV_HEADS, DIM, torch.float32, "cpu")
    # (tokens cached, tokens this step): decodes inside and beyond the window, a chunk after a
    # prefix, a fresh prefill longer than the window, a fresh prefill shorter than it.
    shapes = [(11, 1), (2, 1), (6, 5), (0, 9), (0, 3)]
    full = [
        (torch.randn(c + n, KV_HEADS, DIM), torch.randn(c + n, KV_HEADS, DIM)) for c, n in shapes
    ]
    free = list(range(31, -1, -1))
    tables = [[free.pop() for _ in range(-(-(c + n) // BLOCK))] for c, n in shapes]
    queries, keys, values, slots, spans = lay_out_step(cache, shapes, full, tables, HEADS)
    decode = DecodeBatch(
        block_table=torch.tensor([tables[0], tables[1] + [0, 0]]),
        context_lens=torch.tensor([12, 3]),
        max_context_len=12,
    )
    metadata = AttentionMetadata(torch.tensor(slots), decode=decode, prefills=spans)
    out = paged_attention(
        torch.cat(queries), torch.cat(keys), torch.cat(values), cache, metadata, DIM**-0.5, WINDOW
    )
    expected = torch.cat(
        [dense_attention(q, k, v, WINDOW) for q, (k, v) in zip(queries, full, strict=True)]
    )
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
