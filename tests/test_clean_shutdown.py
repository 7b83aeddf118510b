"""A graceful restart is the same incarnation; a crash is a new one (``clean_shutdown``).

After a graceful stop every log was flushed and closed, so the agent that comes back has all
its predecessor had: it registers under the same incarnation and leads its partitions again
at the same epoch, without the controller re-electing each one. After kill -9 it may have
lost an unsynced tail, so it is a new incarnation and is fenced (a new epoch) as before.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from kazoo.client import KazooClient

from broker_agents import clean_shutdown
from storage.codec import encode_batch
from storage.protocol import messages as m
from tests.cluster import Cluster, WireClient, fetch_values, produce_request
from tests.harness import ProcessGroup, ZooKeeperChroot

TOPIC = "t"


def test_the_note_speaks_for_one_restart_of_its_own_agent(tmp_path: Path) -> None:
    clean_shutdown.record(tmp_path, 3, "abc")
    assert clean_shutdown.take(tmp_path, 3) == "abc"
    assert clean_shutdown.take(tmp_path, 3) is None  # taken: a crash after it is a new one
    clean_shutdown.record(tmp_path, 3, "abc")
    assert clean_shutdown.take(tmp_path, 4) is None  # another agent's disk
    assert not (tmp_path / clean_shutdown.NOTE).exists()
    (tmp_path / clean_shutdown.NOTE).write_text('{"agent_id": 3, "incarn')  # torn
    assert clean_shutdown.take(tmp_path, 3) is None
    assert not (tmp_path / clean_shutdown.NOTE).exists()


def _incarnation(zk: KazooClient) -> str:
    data, _ = zk.get("/agents/1")
    incarnation: str = json.loads(data)["incarnation"]
    return incarnation


def _epoch(zk: KazooClient) -> int:
    data, _ = zk.get(f"/topics/{TOPIC}/partitions/0/state")
    epoch: int = json.loads(data)["leader_epoch"]
    return epoch


def _produce(cluster: Cluster, values: list[bytes]) -> None:
    agent = cluster.agents[1]

    async def run() -> None:
        resp = await WireClient.call_once(
            agent.host,
            agent.port,
            m.ApiKey.PRODUCE,
            produce_request(TOPIC, 0, encode_batch(values), acks=1),
        )
        assert resp.topics[0].partitions[0].error_code == 0

    asyncio.run(run())


def test_a_graceful_restart_leads_again_at_the_same_epoch_and_a_crash_does_not(
    processes: ProcessGroup, zk_chroot: ZooKeeperChroot, zk_client: KazooClient, tmp_path: Path
) -> None:
    cluster = Cluster(processes, zk_chroot, tmp_path / "data")
    cluster.start_agent(1)
    # ``interval``: on the agent WAL, acknowledged before any fsync
    cluster.create_topic(TOPIC, 1, 1, {"fsync.policy": "interval"})
    cluster.wait_for_leaders(TOPIC)
    _produce(cluster, [b"a", b"b"])
    first, epoch = _incarnation(zk_client), _epoch(zk_client)

    cluster.stop(1)  # SIGTERM: a graceful stop
    assert (tmp_path / "data" / "agent-1" / clean_shutdown.NOTE).exists()
    cluster.start_agent(1)
    cluster.wait_for_leaders(TOPIC)
    assert _incarnation(zk_client) == first
    assert _epoch(zk_client) == epoch  # led again without an election
    assert not (tmp_path / "data" / "agent-1" / clean_shutdown.NOTE).exists()
    assert fetch_values(cluster.agents[1], TOPIC) == [b"a", b"b"]
    # its log was opened before its state arrived (``broker_agents.preopen``)
    assert "opened 1 local logs ahead" in cluster.agents[1].process.log_text()
    _produce(cluster, [b"c"])

    cluster.kill(1)  # kill -9: no note, a new incarnation, fenced at a new epoch
    cluster.start_agent(1)
    cluster.wait_for_leaders(TOPIC)
    assert _incarnation(zk_client) != first
    assert _epoch(zk_client) > epoch
    assert fetch_values(cluster.agents[1], TOPIC) == [b"a", b"b", b"c"]  # c from the WAL
    assert "opened 1 local logs ahead" in cluster.agents[1].process.log_text()
