"""Building blocks shared by the model families: norms, embeddings, activations, rotary
embedding, fused linears.

Every layer works on *flattened* tokens: the tokens of all requests in a step are one
``[num_tokens, ...]`` batch, so the linear layers see one big matmul per step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from switchboard.kernels import fused_ops
from switchboard.kernels.gemm import MatmulPanels, linear
from switchboard.models.hf_config import RopeConfig

T = TypeVar("T")


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 like the reference implementation."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = fused_ops.rms_norm(x, self.weight, self.eps)  # float32 on CPU: one C call
        if fused is not None:
            return fused
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # the same arithmetic as below in one op (measured 7 us less per call on CPU,
            # bit-identical results); other dtypes keep the reference's float32 detour
            return torch.rms_norm(x, self.weight.shape, self.weight, self.eps)
        input_dtype = x.dtype
        x32 = x.to(torch.float32)
        variance = x32.pow(2).mean(-1, keepdim=True)
        return self.weight * (x32 * torch.rsqrt(variance + self.eps)).to(input_dtype)


class LayerNorm(nn.Module):
    """Mean-and-variance norm with a bias (GPT-2), computed like ``nn.LayerNorm``."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.bias = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


class VocabEmbedding(nn.Module):
    """Token embedding table, uninitialised: its weights always come from a checkpoint."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(token_ids, self.weight)


class PositionEmbedding(VocabEmbedding):
    """Learned absolute positions (GPT-2): row ``p`` is added to the token at position ``p``."""


class Linear(nn.Module):
    """``y = x W^T + b`` with uninitialised parameters: the checkpoint fills them, so random
    init (seconds for a large model on CPU) would be wasted work."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        # the weight laid out for a small-batch matmul kernel, beside oneDNN's (``prepack.py``;
        # quantized: ``quantized.py``)
        self.small_batch: MatmulPanels | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.small_batch)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}"


class MergedLinear(Linear):
    """One linear layer holding several checkpoint matrices stacked along the output dim.

    ``shards`` names each stacked part and its output size, in order; ``load_shard`` copies
    one checkpoint tensor (weight or bias) into its rows. One matmul replaces several.
    """

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool) -> None:
        super().__init__(in_features, sum(shards.values()), bias=bias)
        self.shard_sizes = dict(shards)
        self.shard_offsets: dict[str, int] = {}
        offset = 0
        for name, size in shards.items():
            self.shard_offsets[name] = offset
            offset += size

    def load_shard(self, shard: str, param_name: str, tensor: torch.Tensor) -> None:
        target = self.weight if param_name == "weight" else self.bias
        if target is None:
            raise ValueError(f"shard {shard!r}: {param_name} of a layer without bias")
        start, size = self.shard_offsets[shard], self.shard_sizes[shard]
        if tensor.shape[0] != size:
            raise ValueError(f"shard {shard!r} has {tensor.shape[0]} rows, expected {size}")
        with torch.no_grad():
            target[start : start + size].copy_(tensor)

    def split(self, output: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return output.split(list(self.shard_sizes.values()), dim=-1)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    fused = fused_ops.silu_and_mul(gate_up)  # float32 on CPU: one C call
    if fused is not None:
        return fused
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


# transformers' ACT2FN names -> the function. gelu_new (GPT-2's) is the tanh approximation.
_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_new": _gelu_tanh,
    "gelu_pytorch_tanh": _gelu_tanh,
    "gelu_fast": _gelu_tanh,
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in _ACTIVATIONS:
        raise ValueError(f"unsupported activation {name!r}; supported: {', '.join(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


def rope_inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Per-pair rotation speeds (float32, ``[head_dim // 2]``), with linear or llama3 scaling."""
    # Explicit device and dtypes: models are built under a default device and (maybe half)
    # default dtype, and these frequencies must be computed exactly as the reference does.
    steps = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu")
    exponents = steps.to(torch.float32) / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.type == "linear":
        return inv_freq / rope.factor
    if rope.type != "llama3":
        return inv_freq
    # Llama 3.1: slow (long-wavelength) pairs are divided by `factor`, fast ones kept, and the
    # band in between interpolated smoothly.
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def on_calling_thread(compute: Callable[[], T]) -> T:
    """``compute()`` with torch's intra-op threads set to one. torch splits a large ``cos`` or
    ``sin`` across its threads (chunks of 2,048 values through MKL), and in some worker
    processes the chunk another thread ran came out different: the cosines of tiny-llama's
    positions 256-511 up to 1e-4 apart from the calling thread's (2 workers of 24 measured), so
    the same request decoded other tokens in another process (a resumed stream diverged from
    its undisturbed run). On the calling thread the values are those a step of one position
    computes, in every process."""
    threads = torch.get_num_threads()
    if threads == 1:
        return compute()
    torch.set_num_threads(1)
    try:
        return compute()
    finally:
        torch.set_num_threads(threads)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding in the "rotate half" layout of Hugging Face checkpoints.

    ``cos``/``sin`` of every position up to ``max_positions`` are computed once, here, and a
    step looks its positions up: computing them per step cost more than the lookup (the
    vectorised cos/sin wakes the whole thread team for a few thousand values). The tables hold
    one half of the head dimension: "rotate half" uses each angle for both halves.
    """

    def __init__(
        self, rope: RopeConfig, head_dim: int, device: torch.device | str, max_positions: int
    ) -> None:
        super().__init__()
        # Plain attributes, not buffers: computed here, never loaded, and kept in float32
        # whatever dtype the model is cast to.
        self.inv_freq = rope_inverse_frequencies(rope, head_dim).to(device)
        positions = torch.arange(max_positions, dtype=torch.float32, device=self.inv_freq.device)
        angles = positions[:, None] * self.inv_freq[None, :]  # the product HF's forward takes
        self.cos_table, self.sin_table = on_calling_thread(lambda: (angles.cos(), angles.sin()))

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """``cos``/``sin`` of shape ``[num_tokens, head_dim // 2]`` for these positions."""
        cos = self.cos_table.index_select(0, positions)
        sin = self.sin_table.index_select(0, positions)
        return cos.to(dtype), sin.to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape ``[num_tokens, heads, head_dim]`` by half-dimension ``cos``/``sin``
    (``RotaryEmbedding.cos_sin``): the same products and sums as HF's
    ``x * cos + rotate_half(x) * sin`` on duplicated angles, so the same floats. Float32 on
    CPU rotates ``x`` in place, in one C call (``kernels/fused_ops.py``), and returns it."""
    if fused_ops.rotary_(x, cos, sin):
        return x
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
