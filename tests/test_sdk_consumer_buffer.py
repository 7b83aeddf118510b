"""How the consumer hands out fetched bytes: position slicing, max_records, control batches,
torn tails and errors. Fed with encoded batches directly; no network."""

from __future__ import annotations

import pyarrow as pa
import pytest

from sdk.consumer import Consumer, _Buffered, to_records
from sdk.records import ConsumerRecord, TopicPartition
from storage.codec import SCHEMA, encode_batch
from storage.errors import CorruptBatchError

TP0 = TopicPartition("t", 0)
TP1 = TopicPartition("t", 1)


def batch(base: int, n: int, **kw: object) -> bytes:
    return encode_batch(
        [b"v%d" % (base + i) for i in range(n)], base_offset=base, timestamps=1000 + base, **kw
    )


def consumer(*fed: tuple[TopicPartition, int, bytes]) -> Consumer:
    c = Consumer({"bootstrap.servers": "localhost:1"})
    c.assign([tp for tp, _, _ in fed])
    for tp, position, data in fed:
        st = c._states[tp]
        st.position = position
        st.buffered = _Buffered(memoryview(data))
        c._buffered_bytes += len(data)
    return c


def offsets(got: dict[TopicPartition, list[pa.RecordBatch]], tp: TopicPartition) -> list[int]:
    return [o for rb in got.get(tp, []) for o in rb.column(0).to_pylist()]


def test_records_below_the_position_are_dropped() -> None:
    c = consumer((TP0, 13, batch(10, 5) + batch(15, 5)))
    got = c._take([TP0], 100)
    assert offsets(got, TP0) == list(range(13, 20))
    assert c._states[TP0].position == 20
    assert c._states[TP0].buffered is None and c._buffered_bytes == 0


def test_max_records_cuts_inside_a_batch_and_resumes_there() -> None:
    c = consumer((TP0, 0, batch(0, 10)))
    assert offsets(c._take([TP0], 4), TP0) == [0, 1, 2, 3]
    assert c._states[TP0].position == 4
    assert offsets(c._take([TP0], 4), TP0) == [4, 5, 6, 7]
    assert offsets(c._take([TP0], 4), TP0) == [8, 9]
    assert c._take([TP0], 4) == {}


def test_whole_batches_before_the_position_are_skipped_without_decoding() -> None:
    data = bytearray(batch(0, 5) + batch(5, 5))
    data[100] ^= 0xFF  # corrupt the first batch's body: it must not be decoded
    c = consumer((TP0, 7, bytes(data)))
    assert offsets(c._take([TP0], 100), TP0) == [7, 8, 9]


def test_control_batches_are_skipped() -> None:
    c = consumer((TP0, 0, batch(0, 2) + batch(2, 1, control=True) + batch(3, 2)))
    assert offsets(c._take([TP0], 100), TP0) == [0, 1, 3, 4]
    assert c._states[TP0].position == 5


def test_a_torn_tail_after_whole_batches_is_left_for_the_next_fetch() -> None:
    tail = batch(5, 5)
    c = consumer((TP0, 0, batch(0, 5) + tail[:50]))
    assert offsets(c._take([TP0], 100), TP0) == [0, 1, 2, 3, 4]
    assert c._states[TP0].position == 5 and c._states[TP0].error is None


def test_a_corrupt_batch_is_raised_after_other_partitions_data() -> None:
    bad = bytearray(batch(0, 3))
    bad[-20] ^= 0xFF
    c = consumer((TP0, 0, bytes(bad)), (TP1, 0, batch(0, 2)))
    got = c._take([TP0, TP1], 100)
    assert offsets(got, TP1) == [0, 1] and TP0 not in got
    with pytest.raises(CorruptBatchError, match="CRC32C"):
        c._take([TP0, TP1], 100)
    assert c._states[TP0].position == 0  # not skipped: the application decides (seek)
    assert c._take([TP0, TP1], 100) == {}


def test_max_records_spans_partitions() -> None:
    c = consumer((TP0, 0, batch(0, 5)), (TP1, 0, batch(0, 5)))
    got = c._take([TP0, TP1], 7)
    assert sum(rb.num_rows for rbs in got.values() for rb in rbs) == 7


def test_to_records_and_arrow_agree() -> None:
    data = encode_batch(
        [b"a", None, b"c"],
        keys=[b"k", None, b""],
        timestamps=[5, 6, 7],
        headers=[[("h", b"1")], None, [("x", b""), ("y", b"2")]],
        tags=[["red"], None, []],
        base_offset=40,
    )
    c = consumer((TP0, 41, data))
    got = c._take([TP0], 100)
    table = pa.Table.from_batches(got[TP0], schema=SCHEMA)
    assert table.column("offset").to_pylist() == [41, 42]
    assert to_records(TP0, got[TP0]) == [
        ConsumerRecord("t", 0, 41, 6, None, None, (), ()),
        ConsumerRecord("t", 0, 42, 7, b"", b"c", (("x", b""), ("y", b"2")), ()),
    ]
    plain = consumer((TP1, 0, batch(0, 2)))._take([TP1], 10)
    assert [r.headers for r in to_records(TP1, plain[TP1])] == [(), ()]
