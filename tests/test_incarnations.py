"""A restarted agent is a new incarnation: it no longer counts as in sync (#19).

An agent killed and restarted inside its ZooKeeper session can come back before the
controller ever notices it was gone (the deletion and re-creation of ``/agents/<id>`` fall
between two reads of the watch). Under a relaxed ``fsync.policy`` (or a power loss) it may have
lost its unsynced tail while its followers still hold it, so it must neither lead at the same
epoch nor stay in the ISR. The controller (in this process, on the real ZooKeeper, with its
own seams) compares each ISR member's stamp with the incarnation its agent registered; the
partition manager refuses to lead a state stamped for an earlier incarnation of itself.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

from broker_agents.controller import Controller
from broker_agents.partitions import PartitionManager
from broker_agents.view import ClusterView
from storage.metadata import AgentRegistration, AsyncZooKeeper, MetadataStore, PartitionState
from storage.metadata.models import TopicSpec
from tests.harness import ZooKeeperChroot

TOPIC = "t"


def _registration(agent_id: int, incarnation: str) -> AgentRegistration:
    return AgentRegistration(
        agent_id=agent_id,
        host="127.0.0.1",
        port=9000 + agent_id,
        started_ms=int(time.time() * 1000),
        incarnation=incarnation,
    )


async def _after_reconcile(
    connect: str, state: PartitionState, incarnations: dict[int, str]
) -> PartitionState:
    """Write ``state`` for t-0, let a controller that sees ``incarnations`` reconcile once
    (twice: a fencing pass, then whatever follows), and return the state it left."""
    zk = AsyncZooKeeper(connect)
    await zk.start()
    try:
        store = MetadataStore(zk)
        await store.init()
        await store.create_topic(
            TopicSpec.build(
                name=TOPIC,
                partitions=1,
                replication_factor=len(state.replicas),
                topic_id=uuid.uuid4().hex,
                created_ms=0,
            )
        )
        await store.create_partition_state(TOPIC, 0, state)
        view = ClusterView(agents={a: _registration(a, i) for a, i in incarnations.items()})
        controller = Controller(1, zk, store, view)
        controller.epoch = 1
        await controller.reconcile()
        await controller.reconcile()
        got = await store.get_partition_state(TOPIC, 0)
        assert got is not None
        return got[0]
    finally:
        await zk.stop()


def _state(leader: int, isr: list[int], stamps: dict[int, str], epoch: int = 4) -> PartitionState:
    return PartitionState(
        leader=leader,
        leader_epoch=epoch,
        replicas=[1, 2, 3],
        isr=isr,
        controller_epoch=1,
        incarnations=stamps,
    )


STAMPS = {1: "a1", 2: "b1", 3: "c1"}


def test_a_restarted_leader_loses_leadership_to_an_in_sync_replica(
    zk_chroot: ZooKeeperChroot,
) -> None:
    state = asyncio.run(
        _after_reconcile(
            zk_chroot.connect_string,
            _state(1, [1, 2, 3], STAMPS),
            {1: "a2", 2: "b1", 3: "c1"},  # agent 1 restarted
        )
    )
    assert (state.leader, state.leader_epoch, sorted(state.isr)) == (2, 5, [2, 3])
    assert state.incarnations == {2: "b1", 3: "c1"}


def test_a_restarted_follower_leaves_the_isr_and_the_leader_stays(
    zk_chroot: ZooKeeperChroot,
) -> None:
    state = asyncio.run(
        _after_reconcile(
            zk_chroot.connect_string,
            _state(1, [1, 2, 3], STAMPS),
            {1: "a1", 2: "b1", 3: "c2"},  # agent 3 restarted
        )
    )
    assert (state.leader, state.leader_epoch, sorted(state.isr)) == (1, 4, [1, 2])


def test_agents_that_all_restarted_stay_in_sync_under_a_new_epoch(
    zk_chroot: ZooKeeperChroot,
) -> None:
    """Every agent crashed at once: none knows more than the others, so the ISR stays whole,
    stamped with the new incarnations, and the epoch moves on."""
    state = asyncio.run(
        _after_reconcile(
            zk_chroot.connect_string,
            _state(1, [1, 2, 3], STAMPS),
            {1: "a2", 2: "b2", 3: "c2"},
        )
    )
    assert (state.leader, state.leader_epoch, sorted(state.isr)) == (1, 5, [1, 2, 3])
    assert state.incarnations == {1: "a2", 2: "b2", 3: "c2"}


def test_the_last_replica_standing_leads_again_at_a_new_epoch(
    zk_chroot: ZooKeeperChroot,
) -> None:
    """The leader, alone in the ISR, restarted: nobody has more than it may still have, so it
    leads again, but at a new epoch (its followers truncate by epoch against it)."""
    state = asyncio.run(
        _after_reconcile(
            zk_chroot.connect_string,
            _state(1, [1], {1: "a1"}),
            {1: "a2", 2: "b1", 3: "c1"},
        )
    )
    assert (state.leader, state.leader_epoch, state.isr) == (1, 5, [1])
    assert state.incarnations == {1: "a2"}


def test_states_without_stamps_are_trusted_and_get_stamped(zk_chroot: ZooKeeperChroot) -> None:
    """A state written before incarnations existed changes nothing by itself."""
    state = asyncio.run(
        _after_reconcile(
            zk_chroot.connect_string,
            _state(1, [1, 2, 3], {}),
            {1: "a1", 2: "b1", 3: "c1"},
        )
    )
    assert (state.leader, state.leader_epoch, sorted(state.isr)) == (1, 4, [1, 2, 3])


def test_an_agent_does_not_lead_a_state_stamped_for_its_earlier_incarnation(
    tmp_path: Path,
) -> None:
    async def run() -> tuple[str, str]:
        pm = PartitionManager(1, tmp_path)
        pm.session_ok = True
        spec = TopicSpec.build(
            name=TOPIC, partitions=1, replication_factor=3, topic_id="x", created_ms=0
        )
        try:
            await pm.apply(TOPIC, 0, _state(1, [1, 2, 3], STAMPS), spec.config)
            p = pm.partitions.get((TOPIC, 0))
            before = "not hosted" if p is None else p.role
            fresh = {**STAMPS, 1: pm.incarnation}
            await pm.apply(TOPIC, 0, _state(1, [1, 2, 3], fresh, epoch=5), spec.config)
            return before, pm.partitions[(TOPIC, 0)].role
        finally:
            await pm.close()

    assert asyncio.run(run()) == ("not hosted", "leader")
