"""The asynchronous consumer: manual assignment, or consumer groups (``subscribe``).

Theory of operation
-------------------
Each assigned partition has a *position*: the offset of the next record the application will
see. A position comes from ``seek``, or is *reset* — by ``seek_to_beginning`` /
``seek_to_end``, or when there is none, by ``auto.offset.reset`` — with a ListOffsets request
to the partition's leader.

One *fetcher* loop (a named task under the consumer's ``asyncio.TaskGroup``) keeps data ready
ahead of the application. On each wake-up it groups the partitions that have a position, no
buffered data and no error by leader agent and sends each leader one FetchRequest covering all
of them (long polling: the agent answers after ``fetch.max.wait.ms`` or once it has
``fetch.min.bytes``); at most one fetch per agent is in flight. A fetch response's record
bytes are kept as they arrived (no copy, no decoding) until the application asks for them.
Prefetching stops while the buffered bytes exceed ``fetch.max.bytes``, so the consumer holds at
most about two responses' worth of data however slowly it is read.

``getmany`` / ``getmany_arrow`` decode the buffered batches with ``storage.codec.decode_batch``
(CRC checked unless ``check.crcs`` is off) into Arrow — a run of consecutive small plain
batches (what a keyed topic of many partitions holds) into one record batch with
``storage.codec.runs.decode_run``, so the cost per batch is its check, not eleven Arrow
arrays — drop records below the position with a
zero-copy slice (a fetch may start in the middle of a batch), cut at ``max_records`` and move
the position past what they return. ``getmany`` then turns Arrow columns into
:class:`~sdk.records.ConsumerRecord` tuples; ``getmany_arrow`` returns the Arrow table itself,
which is the fast path for analytics and replay.

Filters: ``subscribe(topics, tags="TagA || TagB")`` / ``subscribe(topics, filter=...)`` and
``assign(partitions, filter=...)`` take an expression over records' tags and headers
(``storage.filters``; ``docs/filters.md``), parsed once (a mistake raises
``InvalidFilterError`` with its position) and sent with every fetch as its canonical text. The
agent answers with only the batches that hold matching records (a mixed batch comes whole,
with a selection bitmap that the consumer applies after decoding) and with the offset where it
stopped looking (``next_offset``); once the records before it are handed out, the position
moves there, so records the filter skipped count as consumed (commits and lag include them)
and a sparse filter never fetches the same range twice.

Transactions: with ``isolation.level=read_committed`` fetches read below the partition's last
stable offset (records of open transactions wait until their transaction ends) and come with
the aborted transactions of the range; the batches of those transactions are skipped whole,
by their header (producer id and offset range), as transaction markers always are — no
Python code runs per record for it. The position moves past what was skipped, and
``end_offsets`` / ``seek_to_end`` mean the last stable offset. ``group_metadata()`` is what
a transactional producer's ``send_offsets_to_transaction`` takes.

Errors: OFFSET_OUT_OF_RANGE resets the position by ``auto.offset.reset`` (``none``: raises
``OffsetOutOfRangeError`` from ``getmany``); NOT_LEADER, UNKNOWN_TOPIC_OR_PARTITION, network
errors and the like refresh metadata and retry the partition after ``retry.backoff.ms``; any
other error is raised from the next ``getmany`` that covers the partition — after data already
collected for other partitions has been returned.

Topic incarnations: a position belongs to the topic id it was set under, and fetches name
that id (KIP-516). When the metadata shows that a topic was deleted and created again (a new
id), the positions and buffered records of the old incarnation are dropped and the new one is
read from ``auto.offset.reset``, as a partition without a committed offset (a delete removes
them): never from the old incarnation's log, never at an offset meant for it.

Groups: with ``group.id``, ``subscribe(topics, listener=...)`` hands the assignment to the
group (``sdk.group.GroupClient``: join/sync/heartbeat loop, assignors, auto-commit), and
``commit`` / ``commit_async`` / ``committed`` talk to the group's coordinator. A committed
offset is the next offset to read.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import defaultdict, deque
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable, Mapping
from dataclasses import dataclass, field
from itertools import repeat
from types import TracebackType
from typing import Any, Self

import numpy as np
import pyarrow as pa

from sdk.backoff import ExponentialBackoff
from sdk.cluster import STALE_METADATA_ERRORS, Cluster
from sdk.config import ConsumerConfig
from sdk.crashes import CrashWatch
from sdk.errors import IllegalStateError, NoOffsetForPartitionError
from sdk.group import GroupClient, OffsetAndMetadata, RebalanceListener
from sdk.records import ConsumerRecord, OffsetAndTimestamp, TopicPartition
from sdk.retry import HAND_OUT, PARK, KeyOrder, Retrier, new_retrier_producer, retry_topic
from sdk.transactions import ConsumerGroupMetadata
from storage.codec import SCHEMA, Compression, decode_batch, read_header
from storage.codec.control import AbortedRanges, aborted_ranges, is_aborted
from storage.codec.runs import RUN_BATCH_RECORDS, decode_run
from storage.errors import (
    CorruptBatchError,
    InvalidFilterError,
    InvalidOffsetError,
    OffsetOutOfRangeError,
    RequestTimedOutError,
    StrataError,
    from_wire,
)
from storage.filters import Filter, as_filter, parse_tags, selection_mask
from storage.protocol import DEFAULT_MAX_FRAME
from storage.protocol.messages import (
    CONSUMER_REPLICA_ID,
    EARLIEST_TIMESTAMP,
    LATEST_TIMESTAMP,
    NO_GENERATION,
    READ_COMMITTED,
    READ_UNCOMMITTED,
    FetchPartition,
    FetchPartitionResult,
    FetchRequest,
    FetchResponse,
    FetchTopic,
    ListOffsetsPartition,
    ListOffsetsPartitionResult,
    ListOffsetsRequest,
    ListOffsetsResponse,
    ListOffsetsTopic,
)

log = logging.getLogger(__name__)
_OUT_OF_RANGE = OffsetOutOfRangeError.code
_RESETS = {"earliest": EARLIEST_TIMESTAMP, "latest": LATEST_TIMESTAMP}
FETCHES_PER_AGENT = 4
"""Fetches in flight to one agent at once, for disjoint partitions, each on a connection of
its own (an agent answers a connection's requests in order). A partition that becomes
fetchable while a long poll for others of the same agent is in flight (its buffered records
were handed out; it was resumed, sought, or reset) is fetched at once instead of waiting for
that poll to end, which could take ``fetch.max.wait.ms``. Long polls and the default
connection's requests (metadata, offset lookups) no longer wait behind each other either."""
_INT64 = pa.int64()


class _Buffered:
    """One fetch response's record bytes for one partition, consumed batch by batch; for a
    filtered fetch, the selections of its mixed batches and where the agent stopped looking
    (``end``, -1 unfiltered)."""

    __slots__ = (
        "aborted",
        "current",
        "current_base",
        "current_next",
        "current_offsets",
        "data",
        "end",
        "pos",
        "seen_whole",
        "selections",
    )

    def __init__(
        self,
        data: memoryview,
        end: int = -1,
        selections: dict[int, Any] | None = None,
        aborted: AbortedRanges | None = None,
    ) -> None:
        self.data = data
        self.pos = 0
        self.end = end
        self.selections = selections
        self.aborted = aborted  # read_committed: the aborted transactions' ranges
        self.current: pa.RecordBatch | None = None
        self.current_base = 0
        self.current_next = 0
        self.current_offsets: np.ndarray | None = None  # of a batch cut by its selection
        self.seen_whole = False


@dataclass(slots=True)
class _PartitionState:
    position: int | None = None
    reset: int | None = None  # EARLIEST_TIMESTAMP / LATEST_TIMESTAMP while a reset is pending
    error: StrataError | None = None
    buffered: _Buffered | None = None
    busy: bool = False  # a fetch or reset for it is in flight
    retry_at: float = 0.0
    generation: int = 0  # bumped by every seek: answers to older requests are dropped
    high_watermark: int = -1
    last_stable_offset: int = -1
    log_start_offset: int = -1
    attempts: int = field(default=0)
    paused: bool = False  # neither fetched nor returned until resumed
    topic_id: str | None = None  # the incarnation the position belongs to (None: not known yet)


def _as_tp(tp: Any) -> TopicPartition:
    try:
        topic, partition = tp
    except (TypeError, ValueError):
        raise TypeError(f"expected a (topic, partition) pair, got {tp!r}") from None
    if not isinstance(topic, str) or not isinstance(partition, int) or partition < 0:
        raise TypeError(f"expected a (topic: str, partition: int >= 0) pair, got {tp!r}")
    return TopicPartition(topic, partition)


def _list_total(col: Any) -> int:
    offsets = col.offsets
    return int(offsets[len(offsets) - 1].as_py() - offsets[0].as_py())


def _header_tuples(hcol: pa.ListArray, n: int) -> list[tuple[tuple[str, bytes], ...]]:
    """Each record's headers as a tuple of (key, value) pairs: the key and value columns
    converted whole and cut by the list offsets (not a dict per header, as ``to_pylist``)."""
    offsets = hcol.offsets.to_pylist()  # into ``values``, which ignores the column's slice
    lo = offsets[0]
    pairs = hcol.values.slice(lo, offsets[n] - lo)  # only this slice's headers, not the batch's
    flat = list(zip(pairs.field(0).to_pylist(), pairs.field(1).to_pylist(), strict=True))
    return [tuple(flat[offsets[i] - lo : offsets[i + 1] - lo]) for i in range(n)]


def to_records(tp: TopicPartition, batches: Iterable[pa.RecordBatch]) -> list[ConsumerRecord]:
    """Arrow record batches (``storage.codec.SCHEMA``) as ConsumerRecords, column by column."""
    out: list[ConsumerRecord] = []
    for rb in batches:
        n = rb.num_rows
        offsets = rb.column(0).to_pylist()
        timestamps = rb.column(1).cast(_INT64).to_pylist()
        keys = rb.column(2).to_pylist()
        values = rb.column(3).to_pylist()
        hcol, tcol = rb.column(4), rb.column(5)
        headers: Iterable[Any] = _header_tuples(hcol, n) if _list_total(hcol) else repeat((), n)
        tags: Iterable[Any] = (
            [tuple(ts) for ts in tcol.to_pylist()] if _list_total(tcol) else repeat((), n)
        )
        out.extend(
            map(
                ConsumerRecord,
                repeat(tp.topic, n),
                repeat(tp.partition, n),
                offsets,
                timestamps,
                keys,
                values,
                headers,
                tags,
            )
        )
    return out


class Consumer:
    """Read records of assigned partitions (see the module docstring)::

    async with Consumer({"bootstrap.servers": "localhost:9092",
                         "auto.offset.reset": "earliest"}) as consumer:
        consumer.assign([("events", 0), ("events", 1)])
        async for record in consumer:
            ...
    """

    def __init__(
        self,
        config: ConsumerConfig | Mapping[str, Any],
        *,
        clock: Callable[[], float] = time.monotonic,
        backoff: ExponentialBackoff | None = None,
    ) -> None:
        self.config = ConsumerConfig.parse(config)
        self._clock = clock
        self._backoff = backoff or ExponentialBackoff(
            self.config.retry_backoff_ms, self.config.effective_backoff_max_ms
        )
        self._states: dict[TopicPartition, _PartitionState] = {}
        self._buffered_bytes = 0
        #: agent id -> the fetch slots in use (each slot its own connection: ``_fetch``)
        self._fetching: dict[int, set[int]] = defaultdict(set)
        self._rotation = 0
        self._pending: deque[ConsumerRecord] = deque()
        self._wake = asyncio.Event()
        self._changed = asyncio.Event()
        self._cluster: Cluster | None = None
        self._tg: asyncio.TaskGroup | None = None
        self._supervisor: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()
        self._failure: BaseException | None = None
        self._started = False
        self._closed = False
        self._group: GroupClient | None = None
        self._group_task: asyncio.Task[None] | None = None
        self._subscription: tuple[list[str], RebalanceListener | None] | None = None
        self._filter: Filter | None = None
        self._retrier: Retrier | None = None
        self._key_order = KeyOrder() if self.config.retry_ordering == "key" else None
        #: a retry-enabled group member's crash counting (sdk.crashes)
        self._crashes: CrashWatch | None = None

    # ---- lifecycle -----------------------------------------------------------------------
    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        if self._tg is None:
            coro.close()
            raise IllegalStateError("the consumer is not running")
        return self._tg.create_task(coro, name=name)

    async def start(self) -> None:
        if self._started:
            return
        self._started = True
        cfg = self.config
        self._cluster = Cluster(
            cfg,
            spawn=self._spawn,
            clock=self._clock,
            backoff=self._backoff,
            max_frame=max(DEFAULT_MAX_FRAME, cfg.fetch_max_bytes + (1 << 20)),
        )
        self._cluster.add_topics(tp.topic for tp in self._states)
        self._cluster.add_listener(self._wake.set)
        if cfg.group_id is not None:
            self._group = GroupClient(self, self._cluster, cfg)
            if self._retries_enabled:
                self._crashes = CrashWatch(self._group, self._spawn)
        running: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._supervisor = asyncio.create_task(self._supervise(running), name="strata-consumer")
        await running
        try:
            await self._cluster.bootstrap()
        except BaseException:
            await self.close()
            raise

    async def _supervise(self, running: asyncio.Future[None]) -> None:
        assert self._cluster is not None
        try:
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                running.set_result(None)
                loops = [
                    tg.create_task(self._cluster.run(), name="strata-consumer-metadata"),
                    tg.create_task(self._fetch_loop(), name="strata-consumer-fetcher"),
                ]
                if self._subscription is not None:
                    self._start_group()
                await self._stop.wait()
                for task in loops:
                    task.cancel()
                if self._group_task is not None:
                    self._group_task.cancel()
                await self._cluster.close()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            self._failure = exc
        finally:
            self._tg = None
            if not running.done():
                running.set_exception(IllegalStateError("the consumer stopped while starting"))
            if self._cluster is not None:
                await self._cluster.close()
            self._notify()

    async def close(self) -> None:
        """Stop fetching and close the connections. Buffered records are dropped.

        A group member commits (with ``enable.auto.commit``), runs ``on_partitions_revoked``
        and leaves the group first (a static member does not leave)."""
        if self._group is not None and not self._closed and self._failure is None:
            if self._group_task is not None:
                self._group_task.cancel()
                await asyncio.wait([self._group_task])
            with contextlib.suppress(StrataError, TimeoutError):
                async with asyncio.timeout(self.config.request_timeout_ms / 1000):
                    await self._group.close()
        self._closed = True
        if self._retrier is not None:
            await self._retrier.close()
        self._stop.set()
        if self._supervisor is not None:
            await asyncio.wait([self._supervisor])
        for st in self._states.values():
            st.buffered = None
        self._buffered_bytes = 0
        self._pending.clear()

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

    def _check_running(self) -> Cluster:
        if self._closed:
            raise IllegalStateError("the consumer is closed")
        if self._failure is not None:
            raise IllegalStateError(f"the consumer failed: {self._failure!r}") from self._failure
        if self._cluster is None or self._tg is None:
            raise IllegalStateError("the consumer is not started: await consumer.start()")
        return self._cluster

    def wake_pollers(self) -> None:
        """Wake ``getmany`` callers waiting for records (the group's state changed)."""
        self._notify()

    def _notify(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def _wait_changed(self, max_wait: float) -> None:
        changed = self._changed
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(max_wait, 0)):
                await changed.wait()

    # ---- assignment and positions ---------------------------------------------------------
    # ---- consumer groups (sdk/group.py) -----------------------------------------------------
    def subscribe(
        self,
        topics: Iterable[str],
        listener: RebalanceListener | None = None,
        *,
        tags: str | None = None,
        filter: str | Filter | None = None,
    ) -> None:
        """Join the group ``group.id`` and consume the partitions it assigns from ``topics``.

        ``listener`` may define ``on_partitions_revoked(set)``, ``on_partitions_assigned(set)``
        and ``on_partitions_lost(set)`` (plain or async); commit in ``on_partitions_revoked``
        to keep what was processed before a partition moves.

        ``tags`` (RocketMQ's ``"TagA || TagB"``, ``"*"`` for all) or ``filter`` (an expression
        over tags and headers, ``docs/filters.md``) make the agents send only matching records;
        a mistake raises ``InvalidFilterError`` here, with its position. The filter is part of
        the subscription: every member of the group must have the same one (a member with
        another is refused, ``InconsistentFilterError`` from ``getmany``)."""
        if self.config.group_id is None:
            raise IllegalStateError("subscribe needs group.id in the consumer's config")
        if self._subscription is not None:
            raise IllegalStateError("already subscribed")
        names = sorted(set(topics))
        if not names or not all(isinstance(t, str) for t in names):
            raise TypeError(f"subscribe needs topic names, got {names!r}")
        if self._retries_enabled:
            names = sorted({*names, retry_topic(self.config.group_id)})
        chosen = _subscription_filter(tags, filter)
        self.assign([])
        self._filter = chosen
        self._subscription = (names, listener)
        if self._tg is not None:
            self._start_group()

    @property
    def _retries_enabled(self) -> bool:
        return self.config.retry_enable or self.config.retry_ordering == "key"

    async def retry_later(self, record: ConsumerRecord, reason: str = "") -> None:
        """Mark ``record`` failed: it is sent to the group's retry topic and comes back to this
        group after the policy's backoff, or goes to the dead-letter topic after its last
        attempt (``docs/retries.md``). Returns at once (the failure record is stored in the
        background); the record counts as processed, and its offset is committed with the
        first commit after it is stored. Needs ``retry.enable``. In a consume-transform-produce
        transaction use the transactional producer's ``retry_later`` instead (its failure
        record is part of the transaction)."""
        group = self.config.group_id
        if group is None or not self._retries_enabled:
            raise IllegalStateError("retry_later needs group.id and retry.enable=true")
        self._check_running()
        retrier = await self._ensure_retrier()
        if self._key_order is not None:
            self._key_order.failed(record)
        await retrier.submit(record, reason, ordered=self._key_order is not None)

    async def flush_retries(self) -> None:
        """Wait until every record given to ``retry_later`` is stored (a commit of explicit
        offsets does this first; a commit of positions never passes one that is not)."""
        if self._retrier is not None:
            await self._retrier.flush()

    async def _ensure_retrier(self) -> Retrier:
        if self._retrier is None:
            assert self.config.group_id is not None
            producer = new_retrier_producer(self.config.bootstrap_servers)
            await producer.start()
            self._retrier = Retrier(producer, self.config.group_id)
        return self._retrier

    async def _next_in_key_order(self, wanted: set[TopicPartition]) -> ConsumerRecord:
        """``getone`` with ``retry.ordering=key``: park what must wait behind its key."""
        assert self._key_order is not None
        while True:
            ready = self._key_order.next_ready()
            if ready is not None:
                return ready
            record = await self._next_pending(wanted)
            verdict = self._key_order.admit(record)
            if verdict == HAND_OUT:
                return record
            if verdict == PARK:
                retrier = await self._ensure_retrier()
                await retrier.submit(record, parked=True, ordered=True)

    def _start_group(self) -> asyncio.Task[None]:
        assert self._group is not None and self._subscription is not None
        topics, listener = self._subscription
        self._group.subscribe(topics, listener, self._filter)
        assert self._cluster is not None
        self._cluster.add_topics(topics)
        self._group_task = self._spawn(self._group.run(), "strata-consumer-group")
        return self._group_task

    def group_assignment(
        self, partitions: set[TopicPartition], positions: Mapping[TopicPartition, int]
    ) -> None:
        """The group's assignment (called by ``GroupClient``): positions for new partitions
        are the committed offsets; without one, ``auto.offset.reset`` decides."""
        self._assign(partitions)
        for tp, offset in positions.items():
            st = self._states.get(tp)
            if st is not None and st.position is None:
                st.position, st.reset = offset, None
        if self._crashes is not None:
            self._crashes.assigned()
        self._notify()

    @property
    def group_generation(self) -> int:
        """The generation of the current group assignment (-1 outside a group)."""
        return -1 if self._group is None else self._group.generation

    @property
    def member_id(self) -> str:
        return "" if self._group is None else self._group.member_id

    def group_metadata(self) -> ConsumerGroupMetadata:
        """The group, generation and member id, for a transactional producer's
        ``send_offsets_to_transaction`` (which refuses them once this member's generation
        is over)."""
        group_id = self.config.group_id
        if group_id is None:
            raise IllegalStateError("group_metadata() needs group.id in the consumer's config")
        if self._group is None:
            return ConsumerGroupMetadata(group_id)
        return ConsumerGroupMetadata(
            group_id,
            self._group.generation if self._group.topics else NO_GENERATION,
            self._group.member_id if self._group.topics else "",
            self.config.group_instance_id if self._group.topics else None,
        )

    def positions_to_commit(self) -> dict[TopicPartition, int]:
        """Every partition's position in its current incarnation (a deleted one's are not
        kept); with retries, never past a record whose failure record is not stored yet or
        that waits behind its key (``docs/retries.md``)."""
        cluster = self._cluster
        out = {
            tp: st.position
            for tp, st in self._states.items()
            if st.position is not None
            and (cluster is None or st.topic_id in (None, cluster.topic_id(tp.topic)))
        }
        for source in (self._retrier, self._key_order):
            if source is not None:
                for tp, cap in source.commit_caps().items():
                    if tp in out:
                        out[tp] = min(out[tp], cap)
        return out

    def _group_client(self) -> GroupClient:
        self._check_running()
        if self._group is None:
            raise IllegalStateError("committed offsets need group.id in the consumer's config")
        return self._group

    async def commit(
        self, offsets: Mapping[TopicPartition, int | OffsetAndMetadata] | None = None
    ) -> None:
        """Commit ``offsets`` (default: every assigned partition's position) and wait for the
        coordinator's acknowledgement. A committed offset is the next offset to read. A
        member of an old generation gets ``IllegalGenerationError`` (its partitions may
        already be someone else's)."""
        group = self._group_client()
        if offsets is None:
            values = {tp: OffsetAndMetadata(o) for tp, o in self.positions_to_commit().items()}
        else:
            await self.flush_retries()  # explicit offsets may pass a failed record
            values = {
                _as_tp(tp): o if isinstance(o, OffsetAndMetadata) else OffsetAndMetadata(o)
                for tp, o in offsets.items()
            }
        await group.commit(values)

    def commit_async(
        self,
        offsets: Mapping[TopicPartition, int | OffsetAndMetadata] | None = None,
        callback: Callable[[BaseException | None], Any] | None = None,
    ) -> asyncio.Task[None]:
        """Start a commit and return at once; ``callback(error or None)`` runs when done."""
        self._group_client()
        snapshot = None if offsets is None else dict(offsets)
        if snapshot is None:
            snapshot = dict(self.positions_to_commit())

        async def run() -> None:
            error: BaseException | None = None
            try:
                await self.commit(snapshot)
            except StrataError as exc:
                error = exc
            if callback is not None:
                callback(error)
            elif error is not None:
                log_commit_failure(error)

        return self._spawn(run(), "strata-consumer-commit")

    async def committed(self, tp: TopicPartition | tuple[str, int]) -> OffsetAndMetadata | None:
        """The group's committed offset of ``tp`` (None if nothing is committed)."""
        tp = _as_tp(tp)
        return (await self._group_client().committed([tp])).get(tp)

    def assign(
        self,
        partitions: Iterable[TopicPartition | tuple[str, int]],
        *,
        filter: str | Filter | None = None,
    ) -> None:
        """Consume exactly these partitions (replacing any earlier assignment), only their
        records that match ``filter`` (an expression, ``docs/filters.md``; None: all)."""
        if self._subscription is not None:
            raise IllegalStateError("the consumer is subscribed: the group assigns partitions")
        chosen = as_filter(filter)
        wanted = [_as_tp(tp) for tp in partitions]
        if chosen != self._filter:
            self._filter = chosen
            for tp, st in self._states.items():  # what was fetched for the old filter goes
                self._reposition(tp, st)
        self._assign(wanted)

    @property
    def filter(self) -> Filter | None:
        """The filter of the subscription or assignment (None: every record)."""
        return self._filter

    def _assign(self, partitions: Iterable[TopicPartition | tuple[str, int]]) -> None:
        wanted = [_as_tp(tp) for tp in partitions]
        keep = set(wanted)
        for tp in list(self._states):
            if tp not in keep:
                self._drop(self._states.pop(tp))
        for tp in wanted:
            self._states.setdefault(tp, _PartitionState())
        self._pending = deque(r for r in self._pending if (r.topic, r.partition) in keep)
        if self._cluster is not None:
            self._cluster.add_topics(tp.topic for tp in wanted)
        self._wake.set()

    def assignment(self) -> set[TopicPartition]:
        return set(self._states)

    def _state(self, tp: Any) -> _PartitionState:
        st = self._states.get(_as_tp(tp))
        if st is None:
            raise IllegalStateError(f"{tp} is not assigned to this consumer")
        return st

    def _drop(self, st: _PartitionState) -> None:
        if st.buffered is not None:
            self._buffered_bytes -= len(st.buffered.data)
            st.buffered = None

    def _reposition(self, tp: TopicPartition, st: _PartitionState) -> None:
        self._drop(st)
        st.error = None
        st.retry_at = 0.0
        st.generation += 1
        if self._pending:
            self._pending = deque(r for r in self._pending if (r.topic, r.partition) != tp)
        self._wake.set()

    def seek(self, tp: TopicPartition | tuple[str, int], offset: int) -> None:
        """The next record returned for ``tp`` will be the one at ``offset`` (or after it)."""
        if not isinstance(offset, int) or offset < 0:
            raise InvalidOffsetError(f"cannot seek to offset {offset!r}")
        tp = _as_tp(tp)
        st = self._state(tp)
        st.position, st.reset = offset, None
        self._reposition(tp, st)

    def pause(self, *partitions: TopicPartition | tuple[str, int]) -> None:
        """Stop fetching and returning records of ``partitions`` until ``resume``. Their
        buffered data is dropped (the position stays), so a paused partition holds no memory."""
        for tp in map(_as_tp, partitions):
            st = self._state(tp)
            if not st.paused:
                st.paused = True
                self._reposition(tp, st)

    def resume(self, *partitions: TopicPartition | tuple[str, int]) -> None:
        for tp in map(_as_tp, partitions):
            st = self._state(tp)
            if st.paused:
                st.paused = False
                self._wake.set()

    def paused(self) -> set[TopicPartition]:
        return {tp for tp, st in self._states.items() if st.paused}

    def seek_to_beginning(self, *partitions: TopicPartition | tuple[str, int]) -> None:
        self._seek_to(EARLIEST_TIMESTAMP, partitions)

    def seek_to_end(self, *partitions: TopicPartition | tuple[str, int]) -> None:
        self._seek_to(LATEST_TIMESTAMP, partitions)

    def _seek_to(self, where: int, partitions: Iterable[Any]) -> None:
        tps = [_as_tp(tp) for tp in partitions] or list(self._states)
        for tp in tps:
            st = self._state(tp)
            st.reset = where
            self._reposition(tp, st)

    async def position(self, tp: TopicPartition | tuple[str, int]) -> int:
        """The offset of the next record to be returned, resolving a pending reset first."""
        self._check_running()
        tp = _as_tp(tp)
        deadline = self._clock() + self.config.request_timeout_ms / 1000
        while True:
            st = self._state(tp)
            if st.error is not None:
                raise st.error
            if st.position is not None and st.reset is None:
                return st.position
            remaining = deadline - self._clock()
            if remaining <= 0:
                raise RequestTimedOutError(f"could not find a position for {tp} in time")
            self._wake.set()
            await self._wait_changed(remaining)
            self._check_running()

    def highwater(self, tp: TopicPartition | tuple[str, int]) -> int:
        """The partition's high watermark as of the last fetch (-1 before one)."""
        return self._state(tp).high_watermark

    def last_stable_offset(self, tp: TopicPartition | tuple[str, int]) -> int:
        """read_committed: the partition's last stable offset as of the last fetch (-1 before
        one, and for read_uncommitted)."""
        return self._state(tp).last_stable_offset

    # ---- offsets lookups -----------------------------------------------------------------
    async def beginning_offsets(
        self, partitions: Iterable[TopicPartition | tuple[str, int]]
    ) -> dict[TopicPartition, int]:
        found = await self._list_offsets({_as_tp(tp): EARLIEST_TIMESTAMP for tp in partitions})
        return {tp: r.offset for tp, r in found.items()}

    async def end_offsets(
        self, partitions: Iterable[TopicPartition | tuple[str, int]]
    ) -> dict[TopicPartition, int]:
        found = await self._list_offsets({_as_tp(tp): LATEST_TIMESTAMP for tp in partitions})
        return {tp: r.offset for tp, r in found.items()}

    async def offsets_for_times(
        self, timestamps: Mapping[TopicPartition | tuple[str, int], int]
    ) -> dict[TopicPartition, OffsetAndTimestamp | None]:
        """The first offset whose timestamp is at or after the one given (None: no such)."""
        query: dict[TopicPartition, int] = {}
        for tp, ts in timestamps.items():
            if not isinstance(ts, int) or ts < 0:
                raise ValueError(f"timestamp for {tp} must be a non-negative int (ms), got {ts!r}")
            query[_as_tp(tp)] = ts
        found = await self._list_offsets(query)
        return {
            tp: None if r.offset < 0 else OffsetAndTimestamp(r.offset, r.timestamp)
            for tp, r in found.items()
        }

    async def _list_offsets(
        self, query: dict[TopicPartition, int]
    ) -> dict[TopicPartition, ListOffsetsPartitionResult]:
        """ListOffsets to each partition's leader, retrying retriable errors until
        ``request.timeout.ms`` has passed."""
        cluster = self._check_running()
        cluster.add_topics(tp.topic for tp in query)
        deadline = self._clock() + self.config.request_timeout_ms / 1000
        pending = dict(query)
        results: dict[TopicPartition, ListOffsetsPartitionResult] = {}
        last: StrataError | None = None
        attempt = 0
        while pending:
            by_leader: dict[int, dict[TopicPartition, int]] = defaultdict(dict)
            for tp, ts in pending.items():
                leader = cluster.leader_for(tp.topic, tp.partition)
                if leader is None:
                    cluster.request_update()
                else:
                    by_leader[leader][tp] = ts
            isolation = READ_COMMITTED if self.config.read_committed else READ_UNCOMMITTED
            answers = await asyncio.gather(
                *(
                    cluster.send(agent, _list_offsets_request(q, isolation))
                    for agent, q in by_leader.items()
                ),
                return_exceptions=True,
            )
            for answer in answers:
                if isinstance(answer, StrataError):
                    if not answer.retriable:
                        raise answer
                    last = answer
                    continue
                if isinstance(answer, BaseException):
                    raise answer
                response: ListOffsetsResponse = answer
                for t in response.topics:
                    for r in t.partitions:
                        tp = TopicPartition(t.name, r.partition)
                        if tp not in pending:
                            continue
                        if r.error_code == 0:
                            results[tp] = r
                            del pending[tp]
                            continue
                        err = from_wire(r.error_code, f"{tp}: error {r.error_code}")
                        if not err.retriable:
                            raise err
                        if isinstance(err, STALE_METADATA_ERRORS):
                            cluster.request_update()
                        last = err
            if not pending:
                break
            remaining = deadline - self._clock()
            if remaining <= 0:
                raise RequestTimedOutError(
                    f"offsets of {sorted(pending)} not found within request.timeout.ms"
                    + (f" (last error: {last})" if last else "")
                )
            await cluster.wait_for_update(min(remaining, self._backoff(attempt)))
            attempt += 1
        return results

    # ---- fetching ------------------------------------------------------------------------
    async def _fetch_loop(self) -> None:
        while True:
            self._wake.clear()
            delay = self._plan(self._clock())
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await self._wake.wait()

    def _plan(self, now: float) -> float | None:
        """Start the resets and fetches that can go now; seconds until one is due."""
        cluster = self._cluster
        assert cluster is not None
        resets: dict[int, dict[TopicPartition, int]] = defaultdict(dict)
        fetches: dict[int, list[TopicPartition]] = defaultdict(list)
        delay: float | None = None
        room = self._buffered_bytes < self.config.fetch_max_bytes
        for tp, st in self._states.items():
            self._follow_incarnation(cluster, tp, st)
            if st.error is not None or st.buffered is not None or st.busy or st.paused:
                continue
            if st.retry_at > now:
                wait = st.retry_at - now
                delay = wait if delay is None else min(delay, wait)
                continue
            if st.position is None and st.reset is None:
                policy = self.config.auto_offset_reset
                if policy == "none":
                    st.error = NoOffsetForPartitionError(tp.topic, tp.partition)
                    self._notify()
                    continue
                st.reset = _RESETS[policy]
            leader = cluster.leader_for(tp.topic, tp.partition)
            if leader is None:
                cluster.request_update()
                continue  # woken by the metadata update
            if st.reset is not None:
                resets[leader][tp] = st.reset
            elif room and len(self._fetching[leader]) < FETCHES_PER_AGENT:
                fetches[leader].append(tp)
        for leader, query in resets.items():
            for tp in query:
                self._states[tp].busy = True
            self._spawn(self._reset(leader, query), f"strata-reset-from-{leader}")
        for leader, tps in fetches.items():
            for tp in tps:
                self._states[tp].busy = True
            in_use = self._fetching[leader]
            slot = min(set(range(FETCHES_PER_AGENT)) - in_use)
            in_use.add(slot)
            self._spawn(self._fetch(leader, tps, slot), f"strata-fetch-from-{leader}")
        return delay

    def _follow_incarnation(
        self, cluster: Cluster, tp: TopicPartition, st: _PartitionState
    ) -> None:
        """Tie the position to the topic's id; a new id (the topic was deleted and created
        again) drops the old incarnation's position and records (module docstring)."""
        current = cluster.topic_id(tp.topic)
        if current is None or st.topic_id == current:
            return
        if st.topic_id is not None:
            log.info(
                "%s was deleted and created again (id %s, was %s): reading it from %s",
                tp,
                current,
                st.topic_id,
                self.config.auto_offset_reset,
            )
            st.position, st.reset = None, None
            self._reposition(tp, st)
        st.topic_id = current

    def _backoff_partition(self, st: _PartitionState) -> None:
        st.retry_at = self._clock() + self._backoff(st.attempts)
        st.attempts += 1

    async def _reset(self, leader: int, query: dict[TopicPartition, int]) -> None:
        cluster = self._cluster
        assert cluster is not None
        # a partition revoked between the plan and this task's start is not asked for
        asked = {tp: st.generation for tp in query if (st := self._states.get(tp)) is not None}
        query = {tp: ts for tp, ts in query.items() if tp in asked}
        if not query:
            self._wake.set()
            return
        isolation = READ_COMMITTED if self.config.read_committed else READ_UNCOMMITTED
        try:
            response: ListOffsetsResponse = await cluster.send(
                leader, _list_offsets_request(query, isolation)
            )
        except StrataError as exc:
            for tp, gen in asked.items():
                st = self._states.get(tp)
                if st is not None and st.generation == gen:
                    self._partition_error(tp, st, exc)
            return
        finally:
            for tp in query:
                st = self._states.get(tp)
                if st is not None:
                    st.busy = False
            self._wake.set()
        for t in response.topics:
            for r in t.partitions:
                tp = TopicPartition(t.name, r.partition)
                st = self._states.get(tp)
                if st is None or tp not in asked or st.generation != asked[tp]:
                    continue
                if r.error_code == 0 and r.offset >= 0:
                    st.position, st.reset, st.attempts = r.offset, None, 0
                elif r.error_code == 0:
                    self._backoff_partition(st)
                else:
                    self._partition_error(
                        tp, st, from_wire(r.error_code, f"{tp}: error {r.error_code}")
                    )
        self._notify()

    async def _fetch(self, leader: int, tps: list[TopicPartition], slot: int) -> None:
        cluster = self._cluster
        assert cluster is not None
        cfg = self.config
        # a partition revoked (or repositioned) between the plan and this task's start: not
        # fetched (a rebalance's new assignment can land in that gap)
        live = [
            tp for tp in tps if (st := self._states.get(tp)) is not None and st.position is not None
        ]
        if not live:
            self._fetching[leader].discard(slot)
            self._wake.set()
            return
        tps = live
        asked: dict[TopicPartition, tuple[int, int]] = {}
        topics: dict[tuple[str, str | None], list[FetchPartition]] = defaultdict(list)
        for tp in tps:
            state = self._states[tp]
            assert state.position is not None
            asked[tp] = (state.generation, state.position)
            topics[(tp.topic, state.topic_id)].append(
                FetchPartition(
                    tp.partition,
                    state.position,
                    cfg.max_partition_fetch_bytes,
                    cluster.leader_epoch(tp.topic, tp.partition),
                    None if self._filter is None else self._filter.text,
                )
            )
        request = FetchRequest(
            replica_id=CONSUMER_REPLICA_ID,
            max_wait_ms=cfg.fetch_max_wait_ms,
            min_bytes=cfg.fetch_min_bytes,
            max_bytes=cfg.fetch_max_bytes,
            isolation_level=READ_COMMITTED if cfg.read_committed else READ_UNCOMMITTED,
            topics=[FetchTopic(name, parts, tid) for (name, tid), parts in topics.items()],
        )
        try:
            response: FetchResponse = await cluster.send(
                leader,
                request,
                request_timeout=(cfg.request_timeout_ms + cfg.fetch_max_wait_ms) / 1000,
                channel=f"fetch-{slot}",
            )
        except StrataError as exc:
            for tp, (gen, _) in asked.items():
                st = self._states.get(tp)
                if st is not None and st.generation == gen:
                    self._partition_error(tp, st, exc)
            return
        finally:
            self._fetching[leader].discard(slot)
            for tp in tps:
                st = self._states.get(tp)
                if st is not None:
                    st.busy = False
            self._wake.set()
        for t in response.topics:
            for r in t.partitions:
                tp = TopicPartition(t.name, r.partition)
                st = self._states.get(tp)
                if st is not None and tp in asked and (st.generation, st.position) == asked[tp]:
                    self._fetched(tp, st, r)
        self._notify()

    def _fetched(self, tp: TopicPartition, st: _PartitionState, r: FetchPartitionResult) -> None:
        if r.error_code == 0:
            st.high_watermark = r.high_watermark
            st.last_stable_offset = r.last_stable_offset
            st.log_start_offset = r.log_start_offset
            st.attempts = 0
            if r.records is not None and len(r.records):
                data = memoryview(r.records)
                selections = (
                    {s.base_offset: s.bitmap for s in r.selections} if r.selections else None
                )
                aborted = (
                    aborted_ranges(
                        (a.producer_id, a.first_offset, a.last_offset)
                        for a in r.aborted_transactions
                    )
                    if r.aborted_transactions
                    else None
                )
                st.buffered = _Buffered(data, r.next_offset, selections, aborted)
                self._buffered_bytes += len(data)
            elif st.position is not None and r.next_offset > st.position:
                st.position = r.next_offset  # a filtered fetch that matched nothing: skipped
            return
        if r.error_code == _OUT_OF_RANGE:
            policy = self.config.auto_offset_reset
            if policy == "none":
                st.error = OffsetOutOfRangeError(
                    st.position if st.position is not None else -1,
                    r.log_start_offset,
                    r.high_watermark,
                )
            else:
                st.reset = _RESETS[policy]
            return
        self._partition_error(tp, st, from_wire(r.error_code, f"{tp}: error {r.error_code}"))

    def _partition_error(self, tp: TopicPartition, st: _PartitionState, exc: StrataError) -> None:
        if exc.retriable:
            if isinstance(exc, STALE_METADATA_ERRORS) and self._cluster is not None:
                self._cluster.request_update()
            self._backoff_partition(st)
        else:
            st.error = exc

    # ---- handing records out --------------------------------------------------------------
    async def getmany(
        self,
        *partitions: TopicPartition | tuple[str, int],
        timeout_ms: int = 0,
        max_records: int | None = None,
    ) -> dict[TopicPartition, list[ConsumerRecord]]:
        """Records ready now (waiting up to ``timeout_ms`` for some), per partition, in offset
        order; at most ``max_records`` (default ``max.poll.records``) in all."""
        got = await self._poll(partitions, timeout_ms, max_records)
        return {tp: to_records(tp, batches) for tp, batches in got.items()}

    async def getmany_arrow(
        self,
        *partitions: TopicPartition | tuple[str, int],
        timeout_ms: int = 0,
        max_records: int | None = None,
    ) -> dict[TopicPartition, pa.Table]:
        """Like ``getmany`` but each partition's records as one Arrow table (``codec.SCHEMA``),
        pointing into the fetched bytes (no per-record Python work)."""
        got = await self._poll(partitions, timeout_ms, max_records)
        return {tp: pa.Table.from_batches(batches, schema=SCHEMA) for tp, batches in got.items()}

    async def getone(self, *partitions: TopicPartition | tuple[str, int]) -> ConsumerRecord:
        """The next record (of ``partitions``, default all), waiting as long as it takes.
        With ``retry.ordering=key``, records that must wait behind their key are parked."""
        wanted = {_as_tp(tp) for tp in partitions}
        if self._key_order is not None:
            return await self._next_in_key_order(wanted)
        return await self._next_pending(wanted)

    async def _next_pending(self, wanted: set[TopicPartition]) -> ConsumerRecord:
        while True:
            if self._pending and not wanted:
                return self._pending.popleft()
            if wanted:
                for i, r in enumerate(self._pending):
                    if (r.topic, r.partition) in wanted:
                        del self._pending[i]
                        return r
            got = await self.getmany(*wanted, timeout_ms=1000)
            for records in got.values():
                self._pending.extend(records)

    def __aiter__(self) -> AsyncIterator[ConsumerRecord]:
        return self

    async def __anext__(self) -> ConsumerRecord:
        if self._closed:
            raise StopAsyncIteration
        try:
            return await self.getone()
        except IllegalStateError:
            if self._closed:
                raise StopAsyncIteration from None
            raise

    async def _poll(
        self,
        partitions: tuple[TopicPartition | tuple[str, int], ...],
        timeout_ms: int,
        max_records: int | None,
    ) -> dict[TopicPartition, list[pa.RecordBatch]]:
        self._check_running()
        if self._group is not None:
            self._group.polled()
            if self._group.refused is not None:
                raise self._group.refused
        limit = self.config.max_poll_records if max_records is None else max_records
        if limit < 1:
            raise ValueError(f"max_records must be at least 1, got {limit}")
        wanted = [_as_tp(tp) for tp in partitions]
        for tp in wanted:
            self._state(tp)
        crashes = self._crashes if self._crashes is not None and self._crashes.enabled else None
        deadline = self._clock() + max(timeout_ms, 0) / 1000
        while True:
            if crashes is not None:  # (an assignment may have come while this poll waited)
                await crashes.learn(self._states.keys())
            got = self._take(wanted or list(self._states), limit)
            if got and crashes is not None:
                got = await self._in_flight(crashes, got)
                if not got:
                    continue  # every record taken had crashed consumers: sent to retry
            if got:
                return got
            remaining = deadline - self._clock()
            if remaining <= 0:
                if crashes is not None:  # what it had is done (but in paused partitions)
                    await crashes.note({}, self._state_position, self._held)
                return {}
            await self._wait_changed(remaining)
            self._check_running()
            if self._group is not None and self._group.refused is not None:
                raise self._group.refused

    async def _in_flight(
        self, crashes: CrashWatch, got: dict[TopicPartition, list[pa.RecordBatch]]
    ) -> dict[TopicPartition, list[pa.RecordBatch]]:
        """Before handing ``got`` out: a record that crashed consumers goes to retry instead
        (its crashes counted as attempts), and the coordinator hears what is in flight."""
        ranges: dict[TopicPartition, tuple[int, int]] = {}
        for tp, batches in list(got.items()):
            first = batches[0].column(0)[0].as_py()
            n = crashes.crashes_of(tp, first, sum(b.num_rows for b in batches))
            if n:
                record = to_records(tp, batches)[0]
                retrier = await self._ensure_retrier()
                why = f"its consumer died while processing it ({n} time(s): kill -9, OOM, ...)"
                await retrier.submit(record, why, crashes=n)
                del got[tp]
                # committed at once (the failure record stored first): the crashes it
                # caused are counted once, and a crash of this member before its next commit
                # does not hand the record out again with its count started over
                try:
                    await self.commit({tp: first + 1})
                except StrataError as exc:  # a rebalance: the next owner sees it suspect
                    log.warning("commit past %s@%d (sent to retry) failed: %r", tp, first, exc)
                continue
            st = self._states[tp]
            assert st.position is not None
            ranges[tp] = (first, st.position)
        await crashes.note(ranges, self._state_position, self._held)
        return got

    def _state_position(self, tp: TopicPartition) -> int | None:
        st = self._states.get(tp)
        return None if st is None or st.paused or st.error is not None else st.position

    def _held(self, tp: TopicPartition) -> bool:
        st = self._states.get(tp)
        return st is not None and st.paused

    @property
    def crash_suspects(self) -> frozenset[TopicPartition]:
        """Assigned partitions whose next records are handed out one per poll, because a
        member of the group died while they were in flight (``retry.enable``; ``docs/
        retries.md``, "Poison messages and crashes"). An application that processes records
        concurrently, as the event-source runner does, finishes what it has in flight before
        polling while this is not empty, so that a crash there names one record."""
        crashes = self._crashes
        if crashes is None or not crashes.enabled:
            return frozenset()
        return frozenset(tp for tp in crashes.suspects if tp in self._states)

    def _take(
        self, tps: list[TopicPartition], limit: int
    ) -> dict[TopicPartition, list[pa.RecordBatch]]:
        out: dict[TopicPartition, list[pa.RecordBatch]] = {}
        taken = 0
        failed: tuple[TopicPartition, _PartitionState] | None = None
        crashes = self._crashes if self._crashes is not None and self._crashes.suspects else None
        if tps:
            start = self._rotation % len(tps)
            self._rotation += 1
            tps = tps[start:] + tps[:start]
        if crashes is not None:
            for tp in list(crashes.suspects):
                st = self._states.get(tp)
                if st is not None:
                    crashes.caught_up(tp, self._state_position(tp), st.high_watermark)
            careful = [tp for tp in tps if crashes.careful(tp, self._state_position(tp))]
            ready = [tp for tp in careful if self._states[tp].buffered is not None]
            if ready:  # one record in all, so that a crash names it (sdk.crashes)
                tps, limit = ready[:1], 1
            elif careful:  # none to hand out there yet: the other partitions go on
                tps = [tp for tp in tps if tp not in careful]
        for tp in tps:
            st = self._states.get(tp)
            if st is None or st.paused:
                continue
            if st.error is not None:
                failed = failed or (tp, st)
                continue
            cap = None if crashes is None else crashes.cap(tp, st.position)
            room = limit - taken if cap is None else min(limit - taken, cap)
            while st.buffered is not None and room > 0:
                try:
                    part = self._next_slice(st, st.buffered, room)
                except StrataError as exc:
                    self._drop(st)
                    st.error = exc
                    failed = failed or (tp, st)
                    break
                if part is None:
                    self._drop(st)
                    self._wake.set()
                    break
                out.setdefault(tp, []).append(part)
                taken += part.num_rows
                room -= part.num_rows
            if taken >= limit:
                break
        if failed is not None and not out:
            tp, st = failed
            err, st.error = st.error, None
            st.generation += 1
            self._wake.set()
            assert err is not None
            raise err
        return out

    def _next_slice(
        self, st: _PartitionState, buf: _Buffered, max_rows: int
    ) -> pa.RecordBatch | None:
        """The next records at or after the position (at most ``max_rows``), or None when
        the buffer holds no more; moves the position past them (and, at the end of a
        filtered fetch's records, to where the agent stopped looking)."""
        assert st.position is not None
        while True:
            if buf.current is None:
                if buf.pos >= len(buf.data):
                    if buf.end > st.position:
                        st.position = buf.end
                    return None
                try:
                    h = read_header(buf.data, buf.pos)
                    if buf.pos + h.size > len(buf.data):
                        raise CorruptBatchError(
                            f"truncated batch: {len(buf.data) - buf.pos} of {h.size} bytes",
                            position=buf.pos,
                        )
                except CorruptBatchError:
                    if buf.seen_whole:
                        return None  # a torn tail after whole batches: fetch it again later
                    raise
                start, buf.pos = buf.pos, buf.pos + h.size
                buf.seen_whole = True
                if h.next_offset <= st.position:
                    continue
                if h.is_control or (buf.aborted is not None and is_aborted(buf.aborted, h)):
                    st.position = h.next_offset  # a marker, or an aborted transaction's batch
                    continue
                buf.current_offsets = None
                run = (
                    decode_run(buf.data, start, verify=self.config.check_crcs)
                    if h.record_count <= RUN_BATCH_RECORDS
                    and buf.selections is None
                    and buf.aborted is None
                    and h.compression == Compression.NONE
                    else None
                )
                if run is not None:  # this batch and the plain ones after it, in one go
                    rb, buf.pos, buf.current_next = run
                    if buf.current_next - h.base_offset != rb.num_rows:
                        buf.current_offsets = np.asarray(rb.column(0))
                else:
                    rb = decode_batch(buf.data, start, verify=self.config.check_crcs)
                    bitmap = None if buf.selections is None else buf.selections.get(h.base_offset)
                    if bitmap is not None:
                        rb = rb.filter(pa.array(selection_mask(bitmap, h.record_count)))
                        buf.current_offsets = np.asarray(rb.column(0))
                    buf.current_next = h.next_offset
                buf.current = rb
                buf.current_base = h.base_offset
            rb = buf.current
            offsets = buf.current_offsets
            if offsets is None:  # every record of the batch: offsets are base + row
                skip = max(st.position - buf.current_base, 0)
            else:
                skip = int(np.searchsorted(offsets, st.position))
            if skip >= rb.num_rows:
                buf.current = None
                st.position = max(st.position, buf.current_next)
                continue
            take = min(rb.num_rows - skip, max_rows)
            if skip + take >= rb.num_rows:
                buf.current = None
                st.position = buf.current_next
            elif offsets is None:
                st.position = buf.current_base + skip + take
            else:
                st.position = int(offsets[skip + take - 1]) + 1
            return rb.slice(skip, take)


def _subscription_filter(tags: str | None, filter_: str | Filter | None) -> Filter | None:
    if tags is not None and filter_ is not None:
        raise InvalidFilterError("subscribe takes tags or filter, not both", position=0)
    return parse_tags(tags) if tags is not None else as_filter(filter_)


def log_commit_failure(error: BaseException) -> None:
    log.warning("async commit failed: %s", error)


def _list_offsets_request(
    query: Mapping[TopicPartition, int], isolation: int = READ_UNCOMMITTED
) -> ListOffsetsRequest:
    topics: dict[str, list[ListOffsetsPartition]] = defaultdict(list)
    for tp, ts in query.items():
        topics[tp.topic].append(ListOffsetsPartition(tp.partition, ts))
    return ListOffsetsRequest(
        topics=[ListOffsetsTopic(name, parts) for name, parts in topics.items()],
        isolation_level=isolation,
    )
