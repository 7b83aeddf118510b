"""The transaction coordinator: InitProducerId, AddPartitionsToTxn, AddOffsetsToTxn, EndTxn.

Theory of operation (``docs/transactions.md`` has the full text):

* **Who coordinates.** The coordinator of a ``transactional.id`` is the agent that rendezvous
  hashing picks among the live agents not shutting down (``coordinator_for``, the group
  coordinator's function, over ``txn/<id>`` so a group and a transactional.id of the same
  name need not share an agent). ``FindCoordinator`` with key type 1 answers it. An agent
  answers ``NOT_COORDINATOR`` for other ids and unloads ids it no longer owns.
* **State lives in ZooKeeper** (``storage.metadata.transactions``), one znode per id, written
  with compare-and-set *before* the producer is answered: the producer id and epoch, the
  phase (``state.py``), the transaction timeout and the partitions and groups of the open
  transaction. Writes that wait while a ZooKeeper ``multi`` is in flight go out together in
  the next one, so the write rate ZooKeeper sees is bounded by round trips, not requests.
  A transaction costs two writes: its first add (ONGOING, with its partitions; later adds
  write only when they bring new partitions) and its end (PREPARE_COMMIT / PREPARE_ABORT).
  The COMPLETE state is written ``transaction.complete.write.delay.ms`` later, unless the
  next transaction's first write (which carries it) comes first.
* **Sessions and fencing.** ``InitProducerId`` gives a new id a random 63-bit producer id and
  epoch 0, and a known id the next epoch: a zombie holding the old epoch is refused by the
  coordinator (``ProducerFencedError``) and, once its open transaction is aborted with
  markers of the new epoch, by every partition it wrote to. EndTxn(abort) and the abort of
  a timed-out transaction bump the epoch too (the producer learns the new one from the
  EndTxn answer, or recovers it with ``InitProducerId`` after ``InvalidProducerEpochError``),
  so a producer's batches after an abort can never join the aborted transaction.
* **Ending.** EndTxn writes the decision (PREPARE_*; the znode's version after that write is
  the decision's *token*) and answers; a task then delivers the markers
  (``markers.MarkerChannel``) to every partition and group of the transaction, retrying
  until each has it, and moves the transaction to COMPLETE_*. The producer's next add waits
  (up to its request deadline) until then, so a partition never sees a producer's next
  transaction before the marker of the previous one.
* **Failover.** A coordinator that takes an id over (on its first request, or when its scan
  after an agent change finds it) reads the znode: a transaction in PREPARE_* gets its
  markers written again (partitions ignore a token they have applied), an ONGOING one keeps
  its timeout clock (the start time is in the znode) and is aborted when it passes.
* **Timeouts.** Every ``transaction.abort.timed.out.transaction.cleanup.interval.ms`` the
  coordinator aborts (epoch bump, markers) transactions open longer than their
  ``transaction.timeout.ms``; a hanging producer therefore holds read_committed readers and
  tiering back for at most that long.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from broker_agents.groups.coordinator import coordinator_for
from broker_agents.transactions.markers import Marker, MarkerChannel
from broker_agents.transactions.state import IDLE, PREPARING, Event, Phase, next_phase
from storage.errors import (
    ConcurrentTransactionsError,
    CoordinatorNotAvailableError,
    InvalidProducerEpochError,
    InvalidProducerIdMappingError,
    InvalidRequestError,
    InvalidTransactionTimeoutError,
    MetadataError,
    MetadataUnavailableError,
    NotCoordinatorError,
    ProducerFencedError,
    StrataError,
    UnknownTopicOrPartitionError,
)
from storage.metadata.transactions import TxnRecord, TxnStore, validate_transactional_id
from storage.protocol import messages as m

if TYPE_CHECKING:
    from broker_agents.view import ClusterView
    from storage.metadata import AsyncZooKeeper

log = logging.getLogger(__name__)

#: the largest producer epoch (int16); at it a producer session gets a new producer id
MAX_EPOCH = 0x7FFF


def new_producer_id() -> int:
    return secrets.randbits(63)


def coordinator_key(txn_id: str) -> str:
    return f"txn/{txn_id}"


@dataclass(frozen=True, slots=True)
class TxnSettings:
    max_timeout_ms: int = 900_000
    abort_check_interval_ms: int = 1000
    complete_write_delay_ms: int = 1000
    id_expiration_ms: int = 7 * 24 * 3600 * 1000
    #: how long a request waits for the previous transaction's markers
    request_wait_s: float = 30.0
    #: ids this agent owns are looked for in ZooKeeper this often (and at every agent change)
    scan_interval_s: float = 30.0


@dataclass(eq=False)
class TxnMeta:
    """This agent's live copy of one transactional.id."""

    txn_id: str
    producer_id: int = -1
    epoch: int = 0
    prev_epoch: int = -1
    bumped_by: str = ""
    phase: Phase = Phase.EMPTY
    timeout_ms: int = 60_000
    partitions: set[tuple[str, int]] = field(default_factory=set)
    groups: set[str] = field(default_factory=set)
    started_ms: int = 0
    updated_ms: int = 0
    version: int = -1  # the znode's version (-1: not written yet)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    ended: asyncio.Event = field(default_factory=asyncio.Event)  # set unless PREPARE_*
    unloaded: bool = False
    complete_due: float | None = None  # monotonic time of the lazy COMPLETE write
    finishing: asyncio.Task[None] | None = None

    def record(self, now_ms: int) -> TxnRecord:
        topics: dict[str, list[int]] = {}
        for topic, p in sorted(self.partitions):
            topics.setdefault(topic, []).append(p)
        return TxnRecord(
            producer_id=self.producer_id,
            epoch=self.epoch,
            prev_epoch=self.prev_epoch,
            bumped_by=self.bumped_by,
            phase=self.phase.value,
            timeout_ms=self.timeout_ms,
            partitions=topics,
            groups=sorted(self.groups),
            started_ms=self.started_ms,
            updated_ms=now_ms,
        )

    @classmethod
    def of(cls, txn_id: str, record: TxnRecord, version: int) -> TxnMeta:
        meta = cls(
            txn_id,
            producer_id=record.producer_id,
            epoch=record.epoch,
            prev_epoch=record.prev_epoch,
            bumped_by=record.bumped_by,
            phase=Phase(record.phase),
            timeout_ms=record.timeout_ms,
            partitions={(t, p) for t, ps in record.partitions.items() for p in ps},
            groups=set(record.groups),
            started_ms=record.started_ms,
            updated_ms=record.updated_ms,
            version=version,
        )
        if meta.phase not in PREPARING:
            meta.ended.set()
        return meta


class TransactionCoordinator:
    def __init__(
        self,
        agent_id: int,
        zk: AsyncZooKeeper,
        view: ClusterView,
        session_ok: Callable[[], bool],
        channel: MarkerChannel,
        settings: TxnSettings,
        *,
        clock_ms: Callable[[], int] = lambda: time.time_ns() // 1_000_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.agent_id = agent_id
        self.view = view
        self.session_ok = session_ok
        self.channel = channel
        self.settings = settings
        self.store = TxnStore(zk)
        self.clock_ms = clock_ms
        self.clock = clock
        self.txns: dict[str, TxnMeta] = {}
        self._loading: dict[str, asyncio.Future[TxnMeta]] = {}
        self._writes: list[tuple[TxnMeta, TxnRecord, int, asyncio.Future[int]]] = []
        self._write_wanted = asyncio.Event()
        self._scan_wanted = asyncio.Event()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._seen_agents: frozenset[int] = frozenset()
        self.commits = 0
        self.aborts = 0
        self.timeouts = 0

    # ---- ownership --------------------------------------------------------------------------
    def coordinator_id(self, txn_id: str) -> int | None:
        agents = self.view.agents
        live = (a for a, r in agents.items() if not r.shutting_down)
        return coordinator_for(coordinator_key(txn_id), live)

    def owns(self, txn_id: str) -> bool:
        return self.session_ok() and self.coordinator_id(txn_id) == self.agent_id

    def _still_owner(self, meta: TxnMeta) -> Callable[[], bool]:
        return lambda: not meta.unloaded and self.owns(meta.txn_id)

    async def _txn(self, txn_id: str | None, *, create: bool = False) -> TxnMeta:
        """This agent's copy of the id (loaded from ZooKeeper on first use)."""
        txn_id = validate_transactional_id(txn_id)
        if not self.owns(txn_id):
            raise NotCoordinatorError(
                f"agent {self.agent_id} does not coordinate transactional.id {txn_id!r}"
            )
        meta = self.txns.get(txn_id)
        if meta is None:
            loading = self._loading.get(txn_id)
            if loading is None:
                loading = asyncio.ensure_future(self._load(txn_id))
                self._loading[txn_id] = loading
                loading.add_done_callback(lambda _: self._loading.pop(txn_id, None))
            meta = await asyncio.shield(loading)
        if meta.version < 0 and not create:
            raise InvalidProducerIdMappingError(
                f"transactional.id {txn_id!r} is unknown: call init_transactions() first"
            )
        return meta

    async def _load(self, txn_id: str) -> TxnMeta:
        try:
            record, version = await self.store.get(txn_id)
        except MetadataError as exc:
            raise CoordinatorNotAvailableError(
                f"cannot load transactional.id {txn_id!r}: {exc}"
            ) from exc
        if not self.owns(txn_id):
            raise NotCoordinatorError(f"transactional.id {txn_id!r} moved while loading")
        existing = self.txns.get(txn_id)
        if existing is not None:
            return existing
        meta = TxnMeta(txn_id) if record is None else TxnMeta.of(txn_id, record, version)
        if record is None:
            meta.ended.set()
        self.txns[txn_id] = meta
        if meta.phase in PREPARING:
            log.info(
                "transactional.id %s: completing the %s found in ZooKeeper",
                txn_id,
                meta.phase.value,
            )
            self._finish(meta)
        return meta

    def _unload(self, meta: TxnMeta, why: str) -> None:
        if self.txns.get(meta.txn_id) is meta:
            del self.txns[meta.txn_id]
        if meta.unloaded:
            return
        log.info("transactional.id %s unloaded: %s", meta.txn_id, why)
        meta.unloaded = True
        meta.ended.set()  # waiters wake and see it unloaded
        if meta.finishing is not None:
            meta.finishing.cancel()

    # ---- ZooKeeper writes -------------------------------------------------------------------
    async def _write(self, meta: TxnMeta) -> None:
        """Write ``meta`` (compare-and-set) in the next batch; on any failure the id is
        unloaded (another coordinator wrote it, or the outcome is unknown) and the caller
        gets a retriable error."""
        now = self.clock_ms()
        meta.updated_ms = now
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._writes.append((meta, meta.record(now), meta.version, fut))
        self._write_wanted.set()
        try:
            meta.version = await asyncio.shield(fut)
            meta.complete_due = None
        except MetadataError as exc:
            self._unload(meta, f"write failed: {exc}")
            if isinstance(exc, MetadataUnavailableError):
                raise CoordinatorNotAvailableError(
                    f"transactional.id {meta.txn_id!r}: ZooKeeper unavailable ({exc})"
                ) from exc
            raise NotCoordinatorError(
                f"transactional.id {meta.txn_id!r} changed under this coordinator: {exc}"
            ) from exc

    async def _write_loop(self) -> None:
        """One ZooKeeper multi at a time with every write queued meanwhile."""
        while True:
            await self._write_wanted.wait()
            self._write_wanted.clear()
            batch, self._writes = self._writes, []
            if not batch:
                continue
            try:
                results = await self.store.write_many(
                    [(meta.txn_id, record, version) for meta, record, version, _ in batch]
                )
            except Exception as exc:  # a bug: fail the writes, keep the writer
                log.exception("transaction state write failed")
                results = [MetadataError(f"write failed: {exc!r}")] * len(batch)
            for (_, _, _, fut), result in zip(batch, results, strict=True):
                if fut.done():
                    continue
                if isinstance(result, MetadataError):
                    fut.set_exception(result)
                else:
                    fut.set_result(result)

    # ---- loops ------------------------------------------------------------------------------
    async def run(self) -> None:
        await self._ensure_root()
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._write_loop(), name="txn-state-writer")
            tg.create_task(self._tick_loop(), name="txn-timeouts")
            tg.create_task(self._scan_loop(), name="txn-scan")

    async def _ensure_root(self) -> None:
        while True:
            try:
                await self.store.init()
                return
            except MetadataError as exc:
                log.warning("cannot create /transactions: %s", exc)
                await asyncio.sleep(1.0)

    async def _tick_loop(self) -> None:
        interval = self.settings.abort_check_interval_ms / 1000
        while True:
            await asyncio.sleep(min(interval, 0.1))
            agents = frozenset(a for a, r in self.view.agents.items() if not r.shutting_down)
            if agents != self._seen_agents:
                self._seen_agents = agents
                self._scan_wanted.set()
            now_ms, now = self.clock_ms(), self.clock()
            for meta in list(self.txns.values()):
                if not self.owns(meta.txn_id):
                    self._unload(meta, "another agent coordinates it now")
                elif meta.lock.locked():
                    continue
                elif meta.phase == Phase.ONGOING and now_ms - meta.started_ms > meta.timeout_ms:
                    self._spawn(self._abort_timed_out(meta), f"txn-timeout-{meta.txn_id}")
                elif meta.complete_due is not None and now >= meta.complete_due:
                    self._spawn(self._write_complete(meta), f"txn-complete-{meta.txn_id}")

    def _spawn(self, coro: Any, name: str) -> None:
        task = asyncio.ensure_future(coro)
        task.set_name(name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _scan_loop(self) -> None:
        """Find the ids this agent owns with a transaction in flight (after a failover their
        producers may never come back): complete PREPARE_*, time out ONGOING; forget ids idle
        past ``transactional.id.expiration.ms``."""
        while True:
            try:
                async with asyncio.timeout(self.settings.scan_interval_s):
                    await self._scan_wanted.wait()
            except TimeoutError:
                pass
            self._scan_wanted.clear()
            if not self.session_ok():
                continue
            try:
                await self._scan()
            except StrataError as exc:
                log.warning("transaction scan failed: %s", exc)

    async def _scan(self) -> None:
        now_ms = self.clock_ms()
        for txn_id in await self.store.list_ids():
            if txn_id in self.txns or not self.owns(txn_id):
                continue
            record, version = await self.store.get(txn_id)
            if record is None or txn_id in self.txns:
                continue
            phase = Phase(record.phase)
            if phase in IDLE:
                if now_ms - record.updated_ms > self.settings.id_expiration_ms:
                    try:
                        await self.store.delete(txn_id, version)
                        log.info("transactional.id %s expired", txn_id)
                    except MetadataError:
                        pass  # written meanwhile: in use
                continue
            try:
                await self._txn(txn_id)
            except StrataError as exc:
                log.info("transactional.id %s not taken over now: %s", txn_id, exc)

    async def _abort_timed_out(self, meta: TxnMeta) -> None:
        async with meta.lock:
            if meta.unloaded or meta.phase != Phase.ONGOING:
                return
            if self.clock_ms() - meta.started_ms <= meta.timeout_ms:
                return
            log.info(
                "transactional.id %s: transaction open for over %d ms, aborting",
                meta.txn_id,
                meta.timeout_ms,
            )
            try:
                await self._decide(meta, commit=False, reason="timeout")
                self.timeouts += 1
            except StrataError as exc:
                log.warning("timed-out transaction of %s not aborted yet: %s", meta.txn_id, exc)

    async def _write_complete(self, meta: TxnMeta) -> None:
        async with meta.lock:
            if meta.unloaded or meta.complete_due is None or meta.phase not in IDLE:
                return
            try:
                await self._write(meta)
            except StrataError as exc:
                log.info("complete state of %s not written: %s", meta.txn_id, exc)

    # ---- decisions and markers --------------------------------------------------------------
    def _bump(self, meta: TxnMeta, reason: str) -> None:
        meta.prev_epoch = meta.epoch
        meta.bumped_by = reason
        if meta.epoch < MAX_EPOCH:
            meta.epoch += 1

    async def _decide(self, meta: TxnMeta, *, commit: bool, reason: str, bump: bool = True) -> None:
        """ONGOING -> PREPARE_*: write the decision, then deliver it in the background. An
        abort bumps the epoch unless ``bump`` is False (a Kafka client's EndTxn, below)."""
        if not commit and bump:
            self._bump(meta, reason)
        meta.phase = next_phase(meta.phase, Event.COMMIT if commit else Event.ABORT)
        meta.ended.clear()
        await self._write(meta)
        if commit:
            self.commits += 1
        else:
            self.aborts += 1
        self._finish(meta)

    def _finish(self, meta: TxnMeta) -> None:
        meta.finishing = asyncio.ensure_future(self._deliver(meta))
        meta.finishing.set_name(f"txn-markers-{meta.txn_id}")

    async def _deliver(self, meta: TxnMeta) -> None:
        marker = Marker(
            meta.producer_id,
            meta.epoch,
            meta.phase == Phase.PREPARE_COMMIT,
            meta.version,  # the decision's token
            frozenset(meta.partitions),
            frozenset(meta.groups),
        )
        try:
            await self.channel.write(marker, self._still_owner(meta))
        except NotCoordinatorError:
            self._unload(meta, "lost while writing markers")
            return
        if meta.unloaded:
            return
        meta.phase = next_phase(meta.phase, Event.MARKERS_WRITTEN)
        meta.partitions.clear()
        meta.groups.clear()
        meta.complete_due = self.clock() + self.settings.complete_write_delay_ms / 1000
        meta.ended.set()

    async def _wait_ended(self, meta: TxnMeta) -> None:
        """Wait until the previous transaction's markers are written."""
        if meta.phase in PREPARING:
            try:
                async with asyncio.timeout(self.settings.request_wait_s):
                    await meta.ended.wait()
            except TimeoutError:
                raise ConcurrentTransactionsError(
                    f"transactional.id {meta.txn_id!r}: the previous transaction is still"
                    " writing its markers"
                ) from None
        if meta.unloaded:
            raise NotCoordinatorError(f"transactional.id {meta.txn_id!r} moved")

    def _check_producer(self, meta: TxnMeta, producer_id: int, epoch: int) -> None:
        if producer_id != meta.producer_id:
            raise InvalidProducerIdMappingError(
                f"producer id {producer_id} is not transactional.id {meta.txn_id!r}'s"
            )
        if epoch == meta.epoch:
            return
        if epoch == meta.prev_epoch and meta.bumped_by == "timeout":
            raise InvalidProducerEpochError(
                f"the transaction of {meta.txn_id!r} was aborted by the coordinator after its"
                f" transaction.timeout.ms ({meta.timeout_ms} ms); abort_transaction() to go on"
            )
        if epoch < meta.epoch:
            raise ProducerFencedError(
                f"producer epoch {epoch} of {meta.txn_id!r} is fenced: a newer producer with"
                f" this transactional.id has epoch {meta.epoch}"
            )
        raise InvalidProducerEpochError(
            f"producer epoch {epoch} of {meta.txn_id!r} is ahead of the coordinator's {meta.epoch}"
        )

    # ---- handlers ---------------------------------------------------------------------------
    async def find_coordinator(self, req: m.FindCoordinatorRequest) -> m.FindCoordinatorResponse:
        try:
            validate_transactional_id(req.key)
        except InvalidRequestError as exc:
            return m.FindCoordinatorResponse(exc.code, -1, "", 0)
        agent_id = self.coordinator_id(req.key)
        reg = None if agent_id is None else self.view.agents.get(agent_id)
        if reg is None:
            return m.FindCoordinatorResponse(CoordinatorNotAvailableError.code, -1, "", 0)
        return m.FindCoordinatorResponse(0, reg.agent_id, reg.host, reg.port)

    async def init_producer_id(self, req: m.InitProducerIdRequest) -> m.InitProducerIdResponse:
        try:
            if req.transactional_id is None:  # an idempotent producer's id
                return m.InitProducerIdResponse(0, new_producer_id(), 0)
            if not 0 < req.transaction_timeout_ms <= self.settings.max_timeout_ms:
                raise InvalidTransactionTimeoutError(
                    f"transaction.timeout.ms {req.transaction_timeout_ms} is outside [1,"
                    f" transaction.max.timeout.ms = {self.settings.max_timeout_ms}]"
                )
            meta = await self._txn(req.transactional_id, create=True)
            async with meta.lock:
                await self._wait_ended(meta)
                await self._init(meta, req)
                return m.InitProducerIdResponse(0, meta.producer_id, meta.epoch)
        except StrataError as exc:
            return m.InitProducerIdResponse(exc.code, -1, -1, str(exc))

    async def _init(self, meta: TxnMeta, req: m.InitProducerIdRequest) -> None:
        if meta.version < 0:  # a new transactional.id
            meta.producer_id, meta.epoch = new_producer_id(), 0
        else:
            if req.producer_id >= 0:  # recovering after an abortable error: must be current
                if req.producer_id != meta.producer_id:
                    raise InvalidProducerIdMappingError(
                        f"producer id {req.producer_id} is not {meta.txn_id!r}'s"
                    )
                if req.producer_epoch not in (meta.epoch, meta.prev_epoch):
                    raise ProducerFencedError(
                        f"producer epoch {req.producer_epoch} of {meta.txn_id!r} is fenced"
                        f" (current: {meta.epoch})"
                    )
            if meta.phase == Phase.ONGOING:  # the previous session's transaction: fence it
                log.info(
                    "transactional.id %s: a new session aborts the open transaction", meta.txn_id
                )
                await self._decide(meta, commit=False, reason="fence")
                await self._wait_ended(meta)
            else:
                self._bump(meta, "init")
            if meta.epoch >= MAX_EPOCH - 1:  # keep room for one fencing bump
                meta.producer_id, meta.epoch, meta.prev_epoch = new_producer_id(), 0, -1
        meta.phase = next_phase(meta.phase, Event.INIT)
        meta.timeout_ms = req.transaction_timeout_ms
        meta.partitions.clear()
        meta.groups.clear()
        await self._write(meta)

    async def add_partitions_to_txn(
        self, req: m.AddPartitionsToTxnRequest
    ) -> m.AddPartitionsToTxnResponse:
        wanted = {(t.name, p) for t in req.topics for p in t.partitions}
        try:
            meta = await self._txn(req.transactional_id)
            async with meta.lock:
                self._check_producer(meta, req.producer_id, req.producer_epoch)
                await self._wait_ended(meta)
                self._check_producer(meta, req.producer_id, req.producer_epoch)
                for topic, p in wanted:
                    spec = self.view.topics.get(topic)
                    if spec is None or not 0 <= p < spec.partitions:
                        raise UnknownTopicOrPartitionError(f"unknown partition {topic}-{p}")
                await self._add(meta, wanted, ())
            code, message = 0, None
        except StrataError as exc:
            code, message = exc.code, str(exc)
        return m.AddPartitionsToTxnResponse(
            code,
            [
                m.TxnTopicResult(t.name, [m.TxnPartitionResult(p, code) for p in t.partitions])
                for t in req.topics
            ],
            message,
        )

    async def add_offsets_to_txn(self, req: m.AddOffsetsToTxnRequest) -> m.AddOffsetsToTxnResponse:
        try:
            meta = await self._txn(req.transactional_id)
            async with meta.lock:
                self._check_producer(meta, req.producer_id, req.producer_epoch)
                await self._wait_ended(meta)
                self._check_producer(meta, req.producer_id, req.producer_epoch)
                await self._add(meta, (), (req.group_id,))
            return m.AddOffsetsToTxnResponse(0)
        except StrataError as exc:
            return m.AddOffsetsToTxnResponse(exc.code, str(exc))

    async def _add(
        self, meta: TxnMeta, partitions: Iterable[tuple[str, int]], groups: Iterable[str]
    ) -> None:
        new_parts = set(partitions) - meta.partitions
        new_groups = set(groups) - meta.groups
        if meta.phase == Phase.ONGOING and not new_parts and not new_groups:
            return  # already part of the transaction: nothing to write
        if meta.phase in IDLE:
            meta.partitions.clear()
            meta.groups.clear()
            meta.started_ms = self.clock_ms()
        meta.phase = next_phase(meta.phase, Event.ADD)
        meta.partitions |= new_parts
        meta.groups |= new_groups
        await self._write(meta)

    async def end_txn(
        self, req: m.EndTxnRequest, *, bump_on_abort: bool = True
    ) -> m.EndTxnResponse:
        """Commit or abort. The SDK learns the epoch an abort moves to from the answer; a
        Kafka client's EndTxn (v0-3) has no epoch in its answer and the client goes on with
        the one it has, so the Kafka listener passes ``bump_on_abort=False``: its aborts keep
        the epoch, as Kafka's coordinator did before KIP-890."""
        try:
            meta = await self._txn(req.transactional_id)
            async with meta.lock:
                await self._end(meta, req, bump_on_abort)
                return m.EndTxnResponse(0, meta.producer_id, meta.epoch)
        except StrataError as exc:
            return m.EndTxnResponse(exc.code, -1, -1, str(exc))

    async def _end(self, meta: TxnMeta, req: m.EndTxnRequest, bump_on_abort: bool) -> None:
        commit = bool(req.committed)
        if req.producer_id != meta.producer_id:
            raise InvalidProducerIdMappingError(
                f"producer id {req.producer_id} is not {meta.txn_id!r}'s"
            )
        # a retry of an EndTxn that was decided (its answer was lost), or the abort a producer
        # sends after the coordinator aborted its timed-out transaction
        decided_commit = meta.phase in (Phase.PREPARE_COMMIT, Phase.COMPLETE_COMMIT)
        if commit and decided_commit and req.producer_epoch == meta.epoch:
            return
        decided_abort = meta.phase in (Phase.PREPARE_ABORT, Phase.COMPLETE_ABORT)
        if (
            not commit
            and decided_abort
            and req.producer_epoch == meta.prev_epoch
            and meta.bumped_by in ("abort", "timeout")
        ):
            return
        self._check_producer(meta, req.producer_id, req.producer_epoch)
        if meta.phase in PREPARING:
            raise ConcurrentTransactionsError(
                f"transactional.id {meta.txn_id!r} is ending a transaction"
            )
        if meta.phase in IDLE:
            return  # nothing was added: nothing to commit or abort (the epoch stays)
        await self._decide(meta, commit=commit, reason="abort", bump=bump_on_abort)

    def handlers(self) -> dict[int, Any]:
        return {
            m.ApiKey.INIT_PRODUCER_ID: self.init_producer_id,
            m.ApiKey.ADD_PARTITIONS_TO_TXN: self.add_partitions_to_txn,
            m.ApiKey.ADD_OFFSETS_TO_TXN: self.add_offsets_to_txn,
            m.ApiKey.END_TXN: self.end_txn,
        }

    async def close(self) -> None:
        for meta in list(self.txns.values()):
            self._unload(meta, "the agent is stopping")
        for task in list(self._tasks):
            task.cancel()


def find_coordinator_router(
    group: Callable[[m.FindCoordinatorRequest], Any],
    transaction: Callable[[m.FindCoordinatorRequest], Any],
) -> Callable[[m.FindCoordinatorRequest], Any]:
    """One FindCoordinator handler for both key types (0: group, 1: transactional.id)."""

    async def find(req: m.FindCoordinatorRequest) -> m.FindCoordinatorResponse:
        if req.key_type == m.COORDINATOR_TRANSACTION:
            return await transaction(req)  # type: ignore[no-any-return]
        if req.key_type != m.COORDINATOR_GROUP:
            return m.FindCoordinatorResponse(InvalidRequestError.code, -1, "", 0)
        return await group(req)  # type: ignore[no-any-return]

    return find
