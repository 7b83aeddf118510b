"""The agent's side of the object tier: seal, upload, commit, serve, retain, reconcile.

For every partition this agent leads, one pass of the uploader (every
``tier.check.interval.ms``, at most ``tier.upload.concurrency`` partitions at a time):

1. **Seal.** Segments roll by ``segment.bytes`` on append; an idle active segment older than
   ``segment.ms`` is rolled here, and a sealed segment is flushed (fsync + index) first.
2. **Upload.** Each sealed, flushed segment at the manifest's end whose every transaction has
   ended (the partition's last stable offset is past its end; at most
   ``transaction.max.timeout.ms`` after a transaction starts, the coordinator aborts it)
   becomes one object (``storage.tier.layout``: batches + footer, the footer listing the
   aborted transactions with batches in it) under its deterministic key, create-only
   (``If-None-Match: *``); above ``tier.multipart.part.bytes`` it goes up in parts, one part in
   memory at a time. A 412 whose trailer equals ours (same bytes) counts as done — that is how
   an agent restart, or a new leader, resumes an upload that had finished.
3. **Commit.** The segment is appended to the manifest (``storage.tier.manifest``) in a
   ZooKeeper transaction that checks the partition state's version (naming this agent leader
   with its epoch) and the manifest's version. On a conflict the manifest is re-read: a
   segment already there is done (never committed twice). After every successful manifest
   change a copy goes to the bucket (``storage.tier.snapshot``) for readers that do not talk
   to ZooKeeper (the SDK's replay, Spark).
4. **Local retention.** Committed segments are deleted from disk by ``local.retention.ms`` /
   ``local.retention.bytes`` (-2: the total retention's values); followers do the same in
   ``broker_agents.retention``.

Every ``tier.retention.check.interval.ms`` the **retention sweep** removes segments older than
``retention.ms`` (by their largest record timestamp) or beyond ``retention.bytes`` from the
manifest first (the log start offset advances; consumers below it get OFFSET_OUT_OF_RANGE),
then deletes their objects and local files. Every ``tier.orphan.check.interval.ms`` the
**reconciler** lists the partition's objects and deletes those not in the manifest: expired
leftovers at once, others once older than ``tier.orphan.grace.ms`` (never one this agent has
uploaded and not yet committed).

**Backpressure.** Bytes on disk not yet committed to the tier are counted per partition; when
the agent's total passes ``tier.max.pending.bytes``, produce requests get
``UploadBacklogError`` (retriable) until uploads catch up. So an S3 outage costs producers
latency, never unbounded disk; memory is bounded by the upload concurrency times one part.

**Reads.** Fetch and ListOffsets for offsets below the local log start and at or above the
manifest's start are served from the tier by ``TierReader`` (range reads, block cache,
read-ahead) — the same batch bytes the local log would have returned; a read_committed fetch
gets the aborted transactions from the footers of the segments it read (``aborted``).

**Recovery.** A new leader opens its log at the manifest's end when its disk is empty or
behind (the ``tier_start_offset`` hook of ``PartitionManager``), so it serves all committed
history from the tier and appends after it.

**Topic incarnations and deletes.** Object keys and snapshots carry the partition's own topic
id (``Partition.topic_id``), never a possibly newer spec's. A leader with nothing committed
yet puts an empty snapshot (create-only), so readers can tell "exists, nothing tiered" from
"deleted". Every pass over a partition (upload, retention, orphans) is counted per topic;
``quiesce(topic)`` waits until none runs, after which — the partitions being closed — this
agent puts nothing more for the topic: an agent confirms a delete's step 3 only after it,
so no upload or snapshot of a deleted topic can land after the controller has listed what
to delete (``broker_agents.deletion``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import mmap
import os
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import TYPE_CHECKING, Any

from broker_agents.retention import local_limits, retention_cut
from storage.errors import (
    MetadataError,
    NodeNotFoundError,
    NotLeaderError,
    ObjectExistsError,
    OffsetOutOfRangeError,
    StorageError,
    StrataError,
    UploadBacklogError,
)
from storage.filters import Filter, FilterScan
from storage.metadata.store import partition_path, state_path
from storage.protocol import messages as m
from storage.tier import (
    Manifest,
    ObjectStore,
    ObjectStoreConfig,
    SegmentEntry,
    TierReader,
    build_footer,
    decode_footer,
    parse_key,
)
from storage.tier.layout import TRAILER_SIZE, segment_prefix
from storage.tier.snapshot import ManifestSnapshot, snapshot_key

if TYPE_CHECKING:
    from broker_agents.config import AgentConfig
    from broker_agents.partitions import Partition, PartitionManager
    from broker_agents.view import ClusterView
    from storage.metadata import AsyncZooKeeper, MetadataStore
    from storage.wal.segment import Segment

log = logging.getLogger(__name__)

Key = tuple[str, int]


def segments_path(topic: str, partition: int) -> str:
    return f"{partition_path(topic, partition)}/segments"


class Tiering:
    def __init__(
        self,
        agent_id: int,
        config: AgentConfig,
        partitions: PartitionManager,
        view: ClusterView,
        zk: AsyncZooKeeper,
        meta: MetadataStore,
    ) -> None:
        self.agent_id = agent_id
        self.config = cfg = config
        self.partitions = partitions
        self.view = view
        self.zk = zk
        self.meta = meta
        bucket = cfg.s3_bucket or os.environ.get("STRATA_BUCKET") or None
        self.enabled = bucket is not None
        self.store: ObjectStore | None = None
        self.reader: TierReader | None = None
        if bucket is not None:
            self.store = ObjectStore(
                ObjectStoreConfig(
                    bucket=bucket,
                    endpoint_url=cfg.s3_endpoint_url,
                    region=cfg.s3_region,
                    prefix=cfg.s3_prefix,
                    request_timeout=cfg.s3_request_timeout_ms / 1000,
                    max_attempts=cfg.s3_max_attempts,
                    max_workers=cfg.tier_upload_concurrency + 8,
                    multipart_part_bytes=cfg.tier_multipart_part_bytes,
                )
            )
            self.reader = TierReader(
                self.store,
                cache_bytes=cfg.tier_cache_bytes,
                block_bytes=cfg.tier_read_block_bytes,
                readahead_blocks=cfg.tier_readahead_blocks,
            )
        #: manifest, znode version, leader epoch, topic id (the incarnation it was read for)
        self.manifests: dict[Key, tuple[Manifest, int, int, str]] = {}
        self.pending: dict[Key, int] = {}
        self.pending_total = 0
        self.uploading: set[str] = set()
        self.uploads = 0
        #: called with (seconds, bytes) after each segment upload (metrics)
        self.on_upload: Callable[[float, int], None] | None = None
        self._wake = asyncio.Event()
        #: passes (upload, retention, orphan check) running per topic, and their waiters
        self._busy: dict[str, int] = {}
        self._settled: dict[str, asyncio.Event] = {}
        #: (topic id, partition) whose empty snapshot is known to be in the bucket
        self._announced: set[tuple[str, int]] = set()

    # ---- hooks called by partitions.py and apis.py ----------------------------------------
    async def start_offset(self, topic: str, partition: int) -> int:
        """Where a new leader's empty (or stale) local log must start: the manifest's end."""
        if not self.enabled:
            return 0
        manifest, _ = await self._load_manifest(topic, partition)
        return manifest.end

    def check_backlog(self, p: Partition) -> None:
        """Raise ``UploadBacklogError`` when too many bytes wait for the object tier."""
        if not self.enabled:
            return
        key = (p.topic, p.index)
        live = self._pending_of(p)
        total = self.pending_total - self.pending.get(key, 0) + live
        if total > self.config.tier_max_pending_bytes:
            raise UploadBacklogError(
                f"{total} bytes wait for upload to the object tier "
                f"(limit {self.config.tier_max_pending_bytes}); retry later"
            )

    def log_start(self, p: Partition) -> int:
        local = p.log.log_start_offset
        cached = self.manifests.get((p.topic, p.index))
        if cached is None or cached[1] < 0 or cached[3] != p.topic_id:
            return local
        manifest = cached[0]
        return manifest.start if manifest.segments else max(manifest.start, local)

    async def prefetch(
        self, req: m.FetchRequest, filters: Mapping[Key, Filter]
    ) -> dict[Key, memoryview | FilterScan | StrataError]:
        """Tier reads for the partitions of a fetch whose offset is below the local log; a
        partition with a filter gets a filtered scan of the tier (``read_filtered``)."""
        out: dict[Key, memoryview | FilterScan | StrataError] = {}
        if not self.enabled:
            return out
        jobs = []
        for topic in req.topics:
            for fp in topic.partitions:
                p = self.partitions.hosted(topic.name, fp.partition)
                if p is None or p.role != "leader":
                    continue
                if fp.fetch_offset >= p.log.log_start_offset and (
                    fp.fetch_offset >= self.log_start(p)
                ):
                    continue
                limit = max(1, min(fp.partition_max_bytes, max(req.max_bytes, 1)))
                jobs.append((p, fp.fetch_offset, limit, filters.get((topic.name, fp.partition))))

        async def one(p: Partition, offset: int, limit: int, filt: Filter | None) -> None:
            try:
                out[(p.topic, p.index)] = (
                    await self.read(p, offset, limit)
                    if filt is None
                    else await self.read_filtered(p, offset, limit, filt)
                )
            except StrataError as exc:
                out[(p.topic, p.index)] = exc

        await asyncio.gather(*(one(*j) for j in jobs))
        return out

    async def read_filtered(
        self, p: Partition, offset: int, max_bytes: int, filt: Filter
    ) -> FilterScan:
        """A filtered scan of the tiered batches from ``offset``, up to the local log's start,
        ``max_bytes`` of matching batches or ``fetch.filter.max.scan.bytes`` looked at."""
        scan = FilterScan(filt, offset, max_bytes, self.config.fetch_filter_max_scan_bytes)
        block = self.config.tier_read_block_bytes
        while not scan.done and scan.next_offset < p.log.log_start_offset:
            scan.feed(await self.read(p, scan.next_offset, block))
        return scan

    async def read(self, p: Partition, offset: int, max_bytes: int) -> memoryview:
        assert self.reader is not None
        manifest, _ = await self._manifest(p)
        local = p.log.log_start_offset
        start = self.log_start(p)
        entry = manifest.find(offset)
        if offset < start or entry is None:
            raise OffsetOutOfRangeError(offset, start, p.log.log_end_offset)
        following = manifest.find(entry.next_offset)
        nxt = None
        if following is not None and following.base_offset < local:
            nxt = (self._key(p, following), following)
        return await self.reader.read(self._key(p, entry), entry, offset, max_bytes, nxt)

    async def aborted(self, p: Partition, start: int, end: int) -> list[m.AbortedTransaction]:
        """Aborted transactions with batches in ``[start, end)`` of the tiered segments, from
        the footers of the segments whose manifest entry counts some."""
        if not self.enabled:
            return []
        assert self.reader is not None
        manifest, _ = await self._manifest(p)
        out = []
        for entry in manifest.segments:
            if entry.next_offset <= start or not entry.aborted:
                continue
            if entry.base_offset >= end:
                break
            footer = await self.reader.footer(self._key(p, entry), entry)
            out += [
                m.AbortedTransaction(pid, first, stop)
                for pid, first, stop in footer.aborted
                if first < end and stop > start
            ]
        return out

    async def offset_for_timestamp(self, p: Partition, ts: int) -> int | None:
        """The first offset with timestamp >= ``ts`` among tiered segments below the local log."""
        if not self.enabled:
            return None
        assert self.reader is not None
        manifest, _ = await self._manifest(p)
        start = self.log_start(p)
        for entry in manifest.segments:
            if entry.base_offset >= p.log.log_start_offset:
                break
            if entry.next_offset <= start or entry.max_timestamp < ts:
                continue
            found = await self.reader.offset_for_timestamp(self._key(p, entry), entry, ts)
            if found is not None:
                return max(found, start)
        return None

    # ---- the loops ------------------------------------------------------------------------
    async def start(self) -> None:
        """Before the agent serves: the object store's client made (``ObjectStore.start``)."""
        if self.store is not None:
            await self.store.start()

    async def run(self) -> None:
        if not self.enabled:
            return
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self._upload_loop(), name="tier-uploader")
                tg.create_task(self._retention_loop(), name="tier-retention")
                tg.create_task(self._orphan_loop(), name="tier-reconciler")
        finally:
            if self.reader is not None:
                await self.reader.close()
            if self.store is not None:
                await self.store.close()

    def _leaders(self) -> list[Partition]:
        if not self.partitions.session_ok:
            return []
        return [p for p in self.partitions.partitions.values() if p.role == "leader"]

    @contextlib.asynccontextmanager
    async def _working(self, topic: str) -> AsyncIterator[None]:
        """Count a pass over one of ``topic``'s partitions (see ``quiesce``)."""
        self._busy[topic] = self._busy.get(topic, 0) + 1
        try:
            yield
        finally:
            self._busy[topic] -= 1
            if not self._busy[topic]:
                del self._busy[topic]
                settled = self._settled.pop(topic, None)
                if settled is not None:
                    settled.set()

    async def quiesce(self, topic: str) -> None:
        """Wait until no pass over a partition of ``topic`` runs, then forget its cached state.

        The caller has closed the topic's partitions (``PartitionManager.remove_topic``), so
        no new pass starts: once this returns, this agent uploads and puts nothing more for
        the topic."""
        while topic in self._busy:
            await self._settled.setdefault(topic, asyncio.Event()).wait()
        for key in [k for k in self.manifests if k[0] == topic]:
            del self.manifests[key]
        for key in [k for k in self.pending if k[0] == topic]:
            self._set_pending(key, None)

    async def _upload_loop(self) -> None:
        cfg = self.config
        sem = asyncio.Semaphore(cfg.tier_upload_concurrency)
        failures: dict[Key, tuple[int, float]] = {}

        async def one(p: Partition) -> None:
            key = (p.topic, p.index)
            fails, until = failures.get(key, (0, 0.0))
            if time.monotonic() < until:
                return
            async with sem, self._working(p.topic):
                if p.role != "leader":
                    return  # closed while waiting for a slot
                try:
                    await self.tier_partition(p)
                    failures.pop(key, None)
                except (StrataError, OSError) as exc:
                    delay = min(10.0, 0.2 * 2**fails)
                    failures[key] = (fails + 1, time.monotonic() + delay)
                    log.warning("tiering %s-%d failed (retry in %.1f s): %s", *key, delay, exc)

        while True:
            leaders = self._leaders()
            await asyncio.gather(*(one(p) for p in leaders))
            hosted = {(p.topic, p.index) for p in leaders}
            for key in list(self.pending):
                if key not in hosted:
                    self._set_pending(key, None)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(cfg.tier_check_interval_ms / 1000):
                    await self._wake.wait()
            self._wake.clear()

    async def tier_partition(self, p: Partition) -> None:
        """One uploader pass over ``p``: seal, upload, commit, local retention."""
        key = (p.topic, p.index)
        plog = p.log
        active = plog.active
        if active.size and (time.time() - active.created_at) * 1000 >= p.config.segment_ms:
            plog.roll()
        if plog.has_unflushed_sealed_segment:
            await p.committer.flush()
        manifest, version = await self._manifest(p)
        if version < 0 and (p.topic_id, p.index) not in self._announced:
            await self._announce(p)
        stable = p.last_stable_offset  # <= the high watermark
        for seg in plog.segments:
            if not seg.sealed or seg.dirty or seg.deleted or seg.next_offset > stable:
                break
            if manifest.segments and seg.next_offset <= manifest.end:
                continue
            if manifest.segments and seg.base_offset != manifest.end:
                raise StorageError(
                    f"{p.topic}-{p.index}: local segment {seg.base_offset} does not continue "
                    f"the manifest (end {manifest.end})"
                )
            entry = await self._upload(p, seg)
            manifest = await self._commit(p, entry)
            self._set_pending(key, self._pending_of(p))
        self._set_pending(key, self._pending_of(p))
        self._local_retention(p, manifest)

    def _set_pending(self, key: Key, value: int | None) -> None:
        """Record ``key``'s un-uploaded bytes (None: no longer hosted); keeps the total exact.

        The total moves with every change: a total recomputed only at the end of a pass is
        stale while a pass commits some segments and retries others, and ``check_backlog``
        (total - this partition's recorded + its live count) then undercounts.
        """
        old = self.pending.pop(key, 0)
        if value is not None:
            self.pending[key] = value
        self.pending_total += (value or 0) - old

    def _pending_of(self, p: Partition) -> int:
        cached = self.manifests.get((p.topic, p.index))
        end = cached[0].end if cached is not None and cached[0].segments else -1
        total = 0
        for seg in reversed(p.log.segments):
            if seg.next_offset <= end:
                break
            total += seg.size
        return total

    def _topic_id(self, p: Partition) -> str:
        """The incarnation ``p`` belongs to (the spec's for a state written before ids)."""
        if p.topic_id:
            return p.topic_id
        spec = self.view.topics.get(p.topic)
        return spec.topic_id if spec is not None else "-"

    def _key(self, p: Partition, entry: SegmentEntry) -> str:
        return entry.key(p.topic, self._topic_id(p), p.index, self.config.s3_prefix)

    async def _upload(self, p: Partition, seg: Segment) -> SegmentEntry:
        assert self.store is not None
        size = seg.size
        path = seg.path
        part = self.config.tier_multipart_part_bytes
        small = size + 64 * 1024 <= part
        # every transaction with batches here has ended (uploads wait for the LSO)
        aborted = [
            (a.producer_id, a.first_offset, a.last_offset)
            for a in p.log.aborted(seg.base_offset, seg.next_offset)
        ]

        def prepare() -> tuple[bytes | None, bytes]:
            with open(path, "rb") as f:
                if small:
                    data = f.read(size)
                    return data, build_footer(data[:size], aborted=aborted)
                with (
                    mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) as mm,
                    memoryview(mm) as view,  # read-only bytes-like: what crc32c accepts
                ):
                    return None, build_footer(view, aborted=aborted)

        data, footer = await asyncio.to_thread(prepare)
        entry = SegmentEntry.of(decode_footer(footer))
        key = self._key(p, entry)
        self.uploading.add(key)
        started = time.perf_counter()
        try:
            if data is not None:
                await self.store.put_if_absent(key, data + footer)
            else:

                async def read_part(start: int, end: int) -> bytes:
                    def run() -> bytes:
                        with open(path, "rb") as fh:
                            fh.seek(min(start, size))
                            body = fh.read(max(0, min(end, size) - start))
                        if end > size:
                            body += footer[max(0, start - size) : end - size]
                        return body

                    return await asyncio.to_thread(run)

                await self.store.put_multipart_if_absent(key, size + len(footer), read_part)
            self.uploads += 1
            if self.on_upload is not None:
                self.on_upload(time.perf_counter() - started, size + len(footer))
        except ObjectExistsError:
            theirs = await self.store.get_range(key, -TRAILER_SIZE, 0)
            if theirs != footer[-TRAILER_SIZE:]:
                self.uploading.discard(key)
                raise StorageError(f"{key} exists with different content") from None
        return entry

    # ---- the manifest ---------------------------------------------------------------------
    async def _load_manifest(self, topic: str, partition: int) -> tuple[Manifest, int]:
        try:
            data, stat = await self.zk.get(segments_path(topic, partition))
        except NodeNotFoundError:
            return Manifest(), -1
        return Manifest.decode(data, where=segments_path(topic, partition)), int(stat.version)

    async def _manifest(self, p: Partition) -> tuple[Manifest, int]:
        key = (p.topic, p.index)
        cached = self.manifests.get(key)
        if cached is None or cached[2] != p.state.leader_epoch or cached[3] != p.topic_id:
            manifest, version = await self._load_manifest(p.topic, p.index)
            self.manifests[key] = (manifest, version, p.state.leader_epoch, p.topic_id)
            return manifest, version
        return cached[0], cached[1]

    async def _write_manifest(
        self, p: Partition, change: Callable[[Manifest], Manifest | None]
    ) -> Manifest:
        """Apply ``change(manifest) -> Manifest | None`` with CAS + leader-epoch fence."""
        key = (p.topic, p.index)
        epoch = p.state.leader_epoch
        for _ in range(10):
            manifest, version = await self._manifest(p)
            new = change(manifest)
            if new is None:
                return manifest
            got = await self.meta.get_partition_state(p.topic, p.index)
            if got is None:
                raise NotLeaderError(f"{p.topic}-{p.index} has no state")
            state, sversion = got
            if state.leader != self.agent_id or state.leader_epoch != epoch:
                raise NotLeaderError(
                    f"not the leader of {p.topic}-{p.index} with epoch {epoch}",
                    leader_id=state.leader,
                    leader_epoch=state.leader_epoch,
                )
            if manifest.epoch > epoch:
                raise NotLeaderError(f"manifest fenced by epoch {manifest.epoch} > {epoch}")
            data = new.encode()

            def build(
                tx: Any, data: bytes = data, version: int = version, sv: int = sversion
            ) -> None:
                tx.check(state_path(p.topic, p.index), sv)
                if version < 0:
                    tx.create(segments_path(p.topic, p.index), data)
                else:
                    tx.set_data(segments_path(p.topic, p.index), data, version)

            try:
                await self.zk.transaction(build)
            except MetadataError as exc:
                log.info("manifest of %s-%d changed under us (%s); re-reading", *key, exc)
                self.manifests.pop(key, None)
                continue
            self.manifests[key] = (new, version + 1, epoch, p.topic_id)
            await self._publish_snapshot(p, new)
            return new
        raise StorageError(f"manifest of {p.topic}-{p.index}: too many conflicts")

    def _snapshot(self, p: Partition, manifest: Manifest) -> ManifestSnapshot:
        topic_id = self._topic_id(p)
        spec = self.view.topics.get(p.topic)
        created = spec.created_ms if spec is not None and spec.topic_id == topic_id else 0
        return ManifestSnapshot(
            p.topic, topic_id, p.index, manifest, int(time.time() * 1000), created
        )

    async def _publish_snapshot(self, p: Partition, manifest: Manifest) -> None:
        """Copy a committed manifest to the bucket for readers without ZooKeeper (best effort).

        See ``storage.tier.snapshot``: written only after the ZooKeeper commit, so it names
        committed segments only; a failed put is logged and the next change writes a newer one.
        Nothing is written for a partition that is closed or whose topic is being deleted.
        """
        assert self.store is not None
        if p.role == "closed" or p.topic_id in self.partitions.removed_ids:
            return
        key = snapshot_key(p.topic, p.index, self.config.s3_prefix)
        try:
            await self.store.put(key, self._snapshot(p, manifest).encode())
        except StrataError as exc:
            log.warning("manifest snapshot %s not written: %s", key, exc)

    async def _announce(self, p: Partition) -> None:
        """Put an empty snapshot for a partition with nothing committed yet (create-only: a
        leader's real snapshot always wins), so replay and Spark read the topic as existing
        and empty rather than unknown. A failure fails the pass (retried with its backoff)."""
        assert self.store is not None
        if p.role == "closed" or p.topic_id in self.partitions.removed_ids:
            return
        key = snapshot_key(p.topic, p.index, self.config.s3_prefix)
        with contextlib.suppress(ObjectExistsError):
            await self.store.put_if_absent(key, self._snapshot(p, Manifest()).encode())
        self._announced.add((p.topic_id, p.index))

    async def _commit(self, p: Partition, entry: SegmentEntry) -> Manifest:
        epoch = p.state.leader_epoch

        def change(manifest: Manifest) -> Manifest | None:
            if manifest.find(entry.base_offset) == entry:
                return None  # already committed (a retry after a lost reply)
            if manifest.segments and entry.next_offset <= manifest.end:
                return None
            return manifest.appended(entry, epoch)

        out = await self._write_manifest(p, change)
        self.uploading.discard(self._key(p, entry))
        return out

    # ---- retention ------------------------------------------------------------------------
    def _local_retention(self, p: Partition, manifest: Manifest) -> None:
        """Committed segments leave this leader's disk (followers: ``broker_agents.retention``)."""
        if not manifest.segments:
            return
        ms, limit = local_limits(p.config)
        cut = retention_cut(
            p.log,
            retention_ms=ms,
            retention_bytes=limit,
            upto=manifest.end,
            now_ms=time.time() * 1000,
        )
        if cut is not None:
            p.log.delete_segments_before(cut)

    async def committed_end(self, p: Partition) -> int:
        """Where the committed manifest of ``p`` ends (read from ZooKeeper; 0: nothing yet)."""
        manifest, _ = await self._load_manifest(p.topic, p.index)
        return manifest.end if manifest.segments else 0

    async def _retention_loop(self) -> None:
        interval = self.config.tier_retention_check_interval_ms / 1000
        while True:
            await asyncio.sleep(interval)
            for p in self._leaders():
                try:
                    async with self._working(p.topic):
                        if p.role == "leader":
                            await self.sweep(p)
                except (StrataError, OSError) as exc:
                    log.warning("retention of %s-%d failed: %s", p.topic, p.index, exc)

    async def sweep(self, p: Partition) -> int:
        """Total retention: drop expired segments from the manifest, then S3, then disk."""
        assert self.store is not None
        cfg = p.config
        now_ms = time.time() * 1000
        epoch = p.state.leader_epoch
        dropped: list[SegmentEntry] = []

        def change(manifest: Manifest) -> Manifest | None:
            dropped.clear()
            total = manifest.total_bytes
            for s in manifest.segments:
                expired = cfg.retention_ms >= 0 and s.max_timestamp < now_ms - cfg.retention_ms
                too_big = cfg.retention_bytes >= 0 and total - s.size >= cfg.retention_bytes
                if not (expired or too_big):
                    break
                dropped.append(s)
                total -= s.size
            return manifest.trimmed(len(dropped), epoch) if dropped else None

        manifest = await self._write_manifest(p, change)
        if not dropped:
            return 0
        log.info(
            "%s-%d: retention removed %d segments; log start is now %d",
            p.topic,
            p.index,
            len(dropped),
            manifest.start,
        )
        p.log.delete_segments_before(manifest.start)
        for s in dropped:
            key = self._key(p, s)
            if self.reader is not None:
                self.reader.forget(key)
            try:
                await self.store.delete(key)
            except StrataError as exc:  # the reconciler removes it later
                log.warning("cannot delete expired %s: %s", key, exc)
        return len(dropped)

    async def _orphan_loop(self) -> None:
        interval = self.config.tier_orphan_check_interval_ms / 1000
        while True:
            await asyncio.sleep(interval)
            for p in self._leaders():
                try:
                    async with self._working(p.topic):
                        if p.role == "leader":
                            await self.reconcile(p)
                except (StrataError, OSError) as exc:
                    log.warning("orphan check of %s-%d failed: %s", p.topic, p.index, exc)

    async def reconcile(self, p: Partition) -> list[str]:
        """Delete objects of ``p`` that the manifest does not name; returns their keys."""
        assert self.store is not None
        manifest, version = await self._manifest(p)
        prefix = segment_prefix(p.topic, self._topic_id(p), p.index, self.config.s3_prefix)
        committed = {self._key(p, s) for s in manifest.segments}
        grace = self.config.tier_orphan_grace_ms / 1000
        removed = []
        for key, _size, modified in await self.store.list(prefix):
            parsed = parse_key(key)
            if parsed is None or key in committed or key in self.uploading:
                continue
            expired = version >= 0 and parsed[1] <= manifest.start
            if expired or time.time() - modified > grace:
                await self.store.delete(key)
                removed.append(key)
        if removed:
            log.info("%s-%d: removed %d orphan objects", p.topic, p.index, len(removed))
        return removed
