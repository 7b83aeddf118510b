"""Spark scan of committed segments against the floor and Spark's Parquet reader, one run.

Run with ``make bench-spark`` (``python -m bench.spark_bench [--write-docs]``).

Segments are written straight into a local object-store directory with the tier layout
(``storage.tier``: batches + footer, manifest snapshot) instead of being produced through
agents: producing and uploading over 1 GB through an agent and moto on this 2-core machine
would take minutes and measure the uploader, not the scan. The Spark side reads them with
``format("strata")`` over a ``file://`` endpoint (the same ``pyarrow.fs`` code path as S3,
without moto's Python HTTP server in the way) on ``local[2]`` and materializes every column
(``write.format("noop")``). Values are random bytes, 1 KiB.

Baselines, in the same Spark session:

* **the floor** (:class:`FloorDataSource`): a trivial Python data source yielding exactly the
  Arrow batches the ``strata`` source yields (computed once here by running its reader, kept
  as one Arrow IPC file per Spark partition and memory-mapped from the page cache), with the
  same number of partitions. It is what any Python data source can reach: the cost of
  starting Python tasks and moving Arrow batches into the JVM.
* **Spark's own Parquet reader** over the same rows written as uncompressed Parquet (the
  codec's columns plus ``partition``), one file per segment.
* for reference, ``pyarrow.parquet.read_table`` of those files in this process (no Spark).

The machine is noisy (2 cores shared with other work), so the readers are alternated within
each round and the report gives medians and every run; the ratios are per round.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition
from pyspark.sql.types import StructType

from bench.common import publish
from sdk.replay import Archive, ArchiveConfig, plan, segment_table
from spark.source import SCHEMA_DDL, StrataDataSource
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


class FloorDataSource(DataSource):
    """The floor: a trivial Python data source yielding prepared Arrow batches (the ones the
    ``strata`` source yields, byte for byte, one Arrow IPC file per Spark partition, memory
    mapped from the page cache) with the same partitions. What any Python data source pays
    to hand Arrow batches to Spark, and nothing else."""

    @classmethod
    def name(cls) -> str:
        return "strata_floor"

    def schema(self) -> str:
        return self.options.get("schema", SCHEMA_DDL)

    def reader(self, schema: Any) -> DataSourceReader:
        return FloorReader(self.options["dir"], int(self.options["partitions"]))


class FloorReader(DataSourceReader):
    def __init__(self, directory: str, partitions: int) -> None:
        self.directory, self.count = directory, partitions

    def partitions(self) -> list[InputPartition]:
        return [InputPartition(i) for i in range(self.count)]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        with pa.memory_map(f"{self.directory}/{partition.value:05d}.arrow") as source:
            reader = pa.ipc.open_file(source)
            for i in range(reader.num_record_batches):
                yield reader.get_batch(i)


def write_floor(root: Path, options: dict[str, str]) -> tuple[int, int, int]:
    """The ``strata`` source's Spark partitions and batches for ``options``, run here, saved
    as one Arrow IPC file per partition under ``root/floor``: (partitions, batches, bytes)."""
    reader = StrataDataSource(options).reader(StructType())
    out = root / "floor"
    out.mkdir()
    partitions = reader.partitions()
    batches = nbytes = 0
    for i, part in enumerate(partitions):
        with pa.OSFile(str(out / f"{i:05d}.arrow"), "wb") as sink:
            writer = None
            for batch in reader.read(part):
                assert isinstance(batch, pa.RecordBatch)
                if writer is None:
                    writer = pa.ipc.new_file(sink, batch.schema)
                writer.write_batch(batch)
                batches += 1
                nbytes += batch.nbytes
            if writer is not None:
                writer.close()
    return len(partitions), batches, nbytes


def spark_cpu_s() -> float:
    """CPU seconds used so far by this process's descendants — the Spark JVM, its Python
    daemon and workers — including children they have reaped (``/proc``, Linux). On a machine
    shared with other work, CPU time per scan moves much less than wall time."""
    children: dict[int, list[int]] = {}
    ticks: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        pid = int(name)
        children.setdefault(int(fields[1]), []).append(pid)
        ticks[pid] = sum(int(x) for x in fields[11:15])  # utime stime cutime cstime
    total, todo = 0, list(children.get(os.getpid(), []))
    while todo:
        pid = todo.pop()
        total += ticks.get(pid, 0)
        todo.extend(children.get(pid, []))
    return total / os.sysconf("SC_CLK_TCK")


def _median(xs: list[float]) -> float:
    return float(statistics.median(xs))


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
        options = {"topic": TOPIC, "bucket": "bucket", "endpoint": f"file://{work}", **args.option}
        spark_partitions, floor_batches, floor_bytes = write_floor(work, options)
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
        spark.dataSource.register(FloorDataSource)

        def timed(df: Any) -> float:
            t = time.perf_counter()
            df.write.format("noop").mode("overwrite").save()
            return time.perf_counter() - t

        def strata_scan() -> float:
            return timed(spark.read.format("strata").options(**options).load())

        def strata_value_scan() -> float:
            df = spark.read.format("strata").options(**options, columns="value").load()
            return timed(df)

        def floor_scan() -> float:
            df = (
                spark.read.format("strata_floor")
                .option("dir", str(work / "floor"))
                .option("partitions", str(spark_partitions))
                .load()
            )
            return timed(df)

        def spark_parquet_scan() -> float:
            return timed(spark.read.parquet(str(work / "parquet")))

        def parquet_scan() -> float:
            t = time.perf_counter()
            table = pq.read_table(work / "parquet")
            assert table.num_rows == rows
            return time.perf_counter() - t

        readers = {
            "strata": strata_scan,
            "floor": floor_scan,
            "spark_parquet": spark_parquet_scan,
            "strata_value": strata_value_scan,
            "pyarrow_parquet": parquet_scan,
        }
        for scan in readers.values():  # warm-up: JVM, Python workers, page cache
            scan()
        runs: dict[str, list[float]] = {name: [] for name in readers}
        cpu: dict[str, list[float]] = {name: [] for name in readers if name != "pyarrow_parquet"}
        for _ in range(args.runs):  # alternated, so a noisy neighbour hits every reader
            for name, scan in readers.items():
                before = spark_cpu_s()
                runs[name].append(scan())
                if name in cpu:  # planning included; pyarrow.parquet runs in this process
                    cpu[name].append(spark_cpu_s() - before)
        spark.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    # per round: strata's rate over the baseline's rate (= baseline time / strata time)
    vs_floor = [f / s for f, s in zip(runs["floor"], runs["strata"], strict=True)]
    vs_parquet = [p / s for p, s in zip(runs["spark_parquet"], runs["strata"], strict=True)]
    cpu_vs_floor = [f / s for f, s in zip(cpu["floor"], cpu["strata"], strict=True)]
    cpu_vs_parquet = [p / s for p, s in zip(cpu["spark_parquet"], cpu["strata"], strict=True)]
    return {
        "date": datetime.date.today().isoformat(),
        "machine": f"{os.cpu_count()} cores, {platform.machine()}, Python {platform.python_version()}",
        "command": "make bench-spark",
        "rows": rows,
        "size": args.size,
        "segments": args.partitions * args.segments,
        "partitions": args.partitions,
        "spark_partitions": spark_partitions,
        "floor_batches": floor_batches,
        "floor_bytes": floor_bytes,
        "data_bytes": data_bytes,
        "parquet_bytes": parquet_bytes,
        "prepare_s": prepared,
        "runs_s": runs,
        "cpu_s": cpu,
        "cpu_strata_vs_floor": _median(cpu_vs_floor),
        "cpu_strata_vs_floor_runs": cpu_vs_floor,
        "cpu_strata_vs_spark_parquet": _median(cpu_vs_parquet),
        "cpu_strata_vs_spark_parquet_runs": cpu_vs_parquet,
        "rows_s": {name: rows / _median(r) for name, r in runs.items()},
        "strata_vs_floor": _median(vs_floor),
        "strata_vs_floor_runs": vs_floor,
        "strata_vs_spark_parquet": _median(vs_parquet),
        "strata_vs_spark_parquet_runs": vs_parquet,
    }


LABELS = {
    "strata": 'Spark `format("strata")`, every column',
    "floor": "the floor: trivial Python source, same Arrow batches from memory, same partitions",
    "spark_parquet": "Spark's own Parquet reader, same rows (uncompressed files)",
    "strata_value": 'Spark `format("strata")`, `columns=value`',
    "pyarrow_parquet": "`pyarrow.parquet.read_table` in this process (threads), no Spark",
}


def render(r: dict[str, Any]) -> str:
    def spread(xs: list[float]) -> str:
        return f"{min(xs):.2f} to {max(xs):.2f}"

    def cpu(name: str) -> str:
        xs = r["cpu_s"].get(name)
        return "n/a" if not xs else f"{_median(xs):.2f} ({', '.join(f'{x:.1f}' for x in xs)})"

    rows = [
        f"| {LABELS[name]} | {r['rows_s'][name] / 1e6:.2f} M | {_median(runs):.2f}"
        f" | {', '.join(f'{x:.2f}' for x in runs)} | {cpu(name)} |"
        for name, runs in r["runs_s"].items()
    ]
    floor_ok = "met" if r["strata_vs_floor"] >= 0.8 else "not met"
    parquet_ok = "met" if r["strata_vs_spark_parquet"] >= 0.7 else "not met"
    return "\n".join(
        [
            "<!-- spark-bench:begin (generated by `make bench-spark`; do not edit by hand) -->",
            f"Measured {r['date']} on {r['machine']} with `{r['command']}`: {r['rows']:,} records"
            f" of {r['size']} B in {r['segments']} committed segments over {r['partitions']}"
            f" partitions ({r['data_bytes'] / 1e9:.2f} GB of segment data; Parquet copy"
            f" {r['parquet_bytes'] / 1e9:.2f} GB, uncompressed). Spark `local[2]`, `noop` sink,"
            f" {r['spark_partitions']} Spark partitions ({r['floor_batches']} Arrow batches,"
            f" {r['floor_bytes'] / 1e9:.2f} GB). Medians of {len(r['runs_s']['strata'])} rounds,"
            " the readers alternated within each round, after one warm-up round.",
            "",
            "| reader | rows/s (median) | median (s) | runs (s) | Spark CPU s, median (runs) |",
            "|---|---:|---:|---|---|",
            *rows,
            "",
            f"`strata` ÷ the floor = **{r['strata_vs_floor']:.2f}** (per round"
            f" {spread(r['strata_vs_floor_runs'])}; target ≥ 0.8: {floor_ok}). `strata` ÷ Spark's"
            f" Parquet reader = **{r['strata_vs_spark_parquet']:.2f}** (per round"
            f" {spread(r['strata_vs_spark_parquet_runs'])}; stretch ≥ 0.7: {parquet_ok}). By the"
            " CPU seconds Spark's processes spent per scan (steadier on a shared machine):"
            f" ÷ the floor {r['cpu_strata_vs_floor']:.2f}"
            f" ({spread(r['cpu_strata_vs_floor_runs'])}), ÷ Spark's Parquet reader"
            f" {r['cpu_strata_vs_spark_parquet']:.2f}"
            f" ({spread(r['cpu_strata_vs_spark_parquet_runs'])}).",
            "<!-- spark-bench:end -->",
        ]
    )


class _Merge(argparse.Action):
    def __call__(self, parser: Any, namespace: Any, values: Any, option: Any = None) -> None:
        setattr(namespace, self.dest, {**getattr(namespace, self.dest), **values})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Strata Spark scan benchmark")
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--segments", type=int, default=8, help="per partition")
    parser.add_argument("--batches", type=int, default=32, help="per segment")
    parser.add_argument("--records", type=int, default=1000, help="per batch")
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--dir", default=None, help="scratch directory (default: system temp)")
    parser.add_argument(
        "--option",
        type=lambda kv: dict([kv.split("=", 1)]),
        action=_Merge,
        default={},
        help="an extra strata source option, name=value (the floor follows its partitions)",
    )
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args(argv)
    r = run(args)
    text = render(r)
    publish("spark", text, r, write_docs=args.write_docs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
