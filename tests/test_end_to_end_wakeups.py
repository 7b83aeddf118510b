"""End to end: a record acknowledged is in a long-polling consumer's hands within milliseconds.

A missed wake-up somewhere between the append, the followers' fetches, the high watermark and a
waiting fetch (#31) does not lose anything; it leaves a committed record unseen until the
consumer's long poll times out. With ``fetch.max.wait.ms=5000`` such a miss shows as ~5 s, so
the 200 ms bound here leaves a busy machine plenty of room and still catches every miss.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from sdk import Consumer, Producer
from tests.cluster import Cluster
from tests.harness import ProcessGroup, ZooKeeperChroot

pytestmark = pytest.mark.slow

TOPIC = "e2e"
PARTITIONS = 6
RECORDS = 5_000
RATE = 500  # records per second
BOUND_S = 0.2


def test_every_acknowledged_record_reaches_a_long_polling_consumer_within_200_ms(
    processes: ProcessGroup, zk_chroot: ZooKeeperChroot, tmp_path: Path
) -> None:
    cluster = Cluster(processes, zk_chroot, tmp_path / "data")
    cluster.start(3)
    cluster.create_topic(TOPIC, PARTITIONS, 3, {"min.insync.replicas": 2})
    cluster.wait_for_leaders(TOPIC)

    async def run() -> dict[tuple[int, int], float]:
        acked: dict[tuple[int, int], float] = {}
        seen: dict[tuple[int, int], float] = {}
        async with (
            Producer(
                {"bootstrap.servers": cluster.bootstrap, "acks": "all", "linger.ms": 0}
            ) as producer,
            Consumer(
                {
                    "bootstrap.servers": cluster.bootstrap,
                    "auto.offset.reset": "earliest",
                    "fetch.max.wait.ms": 5000,
                }
            ) as consumer,
        ):
            for p in range(PARTITIONS):  # every partition led and fully in sync first
                await producer.send_and_wait(TOPIC, b"warm-up", partition=p)
            consumer.assign([(TOPIC, p) for p in range(PARTITIONS)])
            warm = 0
            while warm < PARTITIONS:  # the consumer is long-polling at the end of each one
                for records in (await consumer.getmany(timeout_ms=1000)).values():
                    warm += len(records)

            async def consume() -> None:
                while len(seen) < RECORDS:
                    got = await consumer.getmany(timeout_ms=1000)
                    now = time.monotonic()
                    for tp, records in got.items():
                        for r in records:
                            seen[(tp.partition, r.offset)] = now

            reader = asyncio.create_task(consume())
            start = time.monotonic()
            futures = []
            for i in range(RECORDS):
                pause = start + i / RATE - time.monotonic()
                if pause > 0:
                    await asyncio.sleep(pause)  # pacing the producer, not waiting for an event
                fut = await producer.send(TOPIC, b"%d" % i, partition=i % PARTITIONS)
                fut.add_done_callback(
                    lambda f: acked.__setitem__(
                        (f.result().partition, f.result().offset), time.monotonic()
                    )
                )
                futures.append(fut)
            await asyncio.gather(*futures)
            await asyncio.wait_for(reader, 60)
        assert set(seen) == set(acked), "a record acknowledged was never read"
        return {k: seen[k] - acked[k] for k in acked}

    delays = asyncio.run(run())
    worst = sorted(delays.items(), key=lambda kv: kv[1])[-5:]
    print(f"ack -> consumer: worst {[(k, round(v * 1000, 1)) for k, v in worst]} ms")
    late = {k: v for k, v in delays.items() if v > BOUND_S}
    assert not late, f"{len(late)} record(s) reached the consumer more than 200 ms after the ack"
