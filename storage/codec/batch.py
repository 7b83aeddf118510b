"""Encode, check and decode whole record batches; walk buffers of batches laid end to end.

``encode_batch`` is what a producer calls once per batch. ``check_batch`` is what a leader
calls before appending (header sanity, exact length, size limit, CRC32C, body layout) and is
O(1) in the number of records. ``decode_batch`` turns a batch into an Arrow record batch.
``BatchFramer`` is the incremental (sans-IO) splitter: feed it bytes as they arrive, take out
whole batches.
"""

from __future__ import annotations

import contextlib
import struct
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa

from storage.codec import kafka_body, summary
from storage.codec.body import (
    DIRECTORY,
    DIRECTORY_SIZE,
    N_BUFFERS,
    SCHEMA,
    SMALL_BATCH,
    check_flat_body,
    check_small_body,
    decode_body,
    encode_body,
    raw_body_length,
)
from storage.codec.header import (
    ALIGNMENT,
    ATTR_CONTROL,
    ATTR_TRANSACTIONAL,
    CRC_FIELD,
    CRC_OFFSET,
    CRC_START,
    ENCODINGS,
    HEADER,
    HEADER_SIZE,
    MAGIC,
    MAGIC_V1,
    MAX_BATCH_SIZE,
    BatchHeader,
    Compression,
    padded,
    peek_size,
    read_header,
)
from storage.codec.parts import BatchParts
from storage.crc import crc32c
from storage.errors import BatchTooLargeError, CorruptBatchError

_CODEC_NAMES = {Compression.ZSTD: "zstd", Compression.LZ4: "lz4_raw"}
_codecs: dict[Compression, pa.Codec] = {}
#: a decoder refuses to inflate a body beyond this, whatever the header claims
MAX_RAW_BODY = 256 << 20
_PAD = bytes(8)
#: a body up to this size is joined before its CRC is taken (a copy cheaper than the calls)
_JOIN_BELOW = 64 << 10
#: ``_TIMESTAMPS[n]`` packs n int64 timestamps, for short batches
_TIMESTAMPS = [struct.Struct(f"<{i}q") for i in range(SMALL_BATCH + 1)]


def _codec(c: Compression) -> pa.Codec:
    codec = _codecs.get(c)
    if codec is None:
        codec = _codecs[c] = pa.Codec(_CODEC_NAMES[c])
    return codec


def encode_batch(
    values: Any,
    *,
    keys: Any = None,
    timestamps: Any = None,
    headers: Any = None,
    tags: Any = None,
    compression: Compression = Compression.NONE,
    producer_id: int = -1,
    producer_epoch: int = -1,
    base_sequence: int = -1,
    transactional: bool = False,
    control: bool = False,
    base_offset: int = 0,
    leader_epoch: int = -1,
    summary: bool = True,
) -> bytes:
    """Encode records into one batch.

    ``values``: a sequence of ``bytes`` (or None) or a pyarrow binary/string array.
    ``keys``: same, or None for no keys. ``timestamps``: ms since the epoch, one int for all
    records, a sequence, or an int64 numpy array (default: now). ``headers``: per record a list
    of ``(str, bytes)`` pairs, or None. ``tags``: per record a list of ``str``, or None.
    ``summary``: write format version 2, with the summary of tags and headers that filters
    use (``storage.codec.summary``); False writes version 1, without one.
    """
    n = len(values)
    if n == 0:
        raise ValueError("a record batch holds at least one record")
    if base_offset < 0:
        raise ValueError(f"base_offset must not be negative, got {base_offset}")
    if timestamps is None:
        timestamps = time.time_ns() // 1_000_000
    ts: Any = None
    if isinstance(timestamps, int):
        ts = np.full(n, timestamps, dtype=np.int64)
        first_ts = max_ts = timestamps
    elif type(timestamps) is list and len(timestamps) == n <= SMALL_BATCH:
        # a short list of ints (most batches of a producer of many partitions): no numpy
        with contextlib.suppress(struct.error):  # not all ints: numpy's way below
            ts = _TIMESTAMPS[n].pack(*timestamps)
            first_ts, max_ts = timestamps[0], max(timestamps)
    if ts is None:
        ts = np.ascontiguousarray(timestamps, dtype=np.int64)
        if ts.shape != (n,):
            raise ValueError(f"{ts.shape} timestamps for {n} records")
        first_ts, max_ts = int(ts[0]), int(ts.max())
    parts, summary_bytes = encode_body(n, ts, keys, values, headers, tags, with_summary=summary)
    raw_len = raw_body_length(parts)
    if compression not in ENCODINGS:
        raise ValueError(f"cannot encode a body as {compression!r}")
    if compression != Compression.NONE:
        parts = [_codec(compression).compress(pa.py_buffer(b"".join(parts)), asbytes=True)]
        body_len = len(parts[0])
    else:
        body_len = raw_len
        if len(parts) > 2 and raw_len <= _JOIN_BELOW:
            # one CRC call instead of one per part (a small body is many small parts)
            parts = [b"".join(parts)]
    body_end = padded(HEADER_SIZE + body_len)
    if body_end != HEADER_SIZE + body_len:
        parts.append(_PAD[: body_end - HEADER_SIZE - body_len])
    summary_len = 0 if summary_bytes is None else len(summary_bytes)
    if summary_bytes is not None:
        parts.append(summary_bytes)
    total = body_end + summary_len
    if total > MAX_BATCH_SIZE:
        raise BatchTooLargeError(total, MAX_BATCH_SIZE)
    attributes = (
        int(compression)
        | (ATTR_TRANSACTIONAL if transactional else 0)
        | (ATTR_CONTROL if control else 0)
    )
    header = bytearray(
        HEADER.pack(
            base_offset,
            total - 12,
            leader_epoch,
            MAGIC if summary else MAGIC_V1,
            0,
            attributes,
            summary_len,
            n,
            first_ts,
            max_ts,
            producer_id,
            producer_epoch,
            base_sequence,
            body_len,
            raw_len,
        )
    )
    crc = crc32c(bytes(header[CRC_START:]))
    for p in parts:
        crc = crc32c(p if isinstance(p, bytes) else memoryview(p), crc)
    CRC_FIELD.pack_into(header, CRC_OFFSET, crc)
    return b"".join([header, *parts])


_PRODUCER_FIELDS = struct.Struct("<qh2xi")  # producer_id, producer_epoch, reserved, base_sequence
_PRODUCER_OFFSET = 48


def with_producer(batch: bytes, producer_id: int, producer_epoch: int, base_sequence: int) -> bytes:
    """The same batch under other producer fields, its CRC recomputed (one pass over the
    batch). An idempotent producer needs it only when it restarts a partition's sequences."""
    buf = bytearray(batch)
    _PRODUCER_FIELDS.pack_into(buf, _PRODUCER_OFFSET, producer_id, producer_epoch, base_sequence)
    CRC_FIELD.pack_into(buf, CRC_OFFSET, crc32c(memoryview(buf)[CRC_START:]))
    return bytes(buf)


def check_batch(
    buf: Any,
    pos: int = 0,
    *,
    max_size: int = MAX_BATCH_SIZE,
    exact: bool = True,
    deep: bool = False,
) -> BatchHeader:
    """Verify the batch at ``buf[pos:]``: header, size, CRC32C, padding and body directory.

    With ``exact``, ``buf[pos:]`` must be exactly one batch (what a produce request carries).
    Raises ``CorruptBatchError``, ``UnsupportedVersionError`` or ``BatchTooLargeError``; costs
    one CRC pass and no per-record work. With ``deep`` the body is also decompressed and every
    Arrow buffer validated in C++ (what a leader does before storing a producer's batch, so a
    well-checksummed but malformed batch can never poison a partition).
    """
    h = read_header(buf, pos)
    size = h.size
    available = len(buf) - pos
    if exact and available != size:
        raise CorruptBatchError(
            f"batch length field says {size} bytes but {available} were given", position=pos
        )
    if size > max_size:
        raise BatchTooLargeError(size, max_size)
    if available < size:
        raise CorruptBatchError(f"truncated batch: {available} of {size} bytes", position=pos)
    view = memoryview(buf)[pos + CRC_START : pos + size]
    if crc32c(view) != h.crc:
        raise CorruptBatchError("record batch CRC32C mismatch", position=pos)
    body_end = pos + HEADER_SIZE + h.body_length
    if any(memoryview(buf)[body_end : pos + h.summary_position]):
        raise CorruptBatchError("record batch padding is not zero", position=pos)
    if h.compression == Compression.NONE:
        if h.raw_body_length != h.body_length or h.body_length < DIRECTORY_SIZE:
            raise CorruptBatchError("uncompressed body length mismatch", position=pos)
        lengths = DIRECTORY.unpack_from(buf, pos + HEADER_SIZE)
        if (
            DIRECTORY_SIZE + sum(padded(x) for x in lengths[:N_BUFFERS]) != h.body_length
            or lengths[15]
        ):
            raise CorruptBatchError("body directory does not match the body length", position=pos)
        if lengths[0] != 8 * h.record_count:
            raise CorruptBatchError(
                "timestamp column does not match the record count", position=pos
            )
    elif h.compression == Compression.KAFKA:
        if deep:
            kafka_body.check(buf, pos, h)
        else:
            kafka_body.check_frame(buf, pos, h)
        return h
    elif h.raw_body_length > MAX_RAW_BODY:
        raise CorruptBatchError(
            f"compressed body claims {h.raw_body_length} bytes raw", position=pos
        )
    if deep:
        try:
            _check_deep(buf, pos, h, lengths if h.compression == Compression.NONE else None)
        except CorruptBatchError as exc:
            raise CorruptBatchError(exc.reason, position=pos) from None
    return h


def _check_deep(buf: Any, pos: int, h: BatchHeader, lengths: tuple[int, ...] | None) -> None:
    """The body validated and the summary checked against it. A summary that is byte for
    byte the one the encoder writes for these records (``summary.canonical``) is true without
    being parsed; any other is parsed and its counts compared (a producer may leave out
    what it likes, ``summary.verify``)."""
    n = h.record_count
    if lengths is not None and not any(lengths[7:N_BUFFERS]):
        check_flat_body(buf, pos + HEADER_SIZE, lengths, n)
        if h.magic == MAGIC and not summary.is_canonical(buf, pos, h, summary.empty(n)):
            said = summary.of_batch(buf, pos, h)
            if said is not None and (said.untagged != n or said.tags or said.headers):
                raise CorruptBatchError(
                    "the batch summary lists tags or headers the body does not have"
                )
        return
    small = None if lengths is None else check_small_body(buf, pos + HEADER_SIZE, lengths, n)
    if small is not None:
        if h.magic == MAGIC:
            counts = summary.count_small(n, *small)
            if not summary.is_canonical(buf, pos, h, summary.canonical(n, *counts)):
                said = summary.of_batch(buf, pos, h)
                assert said is not None
                summary.verify_counts(said, *counts)
        return
    rb = decode_body(_body(buf, pos, h), n, h.base_offset, validate=True)
    said = summary.of_batch(buf, pos, h)
    if said is not None:
        summary.verify(said, rb)


def _body(buf: Any, pos: int, h: BatchHeader) -> pa.Buffer:
    stored = pa.py_buffer(memoryview(buf)[pos + HEADER_SIZE : pos + HEADER_SIZE + h.body_length])
    if h.compression == Compression.NONE:
        return stored
    if h.raw_body_length > MAX_RAW_BODY:
        raise CorruptBatchError(
            f"compressed body claims {h.raw_body_length} bytes raw", position=pos
        )
    try:
        raw = _codec(h.compression).decompress(stored, decompressed_size=h.raw_body_length)
    except (OSError, pa.ArrowException) as exc:
        raise CorruptBatchError(
            f"cannot decompress record batch body: {exc}", position=pos
        ) from None
    if raw.size != h.raw_body_length:
        raise CorruptBatchError("decompressed body has the wrong length", position=pos)
    return raw


def decode_batch(buf: Any, pos: int = 0, *, verify: bool = True) -> pa.RecordBatch:
    """The records of the batch at ``buf[pos:]`` as an Arrow record batch (see ``body.SCHEMA``).

    With ``verify`` the CRC and the body are checked first; pass ``verify=False`` only for bytes
    this process has already checked. Arrays point into ``buf`` when it is uncompressed.
    """
    h = check_batch(buf, pos, exact=False) if verify else read_header(buf, pos)
    if h.compression == Compression.KAFKA:
        return kafka_body.decode(buf, pos, h)
    return decode_body(_body(buf, pos, h), h.record_count, h.base_offset, validate=verify)


def iter_batches(
    buf: Any, pos: int = 0, end: int | None = None
) -> Iterator[tuple[BatchHeader, int]]:
    """Walk whole batches laid end to end in ``buf[pos:end]``, yielding (header, position).

    Only headers are read (no CRC). Anything that is not a whole batch — a torn tail, trailing
    garbage — raises ``CorruptBatchError`` with its position once the batches before it are out.
    """
    end = len(buf) if end is None else end
    while pos < end:
        h = read_header(buf, pos)
        if pos + h.size > end:
            raise CorruptBatchError(f"truncated batch: {end - pos} of {h.size} bytes", position=pos)
        yield h, pos
        pos += h.size


def batch_headers(records: Any) -> Iterator[BatchHeader]:
    """The headers of the batches in a produce's ``records``: whole batches laid end to end
    in one buffer (``iter_batches``, which raises for a torn one), or one ``BatchParts``."""
    if isinstance(records, BatchParts):
        yield records.header
        return
    for h, _ in iter_batches(records):
        yield h


def decode_batches(buf: Any, *, verify: bool = True) -> pa.Table:
    """All records of the whole batches in ``buf``, as one table (one chunk per batch)."""
    batches = [decode_batch(buf, p, verify=verify) for _, p in iter_batches(buf)]
    return pa.Table.from_batches(batches, schema=SCHEMA)


class BatchFramer:
    """Incremental splitter of a byte stream into whole batches (sans-IO).

    ``feed(data)`` adds bytes; ``next_batch()`` returns the next whole batch as bytes, or None
    if more bytes are needed. ``buffered`` is bounded by ``max_batch_size``: a length field
    beyond it raises at once instead of buffering toward it.
    """

    def __init__(self, *, max_batch_size: int = MAX_BATCH_SIZE) -> None:
        self._buf = bytearray()
        self._pos = 0
        self._max = max_batch_size
        self.consumed = 0

    @property
    def buffered(self) -> int:
        return len(self._buf) - self._pos

    def feed(self, data: Any) -> None:
        if self._pos and self._pos * 2 > len(self._buf):
            del self._buf[: self._pos]
            self._pos = 0
        self._buf += data

    def next_batch(self) -> bytes | None:
        size = peek_size(self._buf, self._pos)
        if size is None:
            return None
        if size < HEADER_SIZE or size % 8:
            raise CorruptBatchError(f"batch length field says {size} bytes", position=self.consumed)
        if size > self._max:
            raise BatchTooLargeError(size, self._max)
        if self.buffered < size:
            if self.buffered >= HEADER_SIZE:
                read_header(self._buf, self._pos)  # fail early on a garbage header
            return None
        batch = bytes(self._buf[self._pos : self._pos + size])
        try:
            check_batch(batch)
        except CorruptBatchError as exc:
            raise CorruptBatchError(exc.reason, position=self.consumed) from None
        self._pos += size
        self.consumed += size
        return batch

    def close(self) -> None:
        """End of input: anything left over is a torn batch."""
        if self.buffered:
            raise CorruptBatchError(
                f"{self.buffered} bytes of a torn batch at end of input", position=self.consumed
            )


class CrcVerifier:
    """Checks the CRC32C of each batch of a byte stream as the stream goes by, without holding
    on to it (sans-IO): ``feed`` it the stream's bytes in order, from position ``start``;
    checking begins at ``boundary`` (a batch boundary at or after ``start``; the bytes before
    it are skipped).

    ``verified`` is the stream position up to which every batch from ``boundary`` on was whole
    and intact. Checking stops for good at the first batch whose length field or CRC is wrong
    (``verified`` stays at its start): whoever reads those bytes checks them itself
    (``check_batch``) and reports the error. Only the CRC and the length field are looked at
    here; a reader still parses each header it serves (``read_header``).
    """

    __slots__ = ("_crc", "_end", "_expect", "_head", "_pos", "boundary", "stopped", "verified")

    def __init__(self, start: int, boundary: int) -> None:
        if boundary < start:
            raise ValueError(f"boundary {boundary} before the stream's start {start}")
        self.boundary = boundary
        self.verified = boundary
        self.stopped = False
        self._pos = start  # stream position of the next byte fed
        self._end = boundary  # end of the batch being checked (at it: a header comes next)
        self._head = bytearray()  # the first CRC_START bytes of the next batch, as they come
        self._crc = 0
        self._expect = 0

    def covers(self, start: int, end: int) -> bool:
        """Whether every batch in ``[start, end)`` (whole batches) has been checked."""
        return self.boundary <= start and end <= self.verified

    def feed(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        n = len(view)
        i = 0
        if self._pos < self.boundary:  # skip up to the first batch boundary
            i = min(n, self.boundary - self._pos)
            self._pos += i
        while i < n and not self.stopped:
            if self._pos == self._end:  # a batch header: its length and CRC fields
                take = min(CRC_START - len(self._head), n - i)
                self._head += view[i : i + take]
                i += take
                if len(self._head) < CRC_START:
                    break
                size = peek_size(self._head)
                assert size is not None  # the length field is within the first CRC_START bytes
                if size < HEADER_SIZE or size % ALIGNMENT or size > MAX_BATCH_SIZE:
                    self.stopped = True
                    break
                self._expect = CRC_FIELD.unpack_from(self._head, CRC_OFFSET)[0]
                self._end = self._pos + size
                self._pos += CRC_START
                self._head.clear()
                self._crc = 0
            take = min(self._end - self._pos, n - i)
            self._crc = crc32c(view[i : i + take], self._crc)
            i += take
            self._pos += take
            if self._pos == self._end:
                if self._crc != self._expect:
                    self.stopped = True
                    break
                self.verified = self._pos
        self._pos += n - i  # past a stop: only the position moves
