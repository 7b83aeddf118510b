"""Request handlers: one coroutine per API, from decoded request to response body.

Handlers never raise for a partition-level problem: each partition's result carries its own
error code, so one bad partition cannot fail the others. Anything a client sent that is
wrong (a corrupt batch, an oversized batch, an unknown topic) is answered with the typed
error's code and leaves every log unchanged.

Transactions: a producer's control batch is refused (markers come from the transaction
coordinator only, ``broker_agents.transactions``); a ``read_committed`` fetch reads below
the partition's last stable offset and gets the aborted transactions of what it returns
(from the local log's per-segment index, or from the footers of tiered segments).

Ordering: a produce handler appends to the log *before* its first ``await``. The server starts
handlers in request order, so pipelined produce requests on one connection append in order,
while their fsync waits overlap (group commit).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from storage.codec import check_batch, iter_batches
from storage.codec.parts import BatchParts
from storage.errors import (
    BatchTooLargeError,
    CorruptBatchError,
    FencedLeaderEpochError,
    InconsistentTopicIdError,
    InvalidFilterError,
    InvalidRecordError,
    InvalidRequestError,
    InvalidTopicError,
    NotEnoughReplicasAfterAppendError,
    NotEnoughReplicasError,
    NotLeaderError,
    OffsetOutOfRangeError,
    RequestTimedOutError,
    StrataError,
    UnknownTopicIdError,
    UnknownTopicOrPartitionError,
    UnsupportedVersionError,
)
from storage.filters import Filter, FilterScan, parse
from storage.names import validate_topic_name
from storage.protocol import messages as m
from storage.protocol.schema import Message

if TYPE_CHECKING:
    from broker_agents.config import AgentConfig
    from broker_agents.partitions import Partition, PartitionManager
    from broker_agents.view import ClusterView

Handler = Callable[[Any], Awaitable[Message]]
log = logging.getLogger(__name__)


Tiered = memoryview | FilterScan | StrataError
"""A tier read for one partition of a fetch: its batches, a filtered scan of them, or why not."""


class TierAccess(Protocol):
    """What the request handlers need of the object tier (``broker_agents.tiering``)."""

    def check_backlog(self, p: Partition) -> None: ...
    async def prefetch(
        self, req: m.FetchRequest, filters: Mapping[tuple[str, int], Filter]
    ) -> dict[tuple[str, int], Tiered] | None: ...
    def log_start(self, p: Partition) -> int: ...
    async def offset_for_timestamp(self, p: Partition, ts: int) -> int | None: ...
    async def aborted(self, p: Partition, start: int, end: int) -> list[m.AbortedTransaction]: ...


def _code(exc: BaseException) -> int:
    return exc.code if isinstance(exc, StrataError) else StrataError.code


def _aborted(p: Partition, start: int, end: int) -> list[m.AbortedTransaction] | None:
    """The aborted transactions with batches in ``[start, end)`` of the local log."""
    found = p.log.aborted(start, end)
    return [
        m.AbortedTransaction(a.producer_id, a.first_offset, a.last_offset) for a in found
    ] or None


def _offset_range(chunk: memoryview) -> tuple[int, int] | None:
    """(first base offset, next offset) of the whole batches in ``chunk`` (headers only)."""
    first = end = -1
    for h, _ in iter_batches(chunk):
        if first < 0:
            first = h.base_offset
        end = h.next_offset
    return None if first < 0 else (first, end)


@functools.lru_cache(maxsize=256)
def parse_filter(text: str) -> Filter:
    """A fetch's filter, parsed once per distinct text (consumers send the same one)."""
    return parse(text)


#: the local log is scanned in reads of at most this many bytes
SCAN_READ_BYTES = 4 << 20


@dataclass(slots=True)
class _Progress:
    """A filtered partition of one fetch request across its long-poll rounds: before
    ``skip_to`` nothing matched (the next round scans from there); ``scanned`` bytes so far."""

    skip_to: int
    scanned: int = 0


def check_topic_id(requested: str | None, p: Partition) -> None:
    """A request that names a topic id is served by that incarnation's log only (KIP-516)."""
    if requested and p.topic_id and requested != p.topic_id:
        raise InconsistentTopicIdError(
            f"{p.topic}-{p.index} is topic id {p.topic_id}, not {requested}: the topic was "
            "deleted and created again; refresh metadata"
        )


def by_id(exc: StrataError, requested: str | None) -> StrataError:
    """An unknown topic, for a request that names a topic id, is an unknown topic id."""
    if requested and type(exc) is UnknownTopicOrPartitionError:
        return UnknownTopicIdError(f"no topic with id {requested} here: {exc}")
    return exc


def _one_journal(pending: list[tuple[m.ProducePartitionResult, Partition, int]]) -> bool:
    """Whether every partition of ``pending`` has its durability from one agent WAL."""
    first = getattr(pending[0][1].committer, "wal", None)
    return first is not None and all(
        getattr(p.committer, "wal", None) is first for _, p, _ in pending
    )


class Apis:
    def __init__(
        self,
        agent_id: int,
        config: AgentConfig,
        partitions: PartitionManager,
        view: ClusterView,
        tier: TierAccess,
        wake_isr: Callable[[], None],
        check_space: Callable[[int], None] = lambda nbytes: None,
    ) -> None:
        self.agent_id = agent_id
        self.config = config
        self.pm = partitions
        self.view = view
        self.tier = tier
        self.wake_isr = wake_isr
        self.check_space = check_space
        #: called with every filtered scan a fetch answers with (metrics)
        self.on_filter_scan: Callable[[FilterScan], None] | None = None
        self.handlers: dict[int, Handler] = {
            m.ApiKey.API_VERSIONS: self.api_versions,
            m.ApiKey.METADATA: self.metadata,
            m.ApiKey.PRODUCE: self.produce,
            m.ApiKey.FETCH: self.fetch,
            m.ApiKey.LIST_OFFSETS: self.list_offsets,
            m.ApiKey.OFFSET_FOR_LEADER_EPOCH: self.offset_for_leader_epoch,
        }

    # ---- ApiVersions ------------------------------------------------------------------------
    async def api_versions(self, req: m.ApiVersionsRequest) -> m.ApiVersionsResponse:
        return m.ApiVersionsResponse(
            0, [m.ApiVersionRange(a.key, a.min_version, a.max_version) for a in m.APIS.values()]
        )

    # ---- Metadata ---------------------------------------------------------------------------
    async def metadata(self, req: m.MetadataRequest) -> m.MetadataResponse:
        view = self.view
        agents = [
            m.AgentInfo(a.agent_id, a.host, a.port)
            for a in sorted(view.agents.values(), key=lambda a: a.agent_id)
        ]
        names = sorted(view.topics) if req.topics is None else req.topics
        topics = []
        if req.topics is None:  # a topic being deleted is gone for clients
            names = [n for n in names if view.topics[n].deletion is None]
        for name in names:
            spec = view.topics.get(name)
            if spec is None:
                try:
                    validate_topic_name(name)
                    code = UnknownTopicOrPartitionError.code
                except InvalidTopicError as exc:
                    code = exc.code  # no topic can have this name: not worth waiting for
                topics.append(m.TopicMetadata(code, name, []))
                continue
            if spec.deletion is not None:  # being deleted: gone for clients
                topics.append(m.TopicMetadata(UnknownTopicOrPartitionError.code, name, []))
                continue
            parts = []
            for p in range(spec.partitions):
                st = self.pm.latest.get((name, p))
                if st is None:
                    parts.append(m.PartitionMetadata(5, p, -1, -1, [], []))  # LEADER_NOT_AVAILABLE
                else:
                    err = 0 if st.leader >= 0 and st.leader in view.agents else 5
                    parts.append(
                        m.PartitionMetadata(err, p, st.leader, st.leader_epoch, st.replicas, st.isr)
                    )
            topics.append(m.TopicMetadata(0, name, parts, spec.config.delay_max_ms, spec.topic_id))
        return m.MetadataResponse(agents, view.controller_id, topics)

    # ---- Produce ----------------------------------------------------------------------------
    async def produce(self, req: m.ProduceRequest, *, checked: bool = False) -> m.ProduceResponse:
        """Append the request's batches and answer once they are acknowledgeable.

        ``checked``: every batch was built in this process, moments ago, from input already
        checked (the Kafka listener's), so neither its CRC nor its body is checked again;
        its header and size still are."""
        if req.acks not in (0, 1, -1):
            raise UnsupportedVersionError(f"acks must be 0, 1 or -1 (all), got {req.acks}")
        pending: list[tuple[m.ProducePartitionResult, Partition, int]] = []
        out = []
        for topic in req.topics:
            results = []
            for part in topic.partitions:
                result = m.ProducePartitionResult(part.partition, 0, None, -1, -1, -1, -1)
                try:
                    p = self.pm.leader_for_write(topic.name, part.partition)
                    check_topic_id(topic.topic_id, p)
                    result.leader_id, result.leader_epoch = p.state.leader, p.state.leader_epoch
                    self.tier.check_backlog(p)  # backpressure while S3 lags
                    # and before the disk fills (the request's bytes counted against the floor)
                    self.check_space(len(part.records) if part.records is not None else 0)
                    if req.acks == -1 and len(p.state.isr) < p.config.min_insync_replicas:
                        raise NotEnoughReplicasError(
                            f"{topic.name}-{part.partition} has {len(p.state.isr)} in-sync replicas,"
                            f" min.insync.replicas is {p.config.min_insync_replicas}"
                        )
                    end = self._append(p, part.records, checked=checked)
                    result.base_offset = end[0]
                    result.log_start_offset = p.log.log_start_offset
                    pending.append((result, p, end[1]))
                except StrataError as exc:
                    exc = by_id(exc, topic.topic_id)
                    result.error_code, result.error_message = exc.code, str(exc)
                    if isinstance(exc, NotLeaderError):
                        result.leader_id, result.leader_epoch = exc.leader_id, exc.leader_epoch
                results.append(result)
            out.append(m.ProduceTopicResult(topic.name, results))
        if req.acks != 0 and pending:
            await self._wait_durable(pending, req.timeout_ms, req.acks)
        return m.ProduceResponse(out)

    def _append(self, p: Partition, records: Any, *, checked: bool = False) -> tuple[int, int]:
        """Check every batch (and idempotent producers' sequences), then append them all;
        (first offset, end offset). Synchronous."""
        if records is None or len(records) == 0:
            raise CorruptBatchError("produce request without record batches")
        limit = p.config.max_message_bytes
        batches = []
        whole = (
            [(records.header, records)]
            if isinstance(records, BatchParts)  # built and checked by the Kafka listener
            else ((h, records[pos : pos + h.size]) for h, pos in iter_batches(records))
        )
        for h, view in whole:
            if h.is_control:
                raise InvalidRecordError(
                    "control batches (transaction markers) are written by the transaction"
                    " coordinator only"
                )
            if h.is_transactional and h.producer_id < 0:
                raise InvalidRecordError("a transactional batch needs a producer id")
            if not checked:
                if isinstance(view, BatchParts):
                    raise InvalidRequestError("a batch in parts must come checked")
                h = check_batch(view, max_size=limit, deep=True)
            elif h.size > limit:
                raise BatchTooLargeError(h.size, limit)
            batches.append((view, h))
        # idempotent producers: a retry of a stored batch gets its first offsets back
        duplicate = p.log.producers.check_run(h for _, h in batches)
        if duplicate is not None:
            return duplicate.base_offset, duplicate.last_offset + 1
        first = -1
        end = -1
        for view, header in batches:  # every batch checked before any is stored
            info = p.log.append(view, leader_epoch=p.state.leader_epoch, checked=header)
            if first < 0:
                first = info.base_offset
            end = info.last_offset + 1
        p.appended()
        p.advance_hw()
        return first, end

    async def _wait_durable(
        self,
        pending: list[tuple[m.ProducePartitionResult, Partition, int]],
        timeout_ms: int,
        acks: int,
    ) -> None:
        if acks == 1 and all(p.committer.acknowledgeable(end) for _, p, end in pending):
            return  # (``interval`` and ``never``: the leader's page cache is enough)

        async def one(result: m.ProducePartitionResult, p: Partition, end: int) -> None:
            epoch = p.state.leader_epoch
            try:
                await p.committer.wait_acknowledgeable(end)
                if acks == -1:
                    # every in-sync replica must have the records: wait for the high watermark
                    while p.high_watermark < end:
                        if p.role != "leader" or p.state.leader_epoch != epoch:
                            raise NotLeaderError(
                                f"leadership of {p.topic}-{p.index} moved before the records"
                                " were replicated; they are not acknowledged",
                                leader_id=p.state.leader,
                                leader_epoch=p.state.leader_epoch,
                            )
                        await asyncio.shield(p.hw_moved)
                    if len(p.state.isr) < p.config.min_insync_replicas:
                        raise NotEnoughReplicasAfterAppendError(
                            f"{p.topic}-{p.index}: the ISR shrank below min.insync.replicas"
                            " while the records were replicated"
                        )
            except StrataError as exc:
                result.error_code, result.error_message = exc.code, str(exc)
                if isinstance(exc, NotLeaderError):
                    result.leader_id, result.leader_epoch = exc.leader_id, exc.leader_epoch

        def timed_out(result: m.ProducePartitionResult) -> None:
            result.error_code = RequestTimedOutError.code
            result.error_message = f"not durable within {timeout_ms} ms"

        limit = max(timeout_ms, 1) / 1000
        if acks == 1 and len(pending) > 1 and _one_journal(pending):
            await self._wait_one_journal(pending, limit, timed_out)
            return
        if len(pending) == 1:  # the common case: no task, no asyncio.wait
            try:
                async with asyncio.timeout(limit):
                    await one(*pending[0])
            except TimeoutError:
                timed_out(pending[0][0])
            return
        tasks = [asyncio.ensure_future(one(*x)) for x in pending]
        _done, not_done = await asyncio.wait(tasks, timeout=limit)
        for (result, _, _), t in zip(pending, tasks, strict=True):
            if t in not_done:
                t.cancel()
                timed_out(result)

    @staticmethod
    async def _wait_one_journal(
        pending: list[tuple[m.ProducePartitionResult, Partition, int]],
        limit: float,
        timed_out: Callable[[m.ProducePartitionResult], None],
    ) -> None:
        """acks=1, every partition on one agent WAL: one fsync of the WAL covers them all, so
        they are waited for in turn, in one coroutine (after the first, the rest are mostly
        durable already), not with a task each: a request over 4,096 partitions made 4,096
        tasks per request."""
        left = iter(pending)
        try:
            async with asyncio.timeout(limit):
                for result, p, end in left:
                    try:
                        await p.committer.wait_acknowledgeable(end)
                    except StrataError as exc:
                        result.error_code, result.error_message = exc.code, str(exc)
        except TimeoutError:
            timed_out(result)
            for result, p, end in left:
                if not p.committer.acknowledgeable(end):
                    timed_out(result)

    # ---- Fetch ------------------------------------------------------------------------------
    async def fetch(self, req: m.FetchRequest) -> m.FetchResponse:
        """Long polling: answer once ``min_bytes`` are there, an error or a filtered scan's
        progress needs telling (``_filtered``), or ``max_wait_ms`` has passed; any new data on
        a requested partition makes it look again. A filtered partition waiting at the high
        watermark looks only at what arrived since its last round (``_Progress``)."""
        deadline = time.monotonic() + max(req.max_wait_ms, 0) / 1000
        filters = self._filters(req)
        usable = {k: f for k, f in filters.items() if isinstance(f, Filter)}
        tiered = await self.tier.prefetch(req, usable)  # offsets below the local log, from S3
        tier_aborted = await self._tier_aborted(req, tiered) if tiered else {}
        progress: dict[tuple[str, int], _Progress] = {}
        while True:
            waits: list[asyncio.Future[None]] = []
            response, total, answer_now, scans = self._collect(
                req, waits, tiered, filters, progress, tier_aborted
            )
            remaining = deadline - time.monotonic()
            if total >= req.min_bytes or answer_now or remaining <= 0 or not waits:
                if self.on_filter_scan is not None:
                    for scan in scans:
                        self.on_filter_scan(scan)
                return response
            await asyncio.wait(waits, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)

    async def _tier_aborted(
        self, req: m.FetchRequest, tiered: dict[tuple[str, int], Tiered]
    ) -> dict[tuple[str, int], list[m.AbortedTransaction]]:
        """read_committed: the aborted transactions of what the tier read returned (tiered
        segments hold ended transactions only, so the tier's part is all stable). A partition
        whose list cannot be read gets the error instead of its records."""
        if req.isolation_level != m.READ_COMMITTED or req.replica_id >= 0:
            return {}
        out = {}
        starts = {
            (t.name, fp.partition): fp.fetch_offset for t in req.topics for fp in t.partitions
        }
        for key, pre in list(tiered.items()):
            p = self.pm.hosted(*key)
            if p is None or isinstance(pre, StrataError):
                continue
            if isinstance(pre, FilterScan):
                start, end = starts[key], pre.next_offset
            else:
                bounds = _offset_range(pre)
                if bounds is None:
                    continue
                start, end = bounds
            if end > start:
                try:
                    out[key] = await self.tier.aborted(p, start, end)
                except StrataError as exc:
                    log.warning("aborted transactions of %s-%d from the tier: %s", *key, exc)
                    tiered[key] = exc
        return out

    def _filters(self, req: m.FetchRequest) -> dict[tuple[str, int], Filter | StrataError]:
        """The parsed filter of every partition that has one (or why it is refused)."""
        out: dict[tuple[str, int], Filter | StrataError] = {}
        for topic in req.topics:
            for fp in topic.partitions:
                if fp.filter is None:
                    continue
                key = (topic.name, fp.partition)
                if req.replica_id >= 0:
                    out[key] = InvalidRequestError("a follower's fetch cannot have a filter")
                    continue
                try:
                    out[key] = parse_filter(fp.filter)
                except InvalidFilterError as exc:
                    out[key] = exc
        return out

    def _collect(
        self,
        req: m.FetchRequest,
        waits: list[asyncio.Future[None]],
        tiered: Mapping[tuple[str, int], Tiered] | None,
        filters: Mapping[tuple[str, int], Filter | StrataError],
        progress: dict[tuple[str, int], _Progress],
        tier_aborted: Mapping[tuple[str, int], list[m.AbortedTransaction]],
    ) -> tuple[m.FetchResponse, int, bool, list[FilterScan]]:
        """One round: (response, bytes of records in it, whether to answer at once, the
        filtered partitions' scans)."""
        budget = max(req.max_bytes, 0)
        committed = req.isolation_level == m.READ_COMMITTED and req.replica_id < 0
        total = 0
        answer_now = False
        scans: list[FilterScan] = []
        topics = []
        for topic in req.topics:
            results = []
            for fp in topic.partitions:
                r = m.FetchPartitionResult(fp.partition, 0, -1, -1, -1, -1, None)
                key = (topic.name, fp.partition)
                try:
                    p = self._readable(topic.name, fp.partition, req.replica_id)
                    check_topic_id(topic.topic_id, p)
                    replica = req.replica_id >= 0
                    if replica:
                        if fp.current_leader_epoch not in (-1, p.state.leader_epoch):
                            raise FencedLeaderEpochError(
                                f"fetch for epoch {fp.current_leader_epoch}, the leader is at"
                                f" {p.state.leader_epoch}"
                            )
                        now = time.monotonic()
                        p.follower_fetched(req.replica_id, fp.fetch_offset, now)
                        lag = self.config.replica_lag_time_max_ms / 1000
                        if p.rejoins(req.replica_id, now, lag):
                            self.wake_isr()
                    r.high_watermark = p.high_watermark
                    r.log_start_offset = self.tier.log_start(p)
                    bound = p.high_watermark
                    if committed:
                        bound = r.last_stable_offset = p.last_stable_offset
                    r.leader_id, r.leader_epoch = p.state.leader, p.state.leader_epoch
                    filt = filters.get(key)
                    if isinstance(filt, StrataError):
                        raise filt
                    limit = min(fp.partition_max_bytes, budget) if total else fp.partition_max_bytes
                    if limit > 0 or not total:
                        pre = tiered.get(key) if tiered else None
                        if isinstance(pre, StrataError):
                            raise pre
                        if filt is not None:
                            scan, now_ = self._filtered(
                                p, fp, filt, pre, max(limit, 1), progress, bound
                            )
                            scans.append(scan)
                            answer_now = answer_now or now_
                            r.next_offset = scan.next_offset
                            if scan.parts:
                                r.records = scan.parts
                                r.selections = [
                                    m.BatchSelection(s.base_offset, s.bitmap)
                                    for s in scan.selections
                                ] or None
                                total += scan.bytes
                                budget -= scan.bytes
                                if committed:
                                    r.aborted_transactions = tier_aborted.get(key) or (
                                        None
                                        if pre is not None
                                        else _aborted(p, fp.fetch_offset, scan.next_offset)
                                    )
                        else:
                            assert not isinstance(pre, FilterScan)
                            if pre is not None:
                                chunk = pre
                                if committed:
                                    r.aborted_transactions = tier_aborted.get(key) or None
                            else:
                                sliced = p.log.read(
                                    fp.fetch_offset,
                                    max(limit, 1),
                                    max_offset=None if replica else bound,
                                )
                                chunk = sliced.data
                                if committed and len(chunk):
                                    r.aborted_transactions = _aborted(
                                        p, sliced.first_offset, sliced.next_offset
                                    )
                            if len(chunk):
                                r.records = chunk
                                total += len(chunk)
                                budget -= len(chunk)
                    waits.append(p.data_arrived if replica else p.hw_moved)
                except StrataError as exc:
                    r.error_code = by_id(exc, topic.topic_id).code
                    answer_now = True
                    if isinstance(exc, NotLeaderError):
                        r.leader_id, r.leader_epoch = exc.leader_id, exc.leader_epoch
                    if isinstance(exc, OffsetOutOfRangeError):
                        p2 = self.pm.hosted(topic.name, fp.partition)
                        if p2 is not None:
                            r.high_watermark, r.log_start_offset = (
                                p2.high_watermark,
                                self.tier.log_start(p2),
                            )
                results.append(r)
            topics.append(m.FetchTopicResult(topic.name, results))
        return m.FetchResponse(topics), total, answer_now, scans

    def _filtered(
        self,
        p: Partition,
        fp: m.FetchPartition,
        filt: Filter,
        pre: memoryview | FilterScan | None,
        limit: int,
        progress: dict[tuple[str, int], _Progress],
        bound: int,
    ) -> tuple[FilterScan, bool]:
        """A filtered partition of one round: its scan, and whether to answer at once with it.

        It answers at once when the scan stopped short of the high watermark (``max_bytes``
        or ``fetch.filter.max.scan.bytes`` reached, or the tier's part done), and when the
        request's first round caught up with the high watermark without a match: the
        consumer was behind, and its position (and lag) should move now rather than after
        ``max_wait_ms``; its next fetch starts at the high watermark and waits there. Later
        rounds (new data arrived during the wait) keep waiting as long as nothing matches.
        ``bound`` is the high watermark, or the last stable offset for read_committed."""
        hw = bound
        if isinstance(pre, FilterScan):  # below the local log: the tier scanned it already
            return pre, pre.done or pre.next_offset < hw or not pre.parts
        key = (p.topic, p.index)
        first_round = key not in progress
        prog = progress.setdefault(key, _Progress(fp.fetch_offset))
        max_scan = self.config.fetch_filter_max_scan_bytes
        scan = FilterScan(filt, prog.skip_to, limit, max(max_scan - prog.scanned, 1))
        while not scan.done and scan.next_offset < hw:
            chunk = p.log.read(
                scan.next_offset,
                max(1, min(SCAN_READ_BYTES, max_scan - prog.scanned - scan.scanned)),
                max_offset=hw,
            )
            if not len(chunk):
                break
            scan.feed(chunk.data)
        prog.scanned += scan.scanned
        if not scan.parts:
            prog.skip_to = scan.next_offset
        caught_up = first_round and not scan.parts and scan.next_offset > fp.fetch_offset
        return scan, scan.done or caught_up or (scan.next_offset < hw and prog.scanned >= max_scan)

    def _readable(self, topic: str, partition: int, replica_id: int) -> Partition:
        p = self.pm.hosted(topic, partition)
        latest = self.pm.latest.get((topic, partition))
        if latest is None:
            raise UnknownTopicOrPartitionError(f"unknown topic or partition {topic}-{partition}")
        if p is None or p.role != "leader":
            raise NotLeaderError(
                f"agent {self.agent_id} does not lead {topic}-{partition}",
                leader_id=latest.leader,
                leader_epoch=latest.leader_epoch,
            )
        return p

    # ---- OffsetForLeaderEpoch ---------------------------------------------------------------
    async def offset_for_leader_epoch(
        self, req: m.OffsetForLeaderEpochRequest
    ) -> m.OffsetForLeaderEpochResponse:
        topics = []
        for topic in req.topics:
            results = []
            for q in topic.partitions:
                r = m.EpochEndOffset(q.partition, 0, -1, -1)
                try:
                    p = self._readable(topic.name, q.partition, req.replica_id)
                    r.leader_epoch, r.end_offset = p.log.end_offset_for_epoch(q.leader_epoch)
                except StrataError as exc:
                    r.error_code = exc.code
                results.append(r)
            topics.append(m.EpochEndOffsetTopic(topic.name, results))
        return m.OffsetForLeaderEpochResponse(topics)

    # ---- ListOffsets ------------------------------------------------------------------------
    async def list_offsets(self, req: m.ListOffsetsRequest) -> m.ListOffsetsResponse:
        topics = []
        for topic in req.topics:
            results = []
            for lp in topic.partitions:
                r = m.ListOffsetsPartitionResult(lp.partition, 0, -1, -1, -1, -1)
                try:
                    p = self._readable(topic.name, lp.partition, m.CONSUMER_REPLICA_ID)
                    r.leader_id, r.leader_epoch = p.state.leader, p.state.leader_epoch
                    if lp.timestamp == m.EARLIEST_TIMESTAMP:
                        r.offset = self.tier.log_start(p)
                    elif lp.timestamp == m.LATEST_TIMESTAMP:
                        r.offset = (
                            p.last_stable_offset
                            if req.isolation_level == m.READ_COMMITTED
                            else p.high_watermark
                        )
                    else:
                        found = await self.tier.offset_for_timestamp(p, lp.timestamp)
                        if found is None:
                            found = p.log.offset_for_timestamp(lp.timestamp)
                        r.offset = -1 if found is None or found >= p.high_watermark else found
                        r.timestamp = lp.timestamp if found is not None else -1
                except StrataError as exc:
                    r.error_code = _code(exc)
                    if isinstance(exc, NotLeaderError):
                        r.leader_id, r.leader_epoch = exc.leader_id, exc.leader_epoch
                results.append(r)
            topics.append(m.ListOffsetsTopicResult(topic.name, results))
        return m.ListOffsetsResponse(topics)
