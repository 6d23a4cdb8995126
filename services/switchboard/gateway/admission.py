"""Admission control: a per-gateway cap on requests in flight and on queued prompt tokens.

A Generate call takes a ``Ticket`` before anything else is spent on it, and gives it back when
it ends, however it ends. Its prompt tokens count as queued from the moment they are known
(after tokenization, times ``n``) until the first output of the request arrives (the engine
has prefilled it) or the call ends. Over either cap the call fails with RESOURCE_EXHAUSTED and
a ``RetryInfo`` (retrying later helps: it is this gateway's load, not the request). 0 turns a
cap off. Both are per gateway process (``--api-servers`` N: N times as many in all).
"""

from __future__ import annotations

import grpc

from switchboard.gateway.api_errors import ApiError

RETRY_AFTER_S = 1.0


def _overloaded(message: str) -> ApiError:
    return ApiError(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        message,
        reason="GATEWAY_OVERLOADED",
        retry_after_s=RETRY_AFTER_S,
    )


class Admission:
    def __init__(self, max_requests: int, max_queued_prompt_tokens: int) -> None:
        self.max_requests = max_requests
        self.max_queued_prompt_tokens = max_queued_prompt_tokens
        self.in_flight = 0
        self.queued_prompt_tokens = 0

    def enter(self) -> Ticket:
        """A ticket for one more request; RESOURCE_EXHAUSTED when the gateway is full."""
        if self.max_requests and self.in_flight >= self.max_requests:
            raise _overloaded(
                f"this gateway has {self.in_flight} requests in flight, its limit "
                f"(--max-inflight-requests {self.max_requests}); retry later"
            )
        self.in_flight += 1
        return Ticket(self)


class Ticket:
    def __init__(self, admission: Admission) -> None:
        self._admission = admission
        self._queued = 0
        self._open = True

    def queue_prompt(self, num_tokens: int) -> None:
        """Count the prompt's tokens as queued; RESOURCE_EXHAUSTED over the cap (a prompt
        alone over it passes when nothing else is queued: it could never be admitted)."""
        admission = self._admission
        cap = admission.max_queued_prompt_tokens
        queued = admission.queued_prompt_tokens
        if cap and queued and queued + num_tokens > cap:
            raise _overloaded(
                f"this gateway has {queued} prompt tokens waiting for prefill; {num_tokens} more "
                f"would pass its limit (--max-queued-prompt-tokens {cap}); retry later"
            )
        admission.queued_prompt_tokens += num_tokens
        self._queued += num_tokens

    def prompt_started(self) -> None:
        """The engine produced the first output: the prompt is no longer queued."""
        self._admission.queued_prompt_tokens -= self._queued
        self._queued = 0

    def release(self) -> None:
        if not self._open:
            return
        self._open = False
        self.prompt_started()
        self._admission.in_flight -= 1
