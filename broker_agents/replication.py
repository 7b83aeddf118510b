"""Followers: copy the leader's batches, byte for byte, by fetching like a consumer.

For every leader this agent follows partitions of, one named task keeps a connection to the
leader and long-polls it with a Fetch request (``replica_id`` = this agent) for all those
partitions from each local log end. Batches come back exactly as the leader stored them and
are appended with the leader's base offset and leader epoch (the CRC is checked again; the
body was deep-checked by the leader). Before fetching a partition (at start, and after every
leadership change) the follower asks the leader where its latest leader epoch ended and cuts
its log there (KIP-101, ``_truncate_by_epoch``), so what it wrote in an epoch the leader does
not have is gone before it appends; an OFFSET_OUT_OF_RANGE answer with the follower ahead of
the leader's high watermark still truncates to it, and one with the follower's log ending
below the leader's log start (retention there, ``broker_agents.retention``) restarts the
follower's log at that start. Under ``fsync.policy=always`` the next
fetch waits for the fsync of what the last one appended (``_acknowledgeable``): a fetch offset
is what the leader counts toward acks=all.

**Moves are throttled.** A replica being added by a reassignment (this agent in the state's
``adding``: a rebalance, a decommission, a replacement) copies at most
``follower.replication.throttled.rate`` bytes a second, all such replicas of the agent
together (a token bucket, ``MoveThrottle``): a move of a big partition at full speed took both
cores of a small machine and multiplied the produce p99 of everything else
(``make bench-rebalance``). In-sync followers are never throttled, and never wait behind a
move: the replicas being added are fetched from their leader on a connection and task of
their own (the *move lane*), so a move's big fetches, appends and fsyncs do not hold up the
fetches that advance the high watermark of the partitions already in sync (and so their
acks=all answers). A replica switches lanes when the move completes.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import ssl
import struct
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from storage.codec import iter_batches
from storage.errors import MetadataError, OffsetOutOfRangeError, StrataError
from storage.protocol import encode_request, parse_response, read_size
from storage.protocol import messages as m
from storage.protocol.schema import Message

if TYPE_CHECKING:
    from broker_agents.config import AgentConfig
    from broker_agents.partitions import Partition, PartitionManager
    from broker_agents.view import ClusterView
    from sdk.connection import Login
    from storage.metadata import MetadataStore

log = logging.getLogger(__name__)


class MoveThrottle:
    """A token bucket of bytes a second (a second's worth of burst); spending may go into
    debt by the one batch a fetch returns past its limit, paid back before the next."""

    def __init__(self, rate: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = rate
        self.clock = clock
        self.tokens = float(rate)
        self._at = clock()

    def available(self) -> int:
        now = self.clock()
        self.tokens = min(float(self.rate), self.tokens + (now - self._at) * self.rate)
        self._at = now
        return max(0, int(self.tokens))

    def spend(self, nbytes: int) -> None:
        self.tokens -= nbytes

    def wait_s(self) -> float:
        """Seconds until there is something to spend."""
        return max(0.0, (1.0 - self.tokens) / self.rate)


class ReplicaFetchers:
    """One fetch task per leader this agent follows partitions of, and per lane (in sync, or
    being added by a move).

    A task that dies of an unexpected error (the expected ones — connection loss, timeouts,
    protocol errors — are retried inside it) is logged and started again after
    ``restart_delay`` seconds, so a bug met once cannot stop replication from that leader
    until the next leadership change.
    """

    restart_delay = 1.0

    def __init__(
        self,
        agent_id: int,
        partitions: PartitionManager,
        view: ClusterView,
        config: AgentConfig,
        *,
        tls: Callable[[], ssl.SSLContext] | None = None,
        login: Login | None = None,
    ) -> None:
        self.agent_id = agent_id
        #: the leaders' listener is TLS: their current client context
        self.tls = tls
        #: the leaders' listener is SASL: how this agent logs in (``sdk.auth``)
        self.login = login
        self.partitions = partitions
        self.view = view
        self.config = config
        #: one fetch task per (leader, lane): lane ``True`` follows the replicas being added by
        #: a move, ``False`` the others, so a move's big fetches, appends and fsyncs never hold
        #: up the replication (and so the acks=all answers) of the partitions already in sync
        self.tasks: dict[tuple[int, bool], asyncio.Task[None]] = {}
        rate = config.follower_replication_throttled_rate
        self.throttle = MoveThrottle(rate) if rate > 0 else None
        self._stopped = False

    def update(self) -> None:
        """Start or stop per-leader fetch tasks to match the follower roles right now."""
        if self._stopped:
            return
        lanes = {
            (p.state.leader, self._lane(p))
            for p in self.partitions.partitions.values()
            if p.role == "follower" and p.state.leader >= 0 and p.state.leader != self.agent_id
        }
        for lane in lanes:
            if lane not in self.tasks:
                leader, moving = lane
                name = f"replica-fetcher:{leader}{':move' if moving else ''}"
                task = asyncio.create_task(self._follow(leader, moving), name=name)
                task.add_done_callback(functools.partial(self._finished, lane))
                self.tasks[lane] = task
        for lane in set(self.tasks) - lanes:
            self.tasks.pop(lane).cancel()

    def _lane(self, p: Partition) -> bool:
        return self.agent_id in p.state.adding

    def _finished(self, lane: tuple[int, bool], task: asyncio.Task[None]) -> None:
        if task.cancelled() or task.exception() is None:
            return
        log.error(
            "replica fetcher %s died; restarting it", task.get_name(), exc_info=task.exception()
        )
        if self.tasks.get(lane) is task:
            del self.tasks[lane]
        asyncio.get_running_loop().call_later(self.restart_delay, self.update)

    async def stop(self) -> None:
        self._stopped = True
        for t in self.tasks.values():
            t.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)
        self.tasks.clear()

    async def _login(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, correlation: int
    ) -> int:
        """Authenticate a new connection to a leader (SASL listener); the last correlation."""
        assert self.login is not None
        counter = [correlation]

        async def send(body: Message) -> object:
            counter[0] += 1
            key = next(a.key for a in m.APIS.values() if isinstance(body, a.request))
            writer.writelines(encode_request(key, counter[0], f"agent-{self.agent_id}", body))
            await writer.drain()
            async with asyncio.timeout(10):
                size = read_size(await reader.readexactly(4), 1 << 20)
                frame = parse_response(await reader.readexactly(size))
            err = frame.error()
            if err is not None:
                raise err
            return m.APIS[key].response.decode(frame.body)

        await self.login(send)
        return counter[0]

    def _followed(self, leader: int, moving: bool) -> list[Partition]:
        return [
            p
            for p in self.partitions.partitions.values()
            if p.role == "follower" and p.state.leader == leader and self._lane(p) == moving
        ]

    async def _follow(self, leader: int, lane: bool) -> None:
        correlation = 0
        backoff = 0.05
        while True:
            reg = self.view.agents.get(leader)
            if reg is None or not self._followed(leader, lane):
                await asyncio.sleep(0.1)
                continue
            try:
                async with asyncio.timeout(5):
                    reader, writer = await asyncio.open_connection(
                        reg.host,
                        reg.port,
                        ssl=self.tls() if self.tls is not None else None,
                    )
            except (OSError, TimeoutError) as exc:
                if isinstance(exc, ssl.SSLError):
                    log.warning("TLS handshake with leader %d failed: %s", leader, exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 1.0)
                continue
            try:
                if self.login is not None:
                    correlation = await self._login(reader, writer, correlation)
                while True:
                    partitions = self._followed(leader, lane)
                    if not partitions:
                        break
                    unchecked = [p for p in partitions if p.needs_epoch_check]
                    if unchecked:
                        correlation += 1
                        await self._truncate_by_epoch(reader, writer, correlation, unchecked)
                        continue
                    moving = self._moving(partitions)
                    allowance = self.throttle.available() if moving and self.throttle else 0
                    if moving and not allowance:
                        partitions = [p for p in partitions if (p.topic, p.index) not in moving]
                        if not partitions:
                            assert self.throttle is not None
                            await asyncio.sleep(self.throttle.wait_s())
                            continue
                    correlation += 1
                    req = self._request(partitions, moving, allowance)
                    writer.writelines(
                        encode_request(m.ApiKey.FETCH, correlation, f"agent-{self.agent_id}", req)
                    )
                    await writer.drain()
                    timeout = self.config.replica_fetch_wait_max_ms / 1000 + 10
                    async with asyncio.timeout(timeout):
                        size = read_size(await reader.readexactly(4), 1 << 30)
                        frame = parse_response(await reader.readexactly(size))
                    err = frame.error()
                    if err is not None:
                        raise err
                    resp = m.FetchResponse.decode(frame.body)
                    if moving and self.throttle is not None:
                        self.throttle.spend(_bytes_of(resp, moving))
                    appended = self._apply(resp, partitions)
                    await self._acknowledgeable(appended)
                    backoff = 0.05
            except (
                OSError,
                TimeoutError,
                asyncio.IncompleteReadError,
                StrataError,
                struct.error,
            ) as exc:
                log.info("replica fetch from agent %d failed: %s", leader, exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 1.0)
            finally:
                writer.close()
                with contextlib.suppress(Exception):
                    await writer.wait_closed()

    async def _truncate_by_epoch(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        correlation: int,
        partitions: list[Partition],
    ) -> None:
        """KIP-101: ask the leader where our latest epoch ended, and cut our log there.

        Whatever this follower wrote in an epoch past the point where the leader's log left
        that epoch was never committed (the leader does not have it): it goes. Repeats until
        the latest epoch of our log is one the leader agrees with.
        """
        by_topic: dict[str, list[m.EpochQuery]] = {}
        for p in partitions:
            by_topic.setdefault(p.topic, []).append(m.EpochQuery(p.index, p.log.latest_epoch))
        req = m.OffsetForLeaderEpochRequest(
            self.agent_id, [m.EpochQueryTopic(t, qs) for t, qs in by_topic.items()]
        )
        writer.writelines(
            encode_request(
                m.ApiKey.OFFSET_FOR_LEADER_EPOCH, correlation, f"agent-{self.agent_id}", req
            )
        )
        await writer.drain()
        async with asyncio.timeout(10):
            size = read_size(await reader.readexactly(4), 1 << 24)
            frame = parse_response(await reader.readexactly(size))
        err = frame.error()
        if err is not None:
            raise err
        resp = m.OffsetForLeaderEpochResponse.decode(frame.body)
        hosted = {(x.topic, x.index): x for x in partitions}
        for topic in resp.topics:
            for r in topic.partitions:
                found = hosted.get((topic.name, r.partition))
                if found is None or r.error_code:
                    continue
                p = found
                asked = p.log.latest_epoch
                if asked < 0 or r.end_offset < 0:
                    p.needs_epoch_check = False
                    continue
                if r.end_offset < p.log.log_end_offset:
                    log.info(
                        "%s-%d: epoch %d ends at %d on the leader; truncating %d divergent records",
                        p.topic,
                        p.index,
                        asked,
                        r.end_offset,
                        p.log.log_end_offset - r.end_offset,
                    )
                    p.log.truncate_to(max(r.end_offset, p.log.log_start_offset))
                # done once the leader knows our latest epoch; otherwise ask again about the
                # (older) epoch our log now ends with
                if r.leader_epoch == asked or p.log.latest_epoch == asked or p.log.latest_epoch < 0:
                    p.needs_epoch_check = False

    def _moving(self, partitions: list[Partition]) -> set[tuple[str, int]]:
        """The partitions this agent is being added to by a move (throttled), if throttled."""
        if self.throttle is None:
            return set()
        return {(p.topic, p.index) for p in partitions if self.agent_id in p.state.adding}

    def _request(
        self,
        partitions: list[Partition],
        moving: set[tuple[str, int]] | None = None,
        allowance: int = 0,
    ) -> m.FetchRequest:
        # with the topic id: a follower never appends another incarnation's batches
        by_topic: dict[tuple[str, str], list[m.FetchPartition]] = {}
        limit = self.config.replica_fetch_max_bytes
        moving = moving or set()
        share = max(1, allowance // max(1, len(moving)))
        for p in partitions:
            by_topic.setdefault((p.topic, p.topic_id), []).append(
                m.FetchPartition(
                    p.index,
                    p.log.log_end_offset,
                    min(limit, share) if (p.topic, p.index) in moving else limit,
                    p.state.leader_epoch,
                )
            )
        return m.FetchRequest(
            self.agent_id,
            self.config.replica_fetch_wait_max_ms,
            1,
            self.config.replica_fetch_max_bytes,
            0,
            [m.FetchTopic(t, ps, tid or None) for (t, tid), ps in by_topic.items()],
        )

    @staticmethod
    async def _acknowledgeable(partitions: list[Partition]) -> None:
        """Before the next fetch, which tells the leader (and its high watermark, and so
        acks=all) that this follower has everything below its fetch offset, wait as the
        partition's ``fsync.policy`` requires of any acknowledgement: under ``always`` the
        group-commit fsync of what was just appended, so an acknowledged record is on the disk
        of every in-sync replica and survives all of them losing power at once; under
        ``interval`` and ``never``, nothing (in memory, as Kafka's acks=all)."""
        waits = [
            p.committer.wait_acknowledgeable(end)
            for p in partitions
            if not p.committer.acknowledgeable(end := p.log.log_end_offset)
        ]  # (none under ``interval`` and ``never``: no task per partition per fetch)
        if waits:
            await asyncio.gather(*waits)

    def _apply(self, resp: m.FetchResponse, partitions: list[Partition]) -> list[Partition]:
        """Append what the leader sent; returns the partitions that got records."""
        appended: list[Partition] = []
        hosted = {(p.topic, p.index): p for p in partitions}
        for topic in resp.topics:
            for r in topic.partitions:
                p = hosted.get((topic.name, r.partition))
                if p is None or p.role != "follower":
                    continue
                if r.error_code == OffsetOutOfRangeError.code:
                    if p.log.log_end_offset < r.log_start_offset:
                        # retention on the leader removed what this follower had yet to copy:
                        # nothing here is wanted any more; go on from the leader's log start
                        log.info(
                            "%s-%d: the leader's log starts at %d, past this log's end %d:"
                            " restarting the follower log there",
                            p.topic,
                            p.index,
                            r.log_start_offset,
                            p.log.log_end_offset,
                        )
                        p.log.restart_at(r.log_start_offset)
                        continue
                    if p.log.log_end_offset > r.high_watermark >= 0:
                        log.info(
                            "%s-%d: truncating follower log to the leader's high watermark %d",
                            p.topic,
                            p.index,
                            r.high_watermark,
                        )
                        p.log.truncate_to(r.high_watermark)
                    continue
                if r.error_code:
                    continue
                if r.records is None:
                    p.hw = max(p.hw, min(r.high_watermark, p.log.log_end_offset))
                    continue
                for h, pos in iter_batches(r.records):
                    end = p.log.log_end_offset
                    if h.next_offset <= end:
                        continue  # already have it
                    if h.base_offset != end:
                        raise StrataError(
                            f"{p.topic}-{p.index}: leader sent offset {h.base_offset}, log ends at {end}"
                        )
                    p.log.append(
                        r.records[pos : pos + h.size], leader_epoch=h.leader_epoch, deep_check=False
                    )
                    if not appended or appended[-1] is not p:
                        appended.append(p)
                p.hw = max(p.hw, min(r.high_watermark, p.log.log_end_offset))
                p.log.transactions.forget_stable(p.hw)
        return appended


class IsrMaintenance:
    """The leader's side of the ISR: every half ``replica.lag.time.max.ms`` it drops followers
    that have not been caught up for that long and takes back followers that have reached the
    high watermark, writing the new ISR to ZooKeeper with compare-and-set (a controller that
    changed the partition meanwhile wins; the watch brings its state). A member being added
    counts for the high watermark from before the write (``Partition.pending_isr``, Kafka's
    maximal ISR): the controller may elect it as soon as ZooKeeper names it in sync, so nothing
    may be acknowledged without it from then on. A member removed still counts until the
    watch delivers the smaller ISR.

    A follower outside the ISR whose fetch brings it up to the high watermark does not wait
    for the tick: the fetch ``wake``s the check (as Kafka expands the ISR on that fetch), at
    most one check per ``min_interval`` seconds, however many partitions ask."""

    def __init__(
        self,
        agent_id: int,
        partitions: PartitionManager,
        store: MetadataStore,
        view: ClusterView,
        config: AgentConfig,
        *,
        min_interval: float = 0.1,
    ) -> None:
        self.agent_id = agent_id
        self.partitions = partitions
        self.store = store
        self.view = view
        self.config = config
        self.changes = 0
        self.min_interval = min_interval
        self._wake = asyncio.Event()

    def wake(self) -> None:
        self._wake.set()

    async def run(self) -> None:
        lag = self.config.replica_lag_time_max_ms / 1000
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(lag / 2):
                    await self._wake.wait()
            self._wake.clear()
            await self.check(lag)
            await asyncio.sleep(self.min_interval)

    async def check(self, lag: float) -> None:
        pm = self.partitions
        if not pm.session_ok:
            return
        now = time.monotonic()
        for p in list(pm.partitions.values()):
            if p.role != "leader":
                continue
            isr = p.isr_changes(now, lag)
            if isr is None:
                continue
            # joining members count for the high watermark from now on (before the awaits
            # below): once ZooKeeper names them in sync, the controller may make one of them
            # leader, so no record may be acknowledged without them from then on
            joining = {r for r in isr if r not in p.state.isr}
            p.pending_isr |= joining
            before, p.pending_isr_version = p.pending_isr_version, float("inf")
            written = await self._write(p, isr)
            if written is None:
                p.pending_isr -= joining - set(p.state.isr)
                p.pending_isr_version = before
            else:
                p.pending_isr_version = written
            p.advance_hw()

    async def _write(self, p: Partition, isr: list[int]) -> int | None:
        """Write ``isr`` for ``p`` (compare-and-set); the version of the state node that has
        it, or None if ZooKeeper does not have it."""
        got = await self.store.get_partition_state(p.topic, p.index)
        if got is None:
            return None
        current, version = got
        if current.leader != self.agent_id or current.leader_epoch != p.state.leader_epoch:
            return None  # not ours any more: the watch will say so
        if sorted(current.isr) == sorted(isr):
            return version  # already written; the watch has not brought it yet
        agents = self.view.agents
        # only a registered follower that is not shutting down is taken back: the controller
        # drains one that shuts down, and drops one whose agent is gone from the ISR; this
        # leader's state may still name it (the drop not applied here yet), and taking it back
        # would undo the drop, over and over while its last catch-up is recent, holding the
        # high watermark for a replica that fetches nothing
        isr = [r for r in isr if r in current.isr or (r in agents and not agents[r].shutting_down)]
        if sorted(current.isr) == sorted(isr):
            return None
        incarnations = {a: reg.incarnation for a, reg in agents.items()}
        new = current.model_copy(
            update={"isr": isr, "incarnations": current.stamped(isr, incarnations)}
        )
        try:
            written = await self.store.cas_partition_state(p.topic, p.index, new, version)
        except MetadataError as exc:
            log.info("%s-%d: ISR change lost a race (%s)", p.topic, p.index, exc)
            return None
        self.changes += 1
        log.info("%s-%d: ISR %s -> %s", p.topic, p.index, current.isr, isr)
        return written


def _bytes_of(resp: m.FetchResponse, keys: set[tuple[str, int]]) -> int:
    """Record bytes ``resp`` carries for the partitions ``keys``."""
    return sum(
        len(r.records)
        for t in resp.topics
        for r in t.partitions
        if (t.name, r.partition) in keys and r.records is not None
    )
