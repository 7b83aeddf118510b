"""Replica placement plans: spread replicas and preferred leaders evenly over the agents.

A pure function of the cluster's partition states, used by the controller (which carries a
plan out a few moves at a time) and by the admin API (``GET /cluster/rebalance``: the same
plan as a dry run). The plan is greedy and moves as little as it can:

1. **Evacuate.** Replicas on agents that may not hold any (decommissioning, or dead longer
   than ``agent.replace.after.ms``) go to the eligible agent with the fewest replicas that the
   partition does not have yet. The same fills partitions created while fewer agents were
   alive than their replication factor.
2. **Even out replicas.** While the fullest eligible agent holds more than one replica above
   the emptiest, one replica moves from the fullest to the emptiest (a partition that has the
   first and not the second). Counts end within one of each other: ``floor(R/N)`` or
   ``ceil(R/N)`` for ``R`` replicas on ``N`` agents.
3. **Even out preferred leaders.** The first replica of a partition is its preferred leader.
   Reordering a partition's replicas moves no data, so while an agent is preferred for more
   than one partition above another that holds a replica of one of them, the two swap places.

A partition whose reassignment is in progress is planned as if it had finished (its target is
its replicas without ``removing``) and is never moved again until it has. The plan is
deterministic (sorted inputs, ties broken by agent id and partition), so the controller can
recompute it each pass and converge on the same target.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from storage.metadata.models import PartitionState

Key = tuple[str, int]


@dataclass(frozen=True, slots=True)
class Move:
    """One partition's replicas before and after (first replica: the preferred leader)."""

    topic: str
    partition: int
    before: tuple[int, ...]
    after: tuple[int, ...]

    @property
    def copies(self) -> tuple[int, ...]:
        """Agents that must copy the partition (new replicas)."""
        return tuple(a for a in self.after if a not in self.before)

    @property
    def reorder_only(self) -> bool:
        return set(self.before) == set(self.after)

    def to_json(self) -> dict[str, object]:
        return {
            "topic": self.topic,
            "partition": self.partition,
            "before": list(self.before),
            "after": list(self.after),
            "copies": list(self.copies),
        }


@dataclass
class Plan:
    moves: list[Move] = field(default_factory=list)
    #: per eligible agent after the plan: replicas and preferred leaderships
    replicas: dict[int, int] = field(default_factory=dict)
    leaders: dict[int, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, object]:
        return {
            "moves": [m.to_json() for m in self.moves],
            "replicas": {str(a): n for a, n in sorted(self.replicas.items())},
            "preferred_leaders": {str(a): n for a, n in sorted(self.leaders.items())},
        }


def target_of(state: PartitionState) -> list[int]:
    """A partition's replicas once its reassignment (if any) is done."""
    return [r for r in state.replicas if r not in state.removing]


def plan(
    states: Mapping[Key, PartitionState],
    replication: Mapping[str, int],
    eligible: Iterable[int],
    retained: Iterable[int] = (),
) -> Plan:
    """The moves that balance ``states`` over ``eligible`` agents (see the module docstring).

    ``replication`` is each topic's replication factor; partitions of topics not in it are
    left alone. Partitions being reassigned count at their target and are not moved.
    Replicas on ``retained`` agents (dead for less than the replacement time, or restarting)
    stay where they are, but those agents receive none and are not counted."""
    agents = sorted(set(eligible))
    keep = set(retained) - set(agents)
    out = Plan(replicas=dict.fromkeys(agents, 0), leaders=dict.fromkeys(agents, 0))
    if not agents:
        return out
    current = {k: target_of(s) for k, s in sorted(states.items()) if k[0] in replication}
    frozen = {k for k, s in states.items() if s.adding or s.removing}
    placed = {k: list(r) for k, r in current.items()}
    count = out.replicas
    for replicas in placed.values():
        for r in replicas:
            if r in count:
                count[r] += 1

    def emptiest(exclude: list[int]) -> int | None:
        free = [a for a in agents if a not in exclude]
        return min(free, key=lambda a: (count[a], a)) if free else None

    # 1. evacuate ineligible agents; fill under-replicated partitions
    for key, replicas in placed.items():
        if key in frozen:
            continue
        want = min(replication[key[0]], len(agents))
        for i, r in enumerate(list(replicas)):
            if r in count or r in keep:
                continue
            to = emptiest(replicas)
            if to is None:
                continue
            replicas[i] = to
            count[to] += 1
        while len(replicas) < want:
            to = emptiest(replicas)
            if to is None:
                break
            replicas.append(to)
            count[to] += 1
    # 2. even out replica counts
    movable = [k for k in placed if k not in frozen]
    while True:
        hi = max(agents, key=lambda a: (count[a], -a))
        lo = min(agents, key=lambda a: (count[a], a))
        if count[hi] - count[lo] <= 1:
            break
        found = next((k for k in movable if hi in placed[k] and lo not in placed[k]), None)
        if found is None:
            break
        replicas = placed[found]
        replicas[replicas.index(hi)] = lo
        count[hi] -= 1
        count[lo] += 1
    # 3. even out preferred leaders by reordering
    lead = out.leaders
    for replicas in placed.values():
        if replicas and replicas[0] in lead:
            lead[replicas[0]] += 1
    swapped = True
    while swapped:  # each swap lowers the sum of squared counts: this ends
        swapped = False
        for key in movable:
            replicas = placed[key]
            if len(replicas) < 2 or replicas[0] not in lead:
                continue
            first = replicas[0]
            other = min(
                (a for a in replicas[1:] if a in lead), key=lambda a: (lead[a], a), default=None
            )
            if other is None or lead[first] - lead[other] <= 1:
                continue
            replicas.remove(other)
            replicas.insert(0, other)
            lead[first] -= 1
            lead[other] += 1
            swapped = True
    for key, replicas in placed.items():
        if replicas != current[key]:
            out.moves.append(Move(key[0], key[1], tuple(current[key]), tuple(replicas)))
    return out
