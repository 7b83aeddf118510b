"""The SDK's produce and consume paths against one real agent process and a real ZooKeeper:
acks levels and compression, headers/tags/timestamps, positions and offset lookups, resets,
the Arrow path and the blocking wrappers."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest

from sdk import (
    Consumer,
    NoOffsetForPartitionError,
    Producer,
    SyncConsumer,
    SyncProducer,
    TopicPartition,
)
from sdk.partitioner import murmur2, to_positive
from storage.errors import InvalidTopicError, UnknownTopicOrPartitionError
from storage.protocol import messages as m
from tests.cluster import Cluster, WireClient, read_records
from tests.harness import ProcessGroup, ZooKeeperChroot, metric_value, scrape_metrics

pytestmark = pytest.mark.slow


@pytest.fixture
def agent(processes: ProcessGroup, zk_chroot: ZooKeeperChroot, tmp_path: Path) -> Cluster:
    c = Cluster(processes, zk_chroot, tmp_path / "data")
    c.start(1)
    for name in ("t", "z"):
        c.create_topic(name, 2)
        c.wait_for_leaders(name)
    return c


def test_round_trip_at_every_acks_level_and_compression(agent: Cluster) -> None:
    boot = agent.bootstrap

    async def run() -> None:
        sent = []
        # acks=all: the agent answers UNSUPPORTED_VERSION until replication acks land
        for acks, compression in ((1, "zstd"), (1, "lz4"), (1, "none"), (0, "none")):
            async with Producer(
                {"bootstrap.servers": boot, "acks": acks, "compression.type": compression}
            ) as producer:
                for i in range(50):
                    record = (
                        f"{acks}-{compression}-{i}".encode(),
                        None if i % 5 == 0 else b"k%d" % (i % 3),
                        [("n", b"%d" % i)] if i % 2 else None,
                        ["even"] if i % 2 == 0 else None,
                        1_700_000_000_000 + i,
                    )
                    fut = await producer.send(
                        "t",
                        record[0],
                        key=record[1],
                        headers=record[2],
                        tags=record[3],
                        partition=0,
                        timestamp_ms=record[4],
                    )
                    sent.append((acks, fut, record))
                await producer.flush()
        for acks, fut, _ in sent:
            meta = fut.result()
            assert (meta.offset == -1) if acks == 0 else (meta.offset >= 0)
        acked = [f.result().offset for a, f, _ in sent if a != 0]
        assert acked == list(range(len(acked)))  # one partition, in send order

        async with Consumer({"bootstrap.servers": boot, "auto.offset.reset": "earliest"}) as c:
            c.assign([("t", 0)])
            got = await read_records(c, len(sent))
        assert [r.offset for r in got] == list(range(len(sent)))
        for r, (_, _, (value, key, headers, tags, ts)) in zip(got, sent, strict=True):
            assert (r.value, r.key, r.timestamp) == (value, key, ts)
            assert list(r.headers) == (headers or [])
            assert list(r.tags) == (tags or [])

    asyncio.run(run())


def test_acks_1_waits_for_an_fsync_only_under_fsync_policy_always(agent: Cluster) -> None:
    """``fsync.policy`` is the topic's durability choice: acks=1 answers after a group-commit
    fsync under ``always``, at once (page cache) under ``never`` — no fsync per request."""
    handle = agent.agents[1]
    fsyncs = "strata_fsync_duration_seconds_count"
    agent.create_topic("lazy", 1, configs={"fsync.policy": "never"})
    agent.wait_for_leaders("lazy")

    async def produce(topic: str) -> None:
        async with Producer({"bootstrap.servers": agent.bootstrap, "linger.ms": 0}) as producer:
            for i in range(20):
                meta = await producer.send_and_wait(topic, b"v%d" % i, partition=0)
                assert meta.offset == i

    before = metric_value(scrape_metrics(handle.metrics_url), fsyncs)
    asyncio.run(produce("lazy"))
    after_never = metric_value(scrape_metrics(handle.metrics_url), fsyncs)
    assert after_never == before
    asyncio.run(produce("t"))  # fsync.policy=always (the default)
    assert metric_value(scrape_metrics(handle.metrics_url), fsyncs) >= after_never + 20


def test_positions_offset_lookups_and_resets(agent: Cluster) -> None:
    boot = agent.bootstrap
    tp = TopicPartition("t", 1)

    async def run() -> None:
        async with Producer({"bootstrap.servers": boot}) as producer:
            for i in range(30):
                await producer.send("t", b"%d" % i, partition=1, timestamp_ms=1000 + 10 * i)
            await producer.flush()

        async with Consumer({"bootstrap.servers": boot}) as c:  # auto.offset.reset=latest
            c.assign([tp])
            assert await c.position(tp) == 30
            assert await c.getmany(timeout_ms=200) == {}
            assert await c.beginning_offsets([tp]) == {tp: 0}
            assert await c.end_offsets([tp]) == {tp: 30}
            found = await c.offsets_for_times({tp: 1095, TopicPartition("t", 0): 10**13})
            assert found[tp] is not None and found[tp].offset == 10
            assert found[TopicPartition("t", 0)] is None

            c.seek(tp, 25)
            got = await c.getmany(tp, timeout_ms=5000)
            assert [r.offset for r in got[tp]] == [25, 26, 27, 28, 29]

            c.seek_to_beginning(tp)
            tables = await c.getmany_arrow(timeout_ms=5000, max_records=7)
            assert tables[tp].column("offset").to_pylist() == list(range(7))
            assert await c.position(tp) == 7

            c.seek(tp, 1000)  # past the end: auto.offset.reset (latest) brings it back
            assert await c.getmany(timeout_ms=500) == {}
            assert await c.position(tp) == 30

        async with Consumer({"bootstrap.servers": boot, "auto.offset.reset": "none"}) as c:
            c.assign([tp])
            with pytest.raises(NoOffsetForPartitionError):
                await c.getmany(timeout_ms=2000)
            c.seek(tp, 28)
            got = await c.getmany(timeout_ms=5000)
            assert [r.offset for r in got[tp]] == [28, 29]

    asyncio.run(run())


def test_unknown_topic_is_a_typed_error_after_max_block(agent: Cluster) -> None:
    async def run() -> None:
        async with Producer({"bootstrap.servers": agent.bootstrap, "max.block.ms": 300}) as p:
            with pytest.raises(UnknownTopicOrPartitionError, match="not present in metadata"):
                await p.send("missing", b"x")
            with pytest.raises(UnknownTopicOrPartitionError, match="partition 5"):
                await p.send("t", b"x", partition=5)

    asyncio.run(run())


def test_an_invalid_topic_name_fails_at_once_not_after_max_block(agent: Cluster) -> None:
    """A name no topic can have is refused before any wait (max.block.ms is a minute here),
    by the SDK itself, and by the agent's Metadata answer for clients that ask anyway."""

    async def run() -> None:
        async with Producer({"bootstrap.servers": agent.bootstrap, "max.block.ms": 60_000}) as p:
            for send in (
                lambda: p.send("a/b", b"x"),
                lambda: p.send_batch("a/b", [b"x"]),
                lambda: p.send_and_wait("a/b", b"x"),
            ):
                with pytest.raises(InvalidTopicError, match="invalid topic name"):
                    async with asyncio.timeout(5):
                        await send()
        resp = await WireClient.call_once(
            agent.agents[1].host,
            agent.agents[1].port,
            m.ApiKey.METADATA,
            m.MetadataRequest(["a/b"]),
        )
        assert resp.topics[0].error_code == InvalidTopicError.code

    asyncio.run(run())


def test_blocking_wrappers(agent: Cluster) -> None:
    reports = []
    caller = threading.get_ident()

    def on_delivery(err: object, meta: object) -> None:
        reports.append((threading.get_ident(), err, meta))

    with SyncProducer({"bootstrap.servers": agent.bootstrap, "linger.ms": 1}) as producer:
        for i in range(100):
            producer.produce("z", b"%d" % i, key=b"k%d" % (i % 4), on_delivery=on_delivery)
        assert producer.flush(30) == 0
    assert len(reports) == 100
    assert all(t == caller and err is None for t, err, _ in reports)

    with SyncConsumer({"bootstrap.servers": agent.bootstrap, "auto.offset.reset": "earliest"}) as c:
        c.assign([("z", 0), ("z", 1)])
        records = c.consume(100, timeout=30)
        assert sorted(int(r.value or b"") for r in records) == list(range(100))
        assert c.poll(0.2) is None
        c.seek(("z", 0), 0)
        first = c.poll(10)
        assert first is not None and (first.partition, first.offset) == (0, 0)


@pytest.mark.parametrize("idempotent", [True, False])
def test_a_partitions_queued_batches_travel_together_in_order(
    agent: Cluster, idempotent: bool
) -> None:
    """With small batches and one partition, batches queue up behind the ones in flight; they
    go in the next request together (far fewer requests than batches) and are stored back to
    back: every run's reported offsets match what a consumer reads, in send order. (An
    idempotent producer keeps up to five batches of a partition in flight, so its requests
    carry fewer each; without idempotence one request is in flight with all the rest.)"""
    handle = agent.agents[1]

    def produce_requests() -> float:
        page = scrape_metrics(handle.metrics_url)
        return metric_value(page, 'strata_requests_total{api="produce"}')

    values = [b"%06d" % i + bytes(94) for i in range(10_000)]

    async def run() -> None:
        config = {
            "bootstrap.servers": agent.bootstrap,
            "linger.ms": 0,
            "batch.size": 4096,
            "max.request.size": 1 << 20,
            "enable.idempotence": idempotent,
        }
        async with Producer(config) as producer:
            futures = [
                await producer.send_batch("z", values[i : i + 500], partition=1)
                for i in range(0, len(values), 500)
            ]
            await producer.flush()
        runs = [r for f in futures for r in f.result()]
        assert sum(r.record_count for r in runs) == len(values)
        expected = [o for r in runs for o in range(r.base_offset, r.base_offset + r.record_count)]
        assert expected == list(range(len(values)))  # one partition: offsets in send order

        async with Consumer({"bootstrap.servers": agent.bootstrap}) as c:
            c.assign([("z", 1)])
            c.seek_to_beginning(TopicPartition("z", 1))
            got = await read_records(c, len(values))
        assert [r.offset for r in got] == list(range(len(values)))
        assert [r.value for r in got] == values

    before = produce_requests()
    asyncio.run(run())
    batches = len(values) * 100 // 4096  # at least this many 4 KiB batches were filled
    assert produce_requests() - before < batches / (2 if idempotent else 4)


def test_new_data_is_fetched_while_another_partition_of_the_leader_long_polls(
    agent: Cluster,
) -> None:
    """A partition that becomes fetchable while a long poll for another partition of the same
    agent is in flight must not wait for that poll to time out (end-to-end stalls as long as
    ``fetch.max.wait.ms``). Here: t-0's record is handed out while t-1 (no data) long-polls
    for 20 s; the next record on t-0 must arrive long before that poll ends."""
    wait_ms = 20_000

    async def run() -> float:
        async with (
            Producer({"bootstrap.servers": agent.bootstrap, "linger.ms": 0}) as producer,
            Consumer(
                {
                    "bootstrap.servers": agent.bootstrap,
                    "auto.offset.reset": "earliest",
                    "fetch.max.wait.ms": wait_ms,
                }
            ) as consumer,
        ):
            consumer.assign([("t", 0), ("t", 1)])
            await producer.send_and_wait("t", b"first", partition=0)
            first = await asyncio.wait_for(consumer.getone(), 10)
            assert first.value == b"first"
            await producer.send_and_wait("t", b"second", partition=0)
            started = asyncio.get_running_loop().time()
            second = await asyncio.wait_for(consumer.getone(), wait_ms / 1000 + 10)
            assert second.value == b"second"
            return asyncio.get_running_loop().time() - started

    took = asyncio.run(run())
    # the bug this guards against makes it wait out the other partition's 20 s poll
    assert took < wait_ms / 1000 / 2, f"the second record took {took:.1f} s"


def test_keyed_calls_over_many_partitions_store_each_record_where_their_report_says(
    processes: ProcessGroup, zk_chroot: ZooKeeperChroot, tmp_path: Path
) -> None:
    """Keyed ``send_batch`` calls over a topic of many partitions go through the producer's
    stage (``sdk.staging``): every record lands on its key's murmur2 partition, at the offset
    its call's runs name, in call order within a partition, with a ``send`` in between kept in
    its place."""
    c = Cluster(processes, zk_chroot, tmp_path / "data")
    c.start(1)
    c.create_topic("wide", 128)
    c.wait_for_leaders("wide")
    n = 3000
    calls = [
        (
            [b"key-%d" % ((i * 7919 + k) % 1000) for i in range(n)],
            [b"%d-%d" % (k, i) for i in range(n)],
            [1_700_000_000_000 + k * n + i for i in range(n)],
        )
        for k in range(3)
    ]

    async def run() -> tuple[list[Any], Any]:
        async with Producer(
            {"bootstrap.servers": c.bootstrap, "batch.size": 8 << 10, "linger.ms": 60_000}
        ) as producer:
            futures, single = [], None
            for k, (keys, values, ts) in enumerate(calls):
                futures.append(
                    await producer.send_batch("wide", values, keys=keys, timestamp_ms=ts)
                )
                if k == 0:
                    assert producer.metrics()["staged_calls"] == 1  # staged, not yet cut
                if k == 1:
                    single = await producer.send("wide", b"single", key=keys[0])
            await producer.flush()
            assert producer.metrics()["staged_calls"] == 0
            runs = [f.result() for f in futures]
            assert single is not None
        async with Consumer(
            {"bootstrap.servers": c.bootstrap, "auto.offset.reset": "earliest"}
        ) as consumer:
            consumer.assign([("wide", p) for p in range(128)])
            got = await read_records(consumer, 3 * n + 1)
        return runs, (single.result(), got)

    runs, (single, got) = asyncio.run(run())
    stored = {(r.partition, r.offset): (r.key, r.value, r.timestamp) for r in got}
    assert len(stored) == 3 * n + 1
    assert stored[(single.partition, single.offset)][1] == b"single"
    for (keys, values, ts), call_runs in zip(calls, runs, strict=True):
        assert call_runs.record_count == n
        parts = [to_positive(murmur2(key)) % 128 for key in keys]
        order = iter(sorted(range(n), key=parts.__getitem__))  # runs: in partition order
        for run_ in call_runs:
            for j in range(run_.record_count):
                i = next(order)
                assert run_.partition == parts[i]
                assert stored[(run_.partition, run_.base_offset + j)] == (keys[i], values[i], ts[i])
    # the single send sits between call 1's and call 2's records of its partition
    mine = [off for (p, off), rec in stored.items() if p == single.partition]
    before = [off for off in mine if stored[(single.partition, off)][1].startswith((b"0-", b"1-"))]
    after = [off for off in mine if stored[(single.partition, off)][1].startswith(b"2-")]
    assert max(before) < single.offset < min(after)
