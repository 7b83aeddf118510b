"""Redrive: move records from a dead-letter topic back to a topic, rate-limited, resumable.

A redrive is a *task* stored in ZooKeeper (``storage.metadata.retry``, ``/retry/redrives/<id>``):
the source (a dead-letter topic) and its end offsets when the task was made (the task moves
the records below them, never ones that arrive later), the target topic, the rate, an optional
header filter, ``dry_run``, its state and its progress (the next offset per source partition).
:func:`handler` runs a task for as long as its invocation allows and answers its progress;
whoever drives it (``strata dlq redrive``, a Step Functions loop in AWS) invokes it again until
it is ``done``.

**States** (a table, :data:`TRANSITIONS`): ``running`` -> ``done`` (every partition moved) or
``cancelled`` (``DELETE /dlq/redrives/<id>``); both are final.

**Nothing twice across a crash.** The worker moves one *chunk* at a time: a range ``[a, b)``
of one source partition. Before sending anything it writes the chunk as the task's ``intent``
(with the time ``now`` it is stamped with), compare-and-set on the task's version; then it
sends one batch per target partition, each with a producer id derived from (task, partition,
``a``, target partition) and sequence 0 (``Producer.send_exact``); then it writes the progress
(``b``) and clears the intent. A worker that finds an intent redoes exactly that chunk — the
records of an append-only log, the same filter, the same ``now`` — so its batches are the
same, and the target's leader answers a batch it already stored as a duplicate. Two workers on
one task (a stale one still running) cannot both write an intent for the same version: the
loser stops.

**Rate.** Chunks are ``rate / 20`` records, and each starts (and is stamped) at least
``chunk / rate`` seconds after the task's last one — kept in the task, so this holds across
invocations, workers and crashes, and a late chunk is never made up for by a burst. Any
one-second window holds at most ``rate`` plus one chunk: 5% over the limit at most.

A moved record keeps its key, value and tags, loses the ``strata.retry.*`` and
``strata.delay.*`` headers (it starts afresh, attempt 1) and gains ``strata.redrive.task`` and
``strata.redrive.from`` (``<topic>/<partition>/<offset>``). It goes to its original partition
(the ``strata.retry.partition`` header) if the target has it, else by its key.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from handlers.ranges import read_range
from handlers.runtime import Invocation, shared_runtime
from sdk import Consumer, Producer, TopicPartition
from sdk import retry as r
from sdk.config import client_config
from sdk.partitioner import partition_for_key
from sdk.records import ConsumerRecord
from storage.codec import encode_batch
from storage.errors import InvalidRequestError, VersionConflictError
from storage.metadata import MetadataStore
from storage.metadata.retry import RetryStore
from storage.names import validate_topic_name

log = logging.getLogger(__name__)

RUNNING, DONE, CANCELLED = "running", "done", "cancelled"
TRANSITIONS: dict[tuple[str, str], str] = {
    (RUNNING, "progress"): RUNNING,
    (RUNNING, "finish"): DONE,
    (RUNNING, "cancel"): CANCELLED,
}
"""(state, event) -> next state; any other pair is an error (``InvalidRequestError``)."""
STATES = (RUNNING, DONE, CANCELLED)
EVENTS = ("progress", "finish", "cancel")
H_TASK = "strata.redrive.task"
H_FROM = "strata.redrive.from"
SEND_TIMEOUT = 10.0
READ_TIMEOUT = 10.0
MARGIN_S = 1.0
MAX_RATE = 100_000


def transition(state: str, event: str) -> str:
    nxt = TRANSITIONS.get((state, event))
    if nxt is None:
        raise InvalidRequestError(f"a redrive that is {state} cannot {event}")
    return nxt


def parse_filter(text: str | None) -> tuple[str, str] | None:
    """``header=value`` -> (header, value); None for no filter."""
    if not text:
        return None
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise InvalidRequestError(f"filter {text!r} is not header=value")
    return name, value


def matches(record: ConsumerRecord, wanted: tuple[str, str] | None) -> bool:
    if wanted is None:
        return True
    name, value = wanted
    return any(k == name and bytes(v) == value.encode() for k, v in record.headers)


def producer_id(task_id: str, partition: int, a: int, dest: TopicPartition) -> int:
    text = f"redrive/{task_id}/{partition}/{a}/{dest.topic}/{dest.partition}"
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big") >> 1


async def new_task(
    store: MetadataStore,
    source: str,
    target: str,
    rate: int,
    header_filter: str | None,
    dry_run: bool,
) -> dict[str, Any]:
    """Make a task: the source's end offsets now bound what it moves."""
    validate_topic_name(source)
    validate_topic_name(target)
    if source == target:
        raise InvalidRequestError("a redrive's target must differ from its source")
    if not 1 <= rate <= MAX_RATE:
        raise InvalidRequestError(f"rate must be 1..{MAX_RATE} records/s, got {rate}")
    parse_filter(header_filter)
    spec, _ = await store.get_topic(source)
    await store.get_topic(target)  # it must exist
    agents = await store.list_agents()
    if not agents:
        raise InvalidRequestError("no live agents")
    bootstrap = ",".join(f"{a.host}:{a.port}" for a in agents.values())
    tps = [TopicPartition(source, p) for p in range(spec.partitions)]
    async with Consumer(client_config(bootstrap, {"enable.auto.commit": False})) as c:
        starts = await c.beginning_offsets(tps)
        ends = await c.end_offsets(tps)
    task_id = uuid.uuid4().hex[:12]
    doc = {
        "id": task_id,
        "source": source,
        "target": target,
        "rate": rate,
        "filter": header_filter,
        "dry_run": dry_run,
        "state": RUNNING,
        "created_ms": int(time.time() * 1000),
        "end": {str(tp.partition): ends[tp] for tp in tps},
        "next": {str(tp.partition): starts[tp] for tp in tps},
        "total": sum(max(0, ends[tp] - starts[tp]) for tp in tps),
        "scanned": 0,
        "moved": 0,
        "skipped": 0,
        "intent": None,
        "last_chunk_ms": None,
    }
    await RetryStore(store.zk).create_task(task_id, doc)
    return doc


async def cancel_task(store: MetadataStore, task_id: str) -> dict[str, Any]:
    rs = RetryStore(store.zk)
    while True:
        doc, version = await rs.read_task(task_id)
        if doc["state"] == CANCELLED:
            return doc
        doc["state"] = transition(doc["state"], "cancel")
        try:
            await rs.write_task(task_id, doc, version)
        except VersionConflictError:
            continue
        return doc


class Worker:
    """Runs redrive tasks (see the module docstring)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._clients: dict[str, tuple[Producer, Consumer]] = {}

    async def close(self) -> None:
        clients, self._clients = self._clients, {}
        for producer, consumer in clients.values():
            await producer.close(flush_timeout=1.0)
            await consumer.close()

    async def _clients_for(self, store: MetadataStore) -> tuple[Producer, Consumer]:
        agents = await store.list_agents()
        if not agents:
            raise InvalidRequestError("no live agents")
        bootstrap = ",".join(sorted(f"{a.host}:{a.port}" for a in agents.values()))
        clients = self._clients.get(bootstrap)
        if clients is None:
            producer = Producer(client_config(bootstrap, {"acks": "all"}))
            # chunks are read by offset; what retention took of one is gone (read_range)
            config = {"enable.auto.commit": False, "auto.offset.reset": "earliest"}
            consumer = Consumer(client_config(bootstrap, config))
            await producer.start()
            await consumer.start()
            clients = self._clients[bootstrap] = (producer, consumer)
        return clients

    async def run(self, store: MetadataStore, task_id: str, budget_s: float) -> dict[str, Any]:
        """Move chunks until the task is done or cancelled or ``budget_s`` is nearly spent;
        the task's document (its progress)."""
        rs = RetryStore(store.zk)
        producer, consumer = await self._clients_for(store)
        stop_at = self.clock() + budget_s - MARGIN_S
        while True:
            doc, version = await rs.read_task(task_id)
            if doc["state"] != RUNNING:
                return doc
            if doc["intent"] is not None:  # a chunk that may have been cut short: redo it
                log.info("redrive %s: redo %s", task_id, doc["intent"])
                doc, version = await self._send_chunk(rs, producer, consumer, doc, version)
                continue
            p = next(
                (int(k) for k, end in sorted(doc["end"].items()) if doc["next"][k] < end), None
            )
            if p is None:
                doc["state"] = transition(doc["state"], "finish")
                await rs.write_task(task_id, doc, version)
                return doc
            if self.clock() >= stop_at:
                return doc
            rate = int(doc["rate"])
            chunk = max(1, rate // 20)
            a = int(doc["next"][str(p)])
            b = min(a + chunk, int(doc["end"][str(p)]))
            # pace: a chunk starts at least chunk/rate after the task's last one (whichever
            # worker or invocation sent it), so a late chunk is never made up by a burst
            if doc["last_chunk_ms"] is not None:
                wait = doc["last_chunk_ms"] / 1000 + chunk / rate - time.time()
                if wait > 0:
                    await asyncio.sleep(wait)
            now_ms = int(time.time() * 1000)
            doc["intent"] = {"partition": p, "a": a, "b": b, "now": now_ms}
            doc["last_chunk_ms"] = now_ms
            try:
                version = await rs.write_task(task_id, doc, version)
            except VersionConflictError:
                log.info("redrive %s: another worker moved on; stopping", task_id)
                return (await rs.read_task(task_id))[0]
            doc, version = await self._send_chunk(rs, producer, consumer, doc, version)

    async def _send_chunk(
        self,
        rs: RetryStore,
        producer: Producer,
        consumer: Consumer,
        doc: dict[str, Any],
        version: int,
    ) -> tuple[dict[str, Any], int]:
        intent = doc["intent"]
        p, a, b, now_ms = intent["partition"], intent["a"], intent["b"], intent["now"]
        source = TopicPartition(doc["source"], p)
        records = await self._read(consumer, source, a, b)
        wanted = parse_filter(doc["filter"])
        chosen = [x for x in records if matches(x, wanted)]
        if not doc["dry_run"] and chosen:
            n = len(await producer.partitions_for(doc["target"]))
            by_dest: dict[TopicPartition, list[ConsumerRecord]] = {}
            for x in chosen:
                by_dest.setdefault(TopicPartition(doc["target"], _dest(x, n)), []).append(x)
            batches = {
                dest: encode_batch(
                    [x.value for x in xs],
                    keys=[x.key for x in xs],
                    timestamps=now_ms,
                    headers=[_moved_headers(x, doc["id"]) for x in xs],
                    tags=[list(x.tags) or None for x in xs],
                    producer_id=producer_id(doc["id"], p, a, dest),
                    producer_epoch=0,
                    base_sequence=0,
                )
                for dest, xs in by_dest.items()
            }
            await producer.send_exact(batches, SEND_TIMEOUT, channel="redrive")
        doc["next"][str(p)] = b
        doc["scanned"] += b - a
        doc["moved"] += len(chosen)
        doc["skipped"] += len(records) - len(chosen)
        doc["intent"] = None
        version = await rs.write_task(doc["id"], doc, version)
        return doc, version

    async def _read(
        self, consumer: Consumer, tp: TopicPartition, a: int, b: int
    ) -> list[ConsumerRecord]:
        return await read_range(consumer, tp, a, b, limit_s=READ_TIMEOUT)


def _dest(record: ConsumerRecord, partitions: int) -> int:
    original = r.header(record.headers, r.H_PARTITION)
    if original is not None and original.isdigit() and int(original) < partitions:
        return int(original)
    if record.key is not None:
        return partition_for_key(record.key, partitions)
    return record.partition % partitions


def _moved_headers(record: ConsumerRecord, task_id: str) -> list[tuple[str, bytes]]:
    kept = [
        (k, bytes(v))
        for k, v in record.headers
        if not k.startswith((r.HEADER_PREFIX, "strata.delay.", "strata.redrive."))
    ]
    where = f"{record.topic}/{record.partition}/{record.offset}".encode()
    return [*kept, (H_TASK, task_id.encode()), (H_FROM, where)]


def describe(doc: Mapping[str, Any]) -> dict[str, Any]:
    """A task as the status route shows it."""
    return {
        k: doc[k]
        for k in (
            "id",
            "source",
            "target",
            "rate",
            "filter",
            "dry_run",
            "state",
            "total",
            "scanned",
            "moved",
            "skipped",
        )
    }


def make_handler(worker: Worker) -> Callable[[Mapping[str, Any], Any], dict[str, Any]]:
    """``handler({"task_id": ...}, context)``: run the task for this invocation's time."""

    def handle(event: Mapping[str, Any], context: Any) -> dict[str, Any]:
        task_id = str(event.get("task_id") or "")
        if not task_id.isalnum():
            raise InvalidRequestError(f"bad task id {task_id!r}")
        invocation = Invocation(context)
        budget = min(float(event.get("budget_s") or 8.0), invocation.budget())
        doc = invocation.run(lambda store: worker.run(store, task_id, budget))
        return describe(doc)

    return handle


def close(worker: Worker, timeout: float = 5.0) -> None:
    shared_runtime().call(lambda _store: worker.close(), timeout=timeout)


WORKER = Worker()
handler = make_handler(WORKER)
