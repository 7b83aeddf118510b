"""Free space on the data directory's filesystem, as backpressure before the disk fills.

Segments leave the disk when they are committed to the object tier (local retention) or by
retention; an object tier that is down for longer than the disk can buffer, or a retention too
long for the disk, would otherwise end in ENOSPC in the middle of an append. Produce requests
are refused with the retriable ``LogDirFullError`` while the filesystem has less than
``log.dir.min.free.bytes`` free; producers back off and retry, and writes resume as soon as
uploads (or retention) give space back. The free space is read with ``statvfs`` (through the
``fileio`` seam, so a fault drill's quota counts) at most every
``interval`` seconds (a produce request does not pay a system call); in between, each accepted
request's bytes are taken off the last reading, so a burst of appends within one interval
cannot run past the floor by more than the request that finds it still above.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from storage.errors import LogDirFullError
from storage.wal import fileio


class DiskGuard:
    def __init__(
        self,
        path: Path,
        min_free_bytes: int,
        *,
        interval: float = 0.1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = path
        self.min_free_bytes = min_free_bytes
        self.interval = interval
        self.clock = clock
        self._free = -1
        self._read_at = float("-inf")
        self.refusals = 0

    def free_bytes(self) -> int:
        now = self.clock()
        if now - self._read_at >= self.interval:
            self._free = fileio.fs.free_bytes(self.path)
            self._read_at = now
        return self._free

    def check(self, nbytes: int = 0) -> None:
        """Raise ``LogDirFullError`` while free space is below the floor; else count the
        ``nbytes`` about to be written as taken until the next reading."""
        if self.min_free_bytes <= 0:
            return
        free = self.free_bytes()
        if free < self.min_free_bytes:
            self.refusals += 1
            raise LogDirFullError(
                f"{free} bytes free on {self.path}, below log.dir.min.free.bytes"
                f" ({self.min_free_bytes}); retry later"
            )
        self._free -= max(nbytes, 0)
