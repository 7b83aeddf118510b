"""What every benchmark does with its result: print it, save the JSON, rewrite its section of
the docs."""

from __future__ import annotations

import json
import os
import re
import statistics
import time
import uuid
from pathlib import Path
from typing import Any

from storage.metadata import AsyncZooKeeper, MetadataStore, TopicSpec

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
DOC = ROOT / "docs" / "benchmarks.md"


def save_result(name: str, result: Any) -> Path:
    """``bench/results/<name>.json`` (git-ignored)."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(result, indent=2))
    return path


def write_docs_section(marker: str, section: str) -> None:
    """Replace ``<!-- {marker}:begin ... {marker}:end -->`` in docs/benchmarks.md by ``section``."""
    text = DOC.read_text()
    pattern = re.compile(
        rf"<!-- {re.escape(marker)}:begin.*?<!-- {re.escape(marker)}:end -->", re.S
    )
    if not pattern.search(text):
        raise SystemExit(f"docs/benchmarks.md has no {marker} markers")
    DOC.write_text(pattern.sub(lambda _: section, text))


def publish(name: str, table: str, result: Any, *, write_docs: bool) -> None:
    """Print ``table``, save ``result`` as ``bench/results/<name>.json`` (keys starting with
    ``_`` left out: raw samples) and, with ``write_docs``, put ``table`` in place of the
    ``<name>-bench`` section of docs/benchmarks.md."""
    print(table)
    if isinstance(result, dict):
        result = {k: v for k, v in result.items() if not str(k).startswith("_")}
    save_result(name, result)
    if write_docs:
        write_docs_section(f"{name}-bench", table)


async def create_topic(
    zk_connect: str,
    name: str,
    partitions: int,
    config: dict[str, Any] | None = None,
    replication_factor: int = 1,
) -> None:
    """Create topic ``name`` straight in the cluster's ZooKeeper."""
    zk = AsyncZooKeeper(zk_connect)
    await zk.start()
    try:
        spec = TopicSpec.build(
            name=name,
            partitions=partitions,
            replication_factor=replication_factor,
            config=config or {},
            topic_id=uuid.uuid4().hex,
            created_ms=int(time.time() * 1000),
        )
        await MetadataStore(zk).create_topic(spec)
    finally:
        await zk.stop()


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def spread(values: list[float]) -> dict[str, float]:
    """Median and range of one measurement's rounds."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


#: the quiet-disk check of ``settle_writeback``: this many seconds of 1 KiB appends, each
#: fdatasync'ed, all faster than QUIET_MS, within at most SETTLE_LIMIT_S
QUIET_WINDOW_S = 2.0
QUIET_MS = 10.0
SETTLE_LIMIT_S = 60.0


def settle_writeback(directory: Path) -> None:
    """Before every throughput and latency run, for every system alike: write back the dirty
    pages earlier runs left (``sync``), then wait until the disk is quiet — a window of
    ``QUIET_WINDOW_S`` in which 1 KiB append+``fdatasync`` probes all take under ``QUIET_MS``
    (or 10x the median of the first probes, on a disk where every fdatasync is slow), up to
    ``SETTLE_LIMIT_S``. Otherwise the kernel's write-back of the previous run (or of the
    previous benchmark of ``make bench``), and the discards of files just deleted (this disk
    is mounted with ``discard``: for ~20 s after the Spark benchmark deleted its data, single
    fdatasyncs took up to 114 ms), land in the next run's fsyncs and each row measures its
    predecessor too. The probes write in ``directory``, on the disk the systems under test
    use; a wait longer than one quiet window is printed."""
    os.sync()
    path = directory / f"settle-{os.getpid()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    start = time.monotonic()
    try:
        block, pos, window = os.urandom(1024), 0, time.monotonic()
        first: list[float] = []
        quiet_ms = QUIET_MS
        while time.monotonic() - start < SETTLE_LIMIT_S:
            t = time.perf_counter()
            os.pwrite(fd, block, pos)
            os.fdatasync(fd)
            pos += len(block)
            took = (time.perf_counter() - t) * 1000
            if len(first) < 21:  # a disk whose every fdatasync is slow is quiet at 10x its median
                first.append(took)
                quiet_ms = max(QUIET_MS, 10 * sorted(first)[len(first) // 2])
            if took > quiet_ms:
                window = time.monotonic()  # a slow one: the window starts again
            elif time.monotonic() - window >= QUIET_WINDOW_S:
                break
            time.sleep(0.001)
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)
    waited = time.monotonic() - start
    if waited > QUIET_WINDOW_S + 1:
        print(f"disk busy: waited {waited:.1f} s for a quiet window", flush=True)
