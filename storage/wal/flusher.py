"""The fsync thread: one per process, running the group commits' fsyncs off the event loop.

An fsync must not run on the event loop (it blocks for as long as the disk takes, and every
connection with it), so it runs in a thread. ``asyncio.to_thread`` did that through the
default executor: a ``concurrent.futures`` future, its condition variable, a pool of up to
``min(32, cores + 4)`` threads (six here) running fsyncs at once (one per partition that
happened to need one) and a wake-up of the loop for each. Measured with a no-op fsync under
acks=all at RF 3 (three agents on two cores, 1,000 msgs/s), that machinery alone cost each
agent about 110 µs of CPU and 0.5 ms of latency per fsync, more than the disk's own time,
and the thread switches it takes grow worse the busier the cores are (docs/benchmarks.md,
"End-to-end latency").

This thread does less per fsync and shares what it does: it sleeps on a ``SimpleQueue``;
woken, it takes every job queued by then, runs them one after another (the disk's journal
would order them anyway) and wakes each loop once for all of its jobs. An fsync that arrives
while others run waits for the next round, as a group commit's appends wait for the next
fsync. Only the hot path goes through it (``GroupCommitLog`` and the agent WAL's round
fsyncs); bulk work (checkpoints, truncations, directory removals) stays in the default
executor, so that it never holds up an acknowledgement.

The queue needs no bound of its own: a group commit has at most one fsync in flight, and so
does the agent WAL, so it never holds more than one job per open log. One fsync that hangs
(a failing disk) holds up the others behind it; they are on the same data directory, whose
disk would hold them up as well.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import Callable
from typing import Any

_Job = tuple[Callable[[], Any], asyncio.Future[Any], asyncio.AbstractEventLoop]


class Flusher:
    """Runs blocking calls (fsyncs) in one daemon thread, in rounds (see the module doc)."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        #: rounds run and jobs run (the round count is what the loop was woken for)
        self.rounds = 0
        self.jobs = 0

    async def run(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` in the fsync thread; its result, or its exception raised here. Cancelling
        the caller does not stop ``fn`` (an fsync cannot be taken back): it still runs."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        self._start()
        self._queue.put((fn, fut, loop))
        return await fut

    def _start(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._main, name="fsync", daemon=True)
                self._thread.start()

    def _main(self) -> None:
        while True:
            jobs = [self._queue.get()]
            with contextlib.suppress(queue.Empty):
                while True:
                    jobs.append(self._queue.get_nowait())
            done: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future[Any], Any, Any]]]
            done = {}
            for fn, fut, loop in jobs:
                result: Any = None
                error: BaseException | None = None
                try:
                    result = fn()
                except BaseException as exc:  # handed to the awaiting coroutine
                    error = exc
                done.setdefault(loop, []).append((fut, result, error))
            self.rounds += 1
            self.jobs += len(jobs)
            for loop, settled in done.items():
                with contextlib.suppress(RuntimeError):  # that loop is closed: nobody waits
                    loop.call_soon_threadsafe(_settle, settled)


def _settle(settled: list[tuple[asyncio.Future[Any], Any, BaseException | None]]) -> None:
    for fut, result, error in settled:
        if fut.done():  # the caller was cancelled
            continue
        if error is None:
            fut.set_result(result)
        else:
            fut.set_exception(error)


#: the process's fsync thread
flusher = Flusher()
