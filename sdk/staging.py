"""The producer's stage: keyed ``send_batch`` calls over many partitions, batched as columns.

A keyed call over a topic of many partitions is mostly runs of one or two records (1,024
records over 1,024 partitions: ~640 runs). Appended run by run into per-partition batches
(``RecordAccumulator.append_runs``), its Python work is per run, which there is per record:
a third of the producer's time at 1,024 partitions (``docs/benchmarks.md``, *A columnar
stage*). A *staged* call is kept whole instead: its columns as ``send_batch`` ordered them
(by partition) and each record's partition as a numpy array. Every staged call of a topic is
then *cut* into per-partition batches at once, when the sender can take them:

* one stable sort of the stage's records by partition (the calls' order kept within a
  partition), one gather of the value and key columns, and each batch's bounds, bytes and
  creation time computed as arrays; a partition's records are split into batches of at most
  ``batch.size`` bytes (a call's records are at most a quarter of that each, so a batch is
  cut where its bytes before a record pass ``batch.size`` less the largest record);
* a call's report is resolved once every batch holding its records is acknowledged: each
  batch knows, as arrays, which calls it holds and how many of their records, and a call's
  offsets are read from the batches' base offsets in one gather (:class:`StageCut`).

A cut takes every staged record of the topic: the stage is all or nothing, so that no work is
spent on what stays. When it is cut is :meth:`Stage.due`'s rule. The accumulator keeps the
order of a partition across its two ways in: a staged call first closes the topic's open
batches, and a record appended the other way to a partition the stage holds records of cuts
the stage first.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from itertools import chain
from operator import itemgetter
from typing import Any

import numpy as np

from sdk.records import StoredRuns, TopicPartition

#: a keyed ``send_batch`` call is staged when it has at least this many runs (partitions)
STAGE_MIN_RUNS = 64
#: ... and none of its records is more than 1/STAGE_MAX_RECORD_SHARE of ``batch.size``
STAGE_MAX_RECORD_SHARE = 4
#: a stage due by age waits while the last cut's unsent bytes are more than
#: 1/STAGE_UNSENT_SHARE of what is staged (``Stage.due``)
STAGE_UNSENT_SHARE = 8
#: clock readings this close count as equal (as in ``sdk.accumulator``)
_EPSILON = 1e-6


def _gather(column: Sequence[Any], order: list[int]) -> list[Any]:
    """``[column[i] for i in order]`` in C."""
    if len(order) == 1:
        return [column[order[0]]]
    return list(itemgetter(*order)(column))


class StagedCall:
    """One staged ``send_batch`` call: its columns in partition order until it is cut."""

    __slots__ = ("created", "future", "keys", "parts", "sizes", "timestamps", "values")

    def __init__(
        self,
        future: asyncio.Future[StoredRuns],
        parts: np.ndarray,
        values: list[bytes | None],
        keys: list[bytes | None],
        timestamps: np.ndarray,
        sizes: np.ndarray,
        created: float,
    ) -> None:
        self.future = future
        self.parts = parts
        self.values = values
        self.keys = keys
        self.timestamps = timestamps
        self.sizes = sizes
        self.created = created


class StageCut:
    """The batches one cut made, and the reports of the calls it took (see the module
    docstring). Batch ``k`` holds records ``starts[k]:starts[k + 1]`` of ``values``/``keys``/
    ``timestamps`` (the cut's records sorted by partition), of partition ``parts[k]``; the
    accumulator makes a ``ProducerBatch`` of each and tells the cut of its fate."""

    __slots__ = (
        "_bases",
        "_bc_bounds",
        "_bc_calls",
        "_bc_counts",
        "_call_lo",
        "_calls",
        "_left",
        "_rec_batch",
        "_rec_parts",
        "_rec_pos",
        "created",
        "keys",
        "parts",
        "reserved",
        "stage",
        "starts",
        "timestamps",
        "values",
    )

    def __init__(self, stage: Stage, calls: list[StagedCall], room: int) -> None:
        self.stage = stage
        self._calls = [c.future for c in calls]
        lens = np.fromiter((len(c.parts) for c in calls), dtype=np.int64, count=len(calls))
        n = int(lens.sum())
        self._call_lo = np.concatenate(([0], np.cumsum(lens))).tolist()
        parts = np.concatenate([c.parts for c in calls])
        sizes = np.concatenate([c.sizes for c in calls])
        # radix sort on small ints; stable, so a partition's records keep the calls' order
        keys = parts.astype(np.uint16) if len(stage.tps) <= 1 << 16 else parts
        order = np.argsort(keys, kind="stable")
        sp, ss = parts[order], sizes[order]
        new_part = np.empty(n, dtype=bool)
        new_part[0] = True
        np.not_equal(sp[1:], sp[:-1], out=new_part[1:])
        part_starts = np.flatnonzero(new_part)
        ends = np.cumsum(ss)
        before = ends - ss  # the stage's bytes before each record, then within its partition
        before -= before[part_starts][np.cumsum(new_part) - 1]
        span = max(room - int(ss.max()), 1)
        chunk = before // span
        new_batch = new_part.copy()
        new_batch[1:] |= chunk[1:] != chunk[:-1]
        starts = np.flatnonzero(new_batch)
        batch_of = np.cumsum(new_batch) - 1
        self._rec_batch = np.empty(n, dtype=np.int64)
        self._rec_batch[order] = batch_of
        self._rec_pos = np.empty(n, dtype=np.int64)
        self._rec_pos[order] = np.arange(n) - starts[batch_of]
        self._rec_parts = parts
        self._bases = np.full(len(starts), -2, dtype=np.int64)
        # the (batch, call) pairs: a batch's records are in call order, so each call's are one run
        call_of = np.repeat(np.arange(len(calls)), lens)[order]
        new_pair = new_batch.copy()
        new_pair[1:] |= call_of[1:] != call_of[:-1]
        pair_starts = np.flatnonzero(new_pair)
        self._bc_calls = call_of[pair_starts]
        self._bc_counts = np.diff(np.append(pair_starts, n))
        self._bc_bounds = np.searchsorted(pair_starts, np.append(starts, n)).tolist()
        self._left = lens
        created = np.fromiter((c.created for c in calls), dtype=np.float64, count=len(calls))
        #: per batch: its partition, first record, reserved bytes and creation time
        self.parts = sp[starts].tolist()
        self.starts = [*starts.tolist(), n]
        self.reserved = np.add.reduceat(ss, starts).tolist()
        self.created = np.minimum.reduceat(created[call_of], starts).tolist()
        listed = order.tolist()
        self.values = _gather(list(chain.from_iterable(c.values for c in calls)), listed)
        self.keys = _gather(list(chain.from_iterable(c.keys for c in calls)), listed)
        self.timestamps = np.concatenate([c.timestamps for c in calls])[order]

    def release_columns(self) -> None:
        """The batches hold their slices: the cut keeps only what reports need."""
        self.values = self.keys = []
        self.timestamps = self.timestamps[:0]

    def complete(self, k: int, base_offset: int) -> None:
        """Batch ``k`` is stored at ``base_offset`` (-1: unknown, with acks=0)."""
        self._bases[k] = base_offset
        lo, hi = self._bc_bounds[k], self._bc_bounds[k + 1]
        calls = self._bc_calls[lo:hi]
        left = self._left
        left[calls] -= self._bc_counts[lo:hi]
        for c in calls[left[calls] == 0].tolist():
            future = self._calls[c]
            if not future.done():
                future.set_result(self._runs(c))

    def fail(self, k: int, exc: BaseException) -> None:
        """Batch ``k`` failed for good: so does every call it holds records of."""
        lo, hi = self._bc_bounds[k], self._bc_bounds[k + 1]
        for c in self._bc_calls[lo:hi].tolist():
            future = self._calls[c]
            if not future.done():
                future.set_exception(exc)

    def _runs(self, c: int) -> StoredRuns:
        """Call ``c``'s runs: its records split where the partition or the batch changes."""
        lo, hi = self._call_lo[c], self._call_lo[c + 1]
        batch = self._rec_batch[lo:hi]
        parts = self._rec_parts[lo:hi]
        new_run = np.empty(hi - lo, dtype=bool)
        new_run[0] = True
        new_run[1:] = (parts[1:] != parts[:-1]) | (batch[1:] != batch[:-1])
        heads = np.flatnonzero(new_run)
        bases = self._bases[batch[heads]]
        offsets = np.where(bases >= 0, bases + self._rec_pos[lo:hi][heads], -1)
        counts = np.diff(np.append(heads, hi - lo))
        tps = _gather(self.stage.tps, parts[heads].tolist())
        return StoredRuns(tps, offsets.tolist(), counts.tolist())


class Stage:
    """The staged calls of one topic, and the bytes of its cut batches not yet sent."""

    __slots__ = ("bytes", "calls", "first", "full", "staged", "tps", "unsent")

    def __init__(self, tps: Sequence[TopicPartition]) -> None:
        self.tps = tps
        self.calls: list[StagedCall] = []
        #: staged bytes per partition, and in all
        self.bytes = np.zeros(len(tps), dtype=np.int64)
        self.staged = 0
        #: when the oldest staged call was made
        self.first = float("inf")
        #: a partition holds a batch's worth
        self.full = False
        #: bytes of batches cut and not yet drained into a request
        self.unsent = 0

    def add(self, call: StagedCall, room: int) -> bool:
        """Stage ``call``; whether the sender should look at the stage again (it was empty,
        it is full, or the last cut's unsent bytes stopped holding it back), as a pass over
        every queued partition per call would cost the partition count per call."""
        wake = not self.calls or self.held
        if not self.calls:
            self.first = call.created
        self.calls.append(call)
        self.bytes += np.bincount(call.parts, weights=call.sizes, minlength=len(self.tps)).astype(
            np.int64
        )
        self.staged += int(call.sizes.sum())
        if not self.full and int(self.bytes.max()) >= room:
            self.full = True
            wake = True
        return wake and (self.full or not self.held)

    @property
    def held(self) -> bool:
        """The last cut's unsent bytes hold a stage that is due by age back (see ``due``)."""
        return self.unsent * STAGE_UNSENT_SHARE > self.staged

    def holds(self, partition: int) -> bool:
        return bool(self.calls) and partition < len(self.bytes) and bool(self.bytes[partition])

    def due(self, now: float, linger: float, hurry: bool) -> tuple[bool, float | None]:
        """Whether to cut now, else in how many seconds (None: when a drain or an append
        says so). A stage is cut when a flush or close hurries it, when a partition holds a
        batch's worth, or once it is ``linger.ms`` old — but then only when what the last
        cut made is mostly on its way (its unsent bytes at most an eighth of the staged):
        under backpressure the stage keeps growing while the sender works through the last
        cut, as an open batch grows in its queue, so batches stay large however many
        partitions there are. (Waiting for every byte of the last cut would let one
        partition whose batches cannot be sent hold up the topic; a share of one, not an
        eighth, made batches a third smaller and produce 15-30% slower at 1,024 partitions.)"""
        if hurry or self.full:
            return True, None
        if self.held:
            return False, None
        wait = self.first + linger - now
        return wait <= _EPSILON, max(wait, 0.0)

    def cut(self, room: int) -> StageCut:
        """Every staged record, in batches (see :class:`StageCut`)."""
        calls, self.calls = self.calls, []
        cut = StageCut(self, calls, room)
        self.bytes[:] = 0
        self.staged = 0
        self.first = float("inf")
        self.full = False
        return cut
