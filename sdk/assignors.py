"""Partition assignors: who in a group reads which partition (pure functions, no I/O).

The group leader (a consumer) runs the assignor the group agreed on, as in Kafka; the
coordinator only carries the result. Every assignor takes each member's subscription (topics,
and the partitions it owns now with the generation it got them in) and the partition count of
every topic, and returns each member's partitions. No partition goes to two members.

* ``range`` (eager): per topic, members sorted by id each get a contiguous range; the first
  ``partitions % members`` get one more. Partition ``p`` of two co-partitioned topics lands on
  the same member.
* ``roundrobin`` (eager): every (topic, partition), sorted, dealt to the members in turn
  (skipping members not subscribed to the topic).
* ``cooperative-sticky`` (incremental, KIP-429): a balanced assignment that keeps as many
  owned partitions in place as balance allows; then every partition that would move from one
  member to another is left out of this generation's assignment. Its previous owner sees it
  gone and revokes it, rejoins at once, and the next rebalance gives it to its new owner. A
  partition therefore never has two owners in one generation, and partitions that do not move
  are consumed straight through the rebalance.

With an eager assignor the members give up everything before they rejoin (the SDK does this),
so ``owned`` is empty and the two-step dance is not needed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from sdk.records import TopicPartition


@dataclass(frozen=True, slots=True)
class Subscription:
    topics: tuple[str, ...]
    owned: frozenset[TopicPartition] = field(default_factory=frozenset)
    generation: int = -1


Assignment = dict[str, list[TopicPartition]]

EAGER = ("range", "roundrobin")
COOPERATIVE = ("cooperative-sticky",)
ASSIGNORS = EAGER + COOPERATIVE


def _subscribers(members: Mapping[str, Subscription], topic: str) -> list[str]:
    return sorted(mid for mid, sub in members.items() if topic in sub.topics)


def _topics(members: Mapping[str, Subscription], partitions: Mapping[str, int]) -> list[str]:
    return sorted({t for sub in members.values() for t in sub.topics if partitions.get(t)})


def range_assign(members: Mapping[str, Subscription], partitions: Mapping[str, int]) -> Assignment:
    out: Assignment = {mid: [] for mid in members}
    for topic in _topics(members, partitions):
        subs = _subscribers(members, topic)
        n = partitions[topic]
        per, extra = divmod(n, len(subs))
        start = 0
        for i, mid in enumerate(subs):
            count = per + (1 if i < extra else 0)
            out[mid].extend(TopicPartition(topic, p) for p in range(start, start + count))
            start += count
    return out


def roundrobin_assign(
    members: Mapping[str, Subscription], partitions: Mapping[str, int]
) -> Assignment:
    out: Assignment = {mid: [] for mid in members}
    order = sorted(members)
    turn = 0
    for topic in _topics(members, partitions):
        for p in range(partitions[topic]):
            for _ in range(len(order)):
                mid = order[turn % len(order)]
                turn += 1
                if topic in members[mid].topics:
                    out[mid].append(TopicPartition(topic, p))
                    break
    return out


def _owners(
    members: Mapping[str, Subscription], valid: set[TopicPartition]
) -> dict[TopicPartition, str]:
    """Who holds each partition now; a partition claimed twice (a zombie's stale claim) goes
    to the claim of the newest generation."""
    claims: dict[TopicPartition, tuple[int, str]] = {}
    for mid in sorted(members):
        sub = members[mid]
        for tp in sub.owned:
            if tp in valid and tp.topic in sub.topics:
                prev = claims.get(tp)
                if prev is None or sub.generation > prev[0]:
                    claims[tp] = (sub.generation, mid)
    return {tp: mid for tp, (_, mid) in claims.items()}


def sticky_assign(members: Mapping[str, Subscription], partitions: Mapping[str, int]) -> Assignment:
    """A balanced assignment that keeps owned partitions where balance allows (one step)."""
    every = [
        TopicPartition(t, p) for t in _topics(members, partitions) for p in range(partitions[t])
    ]
    order = sorted(members)
    out: Assignment = {mid: [] for mid in order}
    if not order:
        return out
    floor, extra = divmod(len(every), len(order))
    kept: dict[str, list[TopicPartition]] = {mid: [] for mid in order}
    for tp, mid in sorted(_owners(members, set(every)).items()):
        kept[mid].append(tp)
    taken: set[TopicPartition] = set()
    for mid in sorted(order, key=lambda x: (-len(kept[x]), x)):
        cap = floor + (1 if extra > 0 else 0)
        keep = kept[mid][:cap]
        if len(keep) == floor + 1:
            extra -= 1
        out[mid] = list(keep)
        taken.update(keep)
    for tp in every:
        if tp in taken:
            continue
        candidates = [mid for mid in order if tp.topic in members[mid].topics]
        if not candidates:
            continue
        best = min(candidates, key=lambda x: (len(out[x]), x))
        out[best].append(tp)
    for mid in order:
        out[mid].sort()
    return out


def cooperative_sticky_assign(
    members: Mapping[str, Subscription], partitions: Mapping[str, int]
) -> Assignment:
    target = sticky_assign(members, partitions)
    owner = _owners(members, {tp for tps in target.values() for tp in tps})
    return {mid: [tp for tp in tps if owner.get(tp, mid) == mid] for mid, tps in target.items()}


def assign(
    name: str, members: Mapping[str, Subscription], partitions: Mapping[str, int]
) -> Assignment:
    if name == "range":
        return range_assign(members, partitions)
    if name == "roundrobin":
        return roundrobin_assign(members, partitions)
    if name == "cooperative-sticky":
        return cooperative_sticky_assign(members, partitions)
    raise ValueError(f"unknown assignor {name!r}; known: {', '.join(ASSIGNORS)}")
