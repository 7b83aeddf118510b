"""Produce benchmark: one producer process, one agent process, 1 KiB messages, acks=1.

Run with ``make bench-produce`` (``python -m bench.produce_bench [--write-docs]``). Starts a
real ZooKeeper and one agent, creates a topic, then measures in the same run:

* **throughput**: N messages of 1 KiB sent as fast as the producer takes them (linger 5 ms,
  1 MiB batches); msgs/s and MB/s from the first send to the last acknowledgement;
* **latency** at a fixed moderate rate (paced sends, linger 0): the time from ``send`` to the
  acknowledgement for every message, p50 / p99 / p99.9.

The topic uses the default ``fsync.policy=always``: an acks=1 acknowledgement means the batch
is fsynced on the agent (group commit). ``--fsync`` changes that for comparison.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import create_topic, publish, settle_writeback
from infra.agents import start_agent
from infra.zookeeper import start_zookeeper
from sdk import Producer

ROOT = Path(__file__).resolve().parent.parent
TOPIC = "bench"


async def _create_topic(zk_connect: str, partitions: int, fsync: str) -> None:
    await create_topic(zk_connect, TOPIC, partitions, {"fsync.policy": fsync})


async def throughput(bootstrap: str, n: int, size: int, acks: int | str = 1) -> dict[str, float]:
    value = os.urandom(size)
    config = {
        "bootstrap.servers": bootstrap,
        "acks": acks,
        "linger.ms": 5,
        "batch.size": 1 << 20,
        "max.request.size": 4 << 20,  # a partition's queued batches travel together
        "buffer.memory": 256 << 20,
        "max.in.flight.requests.per.connection": 5,
    }
    async with Producer(config) as producer:
        await producer.partitions_for(TOPIC)
        await (await producer.send(TOPIC, value))  # warm the connection
        start = time.perf_counter()
        futures = [await producer.send(TOPIC, value) for _ in range(n)]
        await producer.flush()
        elapsed = time.perf_counter() - start
        failed = [f for f in futures if not f.done() or f.exception() is not None]
        if failed:
            raise RuntimeError(f"{len(failed)} sends failed: {failed[0]}")
    return {
        "messages": n,
        "seconds": elapsed,
        "msgs_per_s": n / elapsed,
        "mb_per_s": n * size / 1e6 / elapsed,
    }


def _record_latency(latencies: list[float], sent: float, _: object) -> None:
    latencies.append(time.perf_counter() - sent)


async def throughput_batched(
    bootstrap: str, n: int, size: int, chunk: int = 1000, acks: int | str = 1
) -> dict[str, float]:
    """The same through ``Producer.send_batch`` (records handed over ``chunk`` at a time)."""
    values = [os.urandom(size)] * chunk
    config = {
        "bootstrap.servers": bootstrap,
        "acks": acks,
        "linger.ms": 5,
        "batch.size": 1 << 20,
        "max.request.size": 4 << 20,  # a partition's queued batches travel together
        "buffer.memory": 256 << 20,
        "max.in.flight.requests.per.connection": 5,
    }
    async with Producer(config) as producer:
        await producer.partitions_for(TOPIC)
        await (await producer.send_batch(TOPIC, values[:1]))
        start = time.perf_counter()
        futures = [await producer.send_batch(TOPIC, values) for _ in range(n // chunk)]
        await producer.flush()
        elapsed = time.perf_counter() - start
        stored = sum(r.record_count for f in futures for r in f.result())
        if stored != n // chunk * chunk:
            raise RuntimeError(f"{stored} records acknowledged of {n}")
    sent = n // chunk * chunk
    return {
        "messages": sent,
        "seconds": elapsed,
        "msgs_per_s": sent / elapsed,
        "mb_per_s": sent * size / 1e6 / elapsed,
    }


async def latency(
    bootstrap: str, rate: int, seconds: float, size: int, acks: int | str = 1
) -> dict[str, float]:
    value = os.urandom(size)
    config = {"bootstrap.servers": bootstrap, "acks": acks, "linger.ms": 0, "batch.size": 1 << 20}
    latencies: list[float] = []
    async with Producer(config) as producer:
        await producer.partitions_for(TOPIC)
        await (await producer.send(TOPIC, value))
        interval = 1 / rate
        total = int(rate * seconds)
        start = time.perf_counter()
        futures = []
        for i in range(total):
            target = start + i * interval
            delay = target - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            sent = time.perf_counter()
            fut = await producer.send(TOPIC, value)
            fut.add_done_callback(functools.partial(_record_latency, latencies, sent))
            futures.append(fut)
        await asyncio.gather(*futures)
        achieved = total / (time.perf_counter() - start)
    ms = np.array(latencies) * 1000
    return {
        "rate": rate,
        "achieved_rate": achieved,
        "messages": total,
        "p50_ms": float(np.percentile(ms, 50)),
        "p99_ms": float(np.percentile(ms, 99)),
        "p999_ms": float(np.percentile(ms, 99.9)),
        "max_ms": float(ms.max()),
    }


def render(r: dict[str, Any]) -> str:
    t, tb, lat = r["throughput"], r["throughput_batched"], r["latency"]
    best = max(t["msgs_per_s"], tb["msgs_per_s"])
    ok = "met" if best >= 300_000 else "**missed**"
    return "\n".join(
        [
            "<!-- produce-bench:begin (generated by `make bench-produce`; do not edit by hand) -->",
            f"Measured {r['date']} on {r['machine']} with `{r['command']}`: one producer process"
            f" (SDK `Producer`), one agent process, topic with {r['partitions']} partitions,"
            f" `fsync.policy={r['fsync']}`, acks=1, {r['size']} B values.",
            "",
            "| scenario | result |",
            "|---|---|",
            f"| throughput ({t['messages']:,} msgs, linger 5 ms, 1 MiB batches, 4 MiB requests) |"
            f" **{t['msgs_per_s']:,.0f} msgs/s**, {t['mb_per_s']:.0f} MB/s |",
            f"| throughput with `send_batch` ({tb['messages']:,} msgs, 1,000 per call, same settings) |"
            f" **{tb['msgs_per_s']:,.0f} msgs/s**, {tb['mb_per_s']:.0f} MB/s |",
            f"| latency at {lat['rate']:,} msgs/s for {lat['messages']:,} msgs (linger 0) |"
            f" p50 {lat['p50_ms']:.2f} ms, p99 {lat['p99_ms']:.2f} ms, p99.9 {lat['p999_ms']:.2f} ms"
            f" (achieved {lat['achieved_rate']:,.0f} msgs/s) |",
            "",
            f"Target ≥ 300,000 msgs/s of 1 KiB through one producer and one agent: {ok}"
            f" ({best:,.0f} msgs/s at best; per-message `send` costs Python work per record,"
            " `send_batch` hands whole lists over).",
            "<!-- produce-bench:end -->",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Strata produce benchmark")
    parser.add_argument("--messages", type=int, default=300_000)
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--rate", type=int, default=5000)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--fsync", default="always", choices=["always", "interval", "never"])
    parser.add_argument("--dir", type=Path, default=ROOT / "var" / "bench")
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args(argv)
    args.dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=args.dir))
    zk = start_zookeeper(work / "zookeeper")
    agent = None
    try:
        connect = f"{zk.connect_string}/bench"
        agent = start_agent(1, connect, work / "agent-1")
        asyncio.run(_create_topic(connect, args.partitions, args.fsync))
        result = {
            "date": time.strftime("%Y-%m-%d"),
            "machine": f"{os.cpu_count()} cores, {platform.machine()}, Python {platform.python_version()}",
            "command": "make bench-produce",
            "partitions": args.partitions,
            "fsync": args.fsync,
            "size": args.size,
        }
        # each run starts on a quiet disk (bench.common.settle_writeback), as in bench-compare
        settle_writeback(args.dir)
        result["throughput"] = asyncio.run(throughput(agent.address, args.messages, args.size))
        settle_writeback(args.dir)
        result["throughput_batched"] = asyncio.run(
            throughput_batched(agent.address, args.messages, args.size)
        )
        settle_writeback(args.dir)
        result["latency"] = asyncio.run(latency(agent.address, args.rate, args.seconds, args.size))
    finally:
        if agent is not None:
            agent.stop()
        zk.stop()
        shutil.rmtree(work, ignore_errors=True)
    table = render(result)
    publish("produce", table, result, write_docs=args.write_docs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
