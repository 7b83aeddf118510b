"""Three real agents and a real ZooKeeper: kill -9 an agent, kill the controller."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from kazoo.client import KazooClient
from kazoo.exceptions import NodeExistsError

from storage.codec import decode_batch, decode_batches, encode_batch, iter_batches
from storage.errors import StrataError
from storage.metadata.models import ControllerInfo, dump
from storage.metadata.store import AGENTS, CONTROLLER
from storage.protocol import messages as m
from tests.cluster import SESSION_TIMEOUT_MS, Cluster, WireClient, fetch_request, produce_request
from tests.harness import ProcessGroup, ZooKeeperChroot

TOPIC = "orders"
PARTITIONS = 6


@pytest.fixture
def cluster(processes: ProcessGroup, zk_chroot: ZooKeeperChroot, tmp_path: Path) -> Cluster:
    c = Cluster(processes, zk_chroot, tmp_path / "data")
    c.start(3)
    c.create_topic(TOPIC, PARTITIONS, 3)
    c.wait_for_leaders(TOPIC)
    return c


def _produce(
    cluster: Cluster, leader_id: int, topic: str, partition: int, values: list[bytes]
) -> m.ProducePartitionResult:
    agent = cluster.agents[leader_id]
    resp = asyncio.run(
        WireClient.call_once(
            agent.host,
            agent.port,
            m.ApiKey.PRODUCE,
            produce_request(topic, partition, encode_batch(values)),
        )
    )
    result: m.ProducePartitionResult = resp.topics[0].partitions[0]
    return result


def _read_all(cluster: Cluster, leader_id: int, topic: str, partition: int) -> list[bytes]:
    agent = cluster.agents[leader_id]
    resp = asyncio.run(
        WireClient.call_once(
            agent.host,
            agent.port,
            m.ApiKey.FETCH,
            fetch_request(topic, partition, 0, max_bytes=8 << 20),
        )
    )
    r = resp.topics[0].partitions[0]
    assert r.error_code == 0, r
    return [] if r.records is None else decode_batches(r.records).column("value").to_pylist()


def _follower_values(directory: Path) -> list[bytes]:
    """Values in a live agent's log files, read-only (no recovery: the agent owns them)."""
    values: list[bytes] = []
    for path in sorted(directory.glob("*.log")):
        data = path.read_bytes()
        try:
            for _, pos in iter_batches(data):
                values += decode_batch(data, pos).column("value").to_pylist()
        except StrataError:
            break  # an append in progress: the rest is not there yet
    return values


def _wait_replicated(
    cluster: Cluster, topic: str, partition: int, expect: list[bytes], agents: list[int]
) -> None:
    """Followers copy asynchronously: wait (bounded) until each follower's log holds ``expect``."""
    deadline = time.monotonic() + 20
    for agent_id in agents:
        directory = cluster.data_root / f"agent-{agent_id}" / f"{topic}-{partition}"
        while _follower_values(directory) != expect:
            assert time.monotonic() < deadline, (
                f"agent {agent_id} did not replicate {topic}-{partition}"
            )
            time.sleep(0.05)


def test_kill_9_an_agent_moves_leadership_within_the_session_timeout(cluster: Cluster) -> None:
    before = cluster.wait_for_leaders(TOPIC)
    victim = before[0].leader_id
    led = sorted(p for p, md in before.items() if md.leader_id == victim)
    assert led
    for p in range(PARTITIONS):
        assert _produce(cluster, before[p].leader_id, TOPIC, p, [b"before-%d" % p]).error_code == 0

    killed_at = time.monotonic()
    cluster.kill(victim)
    after = cluster.wait_for_leaders(
        TOPIC, exclude={victim}, timeout=SESSION_TIMEOUT_MS / 1000 + 10
    )
    elapsed = time.monotonic() - killed_at
    assert elapsed <= SESSION_TIMEOUT_MS / 1000 + 2, f"leadership moved after {elapsed:.1f} s"

    for p in led:
        assert after[p].leader_id != victim
        assert after[p].leader_epoch == before[p].leader_epoch + 1
    for p in range(PARTITIONS):
        if p not in led:
            assert (after[p].leader_id, after[p].leader_epoch) == (
                before[p].leader_id,
                before[p].leader_epoch,
            )
        # the new leaders take writes
        result = _produce(cluster, after[p].leader_id, TOPIC, p, [b"after-%d" % p])
        assert result.error_code == 0, result


def test_kill_the_controller_and_a_new_one_takes_over(cluster: Cluster) -> None:
    old = cluster.metadata().controller_id
    assert old in cluster.agents
    cluster.kill(old)
    deadline = time.monotonic() + SESSION_TIMEOUT_MS / 1000 + 10
    while True:
        controller = cluster.metadata().controller_id
        if controller not in (-1, old):
            break
        assert time.monotonic() < deadline, "no new controller was elected"
        time.sleep(0.05)
    assert controller in {a.agent_id for a in cluster.alive()}

    # the cluster keeps working: the new controller places a new topic and fails over
    # the partitions the old controller led
    cluster.create_topic("after-failover", 4, 2)
    leaders = cluster.wait_for_leaders("after-failover")
    for p, md in leaders.items():
        assert md.leader_id != old
        assert _produce(cluster, md.leader_id, "after-failover", p, [b"x"]).error_code == 0
    cluster.wait_for_leaders(TOPIC, exclude={old})


def test_a_restarted_agent_rejoins_as_a_follower_and_catches_up(cluster: Cluster) -> None:
    leaders = cluster.wait_for_leaders(TOPIC)
    leader = leaders[0].leader_id
    follower = next(r for r in leaders[0].replicas if r != leader)
    values = [b"v%d" % i for i in range(50)]
    assert _produce(cluster, leader, TOPIC, 0, values[:25]).error_code == 0
    _wait_replicated(cluster, TOPIC, 0, values[:25], [follower])

    cluster.stop(follower)
    assert _produce(cluster, leader, TOPIC, 0, values[25:]).error_code == 0
    cluster.start_agent(follower)
    _wait_replicated(cluster, TOPIC, 0, values, [follower])
    assert _read_all(cluster, leader, TOPIC, 0) == values


def test_a_leader_that_cannot_open_its_log_hands_the_partition_to_an_in_sync_replica(
    cluster: Cluster, zk_client: KazooClient
) -> None:
    """All three agents crash at once, so the partition's state still names its leader and a
    full ISR. While they restart, the test holds the controller seat, so that the controller
    elected afterwards sees all three alive — the leader included. The leader's copy fails
    recovery (a damaged batch with good ones after it is corruption, not a torn tail: the
    segment is quarantined); the agent lists the replica as offline in its registration, and
    the controller moves leadership to another in-sync replica, which serves every record,
    and drops the agent from the ISR. Then the repair of docs/operations.md (the damaged
    directory moved out, while the agent runs) brings it back into the ISR."""
    values = [b"v%04d" % i for i in range(200)]
    leader = cluster.wait_for_leaders(TOPIC)[0].leader_id
    for i in range(0, len(values), 20):
        assert _produce(cluster, leader, TOPIC, 0, values[i : i + 20]).error_code == 0
    others = [a for a in cluster.agents if a != leader]
    _wait_replicated(cluster, TOPIC, 0, values, others)
    _wait_isr(cluster, lambda isr: len(isr) == 3, "the ISR did not fill up")
    for agent_id in list(cluster.agents):
        cluster.kill(agent_id)

    directory = cluster.data_root / f"agent-{leader}" / f"{TOPIC}-0"
    segment = sorted(directory.glob("*.log"))[-1]  # the active segment: always scanned at open
    data = bytearray(segment.read_bytes())
    positions = [pos for _, pos in iter_batches(bytes(data))]
    assert len(positions) == 10
    data[positions[5] + 100] ^= 0xFF  # inside a batch's body: its CRC fails
    segment.write_bytes(bytes(data))

    # the dead controller's seat frees when its session expires; take it before anyone else
    seat = ControllerInfo(agent_id=999, epoch=1_000_000)
    deadline = time.monotonic() + 30
    while True:
        try:
            zk_client.create(CONTROLLER, dump(seat), ephemeral=True)
            break
        except NodeExistsError:
            assert time.monotonic() < deadline, "the old controller's seat did not free up"
            time.sleep(0.05)
    for agent_id in sorted(cluster.agents):
        cluster.start_agent(agent_id)
    while len(zk_client.get_children(AGENTS)) < 3:
        assert time.monotonic() < deadline + 30, "the agents did not register"
        time.sleep(0.05)
    zk_client.delete(CONTROLLER)

    state = _wait_isr(
        cluster,
        lambda isr: leader not in isr,
        f"partition 0 still has agent {leader} in its ISR",
        require_leader_not=leader,
    )
    deadline = time.monotonic() + 20
    # readable once the other in-sync follower has fetched from the new leader (high watermark)
    while (got := _read_all(cluster, state.leader_id, TOPIC, 0)) != values:
        assert len(got) < len(values) and time.monotonic() < deadline, got[:3]
        time.sleep(0.05)
    more = _produce(cluster, state.leader_id, TOPIC, 0, [b"after"])
    assert (more.error_code, more.base_offset) == (0, len(values))
    assert list(directory.glob("*.quarantined"))  # the damaged copy is kept for an operator

    # the repair in docs/operations.md: move the directory out; the agent, which retries
    # opening the log with a backoff, starts an empty replica that catches up — no restart
    directory.rename(cluster.data_root / "damaged-copy")
    _wait_isr(cluster, lambda isr: leader in isr, "the repaired replica did not rejoin the ISR")
    _wait_replicated(cluster, TOPIC, 0, [*values, b"after"], [leader])


def _wait_isr(
    cluster: Cluster,
    condition: Callable[[list[int]], bool],
    failure: str,
    *,
    require_leader_not: int = -1,
) -> m.PartitionMetadata:
    """Poll partition 0's metadata until it has a leader (not ``require_leader_not``) and its
    ISR meets ``condition``."""
    deadline = time.monotonic() + 60
    while True:
        state = cluster.metadata([TOPIC]).topics[0].partitions[0]
        if (
            state.error_code == 0
            and state.leader_id not in (require_leader_not, -1)
            and condition(state.isr)
        ):
            return state
        assert time.monotonic() < deadline, f"{failure}: {state}"
        time.sleep(0.05)
