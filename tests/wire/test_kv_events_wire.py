"""The KV-event wire as vLLM's consumers see it: the payload decodes with vLLM's declarations,
endpoints are offset by the DP rank as vLLM offsets them, ``--kv-events-config`` takes vLLM's
JSON, and a subscriber follows a publisher through a lost start and a restart, by replay."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import Coroutine, Iterator
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio

from switchboard import cli
from switchboard.cli import serve
from switchboard.config import KVEventsConfig
from switchboard.engine.kv_event_publisher import KvEventPublisher
from switchboard.wire.kv_event_subscriber import CachedBlocks, KvEventSubscriber
from switchboard.wire.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    encode_batch,
    offset_endpoint,
)

H1, H2, H3 = (bytes([i]) * 32 for i in (1, 2, 3))
FIRST_RUN = 100  # batches pairs before the restart: the restarted stream stays below them


# vLLM's declarations (vllm/distributed/kv_events.py): the batch an array, the events maps
# tagged by class name, later fields with defaults.
class VllmBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class VllmEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class VllmStored(VllmEvent, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None


class VllmRemoved(VllmEvent, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None


class VllmCleared(VllmEvent, tag="AllBlocksCleared"):
    pass


class VllmKVEventBatch(VllmBatch):
    events: list[VllmStored | VllmRemoved | VllmCleared]


def stored(*hashes: bytes, parent: bytes | None = None) -> BlockStored:
    return BlockStored(list(hashes), parent, list(range(2 * len(hashes))), 2, None, "GPU", None)


def test_vllm_declarations_decode_a_batch() -> None:
    batch = KVEventBatch(
        12.5, [AllBlocksCleared(), stored(H1, H2), BlockRemoved([H1], "GPU")], data_parallel_rank=3
    )
    decoded = msgspec.msgpack.decode(encode_batch(batch), type=VllmKVEventBatch)
    assert decoded.ts == 12.5 and decoded.data_parallel_rank == 3
    cleared, store, removed = decoded.events
    assert isinstance(cleared, VllmCleared)
    assert isinstance(store, VllmStored)
    assert (store.block_hashes, store.parent_block_hash, store.block_size) == ([H1, H2], None, 2)
    assert store.token_ids == [0, 1, 2, 3] and store.medium == "GPU"
    assert isinstance(removed, VllmRemoved) and removed.block_hashes == [H1]


def test_endpoints_are_offset_by_the_data_parallel_rank() -> None:
    assert offset_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint("tcp://10.0.0.1:6000", 1) == "tcp://10.0.0.1:6001"
    assert offset_endpoint("ipc:///run/kv", 1) == "ipc:///run/kv_dp1"
    with pytest.raises(ValueError, match="tcp://"):
        offset_endpoint("udp://x:1", 1)


def engine_cache(*flags: str) -> Any:
    args = cli.make_parser().parse_args(["serve", "--model", "/m", *flags])
    return serve.build_configs(args, "/m")[1].cache


def test_the_flag_takes_vllms_json() -> None:
    assert engine_cache().kv_events_config is None
    config = engine_cache(
        "--kv-events-config",
        '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:6000", '
        '"replay_endpoint": "tcp://*:6001", "buffer_steps": 50, "hwm": 10, "topic": "kv"}',
    ).kv_events_config
    assert config.enabled and config.endpoint == "tcp://*:6000"
    assert (config.replay_endpoint, config.buffer_steps, config.topic) == ("tcp://*:6001", 50, "kv")
    assert not KVEventsConfig().enabled  # vLLM's default: off
    assert not KVEventsConfig(enable_kv_cache_events=True, publisher="null").enabled


@pytest.mark.parametrize(
    ("json", "named"),
    [
        ('{"prefix_cache_upload_endpoint": "http://x"}', "prefix_cache_upload_endpoint"),
        ('{"publisher": "kafka"}', "publisher"),
        ('{"endpoint": "udp://x:1"}', "endpoint"),
        ('{"buffer_steps": 0}', "buffer_steps"),
        ("{not json", "JSON"),
    ],
)
def test_what_cannot_be_honoured_is_refused_by_name(
    json: str, named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        engine_cache("--kv-events-config", json)
    error = capsys.readouterr().err
    assert "--kv-events-config" in error and named in error


def test_ports_that_the_ranks_would_share_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    events = '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", "replay_endpoint": '
    parser = cli.make_parser()
    args = ["serve", "--model", "/m", "-dp", "2", "--kv-events-config"]
    clashing = serve.build_configs(parser.parse_args([*args, events + '"tcp://*:5558"}']), "/m")
    with pytest.raises(SystemExit):
        serve.check_kv_events(parser, clashing[1])
    assert "at least 2 apart" in capsys.readouterr().err
    apart = serve.build_configs(parser.parse_args([*args, events + '"tcp://*:5559"}']), "/m")
    serve.check_kv_events(parser, apart[1])


@pytest.fixture
def where() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="sb-kvw-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def events_config(where: str, **fields: Any) -> KVEventsConfig:
    """Events on, published and replayed on sockets under ``where``; ``fields``: more."""
    return KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint=f"ipc://{where}/pub",
        replay_endpoint=f"ipc://{where}/replay",
        **fields,
    )


def run_then_close(
    scenario: Coroutine[Any, Any, None], ctx: zmq.Context, publisher: KvEventPublisher | None = None
) -> None:
    """Run ``scenario``; then, passed or failed, stop ``publisher`` and close ``ctx``."""
    try:
        asyncio.run(scenario)
    finally:
        if publisher is not None:
            publisher.stop()
        ctx.destroy(linger=0)


def test_a_subscriber_follows_a_publisher_through_a_restart(where: str) -> None:
    config = events_config(where)
    ctx = zmq.Context()
    actx = zmq.asyncio.Context.shadow(ctx)

    async def follow(subscriber: KvEventSubscriber, mirror: CachedBlocks, until: int) -> None:
        while subscriber.next_seq < until:
            batches = await subscriber.receive(2.0) or await subscriber.catch_up(until)
            for _, batch in batches:
                mirror.apply(batch)

    async def scenario() -> None:
        first = KvEventPublisher(ctx, config, rank=1)  # rank 1: the _dp1 sockets
        assert first.endpoint.endswith("/pub_dp1")
        first.start()  # batch 0: AllBlocksCleared
        subscriber = KvEventSubscriber(
            actx, first.endpoint, first.replay_endpoint, replay_timeout_s=30
        )
        mirror = CachedBlocks()
        first.publish([stored(H1, H2)])
        for _ in range(FIRST_RUN):
            first.publish([BlockRemoved([H2], "GPU"), stored(H3, parent=H1)])
            first.publish([BlockRemoved([H3], "GPU"), stored(H2, parent=H1)])
        await follow(subscriber, mirror, first.next_seq)
        assert mirror.hashes == {H1, H2}
        first.stop()

        # The engine restarts: numbers from 0 again, and its first batch clears the cache.
        # The subscriber reconnects on its own; the first batch it receives is numbered below
        # where it was, so it replays the new stream from 0.
        second = KvEventPublisher(ctx, config, rank=1)
        second.start()
        received: list[tuple[int, KVEventBatch]] = []
        while not received:
            assert second.next_seq < first.next_seq, "the subscriber never reconnected"
            second.publish([stored(H3)])
            received = await subscriber.receive(1.0)
        for _, batch in received:
            mirror.apply(batch)
        await follow(subscriber, mirror, second.next_seq)
        assert mirror.hashes == {H3}
        assert subscriber.lost_batches == 0
        subscriber.close()
        second.stop()

    run_then_close(scenario(), ctx)


def test_batches_past_the_replay_buffer_are_counted_lost(where: str) -> None:
    config = events_config(where, buffer_steps=2)
    ctx = zmq.Context()
    publisher = KvEventPublisher(ctx, config, rank=0)

    async def scenario() -> None:
        subscriber = KvEventSubscriber(
            zmq.asyncio.Context.shadow(ctx),
            config.endpoint,
            config.replay_endpoint,
            replay_timeout_s=30,
        )
        try:
            publisher.start()  # batch 0
            for hashes in ([H1], [H2], [H3]):
                publisher.publish([stored(*hashes)])
            batches = await subscriber.catch_up(publisher.next_seq)
            assert [seq for seq, _ in batches] == [2, 3]  # all the buffer still holds
            assert subscriber.lost_batches == 2 and subscriber.next_seq == 4
        finally:
            subscriber.close()

    run_then_close(scenario(), ctx, publisher)


def test_follow_probes_for_missed_batches_and_a_snapshot_drops_older_ones(where: str) -> None:
    config = events_config(where)
    ctx = zmq.Context()
    actx = zmq.asyncio.Context.shadow(ctx)
    publisher = KvEventPublisher(ctx, config, rank=0)

    async def next_seq() -> int:
        return publisher.next_seq

    async def scenario() -> None:
        publisher.start()  # batch 0: AllBlocksCleared
        publisher.publish([stored(H1)])  # batch 1: before anyone subscribed
        sent = KvEventSubscriber(actx, config.endpoint, config.replay_endpoint)
        assert len(await sent.catch_up(2)) == 2  # replayable: sent out already
        sent.close()
        follower = KvEventSubscriber(actx, config.endpoint, config.replay_endpoint)
        late = None
        try:
            # No live batch comes to reveal the two it missed: it asks, and replays them.
            mirror = CachedBlocks()
            stream = follower.follow(next_seq, poll_s=0.2)
            while H1 not in mirror.hashes:
                for _, batch in await anext(stream):
                    mirror.apply(batch)
            assert follower.next_seq == 2 and follower.replayed_batches == 2
            await stream.aclose()

            # A consumer that took a snapshot at batch N drops what was queued before it (not
            # an engine restart) and goes on from N.
            late = KvEventSubscriber(actx, config.endpoint, config.replay_endpoint)
            while not await late.receive(0.2):  # until its subscription is surely in place
                publisher.publish([])
            publisher.publish([stored(H2)])  # queued on the socket, and in the snapshot
            late.start_from(publisher.next_seq)
            publisher.publish([stored(H3)])
            received: list[tuple[int, KVEventBatch]] = []
            while not received:
                received = await late.receive(5.0)
            assert [(seq, batch.events) for seq, batch in received] == [
                (publisher.next_seq - 1, [stored(H3)])
            ]
            assert late.lost_batches == 0 and late.next_seq == publisher.next_seq
        finally:
            follower.close()
            if late is not None:
                late.close()

    run_then_close(scenario(), ctx, publisher)
