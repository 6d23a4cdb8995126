"""The ``switchboard chat`` client: talk to an instruct model through its chat template.

A plain gRPC client of ``switchboard.v1.GenerationService`` like ``switchboard generate``, but it
sends ``GenerateRequest.messages`` (the conversation so far) instead of prompt text, so the
server renders the model's chat template and the model answers as an assistant. Two forms:

* one-shot, ``switchboard chat "question"``: the answer is streamed to stdout, a summary line to
  stderr, and the process exits (1 on an RPC error, 130 on Ctrl-C);
* interactive: each line read is a user turn, the streamed answer joins the history. Ctrl-C
  while an answer streams cancels that request (the gateway aborts it) and keeps what was
  shown; Ctrl-C at the prompt clears the line; Ctrl-D (end of input) leaves.

No torch, no tokenizer here: everything about tokens stays in the server.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from typing import TextIO

import grpc

from switchboard.api.v1 import generation_service_pb2 as pb
from switchboard.api.v1 import generation_service_pb2_grpc as pb_grpc
from switchboard.cli.client import EXIT_INTERRUPTED, EXIT_OK, finish_answer, report_rpc_error

USER_PROMPT = ">>> "


def build_chat_request(
    messages: list[tuple[str, str]],
    max_tokens: int | None,
    temperature: float | None,
    *,
    model: str = "",
) -> pb.GenerateRequest:
    """A streaming (DELTA) GenerateRequest for ``messages`` as (role, content) pairs; None
    means "unset: the model's default"."""
    request = pb.GenerateRequest(
        model=model,
        messages=[pb.ChatMessage(role=role, content=content) for role, content in messages],
    )
    request.output.kind = pb.OUTPUT_KIND_DELTA
    if temperature is not None:
        request.sampling.temperature = temperature
    if max_tokens is not None:
        request.stopping.max_tokens = max_tokens
    return request


class _Interrupted(Exception):
    def __init__(self, text: str) -> None:
        self.text = text  # what was streamed before Ctrl-C


def _stream_answer(
    stub: pb_grpc.GenerationServiceStub,
    request: pb.GenerateRequest,
    out: TextIO,
    timeout_s: float | None,
) -> tuple[str, pb.GenerateResponse | None]:
    """Stream one answer to ``out``; return its text and the last response (usage, metrics).
    Raises _Interrupted on Ctrl-C (after cancelling the call) and grpc.RpcError."""
    call = stub.Generate(request, timeout=timeout_s)
    parts: list[str] = []
    last: pb.GenerateResponse | None = None
    try:
        for response in call:
            for sequence in response.outputs:
                out.write(sequence.text)
                parts.append(sequence.text)
            out.flush()
            last = response
    except KeyboardInterrupt:
        call.cancel()
        raise _Interrupted("".join(parts)) from None
    return "".join(parts), last


@dataclasses.dataclass(frozen=True)
class _Knobs:
    """What every turn's request shares."""

    max_tokens: int | None
    temperature: float | None
    model: str
    timeout_s: float | None

    def request(self, messages: list[tuple[str, str]]) -> pb.GenerateRequest:
        return build_chat_request(messages, self.max_tokens, self.temperature, model=self.model)


def run_chat(
    target: str,
    message: str | None = None,
    *,
    max_tokens: int | None = 512,
    temperature: float | None = None,
    system: str | None = None,
    model: str = "",
    timeout_s: float | None = None,
    read_line: Callable[[str], str] | None = None,
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> int:
    """Chat with the model served at ``target`` (host:port): answer ``message`` and return, or,
    when it is None, run an interactive chat on ``read_line`` (default: ``input``) until end
    of input. Returns a process exit code."""
    out = out or sys.stdout
    err = err or sys.stderr
    knobs = _Knobs(max_tokens, temperature, model, timeout_s)
    history: list[tuple[str, str]] = [("system", system)] if system else []
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        if message is not None:
            return _one_shot(stub, [*history, ("user", message)], knobs, out, err)
        return _interactive(stub, history, knobs, read_line or _input_with_editing(), out, err)


def _one_shot(
    stub: pb_grpc.GenerationServiceStub,
    messages: list[tuple[str, str]],
    knobs: _Knobs,
    out: TextIO,
    err: TextIO,
) -> int:
    try:
        _, last = _stream_answer(stub, knobs.request(messages), out, knobs.timeout_s)
    except _Interrupted:
        err.write("\n[interrupted: request cancelled]\n")
        return EXIT_INTERRUPTED
    except grpc.RpcError as error:
        return report_rpc_error(error, out, err)
    return finish_answer(last, out, err)


def _interactive(
    stub: pb_grpc.GenerationServiceStub,
    history: list[tuple[str, str]],
    knobs: _Knobs,
    read_line: Callable[[str], str],
    out: TextIO,
    err: TextIO,
) -> int:
    err.write("[chat: Ctrl-C ends an answer, Ctrl-D leaves]\n")
    while True:
        try:
            line = read_line(USER_PROMPT)
        except EOFError:
            out.write("\n")
            return EXIT_OK
        except KeyboardInterrupt:
            out.write("\n")
            continue
        if not line.strip():
            continue
        turn = [*history, ("user", line)]
        try:
            answer, _ = _stream_answer(stub, knobs.request(turn), out, knobs.timeout_s)
        except _Interrupted as interrupted:
            answer = interrupted.text  # what was shown stays the assistant's answer
            err.write("\n[interrupted]")
        except grpc.RpcError as error:
            err.write(f"\nerror: {error.code().name}: {error.details()}\n")
            continue  # the failed turn is forgotten
        out.write("\n")
        out.flush()
        history = [*turn, ("assistant", answer)]


def _input_with_editing() -> Callable[[str], str]:
    """``input``, with line editing and recall when stdin is a terminal."""
    if sys.stdin.isatty():
        try:
            import readline  # noqa: F401  (importing it is what switches editing on)
        except ImportError:
            pass
    return input
