"""Rules every way of creating or changing a topic applies (the admin API and the agents'
Kafka listener): the replication factor's default and bounds, min.insync.replicas against it.
Pure functions, no I/O."""

from __future__ import annotations

from storage.errors import InvalidConfigError, InvalidReplicationFactorError
from storage.metadata.models import TopicConfig

DEFAULT_REPLICATION_FACTOR = 3
MAX_REPLICATION_FACTOR = 16


def check_min_insync(config: TopicConfig, replication_factor: int) -> None:
    if config.min_insync_replicas > replication_factor:
        raise InvalidConfigError(
            f"min.insync.replicas={config.min_insync_replicas} is more than the replication "
            f"factor {replication_factor}: no acks=all write could ever succeed"
        )


def replication_factor_for(requested: int | None, live_agents: int) -> int:
    """The requested factor, checked against the live agents; default min(3, live agents)."""
    if requested is None:
        if live_agents == 0:
            raise InvalidReplicationFactorError(
                "no live agents: cannot choose a replication factor (start an agent, or pass "
                "replication_factor)"
            )
        return min(DEFAULT_REPLICATION_FACTOR, live_agents)
    if not 1 <= requested <= MAX_REPLICATION_FACTOR:
        raise InvalidReplicationFactorError(
            f"replication factor must be between 1 and {MAX_REPLICATION_FACTOR}, got {requested}"
        )
    if requested > live_agents:
        raise InvalidReplicationFactorError(
            f"replication factor {requested} is larger than the number of live agents "
            f"({live_agents})"
        )
    return requested
