"""A group's membership state machine, as a table (Kafka's group states).

    EMPTY --join--> PREPARING_REBALANCE --all joined / rebalance timeout--> COMPLETING_REBALANCE
    COMPLETING_REBALANCE --leader's sync--> STABLE
    STABLE / COMPLETING_REBALANCE --join, leave, member expired--> PREPARING_REBALANCE
    PREPARING_REBALANCE --last member gone--> EMPTY
    any --coordinator moved / group deleted--> DEAD

A (phase, event) pair missing from ``TRANSITIONS`` is illegal: ``next_phase`` raises
``IllegalTransitionError``, and ``tests/test_groups_state.py`` walks every pair. The
coordinator consults the table for every phase change, so a bug that would, say, complete a
sync while members are still joining fails loudly instead of handing out two owners.
"""

from __future__ import annotations

import enum

from storage.errors import StrataError


class Phase(enum.StrEnum):
    EMPTY = "empty"
    PREPARING_REBALANCE = "preparing_rebalance"
    COMPLETING_REBALANCE = "completing_rebalance"
    STABLE = "stable"
    DEAD = "dead"


class Event(enum.StrEnum):
    JOIN = "join"  # a member joins or rejoins (not a static member's plain restart)
    LEAVE = "leave"  # a member leaves or expires and others remain
    ALL_JOINED = "all_joined"  # every expected member has (re)joined, or the timeout passed
    LEADER_SYNCED = "leader_synced"  # the leader sent the assignment
    LAST_MEMBER_GONE = "last_member_gone"
    UNLOAD = "unload"  # another agent coordinates the group now, or it was deleted


class IllegalTransitionError(StrataError):
    """A (phase, event) pair the group state machine does not allow (a coordinator bug)."""


P, E = Phase, Event
TRANSITIONS: dict[tuple[Phase, Event], Phase] = {
    (P.EMPTY, E.JOIN): P.PREPARING_REBALANCE,
    (P.EMPTY, E.LAST_MEMBER_GONE): P.EMPTY,
    (P.EMPTY, E.UNLOAD): P.DEAD,
    (P.PREPARING_REBALANCE, E.JOIN): P.PREPARING_REBALANCE,
    (P.PREPARING_REBALANCE, E.LEAVE): P.PREPARING_REBALANCE,
    (P.PREPARING_REBALANCE, E.ALL_JOINED): P.COMPLETING_REBALANCE,
    (P.PREPARING_REBALANCE, E.LAST_MEMBER_GONE): P.EMPTY,
    (P.PREPARING_REBALANCE, E.UNLOAD): P.DEAD,
    (P.COMPLETING_REBALANCE, E.JOIN): P.PREPARING_REBALANCE,
    (P.COMPLETING_REBALANCE, E.LEAVE): P.PREPARING_REBALANCE,
    (P.COMPLETING_REBALANCE, E.LEADER_SYNCED): P.STABLE,
    (P.COMPLETING_REBALANCE, E.LAST_MEMBER_GONE): P.EMPTY,
    (P.COMPLETING_REBALANCE, E.UNLOAD): P.DEAD,
    (P.STABLE, E.JOIN): P.PREPARING_REBALANCE,
    (P.STABLE, E.LEAVE): P.PREPARING_REBALANCE,
    (P.STABLE, E.LAST_MEMBER_GONE): P.EMPTY,
    (P.STABLE, E.UNLOAD): P.DEAD,
}


def next_phase(phase: Phase, event: Event) -> Phase:
    try:
        return TRANSITIONS[(phase, event)]
    except KeyError:
        raise IllegalTransitionError(f"group event {event.value} in phase {phase.value}") from None
