"""The group coordinator: JoinGroup / SyncGroup / Heartbeat / LeaveGroup, offset commits.

Theory of operation (``docs/groups.md`` has the full text):

* **Who coordinates.** The coordinator of a group is ``coordinator_for(group, live agents)``:
  rendezvous hashing over the live agents that are not shutting down (the highest CRC32 of
  ``group:agent``), so an agent's arrival or departure moves only its own groups. Every agent computes the same
  answer from its ``/agents`` watch, and ``FindCoordinator`` returns it. An agent answers
  ``NOT_COORDINATOR`` for groups that are not its own, and forgets (unloads) groups it no
  longer coordinates, failing their waiting requests with ``NOT_COORDINATOR``; clients then
  ask FindCoordinator again.
* **State lives in ZooKeeper** (``storage.metadata.groups``): the coordinator loads a group on
  its first request and writes the state (compare-and-set on the znode version) at every
  generation bump and at every completed sync, *before* answering. A coordinator that takes
  over after an agent death therefore knows the generation, the members and their
  assignments; members keep heartbeating and consuming without a rebalance (their session
  clock restarts at load).
* **Rebalance** (eager or cooperative — the protocol is the clients' business, Kafka style):
  a join moves the group to PREPARING_REBALANCE; heartbeats answer REBALANCE_IN_PROGRESS so
  every member rejoins; once every member has rejoined (or the rebalance timeout passed, and
  the laggards are dropped) the generation is bumped, the leader gets every member's
  subscription and the others an empty list; the leader's SyncGroup carries the assignment
  and moves the group to STABLE. A static member (``group.instance.id``) that rejoins with a
  new member id while the group is stable takes its old place, fencing the previous process,
  and gets its old assignment back without a rebalance.
* **One subscription per group.** A JoinGroup carries the member's filter (the canonical
  text of its ``storage.filters`` expression, or none). A member whose filter differs from
  the other members' is refused with ``INCONSISTENT_FILTER`` and does not join; a member
  alone in its group may change it. Filters are persisted with the members.
* **Sessions.** A member not heard from (join, sync, heartbeat, commit) for its
  ``session.timeout.ms`` is removed and the group rebalances; a member that does not rejoin
  within the rebalance timeout (the client's ``max.poll.interval.ms``) is removed too.
* **Topic incarnations.** Committed offsets are stored with the id of the topic incarnation
  they were committed for (``storage.metadata.groups``). A commit naming another id than the
  topic's current one gets ``INCONSISTENT_TOPIC_ID`` (``UNKNOWN_TOPIC_ID`` if no topic has
  it), one for a topic being deleted ``UNKNOWN_TOPIC_OR_PARTITION``; OffsetFetch hands out
  nothing of a deleted topic or of another incarnation. The current id comes from the agent's
  view, or from ZooKeeper for a topic the view does not know yet.
* **Offset commits** are checked against the generation (``ILLEGAL_GENERATION`` for an old
  one, ``UNKNOWN_MEMBER_ID``, ``REBALANCE_IN_PROGRESS`` while the new generation is waiting for
  its assignment), then parked in memory. One flusher task writes every group's parked commits
  in one ZooKeeper transaction per group (state version checked, one znode per topic) and only
  then answers them. Commits that arrive while a write is in flight wait for the next one, so
  the ZooKeeper write rate is bounded by the flush rate, not by the commit rate.
* **Transactional offsets** (``TxnOffsetCommit``, ``docs/transactions.md``) are checked like
  commits, then parked per producer id in ``/groups/<g>/txn`` (written before answering) until
  the transaction coordinator's marker comes: commit moves them into the committed offsets
  and clears them in one ``multi``, abort clears them. Markers carry a token; one not newer
  than the last applied for the producer is a retry (answered, nothing done). While a
  partition has parked offsets, an offset fetch with ``require_stable`` answers
  ``UNSTABLE_OFFSET_COMMIT`` (retriable) for it (KIP-447): a new owner of the partition never
  starts from an offset a transaction in flight is about to move.
* **Crashes on a record** (``ConsumerProgress``, ``docs/retries.md``). A member with retries
  names, before handing records out, the offsets it is about to process; they are kept in
  memory with the member, each note replacing the last. When the member's *session expires*
  (a kill -9, an OOM: not a leave, not a rebalance) the ranges it had in flight become
  *suspects* of the group, persisted with its state: a range that lies inside one of the
  partition's suspects already counts one crash more, any other starts at one; the
  partition's suspects it does not overlap stay (a member dying short of a pinned record
  leaves that record pinned). Every note is answered with the group's suspects, so the
  partition's next owner learns them; a note past a suspect's end clears it.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from broker_agents.groups.state import Event, Phase, next_phase
from storage.errors import (
    CoordinatorNotAvailableError,
    FencedInstanceIdError,
    GroupError,
    IllegalGenerationError,
    InconsistentFilterError,
    InconsistentGroupProtocolError,
    InconsistentTopicIdError,
    InvalidProducerEpochError,
    InvalidRequestError,
    InvalidSessionTimeoutError,
    MetadataError,
    NotCoordinatorError,
    ProducerFencedError,
    RebalanceInProgressError,
    StrataError,
    TransactionCoordinatorFencedError,
    UnknownMemberIdError,
    UnknownTopicIdError,
    UnknownTopicOrPartitionError,
    UnstableOffsetCommitError,
)
from storage.metadata.groups import (
    CommittedOffset,
    GroupRecord,
    GroupStore,
    GroupTxnState,
    MemberRecord,
    PendingTxnOffsets,
    SuspectRecord,
    TopicCommits,
    b64,
    unb64,
    validate_group_id,
)
from storage.protocol import messages as m

if TYPE_CHECKING:
    from broker_agents.view import ClusterView
    from storage.metadata import AsyncZooKeeper, TopicSpec

log = logging.getLogger(__name__)

#: (first, end, crashes, pinned) of one suspect range
SuspectRange = tuple[int, int, int, bool]


#: a producer's last marker token is kept this long after it was applied
TOKEN_RETENTION_MS = 7 * 24 * 3600 * 1000


def coordinator_for(group_id: str, live_agents: Iterable[int]) -> int | None:
    """The coordinating agent of ``group_id`` among ``live_agents`` (None if there is none).

    Rendezvous hashing: the agent with the highest CRC32 of ``group:agent``. When an agent
    joins or leaves, only the groups it gains or held move; the others keep their coordinator
    (a modulo over the sorted ids moved most groups at every change)."""
    key = group_id.encode() + b":"
    best = max(live_agents, key=lambda a: (zlib.crc32(key + str(a).encode()), a), default=None)
    return best


def _code(exc: BaseException) -> int:
    return exc.code if isinstance(exc, StrataError) else StrataError.code


@dataclass
class Member:
    member_id: str
    group_instance_id: str | None
    client_id: str
    session_timeout_ms: int
    rebalance_timeout_ms: int
    protocols: list[tuple[str, bytes]]
    assignment: bytes = b""
    last_seen: float = 0.0
    join: asyncio.Future[m.JoinGroupResponse] | None = None
    sync: asyncio.Future[m.SyncGroupResponse] | None = None
    filter: str | None = None  # the subscription's filter (canonical text); None: all records
    #: (topic, partition) -> [first, end) offsets it said it is processing (ConsumerProgress)
    inflight: dict[tuple[str, int], tuple[int, int]] = field(default_factory=dict)

    def record(self) -> MemberRecord:
        return MemberRecord(
            member_id=self.member_id,
            group_instance_id=self.group_instance_id,
            client_id=self.client_id,
            session_timeout_ms=self.session_timeout_ms,
            rebalance_timeout_ms=self.rebalance_timeout_ms,
            protocols=[(name, b64(meta)) for name, meta in self.protocols],
            assignment=b64(self.assignment),
            filter=self.filter,
        )


@dataclass
class PendingCommit:
    offsets: dict[tuple[str, int], CommittedOffset]
    done: asyncio.Future[None]
    topic_ids: dict[str, str] = field(default_factory=dict)  # the incarnation of each topic


@dataclass
class Group:
    group_id: str
    phase: Phase = Phase.EMPTY
    generation: int = 0
    protocol_type: str | None = None
    protocol: str | None = None
    leader: str | None = None
    members: dict[str, Member] = field(default_factory=dict)
    version: int = -1  # the state znode's version (-1: not written yet)
    offsets: dict[str, tuple[TopicCommits, int]] = field(default_factory=dict)
    pending: list[PendingCommit] = field(default_factory=list)
    join_deadline: float = 0.0  # PREPARING_REBALANCE: when laggards are dropped
    join_ready_at: float = 0.0  # PREPARING_REBALANCE: initial rebalance delay
    sync_deadline: float = 0.0  # COMPLETING_REBALANCE: when members yet to sync are dropped
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one ZooKeeper write at a time
    #: transactional offsets not yet settled, marker tokens (``/groups/<g>/txn``) and version
    txn: GroupTxnState = field(default_factory=lambda: GroupTxnState({}, {}))
    txn_version: int = -1
    #: (topic, partition) -> [(first, end, crashes, pinned), ...]: offsets in flight when
    #: members crashed, disjoint ranges in offset order; pinned: the last crash had that one
    #: record in flight and nothing else
    suspects: dict[tuple[str, int], list[SuspectRange]] = field(default_factory=dict)

    def unstable(self) -> set[tuple[str, int]]:
        """Partitions with transactional offsets waiting for their transaction's marker."""
        return {tp for p in self.txn.pending.values() for tp in p.offsets}

    def static(self, instance_id: str | None) -> Member | None:
        if instance_id is None:
            return None
        for member in self.members.values():
            if member.group_instance_id == instance_id:
                return member
        return None

    def record(self) -> GroupRecord:
        return GroupRecord(
            group_id=self.group_id,
            generation=self.generation,
            phase=self.phase.value,
            protocol_type=self.protocol_type,
            protocol=self.protocol,
            leader=self.leader,
            members=[mb.record() for mb in self.members.values()],
            updated_ms=int(time.time() * 1000),
            suspects=[
                SuspectRecord(
                    topic=t, partition=p, first_offset=a, end_offset=b, crashes=n, pinned=pin
                )
                for (t, p), ranges in self.suspects.items()
                for a, b, n, pin in ranges
            ],
        )


def add_crash(
    suspects: list[SuspectRange], first: int, end: int, alone: bool
) -> list[SuspectRange]:
    """A partition's suspects after a member died with [first, end) of it in flight
    (``alone``: and nothing else). A range inside a suspect narrows it down and counts one
    crash more; any other starts at one and replaces the suspects it overlaps. Those it
    misses stay as they were: a member hands out the records before a suspect as usual, so it
    can die there, short of a record a crash pinned."""
    crashes = 1
    for a, b, n, _ in suspects:
        if a <= first and end <= b:
            crashes = n + 1  # narrowed down (or the same range again)
    kept = [s for s in suspects if s[1] <= first or end <= s[0]]
    return sorted([*kept, (first, end, crashes, alone and end - first == 1)])


@dataclass(frozen=True, slots=True)
class MemberSummary:
    member_id: str
    group_instance_id: str | None
    client_id: str
    metadata: bytes  # the subscription for the group's chosen protocol (opaque)
    assignment: bytes  # opaque


@dataclass(frozen=True, slots=True)
class GroupSummary:
    group_id: str
    phase: Phase
    protocol_type: str
    protocol: str
    members: list[MemberSummary]


#: most suspects a group keeps, and most partitions one progress note names
MAX_SUSPECTS = 10_000


@dataclass(frozen=True, slots=True)
class CoordinatorSettings:
    min_session_timeout_ms: int = 1000
    max_session_timeout_ms: int = 300_000
    initial_rebalance_delay_ms: int = 3000
    commit_linger_ms: int = 5
    tick_s: float = 0.05


class GroupCoordinator:
    def __init__(
        self,
        agent_id: int,
        zk: AsyncZooKeeper,
        view: ClusterView,
        session_ok: Callable[[], bool],
        settings: CoordinatorSettings,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.agent_id = agent_id
        self.view = view
        self.session_ok = session_ok
        self.settings = settings
        self.store = GroupStore(zk)
        self.clock = clock
        self.groups: dict[str, Group] = {}
        self._loading: dict[str, asyncio.Future[Group]] = {}
        self._flush_wanted = asyncio.Event()
        self.commits_received = 0
        self.zk_offset_writes = 0
        self.zk_state_writes = 0

    # ---- ownership --------------------------------------------------------------------------
    def coordinator_id(self, group_id: str) -> int | None:
        agents = self.view.agents
        return coordinator_for(group_id, (a for a, r in agents.items() if not r.shutting_down))

    def owns(self, group_id: str) -> bool:
        return self.session_ok() and self.coordinator_id(group_id) == self.agent_id

    async def _group(self, group_id: str) -> Group:
        """This agent's live copy of the group (loaded from ZooKeeper on first use)."""
        validate_group_id(group_id)
        if not self.owns(group_id):
            raise NotCoordinatorError(
                f"agent {self.agent_id} does not coordinate group {group_id!r}"
            )
        group = self.groups.get(group_id)
        if group is not None:
            return group
        loading = self._loading.get(group_id)
        if loading is None:
            loading = asyncio.ensure_future(self._load(group_id))
            self._loading[group_id] = loading
            loading.add_done_callback(lambda _: self._loading.pop(group_id, None))
        return await asyncio.shield(loading)

    async def _load(self, group_id: str) -> Group:
        try:
            record, version = await self.store.get_state(group_id)
            txn, txn_version = await self.store.get_txn(group_id)
        except MetadataError as exc:
            raise CoordinatorNotAvailableError(f"cannot load group {group_id!r}: {exc}") from exc
        group = Group(group_id, version=version, txn=txn, txn_version=txn_version)
        now = self.clock()
        if record is not None:
            group.generation = record.generation
            group.protocol_type = record.protocol_type
            group.protocol = record.protocol
            group.leader = record.leader
            group.suspects = {}
            for r in record.suspects:
                group.suspects.setdefault((r.topic, r.partition), []).append(
                    (r.first_offset, r.end_offset, r.crashes, r.pinned)
                )
            for ranges in group.suspects.values():
                ranges.sort()
            for mr in record.members:
                group.members[mr.member_id] = Member(
                    mr.member_id,
                    mr.group_instance_id,
                    mr.client_id,
                    mr.session_timeout_ms,
                    mr.rebalance_timeout_ms,
                    [(name, unb64(meta)) for name, meta in mr.protocols],
                    unb64(mr.assignment),
                    last_seen=now,
                    filter=mr.filter,
                )
            phase = Phase(record.phase)
            if not group.members:
                phase = Phase.EMPTY
            elif phase == Phase.PREPARING_REBALANCE:
                phase = Phase.COMPLETING_REBALANCE  # persisted only at the generation bump
            group.phase = phase
            if phase == Phase.COMPLETING_REBALANCE:
                timeout = max(mb.rebalance_timeout_ms for mb in group.members.values())
                group.sync_deadline = now + timeout / 1000
        if not self.owns(group_id):
            raise NotCoordinatorError(f"group {group_id!r} moved while loading")
        existing = self.groups.get(group_id)
        if existing is not None:
            return existing
        self.groups[group_id] = group
        log.info(
            "loaded group %s: generation %d, %s, %d members",
            group_id,
            group.generation,
            group.phase.value,
            len(group.members),
        )
        return group

    def _unload(self, group: Group, why: StrataError) -> None:
        self.groups.pop(group.group_id, None)
        if group.phase != Phase.DEAD:
            group.phase = next_phase(group.phase, Event.UNLOAD)
        for member in group.members.values():
            for fut in (member.join, member.sync):
                if fut is not None and not fut.done():
                    fut.set_exception(why)
        for pending in group.pending:
            if not pending.done.done():
                pending.done.set_exception(why)
        group.pending.clear()

    # ---- loops ------------------------------------------------------------------------------
    async def run(self) -> None:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._tick_loop(), name="group-sessions")
            tg.create_task(self._flush_loop(), name="group-offsets-flusher")

    async def _tick_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.tick_s)
            for group in list(self.groups.values()):
                try:
                    await self._tick(group)
                except Exception:
                    log.exception("group %s: tick failed", group.group_id)

    async def _tick(self, group: Group) -> None:
        if not self.owns(group.group_id):
            self._unload(group, NotCoordinatorError(f"group {group.group_id!r} moved"))
            return
        now = self.clock()
        # a member waiting at the coordinator (a JoinGroup or SyncGroup in hand) is alive: its
        # client cannot heartbeat on the connection the wait holds (Kafka's rule too)
        expired = [
            mb
            for mb in group.members.values()
            if mb.join is None
            and mb.sync is None
            and now - mb.last_seen > mb.session_timeout_ms / 1000
        ]
        for mb in expired:
            log.info("group %s: member %s expired", group.group_id, mb.member_id)
            self._crashed(group, mb)
            await self._remove(group, mb, UnknownMemberIdError("session expired"))
        if group.phase == Phase.PREPARING_REBALANCE:
            await self._maybe_complete_join(group)
        elif group.phase == Phase.COMPLETING_REBALANCE and now > group.sync_deadline:
            # alive (heartbeating) but no SyncGroup within the rebalance timeout: a leader that
            # never hands out the assignment would otherwise hold every member in the wait
            for mb in [mb for mb in group.members.values() if mb.sync is None]:
                log.info("group %s: member %s did not sync in time", group.group_id, mb.member_id)
                await self._remove(group, mb, RebalanceInProgressError("no SyncGroup in time"))

    # ---- membership -------------------------------------------------------------------------
    async def find_coordinator(self, req: m.FindCoordinatorRequest) -> m.FindCoordinatorResponse:
        try:
            validate_group_id(req.key)
        except InvalidRequestError as exc:
            return m.FindCoordinatorResponse(exc.code, -1, "", 0)
        agent_id = self.coordinator_id(req.key)
        reg = None if agent_id is None else self.view.agents.get(agent_id)
        if reg is None:
            return m.FindCoordinatorResponse(CoordinatorNotAvailableError.code, -1, "", 0)
        return m.FindCoordinatorResponse(0, reg.agent_id, reg.host, reg.port)

    async def join_group(self, req: m.JoinGroupRequest) -> m.JoinGroupResponse:
        try:
            return await self._join(req)
        except StrataError as exc:
            return m.JoinGroupResponse(exc.code, -1, None, "", req.member_id, [])

    async def _join(self, req: m.JoinGroupRequest) -> m.JoinGroupResponse:
        s = self.settings
        if not s.min_session_timeout_ms <= req.session_timeout_ms <= s.max_session_timeout_ms:
            raise InvalidSessionTimeoutError(
                f"session.timeout.ms {req.session_timeout_ms} is outside "
                f"[{s.min_session_timeout_ms}, {s.max_session_timeout_ms}]"
            )
        if not req.protocols:
            raise InconsistentGroupProtocolError("a join needs at least one protocol")
        group = await self._group(req.group_id)
        if group.members and (
            req.protocol_type != group.protocol_type
            or not self._common_protocols(group, {p.name for p in req.protocols})
        ):
            raise InconsistentGroupProtocolError(
                f"group {group.group_id!r} uses {group.protocol_type}/{group.protocol}"
            )
        now = self.clock()
        protocols = [(p.name, bytes(p.metadata or b"")) for p in req.protocols]
        member = group.members.get(req.member_id) if req.member_id else None
        static = group.static(req.group_instance_id)
        if req.member_id and member is None:
            if static is None:
                raise UnknownMemberIdError(f"member {req.member_id!r} is not in the group")
            raise FencedInstanceIdError(
                f"group.instance.id {req.group_instance_id!r} belongs to another member now"
            )
        others = [mb for mb in group.members.values() if mb is not member and mb is not static]
        if any(mb.filter != req.filter for mb in others):
            raise InconsistentFilterError(
                f"group {group.group_id!r} subscribes with filter {others[0].filter!r}: a member"
                f" with filter {req.filter!r} cannot join it (one subscription per group)"
            )
        if member is None and static is not None:
            # a static member back under a new member id: it takes the old one's place (the
            # old process is gone: what it had in flight counts as a crash)
            self._crashed(group, static)
            old_id = static.member_id
            new_id = f"{req.group_instance_id}-{uuid.uuid4().hex[:12]}"
            for fut in (static.join, static.sync):
                if fut is not None and not fut.done():
                    fut.set_exception(FencedInstanceIdError("replaced by a newer instance"))
            del group.members[old_id]
            static.member_id, static.join, static.sync = new_id, None, None
            static.last_seen = now
            static.session_timeout_ms = req.session_timeout_ms
            static.rebalance_timeout_ms = req.rebalance_timeout_ms
            group.members[new_id] = static
            if group.leader == old_id:
                group.leader = new_id
            if (
                group.phase == Phase.STABLE
                and static.protocols == protocols
                and static.filter == req.filter
            ):
                await self._persist(group)
                return m.JoinGroupResponse(
                    0, group.generation, group.protocol, group.leader or "", new_id, []
                )
            member = static
        if member is None:
            member = Member(
                f"{req.group_instance_id or 'member'}-{uuid.uuid4().hex[:12]}",
                req.group_instance_id,
                "",
                req.session_timeout_ms,
                req.rebalance_timeout_ms,
                protocols,
            )
            group.members[member.member_id] = member
            group.protocol_type = req.protocol_type
        member.protocols = protocols
        member.inflight = {}  # alive and rejoining: nothing it had in flight crashed
        member.filter = req.filter
        member.session_timeout_ms = req.session_timeout_ms
        member.rebalance_timeout_ms = req.rebalance_timeout_ms
        member.last_seen = now
        if member.join is not None and not member.join.done():
            member.join.set_exception(RebalanceInProgressError("superseded by a newer join"))
        member.join = asyncio.get_running_loop().create_future()
        waiter = member.join
        self._start_rebalance(group)
        await self._maybe_complete_join(group)
        return await waiter

    def _common_protocols(self, group: Group, extra: set[str] | None = None) -> list[str]:
        members = list(group.members.values())
        if not members:
            return sorted(extra or ())
        first = [name for name, _ in members[0].protocols]
        common = [n for n in first if all(n in dict(mb.protocols) for mb in members[1:])]
        return [n for n in common if extra is None or n in extra]

    def _start_rebalance(self, group: Group) -> None:
        if group.phase == Phase.PREPARING_REBALANCE:
            return
        was_empty = group.phase == Phase.EMPTY
        group.phase = next_phase(group.phase, Event.JOIN)
        now = self.clock()
        timeout = max((mb.rebalance_timeout_ms for mb in group.members.values()), default=0)
        group.join_deadline = now + timeout / 1000
        delay = self.settings.initial_rebalance_delay_ms / 1000 if was_empty else 0.0
        group.join_ready_at = now + delay
        self._fail_syncs(group, now)

    @staticmethod
    def _fail_syncs(group: Group, now: float) -> None:
        """A new rebalance answers the SyncGroups still waiting; their members were alive until
        now and get a session's time from here to join again."""
        for mb in group.members.values():
            if mb.sync is not None and not mb.sync.done():
                mb.sync.set_exception(RebalanceInProgressError("the group is rebalancing"))
                mb.last_seen = now
            mb.sync = None

    async def _maybe_complete_join(self, group: Group) -> None:
        if group.phase != Phase.PREPARING_REBALANCE:
            return
        now = self.clock()
        waiting = [mb for mb in group.members.values() if mb.join is None]
        if waiting and now < group.join_deadline:
            return
        if now < group.join_ready_at and now < group.join_deadline:
            return
        for mb in waiting:
            log.info("group %s: member %s did not rejoin in time", group.group_id, mb.member_id)
            del group.members[mb.member_id]
        if not group.members:
            group.phase = next_phase(group.phase, Event.LAST_MEMBER_GONE)
            group.leader = None
            await self._persist(group)
            return
        group.phase = next_phase(group.phase, Event.ALL_JOINED)
        group.generation += 1
        common = self._common_protocols(group)
        if group.leader not in group.members:
            group.leader = next(iter(group.members))
        group.protocol = common[0] if common else None
        for mb in group.members.values():
            mb.assignment = b""
        joins = {mb.member_id: mb.join for mb in group.members.values()}
        for mb in group.members.values():
            mb.join = None
            mb.last_seen = now  # each session runs from the answer, not from its JoinGroup
        group.sync_deadline = (
            now + max(mb.rebalance_timeout_ms for mb in group.members.values()) / 1000
        )
        try:
            await self._persist(group)
        except StrataError as exc:
            for fut in joins.values():
                if fut is not None and not fut.done():
                    fut.set_exception(exc)
            return
        everyone = [
            m.JoinGroupMember(
                mb.member_id, mb.group_instance_id, dict(mb.protocols)[group.protocol]
            )
            for mb in group.members.values()
            if group.protocol is not None
        ]
        for member_id, fut in joins.items():
            if fut is not None and not fut.done():
                fut.set_result(
                    m.JoinGroupResponse(
                        0,
                        group.generation,
                        group.protocol,
                        group.leader,
                        member_id,
                        everyone if member_id == group.leader else [],
                    )
                )
        log.info(
            "group %s: generation %d, %d members, leader %s, protocol %s",
            group.group_id,
            group.generation,
            len(group.members),
            group.leader,
            group.protocol,
        )

    async def _persist(self, group: Group) -> None:
        """Write the group's state (CAS); losing the race means another agent has it now."""
        async with group.lock:
            try:
                group.version = await self.store.write_state(group.record(), group.version)
                self.zk_state_writes += 1
            except MetadataError as exc:
                err = NotCoordinatorError(f"group {group.group_id!r} changed under us: {exc}")
                self._unload(group, err)
                raise err from exc

    async def _remove(self, group: Group, member: Member, why: StrataError) -> None:
        group.members.pop(member.member_id, None)
        for fut in (member.join, member.sync):
            if fut is not None and not fut.done():
                fut.set_exception(why)
        if not group.members:
            group.leader = None
            if group.phase != Phase.EMPTY:
                group.phase = next_phase(group.phase, Event.LAST_MEMBER_GONE)
            await self._persist(group)
            return
        if group.phase == Phase.PREPARING_REBALANCE:
            await self._maybe_complete_join(group)
            return
        group.phase = next_phase(group.phase, Event.LEAVE)
        self._start_rebalance_after_leave(group)
        await self._persist(group)

    def _start_rebalance_after_leave(self, group: Group) -> None:
        now = self.clock()
        timeout = max((mb.rebalance_timeout_ms for mb in group.members.values()), default=0)
        group.join_deadline = now + timeout / 1000
        group.join_ready_at = now
        self._fail_syncs(group, now)

    def _member(
        self, group: Group, member_id: str, instance_id: str | None, generation: int | None
    ) -> Member:
        member = group.members.get(member_id)
        if member is None:
            if group.static(instance_id) is not None:
                raise FencedInstanceIdError(
                    f"group.instance.id {instance_id!r} belongs to another member now"
                )
            raise UnknownMemberIdError(f"member {member_id!r} is not in group {group.group_id!r}")
        if instance_id is not None and member.group_instance_id != instance_id:
            raise FencedInstanceIdError(f"member {member_id!r} is not instance {instance_id!r}")
        member.last_seen = self.clock()
        if generation is not None and generation != group.generation:
            if group.phase == Phase.PREPARING_REBALANCE:
                raise RebalanceInProgressError(f"group {group.group_id!r} is rebalancing")
            raise IllegalGenerationError(
                f"generation {generation} of group {group.group_id!r} is over "
                f"(current: {group.generation})"
            )
        return member

    async def sync_group(self, req: m.SyncGroupRequest) -> m.SyncGroupResponse:
        try:
            group = await self._group(req.group_id)
            member = self._member(group, req.member_id, req.group_instance_id, req.generation_id)
            if group.phase == Phase.PREPARING_REBALANCE:
                raise RebalanceInProgressError(f"group {group.group_id!r} is rebalancing")
            if group.phase == Phase.STABLE:
                return m.SyncGroupResponse(0, member.assignment)
            if member.sync is not None and not member.sync.done():
                member.sync.set_exception(RebalanceInProgressError("superseded by a newer sync"))
            member.sync = asyncio.get_running_loop().create_future()
            waiter = member.sync
            if req.member_id == group.leader:
                given = {a.member_id: bytes(a.assignment or b"") for a in req.assignments}
                for mb in group.members.values():
                    mb.assignment = given.get(mb.member_id, b"")
                group.phase = next_phase(group.phase, Event.LEADER_SYNCED)
                await self._persist(group)
                now = self.clock()
                for mb in group.members.values():
                    if mb.sync is not None and not mb.sync.done():
                        mb.sync.set_result(m.SyncGroupResponse(0, mb.assignment))
                        mb.last_seen = now
                    mb.sync = None
            return await waiter
        except StrataError as exc:
            return m.SyncGroupResponse(exc.code, None)

    async def heartbeat(self, req: m.HeartbeatRequest) -> m.HeartbeatResponse:
        try:
            group = await self._group(req.group_id)
            self._member(group, req.member_id, req.group_instance_id, None)
            if group.phase == Phase.PREPARING_REBALANCE:
                raise RebalanceInProgressError(f"group {group.group_id!r} is rebalancing")
            self._member(group, req.member_id, req.group_instance_id, req.generation_id)
            return m.HeartbeatResponse(0)
        except StrataError as exc:
            return m.HeartbeatResponse(exc.code)

    # ---- progress, and crashes on a record --------------------------------------------------
    async def consumer_progress(self, req: m.ConsumerProgressRequest) -> m.ConsumerProgressResponse:
        try:
            group = await self._group(req.group_id)
            member = self._member(group, req.member_id, None, req.generation_id)
            named = sum(len(t.partitions) for t in req.topics)
            asked = sum(len(t.partitions) for t in req.asked)
            if max(named, asked) > MAX_SUSPECTS:
                raise InvalidRequestError(f"a progress note names over {MAX_SUSPECTS} partitions")
            inflight: dict[tuple[str, int], tuple[int, int]] = {}
            for t in req.topics:
                for p in t.partitions:
                    if not 0 <= p.first_offset < p.end_offset:
                        raise InvalidRequestError(
                            f"progress range [{p.first_offset}, {p.end_offset}) of"
                            f" {t.name}-{p.partition} is empty or negative"
                        )
                    inflight[(t.name, p.partition)] = (p.first_offset, p.end_offset)
            for tp, (first, _) in inflight.items():
                if tp in group.suspects:  # those it is past (persisted with the next write)
                    left = [s for s in group.suspects[tp] if s[1] > first]
                    if left:
                        group.suspects[tp] = left
                    else:
                        del group.suspects[tp]
            member.inflight = inflight
            suspects = [
                m.Suspect(t.name, p, *found[:3], int(found[3]))
                for t in req.asked
                for p in t.partitions
                for found in group.suspects.get((t.name, p), ())
            ]
            return m.ConsumerProgressResponse(0, suspects)
        except StrataError as exc:
            return m.ConsumerProgressResponse(exc.code, [])

    def _crashed(self, group: Group, member: Member) -> None:
        """``member``'s session expired: what it had in flight counts one crash."""
        alone = len(member.inflight) == 1
        for tp, (first, end) in member.inflight.items():
            old = group.suspects.pop(tp, [])  # (re-inserted last: the newest)
            group.suspects[tp] = ranges = add_crash(old, first, end, alone)
            crashes = next(n for a, b, n, _ in ranges if (a, b) == (first, end))
            log.warning(
                "group %s: member %s died processing %s-%d offsets [%d, %d) (crash %d there)",
                group.group_id,
                member.member_id,
                tp[0],
                tp[1],
                first,
                end,
                crashes,
            )
        member.inflight = {}
        while sum(map(len, group.suspects.values())) > MAX_SUSPECTS:  # the oldest go first
            del group.suspects[next(iter(group.suspects))]

    async def leave_group(self, req: m.LeaveGroupRequest) -> m.LeaveGroupResponse:
        try:
            group = await self._group(req.group_id)
            member = group.members.get(req.member_id) or group.static(req.group_instance_id)
            if member is None:
                raise UnknownMemberIdError(f"member {req.member_id!r} is not in the group")
            log.info("group %s: member %s leaves", group.group_id, member.member_id)
            await self._remove(group, member, UnknownMemberIdError("left the group"))
            return m.LeaveGroupResponse(0)
        except StrataError as exc:
            return m.LeaveGroupResponse(exc.code)

    # ---- offsets ----------------------------------------------------------------------------
    async def _topic(self, topic: str) -> TopicSpec | None:
        """The topic's spec as this agent knows it (ZooKeeper's if the view has none yet)."""
        spec = self.view.topics.get(topic)
        if spec is not None:
            return spec
        try:
            return await self.store.topic_spec(topic)
        except MetadataError as exc:
            raise CoordinatorNotAvailableError(f"cannot read topic {topic!r}: {exc}") from exc

    async def _incarnation(self, t: m.OffsetCommitTopic) -> str:
        """The topic id a commit for ``t`` is stored with, or the typed error refusing it."""
        spec = await self._topic(t.name)
        if spec is not None and spec.deletion is not None:
            raise UnknownTopicOrPartitionError(f"topic {t.name!r} is being deleted")
        if spec is None:
            if t.topic_id:
                raise UnknownTopicIdError(f"no topic {t.name!r} with id {t.topic_id}")
            return ""  # by name, for a topic not created (or not known here) yet
        if t.topic_id and t.topic_id != spec.topic_id:
            raise InconsistentTopicIdError(
                f"topic {t.name!r} is id {spec.topic_id} now, not {t.topic_id}: it was deleted "
                "and created again"
            )
        return spec.topic_id

    async def offset_commit(self, req: m.OffsetCommitRequest) -> m.OffsetCommitResponse:
        error = 0
        refused: dict[str, int] = {}
        try:
            group = await self._group(req.group_id)
            if req.generation_id < 0 and not req.member_id:
                if group.members:
                    raise IllegalGenerationError(
                        f"group {group.group_id!r} has members: commit with a generation"
                    )
            else:
                self._member(group, req.member_id, req.group_instance_id, req.generation_id)
                if group.phase == Phase.COMPLETING_REBALANCE:
                    raise RebalanceInProgressError(f"group {group.group_id!r} is rebalancing")
            topic_ids: dict[str, str] = {}
            for t in req.topics:
                try:
                    topic_ids[t.name] = await self._incarnation(t)
                except (
                    UnknownTopicOrPartitionError,
                    UnknownTopicIdError,
                    InconsistentTopicIdError,
                ) as exc:
                    refused[t.name] = exc.code
            now_ms = int(time.time() * 1000)
            offsets = {
                (t.name, p.partition): CommittedOffset(p.offset, p.metadata, now_ms)
                for t in req.topics
                if t.name in topic_ids
                for p in t.partitions
            }
            if offsets:
                done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
                group.pending.append(PendingCommit(offsets, done, topic_ids))
                self.commits_received += len(offsets)
                self._flush_wanted.set()
                await asyncio.shield(done)
        except StrataError as exc:
            error = exc.code
        return m.OffsetCommitResponse(
            [
                m.OffsetCommitTopicResult(
                    t.name,
                    [
                        m.OffsetCommitPartitionResult(p.partition, error or refused.get(t.name, 0))
                        for p in t.partitions
                    ],
                )
                for t in req.topics
            ]
        )

    async def _flush_loop(self) -> None:
        while True:
            await self._flush_wanted.wait()
            if self.settings.commit_linger_ms:
                await asyncio.sleep(self.settings.commit_linger_ms / 1000)
            self._flush_wanted.clear()
            dirty = [g for g in self.groups.values() if g.pending]
            if dirty:
                await asyncio.gather(*(self._flush(g) for g in dirty))

    async def _flush(self, group: Group) -> None:
        batch, group.pending = group.pending, []
        async with group.lock:
            error: StrataError | None = None
            for attempt in range(3):
                try:
                    await self._write_offsets(group, batch)
                    error = None
                    break
                except MetadataError as exc:
                    error = exc
                    group.offsets.clear()  # re-read: an admin reset or another coordinator
                    if group.version >= 0:
                        try:
                            _, version = await self.store.get_state(group.group_id)
                        except MetadataError as again:
                            error = again  # ZooKeeper unreachable: answer, let clients retry
                            break
                        if version != group.version:
                            error = NotCoordinatorError(f"group {group.group_id!r} moved")
                            break
                    await asyncio.sleep(0.01 * (attempt + 1))
                except Exception as exc:  # a bug: answer the commits, keep the flusher alive
                    log.exception("group %s: offset flush failed", group.group_id)
                    error = CoordinatorNotAvailableError(f"offsets not written: {exc!r}")
                    break
        for pending in batch:
            if pending.done.done():
                continue
            if error is None:
                pending.done.set_result(None)
            else:
                pending.done.set_exception(
                    error
                    if isinstance(error, GroupError)
                    else CoordinatorNotAvailableError(f"offsets not written: {error}")
                )
        if isinstance(error, NotCoordinatorError):
            self._unload(group, error)

    async def _write_offsets(self, group: Group, batch: list[PendingCommit]) -> None:
        by_topic: dict[str, dict[int, CommittedOffset]] = {}
        topic_ids: dict[str, str] = {}
        for pending in batch:
            topic_ids.update(pending.topic_ids)
            for (topic, partition), committed in pending.offsets.items():
                by_topic.setdefault(topic, {})[partition] = committed
        writes: dict[str, tuple[TopicCommits, int]] = {}
        for topic, changes in by_topic.items():
            cached = group.offsets.get(topic)
            if cached is None:
                cached = await self.store.get_offsets(group.group_id, topic)
            stored, version = cached
            topic_id = topic_ids.get(topic, "") or stored.topic_id
            # another incarnation's offsets (a deleted topic's leftovers) are replaced
            kept = stored.offsets if stored.belongs_to(topic_id) else {}
            writes[topic] = (TopicCommits(topic_id, {**kept, **changes}), version)
        versions = await self.store.write_offsets(
            group.group_id, writes, state_version=group.version
        )
        self.zk_offset_writes += 1
        for topic, (commits, _) in writes.items():
            group.offsets[topic] = (commits, versions[topic])

    async def offset_fetch(self, req: m.OffsetFetchRequest) -> m.OffsetFetchResponse:
        try:
            group = await self._group(req.group_id)
            async with group.lock:  # wait for a flush in flight: fetches see every commit
                pass
            wanted: dict[str, list[int] | None]
            if req.topics is None:
                wanted = {t: None for t in await self.store.topics(group.group_id)}
            else:
                wanted = {t.name: t.partitions for t in req.topics}
            unstable = group.unstable() if req.require_stable else set()
            topics = []
            for topic, partitions in wanted.items():
                commits, _ = await self.store.get_offsets(group.group_id, topic)
                offsets = commits.visible(await self._topic(topic))
                if partitions is None and not offsets:
                    continue  # a deleted topic, or another incarnation's: nothing to report
                parts = sorted(offsets) if partitions is None else partitions
                results = []
                for p in parts:
                    c = offsets.get(p)
                    if (topic, p) in unstable:
                        code = UnstableOffsetCommitError.code
                        results.append(m.OffsetFetchPartitionResult(p, -1, None, code))
                        continue
                    results.append(
                        m.OffsetFetchPartitionResult(p, -1, None, 0)
                        if c is None
                        else m.OffsetFetchPartitionResult(p, c.offset, c.metadata, 0)
                    )
                topics.append(m.OffsetFetchTopicResult(topic, results))
            return m.OffsetFetchResponse(0, topics)
        except StrataError as exc:
            return m.OffsetFetchResponse(_code(exc), [])
        except Exception as exc:  # pragma: no cover - translated like every handler bug
            log.exception("offset fetch failed")
            return m.OffsetFetchResponse(_code(exc), [])

    # ---- describe and list (protocol-neutral; the Kafka listener's DescribeGroups/ListGroups)
    async def describe_group(self, group_id: str) -> GroupSummary:
        """The group as this coordinator holds it (``NotCoordinatorError`` if not its own).
        A group nobody has used is EMPTY with no members."""
        group = await self._group(group_id)
        members = []
        for mb in group.members.values():
            meta = dict(mb.protocols).get(group.protocol or "", b"")
            members.append(
                MemberSummary(mb.member_id, mb.group_instance_id, mb.client_id, meta, mb.assignment)
            )
        return GroupSummary(
            group.group_id,
            group.phase,
            group.protocol_type or "",
            group.protocol or "",
            members,
        )

    async def list_groups(self) -> list[tuple[str, str]]:
        """(group id, protocol type) of every group this agent coordinates, as Kafka's
        brokers list theirs (a client asks every agent and merges the answers)."""
        out = []
        for group_id in await self.store.list_groups():
            if not self.owns(group_id):
                continue
            loaded = self.groups.get(group_id)
            if loaded is not None:
                out.append((group_id, loaded.protocol_type or ""))
                continue
            try:
                record, _ = await self.store.get_state(group_id)
            except MetadataError:
                continue
            out.append((group_id, (record.protocol_type if record else None) or ""))
        return out

    # ---- transactional offsets --------------------------------------------------------------
    async def txn_offset_commit(
        self, req: m.TxnOffsetCommitRequest, *, without_member: bool = False
    ) -> m.TxnOffsetCommitResponse:
        """Park a transaction's offsets until its marker (checked like a commit: generation,
        member; a producer epoch older than the one parked is fenced). A topic being deleted,
        or named with another incarnation's id, is refused as in ``offset_commit``; the
        incarnation each topic's offsets are for is parked with them, and a commit marker that
        finds the topic deleted (or created again) since drops them.

        ``without_member``: a Kafka client's TxnOffsetCommit before v3 carries no group
        metadata; it is fenced by its producer epoch alone, as Kafka's coordinator does for
        those versions (before KIP-447)."""
        error = 0
        refused: dict[str, int] = {}
        try:
            group = await self._group(req.group_id)
            if without_member:
                pass  # the producer epoch below is the only fence
            elif req.generation_id < 0 and not req.member_id:
                if group.members:
                    raise IllegalGenerationError(
                        f"group {group.group_id!r} has members: commit with the consumer's"
                        " group metadata"
                    )
            else:
                self._member(group, req.member_id, req.group_instance_id, req.generation_id)
                if group.phase == Phase.COMPLETING_REBALANCE:
                    raise RebalanceInProgressError(f"group {group.group_id!r} is rebalancing")
            topic_ids: dict[str, str] = {}
            for t in req.topics:
                try:
                    topic_ids[t.name] = await self._incarnation(t)
                except (
                    UnknownTopicOrPartitionError,
                    UnknownTopicIdError,
                    InconsistentTopicIdError,
                ) as exc:
                    refused[t.name] = exc.code
            now_ms = int(time.time() * 1000)
            offsets = {
                (t.name, p.partition): CommittedOffset(p.offset, p.metadata, now_ms)
                for t in req.topics
                if t.name not in refused
                for p in t.partitions
            }
            async with group.lock:
                before = group.txn.pending.get(req.producer_id)
                if before is not None and before.producer_epoch > req.producer_epoch:
                    raise ProducerFencedError(
                        f"producer {req.producer_id} epoch {req.producer_epoch} is fenced in"
                        f" group {group.group_id!r} (epoch {before.producer_epoch} parked)"
                    )
                merged = dict(before.offsets) if before is not None else {}
                ids = dict(before.topic_ids) if before is not None else {}
                for topic, topic_id in topic_ids.items():
                    if ids.get(topic, topic_id) != topic_id:  # the topic was created again
                        merged = {tp: c for tp, c in merged.items() if tp[0] != topic}
                    ids[topic] = topic_id
                merged.update(offsets)
                pending = dict(group.txn.pending)
                pending[req.producer_id] = PendingTxnOffsets(req.producer_epoch, merged, ids)
                await self._write_txn(group, GroupTxnState(pending, dict(group.txn.tokens)), {})
            self.commits_received += len(offsets)
        except StrataError as exc:
            error = exc.code
        return m.TxnOffsetCommitResponse(
            [
                m.OffsetCommitTopicResult(
                    t.name,
                    [
                        m.OffsetCommitPartitionResult(p.partition, error or refused.get(t.name, 0))
                        for p in t.partitions
                    ],
                )
                for t in req.topics
            ]
        )

    async def txn_marker(self, group_id: str, marker: m.TxnMarker) -> int:
        """A transaction's marker for this group: commit or drop its parked offsets. Returns
        the wire code (0 when applied now or before)."""
        try:
            group = await self._group(group_id)
            pid = marker.producer_id
            async with group.lock:
                token = group.txn.tokens.get(pid, (-1, 0))[0]
                if token > marker.coordinator_epoch:
                    raise TransactionCoordinatorFencedError(
                        f"group {group_id!r} applied a newer decision of producer {pid}"
                    )
                if token == marker.coordinator_epoch:
                    return 0
                parked = group.txn.pending.get(pid)
                if parked is not None and parked.producer_epoch > marker.producer_epoch:
                    raise InvalidProducerEpochError(
                        f"group {group_id!r} has offsets of a newer epoch of producer {pid}"
                    )
                pending = {k: v for k, v in group.txn.pending.items() if k != pid}
                now_ms = int(time.time() * 1000)
                tokens = {
                    k: v for k, v in group.txn.tokens.items() if now_ms - v[1] < TOKEN_RETENTION_MS
                }
                tokens[pid] = (marker.coordinator_epoch, now_ms)
                changes: dict[str, dict[int, CommittedOffset]] = {}
                if marker.committed and parked is not None:
                    for (topic, p), c in parked.offsets.items():
                        changes.setdefault(topic, {})[p] = c
                ids = parked.topic_ids if parked is not None else {}
                await self._write_txn(group, GroupTxnState(pending, tokens), changes, ids)
            return 0
        except StrataError as exc:
            return exc.code

    async def _write_txn(
        self,
        group: Group,
        state: GroupTxnState,
        changes: dict[str, dict[int, CommittedOffset]],
        topic_ids: dict[str, str] | None = None,
    ) -> None:
        """Write the group's transactional state, and with it ``changes`` to the committed
        offsets, in one ZooKeeper transaction (``group.lock`` held). Committed offsets go to
        the topic's current incarnation (another incarnation's stored ones are replaced), and
        only when they were sent for it (``topic_ids``: the incarnation each topic's offsets
        were sent for); a topic being deleted, or deleted and created again since, gets none."""
        try:
            writes: dict[str, tuple[TopicCommits, int]] = {}
            for topic, more in changes.items():
                spec = await self._topic(topic)
                sent_for = (topic_ids or {}).get(topic, "")
                if spec is not None and spec.deletion is not None:
                    continue
                if sent_for and (spec is None or spec.topic_id != sent_for):
                    continue  # that incarnation is gone: its offsets went with it
                cached = group.offsets.get(topic)
                if cached is None:
                    cached = await self.store.get_offsets(group.group_id, topic)
                stored, version = cached
                topic_id = stored.topic_id if spec is None else spec.topic_id
                kept = stored.offsets if stored.belongs_to(topic_id) else {}
                writes[topic] = (TopicCommits(topic_id, {**kept, **more}), version)
            versions = await self.store.write_offsets(
                group.group_id,
                writes,
                state_version=group.version,
                txn=(state, group.txn_version),
            )
        except MetadataError as exc:
            group.offsets.clear()
            self._unload(group, NotCoordinatorError(f"group {group.group_id!r}: {exc}"))
            raise NotCoordinatorError(
                f"group {group.group_id!r}: transactional offsets not written ({exc})"
            ) from exc
        self.zk_offset_writes += 1
        group.txn, group.txn_version = state, versions[""]
        for topic, (commits, _) in writes.items():
            group.offsets[topic] = (commits, versions[topic])

    def handlers(self) -> dict[int, Any]:
        return {
            m.ApiKey.FIND_COORDINATOR: self.find_coordinator,
            m.ApiKey.JOIN_GROUP: self.join_group,
            m.ApiKey.SYNC_GROUP: self.sync_group,
            m.ApiKey.HEARTBEAT: self.heartbeat,
            m.ApiKey.LEAVE_GROUP: self.leave_group,
            m.ApiKey.OFFSET_COMMIT: self.offset_commit,
            m.ApiKey.OFFSET_FETCH: self.offset_fetch,
            m.ApiKey.TXN_OFFSET_COMMIT: self.txn_offset_commit,
            m.ApiKey.CONSUMER_PROGRESS: self.consumer_progress,
        }

    async def close(self) -> None:
        for group in list(self.groups.values()):
            self._unload(group, NotCoordinatorError("the agent is stopping"))
