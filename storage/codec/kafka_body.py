"""Body encoding 3 (``Compression.KAFKA``): a Kafka v2 record batch kept as its producer sent it.

A Kafka client's produce is stored without conversion when its batch is uncompressed, has
no record headers and uses create time: the Strata batch is the usual 72-byte header, then
the whole Kafka batch (its own 61-byte header and records, byte for byte), zero padding, and
the 8-byte summary of ``n`` records without tags or headers::

    Strata header (72) | Kafka batch (body_length = raw_body_length) | 0-7 zero | summary (8)

The Strata header says what every reader needs without the body: record count, first and
largest record timestamps, producer id, epoch, base sequence and the transactional bit,
all equal to what the Kafka batch says (``check`` proves it). The Kafka batch's own base
offset and partition leader epoch stay as the producer sent them; the Strata header's are
the truth, and ``kafka_parts`` stamps them when the batch goes back to a Kafka client.

Costs, against converting to the columnar body: a produce pays the Kafka CRC, one walk of
the records (``storage.kafka.batch.scan_records``: the one Python loop per record, then
numpy) and the Strata CRC, and copies nothing (``frame_parts``: the log writes the pieces
side by side, ``storage.codec.parts``); a Kafka consumer gets
the stored bytes behind a 16-byte prefix; a Strata reader (SDK consumer, replay, Spark)
gathers keys and values into Arrow arrays (``decode``: one walk and two Arrow ``take`` s)
where a columnar body would be pointed at. A batch with headers, compressed, or with
log-append time is converted as before (``storage.kafka.records.kafka_to_strata``).
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
import pyarrow as pa

from storage.codec import summary
from storage.codec.body import SCHEMA, TIMESTAMP_TYPE, no_headers_or_tags
from storage.codec.header import (
    ATTR_TRANSACTIONAL,
    CRC_FIELD,
    CRC_OFFSET,
    CRC_START,
    HEADER,
    HEADER_SIZE,
    MAGIC,
    BatchHeader,
    Compression,
    padded,
    read_header,
)
from storage.codec.parts import BatchParts
from storage.crc import crc32c, crc32c_combine
from storage.errors import CorruptBatchError, UnsupportedVersionError
from storage.kafka import batch as kb

_PAD = bytes(8)
_STAMP = struct.Struct(">qii")  # a Kafka batch's base_offset, batch_length, leader epoch
#: Kafka attribute bits a stored Kafka batch may have (codec none, create time)
_KAFKA_ALLOWED = kb.ATTR_TRANSACTIONAL


def storable(kh: kb.KafkaBatchHeader) -> bool:
    """Whether a checked Kafka batch with this header may be kept as it came (given that its
    records carry no headers): uncompressed, create time, not a control batch."""
    return not kh.attributes & ~_KAFKA_ALLOWED


def frame(kafka: Any, kh: kb.KafkaBatchHeader, first_timestamp: int, max_timestamp: int) -> bytes:
    """The Strata batch holding the Kafka batch ``kafka`` (header ``kh``, already checked and
    walked: ``storable``, no record headers) whose records' timestamps run from
    ``first_timestamp`` (the first record's) to at most ``max_timestamp``, as one buffer."""
    return frame_parts(kafka, kh, first_timestamp, max_timestamp).tobytes()


def frame_parts(
    kafka: Any,
    kh: kb.KafkaBatchHeader,
    first_timestamp: int,
    max_timestamp: int,
    *,
    kafka_crc: int | None = None,
) -> BatchParts:
    """:func:`frame` as its three pieces (header, ``kafka`` itself, padding and summary),
    for the log to write side by side: the Kafka batch is not copied to join them.

    ``kafka_crc``: the CRC32C of ``kafka`` from byte 21 on (Kafka's own CRC field), when
    the caller has just computed it over these bytes to check them; the Strata CRC then
    combines it (``crc32c_combine``) instead of passing over the batch a second time."""
    size = len(kafka)
    n = kh.records_count
    pad = padded(HEADER_SIZE + size) - HEADER_SIZE - size
    tail = _PAD[:pad] + summary.empty(n)
    attributes = Compression.KAFKA | (
        ATTR_TRANSACTIONAL if kh.attributes & kb.ATTR_TRANSACTIONAL else 0
    )
    header = bytearray(
        HEADER.pack(
            0,
            HEADER_SIZE + size + len(tail) - 12,
            0,
            MAGIC,
            0,
            attributes,
            len(tail) - pad,
            n,
            first_timestamp,
            max_timestamp,
            kh.producer_id,
            kh.producer_epoch,
            kh.base_sequence,
            size,
            size,
        )
    )
    crc = crc32c(memoryview(header)[CRC_START:])
    if kafka_crc is None:
        crc = crc32c(kafka, crc)
    else:
        crc = crc32c(memoryview(kafka)[: kb.CRC_START], crc)
        crc = crc32c_combine(crc, kafka_crc, size - kb.CRC_START)
    CRC_FIELD.pack_into(header, CRC_OFFSET, crc32c(tail, crc))
    return BatchParts(read_header(header), (bytes(header), kafka, tail))


def _kafka(buf: Any, pos: int, h: BatchHeader) -> tuple[memoryview, kb.KafkaBatchHeader]:
    view = memoryview(buf).cast("B")[pos + HEADER_SIZE : pos + HEADER_SIZE + h.body_length]
    try:
        kh = kb.read_header(view)
    except (CorruptBatchError, UnsupportedVersionError) as exc:
        raise CorruptBatchError(f"stored Kafka batch: {exc}", position=pos) from None
    if kh.size != len(view):
        raise CorruptBatchError(
            f"stored Kafka batch says {kh.size} bytes, the body holds {len(view)}", position=pos
        )
    return view, kh


def check_frame(buf: Any, pos: int, h: BatchHeader) -> None:
    """The check every read makes (no per-record work): the body is one Kafka batch."""
    _kafka(buf, pos, h)


def check(buf: Any, pos: int, h: BatchHeader) -> None:
    """The deep check of a batch with a Kafka body (its Strata CRC already checked): the
    Kafka batch's CRC, its header against the Strata header, and every record walked."""
    view, kh = _kafka(buf, pos, h)
    if crc32c(view[kb.CRC_START :]) != kh.crc:
        raise CorruptBatchError("stored Kafka batch CRC32C mismatch", position=pos)
    if (
        not storable(kh)
        or bool(kh.attributes & kb.ATTR_TRANSACTIONAL) != h.is_transactional
        or kh.records_count != h.record_count
        or kh.last_offset_delta != h.record_count - 1
        or (kh.producer_id, kh.producer_epoch, kh.base_sequence)
        != (h.producer_id, h.producer_epoch, h.base_sequence)
    ):
        raise CorruptBatchError(
            "stored Kafka batch's header does not match the batch header", position=pos
        )
    said = summary.of_batch(buf, pos, h)
    if said is None or said.untagged != h.record_count or said.tags or said.headers:
        raise CorruptBatchError(
            "a batch with a Kafka body has no tags or headers: its summary says otherwise",
            position=pos,
        )
    try:
        scan = kb.scan_records(view[kb.HEADER_SIZE :], h.record_count)
    except CorruptBatchError as exc:
        raise CorruptBatchError(f"stored Kafka batch: {exc.reason}", position=pos) from None
    if scan.has_headers:
        raise CorruptBatchError("a stored Kafka batch's records carry headers", position=pos)
    first, largest = timestamps(kh, scan)
    if (first, largest, largest) != (h.first_timestamp, h.max_timestamp, kh.max_timestamp):
        raise CorruptBatchError(
            f"batch header says timestamps {h.first_timestamp}..{h.max_timestamp} (the Kafka"
            f" batch's largest {kh.max_timestamp}), its records {first}..{largest}",
            position=pos,
        )


def timestamps(kh: kb.KafkaBatchHeader, scan: kb.Scan) -> tuple[int, int]:
    """(the first record's timestamp, the largest) of a walked Kafka batch."""
    base = kh.base_timestamp
    return base + int(scan.timestamp_delta[0]), base + int(scan.timestamp_delta.max())


def decode(buf: Any, pos: int, h: BatchHeader) -> pa.RecordBatch:
    """The records of a batch with a Kafka body, as ``body.SCHEMA`` columns (keys and values
    gathered into new buffers; the walk checks every record's framing as it goes)."""
    view, kh = _kafka(buf, pos, h)
    n = h.record_count
    try:
        cols = kb.parse_records(view[kb.HEADER_SIZE :], n)
    except CorruptBatchError as exc:
        raise CorruptBatchError(f"stored Kafka batch: {exc.reason}", position=pos) from None
    if cols.headers is not None:
        raise CorruptBatchError("a stored Kafka batch's records carry headers", position=pos)
    ts = cols.timestamp_delta + np.int64(kh.base_timestamp)
    keys = cols.keys if cols.keys is not None else pa.nulls(n, pa.binary())
    columns = [
        pa.array(np.arange(h.base_offset, h.base_offset + n, dtype=np.int64)),
        pa.Array.from_buffers(TIMESTAMP_TYPE, n, [None, pa.py_buffer(ts)], null_count=0),
        keys,
        cols.values,
        *no_headers_or_tags(n),
    ]
    return pa.RecordBatch.from_arrays(columns, schema=SCHEMA)


def kafka_parts(buf: Any, pos: int, h: BatchHeader) -> list[Any]:
    """The stored Kafka batch as a Kafka fetch answers it: its first 16 bytes (outside the
    Kafka CRC) stamped with the batch's offset and leader epoch, then the rest as stored."""
    view = memoryview(buf).cast("B")[pos + HEADER_SIZE : pos + HEADER_SIZE + h.body_length]
    return [_STAMP.pack(h.base_offset, h.body_length - 12, h.leader_epoch), view[16:]]
