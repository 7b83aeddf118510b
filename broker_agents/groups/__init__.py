"""Group coordination: the membership state machine and the coordinator (docs/groups.md)."""

from broker_agents.groups.coordinator import GroupCoordinator, coordinator_for
from broker_agents.groups.state import Event, IllegalTransitionError, Phase, next_phase

__all__ = [
    "Event",
    "GroupCoordinator",
    "IllegalTransitionError",
    "Phase",
    "coordinator_for",
    "next_phase",
]
