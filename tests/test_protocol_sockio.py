"""FrameStream over real loopback sockets: frames of every size arrive whole and in order,
parts are sent in order however little the kernel takes at once, an oversized size field is
refused before its body is read, the end of the stream inside a frame is an
IncompleteReadError, and a connection nobody reads from stops taking bytes (and the agent's
server disconnects a client that reads no answer within its idle timeout)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import struct
from types import SimpleNamespace
from typing import Any

import pytest

from broker_agents.server import AgentServer
from storage.errors import FrameTooLargeError
from storage.protocol import encode_request, encode_response
from storage.protocol import messages as m
from storage.protocol.sockio import STAGE_BYTES, FrameStream


class _Watched(FrameStream):
    """A FrameStream that tells when it stopped writing (transport full) or reading."""

    def __init__(self, sock: socket.socket, **kw: int) -> None:
        super().__init__(sock, **kw)
        self.paused = asyncio.Event()
        self.stopped_reading = asyncio.Event()
        self.arrived = asyncio.Event()

    def staged(self) -> int:
        """Bytes received into the staging buffer and not read yet."""
        return self._end - self._start

    def pause_writing(self) -> None:
        super().pause_writing()
        self.paused.set()

    def buffer_updated(self, nbytes: int) -> None:
        super().buffer_updated(nbytes)
        self.arrived.set()
        assert self.transport is not None
        if not self.transport.is_reading():
            self.stopped_reading.set()


async def _pair(max_frame: int = 64 << 20) -> tuple[_Watched, _Watched]:
    """(receiving stream, sending stream) over a loopback TCP connection."""
    loop = asyncio.get_running_loop()
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    client = socket.socket()
    client.setblocking(False)
    accepted = asyncio.ensure_future(loop.sock_accept(listener))
    await loop.sock_connect(client, listener.getsockname())
    server, _ = await accepted
    listener.close()
    inbound = _Watched(server, max_frame=max_frame)
    await loop.connect_accepted_socket(lambda: inbound, server)
    outbound = _Watched(client, max_frame=max_frame)
    await loop.create_connection(lambda: outbound, sock=client)
    return inbound, outbound


def _close(*streams: FrameStream) -> None:
    for s in streams:
        assert s.transport is not None
        s.transport.close()


def _frame(body: bytes) -> list[bytes]:
    return [struct.pack("<i", len(body)), body]


def test_both_ends_send_small_frames_at_once_nagle_off() -> None:
    """Small answers must not wait for the peer's delayed ACK (40 ms on Linux): both the
    accepted end (the agent's; asyncio leaves Nagle on there, its ``proto`` being 0) and the
    connecting end have TCP_NODELAY."""

    async def run() -> None:
        inbound, outbound = await _pair()
        try:
            for stream in (inbound, outbound):
                assert stream.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        finally:
            _close(inbound, outbound)

    asyncio.run(run())


def test_frames_of_every_size_arrive_whole_and_in_order() -> None:
    sizes = [0, 1, 7, STAGE_BYTES // 2, STAGE_BYTES // 2 + 1, STAGE_BYTES, 3 << 20, 5, 1 << 20]
    bodies = [os.urandom(n) for n in sizes]

    async def run() -> None:
        inbound, outbound = await _pair()

        async def send() -> None:
            for body in bodies:
                await outbound.send(_frame(body))

        sender = asyncio.create_task(send())
        got = []
        for _ in bodies:
            got.append(bytes(await inbound.read_body(await inbound.read_size())))
        await sender
        assert got == bodies
        _close(outbound, inbound)

    asyncio.run(run())


def test_bytes_that_arrive_while_a_grant_is_awaited_stay_in_their_frame() -> None:
    """A large frame's first grant can wait (the agent's request budget is taken by other
    connections); meanwhile more of the frame lands in the staging buffer. Those bytes are the
    body's: read as the next frame's size prefix they desynchronized the stream (the flood test
    of test_agent_protocol saw "frame of 1243179287 bytes exceeds the limit")."""
    bodies = [os.urandom(3 << 20), os.urandom(100), os.urandom(STAGE_BYTES)]
    head = 1000  # of the first body, sent before the receiver asks for room

    async def run() -> None:
        inbound, outbound = await _pair()
        asking = asyncio.Event()

        async def send() -> None:
            await outbound.send([*_frame(bodies[0])[:1], bodies[0][:head]])
            await asking.wait()
            await outbound.send([bodies[0][head:]])
            for body in bodies[1:]:
                await outbound.send(_frame(body))

        sender = asyncio.create_task(send())

        async def grant(n: int) -> int:
            if not asking.is_set():
                # the budget frees once more of the frame sits in the staging buffer
                asking.set()
                while inbound.staged() <= head:
                    inbound.arrived.clear()
                    await inbound.arrived.wait()
            return n

        got = []
        for _ in bodies:
            got.append(bytes(await inbound.read_body(await inbound.read_size(), grant)))
        await sender
        assert got == bodies
        _close(outbound, inbound)

    asyncio.run(run())


def test_many_parts_larger_than_the_socket_buffer_go_out_in_order() -> None:
    parts = [os.urandom(1 + i % 5000) for i in range(3000)]  # > IOV_MAX parts, ~7.5 MB
    body = b"".join(parts)

    async def run() -> None:
        inbound, outbound = await _pair()
        sender = asyncio.create_task(outbound.send([struct.pack("<i", len(body)), *parts]))
        got = await inbound.read_body(await inbound.read_size())
        assert await sender == 4 + len(body)
        assert bytes(got) == body
        _close(outbound, inbound)

    asyncio.run(run())


def test_oversized_size_field_is_refused_and_eof_inside_a_frame_is_incomplete() -> None:
    async def run() -> None:
        inbound, outbound = await _pair(max_frame=1000)
        await outbound.send([struct.pack("<i", 1001)])
        with pytest.raises(FrameTooLargeError):
            await inbound.read_size()
        inbound2, outbound2 = await _pair()
        await outbound2.send([struct.pack("<i", 200_000), b"x" * 1000])
        outbound2.sock.shutdown(socket.SHUT_WR)
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
        inbound, outbound = await _pair()
        small = _frame(b"y" * 100)  # 104 bytes a frame; nobody calls read_* on inbound
        sender = asyncio.create_task(_flood(outbound, small))
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

    async def _flood(stream: FrameStream, frame: list[bytes]) -> None:
        while True:
            await stream.send(frame)

    asyncio.run(run())


async def _answering(answer: Any, *, idle_timeout: float) -> tuple[AgentServer, str, int]:
    """An ``AgentServer`` on loopback that answers every ApiVersions request with ``answer``."""

    async def handler(_: object) -> Any:
        return answer

    server = AgentServer(
        SimpleNamespace(handlers={m.ApiKey.API_VERSIONS: handler}),
        max_frame_bytes=1 << 20,
        idle_timeout=idle_timeout,
    )
    host, port = await server.start("127.0.0.1", 0)
    return server, host, port


def test_agent_server_disconnects_a_client_that_reads_no_response() -> None:
    """A client that sends requests and never reads the answers is closed after the server's
    idle timeout, instead of holding a writer (and its queued answers) forever."""
    answer = m.FetchResponse(
        [m.FetchTopicResult("t", [m.FetchPartitionResult(0, 0, 0, 0, 1, 0, bytes(1 << 20))])]
    )

    async def run() -> None:
        server, host, port = await _answering(answer, idle_timeout=1.0)
        loop = asyncio.get_running_loop()
        client = socket.socket()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.setblocking(False)
        try:
            await loop.sock_connect(client, (host, port))
            request = b"".join(
                encode_request(m.ApiKey.API_VERSIONS, 1, "c", m.ApiVersionsRequest())
            )
            await loop.sock_sendall(client, request)  # one answer read whole: served
            got, size = 0, sum(memoryview(p).nbytes for p in encode_response(1, answer))
            while got < size:
                got += len(await loop.sock_recv(client, 1 << 20))
            for _ in range(20):  # then 20 MiB of answers nobody reads; the kernel holds a few
                await loop.sock_sendall(client, request)
            (conn,) = server.connections
            async with asyncio.timeout(30):
                await asyncio.wait({conn})  # the server ends the connection by itself
            assert not server.connections
            # what the client then reads ends (EOF or reset), it does not hang
            async with asyncio.timeout(30):
                with contextlib.suppress(ConnectionError):
                    while await loop.sock_recv(client, 1 << 20):
                        pass
        finally:
            client.close()
            await server.stop()

    asyncio.run(run())


def test_agent_server_closes_idle_connections_and_keeps_busy_ones() -> None:
    """A client that sends nothing, and one that stops in the middle of a frame, are cut off
    after the idle timeout; a client that keeps sending requests (each answered) is not, however
    long it stays."""
    answer = m.ApiVersionsResponse(0, [])

    async def run() -> None:
        server, host, port = await _answering(answer, idle_timeout=0.4)
        request = b"".join(encode_request(m.ApiKey.API_VERSIONS, 1, "c", m.ApiVersionsRequest()))
        silent = await asyncio.open_connection(host, port)
        partial = await asyncio.open_connection(host, port)
        partial[1].write(request[: len(request) // 2])
        busy_reader, busy_writer = await asyncio.open_connection(host, port)
        try:
            # 2 s of requests, 0.1 s apart: five times the idle timeout
            for _ in range(20):
                busy_writer.write(request)
                size = struct.unpack("<i", await busy_reader.readexactly(4))[0]
                await busy_reader.readexactly(size)
                await asyncio.sleep(0.1)  # the client's pace: the gap is what is being tested
            for reader, _ in (silent, partial):
                async with asyncio.timeout(5):
                    with contextlib.suppress(ConnectionError):
                        assert await reader.read() == b""  # closed by the server
            assert len(server.connections) == 1  # the busy one is still served
            busy_writer.write(request)
            size = struct.unpack("<i", await busy_reader.readexactly(4))[0]
            assert len(await busy_reader.readexactly(size)) == size
        finally:
            for _, writer in (silent, partial, (busy_reader, busy_writer)):
                writer.close()
            await server.stop()

    asyncio.run(run())


def test_agent_server_answers_pipelined_requests_in_order_and_gives_their_bytes_back() -> None:
    """Requests sent back to back in one write (each whole frame taken as it arrives, without
    the reader) and one by one: answers come in request order whichever handler finishes
    first, a held request holds the ones behind it without losing them, at most
    ``max_in_flight`` are in progress at once, and every request's bytes return to the
    shared budget once it is answered."""
    release = asyncio.Event()
    holding = asyncio.Event()
    running: list[int] = []
    peak = 0

    async def answer_after(req: m.MetadataRequest) -> Any:
        nonlocal peak
        running.append(1)
        peak = max(peak, len(running))
        try:
            if req.topics == ["hold"]:
                holding.set()
                await release.wait()
            return m.MetadataResponse([], 0, [])
        finally:
            running.pop()

    async def versions(_: object) -> Any:
        return m.ApiVersionsResponse(0, [])

    async def run() -> None:
        server = AgentServer(
            SimpleNamespace(
                handlers={m.ApiKey.API_VERSIONS: versions, m.ApiKey.METADATA: answer_after}
            ),
            max_frame_bytes=1 << 20,
            max_in_flight=8,
        )
        host, port = await server.start("127.0.0.1", 0)
        reader, writer = await asyncio.open_connection(host, port)

        def request(cid: int) -> bytes:
            if cid == 3:
                body: Any = m.MetadataRequest(["hold"])
                api = m.ApiKey.METADATA
            elif cid % 2:
                body, api = m.MetadataRequest([f"t{cid}"]), m.ApiKey.METADATA
            else:
                body, api = m.ApiVersionsRequest(), m.ApiKey.API_VERSIONS
            return b"".join(encode_request(api, cid, "c", body))

        async def answers(n: int) -> list[int]:
            got = []
            for _ in range(n):
                size = struct.unpack("<i", await reader.readexactly(4))[0]
                got.append(struct.unpack("<i", (await reader.readexactly(size))[:4])[0])
            return got

        try:
            writer.write(b"".join(request(cid) for cid in range(1, 31)))  # one write, 30 frames
            async with asyncio.timeout(10):
                assert await answers(2) == [1, 2]
                await holding.wait()  # request 3 held, those behind it waiting
                assert server.budget.used > 0  # its frame's bytes, until it is answered
                release.set()
                assert await answers(28) == list(range(3, 31))
                for cid in range(31, 41):  # one at a time
                    writer.write(request(cid))
                    assert await answers(1) == [cid]
            assert peak <= 8
            assert server.budget.used == 0
        finally:
            writer.close()
            await server.stop()

    asyncio.run(run())
