"""The agent WAL at run time: one file sequence that makes every partition's appends durable
with one write and one fsync per round, however many partitions the round touches.

Theory of operation
-------------------
* **Append.** A partition log (``PartitionLog``) writes a batch to its own segment as before
  and tells its ``journal`` (a ``WalPartition``, the log's committer). The entry joins the
  round's pending list; a callback scheduled with ``call_soon`` writes every pending entry as
  one frame (``storage.wal.agent.format``) with one ``pwritev`` at the end of the loop turn.
  So the WAL file holds, in the page cache, everything the partition files hold but the
  current turn's appends. (An ``interval`` reply can leave within that turn: a process crash
  then leaves those batches in the partition files only, and replay keeps them.)
* **Durability.** Under ``fsync.policy=always`` a reply waits for an fsync of the WAL that
  started after its frame was written (``wait_durable``); concurrent waiters share one fsync
  (group commit), run in a worker thread while appends go on. Under ``interval`` one
  agent-wide ticker fsyncs every ``fsync.interval.ms``. Partition files are not fsynced on
  the hot path at all (a roll does not fsync either).
* **Checkpoint.** When the WAL holds ``wal.max.bytes`` (or more than the disk has free), or
  every ``wal.checkpoint.interval.ms``,
  a checkpoint starts a new file, notes each hosted partition's log end then (its anchor),
  fsyncs the partition files written since the previous checkpoint (one thread job), writes
  ``checkpoint`` (the anchors and the first file still needed) atomically and deletes the
  older files. The WAL thus holds about one checkpoint's worth of appends.
* **Recovery** is ``storage.wal.agent.replay``: before any partition opens, every entry past
  the checkpoint is applied to the partition logs, which are then fsynced; the WAL starts
  empty.
* **Disk errors.** A failed WAL fsync fences the WAL: every partition with entries it did
  not cover is fenced (``PartitionLog.fail``) at the offset the WAL had made durable, and
  later appends fail with ``StorageError``; the agent closes the partitions and opens them
  again, on a new WAL file, once ``reopen`` has run.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from storage.config import FsyncPolicy
from storage.errors import StorageError
from storage.wal import fileio
from storage.wal.agent.format import (
    ENTRY,
    MAX_ENTRIES,
    MAX_NAMES,
    Kind,
    encode_frame,
    file_name,
    name_entry,
    parse_name,
)
from storage.wal.fileio import fsync_dir, storage_errors, write_file_atomically
from storage.wal.flusher import flusher
from storage.wal.group_commit import observe_fsync
from storage.wal.log import AppendInfo, PartitionLog

_log = logging.getLogger(__name__)

CHECKPOINT = "checkpoint"
#: the WAL's directory under a data directory (no "-<n>" suffix: never a partition's)
WAL_DIRECTORY = "wal"
#: iovecs per pwritev (Linux's IOV_MAX)
_IOV_MAX = 1024


@dataclass(frozen=True, slots=True, kw_only=True)
class AgentWalConfig:
    #: a new file is started once the current one holds this many bytes
    segment_bytes: int = 64 << 20
    #: a checkpoint starts when the WAL's files hold this many bytes (the WAL's size cap is
    #: about this plus what arrives while the checkpoint runs)
    max_bytes: int = 256 << 20
    #: and at least this often while anything was appended
    checkpoint_interval_ms: int = 30_000
    #: the ``interval`` policy's agent-wide fsync period
    fsync_interval_ms: int = 50


class WalPartition:
    """One partition's committer on the agent WAL (the ``GroupCommitLog`` interface), and
    the ``journal`` its ``PartitionLog`` reports appends, truncations and restarts to."""

    def __init__(self, wal: AgentWal, log: PartitionLog, dirname: str, topic_id: str) -> None:
        self.wal = wal
        self.log = log
        self.policy = log.config.fsync_policy
        self.dirname = dirname
        self.topic_id = topic_id
        self.pid = 0
        #: every record below this is in the WAL and fsynced
        self.durable = log.log_end_offset
        self.fsyncs = 0

    # ---- the journal side (called by PartitionLog) -------------------------------------
    def appended(
        self, batch: Sequence[Any], base_offset: int, leader_epoch: int, size: int
    ) -> None:
        """``batch``: the buffers that hold the batch appended, side by side (unstamped)."""
        self.wal.add(self, Kind.DATA, base_offset, leader_epoch, batch, size)

    def truncated(self, end: int) -> None:
        self.wal.add(self, Kind.TRUNCATE, end)
        self.durable = min(self.durable, end)

    def restarted(self, offset: int) -> None:
        self.wal.add(self, Kind.RESTART, offset)
        self.durable = offset

    # ---- the committer side ------------------------------------------------------------
    async def start(self) -> None:
        return None

    async def append(self, batch: Any, *, leader_epoch: int) -> AppendInfo:
        info = self.log.append(batch, leader_epoch=leader_epoch)
        await self.wait_acknowledgeable(info.last_offset + 1)
        return info

    def acknowledgeable(self, offset: int) -> bool:
        return self.policy != FsyncPolicy.ALWAYS or self.durable >= offset

    async def wait_acknowledgeable(self, offset: int) -> None:
        if self.policy == FsyncPolicy.ALWAYS:
            await self.wait_durable(offset)

    async def wait_durable(self, offset: int) -> None:
        await self.wal.wait_durable(self, offset)

    async def flush(self) -> None:
        """Fsync the partition's own files and write the indexes of its sealed segments
        (the object tier uploads only those)."""
        job = self.log.prepare_flush()
        if job is None:
            return
        error: BaseException | None = None
        try:
            await asyncio.to_thread(job.run)
        except BaseException as exc:
            error = exc
        self.log.complete_flush(job, error)

    async def close(self) -> None:
        self.wal.unregister(self)
        with contextlib.suppress(StorageError):  # fenced: the owner heard of it
            await self.flush()
        self.log.journal = None
        self.log.close()


class AgentWal:
    def __init__(
        self,
        directory: Path,
        config: AgentWalConfig | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        free_bytes: Callable[[], int] | None = None,
    ) -> None:
        self.directory = directory
        self.config = config or AgentWalConfig()
        #: free space on the data directory's file system (a checkpoint gives back the WAL's
        #: bytes: it runs early when the WAL holds more than what is free)
        self._free_bytes = free_bytes
        self._clock = clock
        self._fronts: dict[int, WalPartition] = {}
        self._next_pid = 1
        self._seq = 0
        self._fd = -1
        self._file_size = 0
        #: sizes of the files still on disk, by sequence (the current one included)
        self._files: dict[int, int] = {}
        self._retired_fds: list[int] = []
        # the round being gathered (written at the end of the loop turn)
        self._table: list[bytes] = []
        self._names: list[bytes] = []
        self._payloads: list[Any] = []
        self._payload_len = 0
        self._names_len = 0
        self._pending_ends: dict[WalPartition, int] = {}
        self._write_scheduled = False
        self._named: set[int] = set()  # pids named in the current file
        #: written, not yet covered by an fsync: partition -> its log end then
        self._unsynced: dict[WalPartition, int] = {}
        #: partitions appended to since the last checkpoint started
        self._touched: set[WalPartition] = set()
        self._syncing: asyncio.Task[None] | None = None
        self._checkpointing: asyncio.Task[None] | None = None
        self._last_checkpoint = clock()
        self._failed: StorageError | None = None
        self.fsyncs = 0
        self.checkpoints = 0
        self.bytes_written = 0

    # ---- lifecycle ---------------------------------------------------------------------
    def open(self) -> None:
        """Start a new file after the ones on disk (which ``replay`` has applied already)."""
        with storage_errors(f"cannot open the agent WAL in {self.directory}"):
            fileio.fs.make_dirs(self.directory)
            found = [parse_name(p.name) for p in self.directory.iterdir()]
        seqs = [f[0] for f in found if f is not None]
        self._seq = max(seqs, default=0)
        self._new_file_now()

    def _new_file_now(self) -> None:
        self._seq += 1
        path = self.directory / file_name(self._seq)
        with storage_errors(f"cannot create {path}"):
            self._fd = fileio.fs.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            fsync_dir(self.directory)
        self._file_size = 0
        self._files[self._seq] = 0
        self._named.clear()

    async def run(self) -> None:
        """The agent-wide ticker: ``interval`` fsyncs and checkpoints (a named task)."""
        period = self.config.fsync_interval_ms / 1000
        try:
            while True:
                await asyncio.sleep(period)
                if self._failed is not None:
                    continue
                if self._unsynced or self._table:
                    with contextlib.suppress(StorageError):
                        await self.sync()
                self._maybe_checkpoint()
        finally:
            if self._checkpointing is not None:
                self._checkpointing.cancel()
                with contextlib.suppress(BaseException):
                    await self._checkpointing

    async def close(self) -> bool:
        """After every partition closed (each flushed its files): nothing in the WAL is needed
        any more, so a graceful restart replays nothing. Whether it was removed so (not after
        a failure, nor with a partition still open)."""
        clean = False
        if self._checkpointing is not None:
            with contextlib.suppress(BaseException):
                await self._checkpointing
        if self._syncing is not None:
            with contextlib.suppress(StorageError):
                await asyncio.shield(self._syncing)
        if self._fd >= 0:
            if self._failed is None and not self._fronts:
                self._write_pending()
                await asyncio.to_thread(self._remove_all)
                clean = True
            for fd in (self._fd, *self._retired_fds):
                with contextlib.suppress(OSError):
                    os.close(fd)
            self._fd = -1
            self._retired_fds.clear()
        return clean

    def _remove_all(self) -> None:
        for p in self.directory.iterdir():
            if parse_name(p.name) is not None:
                fileio.fs.unlink(p, missing_ok=True)
        fileio.fs.unlink(self.directory / CHECKPOINT, missing_ok=True)
        fsync_dir(self.directory)
        self._files.clear()

    # ---- partitions ----------------------------------------------------------------------
    async def register(self, log: PartitionLog, topic_id: str = "") -> WalPartition:
        """The committer of ``log``: from now on its appends go through this WAL.

        The OPEN entry says the log's files hold its end on disk; a new log (or one whose
        directory changed) is fsynced first so that it is true, names included."""
        if log.needs_flush:
            await asyncio.to_thread(log.flush)
        self.reopen()
        self._check()
        front = WalPartition(self, log, log.directory.name, topic_id)
        front.pid = self._next_pid
        self._next_pid += 1
        self._fronts[front.pid] = front
        log.journal = front
        # OPEN: what the log holds now is on disk (opening it fsynced its tail)
        self.add(front, Kind.OPEN, log.log_end_offset)
        return front

    def unregister(self, front: WalPartition) -> None:
        self._fronts.pop(front.pid, None)

    # ---- appending -----------------------------------------------------------------------
    def add(
        self,
        front: WalPartition,
        kind: Kind,
        offset: int,
        epoch: int = 0,
        batch: Sequence[Any] = (),
        size: int = 0,
    ) -> None:
        if self._failed is not None:
            return  # every partition was fenced with it: its log refuses appends
        if front.pid not in self._named:
            entry, blob = name_entry(front.pid, front.dirname, front.topic_id)
            self._table.append(entry)
            self._names.append(blob)
            self._names_len += len(blob)
            self._named.add(front.pid)
        self._table.append(ENTRY.pack(kind, front.pid, epoch, offset, size))
        if batch:  # one batch, as the buffers that hold it side by side
            self._payloads.extend(batch)
            self._payload_len += size
        self._pending_ends[front] = front.log.log_end_offset
        if len(self._table) >= MAX_ENTRIES - 1 or self._names_len >= MAX_NAMES - (64 << 10):
            self._write_pending()  # a frame a reader takes (its bounds), written in order
        elif not self._write_scheduled:
            self._write_scheduled = True
            asyncio.get_running_loop().call_soon(self._write_pending)

    def _write_pending(self) -> None:
        """Write the round gathered so far as one frame (on the event loop: a page-cache
        write, like the partition logs' own appends)."""
        self._write_scheduled = False
        if not self._table or self._failed is not None:
            return
        parts = encode_frame(self._table, self._names, self._payloads, self._payload_len)
        ends = self._pending_ends
        self._table, self._names, self._payloads = [], [], []
        self._payload_len = self._names_len = 0
        self._pending_ends = {}
        size = 0
        try:
            for i in range(0, len(parts), _IOV_MAX):
                size += fileio.fs.pwrite(self._fd, parts[i : i + _IOV_MAX], self._file_size + size)
        except OSError as exc:
            self._fail(fileio.storage_error(f"write to the agent WAL {self._seq} failed", exc))
            return
        self._file_size += size
        self._files[self._seq] = self._file_size
        self.bytes_written += size
        self._unsynced.update(ends)
        self._touched.update(ends)

    # ---- durability ----------------------------------------------------------------------
    async def wait_durable(self, front: WalPartition, offset: int) -> None:
        while front.durable < offset:
            if self._failed is not None:
                raise self._failed
            if offset > front.log.log_end_offset:
                raise StorageError(
                    f"records below {offset} were truncated away before they reached the disk"
                )
            await self.sync()

    async def sync(self) -> None:
        """Wait for one fsync that starts after this call (joining one that has not started
        yet, or the next one after a running one)."""
        task = self._syncing
        if task is not None:
            await asyncio.shield(task)
            task = self._syncing
        if task is None:
            task = self._syncing = asyncio.create_task(self._sync(), name="agent-wal-fsync")
        await asyncio.shield(task)

    async def _sync(self) -> None:
        try:
            self._write_pending()
            covered, self._unsynced = self._unsynced, {}
            fds = [self._fd, *self._retired_fds]
            retired = len(self._retired_fds)
            started = time.perf_counter()
            try:
                await flusher.fsync(_fsync_order(fds))
            except OSError as exc:
                raise self._fail(
                    fileio.storage_error("fsync of the agent WAL failed", exc)
                ) from exc
            finally:
                observe_fsync(time.perf_counter() - started)
            self.fsyncs += 1
            for fd in self._retired_fds[:retired]:
                with contextlib.suppress(OSError):
                    os.close(fd)
            del self._retired_fds[:retired]
            for front, end in covered.items():
                if end > front.durable:
                    front.durable = end
                front.fsyncs += 1
            if self._file_size >= self.config.segment_bytes:
                self._rotate()
        finally:
            self._syncing = None

    def _rotate(self) -> None:
        """Start a new file; the old fd is fsynced by the next ``sync`` and then closed."""
        self._write_pending()
        old = self._fd
        self._new_file_now()
        self._retired_fds.append(old)

    # ---- checkpoints -----------------------------------------------------------------------
    def _maybe_checkpoint(self) -> None:
        if self._checkpointing is not None or self._failed is not None or not self._touched:
            return
        size = sum(self._files.values())
        due = (self._clock() - self._last_checkpoint) * 1000 >= self.config.checkpoint_interval_ms
        short = self._free_bytes is not None and size > self._free_bytes()
        if size >= self.config.max_bytes or due or short:
            self._checkpointing = asyncio.create_task(
                self.checkpoint(), name="agent-wal-checkpoint"
            )
            self._checkpointing.add_done_callback(self._checkpoint_done)

    def _checkpoint_done(self, task: asyncio.Task[None]) -> None:
        self._checkpointing = None
        if not task.cancelled() and task.exception() is not None:
            _log.error("agent WAL checkpoint failed: %s", task.exception())

    async def checkpoint(self) -> None:
        """Make the partition files hold everything the WAL's current files hold, then drop
        those files (see the module docstring)."""
        self._last_checkpoint = self._clock()
        self._rotate()
        first = self._seq
        anchors = {
            f.dirname: [f.topic_id, f.log.log_end_offset]
            for f in self._fronts.values()
            if not f.log.closed
        }
        touched, self._touched = self._touched, set()
        await self.sync()  # the old files are on disk whole
        jobs = []
        for front in touched:
            if front.log.closed or front.log.failed:
                continue
            job = front.log.prepare_flush()
            if job is not None:
                jobs.append((front, job))
        errors = await asyncio.to_thread(_run_jobs, [job for _, job in jobs])
        for (front, job), error in zip(jobs, errors, strict=True):
            with contextlib.suppress(StorageError):  # the log is fenced and its owner told
                front.log.complete_flush(job, error)
        if any(error is not None for error in errors):
            raise StorageError("a partition's fsync failed during the checkpoint; WAL kept")
        doc = json.dumps({"first_file": first, "anchors": anchors}).encode()
        await asyncio.to_thread(self._commit_checkpoint, doc, first)
        for s in [s for s in self._files if s < first]:
            self._files.pop(s, None)
        self.checkpoints += 1

    def _commit_checkpoint(self, doc: bytes, first: int) -> None:
        write_file_atomically(self.directory / CHECKPOINT, doc)
        fsync_dir(self.directory)
        for p in self.directory.iterdir():
            parsed = parse_name(p.name)
            if parsed is not None and parsed[0] < first:
                fileio.fs.unlink(p, missing_ok=True)
        fsync_dir(self.directory)

    @property
    def size_bytes(self) -> int:
        return sum(self._files.values())

    # ---- failure -------------------------------------------------------------------------
    def _fail(self, exc: StorageError) -> StorageError:
        """Fence the WAL: nothing unsynced can be trusted (fsyncgate). Every partition on it is
        fenced at the offset the WAL made durable for it."""
        if self._failed is None:
            self._failed = exc
            _log.error("agent WAL fenced: %s", exc)
            for front in list(self._fronts.values()):
                front.log.fail(exc, durable_end=front.durable)
        return self._failed

    def reopen(self) -> None:
        """After a failure, once every fenced partition is closed: go on in a new file (the
        failed one stays for replay; what it holds past each partition's durable end was
        never acknowledged)."""
        if self._failed is None or self._fronts:
            return
        self._failed = None
        self._table, self._names, self._payloads = [], [], []
        self._payload_len = self._names_len = 0
        self._pending_ends = {}
        self._unsynced.clear()
        # the failed file is closed (never fsynced again: fsyncgate) and renamed, so replay
        # knows its tail may be torn while the files after it hold acknowledged records
        for fd in (self._fd, *self._retired_fds):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._retired_fds.clear()
        self._files.pop(self._seq, None)
        with storage_errors("cannot set the failed agent WAL file aside"):
            fileio.fs.replace(
                self.directory / file_name(self._seq),
                self.directory / file_name(self._seq, failed=True),
            )
        self._new_file_now()

    def _check(self) -> None:
        if self._failed is not None:
            raise self._failed
        if self._fd < 0:
            raise StorageError("the agent WAL is not open")


def _fsync_order(fds: list[int]) -> list[int]:
    """The current file's fd first in ``fds``: fsynced last, so older files are whole on
    disk before anything of a newer one is known to be (replay relies on it)."""
    return [*fds[1:], fds[0]]


def _run_jobs(jobs: list[Any]) -> list[BaseException | None]:
    errors: list[BaseException | None] = []
    for job in jobs:
        try:
            job.run()
        except BaseException as exc:
            errors.append(exc)
        else:
            errors.append(None)
    return errors
