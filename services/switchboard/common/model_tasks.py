"""What a checkpoint can do (generate, embed) and how it pools, read from its files.

Stdlib only and shared like ``config.py``: the gateway fills model cards, refuses Generate on an
encoder and resolves Embed defaults; the engine refuses generation on an encoder; the workers
pick the runner (paged decoder or whole-prompt encoder).

* An **encoder** (BERT family: bidirectional attention, no LM head) only embeds.
* A **decoder** generates and embeds.

Pooling defaults come from sentence-transformers' files when the checkpoint has them:
``modules.json`` lists the modules in order (Transformer -> Pooling -> [Normalize]); the Pooling
module's ``config.json`` says which pooling mode is on, and a Normalize module means the vectors
are L2-normalized. Without those files a decoder pools its last token and an encoder its first
([CLS]) token (vLLM's defaults), normalized. Other sentence-transformers modules (Dense, ...)
would change the vectors and are not implemented: such a checkpoint is refused at start-up
rather than served with embeddings that differ from the reference.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from switchboard.wire.engine_msgs import PoolingType

ENCODER_ARCHITECTURES = frozenset({"BertModel"})
ENCODER_MODEL_TYPES = frozenset({"bert"})

ST_MODULES_FILE = "modules.json"
_ST_TRANSFORMER = "sentence_transformers.models.Transformer"
_ST_POOLING = "sentence_transformers.models.Pooling"
_ST_NORMALIZE = "sentence_transformers.models.Normalize"
# sentence-transformers' Pooling config key -> our pooling type
_ST_POOLING_MODES = {
    "pooling_mode_cls_token": PoolingType.CLS,
    "pooling_mode_mean_tokens": PoolingType.MEAN,
    "pooling_mode_max_tokens": PoolingType.MAX,
    "pooling_mode_mean_sqrt_len_tokens": PoolingType.MEAN_SQRT_LEN,
    "pooling_mode_lasttoken": PoolingType.LAST,
}
_ST_UNSUPPORTED_MODES = ("pooling_mode_weightedmean_tokens",)


@dataclasses.dataclass(frozen=True)
class ModelTasks:
    encoder_only: bool = False
    pooling_type: PoolingType = PoolingType.LAST  # the default of Embed requests
    normalize: bool = True  # the default of Embed requests
    hidden_size: int = 0  # length of a pooled vector before any ``dimensions`` truncation

    @property
    def can_generate(self) -> bool:
        return not self.encoder_only


def is_encoder_config(raw_config: dict[str, Any]) -> bool:
    architectures = raw_config.get("architectures") or []
    if architectures:
        return architectures[0] in ENCODER_ARCHITECTURES
    return raw_config.get("model_type", "") in ENCODER_MODEL_TYPES


def read_model_tasks(model_dir: str) -> ModelTasks:
    """Raises ValueError for sentence-transformers files that cannot be honoured."""
    raw = _read_json(os.path.join(model_dir, "config.json")) or {}
    encoder_only = is_encoder_config(raw)
    hidden_size = int(raw.get("hidden_size") or raw.get("n_embd") or 0)
    default = PoolingType.CLS if encoder_only else PoolingType.LAST
    modules = _read_json(os.path.join(model_dir, ST_MODULES_FILE))
    if modules is None:
        return ModelTasks(encoder_only, default, True, hidden_size)
    pooling_type, normalize = _read_sentence_transformers(model_dir, modules, default)
    return ModelTasks(encoder_only, pooling_type, normalize, hidden_size)


def _read_sentence_transformers(
    model_dir: str, modules: Any, default: PoolingType
) -> tuple[PoolingType, bool]:
    if not isinstance(modules, list):
        raise ValueError(f"{ST_MODULES_FILE} in {model_dir!r} is not a list of modules")
    pooling_type, normalize = default, False
    for module in modules:
        kind = module.get("type", "")
        if kind == _ST_TRANSFORMER:
            continue
        if kind == _ST_NORMALIZE:
            normalize = True
        elif kind == _ST_POOLING:
            path = os.path.join(model_dir, module.get("path", ""), "config.json")
            pooling_type = _pooling_mode(path, _read_json(path) or {}, default)
        else:
            raise ValueError(
                f"{model_dir!r}: sentence-transformers module {kind!r} is not supported "
                "(supported: Transformer, Pooling, Normalize)"
            )
    return pooling_type, normalize


def _pooling_mode(path: str, config: dict[str, Any], default: PoolingType) -> PoolingType:
    enabled = [key for key in (*_ST_POOLING_MODES, *_ST_UNSUPPORTED_MODES) if config.get(key)]
    if not enabled:
        return default
    if len(enabled) > 1 or enabled[0] in _ST_UNSUPPORTED_MODES:
        raise ValueError(
            f"{path}: pooling {' + '.join(enabled)} is not supported (one of "
            f"{', '.join(_ST_POOLING_MODES)})"
        )
    return _ST_POOLING_MODES[enabled[0]]


def _read_json(path: str) -> Any:
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)
