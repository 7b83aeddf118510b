"""Retry policies, the retry router's statistics and redrive tasks in ZooKeeper.

Layout (under the cluster's chroot)::

    /groups/<group>/retry/<topic>    RetryPolicy (JSON)       the group's policy for a topic
    /retry/stats/<router name>        {...}                    counters for `strata retry status`
    /retry/router/<partition>         {"a", "b", "now"}        the router's last forward of a
                                                               failures partition (an intent)
    /retry/redrives/<task id>         RedriveTask (JSON)       one redrive's plan and progress

A policy lives with the group's other metadata (``storage.metadata.groups``), so deleting the
group deletes its policies. Only the admin API writes policies; the router reads them (and
caches them for a few seconds).

A redrive task is written compare-and-set on its version by the one process that runs it: the
task's ``intent`` (the source range being moved, written before anything is sent) is what makes
a resumed redrive send nothing twice (``handlers.redrive`` has the argument).
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

from storage.errors import NodeExistsError, NodeNotFoundError
from storage.metadata.delays import Intent, read_intent, write_intent
from storage.metadata.groups import group_path, validate_group_id
from storage.metadata.zk import AsyncZooKeeper
from storage.names import validate_topic_name
from storage.retry_policy import RetryPolicy

STATS = "/retry/stats"
FORWARDS = "/retry/router"
REDRIVES = "/retry/redrives"


def policy_path(group: str, topic: str) -> str:
    return f"{group_path(group)}/retry/{topic}"


class RetryStore:
    """Policies, statistics and redrive tasks (see the module docstring)."""

    def __init__(self, zk: AsyncZooKeeper) -> None:
        self.zk = zk

    # ---- policies ------------------------------------------------------------------------
    async def set_policy(self, group: str, topic: str, policy: RetryPolicy) -> None:
        path = policy_path(validate_group_id(group), validate_topic_name(topic))
        await self._put(path, json.dumps(policy.to_json()).encode())

    async def get_policy(self, group: str, topic: str) -> RetryPolicy | None:
        try:
            data, _ = await self.zk.get(policy_path(group, topic))
        except NodeNotFoundError:
            return None
        return RetryPolicy.model_validate(json.loads(data))

    async def delete_policy(self, group: str, topic: str) -> bool:
        try:
            await self.zk.delete(policy_path(group, topic))
        except NodeNotFoundError:
            return False
        return True

    async def list_policies(self, group: str) -> dict[str, RetryPolicy]:
        root = f"{group_path(validate_group_id(group))}/retry"
        try:
            topics = await self.zk.get_children(root)
        except NodeNotFoundError:
            return {}
        out = {}
        for topic in sorted(topics):
            policy = await self.get_policy(group, topic)
            if policy is not None:
                out[topic] = policy
        return out

    # ---- the router's intents -------------------------------------------------------------
    async def read_forward(self, partition: int) -> tuple[Intent | None, int]:
        """The router's last forward of a failures partition, with the node's version (-1:
        none yet); ``handlers.retry`` has the argument."""
        return await read_intent(self.zk, f"{FORWARDS}/{partition}")

    async def write_forward(self, partition: int, a: int, b: int, now: int, version: int) -> Intent:
        """Compare-and-set the router's intent to forward ``[a, b)`` of a failures partition
        (``VersionConflictError``: another process wrote since ``version``)."""
        return await write_intent(self.zk, f"{FORWARDS}/{partition}", a, b, now, version)

    # ---- statistics ----------------------------------------------------------------------
    async def write_stats(self, name: str, stats: dict[str, Any]) -> None:
        await self._put(f"{STATS}/{name}", json.dumps(stats).encode())

    async def read_stats(self) -> dict[str, dict[str, Any]]:
        return await self._read_all(STATS)

    # ---- redrive tasks -------------------------------------------------------------------
    async def create_task(self, task_id: str, doc: dict[str, Any]) -> None:
        await self.zk.create(f"{REDRIVES}/{task_id}", json.dumps(doc).encode(), makepath=True)

    async def read_task(self, task_id: str) -> tuple[dict[str, Any], int]:
        """The task and its node version (``NodeNotFoundError`` for an unknown id)."""
        data, stat = await self.zk.get(f"{REDRIVES}/{task_id}")
        return json.loads(data), stat.version

    async def write_task(self, task_id: str, doc: dict[str, Any], version: int) -> int:
        """Compare-and-set (``VersionConflictError`` if someone wrote since); the new version."""
        stat = await self.zk.set(f"{REDRIVES}/{task_id}", json.dumps(doc).encode(), version)
        new_version: int = stat.version
        return new_version

    async def list_tasks(self) -> dict[str, dict[str, Any]]:
        return await self._read_all(REDRIVES)

    # ---- helpers -------------------------------------------------------------------------
    async def _put(self, path: str, data: bytes) -> None:
        try:
            await self.zk.set(path, data)
        except NodeNotFoundError:
            try:
                await self.zk.create(path, data, makepath=True)
            except NodeExistsError:
                await self.zk.set(path, data)

    async def _read_all(self, root: str) -> dict[str, dict[str, Any]]:
        try:
            names = await self.zk.get_children(root)
        except NodeNotFoundError:
            return {}
        out = {}
        for name in sorted(names):
            with contextlib.suppress(NodeNotFoundError):
                data, _ = await self.zk.get(f"{root}/{name}")
                out[name] = json.loads(data)
        return out
