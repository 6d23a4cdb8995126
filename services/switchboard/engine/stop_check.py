"""Token-level stop conditions, checked in the engine after each appended token.

Stop *strings* need text and are the gateway's job; everything here works on token ids:

1. once ``min_tokens`` outputs exist: EOS (unless ``ignore_eos``) -> STOP, stop_reason None;
   a token in ``stop_token_ids`` -> STOP, stop_reason = that token id;
2. ``max_tokens`` outputs, or ``max_model_len`` tokens in all -> LENGTH;
3. once ``min_tokens`` outputs exist, with ``repetition_detection``: the last outputs repeat one
   pattern of ``min_pattern_size..max_pattern_size`` tokens ``min_count`` times back to back
   -> REPETITION, stop_reason ``"repetition_detected"`` (vLLM's word).

``min_tokens`` is a floor for every stop but LENGTH: the sampler also masks EOS and stop tokens
until then, so they are not even drawn; the check here keeps the rule if a worker did not.

A stop token is kept in the output (the gateway decides whether to show it), and a token that
is both a stop token and the last allowed one reports STOP: the model did choose to stop.
"""

from __future__ import annotations

from switchboard.engine.request import Request
from switchboard.wire.engine_msgs import FinishReason, RepetitionDetectionParams

REPETITION_STOP_REASON = "repetition_detected"


def check_stop(
    request: Request, max_model_len: int
) -> tuple[FinishReason, int | str | None] | None:
    """(finish reason, stop reason) if the request's last token ends it, else None."""
    params = request.sampling_params
    output = request.output_token_ids
    num_output = len(output)
    past_min_tokens = num_output >= params.min_tokens
    if past_min_tokens:
        last = output[-1]
        if not params.ignore_eos and last in params.eos_token_ids:
            return FinishReason.STOP, None
        if last in params.stop_token_ids:
            return FinishReason.STOP, last
    if num_output >= params.max_tokens or len(request.all_token_ids) >= max_model_len:
        return FinishReason.LENGTH, None
    detection = params.repetition_detection
    if past_min_tokens and detection is not None and ends_in_repetition(output, detection):
        return FinishReason.REPETITION, REPETITION_STOP_REASON
    return None


def ends_in_repetition(token_ids: list[int], detection: RepetitionDetectionParams) -> bool:
    """Whether the tail of ``token_ids`` is one pattern of a size in the allowed range, repeated
    ``min_count`` times back to back. O(max_pattern_size) for a tail that cannot repeat (the
    common case: the last token differs from the one a pattern length earlier)."""
    count = max(2, detection.min_count)
    num_tokens = len(token_ids)
    last = token_ids[-1] if token_ids else None
    for size in range(max(1, detection.min_pattern_size), detection.max_pattern_size + 1):
        span = size * count
        if span > num_tokens:
            break
        if token_ids[-1 - size] != last:
            continue
        tail = token_ids[-span:]
        if tail[size:] == tail[:-size]:  # periodic with period `size` over the whole span
            return True
    return False
