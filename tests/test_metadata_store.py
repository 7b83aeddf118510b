"""``MetadataStore`` against a real ZooKeeper: the controller seat."""

from __future__ import annotations

import asyncio

import pytest

from storage.metadata import AsyncZooKeeper, MetadataStore
from tests.harness import ZooKeeperChroot


def test_a_session_that_holds_the_controller_seat_gets_it_back_and_others_do_not(
    zk_chroot: ZooKeeperChroot,
) -> None:
    """A controller that stopped acting while its connection was suspended asks for the seat
    again once reconnected; its session still owns ``/controller``, so the seat is its own,
    at the same epoch. Another session's claim is refused while that node lives, and gets a
    new epoch once the holder's session is gone."""

    async def run() -> None:
        one = AsyncZooKeeper(zk_chroot.connect_string)
        two = AsyncZooKeeper(zk_chroot.connect_string)
        await one.start()
        await two.start()
        try:
            first = await MetadataStore(one).try_become_controller(1)
            assert first is not None
            assert await MetadataStore(one).try_become_controller(1) == first
            assert await MetadataStore(two).try_become_controller(2) is None
            await one.stop()  # the session ends: its ephemeral seat goes with it
            taken = await MetadataStore(two).try_become_controller(2)
            assert taken is not None
            assert (taken.agent_id, taken.epoch) == (2, first.epoch + 1)
        finally:
            await two.stop()
            await one.stop()

    asyncio.run(run())


def test_fields_of_a_newer_version_survive_an_older_agents_rewrite() -> None:
    """A rolling upgrade: a newer agent writes a field this version does not know; this
    version reads the znode and rewrites it (compare-and-set copies), and the field stays."""
    import json

    from storage.metadata.groups import GroupRecord
    from storage.metadata.models import (
        AgentRegistration,
        PartitionState,
        TopicSpec,
        dump,
        load,
    )
    from storage.metadata.transactions import TxnRecord

    samples = [
        AgentRegistration(agent_id=1, host="h", port=1, started_ms=0),
        PartitionState(leader=1, leader_epoch=0, replicas=[1], isr=[1], controller_epoch=0),
        TopicSpec.build(name="t", partitions=1, replication_factor=1, topic_id="x", created_ms=0),
    ]
    samples += [GroupRecord(group_id="g"), TxnRecord(producer_id=7, epoch=0, timeout_ms=1000)]
    for model in samples:
        newer = json.loads(dump(model)) | {"zone": "eu-1"}
        read = load(type(model), json.dumps(newer).encode())
        rewritten = json.loads(dump(read.model_copy(update={})))
        assert rewritten["zone"] == "eu-1", type(model).__name__


def test_a_topic_setting_of_a_newer_version_survives_an_older_agents_reads_and_alters() -> None:
    """A newer version's topic setting in a stored spec: this version reads the spec (it
    does not refuse the whole topic), rewrites it and alters other settings without dropping
    it, and still refuses an unknown setting in a request."""
    import json

    from storage.errors import InvalidConfigError
    from storage.metadata.models import TopicConfig, TopicSpec, dump, load

    spec = TopicSpec.build(
        name="t",
        partitions=1,
        replication_factor=1,
        config=TopicConfig.parse({"retention.ms": 1000}),
        topic_id="x",
        created_ms=0,
    )
    stored = json.loads(dump(spec))
    stored["config"]["compaction.lag.ms"] = 5000  # what a newer version might add
    read = load(TopicSpec, json.dumps(stored).encode())
    assert read.config.retention_ms == 1000
    altered = TopicSpec.build(
        **{**dict(read), "config": read.config.updated({"retention.ms": 2000})}
    )
    again = json.loads(dump(altered))["config"]
    assert (again["retention.ms"], again["compaction.lag.ms"]) == (2000, 5000)
    with pytest.raises(InvalidConfigError):
        read.config.updated({"compaction.lag.ms.typo": 1})
    with pytest.raises(InvalidConfigError):
        TopicConfig.parse({"compaction.lag.ms": 5000})  # unknown to this version's requests


def test_topic_specs_reads_every_topic_and_leaves_out_one_that_does_not_parse(
    zk_chroot: ZooKeeperChroot,
) -> None:
    """What a restarting agent reads to open its logs ahead (``broker_agents.preopen``)."""
    from storage.metadata.models import TopicSpec
    from storage.metadata.store import topic_path

    async def run() -> None:
        zk = AsyncZooKeeper(zk_chroot.connect_string)
        await zk.start()
        try:
            store = MetadataStore(zk)
            await store.init()
            for i, name in enumerate(["a", "b.c", "d-e"]):
                await store.create_topic(
                    TopicSpec.build(
                        name=name,
                        partitions=i + 1,
                        replication_factor=1,
                        topic_id=f"id{i}",
                        created_ms=0,
                    )
                )
            await zk.set(topic_path("b.c"), b"{not json", -1)
            specs = await store.topic_specs()
            assert [(s.name, s.partitions, s.topic_id) for s in specs] == [
                ("a", 1, "id0"),
                ("d-e", 3, "id2"),
            ]
        finally:
            await zk.stop()

    asyncio.run(run())


def test_an_offsets_commit_to_a_topic_node_that_exists_is_one_zookeeper_request(
    zk_chroot: ZooKeeperChroot,
) -> None:
    """A group's first commit for a topic creates the offsets node (and its parent); every
    later commit is the compare-and-set transaction alone, with no look at the parent first
    (it was a second round trip per commit flush). A write that expects a node which is gone
    (the group was deleted meanwhile) still fails instead of creating it."""
    from storage.errors import MetadataError
    from storage.metadata.groups import CommittedOffset, GroupStore, TopicCommits

    async def run() -> None:
        zk = AsyncZooKeeper(zk_chroot.connect_string)
        await zk.start()
        calls: list[str] = []
        for name in ("exists", "ensure_path", "transaction", "get", "create", "set"):
            real = getattr(zk, name)

            def counted(*args: object, _real=real, _name=name, **kwargs: object) -> object:
                calls.append(_name)
                return _real(*args, **kwargs)

            setattr(zk, name, counted)
        try:
            store = GroupStore(zk)
            first = TopicCommits("id-1", {0: CommittedOffset(5, None, 1)})
            versions = await store.write_offsets("g", {"t": (first, -1)})
            assert versions == {"t": 0}
            assert "ensure_path" in calls  # the parent made on the first create
            calls.clear()
            later = TopicCommits("id-1", {0: CommittedOffset(9, "m", 2)})
            assert await store.write_offsets("g", {"t": (later, 0)}) == {"t": 1}
            assert calls == ["transaction"]
            calls.clear()
            assert await store.get_offsets("g", "t") == (later, 1)
            await zk.delete("/groups/g", recursive=True)
            with pytest.raises(MetadataError):
                await store.write_offsets("g", {"t": (later, 1)})
            assert await store.get_offsets("g", "t") == (TopicCommits("", {}), -1)
        finally:
            await zk.stop()

    asyncio.run(run())
