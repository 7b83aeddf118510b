"""Helpers for the retry tests: policies, the router process, reading a dead-letter topic."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from handlers.retries import RetryAdmin
from sdk import Consumer, ConsumerRecord, TopicPartition
from tests.cluster import Cluster
from tests.delay_support import start_scheduler, with_store
from tests.harness import ManagedProcess


def set_policy(cluster: Cluster, group: str, topic: str, policy: dict[str, Any]) -> dict[str, Any]:
    result: dict[str, Any] = asyncio.run(
        with_store(
            cluster.zk.connect_string,
            lambda store: RetryAdmin(store).set_policy(group, topic, policy),
        )
    )
    for name in result["created"]:
        cluster.wait_for_leaders(name)
    return result


def retry_status(cluster: Cluster) -> dict[str, Any]:
    result: dict[str, Any] = asyncio.run(
        with_store(cluster.zk.connect_string, lambda store: RetryAdmin(store).status())
    )
    return result


def start_router(cluster: Cluster, name: str = "router") -> ManagedProcess:
    """``python -m infra.event_source --function handlers.retry:handler``, once assigned."""
    return start_scheduler(cluster, name, "--function", "handlers.retry:handler")


async def read_all(
    bootstrap: str, topic: str, partitions: int, expected: int, deadline_s: float, settle_s: float
) -> list[ConsumerRecord]:
    """Every record of ``topic`` from the beginning: until ``expected`` arrived, then
    ``settle_s`` more to catch extra ones."""
    out: list[ConsumerRecord] = []
    async with Consumer(
        {"bootstrap.servers": bootstrap, "fetch.max.wait.ms": 50, "enable.auto.commit": False}
    ) as consumer:
        tps = [TopicPartition(topic, p) for p in range(partitions)]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        deadline = time.monotonic() + deadline_s
        settle_until: float | None = None
        while time.monotonic() < deadline and (
            settle_until is None or time.monotonic() < settle_until
        ):
            got = await consumer.getmany(timeout_ms=100)
            for recs in got.values():
                out += recs
            if len(out) >= expected and settle_until is None:
                settle_until = time.monotonic() + settle_s
    return out
