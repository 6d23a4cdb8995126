"""Tiny LoRA adapters for the tiny checkpoints, written by ``peft`` itself.

``tiny_lora_dir(base_dir, rank=8, ...)`` wraps the base checkpoint with ``peft``'s
``get_peft_model``, fills every ``lora_A`` *and* ``lora_B`` with seeded random values (peft
starts ``B`` at zero, which would make an adapter a no-op and a test of it meaningless) and
saves the adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``) the way
a fine-tuning run does. Built once per process per set of arguments.
"""

from __future__ import annotations

from typing import Any

import torch

from tests.tiny_checkpoint import _build_once

ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_tiny_lora(
    path: str,
    base_dir: str,
    *,
    rank: int = 8,
    alpha: float = 16.0,
    targets: list[str] | None = None,
    use_rslora: bool = False,
    seed: int = 0,
    spread: float = 0.2,
) -> str:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=list(targets or ALL_PROJECTIONS),
        use_rslora=use_rslora,
        lora_dropout=0.0,
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(base, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * spread)
    model.save_pretrained(path)
    return path


def tiny_lora_dir(base_dir: str, **kwargs: Any) -> str:
    return _build_once(
        "tiny-lora", [base_dir, kwargs], lambda path: make_tiny_lora(path, base_dir, **kwargs)
    )


def load_peft_reference(base_dir: str, adapters: dict[str, str]):
    """transformers' model of ``base_dir`` with every adapter of ``adapters`` (name -> dir)
    loaded by ``PeftModel.from_pretrained`` / ``load_adapter``; ``set_adapter`` picks one and
    ``disable_adapter()`` gives the base model."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    base.generation_config.eos_token_id = None  # compare full lengths; we never stop here
    names = list(adapters)
    model = PeftModel.from_pretrained(base, adapters[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(adapters[name], adapter_name=name)
    return model.eval()


def peft_generate(model, adapter: str, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy tokens of ``adapter`` ("" = the base model, adapters disabled)."""
    input_ids = torch.tensor([prompt])
    kwargs = dict(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=max_tokens,
        do_sample=False,
    )
    with torch.no_grad():
        if not adapter:
            with model.disable_adapter():
                out = model.generate(**kwargs)
        else:
            model.set_adapter(adapter)
            out = model.generate(**kwargs)
    return out[0, len(prompt) :].tolist()
