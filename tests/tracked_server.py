"""An asyncio TCP server for test proxies that closes without leaving a connection open."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any


class TrackedServer:
    """``asyncio.start_server`` whose ``close`` leaves no accepted connection open.

    Python 3.11 leaks a connection accepted in a server's last moments: asyncio sets it up in
    a task of its own a turn of the loop after the accept, and if ``Server.close`` ran in
    between, the new transport's ``Server._attach`` fails an assertion, which asyncio drops
    without a word, and the socket stays open until the garbage collector warns about it in
    whichever test is running then (a CI failure in test_disk_faults, from the S3 proxy of
    test_disk_backpressure just before it, whose agent was still uploading). So ``close``
    first stops accepting, lets the connections already accepted finish their set-up (each is
    aborted as it is made), and only then closes the server, cancels the handlers and aborts
    the connections still open. (3.13's ``Server.close_clients`` does the last part.)"""

    def __init__(self) -> None:
        self.server: asyncio.Server | None = None
        self.open: set[asyncio.BaseTransport] = set()
        self.closing = False
        self.setting_up = 0  # protocols made whose connection_made has not run yet
        self._set_up = asyncio.Event()  # closing, and none is being set up any more

    async def start(
        self,
        handler: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
        host: str,
        port: int,
        *,
        limit: int = 64 * 1024,
        **kwargs: Any,
    ) -> asyncio.Server:
        loop = asyncio.get_running_loop()
        tracker = self

        class Protocol(asyncio.StreamReaderProtocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                tracker.setting_up -= 1
                self.tracked = transport
                if tracker.closing:
                    transport.abort()  # type: ignore[attr-defined]
                    if not tracker.setting_up:
                        tracker._set_up.set()
                    return
                tracker.open.add(transport)
                super().connection_made(transport)

            def connection_lost(self, exc: Exception | None) -> None:
                tracker.open.discard(self.tracked)
                super().connection_lost(exc)

        def protocol() -> Protocol:
            tracker.setting_up += 1
            return Protocol(asyncio.StreamReader(limit=limit, loop=loop), handler, loop=loop)

        self.server = await loop.create_server(protocol, host, port, **kwargs)
        return self.server

    async def close(self, handlers: set[asyncio.Task[None]]) -> None:
        """Stop accepting, cancel the ``handlers`` still running, abort what stays open."""
        assert self.server is not None
        loop = asyncio.get_running_loop()
        self.closing = True
        for sock in self.server.sockets:
            loop.remove_reader(sock.fileno())
        # the connections accepted last make their protocol on the next turn of the loop (the
        # tasks asyncio made for them run before this one resumes), and connection_made (which
        # aborts them now) runs a turn or two after that
        await asyncio.sleep(0)
        if self.setting_up:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._set_up.wait(), 5)
        self.server.close()
        for t in list(handlers):
            t.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)
        for transport in list(self.open):
            transport.abort()
        await asyncio.sleep(0)  # their connection_lost runs on the next turn of the loop
