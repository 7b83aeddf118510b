"""The group state machine and the assignors (pure; no servers)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from broker_agents.groups import Event, IllegalTransitionError, Phase, next_phase
from broker_agents.groups.coordinator import coordinator_for
from broker_agents.groups.state import TRANSITIONS
from sdk.assignors import ASSIGNORS, Subscription, assign, cooperative_sticky_assign
from sdk.records import TopicPartition


@pytest.mark.parametrize(("phase", "event"), list(itertools.product(Phase, Event)))
def test_every_phase_event_pair_is_a_transition_or_an_error(phase: Phase, event: Event) -> None:
    if (phase, event) in TRANSITIONS:
        assert next_phase(phase, event) == TRANSITIONS[(phase, event)]
    else:
        with pytest.raises(IllegalTransitionError):
            next_phase(phase, event)


def test_dead_is_final_and_only_leader_sync_reaches_stable() -> None:
    assert not [k for k in TRANSITIONS if k[0] == Phase.DEAD]
    assert {k for k, v in TRANSITIONS.items() if v == Phase.STABLE} == {
        (Phase.COMPLETING_REBALANCE, Event.LEADER_SYNCED)
    }


def test_coordinator_choice_is_deterministic_and_among_live_agents() -> None:
    assert coordinator_for("g", []) is None
    assert coordinator_for("g", [3, 1, 2]) == coordinator_for("g", [1, 2, 3]) in {1, 2, 3}


members_st = st.dictionaries(
    st.text("abcdef", min_size=1, max_size=4), st.just(("t", "u")), min_size=1, max_size=6
)


@given(members_st, st.integers(1, 30), st.integers(0, 5), st.sampled_from(ASSIGNORS))
def test_assignors_give_each_partition_to_at_most_one_member(
    members: dict[str, tuple[str, ...]], t: int, u: int, name: str
) -> None:
    subs = {mid: Subscription(topics) for mid, topics in members.items()}
    counts = {"t": t, "u": u}
    result = assign(name, subs, counts)
    every = [tp for tps in result.values() for tp in tps]
    assert len(every) == len(set(every)) == t + u  # nobody owns anything yet: all assigned
    sizes = [len(tps) for tps in result.values()]
    if name != "range":
        assert max(sizes) - min(sizes) <= 1


def test_cooperative_sticky_keeps_owned_partitions_and_withholds_moving_ones() -> None:
    owned_a = frozenset(TopicPartition("t", p) for p in range(6))
    subs = {"a": Subscription(("t",), owned_a, 1), "b": Subscription(("t",))}
    first = cooperative_sticky_assign(subs, {"t": 6})
    assert len(first["a"]) == 3 and set(first["a"]) <= owned_a  # kept three, gave up three
    assert first["b"] == []  # the moving ones wait for the next generation
    subs = {
        "a": Subscription(("t",), frozenset(first["a"]), 2),
        "b": Subscription(("t",), frozenset(), 2),
    }
    second = cooperative_sticky_assign(subs, {"t": 6})
    assert second["a"] == first["a"] and len(second["b"]) == 3
