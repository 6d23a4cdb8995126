"""What a checkpoint can do and how it pools, read from config.json and sentence-transformers
files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from switchboard.common.model_tasks import read_model_tasks
from switchboard.wire.engine_msgs import PoolingType

_TRANSFORMER = {
    "idx": 0,
    "name": "0",
    "path": "",
    "type": "sentence_transformers.models.Transformer",
}
_POOLING = {
    "idx": 1,
    "name": "1",
    "path": "1_Pooling",
    "type": "sentence_transformers.models.Pooling",
}
_NORMALIZE = {
    "idx": 2,
    "name": "2",
    "path": "2_Normalize",
    "type": "sentence_transformers.models.Normalize",
}


def checkpoint(
    tmp_path: Path, config: dict, modules: list | None = None, pooling: dict | None = None
) -> str:
    (tmp_path / "config.json").write_text(json.dumps(config))
    if modules is not None:
        (tmp_path / "modules.json").write_text(json.dumps(modules))
    if pooling is not None:
        (tmp_path / "1_Pooling").mkdir()
        (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return str(tmp_path)


LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64}
BERT = {"architectures": ["BertModel"], "model_type": "bert", "hidden_size": 32}


def test_a_plain_decoder_generates_and_embeds_with_its_last_token(tmp_path: Path) -> None:
    tasks = read_model_tasks(checkpoint(tmp_path, LLAMA))
    assert tasks.can_generate and not tasks.encoder_only
    assert (tasks.pooling_type, tasks.normalize, tasks.hidden_size) == (PoolingType.LAST, True, 64)


def test_gpt2_names_its_hidden_size_n_embd(tmp_path: Path) -> None:
    config = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 48}
    assert read_model_tasks(checkpoint(tmp_path, config)).hidden_size == 48


def test_a_plain_bert_is_an_encoder_pooling_cls(tmp_path: Path) -> None:
    tasks = read_model_tasks(checkpoint(tmp_path, BERT))
    assert tasks.encoder_only and not tasks.can_generate
    assert tasks.pooling_type == PoolingType.CLS


def test_model_type_decides_without_architectures(tmp_path: Path) -> None:
    assert read_model_tasks(checkpoint(tmp_path, {"model_type": "bert"})).encoder_only


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("pooling_mode_mean_tokens", PoolingType.MEAN),
        ("pooling_mode_cls_token", PoolingType.CLS),
        ("pooling_mode_lasttoken", PoolingType.LAST),
        ("pooling_mode_max_tokens", PoolingType.MAX),
        ("pooling_mode_mean_sqrt_len_tokens", PoolingType.MEAN_SQRT_LEN),
    ],
)
def test_sentence_transformers_pooling_config_wins(tmp_path: Path, mode, expected) -> None:
    path = checkpoint(tmp_path, LLAMA, [_TRANSFORMER, _POOLING], {mode: True})
    tasks = read_model_tasks(path)
    assert tasks.pooling_type == expected
    assert tasks.normalize is False  # no Normalize module
    assert tasks.can_generate  # a decoder with a pooling config still generates


def test_a_normalize_module_means_normalized(tmp_path: Path) -> None:
    modules = [_TRANSFORMER, _POOLING, _NORMALIZE]
    path = checkpoint(tmp_path, BERT, modules, {"pooling_mode_mean_tokens": True})
    tasks = read_model_tasks(path)
    assert (tasks.pooling_type, tasks.normalize) == (PoolingType.MEAN, True)


@pytest.mark.parametrize(
    ("modules", "pooling", "message"),
    [
        (
            [_TRANSFORMER, _POOLING, {"type": "sentence_transformers.models.Dense"}],
            {"pooling_mode_mean_tokens": True},
            "Dense",
        ),
        (
            [_TRANSFORMER, _POOLING],
            {"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": True},
            "not supported",
        ),
        ([_TRANSFORMER, _POOLING], {"pooling_mode_weightedmean_tokens": True}, "weightedmean"),
    ],
)
def test_what_cannot_be_honoured_is_refused(tmp_path: Path, modules, pooling, message) -> None:
    with pytest.raises(ValueError, match=message):
        read_model_tasks(checkpoint(tmp_path, BERT, modules, pooling))
