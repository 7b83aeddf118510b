"""FrameStream over real loopback sockets: frames of every size arrive whole and in order,
parts are sent in order however little the kernel takes at once, an oversized size field is
refused before its body is read, the end of the stream inside a frame is an
IncompleteReadError, and a connection nobody reads from stops taking bytes."""

from __future__ import annotations

import asyncio
import os
import socket
import struct

import pytest

from storage.errors import FrameTooLargeError
from storage.protocol.sockio import STAGE_BYTES, FrameStream, tune


class _Watched(FrameStream):
    """A FrameStream that tells when it stopped writing (transport full) or reading."""

    def __init__(self, **kw: int) -> None:
        super().__init__(**kw)
        self.paused = asyncio.Event()
        self.stopped_reading = asyncio.Event()

    def pause_writing(self) -> None:
        super().pause_writing()
        self.paused.set()

    def buffer_updated(self, nbytes: int) -> None:
        super().buffer_updated(nbytes)
        assert self.transport is not None
        if not self.transport.is_reading():
            self.stopped_reading.set()


async def _pair(max_frame: int = 64 << 20) -> tuple[_Watched, socket.socket, _Watched]:
    """(receiving stream, sending socket, sending stream) over a loopback TCP connection."""
    loop = asyncio.get_running_loop()
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    client = socket.socket()
    tune(client)
    accepted = asyncio.ensure_future(loop.sock_accept(listener))
    await loop.sock_connect(client, listener.getsockname())
    server, _ = await accepted
    listener.close()
    tune(server)
    inbound = _Watched(max_frame=max_frame)
    await loop.connect_accepted_socket(lambda: inbound, server)
    outbound = _Watched(max_frame=max_frame)
    await loop.create_connection(lambda: outbound, sock=client)
    return inbound, client, outbound


def _close(*streams: FrameStream) -> None:
    for s in streams:
        assert s.transport is not None
        s.transport.close()


def _frame(body: bytes) -> list[bytes]:
    return [struct.pack("<i", len(body)), body]


def test_frames_of_every_size_arrive_whole_and_in_order() -> None:
    sizes = [0, 1, 7, STAGE_BYTES // 2, STAGE_BYTES // 2 + 1, STAGE_BYTES, 3 << 20, 5, 1 << 20]
    bodies = [os.urandom(n) for n in sizes]

    async def run() -> None:
        inbound, client, outbound = await _pair()

        async def send() -> None:
            for body in bodies:
                await outbound.send(client, _frame(body))

        sender = asyncio.create_task(send())
        got = []
        for _ in bodies:
            got.append(bytes(await inbound.read_body(await inbound.read_size())))
        await sender
        assert got == bodies
        _close(outbound, inbound)

    asyncio.run(run())


def test_many_parts_larger_than_the_socket_buffer_go_out_in_order() -> None:
    parts = [os.urandom(1 + i % 5000) for i in range(3000)]  # > IOV_MAX parts, ~7.5 MB
    body = b"".join(parts)

    async def run() -> None:
        inbound, client, outbound = await _pair()
        sender = asyncio.create_task(outbound.send(client, [struct.pack("<i", len(body)), *parts]))
        got = await inbound.read_body(await inbound.read_size())
        assert await sender == 4 + len(body)
        assert bytes(got) == body
        _close(outbound, inbound)

    asyncio.run(run())


def test_oversized_size_field_is_refused_and_eof_inside_a_frame_is_incomplete() -> None:
    async def run() -> None:
        inbound, client, outbound = await _pair(max_frame=1000)
        await outbound.send(client, [struct.pack("<i", 1001)])
        with pytest.raises(FrameTooLargeError):
            await inbound.read_size()
        inbound2, client2, outbound2 = await _pair()
        await outbound2.send(client2, [struct.pack("<i", 200_000), b"x" * 1000])
        client2.shutdown(socket.SHUT_WR)
        size = await inbound2.read_size()
        with pytest.raises(asyncio.IncompleteReadError) as err:
            await inbound2.read_body(size)
        assert err.value.partial == b"x" * 1000
        _close(outbound, inbound, outbound2, inbound2)

    asyncio.run(run())


def test_a_stream_nobody_reads_stops_taking_bytes() -> None:
    """Backpressure: unread, the receiver holds at most its staging buffer; the sender's
    transport buffer fills and ``send`` waits instead of queueing without bound."""

    async def run() -> None:
        inbound, client, outbound = await _pair()
        small = _frame(b"y" * 100)  # 104 bytes a frame; nobody calls read_* on inbound
        sender = asyncio.create_task(_flood(outbound, client, small))
        async with asyncio.timeout(30):  # the kernel's buffers fill, then the transport's
            await outbound.paused.wait()
            await inbound.stopped_reading.wait()  # its staging buffer is full and unread
        assert outbound.writing_paused
        assert inbound.transport is not None and outbound.transport is not None
        high = outbound.transport.get_write_buffer_limits()[1]
        assert outbound.transport.get_write_buffer_size() <= high + 104  # send() waits
        assert not sender.done()
        # reading resumes the flow
        for _ in range(2000):
            assert await inbound.read_body(await inbound.read_size()) == b"y" * 100
        sender.cancel()
        _close(outbound, inbound)

    async def _flood(stream: FrameStream, sock: socket.socket, frame: list[bytes]) -> None:
        while True:
            await stream.send(sock, frame)

    asyncio.run(run())
