"""Transactions: transactional produce against idempotent produce, read_committed against
read_uncommitted consume, and the ZooKeeper writes a transaction costs.

Run with ``make bench-txn`` (``python -m bench.txn_bench [--write-docs]``). Starts a real
ZooKeeper and one agent, then:

* **produce**: for each count of ``--producers`` (default 1 and 16, in one process),
  ``--runs`` alternated pairs, each ``--records`` records of 1 KiB (acks=all) shared by the
  producers, in groups of 100 (25 to each of the 4 partitions, ``send_batch``): once with
  idempotent producers (the groups pipelined, one flush at the end), once with transactional
  producers, each group one transaction (``begin_transaction``, the sends,
  ``commit_transaction``, which flushes and waits for the coordinator's decision).
  Acknowledged records per second; the ratio is taken per pair and reported as the median
  with its spread. The ZooKeeper write
  transactions during the transactional runs (zxid delta, as ``bench.group_bench`` measures
  it) divided by the transactions give the coordinator's write cost per transaction;
* **consume**: a topic of ``--records`` records written in transactions of 100, one in ten
  aborted, is read from its start to its end by a fresh consumer, alternately with
  ``read_uncommitted`` and ``read_committed`` (``--runs`` pairs). Both cover the same log;
  the ratio compares the time to get through it (read_committed hands out 10% fewer
  records: the aborted ones).
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
from infra.agents import start_agent
from infra.zookeeper import start_zookeeper
from sdk import Consumer, Producer, TopicPartition
from storage.metadata import AsyncZooKeeper, MetadataStore, TopicSpec

PRODUCE, READ = "produce", "read"
PARTITIONS = 4
VALUE = b"v" * 1024
TXN_RECORDS = 100
PER_PARTITION = TXN_RECORDS // PARTITIONS


async def setup(connect: str) -> None:
    zk = AsyncZooKeeper(connect)
    await zk.start()
    try:
        store = MetadataStore(zk)
        await store.init()
        for name in (PRODUCE, READ):
            await store.create_topic(
                TopicSpec.build(
                    name=name,
                    partitions=PARTITIONS,
                    replication_factor=1,
                    topic_id=uuid.uuid4().hex,
                    created_ms=int(time.time() * 1000),
                )
            )
    finally:
        await zk.stop()


async def zxid(connect: str) -> int:
    """The ensemble's current zxid: that of a probe znode created now."""
    zk = AsyncZooKeeper(connect)
    await zk.start()
    try:
        path = await asyncio.to_thread(
            zk.client.create, "/bench-probe-", b"", ephemeral=True, sequence=True
        )
        stat = await zk.exists(path)
        assert stat is not None
        return int(stat.czxid)
    finally:
        await zk.stop()


def _config(bootstrap: str, txn_id: str | None) -> dict[str, Any]:
    config: dict[str, Any] = {
        "bootstrap.servers": bootstrap,
        "acks": "all",
        "linger.ms": 5,
        "batch.size": 262144,
    }
    if txn_id is not None:
        config["transactional.id"] = txn_id
    return config


async def _group(producer: Producer, topic: str) -> list[asyncio.Future[Any]]:
    return [
        await producer.send_batch(topic, [VALUE] * PER_PARTITION, partition=p)
        for p in range(PARTITIONS)
    ]


async def produce_idempotent(bootstrap: str, n: int, producers: int = 1) -> float:
    """Records per second, all acknowledged, from ``producers`` producers sharing ``n``."""
    clients = [Producer(_config(bootstrap, None)) for _ in range(producers)]

    async def one(producer: Producer) -> None:
        pending: list[asyncio.Future[Any]] = []
        for _ in range(n // TXN_RECORDS // producers):
            pending += await _group(producer, PRODUCE)
        await asyncio.gather(*pending)

    try:
        for producer in clients:
            await producer.start()
            await producer.partitions_for(PRODUCE)
        start = time.perf_counter()
        await asyncio.gather(*(one(producer) for producer in clients))
        return n / (time.perf_counter() - start)
    finally:
        for producer in clients:
            await producer.close()


async def produce_transactional(
    bootstrap: str, n: int, producers: int = 1, topic: str = PRODUCE, abort_every: int = 0
) -> float:
    """Records per second from ``producers`` transactional producers sharing ``n``, every
    transaction committed (or, one in ``abort_every``, aborted)."""
    run = uuid.uuid4().hex[:8]
    clients = [Producer(_config(bootstrap, f"bench-{run}-{i}")) for i in range(producers)]

    async def one(producer: Producer) -> None:
        for i in range(n // TXN_RECORDS // producers):
            producer.begin_transaction()
            await _group(producer, topic)
            if abort_every and i % abort_every == abort_every - 1:
                await producer.flush()  # stored, then aborted: readers must skip them
                await producer.abort_transaction()
            else:
                await producer.commit_transaction()

    try:
        for producer in clients:
            await producer.start()
            await producer.partitions_for(topic)
            await producer.init_transactions()
        start = time.perf_counter()
        await asyncio.gather(*(one(producer) for producer in clients))
        return n / (time.perf_counter() - start)
    finally:
        for producer in clients:
            await producer.close()


async def consume(bootstrap: str, isolation: str) -> tuple[float, int]:
    """(seconds to read ``READ`` from its start to its end, records handed out)."""
    config = {
        "bootstrap.servers": bootstrap,
        "isolation.level": isolation,
        "auto.offset.reset": "earliest",
        "fetch.max.wait.ms": 50,
    }
    async with Consumer(config) as consumer:
        tps = [TopicPartition(READ, p) for p in range(PARTITIONS)]
        consumer.assign(tps)
        ends = await consumer.end_offsets(tps)
        got = 0
        start = time.perf_counter()
        while [tp for tp in tps if await consumer.position(tp) < ends[tp]]:
            for records in (await consumer.getmany(timeout_ms=100, max_records=10_000)).values():
                got += len(records)
        return time.perf_counter() - start, got


def _median_row(label: str, values: list[float], fmt: str) -> str:
    lo, mid, hi = min(values), statistics.median(values), max(values)
    return f"| {label} | {fmt.format(mid)} ({fmt.format(lo)} to {fmt.format(hi)}) |"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--records", type=int, default=48_000)
    parser.add_argument(
        "--producers", default="1,16", help="producer counts compared, comma-separated"
    )
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args(argv)
    counts = [int(c) for c in args.producers.split(",")]
    work = Path(tempfile.mkdtemp(prefix="strata-txn-bench-"))
    zk = start_zookeeper(work / "zookeeper")
    agent = None
    produce: dict[int, dict[str, list[float]]] = {
        k: {"idempotent": [], "transactional": [], "ratios": []} for k in counts
    }
    zk_writes = transactions = 0
    ru_s: list[float] = []
    rc_s: list[float] = []
    read_ratios: list[float] = []
    ru_got = rc_got = 0
    try:
        connect = zk.connect_string + "/bench"
        agent = start_agent(1, connect, work / "agent-1")
        asyncio.run(setup(connect))
        for run in range(args.runs):
            for k in counts:
                p = asyncio.run(produce_idempotent(agent.address, args.records, k))
                z0 = asyncio.run(zxid(connect))
                q = asyncio.run(produce_transactional(agent.address, args.records, k))
                zk_writes += asyncio.run(zxid(connect)) - z0 - 1  # minus the first probe's own
                transactions += args.records // TXN_RECORDS // k * k
                produce[k]["idempotent"].append(p)
                produce[k]["transactional"].append(q)
                produce[k]["ratios"].append(q / p)
                print(
                    f"run {run + 1}, {k} producers: idempotent {p:,.0f}/s,"
                    f" transactional {q:,.0f}/s, {q / p:.2f}",
                    flush=True,
                )
        asyncio.run(produce_transactional(agent.address, args.records, 1, READ, abort_every=10))
        asyncio.run(consume(agent.address, "read_uncommitted"))  # warm the page cache
        for run in range(args.runs):
            order = ["read_uncommitted", "read_committed"]
            if run % 2:
                order.reverse()
            took = {}
            for isolation in order:
                took[isolation] = asyncio.run(consume(agent.address, isolation))
            (u, ru_got), (c, rc_got) = took["read_uncommitted"], took["read_committed"]
            ru_s.append(u)
            rc_s.append(c)
            read_ratios.append(u / c)
            print(f"run {run + 1}: read_uncommitted {u:.2f} s, read_committed {c:.2f} s")
    finally:
        if agent is not None:
            agent.stop()
        zk.stop()
        shutil.rmtree(work, ignore_errors=True)
    result = {
        "when": time.strftime("%Y-%m-%d"),
        "machine": f"{os.cpu_count()} cores, {platform.machine()}, Python {platform.python_version()}",
        "produce": produce,
        "zk_writes_per_txn": zk_writes / transactions,
        "read_uncommitted_s": ru_s,
        "read_committed_s": rc_s,
        "read_uncommitted_records": ru_got,
        "read_committed_records": rc_got,
        "read_ratios": read_ratios,
    }
    mib = args.records * len(VALUE) / 2**20
    rows = [
        "<!-- txn-bench:begin (written by `make bench-txn`) -->",
        f"Measured {result['when']} on {result['machine']} with `make bench-txn`: one agent"
        f" (fsync.policy=always), 4 partitions; {args.records:,} records of 1 KiB per run,"
        " acks=all, in groups of 100 (25 per partition); idempotent and transactional runs"
        f" alternated, {args.runs} pairs per producer count.",
        "",
        "| measure | median (range) |",
        "|---|---|",
    ]
    for k in counts:
        r = produce[k]
        rows += [
            _median_row(f"idempotent produce, {k} producer(s)", r["idempotent"], "{:,.0f} msgs/s"),
            _median_row(
                f"transactional produce, 100-record transactions, {k} producer(s)",
                r["transactional"],
                "{:,.0f} msgs/s",
            ),
            _median_row(
                f"**transactional / idempotent, {k} producer(s)**, per pair (target ≥ 0.5)",
                r["ratios"],
                "{:.2f}",
            ),
        ]
    rows += [
        f"| ZooKeeper write transactions per transaction (zxid delta, all runs) | "
        f"{result['zk_writes_per_txn']:.2f} |",
        _median_row(
            f"read_uncommitted, whole log ({mib:,.0f} MiB, {ru_got:,} records)", ru_s, "{:.2f} s"
        ),
        _median_row(
            f"read_committed, same log, 1 transaction in 10 aborted ({rc_got:,} records)",
            rc_s,
            "{:.2f} s",
        ),
        _median_row(
            "**read_committed / read_uncommitted speed**, per pair (target ≥ 0.9)",
            read_ratios,
            "{:.2f}",
        ),
        "<!-- txn-bench:end -->",
    ]
    publish("txn", "\n".join(rows), result, write_docs=args.write_docs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
