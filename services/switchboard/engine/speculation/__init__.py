"""Speculative decoding, the engine's half: proposing tokens and learning from their fate.

The scheduler asks :class:`~switchboard.engine.speculation.speculator.Speculator` for each
decoding request's proposals, schedules them as extra positions of the request
(``SchedulerOutput.scheduled_spec_decode_tokens``), and after the step hands back how many the
workers accepted (``worker/spec_verify.py`` verifies them against the model's own samples).
"""
