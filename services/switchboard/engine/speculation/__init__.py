"""Speculative decoding, the engine's half: proposing tokens and learning from their fate.

The scheduler asks :class:`~switchboard.engine.speculation.speculator.Speculator` for each
decoding request's proposals, schedules them as extra positions of the request
(``SchedulerOutput.scheduled_spec_decode_tokens``), and after the step hands back how many the
workers accepted (``worker/spec_verify.py`` verifies them against the model's own samples).
With a draft model the engine schedules ``DRAFT_PLACEHOLDER`` proposals, positions only, and the
workers' draft model fills them in within the step (``worker/draft_model.py``); the rest is the
same.
"""
