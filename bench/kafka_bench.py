"""Kafka listener vs native listener: confluent-kafka against one agent's Kafka port, the Strata
SDK against its native port, 1 KiB messages, in the same run.

Run with ``make bench-kafka`` (``python -m bench.kafka_bench [--write-docs]``). One ZooKeeper,
one agent with ``kafka.listener``; for each round, alternating the order of the two sides:

* **produce**: N messages of 1 KiB, acks=1, to a fresh 4-partition topic (the disk settled
  first); confluent-kafka's ``Producer.produce`` per message and ``produce_batch`` (linger
  5 ms, 1 MiB batches, delivery reports for failures only) vs the SDK's per-message ``send``
  and ``send_batch`` (1,000 records per call, the SDK's fast path); msgs/s from the first
  send to the last acknowledgement;
* **consume**: those N messages from the beginning; confluent-kafka's ``Consumer.consume``
  (assign, 10,000 per call) vs the SDK's ``getmany_arrow`` (Arrow tables, no per-record
  objects) and ``getmany`` (one record object each).

Each figure is the median of the rounds, with the spread; the ratios (Kafka ÷ native) are
taken per round and their median reported: each API against its counterpart, and each
client's fastest API against the other's. Targets: produce >= 0.7x, consume >= 0.8x. Beside
each rate, the agent's CPU time per message over that run (``/proc/<pid>/stat``): what the
listener itself costs, which a loaded machine does not blur as it blurs the rates; and this
process's (the client's, librdkafka's threads included).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import resource
import shutil
import statistics
import tempfile
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import confluent_kafka as ck

from bench.common import cpu_seconds, create_topic, publish, settle_writeback, spread
from infra.agents import start_agent
from infra.zookeeper import start_zookeeper
from sdk import Consumer, Producer, TopicPartition

ROOT = Path(__file__).resolve().parent.parent
PARTITIONS = 4


def kafka_produce(bootstrap: str, topic: str, n: int, value: bytes, batched: bool = False) -> float:
    """``n`` messages through confluent-kafka's ``produce`` (one call per message) or
    ``produce_batch`` (1,000 per call, librdkafka's batch API, the counterpart of the SDK's
    ``send_batch``), msgs/s from the first call to the last delivery."""
    errors: list[Any] = []
    producer = ck.Producer(
        {
            "bootstrap.servers": bootstrap,
            "acks": "1",
            "linger.ms": 5,
            "batch.size": 1 << 20,
            "queue.buffering.max.kbytes": 1 << 20,
            "queue.buffering.max.messages": 1_000_000,
            "enable.idempotence": False,
            # failures still reach ``on_delivery``; successes cost no Python call each
            "delivery.report.only.error": True,
        }
    )
    producer.produce(topic, value)
    producer.flush(30)  # metadata and connections ready
    start = time.perf_counter()
    on_delivery = _on_error(errors)
    if batched:
        deadline = time.monotonic() + 120
        for _ in range(n // 1000):
            todo = [{"value": value} for _ in range(1000)]
            while todo:
                if time.monotonic() > deadline:
                    raise RuntimeError("confluent-kafka's queue stayed full for 120 s")
                producer.produce_batch(topic, todo, on_delivery=on_delivery)
                todo = [{"value": value} for m in todo if "_error" in m]  # queue full: again
                producer.poll(0.01 if todo else 0)
    else:
        for _ in range(n):
            try:
                producer.produce(topic, value, on_delivery=on_delivery)
            except BufferError:
                producer.poll(0.01)
                producer.produce(topic, value, on_delivery=on_delivery)
            producer.poll(0)
    if producer.flush(120):
        raise RuntimeError("confluent-kafka did not deliver everything")
    elapsed = time.perf_counter() - start
    if errors:
        raise RuntimeError(f"{len(errors)} deliveries failed: {errors[0]}")
    return n / elapsed


def _on_error(errors: list[Any]) -> Any:
    def cb(err: Any, _msg: Any) -> None:
        if err is not None:
            errors.append(err)

    return cb


async def sdk_produce(
    bootstrap: str,
    topic: str,
    n: int,
    value: bytes,
    batched: bool,
    security: Mapping[str, Any] | None = None,
) -> float:
    """``n`` messages through the SDK's ``send_batch`` (1,000 per call) or ``send``, msgs/s
    from the first send to the last acknowledgement; ``security``: the client's
    ``security.protocol``, ``ssl.*`` and ``sasl.*`` settings."""
    config = {
        **(security or {}),
        "bootstrap.servers": bootstrap,
        "acks": 1,
        "linger.ms": 5,
        "batch.size": 1 << 20,
        "max.request.size": 4 << 20,
        "buffer.memory": 256 << 20,
    }
    async with Producer(config) as producer:
        await producer.partitions_for(topic)
        await (await producer.send(topic, value))
        start = time.perf_counter()
        if batched:
            chunk = [value] * 1000
            for _ in range(n // 1000):
                await producer.send_batch(topic, chunk)
        else:
            for _ in range(n):
                await producer.send(topic, value)
        await producer.flush()
        return n / (time.perf_counter() - start)


def kafka_consume(bootstrap: str, topic: str, n: int) -> float:
    consumer = ck.Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"bench-{uuid.uuid4().hex[:6]}",
            "enable.auto.commit": False,
            # fetch sizes: librdkafka's defaults, which are the SDK consumer's too (50 MiB a
            # fetch, 1 MiB a partition); larger ones only make the first answer wait longer
            #
            # librdkafka (2.4 on) stops fetching a partition whose local queue is over its
            # threshold for ``fetch.queue.backoff.ms``, 1 s by default: with the application
            # a little behind the fetcher, half of the runs sent no fetch at all for about a
            # second (220k msgs/s against 800k). A client-side pause, whatever the broker; the
            # librdkafka docs say to lower it when an application sees ~1 s gaps.
            "fetch.queue.backoff.ms": 10,
        }
    )
    try:
        # the partitions' leaders known before the assignment, as in a running consumer (the
        # SDK's is started before its clock too): else librdkafka waits for its 500 ms
        # offset-query timer before it asks where the partitions begin
        consumer.list_topics(topic, timeout=10)
        consumer.assign(
            [ck.TopicPartition(topic, p, ck.OFFSET_BEGINNING) for p in range(PARTITIONS)]
        )
        got = 0
        start = time.perf_counter()
        while got < n:
            msgs = consumer.consume(10_000, 1.0)
            for msg in msgs:
                if msg.error() is not None:
                    raise RuntimeError(str(msg.error()))
            got += len(msgs)
        return n / (time.perf_counter() - start)
    finally:
        consumer.close()


async def sdk_consume(
    bootstrap: str,
    topic: str,
    n: int,
    arrow: bool,
    partitions: int = PARTITIONS,
    security: Mapping[str, Any] | None = None,
) -> float:
    """``n`` messages from the beginning of ``topic`` through ``getmany_arrow`` (Arrow tables)
    or ``getmany`` (record objects), msgs/s."""
    async with Consumer({**(security or {}), "bootstrap.servers": bootstrap}) as consumer:
        tps = [TopicPartition(topic, p) for p in range(partitions)]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        got = 0
        start = time.perf_counter()
        while got < n:
            if arrow:
                got += sum(
                    t.num_rows for t in (await consumer.getmany_arrow(timeout_ms=1000)).values()
                )
            else:
                got += sum(len(r) for r in (await consumer.getmany(timeout_ms=1000)).values())
        return n / (time.perf_counter() - start)


def own_cpu_seconds() -> float:
    """User + system CPU of this process, all its threads (librdkafka's too)."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def render(r: dict[str, Any]) -> str:
    def row(name: str, key: str) -> str:
        s = r[key]
        cpu = r["agent_cpu_us"][key]
        client = r["client_cpu_us"][key]
        return (
            f"| {name} | {s['median']:,.0f} | {s['min']:,.0f}-{s['max']:,.0f} |"
            f" {cpu['median']:.1f} | {client['median']:.1f} |"
        )

    lines = [
        "<!-- kafka-bench:begin (generated by `make bench-kafka`; do not edit by hand) -->",
        f"Measured {r['date']} on {r['machine']} with `make bench-kafka`: one agent, a topic of"
        f" {PARTITIONS} partitions per run, acks=1, `fsync.policy=always`, {r['size']} B values,"
        f" {r['messages']:,} messages per run, {r['rounds']} alternated rounds (median, range).",
        "",
        "| client → listener | msgs/s (median) | range | agent CPU µs/msg (median) |"
        " client CPU µs/msg (median) |",
        "|---|---:|---:|---:|---:|",
        row("produce: confluent-kafka `produce_batch` → Kafka listener", "kafka_produce_batch"),
        row("produce: SDK `send_batch` → native", "sdk_produce_batch"),
        row("produce: confluent-kafka `produce` → Kafka listener", "kafka_produce"),
        row("produce: SDK `send` → native", "sdk_produce"),
        row("consume: confluent-kafka `consume` ← Kafka listener", "kafka_consume"),
        row("consume: SDK `getmany_arrow` ← native", "sdk_consume_arrow"),
        row("consume: SDK `getmany` ← native", "sdk_consume"),
        "",
        "Ratios Kafka ÷ native (median of the per-round ratios):",
        "",
        f"* produce, batch APIs (`produce_batch` ÷ `send_batch`):"
        f" **{r['ratio_produce_batch']:.2f}x**; per-message APIs (`produce` ÷ `send`):"
        f" **{r['ratio_produce']:.2f}x** (target ≥ 0.7x)",
        f"* consume vs `getmany_arrow`: **{r['ratio_consume_arrow']:.2f}x**, vs `getmany`:"
        f" **{r['ratio_consume']:.2f}x** (target ≥ 0.8x)",
        f"* each client's fastest API against the other's (per round, the faster of the two):"
        f" produce **{r['ratio_produce_best']:.2f}x**, consume"
        f" **{r['ratio_consume_best']:.2f}x**",
        "",
        "The agent's CPU per message (its user + system time over the run, whatever the load):"
        f" produce {r['cpu_ratio_produce']:.1f}x the native `send_batch`'s, consume"
        f" {r['cpu_ratio_consume']:.1f}x the native `getmany_arrow`'s. The client's (this"
        " process, librdkafka's threads included) is the other half of the two cores.",
        "<!-- kafka-bench:end -->",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Kafka listener vs native listener")
    parser.add_argument("--messages", type=int, default=300_000)
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=ROOT / "var" / "bench")
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args(argv)
    args.dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=args.dir))
    zk = start_zookeeper(work / "zookeeper")
    agent = None
    value = os.urandom(args.size)
    samples: dict[str, list[float]] = {
        k: []
        for k in (
            "kafka_produce_batch",
            "kafka_produce",
            "sdk_produce_batch",
            "sdk_produce",
            "kafka_consume",
            "sdk_consume_arrow",
            "sdk_consume",
        )
    }
    cpu_us: dict[str, list[float]] = {k: [] for k in samples}
    client_us: dict[str, list[float]] = {k: [] for k in samples}
    try:
        connect = f"{zk.connect_string}/bench"
        agent = start_agent(1, connect, work / "agent-1", configs={"kafka.listener": "127.0.0.1:0"})
        kafka = agent.kafka
        n = args.messages
        for rnd in range(args.rounds):
            topics = {k: f"{k}-{rnd}" for k in ("kbatch", "kafka", "batch", "send")}
            for t in topics.values():
                asyncio.run(create_topic(connect, t, PARTITIONS))
            time.sleep(1.0)  # leaders elected
            order = ["kbatch", "kafka", "batch", "send"]
            if rnd % 2:
                order.reverse()
            for side in order:
                settle_writeback(args.dir)  # the previous run's write-back out of this one
                before = cpu_seconds(agent.pid)
                mine = own_cpu_seconds()
                if side in ("kafka", "kbatch"):
                    key = "kafka_produce_batch" if side == "kbatch" else "kafka_produce"
                    samples[key].append(
                        kafka_produce(kafka, topics[side], n, value, batched=side == "kbatch")
                    )
                else:
                    key = "sdk_produce_batch" if side == "batch" else "sdk_produce"
                    samples[key].append(
                        asyncio.run(
                            sdk_produce(agent.address, topics[side], n, value, side == "batch")
                        )
                    )
                cpu_us[key].append((cpu_seconds(agent.pid) - before) / n * 1e6)
                client_us[key].append((own_cpu_seconds() - mine) / n * 1e6)
            for side in order:
                if side == "kbatch":
                    continue  # one Kafka consume per round, of the per-message side's topic
                before = cpu_seconds(agent.pid)
                mine = own_cpu_seconds()
                if side == "kafka":
                    key = "kafka_consume"
                    samples[key].append(kafka_consume(kafka, topics["kafka"], n))
                else:
                    key = "sdk_consume_arrow" if side == "batch" else "sdk_consume"
                    samples[key].append(
                        asyncio.run(sdk_consume(agent.address, topics[side], n, side == "batch"))
                    )
                cpu_us[key].append((cpu_seconds(agent.pid) - before) / n * 1e6)
                client_us[key].append((own_cpu_seconds() - mine) / n * 1e6)
            print({k: round(v[-1]) for k, v in samples.items()}, flush=True)
    finally:
        if agent is not None:
            agent.stop()
        zk.stop()
        shutil.rmtree(work, ignore_errors=True)

    def ratio(a: str, b: str) -> float:
        return statistics.median(x / y for x, y in zip(samples[a], samples[b], strict=True))

    def best_ratio(kafka: tuple[str, ...], native: tuple[str, ...]) -> float:
        """Per round, the faster Kafka-side API over the faster native one; the median."""
        return statistics.median(
            max(samples[k][i] for k in kafka) / max(samples[k][i] for k in native)
            for i in range(args.rounds)
        )

    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{os.cpu_count()} cores, {platform.machine()}, Python {platform.python_version()}",
        "size": args.size,
        "messages": args.messages,
        "rounds": args.rounds,
        **{k: spread(v) for k, v in samples.items()},
        "ratio_produce_batch": ratio("kafka_produce_batch", "sdk_produce_batch"),
        "ratio_produce": ratio("kafka_produce", "sdk_produce"),
        "ratio_consume_arrow": ratio("kafka_consume", "sdk_consume_arrow"),
        "ratio_consume": ratio("kafka_consume", "sdk_consume"),
        "ratio_produce_best": best_ratio(
            ("kafka_produce", "kafka_produce_batch"), ("sdk_produce", "sdk_produce_batch")
        ),
        "ratio_consume_best": best_ratio(("kafka_consume",), ("sdk_consume", "sdk_consume_arrow")),
        "agent_cpu_us": {k: spread(v) for k, v in cpu_us.items()},
        "client_cpu_us": {k: spread(v) for k, v in client_us.items()},
        "cpu_ratio_produce": statistics.median(
            x / y
            for x, y in zip(cpu_us["kafka_produce_batch"], cpu_us["sdk_produce_batch"], strict=True)
        ),
        "cpu_ratio_consume": statistics.median(
            x / y for x, y in zip(cpu_us["kafka_consume"], cpu_us["sdk_consume_arrow"], strict=True)
        ),
        "_samples": samples,
        "_agent_cpu_us": cpu_us,
        "_client_cpu_us": client_us,
    }
    publish("kafka", render(result), result, write_docs=args.write_docs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
