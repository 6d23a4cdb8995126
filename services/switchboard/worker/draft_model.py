"""The draft model of speculative decoding: a smaller checkpoint with the served model's
tokenizer, in the same worker, proposing the tokens the served model verifies in the same step.

Its KV cache shadows the served model's: the same block ids (the engine's block table means the
same positions in both caches), blocks of the draft's own size, and the draft computes a request's
positions from the same tokens as the served model, but only when the request proposes: a step
without proposals (a prompt's prefill, a request whose proposals paused, a batch above
``disable_by_batch_size``) does not run the draft at all. :class:`DraftModel` keeps, per request,
how many positions from the first its cache holds; before a request proposes, the draft catches
up on the positions it missed (one forward pass over those tokens for every such request of the
step). A request the worker creates again (new, or resumed after a preemption: its blocks may have
changed) starts from position 0, so prefix-cache hits are computed again by the draft rather than
trusted; what a shared block then holds is the same tokens' KV either way.

A request with ``k`` ``DRAFT_PLACEHOLDER`` proposals (``SchedulerOutput.
scheduled_spec_decode_tokens``) has ``N`` tokens, ``N - 1`` of them in the served model's cache.
:meth:`DraftModel.propose` catches the draft up to ``N - 1`` positions, then runs it ``k`` times,
one row per such request each time: its last token at position ``N - 1``, then each proposal at
the next position, every time taking the draft's argmax as the next proposal. One more run writes
the KV of the last proposal at ``N + k - 1``. Of those, the positions up to the request's computed
tokens after the step (``N + a`` with ``a`` accepted) hold the tokens the served model accepted;
the rejected ones are computed again at the next catch-up, as the served model overwrites its
own. A greedy draft is a deterministic proposer, so verification keeps the served model's output
exact (``worker/spec_verify.py``), greedy and seeded alike; the draft's cache only decides what it
proposes.
"""

from __future__ import annotations

import logging

import msgspec
import torch

from switchboard.config import EngineConfig, ModelConfig
from switchboard.config.lora import LoraConfig
from switchboard.config.speculative import DRAFT_MODEL, parse_speculative_config
from switchboard.models.attention import AttentionBackend, AttentionMetadata, new_kv_cache
from switchboard.models.hf_config import TransformerConfig
from switchboard.models.loader import CausalLM, as_causal_lm
from switchboard.wire.step_msgs import DRAFT_PLACEHOLDER, SchedulerOutput
from switchboard.worker.model_loading import load_runner_model, resolve_kv_cache_dtype
from switchboard.worker.step_inputs import (
    RequestState,
    RequestStates,
    build_step_inputs,
    decode_batch,
    upload,
)

logger = logging.getLogger(__name__)


def make_draft_model(config: EngineConfig, device: torch.device) -> DraftModel | None:
    """The worker's draft model when ``--speculative-config`` names one (not loaded yet)."""
    speculative = parse_speculative_config(config.scheduler.speculative_config)
    if speculative is None or speculative.method != DRAFT_MODEL or not speculative.model:
        return None
    if config.parallel.world_size > 1:
        raise ValueError(
            "--speculative-config: a draft model runs in one worker; use -tp 1 -pp 1 "
            "(or the ngram method)"
        )
    return DraftModel(speculative.model, config.model, device)


class DraftModel:
    def __init__(self, model_dir: str, model_config: ModelConfig, device: torch.device) -> None:
        """``model_config``: the served model's; the draft runs with its dtype settings."""
        self.model_config = msgspec.structs.replace(
            model_config, model=model_dir, quantization="auto", lora=LoraConfig()
        )
        self.device = device
        self.model: CausalLM | None = None
        self.config: TransformerConfig | None = None
        self.kv_cache_dtype = torch.float32
        self.kv_caches: list[torch.Tensor] = []
        self.block_size = 0
        # request id -> (its state, positions from the first the draft's cache holds for it);
        # a state the worker made again (resumed) holds none
        self._computed: dict[str, tuple[RequestState, int]] = {}

    def load(self, served: TransformerConfig) -> None:
        """Load the draft (once: it stays across a sleep of the served model) and check that it
        can propose for the ``served`` model: its tokens, its positions (ValueError)."""
        if self.model is not None:
            return
        where = f"--speculative-config: the draft model {self.model_config.model!r}"
        try:
            model, config, dtype, _ = load_runner_model(
                self.model_config, self.device, log_prefix="draft model: "
            )
            causal_lm = as_causal_lm(model)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{where}: {exc}") from exc
        if config.vocab_size != served.vocab_size:
            raise ValueError(
                f"{where} has {config.vocab_size} tokens, the model {served.vocab_size}: "
                "a draft must share the model's tokenizer"
            )
        positions = self.model_config.max_model_len or served.max_position_embeddings
        if config.max_position_embeddings < positions:
            raise ValueError(
                f"{where} has {config.max_position_embeddings} positions, fewer than the "
                f"{positions} a request may reach: set --max-model-len "
                f"{config.max_position_embeddings} or less"
            )
        self.kv_cache_dtype = resolve_kv_cache_dtype(
            self.model_config.kv_cache_dtype, dtype, self.device
        )
        self.model, self.config = causal_lm, config
        logger.info("draft model: %s (%d layers)", config.architecture, config.num_layers)

    def kv_cache_bytes_per_token(self) -> int:
        config = self._config()
        element_size = torch.empty((), dtype=self.kv_cache_dtype).element_size()
        return 2 * config.num_layers * config.num_kv_heads * config.head_dim * element_size

    def initialize_kv_cache(self, num_blocks: int, block_size: int) -> None:
        config = self._config()
        self.block_size = block_size
        self.kv_caches = [
            new_kv_cache(
                num_blocks,
                block_size,
                config.num_kv_heads,
                config.head_dim,
                self.kv_cache_dtype,
                self.device,
            )
            for _ in range(config.num_layers)
        ]

    def free_kv_cache(self) -> None:
        self.kv_caches = []
        self._computed.clear()

    @torch.inference_mode()
    def propose(
        self, step: SchedulerOutput, states: RequestStates, backend: AttentionBackend
    ) -> None:
        """Fill in the step's placeholder proposals with the draft's greedy tokens. For a
        request with ``k`` of them the draft catches up on the positions it has not computed,
        then runs ``k + 1`` times: the last run writes the KV of its last proposal."""
        proposals = step.scheduled_spec_decode_tokens
        wanted = {
            rid: len(drafts)
            for rid, drafts in proposals.items()
            if drafts and drafts[0] == DRAFT_PLACEHOLDER
        }
        if not wanted:
            return
        assert self.model is not None
        for rid in wanted:
            state = states[rid]
            if state.num_computed_tokens != len(state.token_ids) - 1:
                raise ValueError(
                    f"step {step.step_id}: {rid!r} asks for draft proposals with "
                    f"{len(state.token_ids) - state.num_computed_tokens} tokens to compute"
                )
        self._catch_up(step.step_id, [states[rid] for rid in wanted], backend)
        drafted: dict[str, list[int]] = {rid: [] for rid in wanted}
        for j in range(max(wanted.values()) + 1):
            rows = [states[rid] for rid, k in wanted.items() if k >= j]
            hidden = self._decode_rows(
                rows,
                [drafted[state.request_id][-1] if j else state.token_ids[-1] for state in rows],
                [state.num_computed_tokens + j for state in rows],
                backend,
            )
            # the rows that still propose (the others only wrote their last proposal's KV)
            proposing = [i for i, state in enumerate(rows) if wanted[state.request_id] > j]
            if not proposing:
                continue
            if len(proposing) < len(rows):
                hidden = hidden[torch.tensor(proposing, dtype=torch.long, device=hidden.device)]
                rows = [rows[i] for i in proposing]
            logits = self.model.compute_logits(hidden)
            _keep_allowed_tokens(logits, rows)
            for state, token_id in zip(rows, logits.argmax(dim=-1).tolist(), strict=True):
                drafted[state.request_id].append(token_id)
        proposals.update(drafted)
        for rid, k in wanted.items():
            state = states[rid]
            # positions up to N + k - 1; those past the step's accepted tokens are caught up again
            self._computed[rid] = (state, state.num_computed_tokens + k + 1)

    def forget(self, request_ids: list[str]) -> None:
        """Requests the worker dropped (finished, aborted or preempted)."""
        for rid in request_ids:
            self._computed.pop(rid, None)

    def _catch_up(
        self, step_id: int, states: list[RequestState], backend: AttentionBackend
    ) -> None:
        """Compute the draft's KV of every position before each request's last token that its
        cache does not hold (see the module), in one forward pass."""
        lagging: dict[str, int] = {}
        starts: dict[str, int] = {}
        for state in states:
            known, computed = self._computed.get(state.request_id, (None, 0))
            start = min(computed, state.num_computed_tokens) if known is state else 0
            if start < state.num_computed_tokens:
                lagging[state.request_id] = state.num_computed_tokens - start
                starts[state.request_id] = start
        if not lagging:
            return
        assert self.model is not None
        shadows = RequestStates(
            {
                state.request_id: RequestState(
                    state.request_id,
                    state.token_ids,
                    state.block_ids,
                    starts[state.request_id],
                    state.sampling_params,
                    num_prompt_tokens=state.num_prompt_tokens,
                )
                for state in states
                if state.request_id in lagging
            }
        )
        step = SchedulerOutput(step_id=step_id, num_scheduled_tokens=lagging)
        inputs = build_step_inputs(step, shadows, self.block_size, self.device)
        backend.prepare(inputs.metadata)
        self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.metadata)

    def _decode_rows(
        self,
        rows: list[RequestState],
        input_ids: list[int],
        positions: list[int],
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """The draft's final hidden states of one token per row, at ``positions``."""
        assert self.model is not None
        block_size = self.block_size
        slots = [
            state.block_ids[p // block_size] * block_size + p % block_size
            for state, p in zip(rows, positions, strict=True)
        ]
        metadata = AttentionMetadata(
            slot_mapping=upload(torch.tensor(slots, dtype=torch.long), self.device),
            decode=decode_batch(rows, block_size, self.device, positions),
            prefills=[],
        )
        backend.prepare(metadata)
        return self.model(
            upload(torch.tensor(input_ids, dtype=torch.long), self.device),
            upload(torch.tensor(positions, dtype=torch.long), self.device),
            self.kv_caches,
            metadata,
        )

    def _config(self) -> TransformerConfig:
        if self.config is None:
            raise RuntimeError("the draft model is not loaded yet")
        return self.config


def _keep_allowed_tokens(logits: torch.Tensor, rows: list[RequestState]) -> None:
    """Propose only what a request may sample: its ``allowed_token_ids`` (a proposal outside
    them is always rejected)."""
    for row, state in enumerate(rows):
        allowed = state.sampling_params.allowed_token_ids
        if allowed:
            keep = torch.tensor(allowed, dtype=torch.long, device=logits.device)
            kept = logits[row, keep]
            logits[row] = float("-inf")
            logits[row, keep] = kept
