"""The controller's half of a topic delete: steps 2-7, each resumable (``docs/operations.md``).

The admin marks the topic (step 1: ``TopicSpec.deletion`` with step ``stop_serving``). The
elected controller then walks every marked topic through the table of ``state``:

2. **Stop serving.** Every partition state is rewritten (compare-and-set) with leader -1, the
   leader epoch + 1, an empty ISR and ``deleting``: agents close the partition (clients get
   ``UNKNOWN_TOPIC_OR_PARTITION``), and a leader's manifest commit in flight fails its
   ZooKeeper check. The replica set is recorded for step 3.
3. **Remove local logs.** Each agent, once it sees the mark, closes the topic's partitions,
   deletes their directories, waits until its tiering passes over the topic have finished,
   and writes ``/topics/<t>/removed/<agent>`` (``replica.LocalRemoval``). The step completes
   when every recorded replica that is alive has done so; a dead one cannot upload any more,
   and removes its directories when it comes back (``partitions``: the directory's topic id
   no longer matches). From here on nothing of the topic is written to the bucket.
4. **Remove the manifest snapshots** (``<prefix>manifests/<t>/``), so replay and Spark stop
   seeing the topic before any of its objects goes.
5. **Delete the segment objects** under ``<prefix>topics/<t>/<topic id>/``: one LIST page of
   ``topic.delete.batch.size`` keys, one ``DeleteObjects`` for them, progress
   (``objects_deleted``) written after each batch, until a LIST finds nothing.
6. **Remove committed offsets** of the topic's incarnation from every group.
7. **Remove the topic from ZooKeeper** after a last sweep of both prefixes; the topic node goes
   last, version-checked, and only then can the name be created again.

Every step is idempotent and its progress is in ZooKeeper, so a controller that crashes (or
loses its session) anywhere leaves the delete to the next one, which redoes at most the step
it was in. A failed step (S3 or ZooKeeper unavailable) is retried with a backoff (1 s doubling
to 30 s) and its error shown in the topic's deletion status until a step succeeds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from broker_agents.deletion.state import DeletionEvent, next_step
from storage.errors import StrataError, UnknownTopicOrPartitionError, VersionConflictError
from storage.metadata.models import DeletionStep, TopicDeletion, TopicSpec
from storage.tier.layout import topic_prefix
from storage.tier.snapshot import snapshot_prefix

if TYPE_CHECKING:
    from broker_agents.view import ClusterView
    from storage.metadata import MetadataStore
    from storage.metadata.groups import GroupStore

log = logging.getLogger(__name__)

S, E = DeletionStep, DeletionEvent


class ObjectCleaner(Protocol):
    """What the deleter needs of the object store (``storage.tier.ObjectStore`` has it)."""

    async def list_keys(
        self, prefix: str, *, max_keys: int = 1000, after: str = ""
    ) -> list[str]: ...
    async def count(self, prefix: str) -> int: ...
    async def delete_many(self, keys: Sequence[str]) -> None: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class DeleterSettings:
    batch_objects: int = 1000  # keys per DeleteObjects request (S3 allows 1,000)
    prefix: str = ""  # the bucket's key prefix (``s3.prefix``)
    pass_interval_s: float = 1.0
    retry_base_s: float = 1.0
    retry_max_s: float = 30.0


@dataclass(frozen=True, slots=True)
class Outcome:
    event: DeletionEvent
    changes: dict[str, Any]


class TopicDeleter:
    def __init__(
        self,
        store: MetadataStore,
        groups: GroupStore,
        objects: ObjectCleaner | None,
        view: ClusterView,
        settings: DeleterSettings,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.groups = groups
        self.objects = objects
        self.view = view
        self.settings = settings
        self.clock = clock
        #: topics the controller found marked for deletion at its last reconcile
        self.tracked: set[str] = set()
        self._failures: dict[str, tuple[int, float]] = {}
        self._wake = asyncio.Event()
        self.completed = 0

    def track(self, names: set[str]) -> None:
        """The topics marked for deletion (the controller's reconcile reads every spec)."""
        if names - self.tracked:
            self._wake.set()
        self.tracked = set(names)

    def poke(self) -> None:
        self._wake.set()

    async def run(self, controller_epoch: int) -> None:
        """Advance every tracked delete while this agent is the controller (cancelled when
        it stops being it). One step (or one batch of step 5) per topic per round."""
        while True:
            self._wake.clear()
            busy = False
            for name in sorted(self.tracked):
                try:
                    busy |= await self.advance(name, controller_epoch)
                except Exception:  # a bug: keep the controller (and the other deletes) alive
                    log.exception("deleting topic %s failed", name)
            if not busy:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.settings.pass_interval_s):
                        await self._wake.wait()

    async def advance(self, name: str, controller_epoch: int) -> bool:
        """Do ``name``'s current step once; True if the delete moved (run again soon)."""
        fails, until = self._failures.get(name, (0, 0.0))
        if time.monotonic() < until:
            return False
        try:
            spec, stat = await self.store.get_topic(name)
        except UnknownTopicOrPartitionError:
            self.tracked.discard(name)
            return False
        deletion = spec.deletion
        if deletion is None or deletion.step == S.DONE:
            self.tracked.discard(name)
            return False
        try:
            outcome = await self._do(spec, deletion, controller_epoch)
        except VersionConflictError:
            return True  # a partition state moved under step 2: re-read and redo
        except StrataError as exc:
            delay = min(self.settings.retry_max_s, self.settings.retry_base_s * 2**fails)
            self._failures[name] = (fails + 1, time.monotonic() + delay)
            log.warning(
                "topic %s: deletion step %s failed (retry in %.0f s): %s",
                name,
                deletion.step.value,
                delay,
                exc,
            )
            outcome = Outcome(E.NOT_YET, {"last_error": f"{type(exc).__name__}: {exc}"[:500]})
        else:
            self._failures.pop(name, None)
        step = next_step(deletion.step, outcome.event)
        if step == S.DONE:
            self.tracked.discard(name)
            self.completed += 1
            log.info(
                "topic %s (id %s) deleted, %.1f s after it was asked for",
                name,
                spec.topic_id,
                (self.clock() * 1000 - deletion.requested_ms) / 1000,
            )
            return True
        changes = dict(outcome.changes)
        if outcome.event != E.NOT_YET:
            changes.setdefault("last_error", "")
        if step == deletion.step and all(getattr(deletion, k) == v for k, v in changes.items()):
            return False  # nothing new to record (waiting)
        new = deletion.model_copy(
            update={**changes, "step": step, "updated_ms": int(self.clock() * 1000)}
        )
        try:
            await self.store.update_topic(spec.model_copy(update={"deletion": new}), stat.version)
        except VersionConflictError:
            return True  # another controller moved it: re-read
        if step != deletion.step:
            log.info("topic %s: deletion step %s done, now %s", name, deletion.step, step)
        return outcome.event != E.NOT_YET

    async def _do(self, spec: TopicSpec, d: TopicDeletion, controller_epoch: int) -> Outcome:
        name = spec.name
        if d.step == S.STOP_SERVING:
            return await self._stop_serving(spec, d, controller_epoch)
        if d.step == S.REMOVE_LOCAL_LOGS:
            acked = await self.store.removal_acks(name, spec.topic_id)
            live = set(self.view.agents)
            waiting = sorted(a for a in d.replicas if a in live and a not in acked)
            return Outcome(E.NOT_YET if waiting else E.STEP_DONE, {"waiting_for": waiting})
        if d.step == S.REMOVE_SNAPSHOTS:
            await self._delete_all(snapshot_prefix(name, self.settings.prefix))
            return Outcome(E.STEP_DONE, {})
        if d.step == S.DELETE_OBJECTS:
            return await self._delete_batch(spec, d)
        if d.step == S.REMOVE_OFFSETS:
            groups = await self.groups.remove_offsets(name, spec.topic_id)
            if groups:
                log.info("topic %s: committed offsets removed from %d groups", name, groups)
            return Outcome(E.STEP_DONE, {})
        if d.step == S.REMOVE_METADATA:
            # a last sweep: nothing can be uploaded since step 3, but an S3 call a dead
            # agent's threads had in flight may have landed late
            await self._delete_all(snapshot_prefix(name, self.settings.prefix))
            await self._delete_all(topic_prefix(name, spec.topic_id, self.settings.prefix))
            await self.store.remove_topic(name, spec.topic_id)
            return Outcome(E.STEP_DONE, {})
        raise AssertionError(f"no work for step {d.step}")

    async def _stop_serving(
        self, spec: TopicSpec, d: TopicDeletion, controller_epoch: int
    ) -> Outcome:
        replicas = set(d.replicas)
        for p, (state, version) in sorted((await self.store.partition_states(spec.name)).items()):
            replicas.update(state.replicas)
            if state.deleting:
                continue
            fenced = state.model_copy(
                update={
                    "leader": -1,
                    "leader_epoch": state.leader_epoch + 1,
                    "isr": [],
                    "incarnations": {},
                    "adding": [],
                    "removing": [],
                    "deleting": True,
                    "topic_id": state.topic_id or spec.topic_id,
                    "controller_epoch": controller_epoch,
                }
            )
            await self.store.cas_partition_state(spec.name, p, fenced, version)
        return Outcome(E.STEP_DONE, {"replicas": sorted(replicas)})

    async def _delete_batch(self, spec: TopicSpec, d: TopicDeletion) -> Outcome:
        if self.objects is None:
            return Outcome(E.STEP_DONE, {})
        prefix = topic_prefix(spec.name, spec.topic_id, self.settings.prefix)
        changes: dict[str, Any] = {}
        if d.objects_total < 0:
            changes["objects_total"] = await self.objects.count(prefix) + d.objects_deleted
        keys = await self.objects.list_keys(prefix, max_keys=self.settings.batch_objects)
        if not keys:
            return Outcome(E.STEP_DONE, changes)
        await self.objects.delete_many(keys)
        changes["objects_deleted"] = d.objects_deleted + len(keys)
        return Outcome(E.BATCH_DELETED, changes)

    async def _delete_all(self, prefix: str) -> int:
        if self.objects is None:
            return 0
        total = 0
        while keys := await self.objects.list_keys(prefix, max_keys=self.settings.batch_objects):
            await self.objects.delete_many(keys)
            total += len(keys)
        return total
