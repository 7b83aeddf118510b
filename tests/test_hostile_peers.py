"""Slow and hostile peers against one real agent: the others keep being served.

* Peers that announce huge frames and go quiet hold only what they sent of the request budget,
  are cut off after ``request.frame.timeout.ms``, and never stop the agent from answering
  others — replica fetches included (an acks=all produce needs them).
* Slowloris peers (frames trickled a byte at a time), thousands of idle connections and
  clients that never read their answers leave a well-behaved client's p99 within 2x of its
  p99 without them (plus 1 ms for timer noise at sub-millisecond figures).
* The memory of 3,000 idle connections is given back once they close.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from storage.codec import encode_batch
from storage.protocol import encode_request
from storage.protocol import messages as m
from tests.cluster import AgentHandle, Cluster, WireClient, fetch_request, produce_request
from tests.harness import ProcessGroup, ZooKeeperChroot, rss_bytes

TOPIC = "hostile"
BIG = 64 << 20  # the default socket.request.max.bytes


def _request_bytes(key: int, body: m.Message) -> bytes:
    return b"".join(bytes(p) for p in encode_request(key, 1, "hostile", body))


def _giant_announcement() -> bytes:
    """A frame size of 64 MiB and a real request header, then nothing more."""
    head = _request_bytes(m.ApiKey.API_VERSIONS, m.ApiVersionsRequest())
    return struct.pack("<i", BIG - 4) + head[4:]


async def _open(
    agent: AgentHandle, n: int
) -> list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    conns = []
    for _ in range(n):
        conns.append(await asyncio.wait_for(asyncio.open_connection(agent.host, agent.port), 10))
    return conns


def _close(conns: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]) -> None:
    for _, writer in conns:
        writer.close()


async def _latencies(agent: AgentHandle, n: int) -> list[float]:
    """Seconds per produce (acks=1, one small batch) of a well-behaved client, one at a time."""
    client = await WireClient.connect(agent.host, agent.port)
    batch = encode_batch([b"x" * 100])
    out = []
    try:
        for _ in range(n):
            started = time.perf_counter()
            resp = await client.call(m.ApiKey.PRODUCE, produce_request(TOPIC, 0, batch))
            out.append(time.perf_counter() - started)
            assert resp.topics[0].partitions[0].error_code == 0
    finally:
        await client.close()
    return out


def _p99(samples: list[float]) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


@pytest.fixture
def cluster(
    processes: ProcessGroup, zk_chroot: ZooKeeperChroot, tmp_path: Path
) -> Iterator[Cluster]:
    yield Cluster(processes, zk_chroot, tmp_path / "data")


def test_silent_giant_frames_neither_starve_others_nor_replication(cluster: Cluster) -> None:
    """Eight peers each announce a 64 MiB frame (256 MiB is the whole request budget at the
    default settings: before, four were enough for the agent to answer no one) and go quiet.
    The agent still answers every other client at once, an acks=all produce (which needs the
    follower's fetches through the same server) is acknowledged, and the silent peers are cut
    off after ``request.frame.timeout.ms``."""
    leader = cluster.start_agent(1, "request.frame.timeout.ms=4000")
    cluster.start_agent(2, "request.frame.timeout.ms=4000")
    cluster.create_topic(TOPIC, 1, 2, {"min.insync.replicas": 2})
    parts = cluster.wait_for_leaders(TOPIC)
    leader = cluster.agents[parts[0].leader_id]

    async def run() -> None:
        hostile = await _open(leader, 8)
        for _, writer in hostile:
            writer.write(_giant_announcement())
            await writer.drain()
        try:
            client = await WireClient.connect(leader.host, leader.port)
            try:
                for _ in range(8):
                    await client.call(m.ApiKey.API_VERSIONS, m.ApiVersionsRequest(), wait_s=5)
                request = produce_request(TOPIC, 0, encode_batch([b"replicated"]), acks=-1)
                resp = await client.call(m.ApiKey.PRODUCE, request, wait_s=10)
                assert resp.topics[0].partitions[0].error_code == 0
            finally:
                await client.close()
            # the silent peers are disconnected by the agent (frame timeout 4 s)
            async with asyncio.timeout(20):
                for reader, _ in hostile:
                    with contextlib.suppress(ConnectionError):
                        assert await reader.read() == b""
        finally:
            _close(hostile)

    asyncio.run(run())


class _Attack:
    """Slowloris peers (a 1 MiB frame announced, then trickled at ten bytes a second), idle
    connections, peers that announce 64 MiB and go quiet, and clients that ask for 30 MiB of
    answers they never read."""

    def __init__(self, agent: AgentHandle) -> None:
        self.agent = agent
        self.conns: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self.socks: list[socket.socket] = []
        self.trickler: asyncio.Task[None] | None = None

    async def start(self) -> None:
        agent = self.agent
        idle = await _open(agent, 1000)
        trickling = await _open(agent, 100)
        silent = await _open(agent, 4)
        self.conns = idle + trickling + silent
        fetch = _request_bytes(m.ApiKey.FETCH, fetch_request(TOPIC, 1, 0, max_bytes=1 << 20))
        for _ in range(4):
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect((agent.host, agent.port))
            sock.sendall(fetch * 30)
            self.socks.append(sock)
        for _, writer in silent:
            writer.write(_giant_announcement())
        frame = _request_bytes(m.ApiKey.API_VERSIONS, m.ApiVersionsRequest())
        slow_frame = struct.pack("<i", 1 << 20) + frame[4:]

        async def trickle() -> None:
            for i in range(10_000):
                for _, writer in trickling:
                    writer.write(slow_frame[i % len(slow_frame) : i % len(slow_frame) + 1])
                await asyncio.sleep(0.1)  # ten bytes a second per peer: the pace is the attack

        self.trickler = asyncio.create_task(trickle())

    async def stop(self) -> None:
        if self.trickler is not None:
            self.trickler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.trickler
        _close(self.conns)
        for sock in self.socks:
            sock.close()
        self.conns, self.socks, self.trickler = [], [], None


@pytest.mark.serial
def test_slowloris_idle_and_non_reading_peers_leave_others_p99_within_2x(cluster: Cluster) -> None:
    """A well-behaved producer's p99, in rounds alternated with and without the attack (so the
    machine's own noise falls on both alike), stays within 2x of its p99 without it."""
    agent = cluster.start_agent(1)
    cluster.create_topic(TOPIC, 2, 1)
    cluster.wait_for_leaders(TOPIC)

    async def run() -> tuple[float, float]:
        # 2 MiB in partition 1, for the answers the non-readers will not take
        client = await WireClient.connect(agent.host, agent.port)
        try:
            for _ in range(2):
                batch = encode_batch([bytes(1 << 10)] * 1000)
                await client.call(m.ApiKey.PRODUCE, produce_request(TOPIC, 1, batch))
        finally:
            await client.close()
        await _latencies(agent, 50)  # warm-up
        base: list[float] = []
        attacked: list[float] = []
        # 6 alternated rounds, 720 samples a side: a p99 of 400 (its 4th worst) swung with
        # the machine (CI once saw 1.87 ms alone, 3-4 ms on most runs)
        for _ in range(6):
            base += await _latencies(agent, 120)
            attack = _Attack(agent)
            await attack.start()
            try:
                await asyncio.sleep(0.3)  # the attack settles in: its steady state is measured
                attacked += await _latencies(agent, 120)
            finally:
                await attack.stop()
        return _p99(base), _p99(attacked)

    base, attacked = asyncio.run(run())
    print(f"produce p99: {base * 1000:.2f} ms alone, {attacked * 1000:.2f} ms under attack")
    assert attacked <= 2 * base + 0.001, (base, attacked)


def test_memory_of_idle_connections_is_given_back(cluster: Cluster) -> None:
    """3,000 connections, each answered once (so each has touched its buffers) and then idle;
    once they close, the agent's RSS comes back near where it was (before: ~+220 MiB kept)."""
    agent = cluster.start_agent(1)
    request = _request_bytes(m.ApiKey.API_VERSIONS, m.ApiVersionsRequest())

    async def run() -> tuple[int, int, int]:
        warm = await _open(agent, 100)  # the first connections' one-off costs (imports, caches)
        _close(warm)
        await asyncio.sleep(0.5)  # the closes reach the agent
        before = rss_bytes(agent.process.pid)
        conns = []
        for _ in range(30):
            batch = await _open(agent, 100)
            for _reader, writer in batch:
                writer.write(request)
            for reader, _ in batch:
                size = struct.unpack("<i", await reader.readexactly(4))[0]
                await reader.readexactly(size)
            conns += batch
        during = rss_bytes(agent.process.pid)
        _close(conns)
        deadline = time.monotonic() + 20
        while True:  # the agent notices each close on its own time: poll with a deadline
            after = rss_bytes(agent.process.pid)
            if after - before < 32 << 20 or time.monotonic() > deadline:
                return before, during, after
            await asyncio.sleep(0.2)

    before, during, after = asyncio.run(run())
    mib = 1 << 20
    print(
        f"RSS {before / mib:.0f} MiB, with 3,000 idle {during / mib:.0f}, after {after / mib:.0f}"
    )
    assert after - before < 32 << 20, (before, during, after)
