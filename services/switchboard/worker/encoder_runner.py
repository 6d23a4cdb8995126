"""The encoder runner: a BERT-family model serving pooling (embedding) requests.

An encoder attends bidirectionally, so a token's hidden state depends on the tokens after it:
a prompt can only be computed whole, and nothing is worth caching between steps. This runner
therefore keeps **no KV cache**. The engine's scheduler still counts blocks (they cost nothing
here, see :meth:`EncoderRunner.num_bookkeeping_blocks`) and may split a long prompt into
chunks; the runner just notes each chunk and computes the whole prompt in the step whose chunk
reaches its end::

    step delta -> requests whose prompt is now complete -> one forward over their prompts
               -> pool each -> ModelRunnerOutput.pooled_outputs[request_id]

It answers the same RPCs as :class:`~switchboard.worker.model_runner.ModelRunner`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from switchboard.config import ModelConfig
from switchboard.models.hf_config import TransformerConfig
from switchboard.models.quantized import NONE as NO_QUANTIZATION
from switchboard.wire.engine_msgs import PoolingParams
from switchboard.wire.step_msgs import ModelRunnerOutput, ModelSummary, SchedulerOutput
from switchboard.worker.model_loading import load_runner_model, model_summary, require_config
from switchboard.worker.pooler import pool_sequence

logger = logging.getLogger(__name__)


@dataclass
class EncoderRequest:
    token_ids: list[int]
    pooling_params: PoolingParams
    num_computed_tokens: int  # as the scheduler counts them (chunks noted, not computed)


class EncoderRunner:
    def __init__(self, model_config: ModelConfig, device: torch.device) -> None:
        self.model_config = model_config
        self.device = device
        self.model: torch.nn.Module | None = None
        self.config: TransformerConfig | None = None
        self.dtype = torch.float32
        self.quantization = NO_QUANTIZATION
        self.kv_caches: list[torch.Tensor] = []  # always empty: an encoder caches nothing
        self.requests: dict[str, EncoderRequest] = {}

    # -- set-up -----------------------------------------------------------------------------

    def load_model(self) -> ModelSummary:
        self.model, self.config, self.dtype, self.quantization = load_runner_model(
            self.model_config, self.device, log_prefix="encoder, "
        )
        return self.summary()

    def summary(self) -> ModelSummary:
        return model_summary(
            self._require_config(),
            self.dtype,
            kv_cache_bytes_per_token=0,
            device=self.device,
            quantization=self.quantization,
        )

    def kv_cache_bytes_per_token(self) -> int:
        return 0

    def num_bookkeeping_blocks(self, block_size: int, max_num_seqs: int) -> int:
        """Blocks for the scheduler to count with: ``max_num_seqs`` full-length prompts.

        They occupy no memory, so the only limit that matters is the number of sequences."""
        config = self._require_config()
        return max_num_seqs * -(-config.max_position_embeddings // block_size)

    def initialize_kv_cache(self, num_blocks: int, block_size: int) -> None:
        logger.info(
            "encoder: no KV cache (%d blocks of %d tokens are bookkeeping only)",
            num_blocks,
            block_size,
        )

    def free_kv_cache(self) -> None:
        self.requests.clear()

    # -- steps ------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, step: SchedulerOutput) -> ModelRunnerOutput:
        if self.model is None:
            raise RuntimeError("execute_model before load_model")
        self._apply(step)
        scheduled = [rid for rid, n in step.num_scheduled_tokens.items() if n > 0]
        complete = []
        for request_id in scheduled:
            request = self.requests[request_id]
            request.num_computed_tokens += step.num_scheduled_tokens[request_id]
            if request.num_computed_tokens >= len(request.token_ids):
                complete.append(request_id)
        return ModelRunnerOutput(
            step_id=step.step_id,
            request_ids=scheduled,
            sampled_token_ids=[[] for _ in scheduled],
            pooled_outputs=self._encode(complete) if complete else {},
        )

    def _apply(self, step: SchedulerOutput) -> None:
        for request_id in step.finished_request_ids:
            self.requests.pop(request_id, None)
        for new in step.new_requests:
            if new.pooling_params is None:
                raise ValueError(
                    f"request {new.request_id!r} asks to generate, but an encoder only embeds"
                )
            self.requests[new.request_id] = EncoderRequest(
                list(new.prompt_token_ids), new.pooling_params, new.num_computed_tokens
            )
        for cached in step.cached_requests:
            request = self.requests.get(cached.request_id)
            if request is None:
                raise KeyError(f"step {step.step_id}: unknown request {cached.request_id!r}")
            request.num_computed_tokens = cached.num_computed_tokens

    def _encode(self, request_ids: list[str]) -> dict[str, list[float]]:
        """One forward pass over the whole prompts of these requests, then pool each."""
        assert self.model is not None
        prompts = [self.requests[rid].token_ids for rid in request_ids]
        seq_lens = [len(p) for p in prompts]
        input_ids = torch.tensor([t for p in prompts for t in p], dtype=torch.long)
        positions = torch.cat([torch.arange(n, dtype=torch.long) for n in seq_lens])
        input_ids, positions = input_ids.to(self.device), positions.to(self.device)
        # One segment per input: every token type is 0, as a tokenizer gives a single text.
        hidden = self.model(input_ids, positions, torch.zeros_like(input_ids), seq_lens)
        pooled: dict[str, list[float]] = {}
        start = 0
        for request_id, length in zip(request_ids, seq_lens, strict=True):
            params = self.requests[request_id].pooling_params
            pooled[request_id] = pool_sequence(hidden[start : start + length], params)
            start += length
        return pooled

    def _require_config(self) -> TransformerConfig:
        return require_config(self.config)
