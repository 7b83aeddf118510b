"""Starting and stopping clients when no agent can be reached: a typed error in bounded time,
and nothing left running."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest

from sdk import Consumer, IllegalStateError, Producer, ProducerClosedError, SyncProducer
from storage.errors import NetworkError


def dead_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


FAST = {"request.timeout.ms": 300, "retry.backoff.ms": 10, "retry.backoff.max.ms": 50}


def test_producer_start_without_agents_fails_in_time() -> None:
    async def go() -> None:
        producer = Producer({"bootstrap.servers": dead_address(), **FAST})
        with pytest.raises(IllegalStateError, match="not started"):
            await producer.send("t", b"x")
        started = time.monotonic()
        with pytest.raises(NetworkError, match="no bootstrap server") as info:
            await producer.start()
        assert time.monotonic() - started < 2
        assert info.value.retriable
        with pytest.raises(ProducerClosedError):
            await producer.send("t", b"x")
        await producer.close()  # idempotent
        assert asyncio.all_tasks() == {asyncio.current_task()}

    asyncio.run(go())


def test_consumer_start_without_agents_fails_in_time() -> None:
    async def go() -> None:
        consumer = Consumer({"bootstrap.servers": dead_address(), **FAST})
        consumer.assign([("t", 0)])
        with pytest.raises(IllegalStateError, match="not started"):
            await consumer.getmany()
        with pytest.raises(NetworkError):
            await consumer.start()
        with pytest.raises(IllegalStateError, match="closed"):
            await consumer.getmany()
        assert asyncio.all_tasks() == {asyncio.current_task()}

    asyncio.run(go())


def test_sync_producer_without_agents_raises_and_stops_its_thread() -> None:
    before = threading.active_count()
    with pytest.raises(NetworkError):
        SyncProducer({"bootstrap.servers": dead_address(), **FAST})
    assert threading.active_count() == before
