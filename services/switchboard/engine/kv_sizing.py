"""Sizing the KV cache and fitting ``max_model_len`` to it.

The number of KV blocks comes from ``--num-gpu-blocks-override`` if set, else from the workers
(``determine_num_kv_blocks``: ``--kv-cache-memory-bytes``, or a fraction of free device memory).
``max_model_len`` is then the configured value (default: the model's positions), capped by the
positions the model has and by what the KV cache holds, so that one full-length request always
fits; READY reports the result to the gateways, which refuse longer prompts.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def check_num_blocks(num_blocks: int, block_size: int, source: str) -> int:
    """A KV cache without a single block cannot serve anything: fail the start-up clearly."""
    if num_blocks < 1:
        raise RuntimeError(
            f"the KV cache has room for {num_blocks} blocks of {block_size} tokens ({source}): "
            "raise --kv-cache-memory-bytes / --gpu-memory-utilization, or set "
            "--num-gpu-blocks-override"
        )
    return num_blocks


def fit_max_model_len(
    configured: int | None, max_position_embeddings: int, kv_capacity_tokens: int
) -> int:
    """The longest request (prompt + output) the engine accepts; logs a warning for each cap."""
    max_model_len = configured or max_position_embeddings
    if max_model_len > max_position_embeddings:
        logger.warning(
            "max_model_len %d exceeds the model's %d positions; using %d",
            max_model_len,
            max_position_embeddings,
            max_position_embeddings,
        )
        max_model_len = max_position_embeddings
    if max_model_len > kv_capacity_tokens:
        logger.warning(
            "The KV cache holds %d tokens, less than max_model_len %d: "
            "max_model_len auto-fitted down to %d",
            kv_capacity_tokens,
            max_model_len,
            kv_capacity_tokens,
        )
        max_model_len = kv_capacity_tokens
    return max_model_len
