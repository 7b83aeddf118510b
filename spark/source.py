"""The ``strata`` PySpark (4.x) Python Data Source: committed segments straight from the bucket.

Theory of operation (user-facing details in ``docs/spark.md``):

* **Driver side** (``partitions()``, run by Spark in a Python planning worker): the manifest
  of every partition — by default the snapshots the agents put in the bucket after each
  ZooKeeper commit (``storage.tier.snapshot``), or ZooKeeper itself with
  ``manifest=zookeeper`` — is turned into read tasks by ``sdk.replay.plan``: one per committed
  segment, or per byte range of a segment larger than ``splitBytes``, pruned by partition,
  offsets and time with the manifest and, for partly wanted segments, the segment footer's
  index. Only segments a manifest names are ever read, so stray or duplicate objects in the
  bucket produce no rows. With ``planReport=<path>`` the planning figures (segments and bytes
  in the topic vs planned) are written there as JSON.
* **Executor side** (``read()``): one ranged GET of the task's bytes through ``sdk.replay``'s
  ``pyarrow.fs`` reader, batches decoded by the shared codec (CRC32C checked), rows filtered
  and the ``topic``/``partition`` columns added with Arrow kernels, yielded as Arrow record
  batches: no Python code per record, no agent and no ZooKeeper in the path.
* **Tag and header filters**: option ``filter`` (an expression over tags and headers, the
  language of ``docs/filters.md``) or ``tags`` (RocketMQ's ``"TagA || TagB"``) is parsed on
  the driver (a mistake fails the query with ``InvalidFilterError`` and its position) and
  applied by every read task as the agents apply a consumer's filter: batches whose summary
  rules it out are not decoded, the rest filtered with Arrow kernels.
* **Transactions**: reads are ``read_committed`` by default (option ``isolation.level``,
  ``read_committed`` or ``read_uncommitted``): transaction markers are never rows, and the
  records of aborted transactions are dropped, using the aborted list each segment's footer
  carries (read on the driver, only for segments whose manifest entry counts aborted ones).
* **Pushdown** (Spark 4.1+, ``spark.sql.python.filterPushdown.enabled=true``, which
  :func:`register` sets): comparisons and ``IN`` on ``partition`` and ``offset`` are applied
  exactly by the source; comparisons on ``timestamp`` prune segments and ranges and are also
  left to Spark (literal time zones are Spark's business).
* **Incarnations.** The plan reads one incarnation of the topic (``sdk.replay``: the newest,
  or the one option ``topicId`` pins); a topic deleted (or being deleted, with
  ``manifest=zookeeper``) raises ``UnknownTopicOrPartitionError``: no row of a deleted
  incarnation is ever read.
* **Streaming** (``readStream``): the offset is ``{partition: manifest end}`` (the end of the
  last committed segment); a micro-batch reads the segments between two such offsets.
  ``Trigger.AvailableNow`` is supported: the target is the manifests' ends when the query starts.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime as dt
import functools
import json
import os
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    EqualTo,
    Filter,
    GreaterThan,
    GreaterThanOrEqual,
    In,
    InputPartition,
    IsNotNull,
    LessThan,
    LessThanOrEqual,
)
from pyspark.sql.streaming.datasource import SupportsTriggerAvailableNow
from pyspark.sql.types import StructType

from sdk.replay import (
    DEFAULT_SPLIT_BYTES,
    Archive,
    ArchiveConfig,
    Bounds,
    PlanReport,
    ReadStats,
    SegmentRead,
    constant_int32,
    constant_string,
    plan,
    read_segment,
)
from storage import filters as record_filters
from storage.codec import SCHEMA as CODEC_SCHEMA
from storage.tier.manifest import Manifest

#: (column, Spark DDL type) of the source's schema, in order
COLUMNS = (
    ("topic", "string"),
    ("partition", "int"),
    ("offset", "bigint"),
    ("timestamp", "timestamp"),
    ("key", "binary"),
    ("value", "binary"),
    ("headers", "array<struct<key:string,value:binary>>"),
    ("tags", "array<string>"),
)
SCHEMA_DDL = ", ".join(f"{name} {ddl}" for name, ddl in COLUMNS)
HEADERS = pa.list_(pa.struct([pa.field("key", pa.string()), pa.field("value", pa.binary())]))
ARROW_SCHEMA = pa.schema(
    [
        ("topic", pa.string()),
        ("partition", pa.int32()),
        ("offset", pa.int64()),
        ("timestamp", pa.timestamp("us", tz="UTC")),
        ("key", pa.binary()),
        ("value", pa.binary()),
        ("headers", HEADERS),
        ("tags", pa.list_(pa.string())),
    ]
)
ALL_COLUMNS = tuple(ARROW_SCHEMA.names)
DEFAULT_OPEN_COST = 4 << 20  # Spark's spark.sql.files.openCostInBytes


def register(session: Any) -> None:
    """Register ``format("strata")`` on ``session`` and turn on Python filter pushdown."""
    session.conf.set("spark.sql.python.filterPushdown.enabled", "true")
    session.dataSource.register(StrataDataSource)


# ---- options ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Options:
    topic: str
    archive: ArchiveConfig
    bounds: Bounds
    manifest_source: str
    zookeeper: str | None
    split_bytes: int
    max_partition_bytes: int
    open_cost_bytes: int
    plan_report: str | None
    starting: str  # streaming: "earliest" | "latest" | JSON
    pushdown: bool
    filter: str | None = None  # canonical text of option filter / tags (None: every record)
    read_committed: bool = True  # option isolation.level
    topic_id: str | None = None  # pins one incarnation of the topic name
    columns: tuple[str, ...] = tuple(name for name, _ in COLUMNS)  # option columns
    keys: tuple[bytes, ...] | None = None  # option keys (and pushed-down key filters)
    read_report: str | None = None  # option readReport: a directory for executors' ReadStats
    parallelism: int = 1  # option parallelism: the cores that run the read tasks

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> Options:
        o = {k.lower(): v for k, v in options.items()}
        topic = o.get("topic")
        if not topic:
            raise ValueError("the strata source needs option topic")
        archive = ArchiveConfig.from_env(
            bucket=o.get("bucket"),
            endpoint_url=o.get("endpoint"),
            region=o.get("region"),
            access_key_id=o.get("accesskey"),
            secret_access_key=o.get("secretkey"),
            session_token=o.get("sessiontoken"),
            prefix=o.get("prefix"),
        )
        parts = o.get("partitions")
        bounds = Bounds(
            partitions=None
            if not parts
            else frozenset(int(p) for p in parts.split(",") if p.strip()),
            start_offsets=_offsets(o.get("startingoffsets"), "earliest"),
            end_offsets=_offsets(o.get("endingoffsets"), "latest"),
            min_ts=_ms(o.get("startingtimestamp")),
            max_ts=_ms(o.get("endingtimestamp")),
        )
        source = o.get("manifest", "bucket").lower()
        if source not in ("bucket", "zookeeper"):
            raise ValueError("option manifest must be 'bucket' or 'zookeeper'")
        if source == "zookeeper" and not o.get("zookeeper"):
            raise ValueError("manifest=zookeeper needs option zookeeper (host:port/chroot)")
        if o.get("filter") is not None and o.get("tags") is not None:
            raise ValueError("options filter and tags cannot be used together")
        isolation = o.get("isolation.level", "read_committed").lower()
        if isolation not in ("read_committed", "read_uncommitted"):
            raise ValueError("option isolation.level must be read_committed or read_uncommitted")
        chosen = (
            record_filters.parse_tags(o["tags"])
            if o.get("tags") is not None
            else record_filters.as_filter(o.get("filter"))
        )
        keys = None
        if o.get("keys") is not None:
            keys = tuple(sorted({k.strip().encode() for k in o["keys"].split(",")}))
        return cls(
            topic,
            archive,
            bounds,
            source,
            o.get("zookeeper"),
            int(o.get("splitbytes", DEFAULT_SPLIT_BYTES)),
            int(o.get("maxpartitionbytes", DEFAULT_SPLIT_BYTES)),
            int(o.get("opencostinbytes", DEFAULT_OPEN_COST)),
            o.get("planreport"),
            o.get("startingoffsets", "earliest"),
            o.get("pushdown", "true").lower() != "false",
            None if chosen is None else chosen.text,
            isolation == "read_committed",
            o.get("topicid") or None,
            _columns(o.get("columns")),
            keys,
            o.get("readreport"),
            int(o.get("parallelism") or os.cpu_count() or 1),
        )

    @property
    def parsed_filter(self) -> record_filters.Filter | None:
        return None if self.filter is None else record_filters.parse(self.filter)


def _columns(raw: str | None) -> tuple[str, ...]:
    """Option ``columns``: a comma-separated subset of the schema (kept in schema order)."""
    names = [name for name, _ in COLUMNS]
    if raw is None or not raw.strip():
        return tuple(names)
    wanted = {c.strip().lower() for c in raw.split(",") if c.strip()}
    unknown = wanted - set(names)
    if unknown:
        raise ValueError(f"option columns: no column {sorted(unknown)} (columns: {names})")
    return tuple(n for n in names if n in wanted)


def _offsets(raw: str | None, open_word: str) -> dict[int, int]:
    """``earliest``/``latest`` (unbounded), one integer for every partition (key -1), or JSON
    ``{"0": 10, "3": 7}``."""
    if raw is None or raw.strip().lower() == open_word:
        return {}
    raw = raw.strip()
    if raw.lstrip("-").isdigit():
        return {-1: int(raw)}
    try:
        return {int(k): int(v) for k, v in json.loads(raw).items()}
    except (ValueError, AttributeError) as exc:
        raise ValueError(f"bad offsets option {raw!r}: {exc}") from None


def _ms(raw: str | None) -> int | None:
    return None if raw is None or raw == "" else int(raw)


# ---- manifests on the driver ------------------------------------------------------------------


def zookeeper_manifests(
    connect: str, topic: str, topic_id: str | None = None
) -> dict[int, tuple[str, Manifest]]:
    """partition -> (topic_id, manifest), read from ZooKeeper (driver only)."""
    from storage.errors import NodeNotFoundError, UnknownTopicOrPartitionError
    from storage.metadata import AsyncZooKeeper
    from storage.metadata.store import partition_path, topic_path

    async def run() -> dict[int, tuple[str, Manifest]]:
        zk = AsyncZooKeeper(connect)
        await zk.start()
        try:
            try:
                spec = json.loads((await zk.get(topic_path(topic)))[0])
            except NodeNotFoundError:
                raise UnknownTopicOrPartitionError(f"unknown topic {topic!r}") from None
            if spec.get("deletion") is not None:
                raise UnknownTopicOrPartitionError(f"topic {topic!r} is being deleted")
            if topic_id is not None and spec["topic_id"] != topic_id:
                raise UnknownTopicOrPartitionError(
                    f"topic {topic!r} is id {spec['topic_id']}, not {topic_id}: that one was "
                    "deleted"
                )
            out = {}
            for child in await zk.get_children(f"{topic_path(topic)}/partitions"):
                p = int(child)
                try:
                    data, _ = await zk.get(f"{partition_path(topic, p)}/segments")
                except NodeNotFoundError:
                    continue
                out[p] = (str(spec["topic_id"]), Manifest.decode(data))
            return out
        finally:
            await zk.stop()

    return asyncio.run(run())


def manifests_for(opts: Options, archive: Archive) -> dict[int, tuple[str, Manifest]]:
    if opts.manifest_source == "zookeeper":
        assert opts.zookeeper is not None
        return zookeeper_manifests(opts.zookeeper, opts.topic, opts.topic_id)
    snaps = archive.incarnation(opts.topic, opts.topic_id)
    return {p: (s.topic_id, s.manifest) for p, s in snaps.items()}


def _write_report(path: str | None, report: PlanReport) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(report.as_dict(), f)


# ---- reading on executors ---------------------------------------------------------------------


class SegmentPartition(InputPartition):
    def __init__(self, tasks: list[SegmentRead]) -> None:
        super().__init__(None)
        self.tasks = tasks


def pack(
    tasks: Sequence[SegmentRead],
    max_bytes: int,
    open_cost: int = DEFAULT_OPEN_COST,
    parallelism: int = 1,
) -> list[SegmentPartition]:
    """Segment reads packed, in order, into Spark partitions of about ``max_bytes`` or less.

    Spark's own file sources do the same with small files (``maxPartitionBytes``,
    ``openCostInBytes``): a Spark task costs tens of milliseconds before it reads a byte, so a
    topic of many small segments (rolled by ``segment.ms``) read one task per segment spends
    most of its time starting tasks. A segment read larger than ``max_bytes`` was already cut
    by ``splitBytes``; each read counts ``open_cost`` extra (its GET's fixed cost).

    Sized to the cores: the number of partitions is the fewest that keep them under
    ``max_bytes``, rounded up to a multiple of ``parallelism`` (the cores that run them) so
    the last wave of tasks is not one task with the other cores idle, and reads are shared
    out so that partitions carry about the same bytes (a read goes to the partition its
    midpoint falls in).
    """
    if not tasks:
        return []
    costs = [t.nbytes + open_cost for t in tasks]
    total = sum(costs)
    n = max(1, -(-total // max(1, max_bytes)))
    n = min(len(tasks), -(-n // max(1, parallelism)) * max(1, parallelism))
    target = total / n
    out: list[list[SegmentRead]] = [[] for _ in range(n)]
    done = 0
    for t, cost in zip(tasks, costs, strict=True):
        out[min(n - 1, int((done + cost / 2) // target))].append(t)
        done += cost
    return [SegmentPartition(p) for p in out if p]


@functools.lru_cache(maxsize=8)
def executor_archive(config: ArchiveConfig) -> Archive:
    """One ``Archive`` (one ``pyarrow.fs`` client and its connection pool) per configuration
    per Python worker: Spark reuses its workers across tasks, and building an S3 client for
    every task would be part of every task's start-up cost."""
    return Archive(config)


@functools.cache
def _prefetcher() -> concurrent.futures.ThreadPoolExecutor:
    """One thread per Python worker that fetches the next segment read's bytes while the
    current one is decoded (``pyarrow.fs`` releases the GIL while it waits on S3)."""
    return concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="strata-prefetch")


def read_tasks(
    archive: Archive,
    tasks: Sequence[SegmentRead],
    columns: Sequence[str] = ALL_COLUMNS,
    stats: ReadStats | None = None,
) -> Iterator[pa.RecordBatch]:
    """Arrow batches of ``columns`` (``ARROW_SCHEMA``'s, in its order) for ``tasks``.

    Each decoded codec batch is handed on as it is (columns pointing into the ranged GET's
    buffer, only ``timestamp`` rewritten in microseconds): gathering them into bigger batches
    copied every byte once more and cost about a fifth of the Python time (``docs/spark.md``).
    The next task's bytes are fetched while the current task's are decoded. ``stats`` is
    added to, including ``bytes_out`` (the Arrow bytes handed to Spark).
    """
    st = ReadStats() if stats is None else stats
    schema = pa.schema([ARROW_SCHEMA.field(c) for c in columns])
    pending: concurrent.futures.Future[Any] | None = None
    for i, task in enumerate(tasks):
        buf = (
            archive.get_range(task.key, task.byte_start, task.byte_end)
            if pending is None
            else pending.result()
        )
        pending = None
        if i + 1 < len(tasks):
            nxt = tasks[i + 1]
            pending = _prefetcher().submit(archive.get_range, nxt.key, nxt.byte_start, nxt.byte_end)
        for batch in read_segment(archive, task, st, buf=buf):
            out = _spark_batch(task, batch, schema)
            st.bytes_out += out.nbytes
            yield out


def _spark_batch(task: SegmentRead, b: pa.RecordBatch, schema: pa.Schema) -> pa.RecordBatch:
    """``b`` (``codec.SCHEMA``) as Spark wants it: ``topic`` and ``partition`` added (built
    once per worker for each size, they are constant), ``timestamp`` in microseconds, and the
    list columns only relabelled (``view``: the codec's non-null list items are the same
    bytes as Spark's nullable ones; a ``cast`` walked and copied them)."""
    n = b.num_rows
    arrays = []
    for name in schema.names:
        if name == "topic":
            arrays.append(_constant_topic(task.topic, n))
        elif name == "partition":
            arrays.append(_constant_partition(task.partition, n))
        elif name == "timestamp":
            arrays.append(b.column(1).cast(schema.field(name).type))
        else:
            arrays.append(b.column(_CODEC_INDEX[name]).view(schema.field(name).type))
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


@functools.lru_cache(maxsize=64)
def _constant_topic(topic: str, n: int) -> pa.Array:
    return constant_string(topic, n)


@functools.lru_cache(maxsize=64)
def _constant_partition(partition: int, n: int) -> pa.Array:
    return constant_int32(partition, n)


_CODEC_INDEX = {name: i for i, name in enumerate(CODEC_SCHEMA.names)}


def _report_reads(directory: str | None, stats: ReadStats) -> None:
    """Option ``readReport``: each read task's ``ReadStats`` as one JSON file in ``directory``
    (executors' counters; the tests sum them)."""
    if directory:
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, f"read-{uuid.uuid4().hex}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(stats.as_dict(), f)
        os.replace(path + ".tmp", path)


def read_partition(opts: Options, partition: InputPartition) -> Iterator[pa.RecordBatch]:
    """What a Spark task runs: ``read_tasks`` of the partition, then the read report."""
    assert isinstance(partition, SegmentPartition)
    stats = ReadStats()
    if partition.tasks:
        yield from read_tasks(executor_archive(opts.archive), partition.tasks, opts.columns, stats)
    _report_reads(opts.read_report, stats)


# ---- the data source --------------------------------------------------------------------------


class StrataDataSource(DataSource):
    """``spark.read.format("strata").option("topic", ...)`` — see ``docs/spark.md``."""

    @classmethod
    def name(cls) -> str:
        return "strata"

    def schema(self) -> str:
        """Every column, or those of option ``columns`` (Spark 4.3's Python data sources are
        not told which columns a query uses, so the source cannot prune them by itself)."""
        wanted = _columns(self.options.get("columns"))
        return ", ".join(f"{name} {ddl}" for name, ddl in COLUMNS if name in wanted)

    def reader(self, schema: StructType) -> DataSourceReader:
        opts = Options.parse(self.options)
        return StrataPushdownReader(opts) if opts.pushdown else StrataReader(opts)

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return StrataStreamReader(Options.parse(self.options))


class StrataReader(DataSourceReader):
    """Batch reads without filter pushdown (option ``pushdown=false``): options prune only."""

    def __init__(self, opts: Options) -> None:
        self.opts = opts
        self.bounds = opts.bounds

    def partitions(self) -> Sequence[InputPartition]:
        archive = Archive(self.opts.archive)
        tasks, report = plan(
            archive,
            self.opts.topic,
            self.bounds,
            split_bytes=self.opts.split_bytes,
            manifests=manifests_for(self.opts, archive),
            filter=self.opts.parsed_filter,
            read_committed=self.opts.read_committed,
            keys=self.opts.keys,
        )
        _write_report(self.opts.plan_report, report)
        if not tasks:
            return [SegmentPartition([])]
        return pack(
            tasks, self.opts.max_partition_bytes, self.opts.open_cost_bytes, self.opts.parallelism
        )

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        return read_partition(self.opts, partition)


class StrataPushdownReader(StrataReader):
    """The default reader: ``StrataReader`` plus filter pushdown (needs the Spark conf
    ``spark.sql.python.filterPushdown.enabled=true``, which :func:`register` sets)."""

    def pushFilters(self, filters: list[Filter]) -> Iterator[Filter]:
        for f in filters:
            by_key = _push_keys(f)
            if by_key is not None:
                keys = by_key if self.opts.keys is None else set(self.opts.keys) & by_key
                self.opts = replace(self.opts, keys=tuple(sorted(keys)))
                continue
            narrowed = _push(self.bounds, f)
            if narrowed is None:
                yield f
                continue
            self.bounds, exact = narrowed
            if not exact:
                yield f


def _push_keys(f: Filter) -> set[bytes] | None:
    """The keys ``key = x`` / ``key IN (...)`` allows (applied exactly by the reads)."""
    if getattr(f, "attribute", None) != ("key",):
        return None
    value = getattr(f, "value", None)
    if isinstance(f, EqualTo) and isinstance(value, bytes | bytearray):
        return {bytes(value)}
    if (
        isinstance(f, In)
        and isinstance(value, tuple | list)
        and all(isinstance(v, bytes | bytearray) for v in value)
    ):
        return {bytes(v) for v in value}
    return None


def _push(bounds: Bounds, f: Filter) -> tuple[Bounds, bool] | None:
    """``bounds`` narrowed by ``f`` and whether the source applies ``f`` exactly; None if
    ``f`` cannot be used."""
    attr = getattr(f, "attribute", None)
    if attr is None or len(attr) != 1:
        return None
    column, value = attr[0], getattr(f, "value", None)
    if column == "partition":
        if isinstance(f, EqualTo) and isinstance(value, int):
            return bounds.narrowed(partitions=[value]), True
        if (
            isinstance(f, In)
            and isinstance(value, tuple | list)
            and all(isinstance(v, int) for v in value)
        ):
            return bounds.narrowed(partitions=value), True
        return None
    if column == "offset" and isinstance(value, int):
        if isinstance(f, EqualTo):
            return bounds.narrowed(start_offset=value, end_offset=value + 1), True
        if isinstance(f, GreaterThan):
            return bounds.narrowed(start_offset=value + 1), True
        if isinstance(f, GreaterThanOrEqual):
            return bounds.narrowed(start_offset=value), True
        if isinstance(f, LessThan):
            return bounds.narrowed(end_offset=value), True
        if isinstance(f, LessThanOrEqual):
            return bounds.narrowed(end_offset=value + 1), True
        return None
    if column == "timestamp" and isinstance(value, dt.datetime) and value.tzinfo is not None:
        # Spark hands TimestampType literals over as aware datetimes (microseconds); records
        # have milliseconds: ts_ms * 1000 >= us  <=>  ts_ms >= ceil(us / 1000), and so on.
        us = (value - _EPOCH) // dt.timedelta(microseconds=1)
        ceil_ms, floor_ms = -(-us // 1000), us // 1000
        if isinstance(f, GreaterThanOrEqual):
            return bounds.narrowed(min_ts=ceil_ms), True
        if isinstance(f, GreaterThan):
            return bounds.narrowed(min_ts=floor_ms + 1), True
        if isinstance(f, LessThan):
            return bounds.narrowed(max_ts=ceil_ms), True
        if isinstance(f, LessThanOrEqual):
            return bounds.narrowed(max_ts=floor_ms + 1), True
        if isinstance(f, EqualTo):
            if us % 1000:
                return bounds.narrowed(min_ts=ceil_ms, max_ts=ceil_ms), True
            return bounds.narrowed(min_ts=floor_ms, max_ts=floor_ms + 1), True
    if isinstance(f, IsNotNull) and column in _NEVER_NULL:
        return bounds, True
    return None


_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
_NEVER_NULL = {"topic", "partition", "offset", "timestamp", "headers", "tags"}


# ---- streaming --------------------------------------------------------------------------------


class StrataStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Offsets are ``{"<partition>": <manifest end>}``; see the module docstring."""

    def __init__(self, opts: Options) -> None:
        self.opts = opts
        self._target: dict[str, int] | None = None

    def _ends(self) -> tuple[dict[str, int], dict[str, int]]:
        archive = Archive(self.opts.archive)
        manifests = manifests_for(self.opts, archive)
        parts = self.opts.bounds.partitions
        starts = {str(p): m.start for p, (_, m) in manifests.items() if parts is None or p in parts}
        ends = {str(p): m.end for p, (_, m) in manifests.items() if parts is None or p in parts}
        return starts, ends

    def initialOffset(self) -> dict[str, int]:
        starts, ends = self._ends()
        if self.opts.starting.strip().lower() == "latest":
            return ends
        explicit = _offsets(self.opts.starting, "earliest")
        return {
            p: max(start, explicit.get(int(p), explicit.get(-1, start)))
            for p, start in starts.items()
        }

    def prepareForTriggerAvailableNow(self) -> None:
        self._target = self._ends()[1]

    def latestOffset(
        self, start: dict[str, int] | None = None, limit: Any = None
    ) -> dict[str, int]:
        ends = self._target if self._target is not None else self._ends()[1]
        out = dict(start or {})
        for p, end in ends.items():
            out[p] = max(end, out.get(p, 0))
        return out

    def partitions(self, start: dict[str, int], end: dict[str, int]) -> Sequence[InputPartition]:
        bounds = Bounds(
            partitions=frozenset(int(p) for p in end),
            start_offsets={int(p): v for p, v in start.items()},
            end_offsets={int(p): v for p, v in end.items()},
        )
        archive = Archive(self.opts.archive)
        tasks, report = plan(
            archive,
            self.opts.topic,
            bounds,
            split_bytes=self.opts.split_bytes,
            manifests=manifests_for(self.opts, archive),
            filter=self.opts.parsed_filter,
            read_committed=self.opts.read_committed,
            keys=self.opts.keys,
        )
        _write_report(self.opts.plan_report, report)
        return pack(
            tasks, self.opts.max_partition_bytes, self.opts.open_cost_bytes, self.opts.parallelism
        )

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        return read_partition(self.opts, partition)

    def commit(self, end: dict[str, int]) -> None:
        pass
