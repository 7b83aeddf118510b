"""The compiled walk of Kafka records (storage/kafka/walk.py) against the numpy one.

Both must give the same fields for every well-framed record set and refuse the same damaged
ones: record sets from an independent encoder (aiokafka's), then with bytes changed, cut off
or appended."""

from __future__ import annotations

import importlib.util
from typing import Any

import numpy as np
import pytest
from aiokafka.record.default_records import DefaultRecordBatchBuilder
from hypothesis import given, settings
from hypothesis import strategies as st

from storage.errors import CorruptBatchError
from storage.kafka import batch as kb
from storage.kafka import walk

# numba comes with the `dev` extra (and `agent`); an SDK install walks with numpy only
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("numba") is None, reason="numba is not installed"
)


def test_the_compiled_walk_is_used_where_numba_is_installed() -> None:
    assert walk.available()  # else it failed to compile or to walk a record right


def _records(records: list[tuple[bytes | None, bytes | None, list[Any]]]) -> tuple[bytes, int]:
    builder = DefaultRecordBatchBuilder(
        magic=2,
        compression_type=0,
        is_transactional=False,
        producer_id=-1,
        producer_epoch=-1,
        base_sequence=-1,
        batch_size=1 << 30,
    )
    for i, (key, value, headers) in enumerate(records):
        builder.append(i, timestamp=1_000 + i, key=key, value=value, headers=headers)
    return bytes(builder.build())[kb.HEADER_SIZE :], len(records)


def _verdict(scan: Any, data: bytes, n: int) -> Any:
    try:
        s = scan(data, n)
    except CorruptBatchError:
        return "refused"
    return [np.asarray(getattr(s, f)).tolist() for f in SCAN_FIELDS]


SCAN_FIELDS = (
    "timestamp_delta",
    "key_start",
    "key_len",
    "value_start",
    "value_len",
    "header_count",
    "headers_at",
    "ends",
)


_record = st.tuples(
    st.none() | st.binary(max_size=300),
    st.none() | st.binary(max_size=3000),
    st.lists(st.tuples(st.text(max_size=5), st.binary(max_size=10)), max_size=2),
)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(_record, min_size=1, max_size=30),
    st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 255)), max_size=3),
    st.integers(-3, 3),
    st.integers(-2, 2),
)
def test_the_compiled_walk_reads_and_refuses_what_the_numpy_walk_does(
    records: list[Any], flips: list[tuple[int, int]], cut: int, miscount: int
) -> None:
    data, n = _records(records)
    damaged = bytearray(data)
    for at, byte in flips:
        damaged[at % len(damaged)] = byte
    if cut < 0:
        damaged = damaged[:cut]
    else:
        damaged += bytes(cut)
    n = max(1, n + miscount)
    for candidate in (data, bytes(damaged)):
        want = _verdict(kb.scan_records_numpy, candidate, n)
        assert _verdict(kb.scan_records, candidate, n) == want


def test_a_walk_that_fails_names_the_record() -> None:
    data, n = _records([(None, b"a", []), (b"k", b"b", []), (None, b"c", [])])
    second = bytearray(data)
    second[data.index(b"\x02k") - 3] = 1  # the second record's attributes (key length 1: 0x02)
    with pytest.raises(CorruptBatchError, match=r"non-zero attributes \(record 1 of 3\)"):
        kb.scan_records(bytes(second), n)


@pytest.mark.parametrize("first_headers", [[], [("h", b"1")]])
def test_a_record_longer_than_its_fields_is_refused_by_both_walks(first_headers: Any) -> None:
    """Also when another record of the batch has headers: a record without any is checked
    whole by the walk itself."""
    data, n = _records([(None, b"a", first_headers), (None, b"b", [])])
    last = data.rindex(b"\x00", 0, data.rindex(b"b")) - 1  # the last record's length byte
    longer = bytearray(data)
    longer[last] += 2  # zigzag: one byte more
    for scan in (kb.scan_records, kb.scan_records_numpy):
        with pytest.raises(CorruptBatchError, match="do not fill"):
            scan(bytes(longer) + b"\x00", n)
