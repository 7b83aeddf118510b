"""A rolling restart (SIGTERM, restart, one agent at a time) under produce and group consume.

Each agent stops with a controlled shutdown: it tells the controller, which moves the
leadership of every partition it leads to another in-sync replica (and its groups to other
coordinators) before the process ends. Checked: nothing acknowledged is lost, nothing is
stored twice (idempotent producer), each agent led nothing that another in-sync replica could
have taken when it stopped, and the group rebalanced at most once per restart.
"""

from __future__ import annotations

import asyncio
import re
import threading
from pathlib import Path

import pytest

from sdk import Consumer, Producer, TopicPartition
from tests.cluster import Cluster
from tests.harness import ManagedProcess, ProcessGroup, ZooKeeperChroot
from tests.test_groups_acceptance import consumed, end_offsets, events, start_member, wait_until

TOPIC = "orders"
PARTITIONS = 6


@pytest.fixture
def cluster(processes: ProcessGroup, zk_chroot: ZooKeeperChroot, tmp_path: Path) -> Cluster:
    c = Cluster(processes, zk_chroot, tmp_path / "data")
    for agent_id in (1, 2, 3):
        c.start_agent(agent_id)
    return c


class AckingProducer:
    """An idempotent acks=all producer in a thread: keyed records at a steady pace, each
    acknowledgement's (partition, offset) kept."""

    def __init__(self, bootstrap: str) -> None:
        self.bootstrap = bootstrap
        self.stop = threading.Event()
        self.acked: dict[bytes, tuple[int, int]] = {}
        self.failed: list[str] = []
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _run(self) -> None:
        config = {
            "bootstrap.servers": self.bootstrap,
            "acks": "all",
            "linger.ms": 2,
            "retry.backoff.ms": 50,
            "request.timeout.ms": 5000,
            "delivery.timeout.ms": 120_000,
        }
        async with Producer(config) as producer:
            seq = 0
            while not self.stop.is_set():
                futures = []
                for _ in range(20):
                    value = b"%08d" % seq
                    key = b"k%d" % (seq % 16)
                    futures.append((value, await producer.send(TOPIC, value, key=key)))
                    seq += 1
                for value, fut in futures:
                    try:
                        meta = await fut
                    except Exception as exc:  # recorded: the test fails on any
                        self.failed.append(repr(exc))
                        continue
                    self.acked[value] = (meta.partition, meta.offset)  # type: ignore[attr-defined]
                await asyncio.sleep(0.02)


def _isr_full(cluster: Cluster) -> bool:
    md = cluster.metadata([TOPIC]).topics[0]
    return all(p.error_code == 0 and len(p.isr) == 3 for p in md.partitions)


def _stored(bootstrap: str) -> dict[int, list[tuple[int, bytes]]]:
    async def run() -> dict[int, list[tuple[int, bytes]]]:
        out: dict[int, list[tuple[int, bytes]]] = {}
        async with Consumer({"bootstrap.servers": bootstrap}) as c:
            tps = [TopicPartition(TOPIC, p) for p in range(PARTITIONS)]
            ends = await c.end_offsets(tps)
            c.assign(tps)
            for tp in tps:
                c.seek(tp, 0)
            want = sum(ends.values())
            got = 0
            while got < want:
                for tp, records in (await c.getmany(timeout_ms=1000)).items():
                    out.setdefault(tp.partition, []).extend((r.offset, r.value) for r in records)
                    got += len(records)
        return out

    return asyncio.run(run())


def test_rolling_restart_under_load_loses_nothing_and_moves_leadership_first(
    cluster: Cluster, tmp_path: Path
) -> None:
    cluster.create_topic(TOPIC, PARTITIONS, 3, {"min.insync.replicas": 2})
    cluster.wait_for_leaders(TOPIC)
    wait_until(lambda: _isr_full(cluster), "a full ISR")
    members: list[tuple[ManagedProcess, Path]] = [
        start_member(cluster, tmp_path, name, TOPIC) for name in ("m1", "m2")
    ]
    logs = {f"m{i + 1}": log for i, (_, log) in enumerate(members)}
    wait_until(
        lambda: all(
            any(e["ev"] == "owned" and e["parts"] for e in events(log)) for log in logs.values()
        ),
        "both members owning partitions",
        within=60,
        logs=logs,
    )
    producer = AckingProducer(cluster.bootstrap)
    producer.thread.start()
    generations_before = {
        e["gen"] for log in logs.values() for e in events(log) if e["ev"] == "owned"
    }

    for agent_id in (1, 2, 3):
        wait_until(lambda: _isr_full(cluster), "a full ISR before the next stop", within=60)
        before = len(producer.acked)
        wait_until(
            lambda before=before: len(producer.acked) > before + 100,
            "acknowledgements flowing",
            within=30,
        )
        handle = cluster.agents[agent_id]
        cluster.processes.stop(handle.process.pid, timeout=40)
        text = handle.process.log_text()
        found = re.findall(
            r"controlled shutdown after ([\d.]+) s: (\d+) partitions still led", text
        )
        assert found, f"agent {agent_id} stopped without a controlled shutdown:\n{text[-2000:]}"
        assert found[-1][1] == "0", found
        cluster.start_agent(agent_id)
    wait_until(lambda: _isr_full(cluster), "a full ISR after the last restart", within=60)
    before = len(producer.acked)
    wait_until(lambda: len(producer.acked) > before + 100, "acknowledgements after the restarts")
    producer.stop.set()
    producer.thread.join(60)
    assert not producer.failed, producer.failed[:5]
    assert len(producer.acked) > 1000

    ends = end_offsets(cluster.bootstrap, TOPIC, PARTITIONS)
    wait_until(
        lambda: all(
            set(range(ends[p])) <= consumed(list(logs.values())).get(p, set())
            for p in range(PARTITIONS)
        ),
        "the group consuming everything",
        within=90,
        logs=logs,
    )
    generations = {e["gen"] for log in logs.values() for e in events(log) if e["ev"] == "owned"}
    rebalances = len(generations - generations_before)
    print(f"{len(producer.acked)} acknowledged; {rebalances} rebalances over 3 restarts")
    assert rebalances <= 3, sorted(generations)

    stored = _stored(cluster.bootstrap)
    values_at = {(p, o): v for p, rows in stored.items() for o, v in rows}
    every_value = [v for rows in stored.values() for _, v in rows]
    assert len(every_value) == len(set(every_value)), "a record was stored twice"
    for value, where in producer.acked.items():
        assert values_at.get(where) == value, (value, where, values_at.get(where))
