"""The leader's "maximal ISR" (``Partition.pending_isr``): a follower the leader is adding to
the ISR counts for the high watermark from before its ZooKeeper write, and stops counting once
the leader has applied a state at least as new as that write without it.

Found by CI: the ISR grew to three, both followers were stopped, and the controller's "dead
replicas leave the ISR" reached the leader before the watch had delivered the grown ISR. The
followers stayed pending for good, so with an ISR of one the high watermark never moved and
an acks=1 record was never readable (``test_replication``'s min.insync test, 1 run in ~20).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from broker_agents.config import AgentConfig
from broker_agents.partitions import PartitionManager
from broker_agents.replication import IsrMaintenance
from broker_agents.view import ClusterView
from storage.codec import encode_batch
from storage.metadata import AsyncZooKeeper, MetadataStore, PartitionState
from storage.metadata.models import AgentRegistration, TopicSpec
from tests.harness import ZooKeeperChroot

TOPIC = "t"


def _state(pm: PartitionManager, isr: list[int], topic_id: str) -> PartitionState:
    return PartitionState(
        leader=1,
        leader_epoch=0,
        replicas=[1, 2, 3],
        isr=isr,
        controller_epoch=1,
        incarnations={1: pm.incarnation},
        topic_id=topic_id,
    )


def test_a_pending_member_removed_by_a_newer_state_stops_holding_the_high_watermark(
    tmp_path: Path,
) -> None:
    spec = TopicSpec.build(
        name=TOPIC, partitions=1, replication_factor=3, topic_id="id-1", created_ms=0
    )

    async def run() -> list[int]:
        pm = PartitionManager(1, tmp_path / "data")
        pm.session_ok = True
        seen = []
        try:
            await pm.apply(TOPIC, 0, _state(pm, [1, 2, 3], spec.topic_id), spec.config, "", 5)
            p = pm.partitions[(TOPIC, 0)]
            p.follower_fetched(2, 0, 0.0)
            p.follower_fetched(3, 0, 0.0)
            p.log.append(encode_batch([b"a"]), leader_epoch=0)
            p.advance_hw()
            seen.append(p.high_watermark)  # 0: the followers have not fetched it
            # the leader wrote an ISR taking 2 back, which landed at version 7 (as
            # ``IsrMaintenance.check`` records it), while its applied ISR is [1, 3]
            await pm.apply(TOPIC, 0, _state(pm, [1, 3], spec.topic_id), spec.config, "", 6)
            p.pending_isr, p.pending_isr_version = {2}, 7
            p.follower_fetched(3, 1, 0.0)
            seen.append(p.high_watermark)  # 0: 2 is pending, it still counts
            # a state read before the write landed (version 6), applied late: 2 still counts
            await pm.apply(TOPIC, 0, _state(pm, [1], spec.topic_id), spec.config, "", 6)
            seen.append(p.high_watermark)
            # the controller dropped the dead followers after the write (version 8)
            await pm.apply(TOPIC, 0, _state(pm, [1], spec.topic_id), spec.config, "", 8)
            seen.append(p.high_watermark)  # 1: an ISR of one, the log end
            seen.append(len(p.pending_isr))
        finally:
            await pm.close()
        return seen

    assert asyncio.run(run()) == [0, 0, 0, 1, 0]


def test_the_leader_does_not_take_back_a_follower_whose_agent_is_gone(
    tmp_path: Path, zk_chroot: ZooKeeperChroot
) -> None:
    """Found by CI (the same min.insync test): the controller dropped two stopped followers
    from the ISR in ZooKeeper; the leader, whose applied state still named them and whose last
    catch-up of them was recent, wrote them back, and again after each drop, so its high
    watermark waited for replicas that fetch nothing. A follower whose agent is not registered
    is not taken back; a registered one is."""
    spec = TopicSpec.build(
        name=TOPIC, partitions=1, replication_factor=3, topic_id="id-1", created_ms=0
    )

    async def run() -> list[list[int]]:
        zk = AsyncZooKeeper(zk_chroot.connect_string)
        await zk.start()
        pm = PartitionManager(1, tmp_path / "data")
        pm.session_ok = True
        isrs = []
        try:
            store = MetadataStore(zk)
            await store.init()
            await store.create_topic(spec)
            await store.create_partition_states(TOPIC, {0: _state(pm, [1], spec.topic_id)})
            # applied here: a stale state that still names 2 and 3, both caught up just now
            await pm.apply(TOPIC, 0, _state(pm, [1, 2, 3], spec.topic_id), spec.config, "", 0)
            p = pm.partitions[(TOPIC, 0)]
            p.follower_fetched(2, 0, time.monotonic())
            p.follower_fetched(3, 0, time.monotonic())
            reg = AgentRegistration(agent_id=1, host="h", port=1, started_ms=0)
            view = ClusterView(agents={1: reg})  # 2 and 3 are gone
            config = AgentConfig.model_validate(
                {"zookeeper.connect": zk_chroot.connect_string, "data.dir": str(tmp_path)}
            )
            isr = IsrMaintenance(1, pm, store, view, config)
            await isr.check(10.0)
            isrs.append(sorted((await store.get_partition_state(TOPIC, 0))[0].isr))
            # the watch brings ZooKeeper's ISR; 2 registers again and fetches: taken back
            await pm.apply(TOPIC, 0, _state(pm, [1], spec.topic_id), spec.config, "", 1)
            view.agents[2] = reg.model_copy(update={"agent_id": 2})
            p.follower_fetched(2, 0, time.monotonic())
            p.follower_fetched(3, 0, time.monotonic())  # a stray late fetch: not registered
            await isr.check(10.0)
            isrs.append(sorted((await store.get_partition_state(TOPIC, 0))[0].isr))
        finally:
            await pm.close()
            await zk.stop()
        return isrs

    assert asyncio.run(run()) == [[1], [1, 2]]
