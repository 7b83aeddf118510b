"""A partition's reassignment, as a table (the phases ``PartitionState`` implies).

    STABLE --request a new replica set--> MOVING     (replicas = target + old; adding, removing)
    STABLE --request the same set reordered--> STABLE (a preferred-leader change, no data moves)
    MOVING --request another target--> MOVING         (retargeted; old replicas still kept)
    MOVING --request the set it started from--> STABLE (cancelled: the added replicas go)
    MOVING --leader lost--> MOVING                    (a new leader from the ISR; the move goes on)
    MOVING --every added replica in the ISR--> STABLE (removed replicas dropped, leadership to
                                                       the first replica if it is in sync)

Old replicas stay in the set until every new one has caught up, so a move never has fewer
in-sync copies than before it. ``MetadataStore.request_reassignment`` (operators, the
rebalancer) and the controller (``Controller._advance_reassignment``) consult
:func:`next_phase`; a pair missing from ``TRANSITIONS`` raises ``IllegalTransitionError`` and
``tests/test_balance.py`` walks every pair.
"""

from __future__ import annotations

import enum

from storage.errors import StrataError
from storage.metadata.models import PartitionState


class Phase(enum.StrEnum):
    STABLE = "stable"
    MOVING = "moving"


class Event(enum.StrEnum):
    REQUEST = "request"  # a new replica set asked for
    REORDER = "reorder"  # the same set in another order
    LEADER_LOST = "leader_lost"
    CAUGHT_UP = "caught_up"  # every added replica is in the ISR
    CANCEL = "cancel"  # a request for the set the move started from


class IllegalTransitionError(StrataError):
    """A (phase, event) pair the reassignment state machine does not allow (a bug)."""


P, E = Phase, Event
TRANSITIONS: dict[tuple[Phase, Event], Phase] = {
    (P.STABLE, E.REQUEST): P.MOVING,
    (P.STABLE, E.REORDER): P.STABLE,
    (P.MOVING, E.REQUEST): P.MOVING,
    (P.MOVING, E.LEADER_LOST): P.MOVING,
    (P.MOVING, E.CAUGHT_UP): P.STABLE,
    (P.MOVING, E.CANCEL): P.STABLE,
}


def phase_of(state: PartitionState) -> Phase:
    return Phase.MOVING if state.adding or state.removing else Phase.STABLE


def next_phase(phase: Phase, event: Event) -> Phase:
    try:
        return TRANSITIONS[(phase, event)]
    except KeyError:
        raise IllegalTransitionError(
            f"reassignment event {event.value} in phase {phase.value}"
        ) from None
