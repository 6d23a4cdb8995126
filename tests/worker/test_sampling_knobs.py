"""Each sampling knob, through the batch builder and the sampler, as the model runner uses them."""

from __future__ import annotations

import math

import pytest
import torch

from switchboard.wire.engine_msgs import SamplingParams
from switchboard.worker.logits_processors import apply_logits_processing
from switchboard.worker.sampler import new_request_generator, sample
from switchboard.worker.sampling_inputs import build_logits_processing, build_sampling_batch
from switchboard.worker.step_inputs import RequestState, TokenHistory

VOCAB = 40
CPU = torch.device("cpu")


def state(prompt=(5, 6), output=(), seed=None, **knobs) -> RequestState:
    params = SamplingParams(seed=seed, **knobs)
    generator = None if seed is None else new_request_generator(seed, len(output))
    return RequestState(
        request_id="r",
        token_ids=[*prompt, *output],
        block_ids=[],
        num_computed_tokens=0,
        sampling_params=params,
        generator=generator,
        num_prompt_tokens=len(prompt),
    )


def logits_of(rows: int = 1, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 2


def draw(states: list[RequestState], logits: torch.Tensor):
    return sample(logits.clone(), build_sampling_batch(states, VOCAB, CPU))


def processed(states: list[RequestState], logits: torch.Tensor) -> torch.Tensor:
    processing = build_logits_processing(states, VOCAB, CPU)
    assert processing is not None
    return apply_logits_processing(logits.clone(), processing)


def test_plain_greedy_rows_build_no_extra_tensors():
    batch = build_sampling_batch([state(temperature=0.0)] * 4, VOCAB, CPU)
    assert batch.all_greedy and batch.processing is None
    assert batch.top_k is None and batch.top_p is None and batch.min_p is None
    assert batch.logprob_rows is None
    logits = logits_of(4)
    assert torch.equal(sample(logits.clone(), batch).token_ids, logits.argmax(-1))


PLAIN_CASES = [  # (knobs, output tokens so far, plain greedy: the sample is the argmax)
    ({"temperature": 0.0}, 0, True),
    ({"temperature": 0.0, "seed": 7}, 0, True),
    ({"temperature": 0.0, "min_tokens": 2, "eos_token_ids": [3]}, 1, False),
    ({"temperature": 0.0, "min_tokens": 2, "eos_token_ids": [3]}, 2, True),
    ({"temperature": 0.0, "min_tokens": 2, "eos_token_ids": [3], "ignore_eos": True}, 0, True),
    ({"temperature": 0.0, "min_tokens": 2, "stop_token_ids": [4], "ignore_eos": True}, 1, False),
    ({"temperature": 0.8}, 3, False),
    ({"temperature": 0.0, "logprobs": 0}, 3, False),
    ({"temperature": 0.0, "min_p": 0.1}, 3, False),
    ({"temperature": 0.0, "presence_penalty": 0.5}, 3, False),
    ({"temperature": 0.0, "logit_bias": {1: 5.0}}, 3, False),
    ({"temperature": 0.0, "allowed_token_ids": [1, 2]}, 3, False),
    ({"temperature": 0.0, "bad_words_token_ids": [[9]]}, 3, False),
]


@pytest.mark.parametrize(("knobs", "outputs", "plain"), PLAIN_CASES)
def test_plain_greedy_rows_are_exactly_the_argmax_rows(knobs, outputs, plain):
    """The runner samples plain greedy rows with one argmax and no batch: only rows whose
    full sampler path also gives the argmax of the raw logits may be called plain."""
    row = state(output=tuple(range(10, 10 + outputs)), **knobs)
    assert row.plain_greedy is plain
    if plain:
        logits = logits_of(1, seed=outputs)
        logits[0, 3] = logits[0, 4] = logits.max() + 1  # EOS / stop would win if unbanned
        assert draw([row], logits).token_ids.tolist() == logits.argmax(-1).tolist()


def test_min_p_drops_tokens_below_a_fraction_of_the_best():
    probs = torch.tensor([0.5, 0.3, 0.1] + [0.1 / (VOCAB - 3)] * (VOCAB - 3))
    logits = probs.log().expand(300, VOCAB).contiguous()
    # min_p 0.25: threshold 0.125 keeps tokens 0 and 1 only.
    tokens = draw([state(min_p=0.25)] * 300, logits).token_ids
    assert set(tokens.tolist()) == {0, 1}


def test_presence_and_frequency_penalties_count_output_tokens_only():
    logits = torch.zeros(1, VOCAB)
    row = state(prompt=(7, 7), output=(3, 3, 3, 9), presence_penalty=0.5, frequency_penalty=0.25)
    out = processed([row], logits)[0]
    assert out[3].item() == pytest.approx(-(0.5 + 3 * 0.25))
    assert out[9].item() == pytest.approx(-(0.5 + 0.25))
    assert out[7].item() == 0.0  # in the prompt only: OpenAI penalties ignore it
    assert out[0].item() == 0.0


def test_repetition_penalty_covers_prompt_and_output_and_respects_the_sign():
    logits = torch.full((1, VOCAB), 1.0)
    logits[0, 4] = -1.0
    row = state(prompt=(4, 11), output=(12,), repetition_penalty=2.0)
    out = processed([row], logits)[0]
    assert out[11].item() == pytest.approx(0.5)  # prompt token, positive logit: divided
    assert out[12].item() == pytest.approx(0.5)  # output token
    assert out[4].item() == pytest.approx(-2.0)  # negative logit: multiplied
    assert out[20].item() == 1.0  # unseen


def test_penalties_follow_the_output_as_it_grows():
    row = state(output=(), frequency_penalty=1.0)
    assert isinstance(row.output_history, TokenHistory) and len(row.output_history) == 0
    for _ in range(100):  # grows past its first buffer
        row.append_output_token(8)
    out = processed([row], torch.zeros(1, VOCAB))[0]
    assert out[8].item() == pytest.approx(-100.0)


def test_logit_bias_can_force_or_forbid_a_token():
    logits = logits_of()
    best = int(logits.argmax())
    forced = draw([state(temperature=0.0, logit_bias={17: 100.0})], logits).token_ids
    forbidden = draw([state(temperature=0.0, logit_bias={best: -100.0})], logits).token_ids
    assert forced.tolist() == [17]
    assert forbidden.item() != best


def test_allowed_token_ids_restrict_sampling():
    tokens = draw([state(allowed_token_ids=[3, 30, 31])] * 200, logits_of(200)).token_ids
    assert set(tokens.tolist()) <= {3, 30, 31}


def test_single_token_bad_word_is_always_banned():
    logits = torch.zeros(1, VOCAB)
    logits[0, 6] = 50.0
    assert draw([state(temperature=0.0, bad_words_token_ids=[[6]])], logits).token_ids != 6


def test_multi_token_bad_word_bans_its_last_token_only_after_its_prefix():
    logits = torch.zeros(1, VOCAB)
    logits[0, 6] = 50.0
    word = [[21, 22, 6]]
    ends_with_prefix = state(output=(1, 21, 22), temperature=0.0, bad_words_token_ids=word)
    other_tail = state(output=(21, 23), temperature=0.0, bad_words_token_ids=word)
    tokens = draw([ends_with_prefix, other_tail], logits.expand(2, VOCAB)).token_ids
    assert tokens.tolist()[0] != 6 and tokens.tolist()[1] == 6


def test_min_tokens_masks_eos_and_stop_tokens_until_reached():
    logits = torch.zeros(1, VOCAB)
    logits[0, 2] = 50.0  # EOS
    logits[0, 3] = 40.0  # a stop token
    knobs = dict(temperature=0.0, min_tokens=2, eos_token_ids=[2], stop_token_ids=[3])
    early = state(output=(9,), **knobs)
    reached = state(output=(9, 9), **knobs)
    ignoring_eos = state(output=(9,), ignore_eos=True, **knobs)
    tokens = draw([early, reached, ignoring_eos], logits.expand(3, VOCAB)).token_ids.tolist()
    assert tokens[0] not in (2, 3)
    assert tokens[1] == 2
    assert tokens[2] == 2  # ignore_eos: EOS does not stop, so it is not masked either


def test_logprobs_are_the_models_own_with_ranks_and_top_n():
    logits = logits_of(2, seed=4)
    logits[0, logits[0].argmax()] = logits[0].topk(2).values[1] + 0.3  # a narrow winner
    rows = [
        state(temperature=0.0, logprobs=3, presence_penalty=1.0, output=(int(logits[0].argmax()),)),
        state(temperature=1.0, logprobs=0),
    ]
    result = draw(rows, logits)
    raw = logits.log_softmax(-1)
    for row, entry in result.logprobs.items():
        chosen = int(result.token_ids[row])
        assert entry.token_ids[0] == chosen
        assert entry.logprobs[0] == pytest.approx(raw[row, chosen].item(), abs=1e-5)
        assert entry.ranks[0] == int((raw[row] > raw[row, chosen]).sum()) + 1
        top = raw[row].topk(rows[row].sampling_params.logprobs or 0)
        assert entry.token_ids[1:] == top.indices.tolist()
        assert entry.logprobs[1:] == pytest.approx(top.values.tolist(), abs=1e-5)
        assert entry.ranks[1:] == list(range(1, len(top.indices) + 1))
    assert sorted(result.logprobs) == [0, 1]
    # The penalty moved the greedy choice off the raw best token: its rank shows it.
    assert result.logprobs[0].ranks[0] > 1


def test_rows_without_logprobs_get_none():
    result = draw([state(logprobs=2), state()], logits_of(2))
    assert list(result.logprobs) == [0]


def test_seeded_request_is_independent_of_its_neighbours_with_every_knob():
    def seeded() -> RequestState:
        return state(
            seed=77,
            temperature=0.9,
            top_k=20,
            top_p=0.9,
            min_p=0.05,
            repetition_penalty=1.3,
            presence_penalty=0.2,
            logit_bias={5: 1.0},
        )

    row_logits = logits_of(1, seed=9)
    alone_state = seeded()
    alone = []
    for _ in range(8):
        token = int(draw([alone_state], row_logits).token_ids[0])
        alone_state.append_output_token(token)
        alone.append(token)
    crowd_state = seeded()
    neighbours = [state(temperature=1.0), state(seed=5, frequency_penalty=1.0), state(top_k=3)]
    crowd = []
    for step in range(8):
        logits = torch.cat([logits_of(1, seed=100 + step), row_logits, logits_of(2, seed=step)])
        token = int(draw([neighbours[0], crowd_state, *neighbours[1:]], logits).token_ids[1])
        crowd_state.append_output_token(token)
        crowd.append(token)
    assert alone == crowd
    assert len(set(alone)) > 1


def test_everything_banned_still_returns_a_token_id_in_range():
    row = state(temperature=1.0, allowed_token_ids=[2], min_tokens=3, eos_token_ids=[2])
    token = int(draw([row], logits_of()).token_ids[0])
    assert 0 <= token < VOCAB


def test_out_of_vocabulary_ids_are_ignored_by_the_builder():
    row = state(temperature=0.0, logit_bias={VOCAB + 5: 10.0}, allowed_token_ids=[1, VOCAB + 1])
    assert draw([row], logits_of()).token_ids.tolist() == [1]
    assert math.isfinite(processed([row], logits_of())[0, 1].item())


def test_a_resumed_seeded_request_continues_its_stream():
    row_logits = logits_of(1, seed=2)
    running = state(seed=3, temperature=1.0)
    tokens = []
    for _ in range(6):
        token = int(draw([running], row_logits).token_ids[0])
        running.append_output_token(token)
        tokens.append(token)
    resumed = state(output=tokens[:4], seed=3, temperature=1.0)  # rebuilt after a preemption
    assert [int(draw([resumed], row_logits).token_ids[0])] == tokens[4:5]
    assert len(set(tokens)) > 1
