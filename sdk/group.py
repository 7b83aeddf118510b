"""Consumer-group membership and committed offsets, on the client side (docs/groups.md).

A :class:`GroupClient` belongs to one :class:`~sdk.consumer.Consumer` with a ``group.id``.
It finds the group's coordinator (FindCoordinator to any agent), commits and fetches offsets
there, and — once the consumer ``subscribe``s — runs the membership loop as a named task under
the consumer's supervisor:

1. **Join.** With an eager assignor (``range``, ``roundrobin``) the member first gives up every
   partition (``on_partitions_revoked``, then an auto-commit if enabled). With
   ``cooperative-sticky`` it keeps consuming and tells the coordinator what it owns.
2. **Sync.** The leader computes the assignment (``sdk.assignors``) from every member's
   subscription; each member gets its share.
3. **Apply.** Newly assigned partitions start at their committed offset (or by
   ``auto.offset.reset`` when none was committed) and ``on_partitions_assigned`` runs.
   Cooperative: partitions no longer assigned are revoked (``on_partitions_revoked``) and the
   member rejoins at once, so the next generation hands them to their new owner.
4. **Heartbeat** every ``heartbeat.interval.ms``. REBALANCE_IN_PROGRESS means rejoin;
   ILLEGAL_GENERATION / UNKNOWN_MEMBER_ID mean the coordinator dropped us: the partitions are
   *lost* (``on_partitions_lost``; no commit is possible any more) and we rejoin;
   NOT_COORDINATOR or a network error mean find the coordinator again.
5. **Poll interval.** If the application does not call ``getmany``/``getone`` for
   ``max.poll.interval.ms``, the member leaves the group (its partitions go to others) and
   rejoins at the next poll.
6. **Partitions added.** The member remembers how many partitions each topic had when the
   group was last assigned (the leader: every topic of the group; others: their own); a
   metadata update (every ``metadata.max.age.ms`` at the latest) that shows another count
   makes it rejoin, so the new partitions are assigned after one rebalance, as Kafka's
   consumers do, instead of at the next unrelated one.
7. **Auto-commit** (``enable.auto.commit``) commits the positions every
   ``auto.commit.interval.ms``, before an eager revocation and at close.

A committed offset is the next offset to read (Kafka's rule): ``commit()`` with no argument
commits each assigned partition's position, i.e. one past the last record returned.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from sdk.assignors import COOPERATIVE, Subscription, assign
from sdk.cluster import Cluster
from sdk.config import ConsumerConfig
from sdk.records import TopicPartition
from storage.errors import (
    CoordinatorNotAvailableError,
    FencedInstanceIdError,
    IllegalGenerationError,
    InconsistentFilterError,
    NetworkError,
    NotCoordinatorError,
    RebalanceInProgressError,
    RequestTimedOutError,
    StrataError,
    UnknownMemberIdError,
    UnstableOffsetCommitError,
    UnsupportedVersionError,
    from_wire,
)
from storage.filters import Filter
from storage.protocol import consumer as cp
from storage.protocol import messages as m

log = logging.getLogger(__name__)

#: the group's requests go on a connection of their own (``Cluster.send``): a JoinGroup waits
#: at the coordinator until the rebalance completes, and must not hold up the fetches' answers
GROUP_CHANNEL = "group"
#: progress notes (sdk.crashes) on a connection of their own: the agent answers a connection's
#: requests in order, and an offset commit waits there for its ZooKeeper write
PROGRESS_CHANNEL = "progress"

_REDISCOVER = (
    NotCoordinatorError,
    CoordinatorNotAvailableError,
    NetworkError,
    RequestTimedOutError,
)


class GroupMember(Protocol):
    """What a ``GroupClient`` needs of its consumer (``sdk.consumer.Consumer``)."""

    def positions_to_commit(self) -> dict[TopicPartition, int]: ...

    def group_assignment(
        self, partitions: set[TopicPartition], positions: Mapping[TopicPartition, int]
    ) -> None: ...

    def wake_pollers(self) -> None: ...


class RebalanceListener(Protocol):
    """Callbacks (plain or async) around rebalances; implement the ones you need."""

    def on_partitions_revoked(self, revoked: set[TopicPartition]) -> Any: ...

    def on_partitions_assigned(self, assigned: set[TopicPartition]) -> Any: ...


@dataclass(frozen=True, slots=True)
class OffsetAndMetadata:
    offset: int
    metadata: str | None = None


async def _call(fn: Callable[..., Any] | None, arg: set[TopicPartition]) -> None:
    if fn is None:
        return
    result = fn(arg)
    if inspect.isawaitable(result):
        await result


class GroupClient:
    def __init__(self, consumer: GroupMember, cluster: Cluster, config: ConsumerConfig) -> None:
        assert config.group_id is not None
        self.consumer = consumer
        self.cluster = cluster
        self.config = config
        self.group_id: str = config.group_id
        self.member_id = ""
        self.generation = m.NO_GENERATION
        self.protocol: str | None = None
        self.topics: tuple[str, ...] = ()
        self.listener: RebalanceListener | None = None
        self.filter: Filter | None = None
        #: why the coordinator will not have this member (its filter is not the group's)
        self.refused: InconsistentFilterError | None = None
        self.owned: set[TopicPartition] = set()
        self.coordinator: int | None = None
        self._need_join = asyncio.Event()
        self._joining = False  # a join/sync round is in flight
        #: the generation commits speak for while a cooperative revocation runs (the new one)
        self._revoking_in: int | None = None
        self._polled = asyncio.Event()
        self.rebalances = 0
        #: partition counts the current assignment was made with (see 6. above)
        self._assigned_counts: dict[str, int] = {}
        #: topics the leader's last assignment left out (not in its metadata in time)
        self._left_out: set[str] = set()
        cluster.add_listener(self._metadata_updated)

    def _metadata_updated(self) -> None:
        if not self.member_id or self._joining or self._need_join.is_set():
            return
        counts: dict[str, int | None] = {**self._assigned_counts}
        counts.update(dict.fromkeys(self._left_out))  # None: not in the metadata then
        for topic, count in counts.items():
            now = self.cluster.partition_count(topic)
            if now is not None and now != count:
                log.info(
                    "group %s: %s has %d partitions, %s when assigned: rejoining",
                    self.group_id,
                    topic,
                    now,
                    count,
                )
                self._need_join.set()
                return

    # ---- coordinator --------------------------------------------------------------------
    async def _find_coordinator(self, deadline: float) -> int:
        attempt = 0
        while True:
            last: StrataError | None = None
            agents: list[int | None] = [*self.cluster.agents] or [None]
            for agent_id in agents:
                try:
                    if agent_id is None:
                        await self.cluster.refresh()
                        continue
                    resp: m.FindCoordinatorResponse = await self.cluster.send(
                        agent_id, m.FindCoordinatorRequest(self.group_id)
                    )
                except StrataError as exc:
                    last = exc
                    continue
                if resp.error_code:
                    last = from_wire(resp.error_code, f"FindCoordinator {self.group_id!r}")
                    continue
                if resp.agent_id not in self.cluster.agents:
                    self.cluster.request_update()
                    await self.cluster.refresh()
                self.coordinator = resp.agent_id
                return resp.agent_id
            if asyncio.get_running_loop().time() > deadline:
                raise CoordinatorNotAvailableError(
                    f"no coordinator for group {self.group_id!r}: {last}"
                )
            self.cluster.request_update()
            await asyncio.sleep(min(0.05 * 2**attempt, 1.0))
            attempt += 1

    async def _send(
        self,
        body: Any,
        *,
        request_timeout: float | None = None,
        channel: str = GROUP_CHANNEL,
        on_sent: Callable[[], None] | None = None,
    ) -> Any:
        """One request to the coordinator, finding it (again) on the way when needed."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.request_timeout_ms / 1000
        while True:
            if self.coordinator is None:
                await self._find_coordinator(deadline)
            assert self.coordinator is not None
            try:
                return await self.cluster.send(
                    self.coordinator,
                    body,
                    request_timeout=request_timeout,
                    channel=channel,
                    on_sent=on_sent,
                )
            except StrataError as exc:
                if not isinstance(exc, _REDISCOVER) and not exc.retriable:
                    raise
                self.coordinator = None
                if loop.time() > deadline:
                    raise
                await asyncio.sleep(0.05)

    def _check(self, code: int, what: str) -> None:
        if code == 0:
            return
        err = from_wire(code, f"{what} (group {self.group_id!r}): error {code}")
        if isinstance(err, NotCoordinatorError | CoordinatorNotAvailableError):
            self.coordinator = None
        raise err

    # ---- offsets ------------------------------------------------------------------------
    async def commit(self, offsets: Mapping[TopicPartition, OffsetAndMetadata]) -> None:
        if not offsets:
            return
        topics: dict[str, list[m.OffsetCommitPartition]] = {}
        for tp, om in offsets.items():
            topics.setdefault(tp.topic, []).append(
                m.OffsetCommitPartition(tp.partition, om.offset, om.metadata)
            )
        subscribed = bool(self.topics)
        attempt = 0
        while True:
            generation = self.generation if self._revoking_in is None else self._revoking_in
            req = m.OffsetCommitRequest(
                self.group_id,
                generation if subscribed else m.NO_GENERATION,
                self.member_id if subscribed else "",
                self.config.group_instance_id if subscribed else None,
                # the incarnation the metadata names: a commit never goes to a deleted topic
                [m.OffsetCommitTopic(t, ps, self.cluster.topic_id(t)) for t, ps in topics.items()],
            )
            resp: m.OffsetCommitResponse = await self._send(req)
            codes = {p.error_code for t in resp.topics for p in t.partitions} - {0}
            if not codes:
                return
            err = from_wire(min(codes), f"offset commit for group {self.group_id!r}")
            if isinstance(err, NotCoordinatorError | CoordinatorNotAvailableError) and attempt < 5:
                self.coordinator = None
                attempt += 1
                continue
            if self._joining or (self.generation, self.member_id) != (
                req.generation_id,
                req.member_id,
            ):
                # the commit spoke for a generation we are already leaving or have left: the
                # join in flight (or done) answers the error; rejoining once more for it would
                # start yet another rebalance, whose members' commits fail the same way (a storm)
                raise err
            if isinstance(err, RebalanceInProgressError | IllegalGenerationError):
                self._need_join.set()
            if isinstance(err, UnknownMemberIdError):
                # no longer a member: the partitions are lost before anything else happens, so
                # nothing fetched for them is processed outside a generation
                await self._lose_all()
                self.member_id, self.generation = "", m.NO_GENERATION
                self._need_join.set()
            raise err

    async def progress(
        self,
        ranges: Mapping[TopicPartition, tuple[int, int]],
        on_sent: Callable[[], None] | None = None,
        asked: Collection[TopicPartition] = (),
    ) -> dict[TopicPartition, list[tuple[int, int, int, bool]]] | None:
        """Tell the coordinator which offsets this member is about to process (``ranges``:
        [first, end) per partition; every earlier note is done); returns the group's
        suspects among the ``asked`` partitions (offsets in flight when members crashed, and
        how often), or None when the note was not taken (no generation yet, a rebalance, the
        coordinator moving). A suspect is (first, end, crashes, pinned): pinned when its last
        crash had that one record in flight and nothing else; a partition's suspects are
        disjoint and in offset order.
        ``docs/retries.md``, "Poison messages and crashes"."""
        if not self.member_id or self.generation == m.NO_GENERATION:
            return None
        topics: dict[str, list[m.ProgressPartition]] = {}
        for tp, (first, end) in ranges.items():
            topics.setdefault(tp.topic, []).append(m.ProgressPartition(tp.partition, first, end))
        wanted: dict[str, list[int]] = {}
        for tp in asked:
            wanted.setdefault(tp.topic, []).append(tp.partition)
        req = m.ConsumerProgressRequest(
            self.group_id,
            self.generation,
            self.member_id,
            [m.ProgressTopic(t, ps) for t, ps in topics.items()],
            [m.AskedTopic(t, ps) for t, ps in wanted.items()],
        )
        resp: m.ConsumerProgressResponse = await self._send(
            req,
            request_timeout=self.config.request_timeout_ms / 1000,
            channel=PROGRESS_CHANNEL,
            on_sent=on_sent,
        )
        if resp.error_code:
            err = from_wire(resp.error_code, f"progress note (group {self.group_id!r})")
            if isinstance(err, UnsupportedVersionError):
                raise err
            return None
        found: dict[TopicPartition, list[tuple[int, int, int, bool]]] = {}
        for s in resp.suspects:
            found.setdefault(TopicPartition(s.topic, s.partition), []).append(
                (s.first_offset, s.end_offset, s.crashes, bool(s.pinned))
            )
        for spans in found.values():
            spans.sort()
        return found

    async def committed(
        self, partitions: Iterable[TopicPartition]
    ) -> dict[TopicPartition, OffsetAndMetadata | None]:
        """The committed offsets. A read_committed consumer asks for stable ones: while a
        transaction's offsets for a partition are not settled, the coordinator answers
        UNSTABLE_OFFSET_COMMIT and the fetch is retried (up to ``request.timeout.ms``)."""
        wanted: dict[str, list[int]] = {}
        for tp in partitions:
            wanted.setdefault(tp.topic, []).append(tp.partition)
        if not wanted:
            return {}
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.request_timeout_ms / 1000
        delay = 0.02
        while True:
            resp: m.OffsetFetchResponse = await self._send(
                m.OffsetFetchRequest(
                    self.group_id,
                    [m.OffsetFetchTopic(t, ps) for t, ps in wanted.items()],
                    1 if self.config.read_committed else 0,
                )
            )
            unstable = any(
                p.error_code == UnstableOffsetCommitError.code
                for t in resp.topics
                for p in t.partitions
            )
            if not unstable or loop.time() + delay > deadline:
                break
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.5)
        self._check(resp.error_code, "offset fetch")
        out: dict[TopicPartition, OffsetAndMetadata | None] = {}
        for t in resp.topics:
            for p in t.partitions:
                self._check(p.error_code, "offset fetch")
                out[TopicPartition(t.name, p.partition)] = (
                    None if p.offset < 0 else OffsetAndMetadata(p.offset, p.metadata)
                )
        return out

    # ---- membership ---------------------------------------------------------------------
    def subscribe(
        self,
        topics: Iterable[str],
        listener: RebalanceListener | None,
        filter_: Filter | None = None,
    ) -> None:
        self.topics = tuple(sorted(set(topics)))
        self.listener = listener
        self.filter = filter_
        self._need_join.set()

    def polled(self) -> None:
        self._polled.set()

    @property
    def cooperative(self) -> bool:
        return self.config.partition_assignment_strategy[0] in COOPERATIVE

    async def run(self) -> None:
        """The membership loop (a named task under the consumer's supervisor)."""
        cfg = self.config
        heartbeat_s = min(cfg.heartbeat_interval_ms, cfg.session_timeout_ms // 3) / 1000
        loop = asyncio.get_running_loop()
        next_commit = loop.time() + cfg.auto_commit_interval_ms / 1000
        self._polled.set()
        last_poll = loop.time()
        while True:
            if self._polled.is_set():
                self._polled.clear()
                last_poll = loop.time()
            if loop.time() - last_poll > cfg.max_poll_interval_ms / 1000 and self.member_id:
                log.warning(
                    "group %s: no poll for max.poll.interval.ms (%d ms): leaving the group",
                    self.group_id,
                    cfg.max_poll_interval_ms,
                )
                await self._lose_all()
                await self.leave()
                await self._polled.wait()
                continue
            if self._need_join.is_set():
                self._joining = True
                try:
                    await self._join_and_sync()
                except FencedInstanceIdError:
                    raise
                except InconsistentFilterError as exc:
                    # not a member, and joining again cannot change that: the application
                    # gets the error from its next poll, and the loop ends
                    log.warning("group %s: %s", self.group_id, exc)
                    self.refused = exc
                    await self._lose_all()
                    await self.leave()
                    self.consumer.wake_pollers()
                    return
                except StrataError as exc:
                    log.info("group %s: join failed: %s", self.group_id, exc)
                    await asyncio.sleep(cfg.retry_backoff_ms / 1000)
                finally:
                    self._joining = False
                continue
            if cfg.enable_auto_commit and loop.time() >= next_commit:
                next_commit = loop.time() + cfg.auto_commit_interval_ms / 1000
                with contextlib.suppress(StrataError):
                    await self.commit_positions()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(heartbeat_s):
                    await self._need_join.wait()
            if self._need_join.is_set():
                continue
            await self._heartbeat()

    async def _heartbeat(self) -> None:
        try:
            resp: m.HeartbeatResponse = await self._send(
                m.HeartbeatRequest(
                    self.group_id, self.generation, self.member_id, self.config.group_instance_id
                ),
                request_timeout=self.config.session_timeout_ms / 1000,
            )
            self._check(resp.error_code, "heartbeat")
        except RebalanceInProgressError:
            self._need_join.set()
        except (IllegalGenerationError, UnknownMemberIdError) as exc:
            await self._lose_all()
            if isinstance(exc, UnknownMemberIdError):
                self.member_id = ""
            self.generation = m.NO_GENERATION
            self._need_join.set()
        except FencedInstanceIdError:
            raise
        except StrataError as exc:
            log.info("group %s: heartbeat failed: %s", self.group_id, exc)
            self.coordinator = None

    async def commit_positions(self) -> None:
        positions = self.consumer.positions_to_commit()
        if positions:
            await self.commit({tp: OffsetAndMetadata(o) for tp, o in positions.items()})

    async def _revoke(self, revoked: set[TopicPartition]) -> None:
        if not revoked:
            return
        if self.config.enable_auto_commit:
            with contextlib.suppress(StrataError):
                await self.commit_positions()
        if self.listener is not None:
            await _call(getattr(self.listener, "on_partitions_revoked", None), set(revoked))
        self.owned -= revoked
        self.consumer.group_assignment(self.owned, {})

    async def _lose_all(self) -> None:
        lost = set(self.owned)
        if not lost:
            return
        self.owned.clear()
        self.consumer.group_assignment(set(), {})
        if self.listener is not None:
            fn = getattr(self.listener, "on_partitions_lost", None) or getattr(
                self.listener, "on_partitions_revoked", None
            )
            await _call(fn, lost)

    def _subscription(self) -> bytes:
        owned: dict[str, list[int]] = {}
        for tp in sorted(self.owned):
            owned.setdefault(tp.topic, []).append(tp.partition)
        sub = cp.ConsumerSubscription(
            list(self.topics),
            [cp.TopicPartitions(t, ps) for t, ps in owned.items()],
            self.generation,
        )
        return cp.encode(sub)

    async def _join_and_sync(self) -> None:
        cfg = self.config
        self._need_join.clear()
        if not self.cooperative:
            await self._revoke(set(self.owned))
        meta = self._subscription()
        rebalance_s = cfg.max_poll_interval_ms / 1000
        join: m.JoinGroupResponse = await self._send(
            m.JoinGroupRequest(
                self.group_id,
                cfg.session_timeout_ms,
                cfg.max_poll_interval_ms,
                self.member_id,
                cfg.group_instance_id,
                m.CONSUMER_PROTOCOL_TYPE,
                [m.JoinGroupProtocol(name, meta) for name in cfg.partition_assignment_strategy],
                None if self.filter is None else self.filter.text,
            ),
            request_timeout=rebalance_s + cfg.request_timeout_ms / 1000,
        )
        if join.error_code == UnknownMemberIdError.code:
            await self._lose_all()
            self.member_id, self.generation = "", m.NO_GENERATION
        if join.error_code == InconsistentFilterError.code:
            mine = "no filter" if self.filter is None else f"filter {self.filter.text!r}"
            raise InconsistentFilterError(
                f"group {self.group_id!r} refused this consumer: its members subscribe with"
                f" another filter than this consumer's {mine} (a group has one subscription)"
            )
        if join.error_code:
            self._need_join.set()
            self._check(join.error_code, "join")
        self.member_id = join.member_id
        assignments: list[m.SyncGroupAssignment] = []
        counts: dict[str, int] = {}
        left_out: set[str] = set()
        beats = asyncio.create_task(
            self._beat_until_synced(join.generation_id), name="group-heartbeat-until-synced"
        )
        try:
            if join.leader == join.member_id and join.members:
                assignments, counts, left_out = await self._assign(join)
            sync: m.SyncGroupResponse = await self._send(
                m.SyncGroupRequest(
                    self.group_id,
                    join.generation_id,
                    self.member_id,
                    cfg.group_instance_id,
                    assignments,
                ),
                request_timeout=rebalance_s + cfg.request_timeout_ms / 1000,
            )
        finally:
            beats.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beats
        if sync.error_code:
            self._need_join.set()
            self._check(sync.error_code, "sync")
        new: set[TopicPartition] = set()
        if sync.assignment:
            got = cp.ConsumerAssignment.decode(sync.assignment)
            new = {TopicPartition(tp.topic, p) for tp in got.partitions for p in tp.partitions}
        revoked = self.owned - new
        if revoked:
            # the group is in the new generation now: commits made while revoking (auto-commit,
            # on_partitions_revoked) speak for it, or the coordinator would refuse them; no one
            # else owns the revoked partitions in it. ``generation`` (what records are handed
            # out under) moves on only once they are gone from the assignment.
            self._revoking_in = join.generation_id
            try:
                await self._revoke(revoked)
            finally:
                self._revoking_in = None
            self._need_join.set()  # cooperative: their new owners get them next generation
        added = new - self.owned
        for topic in self.topics:
            if topic not in counts and (n := self.cluster.partition_count(topic)) is not None:
                counts[topic] = n
        self._assigned_counts = counts
        self._left_out = left_out
        self.generation = join.generation_id
        self.protocol = join.protocol_name
        self.rebalances += 1
        positions: dict[TopicPartition, int] = {}
        if added:
            for tp, om in (await self.committed(added)).items():
                if om is not None:
                    positions[tp] = om.offset
        self.owned = set(new)
        self.consumer.group_assignment(self.owned, positions)
        log.info(
            "group %s: generation %d, member %s, %d partitions (+%d -%d)",
            self.group_id,
            self.generation,
            self.member_id,
            len(new),
            len(added),
            len(revoked),
        )
        if added and self.listener is not None:
            await _call(getattr(self.listener, "on_partitions_assigned", None), set(added))

    async def _beat_until_synced(self, generation: int) -> None:
        """Heartbeats between the JoinGroup's answer and the SyncGroup's, as Kafka's client
        sends them: the coordinator keeps a member alive while its SyncGroup waits there, but
        not a leader still making the assignment. The SyncGroup's answer says how it ended."""
        cfg = self.config
        interval = min(cfg.heartbeat_interval_ms, cfg.session_timeout_ms // 3) / 1000
        while True:
            await asyncio.sleep(interval)
            with contextlib.suppress(StrataError):
                await self._send(
                    m.HeartbeatRequest(
                        self.group_id, generation, self.member_id, cfg.group_instance_id
                    ),
                    request_timeout=cfg.session_timeout_ms / 1000,
                )

    async def _assign(
        self, join: m.JoinGroupResponse
    ) -> tuple[list[m.SyncGroupAssignment], dict[str, int], set[str]]:
        """The leader's assignment, the partition counts it was made with, and the subscribed
        topics it left out."""
        members: dict[str, Subscription] = {}
        for member in join.members:
            sub = cp.ConsumerSubscription.decode(member.metadata)
            members[member.member_id] = Subscription(
                tuple(sub.topics),
                frozenset(
                    TopicPartition(tp.topic, p)
                    for tp in sub.owned_partitions
                    for p in tp.partitions
                ),
                sub.generation,
            )
        topics = sorted({t for s in members.values() for t in s.topics})
        counts: dict[str, int] = {}
        # every member waits on the leader: a topic not in the metadata soon is left out of
        # this generation (its appearance in the leader's metadata makes it join again)
        max_wait = self.config.session_timeout_ms / 1000 / 3
        for topic in topics:
            with contextlib.suppress(StrataError):
                counts[topic] = await self.cluster.wait_for_topic(topic, max_wait)
        result = assign(join.protocol_name or "range", members, counts)
        out = []
        for member_id, tps in result.items():
            by_topic: dict[str, list[int]] = {}
            for tp in tps:
                by_topic.setdefault(tp.topic, []).append(tp.partition)
            payload = cp.ConsumerAssignment(
                [cp.TopicPartitions(t, ps) for t, ps in by_topic.items()]
            )
            out.append(m.SyncGroupAssignment(member_id, cp.encode(payload)))
        return out, counts, set(topics) - counts.keys()

    async def leave(self) -> None:
        """Leave the group (static members do not: their place waits for them)."""
        member_id = self.member_id
        self.member_id, self.generation = "", m.NO_GENERATION
        self._need_join.set()
        if not member_id or self.config.group_instance_id is not None:
            return
        with contextlib.suppress(StrataError):
            resp: m.LeaveGroupResponse = await self._send(
                m.LeaveGroupRequest(self.group_id, member_id, None), request_timeout=5.0
            )
            if resp.error_code and resp.error_code != UnknownMemberIdError.code:
                log.info("group %s: leave answered %d", self.group_id, resp.error_code)

    async def close(self) -> None:
        """Commit (if auto-commit), revoke and leave: the clean way out of the group."""
        if self.topics and self.member_id:
            with contextlib.suppress(StrataError):
                await self._revoke(set(self.owned))
            await self.leave()
