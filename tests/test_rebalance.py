"""Elastic agents (#25): balancing on join, decommission, replacement of a dead agent.

Real agents on loopback, a real ZooKeeper, the admin runtime process (HTTP) and the ``strata``
CLI. One scenario, in the order an operator lives it:

1. 3 agents, a topic of 24 partitions with RF 3, a producer with ``acks=all`` running
   throughout;
2. agents 4 and 5 join: with ``auto.rebalance.enable`` every agent ends up leading 4-6
   partitions and holding 13-16 replicas, without the producer seeing an error;
3. ``strata agents decommission 5``: agent 5 ends with no replica;
4. agent 4 is killed for longer than ``agent.replace.after.ms``: its replicas are re-created on
   the live agents and every ISR is full again;
5. every acknowledged record is read back, once.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kazoo.client import KazooClient

from infra.local_runtime import command, wait_for_listening
from sdk import Consumer, Producer, TopicPartition
from sdk.admin import SyncAdmin
from storage.metadata.models import PartitionState
from tests.cluster import ROOT, Cluster
from tests.harness import ProcessGroup, ZooKeeperChroot

TOPIC = "elastic"
PARTITIONS = 24
AGENT_CONFIGS = (
    "auto.rebalance.enable=true",
    "auto.rebalance.delay.ms=1000",
    "rebalance.max.concurrent.moves=6",
    "agent.replace.after.ms=3000",
)


def _states(zk: KazooClient) -> dict[int, PartitionState]:
    out = {}
    for p in range(PARTITIONS):
        data, _ = zk.get(f"/topics/{TOPIC}/partitions/{p}/state")
        out[p] = PartitionState.model_validate_json(data)
    return out


def _counts(states: dict[int, PartitionState]) -> tuple[dict[int, int], dict[int, int]]:
    replicas: dict[int, int] = {}
    leaders: dict[int, int] = {}
    for s in states.values():
        for r in s.replicas:
            replicas[r] = replicas.get(r, 0) + 1
        leaders[s.leader] = leaders.get(s.leader, 0) + 1
    return replicas, leaders


def _settled(states: dict[int, PartitionState]) -> bool:
    """No move in progress and every ISR full."""
    return all(
        not s.adding and not s.removing and sorted(s.isr) == sorted(s.replicas) and s.leader >= 0
        for s in states.values()
    )


def _wait(what: str, check: Callable[[], Any], timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


class Load:
    """An acks=all producer in a thread of its own: what was acked, and any error it saw."""

    def __init__(self, cluster: Cluster) -> None:
        self.bootstrap = cluster.bootstrap
        self.acked: list[bytes] = []
        self.errors: list[BaseException] = []
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def run(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        config = {
            "bootstrap.servers": self.bootstrap,
            "acks": "all",
            "linger.ms": 2,
            "delivery.timeout.ms": 60_000,
        }
        async with Producer(config) as producer:
            seq = 0
            while not self._stop.is_set():
                batch = [b"%09d" % (seq + i) for i in range(50)]
                seq += len(batch)
                futures = [await producer.send(TOPIC, v, key=v) for v in batch]
                for v, f in zip(batch, futures, strict=True):
                    try:
                        await f
                        self.acked.append(v)
                    except Exception as exc:
                        self.errors.append(exc)
                await asyncio.sleep(0.02)

    def stop(self) -> None:
        assert self._loop is not None and self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)


async def _read_all(bootstrap: str, acked: list[bytes]) -> list[bytes]:
    """Everything in the topic, read from the beginning until every acknowledged record has
    been seen and the end offsets are reached. (A leader that has just taken over learns the
    followers' positions from their next fetches: until then its high watermark, and so
    what a consumer may read, can stay below records the previous leader acknowledged.)"""
    tps = [TopicPartition(TOPIC, p) for p in range(PARTITIONS)]
    want = set(acked)
    out: list[bytes] = []
    async with Consumer({"bootstrap.servers": bootstrap}) as consumer:
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        async with asyncio.timeout(60):
            while True:
                for recs in (await consumer.getmany(timeout_ms=500)).values():
                    out += [r.value for r in recs if r.value is not None]
                if want <= set(out):
                    ends = await consumer.end_offsets(tps)
                    positions = [await consumer.position(tp) for tp in tps]
                    if all(pos >= ends[tp] for pos, tp in zip(positions, tps, strict=True)):
                        return out


@pytest.fixture
def admin_url(processes: ProcessGroup, zk_chroot: ZooKeeperChroot) -> Iterator[str]:
    runtime = processes.start(command(zk_chroot.connect_string), name="local-runtime", cwd=ROOT)
    yield wait_for_listening(runtime.popen, runtime.log_path)


def _cli(url: str, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "infra.cli", "--admin-url", url, *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    return " ".join(done.stdout.split())


@pytest.mark.slow
def test_agents_join_leave_and_die_and_replicas_follow(
    processes: ProcessGroup,
    zk_chroot: ZooKeeperChroot,
    zk_client: KazooClient,
    tmp_path: Path,
    admin_url: str,
) -> None:
    cluster = Cluster(processes, zk_chroot, tmp_path / "data")
    for a in (1, 2, 3):
        cluster.start_agent(a, *AGENT_CONFIGS)
    cluster.create_topic(TOPIC, PARTITIONS, 3, {"min.insync.replicas": 2})
    cluster.wait_for_leaders(TOPIC)
    load = Load(cluster)

    thread = threading.Thread(target=lambda: asyncio.run(load.run()), daemon=True)
    thread.start()
    try:
        _wait("the first acks", lambda: len(load.acked) >= 500, 60)

        # 2. two agents join: the controller spreads replicas and leaders over five
        for a in (4, 5):
            cluster.start_agent(a, *AGENT_CONFIGS)

        def balanced() -> bool:
            states = _states(zk_client)
            replicas, leaders = _counts(states)
            return (
                _settled(states)
                and set(replicas) == {1, 2, 3, 4, 5}
                and all(13 <= n <= 16 for n in replicas.values())
                and set(leaders) == {1, 2, 3, 4, 5}
                and all(4 <= n <= 6 for n in leaders.values())
            )

        _wait("replicas and leaders balanced over 5 agents", balanced, 120)
        with SyncAdmin(admin_url) as admin:
            assert admin.rebalance(dry_run=True)["moves"] == []  # nothing left to do
        assert not load.errors, load.errors[:3]

        # 3. decommission agent 5 through the CLI: it ends with no replica
        said = _cli(admin_url, "agents", "decommission", "5")
        assert "decommissioning agent 5" in said

        def drained() -> bool:
            states = _states(zk_client)
            return _settled(states) and 5 not in _counts(states)[0]

        _wait("agent 5 drained", drained, 120)
        listed = {a["agent_id"]: a for a in SyncAdmin(admin_url).list_agents()}
        assert listed[5]["replicas"] == 0 and listed[5]["decommissioning"]
        assert not load.errors, load.errors[:3]

        # 4. agent 4 dies for longer than agent.replace.after.ms: its replicas are re-created
        cluster.kill(4)

        def replaced() -> bool:
            states = _states(zk_client)
            replicas, _ = _counts(states)
            return _settled(states) and 4 not in replicas and set(replicas) == {1, 2, 3}

        _wait("agent 4's replicas re-created on live agents", replaced, 120)
        assert all(len(s.isr) == 3 for s in _states(zk_client).values())
    finally:
        load.stop()
        thread.join(90)
    assert not thread.is_alive()
    # acks=all with min.insync.replicas=2 survives the one agent killed: no error, no loss
    assert not load.errors, load.errors[:3]
    got = asyncio.run(_read_all(cluster.bootstrap, load.acked))
    assert sorted(got) == sorted(load.acked)
    assert len(set(got)) == len(got)
