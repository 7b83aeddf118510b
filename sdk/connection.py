"""One TCP connection to an agent: pipelined requests matched by correlation id.

Requests are written whole (``storage.protocol.sockio.FrameStream.send``: one ``sendmsg`` of
the parts ``storage.protocol.encode_request`` returns, so record batches are not copied)
without waiting for earlier answers; at most ``max.in.flight.requests.per.connection`` are
outstanding (a semaphore). One reader task reads size-prefixed response frames (straight into
their buffers) and hands each to the waiting request by correlation id.

Deadlines and failures:

* every request has a deadline (``request.timeout.ms`` unless the caller gives a longer one,
  as a long-polling fetch does); when it passes the request raises ``RequestTimedOutError``
  and the connection is closed, as Kafka clients do — a peer that does not answer in time
  cannot be trusted to answer in order;
* a refused, reset or closed connection, and a response stream that does not parse, fail every
  outstanding request with ``NetworkError`` (retriable) or the protocol error, and close the
  connection; the owner (``sdk.cluster``) opens a new one on the next request;
* a response whose header carries an error raises the typed error (``ResponseFrame.error``);
* a produce request with ``acks=0`` expects no response and completes once written.

The reader is a long-lived loop; it is started through the owner's ``spawn`` so that it lives
under the client's supervisor (``asyncio.TaskGroup``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import socket
import ssl
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from storage.errors import (
    MalformedFrameError,
    NetworkError,
    RequestTimedOutError,
    SslAuthenticationError,
    StrataError,
)
from storage.protocol import APIS, DEFAULT_MAX_FRAME, encode_request, parse_response
from storage.protocol.schema import Message
from storage.protocol.sockio import FrameStream

Spawn = Callable[[Coroutine[Any, Any, None], str], "asyncio.Task[None]"]
Send = Callable[[Message], Awaitable[Any]]
Login = Callable[[Send], Awaitable[None]]
"""Authenticates a new connection with the requests it sends through ``Send``."""

_API_KEY: dict[type[Message], int] = {api.request: int(api.key) for api in APIS.values()}
_RESPONSE: dict[int, type[Message]] = {int(api.key): api.response for api in APIS.values()}


def _default_spawn(coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
    return asyncio.get_running_loop().create_task(coro, name=name)


def _discard(fut: asyncio.Future[Any]) -> None:
    """Settle a future nobody will await without leaving an error to be logged as "never
    retrieved" when it is collected (the caller gets the error raised instead)."""
    if not fut.done():
        fut.cancel()
    elif not fut.cancelled():
        fut.exception()


class Connection:
    """A connection to ``host:port``; ``await connect()`` then ``await request(body)``."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        client_id: str | None = None,
        request_timeout_ms: float = 30_000,
        connect_timeout_ms: float = 10_000,
        max_in_flight: int = 5,
        max_frame: int = DEFAULT_MAX_FRAME,
        spawn: Spawn | None = None,
        clock: Callable[[], float] = time.monotonic,
        ssl_context: ssl.SSLContext | None = None,
        login: Login | None = None,
    ) -> None:
        self.host = host
        #: SASL: run on each new connection before any other request (``sdk.auth``)
        self.login = login
        self._ready = False
        #: TLS (``security.protocol`` SSL or SASL_SSL): the server is verified with this
        self.ssl_context = ssl_context
        self.port = port
        self.client_id = client_id
        self.request_timeout = request_timeout_ms / 1000
        self.connect_timeout = connect_timeout_ms / 1000
        self.max_frame = max_frame
        self._spawn = spawn or _default_spawn
        self._clock = clock
        self._sem = asyncio.Semaphore(max_in_flight)
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._stream: FrameStream | None = None
        self._write_lock = asyncio.Lock()
        self._read_task: asyncio.Task[None] | None = None
        self._connect_lock = asyncio.Lock()
        self._closed: StrataError | None = None
        self._requests = 0
        self.last_used = clock()

    def __repr__(self) -> str:
        return f"<Connection {self.host}:{self.port} {'closed' if self.closed else 'open'}>"

    @property
    def closed(self) -> bool:
        return self._closed is not None

    @property
    def connected(self) -> bool:
        return self._ready and self._closed is None

    @property
    def in_flight(self) -> int:
        """Requests written or waiting to be written and not yet answered."""
        return self._requests

    def idle_for(self, now: float) -> float:
        return 0.0 if self._requests else now - self.last_used

    def _closed_error(self) -> NetworkError:
        err = NetworkError(f"connection to {self.host}:{self.port} is closed: {self._closed}")
        err.__cause__ = self._closed
        return err

    async def connect(self) -> None:
        if self._ready and self._closed is None:
            return
        async with self._connect_lock:
            if self._closed is not None:
                raise self._closed_error()
            if self._ready:
                return
            try:
                async with asyncio.timeout(self.connect_timeout):
                    stream = await _open(self.host, self.port, self.max_frame, self.ssl_context)
            except ssl.SSLError as exc:  # not retriable: the same certificates fail the same way
                ssl_err = SslAuthenticationError(
                    f"TLS handshake with {self.host}:{self.port} failed: {exc}"
                )
                self._closed = ssl_err
                raise ssl_err from None
            except TimeoutError:
                err = NetworkError(
                    f"connecting to {self.host}:{self.port} timed out after "
                    f"{self.connect_timeout * 1000:.0f} ms"
                )
                self._closed = err
                raise err from None
            except OSError as exc:
                err = NetworkError(f"cannot connect to {self.host}:{self.port}: {exc}")
                self._closed = err
                raise err from None
            self._stream = stream
            self._read_task = self._spawn(
                self._read_loop(stream),
                f"strata-conn-read-{self.host}:{self.port}",
            )
            if self.login is not None:
                try:
                    await self.login(self._send)
                except StrataError as exc:
                    self._fail(exc)
                    raise
            self._ready = True
            self.last_used = self._clock()

    async def _send(self, body: Message) -> Any:
        """One request on a connection that is not ready yet (the login's)."""
        api_key = _API_KEY[type(body)]
        try:
            async with asyncio.timeout(self.request_timeout):
                frame = await self._exchange(api_key, body, True)
        except TimeoutError:
            raise RequestTimedOutError(
                f"{type(body).__name__} to {self.host}:{self.port} got no response"
            ) from None
        error = frame.error()
        if error is not None:
            raise error
        return _RESPONSE[api_key].decode(frame.body)

    async def request(
        self,
        body: Message,
        *,
        request_timeout: float | None = None,
        expect_response: bool = True,
        on_sent: Callable[[], None] | None = None,
    ) -> Any:
        """Send ``body`` and return the decoded response body (None if none is expected).

        ``request_timeout`` (seconds, default ``request.timeout.ms``) covers waiting for a free
        in-flight slot, writing and the answer. ``on_sent`` is called once the whole request
        has been handed to the socket.
        """
        api_key = _API_KEY[type(body)]
        limit = self.request_timeout if request_timeout is None else request_timeout
        await self.connect()
        self._requests += 1
        try:
            async with asyncio.timeout(limit):
                async with self._sem:
                    frame = await self._exchange(api_key, body, expect_response, on_sent)
        except TimeoutError:
            exc = RequestTimedOutError(
                f"{type(body).__name__} to {self.host}:{self.port} got no response within "
                f"{limit * 1000:.0f} ms"
            )
            self._fail(exc)
            raise exc from None
        finally:
            self._requests -= 1
            self.last_used = self._clock()
        if frame is None:
            return None
        error = frame.error()
        if error is not None:
            raise error
        return _RESPONSE[api_key].decode(frame.body)

    async def _exchange(
        self,
        api_key: int,
        body: Message,
        expect_response: bool,
        on_sent: Callable[[], None] | None = None,
    ) -> Any:
        if self._closed is not None:
            raise self._closed_error()
        stream = self._stream
        assert stream is not None
        correlation_id = next(self._ids) & 0x7FFFFFFF
        parts = encode_request(api_key, correlation_id, self.client_id, body)
        fut: asyncio.Future[Any] | None = None
        if expect_response:
            fut = asyncio.get_running_loop().create_future()
            self._pending[correlation_id] = fut
        try:
            await self._write(stream, parts)
        except BaseException:
            if fut is not None:  # this request's own answer: nobody will await it now
                self._pending.pop(correlation_id, None)
                _discard(fut)
            raise
        if on_sent is not None:
            on_sent()
        if fut is None:
            return None
        try:
            return await fut
        finally:
            self._pending.pop(correlation_id, None)

    async def _write(self, stream: FrameStream, parts: list[Any]) -> None:
        try:
            async with self._write_lock:  # one request's parts at a time on the socket
                if self._closed is not None:
                    raise self._closed_error()
                try:
                    await stream.send(parts)
                except asyncio.CancelledError:  # part of a frame may be out: the stream is lost
                    self._fail(NetworkError(f"a request to {self.host}:{self.port} was cancelled"))
                    raise
        except OSError as exc:
            self._fail(NetworkError(f"writing to {self.host}:{self.port} failed: {exc}"))
            raise self._closed_error() from None

    async def _read_loop(self, frames: FrameStream) -> None:
        error: StrataError | None = None
        try:
            while True:
                frame = parse_response(await frames.read_body(await frames.read_size()))
                fut = self._pending.pop(frame.correlation_id, None)
                if fut is not None and not fut.done():
                    fut.set_result(frame)
        except asyncio.IncompleteReadError as exc:
            error = NetworkError(
                f"{self.host}:{self.port} closed the connection"
                + (f" inside a frame ({len(exc.partial)} bytes read)" if exc.partial else "")
            )
        except OSError as exc:
            if isinstance(exc, ssl.SSLError) or isinstance(exc.__cause__, ssl.SSLError):
                # TLS 1.3: the server refuses our certificate after our side of the handshake
                error = SslAuthenticationError(f"{self.host}:{self.port} refused TLS: {exc}")
            else:
                error = NetworkError(f"reading from {self.host}:{self.port} failed: {exc}")
        except MalformedFrameError as exc:
            error = exc
        finally:
            self._fail(error or NetworkError(f"connection to {self.host}:{self.port} closed"))

    def _fail(self, exc: StrataError) -> None:
        """Close the connection and fail every outstanding request with ``exc``."""
        if self._closed is None:
            self._closed = exc
        pending, self._pending = self._pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(exc)
        task = self._read_task
        if task is not None and task is not asyncio.current_task() and not task.done():
            task.cancel()
        if self._stream is not None and self._stream.transport is not None:
            if self._stream.tls:
                # no close_notify exchange: it would outlive a client whose loop ends now
                self._stream.transport.abort()
            else:
                self._stream.transport.close()  # closes the socket

    async def close(self) -> None:
        self._fail(NetworkError(f"connection to {self.host}:{self.port} was closed by the client"))
        task = self._read_task
        if task is not None and task is not asyncio.current_task():
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


async def _open(
    host: str, port: int, max_frame: int, ssl_context: ssl.SSLContext | None = None
) -> FrameStream:
    """A frame stream over a TCP connection to the first address of ``host`` that accepts
    (over TLS with ``ssl_context``: the handshake done, the server's certificate verified)."""
    loop = asyncio.get_running_loop()
    try:  # a numeric address needs no lookup (and no resolver thread), as in asyncio
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICHOST)
    except socket.gaierror:
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    error: OSError = OSError(f"no address for {host}")
    for family, kind, proto, _, address in infos:
        sock = socket.socket(family, kind, proto)
        try:
            sock.setblocking(False)
            await loop.sock_connect(sock, address)
            stream = FrameStream(sock, max_frame=max_frame, tls=ssl_context is not None)
            if ssl_context is None:
                await loop.create_connection(lambda: stream, sock=sock)  # noqa: B023
                return stream
            # TLS in two steps: start_tls closes the TCP transport itself if the handshake fails
            raw, _ = await loop.create_connection(asyncio.Protocol, sock=sock)
            tls = await loop.start_tls(raw, stream, ssl_context, server_hostname=host)
            assert tls is not None
            stream.connection_made(tls)  # start_tls does not call it
            return stream
        except ssl.SSLError:
            sock.close()
            raise
        except OSError as exc:
            sock.close()
            error = exc
        except BaseException:
            sock.close()
            raise
    raise error
