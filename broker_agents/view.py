"""What this agent currently knows of the cluster from its ZooKeeper watches.

``agent.py`` fills it from the watches of ``/agents``, ``/controller`` and ``/topics``; the
components that need it (the APIs, the controller, the replica fetchers, tiering, the group
coordinator) are handed the same object and only read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from storage.metadata import AgentRegistration, TopicSpec


@dataclass
class ClusterView:
    agents: dict[int, AgentRegistration] = field(default_factory=dict)
    topics: dict[str, TopicSpec] = field(default_factory=dict)
    controller_id: int = -1
