"""One request's path through the gateway before and after the engine: validate the API request
and its sampling knobs, plan what goes to the engine, then turn the engine's events into the
API's stream (text, logprobs, per-sequence grouping for ``n > 1``)."""
