"""Speculative decoding together with what else a step carries, on the real scheduler and model
runner, n-gram and draft-model proposals alike: seeded ``n > 1`` (the gateway's child requests:
one prompt, seeds ``seed + i``, sharing the prompt's cached blocks), LoRA adapters next to base
requests, chunked prefill with preemption, and streams resumed with their output so far (as on
another engine after one died). The tokens are those of speculation off."""

from __future__ import annotations

import json

import msgspec
import pytest

from switchboard.config.lora import LoraConfig
from switchboard.wire.engine_msgs import SamplingParams
from switchboard.worker.model_runner import ModelRunner
from tests.tiny_checkpoint import tiny_checkpoint_dir
from tests.tiny_lora import tiny_lora_dir
from tests.worker.spec_decode_loop import run_loop, spec_runner

NUM_BLOCKS = 160
NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3})
ALLOWED = [5, 9, 33, 40, 41]  # few tokens: text that repeats, so n-gram proposals get accepted
PROMPT = [0, 5, 9, 33, 5, 9, 33, 5, 9, 33, 5, 9, 40, 41]


@pytest.fixture(scope="module")
def model_dir() -> str:
    return tiny_checkpoint_dir("llama")


@pytest.fixture(scope="module")
def runners(model_dir) -> dict[str, tuple[ModelRunner, str]]:
    """speculation off / n-gram / the model as its own draft: (runner, --speculative-config)."""
    self_draft = json.dumps({"model": model_dir, "num_speculative_tokens": 3})
    return {
        "off": (spec_runner(model_dir, NUM_BLOCKS), ""),
        "ngram": (spec_runner(model_dir, NUM_BLOCKS), NGRAM),
        "draft": (spec_runner(model_dir, NUM_BLOCKS, draft_dir=model_dir), self_draft),
    }


@pytest.mark.parametrize("ahead", [False, True])  # steps scheduled ahead as the engine does
@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_seeded_n_greater_than_one_keeps_every_sequence_s_tokens(runners, proposer, ahead):
    base = SamplingParams(
        temperature=0.9, top_k=4, seed=42, max_tokens=28, allowed_token_ids=ALLOWED
    )
    children = {f"{i}_parent": PROMPT for i in range(3)}
    params_of = {rid: msgspec.structs.replace(base, seed=42 + i) for i, rid in enumerate(children)}
    off_runner, _ = runners["off"]
    runner, config = runners[proposer]
    limits = dict(num_blocks=NUM_BLOCKS, params_of=params_of, ahead=ahead)
    off = run_loop(off_runner, children, base, "", **limits)  # type: ignore[arg-type]
    on = run_loop(runner, children, base, config, **limits)  # type: ignore[arg-type]
    for rid in children:
        assert on.tokens(rid) == off.tokens(rid), rid
    assert len({tuple(off.tokens(rid)) for rid in children}) > 1  # the seeds differ
    assert 0 < on.num_accepted_tokens < on.num_draft_tokens


@pytest.mark.parametrize("ahead", [False, True])
@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_chunked_prefill_and_preemption_keep_the_tokens_and_the_draft_s_cache(
    runners, proposer, ahead
):
    """Few blocks (requests are preempted and recomputed, from cached blocks where they can)
    and small steps (prompts prefill in chunks): the draft's cache stays the model's own, so
    the model as its own draft still has its proposals accepted."""
    prompts = {f"r{i}": PROMPT + [40 + i] * (6 + 3 * i) for i in range(4)}
    params = SamplingParams(temperature=0.0, max_tokens=30, allowed_token_ids=ALLOWED)
    limits = dict(num_blocks=28, max_model_len=64, max_num_batched_tokens=8, ahead=ahead)
    off = run_loop(runners["off"][0], prompts, params, "", **limits)  # type: ignore[arg-type]
    runner, config = runners[proposer]
    on = run_loop(runner, prompts, params, config, **limits)  # type: ignore[arg-type]
    for rid in prompts:
        assert on.tokens(rid) == off.tokens(rid), rid
    assert on.num_draft_tokens > 0
    if proposer == "draft":
        assert on.num_accepted_tokens >= 0.9 * on.num_draft_tokens


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_a_resumed_stream_goes_on_with_the_tokens_of_one_engine(runners, proposer):
    prompts = {"a": PROMPT, "b": PROMPT[3:]}
    params = SamplingParams(temperature=0.7, seed=9, max_tokens=30, allowed_token_ids=ALLOWED)
    whole = run_loop(runners["off"][0], prompts, params, "", num_blocks=NUM_BLOCKS)
    runner, config = runners[proposer]
    so_far = {rid: whole.tokens(rid)[:11] for rid in prompts}
    resumed = run_loop(
        runner, prompts, params, config, num_blocks=NUM_BLOCKS, resumed_outputs=so_far
    )
    for rid in prompts:
        assert resumed.tokens(rid) == whole.tokens(rid)[11:], rid
    assert resumed.num_accepted_tokens > 0


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_a_lora_adapter_s_tokens_are_the_same_with_speculation(model_dir, proposer):
    """The adapter changes the verifying model only (a draft proposes as the base model): its
    requests and base-model requests in the same steps keep the tokens of speculation off."""
    adapter = tiny_lora_dir(model_dir, rank=8, alpha=16.0, seed=1)
    lora = LoraConfig(enable_lora=True, max_loras=1, max_lora_rank=8)
    prompts = {"base": PROMPT, "adapted": PROMPT, "adapted-2": PROMPT[:9]}
    lora_of = {"adapted": "a", "adapted-2": "a"}
    params = SamplingParams(temperature=0.0, max_tokens=24, allowed_token_ids=ALLOWED)
    results = []
    for draft, config in [(False, ""), (proposer == "draft", _config(proposer, model_dir))]:
        runner = spec_runner(
            model_dir, NUM_BLOCKS, draft_dir=model_dir if draft else None, lora=lora
        )
        assert runner.lora is not None
        runner.lora.manager.add("a", adapter)
        results.append(
            run_loop(runner, prompts, params, config, num_blocks=NUM_BLOCKS, lora_of=lora_of)
        )
    off, on = results
    for rid in prompts:
        assert on.tokens(rid) == off.tokens(rid), rid
    assert off.tokens("adapted") != off.tokens("base")  # the adapter matters
    assert 0 < on.num_accepted_tokens


def _config(proposer: str, model_dir: str) -> str:
    if proposer == "ngram":
        return NGRAM
    return json.dumps({"model": model_dir, "num_speculative_tokens": 3})
