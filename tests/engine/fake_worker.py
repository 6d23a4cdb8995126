"""A model-free worker for scheduler tests: it consumes SchedulerOutput deltas exactly as a real
worker must, checks them, keeps a fake KV cache, and "samples" a deterministic token.

The fake KV cache stores, in each slot, a key for the whole prefix up to that position (the
real KV of a position depends on every token before it). Before a request's new tokens are
computed, every earlier position is read back through the request's block table and compared:
a prefix hit on a wrong block, a block reused while still needed, a lost delta or a resume
that skips tokens all show up as a mismatch.
"""

from __future__ import annotations

from collections.abc import Callable

from switchboard.engine.scheduler import Scheduler
from switchboard.wire.engine_msgs import EngineCoreOutput
from switchboard.wire.step_msgs import ModelRunnerOutput, SchedulerOutput

TokenFn = Callable[[str, list[int]], int]


def default_token(request_id: str, token_ids: list[int]) -> int:
    """Depends only on the token sequence, like greedy decoding of a fixed model."""
    a = token_ids[-1]
    b = token_ids[-2] if len(token_ids) > 1 else 0
    return (a * 31 + b * 17 + len(token_ids) * 7) % 997 + 3


class _State:
    def __init__(self, token_ids: list[int], block_ids: list[int], num_computed: int) -> None:
        self.token_ids = list(token_ids)
        self.block_ids = list(block_ids)
        self.num_computed = num_computed
        self.keys: list[int] = []

    def key(self, position: int) -> int:
        while len(self.keys) <= position:
            parent = self.keys[-1] if self.keys else 0
            self.keys.append(hash((parent, self.token_ids[len(self.keys)])))
        return self.keys[position]


class FakeWorker:
    def __init__(self, block_size: int, num_blocks: int, token_fn: TokenFn = default_token):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.token_fn = token_fn
        self.states: dict[str, _State] = {}
        self.slots: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        scheduled = out.num_scheduled_tokens
        assert not set(out.finished_request_ids) & set(scheduled), "finished and scheduled"
        assert out.total_num_scheduled_tokens == sum(scheduled.values())
        for rid in out.finished_request_ids:
            self.states.pop(rid, None)
        for new in out.new_requests:
            assert new.request_id not in self.states, f"{new.request_id} is not new"
            assert len(new.prompt_token_ids) > new.num_computed_tokens
            self.states[new.request_id] = _State(
                new.prompt_token_ids, new.block_ids, new.num_computed_tokens
            )
        for cached in out.cached_requests:
            state = self.states[cached.request_id]
            assert state.num_computed == cached.num_computed_tokens, cached.request_id
            state.block_ids.extend(cached.new_block_ids)
        delta_ids = [r.request_id for r in out.new_requests] + [
            r.request_id for r in out.cached_requests
        ]
        assert sorted(delta_ids) == sorted(scheduled), "delta does not match the batch"
        request_ids, sampled = [], []
        proposals = out.scheduled_spec_decode_tokens
        for rid, num_tokens in scheduled.items():
            request_ids.append(rid)
            drafts = proposals.get(rid, [])
            sampled.append(
                self._verify(rid, num_tokens, drafts) if drafts else self._run(rid, num_tokens)
            )
        return ModelRunnerOutput(out.step_id, request_ids, sampled)

    def _verify(self, rid: str, num_tokens: int, drafts: list[int]) -> list[int]:
        """A step with proposals: the request's last token and the proposals computed (their
        slots get the proposals' keys), then the proposals accepted while they equal what
        ``token_fn`` samples after them, and the sample after the last accepted one."""
        state = self.states[rid]
        start = state.num_computed
        assert start == len(state.token_ids) - 1, f"{rid}: proposals while prefilling"
        assert num_tokens == 1 + len(drafts), (rid, num_tokens, drafts)
        assert len(state.block_ids) * self.block_size >= start + num_tokens, f"{rid}: no slot"
        self._run(rid, 1)  # its last token; also checks the prefix's KV
        bs = self.block_size
        key = state.key(start)
        tokens = list(state.token_ids[:-1])  # before the token _run sampled
        emitted = [state.token_ids.pop()]
        tokens.append(emitted[0])
        rejected = False
        for i, draft in enumerate(drafts):
            key = hash((key, draft))
            p = start + 1 + i
            self.slots[state.block_ids[p // bs]][p % bs] = key
            rejected = rejected or emitted[-1] != draft
            if not rejected:  # (a rejected one's slot now holds a wrong key)
                emitted.append(self.token_fn(rid, [*state.token_ids, *emitted]))
        for token in emitted:
            state.token_ids.append(token)
        state.num_computed = len(state.token_ids) - 1
        return emitted

    def _run(self, rid: str, num_tokens: int) -> list[int]:
        state = self.states[rid]
        start, end = state.num_computed, state.num_computed + num_tokens
        assert num_tokens > 0 and end <= len(state.token_ids), (rid, start, end)
        assert len(state.block_ids) * self.block_size >= end, f"{rid}: no slot for a token"
        assert len(set(state.block_ids)) == len(state.block_ids), f"{rid}: block twice"
        bs = self.block_size
        for p in range(start):  # attention reads the whole prefix
            slot = self.slots[state.block_ids[p // bs]][p % bs]
            assert slot == state.key(p), f"{rid}: wrong KV at position {p}"
        for p in range(start, end):
            self.slots[state.block_ids[p // bs]][p % bs] = state.key(p)
        state.num_computed = end
        if end < len(state.token_ids):
            return []
        token = self.token_fn(rid, state.token_ids)
        state.token_ids.append(token)
        return [token]


class Driver:
    """Runs schedule -> execute -> update like the engine's busy loop, recording everything.

    ``ahead=True`` is the engine's async scheduling: each step applies the output of the step
    scheduled in the turn before, after scheduling (and "running") the next one. The fake
    worker runs a step when it is scheduled, which is the order the real one runs them in.
    As the engine, it does not schedule ahead of a step that verifies a request's proposals
    (speculative decoding; ``Scheduler.wants_latest_tokens``) unless ``always_ahead``."""

    def __init__(
        self,
        scheduler: Scheduler,
        worker: FakeWorker,
        ahead: bool = False,
        always_ahead: bool = False,
    ) -> None:
        self.scheduler = scheduler
        self.worker = worker
        self.ahead = ahead
        self.always_ahead = always_ahead
        self.in_flight: tuple[SchedulerOutput, ModelRunnerOutput] | None = None
        self.sched_outputs: list[SchedulerOutput] = []
        self.outputs: dict[str, list[EngineCoreOutput]] = {}

    def submit(self) -> tuple[SchedulerOutput, ModelRunnerOutput]:
        sched_out = self.scheduler.schedule()
        self.sched_outputs.append(sched_out)
        return sched_out, self.worker.execute(sched_out)

    def step(self) -> dict[int, list[EngineCoreOutput]]:
        current = self.in_flight or self.submit()
        self.in_flight = None
        scheduler = self.scheduler
        if (
            self.ahead
            and scheduler.has_unfinished_requests()
            and (self.always_ahead or not scheduler.wants_latest_tokens())
        ):
            self.in_flight = self.submit()
        return self.apply(*current)

    def apply(
        self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput
    ) -> dict[int, list[EngineCoreOutput]]:
        by_client = self.scheduler.update_from_output(sched_out, runner_out)
        for outs in by_client.values():
            for o in outs:
                self.outputs.setdefault(o.request_id, []).append(o)
        return by_client

    def run(self, max_steps: int = 10_000) -> int:
        steps = 0
        while self.scheduler.has_unfinished_requests() or self.in_flight is not None:
            self.step()
            steps += 1
            assert steps < max_steps, "scheduler made no progress"
        return steps

    def tokens(self, request_id: str) -> list[int]:
        return [t for o in self.outputs.get(request_id, []) for t in o.new_token_ids]

    def finish(self, request_id: str) -> EngineCoreOutput:
        return self.outputs[request_id][-1]
