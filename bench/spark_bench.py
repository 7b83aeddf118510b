"""Spark scan of committed segments vs pyarrow.parquet over the same rows, in the same run.

Run with ``make bench-spark`` (``python -m bench.spark_bench [--write-docs]``).

Segments are written straight into a local object-store directory with the tier layout
(``storage.tier``: batches + footer, manifest snapshot) instead of being produced through
agents: producing and uploading over 1 GB through an agent and moto on this 2-core machine
would take minutes and measure the uploader, not the scan. The Spark side reads them with
``format("strata")`` over a ``file://`` endpoint (the same ``pyarrow.fs`` code path as S3,
without moto's Python HTTP server in the way) on ``local[2]`` and materializes every column
(``write.format("noop")``). The baseline writes the same rows (the codec's columns plus
``partition``) as uncompressed Parquet in the same directory tree and reads them back with
``pyarrow.parquet.read_table`` (multi-threaded). Values are random bytes, 1 KiB.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from bench.common import publish
from sdk.replay import Archive, ArchiveConfig, plan, segment_table
from storage.codec import encode_batch, stamp
from storage.tier import Manifest, SegmentEntry, build_footer, decode_footer
from storage.tier.snapshot import ManifestSnapshot, snapshot_key

ROOT = Path(__file__).resolve().parent.parent
TOPIC = "bench"


def write_segments(
    root: Path, *, partitions: int, segments: int, batches: int, records: int, size: int
) -> int:
    """Segment objects + snapshots under ``root/bucket``; returns the data bytes written."""
    rng = np.random.default_rng(7)
    bucket = root / "bucket"
    total = 0
    t0 = int(time.time() * 1000) - 86_400_000
    for p in range(partitions):
        manifest, offset = Manifest(), 0
        for _s in range(segments):
            data = bytearray()
            for _b in range(batches):
                blob = rng.bytes(records * size)
                values = [blob[i * size : (i + 1) * size] for i in range(records)]
                raw = bytearray(
                    encode_batch(
                        values,
                        keys=[b"key-%d" % (i % 1000) for i in range(records)],
                        timestamps=[t0 + offset // 100] * records,
                    )
                )
                raw[:16] = stamp(offset, len(raw) - 12, 1)
                data += raw
                offset += records
            footer = build_footer(bytes(data))
            entry = SegmentEntry.of(decode_footer(footer))
            path = bucket / entry.key(TOPIC, "bench-id", p)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(bytes(data) + footer)
            manifest = manifest.appended(entry, 1)
            total += len(data)
        snap = bucket / snapshot_key(TOPIC, p)
        snap.parent.mkdir(parents=True, exist_ok=True)
        snap.write_bytes(ManifestSnapshot(TOPIC, "bench-id", p, manifest).encode())
    return total


def write_parquet(root: Path, archive: Archive) -> int:
    """The same rows as uncompressed Parquet, one file per segment; returns file bytes."""
    out = root / "parquet"
    out.mkdir()
    tasks, _ = plan(archive, TOPIC)
    for i, task in enumerate(tasks):
        table = segment_table(archive, task)
        table = table.add_column(
            0, "partition", pa.array(np.full(table.num_rows, task.partition, dtype=np.int32))
        )
        pq.write_table(table, out / f"{i:05d}.parquet", compression="none")
    return sum(f.stat().st_size for f in out.iterdir())


def run(args: argparse.Namespace) -> dict[str, Any]:
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    work = Path(tempfile.mkdtemp(prefix="strata-spark-bench-", dir=args.dir))
    try:
        started = time.perf_counter()
        data_bytes = write_segments(
            work,
            partitions=args.partitions,
            segments=args.segments,
            batches=args.batches,
            records=args.records,
            size=args.size,
        )
        rows = args.partitions * args.segments * args.batches * args.records
        archive = Archive(ArchiveConfig(bucket="bucket", endpoint_url=f"file://{work}"))
        parquet_bytes = write_parquet(work, archive)
        prepared = time.perf_counter() - started

        from pyspark.sql import SparkSession

        from spark.source import register

        spark = (
            SparkSession.builder.master("local[2]")
            .appName("strata-spark-bench")
            .config("spark.ui.enabled", "false")
            .config("spark.driver.memory", "4g")
            .config("spark.ui.showConsoleProgress", "false")
            .config("spark.sql.shuffle.partitions", "2")
            .getOrCreate()
        )
        spark.sparkContext.setLogLevel("ERROR")
        register(spark)

        def spark_scan() -> float:
            df = (
                spark.read.format("strata")
                .option("topic", TOPIC)
                .option("bucket", "bucket")
                .option("endpoint", f"file://{work}")
                .load()
            )
            t = time.perf_counter()
            df.write.format("noop").mode("overwrite").save()
            return time.perf_counter() - t

        def parquet_scan() -> float:
            t = time.perf_counter()
            table = pq.read_table(work / "parquet")
            assert table.num_rows == rows
            return time.perf_counter() - t

        def spark_parquet_scan() -> float:
            df = spark.read.parquet(str(work / "parquet"))
            t = time.perf_counter()
            df.write.format("noop").mode("overwrite").save()
            return time.perf_counter() - t

        spark_scan()  # warm-up: JVM, Python workers
        spark_parquet_scan()
        spark_runs = [spark_scan() for _ in range(args.runs)]
        parquet_runs = [parquet_scan() for _ in range(args.runs)]
        spark_parquet_runs = [spark_parquet_scan() for _ in range(args.runs)]
        spark.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    best_spark, best_parquet = min(spark_runs), min(parquet_runs)
    return {
        "date": datetime.date.today().isoformat(),
        "machine": f"{os.cpu_count()} cores, {platform.machine()}, Python {platform.python_version()}",
        "command": "make bench-spark",
        "rows": rows,
        "size": args.size,
        "segments": args.partitions * args.segments,
        "partitions": args.partitions,
        "data_bytes": data_bytes,
        "parquet_bytes": parquet_bytes,
        "prepare_s": prepared,
        "spark_runs_s": spark_runs,
        "parquet_runs_s": parquet_runs,
        "spark_parquet_runs_s": spark_parquet_runs,
        "spark_parquet_rows_s": rows / min(spark_parquet_runs),
        "spark_rows_s": rows / best_spark,
        "spark_mb_s": data_bytes / best_spark / 1e6,
        "parquet_rows_s": rows / best_parquet,
        "parquet_mb_s": parquet_bytes / best_parquet / 1e6,
        "ratio": best_parquet / best_spark,
    }


def render(r: dict[str, Any]) -> str:
    target = "met" if r["ratio"] >= 0.5 else "not met"
    runs = ", ".join(f"{s:.2f}" for s in r["spark_runs_s"])
    pruns = ", ".join(f"{s:.2f}" for s in r["parquet_runs_s"])
    sp = r["spark_parquet_runs_s"]
    return "\n".join(
        [
            "<!-- spark-bench:begin (generated by `make bench-spark`; do not edit by hand) -->",
            f"Measured {r['date']} on {r['machine']} with `{r['command']}`: {r['rows']:,} records"
            f" of {r['size']} B in {r['segments']} committed segments over {r['partitions']}"
            f" partitions ({r['data_bytes'] / 1e9:.2f} GB of segment data; Parquet copy"
            f" {r['parquet_bytes'] / 1e9:.2f} GB, uncompressed). Best of {len(r['spark_runs_s'])}"
            " runs each, after a Spark warm-up run.",
            "",
            "| reader | rows/s | MB/s | runs (s) |",
            "|---|---:|---:|---|",
            f'| Spark `format("strata")`, `local[2]`, every column materialized (`noop` sink)'
            f" | {r['spark_rows_s'] / 1e6:.2f} M | {r['spark_mb_s']:.0f} | {runs} |",
            f"| `pyarrow.parquet.read_table`, same rows, this process (threads)"
            f" | {r['parquet_rows_s'] / 1e6:.2f} M | {r['parquet_mb_s']:.0f} | {pruns} |",
            f"| for reference: Spark's own Parquet reader, same files, `local[2]`, `noop` sink"
            f" | {r['spark_parquet_rows_s'] / 1e6:.2f} M | {r['parquet_bytes'] / min(sp) / 1e6:.0f}"
            f" | {', '.join(f'{x:.2f}' for x in sp)} |",
            "",
            f"Ratio Spark ÷ Parquet (rows/s) = **{r['ratio']:.2f}** (target ≥ 0.5: {target})."
            f" Strata's source ÷ Spark's own Parquet reader ="
            f" {r['spark_rows_s'] / r['spark_parquet_rows_s']:.2f}.",
            "<!-- spark-bench:end -->",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Strata Spark scan benchmark")
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--segments", type=int, default=8, help="per partition")
    parser.add_argument("--batches", type=int, default=32, help="per segment")
    parser.add_argument("--records", type=int, default=1000, help="per batch")
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--dir", default=None, help="scratch directory (default: system temp)")
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args(argv)
    r = run(args)
    text = render(r)
    publish("spark", text, r, write_docs=args.write_docs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
