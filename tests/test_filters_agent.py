"""Broker-side filtering against real agent processes and a real ZooKeeper (docs/filters.md):
filtered consumers get exactly what a plain consumer filtering on its own side gets; a filter
that matches nothing scans a long partition to its end without fetching a range twice; the
long poll of a filtered fetch; groups with one subscription; the object tier."""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path
from typing import Any

import pytest

from sdk import Consumer, Producer, SyncConsumer, SyncProducer, TopicPartition
from storage.codec import encode_batch, iter_batches
from storage.codec.header import MAGIC_V1
from storage.errors import InconsistentFilterError, InvalidFilterError
from storage.filters import parse, parse_tags
from storage.filters.expr import And, Expr, HasHeader, Header, Not, Or, Tag
from storage.protocol import messages as m
from tests.cluster import Cluster, WireClient, fetch_request, produce_request
from tests.harness import ProcessGroup, S3Target, ZooKeeperChroot, metric_value, scrape_metrics

pytestmark = pytest.mark.slow

TAGS = [f"t{i:02d}" for i in range(50)]
REGIONS = [b"eu", b"us", b"ap", b"sa"]


def matches(e: Expr, tags: list[str], headers: list[tuple[str, bytes]]) -> bool:
    """The filter's meaning, one record at a time in plain Python (the client-side filter)."""
    if isinstance(e, Tag):
        return any(t in e.values for t in tags)
    if isinstance(e, Header):
        wanted = {v.encode() for v in e.values}
        return any(k == e.key and v in wanted for k, v in headers)
    if isinstance(e, HasHeader):
        return any(k == e.key for k, _ in headers)
    if isinstance(e, Not):
        return not matches(e.item, tags, headers)
    if isinstance(e, And):
        return all(matches(i, tags, headers) for i in e.items)
    assert isinstance(e, Or)
    return any(matches(i, tags, headers) for i in e.items)


@pytest.fixture
def agent(processes: ProcessGroup, zk_chroot: ZooKeeperChroot, tmp_path: Path) -> Cluster:
    c = Cluster(processes, zk_chroot, tmp_path / "data")
    c.start(1)
    return c


async def _read_to_end(consumer: Consumer, tp: TopicPartition, end: int) -> list[Any]:
    """Every record ``getmany`` hands out until the position reaches ``end``."""
    got: list[Any] = []
    async with asyncio.timeout(120):
        while await consumer.position(tp) < end:
            for records in (await consumer.getmany(tp, timeout_ms=500)).values():
                got.extend(records)
    return got


def _filtered_fetch_metrics(url: str) -> dict[str, float]:
    text = scrape_metrics(url)
    batches = "strata_fetch_filter_batches_total"
    return {
        "scanned": metric_value(text, "strata_fetch_filter_scanned_bytes_total"),
        "sent": metric_value(text, "strata_fetch_filter_sent_bytes_total"),
        "decoded": metric_value(text, "strata_fetch_filter_decoded_batches_total"),
        **{
            outcome: metric_value(text, f'{batches}{{outcome="{outcome}"}}')
            for outcome in ("skipped", "whole", "selected")
        },
    }


# ---- exactly the matching records -----------------------------------------------------------


def test_filtered_consumers_get_exactly_what_a_client_side_filter_keeps(agent: Cluster) -> None:
    """110,000 records with tags drawn from 50 values: mixed batches from the SDK producer,
    batches of one tag each, old-format batches (no summary) sent raw, and batches from a
    producer with ``batch.summary=false`` (the same format)."""
    agent.create_topic("f", 1)
    agent.wait_for_leaders("f")
    tp = TopicPartition("f", 0)
    rng = random.Random(22)

    def record(i: int) -> tuple[bytes, list[str], list[tuple[str, bytes]]]:
        tags = rng.sample(TAGS, rng.choice((0, 1, 1, 1, 2)))
        headers = [("region", rng.choice(REGIONS))] if i % 3 else []
        return b"value-%06d" % i, tags, headers

    async def send(producer: Producer, first: int, count: int) -> None:
        chunk = [record(first + k) for k in range(count)]
        await producer.send_batch(
            "f",
            [c[0] for c in chunk],
            tags=[c[1] for c in chunk],
            headers=[c[2] for c in chunk],
            partition=0,
        )

    async def produce() -> None:
        cfg = {"bootstrap.servers": agent.bootstrap, "acks": 1, "batch.size": 64 << 10}
        async with Producer(cfg) as producer:
            i = 0
            while i < 60_000:  # mixed batches, with summaries
                await send(producer, i, 1000)
                i += 1000
            while i < 80_000:  # one tag per batch (what filters skip by summary)
                tag = TAGS[(i // 500) % len(TAGS)]
                values = [b"value-%06d" % (i + k) for k in range(500)]
                await producer.send_batch("f", values, tags=[[tag]] * 500, partition=0)
                await producer.flush()  # a batch of its own
                i += 500
            await producer.flush()
        handle = agent.agents[1]
        client = await WireClient.connect(handle.host, handle.port)
        try:
            while i < 100_000:  # format version 1, as an older producer wrote them
                chunk = [record(i + k) for k in range(400)]
                batch = encode_batch(
                    [c[0] for c in chunk],
                    tags=[c[1] for c in chunk],
                    headers=[c[2] for c in chunk],
                    summary=False,
                )
                resp = await client.call(m.ApiKey.PRODUCE, produce_request("f", 0, batch))
                assert resp.topics[0].partitions[0].error_code == 0
                i += 400
            cfg["batch.summary"] = False
            async with Producer(cfg) as producer:
                await send(producer, i, 10_000)
                await producer.flush()
            resp = await client.call(m.ApiKey.FETCH, fetch_request("f", 0, i))
            stored = resp.topics[0].partitions[0].records
            magics = [h.magic for h, _ in iter_batches(stored)]
            assert magics and set(magics) == {MAGIC_V1}  # no summary
        finally:
            await client.close()

    asyncio.run(produce())
    end = 110_000

    async def consume(**how: Any) -> list[Any]:
        cfg = {"bootstrap.servers": agent.bootstrap, "auto.offset.reset": "earliest"}
        async with Consumer(cfg) as consumer:
            consumer.assign([tp], **how)
            return await _read_to_end(consumer, tp, end)

    everything = asyncio.run(consume())
    assert [r.offset for r in everything] == list(range(end))
    before = _filtered_fetch_metrics(agent.agents[1].metrics_url)
    cases = {
        "one tag": parse_tags("t07"),
        "three tags": parse_tags("t01 || t02 || t03"),
        "a header": parse("header.region = 'eu'"),
        "tags and headers": parse(
            "tag IN ('t10', 't11') AND NOT header.region IN ('us', 'ap') OR header.region IS NULL"
            " AND tag = 't20'"
        ),
    }
    for name, filt in cases.items():
        assert filt is not None
        want = [
            (r.offset, r.value)
            for r in everything
            if matches(filt.expr, list(r.tags), list(r.headers))
        ]
        got = asyncio.run(consume(filter=filt))
        assert [(r.offset, r.value) for r in got] == want, name
        assert 0 < len(want) < end // 2, name
    after = _filtered_fetch_metrics(agent.agents[1].metrics_url)
    did = {k: after[k] - before[k] for k in after}
    # every way of handling a batch was needed: skipped or taken whole by its summary (the
    # batches of one tag), or decoded and sent with a selection (mixed ones, old ones)
    assert min(did["skipped"], did["whole"], did["selected"]) > 0
    assert did["decoded"] < did["skipped"] + did["whole"] + did["selected"]


def test_malformed_filters_are_refused_with_the_position(agent: Cluster) -> None:
    agent.create_topic("f", 1)
    agent.wait_for_leaders("f")
    handle = agent.agents[1]

    async def run() -> None:
        async with Consumer({"bootstrap.servers": agent.bootstrap, "group.id": "g"}) as c:
            with pytest.raises(InvalidFilterError) as err:
                c.assign([("f", 0)], filter="tag IN ('a', 'b'")
            assert err.value.position == 16
            with pytest.raises(InvalidFilterError) as err:
                c.subscribe(["f"], tags="a || || b")
            assert err.value.position == 5
        # a client that skips the SDK's check gets the partition's error from the agent
        client = await WireClient.connect(handle.host, handle.port)
        try:
            resp = await client.call(
                m.ApiKey.FETCH, fetch_request("f", 0, 0, filter="header.region == 'eu'")
            )
        finally:
            await client.close()
        assert resp.topics[0].partitions[0].error_code == InvalidFilterError.code

    asyncio.run(run())


def test_the_blocking_consumer_takes_a_filter_too(agent: Cluster) -> None:
    agent.create_topic("s", 1)
    agent.wait_for_leaders("s")
    with SyncProducer({"bootstrap.servers": agent.bootstrap}) as producer:
        for i in range(30):
            producer.produce("s", b"%d" % i, partition=0, tags=["even" if i % 2 == 0 else "odd"])
        producer.flush()
    with SyncConsumer({"bootstrap.servers": agent.bootstrap}) as consumer:
        consumer.assign([("s", 0)], filter="tag = 'odd'")
        consumer.seek(("s", 0), 0)
        got = consumer.consume(15, timeout=30)
        assert [r.value for r in got] == [b"%d" % i for i in range(1, 30, 2)]
        assert consumer.position(("s", 0)) == 30


# ---- a filter that matches nothing on a long partition ----------------------------------------

GiB = 1 << 30


def test_a_filter_matching_nothing_scans_a_1_gb_partition_once_and_commits_its_end(
    agent: Cluster,
) -> None:
    agent.create_topic("big", 1)
    agent.wait_for_leaders("big")
    tp = TopicPartition("big", 0)
    value = random.Random(1).randbytes(16 << 10)

    async def produce() -> int:
        cfg = {"bootstrap.servers": agent.bootstrap, "acks": 1, "buffer.memory": 256 << 20}
        async with Producer(cfg) as producer:
            for _ in range(GiB // (len(value) * 256)):
                await producer.send_batch("big", [value] * 256, tags=[["noise"]] * 256, partition=0)
            await producer.flush()
        return GiB // len(value)

    end = asyncio.run(produce())
    handle = agent.agents[1]
    scan_limit = 64 << 20  # fetch.filter.max.scan.bytes, the agent's default

    async def raw_scan() -> list[int]:
        """Follow a filtered fetch's next_offset from 0 with the raw protocol."""
        client = await WireClient.connect(handle.host, handle.port)
        asked = [0]
        try:
            while asked[-1] < end:
                resp = await client.call(
                    m.ApiKey.FETCH, fetch_request("big", 0, asked[-1], filter="tag = 'signal'")
                )
                r = resp.topics[0].partitions[0]
                assert r.error_code == 0 and not r.records and r.high_watermark == end
                assert r.next_offset > asked[-1]  # progress every time
                asked.append(r.next_offset)
        finally:
            await client.close()
        return asked

    asked = asyncio.run(raw_scan())
    assert asked[-1] == end
    assert len(asked) - 1 <= GiB // scan_limit + 2  # each fetch looked at ~scan_limit bytes

    before = _filtered_fetch_metrics(handle.metrics_url)

    async def group_consumer() -> tuple[list[Any], int | None]:
        cfg = {
            "bootstrap.servers": agent.bootstrap,
            "group.id": "nothing-matches",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
        }
        async with Consumer(cfg) as consumer:
            consumer.subscribe(["big"], tags="signal")
            async with asyncio.timeout(120):
                while not consumer.assignment():
                    await consumer.getmany(timeout_ms=200)
            got = await _read_to_end(consumer, tp, end)
            await consumer.commit()
            committed = await consumer.committed(tp)
            return got, None if committed is None else committed.offset

    got, committed = asyncio.run(group_consumer())
    assert got == [] and committed == end
    after = _filtered_fetch_metrics(handle.metrics_url)
    scanned = after["scanned"] - before["scanned"]
    # the whole partition was looked at once: no range fetched twice
    assert GiB <= scanned < GiB + (4 << 20)
    assert after["sent"] == before["sent"]


def test_a_filtered_long_poll_waits_through_records_that_do_not_match(agent: Cluster) -> None:
    agent.create_topic("lp", 1)
    agent.wait_for_leaders("lp")
    handle = agent.agents[1]

    def produce(tags: list[list[str]]) -> m.ProduceRequest:
        return produce_request("lp", 0, encode_batch([b"v"] * len(tags), tags=tags))

    async def run() -> None:
        a = await WireClient.connect(handle.host, handle.port)
        b = await WireClient.connect(handle.host, handle.port)
        try:
            started = time.monotonic()
            # on one connection, handlers start in request order: the fetch's first look (at
            # the empty partition) comes before this produce, whose records then wake it
            cid = await a.send(
                m.ApiKey.FETCH,
                fetch_request("lp", 0, 0, max_wait_ms=30_000, filter="tag = 'wanted'"),
            )
            await a.send(m.ApiKey.PRODUCE, produce([["other"]] * 3))
            await b.call(m.ApiKey.PRODUCE, produce([["other", "more"]] * 3))
            await b.call(m.ApiKey.PRODUCE, produce([["x"], ["wanted"], []]))
            frame = await a.receive(40)
            assert frame.correlation_id == cid
            r = m.FetchResponse.decode(frame.body).topics[0].partitions[0]
            assert time.monotonic() - started < 30  # the matching record ended the wait
            assert r.next_offset == 9
            assert [h.base_offset for h, _ in iter_batches(r.records)] == [6]  # others skipped
            assert [(s.base_offset, bytes(s.bitmap)) for s in r.selections] == [(6, b"\x02")]
            # nothing new: the wait runs out and says how far the agent looked
            resp = await b.call(
                m.ApiKey.FETCH, fetch_request("lp", 0, 9, max_wait_ms=300, filter="tag = 'x'")
            )
            r = resp.topics[0].partitions[0]
            assert (r.records, r.next_offset) == (None, 9)
            # a consumer that is behind gets its progress at once, without waiting
            resp = await b.call(
                m.ApiKey.FETCH, fetch_request("lp", 0, 0, max_wait_ms=30_000, filter="tag = 'z'")
            )
            r = resp.topics[0].partitions[0]
            assert (r.records, r.next_offset) == (None, 9)
            assert time.monotonic() - started < 30
        finally:
            await a.close()
            await b.close()

    asyncio.run(run())


# ---- groups ---------------------------------------------------------------------------------


def test_a_group_member_with_another_filter_is_refused(agent: Cluster) -> None:
    agent.create_topic("g", 2)
    agent.wait_for_leaders("g")
    cfg = {"bootstrap.servers": agent.bootstrap, "group.id": "one-subscription"}

    async def run() -> None:
        async with Consumer(cfg) as first:
            first.subscribe(["g"], tags="a || b")
            async with asyncio.timeout(60):
                while len(first.assignment()) < 2:
                    await first.getmany(timeout_ms=200)
            async with Consumer(cfg) as same:  # the same subscription, spelt differently
                same.subscribe(["g"], filter="tag = 'b' OR tag = 'a'")
                async with asyncio.timeout(60):
                    while len(same.assignment()) != 1 or len(first.assignment()) != 1:
                        await asyncio.gather(
                            first.getmany(timeout_ms=200), same.getmany(timeout_ms=200)
                        )
                generation = first.group_generation
                for refused in ({"tags": "c"}, {}):  # another filter; no filter at all
                    async with Consumer(cfg) as other:
                        other.subscribe(["g"], **refused)
                        with pytest.raises(InconsistentFilterError, match="another filter"):
                            async with asyncio.timeout(60):
                                while True:
                                    await other.getmany(timeout_ms=200)
                        assert other.assignment() == set()
                # the refused never joined: no rebalance, the members keep their partitions
                await asyncio.gather(first.getmany(timeout_ms=200), same.getmany(timeout_ms=200))
                assert (first.group_generation, same.group_generation) == (generation, generation)
                assert len(first.assignment()) == len(same.assignment()) == 1

    asyncio.run(run())


# ---- the object tier ------------------------------------------------------------------------


def test_filtered_reads_from_the_object_tier(
    processes: ProcessGroup,
    zk_chroot: ZooKeeperChroot,
    s3: S3Target,
    tmp_path: Path,
) -> None:
    cluster = Cluster(processes, zk_chroot, tmp_path / "data")
    cluster.start_agent(
        1,
        f"s3.bucket={s3.bucket}",
        "tier.check.interval.ms=100",
        "s3.request.timeout.ms=2000",
        "fetch.filter.max.scan.bytes=65536",  # several tier scans per consumer
        env=s3.env(),
    )
    cluster.create_topic(
        "tiered",
        1,
        configs={"segment.bytes": 256 * 1024, "segment.ms": 1000, "local.retention.ms": 0},
    )
    cluster.wait_for_leaders("tiered")
    tp = TopicPartition("tiered", 0)
    n = 40_000

    async def produce() -> None:
        cfg = {"bootstrap.servers": cluster.bootstrap, "acks": 1, "batch.size": 16384}
        async with Producer(cfg) as producer:
            for start in range(0, n, 500):
                tag = "rare" if start % 10_000 == 0 else "common"
                values = [b"m-%06d" % (start + i) for i in range(500)]
                tags = [[tag] if i % 50 else ["rare"] for i in range(500)]
                await producer.send_batch("tiered", values, tags=tags, partition=0)
            await producer.flush()

    asyncio.run(produce())

    def local_log_start() -> int:
        """The first offset still on the agent's disk (local retention drops tiered ones)."""
        bases = [int(p.stem) for p in (tmp_path / "data").rglob("*.log")]
        return min(bases, default=0)

    deadline = time.monotonic() + 90
    while local_log_start() < n // 2:  # most of the partition is served from the tier
        assert time.monotonic() < deadline, "records not tiered and dropped locally in time"
        time.sleep(0.1)

    async def consume() -> list[int]:
        cfg = {"bootstrap.servers": cluster.bootstrap, "auto.offset.reset": "earliest"}
        async with Consumer(cfg) as consumer:
            consumer.assign([tp], filter="tag = 'rare'")
            got = await _read_to_end(consumer, tp, n)
            return [r.offset for r in got]

    want = [
        start + i
        for start in range(0, n, 500)
        for i in range(500)
        if start % 10_000 == 0 or i % 50 == 0
    ]
    before = _filtered_fetch_metrics(cluster.agents[1].metrics_url)
    assert asyncio.run(consume()) == want
    after = _filtered_fetch_metrics(cluster.agents[1].metrics_url)
    assert after["scanned"] > after["sent"] - before["sent"]
