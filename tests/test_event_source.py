"""The event-source runner against a real agent: batches in order per partition, partial
batch failures (``batchItemFailures``), exceptions, ``retryAfterMs``, commits."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from infra.event_source import EventSourceRunner, MappingConfig, item_id
from sdk import Consumer, Producer, TopicPartition
from tests.cluster import Cluster
from tests.delay_support import InProcessRunner, wait_until
from tests.harness import ProcessGroup, ZooKeeperChroot

TOPIC = "events"
PARTITIONS = 3
N = 3000


@pytest.fixture
def cluster(processes: ProcessGroup, zk_chroot: ZooKeeperChroot, tmp_path: Path) -> Cluster:
    c = Cluster(processes, zk_chroot, tmp_path / "data")
    c.start(1)
    c.create_topic(TOPIC, PARTITIONS, 1)
    c.wait_for_leaders(TOPIC)
    return c


class Function:
    """A user's function: fails some records once, raises once, asks to come back once."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.done: dict[int, list[int]] = defaultdict(list)  # partition -> offsets, in order
        self.failed_once: set[tuple[int, int]] = set()
        self.raised = False
        self.come_back: dict[int, float] = {}  # partition -> when it may come back
        self.early: list[tuple[int, float]] = []
        self.invocations = 0

    def __call__(self, event: dict[str, Any], context: Any) -> dict[str, Any]:
        assert context.get_remaining_time_in_millis() > 0
        failures = []
        with self.lock:
            self.invocations += 1
            if not self.raised and self.invocations == 3:
                self.raised = True
                raise RuntimeError("the function failed: the whole batch is retried")
            for key, records in event["records"].items():
                p = int(key.rsplit("-", 1)[1])
                if p in self.come_back and time.monotonic() < self.come_back[p]:
                    self.early.append((p, time.monotonic()))
                for r in records:
                    o = r["offset"]
                    if o % 500 == 42 and (p, o) not in self.failed_once:
                        self.failed_once.add((p, o))
                        item: dict[str, Any] = {"itemIdentifier": item_id(TOPIC, p, o)}
                        if o == 42:
                            item["retryAfterMs"] = 300
                            self.come_back[p] = time.monotonic() + 0.3
                        failures.append(item)
                        break
                    self.done[p].append(o)
        return {"batchItemFailures": failures}


def test_every_record_handled_in_order_with_partial_failures_and_retries(cluster: Cluster) -> None:
    async def produce() -> None:
        async with Producer({"bootstrap.servers": cluster.bootstrap}) as producer:
            for p in range(PARTITIONS):
                await (await producer.send_batch(TOPIC, [b"x"] * (N // PARTITIONS), partition=p))

    asyncio.run(produce())
    fn = Function()
    config = MappingConfig(
        function="tests.test_event_source:Function",
        topics=(TOPIC,),
        group_id="fn",
        bootstrap_servers=cluster.bootstrap,
        batch_size=100,
        window_ms=20,
        concurrency=2,
        retry_initial_ms=50,
        retry_max_ms=200,
        session_timeout_ms=3000,
    )
    runner = EventSourceRunner(config, fn)
    per = N // PARTITIONS
    with InProcessRunner(runner):
        wait_until(lambda: all(len(fn.done[p]) >= per for p in range(PARTITIONS)), 60, "all")
        wait_until(lambda: runner.stats.committed >= N, 30, "the commits")
    for p in range(PARTITIONS):
        # at-least-once, and in order: a retried batch starts again at the failed record
        assert sorted(set(fn.done[p])) == list(range(per)), p
        assert fn.done[p] == sorted(fn.done[p]), f"partition {p} out of order"
    assert len(fn.failed_once) == PARTITIONS * len(range(42, per, 500))
    assert fn.raised and runner.stats.failed_invocations == 1
    assert not fn.early, f"came back before retryAfterMs: {fn.early}"

    async def committed() -> dict[int, int]:
        config = {"bootstrap.servers": cluster.bootstrap, "group.id": "fn"}
        async with Consumer(config) as consumer:
            out = {}
            for p in range(PARTITIONS):
                c = await consumer.committed(TopicPartition(TOPIC, p))
                out[p] = -1 if c is None else c.offset
            return out

    assert asyncio.run(committed()) == dict.fromkeys(range(PARTITIONS), per)
