"""Moving replicas while in charge: balance, decommission, replacement, preferred leaders.

The controller calls :meth:`Rebalancer.step` at the end of each reconcile pass with the
partition states it read. The rebalancer decides whether balancing is wanted and, if so,
carries out :func:`storage.metadata.balance.plan` a few moves at a time:

* **When.** An operator's request (``/admin/rebalance``, ``strata cluster rebalance``); a
  decommissioned agent that still holds replicas (``strata agents decommission``); an agent
  dead for longer than ``agent.replace.after.ms`` that still holds replicas (replacement; off
  by default); and, with ``auto.rebalance.enable``, any imbalance once the set of live agents
  has been stable for ``auto.rebalance.delay.ms`` (so that agents joining one after another
  cause one plan, not one each).
* **How.** A move that changes the replica set is a reassignment
  (``MetadataStore.request_reassignment``): the new replicas are added, catch up (from the
  leader; for a tiered topic only what is not in the bucket yet, since a new replica opens its
  log where the tier ends), join the ISR, and only then does the controller drop the old ones
  and hand leadership to the first replica. At most ``rebalance.max.concurrent.moves``
  partitions are moving at once, which bounds the extra replication traffic. A move that only
  reorders the replicas is a preferred-leader election: no data moves.
* **Preferred leaders.** On request (``/admin/preferred_leaders``) the leader of every
  partition asked for moves to its first replica when that one is alive and in the ISR.

Dead agents are timed from when this controller first saw them missing: a controller that
takes over starts the clock again (a replacement then comes later, never earlier).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from storage.errors import MetadataError
from storage.metadata import MetadataStore, PartitionState
from storage.metadata.balance import Key, Move, plan
from storage.metadata.requests import ControllerRequests

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RebalanceSettings:
    auto: bool = False
    delay_ms: int = 10_000
    max_moves: int = 8
    replace_after_ms: int = -1  # off


class Rebalancer:
    def __init__(
        self,
        store: MetadataStore,
        settings: RebalanceSettings,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.requests = ControllerRequests(store.zk)
        self.settings = settings
        self.clock = clock
        self._dead_since: dict[int, float] = {}
        self._live: frozenset[int] = frozenset()
        self._live_since = clock()
        self.moves_started = 0

    async def step(
        self,
        states: Mapping[Key, tuple[PartitionState, int]],
        replication: Mapping[str, int],
        live: list[int],
        leaving: set[int],
        epoch: int,
    ) -> None:
        now = self.clock()
        if frozenset(live) != self._live:
            self._live, self._live_since = frozenset(live), now
        holders = {r for s, _ in states.values() for r in s.replicas}
        for a in holders - set(live):
            self._dead_since.setdefault(a, now)
        for a in list(self._dead_since):
            if a in live or a not in holders:
                del self._dead_since[a]
        await self._preferred_leaders(states, set(live), epoch)
        decommissioned = await self.requests.decommissioned()
        s = self.settings
        replaced = {
            a
            for a, since in self._dead_since.items()
            if s.replace_after_ms >= 0 and (now - since) * 1000 >= s.replace_after_ms
        }
        requested = await self.requests.rebalance_requested()
        must = (decommissioned | replaced) & holders
        stable = (now - self._live_since) * 1000 >= s.delay_ms
        if not (must or requested or (s.auto and stable)):
            return
        eligible = [a for a in live if a not in decommissioned and a not in leaving]
        retained = (holders - set(eligible)) - decommissioned - replaced
        current = {k: st for k, (st, _) in states.items()}
        the_plan = plan(current, replication, eligible, retained)
        if not the_plan.moves:
            if requested:
                await self.requests.rebalance_done()
            return
        moving = sum(1 for st in current.values() if st.adding or st.removing)
        budget = max(0, s.max_moves - moving)
        for move in the_plan.moves:
            if budget <= 0:
                break
            if move.reorder_only:
                await self._reorder(move, states[(move.topic, move.partition)], set(live), epoch)
            else:
                await self._reassign(move)
                budget -= 1

    async def _reassign(self, move: Move) -> None:
        try:
            await self.store.request_reassignment(move.topic, move.partition, list(move.after))
            self.moves_started += 1
            log.info("%s-%d: moving %s -> %s", move.topic, move.partition, move.before, move.after)
        except MetadataError as exc:
            log.info("%s-%d: move not started (%s)", move.topic, move.partition, exc)

    async def _reorder(
        self, move: Move, current: tuple[PartitionState, int], live: set[int], epoch: int
    ) -> None:
        state, version = current
        first = move.after[0]
        update: dict[str, object] = {"replicas": list(move.after), "controller_epoch": epoch}
        if state.leader != first and first in state.isr and first in live:
            update["leader"] = first
            update["leader_epoch"] = state.leader_epoch + 1
        try:
            await self.store.cas_partition_state(
                move.topic, move.partition, state.model_copy(update=update), version
            )
        except MetadataError as exc:
            log.info("%s-%d: reorder lost a race (%s)", move.topic, move.partition, exc)

    async def _preferred_leaders(
        self, states: Mapping[Key, tuple[PartitionState, int]], live: set[int], epoch: int
    ) -> None:
        pending = await self.requests.preferred_leaders_requested()
        if pending is None:
            return
        topics, version = pending
        for (topic, p), (state, v) in sorted(states.items()):
            if topics is not None and topic not in topics:
                continue
            if not state.replicas or state.adding or state.removing:
                continue
            first = state.replicas[0]
            if state.leader == first or first not in state.isr or first not in live:
                continue
            new = state.model_copy(
                update={
                    "leader": first,
                    "leader_epoch": state.leader_epoch + 1,
                    "controller_epoch": epoch,
                }
            )
            try:
                await self.store.cas_partition_state(topic, p, new, v)
                log.info("%s-%d: preferred leader %d -> %d", topic, p, state.leader, first)
            except MetadataError as exc:
                log.info("%s-%d: preferred election lost a race (%s)", topic, p, exc)
        await self.requests.preferred_leaders_done(version)
