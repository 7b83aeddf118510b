"""The warm start's logs opened ahead (``broker_agents.preopen``), on real files: which
directories it opens, and that a log is handed out once, for its incarnation and
configuration only, and closed otherwise."""

from __future__ import annotations

from pathlib import Path

from broker_agents.preopen import Preopened
from storage.codec import encode_batch
from storage.metadata import TopicConfig, TopicSpec
from storage.metadata.models import TopicDeletion
from storage.wal import PartitionLog
from storage.wal.partition_meta import write_topic_id


def spec(name: str, partitions: int, topic_id: str, **config: object) -> TopicSpec:
    return TopicSpec.build(
        name=name,
        partitions=partitions,
        replication_factor=1,
        topic_id=topic_id,
        created_ms=0,
        config=TopicConfig.model_validate(config),
    )


def make_log(data: Path, name: str, topic_id: str | None, values: list[bytes]) -> None:
    directory = data / name
    plog = PartitionLog.open(directory, TopicConfig().log_config())
    if values:
        plog.append(encode_batch(values), leader_epoch=1)
    plog.close()
    if topic_id is not None:
        write_topic_id(directory, topic_id)


def test_only_live_partitions_of_the_current_incarnation_are_opened(tmp_path: Path) -> None:
    make_log(tmp_path, "orders-0", "id-1", [b"a", b"b"])
    make_log(tmp_path, "orders-1", "id-1", [])
    make_log(tmp_path, "orders-2", "id-1", [b"x"])  # beyond the spec's 2 partitions
    make_log(tmp_path, "old-0", "id-0", [b"y"])  # a deleted incarnation of "old"
    make_log(tmp_path, "legacy-0", None, [b"z"])  # no partition.metadata
    make_log(tmp_path, "gone-0", "id-3", [b"w"])  # being deleted
    make_log(tmp_path, "a-b-0", "id-4", [b"v"])  # a name with a dash
    (tmp_path / "wal").mkdir()
    (tmp_path / "clean_shutdown").write_text("{}")
    gone = spec("gone", 1, "id-3").model_copy(
        update={"deletion": TopicDeletion(requested_ms=1, updated_ms=1)}
    )
    specs = [
        spec("orders", 2, "id-1"),
        spec("old", 1, "id-2"),
        spec("legacy", 1, "id-5"),
        gone,
        spec("a-b", 1, "id-4"),
    ]
    pre = Preopened()
    pre.open_all(tmp_path, specs, flushed=True)
    assert len(pre) == 3
    # not strays, so the sweep of deleted topics' directories need not read them again
    assert pre.verified == {tmp_path / n for n in ("orders-0", "orders-1", "a-b-0")}
    config = TopicConfig()
    first = pre.take(("orders", 0), config, "id-1")
    assert first is not None and first.log_end_offset == 2
    assert pre.take(("orders", 0), config, "id-1") is None  # handed out once
    dashed = pre.take(("a-b", 0), config, "id-4")
    assert dashed is not None and dashed.log_end_offset == 1
    for key in [("orders", 2), ("old", 0), ("legacy", 0), ("gone", 0)]:
        assert pre.take(key, config, "id-1") is None
    left = pre.take(("orders", 1), config, "id-1")
    assert left is not None and left.log_end_offset == 0
    for plog in (first, dashed, left):
        plog.close()


def test_a_log_is_not_handed_out_for_another_config_or_incarnation_and_the_rest_is_closed(
    tmp_path: Path,
) -> None:
    for p in range(4):
        make_log(tmp_path, f"t-{p}", "id-1", [b"a"])
    pre = Preopened()
    pre.open_all(tmp_path, [spec("t", 4, "id-1")], flushed=False)
    logs = {p: pre._logs[("t", p)].log for p in range(4)}
    assert (
        pre.take(("t", 0), TopicConfig.model_validate({"segment.bytes": 1 << 20}), "id-1") is None
    )
    assert logs[0].closed  # opened with the old configuration: closed, opened again by its owner
    assert pre.take(("t", 1), TopicConfig(), "id-9") is None
    assert logs[1].closed
    pre.discard_topic("t-other")
    assert len(pre) == 2
    assert pre.release() == 2
    assert logs[2].closed and logs[3].closed
    assert pre.take(("t", 2), TopicConfig(), "id-1") is None
    pre.open_all(tmp_path, [spec("t", 4, "id-1")], flushed=True)
    pre.discard_topic("t")  # the topic is deleted while its logs wait
    assert len(pre) == 0
