"""A consumer in its own process for ``tests/test_end_to_end_wakeups.py``: assigned every
partition of a topic from its end, long-polling; prints ``{"ready": true}`` once positioned,
then, after ``count`` records, one JSON line ``{"seen": [[partition, offset, monotonic_ns]...]}``
(the monotonic clock is one clock for every process of the machine)."""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from sdk import Consumer


async def run(args: argparse.Namespace) -> list[list[int]]:
    seen: list[list[int]] = []
    config = {
        "bootstrap.servers": args.bootstrap,
        "auto.offset.reset": "latest",
        "fetch.max.wait.ms": args.fetch_max_wait_ms,
    }
    async with Consumer(config) as consumer:
        consumer.assign([(args.topic, p) for p in range(args.partitions)])
        for p in range(args.partitions):
            await consumer.position((args.topic, p))
        print(json.dumps({"ready": True}), flush=True)
        async with asyncio.timeout(args.timeout):
            while len(seen) < args.count:
                got = await consumer.getmany(timeout_ms=1000)
                now = time.monotonic_ns()
                for tp, records in got.items():
                    seen.extend([tp.partition, r.offset, now] for r in records)
    return seen


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--bootstrap", required=True)
    p.add_argument("--topic", required=True)
    p.add_argument("--partitions", type=int, required=True)
    p.add_argument("--count", type=int, required=True)
    p.add_argument("--fetch-max-wait-ms", type=int, default=5000)
    p.add_argument("--timeout", type=float, default=120)
    args = p.parse_args()
    print(json.dumps({"seen": asyncio.run(run(args))}), flush=True)


if __name__ == "__main__":
    main()
