"""The controller: one agent, elected through ZooKeeper, that assigns partitions and moves
leadership when agents come and go.

Election: the candidate bumps ``/controller_epoch`` (compare-and-set) and creates the
ephemeral ``/controller`` node; whoever creates it is the controller until its session ends.
The others watch the node and try again when it disappears. The controller epoch is written
into every partition state it produces, so states from a deposed controller are recognisable.

While in charge, the controller decides what each partition needs (below) in passes; when
nothing changes it reads no partition state, so an idle cluster costs it the same at 10 or
10,000 partitions. What triggers a pass:

* a **full pass** (every topic's states read, every partition decided): taking charge; a
  change of ``/agents`` (a registration or death, an agent's incarnation, its offline list,
  its ``shutting_down`` flag) or of ``/topics`` or a topic's spec (created, more partitions,
  marked for deletion), through ``poke``; a pass that failed, or a bulk creation that lost a
  race; and, as the **safety net** for an event lost on the way, ``SAFETY_NET_INTERVAL``
  (30 s) after the last full pass. A full pass decodes only the states whose bytes changed
  since it last read them, and gives the event loop a turn every ``YIELD_EVERY`` partitions;
* a **pass over what changed**: the partitions whose state a watch saw at another version
  than the one the controller knows (``state_changed``, called by the agent's state watches:
  a leader's ISR change, which may let a reassignment finish or name a dead replica; an
  operator's reassignment; a write of another controller; a compare-and-set this one lost),
  read again; and those it wrote itself, decided once more from what it wrote (a fencing may
  be followed by an election, as the next once-a-second pass used to do);
* every ``TICK`` (1 s) the loop checks it is still the controller and gives the rebalancer its
  step (which polls its request nodes), with the states as last read or written.

What a pass decides for a partition:

* a partition without a state node gets a replica set of ``min(replication_factor, live
  agents)`` distinct agents, placed round-robin from a per-topic starting point so leaders
  and replicas spread evenly, and its first replica as leader with epoch 0;
* a partition whose leader is not alive gets a new leader from its in-sync replicas that are
  alive (epoch + 1). With none alive it goes offline (leader -1), unless the topic enables
  ``unclean.leader.election.enable``, which takes any live replica. (The ISR is the replica
  set until replication tracking lands; see the replication issue.)
* an offline partition whose replica comes back gets it as leader (epoch + 1);
* an agent that cannot open a partition's local log (a quarantined segment, a disk error)
  lists it as *offline* in its registration (``/agents/<id>``); for that partition the
  controller treats the agent as dead: it loses leadership to another in-sync replica and
  leaves the ISR (Kafka's offline replicas). It is a replica again once it opens the log.

* a reassignment in progress (``adding``/``removing``) completes once every added replica is
  in the ISR: the removed ones go, and leadership goes to the first replica (the preferred
  leader) if it is in sync; ``broker_agents.rebalancer`` starts such moves (balancing,
  decommission, replacement) at the end of each pass;
* a topic marked for deletion is left out of all of the above; while in charge the
  controller runs its delete, step by step (``broker_agents.deletion``: a task under the
  controller's term, so the next controller resumes it where this one stopped).

Every write is a compare-and-set on the znode version; losing a race means re-reading that
partition on the next pass. A controller whose ZooKeeper session is suspended stops reconciling.

A pass costs few ZooKeeper round trips however many partitions there are: a topic's states
are read pipelined; the partitions without one get theirs in transactions of many
(``MetadataStore.create_partition_states``); and the decisions for the others (fencing,
draining, reassignment, election) are made first and their compare-and-set writes then sent
together, in transactions of many (``MetadataStore.cas_partition_states``; a transaction that
loses a race is retried write by write). 10,000 partitions are placed, or re-elected after
their agent restarted, in a few round trips rather than one after another.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from storage.errors import InvalidConfigError, MetadataError
from storage.metadata import (
    AsyncZooKeeper,
    MetadataStore,
    PartitionState,
    SessionState,
    TopicSpec,
)
from storage.metadata.models import load
from storage.metadata.reassignment import Event as ReassignmentEvent
from storage.metadata.reassignment import next_phase, phase_of
from storage.metadata.store import CONTROLLER

if TYPE_CHECKING:
    from broker_agents.deletion import TopicDeleter
    from broker_agents.rebalancer import Rebalancer
    from broker_agents.view import ClusterView

log = logging.getLogger(__name__)

TICK = 1.0
"""Seconds between two turns of the loop when nothing wakes it (the rebalancer's step, and
a look at whether this agent is still the controller)."""
SAFETY_NET_INTERVAL = 30.0
"""Seconds between two full passes when no event asks for one."""
YIELD_EVERY = 1024
"""Partitions a full pass decides between two turns it gives the event loop."""

Key = tuple[str, int]


@dataclass(frozen=True, slots=True)
class _Context:
    """What a pass decides against: the live agents, those shutting down, those a new
    partition may be placed on, and the replicas that cannot open their log."""

    live: list[int]
    leaving: set[int]
    placeable: list[int]
    offline: dict[Key, set[int]]


@dataclass(frozen=True, slots=True)
class _Write:
    """A partition state change decided by a pass: ``new`` over znode ``version``; logged as
    ``done`` (a format and its arguments) once written, as ``what`` lost a race if not."""

    name: str
    p: int
    new: PartitionState
    version: int
    what: str
    done: tuple[Any, ...]


class Controller:
    def __init__(
        self,
        agent_id: int,
        zk: AsyncZooKeeper,
        store: MetadataStore,
        view: ClusterView,
        deleter: TopicDeleter | None = None,
        rebalancer: Rebalancer | None = None,
        *,
        safety_net_interval: float = SAFETY_NET_INTERVAL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.agent_id = agent_id
        self.zk = zk
        self.store = store
        self.view = view
        self.deleter = deleter
        self.rebalancer = rebalancer
        self.epoch: int | None = None
        self._wake = asyncio.Event()
        self.elections_won = 0
        self.safety_net_interval = safety_net_interval
        self.clock = clock
        #: every partition state of the topics not being deleted, with its znode version, as
        #: last read or written; what the rebalancer is handed each turn
        self._known: dict[Key, tuple[PartitionState, int]] = {}
        #: the bytes each state was decoded from: a node read again unchanged is not decoded
        self._decoded: dict[Key, tuple[bytes, PartitionState]] = {}
        # states that do not parse, by the bytes last seen: logged once, left alone until fixed
        self._unreadable: dict[Key, bytes] = {}
        self._replication: dict[str, int] = {}
        #: partitions a watch saw at another version than ``_known``'s: read and decided
        self._dirty: set[Key] = set()
        #: partitions this controller wrote: decided again (from ``_known``) on the next turn
        self._recheck: set[Key] = set()
        self._full_due = True
        self._last_full = float("-inf")
        self.full_passes = 0
        self.partial_passes = 0

    def poke(self) -> None:
        """Something cluster-wide changed (agents, topics, a spec): a full pass is due."""
        self._full_due = True
        self._wake.set()
        if self.deleter is not None:
            self.deleter.poke()

    def state_changed(self, key: Key, version: int | None) -> None:
        """A watch saw partition ``key``'s state node at ``version`` (None: gone). Unless that
        is the version this controller already knows, the next pass reads and decides it."""
        if self.epoch is None:
            return
        known = self._known.get(key)
        if known is not None and known[1] == version:
            return
        self._dirty.add(key)
        self._wake.set()

    async def run(self) -> None:
        zk = self.zk
        while True:
            await zk.connected.wait()
            try:
                info = await self.store.try_become_controller(self.agent_id)
            except MetadataError as exc:
                log.warning("controller election failed: %s", exc)
                await asyncio.sleep(0.2)
                continue
            if info is None:
                await self._wait_for_vacancy()
                continue
            self.epoch = info.epoch
            self.elections_won += 1
            log.info("agent %d is the controller (epoch %d)", self.agent_id, info.epoch)
            try:
                await self._lead()
            finally:
                self.epoch = None
                log.info("agent %d stopped acting as controller", self.agent_id)

    async def _wait_for_vacancy(self) -> None:
        gone = asyncio.Event()

        def on_change(data: bytes | None, stat: object) -> None:
            if data is None:
                gone.set()

        cancel = self.zk.watch_data(CONTROLLER, on_change)
        try:
            await gone.wait()
        finally:
            cancel()

    async def _lead(self) -> None:
        deleting = None
        if self.deleter is not None:
            deleting = asyncio.create_task(self.deleter.run(self.epoch or 0), name="topic-deleter")
        try:
            await self._reconcile_while_leading()
        finally:
            if deleting is not None:
                deleting.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await deleting

    async def _reconcile_while_leading(self) -> None:
        zk = self.zk
        self._full_due = True  # a new term starts from what ZooKeeper holds
        while zk.state == SessionState.CONNECTED:
            controller = await self._still_controller()
            if not controller:
                return
            self._wake.clear()
            try:
                await self._pass()
            except MetadataError as exc:
                self._full_due = True
                log.warning("reconcile failed (will retry): %s", exc)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(TICK):
                    await self._wake.wait()

    async def _still_controller(self) -> bool:
        try:
            info = await self.store.get_controller()
        except MetadataError:
            return False
        return info is not None and info.agent_id == self.agent_id and info.epoch == self.epoch

    async def _pass(self) -> None:
        """One turn of the loop: a full pass when one is due (poked, failed, or the safety net's
        time has come), else the partitions that changed; then the rebalancer's step."""
        if self._full_due or self.clock() - self._last_full >= self.safety_net_interval:
            await self.reconcile()
        elif self._dirty or self._recheck:
            await self._reconcile_changed()
        if self.rebalancer is not None and self.view.agents:
            live = sorted(self.view.agents)
            leaving = {a for a, reg in self.view.agents.items() if reg.shutting_down}
            await self.rebalancer.step(
                self._known, self._replication, live, leaving, self.epoch or 0
            )

    def _context(self) -> _Context | None:
        live = sorted(self.view.agents)
        if not live:
            return None
        leaving = {a for a, reg in self.view.agents.items() if reg.shutting_down}
        # replicas whose agent cannot open their log count as dead for that partition only
        offline: dict[Key, set[int]] = {}
        for agent_id, reg in self.view.agents.items():
            for key in reg.offline:
                offline.setdefault(key, set()).add(agent_id)
        return _Context(live, leaving, [a for a in live if a not in leaving] or live, offline)

    def _decode(self, key: Key, data: bytes) -> PartitionState | None:
        """``key``'s state from its node's bytes, decoded only if they changed since last read;
        None (logged once per content) if they do not parse. Such a partition is left as it is:
        no election or ISR change is decided from bytes nobody can read, and the rest of the
        cluster goes on (an operator rewrites the node; the next read decides it again)."""
        cached = self._decoded.get(key)
        if cached is not None and cached[0] == data:
            return cached[1]
        try:
            state: PartitionState = load(PartitionState, data)
        except InvalidConfigError as exc:
            if self._unreadable.get(key) != data:
                self._unreadable[key] = data
                log.error("unreadable state of %s-%d, left alone: %s", key[0], key[1], exc)
            self._decoded.pop(key, None)
            return None
        self._unreadable.pop(key, None)
        self._decoded[key] = (data, state)
        return state

    async def reconcile(self) -> None:
        """A full pass: every topic's states read from ZooKeeper (decoded only where their
        bytes changed) and every partition decided."""
        self._full_due = False  # a poke while this pass runs makes another
        self._last_full = self.clock()
        self.full_passes += 1
        ctx = self._context()
        if ctx is None:
            return
        started = time.perf_counter()
        store = self.store
        self._dirty.clear()  # everything is read now; what changes from here is noted again
        self._recheck.clear()
        deleting = set()
        writes: list[_Write] = []
        known: dict[Key, tuple[PartitionState, int]] = {}
        replication: dict[str, int] = {}
        decided = 0
        for name in await store.list_topics():
            try:
                spec, _ = await store.get_topic(name)
            except MetadataError:
                continue
            except Exception:  # UnknownTopicOrPartitionError: deleted meanwhile
                continue
            if spec.deletion is not None:
                deleting.add(name)  # its delete owns it: no states, no elections
                continue
            nodes = await store.partition_state_nodes(name)
            replication[name] = spec.replication_factor
            start = zlib.crc32(name.encode())
            missing: dict[int, PartitionState] = {}
            for p in range(spec.partitions):
                node = nodes.get(p)
                if node is None:
                    missing[p] = self._first_state(p, spec, ctx.placeable, start)
                    continue
                state = self._decode((name, p), node[0])
                if state is None:
                    continue
                known[(name, p)] = (state, node[1])
                write = self._decide(name, p, state, node[1], spec, ctx)
                if write is not None:
                    writes.append(write)
                decided += 1
                if decided % YIELD_EVERY == 0:
                    await asyncio.sleep(0)  # thousands of partitions: let the loop breathe
            if missing:
                known.update(await self._create(name, missing))
        self._known = known
        self._replication = replication
        for key in [k for k in self._decoded if k not in known]:
            del self._decoded[key]
        for key in [k for k in self._unreadable if k[0] not in replication]:
            del self._unreadable[key]
        decided_s = time.perf_counter() - started
        await self._write(writes)
        if writes:
            log.info(
                "full pass: %d partitions read and decided in %.2f s, %d written in %.2f s",
                decided,
                decided_s,
                len(writes),
                time.perf_counter() - started - decided_s,
            )
        if self.deleter is not None:
            self.deleter.track(deleting)

    async def _reconcile_changed(self) -> None:
        """A pass over the partitions whose state changed since the last (as watches reported;
        read again here) or that this controller wrote (decided again from what it wrote)."""
        self.partial_passes += 1
        ctx = self._context()
        if ctx is None:
            return
        dirty = sorted(self._dirty)
        recheck = self._recheck - self._dirty
        self._dirty, self._recheck = set(), set()
        try:
            nodes = await self.store.state_nodes(dirty)
        except MetadataError:
            self._dirty.update(dirty)
            raise
        specs: dict[str, TopicSpec | None] = {}
        decide: list[tuple[Key, TopicSpec]] = []
        for key, node in zip(dirty, nodes, strict=True):
            spec = await self._spec(key[0], specs)
            if spec is None or spec.deletion is not None or key[1] >= spec.partitions:
                self._known.pop(key, None)
                continue
            if node is None:
                self._full_due = True  # no state: the full pass makes one
                continue
            state = self._decode(key, node[0])
            if state is None:
                self._known.pop(key, None)
                continue
            self._known[key] = (state, node[1])
            self._replication[key[0]] = spec.replication_factor
            decide.append((key, spec))
        for key in sorted(recheck):
            spec = await self._spec(key[0], specs)
            if key in self._known and spec is not None and spec.deletion is None:
                decide.append((key, spec))
        writes = []
        for (name, p), spec in decide:
            state, version = self._known[(name, p)]
            write = self._decide(name, p, state, version, spec, ctx)
            if write is not None:
                writes.append(write)
        await self._write(writes)

    async def _spec(self, name: str, specs: dict[str, TopicSpec | None]) -> TopicSpec | None:
        if name not in specs:
            try:
                specs[name] = (await self.store.get_topic(name))[0]
            except MetadataError:
                raise
            except Exception:  # UnknownTopicOrPartitionError: deleted meanwhile
                specs[name] = None
        return specs[name]

    def _decide(
        self,
        name: str,
        p: int,
        state: PartitionState,
        version: int,
        spec: TopicSpec,
        ctx: _Context,
    ) -> _Write | None:
        """What partition ``name``-``p`` needs, if anything: fencing of restarted replicas, a
        controlled shutdown step, a reassignment step, or an election (in that order)."""
        usable = ctx.live
        if (name, p) in ctx.offline:
            usable = [a for a in ctx.live if a not in ctx.offline[(name, p)]]
        write = self._fence_restarted(name, p, state, version, usable)
        if write is None and ctx.leaving:
            write = self._drain(name, p, state, version, ctx.leaving, usable)
        if write is None:
            write = (
                self._advance_reassignment(name, p, state, version, usable)
                if state.adding or state.removing
                else self._maybe_elect(
                    name,
                    p,
                    state,
                    version,
                    usable,
                    spec.config.unclean_leader_election_enable,
                )
            )
        return write

    def _incarnations(self) -> dict[int, str]:
        return {a: reg.incarnation for a, reg in self.view.agents.items()}

    async def _write(self, writes: list[_Write]) -> None:
        """Compare-and-set every write, in ZooKeeper transactions of many
        (``MetadataStore.cas_partition_states``); each is logged, a lost race included (the
        next pass re-reads)."""
        if not writes:
            return
        outcomes = await self.store.cas_partition_states(
            [(w.name, w.p, w.new, w.version) for w in writes]
        )
        for w, outcome in zip(writes, outcomes, strict=True):
            if isinstance(outcome, MetadataError):
                log.info("%s-%d: %s lost a race (%s); will re-read", w.name, w.p, w.what, outcome)
                self._dirty.add((w.name, w.p))
                continue
            self._known[(w.name, w.p)] = (w.new, outcome)
            self._recheck.add((w.name, w.p))  # decided again on the next pass, as it was
            log.info(*w.done)

    def _fence_restarted(
        self, name: str, p: int, state: PartitionState, version: int, usable: list[int]
    ) -> _Write | None:
        """Take ISR members whose agent restarted since they were admitted out of the ISR
        (and out of leadership): the change, if any.

        A restarted agent may have lost what it had not fsynced (under a relaxed
        ``fsync.policy``, or a power loss), so it must catch up again before it counts: as
        Kafka treats a broker's new registration as an unclean restart. Leadership goes to an
        in-sync member that did not restart. When every in-sync member alive has restarted
        (all crashed at once; or the last replica standing), none knows more than the others:
        they stay in the ISR, stamped anew, under a new epoch, against which the others
        truncate."""
        current = self._incarnations()
        restarted = [r for r in state.isr if r in current and not state.in_sync_as(r, current[r])]
        if not restarted:
            return None
        kept = [r for r in state.isr if r not in restarted]
        alive_kept = [r for r in kept if r in usable]
        if alive_kept:
            leader = state.leader if state.leader in alive_kept else alive_kept[0]
            isr = kept
        else:
            # every in-sync member alive has restarted (all crashed at once): none knows more
            # than the others, so they stay in sync, stamped anew, under a new epoch
            isr = [r for r in restarted if r in usable]
            if not isr:
                return None  # nobody usable: the election below takes the partition offline
            leader = state.leader if state.leader in isr else isr[0]
        stamps = {r: current[r] if r in restarted else v for r, v in state.incarnations.items()}
        stamps.update({r: current[r] for r in isr if r in restarted})
        new = state.model_copy(
            update={
                "leader": leader,
                "leader_epoch": state.leader_epoch
                + (leader != state.leader or leader in restarted),
                "isr": isr,
                "incarnations": {r: v for r, v in stamps.items() if v and r in isr},
                "controller_epoch": self.epoch or 0,
            }
        )
        return _Write(
            name,
            p,
            new,
            version,
            "fencing restarted replicas",
            (
                "%s-%d: restarted agents %s leave the ISR; leader %d -> %d (epoch %d, ISR %s)",
                name,
                p,
                restarted,
                state.leader,
                leader,
                new.leader_epoch,
                isr,
            ),
        )

    def _drain(
        self,
        name: str,
        p: int,
        state: PartitionState,
        version: int,
        leaving: set[int],
        usable: list[int],
    ) -> _Write | None:
        """Controlled shutdown (Kafka's): move leadership off agents that are shutting down to
        another in-sync replica, and take them out of the ISR: the change, if any.
        A partition with no other in-sync replica alive keeps its leader until it is gone."""
        stay = [r for r in state.isr if r not in leaving and r in usable]
        if not stay or not any(r in leaving for r in state.isr):
            return None
        leader = state.leader if state.leader in stay else stay[0]
        new = state.model_copy(
            update={
                "leader": leader,
                "leader_epoch": state.leader_epoch + (leader != state.leader),
                "isr": [r for r in state.isr if r not in leaving],
                "incarnations": {r: v for r, v in state.incarnations.items() if r not in leaving},
                "controller_epoch": self.epoch or 0,
            }
        )
        return _Write(
            name,
            p,
            new,
            version,
            "controlled shutdown step",
            (
                "%s-%d: agents %s shutting down; leader %d -> %d (epoch %d, ISR %s)",
                name,
                p,
                sorted(leaving & set(state.isr)),
                state.leader,
                leader,
                new.leader_epoch,
                new.isr,
            ),
        )

    def _first_state(self, p: int, spec: TopicSpec, live: list[int], start: int) -> PartitionState:
        """Partition ``p``'s first state: ``min(replication_factor, live)`` replicas placed
        round-robin from the topic's ``start``, the first one leader at epoch 0."""
        n = len(live)
        count = min(spec.replication_factor, n)
        first = (start + p) % n
        replicas = [live[(first + j) % n] for j in range(count)]
        return PartitionState(
            leader=replicas[0],
            leader_epoch=0,
            replicas=replicas,
            isr=list(replicas),
            controller_epoch=self.epoch or 0,
            incarnations={r: c for r, c in self._incarnations().items() if r in replicas and c},
            topic_id=spec.topic_id,
        )

    async def _create(
        self, name: str, states: dict[int, PartitionState]
    ) -> dict[Key, tuple[PartitionState, int]]:
        """Write the first states of ``name``'s partitions ``states`` in bulk; returns those
        written (version 0), to be decided again on the next pass. A chunk that fails (a
        racing controller made one of its states, or the topic was deleted meanwhile) writes
        nothing; the next pass, a full one, sees what is there."""
        created, failed = await self.store.create_partition_states(name, states)
        if failed:
            self._full_due = True
        self._recheck.update((name, p) for p in created)
        if len(created) <= 8:
            for p in created:
                s = states[p]
                log.info("created %s-%d: leader %d, replicas %s", name, p, s.leader, s.replicas)
        elif created:
            log.info(
                "created %d partitions of %s (%d to %d)",
                len(created),
                name,
                min(created),
                max(created),
            )
        for ps, exc in failed:
            log.info(
                "%s: creating %d partition states failed (%s); will re-read", name, len(ps), exc
            )
        return {(name, p): (states[p], 0) for p in created}

    def _advance_reassignment(
        self, name: str, p: int, state: PartitionState, version: int, live: list[int]
    ) -> _Write | None:
        """Finish a reassignment once every added replica is in the ISR
        (``storage.metadata.reassignment``)."""
        if state.leader not in live:
            next_phase(phase_of(state), ReassignmentEvent.LEADER_LOST)
            return self._maybe_elect(name, p, state, version, live, False)
        if not all(r in state.isr for r in state.adding):
            return None  # still catching up
        next_phase(phase_of(state), ReassignmentEvent.CAUGHT_UP)
        replicas = [r for r in state.replicas if r not in state.removing]
        isr = [r for r in state.isr if r not in state.removing]
        update: dict[str, object] = {
            "replicas": replicas,
            "isr": isr,
            "incarnations": state.stamped(isr, self._incarnations()),
            "adding": [],
            "removing": [],
            "controller_epoch": self.epoch or 0,
        }
        preferred = replicas[0]
        if preferred != state.leader and preferred in isr and preferred in live:
            # the first replica is the preferred leader: a move hands leadership to it
            update["leader"] = preferred
            update["leader_epoch"] = state.leader_epoch + 1
        elif state.leader in state.removing:
            update["leader"] = next(r for r in replicas if r in isr)
            update["leader_epoch"] = state.leader_epoch + 1
        return _Write(
            name,
            p,
            state.model_copy(update=update),
            version,
            "reassignment step",
            (
                "%s-%d: reassigned to %s (leader %s)",
                name,
                p,
                replicas,
                update.get("leader", state.leader),
            ),
        )

    def _maybe_elect(
        self,
        name: str,
        p: int,
        state: PartitionState,
        version: int,
        live: list[int],
        unclean: bool,
    ) -> _Write | None:
        alive = set(live)
        if state.leader in alive:
            # a dead follower leaves the ISR at once (its leader would drop it only after
            # replica.lag.time.max.ms, holding back the high watermark meanwhile)
            isr = [r for r in state.isr if r in alive]
            if isr != state.isr and state.leader in isr:
                new = state.model_copy(
                    update={
                        "isr": isr,
                        "incarnations": state.stamped(isr, self._incarnations()),
                        "controller_epoch": self.epoch or 0,
                    }
                )
                return _Write(
                    name,
                    p,
                    new,
                    version,
                    "ISR change",
                    ("%s-%d: dead replicas leave the ISR %s -> %s", name, p, state.isr, isr),
                )
            return None
        candidates = [r for r in state.isr if r in alive]
        if not candidates and unclean:
            candidates = [r for r in state.replicas if r in alive]
        new_leader = candidates[0] if candidates else -1
        if new_leader == state.leader:
            return None
        isr = [r for r in state.isr if r in alive] or (
            [new_leader] if new_leader >= 0 else state.isr
        )
        if new_leader >= 0 and new_leader not in isr:
            isr = [new_leader]  # unclean election: only the new leader is known to be in sync
        new = state.model_copy(
            update={
                "leader": new_leader,
                "leader_epoch": state.leader_epoch + 1,
                "isr": isr,
                "incarnations": state.stamped(isr, self._incarnations()),
                "controller_epoch": self.epoch or 0,
            }
        )
        return _Write(
            name,
            p,
            new,
            version,
            "election",
            (
                "%s-%d: leader %d -> %d (epoch %d, ISR %s)",
                name,
                p,
                state.leader,
                new_leader,
                new.leader_epoch,
                isr,
            ),
        )
