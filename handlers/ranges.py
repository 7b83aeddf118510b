"""Reading a range of one partition's records again, as a handler's redo needs it: the delay
scheduler's lanes, the retry router's failures partitions, a redrive's chunks. Each of them
wrote an intent naming the range before it forwarded it, and a redo forwards exactly those
records."""

from __future__ import annotations

import asyncio
import logging

from sdk import Consumer
from sdk.config import client_config
from sdk.records import ConsumerRecord, TopicPartition

log = logging.getLogger(__name__)

#: records asked for per fetch
MAX_RECORDS = 10_000


async def read_range(
    consumer: Consumer,
    tp: TopicPartition,
    start: int,
    end: int,
    *,
    limit_s: float,
    warn_lost: bool = True,
) -> list[ConsumerRecord]:
    """The records of ``tp`` in ``[start, end)`` as ``consumer`` sees them (its isolation
    level). Records that retention deleted since the range was named (``start`` below the
    log's start: a redo after a long outage) are gone: the rest of the range is read, from
    the log's start, and the loss is logged (unless ``warn_lost`` is False: a range that
    may reach below the log's start by design). The survivors are never skipped (a consumer
    that resets to the latest offset) nor an error that fails every retry (one that does not
    reset); callers' consumers reset to the earliest offset, for retention that moves on
    while the range is read.
    ``TimeoutError`` if that takes over ``limit_s`` seconds. Reads until the consumer's
    position reaches ``end``, so a range that ends in a transaction marker is read whole
    too."""
    out: list[ConsumerRecord] = []
    async with asyncio.timeout(limit_s):
        first = (await consumer.beginning_offsets([tp]))[tp]
        if first > start and warn_lost:
            log.warning(
                "%s[%d]: offsets [%d, %d) were deleted by retention before they could be read"
                " again; %s",
                tp.topic,
                tp.partition,
                start,
                min(first, end),
                "reading the rest" if first < end else "none of the range is left",
            )
        start = max(start, first)
        if start >= end:
            return out
        consumer.assign([tp])
        consumer.seek(tp, start)
        want = min(max(end - start, 1), MAX_RECORDS)
        while await consumer.position(tp) < end:
            got = await consumer.getmany(tp, timeout_ms=200, max_records=want)
            out += [x for x in got.get(tp, []) if start <= x.offset < end]
    return out


async def read_committed_range(
    bootstrap: str,
    tp: TopicPartition,
    start: int,
    end: int,
    *,
    limit_s: float,
    warn_lost: bool = True,
) -> list[ConsumerRecord]:
    """:func:`read_range` with a consumer of its own that reads as the event-source runner
    feeding the scheduler and the router does (``read_committed``: what an aborted
    transaction stored is never forwarded, a redo's included)."""
    config = {
        "enable.auto.commit": False,
        "isolation.level": "read_committed",
        "auto.offset.reset": "earliest",  # retention moving on while the range is read
        "max.poll.records": MAX_RECORDS,
    }
    async with Consumer(client_config(bootstrap, config)) as c:
        return await read_range(c, tp, start, end, limit_s=limit_s, warn_lost=warn_lost)
