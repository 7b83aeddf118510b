"""The demo's retries step: a consumer that fails some records; retries, the DLQ, a redrive.

1,000 records; the consumer (``retry.enable``) fails about 10% of them on their first two
attempts and 2% on every attempt. The policy (3 attempts, 250 ms doubling) brings the first
back until they succeed and sends the others to ``demo-retry.dlq``; ``strata dlq peek`` shows
why; a redrive at 200/s moves them back, and this time they succeed. Checked: every record
processed once, the dead-letter topic holds exactly the always-failing ones, each redriven
record arrives once.
"""

from __future__ import annotations

import asyncio
import time
import zlib
from pathlib import Path

from infra.event_source import start_event_source
from sdk import Consumer, Producer
from sdk.admin import SyncAdmin
from sdk.config import client_config, client_security
from sdk.retry import retry_info

TOPIC = "demo-retry"
DLQ = "demo-retry.dlq"
GROUP = "demo-billing"
PARTITIONS = 3
POLICY = {
    "initial_ms": 250,
    "multiplier": 2,
    "max_ms": 2000,
    "max_attempts": 3,
    "dead_letter_topic": DLQ,
}


def plan(n: int) -> tuple[set[int], set[int]]:
    twice: set[int] = set()
    always: set[int] = set()
    for i in range(n):
        h = zlib.crc32(b"demo%d" % i) % 100
        if h < 2:
            always.add(i)
        elif h < 12:
            twice.add(i)
    return twice, always


async def consume(bootstrap: str, n: int, always: set[int], twice: set[int]) -> dict[int, int]:
    """Until every record succeeded or is known to be dead-lettered; redriven ones succeed."""
    processed: dict[int, int] = {}
    config = client_config(
        bootstrap,
        {
            "group.id": GROUP,
            "auto.offset.reset": "earliest",
            "fetch.max.wait.ms": 50,
            "retry.enable": True,
        },
    )
    async with Consumer(config) as consumer:
        consumer.subscribe([TOPIC])
        deadline = time.monotonic() + 90
        while len(processed) < n and time.monotonic() < deadline:
            for records in (await consumer.getmany(timeout_ms=200)).values():
                for r in records:
                    i = int(r.value or b"-1")
                    attempt = retry_info(r).attempt
                    redriven = any(k == "strata.redrive.task" for k, _ in r.headers)
                    if not redriven and (i in always or (i in twice and attempt <= 2)):
                        await consumer.retry_later(r, reason=f"demo failure on attempt {attempt}")
                    else:
                        processed[i] = processed.get(i, 0) + 1
            if len(processed) >= n - len(always) and not (set(processed) & always):
                break
        # a commit of positions stops below a failure record not stored yet: store them all
        # first, else the next run of the group reads the records after it again
        await consumer.flush_retries()
        await consumer.commit()
    return processed


def run(bootstrap: str, admin_url: str, zookeeper: str, log_dir: Path, n: int = 1000) -> str:
    twice, always = plan(n)
    router = start_event_source(
        bootstrap,
        zookeeper,
        log_path=log_dir / "retry-router.log",
        extra_args=("--function", "handlers.retry:handler"),
    )
    try:
        with SyncAdmin(admin_url, config=client_security()) as admin:
            admin.set_retry_policy(GROUP, TOPIC, POLICY)

            async def produce() -> None:
                async with Producer(client_config(bootstrap, {"acks": "all"})) as p:
                    await (await p.send_batch(TOPIC, [b"%d" % i for i in range(n)]))

            asyncio.run(produce())
            first = asyncio.run(consume(bootstrap, n, always, twice))
            assert all(c == 1 for c in first.values()), "a record processed twice"
            assert set(first) == set(range(n)) - always
            deadline = time.monotonic() + 30
            while admin.dlq_count(DLQ) < len(always) and time.monotonic() < deadline:
                time.sleep(0.2)
            dead = admin.dlq_count(DLQ)
            assert dead == len(always), f"{dead} records in {DLQ}, expected {len(always)}"
            why = admin.dlq_peek(DLQ, 1)[0]
            retries = sum(
                sum(s["retries_by_attempt"].values())
                for s in admin.retry_status()["routers"].values()
            )
            task = admin.redrive(DLQ, TOPIC, 200)
            while task["state"] == "running":
                task = admin.redrive_run(str(task["id"]))
            assert task["moved"] == len(always), task
            second = asyncio.run(consume(bootstrap, len(always), set(), set()))
            assert sorted(second) == sorted(always) and all(c == 1 for c in second.values())
    finally:
        router.stop()
    return (
        f"{n:,} records, {len(twice)} failing twice, {len(always)} always: {retries} retries, "
        f"{dead} dead-lettered ({why['last_error']!r}), redriven at 200/s, each once"
    )
