"""The delay scheduler's state in ZooKeeper: one intent per lane, the cancel set, statistics.

Layout (under the cluster's chroot)::

    /delays/lanes/<level topic>/<partition>     {"a", "b", "now"}  the lane's last intent
    /delays/cancels/<due minute>/<schedule id>  (empty)            one per cancelled record
    /delays/stats/<scheduler name>               {...}              counters, for `strata delays status`

**Intents.** Before the scheduler forwards anything from a lane it writes the exact source
range ``[a, b)`` and the time ``now`` its plan was made at, compare-and-set on the node's
version. The new version (and the write's zxid) names the forward: the producer ids of its
output batches are derived from it, and the cancels it honours are those created before it
(``czxid < mzxid``). A later process that finds an intent whose range starts where it is asked
to start redoes exactly that plan — same batches, same producer ids — so the target's leader
answers what was stored already with its original offsets. The intent also records the lane's
progress. The forward is complete once the runner has committed ``b`` for the lane (it commits
only after the handler returned) or a newer intent exists (a lane's next forward starts only
after its last one is complete).

**Cancels.** A cancel creates its node first, then reads the lanes' intents; every forward
reads the cancel set after writing its intent. ZooKeeper's total order (zxids) is therefore
the linearization point: a cancel created before a forward's intent is honoured by it, one
created after is too late for it (``docs/delays.md`` has the argument). Nodes are grouped by
the minute of their due time, so a forward lists only the few buckets its records fall in;
buckets more than :data:`CANCEL_KEEP_MS` past are deleted.

Every call goes through :class:`AsyncZooKeeper` (deadlines, typed errors).
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from typing import Any

from kazoo.protocol.states import ZnodeStat

from storage.errors import NodeExistsError, NodeNotFoundError
from storage.metadata.zk import AsyncZooKeeper

ROOT = "/delays"
LANES = f"{ROOT}/lanes"
CANCELS = f"{ROOT}/cancels"
STATS = f"{ROOT}/stats"
BUCKET_MS = 60_000
CANCEL_KEEP_MS = 2 * 24 * 3600 * 1000
"""Cancel nodes are kept this long past their due minute (longer than the agents remember a
producer id: a redo later than that is not deduplicated anyway)."""


def lane_path(topic: str, partition: int) -> str:
    return f"{LANES}/{topic}/{partition}"


def cancel_bucket(due_ms: int) -> int:
    return due_ms // BUCKET_MS


@dataclass(frozen=True, slots=True)
class Intent:
    """A lane's last forward: source offsets ``[a, b)`` planned at ``now`` (ms)."""

    a: int
    b: int
    now: int
    version: int
    """The node's version after the intent was written: part of every producer id of the
    forward."""
    zxid: int
    """The intent write's zxid (``mzxid``): cancels created before it are honoured."""

    @classmethod
    def from_node(cls, data: bytes, stat: ZnodeStat) -> Intent | None:
        if not data:
            return None
        doc = json.loads(data)
        return cls(int(doc["a"]), int(doc["b"]), int(doc["now"]), stat.version, stat.mzxid)


async def read_intent(zk: AsyncZooKeeper, path: str) -> tuple[Intent | None, int]:
    """The intent at ``path`` and the node version to compare-and-set against (-1: the node
    does not exist yet). Also the retry router's (``storage.metadata.retry``)."""
    try:
        data, stat = await zk.get(path)
    except NodeNotFoundError:
        return None, -1
    return Intent.from_node(data, stat), stat.version


async def write_intent(
    zk: AsyncZooKeeper, path: str, a: int, b: int, now: int, version: int
) -> Intent:
    """Compare-and-set the intent at ``path`` (``VersionConflictError`` if another process
    wrote since ``version`` was read)."""
    data = json.dumps({"a": a, "b": b, "now": now}).encode()
    if version < 0:
        with contextlib.suppress(NodeExistsError):
            await zk.create(path, b"", makepath=True)
        version = 0
    stat = await zk.set(path, data, version)
    return Intent(a, b, now, stat.version, stat.mzxid)


class DelayStore:
    """Intents, cancels and statistics of the delay scheduler (see the module docstring)."""

    def __init__(self, zk: AsyncZooKeeper) -> None:
        self.zk = zk

    # ---- intents -------------------------------------------------------------------------
    async def read_lane(self, topic: str, partition: int) -> tuple[Intent | None, int]:
        """The lane's last intent and the node version to compare-and-set against (-1: the
        node does not exist yet)."""
        return await read_intent(self.zk, lane_path(topic, partition))

    async def write_intent(
        self, topic: str, partition: int, a: int, b: int, now: int, version: int
    ) -> Intent:
        """Compare-and-set the lane's intent (``VersionConflictError`` if another process
        wrote since ``version`` was read)."""
        return await write_intent(self.zk, lane_path(topic, partition), a, b, now, version)

    # ---- cancels -------------------------------------------------------------------------
    async def create_cancel(self, schedule_id: str, due_ms: int) -> int:
        """Create the cancel node (once); returns its czxid."""
        path = f"{CANCELS}/{cancel_bucket(due_ms)}/{schedule_id}"
        with contextlib.suppress(NodeExistsError):
            await self.zk.create(path, b"", makepath=True)
        stat = await self.zk.exists(path)
        if stat is None:  # deleted by the sweep at once: only for a cancel days too late
            raise NodeNotFoundError(f"cancel node {path} vanished")
        czxid: int = stat.czxid
        return czxid

    async def cancelled_before(self, ids_by_bucket: dict[int, set[str]], zxid: int) -> set[str]:
        """Of the given ids, those whose cancel node was created before ``zxid``."""
        found: set[str] = set()
        for bucket, ids in ids_by_bucket.items():
            try:
                children = await self.zk.get_children(f"{CANCELS}/{bucket}")
            except NodeNotFoundError:
                continue
            for name in ids.intersection(children):
                stat = await self.zk.exists(f"{CANCELS}/{bucket}/{name}")
                if stat is not None and stat.czxid < zxid:
                    found.add(name)
        return found

    async def count_cancels(self) -> int:
        try:
            buckets = await self.zk.get_children(CANCELS)
        except NodeNotFoundError:
            return 0
        total = 0
        for bucket in buckets:
            stat = await self.zk.exists(f"{CANCELS}/{bucket}")
            total += stat.numChildren if stat is not None else 0
        return total

    async def sweep_cancels(self, now_ms: int) -> int:
        """Delete the buckets more than ``CANCEL_KEEP_MS`` past; returns how many."""
        try:
            buckets = await self.zk.get_children(CANCELS)
        except NodeNotFoundError:
            return 0
        old = [
            b for b in buckets if b.isdigit() and int(b) < cancel_bucket(now_ms - CANCEL_KEEP_MS)
        ]
        for bucket in old:
            with contextlib.suppress(NodeNotFoundError):
                await self.zk.delete(f"{CANCELS}/{bucket}", recursive=True)
        return len(old)

    # ---- statistics ----------------------------------------------------------------------
    async def write_stats(self, name: str, stats: dict[str, Any]) -> None:
        path = f"{STATS}/{name}"
        data = json.dumps(stats).encode()
        try:
            await self.zk.set(path, data)
        except NodeNotFoundError:
            try:
                await self.zk.create(path, data, makepath=True)
            except NodeExistsError:
                await self.zk.set(path, data)

    async def read_stats(self) -> dict[str, dict[str, Any]]:
        try:
            names = await self.zk.get_children(STATS)
        except NodeNotFoundError:
            return {}
        out = {}
        for name in names:
            try:
                data, _ = await self.zk.get(f"{STATS}/{name}")
            except NodeNotFoundError:
                continue
            out[name] = json.loads(data)
        return out
