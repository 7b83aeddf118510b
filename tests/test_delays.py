"""Delayed messages end to end: real agents, real ZooKeeper, the scheduler run by the
event-source runner as its own process (``python -m infra.event_source``)."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from kazoo.client import KazooClient
from kazoo.exceptions import NoNodeError
from kazoo.protocol.states import ZnodeStat

from handlers import runtime
from handlers.scheduler import Scheduler, make_handler
from handlers.scheduler import close as close_scheduler
from infra.event_source import EventSourceRunner, scheduler_mapping
from sdk import Consumer, Producer, RecordMetadata, SyncProducer, TopicPartition
from sdk.delays import (
    HEADER_ID,
    MIN_LEVEL,
    ScheduleId,
    level_delay_ms,
    level_for,
    level_topic,
    level_topics,
)
from storage.errors import InvalidDelayError
from storage.metadata.delays import lane_path
from storage.tier import Manifest
from tests.cluster import Cluster
from tests.delay_support import (
    Delivered,
    InProcessRunner,
    cancel_at,
    create_levels,
    delay_status,
    delete_topic,
    header,
    percentile,
    read_delivered,
    start_scheduler,
    wait_until,
)
from tests.harness import ManagedProcess, ProcessGroup, S3Target, ZooKeeperChroot

TARGET = "orders"
PARTITIONS = 6
LANES = 4


@pytest.fixture
def cluster(processes: ProcessGroup, zk_chroot: ZooKeeperChroot, tmp_path: Path) -> Cluster:
    c = Cluster(processes, zk_chroot, tmp_path / "data")
    c.start(1)
    c.create_topic(TARGET, PARTITIONS, 1, {"fsync.policy": "interval"})
    c.wait_for_leaders(TARGET)
    create_levels(c, lanes=LANES)
    return c


async def produce_delayed(
    bootstrap: str, n: int, max_delay_ms: int, seed: int, *, chunk: int = 1000
) -> dict[str, tuple[int, int]]:
    """``n`` keyed records with delays uniform in [0, max_delay_ms], by ``send_batch`` with one
    delay per record: schedule id -> (due, i)."""
    rng = random.Random(seed)
    sent: dict[str, tuple[int, int]] = {}
    async with Producer({"bootstrap.servers": bootstrap, "linger.ms": 5}) as producer:
        for start in range(0, n, chunk):
            idx = range(start, min(n, start + chunk))
            runs = await (
                await producer.send_batch(
                    TARGET,
                    [f"value-{i}".encode() for i in idx],
                    keys=[f"key-{i % 97}".encode() for i in idx],
                    headers=[[("n", str(i).encode())] for i in idx],
                    tags=[["delayed"] for _ in idx],
                    delay_ms=[rng.randint(0, max_delay_ms) for _ in idx],
                )
            )
            for run in runs:
                for sid in run.schedule_ids:
                    sent[sid] = (ScheduleId.parse(sid).due_ms, -1)
    return sent


async def warm_up(bootstrap: str) -> None:
    """One record through the scheduler, so its first invocation (connecting to ZooKeeper and
    the agents) is not charged to the records under test."""
    async with Producer({"bootstrap.servers": bootstrap}) as producer:
        meta = await producer.send_and_wait(TARGET, b"warm-up", partition=0, delay_ms=0)
    got = await read_delivered(bootstrap, TARGET, PARTITIONS, 1, 30)
    assert [g.schedule_id for g in got] == [meta.schedule_id]


def test_10k_random_delays_none_early_all_once_p99_lateness_under_1s(cluster: Cluster) -> None:
    start_scheduler(cluster)
    asyncio.run(warm_up(cluster.bootstrap))
    n = 10_000
    sent = asyncio.run(produce_delayed(cluster.bootstrap, n, 20_000, seed=20))
    got = asyncio.run(read_delivered(cluster.bootstrap, TARGET, PARTITIONS, n + 1, 60, settle_s=2))
    got = [g for g in got if g.value != b"warm-up"]
    ids = [g.schedule_id for g in got]
    assert len(ids) == len(set(ids)), "a record delivered twice"
    assert set(ids) == set(sent), f"{len(set(sent) - set(ids))} record(s) never delivered"
    early = [g for g in got if g.timestamp < g.due_ms]
    assert not early, f"{len(early)} delivered early, e.g. {early[0]}"
    for g in got:  # key, value, headers and tags kept; the original timestamp in a header
        i = int(header(g.headers, "n") or b"-1")
        assert (g.key, g.value, g.tags) == (
            f"key-{i % 97}".encode(),
            f"value-{i}".encode(),
            ("delayed",),
        )
        assert header(g.headers, "n") == str(i).encode()
        assert g.original_ts <= g.due_ms
    lateness = [g.timestamp - g.due_ms for g in got]
    p50, p99 = percentile(lateness, 0.5), percentile(lateness, 0.99)
    print(f"lateness p50 {p50} ms, p99 {p99} ms, max {max(lateness)} ms")
    assert p99 <= 1000

    def reported() -> bool:  # what `strata delays status` shows
        status = delay_status(cluster)
        delivered = sum(s["delivered"] for s in status["schedulers"].values())
        return status["pending"] == 0 and delivered >= n

    wait_until(reported, 30, "the status to show everything delivered")


def check_exactly_once_none_early(got: list[Delivered], sent: dict[str, tuple[int, int]]) -> None:
    ids = [g.schedule_id for g in got]
    twice = {i for i in ids if ids.count(i) > 1} if len(ids) != len(set(ids)) else set()
    assert not twice, f"{len(twice)} record(s) delivered twice"
    missing = set(sent) - set(ids)
    assert not missing, f"{len(missing)} record(s) never delivered"
    assert set(ids) <= set(sent)
    early = [g for g in got if g.timestamp < g.due_ms]
    assert not early, f"{len(early)} delivered early, e.g. {early[0]}"


def kill_at_next_intent(
    zk: KazooClient, processes: ProcessGroup, proc: ManagedProcess, timeout: float
) -> None:
    """kill -9 ``proc`` the moment ZooKeeper shows it wrote a lane's intent: it is then between
    the intent and the commit of that forward (sending its batches), the window a redo mends."""
    killed = threading.Event()
    seen: dict[str, int] = {}

    def on_change(path: str, stat: ZnodeStat | None) -> bool:
        version = -1 if stat is None else stat.version
        if path in seen and version > seen[path] and not killed.is_set():
            processes.kill(proc.pid)
            killed.set()
        seen[path] = version
        return not killed.is_set()  # False ends the watch

    for topic in level_topics():
        for lane in range(LANES):
            path = lane_path(topic, lane)
            zk.DataWatch(path, lambda _d, stat, _e=None, path=path: on_change(path, stat))
    assert killed.wait(timeout), f"the scheduler wrote no intent in {timeout} s"
    proc.wait(10)


def test_scheduler_killed_at_random_moments_delivers_each_record_once_none_early(
    cluster: Cluster, zk_client: KazooClient
) -> None:
    """Four kill -9s, each at a random moment of the run and then at the next intent a lane's
    forward writes, so that every kill cuts a forward short and the next scheduler redoes it."""
    rng = random.Random(21)
    proc = start_scheduler(cluster, "scheduler-0")
    asyncio.run(warm_up(cluster.bootstrap))
    sent = asyncio.run(produce_delayed(cluster.bootstrap, 5_000, 30_000, seed=21))
    for i in range(1, 5):
        time.sleep(rng.uniform(0.2, 1.5))
        kill_at_next_intent(zk_client, cluster.processes, proc, 20)
        proc = start_scheduler(cluster, f"scheduler-{i}")
    got = asyncio.run(
        read_delivered(cluster.bootstrap, TARGET, PARTITIONS, len(sent) + 1, 120, settle_s=3)
    )
    check_exactly_once_none_early([g for g in got if g.value != b"warm-up"], sent)
    redone = sum(p.log_text().count("INFO redo ") for p in cluster.processes)
    print(f"{redone} forward(s) redone after 4 kills")
    assert redone, "no forward was redone: the kills proved nothing about redo"


@pytest.fixture
def cluster3(processes: ProcessGroup, zk_chroot: ZooKeeperChroot, tmp_path: Path) -> Cluster:
    c = Cluster(processes, zk_chroot, tmp_path / "data")
    c.start(3)
    c.create_topic(TARGET, PARTITIONS, 3, {"min.insync.replicas": 2})
    c.wait_for_leaders(TARGET)
    create_levels(c, lanes=2, replication_factor=3, configs={"min.insync.replicas": 2})
    return c


def test_delay_topic_leader_killed_delivers_each_record_once_none_early(
    cluster3: Cluster,
) -> None:
    cluster = cluster3
    rng = random.Random(22)
    start_scheduler(cluster)
    asyncio.run(warm_up(cluster.bootstrap))
    sent = asyncio.run(produce_delayed(cluster.bootstrap, 5_000, 15_000, seed=22))
    killed = []
    for _ in range(2):
        time.sleep(rng.uniform(1.0, 4.0))
        leaders = cluster.wait_for_leaders(level_topic(MIN_LEVEL))  # the busiest level
        victim = leaders[rng.randrange(len(leaders))].leader_id
        cluster.kill(victim)  # kill -9
        killed.append(victim)
        cluster.wait_for_leaders(level_topic(MIN_LEVEL), exclude={victim})
        time.sleep(rng.uniform(0.5, 2.0))
        cluster.start_agent(victim)
    got = asyncio.run(
        read_delivered(cluster.bootstrap, TARGET, PARTITIONS, len(sent) + 1, 120, settle_s=3)
    )
    check_exactly_once_none_early([g for g in got if g.value != b"warm-up"], sent)


def test_cancel_before_due_is_never_delivered_and_after_delivery_is_too_late(
    cluster: Cluster,
) -> None:
    start_scheduler(cluster)
    asyncio.run(warm_up(cluster.bootstrap))

    async def send(n: int, **delay: int) -> list[str]:
        async with Producer({"bootstrap.servers": cluster.bootstrap}) as producer:
            futures = [
                await producer.send(TARGET, f"c{i}".encode(), key=f"k{i}".encode(), **delay)
                for i in range(n)
            ]
            return [m.schedule_id for m in await asyncio.gather(*futures)]

    ids = asyncio.run(send(20, delay_ms=6_000))
    answers = cancel_at(cluster, [(0, sid) for sid in ids[:10]])
    assert all(answers[sid]["cancelled"] for sid in ids[:10])
    got = asyncio.run(read_delivered(cluster.bootstrap, TARGET, PARTITIONS, 11, 30, settle_s=2))
    delivered = {g.schedule_id for g in got}
    assert delivered.isdisjoint(ids[:10]), "a record cancelled in time was delivered"
    assert set(ids[10:]) <= delivered
    late = cancel_at(cluster, [(0, ids[10])])[ids[10]]
    assert late == {"schedule_id": ids[10], "cancelled": False, "reason": "delivered"}
    again = cancel_at(cluster, [(0, ids[0])])[ids[0]]
    assert again["cancelled"], "a second cancel of a cancelled record says so again"


def test_cancels_racing_delivery_are_answered_truthfully(cluster: Cluster) -> None:
    """100 records due at the same moment, each cancelled at a random time within 1.5 s
    of it: every cancel that says "in time" must keep its record off the target, and every
    "too late" must match a delivered record."""
    start_scheduler(cluster)
    asyncio.run(warm_up(cluster.bootstrap))
    due = int(time.time() * 1000) + 5_000

    async def send() -> list[str]:
        async with Producer({"bootstrap.servers": cluster.bootstrap}) as producer:
            runs = await (
                await producer.send_batch(
                    TARGET,
                    [f"r{i}".encode() for i in range(100)],
                    keys=[f"k{i}".encode() for i in range(100)],
                    deliver_at_ms=due,
                )
            )
            return [sid for run in runs for sid in run.schedule_ids]

    ids = asyncio.run(send())
    rng = random.Random(23)
    answers = cancel_at(cluster, [(due / 1000 + rng.uniform(-1.5, 1.5), sid) for sid in ids])
    got = asyncio.run(read_delivered(cluster.bootstrap, TARGET, PARTITIONS, 1, 30, settle_s=4))
    delivered = {g.schedule_id for g in got}
    in_time = {sid for sid, a in answers.items() if a["cancelled"]}
    too_late = set(ids) - in_time
    assert in_time.isdisjoint(delivered), "a cancel answered 'in time' but its record arrived"
    assert too_late <= delivered, "a cancel answered 'too late' but its record never arrived"
    print(f"{len(in_time)} cancelled in time, {len(too_late)} too late")
    assert in_time and too_late, "the cancels did not race the delivery; move the window"


def test_bad_delays_get_a_typed_error_and_store_nothing(cluster: Cluster) -> None:
    cluster.create_topic("short", 1, 1, {"delay.max.ms": 10_000})
    cluster.wait_for_leaders("short")
    bad: list[tuple[str, dict[str, Any]]] = [
        (TARGET, {"delay_ms": -1}),
        (TARGET, {"delay_ms": 1000, "deliver_at_ms": int(time.time() * 1000) + 5000}),
        (TARGET, {"delay_level": 0}),
        (TARGET, {"delay_level": 19}),
        (TARGET, {"delay_ms": 366 * 24 * 3600 * 1000}),  # over the default delay.max.ms
        ("short", {"delay_ms": 10_001}),
    ]

    async def run() -> None:
        async with Producer({"bootstrap.servers": cluster.bootstrap}) as producer:
            for topic, delay in bad:
                with pytest.raises(InvalidDelayError):
                    await producer.send(topic, b"x", **delay)
                with pytest.raises(InvalidDelayError):  # one bad record spoils the batch
                    await producer.send_batch(
                        topic,
                        [b"ok", b"bad"],
                        **{k: [0 if k == "delay_ms" else v, v] for k, v in delay.items()},
                    )
            with pytest.raises(InvalidDelayError):
                await producer.send(TARGET, b"x", headers={HEADER_ID: b"forged"}, delay_ms=1)
            ok = await producer.send_and_wait("short", b"fine", delay_ms=10_000)
            assert ok.schedule_id and ok.offset == -1

    asyncio.run(run())
    with (
        SyncProducer({"bootstrap.servers": cluster.bootstrap}) as sync,
        pytest.raises(InvalidDelayError),
    ):
        sync.produce(TARGET, b"x", delay_ms=-5)
    stored = asyncio.run(level_end_offsets(cluster.bootstrap))
    assert sum(stored.values()) == 1, f"only the good record is stored: {stored}"


async def level_end_offsets(bootstrap: str) -> dict[TopicPartition, int]:
    async with Consumer({"bootstrap.servers": bootstrap}) as consumer:
        counts = {**dict.fromkeys(level_topics(), LANES), TARGET: PARTITIONS, "short": 1}
        tps = [TopicPartition(t, p) for t, n in counts.items() for p in range(n)]
        return await consumer.end_offsets(tps)


YEAR_MS = 365 * 24 * 3600 * 1000


class JumpingClock:
    """Wall-clock milliseconds shifted by what :meth:`set` last asked for."""

    def __init__(self) -> None:
        self.skew = 0

    def __call__(self) -> int:
        return time.time_ns() // 1_000_000 + self.skew

    def set(self, ms: int) -> None:
        self.skew = ms - time.time_ns() // 1_000_000


@pytest.mark.slow
def test_a_one_year_delay_survives_tiering_and_an_agent_restart(
    processes: ProcessGroup,
    zk_chroot: ZooKeeperChroot,
    zk_client: KazooClient,
    s3: S3Target,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The clock is the test's: the scheduler reads it, the producer stamps with it. It jumps
    where the test sets it and runs on from there, as a wall clock does: a retry's backoff
    (a produce that timed out under load) still ends."""
    cluster = Cluster(processes, zk_chroot, tmp_path / "data")
    agent_configs = (f"s3.bucket={s3.bucket}", "tier.check.interval.ms=100")
    cluster.start_agent(1, *agent_configs, env=s3.env())
    cluster.create_topic(TARGET, 1, 1)
    create_levels(cluster, lanes=1, configs={"segment.ms": 300, "local.retention.ms": 0})
    now = JumpingClock()

    async def send() -> RecordMetadata:
        config = {"bootstrap.servers": cluster.bootstrap}
        async with Producer(config, wall_clock_ms=now) as producer:
            return await producer.send_and_wait(TARGET, b"a year later", key=b"k", delay_ms=YEAR_MS)

    meta = asyncio.run(send())
    held = level_topic(level_for(YEAR_MS))

    def tiered() -> bool:
        try:
            data, _ = zk_client.get(f"/topics/{held}/partitions/0/segments")
        except NoNodeError:
            return False
        return Manifest.decode(data).end >= 1

    wait_until(tiered, 60, f"the record in {held} committed to the tier")
    local = tmp_path / "data" / "agent-1" / f"{held}-0"

    def dropped_locally() -> bool:  # local.retention.ms=0: once tiered, the copy goes
        assert local.is_dir(), local
        return not (local / f"{0:020d}.log").exists()

    wait_until(dropped_locally, 60, "the local copy of the segment dropped")
    cluster.stop(1)  # from now on only the tier has the record
    cluster.start_agent(1, *agent_configs, env=s3.env())
    cluster.wait_for_leaders(held)
    cluster.wait_for_leaders(TARGET)

    monkeypatch.setenv("STRATA_ZOOKEEPER_CONNECT", zk_chroot.connect_string)
    runtime.close_shared_runtime()
    scheduler = Scheduler(clock_ms=now)
    runner = EventSourceRunner(
        scheduler_mapping(cluster.bootstrap, session_timeout_ms=3000),
        make_handler(scheduler),
        clock=lambda: now() / 1000,
    )
    due = meta.timestamp + YEAR_MS
    # the clock jumps only while the record waits in a level (parked: the runner holds its
    # come-back time), never while the scheduler reads it: a come-back measured before a
    # jump and counted from after it would lie months past the due time
    try:
        with InProcessRunner(runner):
            wait_until(lambda: runner.stats.parked >= 1, 60, "the record read and held")
            # past the held level's delay: read from the tier, the record hops down
            now.set(meta.timestamp + level_delay_ms(level_for(YEAR_MS)) + 1000)
            wait_until(lambda: scheduler.stats.hops >= 1, 60, "the first hop")
            wait_until(lambda: runner.stats.parked >= 2, 60, "the hopped record held")
            # ten minutes before it is due: to a short level, and not delivered
            now.set(due - 600_000)
            wait_until(lambda: scheduler.stats.hops >= 2, 60, "the hop to a short level")
            early = asyncio.run(read_delivered(cluster.bootstrap, TARGET, 1, 1, 3))
            assert not early, "delivered minutes early"
            wait_until(lambda: runner.stats.parked >= 3, 60, "the record held in the short level")
            now.set(due + 200)
            got = asyncio.run(read_delivered(cluster.bootstrap, TARGET, 1, 1, 60, settle_s=1))
    finally:  # its producers closed on their loop even when a wait failed
        close_scheduler(scheduler)
        runtime.close_shared_runtime()
    assert [g.schedule_id for g in got] == [meta.schedule_id]
    (g,) = got
    assert g.timestamp >= g.due_ms == meta.timestamp + YEAR_MS
    assert (g.key, g.value, g.original_ts) == (b"k", b"a year later", meta.timestamp)
    assert scheduler.stats.delivered == 1


def test_delayed_records_of_an_aborted_transaction_are_never_delivered(cluster: Cluster) -> None:
    """A transactional producer's delayed records (``send`` and ``send_batch``) belong to its
    transaction: the scheduler delivers those of a committed transaction (no earlier than
    due) and never those of an aborted one, though they were stored in the delay levels
    before the abort."""
    start_scheduler(cluster)
    asyncio.run(warm_up(cluster.bootstrap))

    async def produce() -> None:
        config = {"bootstrap.servers": cluster.bootstrap, "transactional.id": "delayed-txn"}
        async with Producer(config) as producer:
            await producer.init_transactions()
            for name in ("committed", "aborted", "also-committed"):
                producer.begin_transaction()
                sent = [
                    await producer.send(
                        TARGET, f"{name}-{i}".encode(), key=f"k{i}".encode(), delay_ms=300
                    )
                    for i in range(8)
                ]
                sent.append(
                    await producer.send_batch(
                        TARGET,
                        [f"{name}-{i}".encode() for i in range(8, 16)],
                        keys=[f"k{i}".encode() for i in range(8, 16)],
                        delay_ms=300,
                    )
                )
                await producer.flush()  # in the delay levels before the transaction ends
                if name == "aborted":
                    await producer.abort_transaction()
                    await asyncio.gather(*sent, return_exceptions=True)
                else:
                    await producer.commit_transaction()
                    await asyncio.gather(*sent)

    asyncio.run(produce())
    want = {f"{n}-{i}".encode() for n in ("committed", "also-committed") for i in range(16)}
    got = asyncio.run(
        read_delivered(cluster.bootstrap, TARGET, PARTITIONS, len(want) + 1, 60, settle_s=3)
    )
    delivered = [g for g in got if g.value != b"warm-up"]
    values = [g.value for g in delivered]
    assert not [v for v in values if v and v.startswith(b"aborted")], "an aborted record delivered"
    assert sorted(values) == sorted(want)  # type: ignore[type-var]
    assert all(g.timestamp >= g.due_ms for g in delivered)


def test_records_delayed_into_a_deleted_topic_never_reach_the_topic_created_again(
    cluster: Cluster,
) -> None:
    """Records delayed into ``orders`` that is then deleted and created again under the same
    name belong to the deleted incarnation (KIP-516): the scheduler drops them when due and
    counts them as dropped, and the new topic gets only the records sent to it. Every delayed
    send path is covered (``send``, ``send_batch`` with one delay, with one delay per record)."""
    start_scheduler(cluster)
    asyncio.run(warm_up(cluster.bootstrap))
    due_old = int(time.time() * 1000) + 10_000

    async def send(prefix: str, **delay: Any) -> list[str]:
        async with Producer({"bootstrap.servers": cluster.bootstrap}) as producer:
            one = [
                await producer.send(TARGET, f"{prefix}-{i}".encode(), key=b"k%d" % i, **delay)
                for i in range(10)
            ]
            runs = [
                await producer.send_batch(
                    TARGET, [f"{prefix}-{i}".encode() for i in range(10, 30)], **delay
                ),
                await producer.send_batch(
                    TARGET,
                    [f"{prefix}-{i}".encode() for i in range(30, 50)],
                    keys=[b"k%d" % i for i in range(30, 50)],
                    headers=[[("n", b"%d" % i)] for i in range(30, 50)],
                    **delay,
                ),
            ]
            ids = [m.schedule_id for m in await asyncio.gather(*one)]
            for stored in await asyncio.gather(*runs):
                ids += [sid for run in stored for sid in run.schedule_ids]
            return ids

    old = asyncio.run(send("old", deliver_at_ms=due_old))
    assert len(old) == 50

    delete_topic(cluster, TARGET)
    cluster.create_topic(TARGET, PARTITIONS, 1, {"fsync.policy": "interval"})
    cluster.wait_for_leaders(TARGET)
    assert time.time() * 1000 < due_old - 2_000, "the old records fell due before the re-create"
    new = asyncio.run(send("new", delay_ms=500))

    def dropped() -> int:
        return sum(s.get("dropped", 0) for s in delay_status(cluster)["schedulers"].values())

    wait_until(lambda: dropped() >= len(old), 60, "the old incarnation's records dropped")
    got = asyncio.run(read_delivered(cluster.bootstrap, TARGET, PARTITIONS, len(new), 30))
    assert sorted(g.schedule_id for g in got) == sorted(new)
    assert all(g.value and g.value.startswith(b"new-") for g in got)
    assert dropped() == len(old)
