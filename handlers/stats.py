"""Publishing a handler's counts to ZooKeeper without a write per invocation.

The delay scheduler and the retry router count what they do (``Stats`` in each) and publish
the counts under their name for the status routes and the metrics. A ZooKeeper write costs
their process about 0.6 ms of CPU, more than routing a record does, and they are invoked many
times a second under load. :class:`ThrottledWrites` writes at most once per interval: a change
inside the interval is written by a timer when the interval ends, so the published counts are
never older than the interval while the handler is busy, and the last change is published
even if no invocation follows it. Writes go one at a time, each taking the counts as of its
turn, so the last one written is the newest.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)

Write = Callable[[], Awaitable[None]]


class ThrottledWrites:
    """Runs ``write()`` at most every ``every`` seconds (see the module docstring)."""

    def __init__(self, every: float, what: str) -> None:
        self.every = every
        self.what = what
        self._at = -every  # monotonic time of the last write's start
        self._timer: asyncio.TimerHandle | None = None
        self._flushing: asyncio.Task[None] | None = None
        #: concurrent invocations write one after another (two first writes racing to create
        #: the node could otherwise leave the older counts last)
        self._lock = asyncio.Lock()

    async def maybe(self, write: Write) -> None:
        """Write now if the interval is over, else make sure a write comes when it is."""
        now = time.monotonic()
        if now - self._at >= self.every:
            await self.now(write)
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(
                self._at + self.every - now, self._later, write
            )

    async def now(self, write: Write) -> None:
        self._at = time.monotonic()
        self.cancel()
        async with self._lock:
            await write()

    def cancel(self) -> None:
        """Drop the write the timer would make (closing)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _later(self, write: Write) -> None:
        self._timer = None
        if self._flushing is None or self._flushing.done():
            self._flushing = asyncio.ensure_future(self.now(write))
            self._flushing.add_done_callback(self._log_failure)

    def _log_failure(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.warning("writing the %s failed: %r", self.what, task.exception())
