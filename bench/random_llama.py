"""The random-weight models of bench/vs_vllm.py (``--make-models DIR``): DIR/tiny-llama (4
layers, hidden 256) and DIR/llama-100m (12 layers, hidden 768), seeded fp32 Llamas with a
byte-level BPE tokenizer of 16000 ids trained on the standard library's sources, so that both
servers load the same small checkpoints without a download.

Not run by itself.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast


def make_models(root: Path, max_positions: int, vocab_size: int = 16000) -> None:
    """root/tiny-llama and root/llama-100m: random-weight Llamas (fp32 safetensors, seeded) with
    a byte-level BPE tokenizer trained on the standard library's sources; both take prompts of up
    to ``max_positions`` tokens."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])

    def texts(limit: int = 12_000_000):
        total = 0
        for path in sorted(stdlib.rglob("*.py")):
            parts = path.relative_to(stdlib).parts
            if "site-packages" in parts or any(p.startswith(("test", "idle")) for p in parts):
                continue
            try:
                text = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            yield text
            total += len(text)
            if total >= limit:
                return

    specials = ["<unk>", "<s>", "</s>", "<pad>"]  # ids 0..3
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts(), trainer=trainer)
    assert [tok.token_to_id(s) for s in specials] == [0, 1, 2, 3]
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        model_max_length=max_positions,
    )
    # name: seed, hidden, intermediate, layers, heads, KV heads
    specs = {"tiny-llama": (0, 256, 688, 4, 8, 4), "llama-100m": (1, 768, 2048, 12, 12, 4)}
    for name, (seed, hidden, intermediate, layers, heads, kv_heads) in specs.items():
        torch.manual_seed(seed)
        config = LlamaConfig(
            vocab_size=tok.get_vocab_size(),
            max_position_embeddings=max_positions,
            rms_norm_eps=1e-5,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=3,
            tie_word_embeddings=False,
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
        )
        model = LlamaForCausalLM(config).to(torch.float32).eval()
        out = root / name
        model.save_pretrained(out, safe_serialization=True)
        hf_tok.save_pretrained(out)
        params = sum(p.numel() for p in model.parameters()) / 1e6
        print(f"{name}: {params:.1f}M parameters -> {out}", flush=True)
