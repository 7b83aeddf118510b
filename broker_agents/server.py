"""The agent's TCP server: frames in, handlers run, responses out in request order.

Per connection, a reader task takes frames off the socket (``storage.protocol.sockio``: the
body of a large frame is received straight into its own buffer; a size over
``max_frame_bytes`` or a negative size closes the connection, since the stream can no longer
be trusted) and starts one handler task per request, in order. Whole small frames that
arrive while the reader waits for the next one are taken on the protocol side, as the reader
would take them, without waking it (a loop turn less per request). Answers go out in request
order whatever finishes first (pipelining, ``_Answers``): the handler whose answer is the
oldest writes it, and those behind it that are ready, in its own step; slow requests (a long
poll, an fsync wait) do not hold up the reading of the next ones. At most ``max_in_flight``
requests per connection are in progress; beyond it the reader stops reading (TCP
backpressure).

Request memory is bounded without letting a few slow or hostile peers starve the rest
(``ByteBudget``):

* bytes are charged as they arrive, not as a frame's size announces them: a large frame is
  received into its buffer only as far as the budget has granted room (``FrameStream``'s
  ``grant``: 64 KiB first, then doubling up to 1 MiB, never more ahead than what arrived);
* ``max_queued_bytes`` over all connections (Kafka's ``queued.max.request.bytes``), and a
  quarter of it per connection, so one connection cannot hold the whole budget;
* small frames (control requests: replica and consumer fetches, metadata, heartbeats, offset
  commits) never queue behind large ones: past the shared budget they draw on a reserve of
  their own (``small_reserve``), so replication keeps flowing while producers wait;
* once a frame has started, the rest of it must arrive within ``frame_timeout``; a peer that
  announces a frame and stalls (slowloris) is disconnected and its bytes released.

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
import logging
import socket
import ssl
import time
from collections.abc import Callable
from typing import Any, Protocol

from broker_agents.security.authenticator import Authenticator, Session
from broker_agents.security.guard import current_principal
from broker_agents.security.quotas import Quotas, Throttled, throttle
from storage.errors import (
    FrameTooLargeError,
    IllegalSaslStateError,
    MalformedFrameError,
    StrataError,
    UnsupportedSaslMechanismError,
    UnsupportedVersionError,
)
from storage.protocol import (
    decode_request_body,
    encode_error_response,
    encode_response,
    parse_request,
    read_size,
)
from storage.protocol.messages import (
    ApiKey,
    SaslAuthenticateResponse,
    SaslHandshakeRequest,
    SaslHandshakeResponse,
)
from storage.protocol.sockio import FrameStream

log = logging.getLogger(__name__)

_NO_RESPONSE = object()


class _CloseAfter:
    """An answer after which the connection is closed (a failed or out-of-order login)."""

    __slots__ = ("parts",)

    def __init__(self, parts: Any) -> None:
        self.parts = parts


class _Activity:
    """When the connection's pending read and write started waiting (None: not waiting)."""

    __slots__ = ("frame", "muted_until", "reading", "session", "writable", "writing")

    def __init__(self) -> None:
        self.session: Session | None = None
        self.muted_until = 0.0  # a quota: no request is read before then (loop time)
        self.reading: float | None = None
        self.frame: float | None = None  # since when the peer has been sending a frame
        self.writing: float | None = None
        self.writable = True  # False once the client was cut off for not reading


class WireCodec(Protocol):
    """One protocol's sans-IO side of a listener: the size prefix, request parsing and
    dispatch to the request core. The server does the framing, budgets and ordering."""

    #: whether a frame over the size limit is skipped and answered (else: connection closed)
    answers_oversize: bool

    #: what a connection that must authenticate may send before it has
    pre_auth_apis: frozenset[int]

    def read_size(self, prefix: Any, max_frame: int) -> int: ...
    def parse(self, frame: Any) -> Any: ...  # a request with an ``api_key``
    # response parts, or None: no response
    async def handle(self, request: Any, session: Session | None) -> Any: ...
    def too_large(self, head: bytes, size: int) -> list[Any]: ...
    def refuse(self, request: Any, exc: StrataError) -> Any: ...  # an error response


class NativeCodec:
    """Strata's own protocol (``storage.protocol``) in front of ``apis.handlers``."""

    answers_oversize = False
    pre_auth_apis: frozenset[int] = frozenset(
        {ApiKey.API_VERSIONS, ApiKey.SASL_HANDSHAKE, ApiKey.SASL_AUTHENTICATE}
    )

    def __init__(
        self, apis: Any, auth: Authenticator | None = None, quotas: Quotas | None = None
    ) -> None:
        self.apis = apis
        self.auth = auth
        self.quotas = quotas

    def refuse(self, request: Any, exc: StrataError) -> Any:
        return encode_error_response(request.correlation_id, exc.code, str(exc))

    async def _sasl(self, body: Any, session: Session | None) -> Any:
        if self.auth is None or session is None:
            raise UnsupportedSaslMechanismError("this listener does not use SASL")
        if isinstance(body, SaslHandshakeRequest):
            return SaslHandshakeResponse(0, self.auth.handshake(session, body.mechanism))
        answer = await self.auth.authenticate(session, body.auth_bytes)
        return SaslAuthenticateResponse(0, None, answer, 0)

    def read_size(self, prefix: Any, max_frame: int) -> int:
        return read_size(prefix, max_frame)

    def parse(self, frame: Any) -> Any:
        return parse_request(frame)

    def too_large(self, head: bytes, size: int) -> list[Any]:
        raise NotImplementedError  # the connection is closed instead

    async def handle(self, request: Any, session: Session | None = None) -> Any:
        try:
            body = decode_request_body(request)
        except StrataError as exc:
            return encode_error_response(request.correlation_id, exc.code, str(exc))
        if request.api_key in (ApiKey.SASL_HANDSHAKE, ApiKey.SASL_AUTHENTICATE):
            try:
                return encode_response(request.correlation_id, await self._sasl(body, session))
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
        cid = request.correlation_id
        if request.api_key == ApiKey.PRODUCE and body.acks == 0:  # type: ignore[attr-defined]
            response = None  # no answer, but the quota counts it and may mute the connection
        if self.quotas is None or not self.quotas.active:  # the common path: no call more
            return _NO_RESPONSE if response is None else encode_response(cid, response)
        answer = throttle(
            self.quotas,
            request.api_key,
            body,
            len(request.body),
            response,
            lambda r: encode_response(cid, r),
            _set_throttle,
        )
        return _NO_RESPONSE if answer is None else answer


def _set_throttle(response: Any, ms: int) -> bool:
    """Produce's and Fetch's answers say how long they were held."""
    if hasattr(response, "throttle_time_ms"):
        response.throttle_time_ms = ms
        return True
    return False


class ServerObserver(Protocol):
    """What the server reports (``broker_agents.metrics`` implements it)."""

    def request_done(self, api_key: int, seconds: float, failed: bool) -> None: ...
    def bytes_in(self, n: int) -> None: ...
    def bytes_out(self, n: int) -> None: ...


class ByteBudget:
    """Bytes shared by readers, granted first come, first served.

    Small requests (``acquire(n, small=True)``) have a queue of their own and may go past the
    capacity by up to ``reserve`` bytes: they never wait behind a large request, and they
    wait only when the reserve is spent too."""

    def __init__(self, capacity: int, *, reserve: int = 0) -> None:
        self.capacity = capacity
        self.reserve = reserve
        self.used = 0
        self.peak = 0
        self._waiters: collections.deque[tuple[int, asyncio.Future[None]]] = collections.deque()
        self._small: collections.deque[tuple[int, asyncio.Future[None]]] = collections.deque()

    async def acquire(self, n: int, *, small: bool = False) -> int:
        """Take ``n`` bytes (at most the capacity, so one huge frame cannot wait forever),
        waiting while they are spent; returns what was taken, for ``release``."""
        taken = self.try_take(n, small=small)
        if taken is not None:
            return taken
        n = min(n, self.capacity)
        queue = self._small if small else self._waiters
        fut = asyncio.get_running_loop().create_future()
        queue.append((n, fut))
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release(n)  # granted as we were cancelled: give it back
            raise
        return n

    def try_take(self, n: int, *, small: bool = False) -> int | None:
        """``acquire`` if it would not wait: the bytes taken, or None (nothing taken)."""
        n = min(n, self.capacity)
        if small:
            limit, queue = self.capacity + self.reserve, self._small
        else:
            limit, queue = self.capacity, self._waiters
        if queue or self.used + n > limit:
            return None
        self._take(n)
        return n

    def release(self, n: int) -> None:
        self.used -= n
        self._grant(self._small, self.capacity + self.reserve)
        self._grant(self._waiters, self.capacity)

    def _grant(
        self, queue: collections.deque[tuple[int, asyncio.Future[None]]], limit: int
    ) -> None:
        while queue:
            m, fut = queue[0]
            if fut.done():  # its acquirer was cancelled
                queue.popleft()
                continue
            if self.used + m > limit:
                break
            queue.popleft()
            self._take(m)
            fut.set_result(None)

    def _take(self, n: int) -> None:
        self.used += n
        self.peak = max(self.peak, self.used)


class _Charge:
    """What one connection holds of the shared budget and of its own, and how it asks for
    more (``FrameStream.read_body``'s ``grant``)."""

    __slots__ = ("held", "own", "shared")

    def __init__(self, shared: ByteBudget, own: ByteBudget) -> None:
        self.shared = shared
        self.own = own
        self.held = 0  # of the frame being read

    async def grant(self, n: int) -> int:
        # one frame is charged at most the connection's cap (so a frame that big can finish)
        want = min(n, self.own.capacity - self.held)
        if want <= 0:
            return n
        own = await self.own.acquire(want)
        try:
            await self.shared.acquire(own)
        except BaseException:
            self.own.release(own)
            raise
        self.held += own
        return n

    async def small(self, n: int) -> int:
        own = await self.own.acquire(n, small=True)
        try:
            await self.shared.acquire(own, small=True)
        except BaseException:
            self.own.release(own)
            raise
        self.held += own
        return own

    def try_small(self, n: int) -> int | None:
        """``small`` without waiting: the bytes held for the frame, or None (nothing held)."""
        own = self.own.try_take(n, small=True)
        if own is None:
            return None
        if self.shared.try_take(own, small=True) is None:
            self.own.release(own)
            return None
        return own

    def take_frame(self) -> int:
        """What the frame just read holds (handed to its handler, released when it ends)."""
        held, self.held = self.held, 0
        return held

    def release(self, n: int) -> None:
        self.shared.release(n)
        self.own.release(n)


_PENDING = object()


class _Slot:
    """One request in flight: its answer once its handler is done, what its frame holds of
    the budgets until then, and its handler task (kept referenced here while it runs)."""

    __slots__ = ("answer", "held", "task")

    def __init__(self, held: int) -> None:
        self.answer: Any = _PENDING
        self.held = held
        self.task: asyncio.Future[None] | None = None


class _Answers:
    """A connection's requests in flight, answered in request order (pipelining).

    A handler that finishes puts its answer in its slot and, when that slot is the oldest,
    writes it, and the ready answers behind it, in its own step: no writer task to wake, so
    an answer leaves in the loop turn its handler ended in. A send the socket does not take
    at once goes on in a task of its own, and the answers behind it wait for it."""

    def __init__(
        self,
        stream: FrameStream,
        activity: _Activity,
        charge: _Charge,
        capacity: int,
        observer: ServerObserver | None,
    ) -> None:
        self.stream = stream
        self.activity = activity
        self.charge = charge
        self.capacity = capacity
        self.observer = observer
        self.slots: collections.deque[_Slot] = collections.deque()
        self._sending: asyncio.Task[None] | None = None
        self._room: asyncio.Future[None] | None = None  # the reader, waiting for room
        self._idle: asyncio.Future[None] | None = None  # the close, waiting for the last

    def full(self) -> bool:
        return len(self.slots) >= self.capacity

    async def room(self) -> None:
        """Wait until fewer than ``capacity`` requests are in flight (TCP backpressure)."""
        while self.full():
            self._room = asyncio.get_running_loop().create_future()
            try:
                await self._room
            finally:
                self._room = None

    def add(self, held: int) -> _Slot:
        slot = _Slot(held)
        self.slots.append(slot)
        return slot

    def done(self, slot: _Slot, answer: Any) -> None:
        slot.answer = answer
        if slot.held:
            self.charge.release(slot.held)
            slot.held = 0
        self.pump()

    def pump(self) -> None:
        while self._sending is None and self.slots and self.slots[0].answer is not _PENDING:
            answer = self.slots.popleft().answer
            if self._room is not None and not self._room.done():
                self._room.set_result(None)
            self._write(answer)
        if self._idle is not None and not self._idle.done() and not self.busy:
            self._idle.set_result(None)

    @property
    def busy(self) -> bool:
        return bool(self.slots) or self._sending is not None

    async def idle(self) -> None:
        """Wait until every request read so far is answered and its answer written."""
        if self.busy:
            self._idle = asyncio.get_running_loop().create_future()
            await self._idle

    def _write(self, parts: Any) -> None:
        activity = self.activity
        if isinstance(parts, Throttled):  # answered now; the reader waits it out
            until = asyncio.get_running_loop().time() + parts.wait
            activity.muted_until = max(activity.muted_until, until)
            parts = _NO_RESPONSE if parts.parts is None else parts.parts
        close = isinstance(parts, _CloseAfter)
        if close:
            parts = parts.parts
        if parts is None or parts is _NO_RESPONSE or not activity.writable:
            return
        assert self.stream.transport is not None
        if self.stream.transport.is_closing():  # a handler that ended after the connection
            return
        try:
            total, rest = self.stream.send_now(parts)
        except OSError:  # ConnectionError included: the client is gone
            activity.writable = False
            return
        if rest is None:
            self._sent(total, close)
        else:
            self._sending = asyncio.ensure_future(self._send_rest(rest, total, close))

    async def _send_rest(self, rest: list[Any], total: int, close: bool) -> None:
        """The rest of an answer the socket did not take at once. A client that takes none
        of it for ``idle_timeout`` is disconnected (``AgentServer._watch_idle``)."""
        activity = self.activity
        activity.writing = asyncio.get_running_loop().time()
        try:
            await self.stream.send(rest)
        except OSError:
            activity.writable = False
        else:
            self._sent(total, close)
        finally:
            activity.writing = None
            self._sending = None
            self.pump()

    def _sent(self, total: int, close: bool) -> None:
        if not self.activity.writable:
            return  # cut off while this answer waited
        if self.observer is not None:
            self.observer.bytes_out(total)
        if close:
            self.activity.writable = False
            assert self.stream.transport is not None
            self.stream.transport.close()  # the reader sees the end of the stream


class AgentServer:
    def __init__(
        self,
        apis: Any,
        *,
        max_frame_bytes: int,
        max_in_flight: int = 64,
        max_queued_bytes: int = 256 << 20,
        idle_timeout: float = 600.0,
        frame_timeout: float = 30.0,
        codec: WireCodec | None = None,
        tls: Callable[[], ssl.SSLContext] | None = None,
        handshake_timeout: float = 10.0,
        auth: Authenticator | None = None,
        sasl: bool = False,
    ) -> None:
        self.apis = apis
        #: TLS: the listener's current context (``storage.tls.ReloadingContext.get``)
        self.tls = tls
        self.handshake_timeout = handshake_timeout
        #: authentication: sessions come from here; with ``sasl`` every connection must log in
        self.auth = auth
        self.sasl = sasl
        self.codec: WireCodec = codec if codec is not None else NativeCodec(apis)
        self.budget = ByteBudget(max_queued_bytes, reserve=max(max_queued_bytes // 16, 1 << 20))
        self.max_frame_bytes = max_frame_bytes
        self.max_in_flight = max_in_flight
        self.per_connection_bytes = max(max_queued_bytes // 4, 1 << 20)
        self.idle_timeout = idle_timeout
        self.frame_timeout = frame_timeout
        self.listener: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self.connections: set[asyncio.Task[None]] = set()
        self.observer: ServerObserver | None = None
        #: called (at most every ``trim_interval`` s) once many connections have closed
        self.give_back_memory: Callable[[], None] | None = None
        self.trim_interval = 5.0
        self._closed_since_trim = 0
        self._trim_pending = False

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
            if self.tls is not None:  # the handshake runs in the connection's own task
                self._track(
                    asyncio.create_task(self._tls_connection(sock, peer), name=f"conn:{peer}")
                )
                continue
            stream = FrameStream(
                sock, max_frame=self.max_frame_bytes, size_reader=self.codec.read_size
            )
            try:
                await loop.connect_accepted_socket(lambda: stream, sock)  # noqa: B023 (called at once)
            except OSError as exc:
                log.warning("connection from %s lost at once: %s", peer, exc)
                sock.close()
                continue
            self._track(asyncio.create_task(self._on_connection(stream, peer), name=f"conn:{peer}"))

    def _track(self, task: asyncio.Task[None]) -> None:
        self.connections.add(task)
        task.add_done_callback(self._connection_closed)

    async def _tls_connection(self, sock: socket.socket, peer: Any) -> None:
        """A TLS connection: the handshake (within ``handshake_timeout``; a peer that fails
        it, speaks plaintext or shows a certificate the CA did not sign is dropped and
        logged), then served like any other."""
        assert self.tls is not None
        stream = FrameStream(
            sock, max_frame=self.max_frame_bytes, size_reader=self.codec.read_size, tls=True
        )
        loop = asyncio.get_running_loop()
        try:
            # in two steps: start_tls closes the TCP transport itself if the handshake fails
            raw, _ = await loop.connect_accepted_socket(asyncio.Protocol, sock)
        except OSError as exc:
            log.warning("connection from %s lost at once: %s", peer, exc)
            sock.close()
            return
        try:
            tls = await loop.start_tls(
                raw,
                stream,
                self.tls(),
                server_side=True,
                ssl_handshake_timeout=self.handshake_timeout,
            )
        except (OSError, TimeoutError) as exc:  # ssl.SSLError is an OSError
            log.warning("TLS handshake with %s failed: %r", peer, exc)
            raw.close()
            return
        assert tls is not None
        stream.connection_made(tls)  # start_tls does not call it
        await self._on_connection(stream, peer)

    def _connection_closed(self, task: asyncio.Task[None]) -> None:
        """Forget the connection; after many closes, give their memory back (once, later)."""
        self.connections.discard(task)
        self._closed_since_trim += 1
        if self.give_back_memory is None or self._trim_pending:
            return
        if self._closed_since_trim >= max(256, len(self.connections)):
            self._trim_pending = True
            asyncio.get_running_loop().call_later(self.trim_interval, self._trim)

    def _trim(self) -> None:
        self._trim_pending = False
        self._closed_since_trim = 0
        if self.give_back_memory is not None:
            self.give_back_memory()

    async def _on_connection(self, stream: FrameStream, peer: Any) -> None:
        charge = _Charge(
            self.budget,
            ByteBudget(self.per_connection_bytes, reserve=self.budget.reserve),
        )
        activity = _Activity()
        assert stream.transport is not None
        session = (
            None
            if self.auth is None
            else self.auth.session(
                peer, sasl=self.sasl, peercert=stream.transport.get_extra_info("peercert")
            )
        )
        activity.session = session
        answers = _Answers(stream, activity, charge, self.max_in_flight, self.observer)
        watchdog = asyncio.create_task(
            self._watch_idle(stream, peer, activity), name=f"conn-idle:{peer}"
        )
        try:
            await self._read_requests(stream, answers, activity, charge)
        except (MalformedFrameError, UnsupportedVersionError) as exc:
            log.warning("closing connection from %s: %s", peer, exc)
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError):
            pass
        finally:
            stream.on_frames = None
            watchdog.cancel()
            if not answers.full():  # the answers to what was read are still written
                with contextlib.suppress(Exception, asyncio.CancelledError):
                    await answers.idle()
            assert stream.transport is not None
            stream.transport.close()

    async def _watch_idle(self, stream: FrameStream, peer: Any, activity: _Activity) -> None:
        """Abort the connection once a read or a write has waited over ``idle_timeout``, or
        a frame has taken the peer longer than ``frame_timeout`` to send."""
        loop = asyncio.get_running_loop()
        assert stream.transport is not None
        while True:
            interval = min(self.idle_timeout, self.frame_timeout) / 4
            if activity.session is not None and activity.session.pending:
                assert self.auth is not None
                interval = min(interval, self.auth.settings.deadline_s / 4)
            await asyncio.sleep(interval)
            now = loop.time()
            too_old = now - self.idle_timeout
            if activity.writing is not None and activity.writing < too_old:
                log.warning(
                    "closing connection from %s: it read no response for %.0f s",
                    peer,
                    self.idle_timeout,
                )
                activity.writable = False  # the answers still due are dropped, not written
                stream.transport.abort()
                return
            session = activity.session
            if session is not None and session.pending and now > session.deadline:
                log.warning("closing connection from %s: it did not authenticate in time", peer)
                activity.writable = False
                stream.transport.abort()
                return
            frame_limit = min(self.frame_timeout, self.idle_timeout)
            stalled = activity.frame is not None and activity.frame < now - frame_limit
            if stalled:
                log.warning(
                    "closing connection from %s: a frame took over %.1f s to arrive",
                    peer,
                    frame_limit,
                )
            if stalled or (activity.reading is not None and activity.reading < too_old):
                activity.writable = False
                stream.transport.abort()  # the reader sees the end of the stream
                return

    async def _read_requests(
        self,
        frames: FrameStream,
        answers: _Answers,
        activity: _Activity,
        charge: _Charge,
    ) -> None:
        loop = asyncio.get_running_loop()

        def take(size: int, frame: bytes) -> bool:
            """A whole small frame that arrived while this task waits for the next size,
            taken on the protocol side (``FrameStream.on_frames``) as below, without waking
            this task first: a loop turn less per request. Anything that would wait or fail
            (``max_in_flight`` reached, a quota, the budget, a frame that does not parse) is
            left to the loop below, which finds the frame where it was."""
            if answers.full() or activity.muted_until > loop.time():
                return False
            try:
                request = self.codec.parse(frame)
            except Exception:
                return False
            held = charge.try_small(size)
            if held is None:
                return False
            if self.observer is not None:
                self.observer.bytes_in(4 + size)
            self._start(request, activity.session, answers, held)
            activity.reading = loop.time()  # waiting for the next frame from now
            return True

        def take_frames() -> None:
            while frames.take_frame(take):
                pass

        frames.on_frames = take_frames

        async def grant(n: int) -> int:
            """Room for ``n`` more bytes; time spent waiting for it is not the peer's."""
            waited = loop.time()
            try:
                return await charge.grant(n)
            finally:
                if activity.frame is not None:
                    activity.frame += loop.time() - waited

        while True:
            activity.reading = loop.time()
            try:
                size = await frames.read_size()
            except FrameTooLargeError as exc:
                answer = await self._too_large(frames, exc.size, activity)
                if answer is None:
                    raise
                await answers.room()
                answers.done(answers.add(0), answer)
                continue
            activity.reading = None
            if activity.muted_until > loop.time():
                # over a quota: the frame's body waits in the socket (nothing charged here)
                await asyncio.sleep(activity.muted_until - loop.time())
            try:
                if frames.is_small(size):
                    await charge.small(size)
                activity.frame = loop.time()
                frame = await frames.read_body(size, grant)
                activity.frame = None
                if self.observer is not None:
                    self.observer.bytes_in(4 + size)
                request = self.codec.parse(frame)
            except BaseException:
                charge.release(charge.take_frame())
                raise
            del frame
            held = charge.take_frame()
            try:
                await answers.room()
            except BaseException:
                charge.release(held)
                raise
            self._start(request, activity.session, answers, held)

    async def _too_large(
        self, frames: FrameStream, size: int, activity: _Activity
    ) -> list[Any] | None:
        """A frame over the limit: the codec's answer after the frame was skipped (read
        off the socket without being kept), or None to close the connection."""
        if not self.codec.answers_oversize:
            return None
        activity.reading = None
        activity.frame = asyncio.get_running_loop().time()
        head = await frames.skip_frame(size, 64)
        activity.frame = None
        log.warning("skipped a frame of %d bytes (over %d)", size, self.max_frame_bytes)
        return self.codec.too_large(head, size)

    def _start(self, request: Any, session: Session | None, answers: _Answers, held: int) -> None:
        slot = answers.add(held)
        slot.task = asyncio.ensure_future(self._answer(request, session, answers, slot))

    async def _answer(
        self, request: Any, session: Session | None, answers: _Answers, slot: _Slot
    ) -> None:
        """Handle one request and answer it in order (``_Answers``)."""
        answer: Any = _NO_RESPONSE
        try:
            answer = await self._handle(request, session)
        except Exception:  # a bug outside the handlers (they answer their own errors)
            log.exception("request %s failed", getattr(request, "api_key", "?"))
        finally:
            slot.task = None
            answers.done(slot, answer)

    async def _handle(self, request: Any, session: Session | None) -> Any:
        if self.observer is None:
            return await self._dispatch(request, session)
        started = time.perf_counter()
        failed = True
        try:
            result = await self._dispatch(request, session)
            failed = False
            return result
        finally:
            self.observer.request_done(request.api_key, time.perf_counter() - started, failed)

    async def _dispatch(self, request: Any, session: Session | None) -> Any:
        if session is not None:
            current_principal.set(session.principal)  # this handler task's (ACL checks)
        if session is not None and session.pending:
            if request.api_key not in self.codec.pre_auth_apis:
                log.warning(
                    "closing connection from %s: API %s before authenticating",
                    session.peer,
                    request.api_key,
                )
                exc = IllegalSaslStateError("authenticate first (SaslHandshake)")
                return _CloseAfter(self.codec.refuse(request, exc))
            answer = await self.codec.handle(request, session)
            return _CloseAfter(answer) if session.failed else answer
        return await self.codec.handle(request, session)
