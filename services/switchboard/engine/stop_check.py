"""Token-level stop conditions, checked in the engine after each appended token.

Stop *strings* need text and are the gateway's job; everything here works on token ids:

1. once ``min_tokens`` outputs exist: EOS (unless ``ignore_eos``) -> STOP, stop_reason None;
   a token in ``stop_token_ids`` -> STOP, stop_reason = that token id;
2. ``max_tokens`` outputs, or ``max_model_len`` tokens in all -> LENGTH.

A stop token is kept in the output (the gateway decides whether to show it), and a token that
is both a stop token and the last allowed one reports STOP: the model did choose to stop.
"""

from __future__ import annotations

from switchboard.engine.request import Request
from switchboard.wire.engine_msgs import FinishReason


def check_stop(request: Request, max_model_len: int) -> tuple[FinishReason, int | None] | None:
    """(finish reason, stop reason) if the request's last token ends it, else None."""
    params = request.sampling_params
    num_output = len(request.output_token_ids)
    if num_output >= params.min_tokens:
        last = request.output_token_ids[-1]
        if not params.ignore_eos and last in params.eos_token_ids:
            return FinishReason.STOP, None
        if last in params.stop_token_ids:
            return FinishReason.STOP, last
    if num_output >= params.max_tokens or len(request.all_token_ids) >= max_model_len:
        return FinishReason.LENGTH, None
    return None
