"""LoRA under tensor and pipeline parallelism: each rank holds its share of every adapter (A
and B sharded as their base projection is, only its stage's layers), and requests of the base
model and two adapters in the same steps get peft's greedy tokens with TP = 2 x PP = 2, for
Llama, Qwen2 and GPT-2."""

from __future__ import annotations

import pytest

from tests.lora_ranks import generate_with_adapters
from tests.parallel_ranks import PlannedRequest, run_on_ranks
from tests.tiny_checkpoint import tiny_checkpoint_dir
from tests.tiny_lora import load_peft_reference, peft_generate, tiny_lora_dir

pytestmark = pytest.mark.slow

PROMPTS = [[0, 17, 250, 3], [0, *range(40, 63)], [0, 900, 3, 3, 3, 77, 512, 8, 1000, 64, 2]]
ADAPTERS = {
    "all-r8": dict(rank=8, alpha=16.0, seed=21),
    "some-r16": dict(rank=16, alpha=8.0, targets=["k_proj", "o_proj", "gate_proj"], seed=22),
}
GPT2_ADAPTERS = {  # c_attn: one module over the fused q/k/v, each rank's rows of its B
    "all-r8": dict(rank=8, alpha=16.0, targets=["c_attn", "c_proj", "c_fc"], seed=21),
    "some-r16": dict(rank=16, alpha=8.0, targets=["c_attn", "attn.c_proj"], seed=22),
}
MAX_TOKENS = 6


def test_tensor_and_pipeline_parallel_adapters_match_peft() -> None:
    tp, pp = 2, 2
    models = []
    for family in ("llama", "qwen2", "gpt2"):
        model_dir = tiny_checkpoint_dir(family)
        settings = GPT2_ADAPTERS if family == "gpt2" else ADAPTERS
        models.append(
            (model_dir, {n: tiny_lora_dir(model_dir, **kw) for n, kw in settings.items()})
        )
    requests = [
        PlannedRequest(f"{i}/{adapter or 'base'}", prompt, MAX_TOKENS, i, lora_name=adapter)
        for i, prompt in enumerate(PROMPTS)
        for adapter in ["", *ADAPTERS]
    ]
    per_rank = run_on_ranks(generate_with_adapters, tp, pp, models, requests)
    output_rank = (pp - 1) * tp
    for (model_dir, adapters), outputs in zip(models, per_rank[output_rank], strict=True):
        reference = load_peft_reference(model_dir, adapters)
        for request in requests:
            expected = peft_generate(reference, request.lora_name, request.prompt, MAX_TOKENS)
            assert outputs[request.request_id]["tokens"] == expected, (model_dir, request)
