"""Operators' requests to the controller, kept in ZooKeeper so that they outlive a controller:

    /admin/decommission/<agent id>   persistent  "" : drain the agent (its replicas move away;
                                                 it can then be stopped for good)
    /admin/rebalance                 persistent  "" : balance replicas and preferred leaders
                                                 once (``storage.metadata.balance``), even with
                                                 ``auto.rebalance.enable=false``
    /admin/preferred_leaders         persistent  JSON list of topics, ``[]`` for all: move
                                                 leadership to each partition's first replica
                                                 where it is alive and in sync

The admin API writes them; the controller watches nothing new for them, it reads them on each
reconcile pass (once a second, or when poked) and deletes a one-shot request once it has
carried it out. A decommission stays until an operator removes it (``DELETE``): the agent's
id stays out of every plan meanwhile, so a restarted agent does not get its replicas back.
"""

from __future__ import annotations

import contextlib
import json

from storage.errors import (
    InvalidRequestError,
    NodeExistsError,
    NodeNotFoundError,
    VersionConflictError,
)
from storage.metadata.zk import AsyncZooKeeper

ADMIN = "/admin"
DECOMMISSION = f"{ADMIN}/decommission"
REBALANCE = f"{ADMIN}/rebalance"
PREFERRED_LEADERS = f"{ADMIN}/preferred_leaders"


class ControllerRequests:
    def __init__(self, zk: AsyncZooKeeper) -> None:
        self.zk = zk

    async def decommission(self, agent_id: int) -> None:
        if agent_id < 0:
            raise InvalidRequestError(f"agent id {agent_id} is negative")
        await self.zk.ensure_path(DECOMMISSION)
        with contextlib.suppress(NodeExistsError):
            await self.zk.create(f"{DECOMMISSION}/{agent_id}", b"")

    async def recommission(self, agent_id: int) -> bool:
        try:
            await self.zk.delete(f"{DECOMMISSION}/{agent_id}")
        except NodeNotFoundError:
            return False
        return True

    async def decommissioned(self) -> set[int]:
        try:
            children = await self.zk.get_children(DECOMMISSION)
        except NodeNotFoundError:
            return set()
        return {int(c) for c in children if c.isdigit()}

    async def request_rebalance(self) -> None:
        await self.zk.ensure_path(ADMIN)
        with contextlib.suppress(NodeExistsError):
            await self.zk.create(REBALANCE, b"")

    async def rebalance_requested(self) -> bool:
        return await self.zk.exists(REBALANCE) is not None

    async def rebalance_done(self) -> None:
        with contextlib.suppress(NodeNotFoundError):
            await self.zk.delete(REBALANCE)

    async def request_preferred_leaders(self, topics: list[str] | None = None) -> None:
        """Ask for a preferred-leader election of ``topics`` (None: every topic). A request
        already pending is widened to cover both."""
        await self.zk.ensure_path(ADMIN)
        wanted = sorted(set(topics)) if topics else []
        while True:
            try:
                data, stat = await self.zk.get(PREFERRED_LEADERS)
            except NodeNotFoundError:
                try:
                    await self.zk.create(PREFERRED_LEADERS, json.dumps(wanted).encode())
                    return
                except NodeExistsError:
                    continue
            pending = json.loads(data or b"[]")
            merged = [] if not pending or not wanted else sorted(set(pending) | set(wanted))
            if merged == pending:
                return
            try:
                await self.zk.set(PREFERRED_LEADERS, json.dumps(merged).encode(), stat.version)
                return
            except VersionConflictError:  # another request widened it meanwhile
                continue

    async def preferred_leaders_requested(self) -> tuple[set[str] | None, int] | None:
        """The pending election: (topics, or None for all; the znode version), or None."""
        try:
            data, stat = await self.zk.get(PREFERRED_LEADERS)
        except NodeNotFoundError:
            return None
        topics = json.loads(data or b"[]")
        return (set(topics) or None), stat.version

    async def preferred_leaders_done(self, version: int) -> None:
        """Remove the request carried out (not a wider one written since)."""
        # widened meanwhile (version conflict): the next pass serves the wider request
        with contextlib.suppress(NodeNotFoundError, VersionConflictError):
            await self.zk.delete(PREFERRED_LEADERS, version)
