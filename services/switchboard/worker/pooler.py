"""Pooling: a sequence's final hidden states -> one embedding vector.

A decoder may compute a prompt in several chunks (chunked prefill), so pooling is incremental:
a :class:`PoolingState` takes the hidden states of each chunk as it is computed and keeps only
what its pooling type needs (a running float32 sum, a running maximum, or one row), then
:meth:`PoolingState.finish` makes the vector::

    pool -> keep the first ``dimensions`` values (Matryoshka) -> L2-normalize if ``normalize``

Normalizing after the cut keeps a truncated vector a unit vector, as Matryoshka models expect.
The arithmetic is float32 whatever the model's dtype (sentence-transformers pools in the
model's output dtype, which is float32 for its reference runs).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

from switchboard.wire.engine_msgs import PoolingParams, PoolingType
from switchboard.wire.step_msgs import SchedulerOutput
from switchboard.worker.step_inputs import RequestStates, StepInputs


class PoolingState:
    """What one request has accumulated of its prompt's hidden states so far."""

    __slots__ = ("params", "num_tokens", "_kept")

    def __init__(self, params: PoolingParams) -> None:
        PoolingType(params.pooling_type)  # ValueError for an unknown type
        self.params = params
        self.num_tokens = 0  # rows seen so far
        self._kept: torch.Tensor | None = None  # sum, max or one row, by pooling type

    def add(self, hidden: torch.Tensor) -> None:
        """Take the next rows (``[n, hidden]``, in prompt order) of the request's tokens."""
        if hidden.shape[0] == 0:
            return
        kind = self.params.pooling_type
        rows = hidden.float()
        if kind == PoolingType.LAST:
            self._kept = rows[-1].clone()
        elif kind == PoolingType.CLS:
            if self.num_tokens == 0:
                self._kept = rows[0].clone()
        elif kind == PoolingType.MAX:
            chunk_max = rows.max(dim=0).values
            self._kept = chunk_max if self._kept is None else torch.maximum(self._kept, chunk_max)
        else:  # MEAN, MEAN_SQRT_LEN: a running sum
            chunk_sum = rows.sum(dim=0)
            self._kept = chunk_sum if self._kept is None else self._kept + chunk_sum
        self.num_tokens += hidden.shape[0]

    def finish(self) -> list[float]:
        if self._kept is None:
            raise RuntimeError("pooling a request that computed no tokens")
        vector = self._kept
        if self.params.pooling_type == PoolingType.MEAN:
            vector = vector / self.num_tokens
        elif self.params.pooling_type == PoolingType.MEAN_SQRT_LEN:
            vector = vector / math.sqrt(self.num_tokens)
        return finish_vector(vector, self.params)


def finish_vector(vector: torch.Tensor, params: PoolingParams) -> list[float]:
    """Matryoshka cut, then normalization; a plain list for the wire."""
    if params.dimensions is not None:
        vector = vector[: params.dimensions]
    if params.normalize:
        vector = F.normalize(vector.float(), p=2, dim=-1)
    return vector.float().tolist()


def pool_sequence(hidden: torch.Tensor, params: PoolingParams) -> list[float]:
    """Pool a whole sequence at once (``[num_tokens, hidden]``)."""
    state = PoolingState(params)
    state.add(hidden)
    return state.finish()


class PoolingRequests:
    """The pooling requests of a decoder runner's batch and what each accumulated so far.

    A decoder computes their prompts like any other (paged KV cache, chunked prefill), but
    they are never sampled: each chunk's hidden rows go to the request's :class:`PoolingState`
    and the step that computes the last prompt token yields the vector. A preempted request
    comes back as a new request and starts over, like its KV cache.
    """

    def __init__(self) -> None:
        self._states: dict[str, PoolingState] = {}

    def apply(self, step: SchedulerOutput) -> None:
        for request_id in step.finished_request_ids:
            self._states.pop(request_id, None)
        for new in step.new_requests:
            if new.pooling_params is not None:
                if new.num_computed_tokens:
                    raise ValueError(
                        f"pooling request {new.request_id!r} starts at token "
                        f"{new.num_computed_tokens}: its first tokens would not be pooled"
                    )
                self._states[new.request_id] = PoolingState(new.pooling_params)

    def clear(self) -> None:
        self._states.clear()

    def without_pooling(self, inputs: StepInputs) -> StepInputs:
        """The step's inputs with the pooling requests taken out of sampling."""
        if not self._states or not any(r in self._states for r in inputs.sampled_request_ids):
            return inputs
        kept = [i for i, r in enumerate(inputs.sampled_request_ids) if r not in self._states]
        return dataclasses.replace(
            inputs,
            sampled_request_ids=[inputs.sampled_request_ids[i] for i in kept],
            logits_rows=inputs.logits_rows[kept],
        )

    def collect(
        self,
        step: SchedulerOutput,
        inputs: StepInputs,
        hidden: torch.Tensor,
        requests: RequestStates,
    ) -> dict[str, list[float]]:
        """Feed this step's hidden rows (before ``num_computed_tokens`` advances); returns
        the vectors of the requests whose prompt is now complete."""
        if not self._states:
            return {}
        pooled: dict[str, list[float]] = {}
        row = 0
        for request_id in inputs.request_ids:  # row order
            n = step.num_scheduled_tokens[request_id]
            state = self._states.get(request_id)
            if state is not None:
                state.add(hidden[row : row + n])
                request = requests[request_id]
                if request.num_computed_tokens + n >= len(request.token_ids):
                    pooled[request_id] = state.finish()
            row += n
        return pooled
