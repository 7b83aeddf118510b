"""Retry topics from the consumer's side: marking a record failed (``docs/retries.md``).

Theory of operation
-------------------
A consumer that cannot process a record hands it to :meth:`Retrier.fail` (what
``Consumer.retry_later`` and the event-source runner call). That writes one *failure record*
to the internal topic :data:`FAILURES_TOPIC`: the record's key, value, tags and headers, plus
the ``strata.retry.*`` headers below (the group, the original topic/partition/offset, the
attempt that failed, the first and this failure's time, the error). The consumer then treats
the record as processed: its offset is committed with the next commit. The retry router
(``handlers.retry``) reads the failure records, applies the group's policy and sends each one
either to the dead-letter topic or, through the delay levels, to the group's retry topic
:func:`retry_topic` — which only that group's consumers read — due after the backoff.

**Exactly once, where it matters.** Failure records are written by an ordinary idempotent
producer (batched: a failure costs the consumer little), so a consumer that crashes after
writing one and before committing may write a second copy when it fails the record again.
Copies are harmless: both land in the same failures partition
(:func:`~sdk.failures.failures_partition`), and the router remembers the identities of the
failure records it routed (group, original topic, partition, offset, attempt) and drops a copy;
its outputs are written under intents, so a router that crashes mid-way redoes exactly what it
had planned (``handlers.retry``). A record is retried, and dead-lettered, once per failed
attempt.

**Attempts.** A record from a source topic is on its attempt 1; a record redelivered from the
retry topic carries the attempt that failed last (``strata.retry.attempt``), so it is on that
plus one. :func:`retry_info` reads all of it back.

**Key order** (``retry.ordering=key``). A consumer with that option keeps, per key, the
records it sent to retry and not yet seen succeed. A later record of such a key is not handed
to the application: it is *parked* — sent to retry too, not as a failed attempt
(``strata.retry.parked`` counts how often), and the router brings it back after the policy's
first wait. A record of such a key that comes back from retry is handed out only when it is
the oldest of its key; the others are parked again. So the records of one key are processed
in their original order, each only after the one before it succeeded or went to the
dead-letter topic. This state is the consumer's memory: a partition that moves to another
member (a rebalance, a crash) starts with none, and order across that move is not promised.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sdk.config import client_config
from sdk.failures import (
    FAILURES_PARTITIONS,
    FAILURES_TOPIC,
    H_ATTEMPT,
    H_DUE_MS,
    H_ERROR,
    H_FAILED_MS,
    H_FIRST_MS,
    H_GROUP,
    H_OFFSET,
    H_ORDERING,
    H_PARK,
    H_PARKED,
    H_PARTITION,
    H_TOPIC,
    HEADER_PREFIX,
    MAX_ERROR_BYTES,
    RETRY_PREFIX,
    ROUTER_GROUP,
    Failure,
    RetryInfo,
    build_failure,
    derived_producer_id,
    failures_partition,
    header,
    identity_seed,
    is_retry_topic,
    retry_info,
    retry_topic,
)
from sdk.producer import Producer
from sdk.records import ConsumerRecord, TopicPartition
from storage.errors import StrataError

log = logging.getLogger(__name__)

#: the failure record's names (``sdk.failures``), re-exported: ``sdk.retry`` is where users
#: and the handlers look for them
__all__ = [
    "FAILURES_PARTITIONS",
    "FAILURES_TOPIC",
    "HEADER_PREFIX",
    "H_ATTEMPT",
    "H_DUE_MS",
    "H_ERROR",
    "H_FAILED_MS",
    "H_FIRST_MS",
    "H_GROUP",
    "H_OFFSET",
    "H_ORDERING",
    "H_PARK",
    "H_PARKED",
    "H_PARTITION",
    "H_TOPIC",
    "MAX_ERROR_BYTES",
    "RETRY_PREFIX",
    "ROUTER_GROUP",
    "Failure",
    "RetryInfo",
    "build_failure",
    "derived_producer_id",
    "failures_partition",
    "header",
    "identity_seed",
    "is_retry_topic",
    "retry_info",
    "retry_topic",
]


class Retrier:
    """Writes failure records for one group (see the module docstring) through an ordinary
    idempotent producer (batched). Until one is stored, :meth:`commit_caps` keeps the
    source record's offset from being committed; one that could not be stored is sent
    again by the next :meth:`flush`."""

    def __init__(self, producer: Producer, group: str) -> None:
        self.producer = producer
        self.group = group
        self._partitions: int | None = None
        self._unsent: dict[TopicPartition, dict[int, int]] = {}
        self._in_flight: set[asyncio.Future[Any]] = set()
        self._failed: list[tuple[ConsumerRecord, Failure]] = []
        self.sent = 0
        self.parked = 0

    async def _failure_partitions(self) -> int:
        if self._partitions is None:
            self._partitions = len(await self.producer.partitions_for(FAILURES_TOPIC))
        return self._partitions

    async def submit(
        self,
        record: ConsumerRecord,
        reason: str = "",
        *,
        parked: bool = False,
        ordered: bool = False,
        crashes: int = 0,
    ) -> None:
        """Start storing the failure record of ``record``; :meth:`flush` waits for it."""
        n = await self._failure_partitions()
        now = time.time_ns() // 1_000_000
        f = build_failure(
            self.group, record, reason, now, n, parked=parked, ordered=ordered, crashes=crashes
        )
        where = TopicPartition(record.topic, record.partition)
        unsent = self._unsent.setdefault(where, {})
        unsent[record.offset] = unsent.get(record.offset, 0) + 1
        await self._send(record, f)
        if parked:
            self.parked += 1
        else:
            self.sent += 1

    async def _send(self, record: ConsumerRecord, f: Failure) -> None:
        fut = await self.producer.send(
            f.tp.topic, f.value, f.key, f.headers, f.tags, f.tp.partition, f.timestamp
        )
        self._in_flight.add(fut)

        def done(fut: asyncio.Future[Any]) -> None:
            self._in_flight.discard(fut)
            if fut.cancelled() or fut.exception() is not None:
                log.warning("a failure record was not stored (sent again by the next flush)")
                self._failed.append((record, f))
                return
            unsent = self._unsent[TopicPartition(record.topic, record.partition)]
            left = unsent[record.offset] - 1
            if left:
                unsent[record.offset] = left
            else:
                del unsent[record.offset]

        fut.add_done_callback(done)

    def commit_caps(self) -> dict[TopicPartition, int]:
        """Per partition, the lowest offset whose failure record is not stored yet."""
        return {tp: min(offsets) for tp, offsets in self._unsent.items() if offsets}

    async def flush(self, wait_s: float | None = None) -> None:
        """Send again what failed, and wait until everything given so far is stored."""
        failed, self._failed = self._failed, []
        for record, f in failed:
            await self._send(record, f)
        if self._in_flight:
            async with asyncio.timeout(wait_s):
                await asyncio.gather(*self._in_flight, return_exceptions=True)
        if self._failed:
            raise StrataError(f"{len(self._failed)} failure record(s) not stored yet")

    async def close(self, wait_s: float = 5.0) -> None:
        """Give what is in flight ``wait_s`` seconds; what is not stored then was not
        committed either, so the partition's next owner reads those records again."""
        with contextlib.suppress(StrataError, TimeoutError):
            await self.flush(wait_s)
        await self.producer.close(flush_timeout=1.0)

    async def fail_many(self, failed: Sequence[tuple[ConsumerRecord, str]]) -> None:
        """Store the failure records of ``failed`` and wait until they are."""
        for record, reason in failed:
            await self.submit(record, reason)
        await self.flush()


def new_retrier_producer(
    bootstrap: Sequence[str] | str, extra: dict[str, Any] | None = None
) -> Producer:
    servers = bootstrap if isinstance(bootstrap, str) else ",".join(bootstrap)
    # no one filters the failures topic: its batches go without a summary
    settings = {"acks": "all", "batch.summary": False, **(extra or {})}
    return Producer(client_config(servers, settings))


H_DEAD = "strata.retry.dead"
"""On a notice the router sends back to a key-ordered group when it dead-letters a record:
the key's next record may go."""

Ident = tuple[str, int, int]


def ident_of(record: ConsumerRecord) -> Ident:
    info = retry_info(record)
    return (info.topic, info.partition, info.offset)


HAND_OUT, HOLD, PARK, DROP = "hand out", "hold", "park", "drop"
MAX_HELD = 10_000
"""Most records a ``retry.ordering=key`` consumer holds in memory behind their keys; beyond
that it parks them (sends them round through the retry topic)."""


@dataclass
class _Entry:
    ident: Ident
    record: ConsumerRecord | None
    """Held here (waiting for its turn), or None: out in the retry topic."""


class KeyOrder:
    """The per-key line of a ``retry.ordering=key`` consumer (see the module docstring).

    Per key, the records not yet done, oldest first: the first is out in retry or being
    processed; the others wait, held in memory (bounded by ``max_held``; beyond it they are
    parked). Pure bookkeeping: the consumer asks :meth:`admit` about every record it reads,
    tells :meth:`failed` about every ``retry_later``, takes :meth:`next_ready` records first,
    and never commits past :meth:`commit_caps`. The record handed out last is settled
    (succeeded, unless it failed) when the next one is asked for."""

    def __init__(self, max_held: int = MAX_HELD) -> None:
        self.max_held = max_held
        self.lines: dict[bytes, list[_Entry]] = {}
        self.held = 0
        self._ready: deque[bytes] = deque()
        self._last: tuple[Ident, bytes] | None = None
        self._last_failed = False

    def settle(self) -> None:
        last, self._last = self._last, None
        if last is None:
            return
        ident, key = last
        line = self.lines.setdefault(key, [])
        if self._last_failed:
            if line and line[0].ident == ident:
                line[0].record = None
            else:
                line.insert(0, _Entry(ident, None))
            return
        if line and line[0].ident == ident:
            line.pop(0)
        self._advance(key)

    def _advance(self, key: bytes) -> None:
        line = self.lines.get(key)
        if not line:
            self.lines.pop(key, None)
            return
        if line[0].record is not None:
            self._ready.append(key)

    def next_ready(self) -> ConsumerRecord | None:
        """A held record whose turn has come (hand it out now), if any."""
        self.settle()
        self._last_failed = False
        while self._ready:
            key = self._ready.popleft()
            line = self.lines.get(key)
            if line and line[0].record is not None:
                record, line[0].record = line[0].record, None
                self.held -= 1
                self._last = (line[0].ident, key)
                return record
        return None

    def admit(self, record: ConsumerRecord) -> str:
        """HAND_OUT, HOLD (kept here until its turn), PARK or DROP (a dead-letter notice)."""
        self.settle()
        self._last_failed = False
        key = record.key
        ident = ident_of(record)
        if header(record.headers, H_DEAD) is not None:
            line = self.lines.get(key) if key is not None else None
            if line:
                was_first = line[0].ident == ident
                line[:] = [e for e in line if e.ident != ident or e.record is not None]
                if was_first and key is not None:
                    self._advance(key)
            return DROP
        if key is None:
            return HAND_OUT
        line = self.lines.get(key)
        if not line or (line[0].ident == ident and line[0].record is None):
            self._last = (ident, key)
            return HAND_OUT
        for entry in line:
            if entry.ident == ident:
                if entry.record is not None:
                    return DROP  # held already (a second copy)
                if self.held >= self.max_held:
                    return PARK
                entry.record = record
                self.held += 1
                return HOLD
        if self.held >= self.max_held:
            line.append(_Entry(ident, None))
            return PARK
        line.append(_Entry(ident, record))
        self.held += 1
        return HOLD

    def failed(self, record: ConsumerRecord) -> None:
        if record.key is not None and self._last == (ident_of(record), record.key):
            self._last_failed = True

    def commit_caps(self) -> dict[TopicPartition, int]:
        """Per partition, the lowest offset held here (not to be committed yet)."""
        caps: dict[TopicPartition, int] = {}
        for line in self.lines.values():
            for e in line:
                if e.record is not None:
                    tp = TopicPartition(e.record.topic, e.record.partition)
                    caps[tp] = min(caps.get(tp, e.record.offset), e.record.offset)
        return caps
