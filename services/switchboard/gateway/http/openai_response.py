"""``pb.GenerateResponse`` -> OpenAI objects: ``text_completion`` / ``chat.completion`` and
their stream chunks.

Streams use OutputKind DELTA (each message: one sequence's new text), non-streaming calls
FINAL_ONLY (one message with every sequence), so a shaper only renames. The usage a client
sees is the call's summed ``Usage`` (the prompt once, every sequence's completion tokens).
"""

from __future__ import annotations

from typing import Any

from switchboard.api.v1 import generation_service_pb2 as pb

FINISH_REASONS = {
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_ABORT: "abort",  # as vLLM
    pb.FINISH_REASON_ERROR: "error",
    pb.FINISH_REASON_REPETITION: "repetition",
}


def usage_object(usage: pb.Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_prompt_tokens},
    }


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
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

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

    def _choice(self, sequence: pb.SequenceOutput, *, chunk: bool) -> dict[str, Any]:
        finish_reason, stop_reason = _finish(sequence)
        logprobs = None
        if self.logprobs is not None:
            logprobs = {"content": [_chat_logprob(entry) for entry in sequence.logprobs]}
        choice: dict[str, Any] = {"index": sequence.index}
        if chunk:
            choice["delta"] = {"content": sequence.text} if sequence.text else {}
        else:
            choice["message"] = {"role": "assistant", "content": sequence.text}
        choice.update(logprobs=logprobs, finish_reason=finish_reason, stop_reason=stop_reason)
        return choice


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
