"""Local retention: what leaves each replica's disk, on leaders and followers alike.

Two cases, by whether the agent has an object tier (``s3.bucket``):

* **No tier.** The local log is the whole log, so the topic's own ``retention.ms`` /
  ``retention.bytes`` apply to it, on every replica independently (as in Kafka): sealed
  segments whose newest record is older than ``retention.ms``, or that the log can lose and
  still hold ``retention.bytes``, are deleted, oldest first, and only below the high
  watermark. The leader's log start moves up: a consumer below it gets OFFSET_OUT_OF_RANGE
  and follows ``auto.offset.reset``; a follower that had not copied those records yet
  gets the same answer with the leader's log start and restarts its log there
  (``PartitionLog.restart_at``: nothing it holds is below what the leader still has).
* **With a tier.** A segment may leave the disk once it is committed to the tier (its
  records are then read from S3), by ``local.retention.ms`` / ``local.retention.bytes``
  (KIP-405's names; -2 means the total retention's values). The leader applies it after
  each upload pass (``broker_agents.tiering``); followers here, up to the end of the
  committed manifest, read from ZooKeeper each pass. Before, followers kept their whole log.

Never the active segment, never a segment with unflushed bytes (``delete_segments_before``).
A pass runs every ``log.retention.check.interval.ms`` over the partitions hosted here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING

from storage.errors import StrataError
from storage.wal import PartitionLog

if TYPE_CHECKING:
    from broker_agents.partitions import Partition
    from storage.metadata.models import TopicConfig

log = logging.getLogger(__name__)

CommittedEnd = Callable[["Partition"], Awaitable[int]]
"""The end of what the object tier holds of a partition (the committed manifest's end)."""


def local_limits(cfg: TopicConfig) -> tuple[int, int]:
    """``(ms, bytes)`` of local retention: ``local.retention.*``, -2 meaning the total's."""
    ms = cfg.retention_ms if cfg.local_retention_ms == -2 else cfg.local_retention_ms
    size = cfg.retention_bytes if cfg.local_retention_bytes == -2 else cfg.local_retention_bytes
    return ms, size


def retention_cut(
    plog: PartitionLog, *, retention_ms: int, retention_bytes: int, upto: int, now_ms: float
) -> int | None:
    """The offset to delete segments before (None: nothing to delete), oldest first: every
    sealed, flushed segment wholly below ``upto`` whose newest record is older than
    ``retention_ms``, or without which the log still holds more than ``retention_bytes``
    (-1 or less: no limit of that kind)."""
    size = plog.size_bytes
    cut = None
    for seg in plog.segments[:-1]:
        if seg.next_offset > upto or not seg.sealed or seg.dirty:
            break
        expired = retention_ms >= 0 and seg.max_timestamp < now_ms - retention_ms
        too_big = retention_bytes >= 0 and size > retention_bytes
        if not (expired or too_big):
            break
        cut = seg.next_offset
        size -= seg.size
    return cut


class LocalRetention:
    """The retention pass of one agent (see the module docstring)."""

    def __init__(
        self,
        hosted: Callable[[], Iterable[Partition]],
        interval_s: float,
        committed_end: CommittedEnd | None,
        *,
        clock_ms: Callable[[], float] = lambda: time.time() * 1000,
    ) -> None:
        self.hosted = hosted
        self.interval_s = interval_s
        self.committed_end = committed_end
        self.clock_ms = clock_ms

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.pass_once()

    async def pass_once(self) -> int:
        """One pass over every hosted partition; returns how many segments were deleted."""
        deleted = 0
        for p in list(self.hosted()):
            try:
                deleted += await self.apply(p)
            except (StrataError, OSError) as exc:
                log.warning("local retention of %s-%d failed: %s", p.topic, p.index, exc)
        return deleted

    async def apply(self, p: Partition) -> int:
        cfg = p.config
        if self.committed_end is None:
            ms, limit, upto = cfg.retention_ms, cfg.retention_bytes, p.high_watermark
        elif p.role == "leader":
            return 0  # the uploader's pass applies local retention right after committing
        else:
            ms, limit = local_limits(cfg)
            upto = min(await self.committed_end(p), p.high_watermark)
        plog = p.log
        cut = retention_cut(
            plog, retention_ms=ms, retention_bytes=limit, upto=upto, now_ms=self.clock_ms()
        )
        if cut is None or p.log is not plog:  # (replaced while the manifest was read)
            return 0
        gone = plog.delete_segments_before(cut)
        if gone:
            log.info(
                "%s-%d: local retention deleted %d segment(s) as %s; log start is now %d",
                p.topic,
                p.index,
                len(gone),
                p.role,
                plog.log_start_offset,
            )
        return len(gone)
