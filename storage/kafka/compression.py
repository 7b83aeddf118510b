"""Kafka's record-batch compression codecs, from libraries: zlib (gzip) and cramjam (snappy,
lz4, zstd). Sans-IO; every decompression is bounded.

Codec ids (batch attributes bits 0-2): 0 none, 1 gzip, 2 snappy, 3 lz4, 4 zstd.

* **gzip**: a gzip member (RFC 1952), through ``zlib`` with a ``max_length``.
* **snappy**: raw snappy blocks (librdkafka, kafka-python) or the Java client's xerial
  framing (``\\x82SNAPPY\\x00``, two int32 versions, then int32-length-prefixed raw blocks);
  the decoded size is read from each block's header before anything is inflated.
* **lz4**: the LZ4 frame format (Kafka's since KIP-57).
* **zstd**: a zstd frame.

A body that would inflate past ``limit`` bytes, or does not decompress, raises
:class:`~storage.errors.CorruptBatchError` (Kafka's CORRUPT_MESSAGE); the codecs' own
exceptions never leave this module.
"""

from __future__ import annotations

import enum
import struct
import zlib
from typing import Any

import cramjam

from storage.errors import CorruptBatchError


class Codec(enum.IntEnum):
    NONE = 0
    GZIP = 1
    SNAPPY = 2
    LZ4 = 3
    ZSTD = 4


_XERIAL_MAGIC = b"\x82SNAPPY\x00"
_XERIAL_HEADER = 16  # magic, int32 version, int32 compatible version
_I32 = struct.Struct(">i")


def decompress(codec: int, data: Any, limit: int) -> bytes:
    """The inflated bytes of ``data`` (at most ``limit`` of them)."""
    try:
        if codec == Codec.GZIP:
            return _gunzip(data, limit)
        if codec == Codec.SNAPPY:
            return _unsnappy(bytes(data), limit)
        if codec in (Codec.LZ4, Codec.ZSTD):
            mod = cramjam.lz4 if codec == Codec.LZ4 else cramjam.zstd
            out = bytearray(limit)
            n = mod.decompress_into(bytes(data), out)
            del out[n:]
            return bytes(out)
    except cramjam.DecompressionError as exc:
        raise CorruptBatchError(
            f"cannot decompress a {Codec(codec).name.lower()} record batch within {limit} bytes:"
            f" {exc}"
        ) from None
    raise CorruptBatchError(f"unknown compression codec {codec}")


def compress(codec: int, data: bytes) -> bytes:
    """``data`` compressed with ``codec`` (what a Kafka producer would send)."""
    if codec == Codec.GZIP:
        c = zlib.compressobj(wbits=31)
        return c.compress(data) + c.flush()
    if codec == Codec.SNAPPY:
        return bytes(cramjam.snappy.compress_raw(data))
    if codec == Codec.LZ4:
        return bytes(cramjam.lz4.compress(data))
    if codec == Codec.ZSTD:
        return bytes(cramjam.zstd.compress(data))
    raise ValueError(f"unknown compression codec {codec}")


def _gunzip(data: Any, limit: int) -> bytes:
    d = zlib.decompressobj(wbits=47)  # gzip or zlib header, detected
    try:
        out = d.decompress(bytes(data), limit)
    except zlib.error as exc:
        raise CorruptBatchError(f"cannot decompress a gzip record batch: {exc}") from None
    if d.unconsumed_tail:
        raise CorruptBatchError(f"a gzip record batch inflates past {limit} bytes")
    if not d.eof:
        raise CorruptBatchError("a gzip record batch ends before its stream does")
    return out


def _unsnappy(data: bytes, limit: int) -> bytes:
    if not data.startswith(_XERIAL_MAGIC):
        return _raw_snappy(data, limit)
    parts = []
    total = 0
    pos = _XERIAL_HEADER
    if len(data) < pos:
        raise CorruptBatchError("a snappy (xerial) record batch ends inside its header")
    while pos < len(data):
        if pos + 4 > len(data):
            raise CorruptBatchError("a snappy (xerial) block ends inside its length")
        (n,) = _I32.unpack_from(data, pos)
        pos += 4
        if n < 0 or pos + n > len(data):
            raise CorruptBatchError(f"a snappy (xerial) block of {n} bytes does not fit")
        block = _raw_snappy(data[pos : pos + n], limit - total)
        total += len(block)
        parts.append(block)
        pos += n
    return b"".join(parts)


def _raw_snappy(data: bytes, limit: int) -> bytes:
    try:
        size = cramjam.snappy.decompress_raw_len(data)
    except cramjam.DecompressionError as exc:
        raise CorruptBatchError(f"not a snappy block: {exc}") from None
    if size > limit:
        raise CorruptBatchError(f"a snappy block inflates to {size} bytes, over {limit}")
    return bytes(cramjam.snappy.decompress_raw(data))
