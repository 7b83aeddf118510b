"""Transactions against real agents (``docs/transactions.md``).

* commit and abort across partitions: read_committed sees the committed transactions whole,
  never an aborted record, and stops at an open transaction (the last stable offset);
  read_uncommitted sees everything but the markers; a producer cannot send a control batch;
* offsets sent with a transaction count only if it commits, and are "unstable" meanwhile;
* zombie fencing: a producer paused with SIGSTOP while a new instance with its
  transactional.id initializes can neither write nor commit once resumed;
* a hanging transaction (its producer killed) holds read_committed readers at its first
  offset until the coordinator aborts it after ``transaction.timeout.ms``;
* the coordinator's agent killed between the commit decision and the markers (a partition
  leader frozen meanwhile): the next coordinator finds the decision and completes it.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from sdk import Consumer, Producer, TopicPartition
from storage.codec import encode_batch
from storage.codec.control import encode_marker
from storage.errors import InvalidRecordError, UnstableOffsetCommitError
from storage.metadata import AsyncZooKeeper
from storage.metadata.transactions import TxnRecord, TxnStore
from storage.protocol import messages as m
from tests.cluster import ROOT, Cluster, WireClient, produce_request
from tests.harness import (
    ManagedProcess,
    ProcessGroup,
    ZooKeeperChroot,
    metric_value,
    scrape_metrics,
)

CONFIGS = (
    "group.initial.rebalance.delay.ms=0",
    "transaction.abort.timed.out.transaction.cleanup.interval.ms=200",
    "transaction.complete.write.delay.ms=100",
)


@pytest.fixture
def cluster(processes: ProcessGroup, zk_chroot: ZooKeeperChroot, tmp_path: Path) -> Cluster:
    c = Cluster(processes, zk_chroot, tmp_path / "data")
    for agent_id in (1, 2):
        c.start_agent(agent_id, *CONFIGS)
    return c


def producer_config(cluster: Cluster, txn_id: str, **extra: Any) -> dict[str, Any]:
    return {
        "bootstrap.servers": cluster.bootstrap,
        "transactional.id": txn_id,
        "linger.ms": 1,
        "retry.backoff.ms": 50,
        **extra,
    }


def consumer(cluster: Cluster, isolation: str, **extra: Any) -> Consumer:
    return Consumer(
        {
            "bootstrap.servers": cluster.bootstrap,
            "isolation.level": isolation,
            "auto.offset.reset": "earliest",
            "fetch.max.wait.ms": 100,
            **extra,
        }
    )


async def drain(c: Consumer, until: Callable[[list[Any]], bool], within: float = 30.0) -> list[Any]:
    """Records from ``c`` until ``until(records)`` holds (or the deadline passes)."""
    got: list[Any] = []
    async with asyncio.timeout(within):
        while not until(got):
            for records in (await c.getmany(timeout_ms=200)).values():
                got.extend(records)
    return got


async def settle(c: Consumer, tps: list[TopicPartition], within: float = 30.0) -> list[Any]:
    """Everything ``c`` can read now: up to each partition's end (its LSO for read_committed)."""
    ends = await c.end_offsets(tps)
    got: list[Any] = []
    async with asyncio.timeout(within):
        while [tp for tp in tps if await c.position(tp) < ends[tp]]:
            for records in (await c.getmany(timeout_ms=200)).values():
                got.extend(records)
    return got


async def eventually(check: Callable[[], Awaitable[Any]], what: str, within: float = 30.0) -> Any:
    """Poll ``check()`` until it returns something true (a deadline, not a sleep)."""
    deadline = time.monotonic() + within
    while True:
        got = await check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


async def txn_record(cluster: Cluster, txn_id: str) -> Any:
    zk = AsyncZooKeeper(cluster.zk.connect_string)
    await zk.start()
    try:
        record, _ = await TxnStore(zk).get(txn_id)
        return record
    finally:
        await zk.stop()


# ---- commit, abort, read_committed ---------------------------------------------------------------


def test_commit_abort_and_read_committed(cluster: Cluster) -> None:
    cluster.create_topic("t", 3, replication_factor=2)
    leaders = cluster.wait_for_leaders("t")
    leader = cluster.agents[leaders[0].leader_id]
    asyncio.run(_commit_abort_and_read_committed(cluster, leader.host, leader.port))


async def _commit_abort_and_read_committed(cluster: Cluster, host: str, port: int) -> None:
    tps = [TopicPartition("t", p) for p in range(3)]
    async with (
        Producer(producer_config(cluster, "a")) as a,
        Producer(producer_config(cluster, "b")) as b,
    ):
        await a.init_transactions()
        await b.init_transactions()
        a.begin_transaction()
        for p in range(3):
            for i in range(3):
                await a.send("t", f"c1-{p}-{i}".encode(), partition=p)
        await a.commit_transaction()
        a.begin_transaction()
        aborted_futures = [await a.send("t", f"x-{p}".encode(), partition=p) for p in range(3)]
        await a.flush()  # stored (read_uncommitted sees them), then aborted
        await a.abort_transaction()
        assert all(f.result().offset >= 0 for f in aborted_futures)
        assert a.metrics()["producer_epoch"] == 1  # an abort moves the producer to a new epoch
        b.begin_transaction()
        open_at = (await (await b.send("t", b"b-open", partition=0))).offset
        a.begin_transaction()
        await a.send("t", b"c2-0", partition=0)
        await a.commit_transaction()

        async with consumer(cluster, "read_committed") as rc:
            rc.assign(tps)
            seen = await settle(rc, tps)
            assert sorted(r.value for r in seen) == sorted(
                f"c1-{p}-{i}".encode() for p in range(3) for i in range(3)
            )
            # b's open transaction holds partition 0 back: the LSO is its first offset
            ends = await rc.end_offsets(tps)
            assert ends[tps[0]] == open_at == rc.last_stable_offset(tps[0])
            await b.commit_transaction()
            more = await drain(rc, lambda got: len(got) >= 2)
            assert [r.value for r in more] == [b"b-open", b"c2-0"]
            assert (await rc.end_offsets(tps))[tps[0]] == rc.highwater(tps[0])

        async with consumer(cluster, "read_uncommitted") as ru:
            ru.assign(tps)
            everything = await settle(ru, tps)
            values = sorted(r.value for r in everything)
            assert [v for v in values if v.startswith(b"x-")] == [b"x-0", b"x-1", b"x-2"]
            assert len(values) == 9 + 3 + 2  # the markers (8 of them) are never records
            offsets = {(r.partition, r.offset) for r in everything}
            assert len(offsets) == len(everything)
        client = await WireClient.connect(host, port)
        try:
            forged = encode_marker(1, 0, commit=True, coordinator_epoch=99, timestamp_ms=0)
            resp = await client.call(m.ApiKey.PRODUCE, produce_request("t", 0, forged, acks=1))
            code = resp.topics[0].partitions[0].error_code
            assert code == InvalidRecordError.code
        finally:
            await client.close()


def test_offsets_count_only_when_the_transaction_commits(cluster: Cluster) -> None:
    cluster.create_topic("in", 1, replication_factor=2)
    cluster.create_topic("out", 2, replication_factor=2)
    cluster.wait_for_leaders("in")
    cluster.wait_for_leaders("out")
    asyncio.run(_offsets_count_only_when_the_transaction_commits(cluster))


async def _offsets_count_only_when_the_transaction_commits(cluster: Cluster) -> None:
    tp = TopicPartition("in", 0)
    async with Producer({"bootstrap.servers": cluster.bootstrap, "acks": "all"}) as plain:
        for i in range(10):
            await plain.send("in", f"in-{i}".encode(), partition=0)
        await plain.flush()
    async with (
        Producer(producer_config(cluster, "pipe")) as producer,
        consumer(cluster, "read_committed", **{"group.id": "g", "enable.auto.commit": False}) as c,
    ):
        await producer.init_transactions()
        c.assign([tp])
        batch = await drain(c, lambda got: len(got) >= 5)
        batch = batch[:5]
        producer.begin_transaction()
        for r in batch:
            await producer.send("out", r.value.upper(), partition=r.offset % 2)
        await producer.send_offsets_to_transaction({tp: batch[-1].offset + 1}, c.group_metadata())
        # while the transaction is open its offsets are unstable: a stable fetch must wait
        coordinator = await find_coordinator(cluster, "g", m.COORDINATOR_GROUP)
        client = await WireClient.connect(*coordinator)
        try:
            unstable = await client.call(
                m.ApiKey.OFFSET_FETCH,
                m.OffsetFetchRequest("g", [m.OffsetFetchTopic("in", [0])], 1),
            )
            assert unstable.topics[0].partitions[0].error_code == UnstableOffsetCommitError.code
            loose = await client.call(
                m.ApiKey.OFFSET_FETCH, m.OffsetFetchRequest("g", [m.OffsetFetchTopic("in", [0])])
            )
            assert loose.topics[0].partitions[0].offset == -1  # nothing committed yet
            await producer.abort_transaction()
            assert await c.committed(tp) is None  # aborted: the offsets were dropped
            producer.begin_transaction()
            for r in batch:
                await producer.send("out", r.value.upper(), partition=r.offset % 2)
            await producer.send_offsets_to_transaction(
                {tp: batch[-1].offset + 1}, c.group_metadata()
            )
            await producer.commit_transaction()
            committed = await c.committed(tp)
            assert committed is not None and committed.offset == batch[-1].offset + 1
            stable = await client.call(
                m.ApiKey.OFFSET_FETCH,
                m.OffsetFetchRequest("g", [m.OffsetFetchTopic("in", [0])], 1),
            )
            assert stable.topics[0].partitions[0].offset == batch[-1].offset + 1
        finally:
            await client.close()
    async with consumer(cluster, "read_committed") as out:
        outs = [TopicPartition("out", p) for p in range(2)]
        out.assign(outs)
        got = await settle(out, outs)
        assert sorted(r.value for r in got) == sorted(r.value.upper() for r in batch)


async def find_coordinator(cluster: Cluster, key: str, key_type: int) -> tuple[str, int]:
    agent = cluster.alive()[0]
    resp = await WireClient.call_once(
        agent.host, agent.port, m.ApiKey.FIND_COORDINATOR, m.FindCoordinatorRequest(key, key_type)
    )
    assert resp.error_code == 0
    return resp.host, resp.port


# ---- zombies, hanging transactions, failover -------------------------------------------------


def start_client(
    cluster: Cluster, tmp_path: Path, txn_id: str, *extra: str, partition: int = 0
) -> tuple[ManagedProcess, Path]:
    log = tmp_path / f"{txn_id}.jsonl"
    argv = [
        sys.executable,
        "-m",
        "tests.txn_client",
        "--bootstrap",
        cluster.bootstrap,
        "--txn-id",
        txn_id,
        "--topic",
        "t",
        "--partition",
        str(partition),
        "--log",
        str(log),
        *extra,
    ]
    return cluster.processes.start(argv, name=txn_id, cwd=ROOT), log


def client_events(log: Path) -> list[dict[str, Any]]:
    if not log.exists():
        return []
    text = log.read_text()
    return [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines()]


async def client_event(
    log: Path, ev: str, proc: ManagedProcess, within: float = 30.0
) -> dict[str, Any]:
    async def found() -> dict[str, Any] | None:
        hits = [e for e in client_events(log) if e["ev"] == ev]
        if not hits and not proc.alive:
            raise AssertionError(f"{proc.name} exited before {ev!r}:\n{proc.log_text()[-3000:]}")
        return hits[0] if hits else None

    event: dict[str, Any] = await eventually(found, f"{proc.name}: {ev}", within)
    return event


def test_a_zombie_producer_can_neither_write_nor_commit(cluster: Cluster, tmp_path: Path) -> None:
    cluster.create_topic("t", 1, replication_factor=2)
    cluster.wait_for_leaders("t")
    asyncio.run(_zombie(cluster, tmp_path))


async def _zombie(cluster: Cluster, tmp_path: Path) -> None:
    zombie, log = start_client(cluster, tmp_path, "shared", "--then", "resume")
    sent = await client_event(log, "sent", zombie)
    cluster.processes.kill(zombie.pid, signal.SIGSTOP)  # paused mid-transaction
    try:
        async with Producer(producer_config(cluster, "shared")) as successor:
            await successor.init_transactions()  # fences the zombie, aborts its transaction
            assert successor.metrics()["producer_epoch"] > sent["epoch"]
            successor.begin_transaction()
            await successor.send("t", b"successor", partition=0)
            await successor.commit_transaction()
    finally:
        cluster.processes.kill(zombie.pid, signal.SIGCONT)
    cluster.processes.kill(zombie.pid, signal.SIGUSR1)
    wrote = await client_event(log, "send", zombie)
    committed = await client_event(log, "commit", zombie)
    aborted = await client_event(log, "abort", zombie)
    # the partition refuses its old epoch; the commit fails with that; the coordinator then
    # tells it that it is fenced (fatal)
    assert wrote["error"] == "InvalidProducerEpochError", wrote
    assert "transactional.id fenced it" in wrote["message"]
    assert committed["error"] in ("InvalidProducerEpochError", "ProducerFencedError"), committed
    assert aborted["error"] == "ProducerFencedError", aborted
    async with consumer(cluster, "read_committed") as rc:
        rc.assign([TopicPartition("t", 0)])
        got = await settle(rc, [TopicPartition("t", 0)])
        assert [r.value for r in got] == [b"successor"]


def test_a_hanging_transaction_is_aborted_after_its_timeout(
    cluster: Cluster, tmp_path: Path
) -> None:
    cluster.create_topic("t", 1, replication_factor=2)
    cluster.wait_for_leaders("t")
    asyncio.run(_hanging(cluster, tmp_path))


async def _hanging(cluster: Cluster, tmp_path: Path) -> None:
    timeout_ms = 5000
    hanging, log = start_client(
        cluster, tmp_path, "hangs", "--then", "hang", "--timeout-ms", str(timeout_ms)
    )
    sent = await client_event(log, "sent", hanging)
    cluster.processes.kill(hanging.pid)  # its producer is gone for good
    hanging.wait(10)
    first = sent["offsets"][0]
    tp = TopicPartition("t", 0)
    async with Producer(producer_config(cluster, "other")) as other:
        await other.init_transactions()
        other.begin_transaction()
        for i in range(3):
            await other.send("t", f"after-{i}".encode(), partition=0)
        await other.commit_transaction()
        record = await txn_record(cluster, "hangs")
        async with consumer(cluster, "read_committed") as rc:
            rc.assign([tp])
            early = await rc.getmany(timeout_ms=300)
            # still within the timeout: the open transaction holds readers at its start
            if time.time() * 1000 - record.started_ms < timeout_ms:
                assert not early and (await rc.end_offsets([tp]))[tp] == first
                assert rc.last_stable_offset(tp) in (-1, first)
            got = await drain(rc, lambda got: len(got) >= 3, within=timeout_ms / 1000 + 20)
            assert [r.value for r in got] == [b"after-0", b"after-1", b"after-2"]
            assert time.time() * 1000 - record.started_ms >= timeout_ms
    ended = await txn_record(cluster, "hangs")
    assert ended.bumped_by == "timeout" and ended.phase in ("prepare_abort", "complete_abort")
    async with consumer(cluster, "read_uncommitted") as ru:
        ru.assign([tp])
        everything = await settle(ru, [tp])
        assert sum(r.value.startswith(b"hangs-") for r in everything) == len(sent["offsets"])


# ---- a transaction no coordinator knows --------------------------------------------------------
ORPHAN_CONFIGS = ("transaction.max.timeout.ms=1500", "transaction.orphan.check.interval.ms=100")


def test_a_transaction_no_coordinator_knows_is_aborted_by_its_leader(
    processes: ProcessGroup, zk_chroot: ZooKeeperChroot, tmp_path: Path
) -> None:
    """A transactional batch that no coordinator has in a transaction (a late produce after
    an abort, a client that skipped AddPartitionsToTxn) opens a transaction that nobody ends:
    read_committed readers stop at it. While a coordinator's record names the partition in an
    ongoing transaction of that producer, the leader leaves it alone; once no record does,
    past ``transaction.max.timeout.ms``, the leader aborts it: the records behind it become
    readable, the hanging one never does."""
    cluster = Cluster(processes, zk_chroot, tmp_path / "data")
    agent = cluster.start_agent(1, *CONFIGS, *ORPHAN_CONFIGS)
    cluster.create_topic("orphans", 1)
    cluster.wait_for_leaders("orphans")
    asyncio.run(_orphan(cluster))
    assert "aborting a hanging transaction on orphans-0: producer 4242" in agent.process.log_text()
    page = scrape_metrics(agent.metrics_url)
    assert metric_value(page, "strata_transactions_hanging_aborted_total") == 1


async def _orphan(cluster: Cluster) -> None:
    tp = TopicPartition("orphans", 0)
    zk = AsyncZooKeeper(cluster.zk.connect_string)
    await zk.start()
    store = TxnStore(zk)
    await store.init()
    now = int(time.time() * 1000)
    # a coordinator's record of producer 4242: an ongoing transaction on orphans-0 (started
    # in the future, so no coordinator times it out during the test)
    ongoing = TxnRecord(
        producer_id=4242,
        epoch=0,
        phase="ongoing",
        timeout_ms=1500,
        partitions={"orphans": [0]},
        started_ms=now + 3_600_000,
        updated_ms=now,
    )
    (version,) = await store.write_many([("orphan-txn", ongoing, -1)])
    assert isinstance(version, int)
    try:
        async with Producer({"bootstrap.servers": cluster.bootstrap, "acks": "all"}) as p:
            raw = encode_batch(
                [b"hanging"], producer_id=4242, producer_epoch=0, base_sequence=0,
                transactional=True,
            )  # fmt: skip
            assert await p.send_exact({tp: raw}, 10) == {tp: 0}
            for i in range(10):
                await p.send("orphans", f"after-{i}".encode(), partition=0)
            await p.flush()
        async with consumer(cluster, "read_committed") as rc:
            rc.assign([tp])
            # three times the sweeper's threshold: the record names the partition, so the
            # transaction stays open and holds committed readers at its first offset (an
            # absence over a while: there is no event to await)
            deadline = time.monotonic() + 3 * 1.6
            while time.monotonic() < deadline:
                assert not (await rc.getmany(timeout_ms=200)), "read past an open transaction"
            assert (await rc.end_offsets([tp]))[tp] == 0
            # the coordinator is done with it (aborted elsewhere, say): now nobody ends it
            done = ongoing.model_copy(update={"phase": "complete_abort", "partitions": {}})
            assert await store.write_many([("orphan-txn", done, version)]) == [version + 1]
            got = await drain(rc, lambda got: len(got) >= 10, within=30)
            assert [r.value for r in got] == [f"after-{i}".encode() for i in range(10)]
        async with consumer(cluster, "read_uncommitted") as ru:
            ru.assign([tp])
            everything = [r.value for r in await settle(ru, [tp])]
            assert everything == [b"hanging"] + [f"after-{i}".encode() for i in range(10)]
    finally:
        await zk.stop()


def test_the_next_coordinator_completes_a_decided_commit(
    processes: ProcessGroup, zk_chroot: ZooKeeperChroot, tmp_path: Path
) -> None:
    cluster = Cluster(processes, zk_chroot, tmp_path / "data")
    for agent_id in (1, 2, 3):
        cluster.start_agent(agent_id, *CONFIGS)
    cluster.create_topic("t", 3, replication_factor=1)
    leaders = {p: md.leader_id for p, md in cluster.wait_for_leaders("t").items()}
    asyncio.run(_next_coordinator_completes(cluster, leaders))


async def _next_coordinator_completes(cluster: Cluster, leaders: dict[int, int]) -> None:
    # a transactional.id whose coordinator leads none of the partitions we write to
    chosen = None
    for i in range(200):
        _, port = await find_coordinator(cluster, f"c-{i}", m.COORDINATOR_TRANSACTION)
        coordinator = next(a.agent_id for a in cluster.alive() if a.port == port)
        others = [p for p, leader in leaders.items() if leader != coordinator]
        if others:
            chosen = (f"c-{i}", coordinator, others[0])
            break
    assert chosen is not None
    txn_id, coordinator, partition = chosen
    frozen = leaders[partition]
    tp = TopicPartition("t", partition)
    async with Producer(
        producer_config(cluster, txn_id, **{"transaction.timeout.ms": 120_000})
    ) as producer:
        await producer.init_transactions()
        producer.begin_transaction()
        for i in range(4):
            await producer.send("t", f"decided-{i}".encode(), partition=partition)
        await producer.flush()
        cluster.kill(frozen, signal.SIGSTOP)  # its partition cannot take the marker now
        try:
            await producer.commit_transaction()  # the decision is in ZooKeeper: committed
            record = await txn_record(cluster, txn_id)
            assert record.phase == "prepare_commit"
            cluster.kill(coordinator)  # kill -9 before the markers are written
        finally:
            cluster.kill(frozen, signal.SIGCONT)

    async def completed() -> bool:
        record = await txn_record(cluster, txn_id)
        return bool(record.phase == "complete_commit")

    await eventually(completed, "the next coordinator to complete the commit", within=60)
    async with consumer(cluster, "read_committed") as rc:
        rc.assign([tp])
        got = await drain(rc, lambda got: len(got) >= 4, within=30)
        assert [r.value for r in got] == [f"decided-{i}".encode() for i in range(4)]
