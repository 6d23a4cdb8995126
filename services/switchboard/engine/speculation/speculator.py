"""Which decoding requests propose tokens in a step, and what their proposals earned.

A request proposes when nothing its sampler does depends on the outputs before each proposed
position in a way one forward pass cannot reproduce. Speculation is therefore off, automatically,
for a request with

* structured output (its grammar would have to advance through every proposal to mask the next
  position; the engine's matcher cannot roll back),
* presence, frequency or repetition penalties, or bad words (they read the output so far),
* fewer outputs than ``min_tokens`` (EOS and the stop tokens are masked until then),

and for a pooling request (nothing to decode). Everything else (temperature, top-k/p, min-p,
seeds, logit bias, allowed tokens, logprobs, stop tokens and strings, ``n`` > 1) keeps its exact
meaning: the workers sample every proposed position as they would sample it alone and accept
proposals while they equal those samples.

Proposals adapt (:class:`SpeculationState`), since every proposed token costs a row of the step
whether it is accepted or not. A request starts at ``FIRST_LEN`` tokens (at most
``num_speculative_tokens``); after a step that accepted all its proposals the next proposal is
twice as long (text that copies, copies long runs: a run the proposer found goes on), up to
``num_speculative_tokens``; after one that rejected some, one token more than it accepted; and
never more than raise the step's tokens per second at what a row costs on this machine, measured
as it serves (``step_cost.py``: none at all where a row costs more than the request's
proposals are likely to earn, which a large batch on a CPU makes the rule). On a
2-core CPU a proposed row costs about a sixth of a one-row step (the matmul kernels are compute
bound there); replaying the default model's greedy answers to the benchmark's copying tasks at
that cost, this rule needs 9 % less step time than following a running mean of the accepted
counts (``num_speculative_tokens`` 4), 13 % less with 8. After ``MAX_MISSES`` steps in a row
whose proposals were all rejected, or ``MAX_DRY_LOOKUPS`` lookups in a row that found nothing to
propose (those cost no forward work, and the engine schedules ahead of them), a request
stops proposing for a pause of ``FIRST_PAUSE`` output tokens, doubled each time up to
``MAX_PAUSE``; an accepted token resets both. A request on text the proposer cannot predict
then decodes as without speculation almost all the time.

Proposals and the engine's scheduling ahead: a step that verifies a request's proposals returns
an unknown number of its tokens, so the step after it waits for them (it is not scheduled
ahead). A step that does not (the request proposed nothing, a dry lookup or a pause) is followed
by one scheduled ahead, in which the n-gram proposer looks up from the tokens the engine has
and proposes what follows its guess of the token in flight (``Speculator.proposes_ahead``): the
lookups of a request whose text never repeats cost the engine none of its overlap with the
workers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from switchboard.config.speculative import (
    DEFAULT_DISABLE_BY_BATCH_SIZE,
    DRAFT_MODEL,
    SpeculativeConfig,
    parse_speculative_config,
)
from switchboard.engine.request import Request
from switchboard.engine.speculation.ngram import TokenIndex, propose_ngram
from switchboard.engine.speculation.step_cost import (
    AcceptanceRate,
    Evidence,
    StepCost,
    worth_proposing,
)
from switchboard.wire.engine_msgs import SamplingParams, SchedulerStats
from switchboard.wire.step_msgs import DRAFT_PLACEHOLDER, SchedulerOutput

FIRST_LEN = 4
MAX_MISSES = 3
# a dry lookup costs a dictionary lookup (it is made ahead of the request's latest token, so
# the engine keeps scheduling steps ahead), and with prompt_lookup_min above 1 matches come
# after longer dry runs: replaying the default model's greedy answers to copying tasks with
# 3-grams, 4 in a row gave 12 % fewer tokens a step
MAX_DRY_LOOKUPS = 16
FIRST_PAUSE = 8
MAX_PAUSE = 128


def make_speculator(speculative_config: str) -> Speculator | None:
    """The engine's speculator for ``--speculative-config`` (None: off). ValueError if the
    JSON does not say something the engine can do."""
    config = parse_speculative_config(speculative_config)
    return Speculator(config) if config is not None else None


def speculation_allowed(request: Request) -> bool:
    """Whether speculation can keep this request's output exact at all (see the module)."""
    if request.pooling_params is not None or request.grammar is not None:
        return False
    params: SamplingParams = request.sampling_params
    return (
        params.presence_penalty == 0.0
        and params.frequency_penalty == 0.0
        and params.repetition_penalty == 1.0
        and not params.bad_words_token_ids
    )


@dataclass
class SpeculationState:
    """One request's proposer index and its record."""

    allowed: bool
    max_len: int  # num_speculative_tokens
    index: TokenIndex = field(default_factory=TokenIndex)
    misses: int = 0  # steps in a row whose proposals were all rejected
    dry_lookups: int = 0  # lookups in a row that found nothing to propose
    pause: int = FIRST_PAUSE  # the next pause, in output tokens
    paused_until: int = 0  # no proposals before this many output tokens
    in_flight: int = 0  # tokens proposed in a step not applied yet
    length: int = 0  # tokens to propose next (0: FIRST_LEN)
    num_draft_tokens: int = 0  # over the request's life, for its usage
    num_accepted_tokens: int = 0
    evidence: Evidence = field(default_factory=Evidence)  # its verdicts, for step_cost.py

    def proposal_len(self) -> int:
        """Tokens worth proposing next (see the module)."""
        return min(self.length or FIRST_LEN, self.max_len)

    def record(self, num_proposed: int, num_accepted: int, num_output_tokens: int) -> None:
        if num_proposed:
            grown = 2 * num_proposed if num_accepted == num_proposed else num_accepted + 1
            self.length = min(grown, self.max_len)
            self.evidence.record(num_proposed, num_accepted, num_output_tokens)
        if num_accepted > 0:
            self.misses = self.dry_lookups = 0
            self.pause = FIRST_PAUSE
            return
        if num_proposed:
            self.misses += 1
        else:
            self.dry_lookups += 1
        if self.misses >= MAX_MISSES or self.dry_lookups >= MAX_DRY_LOOKUPS:
            self.misses = self.dry_lookups = 0
            self.paused_until = num_output_tokens + self.pause
            self.pause = min(2 * self.pause, MAX_PAUSE)


@dataclass
class SpeculationCounters:
    """Cumulative since start-up (vLLM's spec_decode counters)."""

    num_drafts: int = 0  # steps of a request with at least one proposed token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)


class Speculator:
    def __init__(self, config: SpeculativeConfig) -> None:
        assert config.prompt_lookup_min is not None and config.prompt_lookup_max is not None
        self.config = config
        self.num_speculative_tokens = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max
        self.max_batch = config.disable_by_batch_size or DEFAULT_DISABLE_BY_BATCH_SIZE
        # A draft model proposes in the workers: the engine only reserves its positions.
        self.worker_proposes = config.method == DRAFT_MODEL
        self.counters = SpeculationCounters(
            accepted_per_position=[0] * config.num_speculative_tokens
        )
        self.cost = StepCost()
        self.acceptance = AcceptanceRate()

    def state(self, request: Request) -> SpeculationState:
        state = request.speculation
        if state is None:
            state = request.speculation = SpeculationState(
                speculation_allowed(request), self.num_speculative_tokens
            )
        assert isinstance(state, SpeculationState)
        return state

    def active(self, num_running: int) -> bool:
        """Whether requests propose in a step of this many running requests."""
        return num_running <= self.max_batch

    def will_propose(self, request: Request, decoding: int = 1) -> bool:
        """Whether the request looks up proposals at its next decode step, in a step of
        ``decoding`` decoding requests (the engine then waits for its latest token instead of
        scheduling a step ahead)."""
        return self.tokens_to_propose(request, decoding) > 0

    def tokens_to_propose(self, request: Request, decoding: int) -> int:
        """The tokens the request would propose at its next decode step, in a step of
        ``decoding`` decoding requests: 0 where it may not or should not; else its adaptive
        length cut to those that raise a step's tokens per second (``step_cost.py``)."""
        state = self.state(request)
        if not (
            state.allowed
            and request.num_output_tokens >= max(state.paused_until, 1)
            and request.num_output_tokens >= request.sampling_params.min_tokens
        ):
            return 0
        p = state.evidence.rate(request.num_output_tokens, self.acceptance.prior())
        return worth_proposing(p, decoding, self.cost.row_share(), state.proposal_len())

    @property
    def proposes_ahead(self) -> bool:
        """Whether a request proposes in a step scheduled ahead of its latest tokens (those a
        step in flight samples): the n-gram proposer looks the proposals up from the tokens
        the engine has, one per pending token longer, and proposes what follows the pending
        ones. A draft model proposes in the workers, from every token they sampled, but the
        engine still waits for the latest one before it reserves the draft's positions."""
        return not self.worker_proposes

    def propose(
        self, request: Request, max_tokens: int, decoding: int = 1, pending: int = 0
    ) -> list[int]:
        """At most ``max_tokens`` proposals (fewer near the request's length limits, which the
        caller folds into ``max_tokens``) for a decoding request, in a step of ``decoding``
        decoding requests, after its ``pending`` tokens in flight (only where
        ``proposes_ahead``). Such proposals follow the lookup's guess of the pending tokens: where
        the workers sampled others, the model rejects them, as any proposal it does not
        sample."""
        num_tokens = min(max_tokens, self.num_speculative_tokens)
        if num_tokens > 0:
            num_tokens = min(num_tokens, self.tokens_to_propose(request, decoding))
        if num_tokens <= 0:
            return []
        state = self.state(request)
        if self.worker_proposes:
            assert not pending, "a draft model proposes from the request's latest token"
            drafts = [DRAFT_PLACEHOLDER] * num_tokens
        else:
            drafts = propose_ngram(
                request.all_token_ids, state.index, pending + num_tokens, self.min_n, self.max_n
            )[pending:]
        if not drafts:
            state.record(0, 0, request.num_output_tokens)
        state.in_flight = len(drafts)
        return drafts

    def accept(self, request: Request, num_proposed: int, num_accepted: int) -> None:
        """The step's verdict on the request's ``num_proposed`` proposals."""
        state = self.state(request)
        state.in_flight = 0
        state.num_draft_tokens += num_proposed
        state.num_accepted_tokens += num_accepted
        state.record(num_proposed, num_accepted, request.num_output_tokens)
        if num_proposed:
            self.acceptance.record(num_proposed, num_accepted)
        counters = self.counters
        counters.num_drafts += 1
        counters.num_draft_tokens += num_proposed
        counters.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            counters.accepted_per_position[position] += 1

    def observe_step(self, step: SchedulerOutput, seconds: float) -> None:
        """A step's period in the busy loop was ``seconds`` (from the previous step's outputs
        applied to its own, or from its scheduling after an idle wait): a sample of the step
        cost if it was decodes only (with proposals)."""
        rows = step.total_num_scheduled_tokens
        if step.new_requests or not rows:
            return
        # every request schedules at least its token and its proposals, so the step is decodes
        # only exactly when its rows are that many (a look at the proposals, not every request)
        decode_rows = len(step.num_scheduled_tokens) + sum(
            map(len, step.scheduled_spec_decode_tokens.values())
        )
        if rows == decode_rows:  # else a prompt chunk, whose rows cost otherwise
            self.cost.observe(rows, seconds)

    @staticmethod
    def drop_in_flight(request: Request) -> None:
        """The step that verifies the request's proposals will not count (preempted, ended)."""
        if request.speculation is not None:
            request.speculation.in_flight = 0

    def fill_stats(self, stats: SchedulerStats) -> None:
        counters = self.counters
        stats.spec_decode_num_drafts = counters.num_drafts
        stats.spec_decode_num_draft_tokens = counters.num_draft_tokens
        stats.spec_decode_num_accepted_tokens = counters.num_accepted_tokens
        stats.spec_decode_accepted_per_position = list(counters.accepted_per_position)
        stats.spec_decode_row_cost = self.cost.row_share()
