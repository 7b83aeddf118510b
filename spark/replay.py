"""Re-publish a range of a topic's history from the object tier into a topic, in order.

    python -m spark.replay --topic orders --to-topic orders-replay \\
        --bootstrap 127.0.0.1:9092 --bucket strata --endpoint http://127.0.0.1:5000 \\
        --from-time 2026-11-01T00:00:00Z --to-time 2026-11-02T00:00:00Z

The driver plans the range exactly like the ``strata`` data source (manifests, pruning by
offsets and time, footers for partly wanted segments) and gives each source partition's
segment reads, in offset order, to one Spark task. That task range-reads its segments from
the bucket (no agent in the read path), decodes them with the shared codec and publishes each
decoded batch with the SDK's ``send_batch`` (Arrow columns handed over as lists) to target
partition ``source partition % target partitions``. Per-partition order is kept: one producer
publishes a source partition, in offset order, and the producer keeps per-partition order
across retries. Timestamps, keys, headers and tags are kept. (No shuffle: a DataFrame
``repartition``/``sortWithinPartitions`` would do the same but needs pandas for
``mapInArrow``, which this environment does not ship.)
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
import sys
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from sdk.config import client_config
from sdk.replay import Archive, ArchiveConfig, SegmentRead, combined_filter, plan, read_segment


def _publisher(target: str, archive_config: ArchiveConfig, producer_config: dict[str, Any]) -> Any:
    def publish(job: tuple[int, list[SegmentRead]]) -> tuple[int, int]:
        from sdk import Producer
        from spark.source import executor_archive

        source, tasks = job
        archive = executor_archive(archive_config)
        count = 0

        async def run() -> None:
            nonlocal count
            async with Producer(producer_config) as producer:
                n_target = len(await producer.partitions_for(target))
                futures = []
                for task in tasks:
                    for batch in read_segment(archive, task):
                        futures.append(
                            await producer.send_batch(
                                target,
                                batch.column("value").to_pylist(),
                                keys=batch.column("key").to_pylist(),
                                headers=_headers(batch.column("headers")),
                                tags=_tags(batch.column("tags")),
                                partition=source % n_target,
                                timestamp_ms=batch.column("timestamp").cast(pa.int64()).to_pylist(),
                            )
                        )
                        count += batch.num_rows
                await producer.flush()
                for fut in futures:
                    await fut

        asyncio.run(run())
        return source, count

    return publish


def _headers(col: pa.Array) -> list[list[tuple[str, bytes]]] | None:
    if not pc.sum(pc.list_value_length(col)).as_py():
        return None
    return [[(h["key"], h["value"]) for h in hs] for hs in col.to_pylist()]


def _tags(col: pa.Array) -> list[list[str]] | None:
    if not pc.sum(pc.list_value_length(col)).as_py():
        return None
    out: list[list[str]] = col.to_pylist()
    return out


def replay(
    session: Any,
    *,
    topic: str,
    to_topic: str,
    bootstrap: str,
    source_options: dict[str, str],
    start_ms: int | None = None,
    end_ms: int | None = None,
    start_offset: int | None = None,
    end_offset: int | None = None,
    partitions: list[int] | None = None,
    producer_config: dict[str, Any] | None = None,
    keys: list[bytes] | None = None,
    tags: list[str] | None = None,
    filter: str | None = None,
) -> dict[int, int]:
    """Publish ``topic``'s records in the range into ``to_topic``; returns records per source
    partition. Bounds: timestamps ``[start_ms, end_ms)``, offsets ``[start_offset,
    end_offset)`` in every partition. ``keys``, ``tags`` and ``filter`` keep only matching
    records, as ``sdk.replay.replay`` does (pushed down to the batches' summaries)."""
    from spark.source import Options, manifests_for

    options = {**source_options, "topic": topic}
    for name, value in (
        ("startingTimestamp", start_ms),
        ("endingTimestamp", end_ms),
        ("startingOffsets", start_offset),
        ("endingOffsets", end_offset),
    ):
        if value is not None:
            options[name] = str(value)
    if partitions:
        options["partitions"] = ",".join(map(str, partitions))
    opts = Options.parse(options)
    archive = Archive(opts.archive)
    tasks, _ = plan(
        archive,
        topic,
        opts.bounds,
        split_bytes=opts.split_bytes,
        manifests=manifests_for(opts, archive),
        filter=combined_filter(tags, filter if filter is not None else opts.parsed_filter),
        keys=keys,
    )
    jobs: dict[int, list[SegmentRead]] = {}
    for task in tasks:
        jobs.setdefault(task.partition, []).append(task)
    if not jobs:
        return {}
    config = client_config(bootstrap, {"acks": "all", "linger.ms": 5})
    config.update(producer_config or {})
    rdd = session.sparkContext.parallelize(sorted(jobs.items()), len(jobs))
    return dict(rdd.map(_publisher(to_topic, opts.archive, config)).collect())


def _time_ms(raw: str | None) -> int | None:
    if raw is None:
        return None
    if raw.lstrip("-").isdigit():
        return int(raw)
    value = dt.datetime.fromisoformat(raw.replace("Z", "+00:00"))
    if value.tzinfo is None:
        value = value.replace(tzinfo=dt.UTC)
    return int(value.timestamp() * 1000)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m spark.replay", description=__doc__.split("\n")[0])
    ap.add_argument("--topic", required=True, help="source topic (read from the archive)")
    ap.add_argument("--to-topic", required=True, help="target topic (must exist)")
    ap.add_argument("--bootstrap", required=True, help="agents to publish to")
    ap.add_argument("--from-time", help="ms since the epoch or ISO-8601 (inclusive)")
    ap.add_argument("--to-time", help="ms since the epoch or ISO-8601 (exclusive)")
    ap.add_argument("--from-offset", type=int, help="in every partition (inclusive)")
    ap.add_argument("--to-offset", type=int, help="in every partition (exclusive)")
    ap.add_argument("--partitions", help="comma-separated source partitions (default all)")
    ap.add_argument("--keys", help="comma-separated keys (UTF-8): only records with one of them")
    ap.add_argument("--tags", help="comma-separated tags: only records carrying one of them")
    ap.add_argument("--filter", help="a filter over tags and headers (docs/filters.md)")
    ap.add_argument("--bucket", default=os.environ.get("STRATA_BUCKET"))
    ap.add_argument("--endpoint", default=os.environ.get("AWS_ENDPOINT_URL"))
    ap.add_argument("--prefix", default=os.environ.get("STRATA_S3_PREFIX", ""))
    ap.add_argument("--zookeeper", help="read manifests from ZooKeeper instead of the bucket")
    ap.add_argument("--master", default="local[2]")
    args = ap.parse_args(argv)
    if not args.bucket:
        ap.error("--bucket (or STRATA_BUCKET) is required")

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    session = SparkSession.builder.master(args.master).appName("strata-replay").getOrCreate()
    options = {"bucket": args.bucket, "prefix": args.prefix}
    if args.endpoint:
        options["endpoint"] = args.endpoint
    if args.zookeeper:
        options.update(manifest="zookeeper", zookeeper=args.zookeeper)
    try:
        counts = replay(
            session,
            topic=args.topic,
            to_topic=args.to_topic,
            bootstrap=args.bootstrap,
            source_options=options,
            start_ms=_time_ms(args.from_time),
            end_ms=_time_ms(args.to_time),
            start_offset=args.from_offset,
            end_offset=args.to_offset,
            partitions=[int(p) for p in args.partitions.split(",")] if args.partitions else None,
            keys=[k.encode() for k in args.keys.split(",")] if args.keys is not None else None,
            tags=[t.strip() for t in args.tags.split(",")] if args.tags is not None else None,
            filter=args.filter,
        )
    finally:
        session.stop()
    for p in sorted(counts):
        print(f"partition {p}: {counts[p]} records replayed")
    print(f"total: {sum(counts.values())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
