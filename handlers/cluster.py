"""The admin API's cluster endpoints: agents, balancing, reassignment, preferred leaders.

    GET    /agents                           -> 200 {"agents": [{"agent_id", "host", "port",
                                                "alive", "decommissioning", "replicas",
                                                "leaders"}]} (dead agents that still hold
                                                replicas are listed with alive false)
    POST   /agents/{id}/decommission         -> 202 the agent's entry: its replicas move away
    DELETE /agents/{id}/decommission         -> 200 the agent's entry: it may hold replicas again
    GET    /cluster/rebalance                -> 200 the plan, not carried out (a dry run)
    POST   /cluster/rebalance                -> 202 the plan; the controller carries it out a
                                                few moves at a time
    POST   /cluster/preferred-leaders        {"topics"?: [...]} -> 202: leadership moves to
                                                each partition's first replica if in sync
    POST   /topics/{name}/partitions/{p}/reassignment  {"replicas": [ids]} -> 202 the
                                                partition's state with the move in progress

The controller does the work (``broker_agents.rebalancer``); these routes only write the
requests it reads (``storage.metadata.requests``) or, for a reassignment, the partition's
``adding``/``removing`` (``MetadataStore.request_reassignment``). The plan shown is the
same function of the same states as the controller's (``storage.metadata.balance``).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

from handlers.http import CLUSTER_ALTER, CLUSTER_DESCRIBE, Request, Response, Route, parse_body
from handlers.runtime import Invocation
from storage.errors import (
    InvalidPartitionsError,
    InvalidReplicationFactorError,
    InvalidRequestError,
    UnknownTopicOrPartitionError,
)
from storage.metadata import MetadataStore, PartitionState
from storage.metadata.balance import Key, Plan, plan
from storage.metadata.models import validate_topic_name
from storage.metadata.requests import ControllerRequests


class ReassignBody(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    replicas: list[StrictInt] = Field(min_length=1)


class PreferredBody(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    topics: list[StrictStr] | None = None


async def _cluster_states(
    store: MetadataStore,
) -> tuple[dict[Key, PartitionState], dict[str, int]]:
    states: dict[Key, PartitionState] = {}
    replication: dict[str, int] = {}
    for name in await store.list_topics():
        try:
            spec, _ = await store.get_topic(name)
        except UnknownTopicOrPartitionError:
            continue
        if spec.deletion is not None:
            continue
        replication[name] = spec.replication_factor
        for p, (state, _) in (await store.partition_states(name)).items():
            states[(name, p)] = state
    return states, replication


class ClusterAdmin:
    def __init__(self, store: MetadataStore) -> None:
        self.store = store
        self.requests = ControllerRequests(store.zk)

    async def agents(self) -> list[dict[str, Any]]:
        live = await self.store.list_agents()
        states, _ = await _cluster_states(self.store)
        decommissioned = await self.requests.decommissioned()
        replicas: dict[int, int] = {}
        leaders: dict[int, int] = {}
        for s in states.values():
            for r in s.replicas:
                replicas[r] = replicas.get(r, 0) + 1
            if s.leader >= 0:
                leaders[s.leader] = leaders.get(s.leader, 0) + 1
        out = []
        for a in sorted(set(live) | set(replicas) | decommissioned):
            reg = live.get(a)
            out.append(
                {
                    "agent_id": a,
                    "host": reg.host if reg else None,
                    "port": reg.port if reg else None,
                    "alive": reg is not None,
                    "decommissioning": a in decommissioned,
                    "replicas": replicas.get(a, 0),
                    "leaders": leaders.get(a, 0),
                }
            )
        return out

    async def agent(self, agent_id: int) -> dict[str, Any]:
        for entry in await self.agents():
            if entry["agent_id"] == agent_id:
                return entry
        raise InvalidRequestError(f"agent {agent_id} is neither alive nor holds any replica")

    async def decommission(self, agent_id: int) -> dict[str, Any]:
        entry = await self.agent(agent_id)  # one read of every state: its counts, as they are
        await self.requests.decommission(agent_id)
        return {**entry, "decommissioning": True}

    async def recommission(self, agent_id: int) -> dict[str, Any]:
        await self.requests.recommission(agent_id)
        return await self.agent(agent_id)

    async def plan(self) -> Plan:
        live = await self.store.list_agents()
        states, replication = await _cluster_states(self.store)
        decommissioned = await self.requests.decommissioned()
        eligible = [
            a for a, reg in live.items() if a not in decommissioned and not reg.shutting_down
        ]
        holders = {r for s in states.values() for r in s.replicas}
        retained = holders - set(eligible) - decommissioned
        return plan(states, replication, eligible, retained)

    async def rebalance(self) -> Plan:
        the_plan = await self.plan()
        await self.requests.request_rebalance()
        return the_plan

    async def reassign(self, name: str, partition: int, replicas: list[int]) -> PartitionState:
        spec, _ = await self.store.get_topic(name)
        if not 0 <= partition < spec.partitions:
            raise InvalidPartitionsError(f"{name} has no partition {partition}")
        live = await self.store.list_agents()
        unknown = [r for r in replicas if r not in live]
        if unknown:
            raise InvalidReplicationFactorError(f"agents {unknown} are not alive")
        return await self.store.request_reassignment(name, partition, replicas)


def _agent_id(text: str) -> int:
    if not text.isdigit():
        raise InvalidRequestError(f"agent id {text!r} is not a number")
    return int(text)


def _list_agents(request: Request, invocation: Invocation) -> Response:
    agents = invocation.run(lambda store: ClusterAdmin(store).agents())
    return Response(200, {"agents": agents})


def _decommission(request: Request, invocation: Invocation, agent: str) -> Response:
    agent_id = _agent_id(agent)
    entry = invocation.run(lambda store: ClusterAdmin(store).decommission(agent_id))
    return Response(202, entry)


def _recommission(request: Request, invocation: Invocation, agent: str) -> Response:
    agent_id = _agent_id(agent)
    entry = invocation.run(lambda store: ClusterAdmin(store).recommission(agent_id))
    return Response(200, entry)


def _plan(request: Request, invocation: Invocation) -> Response:
    the_plan = invocation.run(lambda store: ClusterAdmin(store).plan())
    return Response(200, the_plan.to_json())


def _rebalance(request: Request, invocation: Invocation) -> Response:
    the_plan = invocation.run(lambda store: ClusterAdmin(store).rebalance())
    return Response(202, the_plan.to_json())


def _preferred(request: Request, invocation: Invocation) -> Response:
    body = parse_body(PreferredBody, request.json() if request.body.strip() else {})
    topics = [validate_topic_name(t) for t in body.topics] if body.topics else None

    async def run(store: MetadataStore) -> None:
        await ControllerRequests(store.zk).request_preferred_leaders(topics)

    invocation.run(run)
    return Response(202, {"topics": topics})


def _reassign(request: Request, invocation: Invocation, name: str, partition: str) -> Response:
    name = validate_topic_name(name)
    if not partition.isdigit():
        raise InvalidPartitionsError(f"partition {partition!r} is not a number")
    body = parse_body(ReassignBody, request.json(), errors={"replicas": InvalidRequestError})
    if len(set(body.replicas)) != len(body.replicas):
        raise InvalidReplicationFactorError(f"replicas {body.replicas} name an agent twice")
    state = invocation.run(
        lambda store: ClusterAdmin(store).reassign(name, int(partition), list(body.replicas))
    )
    return Response(202, state.model_dump(mode="json"))


CLUSTER_ROUTES = [
    Route("GET", "/agents", _list_agents, CLUSTER_DESCRIBE),
    Route("POST", "/agents/{agent}/decommission", _decommission, CLUSTER_ALTER),
    Route("DELETE", "/agents/{agent}/decommission", _recommission, CLUSTER_ALTER),
    Route("GET", "/cluster/rebalance", _plan, CLUSTER_DESCRIBE),
    Route("POST", "/cluster/rebalance", _rebalance, CLUSTER_ALTER),
    Route("POST", "/cluster/preferred-leaders", _preferred, CLUSTER_ALTER),
    Route("POST", "/topics/{name}/partitions/{partition}/reassignment", _reassign, CLUSTER_ALTER),
]
"""Describe on the cluster to look, Alter to change (Kafka's ElectLeaders and
AlterPartitionReassignments need Alter on the cluster too)."""
