"""The engine's step loop in one process: the real scheduler and the real model runner, so that
speculative decoding is checked end to end on a model without processes or sockets."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import torch

from switchboard.config import CacheConfig, ModelConfig, SchedulerConfig
from switchboard.config.lora import LoraConfig
from switchboard.engine.request import Request
from switchboard.engine.scheduler import Scheduler
from switchboard.models.parallel import SINGLE_PROCESS, ParallelState
from switchboard.wire.engine_msgs import EngineCoreOutput, EngineCoreRequest, SamplingParams
from switchboard.wire.lora import lora_request
from switchboard.worker.draft_model import DraftModel
from switchboard.worker.model_runner import ModelRunner

BLOCK_SIZE = 4
_arrival = itertools.count(1)


def spec_runner(
    model_dir: str,
    num_blocks: int,
    *,
    draft_dir: str | None = None,
    lora: LoraConfig | None = None,
    parallel: ParallelState = SINGLE_PROCESS,
) -> ModelRunner:
    """A CPU runner of ``model_dir`` with a KV cache of ``num_blocks`` blocks of ``BLOCK_SIZE``;
    ``draft_dir``: the checkpoint of its draft model (speculative decoding), ``lora``: its
    adapters' configuration, ``parallel``: its share of a tensor/pipeline-parallel group."""
    config = ModelConfig(model=model_dir, lora=lora or LoraConfig())
    device = torch.device("cpu")
    draft = DraftModel(draft_dir, config, device) if draft_dir else None
    runner = ModelRunner(config, device, parallel, draft=draft)
    runner.load_model()
    runner.initialize_kv_cache(num_blocks, BLOCK_SIZE)
    return runner


@dataclass
class LoopResult:
    outputs: dict[str, list[EngineCoreOutput]] = field(default_factory=dict)
    steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # with ahead: steps scheduled before the output of the step in flight, and those of them
    # with proposals (looked up ahead of the tokens that step samples)
    steps_ahead: int = 0
    steps_ahead_proposing: int = 0

    def tokens(self, request_id: str) -> list[int]:
        return [t for o in self.outputs[request_id] for t in o.new_token_ids]

    def logprobs(self, request_id: str) -> list[float]:
        return [lp.logprobs[0] for o in self.outputs[request_id] for lp in o.new_logprobs or []]


def run_loop(
    runner: ModelRunner,
    prompts: dict[str, list[int]],
    params: SamplingParams,
    speculative_config: str,
    *,
    num_blocks: int,
    max_model_len: int = 256,
    max_num_batched_tokens: int = 64,
    params_of: dict[str, SamplingParams] | None = None,
    lora_of: dict[str, str] | None = None,
    resumed_outputs: dict[str, list[int]] | None = None,
    ahead: bool = False,
) -> LoopResult:
    """Generate for every prompt until all finish; the runner's KV cache must have been made
    with ``num_blocks`` blocks of ``BLOCK_SIZE``. ``params_of`` / ``lora_of``: a request's own
    sampling parameters / LoRA adapter instead of ``params`` / the base model;
    ``resumed_outputs``: a request's output so far, as a stream resumed on another engine;
    ``ahead``: the next step scheduled before the step in flight's output is applied, as the
    engine schedules ahead (the runner computes the steps in the order they are scheduled, as
    the worker does)."""
    scheduler = Scheduler(
        SchedulerConfig(
            max_num_seqs=8,
            max_num_batched_tokens=max_num_batched_tokens,
            speculative_config=speculative_config,
        ),
        CacheConfig(block_size=BLOCK_SIZE),
        num_blocks,
        max_model_len,
        max_loras=1 if lora_of else 0,
    )
    for rid, prompt in prompts.items():
        request = EngineCoreRequest(
            rid,
            prompt,
            sampling_params=(params_of or {}).get(rid, params),
            lora_request=lora_request((lora_of or {}).get(rid, "")),
            output_token_ids=(resumed_outputs or {}).get(rid, []),
        )
        scheduler.add_request(Request.from_engine_core_request(request, BLOCK_SIZE, next(_arrival)))
    result = LoopResult()
    in_flight = None
    while scheduler.has_unfinished_requests() or scheduler.has_finished_requests() or in_flight:
        if in_flight is None:
            step = scheduler.schedule()
            in_flight = step, runner.execute_model(step)
        current, in_flight = in_flight, None
        if ahead and scheduler.has_unfinished_requests() and not scheduler.wants_latest_tokens():
            step = scheduler.schedule()
            in_flight = step, runner.execute_model(step)
            result.steps_ahead += 1
            result.steps_ahead_proposing += bool(step.scheduled_spec_decode_tokens)
        by_client = scheduler.update_from_output(*current)
        for outputs in by_client.values():
            for output in outputs:
                result.outputs.setdefault(output.request_id, []).append(output)
        result.steps += 1
        assert result.steps < 10_000
    stats = scheduler.make_stats()
    result.num_draft_tokens = stats.spec_decode_num_draft_tokens
    result.num_accepted_tokens = stats.spec_decode_num_accepted_tokens
    assert scheduler.kv.usage() == 0.0
    return result


def loop_on_rank(
    parallel: ParallelState, model_dir: str, speculative_config: str, params: SamplingParams
) -> dict[str, Any]:
    """``run_loop`` on one rank of a tensor/pipeline-parallel group (``parallel_ranks``): every
    rank schedules the same steps from the tokens its runner returns (the output rank's, shared
    with every rank)."""
    runner = spec_runner(model_dir, PARALLEL_NUM_BLOCKS, parallel=parallel)
    result = run_loop(
        runner, PARALLEL_PROMPTS, params, speculative_config, num_blocks=PARALLEL_NUM_BLOCKS
    )
    return {
        "tokens": {rid: result.tokens(rid) for rid in PARALLEL_PROMPTS},
        "accepted": result.num_accepted_tokens,
    }


PARALLEL_NUM_BLOCKS = 96
PARALLEL_PROMPTS = {
    "loop": [0, 5, 9, 33, 5, 9, 33, 5, 9, 33, 5, 9],
    "odd": [0, 900, 3, 3, 3, 77, 512, 8, 1000, 64, 2],
}
