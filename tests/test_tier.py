"""The object tier: footer codec, and real agents tiering to moto through ZooKeeper manifests."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from kazoo.client import KazooClient

from sdk import Consumer, Producer, TopicPartition
from storage.codec import encode_batch, stamp
from storage.errors import CorruptSegmentError, OffsetOutOfRangeError
from storage.tier import Manifest, SegmentEntry, build_footer, decode_footer, parse_key, segment_key
from tests.cluster import Cluster
from tests.harness import ProcessGroup, S3Target, ZooKeeperChroot

TOPIC = "tiered"


# ---------------------------------------------------------------- footer and manifest (pure)


def _segment(batches: int = 20, base: int = 100) -> bytes:
    out = bytearray()
    offset = base
    for i in range(batches):
        b = bytearray(encode_batch([b"v%d-%d" % (i, j) for j in range(5)]))
        b[:16] = stamp(offset, len(b) - 12, 3)
        out += b
        offset += 5
    return bytes(out)


def test_footer_round_trip_and_index_lookups() -> None:
    data = _segment()
    footer = build_footer(data, interval=256)
    f = decode_footer(data + footer)
    assert (f.base_offset, f.next_offset, f.leader_epoch, f.batch_count) == (100, 200, 3, 20)
    assert f.record_count == 100 and f.data_length == len(data)
    assert len(f.rels) > 1 and f.positions[0] == 0
    for offset in range(100, 200):
        pos = f.position_for_offset(offset)
        assert pos <= len(data)
    # a footer decodes from exactly its own bytes too
    assert decode_footer(footer) == f


def test_footer_torn_corrupt_and_garbage_raise_typed_errors() -> None:
    footer = build_footer(_segment(), interval=128)
    for cut in range(len(footer)):
        with pytest.raises(CorruptSegmentError):
            decode_footer(footer[cut + 1 :])
    for i in range(0, len(footer), 7):
        bad = bytearray(footer)
        bad[i] ^= 0x40
        with pytest.raises(CorruptSegmentError):
            decode_footer(bytes(bad))
    with pytest.raises(CorruptSegmentError):
        decode_footer(footer + b"\0" * 8)  # trailing garbage: the trailer is no longer last


def test_keys_and_manifest() -> None:
    key = segment_key("t", "id", 3, 10, 20, 7)
    assert parse_key(key) == (10, 20, 7)
    assert parse_key("x/y.txt") is None
    m = Manifest()
    m = m.appended(SegmentEntry(0, 10, 1, 500, 400, 1000), 1)
    m = m.appended(SegmentEntry(10, 20, 1, 500, 400, 2000), 2)
    assert Manifest.decode(m.encode()) == m
    assert m.find(15) == m.segments[1] and m.find(20) is None
    t = m.trimmed(1, 2)
    assert (t.start, t.end, len(t.segments)) == (10, 20, 1)
    with pytest.raises(CorruptSegmentError):
        Manifest.decode(b'{"v":1,"epoch":1,"start":0,"end":9,"segs":[[0,10,1,5,4,1]]}')


# ---------------------------------------------------------------- real agents + moto + ZooKeeper


def _agent_configs(s3: S3Target, *extra: str) -> tuple[str, ...]:
    return (
        f"s3.bucket={s3.bucket}",
        "tier.check.interval.ms=100",
        "s3.request.timeout.ms=2000",
        *extra,
    )


def _manifest(zk: KazooClient, topic: str = TOPIC, partition: int = 0) -> Manifest:
    try:
        data, _ = zk.get(f"/topics/{topic}/partitions/{partition}/segments")
    except Exception:
        return Manifest()
    return Manifest.decode(data)


def _wait(what: str, check: Any, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.1)


def _keys(s3: S3Target) -> set[str]:
    out: set[str] = set()
    for page in s3.client.get_paginator("list_objects_v2").paginate(Bucket=s3.bucket):
        out.update(o["Key"] for o in page.get("Contents", []))
    return out


def _values(n: int) -> list[bytes]:
    return [b"message-%08d-" % i + bytes([i % 251]) * (i % 61) for i in range(n)]


async def _produce(bootstrap: str, values: list[bytes]) -> None:
    async with Producer(
        {"bootstrap.servers": bootstrap, "acks": 1, "linger.ms": 5, "batch.size": 32768}
    ) as producer:
        for start in range(0, len(values), 500):
            await producer.send_batch(TOPIC, values[start : start + 500], partition=0)
        await producer.flush()


async def _consume(bootstrap: str, expected: int, reset: str = "earliest") -> list[bytes]:
    out: list[bytes] = []
    config = {"bootstrap.servers": bootstrap, "auto.offset.reset": reset}
    async with Consumer(config) as consumer:
        tp = TopicPartition(TOPIC, 0)
        consumer.assign([tp])
        consumer.seek_to_beginning(tp)
        async with asyncio.timeout(90):
            while len(out) < expected:
                for table in (await consumer.getmany_arrow(timeout_ms=500)).values():
                    out.extend(table.column("value").to_pylist())
    return out


def _cluster(processes: ProcessGroup, zk_chroot: ZooKeeperChroot, tmp_path: Path) -> Cluster:
    return Cluster(processes, zk_chroot, tmp_path / "data")


@pytest.mark.slow
def test_200k_messages_tiered_then_served_from_s3_after_the_disk_is_wiped(
    processes: ProcessGroup,
    zk_chroot: ZooKeeperChroot,
    zk_client: KazooClient,
    s3: S3Target,
    tmp_path: Path,
) -> None:
    cluster = _cluster(processes, zk_chroot, tmp_path)
    env = s3.env()
    cluster.start_agent(1, *_agent_configs(s3), env=env)
    cluster.create_topic(
        TOPIC,
        1,
        configs={"segment.bytes": 256 * 1024, "segment.ms": 1000, "local.retention.ms": 0},
    )
    cluster.wait_for_leaders(TOPIC)
    values = _values(200_000)
    asyncio.run(_produce(cluster.bootstrap, values))

    _wait("every record committed to the tier", lambda: _manifest(zk_client).end == 200_000)
    manifest = _manifest(zk_client)
    assert manifest.start == 0 and 50 <= len(manifest.segments) <= 200
    keys = _keys(s3)
    spec = json.loads(zk_client.get(f"/topics/{TOPIC}")[0])
    committed = {s.key(TOPIC, spec["topic_id"], 0) for s in manifest.segments}
    assert committed <= keys, "a committed segment is missing from the bucket"

    # served from S3 while the agent runs (local retention already dropped the committed files)
    assert asyncio.run(_consume(cluster.bootstrap, 200_000)) == values
    cluster.stop(1)
    shutil.rmtree(tmp_path / "data" / "agent-1")
    cluster.start_agent(1, *_agent_configs(s3), env=env)
    cluster.wait_for_leaders(TOPIC)
    got = asyncio.run(_consume(cluster.bootstrap, 200_000))
    assert len(got) == 200_000
    assert got == values  # in order, byte-identical

    # the new leader appends after the committed history
    asyncio.run(_produce(cluster.bootstrap, [b"after-restart"]))
    got = asyncio.run(_consume(cluster.bootstrap, 200_001))
    assert got[-1] == b"after-restart" and len(got) == 200_001


@pytest.mark.slow
def test_retention_drops_old_segments_and_a_lagging_consumer_resets(
    processes: ProcessGroup,
    zk_chroot: ZooKeeperChroot,
    zk_client: KazooClient,
    s3: S3Target,
    tmp_path: Path,
) -> None:
    cluster = _cluster(processes, zk_chroot, tmp_path)
    cluster.start_agent(
        1, *_agent_configs(s3, "tier.retention.check.interval.ms=200"), env=s3.env()
    )
    cluster.create_topic(
        TOPIC,
        1,
        configs={"segment.bytes": 64 * 1024, "segment.ms": 500, "retention.ms": 4000},
    )
    cluster.wait_for_leaders(TOPIC)
    old = _values(20_000)
    asyncio.run(_produce(cluster.bootstrap, old))
    _wait("old records tiered", lambda: _manifest(zk_client).end == 20_000)
    old_keys = {k for k in _keys(s3) if k.endswith(".seg")}  # not the manifest snapshot
    assert old_keys
    time.sleep(2.5)
    fresh = [b"fresh-%d" % i for i in range(1000)]
    asyncio.run(_produce(cluster.bootstrap, fresh))
    _wait("old segments expired", lambda: _manifest(zk_client).start >= 20_000, timeout=30)
    manifest = _manifest(zk_client)
    assert all(s.base_offset >= 20_000 for s in manifest.segments)
    _wait("expired objects deleted", lambda: not (old_keys & _keys(s3)), timeout=10)

    async def behind(reset: str) -> Any:
        config = {"bootstrap.servers": cluster.bootstrap, "auto.offset.reset": reset}
        async with Consumer(config) as consumer:
            tp = TopicPartition(TOPIC, 0)
            consumer.assign([tp])
            consumer.seek(tp, 0)
            async with asyncio.timeout(20):
                while True:
                    batch = await consumer.getmany_arrow(timeout_ms=500)
                    if batch:
                        return pa.concat_tables(list(batch.values()))

    table = asyncio.run(behind("earliest"))
    assert table.column("offset")[0].as_py() == manifest.start
    with pytest.raises(OffsetOutOfRangeError):
        asyncio.run(behind("none"))
