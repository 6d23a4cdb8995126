"""Speculative decoding with a draft model (``worker/draft_model.py``), on the real scheduler and
model runner: the served model's tokens are the same with the draft on and off, greedy and seeded,
whether the draft is the model itself (every proposal accepted) or another random model (almost
none accepted); and the configuration refuses a draft that cannot propose for the model."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from switchboard.config import ModelConfig
from switchboard.config.speculative import check_draft_model, parse_speculative_config
from switchboard.wire.engine_msgs import SamplingParams
from switchboard.worker.draft_model import DraftModel
from switchboard.worker.model_runner import ModelRunner
from tests.tiny_checkpoint import tiny_checkpoint_dir, tiny_llama_dir
from tests.worker.spec_decode_loop import run_loop, spec_runner
from tests.worker.test_model_runner_parity import make_runner

NUM_BLOCKS = 160
PROMPTS = {
    "loop": [0, 5, 9, 33, 5, 9, 33, 5, 9, 33, 5, 9],
    "counting": [0, *range(40, 63)],
    "odd": [0, 900, 3, 3, 3, 77, 512, 8, 1000, 64, 2],
}


def draft_config(draft_dir: str, k: int = 4) -> str:
    return json.dumps({"model": draft_dir, "num_speculative_tokens": k})


def draft_runner(model_dir: str, draft_dir: str) -> ModelRunner:
    return spec_runner(model_dir, NUM_BLOCKS, draft_dir=draft_dir)


@pytest.fixture(scope="module")
def model_dir() -> str:
    return tiny_checkpoint_dir("llama")


@pytest.fixture(scope="module")
def plain(model_dir):
    return make_runner(model_dir, NUM_BLOCKS)


@pytest.fixture(scope="module")
def other_draft() -> str:
    """Another random model with the same tokenizer: one layer, other weights."""
    return tiny_llama_dir(seed=11, num_layers=1, hidden_size=32, intermediate_size=64)


def test_the_model_as_its_own_draft_has_every_proposal_accepted(model_dir, plain):
    params = SamplingParams(temperature=0.0, max_tokens=40, logprobs=1)
    off = run_loop(plain, PROMPTS, params, "", num_blocks=NUM_BLOCKS)
    runner = draft_runner(model_dir, model_dir)
    on = run_loop(runner, PROMPTS, params, draft_config(model_dir), num_blocks=NUM_BLOCKS)
    for rid in PROMPTS:
        assert on.tokens(rid) == off.tokens(rid), rid
        assert on.logprobs(rid) == pytest.approx(off.logprobs(rid), abs=1e-4), rid
    assert on.num_draft_tokens > 0
    assert on.num_accepted_tokens >= 0.9 * on.num_draft_tokens
    assert on.steps < off.steps / 2


def test_a_different_draft_changes_no_token_greedy_or_seeded(model_dir, plain, other_draft):
    runner = draft_runner(model_dir, other_draft)
    config = draft_config(other_draft, k=3)
    greedy = SamplingParams(temperature=0.0, max_tokens=32)
    seeded = SamplingParams(temperature=0.9, top_k=8, seed=77, max_tokens=32)
    for params in (greedy, seeded):
        off = run_loop(plain, PROMPTS, params, "", num_blocks=NUM_BLOCKS)
        on = run_loop(runner, PROMPTS, params, config, num_blocks=NUM_BLOCKS)
        for rid in PROMPTS:
            assert on.tokens(rid) == off.tokens(rid), (rid, params.seed)
        assert on.num_draft_tokens > 0
        assert on.num_accepted_tokens < on.num_draft_tokens / 2  # mostly rejected


def test_seeded_sampling_with_the_model_as_draft_keeps_its_tokens(model_dir, plain):
    """Seeded draws accept a proposal only where it equals the draw: the same tokens as off,
    with proposals both accepted and rejected."""
    params = SamplingParams(temperature=1.0, top_k=6, seed=5, max_tokens=32)
    off = run_loop(plain, PROMPTS, params, "", num_blocks=NUM_BLOCKS)
    runner = draft_runner(model_dir, model_dir)
    on = run_loop(runner, PROMPTS, params, draft_config(model_dir), num_blocks=NUM_BLOCKS)
    for rid in PROMPTS:
        assert on.tokens(rid) == off.tokens(rid), rid
    assert 0 < on.num_accepted_tokens < on.num_draft_tokens


class DraftCacheWatch:
    """The runner, checking that a step without proposals leaves the draft's cache as it was."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.steps_without_proposals = 0

    def execute_model(self, step):
        draft = self.runner.draft
        assert draft is not None
        proposes = any(step.scheduled_spec_decode_tokens.values())
        before = [cache.clone() for cache in draft.kv_caches] if not proposes else []
        output = self.runner.execute_model(step)
        if not proposes and any(n > 0 for n in step.num_scheduled_tokens.values()):
            self.steps_without_proposals += 1
            for cache, was in zip(draft.kv_caches, before, strict=True):
                assert torch.equal(cache, was), step.step_id
        return output


def test_the_draft_skips_steps_without_proposals_and_catches_up_before_proposing(model_dir, plain):
    """Above ``disable_by_batch_size`` nobody proposes and the draft computes nothing (prefills
    included); once one request is left it proposes, the draft having caught up on its prompt and
    outputs first: its own draft's proposals are all accepted, the tokens those of off."""
    lengths = {"loop": 30, "counting": 6, "odd": 12}
    params_of = {rid: SamplingParams(temperature=0.0, max_tokens=n) for rid, n in lengths.items()}
    greedy = SamplingParams(temperature=0.0)
    off = run_loop(plain, PROMPTS, greedy, "", num_blocks=NUM_BLOCKS, params_of=params_of)
    config = json.dumps(
        {"model": model_dir, "num_speculative_tokens": 3, "disable_by_batch_size": 1}
    )
    watch = DraftCacheWatch(draft_runner(model_dir, model_dir))
    on = run_loop(watch, PROMPTS, greedy, config, num_blocks=NUM_BLOCKS, params_of=params_of)
    for rid in PROMPTS:
        assert on.tokens(rid) == off.tokens(rid), rid
    assert watch.steps_without_proposals >= 12  # the shorter two ran their course unproposed
    assert on.num_draft_tokens > 0
    assert on.num_accepted_tokens >= 0.9 * on.num_draft_tokens


def test_the_config_takes_vllm_s_draft_form_and_refuses_a_draft_that_cannot_propose(
    model_dir, other_draft, tmp_path
):
    config = parse_speculative_config(draft_config(other_draft, k=2))
    assert config is not None and config.method == "draft_model"
    assert config.model == other_draft and config.num_speculative_tokens == 2
    explicit = parse_speculative_config(
        json.dumps({"method": "draft_model", "model": other_draft, "num_speculative_tokens": 2})
    )
    assert explicit == config
    check_draft_model(config, model_dir)  # the same tokenizer: accepted
    short = parse_speculative_config(draft_config(tiny_llama_dir(max_position_embeddings=128)))
    assert short is not None
    with pytest.raises(ValueError, match="--max-model-len 128"):
        check_draft_model(short, model_dir)
    check_draft_model(short, model_dir, max_model_len=128)
    with pytest.raises(ValueError, match="-tp 1 -pp 1"):
        check_draft_model(config, model_dir, tensor_parallel_size=2)
    other_vocab = parse_speculative_config(draft_config(tiny_llama_dir(vocab_size=512)))
    assert other_vocab is not None
    with pytest.raises(ValueError, match="512 tokens"):
        check_draft_model(other_vocab, model_dir)
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["BertModel"], "model_type": "bert", "vocab_size": 1024})
    )
    encoder = parse_speculative_config(draft_config(str(tmp_path)))
    assert encoder is not None
    with pytest.raises(ValueError, match="not a decoder"):
        check_draft_model(encoder, model_dir)
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["PhiForCausalLM"], "vocab_size": 1024})
    )
    with pytest.raises(ValueError, match="PhiForCausalLM.*not a decoder"):
        check_draft_model(encoder, model_dir)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", "vocab_size": 1024}))
    check_draft_model(encoder, model_dir)  # no "architectures": its model_type says it
    for bad, says in [
        ('{"method": "draft_model", "num_speculative_tokens": 2}', "needs"),
        ('{"method": "ngram", "model": "/d", "num_speculative_tokens": 2}', "takes no model"),
        ('{"model": "/d", "num_speculative_tokens": 2, "prompt_lookup_max": 3}', "ngram"),
    ]:
        with pytest.raises(ValueError, match=says):
            parse_speculative_config(bad)


def test_the_runner_refuses_a_draft_with_another_vocabulary(model_dir):
    config = ModelConfig(model=model_dir)
    device = torch.device("cpu")
    draft = DraftModel(tiny_llama_dir(vocab_size=512), config, device)
    runner = ModelRunner(config, device, draft=draft)
    with pytest.raises(ValueError, match="share the model's tokenizer"):
        runner.load_model()


def test_serve_refuses_a_draft_with_another_vocabulary_before_starting(model_dir, capsys):
    from switchboard import cli
    from switchboard.cli import serve

    parser = cli.make_parser()
    other = draft_config(tiny_llama_dir(vocab_size=512))
    args = parser.parse_args(["serve", "--model", model_dir, "--speculative-config", other])
    with pytest.raises(SystemExit) as exit_info:
        serve.prepare(parser, args)
    assert exit_info.value.code == 2
    assert "a draft must share the model's tokenizer" in capsys.readouterr().err
    # a gateway loads no model: the draft need not be on its host
    elsewhere = draft_config("/not/on/this/host")
    serve.prepare(
        parser,
        parser.parse_args(["gateway", "--model", model_dir, "--speculative-config", elsewhere]),
    )


def test_the_runner_refuses_a_draft_with_fewer_positions_than_a_request_may_reach(model_dir):
    short = tiny_llama_dir(max_position_embeddings=128)
    device = torch.device("cpu")
    config = ModelConfig(model=model_dir)
    with pytest.raises(ValueError, match="--max-model-len 128"):
        ModelRunner(config, device, draft=DraftModel(short, config, device)).load_model()
    fitted = ModelConfig(model=model_dir, max_model_len=128)
    ModelRunner(fitted, device, draft=DraftModel(short, fitted, device)).load_model()


@pytest.mark.parametrize("family", ["qwen2", "mistral", "gpt2"])
def test_other_decoder_families_draft_for_themselves(family):
    """Qwen2 (biases), Mistral (a sliding window shorter than the output), GPT-2 (learned
    positions): the model as its own draft has its proposals accepted, the tokens unchanged."""
    model_dir = tiny_checkpoint_dir(family)
    prompts = {"loop": PROMPTS["loop"], "counting": PROMPTS["counting"]}
    params = SamplingParams(temperature=0.0, max_tokens=30)
    off = run_loop(make_runner(model_dir, NUM_BLOCKS), prompts, params, "", num_blocks=NUM_BLOCKS)
    runner = draft_runner(model_dir, model_dir)
    on = run_loop(runner, prompts, params, draft_config(model_dir, k=3), num_blocks=NUM_BLOCKS)
    for rid in prompts:
        assert on.tokens(rid) == off.tokens(rid), rid
    assert on.num_accepted_tokens >= 0.9 * on.num_draft_tokens > 0


def test_the_runner_refuses_a_draft_of_an_unsupported_architecture(model_dir, tmp_path):
    for name in os.listdir(model_dir):
        shutil.copy(os.path.join(model_dir, name), tmp_path)
    config_path = tmp_path / "config.json"
    raw = json.loads(config_path.read_text())
    config_path.write_text(
        json.dumps({**raw, "architectures": ["PhiForCausalLM"], "model_type": "phi"})
    )
    config = ModelConfig(model=model_dir)
    device = torch.device("cpu")
    runner = ModelRunner(config, device, draft=DraftModel(str(tmp_path), config, device))
    with pytest.raises(ValueError, match="draft model .*unsupported architecture 'PhiForCausalLM'"):
        runner.load_model()


def test_the_draft_architectures_are_the_loader_s_decoders():
    from switchboard.config.speculative import DRAFT_ARCHITECTURES
    from switchboard.models.loader import _MODEL_TYPES, MODEL_FAMILIES

    assert set(DRAFT_ARCHITECTURES) == set(MODEL_FAMILIES) - {"BertModel"}
    assert {v: k for k, v in DRAFT_ARCHITECTURES.items()} == _MODEL_TYPES
