"""The small value types applications see: partitions, delivery reports, consumed records."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


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
