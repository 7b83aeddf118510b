"""The partitions an agent hosts, and its role for each: leader, follower, or none.

ZooKeeper is the source of truth. The agent watches every partition state node
(``/topics/<t>/partitions/<p>/state``); a state naming this agent as leader makes it open
(or keep) the local log and accept writes stamped with that leader epoch; a state naming it
as a replica makes it a follower that copies the leader's batches; anything else closes the
partition here. Writes are refused (``NotLeaderError`` with the leader it knows) whenever:

* the latest state names another leader or another epoch (the agent is stale), or
* the agent's ZooKeeper session is SUSPENDED or LOST — it may already have been replaced, so
  it stops acting as a leader until the session is confirmed again (STYLE point 7).

Long-polling fetches wait on futures instead of sleeping, each on the one that can bring it
something: a follower's on ``data_arrived`` (completed at the next append), a consumer's and an
acks=all producer's on ``hw_moved`` (completed when the high watermark moves: a consumer sees
nothing above it). An append then wakes only the followers, and a high watermark move only the
consumers and producers; before, both woke every fetch of the partition, and each woken fetch
looked again and went back to waiting (three such looks per record at RF 3 with one
long-polling consumer). A change of state or role, and a close, wake both (``notify``).

Topic incarnations: a hosted partition remembers the topic id it was opened for, and its
directory says it too (``storage.wal.partition_meta``). A state of another incarnation of the
same name closes the old log and deletes its directory before the new one is opened; a
directory left by an older incarnation (this agent was down while the topic was deleted) is
removed at open, never reopened. A state marked ``deleting``, or of an incarnation this agent
has removed (``remove_topic``, a delete's step 3), is treated as no state at all: the
partition is closed and its directory deleted, and it is not opened again.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from broker_agents.preopen import Preopened, close_all
from storage.config import FsyncPolicy, LogConfig
from storage.errors import NotLeaderError, StorageError, UnknownTopicOrPartitionError
from storage.metadata import PartitionState, TopicConfig
from storage.wal import GroupCommitLog, PartitionLog, fileio
from storage.wal.agent import AgentWal, WalPartition
from storage.wal.partition_meta import read_topic_id, write_topic_id

log = logging.getLogger(__name__)

#: threads that create and open partition directories: their fsyncs mostly wait on the disk,
#: and the more of them wait together, the more one journal commit covers
OPEN_THREADS = 16


class _Gate:
    """Many holders of ``shared`` at once, or one of ``exclusive``.

    ``apply`` of different partitions runs concurrently (each also under its partition's own
    lock), so that opening thousands of logs overlaps their fsyncs instead of paying them one
    after another; what works on every partition at once (``remove_topic``, ``sweep_stray``,
    ``close``) is exclusive. Waiters are served in order: an exclusive waiter holds back the
    shared ones that come after it.
    """

    def __init__(self) -> None:
        self._order = asyncio.Lock()
        self._shared = 0
        self._no_shared = asyncio.Event()
        self._no_shared.set()

    @contextlib.asynccontextmanager
    async def shared(self) -> AsyncIterator[None]:
        async with self._order:
            self._shared += 1
            self._no_shared.clear()
        try:
            yield
        finally:
            self._shared -= 1
            if not self._shared:
                self._no_shared.set()

    @contextlib.asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        async with self._order:
            await self._no_shared.wait()
            yield


@dataclass(eq=False)
class Partition:
    """One partition hosted here, and (as leader) the replication bookkeeping of KIP-101 style.

    As leader it tracks every follower's log end offset (the offset of its last Fetch) and the
    last time the follower was caught up (its fetch reached the leader's log end as of the
    follower's previous fetch). The high watermark is the smallest log end offset over the
    in-sync replicas (the leader included); it never moves back. Consumers read below it;
    acks=all producers wait for it to pass their records.
    """

    topic: str
    index: int
    config: TopicConfig
    state: PartitionState
    log: PartitionLog
    committer: GroupCommitLog | WalPartition
    role: str  # "leader" | "follower"
    agent_id: int = -1
    topic_id: str = ""  # the incarnation of the topic this log belongs to
    hw: int = 0
    follower_leo: dict[int, int] = field(default_factory=dict)
    caught_up_at: dict[int, float] = field(default_factory=dict)
    last_fetch_leo: dict[int, int] = field(default_factory=dict)
    leader_since: float = 0.0
    #: followers this leader is adding to the ISR (written to ZooKeeper, not yet back through
    #: the watch): counted for the high watermark already, as Kafka's "maximal ISR" — else a
    #: record could be acknowledged without them in the window, and one of them, in the ISR
    #: by ZooKeeper's state, be made leader without it
    pending_isr: set[int] = field(default_factory=set)
    #: the ZooKeeper version of the state node that holds ``pending_isr`` (written by this
    #: leader; unbounded while the write is in flight) and of the state applied here (-1:
    #: unknown). A state at least as new as the write that lacks a pending member has it
    #: removed by a later writer (the controller dropping a dead replica): it stops counting
    pending_isr_version: float = float("inf")
    state_version: int = -1
    #: a follower that changed leader (or epoch) must truncate by epoch before fetching
    needs_epoch_check: bool = True
    data_arrived: asyncio.Future[None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )
    hw_moved: asyncio.Future[None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )

    @property
    def high_watermark(self) -> int:
        return min(self.hw, self.log.log_end_offset)

    @property
    def last_stable_offset(self) -> int:
        """Where ``read_committed`` reads stop (``storage.wal.txn``): the first offset of the
        oldest transaction not yet ended with a marker below the high watermark."""
        return self.log.last_stable_offset(self.high_watermark)

    def notify(self) -> None:
        """Wake every fetch (and acks=all producer) waiting for news on this partition: its
        state, role or log changed."""
        self.appended()
        self._hw_moved()

    def appended(self) -> None:
        """Wake the followers' fetches: records were appended (consumers see them only once
        the high watermark passes them, which ``advance_hw`` tells)."""
        if not self.data_arrived.done():
            self.data_arrived.set_result(None)
        self.data_arrived = asyncio.get_running_loop().create_future()

    def _hw_moved(self) -> None:
        if not self.hw_moved.done():
            self.hw_moved.set_result(None)
        self.hw_moved = asyncio.get_running_loop().create_future()

    def become_leader(self, now: float) -> None:
        self.leader_since = now
        self.follower_leo.clear()
        self.last_fetch_leo.clear()
        self.pending_isr.clear()
        # a grace period: followers in the ISR count as caught up when leadership starts
        self.caught_up_at = {r: now for r in self.state.isr if r != self.agent_id}
        self.advance_hw()

    def follower_fetched(self, replica: int, fetch_offset: int, now: float) -> None:
        """A follower's Fetch at ``fetch_offset``: everything below it is in its log."""
        if replica not in self.state.replicas:
            return
        leo = self.log.log_end_offset
        if fetch_offset >= leo or fetch_offset >= self.last_fetch_leo.get(replica, leo + 1):
            self.caught_up_at[replica] = now
        self.last_fetch_leo[replica] = leo
        self.follower_leo[replica] = min(fetch_offset, leo)
        self.advance_hw()

    def advance_hw(self) -> None:
        if self.role != "leader":
            return
        hw = self.log.log_end_offset
        self.pending_isr.difference_update(self.state.isr)
        if self.pending_isr and self.state_version >= self.pending_isr_version:
            self.pending_isr.clear()  # superseded: ZooKeeper no longer names them in sync
        for r in (*self.state.isr, *self.pending_isr):
            if r != self.agent_id:
                hw = min(hw, self.follower_leo.get(r, -1))
        if hw > self.hw:
            self.hw = hw
            self._hw_moved()

    def rejoins(self, replica: int, now: float, lag_max_s: float) -> bool:
        """Whether ``replica``, a follower outside the ISR, has reached the high watermark (and
        this leader's first offset: nothing it has of an older epoch can be divergent) and has
        been caught up within ``lag_max_s``."""
        leo = self.follower_leo.get(replica)
        if (
            leo is None
            or replica in self.state.isr
            or self.role != "leader"
            or now - self.caught_up_at.get(replica, 0) > lag_max_s
        ):
            return False
        epoch_start = (
            self.log.end_offset_for_epoch(self.state.leader_epoch - 1)[1]
            if self.state.leader_epoch
            else 0
        )
        return leo >= max(self.hw, epoch_start)

    def isr_changes(self, now: float, lag_max_s: float) -> list[int] | None:
        """The ISR this leader wants now (None: keep it): drop followers that have not been
        caught up for ``lag_max_s``, take back followers that reached the high watermark."""
        isr = [
            r
            for r in self.state.isr
            if r == self.agent_id or now - self.caught_up_at.get(r, self.leader_since) <= lag_max_s
        ]
        for r in self.state.replicas:
            if r not in isr and self.rejoins(r, now, lag_max_s):
                isr.append(r)
        if self.agent_id not in isr:
            isr.insert(0, self.agent_id)
        return None if sorted(isr) == sorted(self.state.isr) else isr


def _prepare_directory(directory: Path, topic: str, topic_id: str) -> tuple[bool, bool, bool]:
    """Before a log is opened in ``directory`` (on a worker thread): remove it if another
    incarnation of ``topic`` left it; create it if missing, with its ``partition.metadata``,
    neither name fsynced yet (``PartitionManager._open_log`` says by what they are).

    Returns (removed, created, whether the directory says ``topic_id`` already)."""
    found = read_topic_id(directory) if topic_id else None
    removed = found is not None and found != topic_id
    if removed:
        log.warning(
            "%s: left by incarnation %s of topic %s, which was deleted; removing it",
            directory,
            found,
            topic,
        )
        fileio.fs.remove_tree(directory)
    created = not directory.is_dir()
    if created:
        with fileio.storage_errors(f"cannot create {directory}"):
            fileio.fs.make_dirs(directory, sync_parent=False)
        if topic_id:
            write_topic_id(directory, topic_id, sync_dir=False)
    return removed, created, created or (bool(topic_id) and found == topic_id)


def _open_new_or_existing(
    directory: Path, config: TopicConfig, start: int, created: bool, flushed: bool
) -> PartitionLog:
    """``PartitionLog.open``; a log just created in a new directory is flushed at once: one
    fsync of the directory covers its first segment's name and ``partition.metadata``'s."""
    plog = PartitionLog.open(directory, config.log_config(), start_offset=start, flushed=flushed)
    if created:
        try:
            plog.flush()
        except BaseException:
            plog.close()
            raise
    return plog


class _DirSync:
    """fsyncs of one directory, shared: a caller returns once an fsync that started after its
    call has completed, and callers that arrive while one runs share the next one (a group
    commit for the names of many new partition directories)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._next: asyncio.Future[None] | None = None
        self._task: asyncio.Task[None] | None = None

    async def sync(self) -> None:
        if self._next is None:
            self._next = asyncio.get_running_loop().create_future()
            self._next.add_done_callback(_retrieve)
            if self._task is None:
                self._task = asyncio.get_running_loop().create_task(
                    self._run(), name=f"fsync:{self.path}"
                )
        await asyncio.shield(self._next)

    async def _run(self) -> None:
        try:
            while self._next is not None:
                done, self._next = self._next, None
                try:
                    with fileio.storage_errors(f"cannot fsync {self.path}"):
                        await asyncio.to_thread(fileio.fs.fsync_dir, self.path)
                except Exception as exc:
                    done.set_exception(exc)
                except BaseException:
                    done.cancel()
                    raise
                else:
                    done.set_result(None)
        finally:
            self._task = None
            if self._next is not None and not self._next.done():
                self._next.cancel()  # cancelled (the agent stops): the waiters see it
                self._next = None


def _retrieve(fut: asyncio.Future[None]) -> None:
    if not fut.cancelled():
        fut.exception()  # seen by the waiters; not "never retrieved" if they all went


class PartitionManager:
    def __init__(self, agent_id: int, data_dir: Path) -> None:
        self.agent_id = agent_id
        self.data_dir = data_dir
        #: this process's incarnation (``AgentRegistration.incarnation``)
        self.incarnation = uuid.uuid4().hex
        #: the previous process stopped cleanly (``broker_agents.clean_shutdown``): every log
        #: here was flushed and closed, and opening one need not fsync its tail (until a disk
        #: error here, after which nothing is assumed)
        self.after_clean_shutdown = False
        self.partitions: dict[tuple[str, int], Partition] = {}
        self.latest: dict[tuple[str, int], PartitionState] = {}
        self.session_ok = False
        #: incarnations removed here (deleted topics): never opened again by this process
        self.removed_ids: set[str] = set()
        self._gate = _Gate()
        #: the data directory's fsync, shared by the partitions created at the same time
        self._data_dir_sync = _DirSync(data_dir)
        self._opener = concurrent.futures.ThreadPoolExecutor(
            OPEN_THREADS, thread_name_prefix="partition-open"
        )
        #: the logs opened at start, before any state arrived (``broker_agents.preopen``)
        self.preopened = Preopened()
        #: one lock per partition being applied (see ``_Gate``), with its number of users
        self._key_locks: dict[tuple[str, int], tuple[asyncio.Lock, int]] = {}
        #: the object tier's hook: where a new leader's log must start (its manifest's end)
        self.tier_start_offset: Callable[[str, int], Awaitable[int]] | None = None
        #: told after a hosted partition's log failed on disk and was closed here (the agent
        #: marks it offline, so the controller moves it away, and applies its state again later)
        self.on_disk_failure: Callable[[tuple[str, int], StorageError], Awaitable[None]] | None = (
            None
        )
        #: partitions closed after a disk error and not opened again yet
        self._disk_failed: set[tuple[str, int]] = set()
        #: of those, the ones closed after a failed fsync: the end of what their disk holds
        self._durable_end: dict[tuple[str, int], int] = {}
        self._failing: dict[tuple[str, int], asyncio.Task[None]] = {}
        #: the agent WAL (None: each partition log fsyncs its own files), and the fsync
        #: policies whose topics use it
        self.wal: AgentWal | None = None
        self.wal_policies: frozenset[FsyncPolicy] = frozenset()
        #: ``wal.mode=auto``: (topic partitions, own commits) past which an ``always``
        #: partition goes on the WAL as well (``_uses_wal``); None: the policies decide alone
        self.wal_auto: tuple[int, int] | None = None
        #: hosted ``always`` partitions with their own group commit (``wal_auto``'s count)
        self._own_commits: set[tuple[str, int]] = set()

    @contextlib.asynccontextmanager
    async def _partition_lock(self, key: tuple[str, int]) -> AsyncIterator[None]:
        """Held while changing ``key``'s role: its state changes apply one at a time, in
        order, while other partitions' apply alongside (under the shared gate)."""
        async with self._gate.shared():
            lock, users = self._key_locks.get(key, (None, 0))
            if lock is None:
                lock = asyncio.Lock()
            self._key_locks[key] = (lock, users + 1)
            try:
                async with lock:
                    yield
            finally:
                lock, users = self._key_locks[key]
                if users == 1:
                    del self._key_locks[key]
                else:
                    self._key_locks[key] = (lock, users - 1)

    def directory(self, topic: str, partition: int) -> Path:
        return self.data_dir / f"{topic}-{partition}"

    # ---- lookups used by the request handlers ------------------------------------------
    def leader_for_write(self, topic: str, partition: int) -> Partition:
        """The partition if this agent may act as its leader right now, else a typed error."""
        key = (topic, partition)
        p = self.partitions.get(key)
        latest = self.latest.get(key)
        if latest is None:
            raise UnknownTopicOrPartitionError(f"unknown topic or partition {topic}-{partition}")
        if (
            p is None
            or p.role != "leader"
            or latest.leader != self.agent_id
            or p.state.leader_epoch != latest.leader_epoch
        ):
            raise NotLeaderError(
                f"agent {self.agent_id} is not the leader of {topic}-{partition}",
                leader_id=latest.leader,
                leader_epoch=latest.leader_epoch,
            )
        if not self.session_ok:
            raise NotLeaderError(
                f"agent {self.agent_id} has no confirmed ZooKeeper session; refusing to lead",
                leader_id=-1,
                leader_epoch=latest.leader_epoch,
            )
        return p

    def hosted(self, topic: str, partition: int) -> Partition | None:
        return self.partitions.get((topic, partition))

    # ---- reacting to ZooKeeper ----------------------------------------------------------
    async def apply(
        self,
        topic: str,
        partition: int,
        state: PartitionState | None,
        config: TopicConfig | None,
        topic_id: str = "",
        version: int = -1,
        topic_partitions: int = 0,
    ) -> None:
        """Make this agent's role for ``topic-partition`` match ``state`` (None: topic gone).

        ``topic_id`` is the topic spec's id, used when the state predates ids in states;
        ``version`` the ZooKeeper version ``state`` was read at (-1: not known);
        ``topic_partitions`` the topic's partition count (0: not known; ``_uses_wal``).
        Calls for different partitions may run concurrently; for one partition they apply
        one at a time, in the order they were made."""
        key = (topic, partition)
        async with self._partition_lock(key):
            current = self.partitions.get(key)
            if state is not None:
                topic_id = state.topic_id or topic_id
                if state.deleting or topic_id in self.removed_ids:
                    state = None  # the topic is being deleted: nobody hosts it any more
            if state is None:
                self.latest.pop(key, None)
                self._disk_failed.discard(key)
                self._durable_end.pop(key, None)
                if current is not None:
                    await self._close(current, delete=True)
                return
            if current is not None and topic_id and current.topic_id != topic_id:
                log.info(
                    "%s-%d: the topic was created again (id %s, was %s): dropping the old log",
                    topic,
                    partition,
                    topic_id,
                    current.topic_id,
                )
                await self._close(current, delete=True)
                current = None
            self.latest[key] = state
            if self.agent_id == state.leader and state.in_sync_as(self.agent_id, self.incarnation):
                role = "leader"
            elif self.agent_id == state.leader:
                # elected before this process started: what it had not fsynced may be gone,
                # so it waits for the controller to see the restart and elect again (another
                # in-sync replica, or this one at a new epoch); its log stays as it is
                log.debug(  # counted in the reconcile loop's line (``Agent._apply_all``)
                    "%s-%d: led by an earlier incarnation of this agent; waiting for the"
                    " controller",
                    topic,
                    partition,
                )
                if current is None:
                    return
                role = "follower"
            elif self.agent_id in state.replicas:
                role = "follower"
            else:
                role = ""
            if not role:
                if current is not None:
                    # moved away (reassignment): the new replicas have everything
                    await self._close(current, delete=True)
                return
            if (
                current is not None
                and role == "leader"
                and current.role != "leader"
                and self.tier_start_offset is not None
                and current.log.log_end_offset < await self.tier_start_offset(topic, partition)
            ):
                # promoted with a log that ends below the object tier (a replica that had
                # not caught up): reopen it where the tier ends, as a new leader's open does
                await self._close(current, delete=False)
                current = None
            if current is None:
                assert config is not None
                plog = await self._open_log(topic, partition, config, role, topic_id)
                committer: GroupCommitLog | WalPartition
                if self.wal is not None and self._uses_wal(plog.config, topic_partitions):
                    try:
                        committer = await self.wal.register(plog, topic_id)
                    except BaseException:
                        plog.close()
                        raise
                else:
                    committer = GroupCommitLog(plog)
                    if plog.config.fsync_policy is FsyncPolicy.ALWAYS:
                        self._own_commits.add(key)
                await committer.start()
                current = Partition(
                    topic,
                    partition,
                    config,
                    state,
                    plog,
                    committer,
                    role,
                    agent_id=self.agent_id,
                    topic_id=topic_id,
                    state_version=version,
                )
                self.partitions[key] = current
                plog.on_io_error = functools.partial(self._disk_error, key)
                # one line per partition costs more than its open when thousands come at
                # once: the reconcile loop logs one line per round (``Agent._apply_all``)
                log.debug(
                    "hosting %s-%d as %s (epoch %d)", topic, partition, role, state.leader_epoch
                )
                if role == "leader":
                    current.become_leader(time.monotonic())
            else:
                changed = (current.role, current.state.leader_epoch, current.state.leader) != (
                    role,
                    state.leader_epoch,
                    state.leader,
                )
                if changed:
                    log.info(
                        "%s-%d: %s -> %s (epoch %d)",
                        topic,
                        partition,
                        current.role,
                        role,
                        state.leader_epoch,
                    )
                current.role = role
                current.state = state
                current.state_version = max(current.state_version, version)
                if changed and role == "leader":
                    current.become_leader(time.monotonic())
                elif changed:
                    current.needs_epoch_check = True
                current.advance_hw()
            current.notify()

    async def _open_log(
        self, topic: str, partition: int, config: TopicConfig, role: str, topic_id: str
    ) -> PartitionLog:
        """Open the local log; one whose disk is behind the object tier starts at its end.

        After a disk error (``_disk_error``) the log is opened again only once the data
        directory has room for the largest batch, and after a failed fsync it is first cut
        back to what was fsynced before the failure: the page cache may still show the rest,
        but the disk may not have it (fsyncgate).

        A directory of another incarnation of the topic is removed first (module docstring).

        A new directory costs three fsyncs, not one per step: its name, through one fsync of
        the data directory shared by every partition created meanwhile (``_DirSync``); its
        ``partition.metadata`` (the temporary file); and one fsync of the directory itself,
        the new log's first flush, which makes both its first segment's name and
        ``partition.metadata``'s durable. Nothing is hosted before all three are done.
        """
        key = (topic, partition)
        directory = self.directory(topic, partition)
        if key in self._disk_failed:
            need = config.log_config().max_message_bytes
            free = await asyncio.to_thread(fileio.fs.free_bytes, self.data_dir)
            if free < need:
                raise StorageError(
                    f"{free} bytes free in {self.data_dir}: not taking {topic}-{partition}"
                    f" back before {need} are"
                )
        start = 0
        if self.tier_start_offset is not None:
            # a leader must not serve a gap; a follower need not copy what the bucket holds
            # (a new replica, e.g. a move, catches up on the untiered tail only)
            start = await self.tier_start_offset(topic, partition)
        warm = self.preopened.take(key, config, topic_id) if key not in self._disk_failed else None
        if warm is not None:
            plog, has_id = warm, True  # its directory names ``topic_id`` (``preopen``)
        else:
            loop = asyncio.get_running_loop()
            removed, created, has_id = await loop.run_in_executor(
                self._opener, _prepare_directory, directory, topic, topic_id
            )
            if removed:
                self._durable_end.pop(key, None)  # said of the removed incarnation's log
            if created:
                await self._data_dir_sync.sync()
            plog = await loop.run_in_executor(
                self._opener,
                _open_new_or_existing,
                directory,
                config,
                start,
                created,
                self.after_clean_shutdown and not self._disk_failed,
            )
        durable = self._durable_end.get(key)
        if durable is not None and plog.log_end_offset <= durable:
            # the failed fsync covered nothing of this partition past what an earlier one did
            log.info(
                "%s-%d: the log ends at %d, within what was last fsynced (%d): nothing to cut",
                topic,
                partition,
                plog.log_end_offset,
                durable,
            )
        elif durable is not None:
            log.warning(
                "%s-%d: cutting the log back from %d to %d, where it was last fsynced",
                topic,
                partition,
                plog.log_end_offset,
                durable,
            )
            try:
                await asyncio.to_thread(plog.truncate_to, max(durable, plog.log_start_offset))
            except BaseException:
                plog.close()
                raise
        self._durable_end.pop(key, None)
        self._disk_failed.discard(key)
        if plog.log_end_offset < start:
            # everything on this disk is committed to the tier: serve history from there
            log.info(
                "%s-%d: local log ends at %d, tier at %d",
                topic,
                partition,
                plog.log_end_offset,
                start,
            )
            plog.close()
            await asyncio.to_thread(fileio.fs.remove_tree, directory)
            plog = await asyncio.to_thread(
                PartitionLog.open, directory, config.log_config(), start_offset=start
            )
            has_id = False
        if (
            topic_id
            and not has_id
            and await asyncio.to_thread(read_topic_id, directory) != topic_id
        ):
            try:
                await asyncio.to_thread(write_topic_id, directory, topic_id)
            except BaseException:
                plog.close()
                raise
        return plog

    def _disk_error(self, key: tuple[str, int], exc: StorageError) -> None:
        """``PartitionLog.on_io_error``: close the partition here and report it (once)."""
        p = self.partitions.get(key)
        if p is None or key in self._failing:
            return
        task = asyncio.get_running_loop().create_task(
            self._close_failed(key, p, exc), name=f"disk-failure:{key[0]}-{key[1]}"
        )
        self._failing[key] = task
        task.add_done_callback(lambda _: self._failing.pop(key, None))

    async def _close_failed(self, key: tuple[str, int], p: Partition, exc: StorageError) -> None:
        async with self._partition_lock(key):
            if self.partitions.get(key) is not p:
                return
            log.error("%s-%d: disk error, closing the partition here: %s", key[0], key[1], exc)
            self._disk_failed.add(key)
            try:
                await self._close(p, delete=False)
            except StorageError as close_exc:  # e.g. the flush at close failed as well
                log.error("%s-%d: closing after the disk error: %s", key[0], key[1], close_exc)
            if p.log.durable_end_at_failure is not None:
                self._durable_end[key] = p.log.durable_end_at_failure
        if self.on_disk_failure is not None:
            await self.on_disk_failure(key, exc)

    async def sweep_stray(self, topics: dict[str, str]) -> int:
        """Remove local partition directories of deleted incarnations: those whose
        ``partition.metadata`` names an id that ``topics`` (name -> current id, every topic
        that exists) does not give their topic. Run once at start-up, for directories left by
        deletes that happened while this agent was down. Hosted partitions and directories
        without the file (from before topic ids) are left alone. Returns how many went.

        The scan reads every directory's ``partition.metadata`` without holding the gate
        (2 s at 10,000 partitions, during which a restart hosted nothing while it was held);
        only what it found is read again and removed under the exclusive gate, once no
        partition is being opened and the hosted set is settled. Directories the warm start
        found to be of their topic's current incarnation are not read again (a delete since
        removes them itself)."""

        def stray(candidates: list[Path], hosted: set[Path]) -> list[Path]:
            found: list[Path] = []
            for d in candidates:
                name, sep, index = d.name.rpartition("-")
                if not sep or not index.isdigit() or d in hosted or not d.is_dir():
                    continue
                try:
                    topic_id = read_topic_id(d)
                except StorageError:
                    continue  # unreadable: not ours to judge
                if topic_id is not None and topics.get(name) != topic_id:
                    found.append(d)
            return found

        def scan(hosted: set[Path]) -> list[Path]:
            if not self.data_dir.exists():
                return []
            return stray(list(self.data_dir.iterdir()), hosted)

        found = await asyncio.to_thread(
            scan, {self.directory(t, i) for t, i in self.partitions} | self.preopened.verified
        )
        if not found:
            return 0
        async with self._gate.exclusive():
            hosted = {self.directory(t, i) for t, i in self.partitions}

            def remove() -> list[Path]:
                gone = stray(found, hosted)
                for d in gone:
                    fileio.fs.remove_tree(d)
                return gone

            gone = await asyncio.to_thread(remove)
        for d in gone:
            log.info("%s: left by a deleted topic; removed", d)
        return len(gone)

    def forbid(self, topic_id: str) -> None:
        """Never open a partition of incarnation ``topic_id`` again (it is being deleted);
        ``apply`` closes hosted ones as their states arrive, ``remove_topic`` all at once."""
        self.removed_ids.add(topic_id)

    async def remove_topic(self, topic: str, topic_id: str) -> int:
        """A delete's step 3 on this agent: close every hosted partition of ``topic``'s
        incarnation ``topic_id`` and delete the topic's local directories; the incarnation is
        never opened again here. Returns the directories removed.

        While a name is being deleted no other incarnation of it can exist, so every
        ``<topic>-<p>`` directory not hosted is this incarnation's or an older one's.
        """
        async with self._gate.exclusive():
            self.removed_ids.add(topic_id)
            self.preopened.discard_topic(topic)
            for key, p in list(self.partitions.items()):
                if key[0] == topic and p.topic_id in (topic_id, ""):
                    self.latest.pop(key, None)
                    await self._close(p, delete=True)
            hosted = {self.directory(t, i) for t, i in self.partitions}
            pattern = re.compile(re.escape(topic) + r"-\d+")

            def sweep() -> int:
                if not self.data_dir.exists():
                    return 0
                gone = [
                    d
                    for d in self.data_dir.iterdir()
                    if pattern.fullmatch(d.name) and d.is_dir() and d not in hosted
                ]
                for d in gone:
                    fileio.fs.remove_tree(d)
                return len(gone)

            removed = await asyncio.to_thread(sweep)
            if removed:
                log.info(
                    "%s (id %s): removed %d local partition directories", topic, topic_id, removed
                )
            return removed

    def _uses_wal(self, config: LogConfig, topic_partitions: int) -> bool:
        """Whether a partition opened now goes on the agent WAL: its fsync policy's topics do
        (``wal_policies``), and under ``wal.mode=auto`` an ``always`` partition does too when
        its topic has more than ``wal.auto.topic.partitions`` partitions (keyed writes spread
        every request thin over them: a round of small appends to many files, one fsync each,
        where the WAL gives the round one) or when ``wal.auto.max.own.commits`` partitions
        here already fsync their own files (so the fsyncs of a round stay bounded however
        many topics there are). A partition keeps its committer until it is closed."""
        if config.fsync_policy in self.wal_policies:
            return True
        if self.wal_auto is None or config.fsync_policy is not FsyncPolicy.ALWAYS:
            return False
        many, cap = self.wal_auto
        return topic_partitions > many or len(self._own_commits) >= cap

    async def _close(self, p: Partition, *, delete: bool) -> None:
        self.partitions.pop((p.topic, p.index), None)
        self._own_commits.discard((p.topic, p.index))
        p.role = "closed"  # acks=all waiters see it and answer NOT_LEADER instead of timing out
        p.notify()
        await p.committer.close()
        if delete:
            await asyncio.to_thread(fileio.fs.remove_tree, self.directory(p.topic, p.index))

    async def close(self) -> bool:
        """Close every hosted log (each flushes its files); whether all of them were flushed
        and closed with no disk error (``broker_agents.clean_shutdown``)."""
        clean = not self._disk_failed
        async with self._gate.exclusive():
            for p in list(self.partitions.values()):
                await self._close(p, delete=False)
                clean = clean and not p.log.failed
            await asyncio.to_thread(close_all, self.preopened.detach())
        self._opener.shutdown(wait=False)
        return clean
