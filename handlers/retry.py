"""The retry router: a lambda-style handler over batches of the failures topic.

The event-source runner (``infra.event_source``, mapping :func:`router_mapping`) invokes
:func:`handler` with failure records (``sdk.retry``): records a consumer could not process,
each with the group, the original topic/partition/offset, the attempt that failed and the
time of the failure in ``strata.retry.*`` headers. For each one the router reads the group's
policy for the original topic (``storage.metadata.retry``; the default policy if it has none)
and sends the record on:

* ``attempt >= max_attempts``: to the dead-letter topic, partition = original partition
  modulo its partitions, with every header;
* otherwise to the group's retry topic (``__strata_retry.<group>``), due at failure time +
  ``backoff(attempt)``: through the delay levels (``docs/delays.md``) when there is time left,
  straight to the retry topic when the due time has passed. ``strata.retry.due_ms`` says when.
* a *parked* record (``retry.ordering=key``; it waits behind an earlier record of its key) goes
  back after the policy's first wait, never to the dead-letter topic; a dead-lettered record
  of a key-ordered group is followed by a notice on the retry topic (``strata.retry.dead``) so
  the key's next record may go.

**Exactly once.** The router forwards a failures partition in *ranges*, as the delay scheduler
forwards a lane (``handlers.scheduler``): before it sends anything it writes its *intent*, the
range ``[a, b)`` of failure records it is about to route, to ZooKeeper (compare-and-set:
``storage.metadata.retry``), then writes one batch per destination partition with a producer
id derived from (failures partition, the intent's version and start, destination), sequence
0. A router that crashes mid-forward, or an invocation that fails, leaves the runner's
commit at or before ``a``: the next invocation redoes exactly ``[a, b)`` (reading the records
again if its batch lacks some), every choice — destination, due time (the jitter is a hash),
level, entry timestamp — being a function of each failure record and its policy, so it writes
the same batches, which the destinations' leaders answer as duplicates; records below ``b``
are skipped. A *copy* of a failure record (a consumer that crashed after storing one and
before committing its source offset fails the record again) sits at another offset of the same
failures partition (``sdk.failures.failures_partition``): the router remembers the identities
(group, original topic/partition/offset, attempt, parks) of the last :data:`WINDOW` failure
records of each partition it forwards, reading them back from the log when it takes a
partition over, and drops a copy whose original is among them. So nothing is lost (the runner
commits only what was routed) and nothing is dead-lettered or retried twice, within those
bounds (``docs/retries.md``).
"""

from __future__ import annotations

import base64
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from handlers import ranges
from handlers.runtime import NATIVE_RECORDS, Invocation, shared_runtime, takes_native_records
from handlers.stats import ThrottledWrites
from sdk import Producer
from sdk import delays as d
from sdk import retry as r
from sdk.config import client_config
from sdk.records import ConsumerRecord, TopicPartition
from storage.codec import encode_batch
from storage.errors import NodeNotFoundError, StrataError, VersionConflictError
from storage.metadata import MetadataStore
from storage.metadata.delays import Intent
from storage.metadata.retry import RetryStore
from storage.retry_policy import DEFAULT_POLICY, RetryPolicy

log = logging.getLogger(__name__)

SEND_TIMEOUT = 10.0
POLICY_TTL_S = 5.0
#: at most one write of the router's counts to ZooKeeper this often (``handlers.stats``)
STATS_EVERY = 1.0
CHUNK_BYTES = 512 * 1024
"""At most this many record bytes are forwarded under one intent (one output batch never
exceeds it)."""
WINDOW = 50_000
"""Failure records whose identities the router remembers per failures partition: a copy of a
failure record is recognised (and dropped) if its original is among the last this many
records of its partition."""
READ_TIMEOUT = 30.0
Headers = list[tuple[str, bytes]]


def _wall_ms() -> int:
    return time.time_ns() // 1_000_000


def record_of(doc: Mapping[str, Any]) -> ConsumerRecord:
    key, value = doc.get("key"), doc.get("value")
    return ConsumerRecord(
        str(doc["topic"]),
        int(doc["partition"]),
        int(doc["offset"]),
        int(doc["timestamp"]),
        None if key is None else base64.b64decode(key),
        None if value is None else base64.b64decode(value),
        [(k, bytes(v)) for h in doc.get("headers") or () for k, v in h.items()],
        tuple(doc.get("tags") or ()),
    )


@dataclass(frozen=True, slots=True)
class Output:
    """One routed record: its destination and what is written there."""

    tp: TopicPartition
    record: ConsumerRecord
    headers: Headers
    timestamp: int
    kind: str
    """"retry", "dlq", "park" or "notice"."""
    summary: bool = True
    """Write the tag/header summary filters use (not needed in a delay level)."""


@dataclass
class Stats:
    retries_by_attempt: dict[str, int] = field(default_factory=dict)
    dead_lettered: dict[str, int] = field(default_factory=dict)
    parked: int = 0
    copies: int = 0
    """Copies of failure records recognised and dropped."""
    redone: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "retries_by_attempt": dict(self.retries_by_attempt),
            "dead_lettered": dict(self.dead_lettered),
            "parked": self.parked,
            "copies": self.copies,
            "redone": self.redone,
        }


class PartitionCounts:
    """Partition counts of the destinations, learned once per topic."""

    def __init__(self, producer: Producer) -> None:
        self.producer = producer
        self._counts: dict[str, int] = {}

    async def __call__(self, topic: str) -> int:
        if topic not in self._counts:
            self._counts[topic] = len(await self.producer.partitions_for(topic))
        return self._counts[topic]

    def topic_id(self, topic: str) -> str | None:
        """The id of the incarnation of ``topic`` (counted before) the metadata names."""
        return self.producer.topic_id(topic)


class Router:
    """Routes failure records (see the module docstring)."""

    def __init__(
        self,
        *,
        clock_ms: Callable[[], int] = _wall_ms,
        name: str | None = None,
        stats_every: float = STATS_EVERY,
        window: int = WINDOW,
        chunk_bytes: int = CHUNK_BYTES,
    ) -> None:
        self.clock_ms = clock_ms
        self.window = window
        self.chunk_bytes = chunk_bytes
        self._intents: dict[int, tuple[Intent | None, int]] = {}
        """Each failures partition's intent as this process last wrote (or read) it, with the
        node's version (as the scheduler's lanes)."""
        self._seen: dict[int, Seen] = {}
        self.name = name or f"router-{os.getpid()}"
        self.stats = Stats()
        self._producers: dict[str, Producer] = {}
        self._policies: dict[tuple[str, str], tuple[float, RetryPolicy]] = {}
        self._written: dict[str, Any] | None = None
        self._stats = ThrottledWrites(stats_every, "retry router's stats")

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
        return producer

    async def policy(self, store: RetryStore, group: str, topic: str) -> RetryPolicy:
        now = time.monotonic()
        cached = self._policies.get((group, topic))
        if cached is not None and now - cached[0] < POLICY_TTL_S:
            return cached[1]
        policy = await store.get_policy(group, topic) or DEFAULT_POLICY
        self._policies[(group, topic)] = (now, policy)
        return policy

    async def process(self, event: Mapping[str, Any], store: MetadataStore) -> dict[str, Any]:
        """One invocation: routes every record, answers Lambda's ``batchItemFailures``."""
        bootstrap = str(event.get("bootstrapServers") or "")
        producer = await self._producer(bootstrap)
        rs = RetryStore(store.zk)
        counts = PartitionCounts(producer)
        failures = []
        native = event.get(NATIVE_RECORDS)  # the runner in this process: no base64 to undo
        batches = (
            [list(recs) for recs in native.values() if recs]
            if native is not None
            else [list(map(record_of, docs)) for docs in (event.get("records") or {}).values()]
        )
        for recs in batches:
            recs.sort(key=lambda x: x.offset)
            try:
                await self._route_partition(rs, producer, counts, bootstrap, recs)
            except StrataError as exc:
                log.warning("routing %s[%d] failed: %r", recs[0].topic, recs[0].partition, exc)
                failures.append(
                    {"itemIdentifier": f"{recs[0].topic}-{recs[0].partition}@{recs[0].offset}"}
                )
        await self.write_stats(rs)
        return {"batchItemFailures": failures}

    async def write_stats(self, rs: RetryStore) -> None:
        """Publish the counts if they changed since the last write, at most every
        ``stats_every`` seconds (``handlers.stats``: the last change is written when the
        interval ends, the newest counts last)."""

        async def write() -> None:
            stats = self.stats.to_json()
            if stats != self._written:
                await rs.write_stats(self.name, stats)
                self._written = stats

        await self._stats.maybe(write)

    async def _route_partition(
        self,
        rs: RetryStore,
        producer: Producer,
        counts: PartitionCounts,
        bootstrap: str,
        recs: list[ConsumerRecord],
    ) -> None:
        """Route one failures partition's records, in ranges under intents (module
        docstring)."""
        tp = TopicPartition(recs[0].topic, recs[0].partition)
        known = self._intents.get(tp.partition)
        if known is not None and (known[0] is None or recs[0].offset > known[0].a):
            intent, version = known  # no forward to redo (unless another process wrote since)
        else:
            intent, version = await rs.read_forward(tp.partition)
            self._intents[tp.partition] = (intent, version)
            self._seen.pop(tp.partition, None)  # another process may have routed meanwhile
            known = None
        if intent is not None and recs[0].offset <= intent.a:
            # the runner did not commit past the last forward: it may be incomplete, redo it
            chunk = [x for x in recs if intent.a <= x.offset < intent.b]
            if not chunk or chunk[0].offset != intent.a or recs[-1].offset < intent.b - 1:
                chunk = await ranges.read_committed_range(
                    bootstrap, tp, intent.a, intent.b, limit_s=READ_TIMEOUT
                )
            log.info("redo %s[%d] [%d, %d)", tp.topic, tp.partition, intent.a, intent.b)
            self.stats.redone += 1
            await self._forward(rs, producer, counts, bootstrap, tp, intent, chunk)
        if intent is not None:
            recs = [x for x in recs if x.offset >= intent.b]  # forwarded already
        while recs:
            size = 0
            n = 0
            for x in recs:
                size += len(x.value or b"") + len(x.key or b"")
                if n and size > self.chunk_bytes:
                    break
                n += 1
            chunk, recs = recs[:n], recs[n:]
            try:
                intent = await rs.write_forward(
                    tp.partition, chunk[0].offset, chunk[-1].offset + 1, self.clock_ms(), version
                )
            except (VersionConflictError, NodeNotFoundError):
                self._intents.pop(tp.partition, None)
                raise  # another process forwards this partition: the runner tries again
            version = intent.version
            self._intents[tp.partition] = (intent, version)
            await self._forward(rs, producer, counts, bootstrap, tp, intent, chunk)

    async def _forward(
        self,
        rs: RetryStore,
        producer: Producer,
        counts: PartitionCounts,
        bootstrap: str,
        tp: TopicPartition,
        intent: Intent,
        chunk: list[ConsumerRecord],
    ) -> None:
        """Route ``chunk``, the records of ``intent``: copies of failures already routed are
        dropped, the rest written as one batch per destination partition."""
        seen = await self._seen_before(bootstrap, tp, intent.a)
        fresh: dict[Identity, None] = {}
        outputs: list[Output] = []
        copies = 0
        for rec in chunk:
            failure = Failure.of(rec)
            if failure is None:
                log.warning("dropping a record without %s at offset %d", r.H_GROUP, rec.offset)
                continue
            if failure.identity in seen.ids or failure.identity in fresh:
                copies += 1
                continue
            fresh[failure.identity] = None
            outputs += await self.route(rs, counts, failure)
        by_dest: dict[TopicPartition, list[Output]] = {}
        for out in outputs:
            by_dest.setdefault(out.tp, []).append(out)
        batches = {
            dest: encode_outputs(outs, forward_producer_id(tp, intent, dest))
            for dest, outs in by_dest.items()
        }
        if batches:
            await producer.send_exact(batches, SEND_TIMEOUT, channel="retry")
        seen.extend(fresh, intent.b)
        self.stats.copies += copies
        for out in outputs:
            self._count(out)

    async def _seen_before(self, bootstrap: str, tp: TopicPartition, at: int) -> Seen:
        """The identities of the failure records of ``tp`` below ``at`` (at most the last
        ``window``): this process's own memory if it routed up to ``at``, else read back from
        the log (a partition taken over, a restart)."""
        seen = self._seen.get(tp.partition)
        if seen is not None and seen.end <= at:
            return seen  # (between end and at: records the runner does not see, e.g. markers)
        seen = Seen(self.window)
        if at > 0:
            start = max(0, at - self.window)
            got = await ranges.read_committed_range(
                bootstrap, tp, start, at, limit_s=READ_TIMEOUT, warn_lost=False
            )
            for rec in got:
                if (failure := Failure.of(rec)) is not None:
                    seen.ids[failure.identity] = None
        seen.end = at
        self._seen[tp.partition] = seen
        return seen

    def _count(self, out: Output) -> None:
        if out.kind == "retry":
            attempt = r.header(out.headers, r.H_ATTEMPT) or b"0"
            key = attempt.decode()
            self.stats.retries_by_attempt[key] = self.stats.retries_by_attempt.get(key, 0) + 1
        elif out.kind == "dlq":
            topic = out.tp.topic
            self.stats.dead_lettered[topic] = self.stats.dead_lettered.get(topic, 0) + 1
        elif out.kind == "park":
            self.stats.parked += 1

    async def route(
        self, rs: RetryStore, counts: PartitionCounts, failure: Failure
    ) -> list[Output]:
        """Where one failure record goes: a function of its headers and its policy only (a
        redo routes it the same way)."""
        rec, group, info, parked = failure.record, failure.group, failure.info, failure.parked
        h = rec.headers
        attempt = info.attempt - 1  # the attempt that failed
        failed_ms = int(r.header(h, r.H_FAILED_MS) or rec.timestamp)
        policy = await self.policy(rs, group, info.topic)
        seed = r.identity_seed(group, info.topic, info.partition, info.offset)
        ordered = r.header(h, r.H_ORDERING) is not None
        retry_topic = r.retry_topic(group)
        if not parked and policy.gives_up(attempt):
            dlq = policy.dlq_for(info.topic)
            dest = TopicPartition(dlq, info.partition % await counts(dlq))
            outs = [Output(dest, rec, list(h), failed_ms, "dlq")]
            if ordered:
                notice = [*h, (r.H_DEAD, b"1")]
                tp = TopicPartition(retry_topic, info.partition % await counts(retry_topic))
                outs.append(Output(tp, rec, notice, failed_ms, "notice"))
            return outs
        wait = policy.park_ms(info.parked) if parked else policy.backoff_ms(attempt, seed)
        due = failed_ms + wait
        dest = TopicPartition(retry_topic, info.partition % await counts(retry_topic))
        headers = [(k, v) for k, v in h if k not in d.DELAY_HEADERS and k != r.H_DUE_MS]
        headers.append((r.H_DUE_MS, str(due).encode()))
        kind = "park" if parked else "retry"
        if wait <= 0:
            return [Output(dest, rec, headers, failed_ms, kind)]
        # the level follows from the wait alone; entered at the failure time, the record
        # leaves it at failed_ms + 2**level <= due (at once if the router is late)
        # a nonce of the identity: a keyless record's lane follows from it, the same in a redo
        nonce = f"r{r.derived_producer_id(kind, seed, attempt, info.parked):x}"
        sid = d.ScheduleId.new(due, dest.topic, dest.partition, rec.key, nonce)
        headers.append((d.HEADER_ID, sid.encode().encode()))
        if (topic_id := counts.topic_id(dest.topic)) is not None:
            # the retry topic's incarnation: if it is deleted (and created again) while the
            # record waits, the scheduler drops the record (``docs/delays.md``)
            headers.append((d.HEADER_TOPIC_ID, topic_id.encode()))
        headers.append((d.HEADER_TIMESTAMP, str(failed_ms).encode()))
        level = d.level_topic(d.level_for(wait))
        lane = TopicPartition(level, sid.lane_in(await counts(level)))
        return [Output(lane, rec, headers, failed_ms, kind, summary=False)]


Identity = tuple[str, int, int, bool]


class Failure(NamedTuple):
    """A failure record with its ``strata.retry.*`` headers read once."""

    record: ConsumerRecord
    group: str
    info: r.RetryInfo
    parked: bool

    @classmethod
    def of(cls, rec: ConsumerRecord) -> Failure | None:
        """None for a record without a group (not a failure record)."""
        group = r.header(rec.headers, r.H_GROUP)
        if not group:
            return None
        parked = r.header(rec.headers, r.H_PARK) is not None
        return cls(rec, group.decode(), r.retry_info(rec), parked)

    @property
    def identity(self) -> Identity:
        """What makes two failure records the same failure: the source record (group,
        original topic, partition, offset), the attempt that failed, how often it was
        parked and whether this is a park."""
        info = self.info
        seed = r.identity_seed(self.group, info.topic, info.partition, info.offset)
        return seed, info.attempt, info.parked, self.parked


class Seen:
    """The identities of one failures partition's records below ``end`` (the last ``size``
    of them, oldest forgotten first: an ``OrderedDict``, since taking the first key of a
    plain dict again and again walks the slots already emptied, 15 us against 0.2 us per
    record once the window is full)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.end = 0
        self.ids: OrderedDict[Identity, None] = OrderedDict()

    def extend(self, ids: Mapping[Identity, None], end: int) -> None:
        self.ids.update(ids)
        while len(self.ids) > self.size:
            self.ids.popitem(last=False)
        self.end = end


def forward_producer_id(source: TopicPartition, intent: Intent, dest: TopicPartition) -> int:
    """The producer id of one output batch of a forward."""
    return r.derived_producer_id(
        "router",
        source.topic,
        source.partition,
        intent.version,
        intent.a,
        dest.topic,
        dest.partition,
    )


def encode_outputs(outputs: list[Output], producer_id: int) -> bytes:
    """One destination's outputs as one batch, in the order routed (a key's order kept)."""
    return encode_batch(
        [o.record.value for o in outputs],
        keys=[o.record.key for o in outputs],
        timestamps=[o.timestamp for o in outputs],
        headers=[o.headers for o in outputs],
        tags=[list(o.record.tags) or None for o in outputs],
        producer_id=producer_id,
        producer_epoch=0,
        base_sequence=0,
        summary=outputs[0].summary,  # (the destination decides: filters read no level)
    )


def close(router: Router, timeout: float = 5.0) -> None:
    shared_runtime().call(lambda _store: router.close(), timeout=timeout)


def make_handler(router: Router) -> Callable[[Mapping[str, Any], Any], dict[str, Any]]:
    """A ``handler(event, context)`` running ``router`` on the handlers' shared runtime."""

    @takes_native_records
    def handle(event: Mapping[str, Any], context: Any) -> dict[str, Any]:
        return Invocation(context).run(lambda store: router.process(event, store))

    return handle


handler = make_handler(Router())
