"""A sequence's messages that queued up, sent as one.

A call whose messages go out slower than its engine makes steps (the client reads slowly, or
the gateway's loop is busy with other streams) finds several steps waiting in its channel. Sent
one message a step, each costs the gateway, the connection and the client the per-message work
that put the call behind in the first place; the call sends what they say together instead, as
vLLM's output collector merges the outputs its consumer has not picked up yet. Nothing waits
for more to come: a call that keeps up sends one message a step.
"""

from __future__ import annotations

from switchboard.api.v1 import generation_service_pb2 as pb


def coalesce(responses: list[pb.GenerateResponse], kind: int) -> pb.GenerateResponse:
    """One message saying what ``responses`` (one sequence's, in order) say one after another:
    the text, token ids and logprobs of them all; the prompt info of the first; the finish,
    usage and metrics of the last."""
    merged = responses[-1]
    if len(responses) == 1:
        return merged
    first = responses[0]
    if first.HasField("prompt_info"):
        merged.prompt_info.CopyFrom(first.prompt_info)
    if kind == pb.OUTPUT_KIND_CUMULATIVE:
        return merged  # the last says everything so far
    sequence = pb.SequenceOutput()
    for response in responses:
        # repeated fields (token ids, logprobs) are appended; finish and stop reason are set
        # on the last only, and a field left unset does not overwrite one set earlier
        sequence.MergeFrom(response.outputs[0])
    sequence.text = "".join(response.outputs[0].text for response in responses)
    del merged.outputs[:]
    merged.outputs.append(sequence)
    return merged
