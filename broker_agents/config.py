"""Configuration of one agent process (validated at the edge, ``from_env`` for deployments)."""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import Field

from storage.config import _Config
from storage.protocol import DEFAULT_MAX_FRAME


class AgentConfig(_Config):
    agent_id: int = Field(alias="agent.id", ge=0, le=1_000_000)
    listen_host: str = Field("127.0.0.1", alias="listen.host")
    listen_port: int = Field(0, alias="listen.port", ge=0, le=65535)
    advertised_host: str | None = Field(None, alias="advertised.host")
    zookeeper: str = Field(alias="zookeeper.connect")
    data_dir: Path = Field(alias="data.dir")
    session_timeout_ms: int = Field(6000, alias="zookeeper.session.timeout.ms", ge=1000)
    request_timeout_ms: int = Field(10000, alias="zookeeper.request.timeout.ms", ge=100)
    max_frame_bytes: int = Field(DEFAULT_MAX_FRAME, alias="socket.request.max.bytes", ge=1024)
    max_in_flight_per_connection: int = Field(64, alias="max.in.flight.per.connection", ge=1)
    replica_fetch_max_bytes: int = Field(8 << 20, alias="replica.fetch.max.bytes", ge=1024)
    replica_fetch_wait_max_ms: int = Field(500, alias="replica.fetch.wait.max.ms", ge=0)
    replica_lag_time_max_ms: int = Field(10_000, alias="replica.lag.time.max.ms", ge=100)
    # consumer groups (docs/groups.md)
    group_min_session_timeout_ms: int = Field(1000, alias="group.min.session.timeout.ms", ge=1)
    group_max_session_timeout_ms: int = Field(300_000, alias="group.max.session.timeout.ms", ge=1)
    group_initial_rebalance_delay_ms: int = Field(
        3000, alias="group.initial.rebalance.delay.ms", ge=0
    )
    offsets_commit_linger_ms: int = Field(5, alias="offsets.commit.linger.ms", ge=0)

    @classmethod
    def from_env(cls, prefix: str = "STRATA_AGENT_") -> AgentConfig:
        """From ``STRATA_AGENT_AGENT_ID``, ``STRATA_AGENT_ZOOKEEPER_CONNECT``, ... (dots -> _)."""
        values = {}
        for name, field in cls.model_fields.items():
            alias = field.alias or name
            key = prefix + alias.replace(".", "_").upper()
            if key in os.environ:
                values[alias] = os.environ[key]
        result: AgentConfig = cls.parse(values)
        return result
