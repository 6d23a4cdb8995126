"""Memory for the quantized weights' panels in transparent huge pages, where Linux offers them.

A decode step at one row streams every panel once (SmolLM2's Q4_1 layers and Q8_0 head: ~96 MB
a token), which in 4 KiB pages is a TLB miss and a page walk every 4 KiB. In 2 MiB pages the
same matmuls took ~15 % less of one thread's time (the 1-row matmuls of SmolLM2's 30 layers,
AMD EPYC with AVX-512, alternated runs: 3.05 -> 2.59 ms). With transparent huge pages on
``madvise`` (a common default) memory gets them only where asked before it is first written,
so the panels are copied into chunks of anonymous memory advised ``MADV_HUGEPAGE``; where the
advice is refused (THP off, another OS) the chunks are plain pages and nothing else differs.
A chunk is freed when the last tensor in it is.
"""

from __future__ import annotations

import mmap
import threading
import weakref

import torch

HUGE_PAGE = 2 << 20
CHUNK_BYTES = 64 << 20
ALIGN = 64  # the kernels' loads are unaligned, but a panel start on a cache line reads fewer


class _Arena:
    """Tensors cut from the current chunk, a new chunk when one does not fit or the last one
    was freed (the arena holds it weakly: weights dropped, their memory goes back)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._chunk: weakref.ref[mmap.mmap] | None = None
        self._used = self._length = 0

    def take(self, size: int) -> torch.Tensor:
        with self._lock:
            memory = self._chunk() if self._chunk is not None else None
            if memory is None or self._used + size > self._length:
                memory, self._used = _new_chunk(size), 0
                self._chunk, self._length = weakref.ref(memory), len(memory) - HUGE_PAGE
            whole = torch.frombuffer(memory, dtype=torch.uint8)  # holds the mapping
            start = -whole.data_ptr() % HUGE_PAGE + self._used
            self._used = -(-(self._used + size) // ALIGN) * ALIGN
            return whole[start : start + size]


def _new_chunk(least: int) -> mmap.mmap:
    """Anonymous memory advised into huge pages, untouched: ``least`` bytes or more, from its
    first huge page boundary on."""
    return advised_memory(max(CHUNK_BYTES, -(-least // HUGE_PAGE) * HUGE_PAGE) + HUGE_PAGE)


def advised_memory(length: int) -> mmap.mmap:
    """``length`` bytes of private anonymous memory, untouched (Linux hands out zeroed pages as
    they are first written), advised into huge pages where the OS takes the advice."""
    # private: shared anonymous memory is shmem, which takes huge pages by another switch
    private = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    memory = mmap.mmap(-1, length, flags=private) if private else mmap.mmap(-1, length)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        try:
            memory.madvise(advice)
        except OSError:
            pass  # THP off: plain pages
    return memory


_arena = _Arena()


def copy_of(data: torch.Tensor) -> torch.Tensor:
    """A copy of the uint8 tensor ``data`` (1-D, contiguous) in huge-page-advised memory."""
    out = _arena.take(data.numel())
    out.copy_(data)
    return out
