"""The controller acts on partition state changes as the watches report them, not on a timer.

Changes that only the once-a-second pass used to notice (a leader writing an ISR that lets a
reassignment finish, or one that names a dead agent) are now handled by a pass over the
partitions that changed, with the safety-net full pass an hour away. A quiet controller reads
no partition state between two safety-net passes. On the real ZooKeeper, the controller in
this process, its state watch wired as ``agent.py`` wires it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Awaitable, Callable

from broker_agents.controller import Controller
from broker_agents.view import ClusterView
from storage.metadata import AgentRegistration, AsyncZooKeeper, MetadataStore, PartitionState
from storage.metadata.models import TopicSpec, load
from storage.metadata.store import state_path
from tests.harness import ZooKeeperChroot

TOPIC = "t"
DEADLINE_S = 10.0  # far less than the safety net's hour: only a watch-driven pass can do it


def _agents(*ids: int) -> dict[int, AgentRegistration]:
    return {
        a: AgentRegistration(
            agent_id=a,
            host="127.0.0.1",
            port=9000 + a,
            started_ms=int(time.time() * 1000),
            incarnation=f"i{a}",
        )
        for a in ids
    }


async def _with_controller(
    connect: str,
    agents: dict[int, AgentRegistration],
    body: Callable[[MetadataStore, Controller, AsyncZooKeeper], Awaitable[None]],
) -> None:
    """A running controller (safety net an hour away) over topic ``t`` (1 partition, RF 2)
    whose state it has created, with the state watch feeding ``state_changed``."""
    zk = AsyncZooKeeper(connect)
    await zk.start()
    try:
        store = MetadataStore(zk)
        await store.init()
        spec = TopicSpec.build(
            name=TOPIC, partitions=1, replication_factor=2, topic_id=uuid.uuid4().hex, created_ms=0
        )
        await store.create_topic(spec)
        controller = Controller(1, zk, store, ClusterView(agents=agents), safety_net_interval=3600)
        created = asyncio.Event()

        def watched(path: str, data: bytes | None, stat: object) -> None:
            controller.state_changed((TOPIC, 0), getattr(stat, "version", None))
            if data is not None:
                created.set()

        cancel = zk.watch_data_many([state_path(TOPIC, 0)], watched)
        running = asyncio.create_task(controller.run())
        try:
            await asyncio.wait_for(created.wait(), DEADLINE_S)
            await body(store, controller, zk)
        finally:
            cancel()
            running.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await running
    finally:
        await zk.stop()


async def _until(zk: AsyncZooKeeper, done: Callable[[PartitionState], bool]) -> PartitionState:
    """The state of t-0 once ``done`` holds for it (awaited on a watch)."""
    seen = asyncio.Event()
    last: list[PartitionState] = []

    def on_change(data: bytes | None, stat: object) -> None:
        if data is not None and done(state := load(PartitionState, data)):
            last.append(state)
            seen.set()

    cancel = zk.watch_data(state_path(TOPIC, 0), on_change)
    try:
        await asyncio.wait_for(seen.wait(), DEADLINE_S)
    finally:
        cancel()
    return last[-1]


def test_a_reassignment_finishes_when_the_leader_admits_the_new_replica(
    zk_chroot: ZooKeeperChroot,
) -> None:
    async def body(store: MetadataStore, controller: Controller, zk: AsyncZooKeeper) -> None:
        state, _ = await store.get_partition_state(TOPIC, 0) or (None, 0)
        assert state is not None
        (new,) = {1, 2, 3} - set(state.replicas)
        target = [new, state.leader]
        await store.request_reassignment(TOPIC, 0, target)
        full = controller.full_passes
        # the leader sees the new replica caught up and admits it (as replication.py does)
        got = await store.get_partition_state(TOPIC, 0)
        assert got is not None and got[0].adding == [new]
        await store.cas_partition_state(
            TOPIC, 0, got[0].model_copy(update={"isr": [*got[0].isr, new]}), got[1]
        )
        done = await _until(zk, lambda s: not s.adding and not s.removing)
        assert sorted(done.replicas) == sorted(target)
        assert new in done.isr
        assert controller.full_passes == full  # a pass over what changed did it
        assert controller.partial_passes > 0

    asyncio.run(_with_controller(zk_chroot.connect_string, _agents(1, 2, 3), body))


def test_a_dead_agent_written_into_the_isr_leaves_it(zk_chroot: ZooKeeperChroot) -> None:
    async def body(store: MetadataStore, controller: Controller, zk: AsyncZooKeeper) -> None:
        got = await store.get_partition_state(TOPIC, 0)
        assert got is not None
        state, version = got
        full = controller.full_passes
        # a leader's late write names agent 9, which is not registered (dead)
        await store.cas_partition_state(
            TOPIC,
            0,
            state.model_copy(update={"replicas": [*state.replicas, 9], "isr": [*state.isr, 9]}),
            version,
        )
        done = await _until(zk, lambda s: 9 in s.replicas and 9 not in s.isr)
        assert done.leader == state.leader
        assert controller.full_passes == full

    asyncio.run(_with_controller(zk_chroot.connect_string, _agents(1, 2), body))


def test_a_quiet_controller_reads_states_only_at_the_safety_net(
    zk_chroot: ZooKeeperChroot,
) -> None:
    async def main() -> None:
        zk = AsyncZooKeeper(zk_chroot.connect_string)
        await zk.start()
        try:
            store = MetadataStore(zk)
            await store.init()
            await store.create_topic(
                TopicSpec.build(
                    name=TOPIC,
                    partitions=4,
                    replication_factor=1,
                    topic_id=uuid.uuid4().hex,
                    created_ms=0,
                )
            )
            now = [0.0]
            controller = Controller(
                1, zk, store, ClusterView(agents=_agents(1)), clock=lambda: now[0]
            )
            controller.epoch = 1
            await controller._pass()  # the first: full, creates the states
            await controller._pass()  # decides again what it wrote, from what it wrote
            assert (controller.full_passes, controller.partial_passes) == (1, 1)
            for _ in range(5):
                now[0] += 1.0
                await controller._pass()
            assert (controller.full_passes, controller.partial_passes) == (1, 1)
            now[0] += controller.safety_net_interval
            await controller._pass()
            assert controller.full_passes == 2
            # a state this controller knows at that version is not read again
            controller.state_changed((TOPIC, 0), 0)
            await controller._pass()
            assert controller.partial_passes == 1
            controller.state_changed((TOPIC, 0), 1)
            await controller._pass()
            assert controller.partial_passes == 2
        finally:
            await zk.stop()

    asyncio.run(main())
