"""Strata against the physical limits and against the systems users would pick instead.

Run with ``make bench-compare`` (``python -m bench.compare_bench [--write-docs]``; part of
``make bench``). Everything is measured in this run, on loopback, with the same message sizes,
in ``--rounds`` alternated rounds (3 by default; odd rounds run the peers before Strata); each
published figure is the median over the rounds with its min-max range, and each ratio is taken
within a round before its median is taken:

* **limits**: the disk with the WAL's write pattern (1 MiB and 4 KiB appends, an
  ``fdatasync`` after each), dd's one long write for reference, loopback TCP bandwidth (one
  connection, 1 MiB writes);
* **Strata**: produce 100 B / 1 KiB / 10 KiB, tuned for throughput (linger 5 ms, 1 MiB
  batches, 4 MiB requests; per-message ``send`` and bulk ``send_batch``) with acks=1 on one
  agent (``fsync.policy=always``, and ``interval`` at 1 KiB) and acks=all, RF=3 on three
  agents; latency tuned (linger 0) at a fixed moderate rate: produce→ack and produce→consume
  p50/p99/p99.9; consume from the agent's disk and from the object tier (moto S3); agent peak
  RSS under overload;
* **peers** (``bench/peers.py``): NATS JetStream, Redis Streams, RabbitMQ streams — same
  sizes, their usual Python clients, pipelined for throughput and one awaited publish at a
  time for latency; NATS and Redis also with an fsync per write (1 KiB), for the
  same-durability table.

Results: ``bench/results/compare.json`` (medians, ranges and every round), plots under
``docs/img/``, and with ``--write-docs`` the generated section of ``docs/benchmarks.md``
(``--from-json`` renders a saved result again). Each scenario is bounded in time
(``--seconds`` per throughput run) and every child process stops with the benchmark.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import create_topic, publish, save_result, settle_writeback, spread
from bench.peers import (
    Peer,
    PeerUnavailable,
    ensure_installed,
    start_nats,
    start_rabbitmq,
    start_redis,
)
from bench.storage_bench import disk_rates, fsyncs_per_second
from infra.agents import AgentProcess, start_agent
from infra.zookeeper import start_zookeeper
from sdk import Consumer, Producer, TopicPartition
from storage.config import LogConfig

ROOT = Path(__file__).resolve().parent.parent
SIZES = (100, 1024, 10240)
STAMP = struct.Struct(">d")
MiB = 1 << 20
INTERVAL = {"fsync.policy": "interval"}
#: the default ``fsync.interval.ms``, which the interval rows run with
INTERVAL_MS = LogConfig.model_fields["fsync_interval_ms"].default


async def _within(step: Awaitable[Any], seconds: float) -> Any:
    async with asyncio.timeout(seconds):
        return await step


def _count(size: int, scale: float) -> int:
    """Messages per throughput run: ~100 MB of 1 KiB, capped for small/large messages."""
    return int({100: 200_000, 1024: 100_000, 10240: 20_000}[size] * scale)


def _pcts(samples_s: list[float]) -> dict[str, float]:
    if not samples_s:
        return {"count": 0}
    ms = np.array(samples_s) * 1000
    return {
        "count": len(ms),
        "p50_ms": float(np.percentile(ms, 50)),
        "p99_ms": float(np.percentile(ms, 99)),
        "p999_ms": float(np.percentile(ms, 99.9)),
        "max_ms": float(ms.max()),
    }


def _rate(n: int, size: int, seconds: float) -> dict[str, float]:
    return {
        "messages": n,
        "seconds": seconds,
        "msgs_per_s": n / seconds,
        "mb_per_s": n * size / 1e6 / seconds,
    }


# ------------------------------------------------------------------ physical limits


def loopback_mb_per_s(seconds: float = 2.0) -> float:
    """One TCP connection on 127.0.0.1, 1 MiB ``sendall`` calls, receiver in another thread."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    received = [0]

    def sink() -> None:
        conn, _ = server.accept()
        buf = bytearray(MiB)
        with conn:
            while n := conn.recv_into(buf):
                received[0] += n

    thread = threading.Thread(target=sink, daemon=True)
    thread.start()
    chunk = b"\0" * MiB
    with socket.create_connection(("127.0.0.1", port)) as client:
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            client.sendall(chunk)
        client.shutdown(socket.SHUT_WR)
        thread.join(10)
        elapsed = time.perf_counter() - start
    server.close()
    return received[0] / 1e6 / elapsed


def limits(directory: Path) -> dict[str, Any]:
    """The disk measured with the WAL's own write pattern (1 MiB and 4 KiB appends, an
    ``fdatasync`` after each), dd's one long write for reference, and loopback TCP."""
    rates = disk_rates(directory, 512)
    return {
        "append_1mib_mb_per_s": fsyncs_per_second(directory, 2.0, MiB) * MiB / 1e6,
        "disk_fdatasync_mb_per_s": max(rates),
        "disk_runs_mb_per_s": rates,
        "fsyncs_per_s": fsyncs_per_second(directory, 1.0),
        "loopback_mb_per_s": loopback_mb_per_s(),
    }


# ------------------------------------------------------------------ Strata


async def _create_topic(
    zk_connect: str, name: str, partitions: int, rf: int, config: dict[str, Any]
) -> None:
    await create_topic(zk_connect, name, partitions, config, replication_factor=rf)


def _throughput_config(bootstrap: str, acks: int | str) -> dict[str, Any]:
    return {
        "bootstrap.servers": bootstrap,
        "acks": acks,
        "linger.ms": 5,
        "batch.size": MiB,
        "max.request.size": 4 * MiB,  # a partition's queued batches travel together
        "buffer.memory": 256 * MiB,
        "max.in.flight.requests.per.connection": 5,
    }


async def _warm(bootstrap: str, topic: str, partitions: int, acks: int | str) -> None:
    async with Producer({"bootstrap.servers": bootstrap, "acks": acks}) as producer:
        await producer.partitions_for(topic)
        for p in range(partitions):
            await (await producer.send(topic, b"warm-up", partition=p))


async def strata_send(
    bootstrap: str, topic: str, n: int, size: int, acks: int | str, deadline: float
) -> dict[str, float]:
    value = os.urandom(size)
    async with Producer(_throughput_config(bootstrap, acks)) as producer:
        await producer.partitions_for(topic)
        await (await producer.send(topic, value))
        start = time.perf_counter()
        end = start + deadline
        futures = []
        for i in range(n):
            futures.append(await producer.send(topic, value))
            if i & 1023 == 0 and time.perf_counter() > end:
                break
        await producer.flush()
        elapsed = time.perf_counter() - start
        if any(not f.done() or f.exception() is not None for f in futures):
            raise RuntimeError("a Strata send failed")
    return _rate(len(futures), size, elapsed)


async def strata_send_batch(
    bootstrap: str, topic: str, n: int, size: int, acks: int | str, deadline: float
) -> dict[str, float]:
    chunk = max(100, min(1000, MiB // size))
    values = [os.urandom(size)] * chunk
    async with Producer(_throughput_config(bootstrap, acks)) as producer:
        await producer.partitions_for(topic)
        await (await producer.send_batch(topic, values[:1]))
        start = time.perf_counter()
        end = start + deadline
        futures = []
        for _ in range(n // chunk):
            futures.append(await producer.send_batch(topic, values))
            if time.perf_counter() > end:
                break
        await producer.flush()
        elapsed = time.perf_counter() - start
        stored = sum(r.record_count for f in futures for r in f.result())
    return _rate(stored, size, elapsed)


async def _paced(
    rate: int, seconds: float, size: int, send: Callable[[bytes], Awaitable[Awaitable[Any]]]
) -> tuple[list[float], float]:
    """Sends at ``rate``/s for ``seconds``; ``send`` returns an awaitable acknowledgement."""
    acks: list[float] = []
    total = int(rate * seconds)
    pending = []

    async def track(ack: Awaitable[Any], sent: float) -> None:
        await ack
        acks.append(time.perf_counter() - sent)

    start = time.perf_counter()
    for i in range(total):
        delay = start + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        sent = time.perf_counter()
        ack = await send(STAMP.pack(sent) + os.urandom(size - STAMP.size))
        pending.append(asyncio.ensure_future(track(ack, sent)))
    await asyncio.gather(*pending)
    return acks, total / (time.perf_counter() - start)


def _e2e(received: list[float], value: bytes) -> None:
    received.append(time.perf_counter() - STAMP.unpack_from(value)[0])


async def strata_latency(
    bootstrap: str,
    topic: str,
    partitions: int,
    rate: int,
    seconds: float,
    size: int,
    acks: int | str,
    consume: bool,
) -> dict[str, Any]:
    """Paced sends; with ``consume`` a consumer in the same event loop times each arrival."""
    received: list[float] = []
    consumer_config = {
        "bootstrap.servers": bootstrap,
        "auto.offset.reset": "latest",
        "fetch.max.wait.ms": 100,
    }
    async with contextlib.AsyncExitStack() as stack:
        producer = await stack.enter_async_context(
            Producer(
                {"bootstrap.servers": bootstrap, "acks": acks, "linger.ms": 0, "batch.size": MiB}
            )
        )
        await producer.partitions_for(topic)
        stop = asyncio.Event()
        task: asyncio.Task[None] | None = None
        if consume:
            consumer = await stack.enter_async_context(Consumer(consumer_config))
            tps = [TopicPartition(topic, p) for p in range(partitions)]
            consumer.assign(tps)
            consumer.seek_to_end(*tps)
            for tp in tps:
                await consumer.position(tp)

            async def consume_all() -> None:
                while not stop.is_set():
                    for table in (await consumer.getmany_arrow(timeout_ms=100)).values():
                        now = time.perf_counter()
                        for v in table.column("value").to_pylist():
                            received.append(now - STAMP.unpack_from(v)[0])

            task = asyncio.create_task(consume_all())
        acked, achieved = await _paced(rate, seconds, size, lambda v: producer.send(topic, v))
        if task is not None:
            await _drain(received, len(acked))
            stop.set()
            await task
    return {
        "rate": rate,
        "achieved_rate": achieved,
        "ack": _pcts(acked),
        "e2e": _pcts(received),
        "_ack": acked,
        "_e2e": received,
    }


async def strata_consume(
    bootstrap: str, topic: str, partitions: int, size: int, limit_s: float = 60.0
) -> dict[str, float]:
    config = {
        "bootstrap.servers": bootstrap,
        "auto.offset.reset": "earliest",
        "max.partition.fetch.bytes": 8 * MiB,
    }
    async with Consumer(config) as consumer:
        tps = [TopicPartition(topic, p) for p in range(partitions)]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        ends = await consumer.end_offsets(tps)
        expected = sum(ends.values())
        got = 0
        start = time.perf_counter()
        async with asyncio.timeout(limit_s):
            while got < expected:
                for table in (await consumer.getmany_arrow(timeout_ms=500)).values():
                    got += table.num_rows
        elapsed = time.perf_counter() - start
    return _rate(got, size, elapsed)


def _strata_produce_all(
    bootstrap: str,
    zk: str,
    rf: int,
    acks: int | str,
    args: argparse.Namespace,
    tag: str,
    sizes: tuple[int, ...] = SIZES,
    config: dict[str, Any] | None = None,
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for size in sizes:
        topic = f"{tag}-{size}"
        topic_config = ({"min.insync.replicas": 2} if rf == 3 else {}) | (config or {})
        asyncio.run(_create_topic(zk, topic, args.partitions, rf, topic_config))
        asyncio.run(_warm(bootstrap, topic, args.partitions, acks))
        n = _count(size, args.scale)
        settle_writeback(args.dir)
        sent = asyncio.run(strata_send(bootstrap, topic, n, size, acks, args.seconds))
        settle_writeback(args.dir)
        out[str(size)] = {
            "send": sent,
            "send_batch": asyncio.run(
                strata_send_batch(bootstrap, topic, n, size, acks, args.seconds)
            ),
        }
        print(f"strata {tag} {size} B: {out[str(size)]}", flush=True)
    return out


def _rss_kib(pid: int, field: str = "VmRSS") -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _flood(address: str, topic: str, partitions: int, seconds: float, conns: int) -> dict[str, Any]:
    """``bench.overload flood`` in a child process; its JSON line."""
    out = subprocess.run(
        [
            *(sys.executable, "-m", "bench.overload", "flood", address, topic),
            *(str(partitions), str(seconds), str(conns)),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=seconds + 120,
        check=True,
    )
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def overload(
    agent: AgentProcess, bootstrap: str, zk: str, args: argparse.Namespace, sustained: float
) -> dict[str, Any]:
    """The generator's capacity against a discard sink, then the same generator at the agent
    while this process samples the agent's RSS."""
    topic = "overload"
    asyncio.run(_create_topic(zk, topic, args.partitions, 1, {}))
    asyncio.run(_warm(bootstrap, topic, args.partitions, 1))
    sink = subprocess.Popen(
        [sys.executable, "-m", "bench.overload", "sink"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert sink.stdout is not None
        port = int(sink.stdout.readline())
        capacity = _flood(
            f"127.0.0.1:{port}", topic, args.partitions, 3.0, args.overload_connections
        )
    finally:
        sink.kill()
        sink.wait()
        if sink.stdout is not None:
            sink.stdout.close()
    capacity_msgs = capacity["requests"] * 1000 / capacity["seconds"]
    before = _rss_kib(agent.pid)
    samples: list[tuple[float, int]] = []
    done = threading.Event()

    def sample() -> None:
        start = time.perf_counter()
        while not done.is_set():
            samples.append((time.perf_counter() - start, _rss_kib(agent.pid)))
            done.wait(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        run = _flood(
            agent.address, topic, args.partitions, args.overload_seconds, args.overload_connections
        )
    finally:
        done.set()
        sampler.join()
    return {
        "connections": args.overload_connections,
        "seconds": run["seconds"],
        "capacity_msgs_per_s": capacity_msgs,
        "capacity_mb_per_s": capacity["bytes"] / capacity["seconds"] / 1e6,
        "accepted_msgs_per_s": run["requests"] * 1000 / run["seconds"],
        "answers": run["answers"],
        "errors": run["errors"],
        "sustained_msgs_per_s": sustained,
        "overload_factor": capacity_msgs / sustained if sustained else 0.0,
        "rss_before_mib": before / 1024,
        "rss_peak_mib": max([s[1] for s in samples] + [_rss_kib(agent.pid, "VmHWM")]) / 1024,
        "_samples": samples,
    }


def _s3_setup(work: Path) -> tuple[Any, str]:
    from infra.moto_s3 import start_moto

    moto = start_moto(work / "moto")
    import boto3

    bucket = "strata-bench"
    os.environ.update(
        AWS_ENDPOINT_URL=moto.endpoint_url,
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_REGION="us-east-1",
    )
    boto3.client("s3", endpoint_url=moto.endpoint_url).create_bucket(Bucket=bucket)
    return moto, bucket


def tier_consume(work: Path, zk_server: str, args: argparse.Namespace) -> dict[str, Any]:
    """One agent with the object tier: produce, wait until every segment is committed to S3
    (local copies dropped), then consume from the beginning — served from S3 (moto)."""
    from kazoo.client import KazooClient

    from storage.tier import Manifest

    moto, bucket = _s3_setup(work)
    chroot = f"{zk_server}/bench-tier"
    agent = None
    try:
        agent = start_agent(
            9,
            chroot,
            work / "agent-tier",
            configs={
                "s3.bucket": bucket,
                "s3.endpoint.url": moto.endpoint_url,
                "tier.check.interval.ms": 100,
            },
        )
        topic, size = "tiered", 1024
        n = _count(size, args.scale)
        asyncio.run(
            _create_topic(
                chroot,
                topic,
                1,
                1,
                {"segment.bytes": 8 * MiB, "segment.ms": 1000, "local.retention.ms": 0},
            )
        )
        asyncio.run(_warm(agent.address, topic, 1, 1))
        asyncio.run(strata_send_batch(agent.address, topic, n, size, 1, args.seconds * 4))
        zk = KazooClient(hosts=chroot, timeout=10)
        zk.start(timeout=10)
        try:
            end_offset = asyncio.run(_end_offset(agent.address, topic))
            deadline = time.monotonic() + 120
            while True:
                try:
                    manifest = Manifest.decode(zk.get(f"/topics/{topic}/partitions/0/segments")[0])
                except Exception:
                    manifest = Manifest()
                if manifest.end >= end_offset or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
        finally:
            zk.stop()
            zk.close()
        result = asyncio.run(strata_consume(agent.address, topic, 1, size, limit_s=180))
        result["tiered_offsets"] = manifest.end
        result["end_offset"] = end_offset
        return result
    finally:
        if agent is not None:
            agent.stop()
        moto.stop()


async def _end_offset(bootstrap: str, topic: str) -> int:
    async with Consumer({"bootstrap.servers": bootstrap}) as consumer:
        tp = TopicPartition(topic, 0)
        return (await consumer.end_offsets([tp]))[tp]


# ------------------------------------------------------------------ peers


class NatsPeer:
    name = "NATS JetStream"

    def __init__(self, peer: Peer) -> None:
        self.url = f"nats://127.0.0.1:{peer.port}"

    async def __aenter__(self) -> NatsPeer:
        import nats
        from nats.js.api import StorageType

        self.nc = await nats.connect(self.url, max_reconnect_attempts=1)
        self.js = self.nc.jetstream(publish_async_max_pending=4000)
        for size in SIZES:
            await self.js.add_stream(
                name=f"B{size}", subjects=[f"bench.{size}"], storage=StorageType.FILE
            )
        await self.js.add_stream(name="LAT", subjects=["lat"], storage=StorageType.FILE)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.nc.close()

    async def produce(self, n: int, size: int, deadline: float) -> dict[str, float]:
        value, subject = os.urandom(size), f"bench.{size}"
        start = time.perf_counter()
        sent = 0
        while sent < n and time.perf_counter() - start < deadline:
            futures = [await self.js.publish_async(subject, value) for _ in range(1000)]
            sent += len(futures)
        await self.js.publish_async_completed()
        return _rate(sent, size, time.perf_counter() - start)

    async def consume(self, size: int) -> dict[str, float]:
        from nats.js.api import AckPolicy, ConsumerConfig

        info = await self.js.stream_info(f"B{size}")
        expected = info.state.messages
        sub = await self.js.pull_subscribe(
            f"bench.{size}", durable="reader", config=ConsumerConfig(ack_policy=AckPolicy.NONE)
        )
        got = 0
        start = time.perf_counter()
        async with asyncio.timeout(60):
            while got < expected:
                got += len(await sub.fetch(1000, timeout=5))
        return _rate(got, size, time.perf_counter() - start)

    async def latency(self, rate: int, seconds: float, size: int, consume: bool) -> dict[str, Any]:
        from nats.js.api import DeliverPolicy

        received: list[float] = []

        async def on_msg(msg: Any) -> None:
            _e2e(received, msg.data)

        sub = None
        if consume:
            sub = await self.js.subscribe(
                "lat", cb=on_msg, ordered_consumer=True, deliver_policy=DeliverPolicy.NEW
            )

        async def send(v: bytes) -> Awaitable[Any]:
            return self.js.publish("lat", v)

        acked, achieved = await _paced(rate, seconds, size, send)
        if sub is not None:
            await _drain(received, len(acked))
            await sub.unsubscribe()
        return {
            "rate": rate,
            "achieved_rate": achieved,
            "ack": _pcts(acked),
            "e2e": _pcts(received),
            "_ack": acked,
            "_e2e": received,
        }


async def _drain(received: list[float], expected: int) -> None:
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(10):
            while len(received) < expected:  # noqa: ASYNC110 - counters bumped by client callbacks
                await asyncio.sleep(0.05)


class RedisPeer:
    name = "Redis Streams"

    def __init__(self, peer: Peer) -> None:
        self.port = peer.port

    async def __aenter__(self) -> RedisPeer:
        import redis.asyncio as aioredis

        # paced latency sends run concurrently and each takes a pooled connection: wait for
        # one (bounded) instead of failing with MaxConnectionsError when Redis lags
        pool = aioredis.BlockingConnectionPool(
            host="127.0.0.1", port=self.port, socket_timeout=10, max_connections=64, timeout=10
        )
        self.r = aioredis.Redis(connection_pool=pool)
        self.r2 = aioredis.Redis(host="127.0.0.1", port=self.port, socket_timeout=10)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.r.aclose()
        await self.r2.aclose()

    async def produce(self, n: int, size: int, deadline: float) -> dict[str, float]:
        value, key = os.urandom(size), f"bench-{size}"
        start = time.perf_counter()
        sent = 0
        while sent < n and time.perf_counter() - start < deadline:
            pipe = self.r.pipeline(transaction=False)
            for _ in range(1000):
                pipe.xadd(key, {"v": value})
            sent += len(await pipe.execute())
        return _rate(sent, size, time.perf_counter() - start)

    async def consume(self, size: int) -> dict[str, float]:
        key = f"bench-{size}"
        expected = await self.r.xlen(key)
        got, last = 0, "0-0"
        start = time.perf_counter()
        async with asyncio.timeout(60):
            while got < expected:
                reply: Any = await self.r.xread({key: last}, count=1000)
                entries = reply[0][1]
                got += len(entries)
                last = entries[-1][0]
        return _rate(got, size, time.perf_counter() - start)

    async def latency(self, rate: int, seconds: float, size: int, consume: bool) -> dict[str, Any]:
        received: list[float] = []
        stop = asyncio.Event()

        async def consume_all() -> None:
            last = "$"
            while not stop.is_set():
                reply: Any = await self.r2.xread({"lat": last}, count=1000, block=100)
                for _, entries in reply:
                    for entry_id, fields in entries:
                        _e2e(received, fields[b"v"])
                        last = entry_id

        task = asyncio.create_task(consume_all()) if consume else None
        await asyncio.sleep(0.2)

        async def send(v: bytes) -> Awaitable[Any]:
            return self.r.xadd("lat", {"v": v})

        acked, achieved = await _paced(rate, seconds, size, send)
        if task is not None:
            await _drain(received, len(acked))
            stop.set()
            await task
        return {
            "rate": rate,
            "achieved_rate": achieved,
            "ack": _pcts(acked),
            "e2e": _pcts(received),
            "_ack": acked,
            "_e2e": received,
        }


class RabbitPeer:
    name = "RabbitMQ streams"

    def __init__(self, peer: Peer) -> None:
        self.port = peer.port
        self.produced: dict[int, int] = {}

    async def __aenter__(self) -> RabbitPeer:
        import rstream

        self.producer = rstream.Producer("127.0.0.1", self.port, username="guest", password="guest")
        await self.producer.start()
        for size in SIZES:
            await self.producer.create_stream(f"bench-{size}", exists_ok=True)
        await self.producer.create_stream("lat", exists_ok=True)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.producer.close()

    async def produce(self, n: int, size: int, deadline: float) -> dict[str, float]:
        stream = f"bench-{size}"
        chunk = max(1, min(1000, (MiB // 2) // size))
        batch = [os.urandom(size)] * chunk
        confirmed = [0]

        def on_confirm(status: Any) -> None:
            confirmed[0] += 1

        start = time.perf_counter()
        sent = 0
        while sent < n and time.perf_counter() - start < deadline:
            await self.producer.send_batch(stream, batch, on_publish_confirm=on_confirm)
            sent += chunk
            while sent - confirmed[0] > 20_000:  # bounded in flight  # noqa: ASYNC110 - counters bumped by client callbacks
                await asyncio.sleep(0.001)
        async with asyncio.timeout(60):
            while confirmed[0] < sent:  # noqa: ASYNC110 - counters bumped by client callbacks
                await asyncio.sleep(0.001)
        return _rate(sent, size, time.perf_counter() - start)

    async def consume(self, size: int) -> dict[str, float]:
        import rstream

        stream = f"bench-{size}"
        expected = self.produced.get(size, 0)
        got = [0]
        done = asyncio.Event()

        def on_message(msg: Any, ctx: Any) -> None:
            got[0] += 1
            if got[0] >= expected:
                done.set()

        consumer = rstream.Consumer("127.0.0.1", self.port, username="guest", password="guest")
        await consumer.start()
        start = time.perf_counter()
        await consumer.subscribe(
            stream,
            on_message,
            offset_specification=rstream.ConsumerOffsetSpecification(
                rstream.OffsetType.FIRST, None
            ),
            initial_credit=50,
        )
        try:
            async with asyncio.timeout(60):
                await done.wait()
        finally:
            elapsed = time.perf_counter() - start
            await consumer.close()
        return _rate(got[0], size, elapsed)

    async def latency(self, rate: int, seconds: float, size: int, consume: bool) -> dict[str, Any]:
        import rstream

        received: list[float] = []
        consumer = None
        if consume:
            consumer = rstream.Consumer("127.0.0.1", self.port, username="guest", password="guest")
            await consumer.start()
            await consumer.subscribe(
                "lat",
                lambda msg, ctx: _e2e(received, bytes(msg)),
                offset_specification=rstream.ConsumerOffsetSpecification(
                    rstream.OffsetType.NEXT, None
                ),
            )
            await asyncio.sleep(0.2)

        async def send(v: bytes) -> Awaitable[Any]:
            return self.producer.send_wait("lat", v)

        acked, achieved = await _paced(rate, seconds, size, send)
        if consumer is not None:
            await _drain(received, len(acked))
            await consumer.close()
        return {
            "rate": rate,
            "achieved_rate": achieved,
            "ack": _pcts(acked),
            "e2e": _pcts(received),
            "_ack": acked,
            "_e2e": received,
        }


async def run_peer(
    client: Any, args: argparse.Namespace, sizes: tuple[int, ...] = SIZES, consume: bool = True
) -> dict[str, Any]:
    out: dict[str, Any] = {"produce": {}}
    async with client:
        for size in sizes:
            settle_writeback(args.dir)
            r = await client.produce(_count(size, args.scale), size, args.seconds)
            if isinstance(client, RabbitPeer):
                client.produced[size] = r["messages"]
            out["produce"][str(size)] = r
            print(f"{client.name} {size} B: {r}", flush=True)
        if consume:
            out["consume"] = await client.consume(1024)
        settle_writeback(args.dir)
        out["latency"] = _latency_pair(
            await client.latency(args.rate, args.latency_seconds, 1024, consume=False),
            await client.latency(args.rate, args.latency_seconds, 1024, consume=True),
        )
    return out


# ------------------------------------------------------------------ report


def _strata_latency_pair(
    bootstrap: str, args: argparse.Namespace, acks: int | str, topic: str = "lat"
) -> dict[str, Any]:
    runs = [
        asyncio.run(
            strata_latency(
                bootstrap,
                topic,
                args.partitions,
                args.rate,
                args.latency_seconds,
                1024,
                acks,
                consume,
            )
        )
        for consume in (False, True)
    ]
    return _latency_pair(*runs)


def _latency_pair(alone: dict[str, Any], with_consumer: dict[str, Any]) -> dict[str, Any]:
    """One latency result from two paced runs: produce→ack timed with nothing else in the
    client process, produce→consume (and ack, for reference) with a consumer in the same
    event loop, which delays the producer's own acknowledgements."""
    return {
        "rate": alone["rate"],
        "achieved_rate": alone["achieved_rate"],
        "ack": alone["ack"],
        "ack_with_consumer": with_consumer["ack"],
        "e2e": with_consumer["e2e"],
        "_ack": alone["_ack"],
        "_e2e": with_consumer["_e2e"],
    }


def _p99(latency: dict[str, Any]) -> str:
    return f"{latency.get('ack_with_consumer', {}).get('p99_ms', float('nan')):.2f}"


def _strip(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _strip(v) for k, v in obj.items() if not k.startswith("_")}
    return obj


def plots(r: dict[str, Any], img: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    img.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    series = {
        "Strata acks=1 send_batch": [
            r["strata_acks1"][str(s)]["send_batch"]["mb_per_s"] for s in SIZES
        ],
        "Strata acks=1 send": [r["strata_acks1"][str(s)]["send"]["mb_per_s"] for s in SIZES],
        "Strata acks=all RF=3 send_batch": [
            r["strata_acksall"][str(s)]["send_batch"]["mb_per_s"] for s in SIZES
        ],
    }
    for name, peer in r["peers"].items():
        if "produce" in peer:
            series[name] = [peer["produce"][str(s)]["mb_per_s"] for s in SIZES]
    for name, ys in series.items():
        ax.plot(SIZES, ys, marker="o", label=name)
    ax.axhline(
        r["limits"]["append_1mib_mb_per_s"],
        color="k",
        ls="--",
        label="disk: 1 MiB appends, fdatasync each",
    )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xticks(SIZES, ["100 B", "1 KiB", "10 KiB"])
    ax.set_xlabel("message size")
    ax.set_ylabel("produce throughput, MB/s (log)")
    ax.set_title("Produce throughput by message size (one producer process)")
    ax.legend(fontsize=7)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(img / "bench-throughput.png", dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2), sharey=True)
    lat = {
        "Strata acks=1": r["_lat"]["strata_acks1"],
        "Strata acks=all RF=3": r["_lat"]["strata_acksall"],
    }
    lat |= {name: peer["_latency"] for name, peer in r["_peers_raw"].items()}
    for ax, kind, title in (
        (axes[0], "_ack", "produce → ack"),
        (axes[1], "_e2e", "produce → consume"),
    ):
        for name, data in lat.items():
            xs = np.sort(np.array(data[kind]) * 1000)
            if len(xs):
                ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=name)
        ax.set_xscale("log")
        ax.set_xlabel("latency, ms (log)")
        ax.set_title(f"{title}, 1 KiB at {r['rate']:,} msgs/s")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("fraction of messages")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(img / "bench-latency-cdf.png", dpi=110)
    plt.close(fig)
    return ["img/bench-throughput.png", "img/bench-latency-cdf.png"]


def _get(tree: Any, *path: str) -> Any:
    for key in path:
        if not isinstance(tree, dict) or key not in tree:
            return None
        tree = tree[key]
    return tree


def _spread(values: list[float], fmt: str = "{:,.0f}") -> str:
    """``median (min-max)`` of per-round values."""
    if not values:
        return "n/a"
    s = spread(values)
    if len(values) == 1:
        return fmt.format(s["median"])
    return f"{fmt.format(s['median'])} ({fmt.format(s['min'])}-{fmt.format(s['max'])})"


def _per_round(rounds: list[dict[str, Any]], a: tuple[str, ...], b: tuple[str, ...]) -> list[float]:
    """``a ÷ b`` within each round that has both: a ratio is taken inside one run."""
    out = []
    for r in rounds:
        x, y = _get(r, *a), _get(r, *b)
        if isinstance(x, int | float) and isinstance(y, int | float) and y:
            out.append(x / y)
    return out


def _values(rounds: list[dict[str, Any]], *path: str) -> list[float]:
    return _numbers([_get(r, *path) for r in rounds])


#: what an acknowledgement means for each row of the throughput and latency tables
DURABILITY = {
    "Strata acks=all": "fsync (group commit) on every in-sync replica",
    "interval": f"in the page cache; fsync within {INTERVAL_MS} ms",
    "Strata": "fsync (group commit) before the ack",
    "fsync per write": "fsync per write before the ack",
    "NATS JetStream": "in the page cache; fsync every 2 min",
    "Redis Streams": "in the page cache; AOF fsync once a second",
    "RabbitMQ streams": "in the page cache; fsync left to the OS",
}


def _durability(row: str) -> str:
    """The first entry of ``DURABILITY`` whose key the row's name contains."""
    return next((text for key, text in DURABILITY.items() if key in row), "")


def same_durability(r: dict[str, Any]) -> list[str]:
    """Strata against each peer at the same durability: fsync before the acknowledgement, and
    no fsync before it. Each ratio is taken within a round; the cell is its median (range)."""
    rounds = r["rounds"]
    k1 = ("1024",)
    classes = [
        (
            "fsync before the ack",
            ("strata_acks1",),
            ("lat_strata_acks1",),
            "Strata acks=1, `fsync.policy=always`",
            "peers_durable",
            {"NATS JetStream": "`sync_interval: always`", "Redis Streams": "`appendfsync always`"},
        ),
        (
            "no fsync before the ack",
            ("strata_acks1_interval",),
            ("lat_strata_acks1_interval",),
            f"Strata acks=1, `fsync.policy=interval` (an fsync every {INTERVAL_MS} ms by default)",
            "peers",
            {
                "NATS JetStream": "`sync_interval` 2 min (default)",
                "Redis Streams": "`appendfsync everysec`",
                "RabbitMQ streams": "written to the segment file, fsync left to the OS",
            },
        ),
    ]
    lines = [
        "**Same durability** (1 KiB, one producer process; each cell the median over the rounds"
        " with its range; each ratio taken within a round, then the median): throughput with"
        " each system's fastest publishing API (Strata `send_batch`; the peers' pipelined"
        " publishes) and with Strata's per-message `send`; produce→ack p99 at"
        f" {r['rate']:,} msgs/s with one awaited publish at a time (Strata linger 0).",
        "",
        "| durability at the ack | system | setting | msgs/s | Strata `send_batch` ÷ it | Strata `send` ÷ it | ack p99 ms | its p99 ÷ Strata's |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for label, strata, strata_lat, strata_name, group, settings in classes:
        batch = (*strata, *k1, "send_batch", "msgs_per_s")
        send = (*strata, *k1, "send", "msgs_per_s")
        p99 = (*strata_lat, "ack", "p99_ms")
        lines.append(
            f"| {label} | **{strata_name}** | | {_spread(_values(rounds, *batch))} | 1.00x | "
            f"{_spread(_per_round(rounds, send, batch), '{:.2f}x')} | "
            f"{_spread(_values(rounds, *p99), '{:.2f}')} | 1.00x |"
        )
        for name, setting in settings.items():
            peer = (group, name, "produce", *k1, "msgs_per_s")
            peer_p99 = (group, name, "latency", "ack", "p99_ms")
            if not _values(rounds, *peer):
                error = _get(r, group, name, "error") or "not run (`--peers`)"
                lines.append(f"| {label} | {name} | {setting} | not measured: {error} |||||")
                continue
            lines.append(
                f"| {label} | {name} | {setting} | {_spread(_values(rounds, *peer))} | "
                f"{_spread(_per_round(rounds, batch, peer), '{:.2f}x')} | "
                f"{_spread(_per_round(rounds, send, peer), '{:.2f}x')} | "
                f"{_spread(_values(rounds, *peer_p99), '{:.2f}')} | "
                f"{_spread(_per_round(rounds, peer_p99, p99), '{:.2f}x')} |"
            )
    lines += [
        "",
        "RabbitMQ streams have no setting that fsyncs before the confirm, so they appear only"
        " in the second class. In the first class every system pays an fsync per acknowledged"
        " write (Strata one per group commit, shared by every batch in it).",
    ]
    return lines


def render(r: dict[str, Any]) -> str:
    lim = r["limits"]
    rounds = r["rounds"]
    disk = lim["append_1mib_mb_per_s"]
    peers = {k: v for k, v in r["peers"].items() if "produce" in v}
    lines = [
        "<!-- compare-bench:begin (generated by `make bench-compare`; do not edit by hand) -->",
        f"Measured {r['date']} on {r['machine']} with `{r['command']}` (about {r['elapsed_s'] / 60:.0f} min):"
        f" **{len(rounds)} rounds**, alternated (odd rounds run the peers first). Every figure"
        " is the median over the rounds; where a range is shown it is min-max."
        + (
            " **Shared machine**: other engineers' test suites ran at the same time, so absolute figures are low and noisy; the ratios within one run are what to read."
            if r.get("shared")
            else ""
        ),
        "",
        "**Physical limits** (same run, the WAL's write pattern): 1 MiB appends with an"
        f" fdatasync after each **{_spread(_values(rounds, 'limits', 'append_1mib_mb_per_s'))} MB/s**;"
        f" 4 KiB appends with an fdatasync after each **{_spread(_values(rounds, 'limits', 'fsyncs_per_s'))}"
        f" per second**; for reference, dd of 512 MiB with one fdatasync at the end"
        f" {_spread(_values(rounds, 'limits', 'disk_fdatasync_mb_per_s'))} MB/s (best of 3 per"
        f" round); loopback TCP {_spread(_values(rounds, 'limits', 'loopback_mb_per_s'))} MB/s"
        " (one connection).",
        "",
        "**Produce throughput** (one producer process; Strata topics have "
        f"{r['partitions']} partitions, `fsync.policy=always` unless the row says otherwise;"
        " linger 5 ms, 1 MiB batches, 4 MiB requests; peers in their usual settings, see the"
        " same-durability table below for the others):",
        "",
        "| system | durability at the ack | 100 B msgs/s | 100 B MB/s | 1 KiB msgs/s | 1 KiB range | 1 KiB MB/s | 10 KiB msgs/s | 10 KiB MB/s | 1 KiB ÷ disk (1 MiB appends) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def row(name: str, cells: dict[str, Any], path_1k: tuple[str, ...]) -> str:
        """``path_1k``: where a round keeps this row's 1 KiB figures (for the range)."""
        parts = [f"| {name} | {_durability(name)} "]
        for s in SIZES:
            c = cells.get(str(s))
            if c is None:
                parts.append("| — | — " + ("| — " if s == 1024 else ""))
                continue
            parts.append(f"| {c['msgs_per_s']:,.0f} ")
            if s == 1024:
                values = _values(rounds, *path_1k, "msgs_per_s")
                parts.append(f"| {min(values):,.0f}-{max(values):,.0f} ")
            parts.append(f"| {c['mb_per_s']:,.1f} ")
        parts.append(f"| {cells['1024']['mb_per_s'] / disk:.3f} |")
        return "".join(parts)

    strata_rows = [
        ("Strata acks=1, `send_batch`", "strata_acks1", "send_batch"),
        ("Strata acks=1, per-message `send`", "strata_acks1", "send"),
        (
            "Strata acks=1, `fsync.policy=interval`, `send_batch`",
            "strata_acks1_interval",
            "send_batch",
        ),
        ("Strata acks=1, `fsync.policy=interval`, `send`", "strata_acks1_interval", "send"),
        ("Strata acks=all RF=3 (3 agents), `send_batch`", "strata_acksall", "send_batch"),
        ("Strata acks=all RF=3 (3 agents), `send`", "strata_acksall", "send"),
    ]
    for name, key, api in strata_rows:
        lines.append(row(name, {k: v[api] for k, v in r[key].items()}, (key, "1024", api)))
    for name, p in peers.items():
        lines.append(row(name, p["produce"], ("peers", name, "produce", "1024")))
    for name, p in r["peers"].items():
        if "error" in p and "produce" not in p:
            lines.append(f"| {name} | | not measured: {p['error']} ||||||||")
    best = ("strata_acks1", "1024", "send_batch", "mb_per_s")
    one = ("strata_acks1", "1024", "send", "mb_per_s")
    to_disk = _per_round(rounds, best, ("limits", "append_1mib_mb_per_s"))
    met = "met" if to_disk and float(np.median(to_disk)) >= 0.5 else "**missed**"
    lines += [
        "",
        "**Ratios at 1 KiB, acks=1** (Strata `send_batch` / per-message `send`; each taken"
        " within a round, median (range)):",
        "",
        f"* Strata ÷ disk (1 MiB appends, fdatasync each): **{_spread(to_disk, '{:.3f}')}** /"
        f" {_spread(_per_round(rounds, one, ('limits', 'append_1mib_mb_per_s')), '{:.3f}')}"
        f" (target ≥ 0.5: {met})",
    ]
    for name in peers:
        peer = ("peers", name, "produce", "1024", "mb_per_s")
        ratios = _per_round(rounds, best, peer)
        ok = "met" if ratios and float(np.median(ratios)) >= 2 else "**missed**"
        lines.append(
            f"* Strata ÷ {name} (its usual setting): **{_spread(ratios, '{:.2f}x')}** /"
            f" {_spread(_per_round(rounds, one, peer), '{:.2f}x')} (target ≥ 2x: {ok} with"
            " `send_batch`)"
        )
    lines += ["", *same_durability(r)]
    lat_rows: list[tuple[str, tuple[str, ...]]] = [
        ("Strata acks=1 (1 agent), `always`", ("lat_strata_acks1",)),
        ("Strata acks=1 (1 agent), `interval`", ("lat_strata_acks1_interval",)),
        ("Strata acks=all, RF=3 (3 agents), `always`", ("lat_strata_acksall",)),
    ]
    lat_rows += [(name, ("peers", name, "latency")) for name in peers]
    lat_rows += [
        (f"{name}, fsync per write", ("peers_durable", name, "latency"))
        for name, p in r["peers_durable"].items()
        if "latency" in p
    ]
    lines += [
        "",
        f"**Latency** at a fixed {r['rate']:,} msgs/s of 1 KiB for {r['latency_seconds']:g} s, tuned for latency (Strata linger 0; peers: one awaited publish per message), ms. Two paced runs per system: *ack* with nothing else in the client process; *consume* (and *ack with consumer*) with a consumer in the producer's event loop. The fsync-per-write peers ran both latency runs at 1 KiB (their other sizes and consume throughput are not measured):",
        "",
        "| system | durability at the ack | ack p50 | ack p99 (range) | ack p99.9 | consume p50 | consume p99 | consume p99.9 | ack with consumer p50 / p99 | achieved msgs/s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    nan = float("nan")
    for name, path in lat_rows:
        lt = _get(r, *path)
        a, e, ac = lt["ack"], lt.get("e2e", {}), lt.get("ack_with_consumer", {})
        p99 = _spread(_values(rounds, *path, "ack", "p99_ms"), "{:.2f}")
        lines.append(
            f"| {name} | {_durability(name)} | {a['p50_ms']:.2f} | {p99} | {a['p999_ms']:.2f} | "
            f"{e.get('p50_ms', nan):.2f} | {e.get('p99_ms', nan):.2f} | {e.get('p999_ms', nan):.2f} | "
            f"{ac.get('p50_ms', nan):.2f} / {ac.get('p99_ms', nan):.2f} | {lt['achieved_rate']:,.0f} |"
        )
    p1 = r["lat_strata_acks1"]["ack"]["p99_ms"]
    pi = r["lat_strata_acks1_interval"]["ack"]["p99_ms"]
    pa = r["lat_strata_acksall"]["ack"]["p99_ms"]
    lines += [
        "",
        f"Targets of the latency issue (#27): p99 produce→ack ≤ 1.0 ms with acks=1:"
        f" `always` {'met' if p1 <= 1 else '**missed**'} ({p1:.2f} ms), `interval`"
        f" {'met' if pi <= 1 else '**missed**'} ({pi:.2f} ms); ≤ 5 ms with acks=all, RF=3:"
        f" {'met' if pa <= 5 else '**missed**'} ({pa:.2f} ms). The floors on this machine,"
        ' measured in one run with the latency rows, are in "End-to-end latency" below'
        " (`make bench-latency`). With a consumer in the producer's event loop:"
        f" {_p99(r['lat_strata_acks1'])} and {_p99(r['lat_strata_acksall'])} ms.",
        "",
        "**Consume** (1 KiB messages, from the beginning, one consumer):",
        "",
        "| source | msgs/s | ÷ Strata from disk |",
        "|---|---:|---:|",
    ]
    rows_c: list[tuple[str, tuple[str, ...]]] = [("Strata, agent's disk", ("consume_disk",))]
    tier = r.get("consume_tier", {})
    if "msgs_per_s" in tier:
        rows_c.append(
            (
                f"Strata, object tier (moto S3; {tier['tiered_offsets']:,.0f} of {tier['end_offset']:,.0f} offsets tiered, local copies dropped)",
                ("consume_tier",),
            )
        )
    rows_c += [(name, ("peers", name, "consume")) for name, p in peers.items() if "consume" in p]
    for name, path in rows_c:
        lines.append(
            f"| {name} | {_spread(_values(rounds, *path, 'msgs_per_s'))} | "
            f"{_spread(_per_round(rounds, (*path, 'msgs_per_s'), ('consume_disk', 'msgs_per_s')), '{:.2f}')} |"
        )
    if "error" in tier and "msgs_per_s" not in tier:
        lines.append(f"| Strata, object tier | not measured: {tier['error']} ||")
    ov = r["overload"]
    ok = "met" if ov["rss_peak_mib"] <= 1024 else "**missed**"
    lines += [
        "",
        f"**Overload**: a load generator (`bench/overload.py`: {ov['connections']:.0f} connections, one"
        " pre-encoded acks=1 produce request of 1,000 x 1 KiB replayed back to back, blocking"
        f" `sendall` per connection) offers **{ov['capacity_mb_per_s']:,.0f} MB/s** when pointed"
        f" at a discard sink in the same run = **{ov['overload_factor']:.1f}x** the acks=1 rate"
        f" the agent sustained ({ov['sustained_msgs_per_s']:,.0f} msgs/s). Pointed at one agent"
        f" for {ov['seconds']:.0f} s, the agent took {ov['accepted_msgs_per_s']:,.0f} msgs/s"
        f" ({ov['answers']:,.0f} answers, {ov['errors']:,.0f} errors) and held the rest back through"
        " TCP (`queued.max.request.bytes`, 256 MiB by default, bounds what it has read and not"
        f" handled); agent RSS {ov['rss_before_mib']:,.0f} MiB before, peak"
        f" **{_spread(_values(rounds, 'overload', 'rss_peak_mib'))} MiB** (target ≤ 1 GiB: {ok}).",
        "",
        "![produce throughput by message size](img/bench-throughput.png)",
        "",
        "![latency CDFs](img/bench-latency-cdf.png)",
        "<!-- compare-bench:end -->",
    ]
    return "\n".join(lines)


# ------------------------------------------------------------------ main


#: peers with a setting that fsyncs before the acknowledgement (``bench/peers.py``)
DURABLE_PEERS = ("nats", "redis")


def _strata_round(r: dict[str, Any], work: Path, args: argparse.Namespace) -> None:
    """Strata's rows of one round: acks=1 on one agent (``always`` at every size, ``interval``
    at 1 KiB), latency, consume, overload; acks=all RF=3 on three agents; the object tier."""
    zk = start_zookeeper(work / "zookeeper")
    agents: list[AgentProcess] = []
    try:
        # ---- acks=1, one agent
        connect = f"{zk.connect_string}/bench-one"
        agents.append(start_agent(1, connect, work / "agent-1"))
        boot = agents[0].address
        r["strata_acks1"] = _strata_produce_all(boot, connect, 1, 1, args, "a1")
        r["strata_acks1_interval"] = _strata_produce_all(
            boot, connect, 1, 1, args, "i1", sizes=(1024,), config=INTERVAL
        )
        for topic, config in (("lat", {}), ("lat-i", INTERVAL)):
            asyncio.run(_create_topic(connect, topic, args.partitions, 1, config))
            asyncio.run(_warm(boot, topic, args.partitions, 1))
        for key, topic in (("strata_acks1", "lat"), ("strata_acks1_interval", "lat-i")):
            settle_writeback(args.dir)
            lat = _strata_latency_pair(boot, args, 1, topic)
            r["_lat"][key] = lat
            r[f"lat_{key}"] = _strip(lat)
            print(f"strata latency {key}:", r[f"lat_{key}"], flush=True)
        r["consume_disk"] = asyncio.run(strata_consume(boot, "a1-1024", args.partitions, 1024))
        print("consume:", r["consume_disk"], flush=True)
        sustained = r["strata_acks1"]["1024"]["send_batch"]["msgs_per_s"]
        r["overload"] = _strip(overload(agents[0], boot, connect, args, sustained))
        print("overload:", r["overload"], flush=True)
        agents[0].stop()
        agents.clear()
        # ---- acks=all, RF=3, three agents
        connect = f"{zk.connect_string}/bench-three"
        agents = [start_agent(i, connect, work / f"agent3-{i}") for i in (1, 2, 3)]
        boot = ",".join(a.address for a in agents)
        r["strata_acksall"] = _strata_produce_all(boot, connect, 3, "all", args, "aa")
        asyncio.run(_create_topic(connect, "lat", args.partitions, 3, {"min.insync.replicas": 2}))
        asyncio.run(_warm(boot, "lat", args.partitions, "all"))
        settle_writeback(args.dir)
        lat = _strata_latency_pair(boot, args, "all")
        r["_lat"]["strata_acksall"] = lat
        r["lat_strata_acksall"] = _strip(lat)
        print("strata latency acks=all:", r["lat_strata_acksall"], flush=True)
        for a in agents:
            a.stop()
        agents.clear()
        # ---- object tier
        try:
            r["consume_tier"] = tier_consume(work, zk.connect_string, args)
        except Exception as exc:  # reported, not fatal: the rest of the run still counts
            r["consume_tier"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        print("tier consume:", r["consume_tier"], flush=True)
    finally:
        for a in agents:
            a.stop()
        zk.stop()


def _peers_round(r: dict[str, Any], work: Path, args: argparse.Namespace) -> None:
    """Each peer's rows of one round: its usual setting at every size, with consume and
    latency; its fsync-per-write setting (where it has one) at 1 KiB with latency."""
    problems = ensure_installed()
    starters: dict[str, tuple[Callable[..., Peer], Any]] = {
        "nats": (start_nats, NatsPeer),
        "redis": (start_redis, RedisPeer),
        "rabbitmq": (start_rabbitmq, RabbitPeer),
    }
    packages = {"nats": "nats-server", "redis": "redis-server", "rabbitmq": "rabbitmq-server"}
    for key in args.peers.split(","):
        start, client = starters[key]
        for durable in (False, True) if key in DURABLE_PEERS else (False,):
            into = r["peers_durable" if durable else "peers"]
            if packages[key] in problems:
                into[client.name] = {"error": problems[packages[key]]}
                continue
            directory = work / f"{key}-{int(durable)}"
            try:
                peer = start(directory, durable=True) if durable else start(directory)
            except PeerUnavailable as exc:
                into[client.name] = {"error": str(exc).splitlines()[0][:300]}
                continue
            sizes, consume = ((1024,), False) if durable else (SIZES, True)
            try:
                run = run_peer(client(peer), args, sizes, consume)
                raw = asyncio.run(_within(run, 300))
                if not durable:
                    r["_peers_raw"][client.name] = {"_latency": raw["latency"]}
                into[client.name] = _strip(raw)
            except Exception as exc:
                into[client.name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            finally:
                peer.stop()
            print(client.name, "durable" if durable else "usual", into[client.name], flush=True)


def one_round(work: Path, args: argparse.Namespace, index: int) -> dict[str, Any]:
    """Every figure once. Odd rounds run the peers before Strata, so that neither side always
    meets the disk and page cache the other left behind."""
    r: dict[str, Any] = {"peers": {}, "peers_durable": {}, "_lat": {}, "_peers_raw": {}}
    r["limits"] = limits(work)
    print(f"round {index + 1} limits:", r["limits"], flush=True)
    parts: list[tuple[Callable[[dict[str, Any], Path, argparse.Namespace], None], str]] = [
        (_strata_round, "strata"),
        (_peers_round, "peers"),
    ]
    for part, name in reversed(parts) if index % 2 else parts:
        part(r, work / f"{name}-{index}", args)
    return r


def _numbers(values: list[Any]) -> list[float]:
    return [float(v) for v in values if isinstance(v, int | float) and not isinstance(v, bool)]


def summarize(rounds: list[Any], pick: Callable[[list[float]], Any]) -> Any:
    """One tree of the rounds' shape whose number leaves are ``pick`` of that leaf over the
    rounds that have it (a peer that failed in one round counts with the others)."""
    dicts = [x for x in rounds if isinstance(x, dict)]
    if dicts:
        keys = list(dict.fromkeys(k for d in dicts for k in d))
        return {k: summarize([d[k] for d in dicts if k in d], pick) for k in keys}
    numbers = _numbers(rounds)
    return pick(numbers) if numbers and len(numbers) == len(rounds) else rounds[0]


def combine(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The published result: each figure's median over the rounds, its ``range`` (min, max),
    and the ``rounds`` themselves (raw samples left out), from which ratios are taken."""
    kept = [_strip(r) for r in rounds]
    result: dict[str, Any] = summarize(kept, lambda xs: float(np.median(xs)))
    return result | {"rounds": kept, "range": summarize(kept, lambda xs: [min(xs), max(xs)])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Strata vs physical limits and peers")
    parser.add_argument("--rounds", type=int, default=3, help="alternated rounds (medians)")
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies message counts")
    parser.add_argument("--seconds", type=float, default=8.0, help="cap per throughput run")
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--rate", type=int, default=1000)
    parser.add_argument("--latency-seconds", type=float, default=4.0)
    parser.add_argument("--overload-connections", type=int, default=16)
    parser.add_argument("--overload-seconds", type=float, default=10.0)
    parser.add_argument("--peers", default="nats,redis,rabbitmq")
    parser.add_argument(
        "--shared", action="store_true", help="say in the docs that the machine was shared"
    )
    parser.add_argument("--dir", type=Path, default=ROOT / "var" / "bench")
    parser.add_argument("--write-docs", action="store_true")
    parser.add_argument(
        "--from-json", type=Path, help="render a saved bench/results/compare.json (no plots)"
    )
    args = parser.parse_args(argv)
    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        publish("compare", render(saved), saved, write_docs=args.write_docs)
        return 0

    began = time.perf_counter()
    args.dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=args.dir, prefix="compare-"))
    rounds: list[dict[str, Any]] = []
    try:
        for index in range(args.rounds):
            rounds.append(one_round(work, args, index))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result = combine(rounds)
    result |= {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{os.cpu_count()} cores, {platform.machine()}, Python {platform.python_version()}",
        "command": "make bench",
        "partitions": args.partitions,
        "rate": args.rate,
        "latency_seconds": args.latency_seconds,
        "shared": args.shared,
        "elapsed_s": time.perf_counter() - began,
        # the CDF plots show the first round's samples
        "_lat": rounds[0]["_lat"],
        "_peers_raw": rounds[0]["_peers_raw"],
    }
    # saved before rendering, so that a render bug loses no run (``--from-json``)
    save_result("compare", {k: v for k, v in result.items() if not k.startswith("_")})
    # the docs' plots change only with the docs' tables
    plots(result, ROOT / ("docs" if args.write_docs else "bench/results") / "img")
    table = render(result)
    publish("compare", table, result, write_docs=args.write_docs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
