"""Local retention on leaders and followers, with and without an object tier (#25).

Without a bucket the local log is the whole log: ``retention.bytes`` / ``retention.ms`` bound
every replica's disk, a consumer below the new log start resets, and a follower that was down
while the leader's log start passed its end restarts its log there and rejoins the ISR. With a
bucket, ``local.retention.bytes`` bounds the local copy on followers as on the leader once
segments are committed, and older offsets are read back from S3.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from kazoo.client import KazooClient

from sdk import Consumer, Producer, TopicPartition
from tests.cluster import Cluster
from tests.harness import ProcessGroup, S3Target, ZooKeeperChroot
from tests.test_tier import _manifest

pytestmark = pytest.mark.slow

TOPIC = "kept"
SEGMENT = 64 << 10
BOUND = 256 << 10
CHECK = "log.retention.check.interval.ms=200"


def _wait(
    what: str, check: Callable[[], bool], timeout: float = 60.0, state: Callable[[], object] = str
) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {state()}"
        time.sleep(0.1)


def _local_bytes(cluster: Cluster, agent_id: int) -> int:
    directory = cluster.data_root / f"agent-{agent_id}" / f"{TOPIC}-0"
    total = 0
    for p in directory.glob("*.log"):
        try:
            total += p.stat().st_size
        except FileNotFoundError:  # retention deleted it between the listing and now
            continue
    return total


def _values(start: int, n: int) -> list[bytes]:
    return [b"%08d-" % i + bytes(1000) for i in range(start, start + n)]


async def _produce(bootstrap: str, values: list[bytes], timestamp_ms: int | None = None) -> None:
    config = {"bootstrap.servers": bootstrap, "acks": "all", "batch.size": 32 << 10}
    async with Producer(config) as producer:
        for start in range(0, len(values), 100):
            await producer.send_batch(
                TOPIC, values[start : start + 100], partition=0, timestamp_ms=timestamp_ms
            )
        await producer.flush()


async def _read_from_start(bootstrap: str, until: bytes) -> list[bytes]:
    """Every value from the log start (``auto.offset.reset=earliest``) up to ``until``."""
    out: list[bytes] = []
    async with Consumer({"bootstrap.servers": bootstrap, "auto.offset.reset": "earliest"}) as c:
        c.assign([(TOPIC, 0)])
        c.seek(TopicPartition(TOPIC, 0), 0)  # below the log start once retention ran: resets
        async with asyncio.timeout(60):
            while not out or out[-1] != until:
                for table in (await c.getmany_arrow(timeout_ms=500)).values():
                    out.extend(table.column("value").to_pylist())
    return out


def _isr(cluster: Cluster) -> list[int]:
    md = cluster.metadata([TOPIC])
    return sorted(md.topics[0].partitions[0].isr)


def test_without_a_bucket_retention_bounds_every_replica_and_a_late_follower_restarts(
    processes: ProcessGroup, zk_chroot: ZooKeeperChroot, tmp_path: Path
) -> None:
    cluster = Cluster(processes, zk_chroot, tmp_path / "data")
    for agent_id in (1, 2, 3):
        cluster.start_agent(agent_id, CHECK)
    cluster.create_topic(
        TOPIC,
        1,
        3,
        {"segment.bytes": SEGMENT, "retention.bytes": BOUND, "min.insync.replicas": 2},
    )
    leader = cluster.wait_for_leaders(TOPIC)[0].leader_id
    late = next(a for a in (1, 2, 3) if a != leader)
    cluster.kill(late)  # down while the leader's log start passes its end

    first = _values(0, 2000)  # ~2 MiB: 8 times the bound
    asyncio.run(_produce(cluster.bootstrap, first))
    limit = BOUND + 2 * SEGMENT  # the bound, the active segment and one being rolled
    live = [a for a in (1, 2, 3) if a != late]
    _wait(
        "the live replicas to shrink to the bound",
        lambda: all(_local_bytes(cluster, a) <= limit for a in live),
        state=lambda: {a: _local_bytes(cluster, a) for a in live},
    )

    got = asyncio.run(_read_from_start(cluster.bootstrap, first[-1]))
    assert 0 < len(got) < len(first), "retention removed nothing, or everything"
    assert got == first[len(first) - len(got) :], "not the newest records, in order"

    cluster.start_agent(late, CHECK)
    _wait("the late follower back in the ISR", lambda: _isr(cluster) == [1, 2, 3])
    log_text = cluster.agents[late].process.log_text()
    assert "restarting the follower log there" in log_text
    assert _local_bytes(cluster, late) <= limit


def test_without_a_bucket_records_older_than_retention_ms_leave_the_disk(
    processes: ProcessGroup, zk_chroot: ZooKeeperChroot, tmp_path: Path
) -> None:
    cluster = Cluster(processes, zk_chroot, tmp_path / "data")
    cluster.start_agent(1, CHECK)
    cluster.create_topic(TOPIC, 1, 1, {"segment.bytes": SEGMENT, "retention.ms": 3_600_000})
    cluster.wait_for_leaders(TOPIC)
    day_old = int(time.time() * 1000) - 86_400_000
    old, new = _values(0, 1000), _values(1000, 300)
    asyncio.run(_produce(cluster.bootstrap, old, timestamp_ms=day_old))
    asyncio.run(_produce(cluster.bootstrap, new))
    _wait("the day-old segments to go", lambda: _local_bytes(cluster, 1) < 600 * 1024)
    got = asyncio.run(_read_from_start(cluster.bootstrap, new[-1]))
    assert got[-len(new) :] == new, "a record within retention.ms was deleted"
    assert len(got) - len(new) < SEGMENT // 1000, "more than one segment of old records kept"


def test_with_a_bucket_local_retention_bounds_followers_and_old_offsets_come_from_s3(
    processes: ProcessGroup,
    zk_chroot: ZooKeeperChroot,
    zk_client: KazooClient,
    s3: S3Target,
    tmp_path: Path,
) -> None:
    cluster = Cluster(processes, zk_chroot, tmp_path / "data")
    configs = (f"s3.bucket={s3.bucket}", "tier.check.interval.ms=100", CHECK)
    for agent_id in (1, 2, 3):
        cluster.start_agent(agent_id, *configs, env=s3.env())
    cluster.create_topic(
        TOPIC,
        1,
        3,
        {"segment.bytes": SEGMENT, "local.retention.bytes": BOUND, "min.insync.replicas": 2},
    )
    cluster.wait_for_leaders(TOPIC)
    values = _values(0, 2000)
    asyncio.run(_produce(cluster.bootstrap, values))
    _wait(
        "most of the log committed to the tier",
        lambda: _manifest(zk_client, TOPIC).end >= len(values) - 400,
    )
    limit = BOUND + 2 * SEGMENT
    _wait(
        "every replica's local copy within local.retention.bytes",
        lambda: all(_local_bytes(cluster, a) <= limit for a in (1, 2, 3)),
        state=lambda: {a: _local_bytes(cluster, a) for a in (1, 2, 3)},
    )
    got = asyncio.run(_read_from_start(cluster.bootstrap, values[-1]))
    assert got == values, "older offsets are read back from S3, all of them, in order"
