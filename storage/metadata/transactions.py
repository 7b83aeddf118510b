"""Transaction coordinators' state in ZooKeeper: one znode per ``transactional.id``.

Layout (under the cluster's chroot; ``docs/transactions.md``)::

    /transactions/<transactional.id>   TxnRecord (JSON): producer id and epoch, phase, timeout,
                                       the partitions and groups of the open transaction

Only the id's coordinator writes it, always with compare-and-set on the znode version: a
coordinator that lost the id to another agent fails its next write and unloads the id. The
version a decision (``prepare_commit`` / ``prepare_abort``) was written with is the decision's
*token*: the coordinator epoch its markers carry, so a partition can tell a newer decision
from a retried or stale one.

``write_many`` puts the writes of many transactional ids into one ZooKeeper ``multi`` (a
coordinator batches whatever waits while its previous multi is in flight); when the multi
fails (one CAS lost a race) the writes are retried one by one, so one stale record never
fails the others.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from storage.errors import InvalidRequestError, MetadataError, NodeNotFoundError, StrataError
from storage.metadata.models import dump, load
from storage.metadata.zk import AsyncZooKeeper

log = logging.getLogger(__name__)

TRANSACTIONS = "/transactions"
MAX_TRANSACTIONAL_ID = 249


def validate_transactional_id(txn_id: Any) -> str:
    """A transactional.id is 1-249 printable characters with no ``/`` (it is a znode name)."""
    if (
        not isinstance(txn_id, str)
        or not 0 < len(txn_id) <= MAX_TRANSACTIONAL_ID
        or "/" in txn_id
        or txn_id in {".", ".."}
        or not txn_id.isprintable()
    ):
        raise InvalidRequestError(
            f"invalid transactional.id {txn_id!r}: 1-{MAX_TRANSACTIONAL_ID} printable"
            " characters, no '/'"
        )
    return txn_id


def txn_path(txn_id: str) -> str:
    return f"{TRANSACTIONS}/{txn_id}"


class TxnRecord(BaseModel):
    """``/transactions/<id>``: what a new coordinator needs to take the id over."""

    model_config = ConfigDict(
        frozen=True, extra="allow"
    )  # fields of newer versions kept: see models.py

    producer_id: int
    epoch: int = Field(ge=0, le=0x7FFF)
    #: the epoch before the last bump (-1: none), and why it was bumped: "init", "abort"
    #: (EndTxn(abort)), "timeout" (transaction.timeout.ms), "fence" (a new session)
    prev_epoch: int = -1
    bumped_by: str = ""
    phase: str = "empty"
    timeout_ms: int = Field(ge=1)
    #: the open (or ending) transaction's partitions, topic -> sorted partition numbers
    partitions: dict[str, list[int]] = Field(default_factory=dict)
    groups: list[str] = Field(default_factory=list)
    #: wall-clock ms when the open transaction started (its first add) and of the last write
    started_ms: int = 0
    updated_ms: int = 0


class TxnStore:
    """Typed reads and compare-and-set writes of ``/transactions``."""

    def __init__(self, zk: AsyncZooKeeper) -> None:
        self.zk = zk
        self.multis = 0  # ZooKeeper write transactions issued (metrics, benchmarks)
        self.records_written = 0

    async def init(self) -> None:
        await self.zk.ensure_path(TRANSACTIONS)

    async def list_ids(self) -> list[str]:
        try:
            return sorted(await self.zk.get_children(TRANSACTIONS))
        except NodeNotFoundError:
            return []

    async def get(self, txn_id: str) -> tuple[TxnRecord | None, int]:
        """The record and its znode version (``None, -1`` when there is none)."""
        try:
            data, stat = await self.zk.get(txn_path(txn_id))
        except NodeNotFoundError:
            return None, -1
        record: TxnRecord = load(TxnRecord, data)
        return record, int(stat.version)

    async def records(self) -> list[tuple[str, TxnRecord, int]]:
        """Every record with its id and znode version (``multiRead`` batches; a record that
        does not parse is left out and logged)."""
        ids = await self.list_ids()
        out: list[tuple[str, TxnRecord, int]] = []
        for txn_id, got in zip(
            ids, await self.zk.get_many([txn_path(i) for i in ids]), strict=True
        ):
            if got is None:
                continue  # expired since the listing
            try:
                out.append((txn_id, load(TxnRecord, got[0]), int(got[1].version)))
            except StrataError as exc:
                log.warning("transaction record %s does not parse: %s", txn_id, exc)
        return out

    async def write_many(
        self, writes: Sequence[tuple[str, TxnRecord, int]]
    ) -> list[int | MetadataError]:
        """Compare-and-set each ``(id, record, version)`` (version -1: create); per write, its
        new version or the error that refused it. One ``multi`` when all succeed."""
        if not writes:
            return []

        def build(tx: Any) -> None:
            for txn_id, record, version in writes:
                if version < 0:
                    tx.create(txn_path(txn_id), dump(record))
                else:
                    tx.set_data(txn_path(txn_id), dump(record), version)

        self.multis += 1
        try:
            await self.zk.transaction(build)
            self.records_written += len(writes)
            return [version + 1 for _, _, version in writes]
        except MetadataError as exc:
            if len(writes) == 1:
                return [exc]
        out: list[int | MetadataError] = []
        for txn_id, record, version in writes:  # find the one(s) that lost a race
            self.multis += 1
            try:
                if version < 0:
                    await self.zk.create(txn_path(txn_id), dump(record))
                    out.append(0)
                else:
                    stat = await self.zk.set(txn_path(txn_id), dump(record), version)
                    out.append(int(stat.version))
                self.records_written += 1
            except MetadataError as exc:
                out.append(exc)
        return out

    async def delete(self, txn_id: str, version: int) -> None:
        await self.zk.delete(txn_path(txn_id), version)
