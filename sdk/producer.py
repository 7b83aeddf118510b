"""The asynchronous producer.

Theory of operation
-------------------
``await producer.send(topic, value, key=...)`` picks the partition (``sdk.partitioner``:
murmur2 of the key as Kafka does, sticky for keyless records), then appends the record to the
:class:`~sdk.accumulator.RecordAccumulator` and returns a future of its
:class:`~sdk.records.RecordMetadata`. Awaiting ``send`` waits only for metadata of a new topic
and for buffer space (both bounded by ``max.block.ms``); awaiting the returned future waits for
the leader's acknowledgement. ``send_and_wait`` does both.

One *sender* task turns ready batches into requests. On each wake-up (a new or full batch, a
linger deadline, a response, a retry falling due, new metadata) it:

1. fails queued batches older than ``delivery.timeout.ms``;
2. asks the accumulator which partitions are ready and looks up each one's leader (an unknown
   leader asks for a metadata refresh and the partition waits);
3. for every leader agent with fewer than ``max.in.flight.requests.per.connection`` produce
   requests outstanding, drains each ready partition's head batch and the full batches queued
   behind it (up to ``max.request.size`` in all) into a single ProduceRequest — several
   partitions per request, a partition's batches back to back in its records field — and
   sends it from a short task of its own, so a slow agent never holds up the others.

A response completes a partition's batches from its base offset, in order (record *i* of the
first batch gets ``base_offset + i``, the next batch follows on). A retriable error
(``NotLeaderError``, ``NetworkError``, ``RequestTimedOutError``, ...) puts the batches back at
the head of their partition, in their order — see ``sdk.accumulator`` for how order within a
partition holds across retries, and ``sdk.idempotence`` for the idempotent producer (the
default unless ``acks=0``), whose retries are never stored twice — after an exponential
backoff with jitter (``retry.backoff.ms`` .. ``retry.backoff.max.ms``), and errors that suggest
stale leadership also refresh metadata. A batch fails for good on a non-retriable error, after
``retries`` retries, or when its ``delivery.timeout.ms`` would pass. With ``acks=0`` the
futures resolve once the request is written, with offset -1.

With ``transactional.id`` the producer is transactional (``sdk.transactions``):
``init_transactions()`` once, then ``begin_transaction()``, sends (and
``send_offsets_to_transaction``), and ``commit_transaction()`` or ``abort_transaction()``;
its batches carry the transactional bit and a partition's batches wait until the
coordinator has the partition in the transaction.

Each request names the topic id the metadata holds (KIP-516): a batch is never stored in a
deleted topic's log. While a topic is being deleted its batches wait and retry
(``UNKNOWN_TOPIC_OR_PARTITION``); once the name is created again they go to the new topic,
whose id the refreshed metadata names — or fail when ``delivery.timeout.ms`` passes first.

The sender, the metadata refresh loop and the connections' reader loops are named tasks under
one ``asyncio.TaskGroup`` owned by a supervisor task; if any of them fails unexpectedly the
others are cancelled and every outstanding future fails with that error.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import secrets
import time
from collections import defaultdict
from collections.abc import Callable, Coroutine, Mapping, Sequence
from itertools import repeat
from operator import is_not, itemgetter
from types import TracebackType
from typing import Any, Self

import numpy as np

from sdk import delays
from sdk.accumulator import (
    RECORD_OVERHEAD,
    Headers,
    ProducerBatch,
    RecordAccumulator,
    estimate_size,
)
from sdk.backoff import ExponentialBackoff
from sdk.cluster import STALE_METADATA_ERRORS, Cluster
from sdk.config import ProducerConfig
from sdk.errors import DeliveryTimeoutError, IllegalStateError, ProducerClosedError
from sdk.failures import FAILURES_TOPIC, build_failure
from sdk.group import OffsetAndMetadata
from sdk.idempotence import Sequencer
from sdk.partitioner import (
    DefaultPartitioner,
    group_by_partition,
    partition_for_key,
    partitions_for_keys,
)
from sdk.records import ConsumerRecord, RecordMetadata, StoredRuns, TopicPartition
from sdk.staging import STAGE_MIN_RUNS
from sdk.transactions import ConsumerGroupMetadata, TransactionManager
from storage.codec import encode_batch
from storage.errors import InvalidDelayError, StrataError, UnknownTopicOrPartitionError, from_wire
from storage.protocol.messages import (
    ProducePartition,
    ProduceRequest,
    ProduceResponse,
    ProduceTopic,
)

_BYTES_LIKE = (bytes, bytearray, memoryview)
_VALUE_TYPES = frozenset({bytes, type(None)})


def _len0(value: bytes | None) -> int:
    return len(value) if value else 0


def _as_bytes(value: Any, what: str) -> bytes | None:
    if value is None or type(value) is bytes:
        return value
    if isinstance(value, _BYTES_LIKE):
        return bytes(value)
    raise TypeError(f"{what} must be bytes (or None), not {type(value).__name__}")


def _check_headers(headers: Any) -> Headers | None:
    if not headers:
        return None
    if isinstance(headers, Mapping):
        headers = list(headers.items())
    out = []
    for pair in headers:
        k, v = pair
        if not isinstance(k, str):
            raise TypeError(f"header keys must be str, not {type(k).__name__}")
        out.append((k, _as_bytes(v, "a header value") or b""))
    return out


def _check_tags(tags: Any) -> list[str] | None:
    if not tags:
        return None
    if isinstance(tags, str):
        raise TypeError("tags must be a sequence of str, not one str")
    out = list(tags)
    for t in out:
        if not isinstance(t, str):
            raise TypeError(f"tags must be str, not {type(t).__name__}")
    return out


class ScheduledFuture(asyncio.Future[RecordMetadata]):
    """The future of a delayed ``send``: its ``schedule_id`` is known before it resolves."""

    schedule_id: str = ""


class Sender:
    """Drains ready batches into ProduceRequests, one in-flight window per leader agent."""

    def __init__(
        self,
        config: ProducerConfig,
        accumulator: RecordAccumulator,
        cluster: Cluster,
        spawn: Callable[[Coroutine[Any, Any, None], str], asyncio.Task[None]],
        *,
        clock: Callable[[], float] = time.monotonic,
        backoff: ExponentialBackoff | None = None,
    ) -> None:
        self.config = config
        self._acc = accumulator
        self._cluster = cluster
        self._spawn = spawn
        self._clock = clock
        self._backoff = backoff or ExponentialBackoff(
            config.retry_backoff_ms, config.effective_backoff_max_ms
        )
        self._in_flight: dict[int, int] = defaultdict(int)
        #: how long agents held answers over a quota, in all (docs/security.md)
        self.throttle_time_ms = 0
        self._drain_start: dict[int, int] = defaultdict(int)
        self._stopping = False
        self._retry_poll = max(config.retry_backoff_ms / 1000, 0.01)

    @property
    def in_flight(self) -> int:
        return sum(self._in_flight.values())

    def stop(self) -> None:
        """Send what is buffered, then return from ``run``."""
        self._stopping = True
        self._acc.wakeup.set()

    async def run(self) -> None:
        acc = self._acc
        while True:
            acc.wakeup.clear()
            delay = self.run_once(self._clock())
            if self._stopping and acc.incomplete == 0 and self.in_flight == 0:
                return
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await acc.wakeup.wait()

    def run_once(self, now: float) -> float | None:
        """One pass: plan, then start each request. Returns seconds until the next pass."""
        requests, delay = self.plan(now)
        for agent_id, batches in requests:
            self._spawn(self._produce(agent_id, batches), f"strata-produce-to-{agent_id}")
        return delay

    def plan(self, now: float) -> tuple[list[tuple[int, list[ProducerBatch]]], float | None]:
        """Expire old batches, group ready partitions by leader and drain one request's worth
        of batches for every leader with a free in-flight slot (taking the slot)."""
        acc = self._acc
        acc.expire(now)
        ready, delay = acc.ready(now)
        requests: list[tuple[int, list[ProducerBatch]]] = []
        if not ready:
            return requests, delay
        by_leader: dict[int, list[TopicPartition]] = defaultdict(list)
        for tp in ready:
            leader = self._cluster.leader_for(tp.topic, tp.partition)
            if leader is None:
                self._cluster.request_update()
                delay = self._retry_poll if delay is None else min(delay, self._retry_poll)
                continue
            by_leader[leader].append(tp)
        limit = self.config.max_in_flight_requests_per_connection
        for agent_id, tps in by_leader.items():
            # as many requests as the window allows: one per pass left the window at one
            # request whenever every ready partition's head batch filled a request alone
            while self._in_flight[agent_id] < limit:  # else a response will wake us
                start = self._drain_start[agent_id] % len(tps)
                self._drain_start[agent_id] = start + 1
                batches = acc.drain(tps[start:] + tps[:start], self.config.max_request_size)
                if not batches:
                    break
                self._in_flight[agent_id] += 1
                requests.append((agent_id, batches))
        return requests, delay

    def request_done(self, agent_id: int) -> None:
        self._in_flight[agent_id] -= 1
        self._acc.wakeup.set()

    def request_for(self, batches: Sequence[ProducerBatch]) -> ProduceRequest:
        """One ProducePartition per partition; a partition's batches (in queue order) go back
        to back in its ``records`` field."""
        records: dict[TopicPartition, list[bytes]] = {}
        for b in batches:
            assert b.encoded is not None
            records.setdefault(b.tp, []).append(b.encoded)
        topics: dict[str, list[ProducePartition]] = defaultdict(list)
        for tp, encoded in records.items():
            topics[tp.topic].append(ProducePartition(tp.partition, encoded))
        return ProduceRequest(
            acks=self.config.acks,
            timeout_ms=self.config.request_timeout_ms,
            # the id of the incarnation the metadata names: a batch never lands in a deleted
            # topic's log; after a re-create it goes to the new topic once metadata says so
            topics=[
                ProduceTopic(name, parts, self._cluster.topic_id(name))
                for name, parts in topics.items()
            ],
            transactional_id=self.config.transactional_id,
        )

    async def _produce(self, agent_id: int, batches: list[ProducerBatch]) -> None:
        acks = self.config.acks
        settled: set[int] = set()
        retry: list[tuple[ProducerBatch, StrataError]] = []
        try:
            try:
                response: ProduceResponse | None = await self._cluster.send(
                    agent_id, self.request_for(batches), expect_response=acks != 0
                )
            except StrataError as exc:
                retry = [(b, exc) for b in batches]
                return
            if response is None:
                for b in batches:
                    self._acc.complete(b, -1)
                    settled.add(id(b))
                return
            self.throttle_time_ms += response.throttle_time_ms
            results = {(t.name, r.partition): r for t in response.topics for r in t.partitions}
            next_base: dict[TopicPartition, int] = {}
            for b in batches:
                r = results.get(b.tp)
                if r is None:
                    retry.append(
                        (
                            b,
                            UnknownTopicOrPartitionError(
                                f"agent {agent_id} did not answer for {b.tp.topic}[{b.tp.partition}]"
                            ),
                        )
                    )
                elif r.error_code == 0:
                    # a partition's batches were stored back to back from its base offset
                    base = next_base.get(b.tp, r.base_offset)
                    next_base[b.tp] = base + b.record_count
                    self._acc.complete(b, base)
                    settled.add(id(b))
                else:
                    retry.append((b, from_wire(r.error_code, r.error_message)))
        except BaseException as exc:
            failure = exc if isinstance(exc, Exception) else ProducerClosedError("producer stopped")
            for b in batches:
                if id(b) not in settled:
                    self._acc.fail(b, failure)
            retry = []
            raise
        finally:
            # last batch first: a retried batch goes back to the head of its queue, so a
            # partition's batches end up there in their original order
            for b, err in reversed(retry):
                self.retry_or_fail(b, err)
            self.request_done(agent_id)

    def retry_or_fail(self, batch: ProducerBatch, exc: StrataError) -> None:
        """Back to the head of its partition after a backoff, or fail it for good."""
        now = self._clock()
        if exc.retriable and batch.attempts < self.config.retries:
            if isinstance(exc, STALE_METADATA_ERRORS):
                self._cluster.request_update()
            retry_at = now + self._backoff(batch.attempts)
            if retry_at < batch.deadline:
                self._acc.reenqueue(batch, retry_at, exc)
                return
            timeout = DeliveryTimeoutError(
                f"{batch.record_count} record(s) for {batch.tp.topic}[{batch.tp.partition}] "
                f"not delivered within delivery.timeout.ms ({self.config.delivery_timeout_ms} "
                f"ms) after {batch.attempts + 1} attempt(s); last error: {exc}"
            )
            timeout.__cause__ = exc
            self._acc.fail(batch, timeout)
            return
        self._acc.fail(batch, exc)


async def _scheduled_runs(
    topic: str, runs: list[tuple[int, tuple[str, ...], list[asyncio.Future[StoredRuns]]]]
) -> StoredRuns:
    """What a delayed ``send_batch`` resolves to once every lane's records are stored: one
    run per target partition (and level), no offsets yet, the records' schedule ids."""
    for _, _, stored in runs:
        await asyncio.gather(*stored)
    return StoredRuns(
        [TopicPartition(topic, p) for p, _, _ in runs],
        [-1] * len(runs),
        [len(ids) for _, ids, _ in runs],
        [ids for _, ids, _ in runs],
    )


class Producer:
    """Send records to topics (see the module docstring). Use as an async context manager::

    async with Producer({"bootstrap.servers": "localhost:9092"}) as producer:
        meta = await producer.send_and_wait("events", b"payload", key=b"user-1")
    """

    def __init__(
        self,
        config: ProducerConfig | Mapping[str, Any],
        *,
        clock: Callable[[], float] = time.monotonic,
        wall_clock_ms: Callable[[], int] = lambda: time.time_ns() // 1_000_000,
        backoff: ExponentialBackoff | None = None,
        partitioner: DefaultPartitioner | None = None,
    ) -> None:
        self.config = ProducerConfig.parse(config)
        self._clock = clock
        self._wall_ms = wall_clock_ms
        self._backoff = backoff
        self._partitioner = partitioner or DefaultPartitioner()
        self._tg: asyncio.TaskGroup | None = None
        self._supervisor: asyncio.Task[None] | None = None
        self._failure: BaseException | None = None
        self._closed = False
        self._started = False
        self._cluster: Cluster | None = None
        self._acc: RecordAccumulator | None = None
        self._sender: Sender | None = None
        self._tps: dict[tuple[str, int], TopicPartition] = {}
        self._topic_tps: dict[str, list[TopicPartition]] = {}
        self._schedule_nonce = f"{secrets.randbits(40):010x}"
        self._scheduled = 0
        #: transactional producers (``transactional.id``): the transaction's state
        self._txn: TransactionManager | None = None

    # ---- lifecycle -----------------------------------------------------------------------
    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        if self._tg is None:
            coro.close()
            raise IllegalStateError("the producer is not running")
        return self._tg.create_task(coro, name=name)

    async def start(self) -> None:
        """Start the background tasks and fetch the cluster's metadata."""
        if self._started:
            return
        self._started = True
        cfg = self.config
        self._cluster = Cluster(cfg, spawn=self._spawn, clock=self._clock, backoff=self._backoff)
        txn = None
        if cfg.transactional_id is not None:
            txn = self._txn = TransactionManager(
                cfg, self._cluster, clock=self._clock, backoff=self._backoff
            )
        self._acc = RecordAccumulator(
            batch_size=cfg.batch_size,
            linger_ms=cfg.linger_ms,
            buffer_memory=cfg.buffer_memory,
            delivery_timeout_ms=cfg.delivery_timeout_ms,
            max_request_size=cfg.max_request_size,
            compression=cfg.compression,
            clock=self._clock,
            on_batch_closed=self._batch_closed,
            sequencer=Sequencer() if cfg.idempotent else None,
            encoder=functools.partial(
                encode_batch, transactional=txn is not None, summary=cfg.batch_summary
            ),
            admit=None if txn is None else txn.admit,
            on_failure=None if txn is None else txn.batch_failed,
        )
        if txn is not None:
            txn.accumulator = self._acc
        self._sender = Sender(
            cfg, self._acc, self._cluster, self._spawn, clock=self._clock, backoff=self._backoff
        )
        self._cluster.add_listener(self._acc.wakeup.set)
        running: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._supervisor = asyncio.create_task(self._supervise(running), name="strata-producer")
        await running
        try:
            await self._cluster.bootstrap()
        except BaseException:
            await self.close(flush_timeout=0)
            raise

    async def _supervise(self, running: asyncio.Future[None]) -> None:
        assert self._cluster is not None and self._sender is not None
        try:
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                running.set_result(None)
                refresher = tg.create_task(self._cluster.run(), name="strata-producer-metadata")
                sender = tg.create_task(self._sender.run(), name="strata-producer-sender")
                adder = None
                if self._txn is not None:
                    adder = tg.create_task(self._txn.run(), name="strata-producer-txn")
                await asyncio.wait([sender, refresher], return_when=asyncio.FIRST_COMPLETED)
                refresher.cancel()
                if adder is not None:
                    adder.cancel()
                await self._cluster.close()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            self._failure = exc
        finally:
            self._tg = None
            if not running.done():
                running.set_exception(ProducerClosedError("the producer stopped while starting"))
            if self._cluster is not None:
                await self._cluster.close()
            if self._acc is not None:
                cause = self._failure
                err = ProducerClosedError(
                    "the producer stopped" + (f": {cause!r}" if cause is not None else "")
                )
                err.__cause__ = cause
                self._acc.abort_incomplete(err)

    async def flush(self) -> None:
        """Send everything buffered now and wait until each record is acknowledged or failed.

        Bound the wait with ``asyncio.timeout`` if needed; records keep their own
        ``delivery.timeout.ms`` either way.
        """
        await self._running_acc().flush()

    async def close(self, flush_timeout: float | None = None) -> None:
        """Flush (up to ``flush_timeout`` seconds; None waits), then stop. Records still
        unsent when that time passes fail with ``ProducerClosedError``."""
        if self._closed:
            if self._supervisor is not None:
                await asyncio.wait([self._supervisor])
            return
        self._closed = True
        if self._acc is None or self._sender is None or self._supervisor is None:
            return
        self._acc.begin_close()
        self._sender.stop()
        try:
            async with asyncio.timeout(flush_timeout):
                await asyncio.wait([self._supervisor])
        except TimeoutError:
            self._acc.abort_incomplete(ProducerClosedError("the producer closed before sending"))
            self._supervisor.cancel()
            await asyncio.wait([self._supervisor])
        if self._failure is not None:
            raise ProducerClosedError(f"the producer failed: {self._failure!r}") from self._failure

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    # ---- transactions (sdk.transactions) --------------------------------------------------
    def _transactions(self) -> TransactionManager:
        self._running_acc()
        if self._txn is None:
            raise IllegalStateError("transactions need transactional.id in the producer's config")
        return self._txn

    async def init_transactions(self) -> None:
        """Get the producer id and epoch for ``transactional.id`` (fencing older producers with
        the same id, and aborting their open transaction). Call once, before the first
        ``begin_transaction()``."""
        await self._transactions().init()

    def begin_transaction(self) -> None:
        """Start a transaction: records sent until commit or abort belong to it."""
        self._transactions().begin()

    async def send_offsets_to_transaction(
        self,
        offsets: Mapping[TopicPartition | tuple[str, int], int | OffsetAndMetadata],
        group_metadata: ConsumerGroupMetadata | str,
    ) -> None:
        """Commit a consumer's offsets (the next offset to read, per partition) as part of the
        transaction: they count only if it commits. ``group_metadata`` is
        ``consumer.group_metadata()`` (or a group id, for a consumer outside the group
        protocol)."""
        txn = self._transactions()
        group = (
            ConsumerGroupMetadata(group_metadata)
            if isinstance(group_metadata, str)
            else group_metadata
        )
        values = {}
        for tp, o in offsets.items():
            topic, partition = tp
            om = o if isinstance(o, OffsetAndMetadata) else OffsetAndMetadata(int(o))
            values[TopicPartition(topic, partition)] = (om.offset, om.metadata)
        await txn.send_offsets(values, group)

    async def retry_later(
        self,
        record: ConsumerRecord,
        group_metadata: ConsumerGroupMetadata | str,
        reason: str = "",
    ) -> asyncio.Future[RecordMetadata]:
        """In a transaction: mark ``record`` (read by the consumer of ``group_metadata``)
        failed as part of it. Its failure record (``docs/retries.md``) is written inside the
        transaction, so the retry router, which reads ``read_committed``, acts on it only if
        the transaction commits; commit the record's offset with
        ``send_offsets_to_transaction`` as for any record it processed. A crash or an abort
        then leaves the record to be read again, and nothing retried. (Unlike
        ``Consumer.retry_later``, later records of its key are not held back:
        ``retry.ordering=key`` is the consumer's.)"""
        self._transactions()
        group = group_metadata if isinstance(group_metadata, str) else group_metadata.group_id
        partitions = len(await self.partitions_for(FAILURES_TOPIC))
        failure = build_failure(group, record, reason, self._wall_ms(), partitions)
        return await self.send(
            failure.tp.topic,
            failure.value,
            failure.key,
            failure.headers,
            failure.tags,
            failure.tp.partition,
            failure.timestamp,
        )

    async def commit_transaction(self) -> None:
        """Flush the transaction's records and commit it: readers with
        ``isolation.level=read_committed`` see all of it. If a record of it failed, this
        raises that error; then call ``abort_transaction()``."""
        await self._transactions().commit()

    async def abort_transaction(self) -> None:
        """Abort the transaction: its records never reach read_committed readers, its
        offsets are not committed. Records not yet sent fail with ``TransactionAbortedError``."""
        await self._transactions().abort()

    # ---- sending -------------------------------------------------------------------------
    def _running_acc(self) -> RecordAccumulator:
        if self._closed:
            raise ProducerClosedError("the producer is closed")
        if self._acc is None or self._tg is None:
            if self._failure is not None:
                raise ProducerClosedError(f"the producer failed: {self._failure!r}")
            raise IllegalStateError("the producer is not started: await producer.start()")
        return self._acc

    def _batch_closed(self, tp: TopicPartition) -> None:
        assert self._cluster is not None
        n = self._cluster.partition_count(tp.topic)
        if n:
            self._partitioner.batch_closed(
                tp.topic, tp.partition, n, self._cluster.available_partitions(tp.topic)
            )

    async def send(
        self,
        topic: str,
        value: bytes | None,
        key: bytes | None = None,
        headers: Sequence[tuple[str, bytes]] | Mapping[str, bytes] | None = None,
        tags: Sequence[str] | None = None,
        partition: int | None = None,
        timestamp_ms: int | None = None,
        *,
        delay_ms: int | None = None,
        deliver_at_ms: int | None = None,
        delay_level: int | None = None,
    ) -> asyncio.Future[RecordMetadata]:
        """Buffer one record; the returned future resolves when the leader acknowledges it.

        With ``delay_ms``, ``deliver_at_ms`` or ``delay_level`` (one of them) the record is
        delayed (``docs/delays.md``): it is stored in the delay levels and becomes readable
        on ``topic`` no earlier than its due time; the future's ``RecordMetadata`` then names
        the target partition and carries the ``schedule_id``."""
        if delay_ms is not None or deliver_at_ms is not None or delay_level is not None:
            return await self._send_delayed(
                topic,
                value,
                key,
                headers,
                tags,
                partition,
                timestamp_ms,
                (delay_ms, deliver_at_ms, delay_level),
            )
        acc = self._running_acc()
        cluster = self._cluster
        assert cluster is not None
        if value is not None and type(value) is not bytes:
            value = _as_bytes(value, "value")
        if key is not None and type(key) is not bytes:
            key = _as_bytes(key, "key")
        hdrs = _check_headers(headers) if headers else None
        tag_list = _check_tags(tags) if tags else None
        n = cluster.partition_count(topic)
        started = self._clock()
        if n is None:
            n = await cluster.wait_for_topic(topic, self.config.max_block_ms / 1000)
        if partition is None:
            if key is None:
                partition = self._partitioner.sticky(topic)
                if partition is None or partition >= n:
                    partition = self._partitioner.partition(
                        topic, None, n, cluster.available_partitions(topic)
                    )
            else:
                partition = partition_for_key(key, n)
        elif not 0 <= partition < n:
            raise UnknownTopicOrPartitionError(
                f"partition {partition} of topic {topic!r} does not exist (it has {n})"
            )
        ts = self._wall_ms() if timestamp_ms is None else int(timestamp_ms)
        tp = self._tps.get((topic, partition))
        if tp is None:
            tp = self._tps[(topic, partition)] = TopicPartition(topic, partition)
        if self._txn is not None:
            self._txn.maybe_add(tp)
        fut = acc.append_nowait(tp, value, key, hdrs, tag_list, ts)
        if fut is not None:
            return fut
        remaining = self.config.max_block_ms / 1000 - (self._clock() - started)
        return await acc.append(tp, value, key, hdrs, tag_list, ts, remaining)

    async def send_batch(
        self,
        topic: str,
        values: Sequence[bytes | None],
        *,
        keys: Sequence[bytes | None] | None = None,
        headers: Sequence[Sequence[tuple[str, bytes]] | None] | None = None,
        tags: Sequence[Sequence[str] | None] | None = None,
        partition: int | None = None,
        timestamp_ms: int | Sequence[int] | None = None,
        delay_ms: int | Sequence[int] | None = None,
        deliver_at_ms: int | Sequence[int] | None = None,
        delay_level: int | Sequence[int] | None = None,
    ) -> asyncio.Future[StoredRuns]:
        """Buffer many records in one call: the fast path for bulk producing.

        The records are appended to batches as list slices (no Python code per record, except
        the murmur2 hash when ``keys`` pick the partitions). Keyless records without a
        ``partition`` all go to the topic's current sticky partition. The returned future
        resolves to a :class:`StoredRuns`: a sequence of one :class:`RecordsMetadata` per run
        of records stored together (record ``i`` of a run is at ``base_offset + i``), in the
        order of the input, and the call's ``record_count``.

        ``delay_ms`` / ``deliver_at_ms`` / ``delay_level`` (one of them, for the batch or one
        per record) delay the records as ``send`` does; the future then resolves to one
        :class:`RecordsMetadata` per target partition and level, with the records'
        ``schedule_ids``.
        """
        if delay_ms is not None or deliver_at_ms is not None or delay_level is not None:
            return await self._send_batch_delayed(
                topic,
                values,
                keys,
                headers,
                tags,
                partition,
                timestamp_ms,
                (delay_ms, deliver_at_ms, delay_level),
            )
        acc = self._running_acc()
        cluster = self._cluster
        assert cluster is not None
        values = list(values)
        count = len(values)
        if not count:
            raise ValueError("send_batch needs at least one record")
        if not set(map(type, values)) <= _VALUE_TYPES:
            raise TypeError("values must be bytes (or None)")
        key_list = None if keys is None else list(keys)
        if key_list is not None and (
            len(key_list) != count or not set(map(type, key_list)) <= _VALUE_TYPES
        ):
            raise TypeError("keys must be bytes (or None), one per value")
        header_list = (
            None if headers is None else [_check_headers(h) if h else None for h in headers]
        )
        tag_lists = None if tags is None else [_check_tags(t) if t else None for t in tags]
        for name, col in (("headers", header_list), ("tags", tag_lists)):
            if col is not None and len(col) != count:
                raise ValueError(f"{name} must have one entry per value")
        if timestamp_ms is None or isinstance(timestamp_ms, int):
            ts = self._wall_ms() if timestamp_ms is None else int(timestamp_ms)
            timestamps = [ts] * count
        else:
            timestamps = [int(t) for t in timestamp_ms]
            if len(timestamps) != count:
                raise ValueError("timestamp_ms must have one entry per value")
        max_block = self.config.max_block_ms / 1000
        started = self._clock()
        n = cluster.partition_count(topic)
        if n is None:
            n = await cluster.wait_for_topic(topic, max_block)
        if partition is not None and not 0 <= partition < n:
            raise UnknownTopicOrPartitionError(
                f"partition {partition} of topic {topic!r} does not exist (it has {n})"
            )
        if header_list or tag_lists:
            sizes = np.fromiter(
                map(
                    estimate_size,
                    values,
                    key_list or repeat(None),
                    header_list or repeat(None),
                    tag_lists or repeat(None),
                ),
                dtype=np.int64,
                count=count,
            )
        else:
            sizes = np.fromiter(
                map(len, values) if None not in values else map(_len0, values),  # type: ignore[arg-type]
                dtype=np.int64,
                count=count,
            )
            if key_list is not None:
                sizes += np.fromiter(
                    map(len, key_list) if None not in key_list else map(_len0, key_list),  # type: ignore[arg-type]
                    dtype=np.int64,
                    count=count,
                )
            sizes += RECORD_OVERHEAD
        if partition is None and key_list is None:
            partition = self._partitioner.sticky(topic)
            if partition is None or partition >= n:
                partition = self._partitioner.partition(
                    topic, None, n, cluster.available_partitions(topic)
                )
        tps = self._topic_partitions(topic, n)
        run_tps: Sequence[TopicPartition]
        bounds: list[int]
        grouped = None
        if (
            partition is None
            and key_list is not None
            and header_list is None
            and tag_lists is None
            and min(count, n) >= STAGE_MIN_RUNS
            and None not in key_list
            and acc.stageable(int(sizes.sum()), int(sizes.max()))
        ):
            grouped = group_by_partition(partitions_for_keys(key_list, n))  # type: ignore[arg-type]
            if len(grouped[1]) >= STAGE_MIN_RUNS:
                return await self._stage_by_key(
                    acc,
                    tps,
                    grouped,
                    values,
                    key_list,
                    timestamp_ms,
                    timestamps,
                    sizes,
                    max_block - (self._clock() - started),
                )
        if partition is not None:
            run_tps, bounds = (tps[partition],), [0, count]
        else:
            assert key_list is not None
            order, parts, bounds = grouped or self._runs_by_key(topic, key_list, n)
            run_tps = [tps[parts[0]]] if len(parts) == 1 else itemgetter(*parts)(tps)
            if len(parts) > 1:
                # every column in partition order at once (C loops), then one slice a run
                take = itemgetter(*order.tolist())
                values = take(values)
                key_list = take(key_list)
                header_list = None if header_list is None else take(header_list)
                tag_lists = None if tag_lists is None else take(tag_lists)
                if timestamp_ms is not None and not isinstance(timestamp_ms, int):
                    timestamps = take(timestamps)
                sizes = sizes[order]
        if self._txn is not None:
            for tp in run_tps:
                self._txn.maybe_add(tp)
        return await acc.append_runs(
            run_tps,
            bounds,
            values,
            key_list,
            header_list,
            tag_lists,
            timestamps,
            sizes.tolist(),
            max_block - (self._clock() - started),
        )

    async def _stage_by_key(
        self,
        acc: RecordAccumulator,
        tps: list[TopicPartition],
        grouped: tuple[np.ndarray, list[int], list[int]],
        values: list[bytes | None],
        keys: list[bytes | None],
        timestamp_ms: int | Sequence[int] | None,
        timestamps: list[int],
        sizes: np.ndarray,
        max_block: float,
    ) -> asyncio.Future[StoredRuns]:
        """A keyed call over many partitions goes to the accumulator's stage
        (``sdk.staging``): its columns in partition order (``grouped``, as
        ``group_by_partition`` gives it), and no Python work per run."""
        order, parts, bounds = grouped
        if self._txn is not None:
            for p in parts:
                self._txn.maybe_add(tps[p])
        ordered = np.repeat(np.asarray(parts, dtype=np.int64), np.diff(bounds))
        take = itemgetter(*order.tolist())
        if timestamp_ms is None or isinstance(timestamp_ms, int):
            ts = np.full(len(values), timestamps[0], dtype=np.int64)
        else:
            ts = np.asarray(timestamps, dtype=np.int64)[order]
        return await acc.stage_runs(
            tps, ordered, list(take(values)), list(take(keys)), ts, sizes[order], max_block
        )

    def _topic_partitions(self, topic: str, n: int) -> list[TopicPartition]:
        """``TopicPartition(topic, p)`` for every partition ``p`` of ``topic``, built once per
        partition count (``send_batch`` picks its runs' partitions from it by index)."""
        tps = self._topic_tps.get(topic)
        if tps is None or len(tps) != n:
            tps = self._topic_tps[topic] = [TopicPartition(topic, p) for p in range(n)]
        return tps

    def _runs_by_key(
        self, topic: str, keys: Sequence[bytes | None], n: int
    ) -> tuple[np.ndarray, list[int], list[int]]:
        """The records grouped by partition (``group_by_partition``: the order, each run's
        partition, the runs' bounds): keys hashed all at once (``partitions_for_keys``),
        keyless records to the sticky partition."""
        if None in keys:
            mask = np.fromiter(map(is_not, keys, repeat(None)), dtype=bool, count=len(keys))
            keyed = np.flatnonzero(mask)
            sticky = self._partitioner.partition(
                topic, None, n, self._cluster.available_partitions(topic) if self._cluster else ()
            )
            parts = np.full(len(keys), sticky, dtype=np.int64)
            if len(keyed):
                picked = itemgetter(*keyed.tolist())(keys) if len(keyed) > 1 else [keys[keyed[0]]]
                parts[keyed] = partitions_for_keys(picked, n)
        else:
            parts = partitions_for_keys(keys, n)  # type: ignore[arg-type]
        return group_by_partition(parts)

    async def send_and_wait(
        self,
        topic: str,
        value: bytes | None,
        key: bytes | None = None,
        headers: Sequence[tuple[str, bytes]] | Mapping[str, bytes] | None = None,
        tags: Sequence[str] | None = None,
        partition: int | None = None,
        timestamp_ms: int | None = None,
        *,
        delay_ms: int | None = None,
        deliver_at_ms: int | None = None,
        delay_level: int | None = None,
    ) -> RecordMetadata:
        fut = await self.send(
            topic,
            value,
            key,
            headers,
            tags,
            partition,
            timestamp_ms,
            delay_ms=delay_ms,
            deliver_at_ms=deliver_at_ms,
            delay_level=delay_level,
        )
        return await fut

    # ---- delayed records (docs/delays.md) -------------------------------------------------
    def _next_schedule_nonce(self) -> str:
        self._scheduled += 1
        return f"{self._schedule_nonce}{self._scheduled:x}"

    def _target_partition(
        self, topic: str, key: bytes | None, partition: int | None, n: int
    ) -> int:
        assert self._cluster is not None
        if partition is not None:
            if not 0 <= partition < n:
                raise UnknownTopicOrPartitionError(
                    f"partition {partition} of topic {topic!r} does not exist (it has {n})"
                )
            return partition
        if key is not None:
            return partition_for_key(key, n)
        return self._partitioner.partition(
            topic, None, n, self._cluster.available_partitions(topic)
        )

    async def _lanes(self, level_topic: str, max_wait: float) -> int:
        """The partition count of a level topic (the same for every level)."""
        assert self._cluster is not None
        n = self._cluster.partition_count(level_topic)
        if n:
            return n
        try:
            return await self._cluster.wait_for_topic(level_topic, max(max_wait, 0.0))
        except UnknownTopicOrPartitionError as exc:
            raise UnknownTopicOrPartitionError(
                f"{exc}: delayed records need the delay level topics (`strata delays init`, "
                "or `strata local up`, creates them)"
            ) from None

    def _delay_max_ms(self, topic: str) -> int:
        assert self._cluster is not None
        limit = self._cluster.delay_max_ms(topic)
        return delays.DEFAULT_DELAY_MAX_MS if limit < 0 else limit

    def _joined(self, tp: TopicPartition) -> TopicPartition:
        """``tp``, a delay level's partition, added to the open transaction if there is one:
        a transaction's delayed records are stored in the levels as part of it (and the
        scheduler, reading ``read_committed``, never delivers an aborted one)."""
        if self._txn is not None:
            self._txn.maybe_add(tp)
        return tp

    async def _send_delayed(
        self,
        topic: str,
        value: bytes | None,
        key: bytes | None,
        headers: Sequence[tuple[str, bytes]] | Mapping[str, bytes] | None,
        tags: Sequence[str] | None,
        partition: int | None,
        timestamp_ms: int | None,
        delay: tuple[int | None, int | None, int | None],
    ) -> asyncio.Future[RecordMetadata]:
        acc = self._running_acc()
        cluster = self._cluster
        assert cluster is not None
        value = _as_bytes(value, "value")
        key = _as_bytes(key, "key")
        hdrs = list(_check_headers(headers) or ())
        if any(k in delays.DELAY_HEADERS for k, _ in hdrs):
            raise InvalidDelayError(f"headers {sorted(delays.DELAY_HEADERS)} are reserved")
        tag_list = _check_tags(tags) if tags else None
        started = self._clock()
        max_block = self.config.max_block_ms / 1000
        n = cluster.partition_count(topic) or await cluster.wait_for_topic(topic, max_block)
        now = self._wall_ms()
        due = delays.due_ms(
            now,
            delay_ms=delay[0],
            deliver_at_ms=delay[1],
            delay_level=delay[2],
            max_delay_ms=self._delay_max_ms(topic),
        )
        partition = self._target_partition(topic, key, partition, n)
        original_ts = now if timestamp_ms is None else int(timestamp_ms)
        schedule = delays.ScheduleId.new(due, topic, partition, key, self._next_schedule_nonce())
        sid = schedule.encode()
        hdrs.append((delays.HEADER_ID, sid.encode()))
        if (topic_id := cluster.topic_id(topic)) is not None:
            hdrs.append((delays.HEADER_TOPIC_ID, topic_id.encode()))
        if original_ts != now:  # else the level record's own timestamp says it
            hdrs.append((delays.HEADER_TIMESTAMP, str(original_ts).encode()))
        level_topic = delays.level_topic(delays.level_for(due - now))
        lanes = await self._lanes(level_topic, max_block - (self._clock() - started))
        tp = self._joined(TopicPartition(level_topic, schedule.lane_in(lanes)))
        stored = acc.append_nowait(tp, value, key, hdrs, tag_list, now)
        if stored is None:
            remaining = max_block - (self._clock() - started)
            stored = await acc.append(tp, value, key, hdrs, tag_list, now, remaining)
        out = ScheduledFuture(loop=asyncio.get_running_loop())
        out.schedule_id = sid

        def done(f: asyncio.Future[RecordMetadata]) -> None:
            if out.done():
                return
            if f.cancelled():
                out.cancel()
            elif (exc := f.exception()) is not None:
                out.set_exception(exc)
            else:
                out.set_result(RecordMetadata(topic, partition, -1, original_ts, sid))

        stored.add_done_callback(done)
        return out

    async def _send_batch_one_delay(
        self,
        topic: str,
        values: list[bytes | None],
        keys: Sequence[bytes | None] | None,
        tags: Sequence[Sequence[str] | None] | None,
        partition: int | None,
        timestamp_ms: int | None,
        delay: tuple[Any, Any, Any],
    ) -> asyncio.Future[StoredRuns]:
        """``send_batch`` with one delay for every record and no headers of the caller's: the
        due time and level are worked out once, keyless records share one lane per call."""
        acc = self._running_acc()
        cluster = self._cluster
        assert cluster is not None
        count = len(values)
        key_list = None if keys is None else list(keys)
        if key_list is not None and (
            len(key_list) != count or not set(map(type, key_list)) <= _VALUE_TYPES
        ):
            raise TypeError("keys must be bytes (or None), one per value")
        tag_lists = None if tags is None else [_check_tags(t) if t else None for t in tags]
        if tag_lists is not None and len(tag_lists) != count:
            raise ValueError("tags must have one entry per value")
        started = self._clock()
        max_block = self.config.max_block_ms / 1000
        n = cluster.partition_count(topic) or await cluster.wait_for_topic(topic, max_block)
        now = self._wall_ms()
        due = delays.due_ms(
            now,
            delay_ms=delay[0],
            deliver_at_ms=delay[1],
            delay_level=delay[2],
            max_delay_ms=self._delay_max_ms(topic),
        )
        level_topic = delays.level_topic(delays.level_for(due - now))
        lanes = await self._lanes(level_topic, max_block - (self._clock() - started))
        stamp = b"" if timestamp_ms is None else str(int(timestamp_ms)).encode()
        first = self._scheduled + 1
        self._scheduled += count
        nonce = self._schedule_nonce
        ids: list[str]
        groups: dict[tuple[int, int], list[int]]
        if key_list is None or (None in key_list and len(set(key_list)) == 1):
            p = self._target_partition(topic, None, partition, n)
            h = delays.lane_hash(topic, p, None, f"{nonce}{first:x}")
            head = f"{due}~{p}~{h:08x}~{nonce}"
            ids = [f"{head}{c:x}~{topic}" for c in range(first, first + count)]
            groups = {(p, h % lanes): list(range(count))}
        else:
            ids = []
            groups = defaultdict(list)
            for i, k in enumerate(key_list):
                p = self._target_partition(topic, k, partition, n)
                h = delays.lane_hash(topic, p, k, f"{nonce}{first + i:x}")
                ids.append(f"{due}~{p}~{h:08x}~{nonce}{first + i:x}~{topic}")
                groups[(p, h % lanes)].append(i)
        hdr_id, hdr_ts = delays.HEADER_ID, delays.HEADER_TIMESTAMP
        topic_id = cluster.topic_id(topic)
        pin = () if topic_id is None else ((delays.HEADER_TOPIC_ID, topic_id.encode()),)
        extra = 16 + len(hdr_id) + len(hdr_ts) + len(stamp) + max(map(len, ids))
        extra += sum(8 + len(k) + len(v) for k, v in pin)
        if stamp == str(now).encode():
            stamp = b""
        runs: list[tuple[int, tuple[str, ...], list[asyncio.Future[StoredRuns]]]] = []
        for (p, lane), idx in groups.items():
            every = len(idx) == count
            vals = values if every else [values[i] for i in idx]
            ks = None if key_list is None else key_list if every else [key_list[i] for i in idx]
            tgs: list[Sequence[str] | None] | None = (
                None if tag_lists is None else [tag_lists[i] for i in idx]
            )
            run_ids = ids if every else [ids[i] for i in idx]
            # tuples of str/bytes: the cyclic GC stops tracking them, so a full buffer of
            # delayed records does not make every later collection slower
            hdrs: list[Headers | None] = (
                [((hdr_id, sid.encode()), *pin, (hdr_ts, stamp)) for sid in run_ids]
                if stamp
                else [((hdr_id, sid.encode()), *pin) for sid in run_ids]
            )
            sizes = [RECORD_OVERHEAD + extra + (len(v) if v else 0) for v in vals]
            if ks is not None:
                sizes = [s + (len(k) if k else 0) for s, k in zip(sizes, ks, strict=True)]
            if tgs is not None:
                sizes = [
                    s + sum(4 + len(t.encode()) for t in tg or ())
                    for s, tg in zip(sizes, tgs, strict=True)
                ]
            stored = [
                await acc.append_many(
                    self._joined(TopicPartition(level_topic, lane)),
                    vals,
                    ks,
                    hdrs,
                    tgs,
                    [now] * len(idx),
                    sizes,
                    max_block - (self._clock() - started),
                )
            ]
            runs.append((p, tuple(run_ids), stored))

        return asyncio.ensure_future(_scheduled_runs(topic, runs))

    async def _send_batch_delayed(
        self,
        topic: str,
        values: Sequence[bytes | None],
        keys: Sequence[bytes | None] | None,
        headers: Sequence[Sequence[tuple[str, bytes]] | None] | None,
        tags: Sequence[Sequence[str] | None] | None,
        partition: int | None,
        timestamp_ms: int | Sequence[int] | None,
        delay: tuple[Any, Any, Any],
    ) -> asyncio.Future[StoredRuns]:
        acc = self._running_acc()
        cluster = self._cluster
        assert cluster is not None
        values = list(values)
        count = len(values)
        if not count:
            raise ValueError("send_batch needs at least one record")
        if not set(map(type, values)) <= _VALUE_TYPES:
            raise TypeError("values must be bytes (or None)")
        if (
            headers is None
            and all(v is None or isinstance(v, int) for v in delay)
            and (timestamp_ms is None or isinstance(timestamp_ms, int))
        ):
            return await self._send_batch_one_delay(
                topic, values, keys, tags, partition, timestamp_ms, delay
            )

        def column(col: Any, what: str) -> list[Any]:
            if col is None or isinstance(col, int):
                return [col] * count
            out = list(col)
            if len(out) != count:
                raise ValueError(f"{what} must have one entry per value")
            return out

        key_list = column(keys, "keys")
        if not set(map(type, key_list)) <= _VALUE_TYPES:
            raise TypeError("keys must be bytes (or None), one per value")
        header_list = [list(_check_headers(h) or ()) for h in column(headers, "headers")]
        tag_lists = [_check_tags(t) if t else None for t in column(tags, "tags")]
        stamps = column(timestamp_ms, "timestamp_ms")
        delay_cols = [
            column(d, name)
            for d, name in zip(delay, ("delay_ms", "deliver_at_ms", "delay_level"), strict=True)
        ]
        started = self._clock()
        max_block = self.config.max_block_ms / 1000
        n = cluster.partition_count(topic) or await cluster.wait_for_topic(topic, max_block)
        max_delay = self._delay_max_ms(topic)
        topic_id = cluster.topic_id(topic)
        pin = [] if topic_id is None else [(delays.HEADER_TOPIC_ID, topic_id.encode())]
        now = self._wall_ms()
        keyless = None
        groups: dict[tuple[int, int], list[tuple[int, delays.ScheduleId]]] = defaultdict(list)
        for i in range(count):
            if any(k in delays.DELAY_HEADERS for k, _ in header_list[i]):
                raise InvalidDelayError(f"headers {sorted(delays.DELAY_HEADERS)} are reserved")
            due = delays.due_ms(
                now,
                delay_ms=delay_cols[0][i],
                deliver_at_ms=delay_cols[1][i],
                delay_level=delay_cols[2][i],
                max_delay_ms=max_delay,
            )
            k = key_list[i]
            if partition is None and k is None:
                if keyless is None:
                    keyless = self._target_partition(topic, None, None, n)
                p = keyless
            else:
                p = self._target_partition(topic, k, partition, n)
            schedule = delays.ScheduleId.new(due, topic, p, k, self._next_schedule_nonce())
            groups[(p, delays.level_for(due - now))].append((i, schedule))
        runs: list[tuple[int, tuple[str, ...], list[asyncio.Future[StoredRuns]]]] = []
        for (p, level), members in groups.items():
            level_topic = delays.level_topic(level)
            lanes = await self._lanes(level_topic, max_block - (self._clock() - started))
            by_lane: dict[int, list[tuple[int, delays.ScheduleId]]] = defaultdict(list)
            for i, schedule in members:
                by_lane[schedule.lane_in(lanes)].append((i, schedule))
            ids: list[str] = []
            stored: list[asyncio.Future[StoredRuns]] = []
            for lane, lane_members in by_lane.items():
                hdrs: list[Headers | None] = []
                for i, schedule in lane_members:
                    sid = schedule.encode()
                    ids.append(sid)
                    ts = now if stamps[i] is None else int(stamps[i])
                    extra = [(delays.HEADER_ID, sid.encode()), *pin]
                    if ts != now:
                        extra.append((delays.HEADER_TIMESTAMP, str(ts).encode()))
                    hdrs.append([*header_list[i], *extra])
                idx = [i for i, _ in lane_members]
                vals = [values[i] for i in idx]
                ks = [key_list[i] for i in idx]
                tgs: list[Sequence[str] | None] = [tag_lists[i] for i in idx]
                sizes = [estimate_size(*rec) for rec in zip(vals, ks, hdrs, tgs, strict=True)]
                stored.append(
                    await acc.append_many(
                        self._joined(TopicPartition(level_topic, lane)),
                        vals,
                        ks,
                        hdrs,
                        tgs,
                        [now] * len(idx),
                        sizes,
                        max_block - (self._clock() - started),
                    )
                )
            runs.append((p, tuple(ids), stored))

        return asyncio.ensure_future(_scheduled_runs(topic, runs))

    async def send_exact(
        self,
        batches: Mapping[TopicPartition, bytes],
        deadline_s: float,
        *,
        channel: str = "",
        topic_ids: Mapping[str, str] | None = None,
    ) -> dict[TopicPartition, int]:
        """Store encoded batches whose producer fields the caller chose (``encode_batch``'s
        ``producer_id``, epoch, ``base_sequence``), at most one per partition, with
        ``acks=all``: one request per leader agent, retriable errors retried (for the
        partitions that got them) for up to ``deadline_s`` seconds. Returns each partition's
        base offset; raises the first error that is not retriable or outlives the deadline.

        The caller owns idempotence: a retry of the same batch after a lost answer, or the
        same batch sent again by another process, is answered by the leader with the offset
        it was stored at the first time (``docs/protocol.md``). The delay scheduler uses it to
        make its forwards exactly-once across crashes (``docs/delays.md``). ``channel`` picks
        a connection of its own (an agent answers a connection's requests in order, so writes
        that wait for a slow fsync hold up those behind them). ``topic_ids`` pins topics to
        one incarnation each (KIP-516), whatever the metadata says: the scheduler delivers a
        delayed record into the incarnation it was sent to, never into one created since."""
        self._running_acc()
        cluster = self._cluster
        assert cluster is not None
        backoff = self._backoff or ExponentialBackoff(
            self.config.retry_backoff_ms, self.config.effective_backoff_max_ms
        )
        deadline = self._clock() + deadline_s
        todo = dict(batches)
        pinned = topic_ids or {}
        done: dict[TopicPartition, int] = {}
        for topic in {tp.topic for tp in todo if cluster.partition_count(tp.topic) is None}:
            await cluster.wait_for_topic(topic, max(deadline - self._clock(), 0))
        attempt = 0
        while todo:
            errors: list[StrataError] = []
            by_leader: dict[int, list[TopicPartition]] = defaultdict(list)
            for tp in todo:
                leader = cluster.leader_for(tp.topic, tp.partition)
                if leader is None:
                    cluster.request_update()
                    errors.append(
                        UnknownTopicOrPartitionError(
                            f"no leader known for {tp.topic}[{tp.partition}]"
                        )
                    )
                else:
                    by_leader[leader].append(tp)

            async def one(
                leader: int, tps: list[TopicPartition], errors: list[StrataError] = errors
            ) -> None:
                topics: dict[str, list[ProducePartition]] = defaultdict(list)
                for tp in tps:
                    topics[tp.topic].append(ProducePartition(tp.partition, todo[tp]))
                request = ProduceRequest(
                    acks=-1,
                    timeout_ms=self.config.request_timeout_ms,
                    topics=[
                        ProduceTopic(t, parts, pinned.get(t) or cluster.topic_id(t))
                        for t, parts in topics.items()
                    ],
                )
                try:
                    response: ProduceResponse = await cluster.send(leader, request, channel=channel)
                except StrataError as exc:
                    errors.append(exc)
                    return
                for t in response.topics:
                    for r in t.partitions:
                        tp = TopicPartition(t.name, r.partition)
                        if r.error_code == 0:
                            done[tp] = r.base_offset
                            todo.pop(tp, None)
                        else:
                            errors.append(from_wire(r.error_code, r.error_message))

            await asyncio.gather(*(one(leader, tps) for leader, tps in by_leader.items()))
            if not todo:
                break
            if any(isinstance(e, STALE_METADATA_ERRORS) for e in errors):
                cluster.request_update()
            error = next((e for e in errors if not e.retriable), None) or (
                errors[0] if errors else UnknownTopicOrPartitionError("no answer")
            )
            wait = backoff(attempt)
            attempt += 1
            if not error.retriable or self._clock() + wait > deadline:
                raise error
            await asyncio.sleep(wait)
        return done

    def topic_id(self, topic: str) -> str | None:
        """The id of the incarnation of ``topic`` the producer's metadata names (None: not
        known yet)."""
        self._running_acc()
        assert self._cluster is not None
        return self._cluster.topic_id(topic)

    async def partitions_for(self, topic: str) -> list[int]:
        self._running_acc()
        assert self._cluster is not None
        n = await self._cluster.wait_for_topic(topic, self.config.max_block_ms / 1000)
        return list(range(n))

    def metrics(self) -> dict[str, Any]:
        stats = self._acc.stats() if self._acc is not None else {}
        if self._sender is not None:
            stats["in_flight_requests"] = self._sender.in_flight
            stats["produce_throttle_time_ms"] = self._sender.throttle_time_ms
        if self._acc is not None and self._acc.sequencer is not None:
            stats["producer_id"] = self._acc.sequencer.producer_id
        if self._txn is not None:
            stats["transaction_state"] = self._txn.state.value
            stats["producer_epoch"] = self._txn.epoch
            stats["transactions_committed"] = self._txn.commits
            stats["transactions_aborted"] = self._txn.aborts
        return stats
