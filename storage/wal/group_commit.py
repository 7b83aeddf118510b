"""Group commit: the asyncio front of a ``PartitionLog`` that applies its fsync policy.

With ``fsync.policy=always`` every ``append`` returns only once an fsync covers it, but appends
do not each pay for an fsync. While one fsync runs (in the kernel, or in the fsync thread: ``storage.wal.flusher``;
either way the event loop keeps accepting appends), the appends that arrive meanwhile queue behind it;
when it completes, one new fsync covers all of them. Under load the number of fsyncs per second stays near
``1 / fsync latency`` while the bytes per fsync grow: that is the whole trick.

With ``interval`` a named background task flushes every ``fsync.interval.ms``; with ``never``
the same task only flushes once a segment has been sealed (fsyncing it and writing its index
file) and otherwise leaves write-back to the OS. Either way ``append`` returns as soon as the
bytes are in the page cache.

An fsync failure fences the log (see ``PartitionLog.complete_flush``): every waiter and every
later append gets ``StorageError``, the ticker stops, and ``close`` releases the files
without trying again.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

from storage.config import FsyncPolicy
from storage.errors import StorageError
from storage.wal.fileio import storage_error
from storage.wal.flusher import flusher
from storage.wal.log import AppendInfo, PartitionLog

_fsync_observer: Callable[[float], None] | None = None


def set_fsync_observer(observer: Callable[[float], None] | None) -> None:
    """Call ``observer(seconds)`` after every fsync of every log in this process (metrics)."""
    global _fsync_observer
    _fsync_observer = observer


def observe_fsync(seconds: float) -> None:
    """Report one fsync's duration to the observer (the agent WAL's fsyncs count too)."""
    if _fsync_observer is not None:
        _fsync_observer(seconds)


class GroupCommitLog:
    def __init__(self, log: PartitionLog) -> None:
        self.log = log
        self.policy = log.config.fsync_policy
        self._flushing: asyncio.Task[None] | None = None
        self._ticker: asyncio.Task[None] | None = None
        self.fsyncs = 0

    async def start(self) -> None:
        if self.policy != FsyncPolicy.ALWAYS and self._ticker is None:
            self._ticker = asyncio.create_task(
                self._tick(), name=f"fsync-ticker:{self.log.directory.name}"
            )

    async def append(self, batch: Any, *, leader_epoch: int) -> AppendInfo:
        """Append and, under ``always``, wait until the batch is on disk."""
        info = self.log.append(batch, leader_epoch=leader_epoch)
        await self.wait_acknowledgeable(info.last_offset + 1)
        return info

    def acknowledgeable(self, offset: int) -> bool:
        """Whether records below ``offset`` may be acknowledged now, without waiting."""
        return self.policy != FsyncPolicy.ALWAYS or self.log.flushed_offset >= offset

    async def wait_acknowledgeable(self, offset: int) -> None:
        """Wait as the policy requires before records below ``offset`` are acknowledged: an
        fsync covering them under ``always``; nothing otherwise (they are in the page cache)."""
        if self.policy == FsyncPolicy.ALWAYS:
            await self.wait_durable(offset)

    async def wait_durable(self, offset: int) -> None:
        """Return once every record below ``offset`` is fsynced (starting fsyncs as needed)."""
        while self.log.flushed_offset < offset:
            if offset > self.log.log_end_offset:
                raise StorageError(
                    f"records below {offset} were truncated away before they reached the disk"
                )
            task = self._flushing
            if task is None:
                task = self._flushing = asyncio.create_task(self._flush(), name="fsync")
            await asyncio.shield(task)

    async def flush(self) -> None:
        """Fsync everything appended so far and write the index of every sealed segment."""
        await self.wait_durable(self.log.log_end_offset)
        while self.log.has_unflushed_sealed_segment:
            task = self._flushing
            if task is None:
                task = self._flushing = asyncio.create_task(self._flush(), name="fsync")
            await asyncio.shield(task)

    async def _flush(self) -> None:
        try:
            job = self.log.prepare_flush()
            if job is None:
                return
            error: BaseException | None = None
            started = time.perf_counter()
            try:
                if job.fsyncs_only:
                    await flusher.fsync([seg.fd for seg, _, _ in job.segments])
                else:
                    await flusher.run(job.run)
            except OSError as exc:
                error = storage_error(f"fsync of {self.log.directory} failed", exc)
            except BaseException as exc:
                error = exc
            if _fsync_observer is not None:
                _fsync_observer(time.perf_counter() - started)
            self.fsyncs += 1
            self.log.complete_flush(job, error)
        finally:
            self._flushing = None

    async def _tick(self) -> None:
        interval = self.log.config.fsync_interval_ms / 1000
        try:
            while True:
                await asyncio.sleep(interval)
                if self.policy == FsyncPolicy.INTERVAL:
                    if self.log.flushed_offset < self.log.log_end_offset:
                        await self.flush()
                elif self.log.has_unflushed_sealed_segment:
                    await self.flush()
        except StorageError:
            return  # the log is fenced; its owner heard of it (``PartitionLog.on_io_error``)

    async def close(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker
            self._ticker = None
        if self._flushing is not None:
            with contextlib.suppress(StorageError):  # a failed fsync fenced the log: no retry
                await asyncio.shield(self._flushing)
        self.log.close()
