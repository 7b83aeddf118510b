"""The producer's record accumulator: per-partition batches under one byte budget.

Theory of operation
-------------------
``send`` never talks to the network. It reserves the record's estimated encoded size from the
:class:`BufferPool` (``buffer.memory`` bytes shared by every batch of the producer), then
appends the record to the open batch at the tail of its partition's queue — appending means
adding the value and timestamp to two Python lists (key, headers and tags to three more, once
a record of the batch has one) and one future to another; no encoding happens per record.
``send_batch`` appends runs of records (``append_runs``): each partition's run is a list
slice added to its batch, the call's bytes are reserved at once, and one
:class:`RunsFuture` reports on the whole call. A batch is *closed* when the next record would
take it past ``batch.size`` (a record larger than that gets a batch of its own), and a partition is
*ready* to send when its head batch is closed, is older than ``linger.ms``, or a flush or
close is under way.

The sender (``sdk.producer``) asks :meth:`RecordAccumulator.ready` which partitions are ready
and :meth:`~RecordAccumulator.drain`\\ s their head batches, grouped by leader agent. Draining
encodes a batch — once, with ``storage.codec.encode_batch`` over the collected lists — and drops
the lists. A batch that fails with a retriable error goes back to the *head* of its queue
(:meth:`~RecordAccumulator.reenqueue`) with a retry time, and is resent as the very bytes encoded
the first time. Order within a partition holds in one of two ways:

* without idempotence, a partition is *muted* while one request with its batches is in
  flight: nothing else of it is sent until that request is answered;
* with idempotence (``sdk.idempotence``) each batch carries sequence numbers, given when it
  is first drained; up to five batches of a partition may be in flight, because the leader
  refuses a batch whose predecessor is missing. Retried batches go back in sequence order and
  are resent one at a time until they are through.

Completion (:meth:`~RecordAccumulator.complete` / :meth:`~RecordAccumulator.fail`) resolves each
record's future (offset = the batch's base offset + the record's index) and only then gives the
batch's bytes back to the pool. The pool therefore bounds everything the producer holds —
open, closed, in-flight and retrying batches. When it is full, ``send`` waits (FIFO, so a big
record is not starved) up to ``max.block.ms`` and then raises :class:`BufferExhaustedError`:
backpressure, never unbounded memory. Batches not acknowledged within ``delivery.timeout.ms``
of their creation fail with :class:`DeliveryTimeoutError`.

A transactional producer (``sdk.transactions``) adds two rules: a partition is not ready
until the transaction coordinator has it in the open transaction (``admit``), and a gap in
a partition's sequences (``_needs_reset``) holds the partition until the transaction is
aborted and every partition restarts under the epoch the abort gave
(``restart_sequences``); every batch that fails for good is reported (``on_failure``),
since the transaction can no longer commit.

Everything here is synchronous except waiting for memory; time comes from an injected clock,
so linger, backoff and expiry are tested without sleeping.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from itertools import accumulate, repeat
from typing import Any

import numpy as np

from sdk.errors import BufferExhaustedError, DeliveryTimeoutError, ProducerClosedError
from sdk.idempotence import Sequencer
from sdk.records import RecordMetadata, StoredRuns, TopicPartition
from sdk.staging import STAGE_MAX_RECORD_SHARE, Stage, StageCut, StagedCall
from storage.codec import HEADER_SIZE, Compression, encode_batch, with_producer
from storage.codec.header import DEDUP_WINDOW, SEQUENCE_MASK
from storage.errors import BatchTooLargeError, OutOfOrderSequenceError, StrataError

#: per record: timestamp (8), key, value, header-list and tag-list offsets (4 x 4: a list
#: column present for one record has offsets for all), validity bits (rounded up to 1)
RECORD_OVERHEAD = 25
#: per batch: header, body directory, worst-case padding of 15 buffers, the n+1-th offsets,
#: the summary's fixed part and padding (its entries are counted per record, below)
BATCH_OVERHEAD = HEADER_SIZE + 64 + 15 * 7 + 5 * 4 + 8 + 7

#: clock readings this close count as equal (float sums of ms in seconds do not add up exactly)
_EPSILON = 1e-6

Headers = Sequence[tuple[str, bytes]]
Encoder = Callable[..., bytes]


def estimate_size(
    value: bytes | None,
    key: bytes | None,
    headers: Headers | None,
    tags: Sequence[str] | None,
) -> int:
    """An upper bound of the bytes a record adds to an uncompressed batch: its columns, and
    the summary entries it could add if each of its tags and headers were new to the batch
    (``storage.codec.summary``: 6 + n bytes a tag or a value, 8 + n a header key)."""
    size = RECORD_OVERHEAD + (len(value) if value else 0) + (len(key) if key else 0)
    if headers:
        size += sum(22 + 2 * (len(k.encode()) + len(v)) for k, v in headers)
    if tags:
        size += sum(10 + 2 * len(t.encode()) for t in tags)
    return size


def _precedes(a: ProducerBatch, b: ProducerBatch) -> bool:
    """Whether sequenced batch ``a`` comes before ``b`` (sequences wrap at 2**31)."""
    return a.sequence >= 0 and 0 < (b.sequence - a.sequence) & SEQUENCE_MASK <= SEQUENCE_MASK // 2


class BufferPool:
    """A byte budget: ``reserve`` before buffering, ``release`` when the bytes are gone.

    Waiters are served first come, first served; a caller that would fit is not allowed to
    overtake one that is already waiting.
    """

    def __init__(self, total: int) -> None:
        self.total = total
        self.used = 0
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()

    @property
    def available(self) -> int:
        return self.total - self.used

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def try_reserve(self, n: int) -> bool:
        if not self._waiters and self.used + n <= self.total:
            self.used += n
            return True
        return False

    async def reserve(self, n: int, max_block: float) -> None:
        """Reserve ``n`` bytes, waiting up to ``max_block`` seconds; else BufferExhaustedError."""
        if n > self.total:
            raise BatchTooLargeError(n, self.total)
        if self.try_reserve(n):
            return
        if max_block <= 0:
            raise self._exhausted(n, max_block)
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (n, fut)
        self._waiters.append(entry)
        try:
            async with asyncio.timeout(max_block):
                await fut
        except BaseException as exc:
            if fut.done() and not fut.cancelled():
                self.release(n)  # granted just as we gave up
            else:
                fut.cancel()
                with contextlib.suppress(ValueError):
                    self._waiters.remove(entry)
                self._grant()
            if isinstance(exc, TimeoutError):
                raise self._exhausted(n, max_block) from None
            raise

    def _exhausted(self, n: int, timeout: float) -> BufferExhaustedError:
        return BufferExhaustedError(
            f"could not reserve {n} bytes of buffer.memory ({self.used} of {self.total} in use) "
            f"within max.block.ms ({timeout * 1000:.0f} ms): the producer is sending slower "
            "than records arrive"
        )

    def release(self, n: int) -> None:
        self.used -= n
        self._grant()

    def _grant(self) -> None:
        while self._waiters:
            n, fut = self._waiters[0]
            if fut.done():
                self._waiters.popleft()
                continue
            if self.used + n > self.total:
                return
            self._waiters.popleft()
            self.used += n
            fut.set_result(None)


_ENCODE_ERRORS = (StrataError, ValueError, TypeError, OverflowError)


class RunsFuture:
    """The delivery report of one ``append_runs`` call: a future of one
    :class:`RecordsMetadata` per chunk of records stored together, in the order they were
    appended. Every chunk takes a *slot* (``ProducerBatch.extend``); the batch holding the
    chunk fills it in when it is acknowledged (``RecordAccumulator.complete``), and the future
    resolves once every slot is filled and the call is done appending (``seal``): no future or
    callback per chunk, however many partitions the call touched. The first failure of any of
    its batches fails it.

    A slot is kept as plain values in three lists (partition, base offset, count), and the
    future resolves to those lists wrapped (:class:`StoredRuns`), whose
    :class:`RecordsMetadata` are made when read: neither a call waiting behind a deep queue
    (many partitions, a full ``buffer.memory``) nor a resolved call an application keeps
    holds objects the cyclic collector must walk, where a tuple per chunk made its full
    passes the cost that grew with the partition count."""

    __slots__ = ("counts", "future", "offsets", "pending", "sealed", "tps")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.future: asyncio.Future[StoredRuns] = loop.create_future()
        self.tps: list[TopicPartition] = []
        #: a slot's base offset once its batch is acknowledged (None until then)
        self.offsets: list[int | None] = []
        self.counts: list[int] = []
        self.pending = 0
        self.sealed = False

    def done(self) -> bool:
        return self.future.done()

    def seal(self) -> asyncio.Future[StoredRuns]:
        """No more chunks: the future resolves when the pending ones are acknowledged."""
        self.sealed = True
        if not self.pending and not self.future.done():
            self.future.set_result(self.results())
        return self.future

    def results(self) -> StoredRuns:
        """One :class:`RecordsMetadata` per slot (every slot filled), made when read."""
        return StoredRuns(self.tps, self.offsets, self.counts)  # type: ignore[arg-type]

    def fail(self, exc: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(exc)


class ProducerBatch:
    """Records of one partition on their way to the leader (see the module docstring)."""

    __slots__ = (
        "attempts",
        "closed",
        "created",
        "cut",
        "cut_index",
        "deadline",
        "done",
        "encoded",
        "futures",
        "groups",
        "headers",
        "in_flight",
        "keys",
        "last_error",
        "producer_epoch",
        "producer_id",
        "reserved",
        "retry_at",
        "sequence",
        "size",
        "tags",
        "timestamps",
        "tp",
        "unsent",
        "values",
    )

    def __init__(self, tp: TopicPartition, created: float, deadline: float) -> None:
        self.tp = tp
        self.created = created
        self.deadline = deadline
        self.values: list[bytes | None] = []
        self.timestamps: list[int] = []
        #: the optional columns: None until a record has one (then None for those before)
        self.keys: list[bytes | None] | None = None
        self.headers: list[Headers | None] | None = None
        self.tags: list[Sequence[str] | None] | None = None
        #: (index, future) per record appended alone; runs have one future in ``groups``
        self.futures: list[tuple[int, asyncio.Future[RecordMetadata]]] = []
        #: per run of records appended by ``extend``, flat (no tuple per run): its report,
        #: its slot there and its first index in the batch, then the next run's three
        self.groups: list[Any] = []
        self.size = BATCH_OVERHEAD
        self.reserved = 0
        self.closed = False
        self.encoded: bytes | None = None
        self.attempts = 0
        self.in_flight = False
        #: idempotent producers: the fields stamped in the header (-1: none, or not yet)
        self.producer_id = self.producer_epoch = self.sequence = -1
        self.retry_at = 0.0
        self.last_error: BaseException | None = None
        #: set when the batch is completed or failed; made only when a flush waits for it
        self.done: asyncio.Future[None] | None = None
        #: a batch a stage's cut made: the cut (which reports on its calls), its index there,
        #: and whether it still counts in the stage's unsent bytes (not yet drained)
        self.cut: StageCut | None = None
        self.cut_index = 0
        self.unsent = False

    @property
    def record_count(self) -> int:
        return len(self.timestamps)

    def append(
        self,
        value: bytes | None,
        key: bytes | None,
        headers: Headers | None,
        tags: Sequence[str] | None,
        timestamp_ms: int,
        size: int,
    ) -> asyncio.Future[RecordMetadata]:
        start = len(self.timestamps)
        self.values.append(value)
        self.timestamps.append(timestamp_ms)
        if key is not None or self.keys is not None:
            self._column("keys", start).append(key)
        if headers or self.headers is not None:
            self._column("headers", start).append(headers)
        if tags or self.tags is not None:
            self._column("tags", start).append(tags)
        self.size += size
        self.reserved += size
        fut: asyncio.Future[RecordMetadata] = asyncio.get_running_loop().create_future()
        self.futures.append((start, fut))
        return fut

    def _column(self, name: str, count: int) -> list[Any]:
        """An optional column, made (None for the ``count`` records before) if it is not."""
        col: list[Any] | None = getattr(self, name)
        if col is None:
            col = [None] * count
            setattr(self, name, col)
        return col

    def extend(
        self,
        values: Sequence[bytes | None],
        keys: Sequence[bytes | None] | None,
        headers: Sequence[Headers | None] | None,
        tags: Sequence[Sequence[str] | None] | None,
        timestamps: Sequence[int],
        size: int,
        report: RunsFuture,
    ) -> None:
        """Append a run of records, reported as one slot of ``report`` (list extends, no
        loop). ``RecordAccumulator.append_runs`` does the same inline for its common case
        (a run that fits an open batch of the same columns): a change to the bookkeeping
        here (size, reserved, the report's slot, ``groups``) goes there too."""
        n = len(values)
        start = len(self.timestamps)
        self.values += values
        self.timestamps += timestamps
        if keys is not None:
            (self.keys if self.keys is not None else self._column("keys", start)).extend(keys)
        elif self.keys is not None:
            self.keys += repeat(None, n)
        if headers is not None:
            self._column("headers", start).extend(headers)
        elif self.headers is not None:
            self.headers += repeat(None, n)
        if tags is not None:
            self._column("tags", start).extend(tags)
        elif self.tags is not None:
            self.tags += repeat(None, n)
        self.size += size
        self.reserved += size
        report.pending += 1
        self.groups += (report, len(report.counts), start)
        report.tps.append(self.tp)
        report.offsets.append(None)
        report.counts.append(n)

    def encode(
        self, encoder: Encoder, compression: Compression, sequencer: Sequencer | None = None
    ) -> bytes:
        """The batch's bytes, encoded on the first call only; the record lists are dropped.
        With a ``sequencer`` the batch takes the partition's next sequence numbers."""
        if self.encoded is None:
            self.closed = True
            pid = epoch = seq = -1
            if sequencer is not None:
                pid, epoch, seq = sequencer.assign(self.tp, self.record_count)
            try:
                self.encoded = encoder(
                    self.values,
                    keys=self.keys,
                    timestamps=self.timestamps,
                    headers=self.headers,
                    tags=self.tags,
                    compression=compression,
                    producer_id=pid,
                    producer_epoch=epoch,
                    base_sequence=seq,
                )
            except BaseException:
                if sequencer is not None:  # never sent: the sequences are free again
                    sequencer.unassign(self.tp, seq)
                raise
            self.producer_id, self.producer_epoch, self.sequence = pid, epoch, seq
            self.values = []
            self.keys = self.headers = self.tags = None
        return self.encoded

    def restamp(self, producer_id: int, epoch: int, sequence: int) -> None:
        """Give an encoded batch new producer fields (a partition's sequences restarted)."""
        assert self.encoded is not None
        self.encoded = with_producer(self.encoded, producer_id, epoch, sequence)
        self.producer_id, self.producer_epoch, self.sequence = producer_id, epoch, sequence


class RecordAccumulator:
    """Per-partition queues of batches under one :class:`BufferPool`."""

    def __init__(
        self,
        *,
        batch_size: int,
        linger_ms: float,
        buffer_memory: int,
        delivery_timeout_ms: float,
        max_request_size: int,
        compression: Compression = Compression.NONE,
        clock: Callable[[], float] = time.monotonic,
        encoder: Encoder = encode_batch,
        on_batch_closed: Callable[[TopicPartition], None] | None = None,
        sequencer: Sequencer | None = None,
        admit: Callable[[TopicPartition], bool] | None = None,
        on_failure: Callable[[ProducerBatch, BaseException], None] | None = None,
    ) -> None:
        self.batch_size = batch_size
        self.linger = linger_ms / 1000
        self.delivery_timeout = delivery_timeout_ms / 1000
        self.max_request_size = max_request_size
        self.compression = compression
        self.pool = BufferPool(buffer_memory)
        self.clock = clock
        self._encoder = encoder
        self._on_batch_closed = on_batch_closed
        #: partitions with batches queued (a queue that empties is dropped, so that the
        #: sender's passes cost what is queued, not every partition ever written to)
        self._queues: dict[TopicPartition, deque[ProducerBatch]] = {}
        #: no queued batch expires before this (``expire`` looks only then)
        self._next_deadline = float("inf")
        #: idempotent producers: sequences (None: batches carry none, one request at a time)
        self.sequencer = sequencer
        #: transactional producers: whether a partition may be sent (it is in the
        #: transaction), and who hears of every batch that fails for good
        self.admit = admit
        self.on_failure = on_failure
        #: batches in flight per partition
        self._in_flight: dict[TopicPartition, int] = {}
        #: partitions that had a batch retried: one batch at a time until the retries are done
        self._recovering: set[TopicPartition] = set()
        #: partitions whose sequences restart once nothing of theirs is in flight
        self._needs_reset: set[TopicPartition] = set()
        self._incomplete: set[ProducerBatch] = set()
        #: staged keyed calls per topic (``sdk.staging``), and the partitions per topic whose
        #: batch was opened here (a staged call closes them first, to keep their order)
        self._stages: dict[str, Stage] = {}
        self._opened: dict[str, set[TopicPartition]] = {}
        self._flushing = 0
        self._closing = False
        #: set whenever the sender may have new work: a new or closed batch, a flush, a retry
        self.wakeup = asyncio.Event()

    # ---- appending ------------------------------------------------------------------------
    def append_nowait(
        self,
        tp: TopicPartition,
        value: bytes | None,
        key: bytes | None,
        headers: Headers | None,
        tags: Sequence[str] | None,
        timestamp_ms: int,
    ) -> asyncio.Future[RecordMetadata] | None:
        """``append`` without waiting: None when buffer space must be waited for."""
        if self._closing:
            raise ProducerClosedError("the producer is closed")
        size = RECORD_OVERHEAD + (len(value) if value else 0) + (len(key) if key else 0)
        if headers or tags:
            size = estimate_size(value, key, headers, tags)
        if size + BATCH_OVERHEAD > self.max_request_size or size + BATCH_OVERHEAD > self.pool.total:
            raise BatchTooLargeError(
                size + BATCH_OVERHEAD, min(self.max_request_size, self.pool.total)
            )
        if not self.pool.try_reserve(size):
            return None
        return self._add(tp, value, key, headers, tags, timestamp_ms, size)

    def _current(self, tp: TopicPartition, size: int) -> ProducerBatch:
        """The open batch of ``tp`` that ``size`` more bytes fit in (a new one if needed)."""
        if self._stages:
            stage = self._stages.get(tp.topic)
            if stage is not None and stage.holds(tp.partition):
                self._cut(stage)  # the staged records of tp go first
        queue = self._queues.get(tp)
        if queue is None:
            queue = self._queues[tp] = deque()
        batch = queue[-1] if queue else None
        if (
            batch is None
            or batch.closed
            or (batch.record_count and batch.size + size > self.batch_size)
        ):
            if batch is not None and not batch.closed:
                self._close(batch)
            now = self.clock()
            batch = ProducerBatch(tp, now, now + self.delivery_timeout)
            queue.append(batch)
            if batch.deadline < self._next_deadline:
                self._next_deadline = batch.deadline
            self._incomplete.add(batch)
            opened = self._opened.get(tp.topic)
            if opened is None:
                opened = self._opened[tp.topic] = set()
            opened.add(tp)
            self.wakeup.set()
        return batch

    def _add(
        self,
        tp: TopicPartition,
        value: bytes | None,
        key: bytes | None,
        headers: Headers | None,
        tags: Sequence[str] | None,
        timestamp_ms: int,
        size: int,
    ) -> asyncio.Future[RecordMetadata]:
        batch = self._current(tp, size)
        fut = batch.append(value, key, headers, tags, timestamp_ms, size)
        if batch.size >= self.batch_size:
            self._close(batch)
        return fut

    async def append_many(
        self,
        tp: TopicPartition,
        values: Sequence[bytes | None],
        keys: Sequence[bytes | None] | None,
        headers: Sequence[Headers | None] | None,
        tags: Sequence[Sequence[str] | None] | None,
        timestamps: Sequence[int],
        sizes: Sequence[int],
        max_block: float = 0.0,
    ) -> asyncio.Future[StoredRuns]:
        """Append a run of records to ``tp`` (``append_runs`` with one run)."""
        return await self.append_runs(
            [tp], [0, len(values)], values, keys, headers, tags, timestamps, sizes, max_block
        )

    async def append_runs(
        self,
        tps: Sequence[TopicPartition],
        bounds: Sequence[int],
        values: Sequence[bytes | None],
        keys: Sequence[bytes | None] | None,
        headers: Sequence[Headers | None] | None,
        tags: Sequence[Sequence[str] | None] | None,
        timestamps: Sequence[int],
        sizes: Sequence[int],
        max_block: float = 0.0,
    ) -> asyncio.Future[StoredRuns]:
        """Append runs of records: records ``bounds[r]:bounds[r + 1]`` of the columns go to
        ``tps[r]``, filling batches up to ``batch.size``. ``sizes`` are the records' size
        estimates (``estimate_size``). Returns one future of a :class:`StoredRuns`: a
        :class:`RecordsMetadata` per batch-sized chunk, in order (see :class:`RunsFuture`).

        The work is per chunk (a list slice into a batch), not per record, and there is no
        future per chunk. The call's bytes are reserved at once (waiting up to ``max_block``
        seconds), unless they are more than ``buffer.memory``: then each chunk waits for its
        own bytes in turn."""
        if self._closing:
            raise ProducerClosedError("the producer is closed")
        cum = list(accumulate(sizes))
        limit = min(self.max_request_size, self.pool.total)
        if cum and max(sizes) + BATCH_OVERHEAD > limit:
            raise BatchTooLargeError(max(sizes) + BATCH_OVERHEAD, limit)
        report = RunsFuture(asyncio.get_running_loop())
        # the whole call's bytes at once when the buffer can ever hold them: one wait, and
        # either every record is appended or (BufferExhaustedError) none is
        reserved = bool(cum) and cum[-1] <= self.pool.total
        if reserved and not self.pool.try_reserve(cum[-1]):
            await self.pool.reserve(cum[-1], max_block)
            if self._closing:
                self.pool.release(cum[-1])
                raise ProducerClosedError("the producer was closed while send_batch() waited")
        batch_size = self.batch_size
        queues = self._queues
        # the common case inline (no headers or tags, bytes reserved, the run fits the open
        # batch, whose columns match): no call or slice beyond the columns' own, as a keyed
        # call over many partitions is mostly runs of one or two records. It is
        # ProducerBatch.extend's bookkeeping, kept in step with it (tests: *every_shape*)
        plain = reserved and headers is None and tags is None
        keyed = keys is not None
        offsets, counts, slot_tps = report.offsets, report.counts, report.tps
        for r, tp in enumerate(tps):
            i, end = bounds[r], bounds[r + 1]
            if plain:
                queue = queues.get(tp)
                if queue:
                    head = queue[-1]
                    chunk = cum[end - 1] - (cum[i - 1] if i else 0)
                    if (
                        not head.closed
                        and head.size + chunk <= batch_size
                        and head.headers is None
                        and head.tags is None
                        and (head.keys is not None) is keyed
                    ):
                        start = len(head.timestamps)
                        if end - i == 1:
                            head.values.append(values[i])
                            head.timestamps.append(timestamps[i])
                            if keyed:
                                head.keys.append(keys[i])  # type: ignore[index,union-attr]
                        else:
                            head.values += values[i:end]
                            head.timestamps += timestamps[i:end]
                            if keyed:
                                head.keys += keys[i:end]  # type: ignore[index,operator]
                        head.size += chunk
                        head.reserved += chunk
                        report.pending += 1
                        head.groups += (report, len(counts), start)
                        slot_tps.append(tp)
                        offsets.append(None)
                        counts.append(end - i)
                        if head.size >= batch_size:
                            self._close(head)
                        continue
            while i < end:
                base = cum[i - 1] if i else 0
                queue = queues.get(tp)
                batch = queue[-1] if queue else None
                if (
                    batch is not None
                    and not batch.closed
                    and batch.size + cum[end - 1] - base <= batch_size
                ):
                    j = end  # the common case: the rest of the run fits in the open batch
                else:
                    batch = self._current(tp, sizes[i])
                    j = bisect.bisect_right(cum, base + max(batch_size - batch.size, 0), i, end)
                    # an empty batch (_current made room) takes one record whatever its size
                    j = max(j, i + 1)
                chunk = cum[j - 1] - base
                if not reserved and not self.pool.try_reserve(chunk):
                    await self.pool.reserve(chunk, max_block)
                    if self._closing:
                        self.pool.release(chunk)
                        raise ProducerClosedError(
                            "the producer was closed while send_batch() waited"
                        )
                    batch = self._current(tp, chunk)
                batch.extend(
                    values[i:j],
                    None if keys is None else keys[i:j],
                    None if headers is None else headers[i:j],
                    None if tags is None else tags[i:j],
                    timestamps[i:j],
                    chunk,
                    report,
                )
                if batch.size >= batch_size:
                    self._close(batch)
                i = j
        return report.seal()

    def stageable(self, total: int, largest: int) -> bool:
        """Whether a keyed call of ``total`` bytes, none over ``largest``, may be staged: its
        bytes can be reserved at once and each record is a small share of a batch."""
        room = self.batch_size - BATCH_OVERHEAD
        return total <= self.pool.total and largest * STAGE_MAX_RECORD_SHARE <= room

    async def stage_runs(
        self,
        tps: Sequence[TopicPartition],
        parts: np.ndarray,
        values: list[bytes | None],
        keys: list[bytes | None],
        timestamps: np.ndarray,
        sizes: np.ndarray,
        max_block: float = 0.0,
    ) -> asyncio.Future[StoredRuns]:
        """Stage a keyed call (``sdk.staging``): record ``i`` goes to ``tps[parts[i]]``, the
        records in partition order (``parts`` ascending). Same report as ``append_runs`` (one
        :class:`RecordsMetadata` per run stored together, in order); ``stageable`` says which
        calls may come here. The call's bytes are reserved at once, waiting up to
        ``max_block`` seconds."""
        if self._closing:
            raise ProducerClosedError("the producer is closed")
        total = int(sizes.sum())
        if not self.pool.try_reserve(total):
            await self.pool.reserve(total, max_block)
            if self._closing:
                self.pool.release(total)
                raise ProducerClosedError("the producer was closed while send_batch() waited")
        topic = tps[0].topic
        stage = self._stages.get(topic)
        if stage is not None and len(stage.tps) != len(tps):
            self._cut(stage)  # the topic grew: its staged records go first, then a new stage
            stage = None
        if stage is None:
            stage = self._stages[topic] = Stage(tps)
        opened = self._opened.pop(topic, None)
        if opened:  # batches opened the other way go first
            for tp in opened:
                queue = self._queues.get(tp)
                if queue and not queue[-1].closed:
                    self._close(queue[-1])
        future: asyncio.Future[StoredRuns] = asyncio.get_running_loop().create_future()
        call = StagedCall(future, parts, values, keys, timestamps, sizes, self.clock())
        if stage.add(call, self.batch_size - BATCH_OVERHEAD):
            self.wakeup.set()
        return future

    def _cut(self, stage: Stage) -> None:
        """Every record ``stage`` holds into closed batches at the tails of their queues."""
        if not stage.calls:
            return
        cut = stage.cut(self.batch_size - BATCH_OVERHEAD)
        tps, queues, incomplete = stage.tps, self._queues, self._incomplete
        values, keys, timestamps, starts = cut.values, cut.keys, cut.timestamps, cut.starts
        timeout = self.delivery_timeout
        nearest = self._next_deadline
        for k, (p, reserved, created) in enumerate(
            zip(cut.parts, cut.reserved, cut.created, strict=True)
        ):
            tp = tps[p]
            batch = ProducerBatch(tp, created, created + timeout)
            i, j = starts[k], starts[k + 1]
            batch.values = values[i:j]
            batch.keys = keys[i:j]
            batch.timestamps = timestamps[i:j]  # type: ignore[assignment]
            batch.size = BATCH_OVERHEAD + reserved
            batch.reserved = reserved
            batch.closed = True
            batch.cut, batch.cut_index, batch.unsent = cut, k, True
            queue = queues.get(tp)
            if queue is None:
                queue = queues[tp] = deque()
            queue.append(batch)
            incomplete.add(batch)
            if batch.deadline < nearest:
                nearest = batch.deadline
            stage.unsent += reserved
        self._next_deadline = nearest
        cut.release_columns()
        self.wakeup.set()

    def _cut_all(self) -> None:
        for stage in self._stages.values():
            self._cut(stage)

    def _dequeued(self, batch: ProducerBatch) -> None:
        """A cut's batch left its queue for the first time (drained, expired or aborted)."""
        if batch.unsent and batch.cut is not None:
            batch.unsent = False
            stage = batch.cut.stage
            held = stage.held
            stage.unsent -= batch.reserved
            if held and stage.calls and not stage.held:
                self.wakeup.set()  # the stage may be due now

    async def append(
        self,
        tp: TopicPartition,
        value: bytes | None,
        key: bytes | None = None,
        headers: Headers | None = None,
        tags: Sequence[str] | None = None,
        timestamp_ms: int = 0,
        max_block: float = 0.0,
    ) -> asyncio.Future[RecordMetadata]:
        """Add one record; waits up to ``max_block`` seconds for buffer space."""
        if self._closing:
            raise ProducerClosedError("the producer is closed")
        size = estimate_size(value, key, headers, tags)
        limit = min(self.max_request_size, self.pool.total)
        if size + BATCH_OVERHEAD > limit:
            raise BatchTooLargeError(size + BATCH_OVERHEAD, limit)
        if not self.pool.try_reserve(size):
            await self.pool.reserve(size, max_block)
            if self._closing:
                self.pool.release(size)
                raise ProducerClosedError("the producer was closed while send() waited")
        return self._add(tp, value, key, headers, tags, timestamp_ms, size)

    def _close(self, batch: ProducerBatch) -> None:
        if not batch.closed:
            batch.closed = True
            self.wakeup.set()
            if self._on_batch_closed is not None:
                self._on_batch_closed(batch.tp)

    # ---- the sender's side ---------------------------------------------------------------
    def ready(self, now: float) -> tuple[list[TopicPartition], float | None]:
        """Partitions whose head batch may be sent now, and seconds until the next one may."""
        ready: list[TopicPartition] = []
        wait: float | None = None
        hurry = self._flushing > 0 or self._closing
        cutoff = now + _EPSILON
        if self._stages:
            for topic, stage in list(self._stages.items()):
                if not stage.calls:
                    if not stage.unsent:
                        del self._stages[topic]
                    continue
                due, delay = stage.due(now, self.linger, hurry)
                if due:
                    self._cut(stage)
                elif delay is not None:
                    wait = delay if wait is None else min(wait, delay)
        admit = self.admit
        for tp, queue in self._queues.items():
            if not queue or not self._can_send(tp) or (admit is not None and not admit(tp)):
                continue
            head = queue[0]
            if head.retry_at > cutoff:
                delay = head.retry_at - now
            elif hurry or head.closed or len(queue) > 1 or head.created + self.linger <= cutoff:
                ready.append(tp)
                continue
            else:
                delay = head.created + self.linger - now
            wait = delay if wait is None else min(wait, delay)
        return ready, wait

    def _can_send(self, tp: TopicPartition) -> bool:
        n = self._in_flight.get(tp, 0)
        if tp in self._needs_reset and self.admit is not None:
            return False  # transactional: held until the abort restarts the sequences
        if self.sequencer is None or tp in self._needs_reset:
            return n == 0
        return n < (1 if tp in self._recovering else DEDUP_WINDOW)

    def drain(
        self, tps: Iterable[TopicPartition], max_bytes: int | None = None
    ) -> list[ProducerBatch]:
        """Take the head batch of each ready partition in ``tps`` (encoding it if it is new),
        and the closed batches queued behind it, up to ``max_bytes`` in all (at least one
        batch). A partition's batches are taken in order.

        Without a sequencer a partition has at most one request in flight, so a retry cannot
        land behind a later batch. With one (idempotent producer) up to five batches of a
        partition may be in flight: the leader refuses a batch whose predecessor is missing,
        and it comes back to be resent in sequence order. A retried batch travels alone, as
        the leader can answer a duplicate only then, and while a partition's retries last, it
        has one batch in flight."""
        limit = self.max_request_size if max_bytes is None else max_bytes
        taken: list[ProducerBatch] = []
        total = 0
        cutoff = self.clock() + _EPSILON
        sequencer = self.sequencer
        for tp in tps:
            queue = self._queues.get(tp)
            if not queue or not self._can_send(tp) or queue[0].retry_at > cutoff:
                continue
            if self.admit is not None and not self.admit(tp):
                continue
            if tp in self._needs_reset:
                self._reset(tp, queue)
            room = DEDUP_WINDOW - self._in_flight.get(tp, 0) if sequencer else 1 << 30
            first, full = True, False
            while (
                queue
                and room
                and (first or (queue[0].closed and not (sequencer and queue[0].attempts)))
            ):
                batch = queue[0]
                was_closed = batch.closed
                try:
                    data = batch.encode(self._encoder, self.compression, sequencer)
                except _ENCODE_ERRORS as exc:
                    queue.popleft()
                    self._dequeued(batch)
                    self._finish(batch)
                    self._fail_futures(batch, exc)
                    continue
                if not was_closed and self._on_batch_closed is not None:
                    self._on_batch_closed(tp)
                if taken and total + len(data) > limit:
                    full = True
                    break
                queue.popleft()
                if batch.unsent:
                    self._dequeued(batch)
                batch.in_flight = True
                self._in_flight[tp] = self._in_flight.get(tp, 0) + 1
                taken.append(batch)
                total += len(data)
                room -= 1
                first = False
                if batch.attempts and sequencer is not None:
                    break  # a retried batch goes alone
            if not queue:
                del self._queues[tp]
            if full:
                break
        return taken

    def _reset(self, tp: TopicPartition, queue: deque[ProducerBatch]) -> None:
        """Restart ``tp``'s sequences under a new epoch and restamp its sequenced batches."""
        assert self.sequencer is not None
        self.sequencer.new_epoch(tp)
        for batch in queue:
            if batch.sequence >= 0:
                pid, epoch, seq = self.sequencer.assign(tp, batch.record_count)
                batch.restamp(pid, epoch, seq)
        self._needs_reset.discard(tp)
        self._recovering.discard(tp)

    def restart_sequences(self, producer_id: int, epoch: int) -> None:
        """Every partition starts over at sequence 0 under ``producer_id``/``epoch`` (a
        transactional producer after an abort; nothing may be queued or in flight)."""
        assert self.sequencer is not None
        self.sequencer.set_producer(producer_id, epoch)
        self._needs_reset.clear()
        self._recovering.clear()

    def _landed(self, batch: ProducerBatch) -> None:
        """The batch is no longer in flight."""
        if batch.in_flight:
            batch.in_flight = False
            left = self._in_flight[batch.tp] - 1
            if left:
                self._in_flight[batch.tp] = left
            else:
                del self._in_flight[batch.tp]

    def reenqueue(self, batch: ProducerBatch, retry_at: float, error: BaseException) -> None:
        """Put an in-flight batch back at the head of its queue, to be sent at ``retry_at``."""
        batch.attempts += 1
        batch.retry_at = retry_at
        batch.last_error = error
        self._landed(batch)
        queue = self._queues.get(batch.tp)
        if queue is None:
            queue = self._queues[batch.tp] = deque()
        self._next_deadline = min(self._next_deadline, batch.deadline)
        if batch.sequence >= 0:
            if isinstance(error, OutOfOrderSequenceError):
                self._out_of_order(batch)
            # in sequence order among the retried batches at the head
            self._recovering.add(batch.tp)
            i = 0
            while i < len(queue) and _precedes(queue[i], batch):
                i += 1
            queue.insert(i, batch)
        else:
            queue.appendleft(batch)
        self.wakeup.set()

    def _out_of_order(self, batch: ProducerBatch) -> None:
        """The leader refused ``batch`` as out of sequence. If nothing of ours is missing
        before it (it follows the last acknowledged batch), the partition must restart its
        sequences; otherwise its predecessor is being retried and it simply follows. (Failed
        for good instead of retried, the batch leaves a gap either way: ``fail`` resets.)"""
        if self.sequencer is not None and self.sequencer.follows_last_acknowledged(
            batch.tp, batch.producer_epoch, batch.sequence
        ):
            self._needs_reset.add(batch.tp)

    def complete(self, batch: ProducerBatch, base_offset: int) -> None:
        """The leader stored the batch at ``base_offset`` (-1: unknown, with acks=0)."""
        self._landed(batch)
        tp = batch.tp
        if batch.sequence >= 0:
            assert self.sequencer is not None
            self.sequencer.acknowledged(
                tp, batch.producer_epoch, batch.sequence, batch.record_count
            )
            if tp in self._recovering and tp not in self._in_flight:
                queue = self._queues.get(tp)
                if not queue or not queue[0].attempts:
                    self._recovering.discard(tp)  # every retried batch is through
        self._finish(batch)
        topic, partition = batch.tp
        timestamps = batch.timestamps
        for i, fut in batch.futures:
            if not fut.done():
                offset = base_offset + i if base_offset >= 0 else -1
                fut.set_result(RecordMetadata(topic, partition, offset, timestamps[i]))
        groups = batch.groups
        for k in range(0, len(groups), 3):
            # RunsFuture.fill, inline (a call per run adds up over many partitions)
            report = groups[k]
            offsets = report.offsets
            slot = groups[k + 1]
            if offsets[slot] is None:
                offsets[slot] = base_offset + groups[k + 2] if base_offset >= 0 else -1
                report.pending -= 1
                if not report.pending and report.sealed and not report.future.done():
                    report.future.set_result(report.results())
        if batch.cut is not None:
            batch.cut.complete(batch.cut_index, base_offset)

    def fail(self, batch: ProducerBatch, exc: BaseException) -> None:
        self._landed(batch)
        self._lost_sequence(batch)
        self._finish(batch)
        self._fail_futures(batch, exc)
        if self.on_failure is not None:
            self.on_failure(batch, exc)

    def expire(self, now: float) -> list[ProducerBatch]:
        """Fail queued (not in-flight) batches older than delivery.timeout.ms."""
        expired: list[ProducerBatch] = []
        if now < self._next_deadline:
            return expired
        nearest = float("inf")
        for tp, queue in list(self._queues.items()):
            while queue and queue[0].deadline <= now:
                expired.append(queue.popleft())
                self._dequeued(expired[-1])
            if queue:
                nearest = min(nearest, queue[0].deadline)
            else:
                del self._queues[tp]
        self._next_deadline = nearest
        for batch in expired:
            exc = DeliveryTimeoutError(
                f"{batch.record_count} record(s) for {batch.tp.topic}[{batch.tp.partition}] "
                f"expired: {(now - batch.created) * 1000:.0f} ms passed since the batch was "
                f"created (delivery.timeout.ms {self.delivery_timeout * 1000:.0f})"
            )
            exc.__cause__ = batch.last_error
            self._lost_sequence(batch)
            self._finish(batch)
            self._fail_futures(batch, exc)
            if self.on_failure is not None:
                self.on_failure(batch, exc)
        return expired

    def _lost_sequence(self, batch: ProducerBatch) -> None:
        if batch.sequence >= 0:
            self._needs_reset.add(batch.tp)  # its sequences will never arrive: a gap

    def _finish(self, batch: ProducerBatch) -> None:
        if batch in self._incomplete:
            self._incomplete.discard(batch)
            self.pool.release(batch.reserved)
            if batch.done is not None:
                batch.done.set_result(None)
            self.wakeup.set()

    @staticmethod
    def _fail_futures(batch: ProducerBatch, exc: BaseException) -> None:
        for _, fut in batch.futures:
            if not fut.done():
                fut.set_exception(exc)
        for report in batch.groups[::3]:
            report.fail(exc)
        if batch.cut is not None:
            batch.cut.fail(batch.cut_index, exc)

    # ---- flush, close, abort -------------------------------------------------------------
    @property
    def incomplete(self) -> int:
        """Batches created and not yet completed (queued, in flight or waiting to retry), and
        calls staged (not yet cut into batches)."""
        return len(self._incomplete) + sum(len(s.calls) for s in self._stages.values())

    def queued(self) -> int:
        """Batches waiting in queues (not in flight)."""
        return sum(len(q) for q in self._queues.values())

    async def flush(self) -> None:
        """Make every buffered record ready now and wait until all of them are completed."""
        self._flushing += 1
        self._cut_all()
        self.wakeup.set()
        try:
            loop = asyncio.get_running_loop()
            pending = []
            for b in self._incomplete:
                if b.done is None:
                    b.done = loop.create_future()
                pending.append(b.done)
            if pending:
                await asyncio.wait(pending)
        finally:
            self._flushing -= 1

    def begin_close(self) -> None:
        """No more appends; everything buffered is ready at once."""
        self._closing = True
        self.wakeup.set()

    def abort(self, exc: BaseException) -> None:
        """Fail every batch that is not in flight (a forced close, an aborted transaction),
        and every staged call."""
        self._cut_all()
        queues, self._queues = self._queues, {}
        for queue in queues.values():
            while queue:
                batch = queue.popleft()
                self._dequeued(batch)
                self._finish(batch)
                self._fail_futures(batch, exc)

    def abort_incomplete(self, exc: BaseException) -> None:
        """Fail every batch not yet completed, in flight or not (the producer is stopping)."""
        self.abort(exc)
        for batch in list(self._incomplete):
            self._finish(batch)
            self._fail_futures(batch, exc)
        self._in_flight.clear()

    def batches(self, tp: TopicPartition) -> Sequence[ProducerBatch]:
        """The queued batches of a partition, head first (for tests and introspection)."""
        return tuple(self._queues.get(tp, ()))

    def is_muted(self, tp: TopicPartition) -> bool:
        """Whether no batch of ``tp`` may be sent now (for tests and introspection)."""
        return not self._can_send(tp)

    def stats(self) -> dict[str, Any]:
        return {
            "buffer_used": self.pool.used,
            "buffer_total": self.pool.total,
            "incomplete_batches": len(self._incomplete),
            "queued_batches": self.queued(),
            "in_flight_partitions": len(self._in_flight),
            "queued_partitions": len(self._queues),
            "staged_calls": sum(len(s.calls) for s in self._stages.values()),
        }
