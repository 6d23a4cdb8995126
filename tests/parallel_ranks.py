"""Running a function on N gloo ranks (spawned processes) for the parallelism tests.

``run_on_ranks(target, tp, pp, *args)`` starts ``tp * pp`` processes; each joins a gloo group
through ``worker.distributed.init_parallel_state`` (the workers' own code) at a ``file://``
rendezvous, calls ``target(parallel_state, *args)`` with one torch thread, and sends back its
return value. It returns the values in rank order, raises with the failing rank's traceback,
and kills every process it started (by pid) when the deadline passes.

Targets must live in an importable module (this one, or another non-test module under tests/),
since spawned children import them by name.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import random
import shutil
import tempfile
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

DEFAULT_TIMEOUT_S = 150.0


def run_on_ranks(
    target: Callable[..., Any], tp: int, pp: int, *args: Any, timeout_s: float = DEFAULT_TIMEOUT_S
) -> list[Any]:
    import time

    world_size = tp * pp
    context = multiprocessing.get_context("spawn")
    results: queue.Queue = context.Queue()
    rendezvous_dir = tempfile.mkdtemp(prefix="sb-dist-")
    init_method = f"file://{os.path.join(rendezvous_dir, 'rendezvous')}"
    processes = [
        context.Process(
            target=_rank_main,
            args=(target, tp, pp, rank, init_method, results, args),
            name=f"rank{rank}",
            daemon=True,
        )
        for rank in range(world_size)
    ]
    try:
        for process in processes:
            process.start()
        values: dict[int, Any] = {}
        deadline = time.monotonic() + timeout_s
        while len(values) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"ranks {sorted(set(range(world_size)) - set(values))} "
                                     f"did not finish within {timeout_s:.0f}s")  # fmt: skip
            try:
                rank, ok, value = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [p for p in processes if p.exitcode not in (None, 0)]
                if dead:
                    raise AssertionError(f"{dead[0].name} exited with {dead[0].exitcode}") from None
                continue
            if not ok:
                raise AssertionError(f"rank {rank} failed:\n{value}")
            values[rank] = value
        return [values[rank] for rank in range(world_size)]
    finally:
        for process in processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join(timeout=10)
        shutil.rmtree(rendezvous_dir, ignore_errors=True)


def _rank_main(target, tp, pp, rank, init_method, results, args) -> None:
    import torch

    from switchboard.config import ParallelConfig
    from switchboard.worker.distributed import init_parallel_state, leave_parallel_group

    torch.set_num_threads(1)
    try:
        parallel = init_parallel_state(
            ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp),
            rank,
            init_method,
            torch.device("cpu"),
        )
        results.put((rank, True, target(parallel, *args)))
    except BaseException:  # noqa: BLE001 - the parent shows it
        results.put((rank, False, traceback.format_exc()))
    finally:
        leave_parallel_group()


# -- a small scheduler driving model runners with identical deltas on every rank -----------------

BLOCK_SIZE = 4
NUM_BLOCKS = 64


@dataclass
class PlannedRequest:
    request_id: str
    prompt: list[int]
    max_tokens: int
    join_step: int = 0
    params: dict[str, Any] = field(default_factory=dict)  # SamplingParams fields
    lora_name: str = ""  # the LoRA adapter it runs with ("" = the base model)


def planned_requests() -> list[PlannedRequest]:
    """Requests that join at different steps, prefill in chunks, decode together; one seeded
    sampled request and one with logprobs and prompt logprobs."""
    return [
        PlannedRequest("a", [0, 17, 250, 3], 10),
        PlannedRequest("b", [0, *range(40, 63)], 8, join_step=1),
        PlannedRequest("c", [0, 900, 3, 3, 3, 77, 512, 8, 1000, 64, 2], 12, join_step=2),
        PlannedRequest("sampled", [0, 5, 9, 33], 8, params={"temperature": 0.8, "seed": 7}),
        PlannedRequest(
            "logprobs",
            [0, 11, 12, 13, 14, 15],
            5,
            join_step=3,
            params={"logprobs": 3, "prompt_logprobs": 2},
        ),  # fmt: skip
    ]


def drive_runner(runner, requests: list[PlannedRequest], chunk_size: int = 5) -> dict[str, Any]:
    """Run ``requests`` to completion through ``runner.execute_model``; returns request id ->
    {"tokens": [...], "logprobs": [...], "prompt_logprobs": [...]} (as seen by this rank)."""
    from switchboard.wire.engine_msgs import SamplingParams
    from switchboard.wire.step_msgs import CachedRequest, NewRequest, SchedulerOutput

    free_blocks = list(range(NUM_BLOCKS))
    random.Random(0).shuffle(free_blocks)
    state = {r.request_id: {"computed": 0, "blocks": [], "sent": False} for r in requests}
    outputs: dict[str, Any] = {
        r.request_id: {"tokens": [], "logprobs": [], "prompt_logprobs": []} for r in requests
    }
    finished: list[str] = []
    for step_id in range(300):
        active = [
            r
            for r in requests
            if r.join_step <= step_id and len(outputs[r.request_id]["tokens"]) < r.max_tokens
        ]
        if not active and not finished:
            if all(len(outputs[r.request_id]["tokens"]) >= r.max_tokens for r in requests):
                return outputs
            continue
        step = SchedulerOutput(step_id=step_id, finished_request_ids=finished)
        for request in active:
            s = state[request.request_id]
            tokens = request.prompt + outputs[request.request_id]["tokens"]
            n = min(len(tokens) - s["computed"], chunk_size)
            needed = -(-(s["computed"] + n) // BLOCK_SIZE) - len(s["blocks"])
            new_blocks = [free_blocks.pop() for _ in range(max(needed, 0))]
            s["blocks"] += new_blocks
            if not s["sent"]:
                s["sent"] = True
                params = SamplingParams(
                    **{"temperature": 0.0, "max_tokens": request.max_tokens, **request.params}
                )
                step.new_requests.append(
                    NewRequest(
                        request.request_id,
                        list(request.prompt),
                        params,
                        new_blocks,
                        0,
                        lora_name=request.lora_name,
                    )
                )
            else:
                step.cached_requests.append(
                    CachedRequest(request.request_id, new_blocks, s["computed"])
                )
            step.num_scheduled_tokens[request.request_id] = n
        step.total_num_scheduled_tokens = sum(step.num_scheduled_tokens.values())
        output = runner.execute_model(step)
        finished = []
        for i, (request_id, sampled) in enumerate(
            zip(output.request_ids, output.sampled_token_ids, strict=True)
        ):
            state[request_id]["computed"] += step.num_scheduled_tokens[request_id]
            outputs[request_id]["tokens"] += sampled
            if output.logprobs and output.logprobs[i]:
                outputs[request_id]["logprobs"] += [_plain(lp) for lp in output.logprobs[i]]
            if request_id in output.prompt_logprobs:
                prompt = output.prompt_logprobs[request_id]
                outputs[request_id]["prompt_logprobs"] += [_plain(lp) for lp in prompt]
            request = next(r for r in requests if r.request_id == request_id)
            if len(outputs[request_id]["tokens"]) >= request.max_tokens:
                free_blocks += state[request_id]["blocks"]
                finished.append(request_id)
    raise AssertionError("requests did not finish")


def _plain(logprobs) -> tuple[list[int], list[float]]:
    return list(logprobs.token_ids), list(logprobs.logprobs)


def generate_with_runner(parallel, model_dirs: list[str]) -> list[dict[str, Any]]:
    """Target: load each checkpoint as this rank's share, drive the planned requests, and return
    what this rank saw (per checkpoint) plus its KV cache shape."""
    import torch

    from switchboard.config import ModelConfig
    from switchboard.worker.model_runner import ModelRunner

    results = []
    for model_dir in model_dirs:
        runner = ModelRunner(ModelConfig(model=model_dir), torch.device("cpu"), parallel)
        runner.load_model()
        runner.initialize_kv_cache(NUM_BLOCKS, BLOCK_SIZE)
        outputs = drive_runner(runner, planned_requests())
        outputs["kv_cache_shape"] = [tuple(runner.kv_caches[0].shape), len(runner.kv_caches)]
        results.append(outputs)
    return results


# -- the parallel layers against dense ones -------------------------------------------------------


def compare_parallel_layers(parallel, seed: int = 0) -> dict[str, float]:
    """Target: each tensor-parallel layer, loaded from a full (dense) weight, against the dense
    computation on the same input; returns the largest absolute difference per layer."""
    import torch
    import torch.nn.functional as F

    from switchboard.models.parallel_layers import (
        ColumnParallelLinear,
        ParallelLMHead,
        RowParallelLinear,
        VocabParallelEmbedding,
        vocab_parallel_logits,
    )

    generator = torch.Generator().manual_seed(seed)  # the same tensors on every rank

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator)

    hidden, q_size, kv_size, vocab = 16, 32, 8, 37  # 37: the last rank's rows are padding
    x = randn(5, hidden)
    diffs: dict[str, float] = {}

    # Column-parallel q/k/v (each split separately) -> row-parallel output projection.
    q_w, k_w, v_w, qkv_bias = (
        randn(q_size, hidden),
        randn(kv_size, hidden),
        randn(kv_size, hidden),
        randn(q_size + 2 * kv_size),
    )
    o_w, o_bias = randn(hidden, q_size), randn(hidden)
    q_rows = parallel.split(q_size, "q")
    kv_rows = parallel.split(kv_size, "kv")
    qkv = ColumnParallelLinear(hidden, {"q": q_rows, "k": kv_rows, "v": kv_rows}, bias=True)
    for name, weight, bias in zip(
        "qkv", (q_w, k_w, v_w), qkv_bias.split([q_size, kv_size, kv_size]), strict=True
    ):
        qkv.load_shard(name, "weight", weight)
        qkv.load_shard(name, "bias", bias)
    o_proj = RowParallelLinear(q_rows, hidden, bias=True, parallel=parallel)
    o_proj.load_param("weight", o_w)
    o_proj.load_param("bias", o_bias)
    with torch.no_grad():
        q_local, k_local, v_local = qkv.split(qkv(x))
        dense_qkv = F.linear(x, torch.cat([q_w, k_w, v_w]), qkv_bias)
        dense_q, dense_k, dense_v = dense_qkv.split([q_size, kv_size, kv_size], dim=-1)
        diffs["column q"] = _max_diff(q_local, dense_q[:, q_rows.start : q_rows.stop])
        diffs["column k"] = _max_diff(k_local, dense_k[:, kv_rows.start : kv_rows.stop])
        diffs["column v"] = _max_diff(v_local, dense_v[:, kv_rows.start : kv_rows.stop])
        diffs["row"] = _max_diff(o_proj(q_local), F.linear(dense_q, o_w, o_bias))

    # Vocabulary-parallel embedding and LM head (logits gathered, padding dropped).
    table = randn(vocab, hidden)
    embedding = VocabParallelEmbedding(vocab, hidden, parallel)
    embedding.load_param("weight", table)
    head = ParallelLMHead(vocab, hidden, parallel)
    head.load_param("weight", table)
    token_ids = torch.tensor([0, 36, 18, 19, 5, 36])
    with torch.no_grad():
        diffs["embedding"] = _max_diff(embedding(token_ids), F.embedding(token_ids, table))
        logits = vocab_parallel_logits(x, head.weight, parallel, vocab)
        diffs["lm head"] = _max_diff(logits, F.linear(x, table))
        diffs["lm head shape"] = float(logits.shape != (5, vocab))
    return diffs


def _max_diff(a, b) -> float:
    return float((a - b).abs().max())


# -- structured output: the grammar bitmask under TP / PP ------------------------------------------


def sample_under_grammar_mask(parallel, model_dir: str, bitmask: bytes) -> dict[str, int]:
    """Target: one prefill step of a free and a constrained request (mask row for "held");
    the token each got on this rank (every rank appends the output rank's draw)."""
    import torch

    from switchboard.config import ModelConfig
    from switchboard.wire.engine_msgs import SamplingParams
    from switchboard.wire.step_msgs import NewRequest, SchedulerOutput
    from switchboard.worker.model_runner import ModelRunner

    runner = ModelRunner(ModelConfig(model=model_dir), torch.device("cpu"), parallel)
    runner.load_model()
    runner.initialize_kv_cache(NUM_BLOCKS, BLOCK_SIZE)
    greedy = SamplingParams(temperature=0.0, max_tokens=4)
    prompt = [0, 17, 42, 99, 7]
    runner.execute_model(
        SchedulerOutput(
            step_id=1,
            new_requests=[
                NewRequest("free", prompt, greedy, [1, 2], 0),
                NewRequest("held", prompt, greedy, [3, 4], 0),
            ],
            num_scheduled_tokens={"free": 5, "held": 5},
            total_num_scheduled_tokens=10,
            grammar_bitmask=bitmask,
            structured_request_ids=["held"] if bitmask else [],
        )
    )
    return {rid: runner.requests[rid].token_ids[-1] for rid in ("free", "held")}
