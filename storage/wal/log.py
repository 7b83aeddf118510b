"""A partition's local write-ahead log: an ordered list of segments in one directory.

Theory of operation
-------------------
* **Append.** A batch arrives as the producer encoded it. ``append`` checks it completely
  (header, exact length, ``max.message.bytes``, CRC32C, body layout, and — unless the caller
  opts out — every Arrow buffer of the body) *before* touching the file, then writes the leader's 16 stamped bytes (base offset, length, leader epoch — all
  outside the CRC) followed by the producer's bytes from byte 16 on: the batch is never
  re-encoded. A failed write is rolled back with ``ftruncate``, so bad input and I/O errors
  both leave the log as it was (an I/O error is also reported, see *Disk errors*).
* **Roll.** Before an append, the active segment is sealed and a new one started if the batch
  would push it past ``segment.bytes`` or its first batch is older than ``segment.ms``.
* **Disk errors.** ``on_io_error`` tells the owner of every disk error (the agent takes the
  partition offline and opens it again later). A failed append or segment creation leaves
  the log as it was and usable; a failed fsync, truncation or removal fences it: every later
  call raises the same ``StorageError``. A failed fsync is never retried as if it had
  worked: the page cache may still show bytes the disk never got (fsyncgate), so
  ``durable_end_at_failure`` keeps the offset below which everything was fsynced, and the
  owner cuts the reopened log there before trusting it.
* **Flush.** ``flush`` fsyncs the segments written since the last flush, writes the index
  files of newly sealed segments, and fsyncs the directory when files were created. It is
  split in three (``prepare_flush`` / ``FlushJob.run`` / ``complete_flush``) so that an asyncio
  caller can run the fsyncs in a thread while appends continue (group commit, see
  ``storage.wal.group_commit``). ``flushed_offset`` is the offset below which every record is
  on disk.
* **Recovery.** ``open`` trusts a sealed segment whose index file checks out (it was written
  only after the segment's fsync) and scans the rest with CRC checks: every segment without a
  valid index, and always the last one. A failure with no valid batch anywhere after it is a
  torn tail — the unflushed end of a crash — and is cut off. A tail can be torn in the last
  segment, and, under the policies that do not fsync at a roll, in any segment past the last
  indexed one: a power loss can keep the names of newer segments without the unsynced end of
  an older one. The segment that ends short (cut, or followed by a gap) is then the log's
  end, and the segments after it are removed: segments are fsynced in order, so nothing past
  a torn tail was ever covered by an fsync. Any other failure (a bad batch followed by good
  ones, a bad or short indexed segment before the last, a gap after one) is corruption: the
  segment is renamed ``*.quarantined`` and ``CorruptSegmentError`` is raised, now and on every
  later open, until an operator or a replica repairs the partition. Records are never skipped
  silently.
* **Reads** return whole batches as zero-copy slices of a segment's mmap, from the batch that
  holds the requested offset, at least one batch and otherwise at most ``max_bytes``.
* **Transactions** (``storage.wal.txn``): every append (and the header walk at open) updates
  the open transactions, the aborted-transaction index of each segment and the marker tokens;
  ``last_stable_offset`` and ``aborted`` answer ``read_committed`` reads. A truncation rebuilds
  them with one header walk (markers are the only batches decoded).

Invariants: segment base offsets are strictly increasing and contiguous (each segment starts
where the previous one ends); only the last segment is appended to; offsets in the log are
gap-free from ``log_start_offset`` to ``log_end_offset``.

A ``PartitionLog`` is not thread-safe: one thread (an event loop) owns it; only
``FlushJob.run`` may run elsewhere.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from storage.codec.batch import check_batch, decode_batch
from storage.codec.control import ControlMarker, read_marker
from storage.codec.header import STAMP, BatchHeader
from storage.codec.parts import BatchParts
from storage.config import FsyncPolicy, LogConfig
from storage.errors import (
    CorruptBatchError,
    CorruptSegmentError,
    InvalidOffsetError,
    LogClosedError,
    OffsetOutOfRangeError,
    StorageError,
    StrataError,
)
from storage.wal import fileio
from storage.wal.fileio import fsync_dir, storage_errors, write_file_atomically
from storage.wal.index import SparseIndex
from storage.wal.producers import ProducerStateTable
from storage.wal.segment import INDEX_SUFFIX, LOG_SUFFIX, QUARANTINE_SUFFIX, Segment
from storage.wal.txn import AbortedTxn, TransactionIndex

Clock = Callable[[], float]  # seconds since the epoch

_log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class AppendInfo:
    base_offset: int
    last_offset: int
    max_timestamp: int
    size: int


@dataclass(frozen=True, slots=True)
class LogSlice:
    """Whole batches read from the log: ``data`` is a zero-copy view of the segment file."""

    data: memoryview
    first_offset: int  # base offset of the first batch (may be below the offset asked for)
    next_offset: int  # offset after the last record in ``data``
    batch_count: int

    def __len__(self) -> int:
        return self.data.nbytes


@dataclass(slots=True)
class FlushJob:
    """The fsync work of one flush, runnable in another thread."""

    segments: list[tuple[Segment, int, bool]]  # segment, its size, sealed (write its index)
    end_offset: int
    sync_directory: bool
    directory: Path

    @property
    def fsyncs_only(self) -> bool:
        """Nothing to do but fsync segments (no index to write, no directory to fsync): the
        group commit's usual flush, which ``Flusher.fsync`` can hand to the kernel."""
        return not self.sync_directory and not any(sealed for _, _, sealed in self.segments)

    def run(self) -> None:
        for seg, size, sealed in self.segments:
            seg.fsync()
            if (
                sealed and not seg.deleted
            ):  # (a stray index of a deleted segment is removed at open)
                with storage_errors(f"cannot write {seg.index_path}"):
                    write_file_atomically(seg.index_path, seg.index.to_bytes(size))
        if self.sync_directory or any(sealed for _, _, sealed in self.segments):
            with storage_errors(f"cannot fsync {self.directory}"):
                fsync_dir(self.directory)


class PartitionLog:
    def __init__(
        self, directory: Path, config: LogConfig, segments: list[Segment], clock: Clock
    ) -> None:
        self.directory = directory
        self.config = config
        self._segments = segments
        self._bases = [s.base_offset for s in segments]
        self._clock = clock
        self._closed = False
        self._failed: StorageError | None = None
        #: after a failed fsync: ``flushed_offset`` then, the end of what is known to be on disk
        self.durable_end_at_failure: int | None = None
        #: the agent WAL's front (``storage.wal.agent.journal.WalPartition``), told of every
        #: append, truncation and restart; with one, a roll does not fsync (the WAL is the
        #: durability)
        self.journal: Any = None
        #: told (on the thread that owns the log) when a disk error fences the log
        self.on_io_error: Callable[[StorageError], None] | None = None
        self._dir_dirty = False
        self.flushed_offset = segments[-1].next_offset if segments else 0
        #: (leader epoch, first offset written in it), ascending: the leader-epoch cache
        self.epochs: list[tuple[int, int]] = []
        #: idempotent producers' last batches (``storage.wal.producers``)
        self.producers = ProducerStateTable()
        #: open and aborted transactions, the last stable offset (``storage.wal.txn``)
        self.transactions = TransactionIndex()
        now = clock()
        for seg in segments:
            self.transactions.segment_started(seg.base_offset)
            for h, pos in seg.walk(0):
                if not self.epochs or self.epochs[-1][0] != h.leader_epoch:
                    self.epochs.append((h.leader_epoch, h.base_offset))
                self.producers.update(h, now)  # a reopened log counts as activity
                if h.is_transactional:
                    marker = read_marker(seg.buffer(), pos, h) if h.is_control else None
                    self.transactions.append(h, marker)

    # ---- opening -----------------------------------------------------------------------
    @classmethod
    def open(
        cls,
        directory: str | Path,
        config: LogConfig | None = None,
        *,
        start_offset: int = 0,
        clock: Clock = time.time,
        verify_all: bool = False,
        flushed: bool = False,
    ) -> PartitionLog:
        """Open (recovering) or create the log in ``directory``.

        ``start_offset`` is the base of the first segment of a new, empty log. ``verify_all``
        checks the CRC of every batch of every segment instead of only the unsealed ones.
        ``flushed``: the log was flushed and closed by a clean shutdown, so what the page
        cache shows of the last segment is on the disk already and recovery does not fsync
        it (one fsync a partition: 10,000 of them bounded an agent's restart).
        """
        config = config or LogConfig()
        directory = Path(directory)
        with storage_errors(f"cannot open log directory {directory}"):
            fileio.fs.make_dirs(directory)
            names = sorted(p.name for p in directory.iterdir())
        quarantined = [n for n in names if n.endswith(QUARANTINE_SUFFIX)]
        if quarantined:
            raise CorruptSegmentError(
                "partition has quarantined segments; repair it from a replica or the object tier",
                path=str(directory / quarantined[0]),
            )
        for n in names:
            if n.endswith(".tmp") or (
                n.endswith(INDEX_SUFFIX) and n[: -len(INDEX_SUFFIX)] + LOG_SUFFIX not in names
            ):
                fileio.fs.unlink(directory / n)
        logs = [
            directory / n
            for n in names
            if n.endswith(LOG_SUFFIX) and n[: -len(LOG_SUFFIX)].isdigit()
        ]
        # A segment's index is written only after an fsync covered the whole sealed segment,
        # and segments are fsynced in order: past the last indexed segment nothing is known to
        # have reached the disk, so a tail can be torn there (see *Recovery*).
        # (The last segment can always tear: reopened as the active one, a sealed segment
        # keeps its old index file until it is sealed again.)
        last_indexed = max(
            (i for i, p in enumerate(logs) if p.with_suffix(INDEX_SUFFIX).name in names),
            default=-1,
        )
        segments: list[Segment] = []
        try:
            for i, path in enumerate(logs):
                seg = Segment.open_existing(path, config.index_interval_bytes)
                segments.append(seg)
                last = i == len(logs) - 1
                tear_ok = last or i > last_indexed
                cut = _recover(
                    seg, last=last, tear_ok=tear_ok, verify_all=verify_all, flushed=flushed
                )
                if i and seg.base_offset != segments[i - 1].next_offset:
                    raise seg.quarantine(
                        StorageError(
                            f"segment starts at {seg.base_offset}, previous ends at {segments[i - 1].next_offset}"
                        ),
                        0,
                    )
                if not last and tear_ok and (cut or int(logs[i + 1].stem) != seg.next_offset):
                    _drop_past_torn_tail(seg, logs[i + 1 :])
                    break
        except BaseException:
            for s in segments:
                s.close()
            raise
        log = cls(directory, config, segments, clock)
        if segments:
            # The age of a recovered active segment counts from this open: producer timestamps
            # say nothing reliable about when a segment was started.
            segments[-1].created_at = clock()
        else:
            log._new_segment(start_offset)
            log.flushed_offset = start_offset
        return log

    # ---- properties --------------------------------------------------------------------
    @property
    def segments(self) -> tuple[Segment, ...]:
        return tuple(self._segments)

    @property
    def active(self) -> Segment:
        return self._segments[-1]

    @property
    def log_start_offset(self) -> int:
        return self._segments[0].base_offset

    @property
    def log_end_offset(self) -> int:
        """The offset the next appended record gets."""
        return self._segments[-1].next_offset

    @property
    def size_bytes(self) -> int:
        return sum(s.size for s in self._segments)

    @property
    def max_timestamp(self) -> int:
        return max(s.max_timestamp for s in self._segments)

    # ---- appending ---------------------------------------------------------------------
    def append(
        self,
        batch: Any,
        *,
        leader_epoch: int,
        deep_check: bool = True,
        checked: BatchHeader | None = None,
        marker: ControlMarker | None = None,
    ) -> AppendInfo:
        """Verify ``batch`` (one whole encoded batch), stamp its offset and epoch, and write it.

        Raises ``CorruptBatchError``, ``UnsupportedVersionError`` or ``BatchTooLargeError`` for
        bad input and ``StorageError`` for disk trouble; in every case the log is unchanged.
        ``deep_check`` also validates the body (offsets, UTF-8, decompression) so that a batch
        with a good CRC but a malformed body can never be stored; a follower copying batches its
        leader already checked may skip it. ``checked`` is the header ``check_batch`` returned
        for exactly these bytes (and at most ``max.message.bytes``), when the caller has just
        verified them: the CRC pass is not repeated. ``marker``: what the control batch
        ``batch`` holds, when the caller encoded it (the transaction marker writer), so it is
        not decoded again. Durability is the caller's business: see ``flush`` and
        ``storage.wal.group_commit``.
        """
        self._check_open()
        if checked is not None and checked.size == len(batch) <= self.config.max_message_bytes:
            h = checked
        elif isinstance(batch, BatchParts):
            raise ValueError("a batch in parts is appended with its checked header")
        else:
            h = check_batch(batch, max_size=self.config.max_message_bytes, deep=deep_check)
        if h.is_control and isinstance(batch, BatchParts):
            # (a marker is read from one buffer: the coordinator writes them whole)
            raise ValueError("a control batch is appended whole, not in parts")
        now = self._clock()
        active = self.active
        if active.size and (
            active.size + h.size > self.config.segment_bytes
            or (now - active.created_at) * 1000 >= self.config.segment_ms
        ):
            active = self.roll()
        if not active.size:
            active.created_at = now  # a segment's age counts from its first batch
        base = active.next_offset
        if isinstance(batch, BatchParts):
            unstamped: list[Any] = list(batch.parts)
            rest = [memoryview(unstamped[0])[16:], *unstamped[1:]]
        else:
            view = memoryview(batch)
            unstamped, rest = [view], [view[16:]]
        if not h.is_control:
            marker = None
        elif marker is None:
            marker = read_marker(unstamped[0], 0, h)
        stamped = dataclasses.replace(h, base_offset=base, leader_epoch=leader_epoch)
        try:
            active.append([STAMP.pack(base, h.batch_length, leader_epoch), *rest], stamped, h.size)
        except StorageError as exc:  # disk full, I/O error: the segment was rolled back
            self._report(exc)
            raise
        if self.journal is not None:
            self.journal.appended(unstamped, base, leader_epoch, h.size)
        if not self.epochs or self.epochs[-1][0] != leader_epoch:
            self.epochs.append((leader_epoch, base))
        self.producers.update(stamped, now)
        if h.is_transactional:
            self.transactions.append(stamped, marker)
        return AppendInfo(base, stamped.last_offset, h.max_timestamp, h.size)

    def roll(self) -> Segment:
        """Seal the active segment (if it holds anything) and start a new one at the log end."""
        self._check_open()
        old = self.active
        if not old.size:
            return old
        old.sealed = True
        old.dirty = True  # its index file is written by the next flush
        if self.config.fsync_policy == FsyncPolicy.ALWAYS and self.journal is None:
            # keep "only the last segment can have a torn tail" true for the strictest policy
            try:
                old.fsync()
            except StorageError as exc:
                raise self._fence(exc, fsync_failed=True) from exc
        return self._new_segment(old.next_offset)

    def _new_segment(self, base: int) -> Segment:
        try:
            seg = Segment.create(self.directory, base, self.config.index_interval_bytes)
        except StorageError as exc:  # the sealed segment stays the last one; a retry rolls again
            self._report(exc)
            raise
        seg.created_at = self._clock()
        self._segments.append(seg)
        self._bases.append(base)
        self.transactions.segment_started(base)
        self._dir_dirty = True
        return seg

    # ---- flushing ----------------------------------------------------------------------
    def prepare_flush(self) -> FlushJob | None:
        """Snapshot what needs an fsync; None if everything is already on disk."""
        self._check_open()
        dirty = [(s, s.size, s.sealed) for s in self._segments if s.dirty]
        if not dirty and not self._dir_dirty:
            self.flushed_offset = self.log_end_offset
            return None
        job = FlushJob(dirty, self.log_end_offset, self._dir_dirty, self.directory)
        for s, _, _ in dirty:
            s.dirty = False
            s.pin()  # a concurrent delete (retention, truncation) leaves the fd open for the job
        self._dir_dirty = False
        return job

    @property
    def needs_flush(self) -> bool:
        """Whether anything (bytes, or a file's name in the directory) awaits an fsync."""
        return self._dir_dirty or any(s.dirty for s in self._segments)

    @property
    def has_unflushed_sealed_segment(self) -> bool:
        return any(s.sealed and s.dirty for s in self._segments)

    def complete_flush(self, job: FlushJob, error: BaseException | None = None) -> None:
        for seg, _, _ in job.segments:
            seg.unpin()
        if error is not None:
            exc = error if isinstance(error, StorageError) else StorageError(str(error))
            raise self._fence(exc, fsync_failed=True) from error
        self.flushed_offset = max(self.flushed_offset, min(job.end_offset, self.log_end_offset))

    def flush(self) -> int:
        """Force everything appended so far to disk; returns ``flushed_offset``."""
        job = self.prepare_flush()
        if job is not None:
            try:
                job.run()
            except BaseException as exc:
                self.complete_flush(job, exc)
            self.complete_flush(job)
        return self.flushed_offset

    # ---- reading -----------------------------------------------------------------------
    def _segment_for(self, offset: int) -> Segment:
        return self._segments[bisect.bisect_right(self._bases, offset) - 1]

    def read(self, offset: int, max_bytes: int, *, max_offset: int | None = None) -> LogSlice:
        """Whole batches from the one holding ``offset``: at least one, then up to ``max_bytes``.

        Only batches that end at or below ``max_offset`` (e.g. the high watermark) are returned.
        Reading at the log end gives an empty slice; outside ``[log_start, log_end]`` raises
        ``OffsetOutOfRangeError``. Reads stop at a segment boundary.
        """
        self._check_open()
        start, end = self.log_start_offset, self.log_end_offset
        if offset < start or offset > end:
            raise OffsetOutOfRangeError(offset, start, end)
        upper = end if max_offset is None else min(end, max_offset)
        if offset >= upper:
            return LogSlice(memoryview(b""), offset, offset, 0)
        seg = self._segment_for(offset)
        found = seg.position_of(offset)
        if found is None:  # pragma: no cover - impossible while the invariants hold
            raise StorageError(f"offset {offset} missing from {seg.path}")
        first, pos = found
        stop, next_offset, count = seg.extent(pos, upper, max_bytes)
        if not count:
            next_offset = first.base_offset
        return LogSlice(seg.view(pos, stop), first.base_offset, next_offset, count)

    def offset_for_timestamp(self, timestamp: int) -> int | None:
        """The first offset whose record timestamp is >= ``timestamp`` (ms), or None."""
        self._check_open()
        for seg in self._segments:
            if seg.max_timestamp < timestamp:
                continue
            for h, pos in seg.walk(seg.index.position_for_timestamp(timestamp)):
                if h.max_timestamp >= timestamp:
                    ts = decode_batch(seg.buffer(), pos, verify=False).column("timestamp")
                    values = ts.cast("int64").to_numpy()
                    return h.base_offset + int(np.argmax(values >= timestamp))
        return None

    # ---- transactions -------------------------------------------------------------------
    def last_stable_offset(self, high_watermark: int) -> int:
        """Where ``read_committed`` reads stop: the first offset of the oldest transaction
        that is open or whose marker is not below ``high_watermark`` (else the watermark)."""
        return max(
            min(self.transactions.last_stable_offset(high_watermark), self.log_end_offset),
            self.log_start_offset,
        )

    def aborted(self, start: int, end: int) -> list[AbortedTxn]:
        """Aborted transactions with batches in ``[start, end)``."""
        return self.transactions.aborted(start, end)

    def _rebuild_transactions(self) -> None:
        txns = TransactionIndex()
        for seg in self._segments:
            txns.segment_started(seg.base_offset)
            for h, pos in seg.walk(0):
                if h.is_transactional:
                    txns.append(h, read_marker(seg.buffer(), pos, h) if h.is_control else None)
        self.transactions = txns

    # ---- leader epochs ------------------------------------------------------------------
    @property
    def latest_epoch(self) -> int:
        """The leader epoch of the last batch in the log (-1: empty log)."""
        return self.epochs[-1][0] if self.epochs else -1

    def end_offset_for_epoch(self, epoch: int) -> tuple[int, int]:
        """(largest epoch <= ``epoch`` in this log, the offset where it ended) — KIP-101.

        The end of an epoch is where the next epoch starts, or the log end for the latest
        epoch. An epoch older than everything here gives (-1, log start offset).
        """
        index = bisect.bisect_right(self.epochs, (epoch, 1 << 62)) - 1
        if index < 0:
            return -1, self.log_start_offset
        found = self.epochs[index][0]
        end = self.epochs[index + 1][1] if index + 1 < len(self.epochs) else self.log_end_offset
        return found, end

    # ---- truncation and deletion --------------------------------------------------------
    def truncate_to(self, offset: int) -> int:
        """Remove every batch holding an offset >= ``offset``; returns the new log end.

        A batch is removed whole, so the new end is the base of the batch holding ``offset``
        (a replica truncates only at batch boundaries, where this is exactly ``offset``).
        """
        self._check_open()
        if offset >= self.log_end_offset:
            return self.log_end_offset
        if offset < self.log_start_offset:
            raise InvalidOffsetError(
                f"cannot truncate to {offset}, below the log start {self.log_start_offset}"
            )
        try:
            while len(self._segments) > 1 and self._segments[-1].base_offset >= offset:
                self._segments.pop().delete()
                self._bases.pop()
                self._dir_dirty = True
            seg = self.active
            found = seg.position_of(offset)
            if found is not None:
                seg.truncate(found[1])
            elif seg.sealed:
                seg.truncate(seg.size)  # cut at its end: it takes appends again, so unseal it
        except StorageError as exc:  # (a truncation ends with an fsync)
            raise self._fence(exc, fsync_failed=True) from exc
        end = self.log_end_offset
        while self.epochs and self.epochs[-1][1] >= end:
            self.epochs.pop()
        self.producers.truncate(end)
        self._rebuild_transactions()
        self.flushed_offset = min(self.flushed_offset, self.log_end_offset)
        if self.journal is not None:
            self.journal.truncated(end)
        return self.log_end_offset

    def delete_segments_before(self, offset: int) -> list[int]:
        """Delete sealed, flushed segments whose records are all below ``offset``; returns their bases."""
        self._check_open()
        deleted = []
        while len(self._segments) > 1:
            seg = self._segments[0]
            if seg.next_offset > offset or seg.dirty or not seg.sealed:
                break
            try:
                seg.delete()
            except StorageError as exc:
                raise self._fence(exc, fsync_failed=False) from exc
            self._segments.pop(0)
            self._bases.pop(0)
            deleted.append(seg.base_offset)
        if deleted:
            self._dir_dirty = True
            self.transactions.drop_segments(deleted)
            # the leader-epoch cache keeps the last epoch that starts at or below the new log
            # start (it covers the first remaining batch) and drops the older ones
            keep = bisect.bisect_right(self.epochs, self.log_start_offset, key=lambda e: e[1]) - 1
            if keep > 0:
                del self.epochs[:keep]
        return deleted

    def restart_at(self, offset: int) -> None:
        """Drop every segment and go on, empty, from ``offset`` (at or past the log end).

        For a follower whose leader's log now starts past this log's end (retention removed
        what it had not copied yet): nothing it holds is wanted any more. The old segments
        go first, then the new one is created; a crash in between leaves an empty
        directory, which opens as an empty log and is restarted again by the next fetch
        (never a gap between segments, which would read as corruption)."""
        self._check_open()
        if offset < self.log_end_offset:
            raise InvalidOffsetError(
                f"cannot restart at {offset}, below the log end {self.log_end_offset}"
            )
        try:
            while self._segments:
                self._segments.pop().delete()
                self._bases.pop()
            self._dir_dirty = True
            seg = Segment.create(self.directory, offset, self.config.index_interval_bytes)
        except StorageError as exc:  # fenced: the log has no segment to answer with
            raise self._fence(exc, fsync_failed=False) from exc
        seg.created_at = self._clock()
        self._segments.append(seg)
        self._bases.append(offset)
        self.epochs.clear()
        self.producers = ProducerStateTable()
        self.transactions = TransactionIndex()  # nothing of the old segments is left
        self.transactions.segment_started(offset)
        self.flushed_offset = offset
        if self.journal is not None:
            self.journal.restarted(offset)

    # ---- closing -----------------------------------------------------------------------
    def close(self) -> None:
        """Flush and release every file; further calls raise ``LogClosedError``."""
        if self._closed:
            return
        try:
            if self._failed is None:
                self.flush()
        finally:
            self._closed = True
            for s in self._segments:
                s.close()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def failed(self) -> bool:
        return self._failed is not None

    def fail(self, exc: StorageError, *, durable_end: int) -> None:
        """Fence the log after a disk error elsewhere (the agent WAL's fsync failed): only
        what is below ``durable_end`` is known to be on disk."""
        if self._failed is None:
            self.durable_end_at_failure = max(durable_end, self.log_start_offset)
            self._fence(exc, fsync_failed=False)

    def _fence(self, exc: StorageError, *, fsync_failed: bool) -> StorageError:
        """Stop the log after a disk error and tell ``on_io_error``; returns the error every
        later call raises. After a failed fsync nothing past ``flushed_offset`` may be trusted,
        even if the page cache still shows it (fsyncgate): ``durable_end_at_failure``."""
        if self._failed is None:
            self._failed = StorageError(
                f"log {self.directory.name} fenced after a disk error: {exc}"
            )
            if fsync_failed:
                self.durable_end_at_failure = self.flushed_offset
            self._report(self._failed)
        return self._failed

    def _report(self, exc: StorageError) -> None:
        if self.on_io_error is not None:
            self.on_io_error(exc)

    def _check_open(self) -> None:
        if self._closed:
            raise LogClosedError(f"log {self.directory} is closed")
        if self._failed is not None:
            raise self._failed

    def __enter__(self) -> PartitionLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _recover(
    seg: Segment, *, last: bool, tear_ok: bool, verify_all: bool, flushed: bool = False
) -> bool:
    """Bring ``seg``'s in-memory state back from disk, cutting a torn tail (allowed where
    ``tear_ok``) or quarantining. Returns whether a torn tail was cut."""
    if not last and not verify_all and seg.index_path.exists():
        with storage_errors(f"cannot read {seg.index_path}"):
            index = SparseIndex.from_bytes(seg.index_path.read_bytes(), seg.size)
        if index is not None:
            try:
                _load_sealed(seg, index)
                return False
            except StrataError:
                pass  # a header past the last index entry is damaged: verify the whole segment
    result = seg.scan(verify=True)
    if result.error is None:
        seg.sealed = not last
        seg.dirty = not last  # a sealed segment without a valid index gets one at the next flush
        if last and not flushed:
            seg.fsync()  # what a killed writer left in the page cache is durable from here on
        return False
    if tear_ok and not result.valid_batch_after_error:
        # torn tail: bytes of an append that never completed (or never reached the disk)
        with storage_errors(f"cannot truncate {seg.path}"):
            fileio.fs.ftruncate(seg.fd, result.valid_size)
            fileio.fs.fsync(seg.fd)
        seg.size = result.valid_size
        seg._map = None
        return True
    raise seg.quarantine(result.error, result.valid_size)


def _drop_past_torn_tail(seg: Segment, later: list[Path]) -> None:
    """``seg`` ends short of the next segment: the log's torn tail spans segments. Under a
    policy that does not fsync at a roll, a power loss can keep the names of segments created
    after ``seg`` (any directory fsync, or the file system's own journal, makes them durable)
    without ``seg``'s unsynced end. Nothing past that end was ever covered by an fsync
    (segments are fsynced in order), so the later segments are removed and ``seg`` is the
    log's active segment again."""
    for path in later:
        for p in (path, path.with_suffix(INDEX_SUFFIX)):
            with storage_errors(f"cannot delete {p}"):
                fileio.fs.unlink(p, missing_ok=True)
    with storage_errors(f"cannot fsync {seg.directory}"):
        fsync_dir(seg.directory)
    _log.warning(
        "%s: torn tail at offset %d (byte %d of %s); removed %d later segment(s) it cut off",
        seg.directory.name,
        seg.next_offset,
        seg.size,
        seg.path.name,
        len(later),
    )
    seg.sealed = seg.dirty = False
    seg.fsync()


def _load_sealed(seg: Segment, index: SparseIndex) -> None:
    """State of a sealed segment from its index plus a header walk of its last stretch."""
    seg.index = index
    seg.sealed = True
    rel, pos = index.last_entry()
    max_ts = index.last_max_before()
    next_offset = seg.base_offset + rel
    end = pos
    for h, p in seg.walk(pos):
        if h.base_offset != next_offset:
            raise CorruptBatchError(
                f"batch at offset {h.base_offset} where {next_offset} was expected", position=p
            )
        max_ts = max(max_ts, h.max_timestamp)
        next_offset = h.next_offset
        end = p + h.size
    if end != seg.size:
        raise CorruptBatchError(f"last batch ends at byte {end} of {seg.size}", position=pos)
    seg.max_timestamp = max_ts
    seg.next_offset = next_offset
