"""Retry topics and dead-letter topics end to end: real agents, real ZooKeeper, the scheduler
and the retry router each run by the event-source runner as its own process."""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import json
import os
import random
import re
import signal
import sys
import threading
import time
import zlib
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from handlers import retry as retry_handler
from handlers.admin import handler as admin_handler
from handlers.ranges import read_committed_range
from handlers.retry import Router
from handlers.runtime import NATIVE_RECORDS
from infra import demo_retries
from infra.local_runtime import start_local_runtime
from sdk import Consumer, ConsumerRecord, Producer, TopicPartition
from sdk.admin import SyncAdmin
from sdk.delays import level_topics
from sdk.failures import (
    FAILURES_TOPIC,
    H_ATTEMPT,
    H_OFFSET,
    H_PARTITION,
    H_TOPIC,
    build_failure,
    retry_topic,
)
from sdk.retry import H_DUE_MS, H_FAILED_MS, header, identity_seed, retry_info
from storage.errors import InvalidRetryPolicyError, StrataError
from storage.metadata import MetadataStore
from storage.metadata.retry import RetryStore
from storage.metadata.zk import AsyncZooKeeper
from storage.retry_policy import RetryPolicy
from tests.cluster import ROOT, Cluster
from tests.delay_support import (
    create_levels,
    delay_status,
    delete_topic,
    start_scheduler,
    wait_until,
    with_store,
)
from tests.harness import ManagedProcess, ProcessGroup, ZooKeeperChroot
from tests.retry_support import read_all, retry_status, set_policy, start_router

TOPIC = "orders"
DLQ = "orders.dlq"
GROUP = "billing"
PARTITIONS = 6
POLICY = {
    "backoff": "exponential",
    "initial_ms": 200,
    "multiplier": 2,
    "max_ms": 2000,
    "jitter": True,
    "max_attempts": 3,
    "dead_letter_topic": DLQ,
}


@pytest.fixture
def cluster(processes: ProcessGroup, zk_chroot: ZooKeeperChroot, tmp_path: Path) -> Cluster:
    c = Cluster(processes, zk_chroot, tmp_path / "data")
    c.start(1)
    c.create_topic(TOPIC, PARTITIONS, 1, {"fsync.policy": "interval"})
    c.wait_for_leaders(TOPIC)
    create_levels(c, lanes=4)
    return c


def failure_plan(n: int) -> tuple[set[int], set[int]]:
    """The test's own log of injected failures: about 10% of records fail their first two
    attempts, 1% fail every attempt (a hash of the record number decides)."""
    twice, always = set(), set()
    for i in range(n):
        h = zlib.crc32(str(i).encode()) % 1000
        if h < 10:
            always.add(i)
        elif h < 110:
            twice.add(i)
    return twice, always


@dataclass
class Log:
    processed: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    order: dict[bytes, list[int]] = field(default_factory=lambda: defaultdict(list))
    failed_at: dict[tuple[int, int], int] = field(default_factory=dict)
    """(record, attempt) -> when the test failed it (wall ms, before retry_later)."""
    redelivered: list[tuple[int, int, int, int, int, str]] = field(default_factory=list)
    """(record, attempt, seen ms, due ms header, failure ms header, retry seed)."""


async def produce(bootstrap: str, n: int, keys: int) -> None:
    async with Producer({"bootstrap.servers": bootstrap, "linger.ms": 5, "acks": "all"}) as p:
        for start in range(0, n, 1000):
            idx = range(start, min(n, start + 1000))
            await (
                await p.send_batch(
                    TOPIC,
                    [str(i).encode() for i in idx],
                    keys=[f"key-{i % keys}".encode() for i in idx],
                )
            )


async def consume(
    bootstrap: str, twice: set[int], always: set[int], expected: int, deadline_s: float
) -> Log:
    log = Log()
    config = {
        "bootstrap.servers": bootstrap,
        "group.id": GROUP,
        "auto.offset.reset": "earliest",
        "fetch.max.wait.ms": 50,
        "retry.ordering": "key",
    }
    async with Consumer(config) as consumer:
        consumer.subscribe([TOPIC])
        deadline = time.monotonic() + deadline_s
        while sum(log.processed.values()) < expected and time.monotonic() < deadline:
            try:
                async with asyncio.timeout(1.0):
                    record = await consumer.getone()
            except TimeoutError:
                continue
            i = int(record.value or b"-1")
            info = retry_info(record)
            now = time.time_ns() // 1_000_000
            if info.attempt > 1:
                due = int(header(record.headers, H_DUE_MS) or b"0")
                failed = int(header(record.headers, H_FAILED_MS) or b"0")
                seed = identity_seed(GROUP, info.topic, info.partition, info.offset)
                log.redelivered.append((i, info.attempt, now, due, failed, seed))
            if i in always or (i in twice and info.attempt <= 2):
                log.failed_at[(i, info.attempt)] = now
                await consumer.retry_later(record, reason=f"injected failure {info.attempt}")
                continue
            log.processed[i] += 1
            assert record.key is not None
            log.order[record.key].append(i)
        # a few seconds more: a duplicate would show up here
        settle = time.monotonic() + 3
        while time.monotonic() < settle:
            try:
                async with asyncio.timeout(0.5):
                    record = await consumer.getone()
            except TimeoutError:
                continue
            i = int(record.value or b"-1")
            if i not in always:
                log.processed[i] += 1
    return log


def test_10k_records_each_processed_once_or_dead_lettered_once_retries_on_time_in_key_order(
    cluster: Cluster,
) -> None:
    n, keys = 10_000, 1000
    twice, always = failure_plan(n)
    set_policy(cluster, GROUP, TOPIC, POLICY)
    start_scheduler(cluster)
    start_router(cluster)
    asyncio.run(produce(cluster.bootstrap, n, keys))
    log = asyncio.run(consume(cluster.bootstrap, twice, always, n - len(always), 240))

    # processed successfully exactly once, or (the 1%) never
    wrong = {i: c for i, c in log.processed.items() if c != 1}
    assert not wrong, f"{len(wrong)} record(s) processed more than once, e.g. {list(wrong)[:5]}"
    missing = set(range(n)) - always - set(log.processed)
    assert not missing, f"{len(missing)} record(s) never processed, e.g. {sorted(missing)[:5]}"
    assert not set(log.processed) & always

    # dead-lettered exactly once, with the attempts and the origin in headers
    dlq = asyncio.run(read_all(cluster.bootstrap, DLQ, PARTITIONS, len(always), 60, 3))
    values = [int(r.value or b"-1") for r in dlq]
    assert len(values) == len(set(values)), "a record dead-lettered twice"
    assert set(values) == always
    for rec in dlq:
        info = retry_info(rec._replace(topic="__strata_retry_failures"))
        assert info.topic == TOPIC and info.attempt - 1 == POLICY["max_attempts"]
        assert info.last_error == f"injected failure {POLICY['max_attempts']}"

    # every retry came no earlier than its backoff (from the test's own failure time)
    policy = RetryPolicy.parse(POLICY)
    assert len(log.redelivered) >= 2 * len(twice) + 2 * len(always)
    for i, attempt, seen, due, failed, seed in log.redelivered:
        assert failed >= log.failed_at[(i, attempt - 1)]
        assert due == failed + policy.backoff_ms(attempt - 1, seed)
        assert seen >= due, f"record {i} attempt {attempt} seen {due - seen} ms before it was due"

    # key order: each key's records were processed in the order they were produced
    for key, seq in log.order.items():
        assert seq == sorted(seq), f"{key!r} processed out of order: {seq}"

    def counted() -> bool:
        routers = retry_status(cluster)["routers"].values()
        return sum(s["dead_lettered"].get(DLQ, 0) for s in routers) == len(always)

    wait_until(counted, 15, "the router's counters to show the dead letters")


@pytest.mark.parametrize(
    ("policy", "topic", "mistake"),
    [
        ({"initial_ms": -1}, TOPIC, "initial_ms"),
        ({"max_ms": -5, "initial_ms": 0}, TOPIC, "max_ms"),
        ({"max_attempts": 0}, TOPIC, "max_attempts"),
        ({"dead_letter_topic": TOPIC}, TOPIC, "dead_letter_topic is the source topic"),
        ({"dead_letter_topic": "bad/name"}, TOPIC, "invalid topic name"),
        ({"backoff": "fibonacci"}, TOPIC, "backoff"),
        ({"initial_ms": 5000, "max_ms": 1000}, TOPIC, "max_ms (1000) is below initial_ms"),
        ({"max_attempts": 3, "retries": 5}, TOPIC, "retries"),
    ],
)
def test_bad_policies_are_refused_with_a_clear_error(
    policy: dict[str, object], topic: str, mistake: str
) -> None:
    with pytest.raises(InvalidRetryPolicyError, match=re.escape(mistake)) as info:
        RetryPolicy.parse(policy, topic=topic)
    assert info.value.code == 1041 and not info.value.retriable
    # the admin API refuses it the same way, before it touches ZooKeeper
    answer = admin_handler(
        {
            "httpMethod": "PUT",
            "path": f"/groups/{GROUP}/retry/{topic}",
            "headers": {"content-type": "application/json"},
            "body": json.dumps(policy),
        },
        None,
    )
    error = json.loads(answer["body"])["error"]
    assert answer["statusCode"] == 400
    assert error["code"] == 1041 and mistake in error["message"]


def fill_dlq(bootstrap: str, n: int) -> None:
    """``n`` records in the dead-letter topic as the router leaves them (origin in headers)."""

    async def run() -> None:
        async with Producer({"bootstrap.servers": bootstrap, "linger.ms": 5, "acks": "all"}) as p:
            for start in range(0, n, 500):
                idx = range(start, min(n, start + 500))
                await (
                    await p.send_batch(
                        DLQ,
                        [str(i).encode() for i in idx],
                        keys=[f"key-{i}".encode() for i in idx],
                        headers=[
                            [
                                ("strata.retry.topic", TOPIC.encode()),
                                ("strata.retry.partition", str(i % PARTITIONS).encode()),
                                ("strata.retry.offset", str(i).encode()),
                                ("strata.retry.attempt", b"3"),
                                ("kind", b"odd" if i % 2 else b"even"),
                            ]
                            for i in idx
                        ],
                    )
                )

    asyncio.run(run())


def test_redrive_5000_at_1000_per_s_killed_halfway_and_rerun_moves_each_record_once(
    cluster: Cluster, tmp_path: Path
) -> None:
    n, rate = 5000, 1000
    cluster.create_topic(DLQ, PARTITIONS, 1, {"fsync.policy": "interval"})
    cluster.wait_for_leaders(DLQ)
    fill_dlq(cluster.bootstrap, n)
    runtime = start_local_runtime(cluster.zk.connect_string, log_path=tmp_path / "runtime-1.log")
    with SyncAdmin(runtime.url, timeout=30) as admin:
        assert admin.dlq_count(DLQ) == n
        peeked = admin.dlq_peek(DLQ, 3)
        assert len(peeked) == 3 and peeked[0]["original"]["topic"] == TOPIC
        dry = admin.redrive(DLQ, TOPIC, rate, header_filter="kind=odd", dry_run=True)
        while dry["state"] == "running":
            dry = admin.redrive_run(dry["id"])
        assert (dry["moved"], dry["skipped"]) == (n // 2, n // 2)
        task = admin.redrive(DLQ, TOPIC, rate)
    progress: list[dict[str, object]] = []

    def drive(url: str) -> None:
        with SyncAdmin(url, timeout=30) as admin:
            doc = task
            while doc["state"] == "running":
                doc = admin.redrive_run(str(task["id"]))
                progress.append(doc)

    def drive_until_killed(url: str) -> None:
        with contextlib.suppress(StrataError):  # the admin API dies under it
            drive(url)

    first = threading.Thread(target=drive_until_killed, args=(runtime.url,), daemon=True)
    first.start()
    time.sleep(2.5)  # halfway at 1,000/s
    os.kill(runtime.pid, signal.SIGKILL)  # the worker dies mid-chunk as likely as not
    first.join(40)
    runtime.stop()
    runtime = start_local_runtime(cluster.zk.connect_string, log_path=tmp_path / "runtime-2.log")
    try:
        with SyncAdmin(runtime.url, timeout=30) as admin:
            halfway = admin.redrive_status(str(task["id"]))
            assert 0 < int(halfway["moved"]) < n, halfway
            drive(runtime.url)
            final = admin.redrive_status(str(task["id"]))
    finally:
        runtime.stop()
    assert final["state"] == "done" and final["moved"] == n

    got = asyncio.run(read_all(cluster.bootstrap, TOPIC, PARTITIONS, n, 60, 3))
    origins = [header(x.headers, "strata.redrive.from") for x in got]
    assert len(origins) == n == len(set(origins)), "a record redriven twice or lost"
    for x in got:  # back on its original partition, fresh (no retry headers)
        assert x.partition == int(x.value or b"-1") % PARTITIONS
        assert not any(k.startswith("strata.retry.") for k, _ in x.headers)
    # the rate: no 1 s window holds more than 10% over the limit
    stamps = sorted(x.timestamp for x in got)
    worst = max(bisect.bisect_left(stamps, t + 1000) - i for i, t in enumerate(stamps))
    print(f"redrive: busiest 1 s window {worst} records (limit {rate}/s)")
    assert worst <= rate * 1.1


def test_consumer_and_router_killed_at_random_moments_lose_nothing_and_dead_letter_once(
    cluster: Cluster, tmp_path: Path
) -> None:
    n = 4000
    _, always = failure_plan(n)  # the fail-twice records: processed, or dead-lettered by kills
    rng = random.Random(23)
    set_policy(cluster, GROUP, TOPIC, POLICY)
    start_scheduler(cluster)
    router = start_router(cluster, "router-0")
    log = tmp_path / "consumer.log"
    argv = [sys.executable, "-m", "tests.retry_consumer", "--bootstrap", cluster.bootstrap]
    argv += ["--group", GROUP, "--topic", TOPIC, "--log", str(log)]

    def consumer(name: str) -> ManagedProcess:
        return cluster.processes.start(argv, name=name, cwd=ROOT, env={})

    member = consumer("consumer-0")
    asyncio.run(produce(cluster.bootstrap, n, 500))
    for i in range(1, 7):
        time.sleep(rng.uniform(0.5, 2.5))
        if i % 2:
            cluster.processes.kill(member.pid)  # kill -9, mid-batch as likely as not
            member.wait(10)
            member = consumer(f"consumer-{i}")
        else:
            cluster.processes.kill(router.pid)
            router.wait(10)
            router = start_router(cluster, f"router-{i}")

    def oks() -> set[int]:
        text = log.read_text() if log.exists() else ""
        return {int(line.split()[1]) for line in text.splitlines() if line.startswith("ok ")}

    def dead_letters(expected: int, deadline_s: float, settle_s: float) -> list[ConsumerRecord]:
        return asyncio.run(
            read_all(cluster.bootstrap, DLQ, PARTITIONS, expected, deadline_s, settle_s)
        )

    def unprocessed() -> set[int]:
        """Records the test lets succeed that have no success logged yet. Once everything
        has settled, these are the records the kills dead-lettered: a kill that lands while
        a record is in flight counts as a failed attempt of it (docs/retries.md, "Poison
        messages and crashes"), so a record that failed twice and was then in flight at two
        kills has used its three attempts. The more loaded the machine, the longer records
        are in flight, the likelier that is."""
        return set(range(n)) - always - oks()

    def settled() -> bool:
        left = unprocessed()
        if not left:
            return True
        if len(left) > 3:
            # a kill pins at most one record (the one it had alone in flight) and the test kills
            # 3 consumers: more left is not settled (nor a read of the dead-letter topic worth
            # its 0.5 s and connection)
            return False
        return left <= {int(r.value or b"-1") for r in dead_letters(n, 0.5, 0)}

    wait_until(settled, 120, "every record processed or dead-lettered (at most 3 by kills)")
    crashed = unprocessed()
    dlq = dead_letters(len(always | crashed), 60, 3)
    values = [int(r.value or b"-1") for r in dlq]
    assert len(values) == len(set(values)), "a record dead-lettered twice"
    assert set(values) == always | crashed, "a record lost on its way to the dead-letter topic"
    assert not oks() & always
    for rec in dlq:
        if int(rec.value or b"-1") in crashed:
            info = retry_info(rec._replace(topic="__strata_retry_failures"))
            assert "died while processing it" in (info.last_error or ""), info


@pytest.mark.parametrize("member", ["consumer", "runner"])
def test_a_record_that_kills_its_consumer_counts_each_crash_as_an_attempt(
    cluster: Cluster, tmp_path: Path, member: str
) -> None:
    """Poison that is not an exception: the consumer process dies (SIGKILL) whenever it is
    handed one of two records. Each death is seen when its session expires; the group's next
    member hands the suspect offsets out one at a time, and a record that crashed consumers
    goes to retry with its crashes counted as attempts, so after ``max_attempts`` it is in
    the dead-letter topic, once, and the partition goes on. Nothing else is lost, and the
    deaths are bounded (at most ``max_attempts + 1`` per poison record). The same holds for
    a ``handler(event, context)`` run by the event-source runner (``--retry``) that kills
    the runner."""
    n = 400
    poison = {57, 288}
    set_policy(cluster, GROUP, TOPIC, POLICY)
    start_scheduler(cluster)
    start_router(cluster)
    asyncio.run(produce(cluster.bootstrap, n, 100))
    log = tmp_path / "consumer.log"
    env: dict[str, str] = {}
    if member == "consumer":
        argv = [sys.executable, "-m", "tests.retry_consumer", "--bootstrap", cluster.bootstrap]
        argv += ["--group", GROUP, "--topic", TOPIC, "--log", str(log)]
        argv += ["--poison", ",".join(map(str, sorted(poison)))]
    else:
        argv = [sys.executable, "-m", "infra.event_source", "--bootstrap", cluster.bootstrap]
        argv += ["--function", "tests.retry_function:handler", "--topics", TOPIC]
        argv += ["--group", GROUP, "--retry", "--session-timeout-ms", "3000"]
        env = {
            "STRATA_ZOOKEEPER_CONNECT": cluster.zk.connect_string,
            "STRATA_TEST_POISON": ",".join(map(str, sorted(poison))),
            "STRATA_TEST_LOG": str(log),
        }

    def oks() -> set[int]:
        text = log.read_text() if log.exists() else ""
        return {int(line.split()[1]) for line in text.splitlines() if line.startswith("ok ")}

    deaths = 0
    proc = cluster.processes.start(argv, name=f"{member}-0", cwd=ROOT, env=env)
    dlq: list[ConsumerRecord] = []
    deadline = time.monotonic() + 240
    bound = len(poison) * (POLICY["max_attempts"] + 1)
    while time.monotonic() < deadline and deaths <= bound:
        if not proc.alive:
            assert proc.returncode == -signal.SIGKILL, proc.log_text()[-2000:]
            deaths += 1
            proc = cluster.processes.start(argv, name=f"{member}-{deaths}", cwd=ROOT, env=env)
        if oks() >= set(range(n)) - poison:
            dlq = asyncio.run(read_all(cluster.bootstrap, DLQ, PARTITIONS, len(poison), 1, 0))
            if len(dlq) >= len(poison):
                break
        time.sleep(0.2)
    dlq = asyncio.run(read_all(cluster.bootstrap, DLQ, PARTITIONS, len(poison), 30, 3))
    values = sorted(int(r.value or b"-1") for r in dlq)
    assert values == sorted(poison), f"dead letters {values}, {deaths} consumer deaths"
    assert oks() >= set(range(n)) - poison and not oks() & poison
    assert POLICY["max_attempts"] <= deaths / len(poison) and deaths <= bound
    for rec in dlq:
        info = retry_info(rec._replace(topic="__strata_retry_failures"))
        # the attempt that failed last: max_attempts, or one more if the crash that found
        # the record in a retried batch counted on top (see sdk/crashes.py)
        assert info.topic == TOPIC
        assert POLICY["max_attempts"] <= info.attempt - 1 <= POLICY["max_attempts"] + 1
        assert "died while processing it" in (info.last_error or "")
    assert proc.alive  # the partition goes on without it


def test_the_demo_step_retries_dead_letters_and_redrives(cluster: Cluster, tmp_path: Path) -> None:
    cluster.create_topic(demo_retries.TOPIC, demo_retries.PARTITIONS, 1)
    cluster.wait_for_leaders(demo_retries.TOPIC)
    start_scheduler(cluster)
    with start_local_runtime(
        cluster.zk.connect_string, log_path=tmp_path / "runtime.log"
    ) as runtime:
        summary = demo_retries.run(
            cluster.bootstrap, runtime.url, cluster.zk.connect_string, tmp_path
        )
    print(summary)
    assert "redriven at 200/s, each once" in summary


def test_a_transactional_pipeline_retries_inside_its_transactions(cluster: Cluster) -> None:
    """Consume-transform-produce with ``Producer.retry_later``: the failure record is part of
    the transaction. The first transaction, which marks records failed, is aborted (and the
    pipeline goes back to its committed offsets, as after any abort); read again, some of
    them fail again and some succeed. The router, reading read_committed, never acts on the
    aborted failure records: the records that failed in a committed transaction come back
    once each, the others never, and the output holds each record exactly once."""
    set_policy(cluster, GROUP, TOPIC, POLICY)
    start_scheduler(cluster)
    start_router(cluster)
    cluster.create_topic("out", 1, 1)
    cluster.wait_for_leaders("out")
    n = 60
    fail = {i for i in range(n) if i % 10 == 3}  # fail their first attempt, every time
    transient = {i for i in range(n) if i % 10 == 7}  # fail the first time they are read only
    asyncio.run(produce(cluster.bootstrap, n, keys=6))

    async def pipeline() -> tuple[list[int], int]:
        config = {
            "bootstrap.servers": cluster.bootstrap,
            "group.id": GROUP,
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
            "isolation.level": "read_committed",
            "fetch.max.wait.ms": 50,
            "retry.enable": True,
        }
        done: list[int] = []
        failed_once: set[int] = set()
        redelivered = 0
        aborted = False
        async with (
            Consumer(config) as consumer,
            Producer({"bootstrap.servers": cluster.bootstrap, "transactional.id": "pipe"}) as out,
        ):
            await out.init_transactions()
            consumer.subscribe([TOPIC])
            deadline = time.monotonic() + 90
            while len(done) < n and time.monotonic() < deadline:
                batch = await consumer.getmany(timeout_ms=200)
                if not batch:
                    continue
                out.begin_transaction()
                sent, retried = [], 0
                for records in batch.values():
                    for r in records:
                        i = int(r.value or b"-1")
                        if (i in fail and retry_info(r).attempt == 1) or (
                            i in transient and i not in failed_once
                        ):
                            failed_once.add(i)
                            await out.retry_later(r, consumer.group_metadata(), "failed")
                            retried += 1
                        else:
                            await out.send("out", r.value, partition=0)
                            sent.append((i, retry_info(r).attempt))
                offsets = {tp: records[-1].offset + 1 for tp, records in batch.items()}
                await out.send_offsets_to_transaction(offsets, consumer.group_metadata())
                if retried and not aborted:
                    aborted = True
                    await out.abort_transaction()
                    for tp in batch:  # back to the committed offsets, as after any abort
                        committed = await consumer.committed(tp)
                        if committed is None:
                            consumer.seek_to_beginning(tp)
                        else:
                            consumer.seek(tp, committed.offset)
                    continue
                await out.commit_transaction()
                done += [i for i, _ in sent]
                redelivered += sum(1 for _, attempt in sent if attempt > 1)
            # a few seconds more: a record retried though its failure was aborted shows here
            late = await consumer.getmany(timeout_ms=3000)
            done += [int(r.value or b"-1") for records in late.values() for r in records]
        return done, redelivered

    done, redelivered = asyncio.run(pipeline())
    assert sorted(done) == list(range(n))  # each once, the failed ones through their retry
    assert redelivered == len(fail)

    async def committed_output() -> list[int]:
        config = {"bootstrap.servers": cluster.bootstrap, "isolation.level": "read_committed"}
        async with Consumer(config) as reader:
            tp = TopicPartition("out", 0)
            reader.assign([tp])
            reader.seek_to_beginning(tp)
            end = (await reader.end_offsets([tp]))[tp]  # the last stable offset
            values: list[int] = []
            async with asyncio.timeout(30):
                while await reader.position(tp) < end:
                    for records in (await reader.getmany(timeout_ms=500)).values():
                        values += [int(r.value or b"-1") for r in records]
            return values

    # the aborted transaction's records are in the log too, but not for read_committed
    assert sorted(asyncio.run(committed_output())) == list(range(n))


def test_retries_waiting_for_a_deleted_retry_topic_never_reach_the_one_created_again(
    cluster: Cluster,
) -> None:
    """A retry routed through the delay levels names the incarnation of the group's retry
    topic it was routed to (``strata.delay.topic-id``): if that topic is deleted and created
    again while the retry waits, the scheduler drops the retry (counted under ``dropped``)
    and the new retry topic never gets it (as records delayed into a deleted topic,
    ``test_delays``)."""
    n = 20
    policy = {"backoff": "fixed", "initial_ms": 15_000, "jitter": False, "max_attempts": 3}
    set_policy(cluster, GROUP, TOPIC, policy)
    start_scheduler(cluster)
    start_router(cluster)
    asyncio.run(produce(cluster.bootstrap, n, n))
    first_failure_ms = time.time() * 1000  # each retry is due 15 s after its failure, or later

    async def fail_each_once() -> None:
        config = {
            "bootstrap.servers": cluster.bootstrap,
            "group.id": GROUP,
            "auto.offset.reset": "earliest",
            "fetch.max.wait.ms": 50,
            "retry.enable": True,
        }
        failed = 0
        async with Consumer(config) as consumer, asyncio.timeout(60):
            consumer.subscribe([TOPIC])
            while failed < n:
                await consumer.retry_later(await consumer.getone(), reason="not yet")
                failed += 1
            # every failure record stored before the consumer goes (``close`` gives them
            # 5 s and leaves the rest to the partition's next owner: there is none here)
            await consumer.flush_retries()

    asyncio.run(fail_each_once())
    stored = asyncio.run(end_offsets(cluster.bootstrap, FAILURES_TOPIC))
    assert sum(stored.values()) == n, f"failure records stored: {stored}"

    def routed() -> int:
        routers = retry_status(cluster)["routers"].values()
        return sum(s["retries_by_attempt"].get("1", 0) for s in routers)

    try:
        wait_until(lambda: routed() >= n, 90, "the router to route every failure")
    except AssertionError as exc:  # what the router and the scheduler say, for the record
        raise AssertionError(
            f"{exc}: routers {retry_status(cluster)}, schedulers {delay_status(cluster)}"
        ) from None
    name = retry_topic(GROUP)
    delete_topic(cluster, name)
    cluster.create_topic(name, PARTITIONS, 1)
    cluster.wait_for_leaders(name)
    assert time.time() * 1000 < first_failure_ms + 13_000, "retries fell due before the re-create"

    def dropped() -> int:
        return sum(s.get("dropped", 0) for s in delay_status(cluster)["schedulers"].values())

    wait_until(lambda: dropped() >= n, 60, "the old retry topic's retries dropped")
    assert dropped() == n
    ends = asyncio.run(end_offsets(cluster.bootstrap, name))
    assert ends == dict.fromkeys(range(PARTITIONS), 0)


async def end_offsets(bootstrap: str, topic: str) -> dict[int, int]:
    async with Producer({"bootstrap.servers": bootstrap}) as producer:
        count = len(await producer.partitions_for(topic))
    async with Consumer({"bootstrap.servers": bootstrap}) as consumer:
        tps = [TopicPartition(topic, p) for p in range(count)]
        return {tp.partition: end for tp, end in (await consumer.end_offsets(tps)).items()}


def test_concurrent_invocations_leave_the_routers_newest_counts(
    zk_chroot: ZooKeeperChroot,
) -> None:
    """Router invocations run concurrently and each publishes the counts when it ends (at most
    every ``stats_every`` seconds, the last change when the interval ends): the stats node
    must end with the newest, whatever order the writes would finish in. Here the first write
    is held up (as a first write is when it creates the node and its parents, several requests
    between which a later write's shorter path can get ahead) while a later invocation with
    newer counts publishes."""

    class SlowFirstWrite(RetryStore):
        def __init__(self, zk: AsyncZooKeeper) -> None:
            super().__init__(zk)
            self.gate = asyncio.Event()
            self.writes = 0

        async def write_stats(self, name: str, stats: dict[str, Any]) -> None:
            self.writes += 1
            if self.writes == 1:
                await self.gate.wait()
            await super().write_stats(name, stats)

    async def main() -> dict[str, Any]:
        zk = AsyncZooKeeper(zk_chroot.connect_string)
        await zk.start()
        try:
            router = Router(name="router-test", stats_every=0.1)
            rs = SlowFirstWrite(zk)
            router.stats.retries_by_attempt["1"] = 1
            first = asyncio.ensure_future(router.write_stats(rs))
            await asyncio.sleep(0)  # the first invocation took its counts and is writing
            router.stats.retries_by_attempt["1"] = 2
            second = asyncio.ensure_future(router.write_stats(rs))
            await asyncio.sleep(0.3)  # (without the router's ordering, the second lands now)
            rs.gate.set()
            await asyncio.gather(first, second)
            async with asyncio.timeout(10):  # the interval's last change, written at its end
                while True:
                    stats: dict[str, Any] = (await RetryStore(zk).read_stats())["router-test"]
                    if stats["retries_by_attempt"] != {"1": 1}:
                        break
                    await asyncio.sleep(0.05)
            assert rs.writes == 2
            await router.close()
            return stats
        finally:
            await zk.stop()

    assert asyncio.run(main())["retries_by_attempt"] == {"1": 2}


def test_a_router_routing_failure_records_again_stores_each_output_once(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The router forwards a failures partition in ranges under intents, one batch per
    destination. Each output is stored once, retries and dead letters alike, when: the runner
    hands it records it forwarded already (a redo, with the same process and with a new one,
    which reads what it lacks from the log); a forward fails after its intent was written
    and before anything was sent; a consumer wrote copies of a failure record, read in one
    invocation, in later ones, and by a router process started after the original was
    routed (which reads the identities back from the log)."""
    policy = {"backoff": "fixed", "initial_ms": 600_000, "jitter": False, "max_attempts": 2}
    set_policy(cluster, GROUP, TOPIC, policy)
    now = int(time.time() * 1000)

    def failure(offset: int, attempt: int) -> Any:
        source = ConsumerRecord(TOPIC, 0, offset, now, b"k%d" % offset, b"v", [], ())
        if attempt > 1:  # as it comes back from the retry topic
            source = source._replace(
                topic=retry_topic(GROUP),
                headers=[
                    (H_TOPIC, TOPIC.encode()),
                    (H_PARTITION, b"0"),
                    (H_OFFSET, str(offset).encode()),
                    (H_ATTEMPT, str(attempt - 1).encode()),
                ],
            )
        return build_failure(GROUP, source, "boom", now, 8)

    async def store(failures: list[Any]) -> list[ConsumerRecord]:
        """Write failure records as a consumer does; returns them as the runner reads them."""
        tp = TopicPartition(FAILURES_TOPIC, failures[0].tp.partition)
        async with Consumer({"bootstrap.servers": cluster.bootstrap}) as c:
            start = (await c.end_offsets([tp]))[tp]
        async with Producer({"bootstrap.servers": cluster.bootstrap, "acks": "all"}) as p:
            for f in failures:
                await p.send(f.tp.topic, f.value, f.key, f.headers, f.tags, f.tp.partition)
        got = await read_committed_range(
            cluster.bootstrap, tp, start, start + len(failures), limit_s=30
        )
        assert len(got) == len(failures)
        return got

    async def route(router: Router, recs: list[ConsumerRecord]) -> dict[str, Any]:
        event = {"bootstrapServers": cluster.bootstrap, NATIVE_RECORDS: {"failures": recs}}

        async def run(store: MetadataStore) -> dict[str, Any]:
            return await router.process(event, store)

        answer: dict[str, Any] = await with_store(cluster.zk.connect_string, run)
        return answer

    async def main() -> None:
        first = await store(
            [failure(i, 1) for i in range(40)] + [failure(i, 2) for i in range(40, 50)]
        )
        router = Router(name="router-redo")
        try:
            assert (await route(router, first))["batchItemFailures"] == []
            more = await store([failure(i, 1) for i in range(50, 60)])
            assert (await route(router, first + more))["batchItemFailures"] == []
            # a new process given old records: it redoes the last forward, from the log
            assert (await route(Router(name="router-new"), first[::3]))["batchItemFailures"] == []
            copies = await store([failure(i, 1) for i in range(60, 70)] * 2)
            assert (await route(router, copies))["batchItemFailures"] == []
            assert router.stats.copies == 10
            again = await store([failure(i, 1) for i in range(60, 70)])
            assert (await route(router, again))["batchItemFailures"] == []
            later = Router(name="router-later")  # knows nothing: reads the identities back
            again = await store([failure(i, 1) for i in range(60, 65)])
            assert (await route(later, again))["batchItemFailures"] == []
            assert router.stats.copies == 20 and later.stats.copies == 5
            # a forward that fails after its intent, before sending: the retry redoes it
            cut = await store([failure(i, 1) for i in range(70, 80)])
            real = retry_handler.encode_outputs
            with monkeypatch.context() as m:
                m.setattr(retry_handler, "encode_outputs", lambda *_: 1 / 0)
                with pytest.raises(ZeroDivisionError):
                    await route(later, cut)
            monkeypatch.setattr(retry_handler, "encode_outputs", real)
            assert (await route(later, cut))["batchItemFailures"] == []
            assert later.stats.redone == 1
        finally:
            await router.close()

    asyncio.run(main())
    in_levels = 0
    for level in level_topics():
        in_levels += sum(asyncio.run(end_offsets(cluster.bootstrap, level)).values())
    assert in_levels == 70  # records 0-39 and 50-79, each once
    assert sum(asyncio.run(end_offsets(cluster.bootstrap, DLQ)).values()) == 10
