"""The one-call decoder-layer stack: the same logits, bit for bit, as the layer-by-layer path on
decode steps of 1..MAX_ROWS rows (Llama, Qwen2's biases, Mistral's sliding window; the KV cache
it writes equal too), and equal to rounding where the layers' matmuls are oneDNN's; steps it
does not take (a prefill chunk in the step, more than MAX_ROWS rows) left to the layers; and
its off switch. It runs on the CPU kernel attention backend only: the reference stays torch."""

from __future__ import annotations

import random

import pytest
import torch

from switchboard.kernels import bf16_gemm, decode_stack, gemm, small_batch_gemm
from switchboard.models.attention import REFERENCE
from switchboard.wire.engine_msgs import SamplingParams
from switchboard.wire.step_msgs import CachedRequest, NewRequest, SchedulerOutput
from tests.tiny_checkpoint import tiny_checkpoint_dir
from tests.worker.test_model_runner_parity import make_runner

BLOCKS_PER_REQUEST = 8  # of 4 tokens (the runner's): prompts of 20..28 and 4 decode steps
BLOCK_RANGE = 10  # request i takes its blocks from 10i .. 10i + 9


def _steps(rows: int, vocab: int, decode_steps: int, seed: int) -> list[SchedulerOutput]:
    """A prefill step of ``rows`` requests, then ``decode_steps`` steps of one token each."""
    rng = random.Random(seed)
    new = [
        NewRequest(
            request_id=f"r{i}",
            prompt_token_ids=[rng.randrange(vocab) for _ in range(20 + i % 9)],
            sampling_params=SamplingParams(temperature=0.0, max_tokens=decode_steps + 1),
            # shuffled blocks: tables that are not in order
            block_ids=rng.sample(range(i * BLOCK_RANGE, (i + 1) * BLOCK_RANGE), BLOCKS_PER_REQUEST),
            num_computed_tokens=0,
        )
        for i in range(rows)
    ]
    steps = [
        SchedulerOutput(
            step_id=0,
            new_requests=new,
            num_scheduled_tokens={r.request_id: len(r.prompt_token_ids) for r in new},
            total_num_scheduled_tokens=sum(len(r.prompt_token_ids) for r in new),
        )
    ]
    for k in range(decode_steps):
        steps.append(
            SchedulerOutput(
                step_id=k + 1,
                cached_requests=[
                    CachedRequest(r.request_id, [], len(r.prompt_token_ids) + k) for r in new
                ],
                num_scheduled_tokens={r.request_id: 1 for r in new},
                total_num_scheduled_tokens=rows,
            )
        )
    return steps


def _stack_calls(monkeypatch) -> list[bool]:
    """Whether the stack ran, for every forward pass from here on."""
    calls: list[bool] = []
    real_run = decode_stack.DecodeStack.run
    monkeypatch.setattr(
        decode_stack.DecodeStack,
        "run",
        lambda *a, **kw: calls.append(real_run(*a, **kw)) or calls[-1],
    )
    return calls


def _head_calls(monkeypatch) -> list[bool]:
    """Whether each C call of the stack ended with the final norm and the LM head."""
    calls: list[bool] = []
    real_call = decode_stack._call

    def spy(*args, **kwargs):
        calls.append(kwargs.get("logits") is not None)
        return real_call(*args, **kwargs)

    monkeypatch.setattr(decode_stack, "_call", spy)
    return calls


def _run(runner, steps: list[SchedulerOutput], stack_on: bool, monkeypatch) -> list[torch.Tensor]:
    """Each step's logits, with the stack in use or not."""
    with monkeypatch.context() as patch:
        if not stack_on:
            patch.setattr(decode_stack._stack, "function", None)
        logits = []
        for step in steps:
            out = runner.forward_step(step)
            logits.append(out.logits.clone())
            runner.sample_step(out)
        return logits


@pytest.mark.parametrize(
    ("family", "kwargs"),
    [
        ("llama", {}),
        ("qwen2", {}),  # QKV biases
        ("mistral", {}),  # a sliding window shorter than the prompts
    ],
)
def test_decode_steps_are_bit_identical_to_the_layers(family, kwargs, monkeypatch):
    model_dir = tiny_checkpoint_dir(family, **kwargs)
    assert small_batch_gemm.load(), small_batch_gemm.status()  # max_rows() is 0 until loaded
    num_blocks = small_batch_gemm.max_rows() * BLOCK_RANGE
    stacked, layered = make_runner(model_dir, num_blocks), make_runner(model_dir, num_blocks)
    assert decode_stack.status() == "in use", decode_stack.status()
    assert stacked.attention_backend.name == "cpu-kernel"
    vocab = stacked.summary().vocab_size
    calls, heads = _stack_calls(monkeypatch), _head_calls(monkeypatch)
    for rows in sorted({1, 3, small_batch_gemm.max_rows()}):
        steps = _steps(rows, vocab, decode_steps=4, seed=rows)
        calls.clear()
        heads.clear()
        got = _run(stacked, steps, True, monkeypatch)
        # the prompts (short: the decode kernel attends them) in the stack while their tokens
        # fit its rows, else the layers; then the decode steps, with the norm and the LM head
        prompt_tokens = steps[0].total_num_scheduled_tokens
        in_stack = prompt_tokens <= decode_stack.MAX_ROWS
        assert calls == [in_stack] + [True] * 4
        assert heads == [False] * in_stack + [True] * 4
        expected = _run(layered, steps, False, monkeypatch)
        for a, b in zip(got, expected, strict=True):
            assert torch.equal(a, b)
        for cache_a, cache_b in zip(stacked.kv_caches, layered.kv_caches, strict=True):
            assert torch.equal(cache_a, cache_b)
        done = SchedulerOutput(step_id=99, finished_request_ids=[f"r{i}" for i in range(rows)])
        stacked.execute_model(done)
        layered.execute_model(done)


def test_the_head_joins_only_for_a_caller_that_takes_every_decode_rows_logits(monkeypatch):
    """A model whose caller does not take a decode step's logits right after it (a draft
    model's) runs the layers in the call but not the head; the logits agree bit for bit, and
    hidden states other than the ones the step returned get logits of their own."""
    model_dir = tiny_checkpoint_dir("llama")
    fused, apart = make_runner(model_dir), make_runner(model_dir)
    apart.model.logits_with_decodes = False
    steps = _steps(3, fused.summary().vocab_size, decode_steps=3, seed=7)
    heads = _head_calls(monkeypatch)
    got = _run(fused, steps, True, monkeypatch)
    assert heads[-3:] == [True] * 3
    heads.clear()
    assert all(map(torch.equal, got, _run(apart, steps, True, monkeypatch)))
    assert not any(heads)

    step = SchedulerOutput(
        step_id=9,
        cached_requests=[CachedRequest(f"r{i}", [], 20 + i + 3) for i in range(3)],
        num_scheduled_tokens={f"r{i}": 1 for i in range(3)},
        total_num_scheduled_tokens=3,
    )
    returned: list[torch.Tensor] = []
    forward = fused.model.forward
    monkeypatch.setattr(
        fused.model,
        "forward",
        lambda *a, **kw: returned.append(forward(*a, **kw)) or returned[-1],
    )
    out = fused.forward_step(step)
    hidden = returned[-1]
    first_row = fused.model.compute_logits(hidden[:1].clone())  # not the step's: computed
    assert torch.equal(first_row, out.logits[:1])


def test_the_head_stays_out_where_the_model_computes_its_logits_otherwise():
    """The stack takes the LM head only where ``gemm.linear`` would run the same kernel on the
    same panels: a dense float32 weight (oneDNN's or torch's product), a missing norm shape or
    bfloat16 panels keep the head in the model's own call."""
    assert small_batch_gemm.load(), small_batch_gemm.status()
    norm, weight = torch.ones(64), torch.randn(100, 64)
    panels = small_batch_gemm.pack(weight)
    if gemm.packable(weight):
        head = decode_stack.stack_head(norm, 1e-5, gemm.pack(weight), panels)
        assert head is not None and head.columns == 100
        assert decode_stack.stack_head(torch.ones(32), 1e-5, gemm.pack(weight), panels) is None
    assert decode_stack.stack_head(norm, 1e-5, weight, panels) is None
    assert decode_stack.stack_head(norm, 1e-5, weight, None) is None
    if bf16_gemm.packable(weight.bfloat16()):
        bf16 = bf16_gemm.pack(weight.bfloat16())
        assert decode_stack.stack_head(norm, 1e-5, weight.bfloat16(), bf16) is None


@pytest.mark.parametrize("layer_matmuls", ["small-batch kernel", "oneDNN"])
def test_beyond_a_register_group_of_rows(layer_matmuls, monkeypatch):
    """More rows than one register group, up to MAX_ROWS: bit-identical to the layers while
    their matmuls take the same kernel (gemm.SMALL_BATCH_MAX_ROWS), equal to rounding (and
    the same greedy tokens) where they are oneDNN's."""
    model_dir = tiny_checkpoint_dir("llama")
    if layer_matmuls == "oneDNN":
        monkeypatch.setattr(gemm, "SMALL_BATCH_MAX_ROWS", small_batch_gemm.max_rows())
    assert gemm.SMALL_BATCH_MAX_ROWS >= decode_stack.MAX_ROWS or layer_matmuls == "oneDNN"
    calls = _stack_calls(monkeypatch)
    for rows in (small_batch_gemm.max_rows() + 1, decode_stack.MAX_ROWS):
        stacked = make_runner(model_dir, num_blocks=rows * BLOCK_RANGE)
        layered = make_runner(model_dir, num_blocks=rows * BLOCK_RANGE)
        steps = _steps(rows, stacked.summary().vocab_size, decode_steps=3, seed=5)
        calls.clear()
        got = _run(stacked, steps, True, monkeypatch)
        prompt_tokens = steps[0].total_num_scheduled_tokens
        assert calls == [prompt_tokens <= decode_stack.MAX_ROWS] + [True] * 3
        expected = _run(layered, steps, False, monkeypatch)
        for a, b in zip(got, expected, strict=True):
            if layer_matmuls == "oneDNN":
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
                assert torch.equal(a.argmax(-1), b.argmax(-1))
            else:
                assert torch.equal(a, b)


def test_more_rows_than_it_takes_go_to_the_layers(monkeypatch):
    runner = make_runner(tiny_checkpoint_dir("llama"))
    monkeypatch.setattr(decode_stack, "MAX_ROWS", 2)
    calls = _stack_calls(monkeypatch)
    _run(runner, _steps(3, runner.summary().vocab_size, 2, seed=0), True, monkeypatch)
    assert calls == [False] * 3  # the prompts and the decode steps: 3 rows, more than it takes


def test_can_be_turned_off(monkeypatch):
    decode_stack.unload()
    monkeypatch.setenv("SWITCHBOARD_DECODE_STACK", "off")
    try:
        assert not decode_stack.load()
        assert "off" in decode_stack.status()
    finally:
        monkeypatch.delenv("SWITCHBOARD_DECODE_STACK")
        assert decode_stack.load()


def test_the_reference_backend_never_takes_it(monkeypatch):
    runner = make_runner(tiny_checkpoint_dir("llama"))
    runner.attention_backend = REFERENCE
    calls = _stack_calls(monkeypatch)
    _run(runner, _steps(2, runner.summary().vocab_size, 2, seed=0), True, monkeypatch)
    assert calls == []  # the model does not ask the stack: plain torch


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_a_decode_with_proposed_tokens_is_bit_identical_to_the_layers(family, monkeypatch):
    """A step of speculative decoding (each request's token and four proposed ones) takes the
    stack, every token a row of its own context, and gives the layers' logits bit for bit."""
    model_dir = tiny_checkpoint_dir(family)
    stacked, layered = make_runner(model_dir), make_runner(model_dir)
    vocab = stacked.summary().vocab_size
    steps = _steps(2, vocab, decode_steps=0, seed=7)
    prompts = {r.request_id: len(r.prompt_token_ids) for r in steps[0].new_requests}
    steps.append(
        SchedulerOutput(
            step_id=1,
            cached_requests=[CachedRequest(rid, [], n) for rid, n in prompts.items()],
            num_scheduled_tokens={rid: 5 for rid in prompts},
            total_num_scheduled_tokens=10,
            scheduled_spec_decode_tokens={rid: [3, 5, 7, 9] for rid in prompts},
        )
    )
    calls = _stack_calls(monkeypatch)
    got = _run(stacked, steps, True, monkeypatch)
    assert calls[-1] is True and got[-1].shape[0] == 10  # five logits rows per request
    expected = _run(layered, steps, False, monkeypatch)
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)
