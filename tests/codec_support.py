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
