"""Delayed messages: throughput against plain produce, memory with 1,000,000 pending, lateness.

Run with ``make bench-delays`` (``python -m bench.delay_bench [--write-docs]``). Starts a real
ZooKeeper, one agent, the delay level topics (4 lanes) and the scheduler's event-source runner
(``python -m infra.event_source``, its own process), then:

* **throughput**: ``--runs`` alternated pairs, each ``--batch-records`` records of 100 bytes
  sent with ``send_batch`` (chunks of 1,000, acks=all) — once to a plain topic, once delayed by
  two hours to a target topic — acknowledged records per second; the ratio is taken per pair
  and reported as the median with its spread;
* **pending**: delayed records are added until ``--pending`` wait in the levels; then the RSS
  of the agent and of the scheduler process (``VmRSS``, and the peak ``VmHWM``), and the
  pending count as ``GET /delays/status`` reports it;
* **lateness**: records delayed by 5 s are sent at ``--rate`` per second for ``--seconds`` s
  (so they fall due at that rate, while the million wait); lateness is *written* (the
  delivered record's timestamp minus its due time) and *readable* (when a consumer tailing the
  target saw it, minus its due time).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shutil
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from bench.common import publish
from handlers.delays import DelayAdmin
from infra.agents import start_agent
from infra.event_source import start_event_source
from infra.zookeeper import start_zookeeper
from sdk import Consumer, Producer, TopicPartition
from sdk import delays as d
from storage.metadata import AsyncZooKeeper, MetadataStore, TopicSpec

PLAIN, TARGET, LATE = "plain", "target", "late"
PARTITIONS = 4
VALUE = b"v" * 100
CHUNK = 1000
TWO_HOURS = 2 * 3600 * 1000


def rss_mib(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) of ``pid`` in MiB."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) / 1024
    return fields["VmRSS"], fields["VmHWM"]


async def setup(connect: str) -> None:
    zk = AsyncZooKeeper(connect)
    await zk.start()
    try:
        store = MetadataStore(zk)
        await store.init()
        for name in (PLAIN, TARGET, LATE):
            await store.create_topic(
                TopicSpec.build(
                    name=name,
                    partitions=PARTITIONS,
                    replication_factor=1,
                    topic_id=uuid.uuid4().hex,
                    created_ms=int(time.time() * 1000),
                )
            )
        await DelayAdmin(store).ensure_topics(4, 1)
    finally:
        await zk.stop()


async def status(connect: str) -> dict[str, Any]:
    zk = AsyncZooKeeper(connect)
    await zk.start()
    try:
        result: dict[str, Any] = await DelayAdmin(MetadataStore(zk)).status()
        return result
    finally:
        await zk.stop()


async def wait_for_leaders(bootstrap: str, topics: list[str], limit_s: float = 60) -> None:
    async with Producer({"bootstrap.servers": bootstrap}) as producer:
        async with asyncio.timeout(limit_s):
            for topic in topics:
                await producer.partitions_for(topic)


async def produce(bootstrap: str, n: int, *, delayed: bool) -> float:
    """Records per second, all acknowledged (acks=all)."""
    topic = TARGET if delayed else PLAIN
    delay_ms = TWO_HOURS if delayed else None
    async with Producer(
        {"bootstrap.servers": bootstrap, "acks": "all", "linger.ms": 5, "batch.size": 262144}
    ) as producer:
        start = time.perf_counter()
        pending = []
        for i in range(0, n, CHUNK):
            values = [VALUE] * min(CHUNK, n - i)
            pending.append(await producer.send_batch(topic, values, delay_ms=delay_ms))
        await asyncio.gather(*pending)
        return n / (time.perf_counter() - start)


async def lateness(bootstrap: str, rate: int, seconds: float) -> dict[str, float]:
    """Send records due 5 s later at ``rate``/s; read them back as they are delivered."""
    n = int(rate * seconds)
    seen: dict[str, tuple[int, int]] = {}
    written: list[int] = []
    readable: list[int] = []

    async def reader() -> None:
        config = {"bootstrap.servers": bootstrap, "fetch.max.wait.ms": 20}
        async with Consumer(config) as consumer:
            tps = [TopicPartition(LATE, p) for p in range(PARTITIONS)]
            consumer.assign(tps)
            consumer.seek_to_beginning(*tps)
            deadline = time.monotonic() + seconds + 60
            while len(seen) < n and time.monotonic() < deadline:
                got = await consumer.getmany(timeout_ms=100)
                now = time.time_ns() // 1_000_000
                for records in got.values():
                    for r in records:
                        sid = dict(r.headers)[d.HEADER_ID].decode()
                        due = d.ScheduleId.parse(sid).due_ms
                        seen[sid] = (r.timestamp - due, now - due)

    task = asyncio.create_task(reader())
    async with Producer({"bootstrap.servers": bootstrap, "linger.ms": 5}) as producer:
        per_tick = max(1, rate // 100)
        start = time.monotonic()
        for i in range(0, n, per_tick):
            await producer.send_batch(LATE, [VALUE] * per_tick, delay_ms=5000)
            wait = start + (i + per_tick) / rate - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
        await producer.flush()
    await task
    for w, r in seen.values():
        written.append(w)
        readable.append(r)
    written.sort()
    readable.sort()

    def q(values: list[int], p: float) -> float:
        return float(values[min(len(values) - 1, int(p * len(values)))]) if values else -1.0

    return {
        "sent": n,
        "delivered": len(seen),
        "early": sum(1 for w in written if w < 0),
        "written_p50_ms": q(written, 0.5),
        "written_p99_ms": q(written, 0.99),
        "readable_p50_ms": q(readable, 0.5),
        "readable_p99_ms": q(readable, 0.99),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--batch-records", type=int, default=200_000)
    parser.add_argument("--pending", type=int, default=1_000_000)
    parser.add_argument("--rate", type=int, default=10_000)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="strata-delay-bench-"))
    zk = start_zookeeper(work / "zookeeper")
    scheduler = agent = None
    try:
        connect = zk.connect_string + "/bench"
        agent = start_agent(1, connect, work / "agent-1")
        asyncio.run(setup(connect))
        asyncio.run(wait_for_leaders(agent.address, [PLAIN, TARGET, LATE, *d.level_topics()]))
        scheduler = start_event_source(agent.address, connect, log_path=work / "scheduler.log")
        plain, delayed, ratios = [], [], []
        for run in range(args.runs):
            p = asyncio.run(produce(agent.address, args.batch_records, delayed=False))
            q = asyncio.run(produce(agent.address, args.batch_records, delayed=True))
            plain.append(p)
            delayed.append(q)
            ratios.append(q / p)
            print(f"run {run + 1}: plain {p:,.0f}/s, delayed {q:,.0f}/s, ratio {q / p:.2f}")
        pending = args.runs * args.batch_records
        while pending < args.pending:
            more = min(args.batch_records, args.pending - pending)
            asyncio.run(produce(agent.address, more, delayed=True))
            pending += more
        time.sleep(5)  # the scheduler fetches a batch from every lane
        agent_rss, agent_peak = rss_mib(agent.pid)
        sched_rss, sched_peak = rss_mib(scheduler.pid)
        reported = asyncio.run(status(connect))["pending"]
        late = asyncio.run(lateness(agent.address, args.rate, args.seconds))
        agent_rss2, agent_peak2 = rss_mib(agent.pid)
        sched_rss2, sched_peak2 = rss_mib(scheduler.pid)
    finally:
        if scheduler is not None:
            scheduler.stop()
        if agent is not None:
            agent.stop()
        zk.stop()
        shutil.rmtree(work, ignore_errors=True)
    result = {
        "when": time.strftime("%Y-%m-%d"),
        "machine": f"{os.cpu_count()} cores, {platform.machine()}, Python {platform.python_version()}",
        "plain_msgs_s": plain,
        "delayed_msgs_s": delayed,
        "ratios": ratios,
        "pending": pending,
        "pending_reported": reported,
        "agent_rss_mib": [agent_rss, agent_rss2],
        "agent_peak_mib": max(agent_peak, agent_peak2),
        "scheduler_rss_mib": [sched_rss, sched_rss2],
        "scheduler_peak_mib": max(sched_peak, sched_peak2),
        "lateness": late,
    }
    ratio = statistics.median(ratios)
    table = "\n".join(
        [
            "<!-- delays-bench:begin (written by `make bench-delays`) -->",
            f"Measured {result['when']} on {result['machine']} with `make bench-delays`: one "
            "agent, 4 lanes per level, the scheduler's runner in its own process; records of "
            "100 bytes, `send_batch` in chunks of 1,000, acks=all.",
            "",
            "| measure | value |",
            "|---|---|",
            f"| plain produce (median of {args.runs}) | {statistics.median(plain):,.0f} msgs/s "
            f"({min(plain):,.0f} to {max(plain):,.0f}) |",
            f"| delayed produce, 2 h (median of {args.runs}) | {statistics.median(delayed):,.0f}"
            f" msgs/s ({min(delayed):,.0f} to {max(delayed):,.0f}) |",
            f"| delayed / plain, per alternated pair | {ratio:.2f} (median; "
            f"{min(ratios):.2f} to {max(ratios):.2f}); target ≥ 0.3 |",
            f"| pending in the levels | {pending:,} (status reports {reported:,}) |",
            f"| agent RSS with them pending | {agent_rss:.0f} MiB (peak {result['agent_peak_mib']:.0f}"
            " MiB); limit 512 |",
            f"| scheduler RSS with them pending | {sched_rss:.0f} MiB (peak "
            f"{result['scheduler_peak_mib']:.0f} MiB); limit 512 |",
            f"| lateness at {args.rate:,} msgs/s due, written (p50 / p99) | "
            f"{late['written_p50_ms']:.0f} / {late['written_p99_ms']:.0f} ms |",
            f"| lateness at {args.rate:,} msgs/s due, readable (p50 / p99) | "
            f"{late['readable_p50_ms']:.0f} / {late['readable_p99_ms']:.0f} ms "
            f"({late['delivered']:,} of {late['sent']:,} delivered, {late['early']} early) |",
            "<!-- delays-bench:end -->",
        ]
    )
    publish("delays", table, result, write_docs=args.write_docs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
