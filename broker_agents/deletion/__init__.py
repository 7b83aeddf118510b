"""Deleting a topic: the lifecycle table, the controller's steps, the agent's removal."""

from broker_agents.deletion.deleter import DeleterSettings, TopicDeleter
from broker_agents.deletion.replica import LocalRemoval
from broker_agents.deletion.state import DeletionEvent, next_step

__all__ = ["DeleterSettings", "DeletionEvent", "LocalRemoval", "TopicDeleter", "next_step"]
