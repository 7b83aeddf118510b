"""Reading a range again for a redo (``handlers.ranges.read_range``) after retention deleted
part of it: the scheduler's lanes, the retry router's failures partitions and redrive's
chunks are named by offset ranges in ZooKeeper intents, and a redo after a long outage may
find the log's start past the range's start."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import pytest

from handlers import ranges
from sdk import Consumer, Producer, TopicPartition
from tests.cluster import Cluster
from tests.harness import ProcessGroup, ZooKeeperChroot

pytestmark = pytest.mark.slow

TOPIC = "ranged"
TP = TopicPartition(TOPIC, 0)


async def _fill(bootstrap: str, n: int) -> None:
    config = {"bootstrap.servers": bootstrap, "acks": "all", "batch.size": 32 << 10}
    async with Producer(config) as producer:
        for start in range(0, n, 100):
            values = [b"%08d-" % i + bytes(1000) for i in range(start, start + 100)]
            await producer.send_batch(TOPIC, values, partition=0)
        await producer.flush()


async def _log_start(bootstrap: str) -> int:
    async with Consumer({"bootstrap.servers": bootstrap}) as c:
        return (await c.beginning_offsets([TP]))[TP]


def test_a_redo_reads_what_retention_left_of_its_range_whatever_the_reset_policy(
    processes: ProcessGroup,
    zk_chroot: ZooKeeperChroot,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Offsets below the log's start are gone; the rest of the range is read (not skipped
    by a consumer that resets to the latest offset, not an endless error for one that does
    not reset), the loss is logged, and a range wholly below the start reads as empty."""
    cluster = Cluster(processes, zk_chroot, tmp_path / "data")
    cluster.start_agent(1, "log.retention.check.interval.ms=200")
    cluster.create_topic(TOPIC, 1, 1, {"segment.bytes": 64 << 10, "retention.bytes": 256 << 10})
    cluster.wait_for_leaders(TOPIC)
    n = 2000  # about 2 MiB: eight times what retention keeps
    asyncio.run(_fill(cluster.bootstrap, n))
    deadline = time.monotonic() + 60
    while (first := asyncio.run(_log_start(cluster.bootstrap))) == 0:
        assert time.monotonic() < deadline, "retention deleted nothing"
        time.sleep(0.2)
    assert 0 < first < n - 200

    async def read(reset: str, start: int, end: int) -> list[int]:
        config = {"bootstrap.servers": cluster.bootstrap, "auto.offset.reset": reset}
        async with Consumer(config) as c:
            got = await ranges.read_range(c, TP, start, end, limit_s=30)
        return [r.offset for r in got]

    with caplog.at_level(logging.WARNING, logger="handlers.ranges"):
        for reset in ("none", "latest", "earliest"):
            got = asyncio.run(read(reset, 0, n - 100))
            assert got[0] >= first and got == list(range(got[0], n - 100)), reset
            assert asyncio.run(read(reset, 0, 10)) == [], reset  # wholly below the start
    assert "deleted by retention" in caplog.text
    routed = asyncio.run(ranges.read_committed_range(cluster.bootstrap, TP, 0, n, limit_s=30))
    assert [r.offset for r in routed] == list(range(routed[0].offset, n))
