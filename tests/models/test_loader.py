"""Loading checkpoint directories: single file, shards, both config styles, dtypes, errors."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from switchboard.models.hf_config import load_transformer_config
from switchboard.models.loader import load_model, resolve_dtype
from tests.tiny_checkpoint import tiny_llama_dir

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny_dir() -> str:
    return tiny_llama_dir()


def copy_checkpoint(source: str, target) -> str:
    path = str(target / "ckpt")
    shutil.copytree(source, path)
    return path


def parameters(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def assert_same_parameters(a, b) -> None:
    pa, pb = parameters(a), parameters(b)
    assert pa.keys() == pb.keys()
    for name in pa:
        torch.testing.assert_close(pa[name], pb[name], atol=0, rtol=0, msg=name)


def test_fused_parameters_hold_the_checkpoint_matrices(tiny_dir):
    model, _ = load_model(tiny_dir, CPU, torch.float32)
    tensors = load_file(os.path.join(tiny_dir, "model.safetensors"))
    attention = model.model.layers[1].self_attn
    q, k, v = attention.qkv_proj.weight.split([64, 32, 32])
    torch.testing.assert_close(q, tensors["model.layers.1.self_attn.q_proj.weight"])
    torch.testing.assert_close(v, tensors["model.layers.1.self_attn.v_proj.weight"])
    torch.testing.assert_close(
        model.model.layers[0].post_attention_layernorm.weight,
        tensors["model.layers.0.post_attention_layernorm.weight"],
    )


def test_sharded_checkpoint_loads_the_same_weights(tiny_dir, tmp_path):
    path = copy_checkpoint(tiny_dir, tmp_path)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    os.remove(os.path.join(path, "model.safetensors"))
    names = sorted(tensors)
    weight_map = {}
    for index, part in enumerate((names[::2], names[1::2])):
        filename = f"model-0000{index + 1}-of-00002.safetensors"
        save_file({name: tensors[name] for name in part}, os.path.join(path, filename))
        weight_map.update(dict.fromkeys(part, filename))
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    assert_same_parameters(
        load_model(path, CPU, torch.float32)[0], load_model(tiny_dir, CPU, torch.float32)[0]
    )


def test_pre_v5_config_style_loads_the_same_model(tiny_dir, tmp_path):
    path = copy_checkpoint(tiny_dir, tmp_path)
    config_path = os.path.join(path, "config.json")
    with open(config_path) as f:
        raw = json.load(f)
    rope = raw.pop("rope_parameters")
    raw["rope_theta"] = rope["rope_theta"]
    raw["rope_scaling"] = None
    raw["torch_dtype"] = raw.pop("dtype")
    with open(config_path, "w") as f:
        json.dump(raw, f)
    assert load_transformer_config(path).rope == load_transformer_config(tiny_dir).rope
    assert_same_parameters(
        load_model(path, CPU, torch.float32)[0], load_model(tiny_dir, CPU, torch.float32)[0]
    )


def test_tied_embeddings_share_the_embedding_matrix():
    model, config = load_model(tiny_llama_dir(tie_word_embeddings=True), CPU, torch.float32)
    assert config.tie_word_embeddings and model.lm_head is None
    hidden = torch.randn(3, config.hidden_size)
    torch.testing.assert_close(
        model.compute_logits(hidden), hidden @ model.model.embed_tokens.weight.T
    )


def test_model_loads_in_the_requested_dtype(tiny_dir):
    model, _ = load_model(tiny_dir, CPU, torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.compute_logits(torch.randn(2, 64, dtype=torch.bfloat16)).dtype == torch.float32


def test_auto_dtype_is_the_checkpoints_off_the_cpu(tiny_dir, tmp_path):
    path = copy_checkpoint(tiny_dir, tmp_path)
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    raw["dtype"] = "bfloat16"
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(raw, f)
    config = load_transformer_config(path)
    assert resolve_dtype("auto", config, torch.device("cuda", 0)) == torch.bfloat16
    assert resolve_dtype("float16", config, CPU) == torch.float16
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("int3", config, CPU)


def test_missing_weight_is_an_error_naming_it(tiny_dir, tmp_path):
    path = copy_checkpoint(tiny_dir, tmp_path)
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, file)
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.gate_up_proj"):
        load_model(path, CPU, torch.float32)


def test_unknown_architecture_and_missing_weights_file_are_refused(tiny_dir, tmp_path):
    path = copy_checkpoint(tiny_dir, tmp_path)
    os.remove(os.path.join(path, "model.safetensors"))
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(path, CPU, torch.float32)
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    raw["architectures"], raw["model_type"] = ["MambaForCausalLM"], "mamba"
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(raw, f)
    with pytest.raises(ValueError, match="MambaForCausalLM"):
        load_model(path, CPU, torch.float32)


def _checkpoint_dtype(tiny_dir, tmp_path, dtype: str):
    path = copy_checkpoint(tiny_dir, tmp_path / dtype)
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    raw["dtype"] = dtype
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(raw, f)
    return load_transformer_config(path)


def test_auto_dtype_on_cpu_is_bfloat16_only_where_faster_and_nothing_is_lost(
    tiny_dir, tmp_path, monkeypatch, caplog
):
    from switchboard.kernels import bf16_gemm

    half, full = (_checkpoint_dtype(tiny_dir, tmp_path, d) for d in ("bfloat16", "float32"))
    caplog.set_level("INFO", logger="switchboard.models.loader")
    monkeypatch.setattr(bf16_gemm, "faster_than_float32", lambda: "avx512_bf16")
    assert resolve_dtype("auto", half, CPU) == torch.bfloat16
    assert "dtype auto: bfloat16 on CPU (this CPU has avx512_bf16" in caplog.text
    assert resolve_dtype("auto", half, CPU, quantized=True) == torch.float32
    assert resolve_dtype("auto", full, CPU) == torch.float32  # exact, and asked for by name
    assert "the checkpoint is float32: float32 is exact" in caplog.text
    monkeypatch.setattr(bf16_gemm, "faster_than_float32", lambda: None)  # AVX2 only: slower
    caplog.clear()
    assert resolve_dtype("auto", half, CPU) == torch.float32
    assert "this CPU has no AVX-512 BF16 or AMX" in caplog.text
    assert resolve_dtype("bfloat16", half, CPU) == torch.bfloat16  # asked for: served, warned
    assert "slower than float32" in caplog.text


def test_bfloat16_is_faster_by_the_cpus_flags(monkeypatch):
    from switchboard.kernels import bf16_gemm

    if "dpbf16" not in bf16_gemm.available():
        assert bf16_gemm.faster_than_float32() is None
        return
    flags = bf16_gemm.cpu_flags()
    monkeypatch.setattr(bf16_gemm, "cpu_flags", lambda: flags | {"amx_bf16"})
    assert bf16_gemm.faster_than_float32() == "amx_bf16"
    monkeypatch.setattr(bf16_gemm, "cpu_flags", lambda: flags - {"amx_bf16", "avx512_bf16"})
    assert bf16_gemm.faster_than_float32() is None
