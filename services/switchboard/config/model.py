"""The model a server serves: shared by the gateway (tokenizer, chat template) and the engine."""

import os
from typing import Annotated

from switchboard.common.flags import AT_LEAST_1, Flag, Group
from switchboard.config.lora import LoraConfig
from switchboard.config.struct import Config


class ModelConfig(Config, frozen=True):
    model: Annotated[
        str,  # the checkpoint directory (config.json + safetensors + tokenizer.json)
        Flag(
            "a Hugging Face checkpoint directory, a .gguf file, or a Hugging Face model id "
            "(org/name) already in the local Hugging Face cache (HF_HUB_CACHE, HF_HOME; never "
            "downloaded) (default: the built-in SmolLM2-135M-Instruct, converted on first use)",
            Group.MODEL,
            default=None,
        ),
    ]
    served_model_name: Annotated[
        str,
        Flag(
            "the model's name in the API (ListModels, GenerateRequest.model) "
            "(default: the checkpoint directory's name)",
            Group.MODEL,
        ),
    ] = ""
    dtype: Annotated[
        str,
        Flag(
            "weights and activations; auto: float32 on CPU, the checkpoint's dtype on a GPU",
            Group.MODEL,
            choices=("auto", "float32", "bfloat16", "float16"),
        ),
    ] = "auto"
    kv_cache_dtype: Annotated[
        str,
        Flag(
            "the KV cache's dtype; auto: the model's (--dtype); bfloat16 halves the cache's "
            "memory and the bytes decode attention reads (on CPU the attention kernels widen it "
            "to float32 in registers); a dtype other than the model's is CPU-only",
            Group.MODEL,
            choices=("auto", "float32", "bfloat16"),
        ),
    ] = "auto"
    quantization: Annotated[
        str,
        Flag(
            "weights kept quantized for the matmuls on CPU (prefill too with the default "
            "integer dot products; float32 under SWITCHBOARD_QUANT_GEMM=exact); "
            "auto: a checkpoint converted from a .gguf file keeps its blocks (Q8_0, Q4_0, Q4_1, "
            "Q5_0, Q5_1, Q4_K, Q5_K, Q6_K; other types stay float32), any other none; gguf: "
            "those blocks, other types refused; int8: int8 per 32 inputs made at load, any "
            "checkpoint; none: float32",
            Group.MODEL,
            choices=("auto", "none", "gguf", "int8"),
        ),
    ] = "auto"
    max_model_len: Annotated[
        int | None,
        Flag(
            "tokens per request at most, prompt and output together (default: the model's "
            "positions, capped by what the KV cache holds)",
            Group.MODEL,
            accepts=AT_LEAST_1,
        ),
    ] = None
    seed: Annotated[
        int,
        Flag(
            "the workers' torch seed: the draws of requests that set no seed of their own",
            Group.MODEL,
        ),
    ] = 0
    # Read by the gateway only: engines never see chat messages.
    chat_template: Annotated[
        str,
        Flag(
            "a Jinja chat template for GenerateRequest.messages, instead of the checkpoint's "
            "(default: the checkpoint's chat_template.jinja, else tokenizer_config.json's "
            "chat_template; a model with neither refuses messages)",
            Group.CHAT_TEMPLATE,
            metavar="FILE",
            path=True,
        ),
    ] = ""
    lora: LoraConfig = LoraConfig()

    @property
    def name(self) -> str:
        return self.served_model_name or os.path.basename(os.path.normpath(self.model))
