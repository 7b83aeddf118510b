"""Spark reads committed segments straight from the bucket; streaming; replay (issue 7).

Real Spark (``local[2]``, one session for the module), a real moto server, a real ZooKeeper
and real agent processes. Records carry explicit, deterministic timestamps so time filters
have known answers.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from sdk import Consumer, Producer, TopicPartition
from sdk.replay import Archive, ArchiveConfig, replay
from tests.cluster import Cluster
from tests.harness import ProcessGroup, S3Target, ZooKeeperChroot

pytestmark = pytest.mark.slow

T0 = int(time.time() * 1000) - 3_600_000


def _value(p: int, i: int) -> bytes:
    return b"p%d-%07d|" % (p, i) + bytes([(i * 7 + p) % 251]) * (i % 53)


def _key(i: int) -> bytes:
    return b"key-%d" % (i % 97)


def _ts(i: int) -> int:
    return T0 + i // 100  # 100 records per millisecond, increasing


@pytest.fixture(scope="module")
def spark() -> Iterator[Any]:
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    from pyspark.sql import SparkSession

    from spark.source import register

    session = (
        SparkSession.builder.master("local[2]")
        .appName("strata-tests")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.ui.enabled", "false")
        .config("spark.driver.memory", "2g")
        .config("spark.sql.session.timeZone", "UTC")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    register(session)
    yield session
    session.stop()


def _start(
    processes: ProcessGroup,
    zk_chroot: ZooKeeperChroot,
    s3: S3Target,
    tmp_path: Path,
    topics: dict[str, int],
    segment_bytes: int,
    *configs: str,
) -> Cluster:
    cluster = Cluster(processes, zk_chroot, tmp_path / "data")
    cluster.start_agent(
        1,
        f"s3.bucket={s3.bucket}",
        "tier.check.interval.ms=100",
        "s3.request.timeout.ms=5000",
        *configs,
        env=s3.env(),
    )
    for name, partitions in topics.items():
        cluster.create_topic(
            name,
            partitions,
            configs={"segment.bytes": segment_bytes, "segment.ms": 1000},
        )
        cluster.wait_for_leaders(name)
    return cluster


def _archive(s3: S3Target) -> ArchiveConfig:
    return ArchiveConfig(
        bucket=s3.bucket,
        endpoint_url=s3.endpoint_url,
        region=s3.region,
        access_key_id=s3.access_key_id,
        secret_access_key=s3.secret_access_key,
    )


def _options(s3: S3Target, **extra: str) -> dict[str, str]:
    return {
        "bucket": s3.bucket,
        "endpoint": s3.endpoint_url,
        "region": s3.region,
        "accessKey": s3.access_key_id,
        "secretKey": s3.secret_access_key,
        **extra,
    }


async def _produce(bootstrap: str, topic: str, partitions: int, start: int, end: int) -> None:
    config = {"bootstrap.servers": bootstrap, "acks": 1, "linger.ms": 5, "batch.size": 256 * 1024}
    async with Producer(config) as producer:
        chunk = 10_000
        for lo in range(start, end, chunk):
            hi = min(end, lo + chunk)
            for p in range(partitions):
                await producer.send_batch(
                    topic,
                    [_value(p, i) for i in range(lo, hi)],
                    keys=[_key(i) for i in range(lo, hi)],
                    tags=[["even"] if i % 2 == 0 else ["odd"] for i in range(lo, hi)],
                    partition=p,
                    timestamp_ms=[_ts(i) for i in range(lo, hi)],
                )
        await producer.flush()


def _wait_committed(s3: S3Target, topic: str, ends: dict[int, int], timeout: float = 180) -> None:
    """Until the manifest snapshots in the bucket (what Spark reads) reach ``ends``."""
    archive = Archive(_archive(s3))
    deadline = time.monotonic() + timeout
    while True:
        snaps = archive.snapshots(topic)
        got = {p: s.manifest.end for p, s in snaps.items()}
        if all(got.get(p, -1) >= e for p, e in ends.items()):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"committed {got}, waiting for {ends}")
        time.sleep(0.2)


def _report(path: Path) -> dict[str, Any]:
    result: dict[str, Any] = json.loads(path.read_text())
    return result


def test_one_million_messages_read_from_the_bucket_with_pruning_and_no_orphans(
    spark: Any,
    processes: ProcessGroup,
    zk_chroot: ZooKeeperChroot,
    s3: S3Target,
    tmp_path: Path,
) -> None:
    topic, parts, per = "history", 4, 250_000
    cluster = _start(processes, zk_chroot, s3, tmp_path, {topic: parts}, 1 << 20)
    asyncio.run(_produce(cluster.bootstrap, topic, parts, 0, per))
    _wait_committed(s3, topic, dict.fromkeys(range(parts), per))

    report = tmp_path / "plan.json"

    def load() -> Any:
        # a fresh DataFrame per query: Spark 4.3 reuses a DataFrame's last pushed-down scan
        # for a later query without filters on the same DataFrame (docs/spark.md)
        reader = spark.read.format("strata").options(**_options(s3, planReport=str(report)))
        return reader.option("topic", topic).load()

    df = load()
    stats = {
        r["partition"]: r
        for r in df.groupBy("partition")
        .agg({"offset": "min", "*": "count"})
        .withColumnRenamed("min(offset)", "lo")
        .withColumnRenamed("count(1)", "n")
        .join(
            df.groupBy("partition").agg({"offset": "max"}).withColumnRenamed("max(offset)", "hi"),
            "partition",
        )
        .collect()
    }
    assert sorted(stats) == list(range(parts))
    for p in range(parts):
        assert (stats[p]["lo"], stats[p]["hi"], stats[p]["n"]) == (0, per - 1, per)
    assert load().select("partition", "offset").distinct().count() == parts * per
    whole = _report(report)
    assert whole["segments_planned"] == whole["segments_total"]
    assert 4 * parts <= whole["segments_total"] <= 300, whole

    sample = [0, 1, 99, 12_345, 100_000, 199_999, per - 1]
    df = load()
    rows = (
        df.filter(df["offset"].isin(sample))
        .select("topic", "partition", "offset", "timestamp", "key", "value", "tags")
        .collect()
    )
    assert len(rows) == len(sample) * parts
    for r in rows:
        i = r["offset"]
        assert r["topic"] == topic
        assert bytes(r["value"]) == _value(r["partition"], i)
        assert bytes(r["key"]) == _key(i)
        assert r["tags"] == (["even"] if i % 2 == 0 else ["odd"])
        assert r["timestamp"] == dt.datetime.fromtimestamp(_ts(i) / 1000, dt.UTC).replace(
            tzinfo=None
        )

    # a time-range filter plans (and reads) fewer segments and bytes than the whole topic
    cut = 230_000
    since = dt.datetime.fromtimestamp(_ts(cut) / 1000, dt.UTC)
    df = load()
    recent = df.filter(df["timestamp"] >= since)
    assert recent.count() == (per - cut) * parts
    pruned = _report(report)
    assert pruned["segments_planned"] < whole["segments_total"] / 4, pruned
    assert pruned["bytes_planned"] < whole["bytes_total"] / 4, pruned
    # partition and offset filters too
    df = load()
    one = df.filter((df["partition"] == 2) & (df["offset"] >= 1000) & (df["offset"] < 3000))
    assert one.count() == 2000
    assert _report(report)["segments_planned"] <= 2

    # a stray object and a duplicate upload change nothing: only committed segments count
    archive = Archive(_archive(s3))
    snap = archive.snapshot(topic, 1)
    assert snap is not None
    first = snap.manifest.segments[0]
    body = s3.client.get_object(Bucket=s3.bucket, Key=first.key(topic, snap.topic_id, 1))[
        "Body"
    ].read()
    duplicate = first.key(topic, snap.topic_id, 1).replace(
        f"-{first.leader_epoch:010d}.seg", f"-{first.leader_epoch + 7:010d}.seg"
    )
    stray = first.key(topic, snap.topic_id, 1).rsplit("/", 1)[0] + "/stray-object.seg"
    s3.client.put_object(Bucket=s3.bucket, Key=duplicate, Body=body)
    s3.client.put_object(Bucket=s3.bucket, Key=stray, Body=b"not a segment")
    s3.client.put_object(Bucket=s3.bucket, Key=f"topics/{topic}/junk.bin", Body=body[:100])
    assert load().count() == parts * per


def test_streaming_available_now_reads_everything_once_then_only_new_segments(
    spark: Any,
    processes: ProcessGroup,
    zk_chroot: ZooKeeperChroot,
    s3: S3Target,
    tmp_path: Path,
) -> None:
    topic, parts = "stream", 2
    cluster = _start(processes, zk_chroot, s3, tmp_path, {topic: parts}, 128 * 1024)
    asyncio.run(_produce(cluster.bootstrap, topic, parts, 0, 20_000))
    _wait_committed(s3, topic, dict.fromkeys(range(parts), 20_000))

    out, checkpoint, report = tmp_path / "out", tmp_path / "checkpoint", tmp_path / "plan.json"

    def run_once() -> None:
        stream = (
            spark.readStream.format("strata")
            .options(**_options(s3, planReport=str(report)))
            .option("topic", topic)
            .load()
            .select("partition", "offset", "value")
        )
        query = (
            stream.writeStream.format("parquet")
            .option("path", str(out))
            .option("checkpointLocation", str(checkpoint))
            .trigger(availableNow=True)
            .start()
        )
        query.awaitTermination(300)
        assert query.exception() is None

    run_once()
    first = spark.read.parquet(str(out))
    assert first.count() == 40_000
    assert first.select("partition", "offset").distinct().count() == 40_000
    segments_first = _report(report)["segments_total"]

    asyncio.run(_produce(cluster.bootstrap, topic, parts, 20_000, 30_000))
    _wait_committed(s3, topic, dict.fromkeys(range(parts), 30_000))
    run_once()
    second = _report(report)
    assert 0 < second["segments_planned"] < second["segments_total"]
    assert second["segments_planned"] == second["segments_total"] - segments_first
    both = spark.read.parquet(str(out))
    assert both.count() == 60_000
    assert both.select("partition", "offset").distinct().count() == 60_000
    row = both.filter((both["partition"] == 1) & (both["offset"] == 25_000)).collect()[0]
    assert bytes(row["value"]) == _value(1, 25_000)


def test_filter_and_tags_options_apply_the_consumers_filters(
    spark: Any,
    processes: ProcessGroup,
    zk_chroot: ZooKeeperChroot,
    s3: S3Target,
    tmp_path: Path,
) -> None:
    """Options ``filter`` and ``tags`` (docs/filters.md) filter in the read tasks; a mistake
    fails the query with the position."""
    topic, parts, per = "tagged", 2, 20_000
    cluster = _start(processes, zk_chroot, s3, tmp_path, {topic: parts}, 128 * 1024)
    asyncio.run(_produce(cluster.bootstrap, topic, parts, 0, per))
    _wait_committed(s3, topic, dict.fromkeys(range(parts), per))

    def load(**extra: str) -> Any:
        reader = spark.read.format("strata").options(**_options(s3, **extra))
        return reader.option("topic", topic).load()

    evens = load(filter="tag = 'even' AND header.x IS NULL").filter("partition = 1")
    assert evens.count() == per // 2
    assert {r["offset"] % 2 for r in evens.select("offset").distinct().collect()} == {0}
    assert load(tags="odd || none").count() == parts * per // 2
    assert load(filter="tag = 'nothing'").count() == 0
    with pytest.raises(Exception, match="position 10"):
        load(filter="tag = 'a' &&").count()


async def _consume(bootstrap: str, topic: str, partitions: int, total: int) -> dict[int, Any]:
    tables: dict[int, list[pa.Table]] = {p: [] for p in range(partitions)}
    async with Consumer({"bootstrap.servers": bootstrap}) as consumer:
        tps = [TopicPartition(topic, p) for p in range(partitions)]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        got = 0
        async with asyncio.timeout(120):
            while got < total:
                for tp, table in (await consumer.getmany_arrow(timeout_ms=500)).items():
                    tables[tp.partition].append(table)
                    got += table.num_rows
    return {p: pa.concat_tables(t) if t else None for p, t in tables.items()}


def test_replay_a_time_range_into_a_new_topic_keeps_messages_and_order(
    spark: Any,
    processes: ProcessGroup,
    zk_chroot: ZooKeeperChroot,
    s3: S3Target,
    tmp_path: Path,
) -> None:
    from spark.replay import replay as spark_replay

    parts = 3
    cluster = _start(
        processes, zk_chroot, s3, tmp_path, {"source": parts, "replayed": parts}, 128 * 1024
    )
    asyncio.run(_produce(cluster.bootstrap, "source", parts, 0, 30_000))
    _wait_committed(s3, "source", dict.fromkeys(range(parts), 30_000))

    lo, hi = 10_000, 25_000  # the records with these indexes have timestamps [_ts(lo), _ts(hi))
    counts = spark_replay(
        spark,
        topic="source",
        to_topic="replayed",
        bootstrap=cluster.bootstrap,
        source_options=_options(s3),
        start_ms=_ts(lo),
        end_ms=_ts(hi),
    )
    assert counts == dict.fromkeys(range(parts), hi - lo)
    got = asyncio.run(_consume(cluster.bootstrap, "replayed", parts, (hi - lo) * parts))
    for p in range(parts):
        table = got[p]
        assert table is not None and table.num_rows == hi - lo
        assert table.column("value").to_pylist() == [_value(p, i) for i in range(lo, hi)]
        assert table.column("key").to_pylist() == [_key(i) for i in range(lo, hi)]
        ts = table.column("timestamp").cast(pa.int64()).to_pylist()
        assert ts == [_ts(i) for i in range(lo, hi)]

    # the SDK replays without Spark: Arrow tables straight from the bucket, by time, keys, tags
    tables = list(
        replay(
            "source",
            start_ms=_ts(lo),
            end_ms=_ts(hi),
            keys=[_key(5), _key(6)],
            tags=["odd"],
            archive=_archive(s3),
        )
    )
    table = pa.concat_tables(tables)
    expected = [i for i in range(lo, hi) if i % 97 in (5, 6) and i % 2 == 1]
    assert table.num_rows == len(expected) * parts
    for p in range(parts):
        mine = table.filter(pa.compute.equal(table.column("partition"), p))
        assert mine.column("offset").to_pylist() == expected
        assert mine.column("value").to_pylist() == [_value(p, i) for i in expected]


def test_a_kafka_clients_records_read_by_spark_and_replay_and_replayed_back_to_kafka(
    spark: Any,
    processes: ProcessGroup,
    zk_chroot: ZooKeeperChroot,
    s3: S3Target,
    tmp_path: Path,
) -> None:
    """The Kafka listener (issue 24): kafka-python produces gzip batches through it (keys,
    headers, timestamps, odd records tagged with the header ``strata.tag``); Spark and the
    SDK's replay read exactly those records from the bucket, the tag as a tag; Spark's replay
    of them into another topic is read back by the Kafka client unchanged."""
    import kafka as kp

    from spark.replay import replay as spark_replay

    parts, n = 2, 4000
    cluster = _start(
        processes,
        zk_chroot,
        s3,
        tmp_path,
        {"from-kafka": parts, "kafka-copy": parts, "plain-from-kafka": 1},
        64 * 1024,
        "kafka.listener=127.0.0.1:0",
    )
    bootstrap = cluster.agents[1].kafka
    assert bootstrap is not None

    def headers(i: int) -> list[tuple[str, bytes]]:
        return [("i", b"%d" % i)] + ([("strata.tag", b"odd")] if i % 2 else [])

    producer = kp.KafkaProducer(
        bootstrap_servers=[bootstrap], acks="all", linger_ms=5, compression_type="gzip"
    )
    try:
        futures = [
            producer.send(
                "from-kafka",
                value=_value(i % parts, i),
                key=_key(i),
                headers=headers(i),
                partition=i % parts,
                timestamp_ms=_ts(i),
            )
            for i in range(n)
        ]
        producer.flush(60)
        for f in futures:
            f.get(timeout=30)
    finally:
        producer.close(10)
    _wait_committed(s3, "from-kafka", dict.fromkeys(range(parts), n // parts))
    # uncompressed and without headers: batches the agent keeps as the client sent them
    # (``storage.codec.kafka_body``), which Spark and replay decode from the bucket too
    plain = kp.KafkaProducer(bootstrap_servers=[bootstrap], acks="all", linger_ms=5)
    try:
        for i in range(n):
            plain.send("plain-from-kafka", value=_value(0, i), key=_key(i), timestamp_ms=_ts(i))
        plain.flush(60)
    finally:
        plain.close(10)
    _wait_committed(s3, "plain-from-kafka", {0: n})
    want = [(i, _key(i), _value(0, i), _ts(i)) for i in range(n)]
    df = spark.read.format("strata").options(**_options(s3)).option("topic", "plain-from-kafka")
    got = sorted(
        (r["offset"], bytes(r["key"]), bytes(r["value"]), r["timestamp"], list(r["headers"]))
        for r in df.load().collect()
    )
    assert [(o, k, v) for o, k, v, _, _ in got] == [(i, k, v) for i, k, v, _ in want]
    assert all(not h for *_, h in got)
    assert [ts for _, _, _, ts, _ in got] == [
        dt.datetime.fromtimestamp(t / 1000, dt.UTC).replace(tzinfo=None) for *_, t in want
    ]
    table = pa.concat_tables(list(replay("plain-from-kafka", archive=_archive(s3))))
    rows = table.sort_by("offset").to_pylist()
    assert [
        (r["offset"], r["key"], r["value"], round(r["timestamp"].timestamp() * 1000)) for r in rows
    ] == want

    def check(p: int, offset: int, key: bytes, value: bytes, hs: list[Any], tags: Any) -> None:
        i = offset * parts + p  # record i went to partition i % parts, in order
        assert (key, value) == (_key(i), _value(p, i)), (p, offset)
        assert hs == [("i", b"%d" % i)] and list(tags) == (["odd"] if i % 2 else []), (p, offset)

    df = spark.read.format("strata").options(**_options(s3)).option("topic", "from-kafka").load()
    rows = df.collect()
    assert len(rows) == n
    for r in rows:
        check(
            r["partition"],
            r["offset"],
            bytes(r["key"]),
            bytes(r["value"]),
            [(h["key"], bytes(h["value"])) for h in r["headers"]],
            r["tags"],
        )
        i = r["offset"] * parts + r["partition"]
        assert r["timestamp"] == dt.datetime.fromtimestamp(_ts(i) / 1000, dt.UTC).replace(
            tzinfo=None
        )

    table = pa.concat_tables(list(replay("from-kafka", archive=_archive(s3))))
    assert table.num_rows == n
    for row in table.to_pylist():
        check(
            row["partition"],
            row["offset"],
            row["key"],
            row["value"],
            [(h["key"], h["value"]) for h in row["headers"]],
            row["tags"],
        )

    counts = spark_replay(
        spark,
        topic="from-kafka",
        to_topic="kafka-copy",
        bootstrap=cluster.bootstrap,
        source_options=_options(s3),
    )
    assert counts == dict.fromkeys(range(parts), n // parts)
    consumer = kp.KafkaConsumer(bootstrap_servers=[bootstrap], enable_auto_commit=False)
    seen: list[Any] = []
    try:
        tps = [kp.TopicPartition("kafka-copy", p) for p in range(parts)]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        deadline = time.monotonic() + 60
        while len(seen) < n:
            assert time.monotonic() < deadline, len(seen)
            for batch in consumer.poll(timeout_ms=500).values():
                seen += batch
    finally:
        consumer.close()
    assert len(seen) == n
    for r in seen:
        i = r.offset * parts + r.partition
        assert (r.key, r.value, r.timestamp) == (_key(i), _value(r.partition, i), _ts(i))
        assert list(r.headers) == headers(i)


async def _transactions(bootstrap: str, topic: str, rounds: int) -> tuple[set[bytes], set[bytes]]:
    """Two transactional producers interleave transactions on both partitions of ``topic``;
    every third transaction of each is aborted after its records are stored. Returns the
    committed and the aborted values."""
    committed: set[bytes] = set()
    aborted: set[bytes] = set()
    configs = [
        {"bootstrap.servers": bootstrap, "transactional.id": f"tiered-{n}", "linger.ms": 1}
        for n in range(2)
    ]
    async with Producer(configs[0]) as a, Producer(configs[1]) as b:
        await a.init_transactions()
        await b.init_transactions()
        for r in range(rounds):
            a.begin_transaction()
            b.begin_transaction()
            sent: dict[str, list[bytes]] = {"a": [], "b": []}
            for i in range(40):  # a's and b's batches alternate in both partitions
                for name, producer in (("a", a), ("b", b)):
                    value = b"%s-%04d-%02d|" % (name.encode(), r, i) + b"x" * 200
                    await producer.send(topic, value, partition=i % 2)
                    sent[name].append(value)
                if i % 10 == 9:
                    await asyncio.gather(a.flush(), b.flush())
            for name, producer, abort in (("a", a, r % 3 == 1), ("b", b, r % 3 == 2)):
                if abort:
                    await producer.abort_transaction()
                    aborted.update(sent[name])
                else:
                    await producer.commit_transaction()
                    committed.update(sent[name])
    return committed, aborted


def test_spark_and_replay_over_tiered_aborted_transactions_return_committed_records(
    spark: Any,
    processes: ProcessGroup,
    zk_chroot: ZooKeeperChroot,
    s3: S3Target,
    tmp_path: Path,
) -> None:
    """Tiered segments with aborted transactions (their footers list them): Spark and
    ``sdk.replay`` return exactly the committed records by default, everything with
    ``read_uncommitted``, and never a transaction marker."""
    topic, parts = "txns", 2
    cluster = _start(processes, zk_chroot, s3, tmp_path, {topic: parts}, 16 * 1024)
    committed, aborted = asyncio.run(_transactions(cluster.bootstrap, topic, 9))
    assert len(committed) == 12 * 40 and len(aborted) == 6 * 40

    async def log_ends() -> dict[int, int]:
        async with Consumer({"bootstrap.servers": cluster.bootstrap}) as c:
            tps = [TopicPartition(topic, p) for p in range(parts)]
            return {tp.partition: e for tp, e in (await c.end_offsets(tps)).items()}

    # the last markers are the logs' last batches: everything is tiered once the ends are
    _wait_committed(s3, topic, asyncio.run(log_ends()))
    snaps = Archive(_archive(s3)).snapshots(topic)
    entries = [e for s in snaps.values() for e in s.manifest.segments]
    assert sum(e.aborted for e in entries) > 0  # aborted transactions in the tier's footers
    assert len(entries) > 4

    def values(**extra: str) -> list[bytes]:
        reader = spark.read.format("strata").options(**_options(s3, **extra))
        rows = reader.option("topic", topic).load().select("value").collect()
        return [bytes(r["value"]) for r in rows]

    spark_committed = values()
    assert len(spark_committed) == len(committed) and set(spark_committed) == committed
    spark_all = values(**{"isolation.level": "read_uncommitted"})
    assert sorted(spark_all) == sorted(committed | aborted)

    def replayed(**kwargs: Any) -> list[bytes]:
        tables = list(replay(topic, archive=_archive(s3), **kwargs))
        return [v for t in tables for v in t.column("value").to_pylist()]

    replay_committed = replayed()
    assert len(replay_committed) == len(committed) and set(replay_committed) == committed
    assert sorted(replayed(isolation_level="read_uncommitted")) == sorted(committed | aborted)


def _chunk_tag(i: int) -> str:
    return f"t{(i // 1000) % 6}"  # one tag per run of 1000 records: whole batches share it


async def _produce_chunks(bootstrap: str, topic: str, partitions: int, total: int) -> None:
    """Records ``i`` in ``[0, total)`` on every partition, one ``send_batch`` (so one stored
    batch or more, never shared with another run) per run of 1000 records; record ``i`` is
    tagged ``_chunk_tag(i)``."""
    config = {"bootstrap.servers": bootstrap, "acks": 1, "linger.ms": 5, "batch.size": 256 * 1024}
    async with Producer(config) as producer:
        for lo in range(0, total, 1000):
            for p in range(partitions):
                await producer.send_batch(
                    topic,
                    [_value(p, i) for i in range(lo, lo + 1000)],
                    keys=[_key(i) for i in range(lo, lo + 1000)],
                    tags=[[_chunk_tag(i)] for i in range(lo, lo + 1000)],
                    partition=p,
                    timestamp_ms=[_ts(i) for i in range(lo, lo + 1000)],
                )
            await producer.flush()


def _read_stats(directory: Path) -> dict[str, int]:
    """The executors' read reports (option ``readReport``), summed; the files are removed."""
    total: dict[str, int] = {}
    for path in directory.glob("read-*.json"):
        for name, value in json.loads(path.read_text()).items():
            total[name] = total.get(name, 0) + value
        path.unlink()
    return total


def _arrow(rows: list[Any]) -> pa.Table:
    return pa.Table.from_pylist(
        [
            {
                "partition": r["partition"],
                "offset": r["offset"],
                "key": bytes(r["key"]),
                "tags": list(r["tags"]),
            }
            for r in rows
        ]
    )


def _ids(table: pa.Table) -> list[tuple[int, int]]:
    parts, offsets = table.column("partition").to_pylist(), table.column("offset").to_pylist()
    return sorted(zip(parts, offsets, strict=True))


def test_columns_keys_and_tags_are_pushed_down_to_the_reads(
    spark: Any,
    processes: ProcessGroup,
    zk_chroot: ZooKeeperChroot,
    s3: S3Target,
    tmp_path: Path,
) -> None:
    """Option ``columns`` hands Spark only the columns asked for; ``key = / IN`` filters and
    option ``tags`` are applied by the reads — ``tags`` before decoding, by the batches'
    summaries — and return exactly the rows of an unfiltered read filtered in pyarrow; the
    executors' read reports show the batches and segments skipped. ``sdk.replay`` and
    ``spark.replay`` take the same filters."""
    import pyarrow.compute as pc
    from pyspark.sql import functions as F

    from sdk.replay import ReadStats
    from spark.replay import replay as spark_replay

    topic, parts, per = "pushdown", 2, 12_000
    cluster = _start(
        processes, zk_chroot, s3, tmp_path, {topic: parts, "pushed-copy": parts}, 64 * 1024
    )
    asyncio.run(_produce_chunks(cluster.bootstrap, topic, parts, per))
    _wait_committed(s3, topic, dict.fromkeys(range(parts), per))
    reads = tmp_path / "reads"

    def load(**extra: str) -> Any:
        options = _options(s3, readReport=str(reads), **extra)
        return spark.read.format("strata").options(**options).option("topic", topic).load()

    # every column vs value only: the same rows, far fewer bytes handed to Spark
    everything = load().collect()
    every_stats = _read_stats(reads)
    value_only = load(columns="value")
    assert value_only.columns == ["value"]
    values = sorted(bytes(r["value"]) for r in value_only.collect())
    value_stats = _read_stats(reads)
    assert values == sorted(bytes(r["value"]) for r in everything)
    assert value_stats["rows"] == every_stats["rows"] == parts * per
    assert value_stats["bytes_read"] <= every_stats["bytes_read"]
    assert value_stats["bytes_out"] < every_stats["bytes_out"] * 0.7, (value_stats, every_stats)

    full = _arrow(everything)
    assert full.num_rows == parts * per

    # key = / IN: pushed down (the reads return only those rows), exact
    wanted = [_key(3), _key(50)]
    df = load()
    got = _arrow(df.filter(df["key"].isin(wanted)).collect())
    expected = full.filter(pc.is_in(full.column("key"), value_set=pa.array(wanted)))
    assert 0 < expected.num_rows == got.num_rows
    assert _ids(got) == _ids(expected)
    key_stats = _read_stats(reads)
    assert key_stats["rows"] == expected.num_rows  # filtered in the reads, not by Spark
    df = load()
    one = df.filter(df["key"] == _key(7)).select("partition", "offset", "key", "tags").collect()
    assert _ids(_arrow(one)) == _ids(full.filter(pc.equal(full.column("key"), pa.scalar(_key(7)))))
    assert _read_stats(reads)["rows"] == len(one)

    # tags: batches whose summary rules the tag out are never decoded, whole segments skipped
    flat = pc.list_flatten(full.column("tags"))
    rows_with_t5 = pc.list_parent_indices(full.column("tags")).filter(pc.equal(flat, "t5"))
    expected = full.take(rows_with_t5)
    got = _arrow(load(tags="t5").collect())
    assert 0 < expected.num_rows == got.num_rows
    assert _ids(got) == _ids(expected)
    tag_stats = _read_stats(reads)
    assert tag_stats["batches_skipped"] > 0 and tag_stats["segments_skipped"] > 0, tag_stats
    assert tag_stats["batches_decoded"] < every_stats["batches_decoded"] / 3, tag_stats
    # tags and keys together, with Spark's array_contains applied by Spark on top
    df = load(tags="t5 || t1")
    both = df.filter(df["key"].isin(wanted) & F.array_contains(df["tags"], "t5")).collect()
    assert _ids(_arrow(both)) == _ids(
        expected.filter(pc.is_in(expected.column("key"), value_set=pa.array(wanted)))
    )

    # the SDK's replay: the same filters, the same rows, the same skipping
    stats = ReadStats()
    replayed = pa.concat_tables(
        list(replay(topic, tags=["t5"], keys=wanted, archive=_archive(s3), stats=stats))
    )
    expected_both = expected.filter(pc.is_in(expected.column("key"), value_set=pa.array(wanted)))
    assert _ids(replayed) == _ids(expected_both)
    assert stats.batches_skipped > 0 and stats.segments_skipped > 0
    assert stats.rows == expected_both.num_rows

    # and Spark's replay into another topic
    counts = spark_replay(
        spark,
        topic=topic,
        to_topic="pushed-copy",
        bootstrap=cluster.bootstrap,
        source_options=_options(s3),
        tags=["t5"],
        keys=wanted,
    )
    by_partition = {p: 0 for p in range(parts)}
    for p in expected_both.column("partition").to_pylist():
        by_partition[p] += 1
    assert counts == by_partition
    copied = asyncio.run(_consume(cluster.bootstrap, "pushed-copy", parts, expected_both.num_rows))
    for p in range(parts):
        table = copied[p]
        assert table is not None
        want = expected_both.filter(pc.equal(expected_both.column("partition"), p))
        offsets = sorted(want.column("offset").to_pylist())
        assert table.column("value").to_pylist() == [_value(p, i) for i in offsets]
