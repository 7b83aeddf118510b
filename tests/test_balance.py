"""Replica placement plans (``storage.metadata.balance``): pure functions of partition states."""

from __future__ import annotations

import itertools

import pytest

from storage.metadata.balance import plan
from storage.metadata.models import PartitionState
from storage.metadata.reassignment import (
    TRANSITIONS,
    Event,
    IllegalTransitionError,
    Phase,
    next_phase,
    phase_of,
)

Key = tuple[str, int]


def _state(replicas: list[int], **kw: list[int]) -> PartitionState:
    return PartitionState(
        leader=replicas[0],
        leader_epoch=0,
        replicas=replicas,
        isr=list(replicas),
        controller_epoch=0,
        **kw,
    )


def _round_robin(
    topic: str, partitions: int, agents: list[int], rf: int
) -> dict[Key, PartitionState]:
    n = len(agents)
    return {
        (topic, p): _state([agents[(p + j) % n] for j in range(min(rf, n))])
        for p in range(partitions)
    }


def _apply(states: dict[Key, PartitionState], moves: list) -> dict[Key, PartitionState]:
    out = dict(states)
    for m in moves:
        out[(m.topic, m.partition)] = _state(list(m.after))
    return out


def _counts(states: dict[Key, PartitionState]) -> tuple[dict[int, int], dict[int, int]]:
    replicas: dict[int, int] = {}
    leaders: dict[int, int] = {}
    for s in states.values():
        for r in s.replicas:
            replicas[r] = replicas.get(r, 0) + 1
        leaders[s.replicas[0]] = leaders.get(s.replicas[0], 0) + 1
    return replicas, leaders


def test_two_new_agents_get_their_share_of_replicas_and_leaders() -> None:
    states = _round_robin("t", 24, [1, 2, 3], 3)
    p = plan(states, {"t": 3}, [1, 2, 3, 4, 5])
    after = _apply(states, p.moves)
    replicas, leaders = _counts(after)
    assert set(replicas) == {1, 2, 3, 4, 5}
    assert all(14 <= n <= 15 for n in replicas.values()), replicas
    assert all(4 <= n <= 5 for n in leaders.values()), leaders
    assert (replicas, leaders) == (p.replicas, p.leaders)
    for m in p.moves:  # every partition keeps its replication factor on distinct agents
        assert len(set(m.after)) == 3
    # 72 replicas, 5 agents: about 2/5 of them copied, not everything
    assert sum(len(m.copies) for m in p.moves) <= 30
    assert plan(after, {"t": 3}, [1, 2, 3, 4, 5]).moves == []  # balanced: nothing more


def test_a_decommissioned_agent_ends_with_nothing_and_others_stay_even() -> None:
    states = _round_robin("t", 20, [1, 2, 3, 4], 2)
    p = plan(states, {"t": 2}, [1, 2, 3])
    after = _apply(states, p.moves)
    replicas, leaders = _counts(after)
    assert 4 not in replicas and 4 not in leaders
    assert sorted(replicas.values()) in ([13, 13, 14], [13, 14, 13])
    # only partitions that held agent 4 changed their replica set
    for m in p.moves:
        if not m.reorder_only:
            assert 4 in m.before


def test_retained_agents_keep_their_replicas_and_get_no_new_ones() -> None:
    states = _round_robin("t", 12, [1, 2, 3], 3)
    p = plan(states, {"t": 3}, [1, 2], retained=[3])
    assert p.moves == []
    p = plan(states, {"t": 3}, [1, 2, 4], retained=[3])
    for m in p.moves:
        assert 3 in m.after  # not evacuated
    # a replaced (neither eligible nor retained) agent is evacuated to the new one
    p = plan(states, {"t": 3}, [1, 2, 4])
    after = _apply(states, p.moves)
    assert _counts(after)[0] == {1: 12, 2: 12, 4: 12}


def test_partitions_created_short_of_agents_are_filled_up() -> None:
    states = _round_robin("t", 6, [1], 3)
    p = plan(states, {"t": 3}, [1, 2, 3])
    after = _apply(states, p.moves)
    assert all(len(s.replicas) == 3 for s in after.values())
    assert _counts(after)[0] == {1: 6, 2: 6, 3: 6}


def test_moving_partitions_are_left_alone_and_counted_at_their_target() -> None:
    states = _round_robin("t", 6, [1, 2], 2)
    states[("t", 0)] = _state([3, 1, 2], adding=[3], removing=[2])
    p = plan(states, {"t": 2}, [1, 2, 3])
    assert all(m.partition != 0 for m in p.moves)
    after = _apply(states, p.moves)
    after[("t", 0)] = _state([3, 1])
    replicas, _ = _counts(after)
    assert max(replicas.values()) - min(replicas.values()) <= 1


def test_plans_are_deterministic_and_never_place_two_replicas_on_one_agent() -> None:
    for agents, partitions, rf in itertools.product(
        [[1, 2, 3], [5, 7, 9, 11]], [1, 7, 30], [1, 2, 3]
    ):
        states = _round_robin("a", partitions, agents[:2], rf)
        states.update(_round_robin("b", partitions, agents, rf))
        replication = {"a": rf, "b": rf}
        p1 = plan(states, replication, agents)
        p2 = plan(dict(reversed(list(states.items()))), replication, agents)
        assert p1.moves == p2.moves
        for m in p1.moves:
            assert len(set(m.after)) == len(m.after) == min(rf, len(agents))


@pytest.mark.parametrize(("phase", "event"), list(itertools.product(Phase, Event)))
def test_every_reassignment_phase_event_pair_is_a_transition_or_an_error(
    phase: Phase, event: Event
) -> None:
    if (phase, event) in TRANSITIONS:
        assert next_phase(phase, event) == TRANSITIONS[(phase, event)]
    else:
        with pytest.raises(IllegalTransitionError):
            next_phase(phase, event)


def test_only_catching_up_or_a_cancel_ends_a_move() -> None:
    assert {k for k, v in TRANSITIONS.items() if v == Phase.STABLE} == {
        (Phase.STABLE, Event.REORDER),
        (Phase.MOVING, Event.CAUGHT_UP),
        (Phase.MOVING, Event.CANCEL),
    }
    assert phase_of(_state([1, 2])) == Phase.STABLE
    assert phase_of(_state([3, 1, 2], adding=[3], removing=[2])) == Phase.MOVING
