"""Helpers for the delayed-message tests: level topics, a scheduler process, reading targets."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from handlers.delays import DelayAdmin
from sdk import Consumer, TopicPartition
from sdk import delays as d
from storage.errors import UnknownTopicOrPartitionError
from storage.metadata import AsyncZooKeeper, MetadataStore
from tests.cluster import ROOT, Cluster
from tests.harness import ManagedProcess


async def with_store(connect: str, fn: Any) -> Any:
    zk = AsyncZooKeeper(connect)
    await zk.start()
    try:
        store = MetadataStore(zk)
        await store.init()
        return await fn(store)
    finally:
        await zk.stop()


def create_levels(
    cluster: Cluster,
    lanes: int = 2,
    replication_factor: int = 1,
    configs: dict[str, Any] | None = None,
) -> None:
    asyncio.run(
        with_store(
            cluster.zk.connect_string,
            lambda store: DelayAdmin(store).ensure_topics(lanes, replication_factor, configs),
        )
    )
    for topic in d.level_topics():
        cluster.wait_for_leaders(topic)


def delay_status(cluster: Cluster) -> dict[str, Any]:
    result: dict[str, Any] = asyncio.run(
        with_store(cluster.zk.connect_string, lambda store: DelayAdmin(store).status())
    )
    return result


def cancel(cluster: Cluster, schedule_id: str) -> dict[str, Any]:
    result: dict[str, Any] = asyncio.run(
        with_store(cluster.zk.connect_string, lambda store: DelayAdmin(store).cancel(schedule_id))
    )
    return result


class InProcessRunner:
    """An ``EventSourceRunner`` on a thread of this process (a test's clock can drive it)."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="test-runner", daemon=True)

    def _main(self) -> None:
        async def run() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            self._ready.set()
            await self.runner.run(self._stop)

        try:
            asyncio.run(run())
        except BaseException as exc:  # reported by stop()
            self._error = exc

    def __enter__(self) -> InProcessRunner:
        self._thread.start()
        self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)
        if self._error is not None:
            raise self._error


def start_scheduler(cluster: Cluster, name: str = "scheduler", *args: str) -> ManagedProcess:
    """``python -m infra.event_source`` feeding the scheduler, once it has its partitions."""
    argv = [
        sys.executable,
        "-m",
        "infra.event_source",
        "--bootstrap",
        cluster.bootstrap,
        "--session-timeout-ms",
        "3000",
        *args,
    ]
    env = {
        "STRATA_ZOOKEEPER_CONNECT": cluster.zk.connect_string,
        "STRATA_LOG_LEVEL": os.environ.get("STRATA_LOG_LEVEL", "INFO"),
    }
    proc = cluster.processes.start(argv, name=name, cwd=ROOT, env=env)
    deadline = time.monotonic() + 60
    while '"event": "assigned"' not in proc.log_text():
        if not proc.alive:
            raise RuntimeError(f"scheduler exited:\n{proc.log_text()[-3000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"scheduler not running:\n{proc.log_text()[-3000:]}")
        time.sleep(0.05)
    return proc


@dataclass(frozen=True, slots=True)
class Delivered:
    schedule_id: str
    due_ms: int
    seen_ms: int
    """When the reader saw it (wall clock)."""
    timestamp: int
    partition: int
    offset: int
    original_ts: int
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes], ...]
    tags: tuple[str, ...]


def header(headers: Any, name: str) -> bytes | None:
    for k, v in headers:
        if k == name:
            return bytes(v)
    return None


async def read_delivered(
    bootstrap: str,
    topic: str,
    partitions: int,
    expected: int,
    deadline_s: float,
    *,
    settle_s: float = 0.0,
) -> list[Delivered]:
    """Read ``topic`` from the beginning until ``expected`` records arrived (then ``settle_s``
    more, to catch duplicates), noting when each was first seen."""
    out: list[Delivered] = []
    async with Consumer(
        {"bootstrap.servers": bootstrap, "fetch.max.wait.ms": 50, "enable.auto.commit": False}
    ) as consumer:
        tps = [TopicPartition(topic, p) for p in range(partitions)]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        deadline = time.monotonic() + deadline_s
        settle_until: float | None = None
        while True:
            now = time.monotonic()
            if now > deadline or (settle_until is not None and now > settle_until):
                break
            got = await consumer.getmany(timeout_ms=100)
            seen = time.time_ns() // 1_000_000
            for tp, recs in got.items():
                for r in recs:
                    sid = header(r.headers, d.HEADER_ID)
                    ts = header(r.headers, d.HEADER_TIMESTAMP)
                    assert sid is not None, f"a record without a schedule id at {tp}@{r.offset}"
                    parsed = d.ScheduleId.parse(sid.decode())
                    out.append(
                        Delivered(
                            sid.decode(),
                            parsed.due_ms,
                            seen,
                            r.timestamp,
                            r.partition,
                            r.offset,
                            int(ts or b"-1"),
                            r.key,
                            r.value,
                            tuple(r.headers),
                            tuple(r.tags),
                        )
                    )
            if len(out) >= expected and settle_until is None:
                settle_until = time.monotonic() + settle_s
    return out


def percentile(values: list[int], q: float) -> int:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def rows(text: str) -> Iterator[dict[str, Any]]:
    for line in text.splitlines():
        if line.startswith("{"):
            yield json.loads(line)


def cancel_at(cluster: Cluster, plan: list[tuple[float, str]]) -> dict[str, dict[str, Any]]:
    """Cancel each ``(wall time s, schedule id)`` at that time, all on one ZooKeeper session;
    the answers by id."""

    async def run(store: MetadataStore) -> dict[str, dict[str, Any]]:
        admin = DelayAdmin(store)

        async def one(at: float, sid: str) -> tuple[str, dict[str, Any]]:
            await asyncio.sleep(max(0.0, at - time.time()))
            return sid, await admin.cancel(sid)

        return dict(await asyncio.gather(*(one(at, sid) for at, sid in plan)))

    result: dict[str, dict[str, Any]] = asyncio.run(with_store(cluster.zk.connect_string, run))
    return result


def wait_until(check: Any, within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def delete_topic(cluster: Cluster, name: str, timeout: float = 30) -> None:
    """Delete ``name`` through its spec (what the admin API does) and wait for the controller
    to finish: the node is gone at the delete's last step."""

    async def delete(store: MetadataStore) -> None:
        await store.mark_deleted(name)
        deadline = time.monotonic() + timeout
        while True:
            try:
                await store.get_topic(name)
            except UnknownTopicOrPartitionError:
                return
            assert time.monotonic() < deadline, f"the delete of {name} did not finish"
            await asyncio.sleep(0.1)

    asyncio.run(with_store(cluster.zk.connect_string, delete))
