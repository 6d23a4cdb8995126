"""The ``switchboard generate`` client: stream a completion to the terminal as it is generated.

A plain gRPC client of ``switchboard.v1.GenerationService`` (any other language would do the
same): one server-streaming Generate call with OUTPUT_KIND_DELTA, each message's text written and
flushed as it arrives. Ctrl-C cancels the call, which makes the gateway abort the request.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TextIO

import grpc

from switchboard.api.v1 import generation_service_pb2 as pb
from switchboard.api.v1 import generation_service_pb2_grpc as pb_grpc

EXIT_OK = 0
EXIT_RPC_ERROR = 1
EXIT_INTERRUPTED = 130


def build_request(
    prompt: str,
    max_tokens: int | None,
    temperature: float | None,
    *,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    stop: Sequence[str] = (),
    model: str = "",
    request_id: str = "",
) -> pb.GenerateRequest:
    """A GenerateRequest where None means "unset: the model's default"."""
    request = pb.GenerateRequest(text=prompt, model=model, request_id=request_id)
    request.output.kind = pb.OUTPUT_KIND_DELTA
    sampling, stopping = request.sampling, request.stopping
    for name, value in (("temperature", temperature), ("top_p", top_p), ("top_k", top_k)):
        if value is not None:
            setattr(sampling, name, value)
    if seed is not None:
        sampling.seed = seed
    if max_tokens is not None:
        stopping.max_tokens = max_tokens
    stopping.stop.extend(stop)
    return request


def summary_line(response: pb.GenerateResponse) -> str:
    """One line on how the request ended (reason, tokens, latency, id): also ``chat``'s."""
    sequence = response.outputs[0] if response.outputs else pb.SequenceOutput()
    reason = pb.FinishReason.Name(sequence.finish_reason).removeprefix("FINISH_REASON_").lower()
    ttft = response.metrics.time_to_first_token.ToNanoseconds() / 1e9
    e2e = response.metrics.e2e_latency.ToNanoseconds() / 1e9
    return (
        f"[{reason}; {response.usage.prompt_tokens} prompt + "
        f"{response.usage.completion_tokens} completion tokens; "
        f"first token {ttft:.3f}s, total {e2e:.3f}s; id {response.request_id}]"
    )


def run_generate(
    target: str,
    prompt: str,
    max_tokens: int | None = 16,
    temperature: float | None = None,
    *,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    stop: Sequence[str] = (),
    model: str = "",
    timeout_s: float | None = None,
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> int:
    """Stream the completion of ``prompt`` from the gateway at ``target`` (host:port) to ``out``
    and a one-line summary to ``err``. Returns a process exit code."""
    out = out or sys.stdout
    err = err or sys.stderr
    request = build_request(
        prompt, max_tokens, temperature, top_p=top_p, top_k=top_k, seed=seed, stop=stop,
        model=model,
    )  # fmt: skip
    with grpc.insecure_channel(target) as channel:
        call = pb_grpc.GenerationServiceStub(channel).Generate(request, timeout=timeout_s)
        last: pb.GenerateResponse | None = None
        try:
            for response in call:
                for sequence in response.outputs:
                    out.write(sequence.text)
                out.flush()
                last = response
        except KeyboardInterrupt:
            call.cancel()
            err.write("\n[interrupted: request cancelled]\n")
            return EXIT_INTERRUPTED
        except grpc.RpcError as error:
            return report_rpc_error(error, out, err)
    return finish_answer(last, out, err)


def report_rpc_error(error: grpc.RpcError, out: TextIO, err: TextIO) -> int:
    """A failed call: end the answer's line, say the status on ``err``; the exit code."""
    out.write("\n")
    err.write(f"error: {error.code().name}: {error.details()}\n")
    return EXIT_RPC_ERROR


def finish_answer(last: pb.GenerateResponse | None, out: TextIO, err: TextIO) -> int:
    """A streamed answer ended: end its line, the summary of its last message on ``err``."""
    out.write("\n")
    out.flush()
    if last is not None:
        err.write(summary_line(last) + "\n")
    return EXIT_OK
