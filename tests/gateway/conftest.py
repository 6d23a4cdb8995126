"""Tokenizers and a checkpoint directory built in the test, with the `tokenizers` library.

Two tokenizer families, both with tiny vocabularies so that multi-byte characters (emoji, CJK)
are split into several byte tokens:
* GPT-2 style byte-level BPE (SmolLM2's kind);
* Llama style: SentencePiece-like "▁" word boundaries, byte-fallback tokens ``<0xNN>``, a
  decoder that strips the leading space, and a BOS added by the post-processor.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HfTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

from switchboard.gateway.text import Tokenizer

CORPUS = [
    "The capital of France is Paris. Hello world! héllo wörld, naïve café",
    "one two three four five six seven eight nine ten END STOP stop",
] * 3
EOS = "<|endoftext|>"
MAX_POSITION_EMBEDDINGS = 64


def build_byte_level_tokenizer() -> HfTokenizer:
    tok = HfTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=[EOS, "<|im_start|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def build_llama_style_tokenizer() -> HfTokenizer:
    tok = HfTokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    tok.train_from_iterator(CORPUS, trainer)
    # Byte-fallback tokens are ordinary vocabulary entries (not special tokens) in Llama's files.
    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    tok = HfTokenizer.from_str(json.dumps(data))
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    return tok


@pytest.fixture(scope="session")
def byte_level_tokenizer() -> Tokenizer:
    return Tokenizer(build_byte_level_tokenizer())


@pytest.fixture(scope="session")
def llama_style_tokenizer() -> Tokenizer:
    return Tokenizer(build_llama_style_tokenizer())


def write_checkpoint_dir(path: Path, tokenizer: HfTokenizer) -> Path:
    """config.json + generation_config.json + tokenizer.json: all a gateway reads (no weights)."""
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path / "tokenizer.json"))
    eos_id = tokenizer.token_to_id(EOS)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": tokenizer.get_vocab_size(),
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "eos_token_id": eos_id,
        "torch_dtype": "float32",
    }
    (path / "config.json").write_text(json.dumps(config))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos_id]}))
    return path


def write_chat_checkpoint_dir(path: Path, chat_template: str) -> Path:
    """The byte-level checkpoint directory, its ``tokenizer_config.json`` holding
    ``chat_template``."""
    path = write_checkpoint_dir(path, build_byte_level_tokenizer())
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": chat_template}))
    return path


@pytest.fixture
def run_dir() -> Iterator[str]:
    """A gateway's run directory for its ipc:// sockets, removed after the test."""
    path = tempfile.mkdtemp(prefix="sbgw-")  # short: ipc:// paths have a length limit
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def checkpoint_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint_dir(tmp_path_factory.mktemp("tiny-model"), build_byte_level_tokenizer())
