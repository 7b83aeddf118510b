"""Broker-side filtering benchmark: a filter matching 1 % of a partition, tags clustered by batch.

Run with ``make bench-filters`` (``python -m bench.filter_bench [--write-docs]``). Starts a
real ZooKeeper and one agent process with default settings, then:

1. **Ingest.** The SDK producer writes ``--mib`` MiB of ``--value-bytes`` values to one
   partition in batches of ``--batch-records`` records, each batch flushed on its own so that
   a batch holds one tag: batch ``b`` carries ``tag-{b % 100}`` (tags clustered by batch, as
   producers that batch by type write them). The filter ``tag = 'tag-07'`` matches 1 % of the
   records.
2. **Consume** the whole partition from the beginning with the SDK consumer, two ways,
   alternated ``--rounds`` times (which one goes first alternates too): *unfiltered* (every
   record handed out by ``getmany_arrow``) and *filtered* (``assign(..., filter=...)``: the
   agent sends only the matching batches, and the consumer's position follows the agent's
   ``next_offset`` to the end). Each run ends when the position reaches the end of the
   partition. Per run: the time, the records handed out, and the bytes the agent wrote to
   its sockets meanwhile (its ``strata_network_out_bytes`` counter, every response frame).

Reported: medians over the rounds with their spread (min-max), matching records/s, bytes
the agent sent per matching record, and the two targets of the issue: the agent sends at
most 2x the matching bytes (the bytes the matching records occupy in the log), and the
filtered consume of the whole partition takes at most 0.3x the unfiltered one's time.
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
import urllib.request
import uuid
from pathlib import Path
from typing import Any

from bench.common import publish
from infra.agents import start_agent
from infra.zookeeper import start_zookeeper
from sdk import Consumer, Producer, TopicPartition
from storage.metadata import AsyncZooKeeper, MetadataStore, TopicSpec

ROOT = Path(__file__).resolve().parent.parent
TOPIC = "filterbench"
TAGS = 100
WANTED = "tag-07"
FILTER = f"tag = '{WANTED}'"


async def _create_topic(zk_connect: str) -> None:
    zk = AsyncZooKeeper(zk_connect)
    await zk.start()
    try:
        spec = TopicSpec.build(
            name=TOPIC,
            partitions=1,
            replication_factor=1,
            config={},
            topic_id=uuid.uuid4().hex,
            created_ms=int(time.time() * 1000),
        )
        await MetadataStore(zk).create_topic(spec)
    finally:
        await zk.stop()


async def ingest(bootstrap: str, total: int, value_bytes: int, per_batch: int) -> dict[str, int]:
    value = os.urandom(value_bytes)
    values = [value] * per_batch
    batches = max(1, total // (value_bytes * per_batch))
    matching = 0
    config = {"bootstrap.servers": bootstrap, "acks": 1, "linger.ms": 0, "batch.size": 4 << 20}
    async with Producer(config) as producer:
        for b in range(batches):
            tag = f"tag-{b % TAGS:02d}"
            matching += per_batch if tag == WANTED else 0
            await producer.send_batch(TOPIC, values, tags=[[tag]] * per_batch, partition=0)
            await producer.flush()  # one batch per tag run
    return {"records": batches * per_batch, "matching": matching, "batches": batches}


def _metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url, timeout=5) as reply:
        text = reply.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + " ") or line.startswith(name + "{")
    )


async def consume(bootstrap: str, end: int, filter_: str | None) -> tuple[float, int]:
    """(seconds, records handed out) for reading the partition from 0 to ``end``."""
    tp = TopicPartition(TOPIC, 0)
    records = 0
    async with Consumer({"bootstrap.servers": bootstrap}) as consumer:
        start = time.perf_counter()
        consumer.assign([tp], filter=filter_)
        consumer.seek(tp, 0)
        while await consumer.position(tp) < end:
            for table in (await consumer.getmany_arrow(tp, timeout_ms=50)).values():
                records += table.num_rows
        return time.perf_counter() - start, records


def _spread(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def run(agent: Any, args: argparse.Namespace) -> dict[str, Any]:
    total = args.mib << 20
    info = asyncio.run(ingest(agent.address, total, args.value_bytes, args.batch_records))
    end, matching = info["records"], info["matching"]
    log_bytes = sum(p.stat().st_size for p in (args.work / "agent-1").rglob("*.log") if p.is_file())
    out_metric = "strata_network_out_bytes_total"
    samples: dict[str, dict[str, list[float]]] = {
        k: {"seconds": [], "sent": []} for k in ("unfiltered", "filtered")
    }
    asyncio.run(consume(agent.address, end, None))  # warm the page cache, untimed
    for r in range(args.rounds):
        order = ("unfiltered", "filtered") if r % 2 == 0 else ("filtered", "unfiltered")
        for kind in order:
            before = _metric(agent.metrics_url, out_metric)
            seconds, got = asyncio.run(
                consume(agent.address, end, FILTER if kind == "filtered" else None)
            )
            sent = _metric(agent.metrics_url, out_metric) - before
            assert got == (matching if kind == "filtered" else end), (kind, got)
            samples[kind]["seconds"].append(seconds)
            samples[kind]["sent"].append(sent)
    matching_bytes = matching * log_bytes / end
    fs, us = samples["filtered"], samples["unfiltered"]
    ratios = [f / u for f, u in zip(fs["seconds"], us["seconds"], strict=True)]
    return {
        "records": end,
        "matching": matching,
        "batches": info["batches"],
        "log_bytes": log_bytes,
        "matching_bytes": matching_bytes,
        "unfiltered_seconds": _spread(us["seconds"]),
        "filtered_seconds": _spread(fs["seconds"]),
        "unfiltered_sent": _spread(us["sent"]),
        "filtered_sent": _spread(fs["sent"]),
        "time_ratio": _spread(ratios),
        "sent_ratio": _spread([s / matching_bytes for s in fs["sent"]]),
        "sent_per_matching_record": _spread([s / matching for s in fs["sent"]]),
        "matching_per_second": _spread([matching / s for s in fs["seconds"]]),
        "unfiltered_per_second": _spread([end / s for s in us["seconds"]]),
        "_samples": samples,
    }


def _fmt(s: dict[str, float], scale: float = 1.0, digits: int = 2) -> str:
    return (
        f"**{s['median'] * scale:,.{digits}f}** ({s['min'] * scale:,.{digits}f}"
        f"-{s['max'] * scale:,.{digits}f})"
    )


def render(res: dict[str, Any]) -> str:
    mb = 1e6
    lines = [
        "<!-- filter-bench:begin (generated by `make bench-filters`; do not edit by hand) -->",
        f"Measured {res['date']} on {res['machine']} with `{res['command']}`: one agent process"
        " with default settings; one partition of"
        f" {res['records']:,} records ({res['value_bytes']:,}-byte values, {res['batches']:,}"
        f" batches of {res['batch_records']:,} records, each batch one of {TAGS} tags, so tags"
        f" are clustered by batch), {res['log_bytes'] / mb:,.0f} MB in the log; the filter"
        f" `{FILTER}` matches {res['matching']:,} records (1 %). Medians of {res['rounds']}"
        " alternated runs of each consumer (min-max in brackets), after one untimed"
        " unfiltered read.",
        "",
        "| measurement | unfiltered consumer | filtered consumer |",
        "|---|---|---|",
        f"| time to consume the whole partition (s) | {_fmt(res['unfiltered_seconds'])} |"
        f" {_fmt(res['filtered_seconds'])} |",
        f"| records handed out | {res['records']:,} | {res['matching']:,} |",
        f"| records/s handed out | {_fmt(res['unfiltered_per_second'], digits=0)} |"
        f" {_fmt(res['matching_per_second'], digits=0)} matching |",
        f"| bytes the agent sent (MB, every response frame) | {_fmt(res['unfiltered_sent'], 1 / mb)}"
        f" | {_fmt(res['filtered_sent'], 1 / mb, 3)} |",
        f"| bytes the agent sent per matching record | — |"
        f" {_fmt(res['sent_per_matching_record'], digits=0)} |",
        "",
        "| target (issue #22) | result | |",
        "|---|---|---|",
        f"| agent sends ≤ 2x the matching bytes ({res['matching_bytes'] / mb:,.2f} MB: what the"
        f" matching records occupy in the log) | {_fmt(res['sent_ratio'])}x |"
        f" {'met' if res['sent_ratio']['median'] <= 2 else 'not met'} |",
        "| filtered consume ≤ 0.3x the unfiltered time (per round) |"
        f" {_fmt(res['time_ratio'], digits=3)}x |"
        f" {'met' if res['time_ratio']['median'] <= 0.3 else 'not met'} |",
        "<!-- filter-bench:end -->",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Strata broker-side filtering benchmark")
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--value-bytes", type=int, default=1024)
    parser.add_argument("--batch-records", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=ROOT / "var" / "bench")
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args(argv)
    args.dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=args.dir))
    args.work = work
    zk = start_zookeeper(work / "zookeeper")
    agent = None
    try:
        connect = f"{zk.connect_string}/bench"
        agent = start_agent(1, connect, work / "agent-1")
        asyncio.run(_create_topic(connect))
        result = {
            "date": time.strftime("%Y-%m-%d"),
            "machine": f"{os.cpu_count()} cores, {platform.machine()}, Python {platform.python_version()}",
            "command": "make bench-filters",
            "rounds": args.rounds,
            "value_bytes": args.value_bytes,
            "batch_records": args.batch_records,
            **run(agent, args),
        }
    finally:
        if agent is not None:
            agent.stop()
        zk.stop()
        shutil.rmtree(work, ignore_errors=True)
    publish("filter", render(result), result, write_docs=args.write_docs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
