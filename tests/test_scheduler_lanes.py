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


def test_a_lane_reads_its_intent_once_and_again_only_after_another_process_wrote_it(
    zk_chroot: ZooKeeperChroot,
) -> None:
    """A process that wrote a lane's intent knows what the node holds: its next forward of
    that lane reads nothing (the ZooKeeper read was a fifth of the scheduler's time). If
    another process wrote the lane since, the compare-and-set fails and the lane is read
    afresh before anything is sent; a batch that starts at or before the last forward's start
    (a forward to redo) always reads it."""
    lane = TopicPartition(d.level_topic(9), 1)
    entered = 1_000_000
    clock = [entered + 600]  # everything below is ready

    def recs(first: int, count: int) -> list[Rec]:
        return [Rec.build(first + i, entered + i, None, b"v", [], None) for i in range(count)]

    async def run() -> list[object]:
        zk = AsyncZooKeeper(zk_chroot.connect_string)
        await zk.start()
        try:
            mine = Scheduler(clock_ms=lambda: clock[0])
            store = CountingStore(zk)
            meta = MetadataStore(zk)

            async def forward(s: Scheduler, first: int, count: int) -> Outcome:
                return await s._lane(store, meta, None, "", lane, recs(first, count))  # type: ignore[arg-type]

            seen: list[object] = [await forward(mine, 0, 3), store.reads]  # the first: read
            seen += [await forward(mine, 3, 2), store.reads]  # known: no read
            other = Scheduler(clock_ms=lambda: clock[0])
            seen += [await forward(other, 5, 4), store.reads]  # another process: it reads
            seen += [await forward(mine, 9, 1), store.reads]  # stale: fails, reads, goes on
            seen += [await forward(mine, 9, 2), store.reads]  # a redo of [9, 10): reads
            intent, _ = await store.read_lane(lane.topic, lane.partition)
            seen.append(intent and (intent.a, intent.b))
            seen.append(mine.stats.dropped + other.stats.dropped)
            return seen
        finally:
            await zk.stop()

    seen = asyncio.run(run())
    assert seen[:10] == [Outcome(), 1, Outcome(), 1, Outcome(), 2, Outcome(), 3, Outcome(), 4]
    # the redo forwarded [9, 10) again (records without a schedule id: dropped again), then 10
    assert seen[10] == (10, 11)
    assert seen[11] == 3 + 2 + 4 + 1 + 1 + 1
