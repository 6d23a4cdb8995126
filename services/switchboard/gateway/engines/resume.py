"""Streams that resume: a request cut off by its engine's death is sent again, to a live or the
restarted engine, as the same request continued.

The resumed request is the original (same id, prompt and sampling parameters) with the output
tokens already streamed in ``EngineCoreRequest.output_token_ids``: the engine continues after
them as it does after a preemption, so they count as output for ``max_tokens``, ``min_tokens``,
penalties, bad words, repetition detection and a seed's draw position (``worker/sampler.py``
draws output token ``i`` from (seed, i)). Greedy and seeded requests give exactly the tokens
an undisturbed run gives. The outputs keep coming on the same channel, so the client sees one
unbroken stream.

Not resumable (``resume_plan`` says why) once tokens were delivered: a structured-output
request (its grammar matcher would start over) and a request with prompt embeddings.
"""

from __future__ import annotations

import msgspec

from switchboard.wire.engine_msgs import EngineCoreRequest


def resume_plan(
    request: EngineCoreRequest | None, delivered: list[int]
) -> tuple[EngineCoreRequest | None, str]:
    """(the request to send again, "") or (None, why it cannot be resumed)."""
    if request is None:
        return None, "the request is unknown"
    if not delivered:
        return request, ""  # nothing streamed yet: the same request again
    params = request.sampling_params
    if params is None:
        return None, "a pooling request"
    if params.structured_output is not None:
        return None, "its grammar's state cannot be carried over"
    if request.prompt_embeds is not None:
        return None, "prompt embeddings are not kept"
    if len(delivered) >= params.max_tokens:
        return None, "it had no tokens left to generate"
    return msgspec.structs.replace(request, output_token_ids=list(delivered)), ""
