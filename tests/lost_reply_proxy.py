"""A TCP proxy for the agent protocol that loses chosen produce responses.

It relays whole frames both ways (``storage.protocol.frames``: a little-endian 4-byte size, then for a
request the API key, version and correlation id, for a response the correlation id). Produce
requests are counted per proxy; when the response to a produce request whose number is in
``lose`` comes back from the agent, the proxy resets the client's connection instead of
relaying it. The agent has done the work; the client only knows that its connection broke:
the "was my batch stored?" case that retries must not turn into duplicates.

Clients reach agents at the address the agents advertise, so the agent is started with
``advertised.host`` set to a second loopback address (127.0.0.2) where the proxy listens on
the agent's own port.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable

from storage.protocol import parse_request, parse_response, read_size
from storage.protocol.frames import DEFAULT_MAX_FRAME
from storage.protocol.messages import ApiKey
from tests.faulty_proxy import reset
from tests.tracked_server import TrackedServer


async def _frame(reader: asyncio.StreamReader) -> tuple[bytes, bytes] | None:
    """The next frame's size prefix and body, or None at the end of the stream."""
    try:
        head = await reader.readexactly(4)
        return head, await reader.readexactly(read_size(head, DEFAULT_MAX_FRAME))
    except (asyncio.IncompleteReadError, ConnectionError):
        return None


class LostReplyProxy:
    def __init__(self, listen_host: str, upstream_host: str, port: int, lose: Iterable[int]):
        self.listen = (listen_host, port)
        self.upstream = (upstream_host, port)
        self.lose = set(lose)
        self.produce_requests = 0
        self.lost = 0
        self._server = TrackedServer()
        self._tasks: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> LostReplyProxy:
        await self._server.start(self._serve, *self.listen, reuse_address=True)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._server.close(self._tasks)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        async with asyncio.timeout(5):
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        doomed: set[int] = set()  # correlation ids whose responses are to be lost

        async def requests() -> None:
            while (frame := await _frame(reader)) is not None:
                request = parse_request(frame[1])
                if request.api_key == ApiKey.PRODUCE:
                    self.produce_requests += 1
                    if self.produce_requests in self.lose:
                        doomed.add(request.correlation_id)
                up_writer.writelines(frame)
                await up_writer.drain()

        async def responses() -> None:
            while (frame := await _frame(up_reader)) is not None:
                if parse_response(frame[1]).correlation_id in doomed:
                    self.lost += 1
                    reset(writer)
                    return
                writer.writelines(frame)
                await writer.drain()

        pumps = [asyncio.create_task(requests()), asyncio.create_task(responses())]
        try:
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            pass  # the proxy is closing (asyncio would log a cancelled handler as an error)
        finally:
            for p in pumps:
                p.cancel()
            with contextlib.suppress(OSError):
                writer.close()
                up_writer.close()
            self._tasks.discard(task)
