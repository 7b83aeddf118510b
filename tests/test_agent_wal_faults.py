"""Real agents on the agent WAL, killed while every request touches many partitions.

Each produce request carries one batch for each of 256 partitions (what a keyed
``send_batch`` sends). The agents' data directories are recorded by ``storage.wal.crashfs``:
``kill -9`` at a random moment, restart, and then a power loss (``kill -9`` and every byte
no fsync covered dropped, WAL and partition files alike). Under ``fsync.policy=always``
nothing acknowledged may be lost, nothing may appear twice, and every partition's offsets
run from 0 without a gap (``tests.fault_support.check_log``).

An agent that acknowledged a record before the WAL fsync covered it fails the power-loss
step: only the WAL holds the latest records on disk (partition files are not fsynced on the
hot path).
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from storage.codec import encode_batch
from storage.protocol import messages as m
from tests.cluster import AgentHandle, Cluster, WireClient
from tests.fault_support import Ledger, check_log, power_loss, read_log, start_recorded
from tests.harness import ProcessGroup, ZooKeeperChroot

TOPIC = "wide"
PARTITIONS = 256


@pytest.fixture
def cluster(processes: ProcessGroup, zk_chroot: ZooKeeperChroot, tmp_path: Path) -> Cluster:
    return Cluster(processes, zk_chroot, tmp_path / "data")


async def produce_wide(
    agent: AgentHandle,
    partitions: list[int],
    ledgers: dict[int, Ledger],
    *,
    acks: int,
    in_flight: int = 4,
) -> None:
    """Requests of one 2-record batch per partition, ``in_flight`` at a time, until the
    connection breaks (the agent was killed)."""
    for p in partitions:
        ledgers[p].phases.append([])
    try:
        client = await WireClient.connect(agent.host, agent.port)
    except OSError:
        return
    window = asyncio.Semaphore(in_flight)
    pending: asyncio.Queue[dict[int, list[bytes]]] = asyncio.Queue()

    async def receive() -> None:
        while True:
            sent = await pending.get()
            frame = await client.receive(30)
            window.release()
            for result in m.ProduceResponse.decode(frame.body).topics[0].partitions:
                if result.error_code == 0:
                    ledgers[result.partition].acknowledged(sent[result.partition])

    receiver = asyncio.create_task(receive())
    try:
        while not receiver.done():
            slot = asyncio.ensure_future(window.acquire())
            await asyncio.wait({slot, receiver}, return_when=asyncio.FIRST_COMPLETED)
            if receiver.done():
                slot.cancel()
                break
            sent = {p: ledgers[p].batch(2, 64) for p in partitions}
            for p, values in sent.items():
                ledgers[p].phases[-1].extend(values)
            request = m.ProduceRequest(
                acks,
                10_000,
                [
                    m.ProduceTopic(
                        TOPIC,
                        [m.ProducePartition(p, encode_batch(v)) for p, v in sent.items()],
                    )
                ],
            )
            pending.put_nowait(sent)
            await client.send(m.ApiKey.PRODUCE, request)
    except (OSError, ConnectionError, asyncio.IncompleteReadError):
        pass
    finally:
        receiver.cancel()
        await asyncio.gather(receiver, return_exceptions=True)
        await client.close()


def leaders(cluster: Cluster) -> dict[int, list[int]]:
    """Agent id -> the partitions it leads."""
    out: dict[int, list[int]] = {}
    for p, md in cluster.wait_for_leaders(TOPIC, timeout=60).items():
        out.setdefault(md.leader_id, []).append(p)
    return out


async def run_until_killed(
    cluster: Cluster,
    ledgers: dict[int, Ledger],
    acks: int,
    rng: random.Random,
    *,
    kill: str,
    agent_ids: list[int],
    by_leader: dict[int, list[int]],
) -> None:
    """Produce to every partition's leader; at a random moment kill the agents."""
    tasks = [
        asyncio.create_task(produce_wide(cluster.agents[a], ps, ledgers, acks=acks))
        for a, ps in by_leader.items()
    ]
    more = 2 * rng.randint(20, 60)  # records per partition before the kill
    await asyncio.gather(*(led.wait_acked(len(led.acked) + more) for led in ledgers.values()))
    await asyncio.sleep(rng.random() * 0.3)  # a random moment, with requests in flight
    if kill == "power":
        await asyncio.to_thread(power_loss, cluster, *agent_ids)
    else:
        for a in agent_ids:
            await asyncio.to_thread(cluster.kill, a)
    await asyncio.gather(*tasks)


def check_every_partition(cluster: Cluster, ledgers: dict[int, Ledger]) -> int:
    async def read_all() -> list[list[tuple[int, bytes]]]:
        return [await read_log(cluster, TOPIC, p) for p in range(PARTITIONS)]

    logs = asyncio.run(read_all())
    acked = 0
    for p, log in enumerate(logs):
        lost = check_log(log, ledgers[p], ledgers[p].acked)
        assert lost == [], f"partition {p} lost {len(lost)} acknowledged records"
        acked += len(ledgers[p].acked)
    return acked


@pytest.mark.parametrize("acks", [1, -1], ids=["acks=1", "acks=all-rf3"])
def test_kill_9_and_power_loss_during_wide_keyed_produce(cluster: Cluster, acks: int) -> None:
    agent_ids = [1] if acks == 1 else [1, 2, 3]
    # every topic on the agent WAL; checkpoints happen while the test runs
    settings = ("wal.mode=agent", "wal.max.bytes=1048576")
    for a in agent_ids:
        start_recorded(cluster, a, *settings)
    cluster.create_topic(
        TOPIC,
        PARTITIONS,
        len(agent_ids),
        {"fsync.policy": "always", "segment.bytes": 1 << 16},
    )
    ledgers = {p: Ledger() for p in range(PARTITIONS)}
    rng = random.Random(acks)
    # (three agents restart slower: one process crash, then the power loss)
    kills = ("process", "process", "power") if acks == 1 else ("process", "power")
    for kill in kills:
        asyncio.run(
            run_until_killed(
                cluster,
                ledgers,
                acks,
                rng,
                kill=kill,
                agent_ids=agent_ids,
                by_leader=leaders(cluster),
            )
        )
        for a in agent_ids:
            start_recorded(cluster, a, *settings)
        acked = check_every_partition(cluster, ledgers)
        print(f"after {kill} kill: {acked} acknowledged records, every one present once")
    for a in agent_ids:  # before the ZooKeeper chroot goes: they write to it
        cluster.kill(a)
