"""The producer's stage (``sdk.staging``): keyed ``send_batch`` calls over many partitions,
kept as columns and cut into per-partition batches at once. Units with an injected clock;
the encoded batches are decoded to check every record's place."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

from sdk.accumulator import BATCH_OVERHEAD, ProducerBatch, RecordAccumulator, estimate_size
from sdk.errors import DeliveryTimeoutError, ProducerClosedError
from sdk.idempotence import Sequencer
from sdk.records import RecordsMetadata, TopicPartition
from storage.codec import check_batch, decode_batch
from storage.errors import NotLeaderError
from tests.test_sdk_accumulator import Clock, make

N = 100
TPS = [TopicPartition("t", p) for p in range(N)]


class Call:
    """A keyed call as ``Producer.send_batch`` stages it: records sorted by partition."""

    def __init__(self, parts: Sequence[int], tag: str, ts: int = 7) -> None:
        self.parts = list(parts)
        self.values = [f"{tag}{i}".encode() for i in range(len(parts))]
        self.keys = [f"k{tag}{i}".encode() for i in range(len(parts))]
        self.ts = ts
        self.order = np.argsort(np.asarray(self.parts), kind="stable")

    @property
    def sizes(self) -> np.ndarray:
        return np.array(
            [estimate_size(v, k, None, None) for v, k in zip(self.values, self.keys, strict=True)]
        )[self.order]

    async def stage(self, acc: RecordAccumulator) -> asyncio.Future[Any]:
        o = self.order.tolist()
        return await acc.stage_runs(
            TPS,
            np.asarray(self.parts)[self.order],
            [self.values[i] for i in o],
            [self.keys[i] for i in o],
            np.full(len(o), self.ts, dtype=np.int64),
            self.sizes,
        )

    def expected(self, bases: dict[int, int], before: dict[int, int]) -> list[RecordsMetadata]:
        """One run per partition (in partition order), at ``bases[p] + before[p]``."""
        runs = []
        for p in sorted(set(self.parts)):
            runs.append(RecordsMetadata("t", p, bases[p] + before.get(p, 0), self.parts.count(p)))
        return runs


def records(batch: ProducerBatch) -> list[tuple[bytes | None, bytes | None, int]]:
    assert batch.encoded is not None
    rb = decode_batch(batch.encoded)
    ts = rb.column("timestamp").cast("int64").to_pylist()
    return list(zip(rb.column("key").to_pylist(), rb.column("value").to_pylist(), ts, strict=True))


def drain_all(acc: RecordAccumulator, now: float) -> list[ProducerBatch]:
    out: list[ProducerBatch] = []
    while True:
        ready, _ = acc.ready(now)
        got = acc.drain(ready)
        if not got:
            return out
        out += got


def deliver(acc: RecordAccumulator, now: float, base: Any) -> list[ProducerBatch]:
    """Drain and complete (at ``base(batch)``) until nothing is left to send, in drain order."""
    out: list[ProducerBatch] = []
    while got := drain_all(acc, now):
        for batch in got:
            out.append(batch)
            acc.complete(batch, base(batch))
    return out


def spread(n: int, seed: int) -> list[int]:
    """Partitions for n records: every partition at least once, the rest at random."""
    rng = np.random.default_rng(seed)
    return list(range(N)) + rng.integers(0, N, n - N).tolist()


def test_staged_calls_are_cut_at_linger_into_one_batch_per_partition_in_call_order() -> None:
    async def go() -> None:
        clock = Clock()
        acc = make(clock, linger_ms=5)
        a, b = Call(spread(300, 1), "a", ts=11), Call(spread(250, 2), "b", ts=12)
        fa = await a.stage(acc)
        clock.now += 0.002
        fb = await b.stage(acc)
        assert acc.pool.used == int(a.sizes.sum() + b.sizes.sum())  # reserved at once
        assert acc.incomplete == 2 and acc.stats()["staged_calls"] == 2
        ready, wait = acc.ready(clock.now)
        assert ready == [] and wait == pytest.approx(0.003)  # linger from the oldest call
        clock.now += 0.003
        batches = drain_all(acc, clock.now)
        assert sorted(x.tp.partition for x in batches) == list(range(N))
        assert acc.stats()["staged_calls"] == 0
        bases = {p: 1000 * p for p in range(N)}
        for batch in batches:
            p = batch.tp.partition
            want = [
                (c.keys[i], c.values[i], c.ts)
                for c in (a, b)
                for i in range(len(c.parts))
                if c.parts[i] == p
            ]
            assert records(batch) == want  # a's records, then b's, each in input order
            assert batch.created == 1000.0  # the oldest call's time
            acc.complete(batch, bases[p])
        assert await fa == a.expected(bases, {})
        assert await fb == b.expected(bases, {p: a.parts.count(p) for p in range(N)})
        assert (await fa).record_count == 300
        assert acc.pool.used == 0 and acc.incomplete == 0

    asyncio.run(go())


def test_a_partition_over_batch_size_is_split_and_the_stage_is_due_at_once() -> None:
    async def go() -> None:
        clock = Clock()
        one = estimate_size(b"a0", b"ka0", None, None)
        acc = make(clock, batch_size=BATCH_OVERHEAD + 40 * one, linger_ms=60_000)
        parts = list(range(N)) + [5] * 120
        call = Call(parts, "a")
        fut = await call.stage(acc)
        ready, _ = acc.ready(clock.now)  # partition 5 holds three batches' worth: no linger
        assert TopicPartition("t", 5) in ready
        fives: list[ProducerBatch] = []
        bases: list[int] = []

        def base(batch: ProducerBatch) -> int:
            if batch.tp.partition != 5:
                return 0
            # a gap of 10 after each batch: the report must follow each batch's own base
            bases.append(sum(b.record_count + 10 for b in fives))
            fives.append(batch)
            return bases[-1]

        out = deliver(acc, clock.now, base)
        assert len(fives) > 1 and len(out) == N - 1 + len(fives)
        for b in fives:
            assert b.size <= acc.batch_size and b.encoded is not None
            assert len(b.encoded) <= acc.batch_size
        got = [v for b in fives for _, v, _ in records(b)]
        assert got == [call.values[i] for i, p in enumerate(parts) if p == 5]
        runs = [r for r in await fut if r.partition == 5]
        assert [(r.base_offset, r.record_count) for r in runs] == [
            (base, b.record_count) for base, b in zip(bases, fives, strict=True)
        ]

    asyncio.run(go())


def test_order_holds_across_single_sends_and_staged_calls() -> None:
    async def go() -> None:
        clock = Clock()
        acc = make(clock, linger_ms=60_000)
        tp = TopicPartition("t", 3)
        first = await acc.append(tp, b"before", key=b"x", timestamp_ms=1)
        staged = await Call(list(range(N)), "s").stage(acc)
        assert acc.batches(tp)[0].closed  # the open batch closed under the staged records
        after = await acc.append(tp, b"after", key=b"y", timestamp_ms=2)  # cuts the stage
        assert acc.stats()["staged_calls"] == 0
        assert [b.record_count for b in acc.batches(tp)] == [1, 1, 1]
        acc.begin_close()
        mine: list[ProducerBatch] = []
        deliver(acc, clock.now, lambda b: (mine.append(b), len(mine) - 1)[1] if b.tp == tp else 50)
        values = [v for b in mine for _, v, _ in records(b)]
        assert values == [b"before", b"s3", b"after"]
        assert (await first).offset == 0 and (await after).offset == 2
        assert [r for r in await staged if r.partition == 3] == [RecordsMetadata("t", 3, 1, 1)]

    asyncio.run(go())


def test_while_the_last_cut_is_unsent_the_stage_grows_instead_of_cutting_small() -> None:
    async def go() -> None:
        clock = Clock()
        acc = make(clock, linger_ms=5)
        await Call(spread(400, 3), "a").stage(acc)
        clock.now += 0.005
        acc.ready(clock.now)  # cut: 100 batches queued, none drained yet
        await Call(spread(400, 4), "b").stage(acc)
        clock.now += 0.005
        ready, _ = acc.ready(clock.now)
        assert acc.stats()["staged_calls"] == 1  # due by age, but the last cut is mostly unsent
        taken = acc.drain(ready[:50])  # half the last cut is on its way: not enough
        assert len(taken) == 50
        acc.ready(clock.now)
        assert acc.stats()["staged_calls"] == 1
        assert len(acc.drain(ready[50:98])) == 48  # all but two partitions' batches
        acc.ready(clock.now)
        assert acc.stats()["staged_calls"] == 0  # now the stage is cut

    asyncio.run(go())


def test_a_failed_batch_fails_the_calls_it_holds_and_acks_zero_reports_no_offsets() -> None:
    async def go() -> None:
        clock = Clock()
        acc = make(clock, linger_ms=0)
        a = await Call(list(range(N)), "a").stage(acc)
        b = await Call(list(range(50, N)) * 2, "b").stage(acc)
        batches = drain_all(acc, clock.now)
        for batch in batches:
            if batch.tp.partition == 10:
                acc.fail(batch, NotLeaderError("gone"))
            else:
                acc.complete(batch, -1)
        with pytest.raises(NotLeaderError):
            await a
        runs = await b
        assert [(r.partition, r.base_offset, r.record_count) for r in runs] == [
            (p, -1, 2) for p in range(50, N)
        ]
        assert acc.pool.used == 0

    asyncio.run(go())


def test_flush_abort_close_and_expiry_reach_staged_calls() -> None:
    async def go() -> None:
        clock = Clock()
        acc = make(clock, linger_ms=60_000, delivery_timeout_ms=1000)
        fut = await Call(list(range(N)), "a").stage(acc)
        flushing = asyncio.create_task(acc.flush())
        await asyncio.sleep(0)
        batches = drain_all(acc, clock.now)  # the flush cut the stage
        assert len(batches) == N
        for i, batch in enumerate(batches):
            acc.complete(batch, i)
        await asyncio.wait_for(flushing, 1)
        assert fut.done()

        doomed = await Call(list(range(N)), "b").stage(acc)
        acc.abort(ProducerClosedError("aborted"))
        with pytest.raises(ProducerClosedError):
            await doomed
        assert acc.pool.used == 0 and acc.incomplete == 0

        late = await Call(list(range(N)), "c").stage(acc)
        acc.begin_close()
        acc.ready(clock.now)  # closing hurries the stage into batches
        clock.now += 2
        assert len(acc.expire(clock.now)) == N
        with pytest.raises(DeliveryTimeoutError):
            await late
        with pytest.raises(ProducerClosedError):
            await Call(list(range(N)), "d").stage(acc)

    asyncio.run(go())


def test_staged_batches_take_sequences_in_partition_order() -> None:
    async def go() -> None:
        clock = Clock()
        acc = make(clock, linger_ms=0, sequencer=Sequencer(lambda: 77))
        one = estimate_size(b"a0", b"ka0", None, None)
        acc.batch_size = BATCH_OVERHEAD + 12 * one
        parts = list(range(N)) + [9] * 40
        fut = await Call(parts, "a").stage(acc)
        nines = [b for b in deliver(acc, clock.now, lambda b: 0) if b.tp.partition == 9]
        assert len(nines) > 2
        heads = [check_batch(b.encoded) for b in nines if b.encoded is not None]
        assert [(h.producer_id, h.base_sequence) for h in heads] == [
            (77, s) for s in np.cumsum([0] + [b.record_count for b in nines[:-1]]).tolist()
        ]
        assert fut.done()

    asyncio.run(go())


def test_a_staged_call_wakes_the_sender_only_when_the_stage_may_be_due() -> None:
    """The sender's pass looks at every queued partition: a wake-up per staged call would cost
    the partition count per call."""

    async def go() -> None:
        clock = Clock()
        acc = make(clock, linger_ms=5)
        acc.wakeup.clear()
        await Call(list(range(N)), "a").stage(acc)
        assert acc.wakeup.is_set()  # a new stage: its linger starts
        acc.wakeup.clear()
        await Call(list(range(N)), "b").stage(acc)
        assert not acc.wakeup.is_set()  # the sender already waits for that linger
        clock.now += 0.005
        acc.ready(clock.now)  # cut: 100 batches unsent
        acc.wakeup.clear()
        await Call(list(range(N)), "c").stage(acc)
        assert not acc.wakeup.is_set()  # held back by the unsent cut
        ready, _ = acc.ready(clock.now)
        acc.drain(ready[:50])
        assert not acc.wakeup.is_set()  # still held
        acc.drain(ready[50:])
        assert acc.wakeup.is_set()  # no longer held: the stage is due

    asyncio.run(go())


def test_a_topic_that_grew_has_its_stage_cut_before_the_wider_call_is_staged() -> None:
    async def go() -> None:
        clock = Clock()
        acc = make(clock, linger_ms=60_000)
        narrow = await Call(list(range(N)), "a").stage(acc)
        wider = [TopicPartition("t", p) for p in range(N + 20)]
        values = [b"w%d" % p for p in range(N + 20)]
        sizes = np.array([estimate_size(v, v, None, None) for v in values])
        wide = await acc.stage_runs(
            wider, np.arange(N + 20), values, values, np.full(N + 20, 3, dtype=np.int64), sizes
        )
        assert acc.stats()["staged_calls"] == 1  # the narrow call went into batches first
        assert [b.record_count for b in acc.batches(TopicPartition("t", 7))] == [1]
        acc.begin_close()
        stored: dict[int, int] = {}  # records stored per partition so far

        def base(batch: ProducerBatch) -> int:
            p = batch.tp.partition
            stored[p] = stored.get(p, 0) + batch.record_count
            return 10 * p + stored[p] - batch.record_count

        deliver(acc, clock.now, base)
        assert [r.base_offset for r in await narrow] == [10 * p for p in range(N)]
        runs = await wide
        assert [r.partition for r in runs] == list(range(N + 20))
        assert runs[7].base_offset == 71 and runs[N + 5].base_offset == 10 * (N + 5)

    asyncio.run(go())
