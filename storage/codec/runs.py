"""Decode a run of small plain batches laid end to end as one Arrow record batch.

A consumer of many partitions of a keyed topic gets many small batches: a producer's
``send_batch`` of 1,024 keyed records spread over 1,024 partitions makes batches of one to a
few records each; the delay scheduler and the retry router write one-record batches, each
with its own producer id (``docs/delays.md``), full of headers. ``decode_batch`` builds eleven
Arrow arrays per batch (~50-80 us, whatever the record count), which caps such a consumer at
~15-20k batches a second. ``decode_run`` takes the consecutive *plain* batches at a position
— uncompressed, not control, every offsets buffer starting at 0 and ending at its data's
length (what every encoder writes), at most ``RUN_BATCH_RECORDS`` records each — and builds
one record batch for all of them: the per-batch work is the header and CRC check
(``check_batch``), the body check of ``check_flat_body`` and a few slices; the columns are
then joined with one ``numpy.concatenate`` each (timestamps, key, value, header and tag
offsets and data), so the records' bytes are copied once into the run's buffers.

What is checked is what ``decode_batch(verify=True)`` checks: the CRC and header of every
batch, its directory against its length, for its key and value columns the validity bitmap's
size and the offsets (non-decreasing, within the data), and for headers and tags their list
offsets against their children's lengths, per batch. What is left of Arrow's full validation
(offsets of header and tag strings non-decreasing, header keys and tags UTF-8) runs once on
the run's joined header and tag columns. The run stops before the first batch that is not
plain or not whole (a torn tail, a corrupt batch); if the very first batch is such, or the
joined headers or tags fail Arrow's validation (only a forged batch, its CRC made to match,
can do that), ``decode_run`` returns None and the caller decodes the first batch alone (and
gets the typed error for a corrupt one there).
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
    HEADER_PAIR,
    HEADERS_TYPE,
    SCHEMA,
    TAGS_TYPE,
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
from storage.errors import StrataError

_NOT_PLAIN = ATTR_CONTROL | ATTR_COMPRESSION_MASK
#: batches of more records are decoded alone: their Arrow arrays then cost about what copying
#: their records into a run's buffers does, and ``decode_batch`` points into the fetched bytes
RUN_BATCH_RECORDS = 32
_I32 = np.dtype("<i4")
_INT32 = struct.Struct("<i")
_BINARY = pa.binary()
_STRING = pa.string()
#: attributes, summary length and record count: header bytes 24-31
_ATTRIBUTES_TO_COUNT = struct.Struct("<HHi")


def _ints(n: int) -> struct.Struct:
    """The layout of ``n`` little-endian int32."""
    layout = _INTS.get(n)
    if layout is None:
        layout = _INTS[n] = struct.Struct(f"<{n}i")
    return layout


_INTS: dict[int, struct.Struct] = {}


def _canonical(buf: Any, at: int, o: int, d: int, n: int) -> bool:
    """Whether the offsets buffer at ``at`` (``o`` bytes) of a column of ``n`` entries with
    ``d`` bytes of data is canonical: ``n + 1`` offsets from 0 to ``d``, or none at all when
    there is no data (an all-empty column); a run stops before a batch without."""
    if not o:
        return not d
    return (
        o == 4 * (n + 1)
        and _INT32.unpack_from(buf, at)[0] == 0
        and _INT32.unpack_from(buf, at + o - 4)[0] == d
    )


class _Column:
    """One binary or string column of the run, gathered batch by batch: its offsets as ints,
    its data as views of the fetched bytes (joined once, at the end), its validity as the
    bits of one int."""

    __slots__ = ("data", "nullable", "offsets", "rows", "size", "valid")

    def __init__(self) -> None:
        self.offsets: list[int] = [0]
        self.data: list[Any] = []
        self.size = 0  # data bytes so far
        self.valid = 0  # bit i: entry i is not null
        self.rows = 0
        self.nullable = False  # some batch had a validity bitmap

    def take(self, mv: memoryview, at: int, v: int, o: int, d: int, n: int) -> None:
        """Add a batch's column of ``n`` entries (validity, offsets, data of v, o, d bytes at
        ``at``; ``_canonical`` said yes)."""
        if v:
            bits = int.from_bytes(mv[at : at + v], "little") & ((1 << n) - 1)
            self.nullable = True
        else:
            bits = (1 << n) - 1
        self.valid |= bits << self.rows
        self.rows += n
        at += padded(v)
        base = self.size
        if not o:
            self.offsets += [base] * n
        elif n == 1:
            self.offsets.append(base + d)  # canonical: the last offset is d
        elif base:
            self.offsets += [x + base for x in _ints(n).unpack_from(mv, at + 4)]
        else:
            self.offsets += _ints(n).unpack_from(mv, at + 4)
        if d:
            at += padded(o)
            self.data.append(mv[at : at + d])
            self.size = base + d

    def array(self, kind: pa.DataType = _BINARY) -> pa.Array:
        total = self.rows
        validity = None
        if self.nullable and self.valid != (1 << total) - 1:
            validity = pa.py_buffer(self.valid.to_bytes((total + 7) // 8, "little"))
        return pa.Array.from_buffers(
            kind,
            total,
            [
                validity,
                pa.py_buffer(np.array(self.offsets, dtype=_I32)),
                pa.py_buffer(b"".join(self.data)),
            ],
            null_count=-1 if validity is not None else 0,
        )


class _Lists:
    """One list column (headers: key and value children; tags: one child) of the run."""

    __slots__ = ("children", "offsets")

    def __init__(self, children: int) -> None:
        self.offsets: list[int] = [0]
        self.children = [_Column() for _ in range(children)]

    @staticmethod
    def entries(buf: Any, at: list[int], lengths: tuple[int, ...], n: int) -> int | None:
        """The number of entries of a batch's list column (its buffers at ``at``: the list
        offsets, then each child's offsets and data), or None if it is not canonical: list
        offsets ``n + 1`` ints from 0 to the entries and each child's offsets canonical, or
        no buffers at all (no entries)."""
        if not lengths[0]:
            return 0 if not any(lengths) else None
        if lengths[0] != 4 * (n + 1) or _INT32.unpack_from(buf, at[0])[0] != 0:
            return None
        count: int = _INT32.unpack_from(buf, at[0] + 4 * n)[0]
        if count < 0:
            return None
        for i in range(1, len(lengths), 2):
            if not _canonical(buf, at[i], lengths[i], lengths[i + 1], count):
                return None
        return count

    def take(
        self, mv: memoryview, at: list[int], lengths: tuple[int, ...], n: int, count: int
    ) -> None:
        """Add a batch's column of ``count`` entries (``entries`` said so)."""
        base = self.offsets[-1]
        if not count:
            self.offsets += [base] * n
            return
        ends = _ints(n).unpack_from(mv, at[0] + 4)
        self.offsets += [x + base for x in ends] if base else ends
        for i, child in enumerate(self.children):
            child.take(mv, at[2 * i + 1], 0, lengths[2 * i + 1], lengths[2 * i + 2], count)

    def array(self, kind: pa.DataType) -> pa.Array:
        offsets = pa.py_buffer(np.array(self.offsets, dtype=_I32))
        if kind == HEADERS_TYPE:
            k, v = self.children
            child: pa.Array = pa.StructArray.from_arrays(
                [k.array(_STRING), v.array()], fields=list(HEADER_PAIR)
            )
        else:
            child = self.children[0].array(_STRING)
        return pa.Array.from_buffers(
            kind, len(self.offsets) - 1, [None, offsets], null_count=0, children=[child]
        )


def decode_run(
    buf: Any, pos: int = 0, end: int | None = None, *, verify: bool = True
) -> tuple[pa.RecordBatch, int, int] | None:
    """The records of the plain batches from ``buf[pos:]`` up to ``end`` (module docstring),
    as ``(records, position after the last of them, its next offset)``; None if the batch at
    ``pos`` is not plain or not whole. The offset column holds each record's own offset (the
    batches need not be contiguous)."""
    end = len(buf) if end is None else min(end, len(buf))
    mv = memoryview(buf).cast("B")
    stamps: list[Any] = []
    bases: list[int] = []
    counts: list[int] = []
    key, value = _Column(), _Column()
    headers, tags = _Lists(2), _Lists(1)
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
            n = h.record_count
            if verify:
                check_flat_body(buf, pos + HEADER_SIZE, lengths, n)
        except StrataError:
            break
        at = [pos + HEADER_SIZE + DIRECTORY_SIZE]  # where each of the body's buffers starts
        for length in lengths[:14]:
            at.append(at[-1] + padded(length))
        if (
            lengths[0] != 8 * n
            or (lengths[1] and lengths[1] != (n + 7) // 8)
            or (lengths[4] and lengths[4] != (n + 7) // 8)
            or not _canonical(buf, at[2], lengths[2], lengths[3], n)
            or not _canonical(buf, at[5], lengths[5], lengths[6], n)
        ):
            break
        pairs = _Lists.entries(buf, at[7:12], lengths[7:12], n)
        labels = _Lists.entries(buf, at[12:15], lengths[12:15], n)
        if pairs is None or labels is None:
            break
        key.take(mv, at[1], lengths[1], lengths[2], lengths[3], n)
        value.take(mv, at[4], lengths[4], lengths[5], lengths[6], n)
        headers.take(mv, at[7:12], lengths[7:12], n, pairs)
        tags.take(mv, at[12:15], lengths[12:15], n, labels)
        stamps.append(mv[at[0] : at[0] + 8 * n])
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
            TIMESTAMP_TYPE, rows, [None, pa.py_buffer(b"".join(stamps))], null_count=0
        )
        columns = [pa.array(offsets), timestamps, key.array(), value.array()]
        if headers.offsets[-1] or tags.offsets[-1]:
            columns += [headers.array(HEADERS_TYPE), tags.array(TAGS_TYPE)]
            if verify:
                columns[4].validate(full=True)
                columns[5].validate(full=True)
        else:
            columns += no_headers_or_tags(rows)
    except pa.ArrowInvalid:  # a forged batch (strings not UTF-8, offsets going back):
        return None  # decoded alone, where it gets its typed error
    return pa.RecordBatch.from_arrays(columns, schema=SCHEMA), pos, next_offset
