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

**Exactly once.** Every output is its own batch, with a producer id derived from the record's
identity and attempt, sequence 0, to a destination partition derived from the same things
(``Producer.send_exact``), and every choice — due time (the jitter is a hash), level, entry
timestamp — is a function of the failure record alone. An invocation's batches bound for one
partition go back to back in one request (:func:`send_runs`: one request per leader, not one
per record); the agent checks each batch of such a run as it would alone, but refuses the
whole run if one of them is already stored (``DuplicateSequenceError``), and the router then
sends them one by one, each answered as stored or stored now. A router that crashes and routes the
same failure record again writes the same batch (one header may differ: the retry topic's id,
if that topic was created again in between), and the destination's leader answers it as a
duplicate (by its producer id and sequence). So nothing is lost (the runner commits only what was routed) and nothing is
dead-lettered or retried twice (``docs/retries.md`` gives the bounds).
"""

from __future__ import annotations

import base64
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from handlers.runtime import NATIVE_RECORDS, Invocation, shared_runtime, takes_native_records
from handlers.stats import ThrottledWrites
from sdk import Producer
from sdk import delays as d
from sdk import retry as r
from sdk.config import client_config
from sdk.records import ConsumerRecord, TopicPartition
from storage.codec import encode_batch
from storage.errors import StrataError
from storage.metadata import MetadataStore
from storage.metadata.retry import RetryStore
from storage.retry_policy import DEFAULT_POLICY, RetryPolicy

log = logging.getLogger(__name__)

SEND_TIMEOUT = 10.0
POLICY_TTL_S = 5.0
#: at most one write of the router's counts to ZooKeeper this often (``handlers.stats``)
STATS_EVERY = 1.0
#: bytes of one-record batches sent in one round of requests (the router's memory for them
#: is the invocation's records, bounded by the runner's batch size)
MAX_RUN_BYTES = 1 << 20
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
    """One routed record: its destination, its exactly-once producer id, what is written."""

    tp: TopicPartition
    producer_id: int
    record: ConsumerRecord
    headers: Headers
    timestamp: int
    kind: str
    """"retry", "dlq", "park" or "notice"."""
    summary: bool = True
    """Write the tag/header summary filters use (not needed in a delay level)."""

    def encode(self) -> bytes:
        return encode_batch(
            [self.record.value],
            keys=[self.record.key],
            timestamps=self.timestamp,
            headers=[self.headers],
            tags=[list(self.record.tags) or None],
            producer_id=self.producer_id,
            producer_epoch=0,
            base_sequence=0,
            summary=self.summary,
        )


@dataclass
class Stats:
    retries_by_attempt: dict[str, int] = field(default_factory=dict)
    dead_lettered: dict[str, int] = field(default_factory=dict)
    parked: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "retries_by_attempt": dict(self.retries_by_attempt),
            "dead_lettered": dict(self.dead_lettered),
            "parked": self.parked,
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
    ) -> None:
        self.clock_ms = clock_ms
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
        producer = await self._producer(str(event.get("bootstrapServers") or ""))
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
                await self._route_partition(rs, producer, counts, recs)
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
        recs: list[ConsumerRecord],
    ) -> None:
        outputs: list[Output] = []
        for rec in recs:
            outputs += await self.route(rs, counts, rec)
        encoded = [(out, out.encode()) for out in outputs]
        try:
            await send_runs(producer, encoded)
        except StrataError as exc:
            # a run holding a batch already stored (a redo, a copy of a failure record) is
            # refused whole (DuplicateSequenceError): each batch alone is answered as stored
            # or stored now; any other failure is retried the same way, batch by batch
            log.info("routing %d record(s) batch by batch after %r", len(encoded), exc)
            sender = r.ExactSender(producer, send_timeout=SEND_TIMEOUT)
            for out, batch in encoded:  # a key's records keep their order
                sender.submit(out.tp, out.record.key, batch)
            await sender.flush()
        for out in outputs:
            self._count(out)

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
        self, rs: RetryStore, counts: PartitionCounts, rec: ConsumerRecord
    ) -> list[Output]:
        """Where one failure record goes: a function of its headers and its policy only (a
        second copy of a failure record, written at another time, routes the same way and
        under the same producer id)."""
        h = rec.headers
        group = (r.header(h, r.H_GROUP) or b"").decode()
        info = r.retry_info(rec)
        if not group:
            log.warning("dropping a record without %s at offset %d", r.H_GROUP, rec.offset)
            return []
        attempt = info.attempt - 1  # the attempt that failed
        failed_ms = int(r.header(h, r.H_FAILED_MS) or rec.timestamp)
        parked = r.header(h, r.H_PARK) is not None
        policy = await self.policy(rs, group, info.topic)
        seed = r.identity_seed(group, info.topic, info.partition, info.offset)
        ordered = r.header(h, r.H_ORDERING) is not None
        retry_topic = r.retry_topic(group)
        if not parked and policy.gives_up(attempt):
            dlq = policy.dlq_for(info.topic)
            dest = TopicPartition(dlq, info.partition % await counts(dlq))
            pid = r.derived_producer_id("dlq", seed)
            outs = [Output(dest, pid, rec, list(h), failed_ms, "dlq")]
            if ordered:
                notice = [*h, (r.H_DEAD, b"1")]
                tp = TopicPartition(retry_topic, info.partition % await counts(retry_topic))
                notice_pid = r.derived_producer_id("notice", seed)
                outs.append(Output(tp, notice_pid, rec, notice, failed_ms, "notice"))
            return outs
        wait = policy.park_ms(info.parked) if parked else policy.backoff_ms(attempt, seed)
        due = failed_ms + wait
        dest = TopicPartition(retry_topic, info.partition % await counts(retry_topic))
        headers = [(k, v) for k, v in h if k not in d.DELAY_HEADERS and k != r.H_DUE_MS]
        headers.append((r.H_DUE_MS, str(due).encode()))
        kind = "park" if parked else "retry"
        pid = r.derived_producer_id(kind, seed, attempt, info.parked)
        if wait <= 0:
            return [Output(dest, pid, rec, headers, failed_ms, kind)]
        # the level follows from the wait alone; entered at the failure time, the record
        # leaves it at failed_ms + 2**level <= due (at once if the router is late)
        nonce = f"r{pid:x}"
        sid = d.ScheduleId.new(due, dest.topic, dest.partition, rec.key, nonce)
        headers.append((d.HEADER_ID, sid.encode().encode()))
        if (topic_id := counts.topic_id(dest.topic)) is not None:
            # the retry topic's incarnation: if it is deleted (and created again) while the
            # record waits, the scheduler drops the record (``docs/delays.md``)
            headers.append((d.HEADER_TOPIC_ID, topic_id.encode()))
        headers.append((d.HEADER_TIMESTAMP, str(failed_ms).encode()))
        level = d.level_topic(d.level_for(wait))
        lane = TopicPartition(level, sid.lane_in(await counts(level)))
        return [Output(lane, pid, rec, headers, failed_ms, kind, summary=False)]


async def send_runs(producer: Producer, encoded: list[tuple[Output, bytes]]) -> None:
    """Store the one-record batches of ``encoded`` as runs: the batches bound for one
    partition, in order, back to back, in rounds of at most :data:`MAX_RUN_BYTES` (all
    partitions together; a larger batch goes alone), each round one request per leader. Each
    batch keeps its own producer id, so the agent checks them one by one as it would alone; a
    run is stored whole or not at all. Two copies of a failure record in one invocation make
    the same batch (same producer id): it goes once (twice in a run, the agent would refuse
    the second as out of sequence)."""
    rounds: list[dict[TopicPartition, list[bytes]]] = [{}]
    size = 0
    seen: set[tuple[TopicPartition, int]] = set()
    for out, batch in encoded:
        if (out.tp, out.producer_id) in seen:
            continue
        seen.add((out.tp, out.producer_id))
        if size and size + len(batch) > MAX_RUN_BYTES:
            rounds.append({})
            size = 0
        rounds[-1].setdefault(out.tp, []).append(batch)
        size += len(batch)
    for batches in rounds:
        await producer.send_exact(
            {tp: b"".join(run) for tp, run in batches.items()}, SEND_TIMEOUT, channel="retry"
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
