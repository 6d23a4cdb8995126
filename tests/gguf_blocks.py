"""GGUF block bytes of every type the quantized kernel takes, for tests.

gguf-py quantizes only some types (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1): those come from random
weights through ``gguf.quants.quantize``, as llama.cpp would write them. The K types (Q4_K,
Q5_K, Q6_K, and Q2_K, which the kernel does not take) it can only dequantize: their blocks are
random bytes with their float16 fields set to small random scales, so every value of every bit
field occurs.
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quantize

QUANTIZABLE = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
# byte offsets of each K type's float16 fields (d, and dmin where it has one); the kernel does
# not take Q2_K (a type to see refused)
K_FLOAT16_FIELDS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q2_K": (80, 82)}
KERNEL_TYPES = (*QUANTIZABLE, "Q4_K", "Q5_K", "Q6_K")


def gguf_blocks(
    type_name: str, rows: int, inputs: int, rng: np.random.Generator, spread: float = 1.0
) -> np.ndarray:
    """uint8 ``[rows, bytes per row]``: a ``[rows, inputs]`` weight of GGUF type ``type_name``
    whose values are of about ``spread`` in size."""
    qtype = GGMLQuantizationType[type_name]
    if type_name in QUANTIZABLE:
        weight = (rng.standard_normal((rows, inputs)) * spread).astype(np.float32)
        return quantize(weight, qtype)
    values_per_block, bytes_per_block = GGML_QUANT_SIZES[qtype]
    count = rows * inputs // values_per_block
    blocks = rng.integers(0, 256, size=(count, bytes_per_block), dtype=np.uint8)
    for start in K_FLOAT16_FIELDS[type_name]:
        # |d * sc * q| stays about `spread`: sc and m are 6-bit (int8 for Q6_K), q up to 31
        scale = (rng.uniform(0.5, 1.5, count) * spread / 400).astype(np.float16)
        blocks[:, start : start + 2] = scale.view(np.uint8).reshape(count, 2)
    return blocks.reshape(rows, -1)
