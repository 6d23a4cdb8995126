"""``GetTokenizer``: the checkpoint's tokenizer files as one zip archive, streamed in chunks, so
a router tokenizes and renders chat templates without a copy of the model.

The archive is what the router's tokenizer loader reads from a model directory: the tokenizer
itself, its config and special tokens, the chat template files, and the model's
``config.json`` / ``generation_config.json``. It is built once, in the tokenizer pool (reading
and deflating files must not stall the event loop), and kept: the checkpoint does not change
while the gateway runs. The last chunk carries the SHA-256 of the whole archive.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import zipfile
from collections.abc import Iterator
from pathlib import Path

from smg_grpc_proto.generated import common_pb2

from switchboard.gateway.state import GatewayState

CHUNK_BYTES = 64 * 1024
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.json",
    "chat_template.jinja",
    "config.json",
    "generation_config.json",
)


def build_archive(model_dir: str) -> tuple[bytes, str]:
    """The zip of ``model_dir``'s tokenizer files and its SHA-256 (hex)."""
    directory = Path(model_dir)
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name in TOKENIZER_FILES:
            if (directory / name).is_file():
                archive.write(directory / name, name)
    data = buffer.getvalue()
    return data, hashlib.sha256(data).hexdigest()


def chunks(data: bytes, sha256: str) -> Iterator[common_pb2.GetTokenizerChunk]:
    for offset in range(0, len(data), CHUNK_BYTES):
        end = offset + CHUNK_BYTES
        yield common_pb2.GetTokenizerChunk(
            data=data[offset:end], sha256=sha256 if end >= len(data) else ""
        )


class TokenizerArchive:
    """Built on first use (callers meanwhile share the build), then served from memory."""

    def __init__(self, model_dir: str) -> None:
        self._model_dir = model_dir
        self._built: tuple[bytes, str] | None = None
        self._lock = asyncio.Lock()

    async def get(self, state: GatewayState) -> tuple[bytes, str]:
        async with self._lock:
            if self._built is None:
                self._built = await state.in_pool(build_archive, self._model_dir)
            return self._built
