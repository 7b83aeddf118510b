"""The test proxies' server (``tests.tracked_server``) closes with no connection left open, also
while clients are still connecting: a socket left open warns when it is collected, and under
``filterwarnings = error`` that fails whichever later test is running then."""

from __future__ import annotations

import asyncio
import gc
import socket
import threading
import warnings

from tests.tracked_server import TrackedServer


def _connect_until_refused(port: int, first: threading.Event) -> None:
    """Open connections to ``port`` as fast as one thread can until the server stops
    listening; sets ``first`` once one got through."""
    opened: list[socket.socket] = []
    try:
        while True:
            try:
                opened.append(socket.create_connection(("127.0.0.1", port), timeout=5))
            except OSError:
                return
            first.set()
    finally:
        first.set()
        for s in opened:
            s.close()


async def _serve_and_close_under_load() -> int:
    """Runs a server until a client is connected, closes it while that client keeps
    connecting; returns how many connections the server's handlers saw."""
    handlers: set[asyncio.Task[None]] = set()
    seen = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal seen
        task = asyncio.current_task()
        assert task is not None
        handlers.add(task)
        seen += 1
        try:
            await reader.read()
        except asyncio.CancelledError:
            pass
        finally:
            handlers.discard(task)
            writer.close()

    server = TrackedServer()
    listening = await server.start(handle, "127.0.0.1", 0)
    first = threading.Event()
    client = threading.Thread(
        target=_connect_until_refused, args=(listening.sockets[0].getsockname()[1], first)
    )
    client.start()
    try:
        await asyncio.to_thread(first.wait, 10)
        await server.close(handlers)
    finally:
        await asyncio.to_thread(client.join, 10)
    assert not server.open
    return seen


def test_a_server_closed_while_clients_connect_leaves_no_socket_open() -> None:
    seen = 0
    for _ in range(30):  # the connection caught in the middle of its set-up is a race
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            seen += asyncio.run(_serve_and_close_under_load())
            gc.collect()  # an unclosed socket or transport warns as it is collected
        unclosed = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
        assert not unclosed, unclosed[:3]
    assert seen > 0
