"""A transaction's state machine, as a table (Kafka's transaction states, KIP-98).

    EMPTY ──add──> ONGOING ──commit──> PREPARE_COMMIT ──markers written──> COMPLETE_COMMIT
                      │   ──abort / timeout / fence──> PREPARE_ABORT ──markers written──> COMPLETE_ABORT
    COMPLETE_* ──add──> ONGOING (the next transaction)
    EMPTY / COMPLETE_* ──init──> EMPTY (a producer (re)initializes: the epoch goes up)
    any ──unload──> DEAD (another agent coordinates the transactional.id now)

``PREPARE_*`` is the decision: it is written to ZooKeeper before the producer hears it, and a
coordinator that finds a transaction in it (after a failover) writes the markers again and
completes it. ``COMPLETE_*`` is only a formality on disk (written lazily, or not at all when
the next transaction's first write overtakes it): markers are idempotent.

A (phase, event) pair missing from ``TRANSITIONS`` is illegal: ``next_phase`` raises
``IllegalTransitionError``, and ``tests/test_txn_state.py`` walks every pair. Requests that
arrive in a phase where they cannot act (an add while the previous transaction's markers are
being written) wait or are answered by the coordinator without a transition.
"""

from __future__ import annotations

import enum

from storage.errors import StrataError


class Phase(enum.StrEnum):
    EMPTY = "empty"
    ONGOING = "ongoing"
    PREPARE_COMMIT = "prepare_commit"
    PREPARE_ABORT = "prepare_abort"
    COMPLETE_COMMIT = "complete_commit"
    COMPLETE_ABORT = "complete_abort"
    DEAD = "dead"


class Event(enum.StrEnum):
    INIT = "init"  # InitProducerId: a new producer session (epoch bump)
    ADD = "add"  # AddPartitionsToTxn / AddOffsetsToTxn
    COMMIT = "commit"  # EndTxn(commit)
    ABORT = "abort"  # EndTxn(abort), transaction.timeout.ms, or a new session fencing the old
    MARKERS_WRITTEN = "markers_written"  # every partition and group has its marker
    UNLOAD = "unload"


class IllegalTransitionError(StrataError):
    """A (phase, event) pair the transaction state machine does not allow (a coordinator bug)."""


P, E = Phase, Event
TRANSITIONS: dict[tuple[Phase, Event], Phase] = {
    (P.EMPTY, E.INIT): P.EMPTY,
    (P.EMPTY, E.ADD): P.ONGOING,
    (P.EMPTY, E.UNLOAD): P.DEAD,
    (P.ONGOING, E.ADD): P.ONGOING,
    (P.ONGOING, E.COMMIT): P.PREPARE_COMMIT,
    (P.ONGOING, E.ABORT): P.PREPARE_ABORT,
    (P.ONGOING, E.UNLOAD): P.DEAD,
    (P.PREPARE_COMMIT, E.MARKERS_WRITTEN): P.COMPLETE_COMMIT,
    (P.PREPARE_COMMIT, E.UNLOAD): P.DEAD,
    (P.PREPARE_ABORT, E.MARKERS_WRITTEN): P.COMPLETE_ABORT,
    (P.PREPARE_ABORT, E.UNLOAD): P.DEAD,
    (P.COMPLETE_COMMIT, E.INIT): P.EMPTY,
    (P.COMPLETE_COMMIT, E.ADD): P.ONGOING,
    (P.COMPLETE_COMMIT, E.UNLOAD): P.DEAD,
    (P.COMPLETE_ABORT, E.INIT): P.EMPTY,
    (P.COMPLETE_ABORT, E.ADD): P.ONGOING,
    (P.COMPLETE_ABORT, E.UNLOAD): P.DEAD,
}

#: phases in which the markers are being written (the decision is taken, not yet applied)
PREPARING = frozenset({P.PREPARE_COMMIT, P.PREPARE_ABORT})
#: phases in which no transaction is open or ending: a new one may start
IDLE = frozenset({P.EMPTY, P.COMPLETE_COMMIT, P.COMPLETE_ABORT})


def next_phase(phase: Phase, event: Event) -> Phase:
    try:
        return TRANSITIONS[(phase, event)]
    except KeyError:
        raise IllegalTransitionError(
            f"transaction event {event.value} in phase {phase.value}"
        ) from None
