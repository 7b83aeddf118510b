"""The partitions an agent hosts, and its role for each: leader, follower, or none.

ZooKeeper is the source of truth. The agent watches every partition state node
(``/topics/<t>/partitions/<p>/state``); a state naming this agent as leader makes it open
(or keep) the local log and accept writes stamped with that leader epoch; a state naming it
as a replica makes it a follower that copies the leader's batches; anything else closes the
partition here. Writes are refused (``NotLeaderError`` with the leader it knows) whenever:

* the latest state names another leader or another epoch (the agent is stale), or
* the agent's ZooKeeper session is SUSPENDED or LOST — it may already have been replaced, so
  it stops acting as a leader until the session is confirmed again (STYLE point 7).

Every partition has a ``data_arrived`` future that completes at the next append: long-polling
fetches wait on it instead of sleeping.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from storage.errors import NotLeaderError, UnknownTopicOrPartitionError
from storage.metadata import PartitionState, TopicConfig
from storage.wal import GroupCommitLog, PartitionLog

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Partition:
    topic: str
    index: int
    config: TopicConfig
    state: PartitionState
    log: PartitionLog
    committer: GroupCommitLog
    role: str  # "leader" | "follower"
    data_arrived: asyncio.Future[None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )

    @property
    def high_watermark(self) -> int:
        return self.log.log_end_offset

    def notify(self) -> None:
        """Wake every fetch waiting for data on this partition."""
        if not self.data_arrived.done():
            self.data_arrived.set_result(None)
        self.data_arrived = asyncio.get_running_loop().create_future()


class PartitionManager:
    def __init__(self, agent_id: int, data_dir: Path) -> None:
        self.agent_id = agent_id
        self.data_dir = data_dir
        self.partitions: dict[tuple[str, int], Partition] = {}
        self.latest: dict[tuple[str, int], PartitionState] = {}
        self.session_ok = False
        self._lock = asyncio.Lock()

    def directory(self, topic: str, partition: int) -> Path:
        return self.data_dir / f"{topic}-{partition}"

    # ---- lookups used by the request handlers ------------------------------------------
    def leader_for_write(self, topic: str, partition: int) -> Partition:
        """The partition if this agent may act as its leader right now, else a typed error."""
        key = (topic, partition)
        p = self.partitions.get(key)
        latest = self.latest.get(key)
        if latest is None:
            raise UnknownTopicOrPartitionError(f"unknown topic or partition {topic}-{partition}")
        if (
            p is None
            or p.role != "leader"
            or latest.leader != self.agent_id
            or p.state.leader_epoch != latest.leader_epoch
        ):
            raise NotLeaderError(
                f"agent {self.agent_id} is not the leader of {topic}-{partition}",
                leader_id=latest.leader,
                leader_epoch=latest.leader_epoch,
            )
        if not self.session_ok:
            raise NotLeaderError(
                f"agent {self.agent_id} has no confirmed ZooKeeper session; refusing to lead",
                leader_id=-1,
                leader_epoch=latest.leader_epoch,
            )
        return p

    def hosted(self, topic: str, partition: int) -> Partition | None:
        return self.partitions.get((topic, partition))

    # ---- reacting to ZooKeeper ----------------------------------------------------------
    async def apply(
        self, topic: str, partition: int, state: PartitionState | None, config: TopicConfig | None
    ) -> None:
        """Make this agent's role for ``topic-partition`` match ``state`` (None: topic gone)."""
        async with self._lock:
            key = (topic, partition)
            current = self.partitions.get(key)
            if state is None:
                self.latest.pop(key, None)
                if current is not None:
                    await self._close(current, delete=True)
                return
            self.latest[key] = state
            if self.agent_id == state.leader:
                role = "leader"
            elif self.agent_id in state.replicas:
                role = "follower"
            else:
                role = ""
            if not role:
                if current is not None:
                    await self._close(current, delete=False)
                return
            if current is None:
                assert config is not None
                plog = await asyncio.to_thread(
                    PartitionLog.open, self.directory(topic, partition), config.log_config()
                )
                committer = GroupCommitLog(plog)
                await committer.start()
                current = Partition(topic, partition, config, state, plog, committer, role)
                self.partitions[key] = current
                log.info(
                    "hosting %s-%d as %s (epoch %d)", topic, partition, role, state.leader_epoch
                )
            else:
                if (current.role, current.state.leader_epoch) != (role, state.leader_epoch):
                    log.info(
                        "%s-%d: %s -> %s (epoch %d)",
                        topic,
                        partition,
                        current.role,
                        role,
                        state.leader_epoch,
                    )
                current.role = role
                current.state = state
            current.notify()

    async def _close(self, p: Partition, *, delete: bool) -> None:
        self.partitions.pop((p.topic, p.index), None)
        p.notify()
        await p.committer.close()
        if delete:
            await asyncio.to_thread(shutil.rmtree, self.directory(p.topic, p.index), True)

    async def close(self) -> None:
        async with self._lock:
            for p in list(self.partitions.values()):
                await self._close(p, delete=False)
