"""``pb.GenerateResponse`` -> OpenAI objects: ``text_completion`` / ``chat.completion`` and
their stream chunks.

Streams use OutputKind DELTA (each message: one sequence's new text), non-streaming calls
FINAL_ONLY (one message with every sequence), so a shaper only renames. The usage a client
sees is the call's summed ``Usage`` (the prompt once, every sequence's completion tokens).
"""

from __future__ import annotations

from typing import Any

from switchboard.api.v1 import generation_service_pb2 as pb
from switchboard.gateway.chat.tools import (
    AutoToolStream,
    ToolPlan,
    parse_forced_call,
    parse_tool_calls,
)

FINISH_REASONS = {
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_ABORT: "abort",  # as vLLM
    pb.FINISH_REASON_ERROR: "error",
    pb.FINISH_REASON_REPETITION: "repetition",
}


def usage_object(usage: pb.Usage) -> dict[str, Any]:
    """OpenAI's usage; with speculative decoding also what it proposed and had accepted."""
    result: dict[str, Any] = {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_prompt_tokens},
    }
    if usage.spec_draft_tokens:
        result["speculative_decoding"] = {
            "draft_tokens": usage.spec_draft_tokens,
            "accepted_tokens": usage.spec_accepted_tokens,
            "acceptance_rate": usage.spec_accepted_tokens / usage.spec_draft_tokens,
        }
    return result


def _finish(sequence: pb.SequenceOutput) -> tuple[str | None, str | int | None]:
    """(finish_reason, stop_reason): vLLM's ``stop_reason`` names the stop string or token."""
    reason = FINISH_REASONS.get(sequence.finish_reason)
    which = sequence.WhichOneof("stop_reason")
    return reason, getattr(sequence, which) if which else None


class Shaper:
    """One call's OpenAI objects; the subclasses name the choice fields."""

    object_name = ""
    chunk_object_name = ""

    def __init__(
        self, request_id: str, model: str, created: int, n: int, logprobs: int | None
    ) -> None:
        self.request_id = request_id
        self.model = model
        self.created = created
        self.n = n
        self.logprobs = logprobs
        self.usage: pb.Usage | None = None  # the latest seen (the last message has the total)

    def _envelope(self, name: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.request_id,
            "object": name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def opening_chunks(self) -> list[dict[str, Any]]:
        return []

    def chunks(self, response: pb.GenerateResponse) -> list[dict[str, Any]]:
        """Stream chunks for one DELTA message."""
        if response.HasField("usage"):
            self.usage = response.usage
        return [
            self._envelope(self.chunk_object_name, [self._choice(sequence, chunk=True)])
            for sequence in response.outputs
        ]

    def usage_chunk(self) -> dict[str, Any]:
        """The last chunk of ``stream_options.include_usage``: no choices, the call's usage."""
        chunk = self._envelope(self.chunk_object_name, [])
        chunk["usage"] = usage_object(self.usage or pb.Usage())
        return chunk

    def final(self, response: pb.GenerateResponse) -> dict[str, Any]:
        """The whole answer from the one FINAL_ONLY message."""
        choices = [self._choice(sequence, chunk=False) for sequence in response.outputs]
        body = self._envelope(self.object_name, sorted(choices, key=lambda c: c["index"]))
        body["usage"] = usage_object(response.usage)
        return body

    def _choice(self, sequence: pb.SequenceOutput, *, chunk: bool) -> dict[str, Any]:
        raise NotImplementedError


class CompletionShaper(Shaper):
    object_name = chunk_object_name = "text_completion"

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self._text_offsets = [0] * self.n  # per choice, across a stream's chunks

    def _choice(self, sequence: pb.SequenceOutput, *, chunk: bool) -> dict[str, Any]:
        finish_reason, stop_reason = _finish(sequence)
        return {
            "index": sequence.index,
            "text": sequence.text,
            "logprobs": self._logprobs(sequence) if self.logprobs is not None else None,
            "finish_reason": finish_reason,
            "stop_reason": stop_reason,
        }

    def _logprobs(self, sequence: pb.SequenceOutput) -> dict[str, Any]:
        offsets = []
        offset = self._text_offsets[sequence.index] if sequence.index < self.n else 0
        for entry in sequence.logprobs:
            offsets.append(offset)
            offset += len(entry.token)
        if sequence.index < self.n:
            self._text_offsets[sequence.index] = offset
        return {
            "text_offset": offsets,
            "token_logprobs": [entry.logprob for entry in sequence.logprobs],
            "tokens": [entry.token for entry in sequence.logprobs],
            "top_logprobs": [
                {top.token: top.logprob for top in entry.top} for entry in sequence.logprobs
            ],
        }


class ChatShaper(Shaper):
    """With a ``ToolPlan`` the answer's tool calls become ``message.tool_calls`` (finish_reason
    ``tool_calls`` when the model stopped by itself). Streamed, a forced call is held back and
    sent whole in the choice's last chunk; under ``auto`` the content streams until a
    ``<tool_call>`` begins, and the calls (with any content after them) come in the last chunk."""

    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def __init__(self, *args: Any, tools: ToolPlan | None = None) -> None:
        super().__init__(*args)
        self.tools = tools
        self._forced_text: dict[int, str] = {}  # per choice, a forced call's text so far
        self._auto: dict[int, AutoToolStream] = {}

    def opening_chunks(self) -> list[dict[str, Any]]:
        """The role of every choice first, as OpenAI and vLLM stream it."""
        return [
            self._envelope(
                self.chunk_object_name,
                [
                    {
                        "index": index,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ],
            )
            for index in range(self.n)
        ]

    def chunks(self, response: pb.GenerateResponse) -> list[dict[str, Any]]:
        if self.tools is None:
            return super().chunks(response)
        if response.HasField("usage"):
            self.usage = response.usage
        choices = [self._tool_delta(sequence) for sequence in response.outputs]
        return [
            self._envelope(self.chunk_object_name, [choice])
            for choice in choices
            if choice is not None
        ]

    def _logprobs(self, sequence: pb.SequenceOutput) -> dict[str, Any] | None:
        if self.logprobs is None:
            return None
        return {"content": [_chat_logprob(entry) for entry in sequence.logprobs]}

    def _tool_delta(self, sequence: pb.SequenceOutput) -> dict[str, Any] | None:
        """One streamed choice's chunk under a ToolPlan; None when there is nothing to send."""
        assert self.tools is not None
        finish_reason, stop_reason = _finish(sequence)
        index = sequence.index
        delta: dict[str, Any] = {}
        calls: list[dict[str, Any]] = []
        if self.tools.mode == "forced":
            text = self._forced_text.get(index, "") + sequence.text
            self._forced_text[index] = text
            if finish_reason is not None:
                call = parse_forced_call(text) if finish_reason == "stop" else None
                if call is not None:
                    calls = [call]
                elif text:
                    delta["content"] = text  # cut short: what there is, as text
        else:
            stream = self._auto.setdefault(index, AutoToolStream(self.tools))
            content = stream.feed(sequence.text)
            if finish_reason is not None:
                rest, calls = stream.finish()
                content += rest
            if content:
                delta["content"] = content
        if calls:
            delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(calls)]
            if finish_reason == "stop":
                finish_reason = "tool_calls"
        logprobs = self._logprobs(sequence)
        if not delta and finish_reason is None and not sequence.logprobs:
            return None
        return {
            "index": index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
            "stop_reason": stop_reason,
        }

    def _choice(self, sequence: pb.SequenceOutput, *, chunk: bool) -> dict[str, Any]:
        finish_reason, stop_reason = _finish(sequence)
        logprobs = self._logprobs(sequence)
        choice: dict[str, Any] = {"index": sequence.index}
        if chunk:
            choice["delta"] = {"content": sequence.text} if sequence.text else {}
        else:
            message: dict[str, Any] = {"role": "assistant", "content": sequence.text}
            calls = self._final_tool_calls(sequence, finish_reason, message)
            if calls and finish_reason == "stop":
                finish_reason = "tool_calls"
            choice["message"] = message
        choice.update(logprobs=logprobs, finish_reason=finish_reason, stop_reason=stop_reason)
        return choice

    def _final_tool_calls(
        self, sequence: pb.SequenceOutput, finish_reason: str | None, message: dict[str, Any]
    ) -> list[dict[str, Any]]:
        """The calls of a whole answer, written into ``message`` (content: what is left)."""
        if self.tools is None:
            return []
        if self.tools.mode == "forced":
            call = parse_forced_call(sequence.text) if finish_reason == "stop" else None
            content, calls = (None, [call]) if call is not None else (sequence.text, [])
        else:
            content, calls = parse_tool_calls(sequence.text, self.tools.names, self.tools.parallel)
        if calls:
            message["content"] = content
            message["tool_calls"] = calls
        return calls


def _chat_logprob(entry: pb.TokenLogprob) -> dict[str, Any]:
    return {
        **_chat_token(entry),
        "top_logprobs": [_chat_token(top) for top in entry.top],
    }


def _chat_token(entry: pb.TokenLogprob) -> dict[str, Any]:
    return {
        "token": entry.token,
        "logprob": entry.logprob,
        "bytes": list(entry.token.encode("utf-8")),
    }
