"""What a client knows about the cluster, and its connections to the agents.

The client starts from ``bootstrap.servers`` (any agents; one is enough) and asks for
Metadata: the agents (id, host, port), and for each topic it cares about the partitions with
their leader and leader epoch. From then on it talks to leaders directly, one pooled
:class:`~sdk.connection.Connection` per agent address.

Metadata is refreshed

* on demand — ``request_update()`` after NOT_LEADER, UNKNOWN_TOPIC_OR_PARTITION,
  LEADER_NOT_AVAILABLE, a fenced epoch or a network error, and when a new topic is used;
* by age — every ``metadata.max.age.ms``;

by one long-lived loop (:meth:`Cluster.run`, under the client's supervisor) that backs off
exponentially while refreshes fail. A refresh asks the known agents in random order, then
the bootstrap servers in order, each with a deadline. A partition's leader never moves back to
an older leader epoch than the one already known (metadata from a lagging agent is ignored for
that partition), as Kafka clients do.

Each topic's id (KIP-516) is kept too: a topic deleted and created again under the same name
has a new one, and the producer and consumer send the id they hold, so they never write into
or read from another incarnation than the one they mean (``UNKNOWN_TOPIC_ID`` /
``INCONSISTENT_TOPIC_ID`` refresh the metadata, like the other errors below). Epochs of a new
incarnation are not compared with the old one's, and once an id has been replaced by another,
metadata naming the old one (from an agent that lags) is ignored for that topic.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass
from typing import Any

from sdk.auth import ScramLogin
from sdk.backoff import ExponentialBackoff
from sdk.config import ClientConfig
from sdk.connection import Connection, Spawn
from sdk.errors import IllegalStateError
from storage.errors import (
    FencedLeaderEpochError,
    InconsistentTopicIdError,
    LeaderNotAvailableError,
    NetworkError,
    NotLeaderError,
    RequestTimedOutError,
    SecurityError,
    StrataError,
    UnknownTopicIdError,
    UnknownTopicOrPartitionError,
    from_wire,
)
from storage.names import validate_topic_name
from storage.protocol import DEFAULT_MAX_FRAME
from storage.protocol.messages import MetadataRequest, MetadataResponse
from storage.protocol.schema import Message
from storage.tls import ReloadingContext, client_context

#: errors after which the client's view of leaders is suspect
STALE_METADATA_ERRORS: tuple[type[StrataError], ...] = (
    NotLeaderError,
    UnknownTopicOrPartitionError,
    LeaderNotAvailableError,
    FencedLeaderEpochError,
    NetworkError,
    RequestTimedOutError,
    UnknownTopicIdError,
    InconsistentTopicIdError,
)

_UNKNOWN_TOPIC = UnknownTopicOrPartitionError.code
_LEADER_NOT_AVAILABLE = LeaderNotAvailableError.code


@dataclass(frozen=True, slots=True)
class PartitionInfo:
    partition: int
    leader_id: int  # -1: none
    leader_epoch: int
    replicas: tuple[int, ...]
    isr: tuple[int, ...]
    error_code: int = 0


class Cluster:
    """Metadata cache plus connection pool; shared by a client's loops."""

    def __init__(
        self,
        config: ClientConfig,
        *,
        spawn: Spawn | None = None,
        clock: Callable[[], float] = time.monotonic,
        backoff: ExponentialBackoff | None = None,
        max_frame: int = DEFAULT_MAX_FRAME,
        rng: random.Random | None = None,
    ) -> None:
        self.config = config
        self._spawn = spawn
        self._clock = clock
        files = config.tls_files
        #: TLS: the client context, re-read when its files change (``storage.tls``)
        self._tls = None if files is None else ReloadingContext(files, client_context)
        self._login: ScramLogin | None = None
        if config.security_protocol.sasl:
            assert config.sasl_username is not None and config.sasl_password is not None
            self._login = ScramLogin(
                config.sasl_mechanism,
                config.sasl_username,
                config.sasl_password.get_secret_value(),
            )
        self._backoff = backoff or ExponentialBackoff(
            config.retry_backoff_ms, config.effective_backoff_max_ms
        )
        self._max_frame = max_frame
        self._rng = rng or random.Random()
        self._agents: dict[int, tuple[str, int]] = {}
        self._partitions: dict[str, dict[int, PartitionInfo]] = {}
        self._available: dict[str, list[int]] = {}
        self._topic_errors: dict[str, StrataError] = {}
        self._delay_max_ms: dict[str, int] = {}
        self._topic_ids: dict[str, str] = {}
        #: the last id seen of each topic, and ids replaced since (never taken back)
        self._last_ids: dict[str, str] = {}
        self._retired_ids: dict[str, set[str]] = {}
        self._topics: set[str] = set()
        self.controller_id = -1
        #: (address, channel) -> connection; see ``send``
        self._pool: dict[tuple[tuple[str, int], str], Connection] = {}
        self._refresh_lock = asyncio.Lock()
        self._update_requested = asyncio.Event()
        self._changed = asyncio.Event()
        self._listeners: list[Callable[[], None]] = []
        self.version = 0
        self.last_refresh = float("-inf")
        self.last_error: StrataError | None = None
        self._closed = False

    # ---- what is known -------------------------------------------------------------------
    @property
    def agents(self) -> dict[int, tuple[str, int]]:
        return dict(self._agents)

    @property
    def topics(self) -> frozenset[str]:
        return frozenset(self._topics)

    def partitions(self, topic: str) -> dict[int, PartitionInfo] | None:
        return self._partitions.get(topic)

    def partition_count(self, topic: str) -> int | None:
        parts = self._partitions.get(topic)
        return len(parts) if parts else None

    def available_partitions(self, topic: str) -> list[int]:
        """Partitions of ``topic`` whose leader is known (computed once per metadata update,
        not per call: the producer asks at every closed batch)."""
        return self._available.get(topic, [])

    def leader_for(self, topic: str, partition: int) -> int | None:
        """The leader agent's id, or None when unknown (then ``request_update`` is wise)."""
        parts = self._partitions.get(topic)
        info = parts.get(partition) if parts else None
        if info is None or info.leader_id < 0 or info.leader_id not in self._agents:
            return None
        return info.leader_id

    def leader_epoch(self, topic: str, partition: int) -> int:
        parts = self._partitions.get(topic)
        info = parts.get(partition) if parts else None
        return -1 if info is None else info.leader_epoch

    def delay_max_ms(self, topic: str) -> int:
        """The topic's ``delay.max.ms`` as the agents last said (-1: not known)."""
        return self._delay_max_ms.get(topic, -1)

    def topic_id(self, topic: str) -> str | None:
        """The id of the incarnation of ``topic`` the metadata names (None: unknown)."""
        return self._topic_ids.get(topic)

    def topic_error(self, topic: str) -> StrataError | None:
        return self._topic_errors.get(topic)

    def add_listener(self, callback: Callable[[], None]) -> None:
        """``callback()`` runs after every metadata update."""
        self._listeners.append(callback)

    # ---- refreshing ----------------------------------------------------------------------
    def add_topics(self, topics: Iterable[str]) -> None:
        new = set(topics) - self._topics
        if new:
            self._topics |= new
            self.request_update()

    def request_update(self) -> None:
        self._update_requested.set()

    @property
    def update_requested(self) -> bool:
        return self._update_requested.is_set()

    def is_stale(self, now: float | None = None) -> bool:
        now = self._clock() if now is None else now
        return now - self.last_refresh >= self.config.metadata_max_age_ms / 1000

    async def bootstrap(self, max_wait: float | None = None) -> None:
        """Refresh until one succeeds or ``max_wait`` s (default request.timeout.ms) pass."""
        limit = self.config.request_timeout_ms / 1000 if max_wait is None else max_wait
        attempt = 0
        try:
            async with asyncio.timeout(limit):
                while True:
                    try:
                        await self.refresh()
                        return
                    except StrataError as exc:
                        if not exc.retriable:
                            raise
                        await asyncio.sleep(self._backoff(attempt))
                        attempt += 1
        except TimeoutError:
            raise NetworkError(
                f"no bootstrap server of {', '.join(self.config.bootstrap_servers)} answered "
                f"within {limit * 1000:.0f} ms (last error: {self.last_error})"
            ) from None

    async def refresh(self) -> None:
        """Fetch metadata now (concurrent callers share one refresh)."""
        version = self.version
        async with self._refresh_lock:
            if self.version != version:
                return
            await self._refresh()

    async def _refresh(self) -> None:
        self._update_requested.clear()
        candidates: list[tuple[str, int]] = list(self._agents.values())
        self._rng.shuffle(candidates)
        candidates += [a for a in self.config.addresses if a not in candidates]
        # least loaded first (Kafka's rule): the agent answers a connection's requests in order,
        # so behind a long-poll fetch or an acks=all produce the answer would wait for them
        candidates.sort(key=self._load)
        request = MetadataRequest(topics=sorted(self._topics))
        errors = []
        refused = True  # every agent refused who we are (not retriable: raised as such)
        for address in candidates:
            try:
                conn = await self._connection(address)
                response: MetadataResponse = await conn.request(request)
            except StrataError as exc:
                errors.append(f"{address[0]}:{address[1]}: {exc}")
                self.last_error = exc
                refused = refused and isinstance(exc, SecurityError)
                continue
            self.apply_metadata(response)
            return
        text = "metadata refresh failed: " + "; ".join(errors)
        err: StrataError = NetworkError(text)
        if refused and self.last_error is not None:
            err = type(self.last_error)(text)
        self.last_error = err
        raise err

    def apply_metadata(self, response: MetadataResponse) -> None:
        """Take in a Metadata response (the pure half of a refresh)."""
        self._agents = {a.agent_id: (a.host, a.port) for a in response.agents}
        self.controller_id = response.controller_id
        partitions: dict[str, dict[int, PartitionInfo]] = {}
        errors: dict[str, StrataError] = {}
        delay_max: dict[str, int] = {}
        topic_ids: dict[str, str] = {}
        for t in response.topics:
            if t.error_code and t.error_code != _LEADER_NOT_AVAILABLE:
                errors[t.name] = from_wire(t.error_code, f"topic {t.name!r}: error {t.error_code}")
                continue
            old = self._partitions.get(t.name, {})
            if t.topic_id:
                if t.topic_id in self._retired_ids.get(t.name, ()):
                    # a lagging agent's view of a deleted incarnation: keep what we know
                    if t.name in self._partitions:
                        partitions[t.name] = self._partitions[t.name]
                    if t.name in self._topic_ids:
                        topic_ids[t.name] = self._topic_ids[t.name]
                    if t.name in self._delay_max_ms:
                        delay_max[t.name] = self._delay_max_ms[t.name]
                    continue
                last = self._last_ids.setdefault(t.name, t.topic_id)
                if last != t.topic_id:
                    # the topic was deleted and created again: a new incarnation, whose
                    # leader epochs say nothing of the old one's
                    self._retired_ids.setdefault(t.name, set()).add(last)
                    self._last_ids[t.name] = t.topic_id
                    old = {}
                topic_ids[t.name] = t.topic_id
            parts: dict[int, PartitionInfo] = {}
            for p in t.partitions:
                info = PartitionInfo(
                    p.partition,
                    p.leader_id,
                    p.leader_epoch,
                    tuple(p.replicas),
                    tuple(p.isr),
                    p.error_code,
                )
                prev = old.get(p.partition)
                if prev is not None and 0 <= info.leader_epoch < prev.leader_epoch:
                    info = prev  # a lagging agent's view: keep the newer leader
                parts[p.partition] = info
            if parts:
                partitions[t.name] = parts
                delay_max[t.name] = t.delay_max_ms
        self._partitions = partitions
        self._available = {
            name: [p for p, i in parts.items() if i.leader_id >= 0 and i.leader_id in self._agents]
            for name, parts in partitions.items()
        }
        self._delay_max_ms = delay_max
        self._topic_errors = errors
        self._topic_ids = topic_ids
        self.version += 1
        self.last_refresh = self._clock()
        self.last_error = None
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()
        for callback in self._listeners:
            callback()

    async def wait_for_update(self, max_wait: float) -> bool:
        """Wait for the next metadata update; False if ``max_wait`` seconds passed first."""
        changed = self._changed
        try:
            async with asyncio.timeout(max(max_wait, 0)):
                await changed.wait()
        except TimeoutError:
            return False
        return True

    async def wait_for_topic(self, topic: str, max_wait: float) -> int:
        """The partition count of ``topic``, waiting up to ``max_wait`` s for it to appear.
        A name no topic can have raises ``InvalidTopicError`` at once."""
        if self.partition_count(topic) is None:
            validate_topic_name(topic)
        deadline = self._clock() + max_wait
        self.add_topics([topic])
        while True:
            n = self.partition_count(topic)
            if n:
                return n
            err = self._topic_errors.get(topic)
            if err is not None and not err.retriable:
                raise from_wire(err.code, str(err))
            remaining = deadline - self._clock()
            if remaining <= 0:
                raise UnknownTopicOrPartitionError(
                    f"topic {topic!r} not present in metadata after {max_wait * 1000:.0f} ms"
                    + (f" (last error: {self.last_error})" if self.last_error else "")
                )
            self.request_update()
            await self.wait_for_update(remaining)

    async def run(self) -> None:
        """The refresh loop: on request, by age, with backoff while refreshes fail."""
        max_age = self.config.metadata_max_age_ms / 1000
        idle = self.config.connections_max_idle_ms / 1000
        failures = 0
        while not self._closed:
            now = self._clock()
            wait = max(0.0, self.last_refresh + max_age - now)
            wait = min(wait, max(idle / 4, 0.05))
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait):
                    await self._update_requested.wait()
            await self.close_idle()
            if not (self._update_requested.is_set() or self.is_stale()):
                continue
            try:
                await self.refresh()
                failures = 0
            except StrataError:
                await asyncio.sleep(self._backoff(failures))
                failures += 1
                self.request_update()
            else:
                # do not refresh again sooner than retry.backoff.ms, whatever asks
                await asyncio.sleep(self.config.retry_backoff_ms / 1000)

    # ---- connections ---------------------------------------------------------------------
    async def _connection(self, address: tuple[str, int], channel: str = "") -> Connection:
        if self._closed:
            raise NetworkError("the client is closed")
        conn = self._pool.get((address, channel))
        if conn is None or conn.closed:
            conn = Connection(
                address[0],
                address[1],
                client_id=self.config.client_id,
                request_timeout_ms=self.config.request_timeout_ms,
                connect_timeout_ms=self.config.socket_connection_setup_timeout_ms,
                max_in_flight=self.config.max_in_flight_requests_per_connection,
                max_frame=self._max_frame,
                spawn=self._spawn_reader,
                clock=self._clock,
                ssl_context=None if self._tls is None else self._tls.get(),
                login=self._login,
            )
            self._pool[(address, channel)] = conn
        await conn.connect()
        return conn

    def _spawn_reader(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        if self._spawn is None:
            return asyncio.get_running_loop().create_task(coro, name=name)
        try:
            return self._spawn(coro, name)
        except RuntimeError as exc:  # the supervisor is shutting down
            coro.close()
            raise IllegalStateError(f"the client is closing: {exc}") from None

    async def connection_for(self, agent_id: int, channel: str = "") -> Connection:
        address = self._agents.get(agent_id)
        if address is None:
            self.request_update()
            raise LeaderNotAvailableError(f"agent {agent_id} is not in the metadata")
        return await self._connection(address, channel)

    async def send(
        self,
        agent_id: int,
        body: Message,
        *,
        request_timeout: float | None = None,
        expect_response: bool = True,
        channel: str = "",
        on_sent: Callable[[], None] | None = None,
    ) -> Any:
        """One request to one agent; network trouble also asks for fresh metadata.

        An agent answers a connection's requests in the order they were sent, so a request
        that waits at the agent (a JoinGroup until the rebalance completes, a long-poll
        fetch) holds up the answers behind it. Requests that may wait long and are not the
        data path go on their own ``channel`` (a separate connection to the same agent), as
        Kafka clients talk to the group coordinator on a connection of its own."""
        try:
            conn = await self.connection_for(agent_id, channel)
            return await conn.request(
                body,
                request_timeout=request_timeout,
                expect_response=expect_response,
                on_sent=on_sent,
            )
        except (NetworkError, RequestTimedOutError):
            self.request_update()
            raise

    def _load(self, address: tuple[str, int]) -> int:
        """Requests in flight on the data connection to ``address`` (0 when there is none)."""
        conn = self._pool.get((address, ""))
        return 0 if conn is None or conn.closed else conn.in_flight

    def in_flight(self, agent_id: int) -> int:
        address = self._agents.get(agent_id)
        return 0 if address is None else self._load(address)

    async def close_idle(self) -> None:
        now = self._clock()
        limit = self.config.connections_max_idle_ms / 1000
        for key, conn in list(self._pool.items()):
            if conn.closed or conn.idle_for(now) >= limit:
                del self._pool[key]
                await conn.close()

    async def close(self) -> None:
        self._closed = True
        self._update_requested.set()
        pool, self._pool = self._pool, {}
        for conn in pool.values():
            await conn.close()
