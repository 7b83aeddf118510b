"""Planning and reading committed segments without agents or Spark (a ``file://`` archive)."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

from sdk.replay import Archive, ArchiveConfig, Bounds, plan, read_segment, replay
from storage.codec import encode_batch, stamp
from storage.errors import CorruptSegmentError
from storage.tier import Manifest, SegmentEntry, build_footer, decode_footer
from storage.tier.snapshot import ManifestSnapshot, parse_snapshot_key, snapshot_key

T0 = 1_700_000_000_000


def _write(root: Path, topic: str = "t", partitions: int = 2, segments: int = 3) -> None:
    """Segments of 10 batches x 100 records; batch b of segment s has timestamp T0 + (10s+b) s."""
    bucket = root / "b"
    for p in range(partitions):
        m, off = Manifest(), 0
        for s in range(segments):
            data = bytearray()
            for b in range(10):
                raw = bytearray(
                    encode_batch(
                        [b"p%d-o%d" % (p, off + i) for i in range(100)],
                        keys=[b"k%d" % (i % 3) for i in range(100)],
                        tags=[["a"] if i % 2 else [] for i in range(100)],
                        timestamps=[T0 + (s * 10 + b) * 1000] * 100,
                    )
                )
                raw[:16] = stamp(off, len(raw) - 12, 1)
                data += raw
                off += 100
            footer = build_footer(bytes(data), interval=4096)
            e = SegmentEntry.of(decode_footer(footer))
            path = bucket / e.key(topic, "id", p)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(bytes(data) + footer)
            m = m.appended(e, 1)
        snap = bucket / snapshot_key(topic, p)
        snap.parent.mkdir(parents=True, exist_ok=True)
        snap.write_bytes(ManifestSnapshot(topic, "id", p, m).encode())


@pytest.fixture
def archive(tmp_path: Path) -> Archive:
    _write(tmp_path)
    return Archive(ArchiveConfig(bucket="b", endpoint_url=f"file://{tmp_path}"))


def _rows(archive: Archive, bounds: Bounds, split: int = 1 << 30) -> pa.Table:
    tasks, _ = plan(archive, "t", bounds, split_bytes=split)
    batches = [b for t in tasks for b in read_segment(archive, t)]
    return pa.Table.from_batches(batches)


def test_snapshot_codec_and_keys() -> None:
    m = Manifest().appended(SegmentEntry(0, 10, 1, 500, 400, 1000), 1)
    snap = ManifestSnapshot("t", "id", 3, m, 5)
    assert ManifestSnapshot.decode(snap.encode()) == snap
    assert parse_snapshot_key(snapshot_key("t", 3)) == 3
    assert parse_snapshot_key("manifests/t/x.json") is None
    for cut in range(0, len(snap.encode()), 5):
        with pytest.raises(CorruptSegmentError):
            ManifestSnapshot.decode(snap.encode()[:cut])


def test_plan_reads_everything_then_prunes_by_partition_offset_and_time(archive: Archive) -> None:
    tasks, report = plan(archive, "t")
    assert report.segments_total == report.segments_planned == 6 and len(tasks) == 6
    table = _rows(archive, Bounds())
    assert table.num_rows == 6000

    bounds = Bounds(partitions=frozenset({1}), start_offsets={1: 1250}, end_offsets={-1: 1450})
    tasks, report = plan(archive, "t", bounds)
    assert report.segments_planned == 1 and report.footers_read == 1
    assert tasks[0].nbytes < tasks[0].entry.data_length / 2  # the footer index narrowed it
    offsets = _rows(archive, bounds).column("offset").to_pylist()
    assert offsets == list(range(1250, 1450))

    since = Bounds(min_ts=T0 + 25_000, max_ts=T0 + 27_000)
    tasks, report = plan(archive, "t", since)
    assert report.segments_planned == 2  # segment 2 of each partition
    table = _rows(archive, since)
    assert table.num_rows == 2 * 200
    assert sorted(set(table.column("offset").to_pylist())) == list(range(2500, 2700))


def test_large_segments_split_at_index_boundaries(archive: Archive) -> None:
    tasks, _ = plan(archive, "t", split_bytes=8192)
    assert len(tasks) > 6
    table = _rows(archive, Bounds(), split=8192)
    assert table.num_rows == 6000
    assert (
        len(
            set(
                zip(
                    table.column("offset").to_pylist(),
                    table.column("value").to_pylist(),
                    strict=True,
                )
            )
        )
        == 6000
    )


def test_sdk_replay_filters_by_keys_and_tags(archive: Archive) -> None:
    tables = list(replay("t", keys=[b"k1"], tags=["a"], archive=archive))
    table = pa.concat_tables(tables)
    assert table.column_names[0] == "partition"
    # key k1 is i % 3 == 1, tag "a" is i % 2 == 1, within each batch of 100
    per_batch = len([i for i in range(100) if i % 3 == 1 and i % 2 == 1])
    assert table.num_rows == per_batch * 60
    assert set(table.column("key").to_pylist()) == {b"k1"}


def test_small_segment_reads_are_packed_into_spark_partitions_in_order(archive: Archive) -> None:
    """Spark tasks cost tens of ms to start: small segment reads share one, in offset order,
    every read exactly once; a read larger than the limit still gets a partition of its own."""
    from spark.source import pack, read_tasks

    tasks, _ = plan(archive, "t")
    per = max(t.nbytes for t in tasks)
    parts = pack(tasks, max_bytes=3 * per, open_cost=0)
    assert [len(p.tasks) for p in parts] == [3, 3]
    assert [t for p in parts for t in p.tasks] == tasks  # all, once, in plan order
    assert len(pack(tasks, max_bytes=1, open_cost=0)) == len(tasks)  # too big: one each
    # the open cost counts per read: with one read's worth each, only 2 reads fit
    assert [len(p.tasks) for p in pack(tasks, max_bytes=3 * per, open_cost=per // 2)] == [2] * 3
    # sized to the cores: a whole number of waves of about equal partitions
    waves = pack(tasks, max_bytes=3 * per, open_cost=0, parallelism=4)
    assert len(waves) == 4 and [t for p in waves for t in p.tasks] == tasks
    assert sorted(len(p.tasks) for p in waves) == [1, 1, 2, 2]
    rows = sum(b.num_rows for p in parts for b in read_tasks(archive, p.tasks))
    assert rows == sum(t.entry.next_offset - t.entry.base_offset for t in tasks)


def test_replay_pushes_a_filter_down_to_the_batch_summaries(tmp_path: Path) -> None:
    """A batch its summary rules out is never decoded (here its body is damaged: decoding it
    would fail the read); mixed and old-format batches are filtered after decoding."""
    from storage.codec import read_header
    from storage.errors import CorruptBatchError, InvalidFilterError

    def batch(off: int, tags: list[list[str]], *, summary: bool = True) -> bytearray:
        raw = bytearray(
            encode_batch(
                [b"o%d" % (off + i) for i in range(len(tags))],
                tags=tags,
                headers=[[("region", b"eu" if i % 3 else b"us")] for i in range(len(tags))],
                timestamps=T0,
                summary=summary,
            )
        )
        raw[:16] = stamp(off, len(raw) - 12, 1)
        return raw

    only_b = batch(10, [["b"]] * 10)
    only_b[read_header(only_b).summary_position - 8] ^= 0xFF  # damage the body, not the summary
    data = (
        batch(0, [["a"]] * 10)
        + only_b
        + batch(20, [["a"] if i % 2 else ["b"] for i in range(10)])
        + batch(30, [["a", "b"] if i % 4 == 0 else [] for i in range(10)], summary=False)
    )
    footer = build_footer(bytes(data), interval=4096)
    e = SegmentEntry.of(decode_footer(footer))
    path = tmp_path / "b" / e.key("f", "id", 0)
    path.parent.mkdir(parents=True)
    path.write_bytes(bytes(data) + footer)
    snap = tmp_path / "b" / snapshot_key("f", 0)
    snap.parent.mkdir(parents=True, exist_ok=True)
    snap.write_bytes(ManifestSnapshot("f", "id", 0, Manifest().appended(e, 1)).encode())
    archive = Archive(ArchiveConfig(bucket="b", endpoint_url=f"file://{tmp_path}"))

    def offsets(**how: object) -> list[int]:
        tables = list(replay("f", archive=archive, **how))  # type: ignore[arg-type]
        return [o for t in tables for o in t.column("offset").to_pylist()]

    assert offsets(filter="tag = 'a'") == [*range(10), 21, 23, 25, 27, 29, 30, 34, 38]
    assert offsets(tags=["a"], filter="header.region = 'us'") == [0, 3, 6, 9, 23, 29, 30]
    with pytest.raises(InvalidFilterError):
        offsets(filter="tag = ")
    with pytest.raises(CorruptBatchError):  # without the filter the damage is found
        offsets()
