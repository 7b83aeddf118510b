"""The producer's accumulator: batching by size and linger, the memory bound, encode-once,
order within a partition. Units only: an injected clock, no network."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import pytest

from sdk.accumulator import (
    BATCH_OVERHEAD,
    BufferPool,
    ProducerBatch,
    RecordAccumulator,
    estimate_size,
)
from sdk.errors import BufferExhaustedError, DeliveryTimeoutError, ProducerClosedError
from sdk.idempotence import Sequencer
from sdk.records import RecordMetadata, RecordsMetadata, StoredRuns, TopicPartition
from storage.codec import check_batch, decode_batch, encode_batch
from storage.codec.header import STAMP
from storage.errors import BatchTooLargeError, NotLeaderError, OutOfOrderSequenceError

T = TypeVar("T")
TP = TopicPartition("t", 0)
TP1 = TopicPartition("t", 1)


def run(fn: Callable[[], Awaitable[T]]) -> T:
    return asyncio.run(fn())  # type: ignore[arg-type]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class CountingEncoder:
    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def __call__(self, values: Any, **kw: Any) -> bytes:
        self.calls.append({"values": values, **kw})
        return encode_batch(values, **kw)


def make(clock: Clock, **kw: Any) -> RecordAccumulator:
    args: dict[str, Any] = {
        "batch_size": 1 << 20,
        "linger_ms": 5,
        "buffer_memory": 64 << 20,
        "delivery_timeout_ms": 120_000,
        "max_request_size": 1 << 20,
        "clock": clock,
    }
    args.update(kw)
    return RecordAccumulator(**args)


def test_a_batch_is_ready_after_linger() -> None:
    async def go() -> None:
        clock = Clock()
        acc = make(clock, linger_ms=5)
        await acc.append(TP, b"v")
        clock.now += 0.003
        await acc.append(TP, b"w")
        ready, wait = acc.ready(clock.now)
        assert ready == []
        assert wait == pytest.approx(0.002)
        clock.now += 0.002
        ready, wait = acc.ready(clock.now)
        assert (ready, wait) == ([TP], None)
        (batch,) = acc.drain(ready)
        assert batch.record_count == 2

    run(go)


def test_linger_zero_is_ready_at_once() -> None:
    async def go() -> None:
        clock = Clock()
        acc = make(clock, linger_ms=0)
        await acc.append(TP, b"v")
        assert acc.ready(clock.now) == ([TP], None)

    run(go)


def test_a_batch_closes_at_batch_size_and_is_ready_without_linger() -> None:
    async def go() -> None:
        clock = Clock()
        closed: list[TopicPartition] = []
        record = estimate_size(b"x" * 100, None, None, None)
        acc = make(
            clock,
            batch_size=BATCH_OVERHEAD + 3 * record,
            linger_ms=1000,
            on_batch_closed=closed.append,
        )
        for _ in range(7):
            await acc.append(TP, b"x" * 100)
        batches = acc.batches(TP)
        assert [b.record_count for b in batches] == [3, 3, 1]
        assert [b.closed for b in batches] == [True, True, False]
        assert closed == [TP, TP]
        assert all(b.size <= acc.batch_size for b in batches)
        assert acc.ready(clock.now)[0] == [TP]  # full batches do not wait for linger
        drained = acc.drain([TP])
        # the closed batches go together (one request per partition in flight); the open one
        # waits for its linger
        assert [b.record_count for b in drained] == [3, 3]
        assert [b.record_count for b in acc.batches(TP)] == [1]

    run(go)


def test_a_record_larger_than_batch_size_gets_a_batch_of_its_own() -> None:
    async def go() -> None:
        acc = make(Clock(), batch_size=1000)
        await acc.append(TP, b"a")
        await acc.append(TP, b"b" * 5000)
        await acc.append(TP, b"c")
        assert [b.record_count for b in acc.batches(TP)] == [1, 1, 1]

    run(go)


def test_a_record_larger_than_a_request_is_refused() -> None:
    async def go() -> None:
        acc = make(Clock(), max_request_size=10_000)
        with pytest.raises(BatchTooLargeError) as info:
            await acc.append(TP, b"x" * 10_000)
        assert info.value.limit == 10_000
        assert acc.pool.used == 0

    run(go)


def test_batch_is_encoded_once_from_the_collected_lists() -> None:
    async def go() -> None:
        clock = Clock()
        enc = CountingEncoder()
        acc = make(clock, encoder=enc, linger_ms=0)
        f1 = await acc.append(TP, b"v1", timestamp_ms=111)
        f2 = await acc.append(
            TP, b"v2", key=b"k2", headers=[("h", b"x")], tags=["red"], timestamp_ms=222
        )
        (batch,) = acc.drain([TP])
        assert len(enc.calls) == 1
        call = enc.calls[0]
        assert call["values"] == [b"v1", b"v2"]
        assert call["keys"] == [None, b"k2"]
        assert call["timestamps"] == [111, 222]
        assert call["headers"] == [None, [("h", b"x")]]
        assert call["tags"] == [None, ["red"]]
        first = batch.encoded
        assert batch.values == []  # the lists are let go once encoded

        acc.reenqueue(batch, clock.now, NotLeaderError())
        (again,) = acc.drain([TP])
        assert again is batch and again.encoded is first
        assert len(enc.calls) == 1  # a retry sends the same bytes

        assert first is not None
        rb = decode_batch(first)
        assert rb.column("value").to_pylist() == [b"v1", b"v2"]
        assert rb.column("key").to_pylist() == [None, b"k2"]
        assert rb.column("tags").to_pylist() == [[], ["red"]]
        acc.complete(batch, 40)
        assert await f1 == RecordMetadata("t", 0, 40, 111)
        assert await f2 == RecordMetadata("t", 0, 41, 222)

    run(go)


def test_columns_without_data_are_not_passed() -> None:
    async def go() -> None:
        enc = CountingEncoder()
        acc = make(Clock(), encoder=enc, linger_ms=0)
        for i in range(5):
            await acc.append(TP, b"%d" % i)
        acc.drain([TP])
        call = enc.calls[0]
        assert call["keys"] is None and call["headers"] is None and call["tags"] is None

    run(go)


def test_order_within_a_partition_survives_retries() -> None:
    async def go() -> None:
        clock = Clock()
        two = 2 * estimate_size(b"r00", None, None, None)
        acc = make(clock, batch_size=BATCH_OVERHEAD + two, linger_ms=0)
        futures = [await acc.append(TP, b"r%02d" % i) for i in range(6)]
        assert [b.record_count for b in acc.batches(TP)] == [2, 2, 2]

        third = acc.batches(TP)[2]
        size = len(acc.batches(TP)[0].encode(encode_batch, batch_compression()))
        # a request with room for two batches: the third waits behind them (muted partition)
        first, second = acc.drain([TP], max_bytes=2 * size)
        assert acc.is_muted(TP)
        assert acc.ready(clock.now)[0] == []
        assert acc.drain([TP]) == []

        # both fail; the sender puts them back last first, so they keep their order
        acc.reenqueue(second, clock.now + 0.1, NotLeaderError())
        acc.reenqueue(first, clock.now + 0.1, NotLeaderError())
        assert not acc.is_muted(TP)
        ready, wait = acc.ready(clock.now)
        assert ready == [] and wait == pytest.approx(0.1)  # backing off, still at the head
        clock.now += 0.1
        again = acc.drain(acc.ready(clock.now)[0])
        assert again == [first, second, third]
        assert first.attempts == second.attempts == 1
        for base, batch in zip((0, 2, 4), again, strict=True):
            acc.complete(batch, base)
        offsets = [(await f).offset for f in futures]
        assert offsets == [0, 1, 2, 3, 4, 5]

    run(go)


def test_partitions_are_independent() -> None:
    async def go() -> None:
        clock = Clock()
        acc = make(clock, linger_ms=0)
        await acc.append(TP, b"a")
        await acc.append(TP1, b"b")
        (b0,) = acc.drain([TP])
        assert acc.ready(clock.now)[0] == [TP1]
        drained = acc.drain([TP, TP1])
        assert [b.tp for b in drained] == [TP1]
        acc.complete(b0, 0)

    run(go)


def test_drain_stops_at_the_request_size_but_takes_at_least_one() -> None:
    async def go() -> None:
        acc = make(Clock(), linger_ms=0, max_request_size=4096)
        tps = [TopicPartition("t", p) for p in range(4)]
        for tp in tps:
            await acc.append(tp, b"x" * 1500)
        taken = acc.drain(tps)
        assert len(taken) == 2  # the third would pass 4096 bytes
        assert sum(len(b.encoded or b"") for b in taken) <= 4096
        assert [b.tp for b in acc.drain(tps, max_bytes=1)] == [tps[2]]

    run(go)


def test_full_buffer_fails_at_once_with_no_block_time() -> None:
    async def go() -> None:
        record = estimate_size(b"x" * 1000, None, None, None)
        acc = make(Clock(), buffer_memory=3 * record, max_request_size=1 << 20)
        for _ in range(3):
            await acc.append(TP, b"x" * 1000)
        assert acc.pool.available == 0
        with pytest.raises(BufferExhaustedError, match=r"buffer\.memory"):
            await acc.append(TP, b"x" * 1000, max_block=0)
        assert acc.pool.used == 3 * record

    run(go)


def test_full_buffer_blocks_then_errors_after_max_block() -> None:
    async def go() -> None:
        record = estimate_size(b"x" * 1000, None, None, None)
        acc = make(Clock(), buffer_memory=2 * record)
        await acc.append(TP, b"x" * 1000)
        await acc.append(TP, b"x" * 1000)
        started = time.monotonic()
        with pytest.raises(BufferExhaustedError):
            await acc.append(TP, b"x" * 1000, max_block=0.05)
        assert time.monotonic() - started >= 0.045
        assert acc.pool.used == 2 * record and acc.pool.waiting == 0

    run(go)


def test_a_blocked_send_proceeds_when_a_batch_completes() -> None:
    async def go() -> None:
        record = estimate_size(b"x" * 1000, None, None, None)
        acc = make(Clock(), buffer_memory=2 * record, linger_ms=0)
        await acc.append(TP, b"x" * 1000)
        await acc.append(TP, b"x" * 1000)
        blocked = asyncio.create_task(acc.append(TP1, b"x" * 1000, max_block=5))
        await asyncio.sleep(0)
        assert not blocked.done() and acc.pool.waiting == 1
        (batch,) = acc.drain([TP])
        acc.complete(batch, 0)
        fut = await asyncio.wait_for(blocked, 1)
        assert not fut.done()
        assert acc.pool.used == record

    run(go)


def test_pool_serves_waiters_in_order() -> None:
    async def go() -> None:
        pool = BufferPool(100)
        assert pool.try_reserve(90)
        big = asyncio.create_task(pool.reserve(60, 5))
        await asyncio.sleep(0)
        assert not pool.try_reserve(5)  # it would fit, but the big one waits first
        small = asyncio.create_task(pool.reserve(5, 5))
        await asyncio.sleep(0)
        pool.release(40)  # 50 used: big (60) still does not fit; small must not overtake
        await asyncio.sleep(0)
        assert not big.done() and not small.done()
        pool.release(50)
        await asyncio.wait_for(asyncio.gather(big, small), 1)
        assert pool.used == 65

    run(go)


def test_a_timed_out_waiter_does_not_block_the_next() -> None:
    async def go() -> None:
        pool = BufferPool(100)
        pool.try_reserve(100)
        with pytest.raises(BufferExhaustedError):
            await pool.reserve(80, 0.01)
        waiter = asyncio.create_task(pool.reserve(30, 5))
        await asyncio.sleep(0)
        pool.release(50)
        await asyncio.wait_for(waiter, 1)
        assert pool.used == 80

    run(go)


def test_batches_expire_after_delivery_timeout() -> None:
    async def go() -> None:
        clock = Clock()
        acc = make(clock, delivery_timeout_ms=1000, linger_ms=10_000)
        fut = await acc.append(TP, b"x")
        assert acc.expire(clock.now + 0.999) == []
        clock.now += 1.0
        (expired,) = acc.expire(clock.now)
        assert expired.tp == TP
        with pytest.raises(DeliveryTimeoutError, match=r"1 record.*t\[0\]"):
            await fut
        assert acc.pool.used == 0 and acc.incomplete == 0

    run(go)


def test_flush_makes_everything_ready_and_waits_for_completion() -> None:
    async def go() -> None:
        clock = Clock()
        acc = make(clock, linger_ms=60_000)
        fut = await acc.append(TP, b"x")
        assert acc.ready(clock.now)[0] == []
        flushing = asyncio.create_task(acc.flush())
        await asyncio.sleep(0)
        assert acc.ready(clock.now)[0] == [TP]
        (batch,) = acc.drain([TP])
        assert not flushing.done()
        acc.complete(batch, 7)
        await asyncio.wait_for(flushing, 1)
        assert (await fut).offset == 7
        assert acc.ready(clock.now)[0] == []

    run(go)


def test_failure_fails_every_record_and_frees_memory() -> None:
    async def go() -> None:
        acc = make(Clock(), linger_ms=0)
        futs = [await acc.append(TP, b"x") for _ in range(3)]
        (batch,) = acc.drain([TP])
        acc.fail(batch, NotLeaderError("gone"))
        for f in futs:
            with pytest.raises(NotLeaderError):
                await f
        assert acc.pool.used == 0 and not acc.is_muted(TP)

    run(go)


def test_acks_zero_completion_has_no_offset() -> None:
    async def go() -> None:
        acc = make(Clock(), linger_ms=0)
        fut = await acc.append(TP, b"x", timestamp_ms=5)
        (batch,) = acc.drain([TP])
        acc.complete(batch, -1)
        assert await fut == RecordMetadata("t", 0, -1, 5)

    run(go)


def test_closing_refuses_new_records_and_hurries_old_ones() -> None:
    async def go() -> None:
        clock = Clock()
        acc = make(clock, linger_ms=60_000)
        await acc.append(TP, b"x")
        acc.begin_close()
        assert acc.ready(clock.now)[0] == [TP]
        with pytest.raises(ProducerClosedError):
            await acc.append(TP, b"y")

    run(go)


def test_abort_fails_queued_and_in_flight_batches() -> None:
    async def go() -> None:
        acc = make(Clock(), linger_ms=0)
        in_flight = await acc.append(TP, b"a")
        acc.drain([TP])
        queued = await acc.append(TP1, b"b")
        acc.abort_incomplete(ProducerClosedError("stop"))
        for f in (in_flight, queued):
            with pytest.raises(ProducerClosedError):
                await f
        assert acc.pool.used == 0 and acc.incomplete == 0

    run(go)


def test_an_unencodable_batch_fails_alone() -> None:
    async def go() -> None:
        def broken(values: Any, **kw: Any) -> bytes:
            raise ValueError("boom")

        acc = make(Clock(), linger_ms=0, encoder=broken)
        fut = await acc.append(TP, b"x")
        assert acc.drain([TP]) == []
        with pytest.raises(ValueError, match="boom"):
            await fut
        assert acc.pool.used == 0

    run(go)


def test_stamped_batch_decodes_at_its_base_offset() -> None:
    async def go() -> None:
        acc = make(Clock(), linger_ms=0)
        for i in range(3):
            await acc.append(TP, b"%d" % i)
        (batch,) = acc.drain([TP])
        data = bytearray(batch.encoded or b"")
        STAMP.pack_into(data, 0, 1000, len(data) - 12, 3)  # what a leader does
        assert decode_batch(data).column("offset").to_pylist() == [1000, 1001, 1002]

    run(go)


def test_estimate_is_an_upper_bound_of_the_encoded_size() -> None:
    async def go() -> None:
        batch = ProducerBatch(TP, 0.0, 1.0)
        rows = [
            (
                b"v" * (i % 50),
                None if i % 3 else b"k" * (i % 7),
                [("h", b"x" * (i % 5))] if i % 4 == 0 else None,
                [f"tag-{i}"] if i % 6 == 0 else None,
            )
            for i in range(300)
        ]
        for value, key, headers, tags in rows:
            batch.append(value, key, headers, tags, 0, estimate_size(value, key, headers, tags))
        encoded = batch.encode(encode_batch, batch_compression())
        assert len(encoded) <= batch.size

    run(go)


def batch_compression() -> Any:
    from storage.codec import Compression

    return Compression.NONE


# ---- idempotent producer: sequences, several batches in flight, resets ------------------
def idempotent(clock: Clock, **kw: Any) -> RecordAccumulator:
    """An accumulator with a sequencer and one record per batch."""
    one = estimate_size(b"r00", None, None, None)
    ids = iter([77, 88])
    return make(
        clock,
        batch_size=BATCH_OVERHEAD + one,
        linger_ms=0,
        sequencer=Sequencer(lambda: next(ids)),
        **kw,
    )


def producer_fields(batch: ProducerBatch) -> tuple[int, int, int]:
    assert batch.encoded is not None
    h = check_batch(batch.encoded)  # the CRC still matches after a restamp
    return h.producer_id, h.producer_epoch, h.base_sequence


def test_idempotent_batches_get_sequences_and_five_may_be_in_flight() -> None:
    async def go() -> None:
        clock = Clock()
        acc = idempotent(clock)
        for i in range(7):
            await acc.append(TP, b"r%02d" % i)
        first = acc.drain([TP])
        second = acc.drain([TP])  # a second request while the first is in flight
        assert len(first) + len(second) == 5 and acc.is_muted(TP)
        assert [producer_fields(b) for b in first + second] == [(77, 0, s) for s in range(5)]
        for b in first:
            acc.complete(b, 0)
        assert [producer_fields(b) for b in acc.drain([TP])] == [(77, 0, 5), (77, 0, 6)]

    run(go)


def test_retried_batches_go_back_in_sequence_order_and_one_at_a_time() -> None:
    async def go() -> None:
        clock = Clock()
        acc = idempotent(clock)
        for i in range(4):
            await acc.append(TP, b"r%02d" % i)
        a = acc.drain([TP], max_bytes=1)  # one batch per request: four requests
        b, c, d = (
            acc.drain([TP], max_bytes=1),
            acc.drain([TP], max_bytes=1),
            acc.drain([TP], max_bytes=1),
        )
        # the first failed; the others came back refused as out of order (their answers in order)
        acc.reenqueue(a[0], clock.now, NotLeaderError())
        for later in (b, c):
            acc.reenqueue(later[0], clock.now, OutOfOrderSequenceError())
        assert acc.is_muted(TP)  # d is still in flight: nothing goes before it is back
        acc.reenqueue(d[0], clock.now, OutOfOrderSequenceError())
        assert list(acc.batches(TP)) == [a[0], b[0], c[0], d[0]]
        for expected in (a, b, c, d):  # retries travel alone, one in flight at a time
            sent = acc.drain([TP])
            assert sent == expected and acc.is_muted(TP)
            acc.complete(sent[0], 0)
        assert not acc.is_muted(TP) and [producer_fields(x) for x in a + d] == [
            (77, 0, 0),
            (77, 0, 3),
        ]

    run(go)


def test_a_batch_lost_for_good_restarts_the_partitions_sequences() -> None:
    async def go() -> None:
        clock = Clock()
        acc = idempotent(clock)
        futures = [await acc.append(TP, b"r%02d" % i) for i in range(3)]
        a, b = acc.drain([TP], max_bytes=1), acc.drain([TP], max_bytes=1)
        acc.fail(a[0], BatchTooLargeError(1, 0))  # sequence 0 will never be stored: a gap
        acc.reenqueue(b[0], clock.now, OutOfOrderSequenceError())
        again = acc.drain([TP])
        # epoch 1 from sequence 0; the retried batch is restamped, the new one follows it
        assert again == [b[0]] and producer_fields(b[0]) == (77, 1, 0)
        acc.complete(b[0], 5)
        (c,) = acc.drain([TP])
        assert producer_fields(c) == (77, 1, 1)
        with pytest.raises(BatchTooLargeError):
            await futures[0]

    run(go)


def test_out_of_order_right_after_the_last_acknowledged_batch_restarts_the_sequences() -> None:
    """The leader lost acknowledged records (acks=1 and a failover): only a reset helps."""

    async def go() -> None:
        clock = Clock()
        acc = idempotent(clock)
        for i in range(2):
            await acc.append(TP, b"r%02d" % i)
        (a,) = acc.drain([TP], max_bytes=1)
        acc.complete(a, 0)
        (b,) = acc.drain([TP])
        acc.reenqueue(b, clock.now, OutOfOrderSequenceError())
        assert acc.drain([TP]) == [b] and producer_fields(b) == (77, 1, 0)

    run(go)


def test_sequences_given_to_a_batch_that_cannot_be_encoded_are_not_lost() -> None:
    async def go() -> None:
        def broken_once(values: Any, **kw: Any) -> bytes:
            if values == [b"bad"]:
                raise ValueError("cannot encode")
            return encode_batch(values, **kw)

        clock = Clock()
        acc = idempotent(clock, encoder=broken_once)
        bad = await acc.append(TP, b"bad")
        await acc.append(TP, b"r01")
        (good,) = acc.drain([TP])
        assert producer_fields(good) == (77, 0, 0)
        with pytest.raises(ValueError):
            await bad

    run(go)


# ---- append_runs: many partitions in one call (issue #30) -------------------------------
def _runs_columns(parts: list[int]) -> tuple[list[bytes], list[int]]:
    values = [f"v{i}".encode() for i in range(len(parts))]
    return values, [estimate_size(v, None, None, None) for v in values]


def test_append_runs_reports_one_chunk_per_partition_in_call_order() -> None:
    async def go() -> None:
        clock = Clock()
        acc = make(clock)
        tps = [TopicPartition("t", p) for p in (3, 0, 7)]
        values, sizes = _runs_columns([3, 3, 0, 7, 7, 7])
        report = await acc.append_runs(tps, [0, 2, 3, 6], values, None, None, None, [1] * 6, sizes)
        assert acc.pool.used == sum(sizes)  # reserved at once, for the whole call
        assert not report.done()
        clock.now += 1
        ready, _ = acc.ready(clock.now)
        batches = acc.drain(ready)
        assert sorted(b.tp.partition for b in batches) == [0, 3, 7]
        for b in batches:
            acc.complete(b, {0: 10, 3: 30, 7: 70}[b.tp.partition])
        got = await report
        assert [(m.partition, m.base_offset, m.record_count) for m in got] == [
            (3, 30, 2),
            (0, 10, 1),
            (7, 70, 3),
        ]
        assert acc.pool.used == 0
        assert acc.stats()["queued_partitions"] == 0  # drained queues are dropped

    run(go)


def test_the_runs_of_a_call_read_as_a_list_of_records_metadata() -> None:
    tps = [TopicPartition("t", p) for p in (3, 0, 7)]
    runs = StoredRuns(tps, [30, 10, 70], [2, 1, 3])
    whole = [
        RecordsMetadata("t", 3, 30, 2),
        RecordsMetadata("t", 0, 10, 1),
        RecordsMetadata("t", 7, 70, 3),
    ]
    assert len(runs) == 3
    assert list(runs) == whole and runs == whole and whole == runs
    assert runs[0] == whole[0] and runs[-1] == whole[-1] and runs[1:] == whole[1:]
    assert runs[::-1] == whole[::-1] and list(reversed(runs)) == whole[::-1]
    assert whole[2] in runs and runs.index(whole[1]) == 1
    assert isinstance(runs[0], RecordsMetadata) and runs[0].schedule_ids == ()
    assert runs.record_count == sum(r.record_count for r in runs) == 6
    assert runs != whole[:2] and runs != tuple(whole)  # a list's equality, not a tuple's
    assert repr(runs) == f"StoredRuns({whole!r})"
    with pytest.raises(IndexError):
        runs[3]
    with pytest.raises(TypeError):
        hash(runs)
    with pytest.raises(ValueError, match="one partition, base offset and count"):
        StoredRuns(tps, [30, 10], [2, 1, 3])
    # delayed records: no offsets yet, their schedule ids per run
    delayed = StoredRuns(tps[:2], [-1, -1], [2, 1], [("a", "b"), ("c",)])
    assert delayed == [
        RecordsMetadata("t", 3, -1, 2, ("a", "b")),
        RecordsMetadata("t", 0, -1, 1, ("c",)),
    ]
    assert delayed[1].schedule_ids == ("c",) and delayed.record_count == 3
    with pytest.raises(ValueError, match="one partition, base offset and count"):
        StoredRuns(tps[:2], [-1, -1], [2, 1], [("a", "b")])


def test_append_runs_splits_a_run_over_batches_and_resolves_after_every_one() -> None:
    async def go() -> None:
        clock = Clock()
        size = estimate_size(b"x" * 100, None, None, None)
        acc = make(clock, batch_size=BATCH_OVERHEAD + 2 * size)
        values = [b"x" * 100] * 5
        report = await acc.append_runs([TP], [0, 5], values, None, None, None, [1] * 5, [size] * 5)
        queued = acc.batches(TP)
        assert [b.record_count for b in queued] == [2, 2, 1]
        full = acc.drain([TP])  # the closed batches; the open one waits for linger
        assert [b.record_count for b in full] == [2, 2]
        acc.complete(full[0], 0)
        acc.complete(full[1], 2)
        assert not report.done()  # the last chunk is still queued
        clock.now += 1
        (last,) = acc.drain(acc.ready(clock.now)[0])
        acc.complete(last, 4)
        assert [(m.base_offset, m.record_count) for m in await report] == [(0, 2), (2, 2), (4, 1)]

    run(go)


def test_append_runs_into_open_batches_of_every_shape_keeps_the_columns_aligned() -> None:
    """Runs join open batches that single sends or earlier calls started, with and without
    keys, headers and tags: every record keeps its own key, value and headers, and every
    chunk its own offsets, one or many records a run."""

    async def go() -> None:
        clock = Clock()
        acc = make(clock)
        tps = [TopicPartition("t", p) for p in range(4)]
        sent: dict[int, list[tuple[bytes | None, bytes, list[tuple[str, bytes]]]]] = {
            p: [] for p in range(4)
        }
        # partition 0 starts keyed, 1 unkeyed, 2 with headers, 3 with a tag
        await acc.append(tps[0], b"a0", key=b"k0")
        await acc.append(tps[1], b"a1")
        await acc.append(tps[2], b"a2", key=b"k2", headers=[("h", b"1")])
        await acc.append(tps[3], b"a3", key=b"k3", tags=["t"])
        sent[0].append((b"k0", b"a0", []))
        sent[1].append((None, b"a1", []))
        sent[2].append((b"k2", b"a2", [("h", b"1")]))
        sent[3].append((b"k3", b"a3", []))
        reports = []
        for call, keyed in enumerate((True, False, True)):
            # runs of one record and of three: partitions 0 and 2 one, 1 and 3 three
            parts = [0, 1, 1, 1, 2, 3, 3, 3]
            values = [f"c{call}r{i}".encode() for i in range(len(parts))]
            keys = [f"k{call}{i}".encode() for i in range(len(parts))] if keyed else None
            sizes = [
                estimate_size(v, None if keys is None else keys[i], None, None)
                for i, v in enumerate(values)
            ]
            reports.append(
                await acc.append_runs(
                    tps, [0, 1, 4, 5, 8], values, keys, None, None, [7] * 8, sizes
                )
            )
            for i, p in enumerate(parts):
                sent[p].append((None if keys is None else keys[i], values[i], []))
        clock.now += 1
        batches = acc.drain(acc.ready(clock.now)[0])
        assert sorted(b.tp.partition for b in batches) == [0, 1, 2, 3]
        for b in batches:
            p = b.tp.partition
            records = decode_batch(b.encoded).to_pylist()
            got = [
                (r["key"], r["value"], [(h["key"], h["value"]) for h in r["headers"] or []])
                for r in records
            ]
            assert got == sent[p]
            acc.complete(b, 100 * p)
        for report in reports:
            got = await report
            assert [(m.partition, m.record_count) for m in got] == [(0, 1), (1, 3), (2, 1), (3, 3)]
        # each call's chunk starts where the records before it in the partition ended
        assert [m.base_offset for m in reports[1].result()] == [2, 104, 202, 304]

    run(go)


def test_append_runs_fails_with_the_first_failed_batch() -> None:
    async def go() -> None:
        clock = Clock()
        acc = make(clock, linger_ms=0)
        values, sizes = _runs_columns([0, 1])
        report = await acc.append_runs(
            [TP, TP1], [0, 1, 2], values, None, None, None, [1, 1], sizes
        )
        batches = acc.drain(acc.ready(clock.now)[0])
        acc.complete(batches[0], 0)
        acc.fail(batches[1], NotLeaderError("gone"))
        with pytest.raises(NotLeaderError):
            await report
        assert acc.pool.used == 0

    run(go)


def test_append_runs_waits_for_the_whole_call_then_appends_it_all() -> None:
    async def go() -> None:
        clock = Clock()
        values = [b"v" * 300] * 3
        sizes = [estimate_size(v, None, None, None) for v in values]
        acc = make(clock, buffer_memory=sum(sizes) + 50, linger_ms=0)
        await acc.append(TP, b"x" * 100)  # leaves less room than the call needs
        waiting = asyncio.ensure_future(
            acc.append_runs([TP, TP1], [0, 1, 3], values, None, None, None, [1] * 3, sizes, 5)
        )
        await asyncio.sleep(0)
        assert not waiting.done() and acc.batches(TP1) == ()  # nothing appended yet
        (head,) = acc.drain([TP])
        acc.complete(head, 0)
        report = await waiting
        assert [b.record_count for b in acc.batches(TP)] == [1]
        assert [b.record_count for b in acc.batches(TP1)] == [2]
        for b in acc.drain(acc.ready(clock.now)[0]):
            acc.complete(b, 1)
        assert [m.record_count for m in await report] == [1, 2]

    run(go)


def test_a_call_too_big_for_the_buffer_waits_chunk_by_chunk() -> None:
    async def go() -> None:
        clock = Clock()
        size = estimate_size(b"x" * 100, None, None, None)
        acc = make(
            clock,
            buffer_memory=BATCH_OVERHEAD + size,  # less than the call's 5 records
            batch_size=BATCH_OVERHEAD + size,
            linger_ms=0,
        )
        values = [b"x" * 100] * 5
        assert 5 * size > acc.pool.total
        call = asyncio.ensure_future(
            acc.append_runs([TP], [0, 5], values, None, None, None, [1] * 5, [size] * 5, 5)
        )
        offset, waits = 0, 0
        while not call.done():
            await asyncio.sleep(0)
            waits += 1
            for b in acc.drain(acc.ready(clock.now)[0]):
                acc.complete(b, offset)
                offset += b.record_count
        report = await call
        for b in acc.drain(acc.ready(clock.now)[0]):
            acc.complete(b, offset)
            offset += b.record_count
        assert [m.base_offset for m in await report] == [0, 1, 2, 3, 4]
        assert waits > 1  # it went on as the earlier chunks were acknowledged

    run(go)


def test_expire_looks_again_only_when_a_deadline_is_due() -> None:
    async def go() -> None:
        clock = Clock()
        acc = make(clock, delivery_timeout_ms=1000)
        await acc.append(TP, b"a")
        clock.now += 0.5
        await acc.append(TP1, b"b")
        assert acc.expire(clock.now + 0.49) == []
        (first,) = acc.expire(clock.now + 0.5)
        assert first.tp == TP
        assert acc.expire(clock.now + 0.99) == []
        (second,) = acc.expire(clock.now + 1.0)
        assert second.tp == TP1
        assert acc.stats()["queued_partitions"] == 0

    run(go)
