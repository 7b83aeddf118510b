"""Blocking wrappers for code that is not async: one event loop on a background thread.

``SyncProducer`` mirrors confluent-kafka's ``Producer``: ``produce`` buffers a record (blocking
up to ``max.block.ms`` while the buffer is full) and returns at once; delivery reports are
queued and their ``on_delivery(err, metadata)`` callbacks run on *your* thread inside
``poll``/``flush``, never on the loop thread. Reports waiting to be polled count against
``queue.buffering.max.messages``: past it ``produce`` raises ``BufferError`` (call ``poll``).

``SyncConsumer`` mirrors confluent-kafka's ``Consumer`` for manual assignment:
``assign``, ``seek``, ``poll(timeout)`` (one record or None), ``consume(n, timeout)``.

Each call crosses to the loop thread and back (tens of microseconds): fine for scripts,
tools and moderate rates; use the async clients for throughput.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from functools import partial
from types import TracebackType
from typing import Any, Protocol, Self, TypeVar

from sdk.config import ConsumerConfig, ProducerConfig
from sdk.consumer import Consumer
from sdk.errors import IllegalStateError, ProducerClosedError
from sdk.producer import Producer, ScheduledFuture
from sdk.records import ConsumerRecord, OffsetAndTimestamp, RecordMetadata, TopicPartition
from storage.errors import StrataError
from storage.filters import Filter, as_filter

T = TypeVar("T")


class _Startable(Protocol):
    async def start(self) -> None: ...


C = TypeVar("C", bound=_Startable)
DeliveryCallback = Callable[[StrataError | None, RecordMetadata | None], Any]


class _LoopThread:
    """An event loop running forever on a daemon thread."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        if threading.current_thread() is self._thread:
            coro.close()
            raise IllegalStateError("a sync client was called from its own loop thread")
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise TimeoutError(f"no result within {timeout} s") from None

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        async def invoke() -> T:
            return fn(*args)

        return self.run(invoke())

    def open(self, make: Callable[[], C]) -> C:
        """``make()`` an async client on this loop and ``await`` its ``start()``; on failure
        the loop thread is stopped before the error is raised."""

        async def start() -> C:
            client = make()
            await client.start()
            return client

        try:
            return self.run(start())
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()


class SyncProducer:
    """A blocking producer in confluent-kafka's style (see the module docstring)."""

    def __init__(self, config: ProducerConfig | Mapping[str, Any], **kwargs: Any) -> None:
        self.config = ProducerConfig.parse(config)
        self._thread = _LoopThread("strata-sync-producer")
        self._reports: queue.SimpleQueue[
            tuple[DeliveryCallback | None, StrataError | None, RecordMetadata | None]
        ] = queue.SimpleQueue()
        self._outstanding = 0
        self._lock = threading.Lock()
        self._closed = False
        self._producer: Producer = self._thread.open(lambda: Producer(self.config, **kwargs))

    def __len__(self) -> int:
        """Records produced whose delivery report has not been polled yet."""
        return self._outstanding

    def produce(
        self,
        topic: str,
        value: bytes | None = None,
        key: bytes | None = None,
        headers: Sequence[tuple[str, bytes]] | Mapping[str, bytes] | None = None,
        tags: Sequence[str] | None = None,
        partition: int | None = None,
        timestamp: int | None = None,
        on_delivery: DeliveryCallback | None = None,
        callback: DeliveryCallback | None = None,
        *,
        delay_ms: int | None = None,
        deliver_at_ms: int | None = None,
        delay_level: int | None = None,
    ) -> str | None:
        """Buffer one record; its report reaches ``on_delivery(err, metadata)`` via ``poll``.

        A delayed record (``delay_ms``, ``deliver_at_ms`` or ``delay_level``: see
        ``Producer.send``) returns its schedule id; any other returns None."""
        if self._closed:
            raise ProducerClosedError("the producer is closed")
        with self._lock:
            if self._outstanding >= self.config.queue_buffering_max_messages:
                raise BufferError(
                    f"{self._outstanding} delivery reports are waiting "
                    "(queue.buffering.max.messages): call poll()"
                )
            self._outstanding += 1
        cb = on_delivery or callback
        delay = (delay_ms, deliver_at_ms, delay_level)
        try:
            return self._thread.run(
                self._send(topic, value, key, headers, tags, partition, timestamp, cb, delay)
            )
        except BaseException:
            with self._lock:
                self._outstanding -= 1
            raise

    async def _send(
        self,
        topic: str,
        value: bytes | None,
        key: bytes | None,
        headers: Any,
        tags: Sequence[str] | None,
        partition: int | None,
        timestamp: int | None,
        cb: DeliveryCallback | None,
        delay: tuple[int | None, int | None, int | None],
    ) -> str | None:
        fut = await self._producer.send(
            topic,
            value,
            key,
            headers,
            tags,
            partition,
            timestamp,
            delay_ms=delay[0],
            deliver_at_ms=delay[1],
            delay_level=delay[2],
        )
        fut.add_done_callback(partial(self._delivered, cb))
        return fut.schedule_id if isinstance(fut, ScheduledFuture) else None

    def _delivered(self, cb: DeliveryCallback | None, fut: asyncio.Future[RecordMetadata]) -> None:
        if fut.cancelled():
            self._reports.put((cb, ProducerClosedError("delivery was cancelled"), None))
            return
        exc = fut.exception()
        if exc is None:
            self._reports.put((cb, None, fut.result()))
        elif isinstance(exc, StrataError):
            self._reports.put((cb, exc, None))
        else:
            err = ProducerClosedError(f"delivery failed: {exc!r}")
            err.__cause__ = exc
            self._reports.put((cb, err, None))

    def poll(self, timeout: float | None = 0) -> int:
        """Run the callbacks of delivery reports that arrived, waiting up to ``timeout``
        seconds (None: forever) for the first. Returns how many ran."""
        handled = 0
        try:
            item = (
                self._reports.get(timeout=timeout) if timeout != 0 else self._reports.get_nowait()
            )
        except queue.Empty:
            return 0
        while True:
            cb, err, md = item
            with self._lock:
                self._outstanding -= 1
            handled += 1
            if cb is not None:
                cb(err, md)
            try:
                item = self._reports.get_nowait()
            except queue.Empty:
                return handled

    def flush(self, timeout: float | None = None) -> int:
        """Send everything buffered and wait (up to ``timeout`` s) for the reports; runs their
        callbacks. Returns the number of records still without a report."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with contextlib.suppress(TimeoutError):
            self._thread.run(self._producer.flush(), timeout)
        while self._outstanding:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                break
            self.poll(0.05 if remaining is None else min(remaining, 0.05))
        return self._outstanding

    def partitions_for(self, topic: str) -> list[int]:
        return self._thread.run(self._producer.partitions_for(topic))

    def close(self, timeout: float | None = None) -> None:
        """Flush (up to ``timeout`` s), stop, and run the remaining delivery callbacks."""
        if self._closed:
            return
        self._closed = True
        try:
            self._thread.run(self._producer.close(flush_timeout=timeout))
        finally:
            self._thread.stop()
            self.poll(0)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class SyncConsumer:
    """A blocking consumer in confluent-kafka's style (manual assignment only)."""

    def __init__(self, config: ConsumerConfig | Mapping[str, Any], **kwargs: Any) -> None:
        self.config = ConsumerConfig.parse(config)
        self._thread = _LoopThread("strata-sync-consumer")
        self._records: deque[ConsumerRecord] = deque()
        self._closed = False
        self._consumer: Consumer = self._thread.open(lambda: Consumer(self.config, **kwargs))

    def subscribe(self, *args: Any, **kwargs: Any) -> None:
        self._consumer.subscribe(*args, **kwargs)

    def assign(
        self,
        partitions: Iterable[TopicPartition | tuple[str, int]],
        *,
        filter: str | Filter | None = None,
    ) -> None:
        tps = list(partitions)
        changed = as_filter(filter) != self._consumer.filter
        self._thread.call(lambda: self._consumer.assign(tps, filter=filter))
        keep = {(tp[0], tp[1]) for tp in tps}
        self._records = deque(
            r for r in self._records if (r.topic, r.partition) in keep and not changed
        )

    def assignment(self) -> set[TopicPartition]:
        return self._thread.call(self._consumer.assignment)

    def _forget(self, tps: Iterable[Any]) -> None:
        """Drop records already fetched for ``tps`` (all partitions when empty)."""
        gone = {(tp[0], tp[1]) for tp in tps}
        if not gone:
            self._records.clear()
            return
        self._records = deque(r for r in self._records if (r.topic, r.partition) not in gone)

    def seek(self, tp: TopicPartition | tuple[str, int], offset: int) -> None:
        self._thread.call(self._consumer.seek, tp, offset)
        self._forget([tp])

    def seek_to_beginning(self, *partitions: TopicPartition | tuple[str, int]) -> None:
        self._thread.call(self._consumer.seek_to_beginning, *partitions)
        self._forget(partitions)

    def seek_to_end(self, *partitions: TopicPartition | tuple[str, int]) -> None:
        self._thread.call(self._consumer.seek_to_end, *partitions)
        self._forget(partitions)

    def position(self, tp: TopicPartition | tuple[str, int]) -> int:
        """The offset of the next record ``poll`` will return for ``tp``."""
        tp = TopicPartition(*tp)
        for r in self._records:
            if (r.topic, r.partition) == tp:
                return r.offset
        return self._thread.run(self._consumer.position(tp))

    def beginning_offsets(
        self, partitions: Iterable[TopicPartition | tuple[str, int]]
    ) -> dict[TopicPartition, int]:
        return self._thread.run(self._consumer.beginning_offsets(list(partitions)))

    def end_offsets(
        self, partitions: Iterable[TopicPartition | tuple[str, int]]
    ) -> dict[TopicPartition, int]:
        return self._thread.run(self._consumer.end_offsets(list(partitions)))

    def offsets_for_times(
        self, timestamps: Mapping[TopicPartition | tuple[str, int], int]
    ) -> dict[TopicPartition, OffsetAndTimestamp | None]:
        return self._thread.run(self._consumer.offsets_for_times(dict(timestamps)))

    def _fill(self, timeout: float | None, want: int) -> None:
        deadline = None if timeout is None else time.monotonic() + max(timeout, 0)
        while len(self._records) < want:
            remaining = None if deadline is None else deadline - time.monotonic()
            wait = 1.0 if remaining is None else max(min(remaining, 1.0), 0)
            got = self._thread.run(
                self._consumer.getmany(
                    timeout_ms=int(wait * 1000),
                    max_records=max(want - len(self._records), 1),
                )
            )
            for records in got.values():
                self._records.extend(records)
            if remaining is not None and remaining <= wait:
                return

    def poll(self, timeout: float | None = None) -> ConsumerRecord | None:
        """One record, waiting up to ``timeout`` seconds (None: until one arrives)."""
        if self._closed:
            raise IllegalStateError("the consumer is closed")
        if not self._records:
            self._fill(timeout, 1)
        return self._records.popleft() if self._records else None

    def consume(self, num_messages: int = 1, timeout: float | None = None) -> list[ConsumerRecord]:
        """Up to ``num_messages`` records, waiting up to ``timeout`` s (None: until that many)."""
        if self._closed:
            raise IllegalStateError("the consumer is closed")
        if num_messages < 1:
            raise ValueError("num_messages must be at least 1")
        if len(self._records) < num_messages:
            self._fill(timeout, num_messages)
        return [self._records.popleft() for _ in range(min(num_messages, len(self._records)))]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._thread.run(self._consumer.close())
        finally:
            self._thread.stop()
            self._records.clear()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
