"""How often a streaming call may send: one gateway's message budget shared by its calls.

Every streamed message costs the gateway, the connection and the client a fixed amount of work
(on gRPC: a completion-queue round trip and a wake-up on each side) whatever it carries. With
many calls on a fast engine, one message per call and engine step is thousands a second, and on
a machine with few cores that work is taken from the model: throughput and the time to first
token of new calls suffer. So the gateway aims at no more than ``--stream-messages-per-s``
messages a second in all: with ``c`` calls streaming, a call waits ``c / budget`` seconds after
a message before it sends the next, and sends the steps that came meanwhile as one
(``generate_stream.py``): the same tokens and text in fewer messages. While the engine's steps are
further apart than that, nothing waits. A call's first message is never held (time to first
token), nor the step that ends the call (the wait ends when it comes), nor the steps of a call
with ``n`` > 1 (its sequences' steps are merged only one at a time).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from switchboard.gateway.engines.types import RequestEvent, StepOutput
from switchboard.gateway.pipeline.sequence_group import SequenceGroup


class MessagePacing:
    def __init__(self, messages_per_s: float, streaming_calls: Callable[[], int]) -> None:
        self._messages_per_s = messages_per_s
        self._streaming_calls = streaming_calls

    def interval(self) -> float:
        """Seconds a call leaves between its messages now."""
        return self._streaming_calls() / self._messages_per_s

    async def wait(self, group: SequenceGroup, event: RequestEvent, sent_at: float) -> None:
        """Before the message that ``event`` starts: wait out the call's interval since its
        last message (``sent_at``, the loop's time), or until the step that ends the call is
        here; not at all if the event must go at once."""
        if len(group.channels) != 1 or not isinstance(event, StepOutput):
            return
        if event.output.finish_reason is not None:
            return
        deadline = sent_at + self.interval()
        if deadline <= asyncio.get_running_loop().time():
            return  # the engine's steps are further apart than the interval: nothing to wait
        # Woken by the deadline or the call's last step only, not by each step between: with
        # many calls streaming, a wake-up per call and step is a task switch per token.
        await group.channels[0].end_arrival(deadline)
