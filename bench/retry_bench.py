"""Retries: a consumer with a retry policy and 1% failures against one without, same run.

Run with ``make bench-retries`` (``python -m bench.retry_bench [--write-docs]``). Starts a real
ZooKeeper, one agent, the delay level topics, the scheduler and the retry router (each run by
``python -m infra.event_source`` in its own process), fills a topic with ``--records`` records
of 100 bytes, then ``--runs`` alternated pairs, each a fresh consumer group reading the whole
topic with ``getmany``:

* **plain**: no retries; every record is processed by the same trivial function (which
  also decides, by a hash, which records fail, and processes them anyway); offsets are
  committed by auto-commit (Kafka's default, every 5 s);
* **retry**: ``retry.enable``, a policy of 3 attempts; 1% of the records (a hash decides) fail
  and are given to ``retry_later``; the rest as above.

Throughput is records of the topic handled per second (until the group's position reaches the
end); the ratio retry / plain is taken per pair, the median reported with its spread. Each run
starts once the scheduler and the router are idle (the retries a run started have been
delivered or dead-lettered), and the CPU seconds each process used during the run are reported
beside the rates.
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
import zlib
from pathlib import Path
from typing import Any

from bench.common import cpu_seconds, publish
from handlers.delays import DelayAdmin
from handlers.retries import RetryAdmin
from infra.agents import start_agent
from infra.event_source import start_event_source
from infra.zookeeper import start_zookeeper
from sdk import Consumer, Producer
from sdk import delays as d
from sdk import retry as r
from storage.metadata import AsyncZooKeeper, MetadataStore, TopicSpec

TOPIC = "bench-retry"
PARTITIONS = 4
VALUE = b"v" * 100
POLICY = {"initial_ms": 1000, "max_attempts": 3, "dead_letter_topic": "bench-retry.dlq"}


async def setup(connect: str, groups: list[str]) -> None:
    zk = AsyncZooKeeper(connect)
    await zk.start()
    try:
        store = MetadataStore(zk)
        await store.init()
        await store.create_topic(
            TopicSpec.build(
                name=TOPIC,
                partitions=PARTITIONS,
                replication_factor=1,
                topic_id=uuid.uuid4().hex,
                created_ms=int(time.time() * 1000),
            )
        )
        await DelayAdmin(store).ensure_topics(4, 1)
        for group in groups:
            await RetryAdmin(store).set_policy(group, TOPIC, POLICY)
    finally:
        await zk.stop()


async def fill(bootstrap: str, n: int) -> None:
    async with Producer({"bootstrap.servers": bootstrap, "linger.ms": 5, "acks": 1}) as p:
        for start in range(0, n, 1000):
            count = min(1000, n - start)
            await (await p.send_batch(TOPIC, [VALUE] * count))


async def wait_for_leaders(bootstrap: str, topics: list[str], limit_s: float = 60) -> None:
    async with Producer({"bootstrap.servers": bootstrap}) as p:
        for topic in topics:
            async with asyncio.timeout(limit_s):
                await p.partitions_for(topic)


async def consume(bootstrap: str, group: str, n: int, *, retry: bool) -> float:
    """Records per second until the group handled all ``n`` records of the topic."""
    config = {
        "bootstrap.servers": bootstrap,
        "group.id": group,
        "auto.offset.reset": "earliest",
        "enable.auto.commit": True,
        "max.poll.records": 1000,
        "retry.enable": retry,
    }
    handled = 0
    checksum = 0
    async with Consumer(config) as consumer:
        consumer.subscribe([TOPIC])
        started: float | None = None
        while handled < n:
            got = await consumer.getmany(timeout_ms=500)
            if got and started is None:
                started = time.perf_counter()
            for tp, records in got.items():
                for rec in records:
                    # the same function on both sides: it decides whether a record fails;
                    # only the side with a policy sends failures to retry
                    failed = zlib.crc32(b"%d/%d" % (tp.partition, rec.offset)) % 100 == 0
                    if retry and failed:
                        await consumer.retry_later(rec, reason="bench failure")
                    else:
                        checksum ^= len(rec.value or b"")
                    if not r.is_retry_topic(rec.topic):
                        handled += 1
        assert started is not None
        elapsed = time.perf_counter() - started
        await consumer.flush_retries()
    return n / elapsed


def wait_quiet(pids: list[int], limit_s: float = 60.0) -> None:
    """Until ``pids`` together use under 2% of a core over a second: the retries and dead
    letters a run with a policy started are through the router and the scheduler before the
    next run starts (else their work would slow that run)."""
    deadline = time.monotonic() + limit_s
    before = sum(cpu_seconds(pid) for pid in pids)
    while time.monotonic() < deadline:
        time.sleep(1.0)
        now = sum(cpu_seconds(pid) for pid in pids)
        if now - before < 0.02:
            return
        before = now


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="strata-retry-bench-"))
    zk = start_zookeeper(work / "zookeeper")
    processes: list[Any] = []
    groups = [f"bench-{i}" for i in range(args.runs)]
    try:
        connect = zk.connect_string + "/bench"
        agent = start_agent(1, connect, work / "agent-1")
        processes.append(agent)
        asyncio.run(setup(connect, [f"{g}-retry" for g in groups]))
        asyncio.run(wait_for_leaders(agent.address, [TOPIC, r.FAILURES_TOPIC, *d.level_topics()]))
        processes.append(start_event_source(agent.address, connect, log_path=work / "sched.log"))
        processes.append(
            start_event_source(
                agent.address,
                connect,
                log_path=work / "router.log",
                extra_args=("--function", "handlers.retry:handler"),
            )
        )
        asyncio.run(fill(agent.address, args.records))
        roles = {"agent": agent.pid, "scheduler": processes[1].pid, "router": processes[2].pid}
        plain: list[float] = []
        retried: list[float] = []
        ratios: list[float] = []
        cpu: dict[str, list[dict[str, float]]] = {"plain": [], "retry": []}
        for group in groups:
            for kind in ("plain", "retry"):
                wait_quiet([roles["scheduler"], roles["router"]])
                before = {role: cpu_seconds(pid) for role, pid in roles.items()}
                own = time.process_time()
                rate = asyncio.run(
                    consume(agent.address, f"{group}-{kind}", args.records, retry=kind == "retry")
                )
                used = {role: cpu_seconds(pid) - before[role] for role, pid in roles.items()}
                used["consumer"] = time.process_time() - own
                cpu[kind].append(used)
                (plain if kind == "plain" else retried).append(rate)
            p, q = plain[-1], retried[-1]
            ratios.append(q / p)
            print(f"{group}: plain {p:,.0f}/s, with retries {q:,.0f}/s, ratio {q / p:.2f}")
            for kind in ("plain", "retry"):
                used = cpu[kind][-1]
                print(f"  CPU s, {kind}: " + ", ".join(f"{k} {v:.2f}" for k, v in used.items()))
    finally:
        for proc in reversed(processes):
            proc.stop()
        zk.stop()
        shutil.rmtree(work, ignore_errors=True)
    when = time.strftime("%Y-%m-%d")
    machine = f"{os.cpu_count()} cores, {platform.machine()}, Python {platform.python_version()}"
    ratio = statistics.median(ratios)
    result = {
        "when": when,
        "machine": machine,
        "plain_msgs_s": plain,
        "retry_msgs_s": retried,
        "ratios": ratios,
        "cpu_s": cpu,
    }
    table = "\n".join(
        [
            "<!-- retries-bench:begin (written by `make bench-retries`) -->",
            f"Measured {when} on {machine} with `make bench-retries`: one agent, the scheduler "
            f"and the retry router in their own processes; {args.records:,} records of 100 "
            f"bytes in {PARTITIONS} partitions, read by a fresh group per run with `getmany` "
            "(max.poll.records 1,000), auto-commit.",
            "",
            "| measure | value |",
            "|---|---|",
            f"| plain consumer (median of {args.runs}) | {statistics.median(plain):,.0f} msgs/s "
            f"({min(plain):,.0f} to {max(plain):,.0f}) |",
            f"| with a retry policy, 1% `retry_later` (median of {args.runs}) | "
            f"{statistics.median(retried):,.0f} msgs/s ({min(retried):,.0f} to "
            f"{max(retried):,.0f}) |",
            f"| with retries / plain, per alternated pair | {ratio:.2f} (median; "
            f"{min(ratios):.2f} to {max(ratios):.2f}); target ≥ 0.8 |",
            "",
            "CPU seconds per process while the group read the topic (median of the runs; "
            "each run starts once the scheduler and the router are idle):",
            "",
            "| run | " + " | ".join(cpu["plain"][0]) + " |",
            "|---|" + "---:|" * len(cpu["plain"][0]),
            *(
                f"| {kind} | "
                + " | ".join(
                    f"{statistics.median(run[role] for run in cpu[kind]):.2f}"
                    for role in cpu[kind][0]
                )
                + " |"
                for kind in ("plain", "retry")
            ),
            "<!-- retries-bench:end -->",
        ]
    )
    publish("retries", table, result, write_docs=args.write_docs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
