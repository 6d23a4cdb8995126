"""One Generate call: engine outputs in, GenerateResponse messages out.

Holds the per-request state (text so far, token counts, engine event timestamps) and decides,
per engine step, what the client gets according to its OutputKind (and when a stop string ends
the sequence, in the gateway, sends the engine its ABORT):

* DELTA: the new text / token ids of each step (steps with nothing new send nothing);
* CUMULATIVE: everything so far, whenever something is new;
* FINAL_ONLY: one message at the end.

PromptInfo rides on the first message sent, Usage on the last (``sequence_group.py`` adds the
call's RequestMetrics to it, from the call's one timing record). Logprobs (when asked for) ride
with their tokens: a step with new tokens is news even if its text is held back. With ``n`` > 1
there is one stream per sequence (``index``); ``sequence_group.py`` merges them.

A call that fell behind its engine (the client reads slowly, or the gateway's loop is busy with
other streams, or the gateway's message budget holds it: ``message_pacing.py``) finds several
steps queued in its channel. It feeds them with ``hold`` and ``flush``es after the last: one
message says what they say together (the text, token ids and logprobs of them all), built once,
as vLLM's output collector merges the outputs its consumer has not picked up yet. Nothing waits
for more to come: a call that keeps up sends one message a step. The held steps' tokens are
detokenized together when their message is built (where no stop string needs each step's text,
and the interval is 1): with a byte-level tokenizer two decodes a message instead of two a
token, and the same text (``text.py``). With a stream interval of k > 1
(``--stream-interval``, as vLLM's), a stream sends its first message at once and then one per k
output tokens, and its last: fewer, larger messages, for less work per token in the gateway, the
connection and the client.
"""

from __future__ import annotations

from collections.abc import Callable

import grpc

from switchboard.api.v1 import generation_service_pb2 as pb
from switchboard.gateway.api_errors import ApiError
from switchboard.gateway.engines.types import (
    RequestAborted,
    RequestEvent,
    RequestFailed,
    StepOutput,
)
from switchboard.gateway.lora_names import AdapterNotLoaded
from switchboard.gateway.pipeline.api_logprobs import to_api_logprobs
from switchboard.gateway.pipeline.validation import GeneratePlan
from switchboard.gateway.text import IncrementalDetokenizer, TextStream, Tokenizer
from switchboard.wire.engine_msgs import FinishReason

_FINISH_REASONS = {
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.ABORT: pb.FINISH_REASON_ABORT,
    FinishReason.ERROR: pb.FINISH_REASON_ERROR,
    FinishReason.REPETITION: pb.FINISH_REASON_REPETITION,
}


class GenerateStream:
    def __init__(
        self,
        plan: GeneratePlan,
        prompt_token_ids: list[int],
        tokenizer: Tokenizer,
        index: int = 0,
        stream_interval: int = 1,
        *,
        abort_engine: Callable[[], object],
    ) -> None:
        self.plan = plan
        self._abort_engine = abort_engine  # ABORT this sequence in the engine
        self._stream_interval = stream_interval
        # What the interval holds back since the last message sent (stream_interval > 1).
        self._held_text = ""
        self._held_ids: list[int] = []
        self._held_logprobs: list[pb.TokenLogprob] = []
        # How much of what is held a message may say now (the interval's whole groups, the
        # first token): lengths of the held text, ids and logprobs; None while none of it.
        self._cut: tuple[int, int, int] | None = None
        self.index = index  # of this sequence among the request's n
        self._token_texts = tokenizer if plan.detokenize else None  # logprobs' token strings
        self._logprobs: list[pb.TokenLogprob] = []  # of every output token so far (if asked)
        self._prompt_logprobs: list[pb.TokenLogprob] = []
        self._prompt_token_ids = prompt_token_ids
        self._text: TextStream | None = None
        if plan.detokenize:
            detokenizer = IncrementalDetokenizer(
                tokenizer, prompt_token_ids, plan.skip_special_tokens
            )
            self._text = TextStream(
                detokenizer, plan.stop, plan.include_stop_str_in_output, plan.min_tokens
            )
        self._token_ids: list[int] = []
        # Held steps' tokens not detokenized yet: their text is read when their message is
        # built. Only where nothing needs it sooner: a stop string ends the sequence on a
        # step's text, and an interval > 1 cuts messages at a step's text.
        self._unread_ids: list[int] = []
        self._defers_text = self._text is not None and not plan.stop and stream_interval == 1
        self._released_text = ""
        self._num_cached_tokens = 0
        self._num_draft_tokens = 0  # speculative decoding: proposed and accepted tokens
        self._num_accepted_tokens = 0
        self._sent_first = False
        self.finish_reason = pb.FINISH_REASON_UNSPECIFIED
        self.stop_token_id: int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason != pb.FINISH_REASON_UNSPECIFIED

    def handle(self, event: RequestEvent, hold: bool = False) -> pb.GenerateResponse | None:
        """Feed one event of the request's channel; return the message to send, if any. With
        ``hold``, what a step says is kept for ``flush`` instead (more steps are queued behind
        it: they go out as one message); the message that ends the sequence is never held."""
        if isinstance(event, RequestFailed):
            raise event.error
        if isinstance(event, RequestAborted):
            return self._finish(pb.FINISH_REASON_ABORT, "", [])
        return self._step(event, hold)

    def flush(self) -> pb.GenerateResponse | None:
        """The message for what ``handle(hold=True)`` kept, as the stream interval allows (all
        of it with an interval of 1); None when there is nothing to send."""
        if self.finished or self._cut is None:
            return None
        if self._unread_ids:  # only with an interval of 1: the message is everything held
            text = self._read([])
            self._released_text += text
            self._held_text += text
            return self._build(*self._take_held(), final=False)
        return self._build(*self._take_held(self._cut), final=False)

    def _step(self, step: StepOutput, hold: bool = False) -> pb.GenerateResponse | None:
        output = step.output
        self._num_cached_tokens = max(self._num_cached_tokens, output.num_cached_tokens)
        self._num_draft_tokens += output.num_draft_tokens
        self._num_accepted_tokens += output.num_accepted_tokens
        # Raised before any text is read: the held steps before it are read by flush.
        if output.finish_reason == FinishReason.ERROR:
            if output.lora_not_loaded:  # unloaded through another gateway: NOT_FOUND
                raise AdapterNotLoaded(output.lora_not_loaded, "model")
            why = f": {output.stop_reason}" if isinstance(output.stop_reason, str) else ""
            raise ApiError(
                grpc.StatusCode.INTERNAL,
                f"the engine failed request {self.plan.request_id!r}{why}",
                reason="ENGINE_REQUEST_ERROR",
            )
        new_ids = list(output.new_token_ids)
        new_text = ""
        if hold and self._defers_text and output.finish_reason is None:
            self._unread_ids += new_ids  # read by flush, or by the step that is not held
        elif self._text is not None:
            pushed_before = self._text.num_tokens + len(self._unread_ids)
            new_text = self._read(new_ids)
            if self._text.stopped:  # (one step may bring tokens past it: speculative decoding)
                new_ids = new_ids[: self._text.num_tokens - pushed_before]
        self._token_ids += new_ids
        new_logprobs = to_api_logprobs(
            output.new_logprobs[: len(new_ids)] if output.new_logprobs else None,
            self._token_texts,
        )
        self._logprobs += new_logprobs
        if output.prompt_logprobs:
            self._prompt_logprobs = to_api_logprobs(output.prompt_logprobs, self._token_texts)
        if self._text is not None and self._text.stopped:
            # A stop string ended the sequence here, in the gateway: the engine still runs it.
            self._abort_engine()
            return self._finish(pb.FINISH_REASON_STOP, new_text, new_ids, new_logprobs)
        if output.finish_reason is not None:
            if isinstance(output.stop_reason, int):
                self.stop_token_id = output.stop_reason
            reason = _FINISH_REASONS[output.finish_reason]
            return self._finish(reason, new_text, new_ids, new_logprobs)
        return self._message(new_text, new_ids, new_logprobs, hold=hold)

    def _finish(
        self,
        reason: pb.FinishReason,
        new_text: str,
        new_ids: list[int],
        new_logprobs: list[pb.TokenLogprob] | None = None,
    ) -> pb.GenerateResponse:
        self.finish_reason = reason
        if self._text is not None:
            new_text += self._read([]) + self._text.finish()
        response = self._message(new_text, new_ids, new_logprobs or [], final=True)
        assert response is not None
        return response

    def _message(
        self,
        new_text: str,
        new_ids: list[int],
        new_logprobs: list[pb.TokenLogprob],
        final: bool = False,
        hold: bool = False,
    ) -> pb.GenerateResponse | None:
        self._released_text += new_text
        kind = self.plan.output_kind
        if kind != pb.OUTPUT_KIND_FINAL_ONLY:
            # Kept until the interval's tokens are in (or the batch of queued steps ends:
            # ``flush``; or the sequence does): one message built for several steps.
            self._held_text += new_text
            self._held_ids += new_ids
            self._held_logprobs += new_logprobs
            if final:
                return self._build(*self._take_held(), final=True)
            if self._interval_due():
                self._cut = (len(self._held_text), len(self._held_ids), len(self._held_logprobs))
            if hold or self._cut is None:
                return None
            new_text, new_ids, new_logprobs = self._take_held(self._cut)
        return self._build(new_text, new_ids, new_logprobs, final)

    def _build(
        self,
        new_text: str,
        new_ids: list[int],
        new_logprobs: list[pb.TokenLogprob],
        final: bool,
    ) -> pb.GenerateResponse | None:
        """The message saying ``new_*`` (or, CUMULATIVE, everything so far), if it says
        anything."""
        kind = self.plan.output_kind
        wants_ids = self.plan.return_token_ids or self.plan.logprobs is not None
        has_news = bool(new_text) or (wants_ids and bool(new_ids))
        if not final and (kind == pb.OUTPUT_KIND_FINAL_ONLY or not has_news):
            return None
        whole = (final and kind == pb.OUTPUT_KIND_FINAL_ONLY) or kind == pb.OUTPUT_KIND_CUMULATIVE
        sequence = pb.SequenceOutput(
            index=self.index,
            text=self._released_text if whole else new_text,
            finish_reason=self.finish_reason,
        )
        if self.plan.return_token_ids:
            sequence.token_ids.extend(self._token_ids if whole else new_ids)
        if self.plan.logprobs is not None:
            sequence.logprobs.extend(self._logprobs if whole else new_logprobs)
        if final and self._text is not None and self._text.stop_string is not None:
            sequence.stop_string = self._text.stop_string
        elif final and self.stop_token_id is not None:
            sequence.stop_token_id = self.stop_token_id
        response = pb.GenerateResponse(request_id=self.plan.request_id, outputs=[sequence])
        if not self._sent_first:
            self._sent_first = True
            response.prompt_info.CopyFrom(self._prompt_info())
        if final:
            response.usage.CopyFrom(self.usage())
        return response

    def _read(self, new_ids: list[int]) -> str:
        """The text of the unread ids and then ``new_ids`` (all detokenized at once)."""
        assert self._text is not None
        ids = new_ids
        if self._unread_ids:
            ids, self._unread_ids = self._unread_ids + new_ids, []
        return self._text.push(ids) if ids else ""

    def _interval_due(self) -> bool:
        """Whether what is held past the cut completes a message of the stream interval: the
        first token at once, then one message per ``stream_interval`` output tokens."""
        if self._cut is None:
            return not self._sent_first or len(self._held_ids) >= self._stream_interval
        return len(self._held_ids) - self._cut[1] >= self._stream_interval

    def _take_held(
        self, cut: tuple[int, int, int] | None = None
    ) -> tuple[str, list[int], list[pb.TokenLogprob]]:
        """What is held, up to ``cut`` (all of it: None); the rest stays held."""
        text, ids, logprobs = self._held_text, self._held_ids, self._held_logprobs
        self._cut = None
        if cut is None or cut == (len(text), len(ids), len(logprobs)):  # no copies: all of it
            self._held_text, self._held_ids, self._held_logprobs = "", [], []
            return text, ids, logprobs
        n_text, n_ids, n_logprobs = cut
        self._held_text, self._held_ids = text[n_text:], ids[n_ids:]
        self._held_logprobs = logprobs[n_logprobs:]
        return text[:n_text], ids[:n_ids], logprobs[:n_logprobs]

    def _prompt_info(self) -> pb.PromptInfo:
        info = pb.PromptInfo(
            num_prompt_tokens=len(self._prompt_token_ids),
            num_cached_tokens=self._num_cached_tokens,
        )
        if self.plan.return_token_ids:
            info.token_ids.extend(self._prompt_token_ids)
        info.prompt_logprobs.extend(self._prompt_logprobs)
        return info

    def usage(self) -> pb.Usage:
        return pb.Usage(
            prompt_tokens=len(self._prompt_token_ids),
            completion_tokens=len(self._token_ids),
            cached_prompt_tokens=self._num_cached_tokens,
            spec_draft_tokens=self._num_draft_tokens,
            spec_accepted_tokens=self._num_accepted_tokens,
        )
