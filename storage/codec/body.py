"""The record-batch body: columns laid out as Arrow buffers, so decoding is pointer arithmetic.

A body holds ``n`` records (``n`` = the header's record_count) as 15 buffers, each starting on
an 8-byte boundary, behind a directory of their lengths::

    directory      16 x uint32   byte length of buffers 0..14; slot 15 reserved (0)
    0  timestamps          int64[n]        ms since the epoch
    1  key validity        bitmap          Arrow LSB bit order; empty = no null keys
    2  key offsets         int32[n+1]      empty = every key is empty (data must be empty)
    3  key data            bytes
    4  value validity      bitmap          empty = no null values
    5  value offsets       int32[n+1]      empty = every value is empty
    6  value data          bytes
    7  header list offsets int32[n+1]      index into the header pairs; empty = no headers
    8  header key offsets  int32[h+1]      h = header list offsets[n]
    9  header key data     utf-8
    10 header value offsets int32[h+1]
    11 header value data   bytes
    12 tag list offsets    int32[n+1]      index into the tags; empty = no tags
    13 tag offsets         int32[t+1]      t = tag list offsets[n]
    14 tag data            utf-8

The raw body is ``64 + sum(padded(len_i))`` bytes. Offsets start at 0 and are Arrow's, so a
decoder hands the buffers to ``pyarrow.Array.from_buffers`` without touching a record, and
Arrow's C++ ``validate(full=True)`` proves offsets monotonic and in bounds and strings UTF-8.
The encoder builds the same buffers with ``pyarrow.array`` (C++ loops) from what the caller
handed in; no Python code runs per record on either side.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from itertools import accumulate
from operator import le
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa

from storage.codec import summary
from storage.codec.header import padded
from storage.errors import CorruptBatchError

DIRECTORY = struct.Struct("<16I")
DIRECTORY_SIZE = DIRECTORY.size
N_BUFFERS = 15

HEADER_PAIR = pa.struct(
    [pa.field("key", pa.string(), nullable=False), pa.field("value", pa.binary(), nullable=False)]
)
HEADERS_TYPE = pa.list_(pa.field("item", HEADER_PAIR, nullable=False))
TAGS_TYPE = pa.list_(pa.field("item", pa.string(), nullable=False))
TIMESTAMP_TYPE = pa.timestamp("ms", tz="UTC")

#: the columns a decoded batch has, in order
SCHEMA = pa.schema(
    [
        pa.field("offset", pa.int64(), nullable=False),
        pa.field("timestamp", TIMESTAMP_TYPE, nullable=False),
        pa.field("key", pa.binary()),
        pa.field("value", pa.binary()),
        pa.field("headers", HEADERS_TYPE, nullable=False),
        pa.field("tags", TAGS_TYPE, nullable=False),
    ]
)

_EMPTY = b""
_PAD = bytes(8)


# ---------------------------------------------------------------------------------------------
# encoding


def _as_array(values: Any, type_: pa.DataType) -> pa.Array:
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    if isinstance(values, pa.Array):
        return values if values.type == type_ else values.cast(type_)
    return pa.array(values, type=type_)


def _binary_parts(arr: pa.Array, n: int, *, implicit: bool = True) -> tuple[Any, Any, Any]:
    """(validity, offsets, data) of a binary array of length n, rebased to offset 0.

    With ``implicit``, an all-empty column gets no offsets buffer (the decoder synthesises one).
    """
    if len(arr) != n:
        raise ValueError(f"column has {len(arr)} entries, expected {n}")
    if arr.type != pa.binary():
        arr = arr.cast(pa.binary())
    _, offsets_buf, data_buf = arr.buffers()
    offsets = np.frombuffer(offsets_buf, dtype=np.int32, count=n + 1, offset=arr.offset * 4)
    first, last = int(offsets[0]), int(offsets[n])
    validity: Any = _EMPTY
    if arr.null_count:
        validity = np.packbits(arr.is_valid().to_numpy(zero_copy_only=False), bitorder="little")
    if last == first and implicit:
        return validity, _EMPTY, _EMPTY
    if first:
        offsets = offsets - np.int32(first)
    data = data_buf.slice(first, last - first) if last > first else _EMPTY
    return validity, offsets, data


def _list_child(arr: pa.Array | None, n: int) -> tuple[Any, pa.Array | None]:
    """(list offsets rebased to 0, the child values they index) of a list array of length n."""
    if arr is None:
        return _EMPTY, None
    if len(arr) != n:
        raise ValueError(f"column has {len(arr)} entries, expected {n}")
    offsets = np.frombuffer(arr.buffers()[1], dtype=np.int32, count=n + 1, offset=arr.offset * 4)
    first, last = int(offsets[0]), int(offsets[n])
    if last == first:
        return _EMPTY, None
    if first:
        offsets = offsets - np.int32(first)
    return offsets, arr.values.slice(first, last - first)


#: up to this many records, plain lists of bytes are laid out without pyarrow (whose
#: per-call overhead is most of the cost of encoding one record: a producer with linger 0)
SMALL_BATCH = 64
_BYTES_OR_NONE = frozenset({bytes, type(None)})
#: ``_OFFSETS[n]`` packs or unpacks the n + 1 int32 offsets of n entries, for small n
_OFFSETS = [struct.Struct(f"<{i + 1}i") for i in range(SMALL_BATCH + 1)]


def _small_binary_parts(col: list[bytes | None], n: int) -> tuple[Any, Any, Any]:
    """``_binary_parts(pa.array(col, pa.binary()), n)`` for a short list of bytes/None."""
    if len(col) != n:
        raise ValueError(f"column has {len(col)} entries, expected {n}")
    validity: Any = _EMPTY
    if None in col:
        bits = 0
        for i, v in enumerate(col):
            if v is not None:
                bits |= 1 << i
        validity = bits.to_bytes((n + 7) // 8, "little")
    data = b"".join([v for v in col if v])
    if not data:
        return validity, _EMPTY, _EMPTY
    offsets = _OFFSETS[n].pack(0, *accumulate([len(v) if v else 0 for v in col]))
    return validity, offsets, data


def _small(col: Any) -> bool:
    return type(col) is list and len(col) <= SMALL_BATCH and set(map(type, col)) <= _BYTES_OR_NONE


def encode_body(
    n: int,
    timestamps: np.ndarray | bytes,
    keys: Any,
    values: Any,
    headers: Any,
    tags: Any,
    *,
    with_summary: bool = False,
) -> tuple[list[Any], bytes | None]:
    """The raw body as a list of buffer-protocol parts (directory first, padding included),
    and with ``with_summary`` its records' summary (``storage.codec.summary``).
    ``timestamps``: an int64 array, or their bytes (little-endian int64s)."""
    if isinstance(timestamps, bytes):
        if len(timestamps) != 8 * n:
            raise ValueError(f"{len(timestamps) // 8} timestamps for {n} records")
    elif timestamps.shape != (n,):
        raise ValueError(f"{timestamps.shape[0]} timestamps for {n} records")
    if keys is None:
        key_parts: tuple[Any, Any, Any] = (bytes((n + 7) // 8), _EMPTY, _EMPTY)  # all null
    elif _small(keys):
        key_parts = _small_binary_parts(keys, n)
    else:
        key_parts = _binary_parts(_as_array(keys, pa.binary()), n)
    if _small(values):
        value_parts = _small_binary_parts(values, n)
    else:
        value_parts = _binary_parts(_as_array(values, pa.binary()), n)

    small_headers = None if headers is None else _small_headers(headers, n)
    small_tags = None if tags is None else _small_tags(tags, n)
    if (
        (headers is None or small_headers is not None)
        and (tags is None or small_tags is not None)
        and len(small_headers[1] if small_headers else ())
        + len(small_tags[1] if small_tags else ())
        <= summary.SMALL
    ):
        return _small_body(
            n, timestamps, key_parts, value_parts, small_headers, small_tags, with_summary
        )

    header_list, pairs = _list_child(
        None if headers is None else _as_array(headers, HEADERS_TYPE), n
    )
    if pairs is None:
        header_parts: tuple[Any, ...] = (_EMPTY,) * 5
    else:
        if pairs.null_count:
            raise ValueError("a header pair may not be null")
        hkeys, hvalues = pairs.flatten()
        h = len(pairs)
        if hkeys.null_count or hvalues.null_count:
            raise ValueError("header keys and values may not be null (use b'' for an empty value)")
        _, hko, hkd = _binary_parts(hkeys, h, implicit=False)
        _, hvo, hvd = _binary_parts(hvalues, h, implicit=False)
        header_parts = (header_list, hko, hkd, hvo, hvd)

    tag_list, tag_values = _list_child(None if tags is None else _as_array(tags, TAGS_TYPE), n)
    if tag_values is None:
        tag_parts: tuple[Any, ...] = (_EMPTY,) * 3
    else:
        if tag_values.null_count:
            raise ValueError("a tag may not be null")
        _, to, td = _binary_parts(tag_values, len(tag_values), implicit=False)
        tag_parts = (tag_list, to, td)

    parts = _lay_out((timestamps, *key_parts, *value_parts, *header_parts, *tag_parts))
    if not with_summary:
        return parts, None
    if tag_values is None and pairs is None:
        return parts, summary.empty(n)
    built = summary.build(n, tag_list, tag_values, header_list, pairs)
    return parts, summary.encode(built)


def _lay_out(buffers: Sequence[Any]) -> list[Any]:
    """The body's parts: the directory of buffer lengths, then each buffer padded to 8."""
    lengths = list(map(_nbytes, buffers))
    parts: list[Any] = [DIRECTORY.pack(*lengths, 0)]
    for buf, length in zip(buffers, lengths, strict=True):
        if length:
            parts.append(buf)
            if length & 7:
                parts.append(_PAD[: 8 - (length & 7)])
    return parts


def _small_headers(headers: Any, n: int) -> tuple[list[int], list[bytes], list[bytes]] | None:
    """(list offsets, keys, values) of a short plain list of records' header lists of
    ``(str, bytes)`` tuples; None for anything else, which goes the pyarrow way (and is
    validated there)."""
    if type(headers) is not list or len(headers) != n or n > SMALL_BATCH:
        return None
    offsets = [0]
    keys: list[bytes] = []
    values: list[bytes] = []
    for record in headers:
        if record is not None:
            if type(record) is not list and type(record) is not tuple:
                return None
            for pair in record:
                if type(pair) is not tuple or len(pair) != 2:
                    return None
                key, value = pair
                if type(key) is not str or type(value) is not bytes:
                    return None
                keys.append(key.encode())
                values.append(value)
        offsets.append(len(keys))
    return offsets, keys, values


def _small_tags(tags: Any, n: int) -> tuple[list[int], list[bytes]] | None:
    """(list offsets, tags) of a short plain list of records' tag lists of ``str``; None for
    anything else."""
    if type(tags) is not list or len(tags) != n or n > SMALL_BATCH:
        return None
    offsets = [0]
    names: list[bytes] = []
    for record in tags:
        if record is not None:
            if type(record) is not list and type(record) is not tuple:
                return None
            for tag in record:
                if type(tag) is not str:
                    return None
                names.append(tag.encode())
        offsets.append(len(names))
    return offsets, names


def _int32s(values: list[int]) -> bytes:
    return struct.pack(f"<{len(values)}i", *values)


def _flat_parts(items: list[bytes]) -> tuple[bytes, bytes]:
    """(offsets, data) of a child column of ``len(items)`` values (offsets always written)."""
    return _int32s([0, *accumulate(map(len, items))]), b"".join(items)


def _small_body(
    n: int,
    timestamps: np.ndarray | bytes,
    key_parts: tuple[Any, Any, Any],
    value_parts: tuple[Any, Any, Any],
    headers: tuple[list[int], list[bytes], list[bytes]] | None,
    tags: tuple[list[int], list[bytes]] | None,
    with_summary: bool,
) -> tuple[list[Any], bytes | None]:
    """``encode_body``'s result, laid out without pyarrow, for records whose headers and tags
    are each either absent (any number of records: nothing to lay out) or a short plain list
    (at most ``SMALL_BATCH`` records; pyarrow's per-call cost was most of a one-record batch
    with headers: the retry router's and the delay scheduler's outputs). Byte for byte the
    same body as the pyarrow path."""
    header_parts: tuple[Any, ...] = (_EMPTY,) * 5
    if headers is not None and headers[1]:
        offsets, keys, values = headers
        header_parts = (_int32s(offsets), *_flat_parts(keys), *_flat_parts(values))
    tag_parts: tuple[Any, ...] = (_EMPTY,) * 3
    if tags is not None and tags[1]:
        tag_parts = (_int32s(tags[0]), *_flat_parts(tags[1]))
    parts = _lay_out((timestamps, *key_parts, *value_parts, *header_parts, *tag_parts))
    if not with_summary:
        return parts, None
    header_offsets, keys, values = headers if headers is not None and headers[1] else ([], [], [])
    tag_offsets, names = tags if tags is not None and tags[1] else ([], [])
    if not keys and not names:
        return parts, summary.empty(n)
    built = summary.build_small(n, tag_offsets, names, header_offsets, keys, values)
    return parts, summary.encode(built)


def _nbytes(buf: Any) -> int:
    """Bytes in one buffer (``len`` for bytes, the most of them, ``nbytes`` for the others)."""
    return len(buf) if type(buf) is bytes else memoryview(buf).nbytes


def raw_body_length(parts: Sequence[Any]) -> int:
    return sum(map(_nbytes, parts))


# ---------------------------------------------------------------------------------------------
# decoding

_zero_offsets = pa.py_buffer(bytes(4 * 1025))
_NO_BUFFER = pa.py_buffer(b"")


def _zeros(n: int) -> pa.Buffer:
    global _zero_offsets
    need = 4 * (n + 1)
    if _zero_offsets.size < need:
        _zero_offsets = pa.py_buffer(bytes(max(need, 2 * _zero_offsets.size)))
    return _zero_offsets.slice(0, need)


_EMPTY_STRINGS = pa.array([], pa.string())
_EMPTY_PAIRS = pa.array([], HEADER_PAIR)


def no_headers_or_tags(n: int) -> tuple[pa.Array, pa.Array]:
    """The ``headers`` and ``tags`` columns of ``n`` records that carry none."""
    return (
        pa.Array.from_buffers(
            HEADERS_TYPE, n, [None, _zeros(n)], null_count=0, children=[_EMPTY_PAIRS]
        ),
        pa.Array.from_buffers(
            TAGS_TYPE, n, [None, _zeros(n)], null_count=0, children=[_EMPTY_STRINGS]
        ),
    )


def _split(body: pa.Buffer) -> list[pa.Buffer]:
    if body.size < DIRECTORY_SIZE:
        raise CorruptBatchError(f"record batch body of {body.size} bytes has no directory")
    lengths = DIRECTORY.unpack_from(body)
    if lengths[15]:
        raise CorruptBatchError("reserved body directory slot is not zero")
    out = []
    pos = DIRECTORY_SIZE
    size = body.size
    for length in lengths[:N_BUFFERS]:
        end = pos + length
        if end > size:
            raise CorruptBatchError("body buffer runs past the end of the body")
        out.append(body.slice(pos, length))
        pos = padded(end)
    if pos != size:
        raise CorruptBatchError(f"body directory accounts for {pos} of {size} bytes")
    return out


def _binary(
    n: int,
    validity: pa.Buffer,
    offsets: pa.Buffer,
    data: pa.Buffer,
    what: str,
    string: bool = False,
    implicit: bool = True,
) -> pa.Array:
    """A binary/string array over the buffers; ``implicit`` allows an omitted all-zero offsets
    buffer (only for top-level columns, whose length the timestamp buffer already bounds)."""
    if validity.size and validity.size != (n + 7) // 8:
        raise CorruptBatchError(f"{what} validity bitmap has {validity.size} bytes for {n} records")
    if offsets.size == 0:
        if data.size:
            raise CorruptBatchError(f"{what} data without offsets")
        if n and not implicit:
            raise CorruptBatchError(f"{what} offsets missing for {n} entries")
        offsets = _zeros(n)
    elif offsets.size != 4 * (n + 1):
        raise CorruptBatchError(f"{what} offsets have {offsets.size} bytes for {n} entries")
    return pa.Array.from_buffers(
        pa.string() if string else pa.binary(),
        n,
        [validity if validity.size else None, offsets, data],
        null_count=-1 if validity.size else 0,
    )


def _list_length(offsets: pa.Buffer, n: int, what: str) -> int:
    if offsets.size == 0:
        return 0
    if offsets.size != 4 * (n + 1):
        raise CorruptBatchError(f"{what} list offsets have {offsets.size} bytes for {n} records")
    count = int(np.frombuffer(offsets, dtype=np.int32, count=1, offset=offsets.size - 4)[0])
    if count < 0:
        raise CorruptBatchError(f"{what} list offsets end at {count}")
    return count


_I32 = np.dtype("<i4")


def check_flat_body(buf: Any, start: int, lengths: Sequence[int], n: int) -> None:
    """What ``decode_body(..., validate=True)`` proves, for an uncompressed body whose header
    and tag buffers (7-14) are all empty — the common batch — in a few numpy calls instead of
    building Arrow arrays (~15 us instead of ~95 us per batch). ``buf[start:]`` is the body,
    ``lengths`` its directory, already checked against the body length (``check_batch``).

    Keys and values are binary, so what Arrow's full validation checks of them is the
    validity bitmap's size and, for the offsets, that they are ``n + 1`` int32 starting at 0
    or more, never decreasing, and ending within the data buffer.
    """
    pos = start + DIRECTORY_SIZE + padded(lengths[0])
    for what, (v, o, d) in (("key", lengths[1:4]), ("value", lengths[4:7])):
        if v and v != (n + 7) // 8:
            raise CorruptBatchError(f"{what} validity bitmap has {v} bytes for {n} records")
        at = pos + padded(v)
        if o == 0:
            if d:
                raise CorruptBatchError(f"{what} data without offsets")
        elif o != 4 * (n + 1):
            raise CorruptBatchError(f"{what} offsets have {o} bytes for {n} entries")
        else:
            if n < len(_OFFSETS):  # a few ints: cheaper in Python than numpy's call overhead
                small = _OFFSETS[n].unpack_from(buf, at)
                bad = small[0] < 0 or small[n] > d or list(small) != sorted(small)
            else:
                offsets = np.frombuffer(buf, dtype=_I32, count=n + 1, offset=at)
                bad = offsets[0] < 0 or offsets[n] > d or bool((np.diff(offsets) < 0).any())
            if bad:
                raise CorruptBatchError(
                    f"malformed record batch body: {what} offsets are not non-decreasing "
                    f"within [0, {d}]"
                )
        pos = at + padded(o) + padded(d)


class SmallLists(NamedTuple):
    """A small body's tags and header pairs as plain lists, the way ``summary.count_small``
    takes them (list offsets into the whole child lists)."""

    tag_offsets: list[int]
    tags: list[bytes]
    header_offsets: list[int]
    keys: list[bytes]
    values: list[bytes]


def _read_int32s(buf: Any, at: int, count: int) -> list[int]:
    """``count`` little-endian int32 at ``buf[at:]`` as a list (a cached struct for a few,
    numpy for more: either beats building an Arrow array)."""
    if count <= len(_OFFSETS):
        return list(_OFFSETS[count - 1].unpack_from(buf, at))
    out: list[int] = np.frombuffer(buf, dtype=_I32, count=count, offset=at).tolist()
    return out


def _non_decreasing(offsets: list[int]) -> bool:
    return all(map(le, offsets[:-1], offsets[1:]))


def check_small_body(buf: Any, start: int, lengths: Sequence[int], n: int) -> SmallLists | None:
    """``check_flat_body`` for an uncompressed body with tags or headers, when it has at most
    ``summary.SMALL`` records and ``summary.SMALL`` tags and header pairs in all
    (``summary.counted_one_by_one``): what ``decode_body(..., validate=True)`` proves (list
    and string offsets within bounds and never decreasing, header keys and tags UTF-8), in
    plain Python, and the lists the summary is checked against. Arrow's arrays and the
    columnar count cost ~150 us a batch before any record is looked at: what a one-record
    batch of the retry router or the delay scheduler, or a consumer's batch of failure
    records, paid on its leader. None for a larger body (decode it)."""
    if not summary.counted_one_by_one(n, 0):  # its list offsets alone: more than Arrow's work
        return None
    at = list(accumulate((padded(x) for x in lengths[: N_BUFFERS - 1]), initial=0))
    at = [start + DIRECTORY_SIZE + a for a in at]
    hl = _small_lists(buf, at[7], lengths[7], n, "header")
    tl = _small_lists(buf, at[12], lengths[12], n, "tag")
    if not summary.counted_one_by_one(n, hl[n] + tl[n]):
        return None
    check_flat_body(buf, start, lengths, n)
    keys = _small_strings(buf, at[8], lengths[8], at[9], lengths[9], hl[n], "header key")
    values = _small_strings(
        buf, at[10], lengths[10], at[11], lengths[11], hl[n], "header value", utf8=False
    )
    tags = _small_strings(buf, at[13], lengths[13], at[14], lengths[14], tl[n], "tag")
    return SmallLists(tl, tags, hl, keys, values)


def _small_lists(buf: Any, at: int, length: int, n: int, what: str) -> list[int]:
    """``n + 1`` list offsets (all zero when the buffer is empty), as Arrow checks them."""
    if length == 0:
        return [0] * (n + 1)
    if length != 4 * (n + 1):
        raise CorruptBatchError(f"{what} list offsets have {length} bytes for {n} records")
    offsets = _read_int32s(buf, at, n + 1)
    if offsets[0] < 0 or not _non_decreasing(offsets):
        raise CorruptBatchError(
            f"malformed record batch body: {what} list offsets are not non-decreasing from 0"
        )
    return offsets


def _small_strings(
    buf: Any,
    at: int,
    length: int,
    data_at: int,
    data: int,
    count: int,
    what: str,
    *,
    utf8: bool = True,
) -> list[bytes]:
    """The ``count`` values of a child string (or binary) array, checked as ``_binary`` and
    Arrow's full validation check them."""
    if length == 0:
        if data:
            raise CorruptBatchError(f"{what} data without offsets")
        if count:
            raise CorruptBatchError(f"{what} offsets missing for {count} entries")
        return []
    if length != 4 * (count + 1):
        raise CorruptBatchError(f"{what} offsets have {length} bytes for {count} entries")
    offsets = _read_int32s(buf, at, count + 1)
    if offsets[0] < 0 or offsets[count] > data or not _non_decreasing(offsets):
        raise CorruptBatchError(
            f"malformed record batch body: {what} offsets are not non-decreasing within [0, {data}]"
        )
    whole = bytes(memoryview(buf)[data_at : data_at + offsets[count]])
    out = list(map(whole.__getitem__, map(slice, offsets[:count], offsets[1:])))
    if utf8:
        try:
            for value in set(out):  # keys and tags repeat: each distinct one once
                value.decode()
        except UnicodeDecodeError:
            raise CorruptBatchError(f"malformed record batch body: a {what} is not UTF-8") from None
    return out


def decode_body(
    body: pa.Buffer, n: int, base_offset: int, *, validate: bool = True
) -> pa.RecordBatch:
    """Arrow columns of a raw (decompressed) body holding ``n`` records.

    The arrays point into ``body``; nothing is copied except the offset column, which is
    computed (``base_offset + arange(n)``). With ``validate`` (the default for any bytes that
    came from outside the process) Arrow checks every offset and UTF-8 string in C++.
    """
    try:
        return _decode_body(body, n, base_offset, validate)
    except pa.ArrowInvalid as exc:
        # Array.from_buffers runs Arrow's cheap checks (offset ranges, sizes) even without validate
        raise CorruptBatchError(f"malformed record batch body: {exc}") from None


def _decode_body(body: pa.Buffer, n: int, base_offset: int, validate: bool) -> pa.RecordBatch:
    b = _split(body)
    if b[0].size != 8 * n:
        raise CorruptBatchError(f"{b[0].size} bytes of timestamps for {n} records")
    timestamps = pa.Array.from_buffers(TIMESTAMP_TYPE, n, [None, b[0]], null_count=0)
    key = _binary(n, b[1], b[2], b[3], "key")
    value = _binary(n, b[4], b[5], b[6], "value")

    h = _list_length(b[7], n, "header")
    pairs = pa.StructArray.from_arrays(
        [
            _binary(h, _NO_BUFFER, b[8], b[9], "header key", string=True, implicit=False),
            _binary(h, _NO_BUFFER, b[10], b[11], "header value", implicit=False),
        ],
        fields=list(HEADER_PAIR),
    )
    headers = pa.Array.from_buffers(
        HEADERS_TYPE, n, [None, b[7] if b[7].size else _zeros(n)], null_count=0, children=[pairs]
    )
    t = _list_length(b[12], n, "tag")
    tag_values = _binary(t, _NO_BUFFER, b[13], b[14], "tag", string=True, implicit=False)
    tags = pa.Array.from_buffers(
        TAGS_TYPE,
        n,
        [None, b[12] if b[12].size else _zeros(n)],
        null_count=0,
        children=[tag_values],
    )
    columns = [
        pa.array(np.arange(base_offset, base_offset + n, dtype=np.int64)),
        timestamps,
        key,
        value,
        headers,
        tags,
    ]
    if validate:
        for col in columns[2:]:
            col.validate(full=True)
    return pa.RecordBatch.from_arrays(columns, schema=SCHEMA)
