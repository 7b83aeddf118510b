"""Power loss of real agents: what each ``fsync.policy`` promises, checked after the fact.

Agents run with their data directory recorded by ``storage.wal.crashfs``; a power loss is
``kill -9`` and then dropping every byte and name their fsyncs had not made durable
(``tests/fault_support.py``). The promises (docs/operations.md, *What each fsync policy
promises*):

* a process crash (``kill -9``, page cache intact) loses nothing acknowledged, any policy;
* ``always``: a power loss loses nothing acknowledged, on one agent or all of them;
* ``interval``: a power loss loses at most what was acknowledged since the last completed
  fsync: a record is safe once an fsync that started after its acknowledgement has finished;
* ``never``: the same, but fsyncs only happen after a segment is sealed: everything since the
  last roll can go;
* acks=all RF 3, one agent losing power: nothing acknowledged is lost, any policy (the other
  in-sync replicas have it);

and after every fault the partition is consistent: offsets from 0 without a gap, records in
the order sent, none twice, and every replica ends up with the leader's log.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from tests.cluster import Cluster
from tests.fault_support import (
    Ledger,
    check_log,
    data_dir,
    fsync_count,
    power_loss,
    produce,
    read_log,
    start_recorded,
    values_on_disk,
)
from tests.harness import ProcessGroup, ZooKeeperChroot

TOPIC = "events"
POLICIES = ["always", "interval", "never"]
SEGMENT_BYTES = 64 << 10  # ~50 batches a segment: rolls (and `never`'s fsyncs) happen often


def policies(in_make_test: str) -> list[object]:
    """Every policy; all but ``in_make_test`` only in ``make chaos`` (three agents each)."""
    return [p if p == in_make_test else pytest.param(p, marks=pytest.mark.chaos) for p in POLICIES]


@pytest.fixture
def cluster(processes: ProcessGroup, zk_chroot: ZooKeeperChroot, tmp_path: Path) -> Cluster:
    return Cluster(processes, zk_chroot, tmp_path / "data")


def topic_config(policy: str, **extra: object) -> dict[str, object]:
    return {"fsync.policy": policy, "segment.bytes": SEGMENT_BYTES, **extra}


async def durable_now(cluster: Cluster, agent_ids: list[int], ledger: Ledger) -> list[bytes]:
    """The acknowledged records the policy promises survive a power loss from now on: those
    acknowledged before an fsync that started after this call has finished on every agent
    (the fsyncs of one log run one after another, so the second one counts)."""
    acked = list(ledger.acked)
    agents = [cluster.agents[a] for a in agent_ids]
    start = [await asyncio.to_thread(fsync_count, a) for a in agents]
    deadline = time.monotonic() + 30
    for agent, count in zip(agents, start, strict=True):
        while await asyncio.to_thread(fsync_count, agent) < count + 2:
            assert time.monotonic() < deadline, f"agent {agent.agent_id} stopped fsyncing"
            await asyncio.sleep(0.02)
    return acked


def leader_of(cluster: Cluster, exclude: set[int] | None = None) -> int:
    return cluster.wait_for_leaders(TOPIC, exclude=exclude, timeout=60)[0].leader_id


def wait_replicas_agree(cluster: Cluster, replicas: list[int]) -> list[bytes]:
    """Every replica's disk holds exactly the leader's log (bounded wait)."""
    want = [v for _, v in asyncio.run(read_log(cluster, TOPIC, 0))]
    deadline = time.monotonic() + 30
    for r in replicas:
        directory = data_dir(cluster, r) / f"{TOPIC}-0"
        while (got := values_on_disk(directory)) != want:
            assert time.monotonic() < deadline, (
                f"agent {r} holds {len(got)} records, the leader {len(want)}"
            )
            time.sleep(0.05)
    return want


# ---------------------------------------------------------------- one agent, acks=1


@pytest.mark.parametrize("policy", POLICIES)
def test_one_agent_acks_1_process_crash_then_power_loss(cluster: Cluster, policy: str) -> None:
    agent = start_recorded(cluster, 1)
    cluster.create_topic(TOPIC, 1, 1, topic_config(policy))
    cluster.wait_for_leaders(TOPIC)
    ledger = Ledger()

    async def crash(power: bool) -> list[bytes]:
        target = len(ledger.acked) + 300
        task = asyncio.create_task(produce(agent, TOPIC, 0, ledger, acks=1, batches=1 << 30))
        await ledger.wait_acked(target)
        safe = await durable_now(cluster, [1], ledger) if power and policy != "always" else []
        await ledger.wait_acked(len(ledger.acked) + 100)
        if power:
            await asyncio.to_thread(power_loss, cluster, 1)
        else:
            await asyncio.to_thread(cluster.kill, 1)
        await task
        return safe if policy != "always" else list(ledger.acked)

    # a process crash: the page cache survives, nothing acknowledged is lost under any policy
    asyncio.run(crash(power=False))
    agent = start_recorded(cluster, 1)
    cluster.wait_for_leaders(TOPIC)
    assert check_log(asyncio.run(read_log(cluster, TOPIC, 0)), ledger, ledger.acked) == []

    # a power loss: only what the policy made durable is promised
    must_have = asyncio.run(crash(power=True))
    restarted = time.monotonic()
    agent = start_recorded(cluster, 1)
    log = asyncio.run(read_log(cluster, TOPIC, 0))
    print(f"{policy}: serving {time.monotonic() - restarted:.2f} s after the restart")
    lost = check_log(log, ledger, must_have)
    print(f"{policy}: {len(ledger.acked)} acknowledged, {len(lost)} lost to the power loss")
    if policy == "always":
        assert lost == []
    # the agent takes writes again, after whatever survived
    ledger.phases.append([])
    assert not asyncio.run(produce(agent, TOPIC, 0, ledger, acks=1, batches=10))
    check_log(asyncio.run(read_log(cluster, TOPIC, 0)), ledger, ledger.acked[-40:])


def test_never_loses_the_whole_unsealed_segment_at_power_loss(cluster: Cluster) -> None:
    """The strictest reading of ``never``: nothing of a segment that was never sealed is on
    the disk (not even its name), so a power loss takes all of it; the agent still starts."""
    agent = start_recorded(cluster, 1)
    cluster.create_topic(TOPIC, 1, 1, {"fsync.policy": "never"})
    cluster.wait_for_leaders(TOPIC)
    ledger = Ledger()
    assert not asyncio.run(produce(agent, TOPIC, 0, ledger, acks=1, batches=50))
    power_loss(cluster, 1)
    agent = start_recorded(cluster, 1)
    cluster.wait_for_leaders(TOPIC)
    assert asyncio.run(read_log(cluster, TOPIC, 0)) == []
    assert not asyncio.run(produce(agent, TOPIC, 0, ledger, acks=1, batches=5))
    assert [v for _, v in asyncio.run(read_log(cluster, TOPIC, 0))] == ledger.phases[-1]


# ---------------------------------------------------------------- three agents, acks=all


def three_agents(cluster: Cluster, policy: str) -> None:
    for a in (1, 2, 3):
        start_recorded(cluster, a)
    cluster.create_topic(TOPIC, 1, 3, topic_config(policy, **{"min.insync.replicas": 2}))


@pytest.mark.parametrize("policy", policies("interval"))
def test_acks_all_leader_loses_power_nothing_acknowledged_is_lost(
    cluster: Cluster, policy: str
) -> None:
    three_agents(cluster, policy)
    leader = leader_of(cluster)
    ledger = Ledger()

    async def run() -> None:
        task = asyncio.create_task(
            produce(cluster.agents[leader], TOPIC, 0, ledger, acks=-1, batches=1 << 30)
        )
        await ledger.wait_acked(400)
        await asyncio.to_thread(power_loss, cluster, leader)
        await task

    asyncio.run(run())
    leader_of(cluster, exclude={leader})  # another agent leads
    check_log(asyncio.run(read_log(cluster, TOPIC, 0)), ledger, ledger.acked)
    start_recorded(cluster, leader)
    log = wait_replicas_agree(cluster, [1, 2, 3])
    check_log(list(enumerate(log)), ledger, ledger.acked)


@pytest.mark.parametrize("policy", policies("always"))
def test_acks_all_every_agent_loses_power_at_once(cluster: Cluster, policy: str) -> None:
    three_agents(cluster, policy)
    leader = leader_of(cluster)
    ledger = Ledger()

    async def run() -> list[bytes]:
        task = asyncio.create_task(
            produce(cluster.agents[leader], TOPIC, 0, ledger, acks=-1, batches=1 << 30)
        )
        await ledger.wait_acked(400)
        safe = await durable_now(cluster, [1, 2, 3], ledger) if policy != "always" else []
        await ledger.wait_acked(len(ledger.acked) + 100)
        await asyncio.to_thread(power_loss, cluster, 1, 2, 3)
        await task
        return safe if policy != "always" else list(ledger.acked)

    must_have = asyncio.run(run())
    # the followers come back first, so one of them leads: the old leader's disk cannot help
    followers = [a for a in (1, 2, 3) if a != leader]
    for a in followers:
        start_recorded(cluster, a)
    new = leader_of(cluster, exclude={leader})
    start_recorded(cluster, leader)
    lost = check_log(asyncio.run(read_log(cluster, TOPIC, 0)), ledger, must_have)
    print(f"{policy}: {len(ledger.acked)} acknowledged, {len(lost)} lost; leader {leader} -> {new}")
    log = wait_replicas_agree(cluster, [1, 2, 3])
    check_log(list(enumerate(log)), ledger, must_have)


@pytest.mark.parametrize("policy", policies("interval"))
def test_acks_all_leader_loses_power_and_restarts_at_once(cluster: Cluster, policy: str) -> None:
    """The leader's power fails and it is back within its ZooKeeper session: with a relaxed
    policy its disk lost an acknowledged tail that only the followers still hold."""
    three_agents(cluster, policy)
    leader = leader_of(cluster)
    epoch = cluster.wait_for_leaders(TOPIC)[0].leader_epoch
    ledger = Ledger()

    async def run() -> None:
        task = asyncio.create_task(
            produce(cluster.agents[leader], TOPIC, 0, ledger, acks=-1, batches=1 << 30)
        )
        await ledger.wait_acked(400)
        await asyncio.to_thread(power_loss, cluster, leader)
        await task

    asyncio.run(run())
    start_recorded(cluster, leader)
    log = asyncio.run(read_log(cluster, TOPIC, 0))
    md = cluster.wait_for_leaders(TOPIC, timeout=60)[0]
    print(
        f"{policy}: leader {leader}@{epoch} -> {md.leader_id}@{md.leader_epoch}, {len(log)} records"
    )
    check_log(log, ledger, ledger.acked)
    log2 = wait_replicas_agree(cluster, [1, 2, 3])
    check_log(list(enumerate(log2)), ledger, ledger.acked)
