"""The batch summary (format version 2): a batch's tags and headers in brief, outside the body.

A filtered fetch (``storage.filters``) asks of every batch "can a record here match?" and
"does every record match?". The summary answers both for most batches from a few hundred
bytes, so the agent skips a batch or sends it whole without decompressing or decoding its
body; only a batch it cannot decide is decoded. It is written once, by the producer's encoder,
right after the body's padding (never compressed), and covered by the batch's CRC like
everything from byte 24 on. Layout (little-endian, ``summary_length`` bytes at
``padded(72 + body_length)``)::

    0  4  untagged          uint32  records that carry no tag
    4  2  tag_count         uint16  distinct tags listed; 0xFFFF: the tags are not listed
    6  2  header_key_count  uint16  distinct header keys listed; 0xFFFF: not listed
    8  -  tag_count x         uint32 records carrying the tag, uint16 length, its UTF-8
          header_key_count x  uint16 length, the key's UTF-8, uint32 records carrying the key,
                              uint16 value_count (0xFFFF: the key's values are not listed),
                              value_count x (uint32 records, uint16 length, the value's bytes)
    -  0..7 zero padding to a multiple of 8

Entries are sorted by their bytes, without duplicates (tags; keys; each key's values), so the
summary of a set of records is one byte string. "Records carrying" counts a record once
however often it repeats a tag or a header. A section (the tags, the header keys, one key's
values) is listed completely or not at all: in a listed section, a missing entry means that
no record has it. The encoder leaves out what would make the summary large — more than
``MAX_TAGS`` distinct tags, more than ``MAX_HEADER_KEYS`` header keys, more than
``MAX_VALUES_PER_KEY`` values of a key, a section over ``MAX_SECTION_BYTES`` — so a summary
is at most about 8 KiB; whoever needs what was left out decodes the batch.

The partition leader checks a producer's summary against the body (:func:`verify`, run by
``check_batch(deep=True)``), so what agents and readers trust later was true when stored.
Pure functions, no I/O; a summary that does not parse raises ``CorruptBatchError``.
"""

from __future__ import annotations

import struct
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import chain, repeat
from operator import eq, itemgetter, sub
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from storage.codec.header import MAGIC, BatchHeader, padded
from storage.errors import CorruptBatchError

NOT_LISTED = 0xFFFF
MAX_TAGS = 256
MAX_HEADER_KEYS = 64
MAX_VALUES_PER_KEY = 16
MAX_SECTION_BYTES = 4096

_FIXED = struct.Struct("<IHH")  # untagged, tag_count, header_key_count
_ENTRY = struct.Struct("<IH")  # records, length (a tag; a header value)
_LENGTH = struct.Struct("<H")  # a header key's length
_KEY_TAIL = struct.Struct("<IH")  # records carrying the key, value_count
_PAD = bytes(8)


@dataclass(frozen=True, slots=True)
class KeySummary:
    """One header key: the records carrying it, and its values (None: not listed)."""

    records: int
    values: Mapping[bytes, int] | None


@dataclass(frozen=True, slots=True)
class Summary:
    """What a summary says about a batch of ``records`` records (``None``: not listed)."""

    records: int
    untagged: int
    tags: Mapping[bytes, int] | None
    headers: Mapping[bytes, KeySummary] | None


# ---- building -------------------------------------------------------------------------------


def _lists(offsets: Any, n: int) -> tuple[np.ndarray, bool]:
    """(the record index of each list element, whether every record's list is at most one
    element long), from int32[n+1] list offsets starting at 0."""
    lengths: np.ndarray = np.diff(np.asarray(offsets, dtype=np.int64))
    return np.repeat(np.arange(n, dtype=np.int64), lengths), bool(lengths.max(initial=0) <= 1)


def _encoded(values: pa.Array) -> tuple[np.ndarray, pa.Array]:
    """(each element's index into the distinct values, the distinct values as binary)."""
    enc = pc.dictionary_encode(values)
    idx = np.asarray(enc.indices.to_numpy(zero_copy_only=False), dtype=np.int64)
    return idx, enc.dictionary.cast(pa.binary())


def _once(ids: np.ndarray, parents: np.ndarray, single: bool, space: int) -> np.ndarray:
    """``ids`` (each < ``space``) with repeats within one record removed (a record counts once
    per id); as they are when no record has more than one element (``single``)."""
    return ids if single else np.unique(parents * space + ids) % space


def _tag_stats(
    offsets: Any, values: pa.Array | None, n: int, cap: int
) -> tuple[int, dict[bytes, int] | None]:
    """(untagged records, records per distinct tag or None over ``cap``)."""
    if values is None or not len(values):
        return n, {}
    lengths = np.diff(np.asarray(offsets, dtype=np.int64))
    untagged = int(np.count_nonzero(lengths == 0))
    idx, names = _encoded(values)
    distinct = len(names)
    if distinct > cap:
        return untagged, None
    parents, single = _lists(offsets, n)
    counts = np.bincount(_once(idx, parents, single, distinct), minlength=distinct)
    return untagged, dict(zip(names.to_pylist(), counts.tolist(), strict=True))


def _header_stats(
    offsets: Any, pairs: pa.Array | None, n: int, max_keys: int, max_values: int
) -> dict[bytes, KeySummary] | None:
    """Per header key, the records carrying it and (up to ``max_values`` distinct) its values;
    None with more than ``max_keys`` keys."""
    if pairs is None or not len(pairs):
        return {}
    kidx, keys = _encoded(pairs.field("key"))
    k = len(keys)
    if k > max_keys:
        return None
    parents, single = _lists(offsets, n)
    key_records = np.bincount(_once(kidx, parents, single, k), minlength=k)
    vidx, values = _encoded(pairs.field("value"))
    v = len(values)
    ids, counts = np.unique(_once(kidx * v + vidx, parents, single, k * v), return_counts=True)
    per_key = np.bincount(ids // v, minlength=k)
    listed: dict[int, dict[bytes, int]] = {i: {} for i in range(k) if per_key[i] <= max_values}
    keep = (per_key <= max_values)[ids // v]
    if keep.any():
        ids, counts = ids[keep], counts[keep]
        names = values.take(pa.array(ids % v)).to_pylist()
        for pid, name, count in zip(ids.tolist(), names, counts.tolist(), strict=True):
            listed[pid // v][name] = count
    key_names = keys.to_pylist()
    return {key_names[i]: KeySummary(int(key_records[i]), listed.get(i)) for i in range(k)}


#: at most this many tags and headers (all records together), of at most this many records,
#: are counted in plain Python
SMALL = 256


def counted_one_by_one(n: int, elements: int) -> bool:
    """Whether ``n`` records with ``elements`` tags and header pairs in all are counted (and
    checked) in plain Python rather than column by column: the one rule the encoder's
    ``build``, the deep check (``verify``, ``body.check_small_body``) share."""
    return n <= SMALL and elements <= SMALL


def _small_stats(
    n: int,
    tag_offsets: Any,
    tag_values: pa.Array | None,
    header_offsets: Any,
    header_pairs: pa.Array | None,
) -> tuple[int, dict[bytes, int] | None, dict[bytes, KeySummary] | None]:
    """``_tag_stats`` and ``_header_stats`` for few elements, counted one by one."""
    tag_offs: list[int] = []
    names: list[bytes] = []
    if tag_values is not None and len(tag_values):
        tag_offs = np.asarray(tag_offsets).tolist()
        names = [t.encode() for t in tag_values.to_pylist()]
    header_offs: list[int] = []
    keys: list[bytes] = []
    values: list[bytes] = []
    if header_pairs is not None and len(header_pairs):
        header_offs = np.asarray(header_offsets).tolist()
        keys = [k.encode() for k in header_pairs.field("key").to_pylist()]
        values = header_pairs.field("value").cast(pa.binary()).to_pylist()
    return count_small(n, tag_offs, names, header_offs, keys, values)


def _record_ids(offsets: list[int], n: int) -> list[int]:
    """The record index of each list element, from ``n + 1`` list offsets (C-level
    iterators: no Python code runs per element)."""
    return list(chain.from_iterable(map(repeat, range(n), map(sub, offsets[1:], offsets[:n]))))


def _distinct_per_record(offsets: list[int], items: list[bytes], n: int) -> bool:
    """Whether no record's list repeats an element (what counting by occurrences needs)."""
    if n == 1:
        return len(set(items)) == len(items)
    return len(set(zip(_record_ids(offsets, n), items, strict=True))) == len(items)


def _rebased(items: list[bytes], offsets: list[int], n: int) -> tuple[list[bytes], list[int]]:
    """The elements the ``n`` lists hold, and their offsets from 0."""
    lo = offsets[0]
    return items[lo : offsets[n]], [o - lo for o in offsets]


def count_small(
    n: int,
    tag_offsets: list[int],
    tags: list[bytes],
    header_offsets: list[int],
    keys: list[bytes],
    values: list[bytes],
) -> tuple[int, dict[bytes, int] | None, dict[bytes, KeySummary] | None]:
    """The counts of ``_small_stats`` from plain lists: the records' tags (``tags``, record
    ``i``'s are ``tags[tag_offsets[i]:tag_offsets[i + 1]]``; ``tag_offsets`` empty when no
    record has one) and header pairs (``keys``/``values`` indexed by ``header_offsets``).

    When no record repeats a tag, a header key or a pair (the usual case), the counts are
    occurrences, counted by ``Counter`` in C; else records are deduplicated one by one."""
    if tags and tag_offsets[0]:  # elements before the first list belong to no record
        tags, tag_offsets = _rebased(tags, tag_offsets, n)
    if keys and header_offsets[0]:
        values = values[header_offsets[0] : header_offsets[n]]
        keys, header_offsets = _rebased(keys, header_offsets, n)
    untagged = n
    tag_counts: dict[bytes, int] | None = {}
    if tags:
        untagged = sum(map(eq, tag_offsets[:n], tag_offsets[1:]))
        if _distinct_per_record(tag_offsets, tags, n):
            counts = dict(Counter(tags))
        else:
            counts = dict(
                Counter(
                    chain.from_iterable(
                        set(tags[tag_offsets[i] : tag_offsets[i + 1]]) for i in range(n)
                    )
                )
            )
        tag_counts = counts if len(counts) <= MAX_TAGS else None
    headers: dict[bytes, KeySummary] | None = {}
    if keys:
        if _distinct_per_record(header_offsets, keys, n):
            carriers = Counter(keys)
            pair_counts = Counter(zip(keys, values, strict=True))
        else:
            carriers, pair_counts = Counter(), Counter()
            for i in range(n):
                lo, hi = header_offsets[i], header_offsets[i + 1]
                carriers.update(set(keys[lo:hi]))
                pair_counts.update(set(zip(keys[lo:hi], values[lo:hi], strict=True)))
        if len(carriers) > MAX_HEADER_KEYS:
            headers = None
        else:
            distinct = Counter(map(itemgetter(0), pair_counts))
            pairs: dict[bytes, dict[bytes, int]] = {
                key: {} for key, count in distinct.items() if count <= MAX_VALUES_PER_KEY
            }
            if pairs:
                for (key, value), count in pair_counts.items():
                    per = pairs.get(key)
                    if per is not None:
                        per[value] = count
            headers = {key: KeySummary(count, pairs.get(key)) for key, count in carriers.items()}
    return untagged, tag_counts, headers


def build_small(
    n: int,
    tag_offsets: list[int],
    tags: list[bytes],
    header_offsets: list[int],
    keys: list[bytes],
    values: list[bytes],
) -> Summary:
    """``build`` for a batch the body laid out from plain lists (``count_small``'s)."""
    return _bounded(n, *count_small(n, tag_offsets, tags, header_offsets, keys, values))


def _tag_section(tags: Mapping[bytes, int]) -> int:
    return sum(_ENTRY.size + len(t) for t in tags)


def _header_section(headers: Mapping[bytes, KeySummary]) -> int:
    size = 0
    for key, ks in headers.items():
        size += _LENGTH.size + len(key) + _KEY_TAIL.size
        if ks.values is not None:
            size += sum(_ENTRY.size + len(v) for v in ks.values)
    return size


def build(
    n: int,
    tag_offsets: Any,
    tag_values: pa.Array | None,
    header_offsets: Any,
    header_pairs: pa.Array | None,
) -> Summary:
    """The summary of ``n`` records from their tag and header lists as the body lays them out:
    int32[n+1] list offsets starting at 0 and the child values (None: every list empty).

    Up to ``SMALL`` tags and headers in all, of up to ``SMALL`` records, are counted in plain
    Python (``_small_stats``):
    the columnar counting's fixed cost (~1 ms of dictionary encodes and bincounts) is what a
    one-record batch of the retry router or the delay scheduler paid for its summary."""
    elements = (0 if tag_values is None else len(tag_values)) + (
        0 if header_pairs is None else len(header_pairs)
    )
    if counted_one_by_one(n, elements):
        untagged, tags, headers = _small_stats(
            n, tag_offsets, tag_values, header_offsets, header_pairs
        )
    else:
        untagged, tags = _tag_stats(tag_offsets, tag_values, n, MAX_TAGS)
        headers = _header_stats(
            header_offsets, header_pairs, n, MAX_HEADER_KEYS, MAX_VALUES_PER_KEY
        )
    return _bounded(n, untagged, tags, headers)


def _bounded(
    n: int,
    untagged: int,
    tags: dict[bytes, int] | None,
    headers: dict[bytes, KeySummary] | None,
) -> Summary:
    """The summary, with sections over ``MAX_SECTION_BYTES`` not listed."""
    if tags is not None and _tag_section(tags) > MAX_SECTION_BYTES:
        tags = None
    if headers is not None and _header_section(headers) > MAX_SECTION_BYTES:
        headers = {key: KeySummary(ks.records, None) for key, ks in headers.items()}
        if _header_section(headers) > MAX_SECTION_BYTES:
            headers = None
    return Summary(n, untagged, tags, headers)


def canonical(
    n: int,
    untagged: int,
    tags: dict[bytes, int] | None,
    headers: dict[bytes, KeySummary] | None,
) -> bytes:
    """The summary bytes the encoder writes for records with these counts (``count_small``'s,
    with nothing left out that the limits allow)."""
    return encode(_bounded(n, untagged, tags, headers))


def is_canonical(buf: Any, pos: int, h: BatchHeader, expected: bytes) -> bool:
    """Whether the summary of the batch at ``buf[pos:]`` is ``expected``, byte for byte."""
    at = pos + h.summary_position
    return (
        h.summary_length == len(expected) and memoryview(buf)[at : at + len(expected)] == expected
    )


def empty(n: int) -> bytes:
    """The summary bytes of ``n`` records without tags or headers."""
    return _FIXED.pack(n, 0, 0)


def encode(s: Summary) -> bytes:
    """The summary's bytes (entries sorted, padded to a multiple of 8)."""
    out = [
        _FIXED.pack(
            s.untagged,
            NOT_LISTED if s.tags is None else len(s.tags),
            NOT_LISTED if s.headers is None else len(s.headers),
        )
    ]
    for tag in sorted(s.tags or ()):
        out += [_ENTRY.pack((s.tags or {})[tag], len(tag)), tag]
    for key in sorted(s.headers or ()):
        ks = (s.headers or {})[key]
        out += [_LENGTH.pack(len(key)), key]
        out.append(_KEY_TAIL.pack(ks.records, NOT_LISTED if ks.values is None else len(ks.values)))
        for value in sorted(ks.values or ()):
            out += [_ENTRY.pack((ks.values or {})[value], len(value)), value]
    data = b"".join(out)
    return data + _PAD[: padded(len(data)) - len(data)]


# ---- reading --------------------------------------------------------------------------------


class _Reader:
    __slots__ = ("buf", "end", "pos", "start")

    def __init__(self, buf: Any, pos: int, end: int) -> None:
        self.buf, self.pos, self.end, self.start = buf, pos, end, pos

    def fail(self, what: str) -> CorruptBatchError:
        return CorruptBatchError(f"batch summary: {what} at byte {self.pos - self.start}")

    def take(self, s: struct.Struct) -> tuple[Any, ...]:
        if self.pos + s.size > self.end:
            raise self.fail("truncated")
        out = s.unpack_from(self.buf, self.pos)
        self.pos += s.size
        return out

    def blob(self, length: int) -> bytes:
        if self.pos + length > self.end:
            raise self.fail("truncated")
        out = bytes(self.buf[self.pos : self.pos + length])
        self.pos += length
        return out

    def entries(self, count: int, most: int) -> dict[bytes, int]:
        """``count`` (records, length, bytes) entries, sorted, each record count in [1, most]."""
        out: dict[bytes, int] = {}
        prev: bytes | None = None
        for _ in range(count):
            records, length = self.take(_ENTRY)
            name = self.blob(length)
            if not 0 < records <= most or (prev is not None and name <= prev):
                raise self.fail("entry out of order or with an impossible record count")
            out[name] = records
            prev = name
        return out


def parse(buf: Any, pos: int, length: int, n: int, *, headers: bool = True) -> Summary:
    """The summary in ``buf[pos : pos + length]`` of a batch of ``n`` records. With
    ``headers=False`` the header section is not read (``Summary.headers`` is None)."""
    r = _Reader(buf, pos, pos + length)
    untagged, tag_count, key_count = r.take(_FIXED)
    if untagged > n:
        raise r.fail(f"{untagged} untagged records of {n}")
    tags = None
    if tag_count != NOT_LISTED:
        tags = r.entries(tag_count, n - untagged)
        if (untagged < n) != bool(tags):
            raise r.fail("tag list inconsistent with the untagged count")
    if not headers:
        return Summary(n, untagged, tags, None)
    keyed: dict[bytes, KeySummary] | None = None
    if key_count != NOT_LISTED:
        keyed = {}
        prev: bytes | None = None
        for _ in range(key_count):
            (key_length,) = r.take(_LENGTH)
            key = r.blob(key_length)
            records, value_count = r.take(_KEY_TAIL)
            if not 0 < records <= n or (prev is not None and key <= prev):
                raise r.fail("header key out of order or with an impossible record count")
            values = None
            if value_count != NOT_LISTED:
                values = r.entries(value_count, records)
                if not values:
                    raise r.fail("a listed header key without values")
            keyed[key] = KeySummary(records, values)
            prev = key
    rest = r.end - r.pos
    if padded(r.pos - r.start) != length or any(r.blob(rest)):
        raise r.fail("trailing bytes that are not the zero padding to a multiple of 8")
    return Summary(n, untagged, tags, keyed)


def of_batch(buf: Any, pos: int, h: BatchHeader, *, headers: bool = True) -> Summary | None:
    """The summary of the batch at ``buf[pos:]`` (header ``h``); None for a version 1 batch."""
    if h.magic != MAGIC:
        return None
    return parse(buf, pos + h.summary_position, h.summary_length, h.record_count, headers=headers)


def verify(s: Summary, rb: pa.RecordBatch) -> None:
    """Raise ``CorruptBatchError`` unless ``s`` tells the truth about the decoded records."""
    n = rb.num_rows
    tags, hdrs = rb.column("tags"), rb.column("headers")
    tag_offsets = np.frombuffer(
        tags.buffers()[1], dtype=np.int32, count=n + 1, offset=4 * tags.offset
    )
    hdr_offsets = np.frombuffer(
        hdrs.buffers()[1], dtype=np.int32, count=n + 1, offset=4 * hdrs.offset
    )
    tag_values = tags.values.slice(tag_offsets[0], tag_offsets[n] - tag_offsets[0])
    pairs = hdrs.values.slice(hdr_offsets[0], hdr_offsets[n] - hdr_offsets[0])
    tag_offsets = tag_offsets - tag_offsets[0]
    hdr_offsets = hdr_offsets - hdr_offsets[0]
    if counted_one_by_one(n, len(tag_values) + len(pairs)):  # as ``build`` counts them
        verify_counts(s, *_small_stats(n, tag_offsets, tag_values, hdr_offsets, pairs))
        return
    untagged, got_tags = _tag_stats(tag_offsets, tag_values, n, len(s.tags or ()))
    got = None
    if s.headers is not None:
        most = max(
            (len(ks.values) for ks in s.headers.values() if ks.values is not None), default=0
        )
        got = _header_stats(hdr_offsets, pairs, n, len(s.headers), most)
    verify_counts(s, untagged, got_tags, got)


def verify_counts(
    s: Summary,
    untagged: int,
    tags: dict[bytes, int] | None,
    headers: dict[bytes, KeySummary] | None,
) -> None:
    """Raise ``CorruptBatchError`` unless ``s`` agrees with the counts of the records
    (``count_small``'s; ``tags`` and ``headers`` need only hold what ``s`` lists)."""
    if untagged != s.untagged or (s.tags is not None and tags != s.tags):
        raise CorruptBatchError("the batch summary does not match its tags")
    if s.headers is None:
        return
    if headers is None or headers.keys() != s.headers.keys():
        raise CorruptBatchError("the batch summary does not match its header keys")
    for key, ks in s.headers.items():
        mine = headers[key]
        if mine.records != ks.records or (ks.values is not None and mine.values != ks.values):
            raise CorruptBatchError(f"the batch summary does not match header {key!r}")
