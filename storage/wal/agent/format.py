"""Bytes of the agent WAL: one file sequence per data directory holding every partition's
batches in the order they were appended (``docs/format.md``, *Agent WAL*).

Pure functions (no files): ``encode_frame`` turns a round of entries into buffers to write,
``read_frames`` walks a file's bytes back into frames and says where a torn tail starts.

A file (``<sequence:020d>.wal``) is a run of frames. A frame is written with one ``pwritev``::

    offset  size  field
    0       4     crc          CRC32C of bytes [4, 24 + 24 * count + names_len)
    4       2     magic        0x5357 ("SW")
    6       2     version      1
    8       4     count        entries in the table
    12      4     names_len    bytes of the names section
    16      8     payload_len  bytes of the payloads section (padding included)
    24      24*n  table        one ENTRY each (below)
    ...     names_len  names   the NAME entries' "<dirname>\\n<topic id>" strings, UTF-8,
                               zero padding to a multiple of 8
    ...     payload_len        the DATA entries' batches, back to back, then zero padding to
                               a multiple of 8 (frames start 8-aligned)

    ENTRY: kind u8, 3 pad, pid u32, epoch i32, offset i64, size u32
      NAME      pid's partition directory and topic id (size: bytes in the names section)
      OPEN      the partition was opened here with its log ending, on disk, at ``offset``
      DATA      a batch appended at base ``offset`` with leader ``epoch`` (size: its bytes,
                exactly as received: the first 16 are stamped again when replayed)
      TRUNCATE  the log was cut to end at ``offset``
      RESTART   the log was emptied and restarted at ``offset``

The CRC covers the header, the table and the names; a batch's own CRC32C (checked again on
replay) covers its body. Little-endian throughout.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from storage.crc import crc32c
from storage.errors import CorruptBatchError

MAGIC = 0x5357
VERSION = 1
FRAME = struct.Struct("<IHHIIQ")
ENTRY = struct.Struct("<B3xIiqI")
SUFFIX = ".wal"
_PAD = bytes(8)
#: a frame's table is bounded (a round's entries), so a torn length cannot make a reader
#: allocate or walk gigabytes
MAX_ENTRIES = 1 << 20
MAX_NAMES = 64 << 20


class Kind(enum.IntEnum):
    NAME = 1
    OPEN = 2
    DATA = 3
    TRUNCATE = 4
    RESTART = 5


@dataclass(frozen=True, slots=True)
class Entry:
    kind: Kind
    pid: int
    offset: int
    epoch: int = 0
    data: Any = b""  # DATA: the batch (a buffer); NAME: (dirname, topic id)


FAILED = ".failed"


def file_name(sequence: int, *, failed: bool = False) -> str:
    """``<sequence:020d>.wal``; a file left after a failed fsync is ``<sequence>.failed.wal``."""
    return f"{sequence:020d}{FAILED if failed else ''}{SUFFIX}"


def parse_name(name: str) -> tuple[int, bool] | None:
    """(sequence, failed) of a WAL file's name; None for any other name."""
    if not name.endswith(SUFFIX):
        return None
    stem = name[: -len(SUFFIX)]
    failed = stem.endswith(FAILED)
    if failed:
        stem = stem[: -len(FAILED)]
    return (int(stem), failed) if stem.isdigit() else None


def valid_frame_after(buf: Any, position: int) -> bool:
    """Whether a whole, valid frame starts at any 8-aligned byte past ``position`` (then the
    damage at ``position`` is not a torn tail). Candidates are found with numpy."""
    size = len(buf)
    first = (position // 8 + 1) * 8
    if size - first < FRAME.size:
        return False
    words = np.frombuffer(buf, dtype="<u2", count=(size - first) // 2, offset=first)
    for i in np.flatnonzero(words[2::4] == MAGIC):
        try:
            _read_frame(buf, first + int(i) * 8, size)
        except CorruptBatchError:
            continue
        return True
    return False


def encode_frame(
    table: Sequence[bytes], names: Sequence[bytes], payloads: Sequence[Any], payload_len: int
) -> list[Any]:
    """The buffers of one frame. ``table`` holds ``ENTRY.pack``ed entries, ``names`` the NAME
    strings in table order, ``payloads`` the DATA batches in table order, ``payload_len``
    their total size."""
    names_blob = b"".join(names)
    names_blob += _PAD[: -len(names_blob) % 8]  # frames stay 8-aligned
    pad = -payload_len % 8
    body = FRAME.pack(0, MAGIC, VERSION, len(table), len(names_blob), payload_len + pad)[4:]
    head = body + b"".join(table) + names_blob
    parts: list[Any] = [crc32c(head).to_bytes(4, "little"), head]
    parts.extend(payloads)
    if pad:
        parts.append(_PAD[:pad])
    return parts


def name_entry(pid: int, dirname: str, topic_id: str) -> tuple[bytes, bytes]:
    """(table entry, names bytes) of a NAME entry."""
    blob = f"{dirname}\n{topic_id}".encode()
    return ENTRY.pack(Kind.NAME, pid, 0, 0, len(blob)), blob


@dataclass(frozen=True, slots=True)
class Frame:
    position: int
    size: int
    entries: list[Entry]


def read_frames(buf: Any, start: int = 0) -> tuple[list[Frame], int, CorruptBatchError | None]:
    """Every whole, valid frame of ``buf`` from ``start``; the byte where they end; and why
    the bytes after that are not a frame (None: the buffer ends there)."""
    frames: list[Frame] = []
    pos = start
    size = len(buf)
    while pos < size:
        try:
            frame = _read_frame(buf, pos, size)
        except CorruptBatchError as exc:
            return frames, pos, exc
        frames.append(frame)
        pos += frame.size
    return frames, pos, None


def _read_frame(buf: Any, pos: int, size: int) -> Frame:
    if size - pos < FRAME.size:
        raise CorruptBatchError("frame header cut short", position=pos)
    crc, magic, version, count, names_len, payload_len = FRAME.unpack_from(buf, pos)
    if magic != MAGIC or version != VERSION:
        raise CorruptBatchError(f"no frame (magic {magic:#x}, version {version})", position=pos)
    if count > MAX_ENTRIES or names_len > MAX_NAMES or payload_len % 8:
        raise CorruptBatchError("frame sizes out of bounds", position=pos)
    head_end = pos + FRAME.size + count * ENTRY.size + names_len
    end = head_end + payload_len
    if end > size:
        raise CorruptBatchError("frame cut short", position=pos)
    if crc32c(bytes(buf[pos + 4 : head_end])) != crc:
        raise CorruptBatchError("frame CRC mismatch", position=pos)
    entries: list[Entry] = []
    names_at = pos + FRAME.size + count * ENTRY.size
    data_at = head_end
    for i in range(count):
        kind, pid, epoch, offset, n = ENTRY.unpack_from(buf, pos + FRAME.size + i * ENTRY.size)
        try:
            k = Kind(kind)
        except ValueError:
            raise CorruptBatchError(f"unknown entry kind {kind}", position=pos) from None
        if k == Kind.NAME:
            if names_at + n > head_end:
                raise CorruptBatchError("NAME entry past the names section", position=pos)
            text = bytes(buf[names_at : names_at + n]).decode("utf-8", "replace")
            dirname, _, topic_id = text.partition("\n")
            entries.append(Entry(k, pid, offset, epoch, (dirname, topic_id)))
            names_at += n
        elif k == Kind.DATA:
            if data_at + n > end:
                raise CorruptBatchError("DATA entry past the frame", position=pos)
            entries.append(Entry(k, pid, offset, epoch, memoryview(buf)[data_at : data_at + n]))
            data_at += n
        else:
            entries.append(Entry(k, pid, offset, epoch))
    return Frame(pos, end - pos, entries)
