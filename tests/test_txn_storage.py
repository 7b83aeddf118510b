"""Transactions at rest: markers, the per-log transaction index (LSO, aborted transactions),
producer state across markers, the object tier's footer version 2 and manifest entries.

Pure storage: no servers. The transaction index is checked against a brute-force model over
random histories (appends, markers, rolls), after reopening the log (rebuilt from the
headers) and after truncations.
"""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from storage.codec import encode_batch, iter_batches, read_header
from storage.codec.control import (
    ControlMarker,
    aborted_ranges,
    encode_marker,
    is_aborted,
    read_marker,
)
from storage.config import LogConfig
from storage.errors import CorruptBatchError, CorruptSegmentError, InvalidProducerEpochError
from storage.tier.layout import (
    ABORTED,
    ENTRY,
    TRAILER_SIZE,
    build_footer,
    decode_footer,
    decode_trailer,
)
from storage.tier.manifest import Manifest, SegmentEntry
from storage.wal import PartitionLog
from storage.wal.producers import ProducerStateTable

T0 = 1_700_000_000_000


def txn_batch(pid: int, seq: int, n: int = 2, epoch: int = 0, base: int = 0) -> bytes:
    return encode_batch(
        [b"v%d" % i for i in range(n)],
        timestamps=T0,
        producer_id=pid,
        producer_epoch=epoch,
        base_sequence=seq,
        transactional=True,
        base_offset=base,
    )


def marker(pid: int, *, commit: bool, token: int, epoch: int = 0, base: int = 0) -> bytes:
    data = bytearray(
        encode_marker(pid, epoch, commit=commit, coordinator_epoch=token, timestamp_ms=T0)
    )
    struct.pack_into("<q", data, 0, base)  # outside the CRC, as a leader stamps it
    return bytes(data)


# ---- markers ------------------------------------------------------------------------------------


@pytest.mark.parametrize("commit", [True, False])
def test_marker_round_trip(commit: bool) -> None:
    data = marker(42, commit=commit, token=7, epoch=3)
    h = read_header(data)
    assert h.is_control and h.is_transactional and h.record_count == 1
    assert (h.producer_id, h.producer_epoch, h.base_sequence) == (42, 3, -1)
    assert read_marker(data, 0, h, verify=True) == ControlMarker(commit, 7)


def test_marker_decoding_refuses_what_is_not_a_marker() -> None:
    plain = encode_batch([b"x"])
    with pytest.raises(CorruptBatchError, match="not a control batch"):
        read_marker(plain, 0, read_header(plain))
    two = encode_batch([b"a", b"b"], keys=[b"\0\0\1\0", b"\0\0\1\0"], control=True)
    with pytest.raises(CorruptBatchError, match="one record"):
        read_marker(two, 0, read_header(two))
    for key, value in ((b"\0\0\1", b"\0" * 6), (b"\0\0\7\0", b"\0" * 6), (b"\0\0\1\0", b"\0")):
        bad = encode_batch([value], keys=[key], control=True)
        with pytest.raises(CorruptBatchError):
            read_marker(bad, 0, read_header(bad))
    whole = marker(1, commit=True, token=1)
    for k in range(len(whole)):  # a torn marker is a typed error, never an IndexError
        with pytest.raises(CorruptBatchError):
            read_marker(whole[:k], 0, read_header(whole), verify=True)


def test_aborted_ranges_pick_batches_by_producer_and_offset() -> None:
    ranges = aborted_ranges([(7, 10, 20), (7, 40, 45), (8, 0, 5)])
    heads = {
        (7, 10): True,
        (7, 19): True,
        (7, 20): False,
        (7, 44): True,
        (7, 5): False,
        (8, 4): True,
        (9, 12): False,
    }
    for (pid, offset), want in heads.items():
        h = read_header(txn_batch(pid, 0, base=offset))
        assert is_aborted(ranges, h) is want, (pid, offset)
    plain = read_header(
        encode_batch([b"x"], base_offset=12, producer_id=7, producer_epoch=0, base_sequence=0)
    )
    assert not is_aborted(ranges, plain)  # not transactional: never part of a transaction


# ---- producer state across markers ----------------------------------------------------------


def _stored(batch: bytes, base: int) -> object:
    h = read_header(batch)
    import dataclasses

    return dataclasses.replace(h, base_offset=base)


def test_a_marker_of_a_newer_epoch_fences_the_older_one() -> None:
    table = ProducerStateTable()
    table.update(_stored(txn_batch(5, 0), 0), 0.0)  # type: ignore[arg-type]
    table.update(_stored(marker(5, commit=False, token=1, epoch=1), 2), 0.0)  # type: ignore[arg-type]
    assert table.epoch_of(5) == 1
    with pytest.raises(InvalidProducerEpochError):
        table.check_run([read_header(txn_batch(5, 2))])  # the zombie's next batch
    assert table.check_run([read_header(txn_batch(5, 0, epoch=1))]) is None
    # a marker of the current epoch keeps the sequences (they continue across transactions)
    table.update(_stored(txn_batch(5, 0, epoch=1), 3), 0.0)  # type: ignore[arg-type]
    table.update(_stored(marker(5, commit=True, token=2, epoch=1), 5), 0.0)  # type: ignore[arg-type]
    assert table.check_run([read_header(txn_batch(5, 2, epoch=1))]) is None
    assert table.check_run([read_header(txn_batch(5, 0, epoch=1))]) is not None  # a duplicate
    # a truncation below the marker keeps the entry only as far as it is still stored
    table.truncate(5)
    assert table.epoch_of(5) == 1
    table.truncate(3)
    assert table.epoch_of(5) == 1  # the fencing marker at 2 is still there
    table.truncate(2)
    assert table.epoch_of(5) is None


# ---- the transaction index of a log ----------------------------------------------------------


def test_last_stable_offset_and_aborted_ranges(tmp_path: Path) -> None:
    log = PartitionLog.open(tmp_path / "p", LogConfig(segment_bytes=1 << 20))
    log.append(encode_batch([b"plain"]), leader_epoch=0)  # 0
    log.append(txn_batch(1, 0), leader_epoch=0)  # 1-2 (txn of 1 starts)
    log.append(txn_batch(2, 0), leader_epoch=0)  # 3-4 (txn of 2 starts)
    log.append(txn_batch(1, 2), leader_epoch=0)  # 5-6
    assert log.last_stable_offset(7) == 1
    assert log.last_stable_offset(1) == 1 and log.last_stable_offset(0) == 0
    log.append(marker(1, commit=False, token=3), leader_epoch=0)  # 7: abort of 1
    assert log.last_stable_offset(7) == 1  # the marker is not below the watermark yet
    assert log.last_stable_offset(8) == 3  # 1 ended; 2 is open since 3
    log.roll()
    log.append(marker(2, commit=True, token=4), leader_epoch=0)  # 8: commit of 2
    assert log.last_stable_offset(8) == 3
    assert log.last_stable_offset(9) == 9
    [aborted] = log.aborted(0, 9)
    assert (aborted.producer_id, aborted.first_offset, aborted.last_offset) == (1, 1, 7)
    assert log.aborted(7, 9) == [aborted]  # the marker itself is in the range
    assert log.aborted(8, 9) == []
    assert log.aborted(0, 1) == []
    assert log.transactions.tokens == {1: 3, 2: 4}
    log.close()
    again = PartitionLog.open(tmp_path / "p", LogConfig(segment_bytes=1 << 20))
    assert again.last_stable_offset(9) == 9 and again.aborted(0, 9) == [aborted]
    assert again.transactions.tokens == {1: 3, 2: 4}
    assert again.producers.epoch_of(1) == 0
    again.truncate_to(8)  # the commit marker of 2 goes: its transaction is open again
    assert again.last_stable_offset(8) == 3 and again.transactions.tokens == {1: 3}
    assert again.aborted(0, 3) == [aborted]
    again.close()


def test_aborted_index_goes_with_deleted_segments(tmp_path: Path) -> None:
    log = PartitionLog.open(tmp_path / "p")
    log.append(txn_batch(1, 0), leader_epoch=0)  # 0-1
    log.append(marker(1, commit=False, token=1), leader_epoch=0)  # 2
    log.roll()
    log.append(txn_batch(1, 2), leader_epoch=0)  # 3-4
    log.append(marker(1, commit=False, token=2), leader_epoch=0)  # 5
    log.roll()
    log.flush()
    assert [a.first_offset for a in log.aborted(0, 6)] == [0, 3]
    log.delete_segments_before(3)
    assert [a.first_offset for a in log.aborted(0, 6)] == [3]
    log.close()


def test_a_restarted_log_forgets_the_transactions_it_dropped(tmp_path: Path) -> None:
    """A follower that restarts its log past its end (its leader's log start moved on) keeps
    no aborted entries or open transactions of the segments it dropped."""
    log = PartitionLog.open(tmp_path / "p")
    log.append(txn_batch(1, 0), leader_epoch=0)  # 0-1
    log.append(marker(1, commit=False, token=1), leader_epoch=0)  # 2
    log.append(txn_batch(2, 0), leader_epoch=0)  # 3-4, still open
    assert log.last_stable_offset(5) == 3 and log.aborted(0, 5)
    log.restart_at(100)
    assert log.aborted(0, 200) == []
    assert log.last_stable_offset(100) == 100
    log.append(txn_batch(3, 0, base=100), leader_epoch=0)  # 100-101
    log.append(marker(3, commit=False, token=1, base=102), leader_epoch=0)  # 102
    assert [(a.producer_id, a.first_offset) for a in log.aborted(100, 103)] == [(3, 100)]
    log.close()


ops = st.lists(
    st.one_of(
        st.tuples(st.just("txn"), st.integers(1, 4), st.integers(1, 3)),
        st.tuples(st.just("plain"), st.just(0), st.integers(1, 3)),
        st.tuples(st.just("commit"), st.integers(1, 4), st.just(1)),
        st.tuples(st.just("abort"), st.integers(1, 4), st.just(1)),
        st.tuples(st.just("roll"), st.just(0), st.just(0)),
    ),
    min_size=1,
    max_size=40,
)


def _model(history: list[tuple[str, int, int, int]], end: int) -> tuple[dict, list, list]:
    """(open first offsets, ended (pid, first, marker, aborted)) of the history below ``end``."""
    open_: dict[int, int] = {}
    ended: list[tuple[int, int, int, bool]] = []
    for kind, pid, base, _ in history:
        if base >= end:
            break
        if kind == "txn" and pid not in open_:
            open_[pid] = base
        elif kind in ("commit", "abort") and pid in open_:
            ended.append((pid, open_.pop(pid), base, kind == "abort"))
    return open_, ended, [(p, f, m) for p, f, m, a in ended if a]


def _lso(history: list[tuple[str, int, int, int]], end: int, hw: int) -> int:
    open_, ended, _ = _model(history, end)
    firsts = list(open_.values()) + [f for _, f, mk, _ in ended if mk >= hw]
    return min([hw, *firsts])


@settings(max_examples=80, deadline=None)
@given(history_ops=ops, data=st.data())
def test_index_matches_a_brute_force_model(
    tmp_path_factory: pytest.TempPathFactory,
    history_ops: list[tuple[str, int, int]],
    data: st.DataObject,
) -> None:
    directory = tmp_path_factory.mktemp("txn")
    log = PartitionLog.open(directory / "p", LogConfig(segment_bytes=1 << 20))
    seqs: dict[int, int] = {}
    history: list[tuple[str, int, int, int]] = []  # kind, pid, base offset, count
    token = 0
    for kind, pid, n in history_ops:
        base = log.log_end_offset
        if kind == "roll":
            log.roll()
            continue
        if kind == "txn":
            log.append(txn_batch(pid, seqs.get(pid, 0), n), leader_epoch=0)
            seqs[pid] = seqs.get(pid, 0) + n
        elif kind == "plain":
            log.append(encode_batch([b"p"] * n), leader_epoch=0)
        else:
            token += 1
            log.append(marker(pid, commit=kind == "commit", token=token), leader_epoch=0)
            n = 1
        history.append((kind, pid, base, n))
    end = log.log_end_offset

    def check(plog: PartitionLog, end: int, watermarks: list[int]) -> None:
        for hw in watermarks:  # ascending: a high watermark only moves up
            assert plog.last_stable_offset(hw) == _lso(history, end, hw)
        lso = plog.last_stable_offset(end)
        _, _, aborted = _model(history, end)
        start = data.draw(st.integers(0, max(lso, 0)))
        stop = data.draw(st.integers(start, max(lso, start)))
        want = sorted((p, f, m) for p, f, m in aborted if m >= start and f < stop)
        got = sorted(
            (a.producer_id, a.first_offset, a.last_offset) for a in plog.aborted(start, stop)
        )
        assert got == want

    watermarks = sorted({0, end // 2, end})
    check(log, end, watermarks)
    log.close()
    log = PartitionLog.open(directory / "p", LogConfig(segment_bytes=1 << 20))
    check(log, end, watermarks)  # rebuilt from the headers
    cut = data.draw(st.sampled_from([b for _, _, b, _ in history] + [end]))
    log.truncate_to(cut)
    check(log, cut, [cut])
    log.close()


# ---- the object tier ---------------------------------------------------------------------------


def _segment(base: int) -> bytes:
    out = bytearray()
    offset = base
    for i in range(4):
        out += txn_batch(9, i * 3, n=3, base=offset)
        offset += 3
    out += marker(9, commit=False, token=1, base=offset)
    return bytes(out)


def test_footer_version_2_lists_aborted_transactions_clipped_to_the_segment() -> None:
    data = _segment(100)  # offsets 100..112, the marker at 112
    footer = build_footer(data, interval=64, aborted=[(9, 90, 112), (3, 0, 10), (4, 113, 120)])
    f = decode_footer(footer)
    assert f.aborted == ((9, 100, 112),)  # clipped; the others are outside the segment
    assert footer[-TRAILER_SIZE:][4:6] == b"\x02\x00"
    assert decode_trailer(footer)[2] == len(f.rels) * ENTRY.size + ABORTED.size
    assert len(footer) == f.footer_length
    plain = build_footer(data, interval=64)
    assert plain[-TRAILER_SIZE:][4:6] == b"\x01\x00" and decode_footer(plain).aborted == ()
    entry = SegmentEntry.of(f)
    assert entry.aborted == 1 and entry.as_list()[-1] == 1
    plain_entry = SegmentEntry.of(decode_footer(plain))
    assert len(plain_entry.as_list()) == 6 and plain_entry.size + ABORTED.size == entry.size


def test_footer_version_2_torn_or_flipped_is_a_typed_error() -> None:
    data = _segment(0)
    footer = build_footer(data, interval=64, aborted=[(9, 0, 12), (10, 3, 6)])
    assert decode_footer(data + footer) == decode_footer(footer)
    for k in range(len(footer)):
        with pytest.raises(CorruptSegmentError):
            decode_footer(footer[:k])
        with pytest.raises(CorruptSegmentError):
            decode_footer(footer[k + 1 :])
        for bit in (0x01, 0x80):
            bad = bytearray(footer)
            bad[k] ^= bit
            with pytest.raises(CorruptSegmentError):
                decode_footer(bytes(bad))
    with pytest.raises(CorruptSegmentError):
        decode_footer(footer + b"\0" * 8)


def test_manifest_entries_with_and_without_aborted_counts() -> None:
    m = Manifest().appended(SegmentEntry(0, 10, 1, 500, 400, 1000), 1)
    m = m.appended(SegmentEntry(10, 20, 1, 500, 400, 2000, aborted=3), 1)
    raw = m.encode()
    assert b"[0,10,1,500,400,1000]" in raw and b"[10,20,1,500,400,2000,3]" in raw
    assert Manifest.decode(raw) == m
    with pytest.raises(CorruptSegmentError):
        Manifest.decode(raw.replace(b",2000,3]", b",2000,3,4]"))


def test_segments_built_from_a_log_carry_markers_whole() -> None:
    data = _segment(0)
    heads = [h for h, _ in iter_batches(data)]
    assert heads[-1].is_control and all(h.is_transactional for h in heads)
