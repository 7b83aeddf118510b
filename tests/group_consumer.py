"""A consumer-group member as its own process, for the group acceptance tests.

    python -m tests.group_consumer --bootstrap H:P --group G --topic T --log FILE
        [--mode at-least-once|at-most-once] [--strategy cooperative-sticky]
        [--instance-id ID] [--crash-after-batches N] [--session-timeout-ms 3000]

It logs one JSON line per event to FILE (O_APPEND, one write per line, so a kill -9 loses
nothing already written):

    {"ev": "owned", "gen": 3, "parts": [0, 5], "t": 1700000000.1}     after every rebalance
    {"ev": "rec", "gen": 3, "p": 5, "first": 10, "last": 19, "t": ...} a batch processed
    {"ev": "commit", "gen": 3, "offsets": {"5": 20}, "t": ...}        acknowledged commit
    {"ev": "commit_failed", "error": "IllegalGenerationError", ...}
    {"ev": "closed", "t": ...}                                       after a graceful close

at-least-once: process (log "rec"), then commit. at-most-once: commit, then process.
``--crash-after-batches N`` ends the process with ``os._exit`` right after the N-th batch was
processed (at-least-once: before its commit) or committed (at-most-once: before it is
processed) — a crash at the worst moment. SIGTERM closes the consumer gracefully.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import time
from typing import Any

from sdk import Consumer, TopicPartition
from storage.errors import StrataError


class Log:
    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def __call__(self, ev: str, **fields: Any) -> None:
        os.write(self.fd, (json.dumps({"ev": ev, "t": time.time(), **fields}) + "\n").encode())


async def main(args: argparse.Namespace) -> None:
    log = Log(args.log)
    config: dict[str, Any] = {
        "bootstrap.servers": args.bootstrap,
        "group.id": args.group,
        "auto.offset.reset": "earliest",
        "enable.auto.commit": False,
        "session.timeout.ms": args.session_timeout_ms,
        "heartbeat.interval.ms": max(args.session_timeout_ms // 10, 100),
        "max.poll.records": args.max_poll_records,
        "partition.assignment.strategy": args.strategy,
        "retry.backoff.ms": 50,
    }
    if args.instance_id:
        config["group.instance.id"] = args.instance_id
    consumer = Consumer(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)

    def owned() -> None:
        log(
            "owned",
            gen=consumer.group_generation,
            parts=sorted(tp.partition for tp in consumer.assignment()),
        )

    class Listener:
        async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
            log("revoked", gen=consumer.group_generation, parts=sorted(p for _, p in revoked))

        def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
            pass

    await consumer.start()
    consumer.subscribe([args.topic], listener=Listener())
    batches = 0
    last_seen: tuple[int, frozenset[TopicPartition]] = (-2, frozenset())
    try:
        while not stop.is_set():
            got = await consumer.getmany(timeout_ms=200)
            now = (consumer.group_generation, frozenset(consumer.assignment()))
            if now != last_seen:
                last_seen = now
                owned()
            if not got:
                continue
            gen = consumer.group_generation
            offsets = {tp: records[-1].offset + 1 for tp, records in got.items()}
            if args.mode == "at-most-once":
                await commit(consumer, log, offsets, gen)
                batches += 1
                if args.crash_after_batches and batches >= args.crash_after_batches:
                    os._exit(3)
            for tp, records in got.items():
                log(
                    "rec", gen=gen, p=tp.partition, first=records[0].offset, last=records[-1].offset
                )
            if args.mode == "at-least-once":
                batches += 1
                if args.crash_after_batches and batches >= args.crash_after_batches:
                    os._exit(3)
                await commit(consumer, log, offsets, gen)
    finally:
        await consumer.close()
        log("closed")


async def commit(
    consumer: Consumer, log: Log, offsets: dict[TopicPartition, int], gen: int
) -> None:
    try:
        await consumer.commit(offsets)
    except StrataError as exc:
        log("commit_failed", gen=gen, error=type(exc).__name__)
        return
    log("commit", gen=gen, offsets={str(tp.partition): o for tp, o in offsets.items()})


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--bootstrap", required=True)
    p.add_argument("--group", required=True)
    p.add_argument("--topic", required=True)
    p.add_argument("--log", required=True)
    p.add_argument("--mode", choices=("at-least-once", "at-most-once"), default="at-least-once")
    p.add_argument("--strategy", default="cooperative-sticky")
    p.add_argument("--instance-id")
    p.add_argument("--crash-after-batches", type=int, default=0)
    p.add_argument("--session-timeout-ms", type=int, default=3000)
    p.add_argument("--max-poll-records", type=int, default=200)
    return p.parse_args(argv)


if __name__ == "__main__":
    # the SDK's membership trail (joins, generations, failed heartbeats) goes to the process
    # log the harness keeps (processes/<name>.log), for when a group test fails
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    asyncio.run(main(parse()))
