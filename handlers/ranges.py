"""Reading a range of one partition's records again, as a handler's redo needs it: the delay
scheduler's lanes, the retry router's failures partitions, a redrive's chunks. Each of them
wrote an intent naming the range before it forwarded it, and a redo forwards exactly those
records."""

from __future__ import annotations

import asyncio

from sdk import Consumer
from sdk.records import ConsumerRecord, TopicPartition

#: records asked for per fetch
MAX_RECORDS = 10_000


async def read_range(
    consumer: Consumer, tp: TopicPartition, start: int, end: int, *, limit_s: float
) -> list[ConsumerRecord]:
    """The records of ``tp`` in ``[start, end)`` as ``consumer`` sees them: with its isolation
    level, and from the log's start if ``start`` is below it and the consumer resets to the
    earliest offset. ``TimeoutError`` if that takes over ``limit_s`` seconds. Reads until the
    consumer's position reaches ``end``, so a range that ends in a transaction marker is read
    whole too."""
    consumer.assign([tp])
    consumer.seek(tp, start)
    out: list[ConsumerRecord] = []
    want = min(max(end - start, 1), MAX_RECORDS)
    async with asyncio.timeout(limit_s):
        while await consumer.position(tp) < end:
            got = await consumer.getmany(tp, timeout_ms=200, max_records=want)
            out += [x for x in got.get(tp, []) if start <= x.offset < end]
    return out
