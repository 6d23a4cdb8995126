"""Panel memory in huge-page-advised chunks: copies hold the bytes, start on a cache line, do not
overlap, and a chunk goes back once the last tensor in it is gone; the memory carries the
advice and starts zeroed."""

from __future__ import annotations

import gc
import mmap
import os
import re
from itertools import pairwise

import pytest
import torch

from switchboard.kernels import huge_pages


def _bytes(n: int, seed: int) -> torch.Tensor:
    return torch.randint(
        0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)
    )


def test_copies_hold_the_bytes_on_cache_lines_without_overlap():
    sources = [_bytes(n, i) for i, n in enumerate((1, 100, 4097, 300_000))]
    copies = [huge_pages.copy_of(s) for s in sources]
    for source, copy in zip(sources, copies, strict=True):
        assert torch.equal(copy, source)
        assert copy.data_ptr() % huge_pages.ALIGN == 0
    spans = sorted((c.data_ptr(), c.data_ptr() + c.numel()) for c in copies)
    assert all(end <= start for (_, end), (start, _) in pairwise(spans))


def test_a_copy_larger_than_a_chunk_gets_its_own():
    source = _bytes(huge_pages.CHUNK_BYTES + 12_345, 7)
    copy = huge_pages.copy_of(source)
    assert torch.equal(copy, source)
    assert copy.data_ptr() % huge_pages.HUGE_PAGE == 0


def test_a_chunk_is_freed_with_its_last_tensor(monkeypatch):
    monkeypatch.setattr(huge_pages, "_arena", huge_pages._Arena())  # none of other tests' panels
    copy = huge_pages.copy_of(_bytes(1000, 3))
    chunk = huge_pages._arena._chunk
    assert chunk is not None and chunk() is not None
    del copy
    gc.collect()
    assert chunk() is None
    again = huge_pages.copy_of(_bytes(1000, 4))  # a new chunk, not the freed one's memory
    assert torch.equal(again, _bytes(1000, 4))


_MAPPING = re.compile(r"([0-9a-f]+)-([0-9a-f]+) ")  # a mapping's first line in smaps


def _mapping_of(address: int) -> list[str]:
    """The lines /proc/self/smaps gives for the mapping holding ``address``."""
    with open("/proc/self/smaps") as f:
        lines = f.read().splitlines()
    starts = [(i, m) for i, line in enumerate(lines) if (m := _MAPPING.match(line))]
    for (i, m), (end, _) in zip(starts, [*starts[1:], (len(lines), None)], strict=True):
        if int(m[1], 16) <= address < int(m[2], 16):
            return lines[i + 1 : end]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="no MADV_HUGEPAGE on this OS")
@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="no /proc/self/smaps")
@pytest.mark.skipif(
    not os.path.exists("/sys/kernel/mm/transparent_hugepage"), reason="a kernel without THP"
)
def test_advised_memory_carries_the_advice_and_starts_zeroed():
    memory = huge_pages.advised_memory(4 << 20)
    data = torch.frombuffer(memory, dtype=torch.uint8)
    flags = next(ln for ln in _mapping_of(data.data_ptr()) if ln.startswith("VmFlags"))
    assert " hg" in flags, flags  # MADV_HUGEPAGE: THP in "madvise" mode gives it huge pages
    assert not data.any()  # untouched memory reads as zeros
