"""The deep check of a small body with tags or headers in plain Python
(``storage.codec.body.check_small_body``) against the Arrow decode it stands in for: on
honest batches and on forged ones (any body byte changed, the CRC recomputed, as a forger
would), both accept or both refuse, and the summary is checked the same way."""

from __future__ import annotations

import struct
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from storage.codec import batch as batch_module
from storage.codec import encode_batch, summary
from storage.codec.batch import check_batch
from storage.codec.body import check_small_body
from storage.codec.header import read_header
from storage.errors import CorruptBatchError
from tests.codec_support import HEADER_SIZE, body_buffers, maybe_headers, maybe_tags, with_crc

_tags = maybe_tags(40)
_headers = maybe_headers(40)


def _verdict(data: bytes, *, arrow: bool) -> str:
    """ "ok" or the refusal's reason, with the plain-Python check or with Arrow's."""
    saved = batch_module.check_small_body
    if arrow:
        batch_module.check_small_body = lambda *_: None  # type: ignore[assignment]
    try:
        check_batch(data, deep=True)
        return "ok"
    except CorruptBatchError:
        return "refused"
    finally:
        batch_module.check_small_body = saved


def _batch(tags: list[list[str] | None], headers: list[list[tuple[str, bytes]] | None]) -> bytes:
    n = min(len(tags), len(headers))
    return encode_batch([b"v%d" % i for i in range(n)], tags=tags[:n], headers=headers[:n])


@pytest.fixture
def used(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether the plain-Python check answered, call by call."""
    calls: list[bool] = []
    real = batch_module.check_small_body

    def counting(*args: Any) -> Any:
        got = real(*args)
        calls.append(got is not None)
        return got

    monkeypatch.setattr(batch_module, "check_small_body", counting)
    return calls


@settings(max_examples=150, deadline=None)
@given(_tags, _headers)
def test_honest_small_batches_pass_both_checks(
    tags: list[list[str] | None], headers: list[list[tuple[str, bytes]] | None]
) -> None:
    data = _batch(tags, headers)
    assert _verdict(data, arrow=False) == "ok" == _verdict(data, arrow=True)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_tags, _headers, st.data())
def test_a_forged_body_gets_the_same_verdict_from_both_checks(
    tags: list[list[str] | None],
    headers: list[list[tuple[str, bytes]] | None],
    data: st.DataObject,
) -> None:
    honest = _batch(tags, headers)
    h = read_header(honest)
    end = h.summary_position + h.summary_length  # the body, its padding and the summary
    at = data.draw(st.integers(HEADER_SIZE, end - 1), label="byte")
    value = data.draw(st.integers(0, 255), label="value")
    forged = bytearray(honest)
    forged[at] = value
    forged_bytes = with_crc(forged)
    assert _verdict(forged_bytes, arrow=False) == _verdict(forged_bytes, arrow=True)


def test_the_plain_check_is_the_one_used_for_small_batches_with_headers(used: list[bool]) -> None:
    one = encode_batch([b"v"], headers=[[("strata.retry.attempt", b"1"), ("k", b"v")]])
    check_batch(one, deep=True)
    n = summary.SMALL // 2 + 1  # one pair more than the plain check takes
    many = encode_batch([b"v"] * n, headers=[[("k", b"v"), ("j", b"w")]] * n)
    check_batch(many, deep=True)
    assert used == [True, False]


def test_a_header_key_that_is_not_utf8_is_refused() -> None:
    honest = encode_batch([b"v"], headers=[[("ké", b"v")]])
    pos = body_buffers(honest)[9][0]  # the header keys' bytes
    forged = bytearray(honest)
    forged[pos + 1] = 0xFF  # a broken two-byte sequence
    with pytest.raises(CorruptBatchError, match="UTF-8"):
        check_batch(with_crc(forged), deep=True)


@pytest.mark.parametrize("buffer", [7, 8, 10, 12, 13], ids=lambda b: f"buffer-{b}")
@pytest.mark.parametrize("forge", ["past the data", "negative first", "decreasing"])
def test_bad_offsets_are_refused_by_the_plain_check_itself(buffer: int, forge: str) -> None:
    """Refused by ``check_small_body`` before any summary is compared (a summary that does
    not list a value would not catch a value read from the wrong bytes), and by Arrow."""
    honest = encode_batch(
        [b"a", b"b"],
        tags=[["x", "yy"], ["zzz"]],
        headers=[[("k", b"12"), ("kk", b"345")], [("k", b"6789")]],
    )
    buffers = body_buffers(honest)
    pos, length = buffers[buffer]
    count = length // 4 - 1
    offsets = list(struct.unpack_from(f"<{count + 1}i", honest, pos))
    if forge == "past the data":
        # a list's children are the next buffers' entries; a string's, its data bytes
        offsets[-1] = (count + 5) if buffer in (7, 12) else buffers[buffer + 1][1] + 1
    elif forge == "negative first":
        offsets[0] = -1
    else:
        offsets[1], offsets[2] = offsets[2] + 1, offsets[1]
    forged = bytearray(honest)
    struct.pack_into(f"<{count + 1}i", forged, pos, *offsets)
    h = read_header(honest)
    lengths = struct.unpack_from("<16I", forged, HEADER_SIZE)
    with pytest.raises(CorruptBatchError):
        check_small_body(bytes(forged), HEADER_SIZE, lengths, h.record_count)
    assert _verdict(with_crc(forged), arrow=True) == "refused"
