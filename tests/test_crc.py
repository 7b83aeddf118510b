"""CRC32C (Castagnoli) through storage.crc: known answers, chaining, buffer types, fast path."""

from __future__ import annotations

import google_crc32c
import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import storage.crc
from storage.crc import crc32c, crc32c_combine

# RFC 3720 (iSCSI) appendix B.4; the CRC bytes there are listed least significant first
ISCSI_READ_PDU = bytes.fromhex(
    "01c00000000000000000000000000000"
    "14000000000004000000001400000018"
    "28000000000000000200000000000000"
)
KNOWN_ANSWERS = [
    (b"", 0x00000000),
    (b"a", 0xC1D04330),
    (b"123456789", 0xE3069283),  # the CRC catalogue's check value for CRC-32C
    (bytes(32), 0x8A9136AA),
    (b"\xff" * 32, 0x62A8AB43),
    (bytes(range(32)), 0x46DD794E),
    (bytes(range(31, -1, -1)), 0x113FDB5C),
    (ISCSI_READ_PDU, 0xD9963A56),
]


@pytest.mark.parametrize(("data", "expected"), KNOWN_ANSWERS)
def test_known_answers(data: bytes, expected: int) -> None:
    assert crc32c(data) == expected


@pytest.mark.parametrize(("data", "expected"), KNOWN_ANSWERS)
def test_buffer_types_give_the_same_answer(data: bytes, expected: int) -> None:
    padded = b"xyz" + data + b"tail"
    assert crc32c(memoryview(data)) == expected
    assert crc32c(memoryview(padded)[3 : 3 + len(data)]) == expected
    assert crc32c(memoryview(bytearray(data))) == expected
    assert crc32c(pa.py_buffer(data)) == expected
    assert crc32c(pa.py_buffer(padded).slice(3, len(data))) == expected


def test_memoryview_of_typed_array_is_its_bytes() -> None:
    arr = np.arange(1000, dtype=np.int32)
    assert crc32c(memoryview(arr)) == crc32c(arr.tobytes())
    assert crc32c(memoryview(arr), 0x1234) == crc32c(arr.tobytes(), 0x1234)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200), st.binary(max_size=200), st.binary(max_size=200))
def test_chaining_equals_one_pass(a: bytes, b: bytes, c: bytes) -> None:
    whole = crc32c(a + b + c)
    assert crc32c(c, crc32c(b, crc32c(a))) == whole
    assert crc32c(memoryview(c), crc32c(pa.py_buffer(b), crc32c(memoryview(a)))) == whole


def test_chaining_through_an_empty_chunk() -> None:
    assert crc32c(b"", 0xE3069283) == 0xE3069283
    assert crc32c(b"789", crc32c(b"", crc32c(b"123456"))) == 0xE3069283


def test_detects_any_single_bit_flip() -> None:
    data = bytes(range(64))
    good = crc32c(data)
    for i in range(len(data) * 8):
        flipped = bytearray(data)
        flipped[i // 8] ^= 1 << (i % 8)
        assert crc32c(bytes(flipped)) != good


def test_fast_path_is_the_c_extension() -> None:
    assert google_crc32c.implementation == "c"
    assert storage.crc.IMPLEMENTATION == "c"


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300), st.binary(max_size=5000), st.integers(0, 1 << 21))
def test_combine_gives_the_crc_of_the_concatenation(a: bytes, b: bytes, zeros: int) -> None:
    assert crc32c_combine(crc32c(a), crc32c(b), len(b)) == crc32c(a + b)
    # long second parts (a batch of a megabyte and more): a run of zero bytes of any length
    z = bytes(zeros)
    assert crc32c_combine(crc32c(a), crc32c(z), zeros) == crc32c(a + z)
    # the cached shift of a length seen before gives the same answer
    assert crc32c_combine(crc32c(a), crc32c(z), zeros) == crc32c(a + z)


def test_combine_refuses_a_negative_length_and_multiplies_by_zero() -> None:
    with pytest.raises(ValueError):
        crc32c_combine(1, 2, -1)
    assert crc32c_combine(crc32c(b"abc"), 0, 0) == crc32c(b"abc")
    assert storage.crc._multmodp(0, 0x12345678) == 0  # returns: no endless loop
