"""Validated configuration objects of the storage engine.

Field names are Python identifiers; each also accepts Kafka's dotted name (``segment.bytes``),
so ``LogConfig.model_validate({"segment.bytes": 1 << 20})`` works where users bring Kafka
habits. Objects are frozen: change one with ``model_copy(update=...)``.
"""

from __future__ import annotations

import enum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from storage.errors import InvalidConfigError


class FsyncPolicy(enum.StrEnum):
    """When appended bytes are forced to disk.

    ``always``: an append is acknowledged only after an fsync that covers it; concurrent
    appends share one fsync (group commit). Survives power loss; costs one fsync latency.
    With acks=all, followers too fsync before their fetch moves the high watermark.
    ``interval``: a background flush every ``fsync.interval.ms``; appends return at once.
    A power loss can lose the last interval; a process crash loses nothing.
    ``never``: the OS writes back when it likes; a sealed segment is fsynced (and its index
    written) by the next background tick, so only the active segment can lose data.
    Fastest; rely on replication for durability, as Kafka does by default.
    """

    ALWAYS = "always"
    INTERVAL = "interval"
    NEVER = "never"


class _Config(BaseModel):
    model_config = ConfigDict(frozen=True, populate_by_name=True, extra="forbid")

    @classmethod
    def parse(cls, values: dict[str, Any]) -> Any:
        """Validate ``values`` (dotted or Python names); bad ones raise ``InvalidConfigError``."""
        try:
            return cls.model_validate(values)
        except ValidationError as exc:
            raise InvalidConfigError(str(exc)) from None


class LogConfig(_Config):
    """Configuration of one partition's local write-ahead log."""

    segment_bytes: int = Field(1 << 30, alias="segment.bytes", ge=4096, le=(1 << 31) - 1)
    segment_ms: int = Field(7 * 24 * 3600 * 1000, alias="segment.ms", ge=1)
    index_interval_bytes: int = Field(4096, alias="index.interval.bytes", ge=0)
    max_message_bytes: int = Field(1_048_588, alias="max.message.bytes", ge=1024, le=1 << 30)
    fsync_policy: FsyncPolicy = Field(FsyncPolicy.ALWAYS, alias="fsync.policy")
    fsync_interval_ms: int = Field(50, alias="fsync.interval.ms", ge=1)
