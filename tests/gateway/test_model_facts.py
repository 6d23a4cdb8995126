"""generation_config.json supplies request defaults (eos ids, temperature, top_p, top_k, min_p,
repetition_penalty, max_new_tokens) that a request's own fields override."""

from __future__ import annotations

import json
import logging

import pytest

from switchboard.api.v1 import generation_service_pb2 as pb
from switchboard.config import ModelConfig
from switchboard.gateway.model_facts import ModelFacts, sampling_defaults_from
from switchboard.gateway.pipeline.validation import (
    build_engine_request,
    plan_generate,
    resolve_prompt,
)

QWEN_STYLE = {  # Qwen2.5-Instruct's generation_config.json, plus max_new_tokens
    "bos_token_id": 151643,
    "do_sample": True,
    "eos_token_id": [151645, 151643],
    "pad_token_id": 151643,
    "repetition_penalty": 1.05,
    "temperature": 0.7,
    "top_p": 0.8,
    "top_k": 20,
    "max_new_tokens": 12,
}


def write_checkpoint(path, config: dict, generation_config: dict | None) -> str:
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    if generation_config is not None:
        (path / "generation_config.json").write_text(json.dumps(generation_config))
    return str(path)


def facts_for(tmp_path, generation_config: dict | None, **config) -> ModelFacts:
    base = {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 200000}
    base["max_position_embeddings"] = 64
    base.update(config)
    model_dir = write_checkpoint(tmp_path / "ckpt", base, generation_config)
    return ModelFacts.from_checkpoint(ModelConfig(model=model_dir))


def engine_sampling(facts: ModelFacts, prompt_len: int = 4, **sampling):
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5] * prompt_len))
    for knob, value in sampling.items():
        if knob == "max_tokens":
            request.stopping.max_tokens = value
        else:
            setattr(request.sampling, knob, value)
    plan = plan_generate(request, "r", facts)
    prompt = resolve_prompt(plan, list(plan.prompt_token_ids), facts)
    return build_engine_request(plan, prompt, facts).sampling_params


def test_generation_config_knobs_become_typed_defaults():
    assert sampling_defaults_from(QWEN_STYLE) == {
        "temperature": 0.7,
        "top_p": 0.8,
        "top_k": 20,
        "repetition_penalty": 1.05,
        "max_tokens": 12,
    }
    assert isinstance(sampling_defaults_from({"top_k": 20.0})["top_k"], int)
    assert sampling_defaults_from({"min_p": 0.05}) == {"min_p": 0.05}
    # do_sample is not read (as in vLLM); greedy-only files give no sampling defaults at all.
    assert sampling_defaults_from({"do_sample": False, "eos_token_id": 2}) == {}


def test_invalid_defaults_are_dropped_with_a_warning(caplog):
    bad = {"temperature": -1, "top_p": 0.0, "top_k": -5, "min_p": 2.0, "max_new_tokens": 0}
    bad["repetition_penalty"] = "high"
    with caplog.at_level(logging.WARNING, logger="switchboard.gateway.model_facts"):
        assert sampling_defaults_from(bad) == {}
    assert "top_p=0.0 is out of range" in caplog.text
    assert "repetition_penalty='high' is not a number" in caplog.text


def test_unset_request_fields_take_the_checkpoint_defaults(tmp_path):
    facts = facts_for(tmp_path, QWEN_STYLE, eos_token_id=151643)
    assert facts.eos_token_ids == (151643, 151645)  # config.json's and generation_config's
    sampling = engine_sampling(facts)
    assert sampling.temperature == pytest.approx(0.7)
    assert sampling.top_p == pytest.approx(0.8)
    assert sampling.top_k == 20
    assert sampling.max_tokens == 12  # max_new_tokens
    assert sorted(sampling.eos_token_ids) == [151643, 151645]


def test_request_fields_override_the_checkpoint_defaults(tmp_path):
    facts = facts_for(tmp_path, QWEN_STYLE)
    sampling = engine_sampling(facts, temperature=0.0, top_p=1.0, top_k=-1, max_tokens=40)
    assert (sampling.temperature, sampling.top_p, sampling.top_k) == (0.0, 1.0, -1)
    assert sampling.max_tokens == 40  # more than max_new_tokens: the request wins


def test_default_max_tokens_never_exceeds_the_room_left(tmp_path):
    facts = facts_for(tmp_path, {"max_new_tokens": 1000})
    assert engine_sampling(facts, prompt_len=60).max_tokens == 4  # max_model_len 64
    assert engine_sampling(facts_for(tmp_path, None), prompt_len=10).max_tokens == 54


def test_without_generation_config_the_api_defaults_apply(tmp_path):
    facts = facts_for(tmp_path, None, eos_token_id=7)
    assert facts.eos_token_ids == (7,) and facts.sampling_defaults == {}
    sampling = engine_sampling(facts)
    assert (sampling.temperature, sampling.top_p, sampling.top_k) == (1.0, 1.0, 0)


def test_gpt2_style_config_gives_max_model_len_and_dtype(tmp_path):
    config = {"architectures": ["GPT2LMHeadModel"], "n_positions": 128, "dtype": "bfloat16"}
    model_dir = write_checkpoint(tmp_path / "gpt2", config, {"eos_token_id": 50256})
    facts = ModelFacts.from_checkpoint(ModelConfig(model=model_dir))
    assert facts.max_model_len == 128 and facts.dtype == "bfloat16"
