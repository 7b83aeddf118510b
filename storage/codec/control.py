"""Control batches: the transaction markers a coordinator writes into a partition.

A transaction ends in every partition it wrote to with one **marker**: a batch whose header
has the ``control`` and ``transactional`` attribute bits, the transaction's producer id and
epoch, base sequence -1 and one record (Kafka's shape)::

    key     4 bytes   int16 version (0), int16 type (0 = abort, 1 = commit)
    value   6 bytes   int16 version (0), int32 coordinator epoch

All little-endian, like the rest of the format. The coordinator epoch is the token of the
decision (``docs/transactions.md``): the version of the coordinator's state record that holds
the commit or abort decision. A partition keeps the last token it applied per producer and
ignores a marker whose token is not newer (a retry, or a late copy from a deposed
coordinator).

Markers are never handed to applications: consumers, replay and Spark skip control batches
by their header bit. Only the agent writes them (a producer's control batch is refused with
``InvalidRecordError``). Pure: bytes in, values out.
"""

from __future__ import annotations

import bisect
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from storage.codec.batch import decode_batch, encode_batch
from storage.codec.header import BatchHeader
from storage.errors import CorruptBatchError

ABORT = 0
COMMIT = 1
_KEY = struct.Struct("<hh")
_VALUE = struct.Struct("<hi")
VERSION = 0


@dataclass(frozen=True, slots=True)
class ControlMarker:
    commit: bool
    coordinator_epoch: int


def encode_marker(
    producer_id: int,
    producer_epoch: int,
    *,
    commit: bool,
    coordinator_epoch: int,
    timestamp_ms: int,
) -> bytes:
    """A marker batch (base offset 0, to be stamped by the partition leader)."""
    return encode_batch(
        [_VALUE.pack(VERSION, coordinator_epoch)],
        keys=[_KEY.pack(VERSION, COMMIT if commit else ABORT)],
        timestamps=timestamp_ms,
        producer_id=producer_id,
        producer_epoch=producer_epoch,
        base_sequence=-1,
        transactional=True,
        control=True,
    )


def read_marker(buf: Any, pos: int, header: BatchHeader, *, verify: bool = False) -> ControlMarker:
    """The marker in the control batch at ``buf[pos:]`` (``header`` already read there).

    Raises ``CorruptBatchError`` for a control batch that is not a well-formed marker."""
    if not header.is_control:
        raise CorruptBatchError("not a control batch", position=pos)
    rb = decode_batch(buf, pos, verify=verify)
    keys, values = rb.column(2), rb.column(3)
    if rb.num_rows != 1 or keys.null_count or values.null_count:
        raise CorruptBatchError("a control batch holds one record with a key", position=pos)
    key, value = keys[0].as_py(), values[0].as_py()
    if len(key) != _KEY.size or len(value) != _VALUE.size:
        raise CorruptBatchError("control record of the wrong size", position=pos)
    version, kind = _KEY.unpack(key)
    _, epoch = _VALUE.unpack(value)
    if version != VERSION or kind not in (ABORT, COMMIT):
        raise CorruptBatchError(f"unknown control record {version}/{kind}", position=pos)
    return ControlMarker(kind == COMMIT, epoch)


AbortedRanges = dict[int, list[tuple[int, int]]]


def aborted_ranges(entries: Iterable[tuple[int, int, int]]) -> AbortedRanges:
    """(producer id, first offset, end offset) of aborted transactions -> per producer id its
    ranges ``[first, end)``, sorted: what a reader needs to drop their batches."""
    out: AbortedRanges = {}
    for pid, first, end in entries:
        out.setdefault(pid, []).append((first, end))
    for ranges in out.values():
        ranges.sort()
    return out


def is_aborted(ranges: Mapping[int, list[tuple[int, int]]], header: BatchHeader) -> bool:
    """Whether the batch with ``header`` belongs to one of the aborted transactions: it is
    transactional, of a listed producer, and starts inside one of its ranges. One lookup per
    batch; records are never looked at."""
    if not header.is_transactional:
        return False
    found = ranges.get(header.producer_id)
    if not found:
        return False
    offset = header.base_offset
    i = bisect.bisect_right(found, (offset, 1 << 62)) - 1
    return i >= 0 and offset < found[i][1]
