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


def test_small_batches_are_handed_out_as_one_run_cut_by_position_and_max_records() -> None:
    """Small plain batches (a keyed topic of many partitions) are decoded together; gaps
    between their offsets, the position and max_records still cut where they should."""
    data = batch(0, 2) + batch(2, 3) + batch(10, 2) + batch(12, 1) + batch(20, 4)
    c = consumer((TP0, 3, data))
    got = c._take([TP0], 4)
    assert offsets(got, TP0) == [3, 4, 10, 11] and len(got[TP0]) == 1
    assert c._states[TP0].position == 12
    rest = c._take([TP0], 100)
    assert offsets(rest, TP0) == [12, 20, 21, 22, 23]
    assert [r.value for r in to_records(TP0, rest[TP0])] == [b"v12", b"v20", b"v21", b"v22", b"v23"]
    assert c._states[TP0].position == 24 and c._states[TP0].buffered is None


def test_a_corrupt_batch_after_a_run_of_small_ones_is_raised_after_them() -> None:
    bad = bytearray(batch(4, 2))
    bad[-20] ^= 0xFF
    c = consumer((TP0, 0, batch(0, 2) + batch(2, 2) + bytes(bad) + batch(6, 2)))
    assert offsets(c._take([TP0], 100), TP0) == [0, 1, 2, 3]
    with pytest.raises(CorruptBatchError, match="CRC32C"):
        c._take([TP0], 100)
    assert c._states[TP0].position == 4


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


# ---- filtered fetches: selections and the agent's next_offset ---------------------------------


def filtered(
    tp: TopicPartition, position: int, data: bytes, end: int, sel: dict[int, bytes]
) -> Consumer:
    c = consumer((tp, position, data))
    c._states[tp].buffered = _Buffered(memoryview(data), end, sel)
    return c


def test_a_selection_hands_out_only_the_selected_records_and_the_position_ends_at_next_offset() -> (
    None
):
    # batch 10-14 mixed (11 and 13 match), 20-22 whole; the agent looked up to offset 40
    c = filtered(TP0, 10, batch(10, 5) + batch(20, 3), 40, {10: bytes([0b01010])})
    assert offsets(c._take([TP0], 100), TP0) == [11, 13, 20, 21, 22]
    assert c._states[TP0].position == 40 and c._states[TP0].buffered is None


def test_max_records_cuts_a_selected_batch_and_resumes_after_the_last_record_handed_out() -> None:
    c = filtered(TP0, 0, batch(0, 8), 8, {0: bytes([0b10110110])})  # 1, 2, 4, 5, 7
    assert offsets(c._take([TP0], 2), TP0) == [1, 2]
    assert c._states[TP0].position == 3
    assert offsets(c._take([TP0], 2), TP0) == [4, 5]
    assert c._states[TP0].position == 6
    assert offsets(c._take([TP0], 2), TP0) == [7]
    assert c._states[TP0].position == 8
    assert c._take([TP0], 2) == {}


def test_selected_records_below_the_position_are_dropped() -> None:
    c = filtered(TP0, 3, batch(0, 8), 8, {0: bytes([0b10110110])})
    assert offsets(c._take([TP0], 100), TP0) == [4, 5, 7]


def test_a_selection_of_the_wrong_size_is_an_error_for_that_partition() -> None:
    c = filtered(TP0, 0, batch(0, 8), 8, {0: b"\x01\x00"})
    with pytest.raises(CorruptBatchError):
        c._take([TP0], 100)
