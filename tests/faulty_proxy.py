"""A fault-injecting HTTP/1.1 proxy for tests: put it between boto3 and moto.

The proxy frames every request (head, then a ``Content-Length`` or chunked body) and every
response, so it decides per *request*, not per connection — a keep-alive connection that
carried good requests gets the next fault too. For each request it draws one outcome from the
current fault weights (nothing configured: every request passes):

* ``pass``        forward to the upstream, relay the answer;
* ``slowdown``    answer ``503 SlowDown`` with S3's XML error body (the request never reaches
                  the upstream), then close the connection;
* ``stall``       hold the connection without answering until the client gives up (its read
                  timeout fires) or the faults are cleared;
* ``reset``       close with an RST (``SO_LINGER`` 0) right after reading the request head;
* ``lost_reply``  forward the request (so the upstream *does* it), then reset the client
                  instead of relaying the answer — the "did my PUT happen?" case.

Independently of the weights, ``hold(marker, after=n)`` keeps requests whose body contains
``marker`` — past the first ``n`` of them — waiting, unanswered and not forwarded, until
``release()``; then they go on to the upstream. A test can so stop a process in the middle of a
run of requests it can name (``held`` counts the requests waiting).

``Expect: 100-continue`` is answered by the proxy itself (and not forwarded), so a refused
request needs no body. ``FaultyProxy`` runs its own event loop in a thread so sync tests can
drive it; the counters (requests seen by method, outcomes) are plain dicts read under a lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import struct
import threading
from collections import Counter
from collections.abc import Mapping
from types import TracebackType

from tests.tracked_server import TrackedServer

OUTCOMES = ("pass", "slowdown", "stall", "reset", "lost_reply")
MAX_HEAD = 64 * 1024

SLOWDOWN_BODY = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n'
    b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message>"
    b"<RequestId>faulty-proxy</RequestId><HostId>faulty-proxy</HostId></Error>"
)


class _Closed(Exception):
    """The peer closed the connection between or inside messages."""


def _parse_head(raw: bytes) -> tuple[str, list[tuple[str, str]]]:
    lines = raw.decode("latin-1").split("\r\n")
    headers = []
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers.append((name.strip(), value.strip()))
    return lines[0], headers


def _header(headers: list[tuple[str, str]], name: str) -> str | None:
    for k, v in headers:
        if k.lower() == name:
            return v
    return None


def _build_head(first: str, headers: list[tuple[str, str]]) -> bytes:
    return (first + "\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers) + "\r\n").encode(
        "latin-1"
    )


async def _read_head(reader: asyncio.StreamReader) -> bytes | None:
    try:
        raw = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise _Closed from None
    except asyncio.LimitOverrunError:
        raise _Closed from None
    return raw[:-2]


async def _read_body(reader: asyncio.StreamReader, headers: list[tuple[str, str]]) -> bytes:
    """The body exactly as framed on the wire (chunked bodies keep their chunk framing)."""
    try:
        if (_header(headers, "transfer-encoding") or "").lower().endswith("chunked"):
            out = bytearray()
            while True:
                line = await reader.readuntil(b"\r\n")
                out += line
                size = int(line.split(b";", 1)[0].strip(), 16)
                if size == 0:
                    while True:  # trailers, then the empty line
                        trailer = await reader.readuntil(b"\r\n")
                        out += trailer
                        if trailer == b"\r\n":
                            return bytes(out)
                out += await reader.readexactly(size + 2)
        length = int(_header(headers, "content-length") or 0)
        return await reader.readexactly(length) if length else b""
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError):
        raise _Closed from None


def reset(writer: asyncio.StreamWriter) -> None:
    """Abort the connection with a TCP reset (SO_LINGER 0), not a clean close."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class FaultyProxy:
    """``with FaultyProxy("127.0.0.1", moto_port) as proxy: proxy.endpoint_url ...``"""

    def __init__(self, upstream_host: str, upstream_port: int, *, seed: int = 1) -> None:
        self.upstream = (upstream_host, upstream_port)
        self._rng = random.Random(seed)
        self._weights: dict[str, float] = {}
        self._lock = threading.Lock()
        self.requests: Counter[str] = Counter()  # by method, every request read
        self.outcomes: Counter[str] = Counter()
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._clear: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._hold: tuple[bytes, int] | None = None
        self._hold_matched = 0
        self.held = 0
        self._released: asyncio.Event | None = None

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # ---- control (any thread) -----------------------------------------------------------
    def set_faults(self, weights: Mapping[str, float]) -> None:
        """Per-request outcome weights, e.g. ``{"slowdown": 2, "stall": 1, "pass": 1}``."""
        unknown = set(weights) - set(OUTCOMES)
        if unknown:
            raise ValueError(f"unknown outcomes {sorted(unknown)}")
        with self._lock:
            self._weights = {k: v for k, v in weights.items() if v > 0}
        if self._loop is not None and self._clear is not None:
            self._loop.call_soon_threadsafe(self._clear.clear)

    def clear(self) -> None:
        """Every request passes from now on; stalled connections are closed at once."""
        with self._lock:
            self._weights = {}
        if self._loop is not None and self._clear is not None:
            self._loop.call_soon_threadsafe(self._clear.set)

    def hold(self, marker: bytes, *, after: int = 0) -> None:
        """Hold requests whose body contains ``marker``, except the first ``after``."""
        with self._lock:
            self._hold, self._hold_matched = (marker, after), 0
        if self._loop is not None and self._released is not None:
            self._loop.call_soon_threadsafe(self._released.clear)

    def release(self) -> None:
        """Let every held request go on, and hold no more."""
        with self._lock:
            self._hold = None
        if self._loop is not None and self._released is not None:
            self._loop.call_soon_threadsafe(self._released.set)

    def _holds(self, body: bytes) -> bool:
        with self._lock:
            if self._hold is None or self._hold[0] not in body:
                return False
            self._hold_matched += 1
            if self._hold_matched <= self._hold[1]:
                return False
            self.held += 1
            return True

    def counts(self) -> tuple[dict[str, int], dict[str, int]]:
        with self._lock:
            return dict(self.requests), dict(self.outcomes)

    def _choose(self, method: str) -> str:
        with self._lock:
            self.requests[method] += 1
            if not self._weights:
                outcome = "pass"
            else:
                names = list(self._weights)
                outcome = self._rng.choices(names, [self._weights[n] for n in names])[0]
            self.outcomes[outcome] += 1
            return outcome

    # ---- lifecycle ----------------------------------------------------------------------
    def __enter__(self) -> FaultyProxy:
        self._thread = threading.Thread(target=self._run, name="faulty-proxy", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("faulty proxy did not start")
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(10)

    def _run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._clear = asyncio.Event()
        self._stop = asyncio.Event()
        self._released = asyncio.Event()
        conns: set[asyncio.Task[None]] = set()

        async def accept(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            task = asyncio.current_task()
            assert task is not None
            conns.add(task)
            try:
                await self._serve(r, w)
            except (_Closed, OSError):
                w.transport.abort()
            except asyncio.CancelledError:
                pass  # the proxy is closing (3.11's server would log a cancelled handler)
            finally:
                conns.discard(task)
                if not w.transport.is_closing():
                    w.close()

        tracked = TrackedServer()
        server = await tracked.start(accept, "127.0.0.1", 0, limit=MAX_HEAD)
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        await self._stop.wait()
        await tracked.close(conns)

    # ---- one client connection ----------------------------------------------------------
    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        assert self._clear is not None
        up: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        try:
            while True:
                raw = await _read_head(reader)
                if raw is None:
                    return
                first, headers = _parse_head(raw)
                method = first.split(" ", 1)[0]
                outcome = self._choose(method)
                if outcome == "reset":
                    reset(writer)
                    return
                if outcome == "stall":
                    with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                        async with asyncio.timeout(120):
                            drain = asyncio.ensure_future(reader.read())  # EOF: client gave up
                            clear = asyncio.ensure_future(self._clear.wait())
                            try:
                                await asyncio.wait({drain, clear}, return_when="FIRST_COMPLETED")
                            finally:
                                drain.cancel()
                                clear.cancel()
                    reset(writer)
                    return
                expect = (_header(headers, "expect") or "").lower() == "100-continue"
                headers = [(k, v) for k, v in headers if k.lower() != "expect"]
                if outcome == "slowdown":
                    if not expect:
                        await _read_body(reader, headers)
                    writer.write(
                        b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\n"
                        b"Content-Length: %d\r\nConnection: close\r\n\r\n%s"
                        % (len(SLOWDOWN_BODY), SLOWDOWN_BODY)
                    )
                    await writer.drain()
                    writer.close()
                    return
                if expect:
                    writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                body = await _read_body(reader, headers)
                if self._holds(body):
                    assert self._released is not None
                    await self._released.wait()
                    with self._lock:
                        self.held -= 1
                if up is None:
                    up = await asyncio.open_connection(*self.upstream, limit=MAX_HEAD)
                up[1].write(_build_head(first, headers) + body)
                await up[1].drain()
                head = await _read_head(up[0])
                if head is None:
                    raise _Closed
                status_line, rheaders = _parse_head(head)
                status = int(status_line.split(" ", 2)[1])
                until_close = False
                if method == "HEAD" or status in (204, 304) or 100 <= status < 200:
                    rbody = b""
                elif _header(rheaders, "content-length") is None and not (
                    _header(rheaders, "transfer-encoding") or ""
                ).lower().endswith("chunked"):
                    rbody = await up[0].read()
                    until_close = True
                else:
                    rbody = await _read_body(up[0], rheaders)
                if outcome == "lost_reply":
                    reset(writer)
                    return
                writer.write(head + b"\r\n" + rbody)
                await writer.drain()
                closing = (_header(rheaders, "connection") or "").lower() == "close"
                if until_close or closing:
                    return
        finally:
            if up is not None:
                up[1].transport.abort()
