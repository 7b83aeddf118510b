"""Transactions on the producer side: atomic writes to several partitions (KIP-98).

A producer with ``transactional.id`` talks to that id's transaction coordinator (an agent,
``FindCoordinator`` with key type 1) and keeps a small state machine (``TRANSITIONS``; an
illegal call raises ``IllegalStateError``)::

    UNINITIALIZED --init_transactions--> READY --begin_transaction--> IN_TRANSACTION
    IN_TRANSACTION --commit_transaction--> COMMITTING --> READY
    IN_TRANSACTION / ABORTABLE_ERROR / COMMITTING --abort_transaction--> ABORTING --> READY
    IN_TRANSACTION / COMMITTING --a batch or a request fails--> ABORTABLE_ERROR
    any --fenced (another producer has the transactional.id)--> FATAL_ERROR

* ``init_transactions()``: InitProducerId gives the producer id and epoch (fencing any older
  producer with the same transactional.id, and aborting its open transaction); every
  partition's sequences start at 0 under them.
* ``send()`` inside a transaction: the first record for a partition asks the coordinator to
  add the partition (AddPartitionsToTxn, sent by the *adder* task while records accumulate;
  partitions waiting at the same time go in one request). The accumulator does not send a
  partition's batches before the coordinator has it (``admit``): a partition never holds
  data of a transaction the coordinator does not know.
* ``send_offsets_to_transaction(offsets, group_metadata)``: AddOffsetsToTxn (the group takes
  part in the transaction), then TxnOffsetCommit to the group's coordinator with the
  consumer's generation and member id (a consumer that lost its partitions cannot commit).
  The offsets count only if the transaction commits.
* ``commit_transaction()``: flush, then EndTxn(commit). If any batch of the transaction
  failed, commit raises that error and the producer is in ABORTABLE_ERROR: call
  ``abort_transaction()``.
* ``abort_transaction()``: queued batches fail with ``TransactionAbortedError``, batches in
  flight are waited for, then EndTxn(abort); the coordinator answers with the producer's next
  epoch and every partition's sequences restart under it. This is also how a producer whose
  transaction the coordinator aborted after ``transaction.timeout.ms`` goes on
  (its requests fail with ``InvalidProducerEpochError`` until then).
* A producer fenced by a newer one with the same transactional.id gets
  ``ProducerFencedError`` from the coordinator and ``InvalidProducerEpochError`` from the
  partitions it writes to; it is FATAL_ERROR for good: close it.

Requests to coordinators go on a connection of their own (channel ``txn``), retried while
the coordinator moves (``NOT_COORDINATOR``, ``COORDINATOR_NOT_AVAILABLE``, network errors)
or is still writing the previous transaction's markers (``CONCURRENT_TRANSACTIONS``), up to
``max.block.ms``.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sdk.backoff import ExponentialBackoff
from sdk.errors import IllegalStateError
from sdk.records import TopicPartition
from storage.errors import (
    ConcurrentTransactionsError,
    CoordinatorNotAvailableError,
    InvalidProducerIdMappingError,
    NetworkError,
    NotCoordinatorError,
    ProducerFencedError,
    RequestTimedOutError,
    StrataError,
    TransactionError,
    from_wire,
)
from storage.protocol import messages as m

if TYPE_CHECKING:
    from sdk.accumulator import ProducerBatch, RecordAccumulator
    from sdk.cluster import Cluster
    from sdk.config import ProducerConfig

log = logging.getLogger(__name__)

#: coordinator requests go on their own connection: an add may wait at the coordinator for
#: the previous transaction's markers, and must not hold up produce answers
TXN_CHANNEL = "txn"

_REDISCOVER = (
    NotCoordinatorError,
    CoordinatorNotAvailableError,
    NetworkError,
    RequestTimedOutError,
)
#: errors after which the producer may not go on at all
_FATAL = (ProducerFencedError, InvalidProducerIdMappingError)


class TransactionAbortedError(TransactionError):
    """The record's transaction was aborted (``abort_transaction()``) before it was sent."""


class TxnState(enum.StrEnum):
    UNINITIALIZED = "uninitialized"
    INITIALIZING = "initializing"
    READY = "ready"
    IN_TRANSACTION = "in_transaction"
    COMMITTING = "committing"
    ABORTING = "aborting"
    ABORTABLE_ERROR = "abortable_error"
    FATAL_ERROR = "fatal_error"


class TxnEvent(enum.StrEnum):
    INIT = "init"
    INITIALIZED = "initialized"
    INIT_FAILED = "init_failed"
    BEGIN = "begin"
    COMMIT = "commit"
    COMMITTED = "committed"
    ABORT = "abort"
    ABORTED = "aborted"
    ERROR = "error"
    FATAL = "fatal"


S, E = TxnState, TxnEvent
TRANSITIONS: dict[tuple[TxnState, TxnEvent], TxnState] = {
    (S.UNINITIALIZED, E.INIT): S.INITIALIZING,
    (S.INITIALIZING, E.INITIALIZED): S.READY,
    (S.INITIALIZING, E.INIT_FAILED): S.UNINITIALIZED,
    (S.READY, E.BEGIN): S.IN_TRANSACTION,
    (S.IN_TRANSACTION, E.COMMIT): S.COMMITTING,
    (S.IN_TRANSACTION, E.ABORT): S.ABORTING,
    (S.IN_TRANSACTION, E.ERROR): S.ABORTABLE_ERROR,
    (S.COMMITTING, E.COMMITTED): S.READY,
    (S.COMMITTING, E.ERROR): S.ABORTABLE_ERROR,
    (S.COMMITTING, E.ABORT): S.ABORTING,
    (S.ABORTABLE_ERROR, E.ERROR): S.ABORTABLE_ERROR,
    (S.ABORTABLE_ERROR, E.ABORT): S.ABORTING,
    (S.ABORTING, E.ABORTED): S.READY,
    (S.ABORTING, E.ERROR): S.ABORTABLE_ERROR,
}
for _state in TxnState:
    if _state != S.FATAL_ERROR:
        TRANSITIONS[(_state, E.FATAL)] = S.FATAL_ERROR


def next_state(state: TxnState, event: TxnEvent) -> TxnState:
    try:
        return TRANSITIONS[(state, event)]
    except KeyError:
        raise IllegalStateError(
            f"cannot {event.value} a transactional producer in state {state.value}"
        ) from None


@dataclass(frozen=True, slots=True)
class ConsumerGroupMetadata:
    """What ``send_offsets_to_transaction`` needs of the consumer (``Consumer.group_metadata()``):
    its group, generation and member id, so a consumer that lost its partitions cannot commit
    offsets for them."""

    group_id: str
    generation_id: int = m.NO_GENERATION
    member_id: str = ""
    group_instance_id: str | None = None


class TransactionManager:
    """The producer's transactional state (see the module docstring)."""

    def __init__(
        self,
        config: ProducerConfig,
        cluster: Cluster,
        *,
        clock: Callable[[], float] = time.monotonic,
        backoff: ExponentialBackoff | None = None,
    ) -> None:
        assert config.transactional_id is not None
        self.config = config
        self.txn_id: str = config.transactional_id
        self.cluster = cluster
        self.clock = clock
        self.backoff = backoff or ExponentialBackoff(
            config.retry_backoff_ms, config.effective_backoff_max_ms
        )
        self.state = TxnState.UNINITIALIZED
        self.producer_id = m.NO_PRODUCER_ID
        self.epoch = m.NO_PRODUCER_EPOCH
        self.coordinator: int | None = None
        self.accumulator: RecordAccumulator | None = None
        #: partitions the coordinator has in the open transaction, and those to add
        self.added: set[TopicPartition] = set()
        self._pending: set[TopicPartition] = set()
        self._groups: set[str] = set()
        self._attempted = False  # an add was sent in this transaction
        self._adding: asyncio.Future[None] | None = None
        self._wake = asyncio.Event()
        self.error: StrataError | None = None
        self.commits = 0
        self.aborts = 0

    # ---- state ------------------------------------------------------------------------------
    def _to(self, event: TxnEvent) -> None:
        self.state = next_state(self.state, event)

    def _check_usable(self) -> None:
        if self.state == TxnState.FATAL_ERROR:
            assert self.error is not None
            raise self.error
        if self.state == TxnState.ABORTABLE_ERROR:
            err = IllegalStateError(
                f"the transaction failed ({self.error}); call abort_transaction()"
            )
            raise err from self.error

    def _fail(self, exc: StrataError) -> None:
        """The transaction cannot commit any more (or the producer cannot go on at all)."""
        if self.state == TxnState.FATAL_ERROR:
            return
        fatal = isinstance(exc, _FATAL)
        if self.error is None or fatal:
            self.error = exc
        if fatal:
            self._to(TxnEvent.FATAL)
        elif self.state in (TxnState.IN_TRANSACTION, TxnState.COMMITTING):
            self._to(TxnEvent.ERROR)
        self._pending.clear()
        if self.accumulator is not None:
            self.accumulator.abort(exc)  # queued batches fail: flush and commit can finish

    # ---- the accumulator's hooks ------------------------------------------------------------
    def admit(self, tp: TopicPartition) -> bool:
        return tp in self.added

    def batch_failed(self, batch: ProducerBatch, exc: BaseException) -> None:
        if self.state in (TxnState.IN_TRANSACTION, TxnState.COMMITTING, TxnState.ABORTABLE_ERROR):
            self._fail(exc if isinstance(exc, StrataError) else StrataError(repr(exc)))

    # ---- the producer's calls ---------------------------------------------------------------
    async def init(self) -> None:
        self._to(TxnEvent.INIT)
        try:
            resp: m.InitProducerIdResponse = await self._coordinator_call(
                m.InitProducerIdRequest(self.txn_id, self.config.transaction_timeout_ms)
            )
        except StrataError as exc:
            if isinstance(exc, _FATAL):
                self.error = exc
                self._to(TxnEvent.FATAL)
            else:
                self._to(TxnEvent.INIT_FAILED)
            raise
        self._new_epoch(resp.producer_id, resp.producer_epoch)
        self._to(TxnEvent.INITIALIZED)

    def _new_epoch(self, producer_id: int, epoch: int) -> None:
        self.producer_id, self.epoch = producer_id, epoch
        assert self.accumulator is not None
        self.accumulator.restart_sequences(producer_id, epoch)

    def begin(self) -> None:
        self._check_usable()
        self._to(TxnEvent.BEGIN)

    def maybe_add(self, tp: TopicPartition) -> None:
        """A record for ``tp`` is about to be buffered in the open transaction."""
        if self.state != TxnState.IN_TRANSACTION:
            self._check_usable()
            raise IllegalStateError(
                f"send() on a transactional producer needs begin_transaction() first (state"
                f" {self.state.value})"
            )
        if tp not in self.added and tp not in self._pending:
            self._pending.add(tp)
            self._wake.set()

    async def run(self) -> None:
        """The adder: AddPartitionsToTxn for the partitions the transaction starts using."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._pending and self.state in (TxnState.IN_TRANSACTION, TxnState.COMMITTING):
                wanted = set(self._pending)
                by_topic: dict[str, list[int]] = {}
                for tp in sorted(wanted):
                    by_topic.setdefault(tp.topic, []).append(tp.partition)
                self._attempted = True
                done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
                self._adding = done
                try:
                    await self._coordinator_call(
                        m.AddPartitionsToTxnRequest(
                            self.txn_id,
                            self.producer_id,
                            self.epoch,
                            [m.TxnTopic(t, ps) for t, ps in by_topic.items()],
                        )
                    )
                except StrataError as exc:
                    self._fail(exc)
                    break
                finally:
                    done.set_result(None)
                    self._adding = None
                self.added |= wanted
                self._pending -= wanted
                if self.accumulator is not None:
                    self.accumulator.wakeup.set()

    async def send_offsets(
        self, offsets: Mapping[TopicPartition, tuple[int, str | None]], group: ConsumerGroupMetadata
    ) -> None:
        if self.state != TxnState.IN_TRANSACTION:
            self._check_usable()
            raise IllegalStateError(
                "send_offsets_to_transaction() needs begin_transaction() first"
                f" (state {self.state.value})"
            )
        try:
            self._attempted = True
            await self._coordinator_call(
                m.AddOffsetsToTxnRequest(self.txn_id, self.producer_id, self.epoch, group.group_id)
            )
            self._groups.add(group.group_id)
            topics: dict[str, list[m.OffsetCommitPartition]] = {}
            for tp, (offset, metadata) in offsets.items():
                topics.setdefault(tp.topic, []).append(
                    m.OffsetCommitPartition(tp.partition, offset, metadata)
                )
            await self._group_call(
                group.group_id,
                m.TxnOffsetCommitRequest(
                    self.txn_id,
                    group.group_id,
                    self.producer_id,
                    self.epoch,
                    group.generation_id,
                    group.member_id,
                    group.group_instance_id,
                    [m.OffsetCommitTopic(t, ps) for t, ps in topics.items()],
                ),
            )
        except StrataError as exc:
            self._fail(exc)
            raise

    async def commit(self) -> None:
        if self.state == TxnState.ABORTABLE_ERROR and self.error is not None:
            raise self.error  # what made the transaction fail; abort_transaction() next
        self._check_usable()
        self._to(TxnEvent.COMMIT)
        assert self.accumulator is not None
        self._wake.set()
        await self.accumulator.flush()
        if self.error is not None:  # the transaction must be aborted (or the producer is fenced)
            if self.state == TxnState.COMMITTING:
                self._to(TxnEvent.ERROR)
            raise self.error
        try:
            if self.added or self._groups or self._attempted:
                await self._coordinator_call(
                    m.EndTxnRequest(self.txn_id, self.producer_id, self.epoch, 1)
                )
        except StrataError as exc:
            self._fail(exc)
            raise
        self.commits += 1
        self._reset()
        self._to(TxnEvent.COMMITTED)

    async def abort(self) -> None:
        if self.state == TxnState.FATAL_ERROR:
            self._check_usable()
        self._to(TxnEvent.ABORT)
        assert self.accumulator is not None
        self._pending.clear()
        if self._adding is not None:
            await asyncio.shield(self._adding)
        self.accumulator.abort(TransactionAbortedError("the transaction was aborted"))
        await self.accumulator.flush()  # batches in flight land (or fail) first
        try:
            if self.added or self._groups or self._attempted:
                resp: m.EndTxnResponse = await self._coordinator_call(
                    m.EndTxnRequest(self.txn_id, self.producer_id, self.epoch, 0)
                )
                if (resp.producer_id, resp.producer_epoch) != (self.producer_id, self.epoch):
                    self._new_epoch(resp.producer_id, resp.producer_epoch)
        except StrataError as exc:
            if isinstance(exc, _FATAL):
                self.error = exc
                self._to(TxnEvent.FATAL)
            else:
                self.error = exc
                self._to(TxnEvent.ERROR)
            raise
        self.aborts += 1
        self._reset()
        self._to(TxnEvent.ABORTED)

    def _reset(self) -> None:
        self.added.clear()
        self._pending.clear()
        self._groups.clear()
        self._attempted = False
        self.error = None

    # ---- requests ---------------------------------------------------------------------------
    async def _find(self, key: str, key_type: int, deadline: float) -> int:
        attempt = 0
        last: StrataError | None = None
        while True:
            candidates: list[int | None] = [*self.cluster.agents] or [None]
            for agent_id in candidates:
                try:
                    if agent_id is None:
                        await self.cluster.refresh()
                        continue
                    resp: m.FindCoordinatorResponse = await self.cluster.send(
                        agent_id, m.FindCoordinatorRequest(key, key_type), channel=TXN_CHANNEL
                    )
                except StrataError as exc:
                    last = exc
                    continue
                if resp.error_code:
                    last = from_wire(resp.error_code, f"FindCoordinator {key!r}")
                    if not last.retriable:
                        raise last
                    continue
                if resp.agent_id not in self.cluster.agents:
                    self.cluster.request_update()
                    await self.cluster.refresh()
                return resp.agent_id
            if self.clock() > deadline:
                raise CoordinatorNotAvailableError(f"no coordinator for {key!r}: {last}")
            self.cluster.request_update()
            await asyncio.sleep(self.backoff(attempt))
            attempt += 1

    async def _coordinator_call(self, body: Any) -> Any:
        """A request to the transaction coordinator, retried as the module docstring says."""

        async def find(deadline: float) -> int:
            if self.coordinator is None:
                self.coordinator = await self._find(
                    self.txn_id, m.COORDINATOR_TRANSACTION, deadline
                )
            return self.coordinator

        def forget() -> None:
            self.coordinator = None

        return await self._call(body, find, forget)

    async def _group_call(self, group_id: str, body: m.TxnOffsetCommitRequest) -> None:
        coordinator: list[int | None] = [None]

        async def find(deadline: float) -> int:
            found = coordinator[0]
            if found is None:
                found = coordinator[0] = await self._find(group_id, m.COORDINATOR_GROUP, deadline)
            return found

        def forget() -> None:
            coordinator[0] = None

        await self._call(body, find, forget)

    async def _call(
        self,
        body: Any,
        find: Callable[[float], Any],
        forget: Callable[[], None],
    ) -> Any:
        deadline = self.clock() + self.config.max_block_ms / 1000
        attempt = 0
        while True:
            try:
                agent = await find(deadline)
                resp = await self.cluster.send(agent, body, channel=TXN_CHANNEL)
                err = _error_of(resp)
                if err is None:
                    return resp
                raise err
            except StrataError as exc:
                if isinstance(exc, _REDISCOVER):
                    forget()
                elif not isinstance(exc, ConcurrentTransactionsError) and not exc.retriable:
                    raise
                if self.clock() > deadline:
                    raise
                await asyncio.sleep(self.backoff(attempt))
                attempt += 1


def _error_of(resp: Any) -> StrataError | None:
    """The error a coordinator's response carries (None: success)."""
    if isinstance(resp, m.TxnOffsetCommitResponse):
        codes = {p.error_code for t in resp.topics for p in t.partitions} - {0}
        return from_wire(min(codes), "TxnOffsetCommit") if codes else None
    code = resp.error_code
    if not code:
        return None
    return from_wire(code, getattr(resp, "error_message", None) or type(resp).__name__)


__all__ = [
    "TRANSITIONS",
    "ConsumerGroupMetadata",
    "TransactionAbortedError",
    "TransactionManager",
    "TxnEvent",
    "TxnState",
    "next_state",
]
