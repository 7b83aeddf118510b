"""Frames over a TCP socket: received with one copy, sent with none.

asyncio's streams cost two extra copies per frame on the way in (``StreamReader`` appends what
the transport read to its buffer, ``readexactly`` slices it out again) and one on the way out
(``writelines`` joins the parts before writing). For 1 MiB produce requests and fetch
responses those copies were a fifth of the agent's event loop (py-spy, docs/benchmarks.md).

:class:`FrameStream` (an ``asyncio.BufferedProtocol``) reads size-prefixed frames: small
ones are cut out of a fixed staging buffer (``stage_bytes``; many small frames per ``recv``),
a large one gets a buffer of its own that the kernel fills directly (``recv_into``) after what
the staging buffer already held.
:meth:`FrameStream.send` writes a list of buffers with ``sendmsg`` (scatter-gather, no join);
what the socket does not take at once goes through the transport's buffer. Over TLS
(``tls=True``: an ``asyncio`` SSL transport) everything goes through the transport, which
encrypts it; reading is the same (the SSL transport fills ``get_buffer``'s buffers).

Sizes are checked by ``storage.protocol.frames.read_size`` before anything is read toward a
frame; the end of the stream inside a frame raises ``asyncio.IncompleteReadError`` (as
``readexactly`` does). Deadlines are the callers' (``asyncio.timeout`` around each call).

Memory is taken as bytes arrive, not as sizes are announced. The staging buffer is an
anonymous mapping (its pages are faulted in only as bytes land in them, and given back to the
system when the connection is gone, whatever the C library does with freed heap), and a large
frame's buffer, allocated uncommitted, is filled only as far as the caller's ``grant`` allows:
:meth:`read_body` asks it for room in steps (64 KiB, doubling up to 1 MiB, never more ahead
than what has arrived) and pauses reading while it waits. A peer that announces 64 MiB and
sends nothing holds 64 KiB of the caller's budget, not 64 MiB.
"""

from __future__ import annotations

import asyncio
import mmap
import os
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from storage.protocol.frames import read_size

#: at most this much of a response is queued in the transport at once (see ``send``)
TRANSPORT_CHUNK = 1 << 20
#: most buffers one ``sendmsg`` takes (Linux IOV_MAX)
IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
STAGE_BYTES = 64 << 10
#: room a large frame is granted first, and the most it is granted at a time
FIRST_GRANT = 64 << 10
MAX_GRANT = 1 << 20

Grant = Callable[[int], Awaitable[int]]
"""Asked for room for ``n`` more bytes of a frame; returns how many may be received (> 0)."""


class FrameStream(asyncio.BufferedProtocol):
    """Size-prefixed frames in (straight into their buffers), buffers out (``sendmsg``).

    The protocol side (``get_buffer``/``buffer_updated``, called by the event loop) fills the
    staging buffer, or the buffer of the large frame being read; the coroutine side
    (:meth:`read_size`, :meth:`read_body`) waits for what it needs. While nobody reads and the
    staging buffer is full, reading is paused (TCP backpressure): per connection at most
    ``stage_bytes`` plus the frame being read are held.
    """

    def __init__(
        self,
        sock: socket.socket,
        *,
        max_frame: int,
        stage_bytes: int = STAGE_BYTES,
        size_reader: Callable[[Any, int], int] = read_size,
        tls: bool = False,
    ) -> None:
        self.sock = sock  # the transport's own socket, for sendmsg
        #: over TLS the bytes go through the transport (encrypted), never straight to the socket
        self.tls = tls
        self.max_frame = max_frame
        self.size_reader = size_reader  # the protocol's prefix (Strata: LE, Kafka: BE)
        self.transport: asyncio.Transport | None = None
        self._stage = mmap.mmap(-1, stage_bytes)
        self._view = memoryview(self._stage)
        self._start = 0
        self._end = 0
        self._target: memoryview | None = None  # the large frame being received
        self._filled = 0
        self._limit = 0  # how far into ``_target`` the grant lets the socket write
        self._waiter: asyncio.Future[None] | None = None
        self._paused = False
        self._eof = False
        self._error: BaseException | None = None
        self._writable = asyncio.Event()
        self._writable.set()
        self._awaiting_size = False  # the reader waits in ``read_size`` for a frame's size
        #: called on the protocol side when bytes arrive while the reader waits for a frame's
        #: size: it may take whole small frames itself (``take_frame``), and the reader is
        #: woken only for what is left (see ``take_frame``)
        self.on_frames: Callable[[], None] | None = None

    # ---- protocol side ---------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        # Nagle off. asyncio does this only for sockets whose ``proto`` is IPPROTO_TCP; an
        # accepted socket (``socket.create_server``) reports 0 and would otherwise hold each
        # small answer until the peer's delayed ACK (tens of ms per produce request).
        if self.sock.family in (socket.AF_INET, socket.AF_INET6):
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._target is not None:
            return self._target[self._filled : self._limit]
        if self._end == len(self._stage):
            self._compact()  # not paused, so something was taken from the front
        return self._view[self._end :]

    def _compact(self) -> None:
        """Move the unread bytes of the staging buffer to its front."""
        have = self._end - self._start
        self._view[:have] = self._view[self._start : self._end]
        self._start, self._end = 0, have

    def buffer_updated(self, nbytes: int) -> None:
        if self._target is not None:
            self._filled += nbytes
            if self._filled == len(self._target):
                self._target = None  # complete: the next bytes go to the staging buffer
            elif self._filled == self._limit and not self._paused:
                self._paused = True  # the grant is used up: wait for more room
                assert self.transport is not None
                self.transport.pause_reading()
        else:
            self._end += nbytes
            if self.on_frames is not None and self._reader_waits_for_size():
                self.on_frames()
                if self._start == self._end:
                    self._start = self._end = 0
                    return  # every frame taken: the reader waits on, not woken for nothing
            if self._end == len(self._stage) and not self._start and not self._paused:
                self._paused = True  # full and unread: stop taking bytes off the socket
                assert self.transport is not None
                self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        self._eof = True
        self._wake()
        # half-closed: answers to what was read can still be written (TLS has no half-close)
        return not self.tls

    def connection_lost(self, exc: Exception | None) -> None:
        self._eof = True
        self._error = exc
        self._wake()
        self._writable.set()  # senders fail on the closed transport instead of waiting
        if self.transport is not None:
            # CPython 3.11's selector transport keeps bound methods of itself in its own
            # ``__dict__`` (python/cpython#100348, #106503; fixed in 3.12), a cycle that only
            # the cyclic GC frees: thousands of closed connections stayed in memory until a
            # full collection. The transport is done; drop the cycle so refcounting frees it.
            for name in ("_read_ready_cb", "_write_ready"):
                vars(self.transport).pop(name, None)

    def _reader_waits_for_size(self) -> bool:
        waiter = self._waiter
        return self._awaiting_size and waiter is not None and not waiter.done()

    def take_frame(self, take: Callable[[int, bytes], bool]) -> bool:
        """Protocol side, from ``on_frames`` (the reader is suspended in ``read_size``): hand
        the next frame to ``take(size, frame)`` if it is small and wholly staged, and consume
        it if ``take`` returns True. Otherwise (part of a frame, a large frame, a size the
        reader refuses, or ``take`` declines) nothing is consumed: the reader finds the bytes
        as if this had not been called, and deals with them (waits, errors, budgets)."""
        have = self._end - self._start
        if have < 4:
            return False
        try:
            size = self.size_reader(self._view[self._start : self._start + 4], self.max_frame)
        except Exception:  # the reader raises it in its own time
            return False
        if not self.is_small(size) or have < 4 + size:
            return False
        first = self._start + 4
        if not take(size, bytes(self._view[first : first + size])):
            return False
        self._start = first + size
        return True

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    @property
    def writing_paused(self) -> bool:
        """The transport's send buffer is over its high-water mark (``send`` waits)."""
        return not self._writable.is_set()

    def pause_writing(self) -> None:
        self._writable.clear()

    def resume_writing(self) -> None:
        self._writable.set()

    # ---- coroutine side --------------------------------------------------------------------
    async def send(self, parts: list[Any]) -> int:
        """Write every buffer of ``parts`` in order; returns the bytes sent.

        ``sendmsg`` (scatter-gather, no join) whenever the transport has nothing queued; what
        the kernel does not take goes through the transport's buffer at most
        ``TRANSPORT_CHUNK`` bytes at a time, each time once the buffer has drained below its
        low-water mark. (Handing a whole large response to the transport at once cost a join
        of all of it and then, in Python 3.11's selector transport, a memmove of everything
        still queued after every partial send: quadratic in the response's size; a 54 MB Kafka
        fetch answer spent most of its ~1 s there.) One sender at a time per connection
        (callers that share one hold a lock).
        """
        assert self.transport is not None
        views = [v for v in (memoryview(p).cast("B") for p in parts) if len(v)]
        total = sum(len(v) for v in views)
        i = 0
        while i < len(views):
            if self.transport.is_closing():
                break
            if not self.tls and not self.transport.get_write_buffer_size():
                i = self._send_direct(views, i)
                if i >= len(views):
                    break
            chunk: list[memoryview] = []
            size = 0
            while i < len(views) and size < TRANSPORT_CHUNK:
                v = views[i]
                if size + len(v) > TRANSPORT_CHUNK:
                    cut = TRANSPORT_CHUNK - size
                    chunk.append(v[:cut])
                    views[i] = v[cut:]
                    size += cut
                    break
                chunk.append(v)
                size += len(v)
                i += 1
            self.transport.writelines(chunk)
            await self._writable.wait()
        await self._writable.wait()
        return total

    def send_now(self, parts: list[Any]) -> tuple[int, list[memoryview] | None]:
        """``send`` as far as it goes without waiting: ``(bytes, None)`` when the transport
        took everything and takes more; otherwise ``(bytes, rest)``, and ``send(rest)``
        finishes it (``rest`` may be empty: only the wait for the transport to drain is
        left). On a closing transport nothing is sent (``(bytes, None)``)."""
        assert self.transport is not None
        views = [v for v in (memoryview(p).cast("B") for p in parts) if len(v)]
        total = sum(len(v) for v in views)
        if self.transport.is_closing():
            return total, None
        if not self._writable.is_set():
            return total, views
        if self.tls:
            if total > TRANSPORT_CHUNK:
                return total, views
            self.transport.writelines(views)
            return total, None if self._writable.is_set() else []
        if self.transport.get_write_buffer_size():
            return total, views
        i = self._send_direct(views, 0)
        return total, None if i >= len(views) else views[i:]

    def _send_direct(self, views: list[memoryview], i: int) -> int:
        """``sendmsg`` from ``views[i]`` on while the kernel takes everything offered; returns
        the index of the first buffer not (wholly) sent (``views[i]`` trimmed to its rest)."""
        while i < len(views):
            batch = views[i : i + IOV_MAX]
            try:
                sent = self.sock.sendmsg(batch)
            except (BlockingIOError, InterruptedError):
                return i
            full = sent < sum(len(v) for v in batch)
            while sent:
                if sent >= len(views[i]):
                    sent -= len(views[i])
                    i += 1
                else:
                    views[i] = views[i][sent:]
                    sent = 0
            if full:
                return i  # the kernel took less than offered: its buffer is full
        return i

    async def _wait(self, partial: Any, expected: int) -> None:
        if self._eof:
            if self._error is not None:
                raise ConnectionResetError(str(self._error)) from self._error
            raise asyncio.IncompleteReadError(bytes(partial), expected)
        if self._paused:
            self._paused = False
            assert self.transport is not None
            self.transport.resume_reading()
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    async def _staged(self, need: int) -> None:
        """Wait until the staging buffer holds ``need`` unread bytes (``need`` <= its size)."""
        while self._end - self._start < need:
            if len(self._stage) - self._start < need:
                self._compact()
            await self._wait(self._view[self._start : self._end], need)

    async def read_size(self) -> int:
        """The next frame's size (its 4-byte prefix read and checked against ``max_frame``)."""
        self._awaiting_size = True
        try:
            await self._staged(4)
        finally:
            self._awaiting_size = False
        size = self.size_reader(self._view[self._start : self._start + 4], self.max_frame)
        self._start += 4
        return size

    async def skip_frame(self, size: int, keep: int) -> bytes:
        """Consume the frame whose size prefix ``read_size`` refused (too large): return its
        first ``keep`` bytes (a request header) and drop the rest as it arrives, holding
        none of it beyond the staging buffer."""
        self._start += 4
        head_len = min(size, keep, len(self._stage) // 2)
        await self._staged(head_len)
        head = bytes(self._view[self._start : self._start + head_len])
        remaining = size
        while remaining:
            if self._end == self._start:
                await self._wait(b"", remaining)
                continue
            take = min(self._end - self._start, remaining)
            self._start += take
            remaining -= take
            if self._start == self._end:
                self._start = self._end = 0
        return head

    def is_small(self, size: int) -> bool:
        """A frame this size is cut out of the staging buffer (no buffer of its own)."""
        return size <= len(self._stage) // 2

    async def read_body(self, size: int, grant: Grant | None = None) -> bytes | memoryview:
        """The ``size`` bytes of the frame whose size :meth:`read_size` returned.

        A large frame is received only as far as ``grant`` (if given) has made room for."""
        if self.is_small(size):
            await self._staged(size)
            frame = bytes(self._view[self._start : self._start + size])
            self._start += size
            return frame
        have = min(self._end - self._start, size)
        step = FIRST_GRANT
        limit = size if grant is None else await grant(min(size, max(have, step)))
        # While the grant was awaited, more of this frame may have landed in the staging
        # buffer: it is part of the body (taking ``have`` from before the wait left those
        # bytes behind, to be read as the next frame's size: a desynchronized stream).
        have = min(self._end - self._start, size)
        while limit < have:
            assert grant is not None
            limit += await grant(have - limit)
            have = min(self._end - self._start, size)
        view = np.empty(size, dtype=np.uint8).data  # not zeroed: every byte is received into it
        view[:have] = self._view[self._start : self._start + have]
        self._start += have
        if self._start == self._end:
            self._start = self._end = 0
        self._target, self._filled, self._limit = (
            (view, have, limit) if have < size else (None, have, size)
        )
        try:
            while self._filled < size:
                if self._filled == self._limit:
                    assert grant is not None
                    step = min(step * 2, MAX_GRANT, max(self._filled, FIRST_GRANT))
                    self._limit += await grant(min(step, size - self._limit))
                await self._wait(view[: self._filled], size)
        finally:
            self._target = None
        return view
