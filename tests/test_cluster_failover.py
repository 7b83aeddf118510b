"""Three real agents and a real ZooKeeper: kill -9 an agent, kill the controller."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from storage.codec import decode_batch, decode_batches, encode_batch, iter_batches
from storage.errors import StrataError
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
