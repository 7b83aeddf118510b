"""Transactions: the coordinator, its state machine, and the markers (docs/transactions.md)."""

from broker_agents.transactions.coordinator import (
    TransactionCoordinator,
    TxnSettings,
    find_coordinator_router,
)
from broker_agents.transactions.markers import ClusterRoutes, MarkerChannel, MarkerWriter
from broker_agents.transactions.orphans import OrphanSweeper
from broker_agents.transactions.state import Event, IllegalTransitionError, Phase, next_phase

__all__ = [
    "ClusterRoutes",
    "Event",
    "IllegalTransitionError",
    "MarkerChannel",
    "MarkerWriter",
    "OrphanSweeper",
    "Phase",
    "TransactionCoordinator",
    "TxnSettings",
    "find_coordinator_router",
    "next_phase",
]
