"""The transaction state machines, walked pair by pair: the coordinator's
(``broker_agents.transactions.state``) and the producer's (``sdk.transactions``)."""

from __future__ import annotations

import itertools

import pytest

from broker_agents.transactions.coordinator import coordinator_key
from broker_agents.transactions.state import (
    IDLE,
    PREPARING,
    TRANSITIONS,
    Event,
    IllegalTransitionError,
    Phase,
    next_phase,
)
from sdk.errors import IllegalStateError
from sdk.transactions import TRANSITIONS as CLIENT
from sdk.transactions import TxnEvent, TxnState, next_state


@pytest.mark.parametrize(("phase", "event"), list(itertools.product(Phase, Event)))
def test_every_coordinator_pair_is_a_transition_or_an_error(phase: Phase, event: Event) -> None:
    if (phase, event) in TRANSITIONS:
        assert next_phase(phase, event) == TRANSITIONS[(phase, event)]
    else:
        with pytest.raises(IllegalTransitionError):
            next_phase(phase, event)


def test_coordinator_decisions_come_only_from_an_open_transaction() -> None:
    assert not [k for k in TRANSITIONS if k[0] == Phase.DEAD]
    # a commit can complete only through PREPARE_COMMIT, reached only from ONGOING
    into = {p: {k for k, v in TRANSITIONS.items() if v == p} for p in Phase}
    assert into[Phase.PREPARE_COMMIT] == {(Phase.ONGOING, Event.COMMIT)}
    assert into[Phase.COMPLETE_COMMIT] == {(Phase.PREPARE_COMMIT, Event.MARKERS_WRITTEN)}
    assert into[Phase.PREPARE_ABORT] == {(Phase.ONGOING, Event.ABORT)}
    # nothing starts or re-initializes while markers are being written
    for phase in PREPARING:
        assert (phase, Event.ADD) not in TRANSITIONS and (phase, Event.INIT) not in TRANSITIONS
    for phase in IDLE:
        assert TRANSITIONS[(phase, Event.ADD)] == Phase.ONGOING
        assert TRANSITIONS[(phase, Event.INIT)] == Phase.EMPTY


@pytest.mark.parametrize(("state", "event"), list(itertools.product(TxnState, TxnEvent)))
def test_every_producer_pair_is_a_transition_or_an_error(state: TxnState, event: TxnEvent) -> None:
    if (state, event) in CLIENT:
        assert next_state(state, event) == CLIENT[(state, event)]
    else:
        with pytest.raises(IllegalStateError):
            next_state(state, event)


def test_producer_fatal_is_final_and_commit_needs_a_transaction() -> None:
    assert not [k for k in CLIENT if k[0] == TxnState.FATAL_ERROR]
    assert {k for k, v in CLIENT.items() if v == TxnState.COMMITTING} == {
        (TxnState.IN_TRANSACTION, TxnEvent.COMMIT)
    }
    # an abortable error leaves only one way out: abort
    assert {e for (s, e) in CLIENT if s == TxnState.ABORTABLE_ERROR} == {
        TxnEvent.ABORT,
        TxnEvent.ERROR,
        TxnEvent.FATAL,
    }


def test_transactional_ids_are_placed_apart_from_groups_of_the_same_name() -> None:
    from broker_agents.groups.coordinator import coordinator_for

    agents = list(range(1, 8))
    names = [f"app-{i}" for i in range(200)]
    differ = sum(
        coordinator_for(n, agents) != coordinator_for(coordinator_key(n), agents) for n in names
    )
    assert differ > 100  # independent placements: about 6 in 7 differ
