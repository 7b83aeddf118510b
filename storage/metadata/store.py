"""Typed operations on the cluster's metadata in ZooKeeper (layout in ``docs/zookeeper.md``).

Everything lives under one chroot per cluster (part of the connect string, e.g.
``127.0.0.1:2181/strata/prod``)::

    /agents/<id>                           ephemeral  AgentRegistration
    /controller                            ephemeral  ControllerInfo (elected controller)
    /controller_epoch                      persistent int, bumped by each new controller
    /topics/<name>                         persistent TopicSpec (admin writes, CAS on version)
    /topics/<name>/partitions/<p>/state    persistent PartitionState (controller writes, CAS)
    /topics/<name>/partitions/<p>/segments persistent segment manifest (tiering issue)
    /topics/<name>/removed/<agent id>      persistent topic id: the agent holds nothing of the
                                           topic any more (a delete in progress, step 3)
    /groups/<group>/...                    consumer groups (groups issue)
    /transactions/<transactional.id>       transaction coordinators' state (docs/transactions.md)

Writers never blindly overwrite: a partition state or topic spec change reads the znode
version and writes with it, so two controllers (or two admins) racing cannot both win.

Many partitions at once: a topic's states are read pipelined (``AsyncZooKeeper.get_many``),
and first states are created in transactions of up to ``TRANSACTION_BYTES`` each (ZooKeeper
refuses a request over ``jute.maxbuffer``, 1 MiB by default). Each transaction is atomic, so
a partition has its node and its state or neither.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kazoo.protocol.states import ZnodeStat

from storage.errors import (
    InvalidConfigError,
    InvalidReplicationFactorError,
    MetadataError,
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
    TopicDeletion,
    TopicSpec,
    dump,
    load,
    validate_topic_name,
)
from storage.metadata.reassignment import Event, next_phase, phase_of
from storage.metadata.transactions import TRANSACTIONS
from storage.metadata.zk import AsyncZooKeeper

log = logging.getLogger(__name__)

AGENTS = "/agents"
CONTROLLER = "/controller"
CONTROLLER_EPOCH = "/controller_epoch"
TOPICS = "/topics"
GROUPS = "/groups"
TRANSACTION_BYTES = 512 * 1024
"""What one transaction of ``create_partition_states`` may carry, counting paths, data and
``OP_OVERHEAD`` per operation (headers, ACL): half of ZooKeeper's 1 MiB request limit."""
OP_OVERHEAD = 128
TRANSACTIONS_IN_FLIGHT = 8
"""Transactions of one bulk write sent before the first is answered (``_commit_all``)."""


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


def removed_path(name: str) -> str:
    return f"{TOPICS}/{name}/removed"


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

    async def topic_specs(self) -> list[TopicSpec]:
        """Every topic's spec, read in ``multiRead`` batches (one that does not parse is
        left out and logged: its own reads report it)."""
        names = await self.list_topics()
        specs: list[TopicSpec] = []
        found = await self.zk.get_many([topic_path(n) for n in names])
        for name, got in zip(names, found, strict=True):
            if got is None:
                continue  # deleted since the listing
            try:
                specs.append(load(TopicSpec, got[0]))
            except InvalidConfigError as exc:
                log.warning("topic %s: %s", name, exc)
        return specs

    async def update_topic(self, spec: TopicSpec, version: int) -> None:
        """Compare-and-set the topic spec (``VersionConflictError`` if it changed)."""
        await self.zk.set(topic_path(spec.name), dump(spec), version)

    async def mark_deleted(self, name: str, attempts: int = 5) -> TopicSpec:
        """Step 1 of a delete (``docs/operations.md``, *Deleting a topic*): write ``deletion``
        into the spec, compare-and-set, re-reading on a conflict (``attempts`` times, then
        ``VersionConflictError``); the controller does the rest. Returns the spec written, or
        the spec as it is when the topic is being deleted already. The admin API and the
        Kafka listener's DeleteTopics both delete through here."""
        for _ in range(attempts):
            spec, stat = await self.get_topic(name)
            if spec.deletion is not None:
                return spec
            now = int(time.time() * 1000)
            new = TopicSpec.build(
                **{**dict(spec), "deletion": TopicDeletion(requested_ms=now, updated_ms=now)}
            )
            try:
                await self.update_topic(new, stat.version)
                return new
            except NodeNotFoundError:
                raise UnknownTopicOrPartitionError(f"unknown topic {name!r}") from None
            except VersionConflictError:
                continue
        raise VersionConflictError(
            f"topic {name!r} changed under {attempts} attempts in a row; try again"
        )

    async def ack_removal(self, name: str, topic_id: str, agent_id: int) -> bool:
        """Record that ``agent_id`` holds nothing of ``name``'s incarnation ``topic_id`` any
        more (step 3 of a delete). False when the topic node is gone (nothing to ack)."""
        child = f"{removed_path(name)}/{agent_id}"
        for _ in range(3):
            try:
                await self.zk.create(child, topic_id.encode())
                return True
            except NodeExistsError:
                await self.zk.set(child, topic_id.encode())
                return True
            except NodeNotFoundError:
                pass
            try:  # never ``makepath``: that would bring back a deleted topic's node, empty
                await self.zk.create(removed_path(name), b"")
            except NodeExistsError:
                continue
            except NodeNotFoundError:
                return False
        return False

    async def removal_acks(self, name: str, topic_id: str) -> set[int]:
        """The agents that have acknowledged removing ``name``'s incarnation ``topic_id``."""
        try:
            children = await self.zk.get_children(removed_path(name))
        except NodeNotFoundError:
            return set()
        out = set()
        for child in children:
            try:
                data, _ = await self.zk.get(f"{removed_path(name)}/{child}")
            except NodeNotFoundError:
                continue
            if data.decode() == topic_id:
                out.add(int(child))
        return out

    async def remove_topic(self, name: str, topic_id: str) -> bool:
        """Step 7 of a delete: remove ``name`` from ZooKeeper if it is still the incarnation
        ``topic_id`` being deleted. False when there was nothing to remove.

        The topic node goes last, with the version read here: until then the name cannot be
        created again (the node exists), so everything removed under it was the old
        incarnation's, and a deposed controller repeating this step finds a newer incarnation
        (or none) and leaves it alone.
        """
        try:
            spec, stat = await self.get_topic(name)
        except UnknownTopicOrPartitionError:
            return False
        if spec.topic_id != topic_id or spec.deletion is None:
            return False
        for child in (partitions_path(name), removed_path(name)):
            if await self.zk.exists(child) is not None:
                await self.zk.delete(child, recursive=True)
        try:
            await self.zk.delete(topic_path(name), stat.version)
        except NodeNotFoundError:
            return False
        return True

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
        """Create a partition's first state. Never with ``makepath``: for a topic deleted
        meanwhile that would bring its node back, empty; ``NodeNotFoundError`` instead."""
        with contextlib.suppress(NodeExistsError):
            await self.zk.create(partition_path(name, partition), b"")
        await self.zk.create(state_path(name, partition), dump(state))

    async def create_partition_states(
        self, name: str, states: Mapping[int, PartitionState]
    ) -> tuple[list[int], list[tuple[list[int], MetadataError]]]:
        """Create many partitions' first states (``create_partition_state`` in bulk), in
        transactions of at most ``TRANSACTION_BYTES``, each creating the partition nodes not
        there yet and the state nodes. Returns the partitions created, and the chunks that
        failed with their error (nothing of such a chunk is written: e.g.
        ``NodeExistsError`` when a racing controller made one of its states,
        ``NodeNotFoundError`` when the topic was deleted meanwhile; never ``makepath``)."""
        try:
            have = {int(c) for c in await self.zk.get_children(partitions_path(name))}
        except NodeNotFoundError as exc:
            return [], [(sorted(states), exc)]
        chunks: list[list[tuple[int, bytes]]] = [[]]
        size = 0
        for p in sorted(states):
            data = dump(states[p])
            cost = len(state_path(name, p)) * 2 + len(data) + OP_OVERHEAD * 2
            if chunks[-1] and size + cost > TRANSACTION_BYTES:
                chunks.append([])
                size = 0
            chunks[-1].append((p, data))
            size += cost

        def build(chunk: list[tuple[int, bytes]]) -> Callable[[Any], None]:
            def ops(tx: Any) -> None:
                for p, data in chunk:
                    if p not in have:
                        tx.create(partition_path(name, p), b"")
                    tx.create(state_path(name, p), data)

            return ops

        created: list[int] = []
        failed: list[tuple[list[int], MetadataError]] = []
        results = await self._commit_all([build(chunk) for chunk in chunks])
        for chunk, result in zip(chunks, results, strict=True):
            if isinstance(result, (NodeExistsError, NodeNotFoundError)):
                failed.append(([p for p, _ in chunk], result))
            elif isinstance(result, MetadataError):
                raise result
            else:
                created.extend(p for p, _ in chunk)
        return created, failed

    async def _commit_all(
        self, transactions: Sequence[Callable[[Any], object]]
    ) -> list[list[Any] | MetadataError]:
        """Commit each of ``transactions`` (a builder of kazoo ops) atomically, pipelined on
        the session, ``TRANSACTIONS_IN_FLIGHT`` at a time (ZooKeeper applies one session's
        requests in order): each one's results, or its error. One after another, each waited
        for the loop and kazoo's thread, which an agent busy hosting the partitions just
        created keeps busy: 10,000 states took 10 s to write where 0.9 s is the server's."""
        window = asyncio.Semaphore(TRANSACTIONS_IN_FLIGHT)

        async def commit(build: Callable[[Any], object]) -> list[Any] | MetadataError:
            async with window:
                try:
                    return await self.zk.transaction(build)
                except MetadataError as exc:
                    return exc

        return await asyncio.gather(*(commit(b) for b in transactions))

    async def cas_partition_state(
        self, name: str, partition: int, state: PartitionState, version: int
    ) -> int:
        stat = await self.zk.set(state_path(name, partition), dump(state), version)
        return int(stat.version)

    async def cas_partition_states(
        self, writes: Sequence[tuple[str, int, PartitionState, int]]
    ) -> list[int | MetadataError]:
        """Compare-and-set many partitions' states (``cas_partition_state`` in bulk): in
        transactions of at most ``TRANSACTION_BYTES``, one round trip and one ZooKeeper log
        write each where a set costs both per partition (the controller re-electing the
        10,000 partitions of a restarted agent: ~220 sets a second one by one, on a loop that
        is busy hosting them). A transaction that fails (a version moved: a race lost; or
        ZooKeeper unavailable) writes nothing; its writes are then tried one by one, so that
        each gets its own answer. Returns, in order, each write's new version or its error."""
        out: list[int | MetadataError] = []
        data = [dump(state) for _, _, state, _ in writes]
        chunks: list[list[int]] = [[]]
        size = 0
        for i, (name, p, _, _) in enumerate(writes):
            cost = len(state_path(name, p)) + len(data[i]) + OP_OVERHEAD
            if chunks[-1] and size + cost > TRANSACTION_BYTES:
                chunks.append([])
                size = 0
            chunks[-1].append(i)
            size += cost
        chunks = [c for c in chunks if c]

        def build(chunk: list[int]) -> Callable[[Any], None]:
            def ops(tx: Any) -> None:
                for i in chunk:
                    name, p, _, version = writes[i]
                    tx.set_data(state_path(name, p), data[i], version)

            return ops

        results = await self._commit_all([build(chunk) for chunk in chunks])
        for chunk, result in zip(chunks, results, strict=True):
            if isinstance(result, MetadataError):
                out.extend(await asyncio.gather(*(self._cas_or_error(writes[i]) for i in chunk)))
            else:
                out.extend(int(stat.version) for stat in result)
        return out

    async def _cas_or_error(
        self, write: tuple[str, int, PartitionState, int]
    ) -> int | MetadataError:
        try:
            return await self.cas_partition_state(*write)
        except MetadataError as exc:
            return exc

    async def request_reassignment(
        self, name: str, partition: int, target: list[int]
    ) -> PartitionState:
        """Start moving ``name-partition`` onto ``target`` (the controller completes it).

        The replica set grows to ``target`` plus the current replicas; once every new replica
        has caught up (is in the ISR) the controller drops the others and hands leadership to
        the first replica of ``target`` if it is in sync. Nothing is lost: old replicas stay
        until new ones have it all. Phases: ``storage.metadata.reassignment``.
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
            adding = [r for r in target if r not in base]
            removing = [r for r in base if r not in target]
            if adding or removing:
                event = Event.REQUEST
            else:
                event = Event.CANCEL if state.adding or state.removing else Event.REORDER
            phase = next_phase(phase_of(state), event)
            replicas = list(target) + [r for r in base if r not in target]
            isr = [r for r in state.isr if r in replicas]  # a cancel drops the added ones
            if not isr or state.leader not in replicas:
                raise InvalidReplicationFactorError(
                    f"{target}: cancelling would leave no in-sync replica or drop the leader"
                )
            new = state.model_copy(
                update={
                    "replicas": replicas,
                    "isr": isr,
                    "incarnations": {r: v for r, v in state.incarnations.items() if r in isr},
                    "adding": adding,
                    "removing": removing,
                }
            )
            assert phase_of(new) == phase, (state, new)
            try:
                await self.cas_partition_state(name, partition, new, version)
                return new
            except VersionConflictError:
                continue

    async def partition_states(self, name: str) -> dict[int, tuple[PartitionState, int]]:
        """Every partition state of ``name`` (with its znode version), read pipelined."""
        nodes = await self.partition_state_nodes(name)
        return {p: (load(PartitionState, data), version) for p, (data, version) in nodes.items()}

    async def partition_state_nodes(self, name: str) -> dict[int, tuple[bytes, int]]:
        """Every partition state node of ``name`` undecoded: its bytes and znode version, read
        pipelined (a reader that kept what it decoded before decodes only what changed)."""
        try:
            children = sorted(int(c) for c in await self.zk.get_children(partitions_path(name)))
        except NodeNotFoundError:
            return {}
        found = await self.zk.get_many([state_path(name, p) for p in children])
        return {
            p: (got[0], got[1].version)
            for p, got in zip(children, found, strict=True)
            if got is not None
        }

    async def state_nodes(self, keys: Sequence[tuple[str, int]]) -> list[tuple[bytes, int] | None]:
        """The state nodes of partitions ``keys`` undecoded (None: no state), read pipelined."""
        found = await self.zk.get_many([state_path(name, p) for name, p in keys])
        return [None if got is None else (got[0], got[1].version) for got in found]
