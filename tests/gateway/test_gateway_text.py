"""Incremental detokenization and stop strings across token boundaries."""

from __future__ import annotations

import random

import pytest

from switchboard.gateway.text import IncrementalDetokenizer, TextStream, Tokenizer

TEXTS = [
    "Hello world! The capital of France is Paris.",
    "naïve café 😀 and 🚀🚀 then 東京 👍🏽.",  # emoji, CJK, a skin-tone modifier
    "😀",
    " leading space and  double  spaces",
]


@pytest.fixture(params=["byte_level_tokenizer", "llama_style_tokenizer"])
def tokenizer(request: pytest.FixtureRequest) -> Tokenizer:
    return request.getfixturevalue(request.param)


def _stream_deltas(tokenizer: Tokenizer, prompt: list[int], output: list[int]) -> list[str]:
    detokenizer = IncrementalDetokenizer(tokenizer, prompt)
    deltas = [detokenizer.step(token_id) for token_id in output]
    deltas.append(detokenizer.flush())
    return deltas


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_add_up_to_the_full_decode(tokenizer: Tokenizer, text: str) -> None:
    prompt = tokenizer.encode("The capital of France is")
    output = tokenizer.encode(text, add_special_tokens=False)
    deltas = _stream_deltas(tokenizer, prompt, output)
    expected = tokenizer.decode(prompt + output)[len(tokenizer.decode(prompt)) :]
    assert "".join(deltas) == expected
    assert not any("\ufffd" in d for d in deltas), deltas


def test_a_multibyte_character_split_across_tokens_is_held_back(tokenizer: Tokenizer) -> None:
    output = tokenizer.encode(" 😀", add_special_tokens=False)
    # The test is only meaningful if the emoji really is split into several tokens.
    assert sum("\ufffd" in tokenizer.decode([t]) for t in output) >= 2
    prompt = tokenizer.encode("Hello")
    deltas = _stream_deltas(tokenizer, prompt, output)
    assert "".join(deltas) == tokenizer.decode(prompt + output)[len(tokenizer.decode(prompt)) :]
    assert any("😀" in d for d in deltas)  # the character arrives whole, in one delta
    assert all("\ufffd" not in d for d in deltas)
    assert deltas[-1] == ""  # nothing left to flush: the character completed on its last byte


def test_a_group_of_tokens_decodes_as_the_tokens_one_by_one(tokenizer: Tokenizer) -> None:
    """``extend`` (what a stream holding several steps for one message uses) gives the text
    ``step`` gives token by token, on real text and on random ids (a random model's output:
    cut characters, lone continuation bytes, special tokens), grouped at random."""
    rng = random.Random(7)
    vocab = tokenizer.vocab_size
    sequences = [tokenizer.encode(text, add_special_tokens=False) for text in TEXTS]
    sequences += [[rng.randrange(vocab) for _ in range(rng.randrange(1, 40))] for _ in range(300)]
    for output in sequences:
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, 8))]
        expected = "".join(_stream_deltas(tokenizer, prompt, output))
        detokenizer = IncrementalDetokenizer(tokenizer, prompt)
        text, i = "", 0
        while i < len(output):
            size = rng.randrange(1, 12)
            text += detokenizer.extend(output[i : i + size])
            i += size
        assert text + detokenizer.flush() == expected, output


def test_byte_level_decoders_are_told_apart(
    byte_level_tokenizer: Tokenizer, llama_style_tokenizer: Tokenizer
) -> None:
    assert byte_level_tokenizer.byte_level
    assert not llama_style_tokenizer.byte_level  # SentencePiece-style: one id at a time


def test_flush_releases_an_incomplete_character(byte_level_tokenizer: Tokenizer) -> None:
    output = byte_level_tokenizer.encode("ok 😀", add_special_tokens=False)[:-1]  # cut the emoji
    deltas = _stream_deltas(byte_level_tokenizer, byte_level_tokenizer.encode("Hi"), output)
    assert deltas[-1].endswith("\ufffd")


def test_special_tokens_are_skipped_unless_asked(byte_level_tokenizer: Tokenizer) -> None:
    eos = byte_level_tokenizer.token_id("<|endoftext|>")
    assert eos is not None
    output = byte_level_tokenizer.encode("Hello", add_special_tokens=False) + [eos]
    prompt = byte_level_tokenizer.encode("Hi")
    assert "".join(_stream_deltas(byte_level_tokenizer, prompt, output)) == "Hello"
    detokenizer = IncrementalDetokenizer(byte_level_tokenizer, prompt, skip_special_tokens=False)
    text = "".join(detokenizer.step(t) for t in output) + detokenizer.flush()
    assert text == "Hello<|endoftext|>"


def _run_stop(
    tokenizer: Tokenizer, text: str, stop: list[str], include: bool = False, min_tokens: int = 0
):
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode("Story:"))
    stream = TextStream(
        detokenizer, stop, include_stop_str_in_output=include, min_tokens=min_tokens
    )
    released = []
    for token_id in tokenizer.encode(text, add_special_tokens=False):
        released.append(stream.push([token_id]))
        if stream.stopped:
            break
    released.append(stream.finish())
    return released, stream


def test_stop_string_across_token_boundaries(byte_level_tokenizer: Tokenizer) -> None:
    tokens = byte_level_tokenizer.encode(" nine ten ENDX", add_special_tokens=False)
    assert len(tokens) > 3
    released, stream = _run_stop(byte_level_tokenizer, " one two nine ten ENDX more", ["ten END"])
    assert stream.stop_string == "ten END"
    assert "".join(released) == " one two nine "
    # Part of the stop string was never released early, not even for one step.
    assert all("ten" not in chunk for chunk in released)


def test_stop_string_included_in_output(byte_level_tokenizer: Tokenizer) -> None:
    released, stream = _run_stop(
        byte_level_tokenizer, " one two STOP three four", ["STOP"], include=True
    )
    assert stream.stop_string == "STOP"
    assert "".join(released) == " one two STOP"


def test_a_stop_prefix_that_does_not_complete_is_released(byte_level_tokenizer: Tokenizer) -> None:
    released, stream = _run_stop(byte_level_tokenizer, " EN ENx END tail", ["END"])
    assert stream.stop_string == "END"
    assert "".join(released) == " EN ENx "


def test_the_earliest_of_several_stop_strings_wins(byte_level_tokenizer: Tokenizer) -> None:
    released, stream = _run_stop(byte_level_tokenizer, " one two three four", ["four", "two"])
    assert stream.stop_string == "two"
    assert "".join(released) == " one "


def test_stop_string_with_a_multibyte_character(llama_style_tokenizer: Tokenizer) -> None:
    released, stream = _run_stop(llama_style_tokenizer, "café 😀 done 😀 again", ["😀 d"])
    assert stream.stop_string == "😀 d"
    assert "".join(released) == " café "


def test_a_stop_string_needs_an_ending_past_min_tokens(byte_level_tokenizer: Tokenizer) -> None:
    text = " one STOP two STOP three"
    ids = byte_level_tokenizer.encode(text, add_special_tokens=False)
    first_stop_ends = next(
        n for n in range(1, len(ids) + 1) if "STOP" in byte_level_tokenizer.decode(ids[:n])
    )
    released, stream = _run_stop(byte_level_tokenizer, text, ["STOP"], min_tokens=first_stop_ends)
    assert stream.stop_string == "STOP"
    assert "".join(released) == " one STOP two "  # the first one ended within min_tokens
    released, stream = _run_stop(byte_level_tokenizer, text, ["STOP"], min_tokens=len(ids))
    assert not stream.stopped and "".join(released) == text


def test_no_stop_releases_everything_at_finish(byte_level_tokenizer: Tokenizer) -> None:
    released, stream = _run_stop(byte_level_tokenizer, " one two three", ["three!"])
    assert not stream.stopped
    assert "".join(released) == " one two three"
    # Held back at most len("three!") - 1 characters until the end.
    assert len(released[-1]) <= len("three!") - 1
