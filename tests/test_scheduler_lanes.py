"""The delay scheduler's lane step against a real ZooKeeper: when it reads the lane's intent
and when it need not."""

from __future__ import annotations

import asyncio

from handlers.scheduler import Outcome, Rec, Scheduler
from sdk import delays as d
from sdk.records import TopicPartition
from storage.metadata import AsyncZooKeeper, MetadataStore
from storage.metadata.delays import DelayStore, Intent
from tests.harness import ZooKeeperChroot


class CountingStore(DelayStore):
    """The real store, counting the intent reads."""

    reads = 0

    async def read_lane(self, topic: str, partition: int) -> tuple[Intent | None, int]:
        self.reads += 1
        return await super().read_lane(topic, partition)


def test_a_lane_whose_head_is_not_due_answers_when_to_come_back_without_zookeeper(
    zk_chroot: ZooKeeperChroot,
) -> None:
    """Records that have just entered their level are not ready: the scheduler says when the
    lane's head leaves it and reads no intent (a ZooKeeper round trip per arrival was most of
    its work under a steady trickle). Once the head is ready, the intent is read (it may hold
    a forward to redo) and the ready records go on (here: records without a schedule id,
    which are dropped, so no producer is needed)."""
    entered = 1_000_000
    lane = TopicPartition(d.level_topic(9), 0)  # a record leaves level 9 512 ms after entering
    recs = [Rec.build(10 + i, entered + i, None, b"v", [], None) for i in range(3)]
    clock = [entered + 100]

    async def run() -> tuple[Outcome, int, Outcome, int, int]:
        zk = AsyncZooKeeper(zk_chroot.connect_string)
        await zk.start()
        try:
            scheduler = Scheduler(clock_ms=lambda: clock[0])
            store = CountingStore(zk)
            meta = MetadataStore(zk)
            early = await scheduler._lane(store, meta, None, "", lane, recs)  # type: ignore[arg-type]
            reads_early = store.reads
            clock[0] = entered + 513  # the first two are ready, the third 1 ms later
            later = await scheduler._lane(store, meta, None, "", lane, recs)  # type: ignore[arg-type]
            return early, reads_early, later, store.reads, scheduler.stats.dropped
        finally:
            await zk.stop()

    early, reads_early, later, reads, dropped = asyncio.run(run())
    assert early == Outcome(10, 412) and reads_early == 0
    assert later == Outcome(12, 1) and reads == 1 and dropped == 2
