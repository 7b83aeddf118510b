"""The delay scheduler: a lambda-style handler over batches of the delay level topics.

The event-source runner (``infra.event_source``) invokes :func:`handler` with records of the
delay levels (``sdk.delays``), grouped by lane, in the shape of AWS Lambda's Kafka event. For
each lane the scheduler takes the *ready* prefix — records whose time in their level is over
(``timestamp + 2**level <= now``; in the last mile, ``due <= now``) — and forwards it as one
unit:

1. read the lane's intent (``storage.metadata.delays``). If the batch starts at or before the
   intent's start, the runner never committed past that forward, which may have been cut
   short: redo exactly that plan (reading any records the batch lacks). Records below the
   intent's end are forwarded already and are skipped;
2. write a new intent ``[a, b)`` with the plan's ``now`` (compare-and-set: of two processes
   that hold the lane at once, only one forwards);
3. read the cancel set: records cancelled before the intent are dropped;
4. write one batch per target partition (the records due by ``now``) and one per lower level
   (the others, with ``now`` as their entry time) with ``Producer.send_exact``. Each batch's
   producer id is derived from (lane, intent version, destination) with sequence 0, so a
   redo's batches are recognised by the destination's leader as duplicates;
5. answer success for the forwarded records; the rest of the batch is reported as a
   ``batchItemFailure`` with ``retryAfterMs`` (when its head becomes ready), so the runner
   commits what was forwarded and pauses the lane until then.

Redo and skip make a forward happen exactly once per source record however often the
runner retries, crashes or rebalances; ``docs/delays.md`` gives the argument and its limits.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import logging
import os
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from handlers.ranges import read_committed_range
from handlers.runtime import NATIVE_RECORDS, Invocation, shared_runtime, takes_native_records
from handlers.stats import ThrottledWrites
from sdk import Producer
from sdk import delays as d
from sdk.config import client_config
from sdk.records import ConsumerRecord, TopicPartition
from storage.codec import encode_batch
from storage.errors import (
    InvalidTopicError,
    NodeNotFoundError,
    StrataError,
    UnknownTopicOrPartitionError,
    VersionConflictError,
)
from storage.metadata import MetadataStore
from storage.metadata.delays import DelayStore, Intent, cancel_bucket

log = logging.getLogger(__name__)

CHUNK_BYTES = 512 * 1024
"""At most this many record bytes are forwarded per lane and invocation (one output batch
never exceeds it)."""
PRODUCE_TIMEOUT = 8.0
STATS_EVERY = 5.0
SWEEP_EVERY = 600.0
LATENESS_BUCKETS_MS = (50, 100, 250, 500, 1000, 2000, 5000, 10_000, 60_000)
Headers = list[tuple[str, bytes]]


def _wall_ms() -> int:
    return time.time_ns() // 1_000_000


@dataclass(frozen=True, slots=True)
class Rec:
    """One record of a lane, as the scheduler needs it."""

    offset: int
    timestamp: int
    key: bytes | None
    value: bytes | None
    headers: Headers
    tags: list[str] | None
    sid: d.ScheduleId | None
    topic_id: str | None
    """The target's incarnation when the record was sent (None: deliver by name)."""

    @classmethod
    def build(
        cls,
        offset: int,
        timestamp: int,
        key: bytes | None,
        value: bytes | None,
        headers: Headers,
        tags: list[str] | None,
    ) -> Rec:
        sid = None
        topic_id = None
        for k, v in headers:
            if k == d.HEADER_ID:
                try:
                    sid = d.ScheduleId.parse(v.decode())
                except (StrataError, UnicodeDecodeError):
                    sid = None
            elif k == d.HEADER_TOPIC_ID:
                topic_id = v.decode(errors="replace") or None
        return cls(offset, timestamp, key, value, headers, tags, sid, topic_id)

    @classmethod
    def from_event(cls, r: Mapping[str, Any]) -> Rec:
        key = r.get("key")
        value = r.get("value")
        headers = [(k, bytes(v)) for h in r.get("headers") or () for k, v in h.items()]
        return cls.build(
            int(r["offset"]),
            int(r["timestamp"]),
            None if key is None else base64.b64decode(key),
            None if value is None else base64.b64decode(value),
            headers,
            list(r["tags"]) if r.get("tags") else None,
        )

    @classmethod
    def from_consumer(cls, r: ConsumerRecord) -> Rec:
        return cls.build(
            r.offset, r.timestamp, r.key, r.value, list(r.headers), list(r.tags) or None
        )

    def moved_headers(self) -> Headers:
        """The headers it moves on with: the original timestamp added if the producer left it
        to the record's timestamp in its first level."""
        if any(k == d.HEADER_TIMESTAMP for k, _ in self.headers):
            return self.headers
        return [*self.headers, (d.HEADER_TIMESTAMP, str(self.timestamp).encode())]

    @property
    def size(self) -> int:
        return (
            len(self.value or b"")
            + len(self.key or b"")
            + sum(len(k) + len(v) + 8 for k, v in self.headers)
            + 32
        )


def lanes_of(event: Mapping[str, Any]) -> dict[TopicPartition, list[Rec]]:
    """The event's records by lane, in offset order."""
    native = event.get(NATIVE_RECORDS)
    if native is not None:  # the runner in this process: no base64 to undo
        return {
            tp: sorted(map(Rec.from_consumer, recs), key=lambda r: r.offset)
            for tp, recs in native.items()
            if recs
        }
    out: dict[TopicPartition, list[Rec]] = {}
    for records in (event.get("records") or {}).values():
        for r in records:
            tp = TopicPartition(r["topic"], int(r["partition"]))
            out.setdefault(tp, []).append(Rec.from_event(r))
    for recs in out.values():
        recs.sort(key=lambda r: r.offset)
    return out


def producer_id(intent: Intent, lane: TopicPartition, dest: TopicPartition) -> int:
    """The producer id of one output batch of a forward (63 bits, never negative)."""
    text = (
        f"{lane.topic}/{lane.partition}/{intent.version}/{intent.a}/{dest.topic}/{dest.partition}"
    )
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


@dataclass
class Stats:
    delivered: int = 0
    hops: int = 0
    cancelled: int = 0
    dropped: int = 0
    redone: int = 0
    lateness_ms: list[int] = field(default_factory=lambda: [0] * (len(LATENESS_BUCKETS_MS) + 1))

    def late(self, ms: int) -> None:
        for i, bound in enumerate(LATENESS_BUCKETS_MS):
            if ms <= bound:
                self.lateness_ms[i] += 1
                return
        self.lateness_ms[-1] += 1

    def to_json(self) -> dict[str, Any]:
        return {
            "delivered": self.delivered,
            "hops": self.hops,
            "cancelled": self.cancelled,
            "dropped": self.dropped,
            "redone": self.redone,
            "lateness_buckets_ms": list(LATENESS_BUCKETS_MS),
            "lateness_counts": list(self.lateness_ms),
        }


@dataclass(frozen=True, slots=True)
class Outcome:
    """What became of one lane's records in one invocation: success up to ``failed_at``
    (None: all), the rest retried after ``retry_after_ms`` (None: the runner's backoff)."""

    failed_at: int | None = None
    retry_after_ms: int | None = None


class Scheduler:
    """Forwards what is due from the delay levels (see the module docstring)."""

    def __init__(
        self,
        *,
        clock_ms: Callable[[], int] = _wall_ms,
        name: str | None = None,
        chunk_bytes: int = CHUNK_BYTES,
        produce_timeout: float = PRODUCE_TIMEOUT,
    ) -> None:
        self.clock_ms = clock_ms
        self.name = name or f"scheduler-{os.getpid()}"
        self.chunk_bytes = chunk_bytes
        self.produce_timeout = produce_timeout
        self.stats = Stats()
        self._producers: dict[str, Producer] = {}
        self._swept_at = 0.0
        self._stats = ThrottledWrites(STATS_EVERY, "scheduler's stats")
        self._intents: dict[tuple[str, int], tuple[Intent | None, int]] = {}
        """Each lane's intent as this process last wrote it (or read it), with the node's
        version: what the node holds unless another process wrote it since, which the next
        compare-and-set finds out. One entry per level partition."""

    async def close(self) -> None:
        self._stats.cancel()
        producers, self._producers = self._producers, {}
        for p in producers.values():
            await p.close(flush_timeout=1.0)

    async def _producer(self, bootstrap: str) -> Producer:
        producer = self._producers.get(bootstrap)
        if producer is None:
            producer = Producer(client_config(bootstrap, {"acks": "all"}))
            await producer.start()
            self._producers[bootstrap] = producer
            # the hops' destinations: learn them all at once
            await asyncio.gather(
                *(producer.partitions_for(t) for t in d.level_topics()), return_exceptions=True
            )
        return producer

    async def process(self, event: Mapping[str, Any], store: MetadataStore) -> dict[str, Any]:
        """One invocation: the Lambda-style answer with ``batchItemFailures``."""
        bootstrap = str(event.get("bootstrapServers") or "")
        producer = await self._producer(bootstrap)
        ds = DelayStore(store.zk)
        lanes = lanes_of(event)
        results = await asyncio.gather(
            *(self._lane(ds, store, producer, bootstrap, tp, recs) for tp, recs in lanes.items()),
            return_exceptions=True,
        )
        failures = []
        for (tp, recs), result in zip(lanes.items(), results, strict=True):
            if isinstance(result, BaseException):
                if not isinstance(result, Exception):
                    raise result
                log.warning("lane %s[%d] failed: %r", tp.topic, tp.partition, result)
                result = Outcome(recs[0].offset)
            if result.failed_at is not None:
                item: dict[str, Any] = {
                    "itemIdentifier": f"{tp.topic}-{tp.partition}@{result.failed_at}"
                }
                if result.retry_after_ms is not None:
                    item["retryAfterMs"] = result.retry_after_ms
                failures.append(item)
        await self._housekeeping(ds)
        return {"batchItemFailures": failures}

    async def _housekeeping(self, ds: DelayStore) -> None:
        now = time.monotonic()
        await self._stats.maybe(lambda: ds.write_stats(self.name, self.stats.to_json()))
        if now - self._swept_at >= SWEEP_EVERY:
            self._swept_at = now
            await ds.sweep_cancels(self.clock_ms())

    async def _lane(
        self,
        ds: DelayStore,
        store: MetadataStore,
        producer: Producer,
        bootstrap: str,
        tp: TopicPartition,
        recs: list[Rec],
    ) -> Outcome:
        level = d.level_of(tp.topic)
        if level is None:
            raise UnknownTopicOrPartitionError(f"{tp.topic} is not a delay level topic")
        exit_after = d.level_delay_ms(level)
        last_mile = level == d.MIN_LEVEL

        def leaves(r: Rec) -> int:
            return r.sid.due_ms if last_mile and r.sid is not None else r.timestamp + exit_after

        original = recs
        head = leaves(recs[0]) - self.clock_ms()
        if head > 0:
            # nothing ready, so nothing to forward, and no forward to redo either: a record
            # a forward took was ready then, so it is now (or, under another process's faster
            # clock, soon: the redo waits that long). No ZooKeeper read for records that
            # have just entered their level.
            return Outcome(recs[0].offset, head)
        key = (tp.topic, tp.partition)
        known = self._intents.get(key)
        if known is not None and (known[0] is None or recs[0].offset > known[0].a):
            # no forward to redo, if this process's last write is still the lane's: the
            # compare-and-set below fails if another process wrote since, and then the
            # lane is read afresh before anything is sent
            intent, version = known
        else:
            intent, version = await ds.read_lane(tp.topic, tp.partition)
            self._intents[key] = (intent, version)
            known = None
        if intent is not None and recs[0].offset <= intent.a:
            # the runner did not commit past the last forward: it may be incomplete, redo it
            chunk = [r for r in recs if intent.a <= r.offset < intent.b]
            if len(chunk) != intent.b - intent.a:
                chunk = await self._read(bootstrap, tp, intent.a, intent.b)
            log.info("redo %s[%d] [%d, %d)", tp.topic, tp.partition, intent.a, intent.b)
            self.stats.redone += 1
            await self._forward(ds, store, producer, tp, intent, chunk)
        if intent is not None and recs[0].offset < intent.b:
            recs = [r for r in recs if r.offset >= intent.b]  # forwarded already
            if not recs:
                return Outcome()
        now = self.clock_ms()
        ready: list[Rec] = []
        size = 0
        come_back = 0
        for r in recs:
            if (left := leaves(r) - now) > 0:
                come_back = left
                break
            if ready and size + r.size > self.chunk_bytes:
                break
            ready.append(r)
            size += r.size
        if ready:
            try:
                intent = await ds.write_intent(
                    tp.topic, tp.partition, ready[0].offset, ready[-1].offset + 1, now, version
                )
            except (VersionConflictError, NodeNotFoundError):
                self._intents.pop(key, None)
                if known is None:
                    raise
                # another process wrote the lane since this one did: read it, and start over
                return await self._lane(ds, store, producer, bootstrap, tp, original)
            self._intents[key] = (intent, intent.version)
            await self._forward(ds, store, producer, tp, intent, ready)
        if len(ready) == len(recs):
            return Outcome()
        return Outcome(recs[len(ready)].offset, come_back)

    async def _read(self, bootstrap: str, tp: TopicPartition, start: int, end: int) -> list[Rec]:
        """Records ``[start, end)`` of a lane that a redo needs and the batch lacks, read as
        the runner reads them (``read_committed``: a delay an aborted transaction stored is
        never forwarded, a redo's included)."""
        got = await read_committed_range(bootstrap, tp, start, end, limit_s=self.produce_timeout)
        return [Rec.from_consumer(r) for r in got]

    async def _forward(
        self,
        ds: DelayStore,
        store: MetadataStore,
        producer: Producer,
        lane: TopicPartition,
        intent: Intent,
        records: list[Rec],
    ) -> None:
        deliver: dict[TopicPartition, list[Rec]] = defaultdict(list)
        hop: dict[TopicPartition, list[Rec]] = defaultdict(list)
        lane_counts: dict[str, int] = {}
        for r in records:
            if r.sid is None:
                self.stats.dropped += 1  # not a delayed record: nowhere to send it
                continue
            remaining = r.sid.due_ms - intent.now
            if remaining <= 0:
                deliver[TopicPartition(r.sid.topic, r.sid.partition)].append(r)
                continue
            topic = d.level_topic(d.level_for(remaining))
            if topic not in lane_counts:
                lane_counts[topic] = len(await producer.partitions_for(topic))
            hop[TopicPartition(topic, r.sid.lane_in(lane_counts[topic]))].append(r)
        by_bucket: dict[int, set[str]] = defaultdict(set)
        for recs in deliver.values():
            for r in recs:
                assert r.sid is not None
                by_bucket[cancel_bucket(r.sid.due_ms)].add(r.sid.encode())
        cancelled = await ds.cancelled_before(by_bucket, intent.zxid) if by_bucket else set()
        now = max(self.clock_ms(), intent.now)
        deliveries: dict[TopicPartition, list[Rec]] = {}
        for dest, recs in deliver.items():
            keep = [r for r in recs if r.sid is not None and r.sid.encode() not in cancelled]
            self.stats.cancelled += len(recs) - len(keep)
            if keep:
                deliveries[dest] = keep
        pinned = await self._incarnations(store, producer, deliveries)
        await asyncio.gather(
            self._send(producer, intent, lane, deliveries, now, deliver=True, topic_ids=pinned),
            self._send(producer, intent, lane, hop, intent.now, deliver=False),
        )

    async def _incarnations(
        self,
        store: MetadataStore,
        producer: Producer,
        deliveries: dict[TopicPartition, list[Rec]],
    ) -> dict[str, str]:
        """The incarnation each target topic of ``deliveries`` is written to (KIP-516); the
        records sent to another one, deleted since, are dropped from ``deliveries``.

        The producer's metadata answers when it names the records' own id; otherwise the
        topic's spec in ZooKeeper does (the metadata may lag a delete or a create), read
        once per topic and invocation. A topic being deleted has no live incarnation."""
        sent_to: dict[str, set[str]] = defaultdict(set)
        for dest, recs in deliveries.items():
            sent_to[dest.topic].update(r.topic_id for r in recs if r.topic_id)
        live: dict[str, str] = {}
        for topic, ids in sent_to.items():
            if not ids:
                continue
            current = producer.topic_id(topic)
            if ids != {current}:
                current = await _live_topic_id(store, topic)
            if current is not None:
                live[topic] = current
        for dest in [tp for tp in deliveries if sent_to[tp.topic]]:
            recs = deliveries[dest]
            keep = [r for r in recs if r.topic_id in (None, live.get(dest.topic))]
            if len(keep) < len(recs):
                log.warning(
                    "dropping %d record(s) for a deleted incarnation of topic %s",
                    len(recs) - len(keep),
                    dest.topic,
                )
                self.stats.dropped += len(recs) - len(keep)
            if keep:
                deliveries[dest] = keep
            else:
                del deliveries[dest]
        return live

    async def _send(
        self,
        producer: Producer,
        intent: Intent,
        lane: TopicPartition,
        outputs: dict[TopicPartition, list[Rec]],
        timestamp: int,
        *,
        deliver: bool,
        topic_ids: Mapping[str, str] | None = None,
    ) -> None:
        """One batch per destination, all in one request per agent."""
        if not outputs:
            return
        batches = {
            dest: encode_batch(
                [r.value for r in recs],
                keys=[r.key for r in recs],
                timestamps=timestamp,
                headers=[r.moved_headers() for r in recs],
                tags=[r.tags for r in recs],
                producer_id=producer_id(intent, lane, dest),
                producer_epoch=0,
                base_sequence=0,
                summary=deliver,  # filters read targets, not levels
            )
            for dest, recs in outputs.items()
        }
        channel = "deliver" if deliver else "hop"
        try:
            await producer.send_exact(
                batches, self.produce_timeout, channel=channel, topic_ids=topic_ids
            )
        except UnknownTopicOrPartitionError:
            if not deliver:
                raise
            gone = [t for t in {tp.topic for tp in batches} if not await _topic_exists(producer, t)]
            if not gone:
                raise
            for tp in [tp for tp in batches if tp.topic in gone]:
                log.warning(
                    "dropping %d record(s) for deleted topic %s", len(outputs[tp]), tp.topic
                )
                self.stats.dropped += len(outputs.pop(tp))
                del batches[tp]
            await producer.send_exact(
                batches, self.produce_timeout, channel=channel, topic_ids=topic_ids
            )
        if deliver:
            for recs in outputs.values():
                self.stats.delivered += len(recs)
                for r in recs:
                    if r.sid is not None:
                        self.stats.late(max(0, timestamp - r.sid.due_ms))
        else:
            self.stats.hops += sum(map(len, outputs.values()))


async def _live_topic_id(store: MetadataStore, topic: str) -> str | None:
    """The id of ``topic``'s live incarnation as ZooKeeper says (None: no topic of that name,
    or one being deleted)."""
    try:
        spec, _ = await store.get_topic(topic)
    except (UnknownTopicOrPartitionError, InvalidTopicError):
        return None
    return spec.topic_id if spec.deletion is None else None


async def _topic_exists(producer: Producer, topic: str) -> bool:
    try:
        await producer.partitions_for(topic)
    except UnknownTopicOrPartitionError:
        return False
    return True


def close(scheduler: Scheduler, timeout: float = 5.0) -> None:
    """Close the scheduler's clients on the handlers' runtime (tests; shutdown)."""
    shared_runtime().call(lambda _store: scheduler.close(), timeout=timeout)


def make_handler(scheduler: Scheduler) -> Callable[[Mapping[str, Any], Any], dict[str, Any]]:
    """A ``handler(event, context)`` running ``scheduler`` on the handlers' shared runtime."""

    @takes_native_records
    def handle(event: Mapping[str, Any], context: Any) -> dict[str, Any]:
        return Invocation(context).run(lambda store: scheduler.process(event, store))

    return handle


handler = make_handler(Scheduler())
