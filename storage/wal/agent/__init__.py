"""One write-ahead log per agent (per data directory): every partition's appends made durable
by one write and one fsync per round. ``format`` is the bytes, ``journal`` the run time,
``replay`` the recovery. See ``docs/architecture.md``, *The agent WAL*."""

from storage.wal.agent.journal import AgentWal, AgentWalConfig, WalPartition
from storage.wal.agent.replay import ReplayResult, replay

__all__ = ["AgentWal", "AgentWalConfig", "ReplayResult", "WalPartition", "replay"]
