"""Golden vectors: the exact bytes of a few uncompressed batches, pinned in ``tests/golden``.

Every later stage (WAL, followers, object tier, Spark, SDKs in other languages) reads these
bytes, so an encoder change that moves a byte is a format change. Besides comparing with the
stored hex, the tests read the stored bytes back through the layout documented in the
``header``, ``body`` and ``summary`` module docstrings with their own ``struct`` calls, and
rebuild each body and summary from that documentation, so the vectors are checked against the
spec and not only against the encoder that produced them.

Format version 1 vectors (``single``, ``mixed``, ``control_no_keys``: written before batches
had a summary) stay readable: the encoder writes them with ``summary=False`` and every reader
decodes them. The ``v2_`` vectors are the same records in format version 2, summary included.

Compressed batches have no golden vectors: zstd/lz4 output may change between library versions.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import google_crc32c
import pytest

from storage.codec import decode_batch, encode_batch
from tests.codec_support import HEADER_SIZE, columns, padded8

GOLDEN_DIR = Path(__file__).parent / "golden"

GOLDEN: dict[str, dict[str, Any]] = {
    "single": {
        "values": [b"hello, strata"],
        "timestamps": 1_700_000_000_000,
    },
    "mixed": {
        "values": [b"v0", None, b"", b"value-three"],
        "keys": [b"k0", None, b"k2", b""],
        "timestamps": [1_700_000_000_123, 1_700_000_000_100, 1_700_000_000_500, 1_700_000_000_200],
        "headers": [
            [("trace", b"abc"), ("retry", b"\x01")],
            [],
            [("", b"")],
            [("\u00fc-key", b"\xff\x00")],
        ],
        "tags": [["red"], [], ["blue", "gr\u00fcn"], []],
        "producer_id": 4242,
        "producer_epoch": 7,
        "base_sequence": 100,
        "transactional": True,
        "base_offset": 1_000_000,
        "leader_epoch": 3,
    },
    "control_no_keys": {
        "values": [b"\x00\x00\x00\x01", b"abcdefghi", b"z"],
        "keys": None,
        "timestamps": [5, 5, 6],
        "tags": [[], ["only-tag"], []],
        "control": True,
        "producer_id": 2**40,
        "producer_epoch": 0,
        "base_sequence": 0,
        "base_offset": 2**33,
        "leader_epoch": 0,
    },
}
V1 = tuple(GOLDEN)
for _name in V1:
    GOLDEN[f"v2_{_name}"] = dict(GOLDEN[_name])
    GOLDEN[_name]["summary"] = False
GOLDEN["v2_tags_repeat"] = {  # a tag repeated in a record and across records, a key twice
    "values": [b"a", b"b", b"c"],
    "timestamps": 7,
    "headers": [[("region", b"eu"), ("region", b"us")], [("region", b"eu")], []],
    "tags": [["x", "x", "y"], ["y"], []],
}

# (field, byte offset, struct format) exactly as the table in storage/codec/header.py says
HEADER_FIELDS = [
    ("base_offset", 0, "<q"),
    ("batch_length", 8, "<i"),
    ("leader_epoch", 12, "<i"),
    ("magic", 16, "<B"),
    ("crc", 20, "<I"),
    ("attributes", 24, "<H"),
    ("summary_length", 26, "<H"),
    ("record_count", 28, "<i"),
    ("first_timestamp", 32, "<q"),
    ("max_timestamp", 40, "<q"),
    ("producer_id", 48, "<q"),
    ("producer_epoch", 56, "<h"),
    ("base_sequence", 60, "<i"),
    ("body_length", 64, "<i"),
    ("raw_body_length", 68, "<i"),
]
RESERVED = [(17, 3), (58, 2)]  # and (26, 2) in version 1, where it is not summary_length


def golden_bytes(name: str) -> bytes:
    lines = (GOLDEN_DIR / f"{name}.hex").read_text().splitlines()
    return bytes.fromhex("".join(line for line in lines if not line.startswith("#")))


def timestamps_of(case: dict[str, Any]) -> list[int]:
    ts = case["timestamps"]
    return [ts] * len(case["values"]) if isinstance(ts, int) else list(ts)


def version(case: dict[str, Any]) -> int:
    return 2 if case.get("summary", True) else 1


def expected_header(case: dict[str, Any], size: int, summary_length: int) -> dict[str, int]:
    ts = timestamps_of(case)
    return {
        "base_offset": case.get("base_offset", 0),
        "batch_length": size - 12,
        "leader_epoch": case.get("leader_epoch", -1),
        "magic": version(case),
        "summary_length": summary_length,
        "attributes": (0x10 if case.get("transactional") else 0)
        | (0x20 if case.get("control") else 0),
        "record_count": len(case["values"]),
        "first_timestamp": ts[0],
        "max_timestamp": max(ts),
        "producer_id": case.get("producer_id", -1),
        "producer_epoch": case.get("producer_epoch", -1),
        "base_sequence": case.get("base_sequence", -1),
        "body_length": size - HEADER_SIZE - summary_length,
        "raw_body_length": size - HEADER_SIZE - summary_length,
    }


# --- the body rebuilt from the storage/codec/body.py docstring, one record at a time ---------


def _int32s(xs: list[int]) -> bytes:
    return struct.pack(f"<{len(xs)}i", *xs)


def _offsets(items: list[bytes]) -> list[int]:
    out = [0]
    for item in items:
        out.append(out[-1] + len(item))
    return out


def _bitmap(valid: list[bool]) -> bytes:
    bits = sum(1 << i for i, v in enumerate(valid) if v)
    return bits.to_bytes((len(valid) + 7) // 8, "little")


def _binary_buffers(items: list[bytes | None]) -> list[bytes]:
    """validity (empty = no nulls), offsets (empty = all empty), data."""
    validity = b"" if None not in items else _bitmap([x is not None for x in items])
    data = [x or b"" for x in items]
    offsets = _int32s(_offsets(data)) if any(data) else b""
    return [validity, offsets, b"".join(data)]


def _list_offsets(lists: list[list[Any]]) -> bytes:
    """int32[n+1] list offsets, empty when every list is empty."""
    ends = _offsets([bytes(len(x)) for x in lists])
    return _int32s(ends) if ends[-1] else b""


def reference_body(case: dict[str, Any]) -> bytes:
    values = case["values"]
    n = len(values)
    keys = case.get("keys") or [None] * n
    headers = case.get("headers") or [[]] * n
    tags = case.get("tags") or [[]] * n
    pairs = [pair for record in headers for pair in record]
    all_tags = [tag.encode() for record in tags for tag in record]
    _, header_key_offsets, header_key_data = _binary_buffers([k.encode() for k, _ in pairs])
    _, header_value_offsets, header_value_data = _binary_buffers([v for _, v in pairs])
    _, tag_offsets, tag_data = _binary_buffers(all_tags)
    buffers = [
        struct.pack(f"<{n}q", *timestamps_of(case)),
        *_binary_buffers(keys),
        *_binary_buffers(values),
        _list_offsets(headers),
        header_key_offsets,
        header_key_data,
        header_value_offsets,
        header_value_data,
        _list_offsets(tags),
        tag_offsets,
        tag_data,
    ]
    assert len(buffers) == 15
    directory = struct.pack("<16I", *[len(b) for b in buffers], 0)
    return directory + b"".join(b + bytes(padded8(len(b)) - len(b)) for b in buffers)


# --- the summary rebuilt from the storage/codec/summary.py docstring -------------------------


def reference_summary_bytes(case: dict[str, Any]) -> bytes:
    """The summary of a small case (nothing near the limits, so everything is listed)."""
    n = len(case["values"])
    tags = case.get("tags") or [[]] * n
    headers = case.get("headers") or [[]] * n
    tag_records: dict[bytes, int] = {}
    for record in tags:
        for tag in {t.encode() for t in record}:
            tag_records[tag] = tag_records.get(tag, 0) + 1
    key_records: dict[bytes, int] = {}
    values: dict[bytes, dict[bytes, int]] = {}
    for record in headers:
        for key in {k.encode() for k, _ in record}:
            key_records[key] = key_records.get(key, 0) + 1
        for key, value in {(k.encode(), v) for k, v in record}:
            values.setdefault(key, {})[value] = values.get(key, {}).get(value, 0) + 1
    out = struct.pack("<IHH", sum(1 for r in tags if not r), len(tag_records), len(key_records))
    for tag in sorted(tag_records):
        out += struct.pack("<IH", tag_records[tag], len(tag)) + tag
    for key in sorted(key_records):
        out += struct.pack("<H", len(key)) + key
        out += struct.pack("<IH", key_records[key], len(values[key]))
        for value in sorted(values[key]):
            out += struct.pack("<IH", values[key][value], len(value)) + value
    return out + bytes(padded8(len(out)) - len(out))


# ---------------------------------------------------------------------------------------------


def test_the_golden_set_covers_both_versions() -> None:
    assert {version(c) for c in GOLDEN.values()} == {1, 2}
    assert all((GOLDEN_DIR / f"{name}.hex").exists() for name in GOLDEN)


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_encoder_reproduces_golden_bytes(name: str) -> None:
    assert encode_batch(**GOLDEN[name]).hex() == golden_bytes(name).hex()


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_golden_header_fields_sit_at_documented_offsets(name: str) -> None:
    batch = golden_bytes(name)
    got = {field: struct.unpack_from(fmt, batch, pos)[0] for field, pos, fmt in HEADER_FIELDS}
    summary_length = len(reference_summary_bytes(GOLDEN[name])) if version(GOLDEN[name]) == 2 else 0
    want = expected_header(GOLDEN[name], len(batch), summary_length)
    assert got.pop("crc") == google_crc32c.value(batch[24:])
    assert got == want
    for pos, size in RESERVED:
        assert batch[pos : pos + size] == bytes(size)
    assert len(batch) % 8 == 0
    assert len(batch) == padded8(HEADER_SIZE + got["body_length"]) + summary_length


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_golden_body_follows_documented_layout(name: str) -> None:
    batch = golden_bytes(name)
    body_length = struct.unpack_from("<i", batch, 64)[0]
    body = reference_body(GOLDEN[name])
    assert batch[HEADER_SIZE : HEADER_SIZE + padded8(body_length)] == body


@pytest.mark.parametrize("name", sorted(n for n, c in GOLDEN.items() if version(c) == 2))
def test_golden_summary_follows_documented_layout(name: str) -> None:
    batch = golden_bytes(name)
    body_length = struct.unpack_from("<i", batch, 64)[0]
    assert batch[padded8(HEADER_SIZE + body_length) :] == reference_summary_bytes(GOLDEN[name])


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_golden_bytes_decode_to_their_inputs(name: str) -> None:
    case = GOLDEN[name]
    n = len(case["values"])
    base = case.get("base_offset", 0)
    got = columns(decode_batch(golden_bytes(name)))
    assert got == {
        "offset": list(range(base, base + n)),
        "timestamp": timestamps_of(case),
        "key": case.get("keys") or [None] * n,
        "value": case["values"],
        "headers": case.get("headers") or [[]] * n,
        "tags": case.get("tags") or [[]] * n,
    }
