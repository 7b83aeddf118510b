"""The agent's TCP server: frames in, handlers run, responses out in request order.

Per connection, a reader task takes frames off the socket (``storage.protocol.sockio``: the
body of a large frame is received straight into its own buffer; a size over
``max_frame_bytes`` or a negative size closes the connection, since the stream can no longer
be trusted) and starts one handler task per request, in order. A writer task
awaits those tasks in the same order and writes each response, so responses match request
order whatever finishes first (pipelining), while slow requests (a long poll, an fsync wait)
do not hold up the reading of the next ones. At most ``max_in_flight`` requests per connection
are in progress, and at most ``max_queued_bytes`` of request frames over all connections
(read, not yet handled); beyond either the reader stops reading (TCP backpressure), so the
agent's memory does not grow with the number of producers pushing at it.

A request whose header parses but whose API is unknown or whose body does not parse gets an
error response (``UNSUPPORTED_VERSION`` / ``INVALID_REQUEST``) and the connection stays open.

Idle connections: a watchdog task per connection aborts it when a read (the next frame's size,
or the rest of a frame) or a write (a client that takes no answer) has waited longer than
``idle_timeout``. One sleeping task per connection instead of a timer armed and cancelled
around every read and write: that was a measurable part of an agent's CPU per request.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import socket
import time
from typing import Any, Protocol

from storage.errors import MalformedFrameError, StrataError, UnsupportedVersionError
from storage.protocol import (
    decode_request_body,
    encode_error_response,
    encode_response,
    parse_request,
)
from storage.protocol.messages import ApiKey
from storage.protocol.sockio import FrameStream

log = logging.getLogger(__name__)

_NO_RESPONSE = object()


class _Activity:
    """When the connection's pending read and write started waiting (None: not waiting)."""

    __slots__ = ("reading", "writable", "writing")

    def __init__(self) -> None:
        self.reading: float | None = None
        self.writing: float | None = None
        self.writable = True  # False once the client was cut off for not reading


class ServerObserver(Protocol):
    """What the server reports (``broker_agents.metrics`` implements it)."""

    def request_done(self, api_key: int, seconds: float, failed: bool) -> None: ...
    def bytes_in(self, n: int) -> None: ...
    def bytes_out(self, n: int) -> None: ...


class ByteBudget:
    """Bytes shared by every connection's reader, granted first come, first served."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0
        self.peak = 0
        self._waiters: collections.deque[tuple[int, asyncio.Future[None]]] = collections.deque()

    async def acquire(self, n: int) -> int:
        """Take ``n`` bytes (at most the capacity, so one huge frame cannot wait forever),
        waiting while they are spent; returns what was taken, for ``release``."""
        n = min(n, self.capacity)
        if not self._waiters and self.used + n <= self.capacity:
            self._take(n)
            return n
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append((n, fut))
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release(n)  # granted as we were cancelled: give it back
            raise
        return n

    def release(self, n: int) -> None:
        self.used -= n
        while self._waiters:
            m, fut = self._waiters[0]
            if fut.done():  # its acquirer was cancelled
                self._waiters.popleft()
                continue
            if self.used + m > self.capacity:
                break
            self._waiters.popleft()
            self._take(m)
            fut.set_result(None)

    def _take(self, n: int) -> None:
        self.used += n
        self.peak = max(self.peak, self.used)


class AgentServer:
    def __init__(
        self,
        apis: Any,
        *,
        max_frame_bytes: int,
        max_in_flight: int = 64,
        max_queued_bytes: int = 256 << 20,
        idle_timeout: float = 600.0,
    ) -> None:
        self.apis = apis
        self.budget = ByteBudget(max_queued_bytes)
        self.max_frame_bytes = max_frame_bytes
        self.max_in_flight = max_in_flight
        self.idle_timeout = idle_timeout
        self.listener: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self.connections: set[asyncio.Task[None]] = set()
        self.observer: ServerObserver | None = None

    async def start(self, host: str, port: int) -> tuple[str, int]:
        listener = socket.create_server((host, port), backlog=512)
        listener.setblocking(False)
        self.listener = listener
        self._accepting = asyncio.create_task(self._accept(listener), name="agent-accept")
        address = listener.getsockname()
        return address[0], address[1]

    async def stop(self) -> None:
        if self._accepting is not None:
            self._accepting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._accepting
            self._accepting = None
        if self.listener is not None:
            self.listener.close()
            self.listener = None
        for t in list(self.connections):
            t.cancel()
        await asyncio.gather(*self.connections, return_exceptions=True)

    async def _accept(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, peer = await loop.sock_accept(listener)
            except OSError as exc:  # out of file descriptors and the like: retry shortly
                log.warning("accept failed: %s", exc)
                await asyncio.sleep(0.1)
                continue
            stream = FrameStream(sock, max_frame=self.max_frame_bytes)
            try:
                await loop.connect_accepted_socket(lambda: stream, sock)  # noqa: B023 (called at once)
            except OSError as exc:
                log.warning("connection from %s lost at once: %s", peer, exc)
                sock.close()
                continue
            task = asyncio.create_task(self._on_connection(stream, peer), name=f"conn:{peer}")
            self.connections.add(task)
            task.add_done_callback(self.connections.discard)

    async def _on_connection(self, stream: FrameStream, peer: Any) -> None:
        queue: asyncio.Queue[asyncio.Future[Any] | None] = asyncio.Queue(self.max_in_flight)
        activity = _Activity()
        writer_task = asyncio.create_task(
            self._write_responses(queue, stream, activity), name=f"conn-writer:{peer}"
        )
        watchdog = asyncio.create_task(
            self._watch_idle(stream, peer, activity), name=f"conn-idle:{peer}"
        )
        try:
            await self._read_requests(stream, queue, activity)
        except (MalformedFrameError, UnsupportedVersionError) as exc:
            log.warning("closing connection from %s: %s", peer, exc)
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError):
            pass
        finally:
            watchdog.cancel()
            with contextlib.suppress(asyncio.QueueFull):
                queue.put_nowait(None)
            if queue.full():
                writer_task.cancel()
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await writer_task
            assert stream.transport is not None
            stream.transport.close()

    async def _watch_idle(self, stream: FrameStream, peer: Any, activity: _Activity) -> None:
        """Abort the connection once a read or a write has waited over ``idle_timeout``."""
        loop = asyncio.get_running_loop()
        assert stream.transport is not None
        while True:
            await asyncio.sleep(self.idle_timeout / 4)
            too_old = loop.time() - self.idle_timeout
            if activity.writing is not None and activity.writing < too_old:
                log.warning(
                    "closing connection from %s: it read no response for %.0f s",
                    peer,
                    self.idle_timeout,
                )
                activity.writable = False  # the writer drains its queue without writing
                stream.transport.abort()
                return
            if activity.reading is not None and activity.reading < too_old:
                activity.writable = False
                stream.transport.abort()  # the reader sees the end of the stream
                return

    async def _read_requests(
        self, frames: FrameStream, queue: asyncio.Queue[Any], activity: _Activity
    ) -> None:
        loop = asyncio.get_running_loop()
        while True:
            activity.reading = loop.time()
            size = await frames.read_size()
            activity.reading = None
            held = await self.budget.acquire(size)
            try:
                activity.reading = loop.time()
                frame = await frames.read_body(size)
                activity.reading = None
                if self.observer is not None:
                    self.observer.bytes_in(4 + size)
                request = parse_request(frame)
            except BaseException:
                self.budget.release(held)
                raise
            del frame
            handler = asyncio.ensure_future(self._handle(request))
            # released when the handler is done, even if cancelled before it ever ran
            handler.add_done_callback(functools.partial(self._release, held))
            await queue.put(handler)

    def _release(self, held: int, _handler: asyncio.Future[Any]) -> None:
        self.budget.release(held)

    async def _handle(self, request: Any) -> Any:
        if self.observer is None:
            return await self._dispatch(request)
        started = time.perf_counter()
        failed = True
        try:
            result = await self._dispatch(request)
            failed = False
            return result
        finally:
            self.observer.request_done(request.api_key, time.perf_counter() - started, failed)

    async def _dispatch(self, request: Any) -> Any:
        try:
            body = decode_request_body(request)
        except StrataError as exc:
            return encode_error_response(request.correlation_id, exc.code, str(exc))
        handler = self.apis.handlers.get(request.api_key)
        if handler is None:
            return encode_error_response(
                request.correlation_id,
                UnsupportedVersionError.code,
                f"API {request.api_key} is not served here",
            )
        try:
            response = await handler(body)
        except StrataError as exc:
            return encode_error_response(request.correlation_id, exc.code, str(exc))
        except Exception as exc:  # a bug: answer and keep serving the others
            log.exception("handler for API %s failed", request.api_key)
            return encode_error_response(
                request.correlation_id, StrataError.code, f"internal error: {exc!r}"
            )
        if request.api_key == ApiKey.PRODUCE and body.acks == 0:  # type: ignore[attr-defined]
            return _NO_RESPONSE
        return encode_response(request.correlation_id, response)

    async def _write_responses(
        self, queue: asyncio.Queue[Any], stream: FrameStream, activity: _Activity
    ) -> None:
        """Write each answer in request order. A client that takes none of an answer for
        ``idle_timeout`` is disconnected (by ``_watch_idle``); the queue is still drained, so
        the reader, which then sees the connection closed, is never left waiting for room in
        it."""
        loop = asyncio.get_running_loop()
        while (fut := await queue.get()) is not None:
            parts = await fut
            if parts is _NO_RESPONSE or not activity.writable:
                continue
            activity.writing = loop.time()
            try:
                sent = await stream.send(parts)
            except OSError:  # ConnectionError included: the client is gone
                activity.writable = False
                continue
            finally:
                activity.writing = None
            if not activity.writable:
                continue  # cut off while this answer waited
            if self.observer is not None:
                self.observer.bytes_out(sent)
