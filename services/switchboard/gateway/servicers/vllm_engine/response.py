"""``switchboard.v1.GenerateResponse`` messages -> vLLM's ``GenerateResponse`` stream.

As vLLM's servicer answers (and SMG reads): streamed, one ``chunk`` per sequence per message
with the new token ids (``completion_tokens`` counts them: the router adds them up) and, once a
sequence ends, its ``complete`` with the finish reason, the matched stop and that last message's
ids again; not streamed, one ``complete`` per sequence with all its ids. Prompt logprobs ride on
a sequence's first chunk and on every complete; the prompt's first token has none.
"""

from __future__ import annotations

from smg_grpc_proto import vllm_engine_pb2 as vllm_pb

from switchboard.api.v1 import generation_service_pb2 as pb

FINISH_REASONS = {
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_ABORT: "abort",
    pb.FINISH_REASON_ERROR: "error",
    # vLLM has no reason of its own for a repetition loop: the sequence stopped
    pb.FINISH_REASON_REPETITION: "stop",
}


class ResponseTranslator:
    """One call's translation: remembers the prompt (first message) and who has started."""

    def __init__(self, stream: bool) -> None:
        self._stream = stream
        self._prompt_tokens = 0
        self._cached_tokens = 0
        self._input_logprobs: vllm_pb.InputLogProbs | None = None
        self._started: set[int] = set()

    def translate(self, response: pb.GenerateResponse) -> list[vllm_pb.GenerateResponse]:
        if response.HasField("prompt_info"):
            info = response.prompt_info
            self._prompt_tokens = info.num_prompt_tokens
            self._cached_tokens = info.num_cached_tokens
            if info.prompt_logprobs:
                self._input_logprobs = _input_logprobs(info)
        if response.HasField("usage"):
            self._cached_tokens = response.usage.cached_prompt_tokens or self._cached_tokens
        messages = []
        for sequence in response.outputs:
            if self._stream:
                messages.append(vllm_pb.GenerateResponse(chunk=self._chunk(sequence)))
            if sequence.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                messages.append(vllm_pb.GenerateResponse(complete=self._complete(sequence)))
        return messages

    def _chunk(self, sequence: pb.SequenceOutput) -> vllm_pb.GenerateStreamChunk:
        chunk = vllm_pb.GenerateStreamChunk(
            token_ids=sequence.token_ids,
            prompt_tokens=self._prompt_tokens,
            completion_tokens=len(sequence.token_ids),
            cached_tokens=self._cached_tokens,
            index=sequence.index,
        )
        if sequence.logprobs:
            chunk.output_logprobs.CopyFrom(_output_logprobs(sequence.logprobs))
        if sequence.index not in self._started:
            self._started.add(sequence.index)
            if self._input_logprobs is not None:
                chunk.input_logprobs.CopyFrom(self._input_logprobs)
        return chunk

    def _complete(self, sequence: pb.SequenceOutput) -> vllm_pb.GenerateComplete:
        complete = vllm_pb.GenerateComplete(
            output_ids=sequence.token_ids,
            finish_reason=FINISH_REASONS[sequence.finish_reason],
            prompt_tokens=self._prompt_tokens,
            completion_tokens=len(sequence.token_ids),
            cached_tokens=self._cached_tokens,
            index=sequence.index,
        )
        if sequence.logprobs:
            complete.output_logprobs.CopyFrom(_output_logprobs(sequence.logprobs))
        if self._input_logprobs is not None:
            complete.input_logprobs.CopyFrom(self._input_logprobs)
        which = sequence.WhichOneof("stop_reason")
        if which == "stop_token_id":
            complete.matched_token_id = sequence.stop_token_id
        elif which == "stop_string":
            complete.matched_stop_str = sequence.stop_string
        return complete


def _top(entry: pb.TokenLogprob) -> vllm_pb.TopLogProbs:
    return vllm_pb.TopLogProbs(
        values=[t.logprob for t in entry.top], token_ids=[t.token_id for t in entry.top]
    )


def _output_logprobs(entries: list[pb.TokenLogprob]) -> vllm_pb.OutputLogProbs:
    return vllm_pb.OutputLogProbs(
        token_logprobs=[e.logprob for e in entries],
        token_ids=[e.token_id for e in entries],
        top_logprobs=[_top(e) for e in entries],
    )


def _input_logprobs(info: pb.PromptInfo) -> vllm_pb.InputLogProbs:
    """One entry per prompt token; the tokens before the first with a logprob have none."""
    entries = list(info.prompt_logprobs)
    missing = len(info.token_ids) - len(entries)
    result = vllm_pb.InputLogProbs(token_ids=info.token_ids)
    for _ in range(missing):
        result.token_logprobs.add()
        result.top_logprobs.add()
    for entry in entries:
        result.token_logprobs.add(value=entry.logprob)
        result.top_logprobs.append(_top(entry))
    return result
