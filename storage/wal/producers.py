"""Idempotent producers' state in one partition: what each producer id appended last.

An idempotent producer stamps every batch with its ``producer_id``, a ``producer_epoch`` and
the ``base_sequence`` of the batch's first record (sequences count records per partition, from
0, modulo 2**31). The partition's leader accepts a batch only if it continues the producer's
sequence, and answers a *retry* of one of the producer's last :data:`DEDUP_WINDOW` batches with
the offsets it was stored at the first time, instead of storing it again. So a producer can
retry after a lost response without duplicating records, and can keep several requests in
flight per partition without reordering them: a batch that overtakes a failed predecessor is
refused (``OutOfOrderSequenceError``, retriable) and resent after it.

Rules for a batch of producer ``p`` with epoch ``e`` and sequences ``[first, last]``
(``check``):

* ``p`` unknown here (a new producer, or one whose state expired): accepted.
* ``e`` older than ``p``'s epoch: ``InvalidProducerEpochError``.
* ``e`` newer: accepted only if ``first`` is 0 (the producer restarted its sequences).
* same epoch: ``[first, last]`` equal to one of the last batches' -> a duplicate (its original
  offsets); ``first`` right after the last batch's ``last`` -> accepted; else
  ``OutOfOrderSequenceError``.

Transaction markers (control batches, written by the coordinator) carry the producer's id and
epoch but no sequence: a marker of a newer epoch starts that epoch with no batches (so the
producer's next batch may start anywhere, and older epochs are refused from then on — that is
how an aborting coordinator fences a zombie in every partition of its transaction); a marker
of the current epoch leaves the sequences alone (they continue across transactions).

The table is rebuilt from the batch headers of the local log when the log opens, trimmed
when the log is truncated, and updated by every append, a leader's and a follower's alike
(the headers are replicated with the batches, so a follower that becomes leader has the same
state). Producers idle for :data:`EXPIRATION_S` are forgotten (reopening the log counts as
activity), and at most :data:`MAX_PRODUCERS` are kept per partition (the least recently used
goes first): the table is bounded.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from storage.codec.header import DEDUP_WINDOW, SEQUENCE_MASK, BatchHeader
from storage.errors import (
    CorruptBatchError,
    DuplicateSequenceError,
    InvalidProducerEpochError,
    OutOfOrderSequenceError,
)

#: producers per partition; the least recently used is forgotten beyond it
MAX_PRODUCERS = 10_000
#: a producer silent this long is forgotten (Kafka's producer.id.expiration.ms, 1 day)
EXPIRATION_S = 86_400.0


def last_sequence(h: BatchHeader) -> int:
    return (h.base_sequence + h.record_count - 1) & SEQUENCE_MASK


@dataclass(frozen=True, slots=True)
class Duplicate:
    """A batch already stored: where its records are."""

    base_offset: int
    last_offset: int


@dataclass(slots=True)
class _Producer:
    epoch: int
    #: (first sequence, last sequence, base offset, last offset) of the latest batches
    batches: deque[tuple[int, int, int, int]] = field(
        default_factory=lambda: deque(maxlen=DEDUP_WINDOW)
    )
    last_seen: float = 0.0
    #: offset of the first batch or marker of this epoch here: the entry (which fences older
    #: epochs even without batches) stays through truncations that keep it
    epoch_start: int = -1

    @property
    def last_seq(self) -> int:
        return self.batches[-1][1] if self.batches else -1


def _validate(h: BatchHeader) -> None:
    if h.producer_id < -1 or (h.producer_id >= 0 and (h.producer_epoch < 0 or h.base_sequence < 0)):
        raise CorruptBatchError(
            f"impossible producer fields: id {h.producer_id}, epoch {h.producer_epoch}, "
            f"base sequence {h.base_sequence}"
        )


class ProducerStateTable:
    """Per producer id: its epoch and its last batches (see the module docstring)."""

    def __init__(
        self, *, max_producers: int = MAX_PRODUCERS, expiration_s: float = EXPIRATION_S
    ) -> None:
        self.max_producers = max_producers
        self.expiration_s = expiration_s
        self._producers: OrderedDict[int, _Producer] = OrderedDict()

    def __len__(self) -> int:
        return len(self._producers)

    def check_run(self, headers: Iterable[BatchHeader]) -> Duplicate | None:
        """Check the batches one request brings for this partition, in order, before any is
        appended. Returns the stored offsets if the run is one batch already stored; None if
        every batch may be appended. Raises the errors of the module docstring."""
        run = list(headers)
        pending: dict[int, tuple[int, int]] = {}  # producer id -> (epoch, last seq) in this run
        for i, h in enumerate(run):
            _validate(h)
            pid = h.producer_id
            if pid < 0:
                continue
            before = pending.get(pid)
            if before is None:
                dup = self._check_one(h)
                if dup is not None:
                    if len(run) > 1:
                        raise DuplicateSequenceError(
                            f"batch {i} of {len(run)} (producer {pid}, sequences "
                            f"{h.base_sequence}..{last_sequence(h)}) is already stored; a "
                            "retried batch must be sent alone"
                        )
                    return dup
            elif h.producer_epoch != before[0] or h.base_sequence != (
                (before[1] + 1) & SEQUENCE_MASK
            ):
                raise OutOfOrderSequenceError(
                    f"batch {i} of the request (producer {pid}, epoch {h.producer_epoch}, "
                    f"sequence {h.base_sequence}) does not continue the batch before it "
                    f"(epoch {before[0]}, last sequence {before[1]})"
                )
            pending[pid] = (h.producer_epoch, last_sequence(h))
        return None

    def _check_one(self, h: BatchHeader) -> Duplicate | None:
        entry = self._producers.get(h.producer_id)
        if entry is None:
            return None
        if h.producer_epoch < entry.epoch:
            raise InvalidProducerEpochError(
                f"producer {h.producer_id} sent epoch {h.producer_epoch}; this partition has "
                f"seen epoch {entry.epoch}"
                + (
                    ": a newer producer with its transactional.id fenced it, or the coordinator"
                    " aborted its transaction after transaction.timeout.ms"
                    if h.is_transactional
                    else ""
                )
            )
        if h.producer_epoch > entry.epoch:
            if h.base_sequence != 0:
                raise OutOfOrderSequenceError(
                    f"producer {h.producer_id} started epoch {h.producer_epoch} at sequence "
                    f"{h.base_sequence}, not 0"
                )
            return None
        last = last_sequence(h)
        for first_seq, last_seq, base, last_offset in entry.batches:
            if first_seq == h.base_sequence and last_seq == last:
                return Duplicate(base, last_offset)
        if entry.batches and h.base_sequence != (entry.last_seq + 1) & SEQUENCE_MASK:
            raise OutOfOrderSequenceError(
                f"producer {h.producer_id} epoch {h.producer_epoch}: expected sequence "
                f"{(entry.last_seq + 1) & SEQUENCE_MASK}, got {h.base_sequence}"
            )
        return None

    def epoch_of(self, producer_id: int) -> int | None:
        """The latest epoch seen of ``producer_id`` (None: unknown here)."""
        entry = self._producers.get(producer_id)
        return None if entry is None else entry.epoch

    def last_offset(self, producer_id: int) -> int | None:
        """The last offset of ``producer_id``'s latest batch here (None: none known)."""
        entry = self._producers.get(producer_id)
        return entry.batches[-1][3] if entry is not None and entry.batches else None

    def update(self, h: BatchHeader, now: float) -> None:
        """Record an appended batch (``h`` as stored: with its base offset)."""
        pid = h.producer_id
        if pid < 0:
            return
        entry = self._producers.pop(pid, None)
        if h.is_control:  # a transaction marker: the epoch, no sequences
            if entry is None or h.producer_epoch > entry.epoch:
                entry = _Producer(h.producer_epoch, epoch_start=h.base_offset)
        else:
            if entry is None or h.producer_epoch != entry.epoch:
                entry = _Producer(h.producer_epoch, epoch_start=h.base_offset)
            entry.batches.append((h.base_sequence, last_sequence(h), h.base_offset, h.last_offset))
        self._producers[pid] = entry  # now the most recently used
        entry.last_seen = now
        self._evict(now)

    def _evict(self, now: float) -> None:
        producers = self._producers
        while producers:
            oldest = next(iter(producers.values()))
            if len(producers) <= self.max_producers and oldest.last_seen > now - self.expiration_s:
                return
            producers.popitem(last=False)

    def truncate(self, end_offset: int) -> None:
        """Forget the batches at or above ``end_offset`` (the log was cut there). A producer
        left without batches is forgotten: its next batch is accepted whatever its sequence,
        which is right, since its later batches are no longer stored."""
        for pid in list(self._producers):
            entry = self._producers[pid]
            batches = entry.batches
            while batches and batches[-1][2] >= end_offset:
                batches.pop()
            if entry.epoch_start >= end_offset or (not batches and entry.epoch_start < 0):
                del self._producers[pid]
