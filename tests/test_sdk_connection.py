"""One connection's failure handling against raw socket peers (no agent: each peer only
misbehaves in one way, or answers with a bare error frame)."""

from __future__ import annotations

import asyncio
import gc
import socket
from collections.abc import Awaitable, Callable

import pytest

from sdk.connection import Connection
from storage.errors import (
    FrameTooLargeError,
    LeaderNotAvailableError,
    MalformedFrameError,
    NetworkError,
    RequestTimedOutError,
    UnknownTopicOrPartitionError,
    UnsupportedVersionError,
)
from storage.protocol import encode_error_response, parse_request, read_size
from storage.protocol.messages import (
    MetadataRequest,
    ProducePartition,
    ProduceRequest,
    ProduceTopic,
)

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def read_request(reader: asyncio.StreamReader) -> int:
    size = read_size(await reader.readexactly(4), 1 << 20)
    return parse_request(await reader.readexactly(size)).correlation_id


async def peer(handler: Handler) -> tuple[asyncio.Server, int]:
    async def guarded(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            await handler(r, w)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            w.close()

    server = await asyncio.start_server(guarded, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


def run(test: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(test(), 10))  # type: ignore[arg-type]


def test_refused_connection_is_a_retriable_network_error() -> None:
    async def go() -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        conn = Connection("127.0.0.1", port)
        with pytest.raises(NetworkError, match="cannot connect") as info:
            await conn.request(MetadataRequest([]))
        assert info.value.retriable
        assert conn.closed

    run(go)


def test_no_answer_times_out_and_closes_the_connection() -> None:
    async def go() -> None:
        async def silent(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            await r.read()

        server, port = await peer(silent)
        async with server:
            conn = Connection("127.0.0.1", port, request_timeout_ms=50)
            with pytest.raises(RequestTimedOutError, match="no response within 50 ms"):
                await conn.request(MetadataRequest([]))
            assert conn.closed
            with pytest.raises(NetworkError, match="is closed"):
                await conn.request(MetadataRequest([]))

    run(go)


def test_peer_closing_fails_every_pipelined_request() -> None:
    async def go() -> None:
        async def hang_up(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            await read_request(r)
            await read_request(r)

        server, port = await peer(hang_up)
        async with server:
            conn = Connection("127.0.0.1", port)
            results = await asyncio.gather(
                conn.request(MetadataRequest([])),
                conn.request(MetadataRequest(["t"])),
                return_exceptions=True,
            )
            assert all(isinstance(r, NetworkError) for r in results), results
            assert "closed the connection" in str(results[0])

    run(go)


@pytest.mark.parametrize(
    ("garbage", "error"),
    [(b"\xff\xff\xff\xff", MalformedFrameError), (b"\x00\x00\x00\x7f", FrameTooLargeError)],
)
def test_garbage_on_the_socket_is_a_typed_error(garbage: bytes, error: type[Exception]) -> None:
    async def go() -> None:
        async def garbler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            await read_request(r)
            w.write(garbage)
            await w.drain()
            await r.read()

        server, port = await peer(garbler)
        async with server:
            conn = Connection("127.0.0.1", port, max_frame=1 << 20)
            with pytest.raises(error):
                await conn.request(MetadataRequest([]))
            assert conn.closed

    run(go)


def test_header_errors_are_typed_and_matched_by_correlation_id() -> None:
    async def go() -> None:
        async def answer_backwards(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            while True:
                first, second = await read_request(r), await read_request(r)
                w.writelines(encode_error_response(second, 5, "second"))
                w.writelines(encode_error_response(first, 3, "first"))
                await w.drain()

        server, port = await peer(answer_backwards)
        async with server:
            conn = Connection("127.0.0.1", port, max_in_flight=2)
            for _ in range(2):  # the connection stays usable after error answers
                a, b = await asyncio.gather(
                    conn.request(MetadataRequest([])),
                    conn.request(MetadataRequest([])),
                    return_exceptions=True,
                )
                assert isinstance(a, UnknownTopicOrPartitionError) and str(a) == "first"
                assert isinstance(b, LeaderNotAvailableError) and str(b) == "second"
            assert not conn.closed
            await conn.close()

    run(go)


def test_unsupported_version_answer() -> None:
    async def go() -> None:
        async def old(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            cid = await read_request(r)
            w.writelines(encode_error_response(cid, 35, "unknown API version"))
            await w.drain()
            await r.read()

        server, port = await peer(old)
        async with server:
            conn = Connection("127.0.0.1", port)
            with pytest.raises(UnsupportedVersionError, match="unknown API version"):
                await conn.request(MetadataRequest([]))

    run(go)


def test_in_flight_requests_are_bounded() -> None:
    async def go() -> None:
        seen: list[int] = []
        release = asyncio.Event()

        async def slow(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            while True:
                cid = await read_request(r)
                seen.append(cid)
                await release.wait()
                w.writelines(encode_error_response(cid, 5, "later"))
                await w.drain()

        server, port = await peer(slow)
        async with server:
            conn = Connection("127.0.0.1", port, max_in_flight=1)
            tasks = [asyncio.create_task(conn.request(MetadataRequest([]))) for _ in range(3)]
            await asyncio.sleep(0.05)
            assert len(seen) == 1 and conn.in_flight == 3
            release.set()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            assert all(isinstance(x, LeaderNotAvailableError) for x in results)
            assert len(seen) == 3 and conn.in_flight == 0
            await conn.close()

    run(go)


def test_acks_zero_produce_expects_no_answer() -> None:
    async def go() -> None:
        got = asyncio.Event()

        async def mute(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            await read_request(r)
            got.set()
            await r.read()

        server, port = await peer(mute)
        async with server:
            conn = Connection("127.0.0.1", port, request_timeout_ms=1000)
            request = ProduceRequest(acks=0, timeout_ms=1000, topics=[])
            assert await conn.request(request, expect_response=False) is None
            await asyncio.wait_for(got.wait(), 1)
            await conn.close()

    run(go)


def test_a_request_cut_off_while_writing_leaves_no_unretrieved_error() -> None:
    """The request whose write is cut off gets the error raised; its own answer's future is
    not left holding it for asyncio to log as "never retrieved" when collected (on Python
    3.11 that logging, run by the collector inside ``ast.parse``, broke an unrelated test)."""
    logged: list[object] = []

    async def go() -> None:
        asyncio.get_running_loop().set_exception_handler(
            lambda _loop, ctx: logged.append(ctx["message"])
        )
        hang_up = asyncio.Event()

        async def deaf(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            await hang_up.wait()  # never reads: the write fills the socket and waits

        server, port = await peer(deaf)
        async with server:
            conn = Connection("127.0.0.1", port, request_timeout_ms=200)
            big = ProduceRequest(
                acks=1,
                timeout_ms=1000,
                topics=[ProduceTopic("t", [ProducePartition(0, b"x" * (64 << 20))])],
            )
            with pytest.raises(RequestTimedOutError):
                await conn.request(big)
            assert conn.closed
            hang_up.set()

    run(go)
    gc.collect()  # the connection's futures, with the loop gone
    assert logged == []
