"""Typed operations on the cluster's metadata in ZooKeeper (layout in ``docs/zookeeper.md``).

Everything lives under one chroot per cluster (part of the connect string, e.g.
``127.0.0.1:2181/strata/prod``)::

    /agents/<id>                           ephemeral  AgentRegistration
    /controller                            ephemeral  ControllerInfo (elected controller)
    /controller_epoch                      persistent int, bumped by each new controller
    /topics/<name>                         persistent TopicSpec (admin writes, CAS on version)
    /topics/<name>/partitions/<p>/state    persistent PartitionState (controller writes, CAS)
    /topics/<name>/partitions/<p>/segments persistent segment manifest (tiering issue)
    /groups/<group>/...                    consumer groups (groups issue)
    /transactions/<transactional.id>       transaction coordinators' state (docs/transactions.md)

Writers never blindly overwrite: a partition state or topic spec change reads the znode
version and writes with it, so two controllers (or two admins) racing cannot both win.
"""

from __future__ import annotations

from kazoo.protocol.states import ZnodeStat

from storage.errors import (
    InvalidReplicationFactorError,
    NodeExistsError,
    NodeNotFoundError,
    TopicAlreadyExistsError,
    UnknownTopicOrPartitionError,
    VersionConflictError,
)
from storage.metadata.models import (
    AgentRegistration,
    ControllerInfo,
    PartitionState,
    TopicSpec,
    dump,
    load,
    validate_topic_name,
)
from storage.metadata.transactions import TRANSACTIONS
from storage.metadata.zk import AsyncZooKeeper

AGENTS = "/agents"
CONTROLLER = "/controller"
CONTROLLER_EPOCH = "/controller_epoch"
TOPICS = "/topics"
GROUPS = "/groups"


def agent_path(agent_id: int) -> str:
    return f"{AGENTS}/{agent_id}"


def topic_path(name: str) -> str:
    return f"{TOPICS}/{name}"


def partitions_path(name: str) -> str:
    return f"{TOPICS}/{name}/partitions"


def partition_path(name: str, partition: int) -> str:
    return f"{TOPICS}/{name}/partitions/{partition}"


def state_path(name: str, partition: int) -> str:
    return f"{partition_path(name, partition)}/state"


class MetadataStore:
    def __init__(self, zk: AsyncZooKeeper) -> None:
        self.zk = zk

    async def init(self) -> None:
        """Create the fixed top-level nodes (idempotent)."""
        for path in (AGENTS, TOPICS, GROUPS, TRANSACTIONS):
            await self.zk.ensure_path(path)

    # ---- agents -------------------------------------------------------------------------
    async def register_agent(self, reg: AgentRegistration) -> None:
        await self.zk.create(agent_path(reg.agent_id), dump(reg), ephemeral=True)

    async def update_agent(self, reg: AgentRegistration) -> None:
        """Rewrite this agent's own registration (its ephemeral node)."""
        await self.zk.set(agent_path(reg.agent_id), dump(reg))

    async def list_agents(self) -> dict[int, AgentRegistration]:
        out = {}
        for child in await self.zk.get_children(AGENTS):
            try:
                data, _ = await self.zk.get(agent_path(int(child)))
            except NodeNotFoundError:
                continue
            out[int(child)] = load(AgentRegistration, data)
        return out

    # ---- controller ---------------------------------------------------------------------
    async def get_controller(self) -> ControllerInfo | None:
        try:
            data, _ = await self.zk.get(CONTROLLER)
        except NodeNotFoundError:
            return None
        info: ControllerInfo = load(ControllerInfo, data)
        return info

    async def try_become_controller(self, agent_id: int) -> ControllerInfo | None:
        """Claim ``/controller`` (ephemeral) with a freshly bumped epoch; None if another
        session holds it.

        A seat that this session already holds is returned as it is (same epoch). A
        controller stops acting while its connection is suspended (a ZooKeeper leader change,
        a lost quorum); when the session survives, its ephemeral node survives too and nobody
        else can have taken the seat, so it takes up where it left off. (Treating its own
        node as taken would leave it waiting for that node to go away: no controller acts
        until the agent's session ends.) The same holds when a create that went through was
        reported as a connection loss.
        """
        try:
            data, stat = await self.zk.get(CONTROLLER)
        except NodeNotFoundError:
            pass
        else:
            if stat.ephemeralOwner == self.zk.session_id:
                held: ControllerInfo = load(ControllerInfo, data)
                return held
            return None
        epoch = await self._bump_controller_epoch()
        info = ControllerInfo(agent_id=agent_id, epoch=epoch)
        try:
            await self.zk.create(CONTROLLER, dump(info), ephemeral=True)
        except NodeExistsError:
            return None
        return info

    async def _bump_controller_epoch(self) -> int:
        while True:
            try:
                data, stat = await self.zk.get(CONTROLLER_EPOCH)
            except NodeNotFoundError:
                try:
                    await self.zk.create(CONTROLLER_EPOCH, b"1")
                    return 1
                except NodeExistsError:
                    continue
            epoch = int(data) + 1
            try:
                await self.zk.set(CONTROLLER_EPOCH, str(epoch).encode(), stat.version)
                return epoch
            except VersionConflictError:
                continue  # another candidate bumped it first

    # ---- topics -------------------------------------------------------------------------
    async def create_topic(self, spec: TopicSpec) -> None:
        try:
            await self.zk.transaction(
                lambda tx: (
                    tx.create(topic_path(spec.name), dump(spec)),
                    tx.create(partitions_path(spec.name), b""),
                )
            )
        except NodeExistsError:
            raise TopicAlreadyExistsError(f"topic {spec.name!r} already exists") from None

    async def get_topic(self, name: str) -> tuple[TopicSpec, ZnodeStat]:
        validate_topic_name(name)
        try:
            data, stat = await self.zk.get(topic_path(name))
        except NodeNotFoundError:
            raise UnknownTopicOrPartitionError(f"unknown topic {name!r}") from None
        spec: TopicSpec = load(TopicSpec, data)
        return spec, stat

    async def list_topics(self) -> list[str]:
        return sorted(await self.zk.get_children(TOPICS))

    async def update_topic(self, spec: TopicSpec, version: int) -> None:
        """Compare-and-set the topic spec (``VersionConflictError`` if it changed)."""
        await self.zk.set(topic_path(spec.name), dump(spec), version)

    async def delete_topic(self, name: str) -> None:
        validate_topic_name(name)
        if await self.zk.exists(topic_path(name)) is None:  # kazoo's recursive delete ignores it
            raise UnknownTopicOrPartitionError(f"unknown topic {name!r}")
        try:
            await self.zk.delete(topic_path(name), recursive=True)
        except NodeNotFoundError:
            raise UnknownTopicOrPartitionError(f"unknown topic {name!r}") from None

    # ---- partitions ---------------------------------------------------------------------
    async def get_partition_state(
        self, name: str, partition: int
    ) -> tuple[PartitionState, int] | None:
        try:
            data, stat = await self.zk.get(state_path(name, partition))
        except NodeNotFoundError:
            return None
        return load(PartitionState, data), stat.version

    async def create_partition_state(
        self, name: str, partition: int, state: PartitionState
    ) -> None:
        await self.zk.create(state_path(name, partition), dump(state), makepath=True)

    async def cas_partition_state(
        self, name: str, partition: int, state: PartitionState, version: int
    ) -> int:
        stat = await self.zk.set(state_path(name, partition), dump(state), version)
        return int(stat.version)

    async def request_reassignment(
        self, name: str, partition: int, target: list[int]
    ) -> PartitionState:
        """Start moving ``name-partition`` onto ``target`` (the controller completes it).

        The replica set grows to ``target`` plus the current replicas; once every new replica
        has caught up (is in the ISR) the controller drops the others — and moves leadership if
        the leader is one of them. Nothing is lost: old replicas stay until new ones have it all.
        """
        if not target or len(set(target)) != len(target):
            raise InvalidReplicationFactorError(f"bad target replica list {target}")
        while True:
            got = await self.get_partition_state(name, partition)
            if got is None:
                raise UnknownTopicOrPartitionError(f"unknown partition {name}-{partition}")
            state, version = got
            base = (
                [r for r in state.replicas if r not in state.adding]
                if state.adding
                else state.replicas
            )
            new = state.model_copy(
                update={
                    "replicas": list(target) + [r for r in base if r not in target],
                    "adding": [r for r in target if r not in base],
                    "removing": [r for r in base if r not in target],
                }
            )
            try:
                await self.cas_partition_state(name, partition, new, version)
                return new
            except VersionConflictError:
                continue

    async def partition_states(self, name: str) -> dict[int, tuple[PartitionState, int]]:
        out = {}
        try:
            children = await self.zk.get_children(partitions_path(name))
        except NodeNotFoundError:
            return {}
        for child in children:
            got = await self.get_partition_state(name, int(child))
            if got is not None:
                out[int(child)] = got
        return out
