"""Wire 2 transport: a shared-memory broadcast ring, one writer (engine core), N readers (workers).

Layout of the one POSIX shared-memory segment (``RingHandle.shm_name``, under ``/dev/shm``)::

    0           B           (C-1)B        C*B           C*B+C*(1+N)   ... +N*8
    |<- chunk 0 ->| ... |<- chunk C-1 ->|<- flags --->|<- reader pids ->|<- sleep ->|
    +-------------+-----+---------------+-------------+-----------------+-----------+
    | hdr|payload | ... | hdr|payload   | F0 | F1 ...| pid0 | pid1 | ...| S0 S1 ... |
    +-------------+-----+---------------+-------------+-----------------+-----------+
    C = max_chunks, B = max_chunk_bytes, N = n_readers

    chunk header, 16 bytes little-endian:  [overflow u8][7 bytes pad][length u64][payload ...]
        overflow 0: the message is the `length` payload bytes that follow the header;
        overflow 1: the message (`length` bytes) travels on the ZeroMQ side channel
                    (``ring_notify``); the chunk only marks its place, so order is kept.
    flag record Fi, 1 + N bytes:  [written | read0 | read1 | ... | read(N-1)]
    reader pid table, N x int64 little-endian: each reader writes its pid when it attaches and
        0 when it closes; only read by the writer, to say who holds the ring (warning below).
    sleep flags, N bytes: reader r's is 1 while it sleeps on the notify socket (below).

States of one chunk's flag record (N = 3; the segment starts all zero):

    written read0 read1 read2
       0      x     x     x     free: being (re)written, or never written; no reader touches it
       1      0     0     0     published: every reader may read it
       1      1     0     1     partly read: reader 1 has yet to read it
       1      1     1     1     read by all: free again

    writer:   free or read-by-all
                --(1) written=0 (2) header + payload (3) read flags=0 (4) written=1--> published
    reader r: written==1 and read_r==0 --(copy the payload out)--> read_r=1 (no other byte)

Every reader walks the chunks in the same order as the writer, so each sees every message once
and in order. The writer never passes a reader by a whole lap: it reuses chunk i only after every
reader set its flag there. There are no locks.

Waiting. A reader first spins for ``READER_SPIN_S`` (os.sched_yield between looks at the flags),
then sleeps on the notify socket (one byte published per enqueue that finds a reader asleep,
conflated), waking at least every ``NOTIFY_RECHECK_S`` so that a lost notification costs bounded
latency, never a hang. A reader sets its sleep flag before its last look at the chunk flags and
the writer reads the sleep flags after publishing, a fence between each store and the load that
follows: one of the two sees the other. A busy reader (the next step already on the ring when
it finishes one) is then sent nothing, and no thread in either process wakes for it. On CPUs
other than x86-64, whose fences here are not formally full barriers, every enqueue notifies. An
idle reader therefore costs a few wake-ups a second, not a core (vLLM spins for 1 s after each
message). A writer facing a full ring spins briefly, then sleeps with exponential back-off up to
``WRITER_MAX_SLEEP_S``; after ``warn_after_s`` it logs a WARNING naming each reader (rank, pid)
that has not read the chunk it needs, and repeats that every ``warn_after_s``.

Memory ordering. Flags and payload are plain byte stores through ``memoryview``s. What we rely
on: (a) CPython executes the stores of one thread in program order -- the payload copy (one
memcpy) completes in an earlier bytecode than the flag stores, and the read flags are reset
before ``written`` is set; (b) the hardware keeps store->store and load->load order as seen by
another core, which x86-64 (TSO) guarantees. On weakly ordered CPUs we add the same cheap
"fence" as vLLM, a lock acquire+release (``memory_fence``), between payload and flags on both
sides; glibc implements these with atomic read-modify-write instructions, which order memory
in practice but are not a formal full barrier. A formal guarantee would need a C extension with
real acquire/release atomics. Each reader writes only its own flag byte, so no two processes
ever store to the same byte concurrently.

One thread per writer or reader object. Readers attach without registering the segment with
multiprocessing's resource_tracker: only the writer unlinks it (``close``), and the writer's
tracker unlinks it should the writer die without closing.
"""

from __future__ import annotations

import logging
import os
import platform
import secrets
import time

import msgspec

from switchboard.config import ipc_address
from switchboard.wire.ring_notify import ReaderSockets, WriterSockets
from switchboard.wire.ring_segment import (
    CHUNK_HEADER,
    Buffer,
    SegmentLayout,
    as_bytes_view,
    attach_untracked,
    create_segment,
    describe_pid,
    memory_fence,
    segment_bytes,
)

logger = logging.getLogger(__name__)

# How long an idle reader spins (sched_yield between looks) before it sleeps on the notify socket.
READER_SPIN_S = 100e-6
# The longest a sleeping reader goes without looking at the flags (recovers a lost notification).
NOTIFY_RECHECK_S = 0.25
# A writer facing a full ring spins this long, then sleeps from MIN, doubling up to MAX.
WRITER_SPIN_S = 100e-6
WRITER_MIN_SLEEP_S = 20e-6
WRITER_MAX_SLEEP_S = 1e-3
# Where memory_fence is not a full barrier (the sleep flags need store -> load order), the
# writer notifies on every enqueue instead of only when a reader sleeps.
NOTIFY_EVERY_ENQUEUE = platform.machine().lower() not in ("x86_64", "amd64")


def segment_prefix(writer_pid: int) -> str:
    """Every ring segment a process creates is named with this prefix and a random token."""
    return f"sb_ring_{writer_pid}_"


def unlink_orphaned_segments(writer_pid: int, shm_dir: str = "/dev/shm") -> list[str]:
    """Unlink the segments of a writer that died without closing its rings (kill -9).

    Only for a supervisor that knows ``writer_pid`` is gone; returns the names removed."""
    removed: list[str] = []
    prefix = segment_prefix(writer_pid)
    try:
        names = [n for n in os.listdir(shm_dir) if n.startswith(prefix)]
    except FileNotFoundError:
        return removed
    for name in names:
        try:
            os.unlink(os.path.join(shm_dir, name))
            removed.append(name)
        except FileNotFoundError:
            pass
    return removed


class RingHandle(msgspec.Struct, frozen=True, array_like=True):
    """Everything a reader needs to attach; travels as msgpack/JSON to the worker processes."""

    shm_name: str
    n_readers: int
    max_chunks: int
    max_chunk_bytes: int
    notify_address: str
    side_channel_address: str


def _layout(handle: RingHandle, buf: memoryview | None) -> SegmentLayout:
    """The layout over a segment's buffer (``SharedMemory.buf``: None only once closed)."""
    if buf is None:
        raise ValueError(f"shm ring {handle.shm_name} is closed")
    return SegmentLayout(buf, handle.n_readers, handle.max_chunks, handle.max_chunk_bytes)


class ShmRingWriter:
    """Broadcasts byte messages to ``n_readers`` readers; the engine core's end of wire 2."""

    def __init__(
        self,
        n_readers: int,
        run_dir: str,
        *,
        max_chunks: int = 10,
        max_chunk_bytes: int = 16 * 1024 * 1024,
        warn_after_s: float = 60.0,
    ) -> None:
        if n_readers < 1 or max_chunks < 1 or max_chunk_bytes <= CHUNK_HEADER.size:
            raise ValueError(
                f"need n_readers >= 1, max_chunks >= 1, max_chunk_bytes > {CHUNK_HEADER.size}"
            )
        self._warn_after_s = warn_after_s
        token = secrets.token_hex(4)
        size = segment_bytes(n_readers, max_chunks, max_chunk_bytes)
        os.makedirs(run_dir, exist_ok=True)
        notify_address = ipc_address(run_dir, f"ring-{token}-notify")
        side_address = ipc_address(run_dir, f"ring-{token}-side")
        self._shm = create_segment(f"{segment_prefix(os.getpid())}{token}", size)
        try:
            self._sockets = WriterSockets(notify_address, side_address)
        except BaseException:
            self._shm.close()
            self._shm.unlink()
            raise
        self._handle = RingHandle(
            self._shm.name, n_readers, max_chunks, max_chunk_bytes, notify_address, side_address
        )
        self._layout = _layout(self._handle, self._shm.buf)
        self._all_read = b"\x01" * n_readers
        self._no_reads = bytes(n_readers)
        self._all_awake = bytes(n_readers)
        self._index = 0
        self._closed = False
        logger.info(
            "shm ring %s: %d readers, %d chunks x %d bytes; notify %s, side channel %s",
            self._shm.name,
            n_readers,
            max_chunks,
            max_chunk_bytes,
            notify_address,
            side_address,
        )

    @property
    def handle(self) -> RingHandle:
        return self._handle

    def __enter__(self) -> ShmRingWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def wait_for_readers(self, timeout: float) -> None:
        """Return once every reader attached and both sockets see its subscription."""
        deadline = time.monotonic() + timeout
        subscribed = self._sockets.wait_for_subscribers(self._handle.n_readers, deadline)
        missing = [r for r in range(self._handle.n_readers) if self._layout.pid(r) == 0]
        while missing and time.monotonic() < deadline:
            time.sleep(0.001)
            missing = [r for r in missing if self._layout.pid(r) == 0]
        if not subscribed or missing:
            raise TimeoutError(
                f"shm ring {self._handle.shm_name}: readers not ready after {timeout:.1f} s "
                f"(not attached: ranks {missing}; all subscribed: {subscribed})"
            )
        logger.info("shm ring %s: all %d readers ready", self._shm.name, self._handle.n_readers)

    def enqueue(self, data: Buffer, timeout: float | None = None) -> None:
        """Broadcast one message; blocks while the next chunk is unread (TimeoutError)."""
        if self._closed:
            raise RuntimeError("enqueue on a closed shm ring")
        view = as_bytes_view(data)
        layout = self._layout
        index = self._index
        self._wait_writable(index, None if timeout is None else time.monotonic() + timeout)
        written_at = index * layout.record_bytes
        chunk_at = index * layout.chunk_bytes
        layout.flags[written_at] = 0
        if view.nbytes <= layout.max_payload:
            CHUNK_HEADER.pack_into(layout.buf, chunk_at, 0, view.nbytes)
            payload_at = chunk_at + CHUNK_HEADER.size
            layout.buf[payload_at : payload_at + view.nbytes] = view
        else:
            CHUNK_HEADER.pack_into(layout.buf, chunk_at, 1, view.nbytes)
            self._sockets.send_large(data if isinstance(data, bytes) else view)
        memory_fence()
        layout.flags[written_at + 1 : written_at + layout.record_bytes] = self._no_reads
        memory_fence()
        layout.flags[written_at] = 1
        if NOTIFY_EVERY_ENQUEUE:
            self._sockets.notify()
        else:
            memory_fence()  # published before the sleep flags are read ("Waiting" above)
            if layout.sleeping != self._all_awake:
                self._sockets.notify()
        self._index = (index + 1) % layout.max_chunks

    def _writable(self, index: int) -> bool:
        flags = self._layout.flags
        at = index * self._layout.record_bytes
        return flags[at] == 0 or flags[at + 1 : at + self._layout.record_bytes] == self._all_read

    def _wait_writable(self, index: int, deadline: float | None) -> None:
        if self._writable(index):
            return
        started = time.monotonic()
        spin_until = started + WRITER_SPIN_S
        next_warning = started + self._warn_after_s
        sleep_s = WRITER_MIN_SLEEP_S
        while not self._writable(index):
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise TimeoutError(
                    f"shm ring {self._handle.shm_name}: no free chunk within the timeout; "
                    f"held by {self._holders(index)}"
                )
            if now >= next_warning:
                logger.warning(
                    "shm ring %s: no free chunk for %.1f s; chunk %d is held by %s",
                    self._handle.shm_name,
                    now - started,
                    index,
                    self._holders(index),
                )
                next_warning += self._warn_after_s
            if now < spin_until:
                os.sched_yield()
            else:
                time.sleep(sleep_s)
                sleep_s = min(2 * sleep_s, WRITER_MAX_SLEEP_S)

    def _holders(self, index: int) -> str:
        at = index * self._layout.record_bytes + 1
        ranks = [r for r in range(self._handle.n_readers) if self._layout.flags[at + r] == 0]
        return ", ".join(f"reader rank {r} ({describe_pid(self._layout.pid(r))})" for r in ranks)

    def close(self) -> None:
        """Unlink the segment and close the sockets; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._layout.release()
        self._shm.close()
        try:
            self._shm.unlink()
        except FileNotFoundError:
            pass
        self._sockets.close()
        logger.info("shm ring %s: closed and unlinked", self._handle.shm_name)


class ShmRingReader:
    """Receives every message the writer broadcasts, in order; a worker's end of wire 2."""

    def __init__(self, handle: RingHandle, rank: int) -> None:
        if not 0 <= rank < handle.n_readers:
            raise ValueError(f"reader rank {rank} out of range for {handle.n_readers} readers")
        self._handle = handle
        self._rank = rank
        self._shm = attach_untracked(handle.shm_name)
        expected = segment_bytes(handle.n_readers, handle.max_chunks, handle.max_chunk_bytes)
        if self._shm.size < expected:
            self._shm.close()
            raise ValueError(f"shm ring {handle.shm_name} is smaller than its handle says")
        self._layout = _layout(handle, self._shm.buf)
        self._layout.set_pid(rank, os.getpid())  # before subscribing: the writer waits for both
        self._sockets = ReaderSockets(handle.notify_address, handle.side_channel_address)
        self._index = 0
        self._closed = False
        logger.debug("shm ring %s: reader rank %d attached", handle.shm_name, rank)

    def __enter__(self) -> ShmRingReader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def dequeue(self, timeout: float | None = None) -> bytes:
        """The next message (a copy: the chunk is reused); TimeoutError after ``timeout`` s."""
        if self._closed:
            raise RuntimeError("dequeue on a closed shm ring reader")
        deadline = None if timeout is None else time.monotonic() + timeout
        if self._readable():
            self._sockets.drain_if_due()
        else:
            self._wait_readable(deadline)
        return self._read(deadline)

    def _readable(self) -> bool:
        flags = self._layout.flags
        at = self._index * self._layout.record_bytes
        return flags[at] == 1 and flags[at + 1 + self._rank] == 0

    def _wait_readable(self, deadline: float | None) -> None:
        spin_until = time.monotonic() + READER_SPIN_S
        while time.monotonic() < spin_until:
            os.sched_yield()
            if self._readable():
                return
        sleeping = self._layout.sleeping
        sleeping[self._rank] = 1
        memory_fence()  # the flag is set before the last look: the writer sees one or the other
        try:
            self._sleep_until_readable(deadline)
        finally:
            sleeping[self._rank] = 0

    def _sleep_until_readable(self, deadline: float | None) -> None:
        while True:
            # Drop stale wake-ups, then look once more: a notification for anything published
            # after this look is still pending when we sleep, so none is lost.
            self._sockets.drain_notifications()
            if self._readable():
                return
            wait_s = NOTIFY_RECHECK_S
            if deadline is not None:
                wait_s = min(wait_s, deadline - time.monotonic())
                if wait_s <= 0:
                    raise TimeoutError(
                        f"shm ring {self._handle.shm_name}: reader rank {self._rank} got no "
                        "message within the timeout"
                    )
            self._sockets.wait_for_notification(wait_s)
            if self._readable():  # the usual wake-up: no need to drain first
                return

    def _read(self, deadline: float | None) -> bytes:
        layout = self._layout
        chunk_at = self._index * layout.chunk_bytes
        memory_fence()  # the flags were seen set; now look at the payload
        overflow, length = CHUNK_HEADER.unpack_from(layout.buf, chunk_at)
        if overflow:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            data = self._sockets.recv_large(remaining)
            if data is None:  # the chunk stays unread: the next dequeue picks it up again
                raise TimeoutError(
                    f"shm ring {self._handle.shm_name}: side-channel message did not arrive"
                )
            if len(data) != length:
                raise RuntimeError(f"side-channel message has {len(data)} bytes, not {length}")
        elif length > layout.max_payload:
            raise RuntimeError(f"corrupt chunk header: length {length} > {layout.max_payload}")
        else:
            payload_at = chunk_at + CHUNK_HEADER.size
            data = bytes(layout.buf[payload_at : payload_at + length])
        memory_fence()  # the copy is complete before the writer may see the chunk as free
        layout.flags[self._index * layout.record_bytes + 1 + self._rank] = 1
        self._index = (self._index + 1) % layout.max_chunks
        return data

    def close(self) -> None:
        """Detach (never unlinks: that is the writer's job); idempotent."""
        if self._closed:
            return
        self._closed = True
        self._layout.set_pid(self._rank, 0)
        self._layout.release()
        self._shm.close()
        self._sockets.close()
