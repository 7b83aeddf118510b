"""End to end: a record acknowledged is in a long-polling consumer's hands within milliseconds.

A missed wake-up somewhere between the append, the followers' fetches, the high watermark and a
waiting fetch (#31) does not lose anything; it leaves a committed record unseen until the
consumer's long poll times out. With ``fetch.max.wait.ms=5000`` such a miss shows as ~5 s.
The bound asserted here is 1 s: it catches every such miss. Issue #31 asks for 200 ms, which
is not met yet: at load 3-5 a run shows a burst of records on one agent's partitions all
reaching the consumer 160-230 ms after their acks (a stall still to be found, #31), so 200 ms
would fail this test on a busy machine for a reason other than the one it guards. The
consumer runs in a process of its own (``tests/e2e_consumer.py``), as it would in production:
the producer's work here (and its garbage collections) does not hold up its reading.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sdk import Producer
from tests.cluster import Cluster
from tests.harness import ProcessGroup, ZooKeeperChroot

pytestmark = [pytest.mark.slow, pytest.mark.serial]

ROOT = Path(__file__).resolve().parent.parent
TOPIC = "e2e"
PARTITIONS = 6
RECORDS = 5_000
RATE = 500  # records per second
BOUND_NS = 1_000_000_000


def test_every_acknowledged_record_reaches_a_long_polling_consumer_without_a_missed_wake_up(
    processes: ProcessGroup, zk_chroot: ZooKeeperChroot, tmp_path: Path
) -> None:
    cluster = Cluster(processes, zk_chroot, tmp_path / "data")
    cluster.start(3)
    cluster.create_topic(TOPIC, PARTITIONS, 3, {"min.insync.replicas": 2})
    cluster.wait_for_leaders(TOPIC)

    async def warm_up() -> None:  # every partition led and fully in sync first
        async with Producer({"bootstrap.servers": cluster.bootstrap, "acks": "all"}) as producer:
            for p in range(PARTITIONS):
                await producer.send_and_wait(TOPIC, b"warm-up", partition=p)

    asyncio.run(warm_up())
    consumer = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.e2e_consumer",
            "--bootstrap",
            cluster.bootstrap,
            "--topic",
            TOPIC,
            "--partitions",
            str(PARTITIONS),
            "--count",
            str(RECORDS),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert consumer.stdout is not None
        assert '"ready"' in consumer.stdout.readline(), "the consumer did not start"

        async def produce() -> dict[tuple[int, int], int]:
            acked: dict[tuple[int, int], int] = {}
            config = {"bootstrap.servers": cluster.bootstrap, "acks": "all", "linger.ms": 0}
            async with Producer(config) as producer:
                start = time.monotonic()
                futures = []
                for i in range(RECORDS):
                    pause = start + i / RATE - time.monotonic()
                    if pause > 0:
                        await asyncio.sleep(pause)  # pacing the producer, not an event wait
                    fut = await producer.send(TOPIC, b"%d" % i, partition=i % PARTITIONS)
                    fut.add_done_callback(
                        lambda f: acked.__setitem__(
                            (f.result().partition, f.result().offset), time.monotonic_ns()
                        )
                    )
                    futures.append(fut)
                await asyncio.gather(*futures)
            return acked

        acked = asyncio.run(produce())
        out, _ = consumer.communicate(timeout=120)
    finally:
        if consumer.poll() is None:
            consumer.kill()
    seen = {(p, o): ns for p, o, ns in json.loads(out.splitlines()[-1])["seen"]}
    assert set(seen) == set(acked), "a record acknowledged was never read, or one not sent"
    delays = {k: seen[k] - acked[k] for k in acked}
    worst = sorted(delays.items(), key=lambda kv: kv[1])[-5:]
    print(f"ack -> consumer: worst {[(k, round(v / 1e6, 1)) for k, v in worst]} ms")
    late = {k: v for k, v in delays.items() if v > BOUND_NS}
    assert not late, f"{len(late)} record(s) reached the consumer more than 1 s after the ack"
