"""Kafka's record batch (magic v2, ``storage.kafka.batch``) to Strata's batch and back.

Kafka to Strata (a produce): an uncompressed batch with create time whose records carry no
headers (what clients send unless told to compress) is kept as it came, inside a Strata
batch whose body is the Kafka batch (``storage.codec.kafka_body``): its CRC checked, its
records walked once, nothing converted. Any other batch is converted to the columnar body.

What survives the conversion, both ways: offsets (a batch's records are consecutive; offset
deltas must be 0..n-1, as every producer writes them), timestamps, keys and values (null or
not), headers in order, producer id, epoch and base sequence, the leader epoch. Strata's
**tags** travel as headers named ``strata.tag`` (one per tag, in order): Kafka to Strata,
those headers become the record's tags; Strata to Kafka, a record's tags are appended to its
headers under that name. A header whose value is null is stored with an empty value
(Strata's header values are never null).

The conversion is columnar (``storage.kafka.batch.parse_records`` reads every field for all
records at once). Encoding writes every record's varints into one small buffer with numpy (a
records x fields x bytes block, masked), then one Arrow ``take`` interleaves those pieces
with the keys and values into the answer: one copy of each value, and no Python code per
record unless records carry headers or tags. Both directions check CRCs: the Kafka batch's
CRC32C before decoding, the Strata batch's (``check_batch``) before encoding. A batch stored
as it came goes back to Kafka clients as it came, behind its stamped base offset and leader
epoch, under the CRC its producer computed (the consumer's to check, as from a Kafka broker).

Strata stores a batch that arrived compressed with lz4 (or gzip or snappy) as lz4, with zstd
as zstd; fetches answer uncompressed Kafka batches.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from storage.codec import (
    Compression,
    check_batch,
    decode_batch,
    encode_batch,
    kafka_body,
    read_header,
)
from storage.codec.control import ControlMarker, read_marker
from storage.codec.parts import BatchParts
from storage.crc import crc32c
from storage.errors import (
    CorruptBatchError,
    InvalidRequestError,
    StrataError,
)
from storage.kafka.batch import (
    ATTR_CONTROL,
    ATTR_LOG_APPEND_TIME,
    ATTR_TRANSACTIONAL,
    CRC_FIELD,
    CRC_OFFSET,
    CRC_START,
    HEADER,
    HEADER_SIZE,
    MAGIC,
    TAG_HEADER,
    check_kafka_batch,
    parse_records,
    scan_records,
)
from storage.kafka.batch import (
    is_transactional as is_transactional,
)
from storage.kafka.compression import Codec, compress, decompress
from storage.kafka.wire import write_varint

#: a compressed Kafka batch may inflate to at most this much (as Strata's own bodies)
MAX_RAW_RECORDS = 256 << 20

_STORE_AS = {
    Codec.NONE: Compression.NONE,
    Codec.GZIP: Compression.LZ4,
    Codec.SNAPPY: Compression.LZ4,
    Codec.LZ4: Compression.LZ4,
    Codec.ZSTD: Compression.ZSTD,
}

_U8 = np.uint8


# ---- Kafka -> Strata ------------------------------------------------------------------------
def kafka_to_strata(buf: Any, *, now_ms: int | None = None, keep: bool = True) -> bytes:
    """:func:`kafka_to_append`'s batch as one buffer."""
    out = kafka_to_append(buf, now_ms=now_ms, keep=keep)
    return out.tobytes() if isinstance(out, BatchParts) else out


def kafka_to_append(
    buf: Any, *, now_ms: int | None = None, keep: bool = True
) -> bytes | BatchParts:
    """One Kafka batch (a produce request's records) as one Strata batch, ready to append.

    A transactional batch stays transactional (its producer id and epoch say whose
    transaction it belongs to). Raises ``CorruptBatchError`` (bad CRC, length, varint,
    offsets, a compressed body that does not inflate), ``UnsupportedVersionError`` (magic
    other than 2), and ``InvalidRequestError`` for a control batch: markers are written by
    the transaction coordinator only. ``keep``: a batch that can be is kept as it came
    (``storage.codec.kafka_body``), as ``BatchParts`` around ``buf`` itself (``buf`` must
    not change until it is appended); else every batch is converted to the columnar body."""
    view = memoryview(buf).cast("B")
    h = check_kafka_batch(view)
    if h.attributes & ATTR_CONTROL:
        raise InvalidRequestError(
            "a producer may not write control batches: markers come from the coordinator"
        )
    transactional = bool(h.attributes & ATTR_TRANSACTIONAL)
    if transactional and h.producer_id < 0:
        raise InvalidRequestError("a transactional batch without a producer id")
    n = h.records_count
    if n <= 0 or h.last_offset_delta != n - 1:
        raise CorruptBatchError(
            f"a produced batch needs consecutive records: count {n}, last offset delta"
            f" {h.last_offset_delta}"
        )
    codec = h.codec
    if codec > Codec.ZSTD:
        raise CorruptBatchError(f"unknown compression codec {codec}")
    body: Any = view[HEADER_SIZE:]
    scan = None
    if keep and kafka_body.storable(h):
        scan = scan_records(body, n)
        if not scan.has_headers:
            first, largest = kafka_body.timestamps(h, scan)
            if largest == h.max_timestamp:  # (else converted: the header is taken from the records)
                # h.crc is the CRC of these bytes (check_kafka_batch computed it)
                return kafka_body.frame_parts(view, h, first, largest, kafka_crc=h.crc)
    if codec != Codec.NONE:
        body = decompress(codec, body, MAX_RAW_RECORDS)
    cols = parse_records(body, n, scan)
    if h.attributes & ATTR_LOG_APPEND_TIME:
        ts = np.full(n, now_ms if now_ms is not None else time.time_ns() // 1_000_000)
    else:
        ts = cols.timestamp_delta + np.int64(h.base_timestamp)
    try:
        return encode_batch(
            cols.values,
            keys=cols.keys,
            timestamps=ts,
            headers=cols.headers,
            tags=cols.tags,
            compression=_STORE_AS[Codec(codec)],
            producer_id=h.producer_id,
            producer_epoch=h.producer_epoch,
            base_sequence=h.base_sequence,
            transactional=transactional,
        )
    except StrataError:
        raise
    except (ValueError, pa.ArrowException) as exc:
        raise CorruptBatchError(f"Kafka batch does not convert: {exc}") from None


# ---- Strata -> Kafka ------------------------------------------------------------------------
def _zigzag(v: np.ndarray) -> np.ndarray:
    v = v.astype(np.int64)
    return ((v << 1) ^ (v >> 63)).astype(np.uint64)


_SHIFTS = np.arange(10, dtype=np.uint64) * np.uint64(7)
_BYTE_INDEX = np.arange(10)


def _count_varint_bytes(z: np.ndarray, sizes: np.ndarray) -> None:
    """Add to ``sizes`` (ones, or zeros where a field is absent) the bytes beyond the first
    of each unsigned varint in ``z`` (same shape, uint64)."""
    for k in range(1, 10):
        more = z >= np.uint64(1 << (7 * k))
        if not more.any():
            return
        sizes += more


def _varint_bytes(z: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """The unsigned varints ``z`` (records x fields, uint64) back to back, record by record,
    each ``sizes[i, j]`` bytes long (0: that field is left out), as one uint8 array.

    Every varint is first spread over a (records, fields, bytes) block, then the block's
    bytes that belong to a varint are kept, in order: a fixed number of numpy calls whatever
    the record count."""
    width = int(sizes.max()) if sizes.size else 1
    block = ((z[..., None] >> _SHIFTS[:width]) & np.uint64(0x7F)).astype(_U8)
    last = sizes[..., None] - 1
    block |= (_BYTE_INDEX[:width] < last).astype(_U8) << 7
    kept: np.ndarray = block[_BYTE_INDEX[:width] <= last]
    return kept


#: batches of at most this many records are converted record by record (``strata_to_kafka``)
SMALL_BATCH = 128


def strata_to_kafka(buf: Any, pos: int = 0) -> tuple[list[Any], int]:
    """The Strata batch at ``buf[pos:]`` as one uncompressed Kafka batch: (its parts, to be
    sent back to back; the Strata batch's size).

    A batch built here gets a new Kafka CRC, so the Strata CRC is checked first: corruption
    in the store is refused, never sealed under a fresh CRC. A batch stored as a Kafka client
    sent it goes back with that client's own CRC, which covers everything the client reads
    (all but the stamped offset, length and leader epoch): only its framing is checked here,
    and the Kafka consumer's CRC check (``check.crcs``; on by default in the Java client) is
    the end-to-end check, as for a batch a Kafka broker serves. (Checking the Strata CRC too
    was a quarter of the agent's event loop in a Kafka consume.)

    Batches of up to ``SMALL_BATCH`` records are encoded record by record in Python: the
    columnar path's fixed cost (some 30 numpy and Arrow calls, ~0.25 ms on this 2-core
    machine) is more than a few records cost one by one (~3.5 µs each; the two meet near 100
    records), and a consumer of a topic written at a low rate reads mostly one-record
    batches."""
    h = read_header(buf, pos)
    if h.compression == Compression.KAFKA:  # stored as a Kafka client sent it
        if len(buf) - pos < h.size:
            raise CorruptBatchError(
                f"truncated batch: {len(buf) - pos} of {h.size} bytes", position=pos
            )
        kafka_body.check_frame(buf, pos, h)
        return kafka_body.kafka_parts(buf, pos, h), h.size
    h = check_batch(buf, pos, exact=False)
    n = h.record_count
    if h.is_control:  # a transaction marker: Kafka's control record, which clients skip
        records: Any = _control_record(read_marker(buf, pos, h))
    elif n <= SMALL_BATCH:
        records = _records_one_by_one(decode_batch(buf, pos, verify=False), h.first_timestamp)
    else:
        records = _records_columnar(decode_batch(buf, pos, verify=False), n, h.first_timestamp)
    size = len(records)
    # read_committed clients drop a transactional batch of an aborted transaction by these bits
    attributes = (ATTR_TRANSACTIONAL if h.is_transactional else 0) | (
        ATTR_CONTROL if h.is_control else 0
    )
    header = bytearray(
        HEADER.pack(
            h.base_offset,
            HEADER_SIZE - 12 + size,
            h.leader_epoch,
            MAGIC,
            0,
            attributes,
            n - 1,
            h.first_timestamp,
            h.max_timestamp,
            h.producer_id,
            h.producer_epoch,
            h.base_sequence,
            n,
        )
    )
    crc = crc32c(bytes(header[CRC_START:]))
    crc = crc32c(memoryview(records), crc)
    CRC_FIELD.pack_into(header, CRC_OFFSET, crc)
    return [bytes(header), records], h.size


#: Kafka's control record key (version, type) and value (version, coordinator epoch), big-endian
_CONTROL_KEY = struct.Struct(">hh")
_CONTROL_VALUE = struct.Struct(">hi")


def _control_record(marker: ControlMarker) -> bytes:
    """The one record of a Kafka control batch for ``marker`` (type 0 abort, 1 commit)."""
    key = _CONTROL_KEY.pack(0, 1 if marker.commit else 0)
    value = _CONTROL_VALUE.pack(0, marker.coordinator_epoch)
    body = (
        b"\x00\x00\x00"  # attributes, timestamp delta 0, offset delta 0
        + write_varint(len(key))
        + key
        + write_varint(len(value))
        + value
        + b"\x00"  # no headers
    )
    return write_varint(len(body)) + body


def _records_columnar(rb: pa.RecordBatch, n: int, first_timestamp: int) -> pa.Buffer:
    """The Kafka records of ``rb``, built for all records at once (see the module docstring).

    The varints of every record go into one small buffer, split into pieces at the keys and
    values; one Arrow ``take`` over [pieces, keys, values, headers] in record order then
    copies everything once into the answer."""
    ts = _int64s(rb.column(1))
    keys = rb.column(2)
    values = rb.column(3)
    key_len = _lengths(keys)
    value_len = _lengths(values)
    suffix = _header_suffixes(rb, n)
    has_keys = keys.null_count < n
    plain_tail = suffix is None  # every record ends with a header count of 0: one zero byte
    # per record, its varints in the order they are written: [0] the previous record's zero
    # header count (when the tails are plain), [1] its length, [2] attributes (a zero
    # byte), [3] timestamp delta, [4] offset delta, [5] key length, [6] value length
    z = np.zeros((n, 7), dtype=np.uint64)
    z[:, 3] = _zigzag(ts - np.int64(first_timestamp))
    z[:, 4] = _zigzag(np.arange(n, dtype=np.int64))
    z[:, 5] = _zigzag(key_len)
    z[:, 6] = _zigzag(value_len)
    sizes = np.ones((n, 7), dtype=np.int64)
    sizes[0 if plain_tail else slice(None), 0] = 0
    _count_varint_bytes(z[:, 3:], sizes[:, 3:])
    tail_len: Any = 1 if plain_tail else _lengths(suffix)
    body = sizes[:, 2:].sum(axis=1) + np.maximum(key_len, 0) + np.maximum(value_len, 0) + tail_len
    z[:, 1] = _zigzag(body)
    _count_varint_bytes(z[:, 1], sizes[:, 1])
    gap_bytes = _varint_bytes(z, sizes)
    if plain_tail:
        gap_bytes = np.append(gap_bytes, _U8(0))  # the last record's header count
    # the pieces of ``gap_bytes``: per record everything before its key, and (with keys)
    # its value length between key and value; then the last record's tail
    per_record = sizes.sum(axis=1)
    cuts = 2 if has_keys else 1
    bounds = np.empty(cuts * n + 1 + plain_tail, dtype=np.int64)
    bounds[0] = 0
    np.cumsum(per_record, out=bounds[cuts : cuts * n + 1 : cuts])
    if has_keys:
        bounds[1 : 2 * n : 2] = bounds[0 : 2 * n : 2] + per_record - sizes[:, 6]
    if plain_tail:
        bounds[-1] = len(gap_bytes)
    pieces = len(bounds) - 1
    gaps = pa.Array.from_buffers(
        pa.binary(),
        pieces,
        [None, pa.py_buffer(bounds.astype(np.int32)), pa.py_buffer(gap_bytes)],
    )
    # the order to take them in, record by record
    arrays = [gaps]
    order = [np.arange(0, cuts * n, cuts)]
    if has_keys:
        order += [pieces + np.arange(n), np.arange(1, 2 * n, 2)]
        arrays.append(keys)
    order.append(sum(len(x) for x in arrays) + np.arange(n))
    arrays.append(values)
    if not plain_tail:
        order.append(sum(len(x) for x in arrays) + np.arange(n))
        arrays.append(suffix)
    index = np.stack(order, axis=1).ravel()
    if plain_tail:
        index = np.append(index, pieces - 1)
    joined = pa.concat_arrays(arrays).take(pa.array(index))
    offsets = _offsets(joined)
    start, end = int(offsets[0]), int(offsets[-1])
    return joined.buffers()[2].slice(start, end - start)


def _records_one_by_one(rb: pa.RecordBatch, first_timestamp: int) -> bytes:
    """The Kafka records of ``rb``, one record at a time (small batches)."""
    stamps = rb.column(1).cast(pa.int64()).to_pylist()
    keys = rb.column(2).to_pylist()
    values = rb.column(3).to_pylist()
    headers = rb.column(4).to_pylist()
    tags = rb.column(5).to_pylist()
    tag_key = TAG_HEADER.encode()
    out: list[bytes] = []
    for i, (ts, key, value) in enumerate(zip(stamps, keys, values, strict=True)):
        hs = headers[i] or ()
        tg = tags[i] or ()
        parts = [b"\x00", write_varint(ts - first_timestamp), write_varint(i)]
        parts += [b"\x01"] if key is None else [write_varint(len(key)), key]
        parts += [b"\x01"] if value is None else [write_varint(len(value)), value]
        parts.append(write_varint(len(hs) + len(tg)))
        for pair in hs:
            k = pair["key"].encode()
            v = pair["value"]
            parts += [write_varint(len(k)), k, write_varint(len(v)), v]
        for t in tg:
            tb = t.encode()
            parts += [write_varint(len(tag_key)), tag_key, write_varint(len(tb)), tb]
        body = b"".join(parts)
        out += [write_varint(len(body)), body]
    return b"".join(out)


def _offsets(arr: pa.Array) -> np.ndarray:
    """The int32 offsets of a binary or list array (its length + 1), without a copy."""
    return np.frombuffer(
        arr.buffers()[1], dtype=np.int32, count=len(arr) + 1, offset=arr.offset * 4
    )


def _int64s(arr: pa.Array) -> np.ndarray:
    """The values of a non-null 64-bit array (int64, timestamp), without a copy."""
    return np.frombuffer(arr.buffers()[1], dtype=np.int64, count=len(arr), offset=arr.offset * 8)


def _lengths(arr: pa.Array) -> np.ndarray:
    """Byte length of each value (-1 for null) of a binary array."""
    n = len(arr)
    nulls = arr.null_count
    if nulls == n:
        return np.full(n, -1, dtype=np.int64)
    out = np.diff(_offsets(arr)).astype(np.int64)
    if nulls:
        bits = np.frombuffer(arr.buffers()[0], dtype=_U8)
        valid = np.unpackbits(bits, count=arr.offset + n, bitorder="little")[arr.offset :]
        out[valid == 0] = -1
    return out


def _header_suffixes(rb: pa.RecordBatch, n: int) -> pa.Array | None:
    """Per record: header count and headers (Strata's headers, then its tags as
    ``strata.tag`` headers), or None when no record has either."""
    headers = rb.column(4)
    tags = rb.column(5)
    h_off = _offsets(headers)
    t_off = _offsets(tags)
    if h_off[-1] == h_off[0] and t_off[-1] == t_off[0]:
        return None
    out = []
    tag_key = TAG_HEADER.encode()
    for hs, tg in zip(headers.to_pylist(), tags.to_pylist(), strict=True):
        parts = [write_varint(len(hs) + len(tg))]
        for pair in hs:
            k = pair["key"].encode()
            v = pair["value"]
            parts += [write_varint(len(k)), k, write_varint(len(v)), v]
        for t in tg:
            tb = t.encode()
            parts += [write_varint(len(tag_key)), tag_key, write_varint(len(tb)), tb]
        out.append(b"".join(parts))
    return pa.array(out, pa.binary())


def strata_batches_to_kafka(buf: Any) -> list[Any]:
    """Every whole Strata batch in ``buf`` (a fetch's records), as Kafka batches' parts."""
    view = memoryview(buf).cast("B") if not isinstance(buf, pa.Buffer) else buf
    parts: list[Any] = []
    pos = 0
    end = len(view)
    while pos < end:
        got, size = strata_to_kafka(view, pos)
        parts.extend(got)
        pos += size
    return parts


# ---- building Kafka batches (tests, tools) ---------------------------------------------------
def build_kafka_batch(
    records: Sequence[tuple[bytes | None, bytes | None, Sequence[tuple[str, bytes | None]]]],
    *,
    base_timestamp: int,
    timestamps: Sequence[int] | None = None,
    codec: int = Codec.NONE,
    producer_id: int = -1,
    producer_epoch: int = -1,
    base_sequence: int = -1,
    base_offset: int = 0,
    leader_epoch: int = -1,
) -> bytes:
    """A Kafka batch of ``(key, value, headers)`` records, record by record (the format's
    reference encoder here; the agents convert with :func:`strata_to_kafka`)."""
    n = len(records)
    stamps = list(timestamps) if timestamps is not None else [base_timestamp] * n
    body = []
    for i, (key, value, headers) in enumerate(records):
        parts = [
            b"\x00",
            write_varint(stamps[i] - base_timestamp),
            write_varint(i),
            write_varint(-1 if key is None else len(key)),
            key or b"",
            write_varint(-1 if value is None else len(value)),
            value or b"",
            write_varint(len(headers)),
        ]
        for hk, hv in headers:
            kb = hk.encode()
            parts += [write_varint(len(kb)), kb, write_varint(-1 if hv is None else len(hv))]
            parts.append(hv or b"")
        rec = b"".join(parts)
        body.append(write_varint(len(rec)) + rec)
    raw = b"".join(body)
    data = raw if codec == Codec.NONE else compress(codec, raw)
    header = bytearray(
        HEADER.pack(
            base_offset,
            HEADER_SIZE - 12 + len(data),
            leader_epoch,
            MAGIC,
            0,
            codec,
            n - 1,
            base_timestamp,
            max(stamps) if stamps else base_timestamp,
            producer_id,
            producer_epoch,
            base_sequence,
            n,
        )
    )
    crc = crc32c(bytes(header[CRC_START:]) + data)
    CRC_FIELD.pack_into(header, CRC_OFFSET, crc)
    return bytes(header) + data
