"""The demo's delayed-messages step: 1,000 records scheduled 3 s ahead, none early, each once."""

from __future__ import annotations

import asyncio
import time

from sdk import Consumer, Producer, TopicPartition
from sdk import delays as d
from sdk.config import client_config

TOPIC = "demo-delayed"
PARTITIONS = 3


async def schedule_and_check(bootstrap: str, n: int = 1000, ahead_ms: int = 3000) -> str:
    """Send ``n`` records due ``ahead_ms`` from now; read the target until all arrived (or a
    deadline); raise AssertionError if any came early, twice or not at all. Returns a
    one-line summary with the lateness."""
    due = int(time.time() * 1000) + ahead_ms
    async with Producer(client_config(bootstrap)) as producer:
        runs = await (
            await producer.send_batch(
                TOPIC,
                [b"delayed-%04d" % i for i in range(n)],
                keys=[b"k%04d" % i for i in range(n)],
                deliver_at_ms=due,
            )
        )
    ids = {sid for run in runs for sid in run.schedule_ids}
    seen: list[str] = []
    lateness: list[int] = []
    early = 0
    async with Consumer(client_config(bootstrap, {"fetch.max.wait.ms": 50})) as consumer:
        tps = [TopicPartition(TOPIC, p) for p in range(PARTITIONS)]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        deadline = time.monotonic() + ahead_ms / 1000 + 60
        while len(seen) < n and time.monotonic() < deadline:
            for records in (await consumer.getmany(timeout_ms=200)).values():
                now = int(time.time() * 1000)
                for r in records:
                    sid = dict(r.headers).get(d.HEADER_ID, b"").decode()
                    seen.append(sid)
                    early += now < due or r.timestamp < due
                    lateness.append(r.timestamp - due)
    assert not early, f"{early} record(s) readable before their due time"
    assert len(seen) == len(set(seen)), "a record delivered twice"
    assert set(seen) == ids, f"{len(ids - set(seen))} record(s) not delivered"
    lateness.sort()
    p50, p99 = lateness[len(lateness) // 2], lateness[int(len(lateness) * 0.99)]
    return f"{n:,} records due in {ahead_ms / 1000:g} s: none early, each once; lateness p50 {p50} ms, p99 {p99} ms"


def run(bootstrap: str) -> str:
    return asyncio.run(schedule_and_check(bootstrap))
