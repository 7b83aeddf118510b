"""The small value types applications see: partitions, delivery reports, consumed records."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import NamedTuple, overload

_new_tuple = tuple.__new__


class TopicPartition(NamedTuple):
    topic: str
    partition: int


class RecordMetadata(NamedTuple):
    """Where a produced record was stored. ``offset`` is -1 with ``acks=0`` (nobody answers)."""

    topic: str
    partition: int
    offset: int
    timestamp: int  # ms since the epoch: the record's own (CreateTime) timestamp
    schedule_id: str | None = None
    """For a delayed record: its id (``Admin.cancel_scheduled``). ``topic`` and ``partition``
    are then where it will be delivered, and ``offset`` is -1 (not placed there yet)."""


class RecordsMetadata(NamedTuple):
    """Where a run of records from ``Producer.send_batch`` was stored: ``record_count``
    records at offsets ``base_offset`` .. ``base_offset + record_count - 1`` of one partition
    (``base_offset`` -1 with acks=0)."""

    topic: str
    partition: int
    base_offset: int
    record_count: int
    schedule_ids: tuple[str, ...] = ()
    """For delayed records: their ids in the run's order (``base_offset`` is then -1)."""


class StoredRuns(Sequence[RecordsMetadata]):
    """What ``Producer.send_batch`` resolves to: one :class:`RecordsMetadata` per run of
    records stored together, in the order of the input. A read-only sequence (index, slice,
    iterate, ``len``, compare with a list; ``list(runs)`` for a list of its own).

    The runs are kept as three plain columns (partition, base offset, count) and each
    :class:`RecordsMetadata` is made when it is read. A keyed call over 1,024 partitions has
    ~640 runs and finishes out of order (when its last run is acknowledged): as tuples made
    then, the finished calls an application had not looked at yet held ~150,000 of them, and
    the collector's full passes over them took a fifth of the producer's time
    (``docs/benchmarks.md``, *The collector again*)."""

    __slots__ = ("_counts", "_ids", "_offsets", "_tps")

    def __init__(
        self,
        tps: Sequence[TopicPartition],
        offsets: Sequence[int],
        counts: Sequence[int],
        schedule_ids: Sequence[tuple[str, ...]] | None = None,
    ) -> None:
        if not len(tps) == len(offsets) == len(counts) or (
            schedule_ids is not None and len(schedule_ids) != len(counts)
        ):
            raise ValueError("one partition, base offset and count (and ids) per run")
        self._tps, self._offsets, self._counts = tps, offsets, counts
        self._ids = schedule_ids

    def __len__(self) -> int:
        return len(self._counts)

    @property
    def record_count(self) -> int:
        """How many records the call stored: the sum of its runs' ``record_count``."""
        return sum(self._counts)

    def _run(self, i: int) -> RecordsMetadata:
        tp = self._tps[i]
        ids = () if self._ids is None else self._ids[i]
        return _new_tuple(RecordsMetadata, (tp[0], tp[1], self._offsets[i], self._counts[i], ids))

    @overload
    def __getitem__(self, i: int) -> RecordsMetadata: ...

    @overload
    def __getitem__(self, i: slice) -> list[RecordsMetadata]: ...

    def __getitem__(self, i: int | slice) -> RecordsMetadata | list[RecordsMetadata]:
        if isinstance(i, slice):
            return [self._run(j) for j in range(*i.indices(len(self)))]
        return self._run(range(len(self))[i])  # negative indexes; IndexError past the end

    def __iter__(self) -> Iterator[RecordsMetadata]:
        if self._ids is not None:
            yield from map(self._run, range(len(self)))
            return
        for tp, offset, count in zip(self._tps, self._offsets, self._counts, strict=True):
            yield _new_tuple(RecordsMetadata, (tp[0], tp[1], offset, count, ()))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, StoredRuns | list):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # equal to a list, so unhashable as one

    def __repr__(self) -> str:
        return f"StoredRuns({list(self)!r})"


class ConsumerRecord(NamedTuple):
    topic: str
    partition: int
    offset: int
    timestamp: int  # ms since the epoch
    key: bytes | None
    value: bytes | None
    headers: Sequence[tuple[str, bytes]]
    tags: Sequence[str]


class OffsetAndTimestamp(NamedTuple):
    offset: int
    timestamp: int
