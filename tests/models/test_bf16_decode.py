"""A model in bfloat16 on the CPU kernels (the bfloat16 matmul kernel, the one-call decode stack,
the decode-attention kernel) greedy-decodes as plain torch in bfloat16 does except near-ties; a
bfloat16 KV cache decodes as the float32 cache does within bfloat16's rounding, on the kernel
and on the reference backend alike; ``--kv-cache-dtype`` sizes and refuses as it says."""

from __future__ import annotations

import pytest
import torch

from switchboard import cli
from switchboard.kernels import bf16_gemm, decode_stack, gemm, stack_plan
from switchboard.models.attention import REFERENCE
from switchboard.worker.model_loading import resolve_kv_cache_dtype
from tests.models.test_decode_stack import BLOCK_RANGE, _run, _stack_calls, _steps
from tests.tiny_checkpoint import tiny_llama_dir
from tests.worker.test_model_runner_parity import DrivenRequest, ToyScheduler, make_runner

PROMPTS = [[1, 5, 40, 77, 100], [1, 9], [1, *range(20, 40)], [3, 4, 5, 6]]
# bfloat16 keeps 8 significant bits: the two paths round different intermediate values (the
# kernel path keeps its activations float32 through a decode step, and through the prefill of a
# prompt of up to 16 tokens, which the one-call stack takes too; torch rounds every one), so a
# log-probability moves by up to about a tenth on the tiny model (0.157 seen); its flat
# vocabulary of 1,024 has best-two gaps below that
BF16_ERROR = 0.25


def _greedy(runner, tokens: int = 12) -> list[DrivenRequest]:
    requests = [
        DrivenRequest(f"r{i}", prompt, tokens, join_step=i) for i, prompt in enumerate(PROMPTS)
    ]
    ToyScheduler(runner, chunk_size=6).run(requests)
    return requests


def _plain_torch(runner):
    """The runner on torch alone: the reference attention backend, no matmul panels."""
    runner.attention_backend = REFERENCE
    for module in runner.model.modules():
        if getattr(module, "small_batch", None) is not None:
            module.small_batch = None
    return runner


def _assert_agree_except_near_ties(ours, theirs, error: float) -> int:
    """Each sequence equal to the reference's up to the first near-tie (the reference's best two
    log-probabilities within ``error``), every log-probability before it within ``error``;
    returns how many tokens agreed."""
    agreed = 0
    for got, expected in zip(ours, theirs, strict=True):
        for step, (token, reference) in enumerate(zip(got.output, expected.output, strict=True)):
            best = expected.logprobs[step].topk(5)
            if token != reference:
                assert best.values[0] - best.values[1] < error, (got.request_id, step)
                break
            agreed += 1
            close = got.logprobs[step][best.indices]
            torch.testing.assert_close(close, best.values, atol=error, rtol=0)
    return agreed


def test_bfloat16_on_the_kernels_decodes_as_torch_does(monkeypatch):
    if not bf16_gemm.load():
        pytest.skip(bf16_gemm.status())
    model_dir = tiny_llama_dir()
    kernels = make_runner(model_dir, dtype="bfloat16")
    assert kernels.kv_caches[0].dtype == torch.bfloat16  # auto: the model's
    assert kernels.attention_backend.name == "cpu-kernel"
    qkv = kernels.model.model.layers[0].self_attn.qkv_proj.small_batch
    assert isinstance(qkv, bf16_gemm.Bf16Panels)
    assert decode_stack.status() == "in use"
    calls = _stack_calls(monkeypatch)
    ours = _greedy(kernels)
    assert any(calls)  # the decode-only steps ran in one call
    theirs = _greedy(_plain_torch(make_runner(model_dir, dtype="bfloat16")))
    assert _assert_agree_except_near_ties(ours, theirs, BF16_ERROR) >= 24


@pytest.mark.parametrize("backend", ["cpu-kernel", "reference"])
def test_a_bfloat16_kv_cache_decodes_as_float32_does_within_rounding(backend):
    model_dir = tiny_llama_dir()
    runners = [make_runner(model_dir, kv_cache_dtype=kv) for kv in ("bfloat16", "float32")]
    if backend == "reference":
        for runner in runners:
            runner.attention_backend = REFERENCE
    assert [r.kv_caches[0].dtype for r in runners] == [torch.bfloat16, torch.float32]
    assert runners[0].kv_cache_bytes_per_token() * 2 == runners[1].kv_cache_bytes_per_token()
    assert runners[0].summary().dtype == "float32"  # the model's dtype is unchanged
    bf16_cache, f32_cache = (_greedy(runner) for runner in runners)
    assert _assert_agree_except_near_ties(bf16_cache, f32_cache, BF16_ERROR) >= 24


def test_kv_cache_dtype_flag_is_checked_at_start_up(capsys):
    with pytest.raises(SystemExit):
        cli.make_parser().parse_args(["serve", "--kv-cache-dtype", "fp8"])
    assert "invalid choice: 'fp8'" in capsys.readouterr().err
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert resolve_kv_cache_dtype("auto", torch.bfloat16, cpu) == torch.bfloat16
    assert resolve_kv_cache_dtype("bfloat16", torch.float32, cpu) == torch.bfloat16
    assert resolve_kv_cache_dtype("bfloat16", torch.bfloat16, cuda) == torch.bfloat16
    with pytest.raises(ValueError, match="runs on CPU only"):
        resolve_kv_cache_dtype("float32", torch.bfloat16, cuda)
    with pytest.raises(ValueError, match="unknown KV cache dtype 'fp8'"):
        resolve_kv_cache_dtype("fp8", torch.float32, cpu)


def test_the_amx_kernel_keeps_steps_past_the_float32_rows_in_one_call(monkeypatch):
    """With the amx variant a bfloat16 step of more rows than the float32 stack takes (decodes
    beside a prompt chunk at many streams) runs in one call, agreeing with the layers' to
    bfloat16 rounding; a plan with float32 or quantized panels among its matrices keeps
    ``MAX_ROWS``."""
    if not bf16_gemm.load() or gemm.bf16_max_rows() <= decode_stack.MAX_ROWS:
        pytest.skip("the bfloat16 kernel takes no more rows than the float32 one here")
    assert stack_plan.max_rows({True}, decode_stack.MAX_ROWS) == gemm.bf16_max_rows()
    assert stack_plan.max_rows({True, False}, decode_stack.MAX_ROWS) == decode_stack.MAX_ROWS
    assert stack_plan.max_rows({False}, decode_stack.MAX_ROWS) == decode_stack.MAX_ROWS
    rows = decode_stack.MAX_ROWS + 5
    model_dir = tiny_llama_dir()
    stacked, layered = (
        make_runner(model_dir, rows * BLOCK_RANGE, dtype="bfloat16") for _ in range(2)
    )
    steps = _steps(rows, stacked.summary().vocab_size, decode_steps=3, seed=1)
    calls = _stack_calls(monkeypatch)
    got = _run(stacked, steps, True, monkeypatch)
    assert calls == [False, True, True, True]  # the prompts' thousands of tokens: the layers
    calls.clear()
    with monkeypatch.context() as patch:
        patch.setattr(stack_plan, "max_rows", lambda kinds, kernel_rows: kernel_rows)
        expected = _run(layered, steps, True, monkeypatch)
    assert calls == [False] * 4
    assert torch.equal(got[0], expected[0])  # the same prefill on both
    # the first decode step's inputs are the same on both: each row's best five
    ours, theirs = (logits[1].float().log_softmax(-1) for logits in (got, expected))
    best = theirs.topk(5)
    torch.testing.assert_close(ours.gather(1, best.indices), best.values, atol=BF16_ERROR, rtol=0)
