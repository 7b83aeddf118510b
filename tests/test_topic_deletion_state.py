"""Deleting a topic, the parts without servers: the lifecycle table (every pair), the stored
shapes that carry topic ids, the partition directory's id file, replay's choice of incarnation.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from broker_agents.deletion.state import ORDER, TRANSITIONS, DeletionEvent, next_step
from broker_agents.groups import IllegalTransitionError
from broker_agents.partitions import PartitionManager
from sdk.replay import Archive, ArchiveConfig, replay
from storage.codec import encode_batch
from storage.errors import (
    CorruptSegmentError,
    InconsistentTopicIdError,
    TopicDeletionInProgressError,
    UnknownTopicIdError,
    UnknownTopicOrPartitionError,
    for_code,
    from_wire,
)
from storage.metadata import PartitionState, TopicConfig
from storage.metadata.groups import (
    CommittedOffset,
    GroupTxnState,
    PendingTxnOffsets,
    TopicCommits,
    decode_offsets,
    encode_offsets,
)
from storage.metadata.models import DeletionStep, TopicDeletion, TopicSpec
from storage.tier.manifest import Manifest
from storage.tier.snapshot import ManifestSnapshot, snapshot_key
from storage.wal.partition_meta import FILE_NAME, read_topic_id, write_topic_id

# ---------------------------------------------------------------- the lifecycle table


@pytest.mark.parametrize(("step", "event"), list(itertools.product(DeletionStep, DeletionEvent)))
def test_every_step_event_pair_is_a_transition_or_an_error(
    step: DeletionStep, event: DeletionEvent
) -> None:
    if (step, event) in TRANSITIONS:
        assert next_step(step, event) == TRANSITIONS[(step, event)]
    else:
        with pytest.raises(IllegalTransitionError):
            next_step(step, event)


def test_steps_run_in_the_issues_order_and_done_is_final() -> None:
    step, seen = DeletionStep.STOP_SERVING, []
    while step != DeletionStep.DONE:
        seen.append((step.number, step.value))
        step = next_step(step, DeletionEvent.STEP_DONE)
    assert seen == [
        (2, "stop_serving"),
        (3, "remove_local_logs"),
        (4, "remove_snapshots"),
        (5, "delete_objects"),
        (6, "remove_offsets"),
        (7, "remove_metadata"),
    ]
    assert not [k for k in TRANSITIONS if k[0] == DeletionStep.DONE]
    assert [k for k in TRANSITIONS if k[1] == DeletionEvent.BATCH_DELETED] == [
        (DeletionStep.DELETE_OBJECTS, DeletionEvent.BATCH_DELETED)
    ]


@given(st.lists(st.sampled_from(list(DeletionEvent)), max_size=40))
def test_no_event_sequence_skips_or_repeats_backwards_a_step(events: list[DeletionEvent]) -> None:
    step = DeletionStep.STOP_SERVING
    for event in events:
        try:
            after = next_step(step, event)
        except IllegalTransitionError:
            assert step == DeletionStep.DONE or event == DeletionEvent.BATCH_DELETED
            continue
        assert ORDER.index(after) - ORDER.index(step) in (0, 1)
        step = after


def test_deletion_progress_and_objects_left() -> None:
    d = TopicDeletion(requested_ms=1, updated_ms=1)
    assert (d.step, d.objects_left) == (DeletionStep.STOP_SERVING, -1)
    d = d.model_copy(update={"step": DeletionStep.DELETE_OBJECTS, "objects_total": 120})
    assert d.model_copy(update={"objects_deleted": 50}).objects_left == 70
    assert d.model_copy(update={"step": DeletionStep.REMOVE_OFFSETS}).objects_left == 0
    spec = TopicSpec.build(
        name="t", partitions=1, replication_factor=1, topic_id="a", created_ms=1, deletion=d
    )
    assert TopicSpec.model_validate_json(spec.model_dump_json(by_alias=True)) == spec


def test_topic_id_errors_are_retriable_kafka_codes_and_decode_to_their_classes() -> None:
    for cls, code in (
        (UnknownTopicIdError, 100),
        (InconsistentTopicIdError, 103),
        (TopicDeletionInProgressError, 1030),
    ):
        assert cls.code == code and cls.retriable
        assert for_code(code) is cls
        assert type(from_wire(code)) is cls


# ---------------------------------------------------------------- stored shapes


def test_committed_offsets_carry_their_topic_id_and_old_znodes_still_read() -> None:
    commits = TopicCommits("abc", {0: CommittedOffset(5, None, 10), 3: CommittedOffset(7, "m", 11)})
    assert decode_offsets(encode_offsets(commits)) == commits
    legacy = decode_offsets(b'{"0":[5,null,10]}')  # the format before topic ids
    assert legacy == TopicCommits("", {0: CommittedOffset(5, None, 10)})
    spec = TopicSpec.build(
        name="t", partitions=4, replication_factor=1, topic_id="abc", created_ms=1
    )
    assert commits.visible(spec) == commits.offsets
    assert legacy.visible(spec) == legacy.offsets  # by name, from before ids: the current one's
    assert TopicCommits("old", commits.offsets).visible(spec) == {}  # another incarnation's
    deleting = spec.model_copy(update={"deletion": TopicDeletion(requested_ms=1, updated_ms=1)})
    assert commits.visible(deleting) == {}  # a topic being deleted reports nothing
    assert commits.visible(None) == {}  # a deleted topic's leftovers: nothing
    assert legacy.visible(None) == legacy.offsets  # committed by name before the topic exists


def test_parked_transactional_offsets_carry_their_topic_ids_and_old_znodes_still_read() -> None:
    parked = PendingTxnOffsets(3, {("t", 0): CommittedOffset(5, None, 10)}, {"t": "abc"})
    state = GroupTxnState({7: parked}, {7: (2, 99)})
    assert GroupTxnState.decode(state.encode()) == state
    legacy = GroupTxnState.decode(b'{"pending":{"7":[3,[["t",0,5,null,10]]]},"tokens":{}}')
    assert legacy.pending == {7: PendingTxnOffsets(3, {("t", 0): CommittedOffset(5, None, 10)})}
    assert legacy.pending[7].topic_ids == {}  # parked before ids were kept: by name


def test_snapshots_carry_the_topic_creation_time() -> None:
    snap = ManifestSnapshot("t", "abc", 2, Manifest(), written_ms=5, created_ms=4)
    assert ManifestSnapshot.decode(snap.encode()) == snap
    old = json.loads(snap.encode())
    del old["created_ms"]
    assert ManifestSnapshot.decode(json.dumps(old).encode()).created_ms == 0


def test_partition_directory_names_its_incarnation(tmp_path: Path) -> None:
    d = tmp_path / "t-0"
    assert read_topic_id(d) is None  # no directory yet
    d.mkdir()
    assert read_topic_id(d) is None  # a directory from before topic ids
    write_topic_id(d, "abc")
    assert (d / FILE_NAME).read_text() == "version: 0\ntopic_id: abc\n"
    assert read_topic_id(d) == "abc"
    write_topic_id(d, "def")
    assert read_topic_id(d) == "def"
    (d / FILE_NAME).write_text("garbage")
    with pytest.raises(CorruptSegmentError):
        read_topic_id(d)


# ---------------------------------------------------------------- replay: one incarnation


def _put_snapshot(root: Path, snap: ManifestSnapshot) -> None:
    path = root / "bucket" / snapshot_key(snap.topic, snap.partition)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(snap.encode())


def test_replay_reads_one_incarnation_and_a_topic_without_snapshots_is_unknown(
    tmp_path: Path,
) -> None:
    archive = Archive(ArchiveConfig(bucket="bucket", endpoint_url=f"file://{tmp_path}"))
    with pytest.raises(UnknownTopicOrPartitionError, match="'t'"):
        archive.incarnation("t")
    with pytest.raises(UnknownTopicOrPartitionError):
        list(replay("t", archive=archive))
    # partition 0 still has a snapshot of the old incarnation (say a put that landed late);
    # partition 1 has the new one's: never mixed, the newest incarnation wins
    _put_snapshot(tmp_path, ManifestSnapshot("t", "old", 0, Manifest(), 50, created_ms=10))
    _put_snapshot(tmp_path, ManifestSnapshot("t", "new", 1, Manifest(), 40, created_ms=20))
    assert {p: s.topic_id for p, s in archive.incarnation("t").items()} == {1: "new"}
    assert {p: s.topic_id for p, s in archive.incarnation("t", "old").items()} == {0: "old"}
    with pytest.raises(UnknownTopicOrPartitionError, match="gone"):
        archive.incarnation("t", "gone")
    assert list(replay("t", archive=archive)) == []  # exists, nothing tiered: empty, no error


# ---------------------------------------------------------------- an agent's partitions


def _state(topic_id: str, **changes: object) -> PartitionState:
    state = PartitionState(
        leader=1, leader_epoch=0, replicas=[1], isr=[1], controller_epoch=1, topic_id=topic_id
    )
    return state.model_copy(update=changes)


def test_an_agent_never_reopens_another_incarnations_log(tmp_path: Path) -> None:
    """A real ``PartitionManager`` on real files: the old incarnation's log, left on disk by an
    agent that was down while the topic was deleted, is dropped, not reopened, when the new
    incarnation's state arrives; in a running agent, a state of a new id replaces the hosted
    log; a ``deleting`` state closes it and deletes the directory for good."""
    config = TopicConfig()
    directory = tmp_path / "t-0"

    async def run() -> None:
        pm = PartitionManager(1, tmp_path)
        await pm.apply("t", 0, _state("old"), config)
        pm.hosted("t", 0).log.append(encode_batch([b"a", b"b", b"c"]), leader_epoch=0)  # type: ignore[union-attr]
        await pm.close()  # the agent goes down; its directory stays
        assert read_topic_id(directory) == "old"

        pm = PartitionManager(1, tmp_path)  # back, and the topic is a new one now
        assert await pm.sweep_stray({"t": "old"}) == 0  # still the current incarnation: kept
        await pm.apply("t", 0, _state("new"), config)
        p = pm.hosted("t", 0)
        assert p is not None and p.topic_id == "new" and p.log.log_end_offset == 0
        assert read_topic_id(directory) == "new"
        p.log.append(encode_batch([b"x"]), leader_epoch=0)

        await pm.apply("t", 0, _state("newer"), config)  # re-created again, while running
        p = pm.hosted("t", 0)
        assert p is not None and p.topic_id == "newer" and p.log.log_end_offset == 0

        await pm.apply("t", 0, _state("newer", deleting=True, leader=-1), config)
        assert pm.hosted("t", 0) is None and not directory.exists()
        assert pm.latest.get(("t", 0)) is None
        pm.forbid("newer")
        await pm.apply("t", 0, _state("newer"), config)  # a late state of the deleted one
        assert pm.hosted("t", 0) is None and not directory.exists()

        await pm.apply("t", 1, _state("last"), config)
        await pm.close()
        pm = PartitionManager(1, tmp_path)  # down while "last" was deleted: the sweep
        assert await pm.sweep_stray({}) == 1 and not (tmp_path / "t-1").exists()
        await pm.close()

    asyncio.run(run())
