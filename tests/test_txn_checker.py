"""A Jepsen-style check of exactly-once pipelines through agent crashes.

Three agents (replication factor 3, ``min.insync.replicas`` 2). An input topic of 4
partitions is filled while the test runs; 4 workers each consume one input partition and run
consume-transform-produce transactions: each transaction turns up to 8 input records into
output records on 3 of the 6 output partitions (chosen at random per transaction) and sends
the input offsets with it; one transaction in five is aborted on purpose (after its records
are stored). Meanwhile the coordinator of a random worker's transactional.id is killed with
SIGKILL five times, and the leader of a random output partition five times (each agent comes
back before the next kill).

Each worker logs every transaction it ran and what became of it: committed (commit
returned), aborted (abort returned), or unknown (an error in between: the worker then
starts a new producer with the same transactional.id, which settles the old transaction, and
goes on from the group's stable committed offset). The checker then reads the output with
read_committed and asserts:

* every committed transaction is there whole, every unknown one whole or not at all;
* no record of an aborted transaction, and no record of a transaction nobody logged;
* every input record is in the output exactly once (none lost, none processed twice);
* the group's committed offsets are the input partitions' ends.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from sdk import Consumer, Producer, TopicPartition
from storage.errors import StrataError
from storage.protocol import messages as m
from tests.cluster import Cluster, WireClient
from tests.harness import ProcessGroup, ZooKeeperChroot

WORKERS = 4
OUT_PARTITIONS = 6
KILLS_EACH = 5
CONFIGS = (
    "group.initial.rebalance.delay.ms=0",
    "transaction.abort.timed.out.transaction.cleanup.interval.ms=500",
    "replica.lag.time.max.ms=3000",
)


@dataclass
class Txn:
    worker: int
    number: int
    inputs: list[bytes]
    partitions: list[int]
    outcome: str = "open"  # committed | aborted | unknown


@dataclass
class Run:
    txns: list[Txn] = field(default_factory=list)
    input_done: bool = False
    chaos_done: bool = False
    kills: list[tuple[str, int]] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)


@pytest.fixture
def cluster(processes: ProcessGroup, zk_chroot: ZooKeeperChroot, tmp_path: Path) -> Cluster:
    c = Cluster(processes, zk_chroot, tmp_path / "data")
    for agent_id in (1, 2, 3):
        c.start_agent(agent_id, *CONFIGS)
    return c


def _topic_configs() -> dict[str, Any]:
    return {"min.insync.replicas": 2}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_exactly_once_pipelines_through_coordinator_and_leader_kills(cluster: Cluster) -> None:
    cluster.create_topic("in", WORKERS, replication_factor=3, configs=_topic_configs())
    cluster.create_topic("out", OUT_PARTITIONS, replication_factor=3, configs=_topic_configs())
    cluster.wait_for_leaders("in")
    cluster.wait_for_leaders("out")
    bootstrap = cluster.bootstrap
    run = Run()
    rng = random.Random(2024)
    chaos = threading.Thread(target=_chaos, args=(cluster, run, rng), daemon=True)
    chaos.start()
    try:
        asyncio.run(_pipeline(bootstrap, run, rng))
    finally:
        run.chaos_done = True  # (the chaos thread stops at its next round if still going)
        chaos.join(120)
    assert not chaos.is_alive()
    assert [k for k, _ in run.kills].count("coordinator") == KILLS_EACH
    assert [k for k, _ in run.kills].count("leader") == KILLS_EACH
    cluster.wait_for_leaders("out")
    asyncio.run(_check(cluster.bootstrap, run))


# ---- the chaos ----------------------------------------------------------------------------------


def _chaos(cluster: Cluster, run: Run, rng: random.Random) -> None:
    """Kill -9 a coordinator or an output leader, bring it back, wait for a full ISR; 10 times."""
    plan = ["coordinator", "leader"] * KILLS_EACH
    rng.shuffle(plan)
    for kind in plan:
        _wait_progress(run, rng.randrange(4, 12))  # transactions commit between the kills
        if kind == "coordinator":
            victim = _coordinator_of(cluster, f"w-{rng.randrange(WORKERS)}")
        else:
            leaders = cluster.wait_for_leaders("out")
            victim = leaders[rng.randrange(OUT_PARTITIONS)].leader_id
        run.kills.append((kind, victim))
        port = cluster.agents[victim].port
        cluster.kill(victim)
        cluster.wait_for_leaders("out", exclude={victim}, timeout=60)
        cluster.wait_for_leaders("in", exclude={victim}, timeout=60)
        # back on its port, as a deployed agent is (clients know agents by address)
        cluster.start_agent(victim, *CONFIGS, f"listen.port={port}")
        _wait_full_isr(cluster, 60)
    run.chaos_done = True


def _wait_progress(run: Run, commits: int, timeout: float = 120) -> None:
    """Until ``commits`` more transactions have committed (the pipeline goes on after a kill)."""
    deadline = time.monotonic() + timeout
    target = sum(t.outcome == "committed" for t in list(run.txns)) + commits
    while sum(t.outcome == "committed" for t in list(run.txns)) < target:
        if time.monotonic() > deadline:
            raise AssertionError(
                f"the pipelines made no progress: {Counter(t.outcome for t in run.txns)}"
            )
        time.sleep(0.05)


def _coordinator_of(cluster: Cluster, txn_id: str) -> int:
    for agent in cluster.alive():
        try:
            resp = asyncio.run(
                WireClient.call_once(
                    agent.host,
                    agent.port,
                    m.ApiKey.FIND_COORDINATOR,
                    m.FindCoordinatorRequest(txn_id, m.COORDINATOR_TRANSACTION),
                )
            )
        except (OSError, TimeoutError):
            continue
        if resp.error_code == 0:
            return int(resp.agent_id)
    raise AssertionError(f"no coordinator for {txn_id}")


def _wait_full_isr(cluster: Cluster, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        md = cluster.metadata(["in", "out"])
        if all(len(p.isr) == 3 for t in md.topics for p in t.partitions):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"ISR not full again: {md.topics}")
        time.sleep(0.1)


# ---- the pipeline ---------------------------------------------------------------------------


async def _pipeline(bootstrap: str, run: Run, rng: random.Random) -> None:
    feeder = asyncio.create_task(_feed(bootstrap, run))
    workers = [asyncio.create_task(_worker(bootstrap, w, run, rng)) for w in range(WORKERS)]
    async with asyncio.timeout(400):
        await asyncio.gather(feeder, *workers)


async def _feed(bootstrap: str, run: Run) -> None:
    """Input records ``in-<partition>-<n>`` until the chaos is over (and at least 150 each)."""
    config = {
        "bootstrap.servers": bootstrap,
        "acks": "all",
        "linger.ms": 5,
        "retry.backoff.ms": 50,
        "request.timeout.ms": 5000,
        "delivery.timeout.ms": 60_000,
    }
    n = 0
    async with Producer(config) as producer:
        while not run.chaos_done or n < 150:
            batch = [
                await producer.send("in", f"in-{p}-{n + i}".encode(), partition=p)
                for p in range(WORKERS)
                for i in range(5)
            ]
            await asyncio.gather(*batch)
            n += 5
            await asyncio.sleep(0.05)
    run.input_done = True


def _new_producer(bootstrap: str, worker: int) -> Producer:
    return Producer(
        {
            "bootstrap.servers": bootstrap,
            "transactional.id": f"w-{worker}",
            "transaction.timeout.ms": 20_000,
            "linger.ms": 2,
            "retry.backoff.ms": 50,
            "request.timeout.ms": 5000,
            "delivery.timeout.ms": 30_000,
            "max.block.ms": 30_000,
        }
    )


async def _worker(bootstrap: str, w: int, run: Run, rng: random.Random) -> None:
    tp = TopicPartition("in", w)
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": "pipeline",
            "enable.auto.commit": False,
            "isolation.level": "read_committed",
            "auto.offset.reset": "earliest",
            "fetch.max.wait.ms": 100,
            "request.timeout.ms": 10_000,
            "retry.backoff.ms": 50,
        }
    )
    await consumer.start()
    consumer.assign([tp])
    producer = await _settled_producer(bootstrap, w, consumer, tp, run)
    number = 0
    try:
        while True:
            try:
                got = (await consumer.getmany(tp, timeout_ms=200, max_records=8)).get(tp, [])
                if not got:
                    end = (await consumer.end_offsets([tp]))[tp]
                    if run.input_done and await consumer.position(tp) >= end:
                        return
                    continue
            except StrataError as exc:  # reading the input through a kill: try again
                run.errors[f"read:{type(exc).__name__}"] += 1
                continue
            number += 1
            parts = rng.sample(range(OUT_PARTITIONS), 3)
            txn = Txn(w, number, [r.value for r in got], parts)
            run.txns.append(txn)
            abort = rng.random() < 0.2
            try:
                producer.begin_transaction()
                for i, r in enumerate(got):
                    value = json.dumps({"in": r.value.decode(), "w": w, "n": number}).encode()
                    await producer.send("out", value, partition=parts[i % 3])
                await producer.send_offsets_to_transaction(
                    {tp: got[-1].offset + 1}, consumer.group_metadata()
                )
                if abort:
                    await producer.flush()  # stored, then aborted: readers must drop them
                    await producer.abort_transaction()
                    txn.outcome = "aborted"
                    consumer.seek(tp, got[0].offset)  # the inputs go round again
                else:
                    await producer.commit_transaction()
                    txn.outcome = "committed"
            except StrataError as exc:
                txn.outcome = "unknown"
                run.errors[type(exc).__name__] += 1
                await producer.close(flush_timeout=0)
                producer = await _settled_producer(bootstrap, w, consumer, tp, run)
    finally:
        await producer.close(flush_timeout=1)
        await consumer.close()


async def _settled_producer(
    bootstrap: str, w: int, consumer: Consumer, tp: TopicPartition, run: Run
) -> Producer:
    """A new producer for worker ``w`` (its init settles any transaction of the previous one)
    and the consumer moved to the group's stable committed offset."""
    while True:
        producer = _new_producer(bootstrap, w)
        try:
            await producer.start()
            await producer.init_transactions()
            committed = await consumer.committed(tp)
            consumer.seek(tp, 0 if committed is None else committed.offset)
            return producer
        except StrataError as exc:
            run.errors[f"init:{type(exc).__name__}"] += 1
            await producer.close(flush_timeout=0)
            await asyncio.sleep(0.2)


# ---- the checker ------------------------------------------------------------------------------


async def _check(bootstrap: str, run: Run) -> None:
    outs = [TopicPartition("out", p) for p in range(OUT_PARTITIONS)]
    async with Consumer(
        {
            "bootstrap.servers": bootstrap,
            "isolation.level": "read_committed",
            "auto.offset.reset": "earliest",
            "fetch.max.wait.ms": 100,
        }
    ) as reader:
        reader.assign(outs)
        ends = await reader.end_offsets(outs)
        highs = {}
        records: list[Any] = []
        async with asyncio.timeout(120):
            while [tp for tp in outs if await reader.position(tp) < ends[tp]]:
                for got in (await reader.getmany(timeout_ms=200, max_records=10_000)).values():
                    records.extend(got)
            for tp in outs:
                highs[tp] = reader.highwater(tp)
        assert ends == highs  # nothing is open any more: the LSO is the high watermark
        async with Consumer(
            {
                "bootstrap.servers": bootstrap,
                "group.id": "pipeline",
                "isolation.level": "read_committed",
            }
        ) as group:
            ins = [TopicPartition("in", p) for p in range(WORKERS)]
            input_ends = await group.end_offsets(ins)
            for tp in ins:
                committed = await group.committed(tp)
                assert committed is not None and committed.offset == input_ends[tp], tp

    by_txn: dict[tuple[int, int], list[tuple[str, int]]] = defaultdict(list)
    for r in records:
        v = json.loads(r.value)
        by_txn[(v["w"], v["n"])].append((v["in"], r.partition))
    logged = {(t.worker, t.number): t for t in run.txns}
    assert set(by_txn) <= set(logged), "records of transactions nobody ran"
    outcomes = Counter(t.outcome for t in run.txns)
    assert outcomes["aborted"] > 0 and outcomes["committed"] > 0, outcomes
    for key, txn in logged.items():
        seen = by_txn.get(key, [])
        whole = sorted(i.decode() for i in txn.inputs)
        if txn.outcome == "committed":
            assert sorted(i for i, _ in seen) == whole, f"committed {key} not whole: {seen}"
        elif txn.outcome == "aborted":
            assert not seen, f"aborted {key} visible: {seen}"
        else:
            assert not seen or sorted(i for i, _ in seen) == whole, f"{key} in part: {seen}"
        assert {p for _, p in seen} <= set(txn.partitions)
    processed = Counter(i for seen in by_txn.values() for i, _ in seen)
    twice = [i for i, n in processed.items() if n > 1]
    assert not twice, f"inputs processed into the output twice: {twice[:10]}"
    expected = sum(input_ends.values())
    assert len(processed) == expected, (len(processed), expected)
    print(
        f"transactions: {dict(outcomes)}; output records {len(records)}; kills {run.kills};"
        f" errors {dict(run.errors)}"
    )
