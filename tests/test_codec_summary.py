"""The batch summary (format version 2, storage/codec/summary.py): limits, the leader's check
that a summary tells the truth, and bad bytes (typed errors only)."""

from __future__ import annotations

import struct

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from storage.codec import Compression, check_batch, encode_batch, read_header
from storage.codec import summary as sm
from storage.codec.body import (
    DIRECTORY,
    HEADERS_TYPE,
    SMALL_BATCH,
    TAGS_TYPE,
    check_small_body,
)
from storage.codec.header import HEADER_SIZE, padded
from storage.errors import CorruptBatchError
from tests.codec_support import (
    maybe_headers,
    maybe_tags,
    reference_summary,
    summary_as_dict,
    with_crc,
)


def _summary(batch: bytes) -> sm.Summary:
    s = sm.of_batch(batch, 0, read_header(batch))
    assert s is not None
    return s


def _replace_summary(batch: bytes, new: bytes) -> bytes:
    """``batch`` with another summary (lengths and CRC fixed up), as a buggy encoder makes it."""
    h = read_header(batch)
    out = bytearray(batch[: h.summary_position] + new)
    struct.pack_into("<i", out, 8, len(out) - 12)
    struct.pack_into("<H", out, 26, len(new))
    return with_crc(out)


def test_a_batch_without_tags_or_headers_has_the_eight_byte_summary() -> None:
    batch = encode_batch([b"x"] * 5, timestamps=1)
    h = read_header(batch)
    assert (h.magic, h.summary_length) == (2, 8)
    assert batch[h.summary_position :] == struct.pack("<IHH", 5, 0, 0)


def test_the_summary_is_outside_the_compressed_body() -> None:
    tags = [["a"]] * 100
    for compression in (Compression.ZSTD, Compression.LZ4):
        batch = encode_batch([b"x" * 100] * 100, tags=tags, compression=compression)
        assert dict(_summary(batch).tags or {}) == {b"a": 100}
        check_batch(batch, deep=True)


def test_records_without_tags_may_be_given_as_none() -> None:
    """The producer's accumulator hands over None for a record without tags or headers."""
    batch = encode_batch(
        [b"a", b"b", b"c"], tags=[["x"], None, ["x", "y"]], headers=[None, [("k", b"v")], None]
    )
    check_batch(batch, deep=True)
    s = _summary(batch)
    assert (s.untagged, dict(s.tags or {})) == (1, {b"x": 2, b"y": 1})
    assert s.headers == {b"k": sm.KeySummary(1, {b"v": 1})}


@pytest.mark.parametrize(
    "tags,headers,listed",
    [
        ([[f"t{i}"] for i in range(sm.MAX_TAGS + 1)], None, (False, True)),
        ([["x" * 3000], ["y" * 3000]], None, (False, True)),  # over MAX_SECTION_BYTES
        (None, [[(f"k{i}", b"v")] for i in range(sm.MAX_HEADER_KEYS + 1)], (True, False)),
    ],
)
def test_what_would_make_a_summary_large_is_left_out(
    tags: list[list[str]] | None,
    headers: list[list[tuple[str, bytes]]] | None,
    listed: tuple[bool, bool],
) -> None:
    n = len(tags or headers or [])
    batch = encode_batch([b"v"] * n, tags=tags, headers=headers)
    s = _summary(batch)
    assert (s.tags is not None, s.headers is not None) == listed
    assert read_header(batch).summary_length <= 2 * sm.MAX_SECTION_BYTES + 16
    assert summary_as_dict(s) == reference_summary(n, tags, headers)
    check_batch(batch, deep=True)


def test_a_key_with_many_values_is_listed_without_them() -> None:
    headers = [[("trace", f"id-{i}".encode()), ("region", b"eu")] for i in range(40)]
    s = _summary(encode_batch([b"v"] * 40, headers=headers))
    assert s.headers == {
        b"region": sm.KeySummary(40, {b"eu": 40}),
        b"trace": sm.KeySummary(40, None),
    }


def test_big_header_values_drop_every_value_list_first() -> None:
    headers = [[("k", bytes([i]) * 400)] for i in range(12)]
    s = _summary(encode_batch([b"v"] * 12, headers=headers))
    assert s.headers == {b"k": sm.KeySummary(12, None)}


# ---- the leader's check ---------------------------------------------------------------------


TAGGED = encode_batch(
    [b"a", b"b", b"c"],
    tags=[["x"], ["x", "y"], []],
    headers=[[("region", b"eu")], [], [("region", b"us")]],
)
HONEST = sm.Summary(3, 1, {b"x": 2, b"y": 1}, {b"region": sm.KeySummary(2, {b"eu": 1, b"us": 1})})


def test_the_honest_summary_is_what_the_encoder_wrote() -> None:
    assert _summary(TAGGED) == HONEST
    assert sm.encode(HONEST) == TAGGED[read_header(TAGGED).summary_position :]


@pytest.fixture(params=["one by one", "columnar"])
def counting(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The deep check counts few tags and headers one by one and many column by column (as
    ``build`` does): each test that takes this runs with both."""
    monkeypatch.setattr(sm, "SMALL", 1 << 30 if request.param == "one by one" else -1)
    return str(request.param)


@pytest.mark.parametrize(
    "lie",
    [
        sm.Summary(3, 0, HONEST.tags, HONEST.headers),  # untagged count
        sm.Summary(3, 1, {b"x": 2}, HONEST.headers),  # a tag missing
        sm.Summary(3, 1, {b"x": 1, b"y": 1}, HONEST.headers),  # a wrong count
        sm.Summary(3, 1, {b"x": 2, b"y": 1, b"z": 1}, HONEST.headers),  # a tag too many
        sm.Summary(3, 1, HONEST.tags, {}),  # header keys missing
        sm.Summary(3, 1, HONEST.tags, {b"region": sm.KeySummary(2, {b"eu": 2})}),
        sm.Summary(3, 1, HONEST.tags, {b"region": sm.KeySummary(3, None)}),
    ],
)
def test_the_deep_check_refuses_a_summary_that_lies(lie: sm.Summary, counting: str) -> None:
    forged = _replace_summary(TAGGED, sm.encode(lie))
    check_batch(forged)  # the O(1) check does not read the summary
    with pytest.raises(CorruptBatchError, match="summary"):
        check_batch(forged, deep=True)


@pytest.mark.parametrize(
    "partial",
    [
        sm.Summary(3, 1, None, HONEST.headers),
        sm.Summary(3, 1, HONEST.tags, None),
        sm.Summary(3, 1, HONEST.tags, {b"region": sm.KeySummary(2, None)}),
    ],
)
def test_the_deep_check_accepts_a_summary_that_leaves_things_out(
    partial: sm.Summary, counting: str
) -> None:
    check_batch(_replace_summary(TAGGED, sm.encode(partial)), deep=True)


def test_a_flat_body_must_not_have_a_summary_with_tags() -> None:
    flat = encode_batch([b"a", b"b"])
    for lie in (sm.Summary(2, 1, {b"x": 1}, {}), sm.Summary(2, 0, None, None)):
        with pytest.raises(CorruptBatchError, match="summary"):
            check_batch(_replace_summary(flat, sm.encode(lie)), deep=True)
    check_batch(_replace_summary(flat, sm.encode(sm.Summary(2, 2, None, None))), deep=True)


# ---- bad bytes ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw",
    [
        struct.pack("<IHH", 4, 0, 0),  # 4 untagged of 3 records
        struct.pack("<IHH", 1, 0, 0),  # records have tags but none is listed
        struct.pack("<IHH", 3, 1, 0)
        + struct.pack("<IH", 1, 1)
        + b"x"
        + bytes(1),  # all untagged, yet a tag
        struct.pack("<IHH", 0, 2, 0)
        + struct.pack("<IH", 1, 1)
        + b"b"
        + struct.pack("<IH", 1, 1)
        + b"a"
        + bytes(2),  # unsorted
        struct.pack("<IHH", 0, 1, 0) + struct.pack("<IH", 0, 1) + b"a" + bytes(1),  # zero records
        struct.pack("<IHH", 0, 1, 0) + struct.pack("<IH", 3, 9) + b"a",  # runs past the end
        struct.pack("<IHH", 3, 0, 0) + b"\x00" * 7 + b"\x01",  # not padding
        struct.pack("<IHH", 3, 0, 0) + bytes(8),  # too much padding
        struct.pack("<IHH", 3, 0, 1)
        + struct.pack("<H", 1)
        + b"k"
        + struct.pack("<IH", 2, 0)
        + bytes(5),  # key without values
    ],
)
def test_malformed_summaries_are_corrupt(raw: bytes) -> None:
    with pytest.raises(CorruptBatchError, match="batch summary"):
        sm.parse(raw, 0, len(raw), 3)


@settings(max_examples=1000, deadline=None)
@given(st.binary(max_size=80), st.integers(1, 5))
def test_any_bytes_parse_or_raise_corrupt_batch(raw: bytes, n: int) -> None:
    try:
        s = sm.parse(raw, 0, len(raw), n)
    except CorruptBatchError:
        return
    assert s.untagged <= n and all(0 < c <= n for c in (s.tags or {}).values())


def test_a_truncated_summary_is_corrupt_at_every_cut() -> None:
    h = read_header(TAGGED)
    raw = TAGGED[h.summary_position :]
    for cut in range(len(raw)):
        with pytest.raises(CorruptBatchError):
            sm.parse(raw[:cut], 0, cut, 3)


_tag_lists = st.lists(st.lists(st.sampled_from(["a", "b", "é", "x" * 30]), max_size=3), min_size=1)
_header_lists = st.lists(
    st.lists(st.tuples(st.sampled_from(["k", "region"]), st.binary(max_size=3)), max_size=3),
    min_size=1,
)


@settings(max_examples=80, deadline=None)
@given(_tag_lists, _header_lists)
def test_few_tags_and_headers_counted_one_by_one_give_the_columnar_summary(
    tags: list[list[str]], headers: list[list[tuple[str, bytes]]]
) -> None:
    """Up to ``SMALL`` elements take the plain-Python count: the same summary as the columnar
    count, and as the record-by-record reference."""
    n = min(len(tags), len(headers))
    tags, headers = tags[:n], headers[:n]
    saved = sm.SMALL
    try:
        sm.SMALL = 1 << 30
        small = _summary(encode_batch([b"v"] * n, tags=tags, headers=headers))
        sm.SMALL = -1
        columnar = _summary(encode_batch([b"v"] * n, tags=tags, headers=headers))
    finally:
        sm.SMALL = saved
    assert small == columnar
    assert summary_as_dict(small) == reference_summary(n, tags, headers)


_maybe_tags = maybe_tags(SMALL_BATCH + 6)
_maybe_headers = maybe_headers(SMALL_BATCH + 6)


@settings(max_examples=300, deadline=None)
@given(_maybe_tags, _maybe_headers, st.booleans(), st.booleans(), st.booleans())
def test_plain_lists_laid_out_without_pyarrow_give_the_same_batch(
    tags: list[list[str] | None],
    headers: list[list[tuple[str, bytes]] | None],
    with_tags: bool,
    with_headers: bool,
    summary: bool,
) -> None:
    """A few records whose tags and headers are plain lists skip pyarrow (the retry router's
    and the scheduler's one-record batches): the batch is byte for byte the one pyarrow lays
    out from the same values given as Arrow arrays."""
    n = min(len(tags), len(headers))
    t = tags[:n] if with_tags else None
    h = headers[:n] if with_headers else None

    def batch(tag_col: object, header_col: object) -> bytes:
        return encode_batch(
            [b"v%d" % i for i in range(n)],
            keys=[None] * n,
            timestamps=7,
            tags=tag_col,
            headers=header_col,
            summary=summary,
        )

    arrow_tags = None if t is None else pa.array(t, TAGS_TYPE)
    arrow_headers = None if h is None else pa.array(h, HEADERS_TYPE)
    assert batch(t, h) == batch(arrow_tags, arrow_headers)


@settings(max_examples=200, deadline=None)
@given(_maybe_tags, _maybe_headers)
def test_the_encoder_writes_the_summary_the_deep_check_expects(
    tags: list[list[str] | None], headers: list[list[tuple[str, bytes]] | None]
) -> None:
    """The leader takes a summary without parsing it when it is byte for byte the one the
    encoder writes for the records (``summary.canonical``), so whatever the encoder writes
    must be that, for every mix of tags and headers, whichever way it counted them."""
    n = min(len(tags), len(headers))
    batch = encode_batch([b"v"] * n, tags=tags[:n], headers=headers[:n])
    h = read_header(batch)
    lists = check_small_body(batch, HEADER_SIZE, DIRECTORY.unpack_from(batch, HEADER_SIZE), n)
    if lists is None:  # more than ``SMALL`` tags and headers: the columnar check
        return
    expected = sm.canonical(n, *sm.count_small(n, *lists))
    assert sm.is_canonical(batch, 0, h, expected)


def test_tags_and_headers_before_the_first_record_are_not_counted(counting: str) -> None:
    """Arrow lets a list column's first list start past element 0; the elements before it
    belong to no record, so a summary may not count them (a forged batch could else claim
    a header for every record that no record has)."""
    n = 2
    batch = bytearray(encode_batch([b"a", b"b"], headers=[[("k", b"1")], [("k", b"1")]]))
    lengths = DIRECTORY.unpack_from(batch, HEADER_SIZE)
    at = HEADER_SIZE + DIRECTORY.size + sum(padded(x) for x in lengths[:7])
    # the first record's list becomes empty: its pair now precedes the first list
    struct.pack_into("<3i", batch, at, 1, 1, 2)
    honest = sm.Summary(n, n, {}, {b"k": sm.KeySummary(1, {b"1": 1})})
    check_batch(_replace_summary(bytes(batch), sm.encode(honest)), deep=True)
    lie = sm.Summary(n, n, {}, {b"k": sm.KeySummary(2, {b"1": 2})})
    with pytest.raises(CorruptBatchError, match="summary"):
        check_batch(_replace_summary(bytes(batch), sm.encode(lie)), deep=True)
