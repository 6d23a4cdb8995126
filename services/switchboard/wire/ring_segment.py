"""Wire 2 transport, the shared-memory half of the ring: the segment, its layout, and fences.

The layout and the flag protocol are drawn in ``shm_ring``'s module docstring; this module only
computes the offsets, creates or attaches the segment, and hands out views onto it.
"""

from __future__ import annotations

import logging
import os
import struct
import sys
import threading
from multiprocessing import resource_tracker, shared_memory

logger = logging.getLogger(__name__)

Buffer = bytes | bytearray | memoryview

CHUNK_HEADER = struct.Struct("<B7xQ")  # overflow flag, 7 pad bytes, payload length
_PID = struct.Struct("<q")

_fence_lock = threading.Lock()
_attach_lock = threading.Lock()


def memory_fence() -> None:
    """See "Memory ordering" in ``shm_ring``: an atomic RMW pair, not a formal full barrier."""
    _fence_lock.acquire()
    _fence_lock.release()


def segment_bytes(n_readers: int, max_chunks: int, max_chunk_bytes: int) -> int:
    return max_chunks * (max_chunk_bytes + 1 + n_readers) + n_readers * (_PID.size + 1)


class SegmentLayout:
    """Offsets into the segment and views onto its four regions: chunks, flags, reader pids
    and the readers' sleep flags."""

    def __init__(self, buf: memoryview, n_readers: int, max_chunks: int, chunk_bytes: int) -> None:
        self.n_readers = n_readers
        self.max_chunks = max_chunks
        self.chunk_bytes = chunk_bytes
        self.max_payload = chunk_bytes - CHUNK_HEADER.size
        self.record_bytes = 1 + n_readers  # [written | read0 | read1 | ...]
        flags_at = max_chunks * chunk_bytes
        pids_at = flags_at + max_chunks * self.record_bytes
        self.buf = buf
        self.flags = buf[flags_at:pids_at]
        sleeping_at = pids_at + n_readers * _PID.size
        self.pids = buf[pids_at:sleeping_at]
        self.sleeping = buf[sleeping_at : sleeping_at + n_readers]  # 1: asleep on the notify

    def pid(self, rank: int) -> int:
        pid: int = _PID.unpack_from(self.pids, rank * _PID.size)[0]
        return pid

    def set_pid(self, rank: int, pid: int) -> None:
        _PID.pack_into(self.pids, rank * _PID.size, pid)

    def release(self) -> None:
        """Drop the views; SharedMemory.close() refuses while any is alive."""
        for view in (self.flags, self.pids, self.sleeping, self.buf):
            view.release()


def as_bytes_view(data: Buffer) -> memoryview:
    view = memoryview(data)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def describe_pid(pid: int) -> str:
    """How a reader's recorded pid reads in a log line."""
    if pid == 0:
        return "not attached"
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return f"pid {pid}, not running"
    except PermissionError:
        pass
    return f"pid {pid}"


def create_segment(name: str, size: int) -> shared_memory.SharedMemory:
    """Create (zero-filled) and register with resource_tracker, which unlinks it if we die."""
    _warn_if_no_room(size)
    return shared_memory.SharedMemory(name=name, create=True, size=size)


def attach_untracked(name: str) -> shared_memory.SharedMemory:
    """Attach without registering with resource_tracker, which would unlink it at our exit."""
    if sys.version_info >= (3, 13):
        return shared_memory.SharedMemory(name=name, track=False)
    original = resource_tracker.register
    with _attach_lock:  # serialise the patch among this process's threads
        resource_tracker.register = lambda *args, **kwargs: None
        try:
            return shared_memory.SharedMemory(name=name)
        finally:
            resource_tracker.register = original


def _warn_if_no_room(size: int) -> None:
    """tmpfs pages are allocated on first touch: a full /dev/shm means SIGBUS, not an error."""
    try:
        stat = os.statvfs("/dev/shm")
    except OSError:
        return
    free = stat.f_bavail * stat.f_frsize
    if free < size:
        logger.warning(
            "/dev/shm has %d MiB free but the ring may grow to %d MiB: a full /dev/shm kills a "
            "process with SIGBUS; enlarge it or lower max_chunks/max_chunk_bytes",
            free >> 20,
            size >> 20,
        )
