"""The model runner: one model, its paged KV cache, per-request state, and the sampler.

``execute_model`` = apply the step's delta -> lay out the tokens -> forward -> logits of the
requests that reached the end of their tokens -> sample -> append the sampled tokens.

Under tensor/pipeline parallelism (``parallel``) every worker runs every step: a pipeline stage
other than the first receives its input hidden states from the stage before, one other than the
last sends its output on; only the last stage computes logits and samples, and its output rank
then broadcasts the sampled ids so that every rank appends the same tokens (synchronous, one
step at a time: no micro-batching).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from switchboard.config import ModelConfig
from switchboard.kernels import decode_stack, fused_ops, library
from switchboard.models.attention import REFERENCE, AttentionBackend, new_kv_cache
from switchboard.models.attention_backends import select_backend
from switchboard.models.hf_config import TransformerConfig
from switchboard.models.llama import LlamaForCausalLM
from switchboard.models.loader import CausalLM, as_causal_lm
from switchboard.models.parallel import SINGLE_PROCESS, ParallelState
from switchboard.models.quantized import NONE as NO_QUANTIZATION
from switchboard.wire.engine_msgs import TokenLogprobs
from switchboard.wire.step_msgs import ModelRunnerOutput, ModelSummary, SchedulerOutput
from switchboard.worker import cuda_graphs
from switchboard.worker.draft_model import DraftModel
from switchboard.worker.grammar_mask import apply_grammar_bitmask
from switchboard.worker.logprobs import prompt_token_logprobs
from switchboard.worker.lora_runner import LoraRequests
from switchboard.worker.model_loading import (
    dtype_name,
    load_runner_model,
    model_summary,
    require_config,
    resolve_kv_cache_dtype,
)
from switchboard.worker.pooler import PoolingRequests
from switchboard.worker.sampler import SamplerOutput, greedy_tokens, sample
from switchboard.worker.spec_verify import accepted_tokens, build_verify_batch, expand_rows
from switchboard.worker.step_inputs import (
    RequestState,
    RequestStates,
    StepInputs,
    build_step_inputs,
    sampled_rows,
)
from switchboard.worker.step_threads import StepThreads

logger = logging.getLogger(__name__)


@dataclass
class StepLogits:
    """The forward half of a step: logits of the requests to sample, in this order."""

    step_id: int
    inputs: StepInputs
    # [len(inputs.sampled_request_ids), vocab] float32; None on a pipeline stage but the last
    logits: torch.Tensor | None
    pooled: dict[str, list[float]] | None = None  # pooling requests whose prompt is done
    # Structured output: the step's packed token bitmask and its rows' request ids.
    grammar_bitmask: bytes = b""
    structured_request_ids: list[str] | None = None


class ModelRunner:
    def __init__(
        self,
        model_config: ModelConfig,
        device: torch.device,
        parallel: ParallelState = SINGLE_PROCESS,
        draft: DraftModel | None = None,
    ) -> None:
        self.model_config = model_config
        self.device = device
        self.parallel = parallel  # this worker's share of the model (TP rank, PP stage)
        self.model: CausalLM | None = None
        self.config: TransformerConfig | None = None
        self.dtype = torch.float32
        self.kv_cache_dtype = torch.float32  # the model's unless --kv-cache-dtype says otherwise
        self.quantization = NO_QUANTIZATION
        self.kv_caches: list[torch.Tensor] = []
        self.block_size = 0
        self.requests = RequestStates()
        self.pooling = PoolingRequests()  # embedding requests: pooled, never sampled
        self.attention_backend: AttentionBackend = REFERENCE  # chosen by load_model
        self.decode_graphs: cuda_graphs.DecodeGraphs | None = None  # CUDA only, see there
        self.lora: LoraRequests | None = None  # --enable-lora (worker/lora_runner.py)
        self.draft = draft  # speculative decoding's draft model (worker/draft_model.py)
        self.step_threads: StepThreads | None = None  # CPU: threads a step (step_threads.py)

    # -- set-up -----------------------------------------------------------------------------

    def load_model(self) -> ModelSummary:
        model, self.config, self.dtype, self.quantization = load_runner_model(
            self.model_config, self.device, self.parallel
        )
        self.kv_cache_dtype = resolve_kv_cache_dtype(
            self.model_config.kv_cache_dtype, self.dtype, self.device
        )
        self.model = as_causal_lm(model)
        if isinstance(model, LlamaForCausalLM):  # forward_step takes a decode's every logits row
            model.logits_with_decodes = True
        if self.draft is not None:
            self.draft.load(self.config)
        if self.model_config.lora.enable_lora:
            self.lora = LoraRequests.for_model(
                model, self.config, self.model_config.lora, self.parallel, self.lora
            )
        # on CPU this loads the C decode kernel (the backend when it loads)
        self.attention_backend = select_backend(
            self.device, rounded_rows=self.quantization.rounded_rows
        )
        if self.device.type == "cpu":
            fused_ops.load()
            logger.info("norms, rotary and SiLU: fused CPU kernels %s", fused_ops.status())
            decode_stack.load()
            logger.info("decode steps of few rows: one-call layer stack %s", decode_stack.status())
            logger.info("the kernels' loops: work pool %s", library.pool_status())
        return self.summary()

    def summary(self) -> ModelSummary:
        config = self._require_config()
        return model_summary(
            config, self.dtype, self.kv_cache_bytes_per_token(), self.device, self.quantization
        )

    def kv_cache_bytes_per_token(self) -> int:
        """On this worker: its stage's layers, its share of the KV heads."""
        config = self._require_config()
        num_layers, num_kv_heads = self._kv_cache_share(config)
        element_size = torch.empty((), dtype=self.kv_cache_dtype).element_size()
        draft = self.draft.kv_cache_bytes_per_token() if self.draft is not None else 0
        return 2 * num_layers * num_kv_heads * config.head_dim * element_size + draft

    def _kv_cache_share(self, config: TransformerConfig) -> tuple[int, int]:
        """(layers, KV heads) whose cache this worker holds."""
        num_layers = len(self.parallel.stage_layers(config.num_layers))
        return num_layers, self.parallel.kv_head_shard(config.num_kv_heads).size

    def initialize_kv_cache(self, num_blocks: int, block_size: int) -> None:
        config = self._require_config()
        started = time.monotonic()
        self.block_size = block_size
        num_layers, num_kv_heads = self._kv_cache_share(config)
        graphs = self._graphs_wanted(block_size)
        self.kv_caches = [
            new_kv_cache(
                num_blocks + (1 if graphs else 0),  # + the graphs' scratch block (never lent)
                block_size,
                num_kv_heads,
                config.head_dim,
                self.kv_cache_dtype,
                self.device,
            )
            for _ in range(num_layers)
        ]
        if self.draft is not None:
            self.draft.initialize_kv_cache(num_blocks, block_size)
        logger.info(
            "KV cache: %d blocks x %d tokens (%s, %.1f MiB) in %.2f s",
            num_blocks,
            block_size,
            dtype_name(self.kv_cache_dtype),
            num_blocks * block_size * self.kv_cache_bytes_per_token() / 2**20,
            time.monotonic() - started,
        )
        if graphs:
            self._capture_decode_graphs(num_blocks, block_size)

    def _graphs_wanted(self, block_size: int) -> bool:
        return cuda_graphs.enabled(
            self.device, self.attention_backend, self.parallel.world_size
        ) and self.attention_backend.decode_graphs_supported(block_size)

    def _capture_decode_graphs(self, num_blocks: int, block_size: int) -> None:
        """One CUDA graph per decode batch-size bucket (``worker/cuda_graphs.py``)."""
        config = self._require_config()
        model = self.model
        assert model is not None
        max_len = min(
            self.model_config.max_model_len or config.max_position_embeddings,
            num_blocks * block_size,
        )
        graphs = cuda_graphs.DecodeGraphs(
            lambda ids, positions, metadata: model(ids, positions, self.kv_caches, metadata),
            self.attention_backend,
            cuda_graphs.decode_buckets(cuda_graphs.max_batch_from_env()),
            width=-(-max_len // block_size),
            scratch_block=num_blocks,
            block_size=block_size,
            device=self.device,
        )
        with torch.inference_mode():
            seconds = graphs.capture(cuda_graphs.cuda_graph_recorder())
        self.decode_graphs = graphs
        logger.info(
            "CUDA graphs: decode captured for batch sizes %s in %.1f s", graphs.buckets, seconds
        )

    def free_kv_cache(self) -> None:
        self.decode_graphs = None
        self.kv_caches = []
        if self.draft is not None:
            self.draft.free_kv_cache()
        self.requests.clear()
        self.pooling.clear()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        logger.info("KV cache freed")

    # -- steps ------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, step: SchedulerOutput) -> ModelRunnerOutput:
        # one inference-mode context a step (each costs tens of microseconds after the kernels)
        if self.step_threads is None:
            return self._sample_step(self._forward_step(step))
        self.step_threads.begin(len(step.num_scheduled_tokens), step.total_num_scheduled_tokens)
        held = self.step_threads.holds_pool
        if held:
            library.hold_pool(True)
        try:
            output = self._sample_step(self._forward_step(step))
        finally:
            if held:
                library.hold_pool(False)
        self.step_threads.end()
        return output

    @torch.inference_mode()
    def forward_step(self, step: SchedulerOutput) -> StepLogits | ModelRunnerOutput:
        """Apply the delta and run the model; a step with no tokens returns its output."""
        if self.step_threads is not None:
            self.step_threads.use_all()
        return self._forward_step(step)

    @torch.inference_mode()
    def sample_step(self, step: StepLogits | ModelRunnerOutput) -> ModelRunnerOutput:
        """The sampled tokens of a step ``forward_step`` ran."""
        return self._sample_step(step)

    def _forward_step(self, step: SchedulerOutput) -> StepLogits | ModelRunnerOutput:
        if self.model is None or not self.kv_caches:
            raise RuntimeError("execute_model before load_model and initialize_kv_cache")
        self.requests.apply(step)
        self.pooling.apply(step)
        if self.lora is not None:
            self.lora.apply(step)
        if self.draft is not None:
            self.draft.forget(step.finished_request_ids)
        if not any(n > 0 for n in step.num_scheduled_tokens.values()):
            return ModelRunnerOutput(step_id=step.step_id)
        if self.draft is not None:  # its proposals first: they are the step's input tokens
            self.draft.propose(step, self.requests, self.attention_backend)
        inputs = build_step_inputs(step, self.requests, self.block_size, self.device)
        inputs = self.pooling.without_pooling(inputs)
        if self.lora is not None:
            self.lora.prepare(step, inputs, self.device)
        self.attention_backend.prepare(inputs.metadata)
        hidden = self._forward_stage(inputs)
        if self.lora is not None:
            self.lora.finish()  # no stale batch for what runs next (a graph capture, say)
        logits, pooled = None, None
        if self.parallel.is_last_stage:  # the others' hidden states are not final ones
            logits = self.model.compute_logits(sampled_rows(hidden, inputs.logits_rows))
            self._collect_prompt_logprobs(step, inputs, hidden)
            pooled = self.pooling.collect(step, inputs, hidden, self.requests)
        for request_id, n in step.num_scheduled_tokens.items():
            if n > 0:
                self.requests[request_id].num_computed_tokens += n
        return StepLogits(
            step.step_id,
            inputs,
            logits,
            pooled=pooled,
            grammar_bitmask=step.grammar_bitmask,
            structured_request_ids=step.structured_request_ids,
        )

    def _forward_stage(self, inputs: StepInputs) -> torch.Tensor:
        """This pipeline stage's layers: hidden states in from the previous stage (unless
        first), out to the next (unless last)."""
        assert self.model is not None
        if self.parallel.pp_size == 1:
            if self.decode_graphs is not None and inputs.metadata.lora is None:
                replayed = self.decode_graphs.run(
                    inputs.input_ids, inputs.positions, inputs.metadata
                )
                if replayed is not None:
                    return replayed
            return self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.metadata)
        received = None
        if not self.parallel.is_first_stage:
            shape = (inputs.input_ids.shape[0], self._require_config().hidden_size)
            received = self.parallel.recv_from_previous_stage(shape, self.dtype, self.device)
        hidden = self.model(
            inputs.input_ids, inputs.positions, self.kv_caches, inputs.metadata, received
        )
        if not self.parallel.is_last_stage:
            self.parallel.send_to_next_stage(hidden)
        return hidden

    def _sample_step(self, step: StepLogits | ModelRunnerOutput) -> ModelRunnerOutput:
        if isinstance(step, ModelRunnerOutput):
            return step
        inputs = step.inputs
        states = [self.requests[rid] for rid in inputs.sampled_request_ids]
        sampled: dict[str, list[int]] = {}
        logprobs: dict[str, list[TokenLogprobs]] = {}
        prompt_logprobs: dict[str, list[TokenLogprobs]] = {}
        if states:
            # one logits row per request, more for one with proposals (worker/spec_verify.py)
            rows, drafts_of = expand_rows(states, inputs.proposals)
            result = None
            if step.logits is not None:  # the last pipeline stage
                if step.grammar_bitmask and step.structured_request_ids:
                    apply_grammar_bitmask(
                        step.logits,
                        step.grammar_bitmask,
                        step.structured_request_ids,
                        [state.request_id for state in rows],
                    )
                if all(state.plain_greedy for state in states):  # no batch to build
                    result = SamplerOutput(greedy_tokens(step.logits), {})
                else:
                    vocab_size = step.logits.shape[-1]
                    batch = build_verify_batch(rows, drafts_of, vocab_size, self.device)
                    result = sample(step.logits, batch)
            token_ids = self._share_sampled_tokens(result, len(rows))
            first = 0
            for state, drafts in zip(states, drafts_of, strict=True):
                emitted = accepted_tokens(token_ids[first : first + 1 + len(drafts)], drafts)
                for token_id in emitted:
                    state.append_output_token(token_id)
                state.num_computed_tokens -= len(drafts) + 1 - len(emitted)  # rejected ones
                sampled[state.request_id] = emitted
                if result is not None and first in result.logprobs:
                    logprobs[state.request_id] = [
                        result.logprobs[first + i] for i in range(len(emitted))
                    ]
                if state.prompt_logprobs is not None:  # the prompt is done: send them once
                    prompt_logprobs[state.request_id] = state.prompt_logprobs
                    state.prompt_logprobs = None
                first += 1 + len(drafts)
        return ModelRunnerOutput(
            step_id=step.step_id,
            request_ids=list(inputs.request_ids),
            sampled_token_ids=[sampled.get(rid, []) for rid in inputs.request_ids],
            logprobs=[logprobs.get(rid, []) for rid in inputs.request_ids] if logprobs else [],
            prompt_logprobs=prompt_logprobs,
            pooled_outputs=step.pooled or {},
        )

    def _share_sampled_tokens(self, result: SamplerOutput | None, count: int) -> list[int]:
        """The sampled ids of the output rank, on every rank. The last stage's TP ranks sample
        the same gathered logits, but the output rank's draw is the one the engine sees, so
        every rank appends exactly that (and earlier stages learn the tokens at all)."""
        if self.parallel.world_size == 1:
            assert result is not None
            return result.token_ids.tolist()
        if result is not None:
            token_ids = result.token_ids.to(device=self.device, dtype=torch.long)
        else:
            token_ids = torch.empty(count, dtype=torch.long, device=self.device)
        return self.parallel.broadcast_from_output_rank(token_ids).tolist()

    def _collect_prompt_logprobs(
        self, step: SchedulerOutput, inputs: StepInputs, hidden: torch.Tensor
    ) -> None:
        """Logprobs of the prompt tokens this step computed, for the requests that want them
        (prompt token i+1 given positions 0..i; the first prompt token has none)."""
        rows: list[int] = []
        next_token_ids: list[int] = []
        num_top: list[int] = []
        owners: list[tuple[RequestState, int]] = []
        for request_id, first_row in zip(inputs.request_ids, inputs.first_rows, strict=True):
            state = self.requests[request_id]
            if state.prompt_logprobs is None:
                continue
            start = state.num_computed_tokens  # not advanced yet for this step
            end = min(start + step.num_scheduled_tokens[request_id], state.num_prompt_tokens - 1)
            if end <= start:
                continue
            rows += range(first_row, first_row + end - start)
            next_token_ids += state.token_ids[start + 1 : end + 1]
            num_top += [state.sampling_params.prompt_logprobs or 0] * (end - start)
            owners.append((state, end - start))
        if not rows:
            return
        assert self.model is not None
        results = prompt_token_logprobs(
            hidden[torch.tensor(rows, dtype=torch.long, device=self.device)],
            torch.tensor(next_token_ids, dtype=torch.long, device=self.device),
            num_top,
            self.model.compute_logits,
        )
        offset = 0
        for state, count in owners:
            assert state.prompt_logprobs is not None
            state.prompt_logprobs += results[offset : offset + count]
            offset += count

    def _require_config(self) -> TransformerConfig:
        return require_config(self.config)
