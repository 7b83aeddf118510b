"""Kafka's record batch, magic v2: its header, its CRC, and a columnar walk of its records.

Nothing here knows Strata's format: ``storage.kafka.records`` converts between the two, and
``storage.codec.kafka_body`` keeps a Kafka batch as a Strata batch's body as it came. A Kafka
batch (big-endian; KIP-98)::

    offset size field
    0      8    base_offset
    8      4    batch_length           bytes after this field
    12     4    partition_leader_epoch
    16     1    magic                  2
    17     4    crc                    CRC32C of bytes [21, end)
    21     2    attributes             bits 0-2 codec (none/gzip/snappy/lz4/zstd), bit 3
                                       timestamp type (log append time), bit 4 transactional,
                                       bit 5 control, bit 6 delete horizon
    23     4    last_offset_delta
    27     8    base_timestamp
    35     8    max_timestamp
    43     8    producer_id
    51     2    producer_epoch
    53     4    base_sequence
    57     4    records_count
    61     -    records (compressed as one block when the codec says so)

and each record::

    varint length | int8 attributes | varlong timestamp_delta | varint offset_delta
    | varint key_length (-1 null) | key | varint value_length (-1 null) | value
    | varint header_count | header_count x (varint key_length | key (UTF-8)
                                             | varint value_length (-1 null) | value)

(zigzag varints). Finding where each record starts is the one loop that runs per record in
Python (a record's length prefix says where the next one is); every field after that is read
for all records at once with numpy (``scan_records``), and keys and values are gathered by
Arrow (``take`` over an array whose offsets alternate between field starts and ends;
``parse_records``). Records with headers are the slow path: their headers are read record
by record.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from storage.crc import crc32c
from storage.errors import (
    CorruptBatchError,
    MalformedFrameError,
    StrataError,
    UnsupportedVersionError,
)
from storage.kafka import walk
from storage.kafka.wire import read_uvarint, read_varint

MAGIC = 2
HEADER_SIZE = 61
#: base_offset, batch_length, leader_epoch, magic, crc, attributes, last_offset_delta,
#: base_timestamp, max_timestamp, producer_id, producer_epoch, base_sequence, records_count
HEADER = struct.Struct(">qiibIhiqqqhii")
assert HEADER.size == HEADER_SIZE
CRC_START = 21
CRC_FIELD = struct.Struct(">I")
CRC_OFFSET = 17

ATTR_CODEC = 0x07
ATTR_LOG_APPEND_TIME = 0x08
ATTR_TRANSACTIONAL = 0x10
ATTR_CONTROL = 0x20
ATTR_DELETE_HORIZON = 0x40

#: the header that carries a Strata tag
TAG_HEADER = "strata.tag"


@dataclass(frozen=True, slots=True)
class KafkaBatchHeader:
    base_offset: int
    batch_length: int
    leader_epoch: int
    magic: int
    crc: int
    attributes: int
    last_offset_delta: int
    base_timestamp: int
    max_timestamp: int
    producer_id: int
    producer_epoch: int
    base_sequence: int
    records_count: int

    @property
    def size(self) -> int:
        return self.batch_length + 12

    @property
    def codec(self) -> int:
        return self.attributes & ATTR_CODEC


def read_header(buf: Any, pos: int = 0) -> KafkaBatchHeader:
    """The header of the Kafka batch at ``buf[pos:]`` (no CRC check)."""
    if len(buf) - pos < HEADER_SIZE:
        if len(buf) - pos >= 17 and buf[pos + 16] != MAGIC:
            raise UnsupportedVersionError(
                f"record batch magic {buf[pos + 16]}: only magic 2 (Kafka 0.11+) is accepted"
            )
        raise CorruptBatchError(
            f"truncated Kafka batch header: {len(buf) - pos} of {HEADER_SIZE} bytes",
            position=pos,
        )
    h = KafkaBatchHeader(*HEADER.unpack_from(buf, pos))
    if h.magic != MAGIC:
        raise UnsupportedVersionError(
            f"record batch magic {h.magic}: only magic 2 (Kafka 0.11+) is accepted"
        )
    if h.batch_length + 12 < HEADER_SIZE:
        raise CorruptBatchError(f"Kafka batch length field says {h.size} bytes", position=pos)
    return h


def is_transactional(buf: Any) -> bool:
    """Whether the Kafka batch in ``buf`` has its transactional bit set (a glance at the
    attributes; False for anything too short to have them: the conversion refuses that)."""
    if len(buf) < HEADER_SIZE:
        return False
    return bool(int.from_bytes(bytes(memoryview(buf)[21:23]), "big") & ATTR_TRANSACTIONAL)


def check_kafka_batch(buf: Any) -> KafkaBatchHeader:
    """Header, exact length and CRC32C of one whole Kafka batch."""
    h = read_header(buf)
    if h.size != len(buf):
        raise CorruptBatchError(
            f"a produce request's records must be one batch: its length field says {h.size}"
            f" bytes, {len(buf)} were sent"
        )
    if crc32c(memoryview(buf)[CRC_START:]) != h.crc:
        raise CorruptBatchError("Kafka record batch CRC32C mismatch")
    return h


@dataclass(slots=True)
class Columns:
    timestamp_delta: np.ndarray
    keys: pa.Array | None
    values: pa.Array
    headers: list[list[tuple[str, bytes]]] | None
    tags: list[list[str]] | None


_U8 = np.uint8


def _steps() -> list[int]:
    """For the first two bytes of a record (little-endian), how far its length prefix says
    the next record starts; 0 when the prefix takes three bytes or more."""
    out = [0] * 65536
    for v in range(65536):
        b, c = v & 0xFF, v >> 8
        if b < 0x80:
            out[v] = 1 + (b >> 1)
        elif c < 0x80:
            out[v] = 2 + (((b & 0x7F) | (c << 7)) >> 1)
    return out


_STEP = _steps()


def _record_bounds(data: Any, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(start of each record's body, end of it); the records must fill ``data`` exactly.

    The one loop per record: each record's length prefix says where the next one starts.
    It only collects where each record begins (plain ints in a list, the cheapest step
    Python has; one table lookup per record for prefixes of up to two bytes, records under
    8 KiB); the lengths are then read again and checked for all records at once."""
    buf = data if isinstance(data, bytes) else memoryview(data).cast("B")
    end = len(buf)
    heads: list[int] = []
    append = heads.append
    pos = 0
    step = _STEP
    try:
        for _ in range(n):
            append(pos)
            jump = step[buf[pos] | buf[pos + 1] << 8]  # (a record is longer than 2 bytes)
            if jump:
                pos += jump
            else:
                raw, pos = _read_raw_varint(buf, pos)
                pos += raw >> 1
    except IndexError:
        raise CorruptBatchError(
            f"Kafka batch holds {len(heads) - 1} whole records, its header says {n}"
        ) from None
    if pos != end:
        raise CorruptBatchError(
            f"Kafka batch records end at byte {pos} of {end} (its header says {n} records)"
        )
    at = np.array(heads, dtype=np.int64)
    ends = np.empty(n, dtype=np.int64)
    ends[:-1] = at[1:]
    ends[-1] = end
    arr = np.frombuffer(buf, dtype=_U8)
    first = arr[at]
    if (first & 1).any():  # the zigzag sign bit: the loop above read every length as >= 0
        raise CorruptBatchError("a Kafka record has a negative length")
    two = first >= 0x80
    if not two.any():
        starts = at + 1
    elif (arr[at[two] + 1] < 0x80).all():  # (the loop read that byte: it exists)
        starts = at + 1 + two
    else:  # some length takes three bytes or more: read them all again
        _, starts = _vread(arr, at, ends)
    if (starts >= ends).any():
        raise CorruptBatchError("a Kafka record has a length of zero")
    return starts, ends


def _read_raw_varint(data: Any, pos: int) -> tuple[int, int]:
    try:
        return read_uvarint(data, pos)
    except MalformedFrameError as exc:
        raise CorruptBatchError(f"a Kafka record's length: {exc}") from None


def _vread(arr: np.ndarray, pos: np.ndarray, ends: np.ndarray, *, long: bool = False) -> Any:
    """Zigzag varints at ``pos`` (one per record), each before its record's end: (values,
    positions after them)."""
    if (pos >= ends).any():
        raise CorruptBatchError("a Kafka record ends before its fields do")
    first = arr[pos]
    two = first >= 0x80
    if not two.any():  # one byte each: the usual case for small fields
        v = first.astype(np.int64)
        return (v >> 1) ^ -(v & 1), pos + 1
    after = pos + 1
    if (after[two] >= ends[two]).any():
        raise CorruptBatchError("a Kafka record ends inside a varint")
    second = arr[np.minimum(after, len(arr) - 1)]
    if not (two & (second >= 0x80)).any():  # at most two bytes each (lengths up to 8 KiB)
        v = (first & 0x7F).astype(np.int64) | np.where(two, second.astype(np.int64) << 7, 0)
        return (v >> 1) ^ -(v & 1), after + two
    b = first.astype(np.uint64)
    value = b & np.uint64(0x7F)
    nxt = pos + 1
    more = b >= 0x80
    shift = 7
    limit = 63 if long else 28
    while more.any():
        if shift > limit:
            raise CorruptBatchError("a Kafka record varint is too long")
        idx = np.flatnonzero(more)
        p = nxt[idx]
        if (p >= ends[idx]).any():
            raise CorruptBatchError("a Kafka record ends inside a varint")
        b = arr[p].astype(np.uint64)
        value[idx] |= (b & np.uint64(0x7F)) << np.uint64(shift)
        nxt[idx] = p + 1
        more[idx] = b >= 0x80
        shift += 7
    signed = (value >> np.uint64(1)).astype(np.int64) ^ -(value & np.uint64(1)).astype(np.int64)
    return signed, nxt


def _gather(buf: pa.Buffer, starts: np.ndarray, lengths: np.ndarray) -> pa.Array:
    """A binary array of ``buf[starts[i] : starts[i] + lengths[i]]`` (length -1: null); the
    slices must be in order and disjoint (fields of consecutive records)."""
    n = len(starts)
    sizes = np.maximum(lengths, 0)
    bounds = np.empty(2 * n, dtype=np.int64)
    bounds[0::2] = starts
    bounds[1::2] = starts + sizes
    if n and bounds[-1] > (1 << 31) - 1:
        raise CorruptBatchError("a Kafka batch too large to convert")
    spans = pa.Array.from_buffers(
        pa.binary(), 2 * n - 1, [None, pa.py_buffer(bounds.astype(np.int32)), buf]
    )
    picked = spans.take(pa.array(np.arange(0, 2 * n, 2, dtype=np.int64)))
    if (lengths >= 0).all():
        return picked
    valid = np.packbits(lengths >= 0, bitorder="little")
    return pa.Array.from_buffers(
        pa.binary(), n, [pa.py_buffer(valid), *picked.buffers()[1:]], null_count=-1
    )


@dataclass(slots=True)
class Scan:
    """Where every record's fields are, from one walk of a record set (arrays over records)."""

    timestamp_delta: np.ndarray
    key_start: np.ndarray
    key_len: np.ndarray
    value_start: np.ndarray
    value_len: np.ndarray
    header_count: np.ndarray
    #: where each record's headers start (after its header count)
    headers_at: np.ndarray
    ends: np.ndarray

    @property
    def has_headers(self) -> bool:
        return bool(self.header_count.any())


def scan_records(data: Any, n: int) -> Scan:
    """Walk the ``n`` records of an uncompressed record set: every record's framing, its
    attributes (zero), its offset delta (0, 1, 2, ...), key and value lengths (-1 or more)
    checked, and, for each record without headers, that its fields fill it exactly (records
    with headers are checked by ``parse_records``). Raises ``CorruptBatchError``.

    Compiled (``storage.kafka.walk``) when numba is installed, with numpy otherwise."""
    if walk.available():
        fields, code, record = walk.scan(data, n)
        if code:
            raise CorruptBatchError(f"{walk.ERRORS[code]} (record {record} of {n})")
        return Scan(*fields)
    return scan_records_numpy(data, n)


def scan_records_numpy(data: Any, n: int) -> Scan:
    """``scan_records`` without numba: the records' starts found by a Python loop, their
    fields read for all records at once with numpy."""
    starts, ends = _record_bounds(data, n)
    arr = np.frombuffer(data, dtype=_U8)
    pos = starts
    if (arr[pos] != 0).any():  # record attributes: unused, zero
        raise CorruptBatchError("a Kafka record has non-zero attributes")
    pos = pos + 1
    ts_delta, pos = _vread(arr, pos, ends, long=True)
    offset_delta, pos = _vread(arr, pos, ends)
    if (offset_delta != np.arange(n)).any():
        raise CorruptBatchError("a produced batch's offset deltas must be 0, 1, 2, ...")
    key_len, pos = _vread(arr, pos, ends)
    key_start = pos
    pos = pos + np.maximum(key_len, 0)
    value_len, pos = _vread(arr, pos, ends)
    value_start = pos
    pos = pos + np.maximum(value_len, 0)
    if (key_len < -1).any() or (value_len < -1).any():
        raise CorruptBatchError("a Kafka record has a negative key or value length")
    header_count, pos = _vread(arr, pos, ends)
    if (header_count < 0).any():
        raise CorruptBatchError("a Kafka record has a negative header count")
    s = Scan(ts_delta, key_start, key_len, value_start, value_len, header_count, pos, ends)
    if ((header_count == 0) & (pos != ends)).any():  # (records with headers: parse_records)
        raise CorruptBatchError("a Kafka record's fields do not fill its length")
    return s


def parse_records(data: Any, n: int, scan: Scan | None = None) -> Columns:
    """The ``n`` records of an uncompressed record set as columns (``scan``: its walk, if
    ``scan_records`` has been run already)."""
    s = scan_records(data, n) if scan is None else scan
    headers: list[list[tuple[str, bytes]]] | None = None
    tags: list[list[str]] | None = None
    if s.has_headers:
        headers, tags, pos = _parse_headers(data, s.header_count, s.headers_at, s.ends)
        if (pos != s.ends).any():
            raise CorruptBatchError("a Kafka record's fields do not fill its length")
    buf = pa.py_buffer(data)
    keys = None if (s.key_len == -1).all() else _gather(buf, s.key_start, s.key_len)
    values = _gather(buf, s.value_start, s.value_len)
    return Columns(s.timestamp_delta, keys, values, headers, tags)


def _parse_headers(
    data: Any, counts: np.ndarray, pos: np.ndarray, ends: np.ndarray
) -> tuple[list[list[tuple[str, bytes]]], list[list[str]] | None, np.ndarray]:
    """Headers, per record, in Python (records with headers are the slow path)."""
    out_headers: list[list[tuple[str, bytes]]] = []
    out_tags: list[list[str]] = []
    any_tag = False
    new_pos = pos.copy()
    view = memoryview(data)
    for i in range(len(counts)):
        p = int(pos[i])
        end = int(ends[i])
        hs: list[tuple[str, bytes]] = []
        ts: list[str] = []
        for _ in range(int(counts[i])):
            klen, p = _varint(view, p, end)
            if klen < 0 or p + klen > end:
                raise CorruptBatchError("a Kafka header key does not fit its record")
            try:
                key = str(view[p : p + klen], "utf-8")
            except UnicodeDecodeError:
                raise CorruptBatchError("a Kafka header key is not UTF-8") from None
            p += klen
            vlen, p = _varint(view, p, end)
            if vlen < -1 or p + max(vlen, 0) > end:
                raise CorruptBatchError("a Kafka header value does not fit its record")
            value = bytes(view[p : p + max(vlen, 0)])
            p += max(vlen, 0)
            if key == TAG_HEADER:
                try:
                    ts.append(value.decode())
                except UnicodeDecodeError:
                    raise CorruptBatchError(f"a {TAG_HEADER} header is not UTF-8") from None
                any_tag = True
            else:
                hs.append((key, value))
        out_headers.append(hs)
        out_tags.append(ts)
        new_pos[i] = p
    return out_headers, out_tags if any_tag else None, new_pos


def _varint(view: memoryview, pos: int, end: int) -> tuple[int, int]:
    try:
        value, p = read_varint(view[:end], pos)
    except StrataError as exc:
        raise CorruptBatchError(f"a Kafka header field: {exc}") from None
    return value, p
