"""Replay history straight from the object tier: committed segments to Arrow, no agent involved.

Theory of operation:

* **What exists.** Only committed segments are read. The list comes from the manifest
  snapshots the partition leaders put in the bucket after every ZooKeeper commit
  (``storage.tier.snapshot``: ``<prefix>manifests/<topic>/<partition>.json``); the SDK never
  talks to ZooKeeper. Objects the snapshot does not name — orphans of failed commits, stray
  uploads, copies — are never listed, never read.
* **Which incarnation.** A topic name can be deleted and created again; each incarnation has
  its own ``topic_id``, in its snapshots and its segment keys. A plan reads the snapshots of
  one incarnation only: the one pinned with ``topic_id=``, else the newest (by the topic's
  creation time in the snapshot). A topic with no snapshot — deleted (a delete removes its
  snapshots before its objects), never created, or never led with tiering on — raises
  ``UnknownTopicOrPartitionError``: rows of a deleted incarnation are never returned. A topic
  that exists with nothing tiered yet has empty snapshots and reads as empty.
* **Planning** (:func:`plan`) turns a topic, partitions, an offset range per partition and a
  time range into :class:`SegmentRead` tasks, one per segment or per byte range of a large one.
  Whole segments are skipped with the manifest alone (offsets; ``max_timestamp`` below the
  start of the time range); inside a partly wanted segment the footer's sparse index (one
  ranged GET of index + trailer) narrows the bytes to read. Timestamps are set by producers
  and are not monotonic, so only the *start* of a time range can skip bytes; the end of a time
  range filters rows.
* **Transactions.** Replay reads committed data by default (``isolation_level``
  ``read_committed``): control batches (transaction markers) are never returned, and the
  batches of aborted transactions are dropped. A tiered segment's footer lists the aborted
  transactions with batches in it (``storage.tier.layout``; a segment is tiered only once
  all its transactions have ended), and its manifest entry says how many, so planning reads
  the footer of exactly those segments and each task carries its list. ``read_uncommitted``
  keeps the aborted transactions' records (markers are still dropped).
* **Reading** (:func:`read_segment`) range-reads the task's bytes, walks the batch headers,
  skips control batches, aborted transactions' batches and batches wholly outside the wanted
  offsets or times, decodes the rest with the shared
  codec (CRC32C checked per batch) and filters rows with Arrow compute kernels: no Python code
  runs per record. A filter over tags and headers (``storage.filters``, the same expressions
  a consumer subscribes with) is pushed down the way the agent applies it: a batch whose
  summary rules it out is not decoded, one whose summary says every record matches is not
  filtered, and only the rest are filtered with Arrow kernels.
* **Storage.** ``pyarrow.fs`` (``S3FileSystem`` with request/connect timeouts and a bounded
  retry strategy; or a local directory for ``file://`` endpoints, which benchmarks use, whose
  ranges are memory-mapped rather than copied). Its
  ``OSError``s become ``ObjectNotFoundError`` / ``ObjectStoreError`` in :class:`Archive` only.

The Spark data source (``spark/``) runs the same planning on its driver and the same reads on
its executors.
"""

from __future__ import annotations

import bisect
import functools
import os
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from storage.codec import SCHEMA, decode_batch, iter_batches
from storage.codec.control import aborted_ranges, is_aborted
from storage.errors import (
    CorruptSegmentError,
    ObjectNotFoundError,
    ObjectStoreError,
    UnknownTopicOrPartitionError,
)
from storage.filters import Filter, Verdict, as_filter, classify, parse
from storage.filters.expr import Tag, conjunction
from storage.tier.layout import Footer, decode_footer
from storage.tier.manifest import Manifest, SegmentEntry
from storage.tier.snapshot import (
    ManifestSnapshot,
    parse_snapshot_key,
    snapshot_key,
    snapshot_prefix,
)

DEFAULT_SPLIT_BYTES = 128 << 20
SNAPSHOT_ATTEMPTS = 5

#: the columns of a replayed table: ``partition`` then the codec's columns
REPLAY_SCHEMA = pa.schema([pa.field("partition", pa.int32(), nullable=False), *SCHEMA])


@dataclass(frozen=True, slots=True, kw_only=True)
class ArchiveConfig:
    """Where the object tier is. ``endpoint_url`` ``file:///dir`` means a local directory
    (``dir/<bucket>/<key>``); anything else is S3 (``None``: AWS's own endpoint)."""

    bucket: str
    endpoint_url: str | None = None
    region: str | None = None
    access_key_id: str | None = None
    secret_access_key: str | None = None
    session_token: str | None = None
    prefix: str = ""
    request_timeout: float = 10.0
    connect_timeout: float = 2.0
    max_attempts: int = 5

    @classmethod
    def from_env(cls, **overrides: Any) -> ArchiveConfig:
        """From ``STRATA_BUCKET``, ``AWS_ENDPOINT_URL``, ``AWS_REGION``, ``AWS_ACCESS_KEY_ID``..."""
        env = os.environ
        values: dict[str, Any] = {
            "bucket": env.get("STRATA_BUCKET", ""),
            "endpoint_url": env.get("AWS_ENDPOINT_URL") or None,
            "region": env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or None,
            "access_key_id": env.get("AWS_ACCESS_KEY_ID") or None,
            "secret_access_key": env.get("AWS_SECRET_ACCESS_KEY") or None,
            "session_token": env.get("AWS_SESSION_TOKEN") or None,
            "prefix": env.get("STRATA_S3_PREFIX", ""),
        }
        values.update({k: v for k, v in overrides.items() if v is not None})
        if not values["bucket"]:
            raise ValueError("no bucket: pass bucket= or set STRATA_BUCKET")
        return cls(**values)


class Archive:
    """Synchronous reads of the object tier (thread-safe; ``pyarrow.fs`` releases the GIL)."""

    def __init__(self, config: ArchiveConfig) -> None:
        import pyarrow.fs as pafs

        self.config = config
        self.bytes_read = 0
        self.requests = 0
        endpoint = config.endpoint_url
        self._local = endpoint is not None and endpoint.startswith("file://")
        if endpoint is not None and self._local:
            self._fs: Any = pafs.LocalFileSystem()
            self._root = f"{endpoint[len('file://') :].rstrip('/')}/{config.bucket}/"
        else:
            scheme, host = "https", None
            if endpoint is not None:
                scheme, _, host = endpoint.partition("://")
            self._fs = pafs.S3FileSystem(
                access_key=config.access_key_id,
                secret_key=config.secret_access_key,
                session_token=config.session_token,
                region=config.region or "us-east-1",
                endpoint_override=host,
                scheme=scheme,
                request_timeout=config.request_timeout,
                connect_timeout=config.connect_timeout,
                retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=config.max_attempts),
            )
            self._root = f"{config.bucket}/"

    def _path(self, key: str) -> str:
        return self._root + key

    def _translate(self, exc: OSError, what: str) -> ObjectStoreError:
        if isinstance(exc, FileNotFoundError) or "NoSuchKey" in str(exc) or "404" in str(exc):
            return ObjectNotFoundError(f"{what}: not found")
        return ObjectStoreError(f"{what}: {exc}")

    def get_range(self, key: str, start: int, end: int) -> Any:
        """Bytes ``[start, end)`` of ``key`` (``bytes`` or a ``pyarrow.Buffer``)."""
        self.requests += 1
        try:
            if self._local:
                # a local directory: the page cache's bytes, mapped, not copied (segment
                # objects are written once and never rewritten in place)
                with pa.memory_map(self._path(key)) as f:
                    f.seek(start)
                    buf = f.read_buffer(end - start)
            else:
                with self._fs.open_input_file(self._path(key)) as f:
                    buf = f.read_at(end - start, start)
        except OSError as exc:
            raise self._translate(exc, f"GET {key} bytes={start}-{end - 1}") from None
        if len(buf) != end - start:
            raise ObjectStoreError(f"GET {key}: {len(buf)} of {end - start} bytes")
        self.bytes_read += len(buf)
        return buf

    def get(self, key: str) -> bytes:
        self.requests += 1
        try:
            with self._fs.open_input_stream(self._path(key)) as f:
                data: bytes = f.read()
        except OSError as exc:
            raise self._translate(exc, f"GET {key}") from None
        self.bytes_read += len(data)
        return data

    def list(self, prefix: str) -> list[str]:
        """Keys of the objects under ``prefix`` (a "directory": ends with ``/``)."""
        import pyarrow.fs as pafs

        self.requests += 1
        try:
            infos = self._fs.get_file_info(
                pafs.FileSelector(self._path(prefix).rstrip("/"), allow_not_found=True)
            )
        except OSError as exc:
            raise self._translate(exc, f"LIST {prefix}") from None
        n = len(self._root)
        return sorted(i.path[n:] for i in infos if i.type == pafs.FileType.File)

    # ---- manifests --------------------------------------------------------------------------
    def _read_snapshot(self, key: str) -> ManifestSnapshot:
        # ``pyarrow.fs`` reads an object with a size probe and ranged GETs, so a read that
        # races the leader overwriting the snapshot can splice two versions: read again.
        for attempt in range(SNAPSHOT_ATTEMPTS):
            try:
                return ManifestSnapshot.decode(self.get(key), where=key)
            except CorruptSegmentError:
                if attempt + 1 == SNAPSHOT_ATTEMPTS:
                    raise
                time.sleep(0.05 * (attempt + 1))
        raise AssertionError("unreachable")

    def snapshot(self, topic: str, partition: int) -> ManifestSnapshot | None:
        key = snapshot_key(topic, partition, self.config.prefix)
        try:
            return self._read_snapshot(key)
        except ObjectNotFoundError:
            return None

    def snapshots(self, topic: str) -> dict[int, ManifestSnapshot]:
        """Every partition's manifest snapshot of ``topic`` (partitions without one are absent)."""
        out = {}
        for key in self.list(snapshot_prefix(topic, self.config.prefix)):
            partition = parse_snapshot_key(key)
            if partition is not None:
                out[partition] = self._read_snapshot(key)
        return out

    def incarnation(self, topic: str, topic_id: str | None = None) -> dict[int, ManifestSnapshot]:
        """The snapshots of one incarnation of ``topic``: ``topic_id``'s, else the newest's
        (module docstring). ``UnknownTopicOrPartitionError`` if there is none."""
        snaps = self.snapshots(topic)
        if topic_id is None and snaps:
            newest = max(snaps.values(), key=lambda s: (s.created_ms, s.written_ms))
            topic_id = newest.topic_id
        chosen = {p: s for p, s in snaps.items() if s.topic_id == topic_id}
        if not chosen:
            which = f"topic {topic!r}" + (f" with id {topic_id}" if topic_id else "")
            raise UnknownTopicOrPartitionError(
                f"{which} has no manifest snapshot in the bucket: it does not exist (or was "
                "deleted), or no leader has tiered it yet"
            )
        return chosen

    def footer(self, key: str, entry: SegmentEntry) -> Footer:
        return decode_footer(self.get_range(key, entry.data_length, entry.size), where=key)


# ---- planning -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SegmentRead:
    """One read task: bytes ``[byte_start, byte_end)`` of one committed segment's data, and the
    rows wanted from them (offsets ``[start_offset, end_offset)``, timestamps ``[min_ts,
    max_ts)``; ``None`` = unbounded). ``byte_start`` is always a batch boundary."""

    topic: str
    partition: int
    key: str
    entry: SegmentEntry
    byte_start: int
    byte_end: int
    start_offset: int | None = None
    end_offset: int | None = None
    min_ts: int | None = None
    max_ts: int | None = None
    filter: str | None = None  # a storage.filters expression (canonical text); None: all rows
    #: aborted transactions to drop: (producer id, first offset, end offset), from the footer
    aborted: tuple[tuple[int, int, int], ...] = ()
    #: only rows whose key is one of these (None: every key; a null key never matches)
    keys: tuple[bytes, ...] | None = None

    @property
    def nbytes(self) -> int:
        return self.byte_end - self.byte_start


@dataclass(slots=True)
class ReadStats:
    """What reads did, summed over tasks: the evidence of pushdown below the plan.

    ``batches`` counts the data batches met in the bytes read (control batches and aborted
    transactions' batches not included); ``batches_skipped`` those never decoded (outside the
    offsets or times, or ruled out by their tag/header summary); ``batches_dropped`` those
    decoded whose every row was filtered out (keys, rows' tags/headers, times).
    ``segments_skipped`` counts task reads of which no row was returned. ``bytes_out`` is the
    size of the Arrow data handed on (``pyarrow`` ``nbytes``).
    """

    tasks: int = 0
    segments_skipped: int = 0
    bytes_read: int = 0
    batches: int = 0
    batches_skipped: int = 0
    batches_decoded: int = 0
    batches_dropped: int = 0
    rows: int = 0
    bytes_out: int = 0

    def add(self, other: ReadStats) -> None:
        for name in self.__slots__:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.__slots__}


@dataclass(slots=True)
class PlanReport:
    """What planning kept: the test and benchmark evidence of pruning."""

    segments_total: int = 0
    bytes_total: int = 0
    segments_planned: int = 0
    bytes_planned: int = 0
    tasks: int = 0
    footers_read: int = 0
    ends: dict[int, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "segments_total": self.segments_total,
            "bytes_total": self.bytes_total,
            "segments_planned": self.segments_planned,
            "bytes_planned": self.bytes_planned,
            "tasks": self.tasks,
            "footers_read": self.footers_read,
            "ends": {str(k): v for k, v in self.ends.items()},
        }


@dataclass(frozen=True, slots=True)
class Bounds:
    """The rows wanted: partitions (None = all), per-partition offsets, a time range (ms).

    ``start_offsets`` / ``end_offsets`` map partition -> offset (end exclusive); a partition
    not in the map is unbounded on that side. ``min_ts`` inclusive, ``max_ts`` exclusive.
    """

    partitions: frozenset[int] | None = None
    start_offsets: Mapping[int, int] = field(default_factory=dict)
    end_offsets: Mapping[int, int] = field(default_factory=dict)
    min_ts: int | None = None
    max_ts: int | None = None

    def narrowed(
        self,
        *,
        partitions: Iterable[int] | None = None,
        start_offset: int | None = None,
        end_offset: int | None = None,
        min_ts: int | None = None,
        max_ts: int | None = None,
    ) -> Bounds:
        """These bounds AND the given ones (offsets apply to every partition)."""
        parts = self.partitions
        if partitions is not None:
            p = frozenset(partitions)
            parts = p if parts is None else parts & p
        starts, ends = dict(self.start_offsets), dict(self.end_offsets)
        for d, v, pick in ((starts, start_offset, max), (ends, end_offset, min)):
            if v is not None:
                d[-1] = v if -1 not in d else pick(d[-1], v)
        return replace(
            self,
            partitions=parts,
            start_offsets=starts,
            end_offsets=ends,
            min_ts=_tighter(self.min_ts, min_ts, max),
            max_ts=_tighter(self.max_ts, max_ts, min),
        )

    def offsets_for(self, partition: int) -> tuple[int | None, int | None]:
        """(start, end) for ``partition``; key ``-1`` holds bounds common to every partition."""
        s = [v for k, v in self.start_offsets.items() if k in (partition, -1)]
        e = [v for k, v in self.end_offsets.items() if k in (partition, -1)]
        return (max(s) if s else None), (min(e) if e else None)


def _tighter(a: int | None, b: int | None, pick: Any) -> int | None:
    if a is None:
        return b
    if b is None:
        return a
    return int(pick(a, b))


def plan(
    archive: Archive,
    topic: str,
    bounds: Bounds = Bounds(),
    *,
    split_bytes: int = DEFAULT_SPLIT_BYTES,
    manifests: Mapping[int, tuple[str, Manifest]] | None = None,
    filter: Filter | None = None,
    read_committed: bool = True,
    topic_id: str | None = None,
    keys: Iterable[bytes] | None = None,
) -> tuple[list[SegmentRead], PlanReport]:
    """The read tasks for ``topic`` within ``bounds``, in (partition, offset) order.

    ``manifests`` (partition -> (topic_id, manifest)) overrides the bucket's snapshots (the
    Spark driver passes ZooKeeper's when told to); else the snapshots of one incarnation are
    read (``topic_id``'s, or the newest: ``Archive.incarnation``). ``filter`` and ``keys`` go
    with every task. With ``read_committed`` every task of a segment with aborted
    transactions carries their list (its footer is read for it).
    """
    if manifests is None:
        manifests = {
            p: (s.topic_id, s.manifest) for p, s in archive.incarnation(topic, topic_id).items()
        }
    report = PlanReport()
    key_tuple = None if keys is None else tuple(sorted(set(keys)))
    tasks: list[SegmentRead] = []
    prefix = archive.config.prefix
    for partition in sorted(manifests):
        topic_id, manifest = manifests[partition]
        report.ends[partition] = manifest.end
        report.segments_total += len(manifest.segments)
        report.bytes_total += sum(s.data_length for s in manifest.segments)
        if bounds.partitions is not None and partition not in bounds.partitions:
            continue
        start, end = bounds.offsets_for(partition)
        for entry in manifest.segments:
            if start is not None and entry.next_offset <= start:
                continue
            if end is not None and entry.base_offset >= end:
                break
            if bounds.min_ts is not None and entry.max_timestamp < bounds.min_ts:
                continue
            key = entry.key(topic, topic_id, partition, prefix)
            lo, hi = 0, entry.data_length
            cut_start = start is not None and start > entry.base_offset
            cut_end = end is not None and end < entry.next_offset
            footer: Footer | None = None
            wants_aborted = read_committed and entry.aborted > 0
            if (
                cut_start
                or cut_end
                or bounds.min_ts is not None
                or hi > split_bytes
                or wants_aborted
            ):
                footer = archive.footer(key, entry)
                report.footers_read += 1
                if cut_start and start is not None:
                    lo = max(lo, footer.position_for_offset(start))
                if bounds.min_ts is not None:
                    lo = max(lo, footer.position_for_timestamp(bounds.min_ts))
                if cut_end and end is not None:
                    i = bisect.bisect_left(footer.rels, end - entry.base_offset)
                    hi = footer.positions[i] if i < len(footer.positions) else hi
            if hi <= lo:
                continue
            report.segments_planned += 1
            report.bytes_planned += hi - lo
            for a, b in _splits(footer, lo, hi, split_bytes):
                tasks.append(
                    SegmentRead(
                        topic,
                        partition,
                        key,
                        entry,
                        a,
                        b,
                        start if cut_start else None,
                        end if cut_end else None,
                        bounds.min_ts,
                        bounds.max_ts,
                        None if filter is None else filter.text,
                        footer.aborted if wants_aborted and footer is not None else (),
                        key_tuple,
                    )
                )
    report.tasks = len(tasks)
    return tasks, report


def _splits(footer: Footer | None, lo: int, hi: int, split_bytes: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` cut at indexed batch boundaries into pieces of about ``split_bytes``."""
    if footer is None or hi - lo <= split_bytes:
        return [(lo, hi)]
    out = []
    a = lo
    while hi - a > split_bytes:
        b = footer.next_indexed_position(a + split_bytes - 1)
        if b >= hi:
            break
        out.append((a, b))
        a = b
    out.append((a, hi))
    return out


# ---- reading --------------------------------------------------------------------------------


def read_segment(
    archive: Archive, task: SegmentRead, stats: ReadStats | None = None, *, buf: Any = None
) -> Iterator[pa.RecordBatch]:
    """The wanted rows of ``task`` as record batches of ``codec.SCHEMA``, in offset order.

    ``stats``, if given, is added to (see :class:`ReadStats`). ``buf``: the task's bytes if
    the caller fetched them already (a prefetch); otherwise one ranged GET.
    """
    st = ReadStats() if stats is None else stats
    if buf is None:
        buf = archive.get_range(task.key, task.byte_start, task.byte_end)
    st.tasks += 1
    st.bytes_read += task.nbytes
    rows_before = st.rows
    start, end, min_ts, max_ts = task.start_offset, task.end_offset, task.min_ts, task.max_ts
    filt = None if task.filter is None else _parsed(task.filter)
    keys = None if task.keys is None else _key_set(task.keys)
    aborted = aborted_ranges(task.aborted)
    for h, pos in iter_batches(buf):
        if h.is_control:
            continue  # a transaction marker: never a record for the application
        if aborted and is_aborted(aborted, h):
            continue
        if end is not None and h.base_offset >= end:
            break
        st.batches += 1
        if start is not None and h.next_offset <= start:
            st.batches_skipped += 1
            continue
        if min_ts is not None and h.max_timestamp < min_ts:
            st.batches_skipped += 1
            continue
        verdict = Verdict.WHOLE if filt is None else classify(filt, buf, pos, h)
        if verdict is Verdict.SKIP:
            st.batches_skipped += 1
            continue
        batch = decode_batch(buf, pos)
        st.batches_decoded += 1
        mask = None
        if filt is not None and verdict is Verdict.DECODE:
            mask = pa.array(filt.mask(batch))
        if keys is not None:
            in_keys = pc.is_in(batch.column(2), value_set=keys)
            mask = in_keys if mask is None else pc.and_(mask, in_keys)
        if (start is not None and h.base_offset < start) or (
            end is not None and h.next_offset > end
        ):
            offsets = batch.column(0)
            lo = pc.greater_equal(offsets, start if start is not None else h.base_offset)
            cut = pc.and_(lo, pc.less(offsets, end if end is not None else h.next_offset))
            mask = cut if mask is None else pc.and_(mask, cut)
        if (min_ts is not None and h.first_timestamp < min_ts) or max_ts is not None:
            ts = batch.column(1).cast(pa.int64())
            cond = None
            if min_ts is not None:
                cond = pc.greater_equal(ts, min_ts)
            if max_ts is not None:
                upper = pc.less(ts, max_ts)
                cond = upper if cond is None else pc.and_(cond, upper)
            mask = cond if mask is None else pc.and_(mask, cond)
        if mask is not None:
            batch = batch.filter(mask)
        if batch.num_rows:
            st.rows += batch.num_rows
            yield batch
        else:
            st.batches_dropped += 1
    if st.rows == rows_before:
        st.segments_skipped += 1


@functools.lru_cache(maxsize=64)
def _key_set(keys: tuple[bytes, ...]) -> pa.Array:
    return pa.array(keys, pa.binary())


@functools.lru_cache(maxsize=64)
def _parsed(text: str) -> Filter:
    return parse(text)


def segment_table(archive: Archive, task: SegmentRead, stats: ReadStats | None = None) -> pa.Table:
    """``read_segment`` as one table (chunks point into the ranged GET's buffer)."""
    return pa.Table.from_batches(list(read_segment(archive, task, stats)), schema=SCHEMA)


def constant_int32(value: int, n: int) -> pa.Array:
    return pa.array(np.full(n, value, dtype=np.int32))


def constant_string(value: str, n: int) -> pa.Array:
    """``n`` copies of ``value`` as an Arrow string array, built without a Python loop."""
    raw = value.encode()
    offsets = (np.arange(n + 1, dtype=np.int32) * len(raw)).tobytes()
    return pa.StringArray.from_buffers(n, pa.py_buffer(offsets), pa.py_buffer(raw * n))


# ---- the SDK's replay iterator --------------------------------------------------------------


def combined_filter(
    tags: Iterable[str] | None = None, filter: str | Filter | None = None
) -> Filter | None:
    """Rows carrying one of ``tags`` AND matching ``filter`` (``docs/filters.md``; raises
    ``InvalidFilterError``); None if neither is given."""
    chosen = as_filter(filter)
    if tags is not None:
        by_tag = Filter(Tag(frozenset(tags)))
        chosen = by_tag if chosen is None else Filter(conjunction([by_tag.expr, chosen.expr]))
    return chosen


def replay(
    topic: str,
    *,
    start_ms: int | None = None,
    end_ms: int | None = None,
    keys: Iterable[bytes] | None = None,
    tags: Iterable[str] | None = None,
    filter: str | Filter | None = None,
    partitions: Iterable[int] | None = None,
    archive: Archive | ArchiveConfig | None = None,
    split_bytes: int = DEFAULT_SPLIT_BYTES,
    isolation_level: str = "read_committed",
    topic_id: str | None = None,
    stats: ReadStats | None = None,
) -> Iterator[pa.Table]:
    """Tables of ``topic``'s committed history (``REPLAY_SCHEMA``), read from the object tier.

    Rows have timestamps in ``[start_ms, end_ms)``; with ``keys``, only rows whose key is one
    of them; with ``tags``, only rows carrying at least one of them; with ``filter`` (an
    expression over tags and headers, ``docs/filters.md``; ``InvalidFilterError`` if it does
    not parse), only rows that match it. Tags and filter are pushed down to the batches'
    summaries; ``keys`` is applied to every decoded batch, before the other row filters.
    ``stats``, if given, is added to (:class:`ReadStats`: batches skipped by their summaries,
    segments of which nothing was returned). One table per segment (or byte range of a large
    one), partition by partition,
    each in offset order; empty tables are not yielded. ``archive`` defaults to
    ``ArchiveConfig.from_env()``. ``isolation_level`` ``read_committed`` (the default) drops
    the records of aborted transactions; ``read_uncommitted`` keeps them. Transaction
    markers are never returned. ``topic_id`` pins one incarnation of the name (default: the
    newest); a topic with no snapshot in the bucket (deleted, or never tiered) raises
    ``UnknownTopicOrPartitionError`` (at the first ``next``).
    """
    if isolation_level not in ("read_committed", "read_uncommitted"):
        raise ValueError(
            f"isolation_level must be read_committed or read_uncommitted, not {isolation_level!r}"
        )
    if archive is None:
        archive = ArchiveConfig.from_env()
    if isinstance(archive, ArchiveConfig):
        archive = Archive(archive)
    bounds = Bounds(
        partitions=None if partitions is None else frozenset(partitions),
        min_ts=start_ms,
        max_ts=end_ms,
    )
    chosen = combined_filter(tags, filter)
    tasks, _ = plan(
        archive,
        topic,
        bounds,
        split_bytes=split_bytes,
        filter=chosen,
        read_committed=isolation_level == "read_committed",
        topic_id=topic_id,
        keys=keys,
    )
    for task in tasks:
        table = segment_table(archive, task, stats)
        if stats is not None:
            stats.bytes_out += table.nbytes
        if table.num_rows:
            yield table.add_column(
                0, REPLAY_SCHEMA.field(0), [constant_int32(task.partition, table.num_rows)]
            )


__all__ = [
    "REPLAY_SCHEMA",
    "Archive",
    "ArchiveConfig",
    "Bounds",
    "PlanReport",
    "ReadStats",
    "SegmentRead",
    "combined_filter",
    "plan",
    "read_segment",
    "replay",
    "segment_table",
]
