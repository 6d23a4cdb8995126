"""Wire 2 transport: the shared-memory broadcast ring, with readers in real (spawned) processes."""

from __future__ import annotations

import hashlib
import logging
import multiprocessing as mp
import os
import random
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator

import msgspec
import pytest

from switchboard.wire import shm_ring
from switchboard.wire.shm_ring import RingHandle, ShmRingReader, ShmRingWriter

CTX = mp.get_context("spawn")
# Generous bound for every wait: spawned children import slowly on a loaded 2-core machine.
WAIT_S = 60.0

pytestmark = pytest.mark.slow


def _message(seq: int, size: int) -> bytes:
    return random.Random(seq).randbytes(size)


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _reader_main(
    handle_msgpack: bytes,
    rank: int,
    batches: list[int],
    results: mp.Queue,
    release: mp.Event | None = None,
) -> None:
    """Child process: attach, optionally wait for ``release``, then read each batch and report
    ``(rank, batch index, [sha256 of each message])`` after it."""
    handle = msgspec.msgpack.decode(handle_msgpack, type=RingHandle)
    with ShmRingReader(handle, rank) as reader:
        if release is not None and not release.wait(WAIT_S):
            raise RuntimeError("never released")
        for batch, count in enumerate(batches):
            digests = [_digest(reader.dequeue(timeout=WAIT_S)) for _ in range(count)]
            results.put((rank, batch, digests))


@pytest.fixture
def run_dir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="sbring-")  # short: ipc paths are limited to 107 bytes
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def spawn() -> Iterator[Callable[..., mp.process.BaseProcess]]:
    """Start children with spawn; at teardown, join them and kill (by pid) any still running."""
    started: list[mp.process.BaseProcess] = []

    def start(*args: object) -> mp.process.BaseProcess:
        proc = CTX.Process(target=_reader_main, args=args, daemon=True)
        proc.start()
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=10)


def _collect(results: mp.Queue, n: int) -> dict[tuple[int, int], list[str]]:
    return {
        (rank, batch): digests
        for rank, batch, digests in (results.get(timeout=WAIT_S) for _ in range(n))
    }


def _join_ok(*procs: mp.process.BaseProcess) -> None:
    for proc in procs:
        proc.join(timeout=WAIT_S)
        assert proc.exitcode == 0, f"reader pid {proc.pid} exited with {proc.exitcode}"


def _encode(handle: RingHandle) -> bytes:
    return msgspec.msgpack.encode(handle)


def test_handle_round_trips_through_msgpack_and_json(run_dir: str) -> None:
    with ShmRingWriter(2, run_dir, max_chunks=2, max_chunk_bytes=1024) as writer:
        handle = writer.handle
        assert msgspec.msgpack.decode(_encode(handle), type=RingHandle) == handle
        assert msgspec.json.decode(msgspec.json.encode(handle), type=RingHandle) == handle
        with pytest.raises(ValueError):
            ShmRingReader(handle, 2)


def test_three_readers_receive_the_same_sequence(run_dir: str, spawn) -> None:
    sizes = [random.Random(1000 + i).randrange(0, 30_000) for i in range(300)] + [0]
    with ShmRingWriter(3, run_dir, max_chunks=4, max_chunk_bytes=32 * 1024) as writer:
        results = CTX.Queue()
        procs = [spawn(_encode(writer.handle), rank, [len(sizes)], results) for rank in range(3)]
        writer.wait_for_readers(timeout=WAIT_S)
        expected = []
        for seq, size in enumerate(sizes):
            message = _message(seq, size)
            writer.enqueue(message, timeout=WAIT_S)
            expected.append(_digest(message))
        got = _collect(results, 3)
        _join_ok(*procs)
    for rank in range(3):
        assert got[(rank, 0)] == expected


def test_wrap_around_many_more_messages_than_chunks(run_dir: str, spawn) -> None:
    count = 2000
    with ShmRingWriter(1, run_dir, max_chunks=2, max_chunk_bytes=256) as writer:
        results = CTX.Queue()
        proc = spawn(_encode(writer.handle), 0, [count], results)
        writer.wait_for_readers(timeout=WAIT_S)
        expected = []
        for seq in range(count):
            message = seq.to_bytes(4, "little") + _message(seq, seq % 200)
            writer.enqueue(bytearray(message), timeout=WAIT_S)  # bytearray is accepted too
            expected.append(_digest(message))
        assert _collect(results, 1)[(0, 0)] == expected
        _join_ok(proc)


def test_large_messages_use_side_channel_and_keep_order(run_dir: str, spawn) -> None:
    chunk = 1024
    max_inline = chunk - 16  # the chunk header takes 16 bytes
    sizes = [10, 5000, 20, 0, max_inline, max_inline + 1, 100_000, 30, 70_000, 70_000, 5] * 4
    with ShmRingWriter(2, run_dir, max_chunks=3, max_chunk_bytes=chunk) as writer:
        results = CTX.Queue()
        procs = [spawn(_encode(writer.handle), rank, [len(sizes)], results) for rank in range(2)]
        writer.wait_for_readers(timeout=WAIT_S)
        expected = []
        for seq, size in enumerate(sizes):
            message = _message(seq, size)
            # A memoryview of a large message exercises the side channel's copying path.
            writer.enqueue(memoryview(message) if seq % 2 else message, timeout=WAIT_S)
            expected.append(_digest(message))
        got = _collect(results, 2)
        _join_ok(*procs)
    assert got[(0, 0)] == expected
    assert got[(1, 0)] == expected


def test_slow_reader_holds_writer_back_without_disturbing_fast_readers(run_dir: str, spawn) -> None:
    chunks = 4
    with ShmRingWriter(3, run_dir, max_chunks=chunks, max_chunk_bytes=4096) as writer:
        results = CTX.Queue()
        release = CTX.Event()
        handle = _encode(writer.handle)
        fast = [spawn(handle, rank, [chunks, 1], results) for rank in (0, 1)]
        slow = spawn(handle, 2, [chunks + 1], results, release)
        writer.wait_for_readers(timeout=WAIT_S)
        messages = [_message(seq, 1000 + seq) for seq in range(chunks + 1)]
        expected = [_digest(m) for m in messages]
        for message in messages[:chunks]:
            writer.enqueue(message, timeout=WAIT_S)
        first = _collect(results, 2)
        assert first == {(0, 0): expected[:chunks], (1, 0): expected[:chunks]}
        with pytest.raises(TimeoutError, match="reader rank 2"):
            writer.enqueue(messages[chunks], timeout=0.3)  # every chunk waits on rank 2
        release.set()
        writer.enqueue(messages[chunks], timeout=WAIT_S)
        rest = _collect(results, 3)
        _join_ok(*fast, slow)
    assert rest == {(0, 1): expected[chunks:], (1, 1): expected[chunks:], (2, 0): expected}


def test_blocked_writer_warns_with_reader_rank_and_pid(
    run_dir: str, spawn, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="switchboard.wire.shm_ring")
    with ShmRingWriter(2, run_dir, max_chunks=2, max_chunk_bytes=1024, warn_after_s=0.05) as writer:
        results = CTX.Queue()
        release = CTX.Event()
        handle = _encode(writer.handle)
        fast = spawn(handle, 0, [2, 1], results)
        slow = spawn(handle, 1, [3], results, release)
        writer.wait_for_readers(timeout=WAIT_S)
        for seq in range(2):
            writer.enqueue(_message(seq, 100), timeout=WAIT_S)
        _collect(results, 1)  # the fast reader has read both chunks
        with pytest.raises(TimeoutError):
            writer.enqueue(_message(2, 100), timeout=2.0)
        release.set()
        writer.enqueue(_message(2, 100), timeout=WAIT_S)
        _collect(results, 2)
        _join_ok(fast, slow)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) >= 2, "the warning repeats every warn_after_s"
    for line in warnings:
        assert f"reader rank 1 (pid {slow.pid})" in line
        assert "reader rank 0" not in line


def test_close_unlinks_segment_and_sockets_but_reader_exit_does_not(run_dir: str, spawn) -> None:
    writer = ShmRingWriter(1, run_dir, max_chunks=2, max_chunk_bytes=1024)
    segment = f"/dev/shm/{writer.handle.shm_name}"
    try:
        results = CTX.Queue()
        proc = spawn(_encode(writer.handle), 0, [1], results)
        writer.wait_for_readers(timeout=WAIT_S)
        writer.enqueue(b"bye", timeout=WAIT_S)
        assert _collect(results, 1)[(0, 0)] == [_digest(b"bye")]
        _join_ok(proc)
        assert os.path.exists(segment), "a reader's exit must not unlink the segment"
    finally:
        writer.close()
    assert not os.path.exists(segment)
    assert os.listdir(run_dir) == [], "the ipc socket files are removed"
    writer.close()  # idempotent
    with pytest.raises(RuntimeError):
        writer.enqueue(b"late")


def test_dequeue_and_wait_for_readers_time_out_and_can_be_retried(run_dir: str) -> None:
    with ShmRingWriter(2, run_dir, max_chunks=2, max_chunk_bytes=1024) as writer:
        with ShmRingReader(writer.handle, 0) as reader:
            with pytest.raises(TimeoutError, match=r"ranks \[1\]"):
                writer.wait_for_readers(timeout=0.3)
            with ShmRingReader(writer.handle, 1) as late_reader:
                # Rank 0's subscription was seen by the first, failed call: it still counts.
                writer.wait_for_readers(timeout=WAIT_S)
                with pytest.raises(TimeoutError):
                    reader.dequeue(timeout=0.2)
                writer.enqueue(b"after the timeout")
                assert reader.dequeue(timeout=WAIT_S) == b"after the timeout"
                assert late_reader.dequeue(timeout=WAIT_S) == b"after the timeout"


def test_an_idle_reader_sleeps_instead_of_spinning(run_dir: str) -> None:
    """vLLM's readers spin for a second after every message; ours wait on a notification once
    a short spin finds nothing. CPU time (not wall time) of the waiting thread tells them apart:
    a spinning reader would burn most of the wait even on a loaded machine."""
    wait_s = 1.5
    with ShmRingWriter(1, run_dir, max_chunks=2, max_chunk_bytes=1024) as writer:
        with ShmRingReader(writer.handle, 0) as reader:
            writer.wait_for_readers(timeout=WAIT_S)
            writer.enqueue(b"one message, then silence")
            assert reader.dequeue(timeout=WAIT_S) == b"one message, then silence"
            cpu_before = time.thread_time()
            with pytest.raises(TimeoutError):
                reader.dequeue(timeout=wait_s)
            cpu_s = time.thread_time() - cpu_before
    assert cpu_s < 0.1 * wait_s, f"an idle reader burned {cpu_s:.3f} s of CPU in {wait_s} s"


def test_only_a_sleeping_reader_is_notified(run_dir: str, monkeypatch) -> None:
    """A reader that finds its next message already published is sent no wake-up (no thread of
    either process wakes for it); one asleep on the notify socket is woken by the next enqueue,
    not by its periodic recheck (made longer than the test's bound here)."""
    monkeypatch.setattr(shm_ring, "NOTIFY_RECHECK_S", 2 * WAIT_S)
    with ShmRingWriter(1, run_dir, max_chunks=4, max_chunk_bytes=1024) as writer:
        with ShmRingReader(writer.handle, 0) as reader:
            writer.wait_for_readers(timeout=WAIT_S)
            sent = []
            notify = writer._sockets.notify
            monkeypatch.setattr(writer._sockets, "notify", lambda: (sent.append(1), notify()))
            for i in range(3):
                writer.enqueue(b"busy %d" % i)
            assert [reader.dequeue(timeout=WAIT_S) for _ in range(3)] == [
                b"busy 0",
                b"busy 1",
                b"busy 2",
            ]
            assert len(sent) == (3 if shm_ring.NOTIFY_EVERY_ENQUEUE else 0)
            got: list[bytes] = []
            waiter = threading.Thread(target=lambda: got.append(reader.dequeue(timeout=WAIT_S)))
            waiter.start()
            deadline = time.monotonic() + WAIT_S
            while writer._layout.sleeping[0] != 1 and time.monotonic() < deadline:
                time.sleep(0.001)
            assert writer._layout.sleeping[0] == 1, "the reader never went to sleep"
            started = time.monotonic()
            writer.enqueue(b"wake up")
            waiter.join(timeout=WAIT_S)
            assert got == [b"wake up"] and time.monotonic() - started < WAIT_S
            assert len(sent) == (4 if shm_ring.NOTIFY_EVERY_ENQUEUE else 1)
            assert writer._layout.sleeping[0] == 0
