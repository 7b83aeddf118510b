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

**Plain fsyncs skip the thread** (``Flusher.fsync``): where the kernel has asynchronous fsync
(Linux AIO's ``IOCB_CMD_FSYNC``, through ``caio``), the loop submits it and goes on, the
kernel runs it in a worker of its own and signals an eventfd the loop watches, and the
completion is handled in the loop itself. Even with one thread and rounds, a thread's fsync
needed the GIL twice (to start the call, and to hand the result back) from a loop that holds
it whenever it has work: measured at acks=all, RF 3, ``always``, 1,000 msgs/s on two cores,
each fsync waited 0.9 ms (median) to start and 0.7 ms to be seen by the loop, around 0.4 ms
of disk. The kernel path cut the agents' CPU by 11% and the end-to-end p99 by 22-25%
(docs/benchmarks.md, "End-to-end latency"). A flush that does more than fsync files (writing
a sealed segment's index, fsyncing a directory) still goes to the thread, as does every fsync
when ``fileio.fs`` is not the plain file system (tests and fault drills record or fail fsyncs
there) or the kernel has no asynchronous fsync (not Linux, Linux before 4.18, no ``caio``).
In-flight kernel fsyncs are bounded by the context's depth (``_AIO_DEPTH``); past it, callers
wait for a slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import logging
import os
import queue
import re
import threading
from collections.abc import Callable, Sequence
from typing import Any

from storage.wal import fileio

log = logging.getLogger(__name__)

#: kernel fsyncs in flight per event loop at most (the AIO context's depth)
_AIO_DEPTH = 128

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
        #: fsyncs done through the kernel's asynchronous I/O, not the thread
        self.kernel_fsyncs = 0

    async def fsync(self, fds: Sequence[int]) -> None:
        """fsync each of ``fds`` in turn, each done before the next starts (the agent WAL
        relies on the order); raises ``OSError``. Through the kernel's asynchronous fsync where
        there is one, otherwise in the thread (see the module doc)."""
        ctx = _kernel_aio() if type(fileio.fs) is fileio.FileSystem else None
        if ctx is None:
            await self.run(functools.partial(_fsync_each, fds))
            return
        for fd in fds:
            try:
                await ctx.fsync(fd)
            except (SystemError, ValueError) as exc:  # caio's: failed, or refused at submission
                code = _errno_of(exc)
                raise OSError(code, os.strerror(code)) from exc
            self.kernel_fsyncs += 1

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


#: caio reports a failed fsync with only ``strerror``'s text (SystemError) and a refused one
#: with its errno's name in brackets (ValueError, e.g. "... [EBADF]"): the errno back from those
_ERRNO_BY_TEXT = {os.strerror(code): code for code in errno.errorcode}
_ERRNO_NAME = re.compile(r"\[(E[A-Z0-9]+)\]\s*$")


def _errno_of(exc: Exception) -> int:
    """The errno of caio's exception, as ``os.fsync`` would have raised it (EIO if unknown)."""
    text = str(exc)
    named = _ERRNO_NAME.search(text)
    if named is not None:
        return int(getattr(errno, named.group(1), errno.EIO))
    return _ERRNO_BY_TEXT.get(text.strip(), errno.EIO)


def _fsync_each(fds: Sequence[int]) -> None:
    for fd in fds:
        fileio.fs.fsync(fd)


#: each event loop's kernel AIO context (``caio``), made on its first fsync
_contexts: dict[asyncio.AbstractEventLoop, Any] = {}
_no_kernel_aio = False


def _kernel_aio() -> Any | None:
    """The running loop's AIO context; None where the kernel has no asynchronous fsync."""
    global _no_kernel_aio
    if _no_kernel_aio:
        return None
    loop = asyncio.get_running_loop()
    ctx = _contexts.get(loop)
    if ctx is not None:
        return ctx
    try:
        from caio import linux_aio_asyncio  # (None where caio could not load its Linux AIO)

        if linux_aio_asyncio is None:
            raise ImportError("caio has no Linux AIO on this system")
        ctx = linux_aio_asyncio.AsyncioContext(  # type: ignore[no-untyped-call]
            max_requests=_AIO_DEPTH, loop=loop
        )
    except (ImportError, OSError, SystemError) as exc:
        _no_kernel_aio = True
        log.warning("no asynchronous fsync in this kernel (%s): fsyncs run in a thread", exc)
        return None
    for closed in [other for other in _contexts if other.is_closed()]:
        del _contexts[closed]  # (its context closes its eventfd and AIO context when freed)
    _contexts[loop] = ctx
    return ctx


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
