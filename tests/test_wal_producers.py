"""Idempotent producers' state in a partition log: sequence checks, duplicates, rebuilds."""

from __future__ import annotations

from pathlib import Path

import pytest

from storage.codec import check_batch, encode_batch, read_header
from storage.codec.header import DEDUP_WINDOW, BatchHeader
from storage.errors import (
    CorruptBatchError,
    DuplicateSequenceError,
    InvalidProducerEpochError,
    OutOfOrderSequenceError,
)
from storage.wal import PartitionLog
from storage.wal.producers import Duplicate, ProducerStateTable
from tests.wal_support import T0, config

PID = 4242


def batch(seq: int, n: int = 2, *, pid: int = PID, epoch: int = 0, pad: int = 0) -> bytes:
    return encode_batch(
        [b"v%d" % (seq + i) + bytes(pad) for i in range(n)],
        timestamps=T0,
        producer_id=pid,
        producer_epoch=epoch,
        base_sequence=seq,
    )


def header(data: bytes) -> BatchHeader:
    return read_header(data)


def append(log: PartitionLog, data: bytes) -> int:
    """What the agent does: check the run, then append; the first offset either way."""
    dup = log.producers.check_run([check_batch(data)])
    if dup is not None:
        return dup.base_offset
    return log.append(data, leader_epoch=1).base_offset


def test_next_sequence_is_appended_and_a_retry_gets_its_original_offsets(tmp_path: Path) -> None:
    with PartitionLog.open(tmp_path, config()) as log:
        assert append(log, batch(0)) == 0
        assert append(log, encode_batch([b"other"], timestamps=T0)) == 2  # no producer id
        assert append(log, batch(2)) == 3
        assert append(log, batch(0)) == 0  # retried: answered, not stored again
        assert append(log, batch(2)) == 3
        assert log.log_end_offset == 5


def test_a_gap_or_an_old_epoch_is_refused_and_nothing_is_stored(tmp_path: Path) -> None:
    with PartitionLog.open(tmp_path, config()) as log:
        append(log, batch(0, epoch=3))
        with pytest.raises(OutOfOrderSequenceError):
            append(log, batch(4, epoch=3))  # sequences 2-3 missing
        with pytest.raises(InvalidProducerEpochError):
            append(log, batch(2, epoch=2))
        with pytest.raises(OutOfOrderSequenceError):
            append(log, batch(5, epoch=4))  # a new epoch starts at 0
        assert log.log_end_offset == 2
        assert append(log, batch(0, epoch=4)) == 2  # restarted sequences: accepted
        with pytest.raises(InvalidProducerEpochError):
            append(log, batch(2, epoch=3))  # the old epoch is fenced now


def test_an_unknown_producer_may_start_anywhere(tmp_path: Path) -> None:
    """State lost (expired, or older than the local log): accepted, as Kafka does."""
    with PartitionLog.open(tmp_path, config()) as log:
        assert append(log, batch(1000)) == 0
        assert append(log, batch(1002)) == 2


def test_only_the_last_batches_are_remembered(tmp_path: Path) -> None:
    with PartitionLog.open(tmp_path, config()) as log:
        for i in range(DEDUP_WINDOW + 1):
            append(log, batch(2 * i))
        for i in range(1, DEDUP_WINDOW + 1):
            assert append(log, batch(2 * i)) == 2 * i
        with pytest.raises(OutOfOrderSequenceError):
            append(log, batch(0))  # too old to recognise: refused, never stored twice
        assert log.log_end_offset == 2 * (DEDUP_WINDOW + 1)


def test_sequences_wrap_at_2_31(tmp_path: Path) -> None:
    top = 2**31 - 2
    with PartitionLog.open(tmp_path, config()) as log:
        append(log, batch(top, n=2))
        assert append(log, batch(0, n=2)) == 2


def test_a_run_must_continue_itself_and_may_not_repeat_a_stored_batch(tmp_path: Path) -> None:
    with PartitionLog.open(tmp_path, config()) as log:
        table = log.producers
        append(log, batch(0))
        assert table.check_run([header(batch(2)), header(batch(4))]) is None
        with pytest.raises(OutOfOrderSequenceError):
            table.check_run([header(batch(2)), header(batch(6))])
        with pytest.raises(DuplicateSequenceError):
            table.check_run([header(batch(0)), header(batch(2))])
        assert table.check_run([header(batch(0))]) == Duplicate(0, 1)


def test_impossible_producer_fields_are_refused() -> None:
    table = ProducerStateTable()
    with pytest.raises(CorruptBatchError):
        table.check_run([header(batch(0, pid=-5))])
    bad = encode_batch([b"x"], producer_id=7, producer_epoch=-1, base_sequence=0)
    with pytest.raises(CorruptBatchError):
        table.check_run([header(bad)])


def test_state_is_rebuilt_from_the_log_on_open_and_trimmed_by_truncation(tmp_path: Path) -> None:
    with PartitionLog.open(tmp_path, config()) as log:
        for i in range(6):
            append(log, batch(2 * i, pad=1500))
        assert len(log.segments) > 1
    with PartitionLog.open(tmp_path, config()) as log:
        assert append(log, batch(10)) == 10  # a retry after a restart: still recognised
        with pytest.raises(OutOfOrderSequenceError):
            append(log, batch(14))
        log.truncate_to(8)  # the batches at 8 and 10 are gone: sequence 8 comes next
        with pytest.raises(OutOfOrderSequenceError):
            append(log, batch(12))
        assert append(log, batch(8)) == 8


def test_the_table_is_bounded_by_count_and_by_idle_time() -> None:
    table = ProducerStateTable(max_producers=3, expiration_s=100)
    for pid in range(5):
        table.update(header(batch(0, pid=pid)), now=1000.0 + pid)
    assert len(table) == 3
    # producer 0 was evicted: its retry cannot be recognised, so it counts as new
    assert table.check_run([header(batch(6, pid=0))]) is None
    table.update(header(batch(0, pid=9)), now=1103.5)  # 2 and 3 idle for over 100 s
    assert len(table) == 2


def test_a_producer_whose_batches_were_all_truncated_away_starts_afresh(tmp_path: Path) -> None:
    with PartitionLog.open(tmp_path, config()) as log:
        append(log, batch(0, pid=1))
        append(log, batch(0, pid=2))
        append(log, batch(2, pid=2))
        log.truncate_to(2)  # producer 2's batches are gone; producer 1's is kept
        assert append(log, batch(0, pid=2)) == 2  # stored again: it is no longer in the log
        assert append(log, batch(0, pid=1)) == 0  # still recognised as a retry
