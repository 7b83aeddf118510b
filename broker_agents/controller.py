"""The controller: one agent, elected through ZooKeeper, that assigns partitions and moves
leadership when agents come and go.

Election: the candidate bumps ``/controller_epoch`` (compare-and-set) and creates the
ephemeral ``/controller`` node; whoever creates it is the controller until its session ends.
The others watch the node and try again when it disappears. The controller epoch is written
into every partition state it produces, so states from a deposed controller are recognisable.

While in charge, the controller reconciles on every change of ``/agents`` or ``/topics``
(and once a second as a safety net):

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

Every write is a compare-and-set on the znode version; losing a race means re-reading on the
next pass. A controller whose ZooKeeper session is suspended stops reconciling.

A pass costs few ZooKeeper round trips however many partitions there are: a topic's states
are read pipelined; the partitions without one get theirs in transactions of many
(``MetadataStore.create_partition_states``); and the decisions for the others (fencing,
draining, reassignment, election) are made first and their compare-and-set writes then sent
together, ``WRITES_IN_FLIGHT`` at a time. 10,000 partitions are placed, or re-elected after
their agent restarted, in a second or two rather than one round trip after another.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from storage.errors import MetadataError
from storage.metadata import (
    AsyncZooKeeper,
    MetadataStore,
    PartitionState,
    SessionState,
    TopicSpec,
)
from storage.metadata.reassignment import Event as ReassignmentEvent
from storage.metadata.reassignment import next_phase, phase_of
from storage.metadata.store import CONTROLLER

if TYPE_CHECKING:
    from broker_agents.deletion import TopicDeleter
    from broker_agents.rebalancer import Rebalancer
    from broker_agents.view import ClusterView

log = logging.getLogger(__name__)

WRITES_IN_FLIGHT = 256
"""Partition-state compare-and-sets a reconcile pass has outstanding at once."""


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

    def poke(self) -> None:
        self._wake.set()
        if self.deleter is not None:
            self.deleter.poke()

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
        while zk.state == SessionState.CONNECTED:
            controller = await self._still_controller()
            if not controller:
                return
            try:
                await self.reconcile()
            except MetadataError as exc:
                log.warning("reconcile failed (will retry): %s", exc)
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), 1.0)

    async def _still_controller(self) -> bool:
        try:
            info = await self.store.get_controller()
        except MetadataError:
            return False
        return info is not None and info.agent_id == self.agent_id and info.epoch == self.epoch

    async def reconcile(self) -> None:
        store = self.store
        live = sorted(self.view.agents)
        if not live:
            return
        leaving = {a for a, reg in self.view.agents.items() if reg.shutting_down}
        placeable = [a for a in live if a not in leaving] or live
        # replicas whose agent cannot open their log count as dead for that partition only
        offline: dict[tuple[str, int], set[int]] = {}
        for agent_id, reg in self.view.agents.items():
            for key in reg.offline:
                offline.setdefault(key, set()).add(agent_id)
        deleting = set()
        writes: list[_Write] = []
        seen: dict[tuple[str, int], tuple[PartitionState, int]] = {}
        replication: dict[str, int] = {}
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
            states = await store.partition_states(name)
            replication[name] = spec.replication_factor
            start = zlib.crc32(name.encode())
            missing: dict[int, PartitionState] = {}
            for p in range(spec.partitions):
                current = states.get(p)
                if current is None:
                    missing[p] = self._first_state(p, spec, placeable, start)
                    continue
                seen[(name, p)] = current
                usable = live
                if (name, p) in offline:
                    usable = [a for a in live if a not in offline[(name, p)]]
                state, version = current
                write = self._fence_restarted(name, p, state, version, usable)
                if write is None and leaving:
                    write = self._drain(name, p, state, version, leaving, usable)
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
                if write is not None:
                    writes.append(write)
            if missing:
                await self._create(name, missing)
        await self._write(writes)
        if self.deleter is not None:
            self.deleter.track(deleting)
        if self.rebalancer is not None:
            await self.rebalancer.step(seen, replication, live, leaving, self.epoch or 0)

    def _incarnations(self) -> dict[int, str]:
        return {a: reg.incarnation for a, reg in self.view.agents.items()}

    async def _write(self, writes: list[_Write]) -> None:
        """Compare-and-set every write, ``WRITES_IN_FLIGHT`` at a time (pipelined on the one
        session); each is logged, a lost race included (the next pass re-reads)."""
        slots = asyncio.Semaphore(WRITES_IN_FLIGHT)

        async def one(w: _Write) -> None:
            async with slots:
                try:
                    await self.store.cas_partition_state(w.name, w.p, w.new, w.version)
                except MetadataError as exc:
                    log.info("%s-%d: %s lost a race (%s); will re-read", w.name, w.p, w.what, exc)
                    return
            log.info(*w.done)

        await asyncio.gather(*(one(w) for w in writes))

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

    async def _create(self, name: str, states: dict[int, PartitionState]) -> None:
        """Write the first states of ``name``'s partitions ``states`` in bulk. A chunk that
        fails (a racing controller made one of its states, or the topic was deleted
        meanwhile) writes nothing; the next pass sees what is there."""
        created, failed = await self.store.create_partition_states(name, states)
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
