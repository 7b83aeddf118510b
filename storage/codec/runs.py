"""Decode a run of small plain batches laid end to end as one Arrow record batch.

A consumer of many partitions of a keyed topic gets many small batches: a producer's
``send_batch`` of 1,024 keyed records spread over 1,024 partitions makes batches of one to a
few records each. ``decode_batch`` builds eleven Arrow arrays per batch (~50 us, whatever the
record count), which caps such a consumer at ~20k batches a second. ``decode_run`` takes the
consecutive *plain* batches at a position — uncompressed, not control, no headers or tags
(body buffers 7-14 empty), key and value offsets starting at 0 and ending at their data's
length (what every encoder writes), at most ``RUN_BATCH_RECORDS`` records each — and builds
one record batch for all of them: the per-batch work is the header and CRC check
(``check_batch``), the body check of ``check_flat_body`` and a few slices; the columns are
then joined with one ``numpy.concatenate`` each (timestamps, key and value offsets and data),
so the records' bytes are copied once into the run's buffers.

What is checked is what ``decode_batch(verify=True)`` checks: the CRC and header of every
batch, its directory against its length, and for its key and value columns the validity
bitmap's size and the offsets (non-decreasing, within the data). The run stops before the
first batch that is not plain or not whole (a torn tail, a corrupt batch); if the very first
batch is such, ``decode_run`` returns None and the caller decodes it alone (and gets the
typed error for a corrupt one there).
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
import pyarrow as pa

from storage.codec.batch import check_batch
from storage.codec.body import (
    DIRECTORY,
    DIRECTORY_SIZE,
    SCHEMA,
    TIMESTAMP_TYPE,
    check_flat_body,
    no_headers_or_tags,
)
from storage.codec.header import (
    ATTR_COMPRESSION_MASK,
    ATTR_CONTROL,
    HEADER_SIZE,
    padded,
    read_header,
)
from storage.errors import CorruptBatchError, StrataError

_NOT_PLAIN = ATTR_CONTROL | ATTR_COMPRESSION_MASK
#: batches of more records are decoded alone: their Arrow arrays then cost about what copying
#: their records into a run's buffers does, and ``decode_batch`` points into the fetched bytes
RUN_BATCH_RECORDS = 32
_I32 = np.dtype("<i4")
_INT32 = struct.Struct("<i")
#: attributes, summary length and record count: header bytes 24-31
_ATTRIBUTES_TO_COUNT = struct.Struct("<HHi")


class _Column:
    """One binary column (key or value) of the run, gathered batch by batch."""

    __slots__ = ("data", "nulls", "offsets", "size")

    def __init__(self) -> None:
        self.offsets: list[Any] = []  # per batch: its n offsets after the first (int32 bytes)
        self.data: list[Any] = []
        self.nulls: list[tuple[int, int, Any]] = []  # (first row, rows, bitmap) where there is one
        self.size = 0  # data bytes so far

    @staticmethod
    def canonical(buf: Any, at: int, v: int, o: int, d: int, n: int, row: int) -> bool:
        """Whether a batch's column at ``at`` (validity, offsets, data of v, o, d bytes) has
        canonical offsets (first 0, last ``d``); the run stops before a batch without."""
        if o:
            at += padded(v)
            first, last = _INT32.unpack_from(buf, at)[0], _INT32.unpack_from(buf, at + 4 * n)[0]
            return bool(first == 0 and last == d)
        return True

    def take(self, whole: np.ndarray, at: int, v: int, o: int, d: int, n: int, row: int) -> None:
        """Add a batch's column (``canonical`` said yes)."""
        if v:
            self.nulls.append((row, n, whole[at : at + v]))
        at += padded(v)
        if o:
            offs = whole[at + 4 : at + 4 + 4 * n].view(_I32)
            self.offsets.append(offs + np.int32(self.size) if self.size else offs)
        else:
            self.offsets.append(np.full(n, self.size, dtype=_I32))
        at += padded(o)
        if d:
            self.data.append(whole[at : at + d])
            self.size += d

    def array(self, total: int) -> pa.Array:
        offsets = np.concatenate([np.zeros(1, _I32), *self.offsets])
        data = np.concatenate(self.data) if self.data else np.zeros(0, np.uint8)
        validity = None
        if self.nulls:
            valid = np.ones(total, dtype=bool)
            for row, n, bitmap in self.nulls:
                valid[row : row + n] = np.unpackbits(bitmap, bitorder="little", count=n)
            validity = pa.py_buffer(np.packbits(valid, bitorder="little"))
        return pa.Array.from_buffers(
            pa.binary(),
            total,
            [validity, pa.py_buffer(offsets), pa.py_buffer(data)],
            null_count=-1 if validity is not None else 0,
        )


def decode_run(
    buf: Any, pos: int = 0, end: int | None = None, *, verify: bool = True
) -> tuple[pa.RecordBatch, int, int] | None:
    """The records of the plain batches from ``buf[pos:]`` up to ``end`` (module docstring),
    as ``(records, position after the last of them, its next offset)``; None if the batch at
    ``pos`` is not plain or not whole. The offset column holds each record's own offset (the
    batches need not be contiguous)."""
    end = len(buf) if end is None else min(end, len(buf))
    whole = np.frombuffer(buf, dtype=np.uint8)
    stamps: list[Any] = []
    bases: list[int] = []
    counts: list[int] = []
    key, value = _Column(), _Column()
    rows = 0
    next_offset = -1
    while pos < end:
        if pos + HEADER_SIZE > end:
            break
        attributes, _, count = _ATTRIBUTES_TO_COUNT.unpack_from(buf, pos + 24)
        if attributes & _NOT_PLAIN or count > RUN_BATCH_RECORDS:
            break  # seen before its CRC is checked: a large batch's is checked once, alone
        try:
            h = check_batch(buf, pos, exact=False) if verify else read_header(buf, pos)
            if pos + h.size > end:
                break
            lengths = DIRECTORY.unpack_from(buf, pos + HEADER_SIZE)
            if any(lengths[7:15]):
                break
            n = h.record_count
            if verify:
                check_flat_body(buf, pos + HEADER_SIZE, lengths, n)
        except StrataError:
            break
        at = pos + HEADER_SIZE + DIRECTORY_SIZE
        k_at = at + padded(lengths[0])
        v_at = k_at + padded(lengths[1]) + padded(lengths[2]) + padded(lengths[3])
        kv = (k_at, *lengths[1:4], n, rows)
        vv = (v_at, *lengths[4:7], n, rows)
        if lengths[0] != 8 * n or not key.canonical(buf, *kv) or not value.canonical(buf, *vv):
            break
        key.take(whole, *kv)
        value.take(whole, *vv)
        stamps.append(whole[at : at + 8 * n])
        bases.append(h.base_offset)
        counts.append(n)
        rows += n
        pos += h.size
        next_offset = h.next_offset
    if not rows:
        return None
    first = bases[0]
    if next_offset - first == rows:  # contiguous offsets: the usual case
        offsets = np.arange(first, next_offset, dtype=np.int64)
    else:
        starts = np.repeat(np.asarray(bases, np.int64) - np.cumsum([0, *counts[:-1]]), counts)
        offsets = starts + np.arange(rows, dtype=np.int64)
    try:
        timestamps = pa.Array.from_buffers(
            TIMESTAMP_TYPE, rows, [None, pa.py_buffer(np.concatenate(stamps))], null_count=0
        )
        columns = [
            pa.array(offsets),
            timestamps,
            key.array(rows),
            value.array(rows),
            *no_headers_or_tags(rows),
        ]
    except pa.ArrowInvalid as exc:  # cannot happen for checked batches; typed all the same
        raise CorruptBatchError(f"malformed record batch body: {exc}") from None
    return pa.RecordBatch.from_arrays(columns, schema=SCHEMA), pos, next_offset
