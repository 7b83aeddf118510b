"""Transaction markers: how a coordinator's decision reaches every partition and group.

Two halves:

* :class:`MarkerChannel` (the coordinator's side) delivers one transaction's decision —
  producer id, epoch, commit or abort, and the decision's token (the coordinator epoch) — to
  every partition leader and group coordinator of the transaction, with WriteTxnMarkers
  requests. Markers waiting for the same agent travel in one request (one sender task per
  destination agent takes everything queued for it), a marker for this agent itself is a
  function call. Failures (a leader that moved, an agent that died, a deadline) are retried
  with backoff until every participant has answered, for as long as this agent still
  coordinates the transaction: the decision is in ZooKeeper, and a coordinator that takes
  the id over finishes the job. A participant that answers that the marker is obsolete (the
  partition has seen a newer epoch or token of the producer, or the topic is gone) counts as
  done.
* :class:`MarkerWriter` (every agent's WriteTxnMarkers handler) appends the marker to each
  partition it leads — unless the partition already applied that token (a retry), answering
  once the high watermark has passed the marker — and hands group markers to the group
  coordinator, which commits or drops the transaction's offsets.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from sdk.connection import Connection, Login
from storage.codec.control import ControlMarker, encode_marker
from storage.errors import (
    InvalidProducerEpochError,
    NetworkError,
    NotCoordinatorError,
    NotLeaderError,
    RequestTimedOutError,
    StrataError,
    TransactionCoordinatorFencedError,
)
from storage.protocol import messages as m

if TYPE_CHECKING:
    from broker_agents.partitions import Partition, PartitionManager
    from broker_agents.view import ClusterView
    from storage.metadata import PartitionState

log = logging.getLogger(__name__)

LocalHandler = Callable[[m.WriteTxnMarkersRequest], Awaitable[m.WriteTxnMarkersResponse]]

#: answers that mean "this marker is not needed here any more"
_OBSOLETE = frozenset({0, InvalidProducerEpochError.code, TransactionCoordinatorFencedError.code})
#: markers per WriteTxnMarkers request, at most
MAX_MARKERS_PER_REQUEST = 500


@dataclass(frozen=True, slots=True)
class Marker:
    """One transaction's decision and where it must go."""

    producer_id: int
    producer_epoch: int
    commit: bool
    coordinator_epoch: int
    partitions: frozenset[tuple[str, int]]
    groups: frozenset[str]


class Routes(Protocol):
    """Where the participants are, as this agent's watches see it."""

    def leader_of(self, topic: str, partition: int) -> int | None: ...
    def topic_exists(self, topic: str) -> bool: ...
    def group_coordinator(self, group_id: str) -> int | None: ...
    def address(self, agent_id: int) -> tuple[str, int] | None: ...


class MarkerChannel:
    def __init__(
        self,
        agent_id: int,
        routes: Routes,
        local: LocalHandler,
        *,
        request_timeout_s: float = 30.0,
        backoff_s: tuple[float, float] = (0.02, 1.0),
        tls: Callable[[], ssl.SSLContext] | None = None,
        login: Login | None = None,
    ) -> None:
        self.agent_id = agent_id
        self.routes = routes
        self.tls = tls
        self.login = login
        self.local = local
        self.request_timeout = request_timeout_s
        self.backoff = backoff_s
        self._queues: dict[int, list[tuple[m.TxnMarker, asyncio.Future[m.TxnMarkerResult]]]] = {}
        self._wakes: dict[int, asyncio.Event] = {}
        self._connections: dict[int, Connection] = {}
        self._tg: asyncio.TaskGroup | None = None
        self.requests = 0  # WriteTxnMarkers requests sent (metrics)

    async def run(self) -> None:
        """The supervisor of the per-destination sender tasks (one per agent written to)."""
        try:
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                await asyncio.Event().wait()
        finally:
            self._tg = None
            for conn in self._connections.values():
                await conn.close()
            self._connections.clear()

    # ---- one transaction ------------------------------------------------------------------
    async def write(self, marker: Marker, still_owner: Callable[[], bool]) -> None:
        """Deliver ``marker`` to every participant; returns when all have it. Raises
        ``NotCoordinatorError`` once ``still_owner()`` says the transaction moved."""
        parts = set(marker.partitions)
        groups = set(marker.groups)
        attempt = 0
        while parts or groups:
            if not still_owner():
                raise NotCoordinatorError("the transaction's coordinator moved")
            by_agent: dict[int, tuple[dict[str, list[int]], list[str]]] = {}
            for topic, index in sorted(parts):
                if not self.routes.topic_exists(topic):
                    log.info("marker for %s-%d dropped: the topic is gone", topic, index)
                    parts.discard((topic, index))
                    continue
                leader = self.routes.leader_of(topic, index)
                if leader is None or leader < 0:
                    continue
                by_agent.setdefault(leader, ({}, []))[0].setdefault(topic, []).append(index)
            for group in sorted(groups):
                agent = self.routes.group_coordinator(group)
                if agent is not None:
                    by_agent.setdefault(agent, ({}, []))[1].append(group)
            sends = {
                agent: asyncio.ensure_future(
                    self._send(
                        agent,
                        m.TxnMarker(
                            marker.producer_id,
                            marker.producer_epoch,
                            1 if marker.commit else 0,
                            marker.coordinator_epoch,
                            [m.TxnTopic(t, ps) for t, ps in topics.items()],
                            gs,
                        ),
                    )
                )
                for agent, (topics, gs) in by_agent.items()
            }
            if sends:
                await asyncio.wait(sends.values())
            for agent, fut in sends.items():
                exc = fut.exception()
                if exc is not None:
                    log.info("markers to agent %d failed: %s", agent, exc)
                    continue
                result = fut.result()
                for t in result.topics:
                    for r in t.partitions:
                        if r.error_code in _OBSOLETE:
                            parts.discard((t.name, r.partition))
                for g in result.groups:
                    if g.error_code in _OBSOLETE:
                        groups.discard(g.group_id)
            if parts or groups:
                delay = min(self.backoff[1], self.backoff[0] * 2**attempt)
                attempt += 1
                await asyncio.sleep(delay)

    # ---- destinations ---------------------------------------------------------------------
    async def _send(self, agent: int, marker: m.TxnMarker) -> m.TxnMarkerResult:
        fut: asyncio.Future[m.TxnMarkerResult] = asyncio.get_running_loop().create_future()
        queue = self._queues.get(agent)
        if queue is None:
            if self._tg is None:
                raise NotCoordinatorError("the marker channel is not running")
            queue = self._queues[agent] = []
            self._wakes[agent] = asyncio.Event()
            self._tg.create_task(self._sender(agent), name=f"txn-markers-to-{agent}")
        queue.append((marker, fut))
        self._wakes[agent].set()
        return await fut

    async def _sender(self, agent: int) -> None:
        queue, wake = self._queues[agent], self._wakes[agent]
        while True:
            await wake.wait()
            wake.clear()
            while queue:
                batch = queue[:MAX_MARKERS_PER_REQUEST]
                del queue[:MAX_MARKERS_PER_REQUEST]
                try:
                    resp = await self._request(
                        agent, m.WriteTxnMarkersRequest([x for x, _ in batch])
                    )
                except StrataError as exc:
                    for _, fut in batch:
                        if not fut.done():
                            fut.set_exception(exc)
                    continue
                except Exception as exc:  # a bug: fail the batch, keep the sender
                    log.exception("markers to agent %d", agent)
                    for _, fut in batch:
                        if not fut.done():
                            fut.set_exception(exc)
                    continue
                by_pid = {r.producer_id: r for r in resp.markers}
                for x, fut in batch:
                    if fut.done():
                        continue
                    got = by_pid.get(x.producer_id)
                    if got is None:
                        fut.set_exception(NetworkError(f"agent {agent} left a marker unanswered"))
                    else:
                        fut.set_result(got)

    async def _request(
        self, agent: int, req: m.WriteTxnMarkersRequest
    ) -> m.WriteTxnMarkersResponse:
        self.requests += 1
        if agent == self.agent_id:
            async with asyncio.timeout(self.request_timeout):
                return await self.local(req)
        conn = self._connections.get(agent)
        if conn is None or conn.closed:
            address = self.routes.address(agent)
            if address is None:
                raise NetworkError(f"agent {agent} is not registered")
            conn = self._connections[agent] = Connection(
                *address,
                client_id=f"agent-{self.agent_id}-txn",
                request_timeout_ms=self.request_timeout * 1000,
                connect_timeout_ms=5000,
                ssl_context=self.tls() if self.tls is not None else None,
                login=self.login,
            )
        try:
            resp: m.WriteTxnMarkersResponse = await conn.request(req)
            return resp
        except (NetworkError, RequestTimedOutError):
            self._connections.pop(agent, None)
            await conn.close()
            raise


class MarkerWriter:
    """The WriteTxnMarkers handler: partitions led here get the marker, groups coordinated
    here get their transaction's offsets committed or dropped."""

    def __init__(
        self,
        partitions: PartitionManager,
        groups: Callable[[str, m.TxnMarker], Awaitable[int]],
        *,
        replication_timeout_s: float = 30.0,
        clock_ms: Callable[[], int] = lambda: time.time_ns() // 1_000_000,
    ) -> None:
        self.pm = partitions
        self.groups = groups
        self.replication_timeout = replication_timeout_s
        self.clock_ms = clock_ms
        self.markers_written = 0

    async def write_txn_markers(self, req: m.WriteTxnMarkersRequest) -> m.WriteTxnMarkersResponse:
        # one job per partition: its markers appended in request order (transactions that
        # ended together: a request holds every marker queued for this agent), then one wait
        # for all of them to be replicated; group markers go to the group coordinator
        wanted: dict[tuple[str, int], list[int]] = {}
        for i, marker in enumerate(req.markers):
            for t in marker.topics:
                for p in t.partitions:
                    wanted.setdefault((t.name, p), []).append(i)
        jobs = {
            key: asyncio.ensure_future(self._partition(key, [req.markers[i] for i in which]))
            for key, which in wanted.items()
        }
        group_jobs = [
            [(g, asyncio.ensure_future(self.groups(g, marker))) for g in marker.groups]
            for marker in req.markers
        ]
        code: dict[tuple[int, str, int], int] = {}
        for key, job in jobs.items():
            for i, c in zip(wanted[key], await job, strict=True):
                code[(i, *key)] = c
        results = []
        for i, marker in enumerate(req.markers):
            topics = [
                m.TxnTopicResult(
                    t.name, [m.TxnPartitionResult(p, code[(i, t.name, p)]) for p in t.partitions]
                )
                for t in marker.topics
            ]
            groups = [m.TxnGroupResult(g, await j) for g, j in group_jobs[i]]
            results.append(m.TxnMarkerResult(marker.producer_id, topics, groups))
        return m.WriteTxnMarkersResponse(results)

    async def _partition(self, key: tuple[str, int], markers: list[m.TxnMarker]) -> list[int]:
        """Append ``markers`` to the partition ``key`` (which this agent must lead) and wait
        until they are replicated: each marker's error code."""
        topic, index = key
        try:
            p = self.pm.leader_for_write(topic, index)
        except StrataError as exc:
            return [exc.code] * len(markers)
        codes: list[int] = []
        end = -1
        appended = False
        for marker in markers:
            try:
                written, upto = self._append(p, marker, topic, index)
            except StrataError as exc:
                codes.append(exc.code)
                continue
            appended = appended or written
            end = max(end, upto)
            codes.append(0)
        if appended:
            p.appended()
            p.advance_hw()
        if end >= 0:
            try:
                await self._replicated(p, end)
            except StrataError as exc:
                codes = [c or exc.code for c in codes]
            except TimeoutError:
                codes = [c or RequestTimedOutError.code for c in codes]
        return codes

    def _append(
        self, p: Partition, marker: m.TxnMarker, topic: str, index: int
    ) -> tuple[bool, int]:
        """Append one marker (unless the partition applied its decision already: a retry);
        whether it was appended, and the offset to wait for."""
        pid = marker.producer_id
        token = p.log.transactions.tokens.get(pid, -1)
        if token > marker.coordinator_epoch:
            raise TransactionCoordinatorFencedError(
                f"{topic}-{index} applied producer {pid}'s decision {token} already,"
                f" newer than {marker.coordinator_epoch}"
            )
        if token == marker.coordinator_epoch:  # a retry: answer once it is replicated
            return False, p.log.log_end_offset
        known = p.log.producers.epoch_of(pid)
        if known is not None and marker.producer_epoch < known:
            raise InvalidProducerEpochError(
                f"{topic}-{index} has seen epoch {known} of producer {pid}, the marker is"
                f" for epoch {marker.producer_epoch}"
            )
        end = self._write_marker(
            p, pid, marker.producer_epoch, bool(marker.committed), marker.coordinator_epoch
        )
        return True, end

    def _write_marker(self, p: Partition, pid: int, epoch: int, commit: bool, token: int) -> int:
        """Append one marker to ``p``'s log; the offset after it."""
        batch = encode_marker(
            pid, epoch, commit=commit, coordinator_epoch=token, timestamp_ms=self.clock_ms()
        )
        info = p.log.append(
            batch,
            leader_epoch=p.state.leader_epoch,
            deep_check=False,
            marker=ControlMarker(commit, token),
        )
        self.markers_written += 1
        return info.last_offset + 1

    def abort_orphan(self, p: Partition, producer_id: int, epoch: int, token: int) -> None:
        """Append an abort marker for a hanging transaction on ``p``, which this agent leads
        (``orphans.OrphanSweeper`` decided no coordinator ends it). Replicated like any
        append; the high watermark moves once the ISR has it."""
        self._write_marker(p, producer_id, epoch, False, token)
        p.appended()
        p.advance_hw()

    async def _replicated(self, p: Partition, end: int) -> None:
        """Wait until ``end`` is durable here and below the high watermark (acks=all)."""
        epoch = p.state.leader_epoch
        async with asyncio.timeout(self.replication_timeout):
            await p.committer.wait_acknowledgeable(end)
            while p.high_watermark < end:
                if p.role != "leader" or p.state.leader_epoch != epoch:
                    raise NotLeaderError(
                        f"leadership of {p.topic}-{p.index} moved before the marker was replicated",
                        leader_id=p.state.leader,
                        leader_epoch=p.state.leader_epoch,
                    )
                await asyncio.shield(p.hw_moved)


class ClusterRoutes:
    """``Routes`` from this agent's view: partition leaders from the partition states it
    watches, group coordinators by the group coordinator's placement rule."""

    def __init__(
        self,
        latest: Mapping[tuple[str, int], PartitionState],
        view: ClusterView,
        group_coordinator: Callable[[str], int | None],
    ) -> None:
        self.latest = latest
        self.view = view
        self._group_coordinator = group_coordinator

    def leader_of(self, topic: str, partition: int) -> int | None:
        state = self.latest.get((topic, partition))
        if state is None or state.leader not in self.view.agents:
            return None
        return state.leader

    def topic_exists(self, topic: str) -> bool:
        return topic in self.view.topics

    def group_coordinator(self, group_id: str) -> int | None:
        return self._group_coordinator(group_id)

    def address(self, agent_id: int) -> tuple[str, int] | None:
        reg = self.view.agents.get(agent_id)
        return None if reg is None else (reg.host, reg.port)
