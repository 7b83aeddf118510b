"""Helpers for the record-batch codec tests.

They read batches through the layout documented in ``storage/codec/header.py`` and
``storage/codec/body.py`` with their own ``struct`` calls and ``google_crc32c`` directly, so a
test that uses them does not take the codec's word for where a field lives.
"""

from __future__ import annotations

import struct
from typing import Any

import google_crc32c
import pyarrow as pa
from hypothesis import strategies as st

HEADER_SIZE = 72
CRC_START = 24
DIRECTORY_SIZE = 64
N_BUFFERS = 15


def padded8(n: int) -> int:
    return -(-n // 8) * 8


def with_crc(batch: bytes | bytearray) -> bytes:
    """``batch`` with its CRC field recomputed over bytes [24, end), as a forger would."""
    out = bytearray(batch)
    struct.pack_into("<I", out, 20, google_crc32c.value(bytes(out[CRC_START:])))
    return bytes(out)


def body_buffers(batch: bytes) -> list[tuple[int, int]]:
    """(position in the batch, length) of the 15 body buffers of an uncompressed batch."""
    lengths = struct.unpack_from("<16I", batch, HEADER_SIZE)
    pos = HEADER_SIZE + DIRECTORY_SIZE
    out = []
    for length in lengths[:N_BUFFERS]:
        out.append((pos, length))
        pos += padded8(length)
    return out


def patch(batch: bytes, pos: int, fmt: str, *values: Any) -> bytearray:
    out = bytearray(batch)
    struct.pack_into(fmt, out, pos, *values)
    return out


def columns(rb: pa.RecordBatch) -> dict[str, list[Any]]:
    """A decoded batch as plain Python values, in the shapes ``encode_batch`` takes them."""
    return {
        "offset": rb.column("offset").to_pylist(),
        "timestamp": rb.column("timestamp").view(pa.int64()).to_pylist(),
        "key": rb.column("key").to_pylist(),
        "value": rb.column("value").to_pylist(),
        "headers": [
            [(pair["key"], pair["value"]) for pair in record]
            for record in rb.column("headers").to_pylist()
        ],
        "tags": rb.column("tags").to_pylist(),
    }


def reference_summary(
    n: int, tags: list[list[str]] | None, headers: list[list[tuple[str, bytes]]] | None
) -> dict[str, Any]:
    """The summary of records as ``storage/codec/summary.py`` documents it, computed record by
    record: ``{"untagged", "tags", "headers"}`` with None for what the limits leave out."""
    from storage.codec.summary import (
        MAX_HEADER_KEYS,
        MAX_SECTION_BYTES,
        MAX_TAGS,
        MAX_VALUES_PER_KEY,
    )

    tag_lists = tags or [[] for _ in range(n)]
    header_lists = headers or [[] for _ in range(n)]
    tag_counts: dict[bytes, int] = {}
    for record in tag_lists:
        for tag in {t.encode() for t in record}:
            tag_counts[tag] = tag_counts.get(tag, 0) + 1
    listed_tags: dict[bytes, int] | None = tag_counts
    if len(tag_counts) > MAX_TAGS or sum(6 + len(t) for t in tag_counts) > MAX_SECTION_BYTES:
        listed_tags = None
    key_records: dict[bytes, int] = {}
    value_records: dict[bytes, dict[bytes, int]] = {}
    for record in header_lists:
        for key in {k.encode() for k, _ in record}:
            key_records[key] = key_records.get(key, 0) + 1
        for key, value in {(k.encode(), v) for k, v in record}:
            per_key = value_records.setdefault(key, {})
            per_key[value] = per_key.get(value, 0) + 1
    keyed: dict[bytes, tuple[int, dict[bytes, int] | None]] | None = {
        k: (c, value_records[k] if len(value_records[k]) <= MAX_VALUES_PER_KEY else None)
        for k, c in key_records.items()
    }

    def section(h: dict[bytes, tuple[int, dict[bytes, int] | None]]) -> int:
        return sum(8 + len(k) + sum(6 + len(v) for v in (vals or {})) for k, (_, vals) in h.items())

    if len(key_records) > MAX_HEADER_KEYS:
        keyed = None
    elif section(keyed or {}) > MAX_SECTION_BYTES:
        keyed = {k: (c, None) for k, c in key_records.items()}
        if section(keyed) > MAX_SECTION_BYTES:
            keyed = None
    return {
        "untagged": sum(1 for record in tag_lists if not record),
        "tags": listed_tags,
        "headers": keyed,
    }


def summary_as_dict(s: Any) -> dict[str, Any]:
    """A parsed ``storage.codec.summary.Summary`` in ``reference_summary``'s shape."""
    return {
        "untagged": s.untagged,
        "tags": None if s.tags is None else dict(s.tags),
        "headers": None
        if s.headers is None
        else {
            k: (ks.records, None if ks.values is None else dict(ks.values))
            for k, ks in s.headers.items()
        },
    }


def maybe_tags(max_records: int) -> st.SearchStrategy[list[list[str] | None]]:
    """Per record: no tags (None), or a few (names with non-ASCII and empty ones)."""
    tags = st.lists(st.sampled_from(["a", "b", "ü", ""]), max_size=3)
    return st.lists(st.one_of(st.none(), tags), min_size=1, max_size=max_records)


def maybe_headers(max_records: int) -> st.SearchStrategy[list[list[tuple[str, bytes]] | None]]:
    """Per record: no headers (None), or a few (keys repeat, values are any short bytes)."""
    pairs = st.tuples(st.sampled_from(["k", "région", ""]), st.binary(max_size=4))
    return st.lists(
        st.one_of(st.none(), st.lists(pairs, max_size=4)), min_size=1, max_size=max_records
    )
