"""Many partitions at once (#30, bulk admin): on the real ZooKeeper, in this process.

A topic's partition states are created in chunked transactions (each a partition's node and
state, or nothing), read with ``multiRead``, watched in one batch, and the controller places
thousands of partitions in one pass. The sizes here force several transactions and several
multiRead requests; how fast it goes is measured by ``bench/many_partitions_bench.py``.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from broker_agents.controller import Controller
from broker_agents.view import ClusterView
from storage.errors import NodeExistsError, NodeNotFoundError, VersionConflictError
from storage.metadata import AgentRegistration, AsyncZooKeeper, MetadataStore, PartitionState
from storage.metadata.models import TopicSpec
from storage.metadata.store import (
    TRANSACTION_BYTES,
    partition_path,
    partitions_path,
    state_path,
    topic_path,
)
from storage.metadata.zk import MANY_IN_FLIGHT
from tests.harness import ZooKeeperChroot

TOPIC = "bulk"
PARTITIONS = 3_000


def _spec(partitions: int = PARTITIONS) -> TopicSpec:
    return TopicSpec.build(
        name=TOPIC,
        partitions=partitions,
        replication_factor=1,
        topic_id=uuid.uuid4().hex,
        created_ms=0,
    )


def _state(p: int, topic_id: str) -> PartitionState:
    return PartitionState(
        leader=1 + p % 3,
        leader_epoch=0,
        replicas=[1 + p % 3],
        isr=[1 + p % 3],
        controller_epoch=1,
        topic_id=topic_id,
    )


def _run(connect: str, body: Callable[[AsyncZooKeeper, MetadataStore], Awaitable[None]]) -> None:
    async def main() -> None:
        zk = AsyncZooKeeper(connect)
        await zk.start()
        try:
            store = MetadataStore(zk)
            await store.init()
            await body(zk, store)
        finally:
            await zk.stop()

    asyncio.run(main())


def test_thousands_of_states_in_chunked_transactions(zk_chroot: ZooKeeperChroot) -> None:
    async def body(zk: AsyncZooKeeper, store: MetadataStore) -> None:
        spec = _spec()
        await store.create_topic(spec)
        states = {p: _state(p, spec.topic_id) for p in range(PARTITIONS)}
        assert sum(len(s.model_dump_json()) for s in states.values()) > TRANSACTION_BYTES
        created, failed = await store.create_partition_states(TOPIC, states)
        assert failed == []
        assert created == list(range(PARTITIONS))
        got = await store.partition_states(TOPIC)  # several multiRead requests
        assert PARTITIONS > 2 * MANY_IN_FLIGHT
        assert {p: s for p, (s, _) in got.items()} == states
        assert {v for _, v in got.values()} == {0}

    _run(zk_chroot.connect_string, body)


def test_a_failed_chunk_writes_nothing_and_the_rest_goes_on(zk_chroot: ZooKeeperChroot) -> None:
    """A racing controller made one state: the transaction holding that partition writes
    nothing (no node without its state), every other chunk is written, and a second call with
    what is missing completes the topic."""

    async def body(zk: AsyncZooKeeper, store: MetadataStore) -> None:
        spec = _spec()
        await store.create_topic(spec)
        states = {p: _state(p, spec.topic_id) for p in range(PARTITIONS)}
        raced = PARTITIONS // 2
        await store.create_partition_state(TOPIC, raced, states[raced])
        created, failed = await store.create_partition_states(TOPIC, states)
        assert len(failed) == 1
        lost, error = failed[0]
        assert raced in lost and len(lost) > 1
        assert isinstance(error, NodeExistsError)
        assert sorted(created + lost) == list(range(PARTITIONS))
        nodes = {int(c) for c in await zk.get_children(partitions_path(TOPIC))}
        assert nodes == set(created) | {raced}  # nothing else of the failed chunk
        got = await store.partition_states(TOPIC)
        assert set(got) == nodes
        rest = [p for p in lost if p != raced]
        again, failed = await store.create_partition_states(TOPIC, {p: states[p] for p in rest})
        assert (again, failed) == (rest, [])
        assert len(await store.partition_states(TOPIC)) == PARTITIONS

    _run(zk_chroot.connect_string, body)


def test_compare_and_set_of_thousands_in_transactions_each_write_its_answer(
    zk_chroot: ZooKeeperChroot,
) -> None:
    """``cas_partition_states``: every write lands with its new version, over several
    transactions; one whose version moved loses (``VersionConflictError``) and the others of
    its transaction, retried one by one, still land."""

    async def body(zk: AsyncZooKeeper, store: MetadataStore) -> None:
        spec = _spec()
        await store.create_topic(spec)
        states = {p: _state(p, spec.topic_id) for p in range(PARTITIONS)}
        await store.create_partition_states(TOPIC, states)
        raced = PARTITIONS // 2
        await store.cas_partition_state(TOPIC, raced, states[raced], 0)  # now at version 1
        elected = {p: s.model_copy(update={"leader_epoch": 1}) for p, s in states.items()}
        writes = [(TOPIC, p, elected[p], 0) for p in range(PARTITIONS)]
        assert sum(len(s.model_dump_json()) for s in elected.values()) > TRANSACTION_BYTES
        outcomes = await store.cas_partition_states(writes)
        assert isinstance(outcomes[raced], VersionConflictError)
        assert [o for p, o in enumerate(outcomes) if p != raced] == [1] * (PARTITIONS - 1)
        got = await store.partition_states(TOPIC)
        assert got[raced] == (states[raced], 1)  # the lost write wrote nothing
        assert {p: s for p, (s, _) in got.items() if p != raced} == {
            p: s for p, s in elected.items() if p != raced
        }

    _run(zk_chroot.connect_string, body)


def test_a_deleted_topic_is_not_brought_back(zk_chroot: ZooKeeperChroot) -> None:
    async def body(zk: AsyncZooKeeper, store: MetadataStore) -> None:
        spec = _spec(10)
        created, failed = await store.create_partition_states(
            TOPIC, {p: _state(p, spec.topic_id) for p in range(10)}
        )
        assert created == []
        assert [type(e) for _, e in failed] == [NodeNotFoundError]
        assert await zk.exists(topic_path(TOPIC)) is None

    _run(zk_chroot.connect_string, body)


def test_get_many_reads_in_order_with_none_for_missing_nodes(zk_chroot: ZooKeeperChroot) -> None:
    async def body(zk: AsyncZooKeeper, store: MetadataStore) -> None:
        paths = [f"/n{i}" for i in range(MANY_IN_FLIGHT + 10)]
        for i, path in enumerate(paths):
            if i % 7:
                await zk.create(path, str(i).encode())
        got = await zk.get_many(paths)
        for i, r in enumerate(got):
            if i % 7:
                assert r is not None and r[0] == str(i).encode()
            else:
                assert r is None
        assert await zk.get_many([]) == []

    _run(zk_chroot.connect_string, body)


def test_watch_data_many_delivers_now_and_at_each_change(zk_chroot: ZooKeeperChroot) -> None:
    async def body(zk: AsyncZooKeeper, store: MetadataStore) -> None:
        seen: dict[str, list[bytes | None]] = {}
        news = asyncio.Event()

        def callback(path: str, data: bytes | None, stat: Any) -> None:
            seen.setdefault(path, []).append(data)
            news.set()

        async def until(check: Callable[[], bool]) -> None:
            while not check():
                news.clear()
                await asyncio.wait_for(news.wait(), 10)

        paths = [f"/w{i}" for i in range(500)]
        for path in paths[:-1]:
            await zk.create(path, b"a")
        cancel = zk.watch_data_many(paths, callback)
        await until(lambda: len(seen) == len(paths))
        assert seen[paths[-1]] == [None]
        assert all(seen[p] == [b"a"] for p in paths[:-1])
        await zk.set(paths[0], b"b")
        await zk.create(paths[-1], b"new")
        await until(lambda: seen[paths[0]][-1] == b"b" and seen[paths[-1]][-1] == b"new")
        await zk.delete(paths[1])
        await until(lambda: seen[paths[1]][-1] is None)
        cancel()
        await zk.set(paths[0], b"c")
        await zk.get(paths[0])  # answered after the event would have been sent
        await asyncio.sleep(0)
        assert seen[paths[0]][-1] == b"b"

    _run(zk_chroot.connect_string, body)


@pytest.mark.parametrize("agents", [1, 3])
def test_the_controller_places_thousands_of_partitions_in_one_pass(
    zk_chroot: ZooKeeperChroot, agents: int
) -> None:
    async def body(zk: AsyncZooKeeper, store: MetadataStore) -> None:
        spec = _spec()
        await store.create_topic(spec)
        # a partition node left without a state (a crash between two writes of an older
        # controller) gets its state too
        await zk.create(partition_path(TOPIC, 7), b"")
        view = ClusterView(
            agents={
                a: AgentRegistration(
                    agent_id=a,
                    host="127.0.0.1",
                    port=9000 + a,
                    started_ms=int(time.time() * 1000),
                    incarnation=f"i{a}",
                )
                for a in range(1, agents + 1)
            }
        )
        controller = Controller(1, zk, store, view)
        controller.epoch = 3
        await controller.reconcile()
        got = await store.partition_states(TOPIC)
        assert set(got) == set(range(PARTITIONS))
        leaders = [got[p][0].leader for p in range(PARTITIONS)]
        assert {leaders.count(a) for a in range(1, agents + 1)} == {PARTITIONS // agents}
        assert all(s.controller_epoch == 3 and s.topic_id == spec.topic_id for s, _ in got.values())
        # every agent restarts (new incarnations): one pass fences them all, pipelined
        view.agents = {
            a: r.model_copy(update={"incarnation": f"j{a}"}) for a, r in view.agents.items()
        }
        await controller.reconcile()
        after = await store.partition_states(TOPIC)
        assert all(v == 1 for _, v in after.values())
        assert all(
            s.leader_epoch == 1 and s.incarnations == {s.leader: f"j{s.leader}"}
            for s, _ in after.values()
        )
        assert await zk.exists(state_path(TOPIC, PARTITIONS)) is None

    _run(zk_chroot.connect_string, body)
