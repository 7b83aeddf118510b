"""The event-source runner: topics -> batches -> ``handler(event, context)`` -> commit.

It does locally what an AWS Lambda event-source mapping does for a Kafka topic: a consumer
group member polls the topics through the SDK, gathers a batch (up to ``batch_size`` records,
waiting up to ``window_ms`` for it to fill), invokes the function with it, and commits the
offsets when the function succeeds. Up to ``concurrency`` invocations run at once, each on its
own set of partitions: a partition is paused while an invocation holds it, so its records are
always handled in order, one batch at a time, and nothing of it is buffered meanwhile.

**The event** is Lambda's Kafka event (``eventSource`` ``SelfManagedKafka``): records grouped
under ``"<topic>-<partition>"``, ``key`` and ``value`` in base64, ``headers`` as a list of
``{name: [byte, ...]}``; Strata adds ``tags``.

**The answer.** ``None`` or any answer without failures: the whole batch succeeded. Like
Lambda's partial batch responses, ``{"batchItemFailures": [{"itemIdentifier":
"<topic>-<partition>@<offset>"}]}`` says that, in that partition, the records before
``offset`` succeeded and ``offset`` and after did not: the runner commits up to ``offset``
and, after the retry policy's backoff, invokes the function again with the records from
``offset`` on. It keeps those records (at most one batch per partition) and leaves the
partition paused meanwhile, so a retry costs no fetch and nothing more is buffered. An item may carry
``retryAfterMs``, an explicit time to come back (the delay scheduler says when the head of a
level is due); that is not counted as a failed attempt. An exception, or a handler that does
not return within ``invocation_timeout``, fails the whole batch.

**Retries** follow a :class:`RetryPolicy` (exponential backoff, by default for ever). When the
policy gives up on a partition, ``on_give_up`` decides what happens (the default keeps
retrying at the longest backoff). With ``retry`` (``--retry``) the runner applies the
group's retry policy instead: each failed record goes to the group's retry topic and the rest
of the batch is committed (``docs/retries.md``). A record that kills the runner (kill -9, an
OOM) counts as a failed attempt too, as for any consumer with ``retry.enable``
(``sdk.crashes``): after a crash, the records the dead runner had in flight are invoked one at
a time, with nothing else running, so that the next crash names its record.

**Commits** run in the background, every partition that finished in one request, so a
partition's next batch does not wait for the commit of its last; a failed commit is retried
with the next round, and pending commits are made before a rebalance hands partitions over.
A crash loses at most the commits not yet made: those records are handled again
(at-least-once; the scheduler's intents make its forwards exactly-once anyway).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import importlib
import json
import logging
import os
import signal
import sys
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from handlers.runtime import NATIVE_RECORDS, wants_native_records
from infra.local_runtime import LambdaContext
from infra.processes import ChildProcess, spawn, terminate, wait_until_ready
from sdk import Consumer
from sdk.backoff import ExponentialBackoff
from sdk.config import client_config
from sdk.delays import level_topics
from sdk.records import ConsumerRecord, TopicPartition
from sdk.retry import (
    FAILURES_TOPIC,
    ROUTER_GROUP,
    Retrier,
    new_retrier_producer,
    retry_topic,
)
from storage.errors import InvalidConfigError, StrataError

log = logging.getLogger("infra.event_source")

Handler = Callable[[Mapping[str, Any], Any], Any]


@dataclass(frozen=True, slots=True, kw_only=True)
class MappingConfig:
    """One event-source mapping (names after Lambda's ``EventSourceMapping`` properties)."""

    function: str
    """``module:attribute`` of the handler (``handlers.scheduler:handler``)."""
    topics: tuple[str, ...]
    group_id: str
    bootstrap_servers: str
    batch_size: int = 500
    """``BatchSize``: most records per invocation."""
    window_ms: int = 100
    """``MaximumBatchingWindowInSeconds``, in ms: how long to wait for a batch to fill."""
    concurrency: int = 2
    """Invocations at once (each on its own partitions)."""
    partition_per_invocation: bool = False
    """One partition per invocation: a slow partition holds up no other (the scheduler)."""
    fetch_max_wait_ms: int = 50
    """The consumer's long-poll wait. A resumed partition is fetched at once while fewer than
    four fetches to its agent are waiting (``sdk.consumer.FETCHES_PER_AGENT``), else at the
    latest this long after it is due."""
    invocation_timeout: float = 30.0
    session_timeout_ms: int = 10_000
    """The group member's session: how long a crashed runner holds its partitions."""
    retry_initial_ms: int = 200
    retry_max_ms: int = 30_000
    max_attempts: int = 0
    """Failed attempts of one batch before ``on_give_up``; 0 = never give up."""
    isolation_level: str = "read_uncommitted"
    """The consumer's ``isolation.level``. The delay scheduler and the retry router read
    ``read_committed``: a record a transaction stored in the delay levels, or a failure
    record, acts only if its transaction commits."""
    retry: bool = False
    """Apply the group's retry policy (``docs/retries.md``): each record the function reports
    in ``batchItemFailures`` (or raises on, found by invoking the batch's records one by one)
    goes to the group's retry topic, the rest of the batch is committed; the mapping reads
    the group's retry topic too."""

    def __post_init__(self) -> None:
        if not self.topics:
            raise InvalidConfigError("an event-source mapping needs at least one topic")
        for name in ("batch_size", "concurrency"):
            if getattr(self, name) < 1:
                raise InvalidConfigError(f"{name} must be at least 1")
        if self.window_ms < 0 or self.retry_initial_ms < 0 or self.max_attempts < 0:
            raise InvalidConfigError("window_ms, retry_initial_ms and max_attempts must be >= 0")
        if self.invocation_timeout <= 0:
            raise InvalidConfigError("invocation_timeout must be positive")
        if self.isolation_level not in ("read_committed", "read_uncommitted"):
            raise InvalidConfigError(
                f"isolation_level must be read_committed or read_uncommitted,"
                f" not {self.isolation_level!r}"
            )
        if ":" not in self.function:
            raise InvalidConfigError(f"function {self.function!r} is not module:attribute")


class RetryPolicy(Protocol):
    def delay(self, attempt: int) -> float | None:
        """Seconds before retry ``attempt`` (0 = the first retry), or None to give up."""


@dataclass
class BackoffPolicy:
    """Exponential backoff with jitter; gives up after ``max_attempts`` (0: never)."""

    initial_ms: int
    max_ms: int
    max_attempts: int = 0
    _backoff: ExponentialBackoff = field(init=False)

    def __post_init__(self) -> None:
        self._backoff = ExponentialBackoff(self.initial_ms, self.max_ms)

    def delay(self, attempt: int) -> float | None:
        if self.max_attempts and attempt >= self.max_attempts:
            return None
        return self._backoff(attempt)


def item_id(topic: str, partition: int, offset: int) -> str:
    return f"{topic}-{partition}@{offset}"


def parse_item_id(text: str) -> tuple[TopicPartition, int]:
    where, _, offset = str(text).rpartition("@")
    topic, _, partition = where.rpartition("-")
    if not topic or not partition.isdigit() or not offset.isdigit():
        raise ValueError(f"bad itemIdentifier {text!r}: want <topic>-<partition>@<offset>")
    return TopicPartition(topic, int(partition)), int(offset)


def build_event(
    batch: Mapping[TopicPartition, Sequence[ConsumerRecord]],
    bootstrap: str,
    *,
    native: bool = False,
) -> dict[str, Any]:
    """Lambda's Kafka event for ``batch``; with ``native``, the batch itself under
    ``NATIVE_RECORDS`` in place of Lambda's ``records`` (``handlers.runtime``)."""
    if native:
        return {
            "eventSource": "SelfManagedKafka",
            "bootstrapServers": bootstrap,
            NATIVE_RECORDS: {tp: list(recs) for tp, recs in batch.items()},
        }
    b64 = base64.b64encode
    records: dict[str, list[dict[str, Any]]] = {}
    for tp, recs in batch.items():
        records[f"{tp.topic}-{tp.partition}"] = [
            {
                "topic": r.topic,
                "partition": r.partition,
                "offset": r.offset,
                "timestamp": r.timestamp,
                "timestampType": "CREATE_TIME",
                "key": None if r.key is None else b64(r.key).decode("ascii"),
                "value": None if r.value is None else b64(r.value).decode("ascii"),
                "headers": [{k: list(v)} for k, v in r.headers],
                "tags": list(r.tags),
            }
            for r in recs
        ]
    return {"eventSource": "SelfManagedKafka", "bootstrapServers": bootstrap, "records": records}


def failures_of(answer: Any) -> dict[TopicPartition, tuple[int, int | None]]:
    """Per partition the lowest failed offset and its ``retryAfterMs`` (if any)."""
    out: dict[TopicPartition, tuple[int, int | None]] = {}
    if not isinstance(answer, Mapping):
        return out
    for item in answer.get("batchItemFailures") or ():
        tp, offset = parse_item_id(item["itemIdentifier"])
        after = item.get("retryAfterMs")
        if tp not in out or offset < out[tp][0]:
            out[tp] = (offset, None if after is None else int(after))
    return out


@dataclass
class RunnerStats:
    invocations: int = 0
    failed_invocations: int = 0
    records: int = 0
    committed: int = 0
    parked: int = 0
    """Partitions set aside on a ``retryAfterMs`` ("come back at"): one per such answer."""


class EventSourceRunner:
    """Runs one mapping until ``stop`` is set (see the module docstring)."""

    def __init__(
        self,
        config: MappingConfig,
        handler: Handler | None = None,
        *,
        policy: RetryPolicy | None = None,
        on_give_up: Callable[[TopicPartition, int], None] | None = None,
        consumer_config: Mapping[str, Any] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``clock`` (seconds) times the waits before retries; a test moves it to make a
        ``retryAfterMs`` of months pass at once."""
        self.config = config
        self._clock = clock
        self.handler = handler or load_handler(config.function)
        self._native = wants_native_records(self.handler)
        self.policy = policy or BackoffPolicy(
            config.retry_initial_ms, config.retry_max_ms, config.max_attempts
        )
        self.on_give_up = on_give_up
        self.stats = RunnerStats()
        self._consumer_config = dict(consumer_config or {})
        self._attempts: dict[TopicPartition, int] = {}
        self._resume_at: dict[TopicPartition, float] = {}
        self._carried: dict[TopicPartition, list[ConsumerRecord]] = {}
        """Per paused partition, the records of its last batch not yet handled."""
        self._consumer: Consumer | None = None
        self._executor = ThreadPoolExecutor(config.concurrency, thread_name_prefix="strata-fn")
        self._to_commit: dict[TopicPartition, int] = {}
        self._commit_wanted = asyncio.Event()
        self._retrier: Retrier | None = None

    async def run(self, stop: asyncio.Event) -> None:
        cfg = self.config
        consumer = Consumer(
            client_config(
                cfg.bootstrap_servers,
                {
                    "group.id": cfg.group_id,
                    "enable.auto.commit": False,
                    "auto.offset.reset": "earliest",
                    "max.poll.records": cfg.batch_size,
                    "isolation.level": cfg.isolation_level,
                    "fetch.max.wait.ms": cfg.fetch_max_wait_ms,
                    "session.timeout.ms": cfg.session_timeout_ms,
                    "heartbeat.interval.ms": max(100, cfg.session_timeout_ms // 5),
                    # crash counting (sdk.crashes): a record that kills the runner is a
                    # failed attempt of the function
                    "retry.enable": cfg.retry,
                    **self._consumer_config,
                },
            )
        )
        self._consumer = consumer
        tasks: set[asyncio.Task[None]] = set()
        topics = list(cfg.topics)
        if cfg.retry:
            topics.append(retry_topic(cfg.group_id))
            producer = new_retrier_producer(cfg.bootstrap_servers)
            await producer.start()
            self._retrier = Retrier(producer, cfg.group_id)
        async with consumer:
            consumer.subscribe(topics, listener=self)
            committer = asyncio.create_task(self._commit_loop(consumer, stop), name="strata-commit")
            while not stop.is_set():
                if len(tasks) >= cfg.concurrency:
                    await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED, timeout=0.5)
                    tasks = {t for t in tasks if not t.done()}
                    continue
                if tasks and consumer.crash_suspects:
                    # records a crashed runner had in flight are invoked one at a time, with
                    # nothing else running, so that a crash there names its record
                    await asyncio.wait(tasks, timeout=cfg.invocation_timeout)
                    tasks = {t for t in tasks if not t.done()}
                    continue
                batch = self._resume_due(consumer) or await self._gather(consumer, stop)
                if not batch:
                    continue
                consumer.pause(*batch)
                if cfg.partition_per_invocation:
                    parts = [{tp: recs} for tp, recs in batch.items()]
                else:
                    parts = [batch]
                for part in parts:
                    task = asyncio.create_task(self._invoke(consumer, part), name="strata-invoke")
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
            if tasks:
                await asyncio.wait(tasks, timeout=cfg.invocation_timeout)
            self._commit_wanted.set()
            await committer
        if self._retrier is not None:
            await self._retrier.close()
        self._executor.shutdown(wait=False)

    async def _commit_loop(self, consumer: Consumer, stop: asyncio.Event) -> None:
        """Commit what invocations finished, all partitions in one request, in the background:
        a partition's next batch does not wait for the commit of its last."""
        while True:
            await self._commit_wanted.wait()
            self._commit_wanted.clear()
            await self._commit_pending(consumer)
            if stop.is_set() and not self._to_commit:
                return

    async def _commit_pending(self, consumer: Consumer) -> None:
        pending, self._to_commit = self._to_commit, {}
        assigned = consumer.assignment()
        pending = {tp: o for tp, o in pending.items() if tp in assigned}
        if not pending:
            return
        try:
            await consumer.commit(pending)
        except StrataError as exc:
            log.warning("commit failed (the records may be handled again): %r", exc)
            for tp, offset in pending.items():  # try again with the next round
                self._to_commit[tp] = max(offset, self._to_commit.get(tp, -1))
            await asyncio.sleep(self.policy.delay(0) or 0.1)
            self._commit_wanted.set()

    def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        print(json.dumps({"event": "assigned", "partitions": len(assigned)}), flush=True)

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        for tp in revoked:
            self._resume_at.pop(tp, None)
            self._attempts.pop(tp, None)
            self._carried.pop(tp, None)
        if self._consumer is not None and any(tp in self._to_commit for tp in revoked):
            await self._commit_pending(self._consumer)  # before the next owner starts

    def _next_resume(self) -> float | None:
        return min(self._resume_at.values(), default=None)

    def _resume_due(self, consumer: Consumer) -> dict[TopicPartition, list[ConsumerRecord]]:
        """Partitions whose wait is over: the records they kept from their last batch (handed
        to the next invocation at once), or, with none kept, fetching again."""
        now = self._clock()
        assigned = consumer.assignment()
        carried: dict[TopicPartition, list[ConsumerRecord]] = {}
        for tp, at in list(self._resume_at.items()):
            if at > now:
                continue
            del self._resume_at[tp]
            kept = self._carried.pop(tp, None)
            if tp not in assigned:
                continue
            if kept:
                carried[tp] = kept
            else:
                consumer.resume(tp)
        return carried

    async def _gather(
        self, consumer: Consumer, stop: asyncio.Event
    ) -> dict[TopicPartition, list[ConsumerRecord]]:
        """One batch: the first records, then more until ``batch_size`` or the window ends."""
        cfg = self.config
        wait_ms = 200
        nxt = self._next_resume()
        if nxt is not None:
            wait_ms = max(1, min(wait_ms, int((nxt - self._clock()) * 1000) + 1))
        got = await consumer.getmany(timeout_ms=wait_ms, max_records=cfg.batch_size)
        if not got:
            return {}
        held = self._retrier is not None
        if held:  # in hand from now on: the polls below do not say it is done (sdk.crashes)
            consumer.pause(*got)
        batch: dict[TopicPartition, list[ConsumerRecord]] = {
            tp: list(recs) for tp, recs in got.items()
        }
        count = sum(map(len, batch.values()))
        deadline = time.monotonic() + cfg.window_ms / 1000
        while count < cfg.batch_size and not stop.is_set() and not consumer.crash_suspects:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            more = await consumer.getmany(
                timeout_ms=int(left * 1000), max_records=cfg.batch_size - count
            )
            if held:
                consumer.pause(*more)
            for tp, recs in more.items():
                batch.setdefault(tp, []).extend(recs)
                count += len(recs)
        return batch

    async def _call(self, batch: Mapping[TopicPartition, Sequence[ConsumerRecord]]) -> Any:
        """Invoke the function once with ``batch`` (within the invocation timeout)."""
        cfg = self.config
        event = build_event(batch, cfg.bootstrap_servers, native=self._native)
        context = LambdaContext(
            function_name=cfg.function.rpartition(":")[0].rpartition(".")[2],
            aws_request_id=str(uuid.uuid4()),
            timeout=cfg.invocation_timeout,
        )
        async with asyncio.timeout(cfg.invocation_timeout):
            return await asyncio.get_running_loop().run_in_executor(
                self._executor, self.handler, event, context
            )

    async def _failed_records(
        self, batch: dict[TopicPartition, list[ConsumerRecord]]
    ) -> list[tuple[ConsumerRecord, str]]:
        """With ``retry``: the records the function failed on, with the reason. Each
        ``batchItemFailures`` item names one record; an exception makes the runner invoke
        the records one by one to find those that raise (Lambda's bisect, to the end)."""
        try:
            answer = await self._call(batch)
        except Exception as exc:
            log.info(
                "invocation of %s failed (%r): invoking record by record", self.config.function, exc
            )
            self.stats.failed_invocations += 1
            failed: list[tuple[ConsumerRecord, str]] = []
            for tp, recs in batch.items():
                for rec in recs:
                    try:
                        single = await self._call({tp: [rec]})
                    except Exception as one:
                        failed.append((rec, repr(one)))
                    else:
                        if failures_of(single):
                            failed.append((rec, "reported in batchItemFailures"))
            return failed
        wanted: set[tuple[TopicPartition, int]] = set()
        if isinstance(answer, Mapping):
            for item in answer.get("batchItemFailures") or ():
                wanted.add(parse_item_id(item["itemIdentifier"]))
        return [
            (rec, "reported in batchItemFailures")
            for tp, recs in batch.items()
            for rec in recs
            if (tp, rec.offset) in wanted
        ]

    async def _invoke_with_retry(
        self, consumer: Consumer, batch: dict[TopicPartition, list[ConsumerRecord]]
    ) -> None:
        assert self._retrier is not None
        failures: dict[TopicPartition, tuple[int, int | None]] = {}
        try:
            failed = await self._failed_records(batch)
            await self._retrier.fail_many(failed)
        except Exception as exc:  # the failures could not be stored: the batch is retried
            log.warning("retry routing for %s failed: %r", self.config.function, exc)
            failures = {tp: (recs[0].offset, None) for tp, recs in batch.items()}
        self._finish(consumer, batch, failures)

    async def _invoke(
        self, consumer: Consumer, batch: dict[TopicPartition, list[ConsumerRecord]]
    ) -> None:
        cfg = self.config
        self.stats.invocations += 1
        self.stats.records += sum(map(len, batch.values()))
        if self._retrier is not None:
            await self._invoke_with_retry(consumer, batch)
            return
        failures: dict[TopicPartition, tuple[int, int | None]]
        started = time.monotonic()
        try:
            answer = await self._call(batch)
            log.debug(
                "invocation: %d partitions, %d records, %.1f ms",
                len(batch),
                sum(map(len, batch.values())),
                (time.monotonic() - started) * 1000,
            )
            failures = failures_of(answer)
        except Exception as exc:  # the function failed: the whole batch is retried
            log.warning("invocation of %s failed: %r", cfg.function, exc)
            self.stats.failed_invocations += 1
            failures = {tp: (recs[0].offset, None) for tp, recs in batch.items()}
        self._finish(consumer, batch, failures)

    def _finish(
        self,
        consumer: Consumer,
        batch: dict[TopicPartition, list[ConsumerRecord]],
        failures: Mapping[TopicPartition, tuple[int, int | None]],
    ) -> None:
        for tp, recs in batch.items():
            start, end = recs[0].offset, recs[-1].offset + 1
            failed = failures.get(tp)
            done_to = end if failed is None else max(start, min(failed[0], end))
            if done_to > start:
                self._to_commit[tp] = done_to
                self.stats.committed += done_to - start
                self._commit_wanted.set()
            self._settle(consumer, tp, done_to, failed, recs)

    def _settle(
        self,
        consumer: Consumer,
        tp: TopicPartition,
        next_offset: int,
        failed: tuple[int, int | None] | None,
        records: list[ConsumerRecord],
    ) -> None:
        if tp not in consumer.assignment():
            self._attempts.pop(tp, None)
            return  # revoked meanwhile: the new owner starts from the committed offset
        if failed is None:
            self._attempts.pop(tp, None)
            consumer.resume(tp)
            return
        # keep the rest of the batch (no re-fetch); the partition stays paused meanwhile
        self._carried[tp] = [r for r in records if r.offset >= next_offset]
        if failed[1] is not None:  # "come back at": not a failed attempt
            self._attempts.pop(tp, None)
            self._resume_at[tp] = self._clock() + failed[1] / 1000
            self.stats.parked += 1
            return
        attempt = self._attempts.get(tp, 0)
        self._attempts[tp] = attempt + 1
        wait = self.policy.delay(attempt)
        if wait is None:
            if self.on_give_up is not None:
                self.on_give_up(tp, next_offset)
            wait = self.config.retry_max_ms / 1000
        self._resume_at[tp] = self._clock() + wait


def load_handler(spec: str) -> Handler:
    module, _, name = spec.partition(":")
    fn: Handler = getattr(importlib.import_module(module), name)
    return fn


SCHEDULER_FUNCTION = "handlers.scheduler:handler"
SCHEDULER_GROUP = "__strata_scheduler"


def scheduler_mapping(bootstrap: str, **options: Any) -> MappingConfig:
    """The mapping that feeds the delay scheduler: every delay level, one group, a short
    batching window (each hop waits for it)."""
    return MappingConfig(
        **{
            "function": SCHEDULER_FUNCTION,
            "topics": tuple(level_topics()),
            "group_id": SCHEDULER_GROUP,
            "bootstrap_servers": bootstrap,
            "window_ms": 5,
            "fetch_max_wait_ms": 100,
            "concurrency": 16,
            "partition_per_invocation": True,
            "isolation_level": "read_committed",  # an aborted transaction's delays never fire
            **options,
        }
    )


ROUTER_FUNCTION = "handlers.retry:handler"


def router_mapping(bootstrap: str, **options: Any) -> MappingConfig:
    """The mapping that feeds the retry router: the failures topic, one group, one
    partition per invocation (a slow destination holds up no other partition), a batching
    window of 50 ms: an invocation costs the router a few hundred µs whatever it holds, and
    routing a record in one of 100 about 65 µs (``docs/benchmarks.md``, "Retries"), while a
    retry is due at its failure time plus the backoff whenever the router routes it."""
    return MappingConfig(
        **{
            "function": ROUTER_FUNCTION,
            "topics": (FAILURES_TOPIC,),
            "group_id": ROUTER_GROUP,
            "bootstrap_servers": bootstrap,
            "window_ms": 50,
            "concurrency": 8,
            "partition_per_invocation": True,
            "isolation_level": "read_committed",
            **options,
        }
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class EventSourceProcess(ChildProcess):
    """A runner child process (``strata local up`` starts the scheduler's)."""

    log_path: Path


def start_event_source(
    bootstrap: str,
    zookeeper: str,
    *,
    log_path: Path,
    extra_args: tuple[str, ...] = (),
    startup_timeout: float = 60.0,
    wait: bool = True,
    env: dict[str, str] | None = None,
) -> EventSourceProcess:
    """Start ``python -m infra.event_source`` (the scheduler's mapping unless ``extra_args``
    say otherwise); with ``wait``, until it runs (it joins its group in the background)."""
    process = spawn(
        [sys.executable, "-m", "infra.event_source", "--bootstrap", bootstrap, *extra_args],
        log_path=log_path,
        env={
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "STRATA_ZOOKEEPER_CONNECT": zookeeper,
            **(env or {}),
        },
    )
    if not wait:
        return EventSourceProcess(log_path=log_path, _process=process)
    try:
        wait_until_ready(
            process,
            lambda: log_path.exists() and '"event": "running"' in log_path.read_text(),
            what="the delay scheduler's event-source runner",
            log_path=log_path,
            timeout=startup_timeout,
        )
    except BaseException:
        terminate(process)
        raise
    return EventSourceProcess(log_path=log_path, _process=process)


def parse_args(argv: list[str] | None = None) -> MappingConfig:
    p = argparse.ArgumentParser(
        prog="python -m infra.event_source", description=__doc__.split("\n")[0]
    )
    p.add_argument("--bootstrap", required=True)
    p.add_argument("--function", default=SCHEDULER_FUNCTION)
    p.add_argument("--topics", default="", help="comma separated; default: the delay levels")
    p.add_argument("--group", default=SCHEDULER_GROUP)
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--window-ms", type=int, default=None)
    p.add_argument("--fetch-max-wait-ms", type=int, default=None)
    p.add_argument("--concurrency", type=int, default=None)
    p.add_argument("--invocation-timeout", type=float, default=30.0)
    p.add_argument("--session-timeout-ms", type=int, default=10_000)
    p.add_argument(
        "--isolation-level",
        choices=("read_committed", "read_uncommitted"),
        default=None,
        help="the consumer's isolation.level (the scheduler and the router: read_committed)",
    )
    p.add_argument(
        "--retry",
        action="store_true",
        help="apply the group's retry policy to the records the function fails on",
    )
    a = p.parse_args(argv)
    options: dict[str, Any] = {
        "invocation_timeout": a.invocation_timeout,
        "session_timeout_ms": a.session_timeout_ms,
    }
    if a.concurrency is not None:
        options["concurrency"] = a.concurrency
    if a.batch_size is not None:
        options["batch_size"] = a.batch_size
    if a.window_ms is not None:
        options["window_ms"] = a.window_ms
    if a.fetch_max_wait_ms is not None:
        options["fetch_max_wait_ms"] = a.fetch_max_wait_ms
    if a.isolation_level is not None:
        options["isolation_level"] = a.isolation_level
    topics = tuple(t for t in a.topics.split(",") if t)
    if a.function == SCHEDULER_FUNCTION and not topics:
        return scheduler_mapping(a.bootstrap, group_id=a.group, **options)
    if a.function == ROUTER_FUNCTION and not topics:
        group = ROUTER_GROUP if a.group == SCHEDULER_GROUP else a.group
        return router_mapping(a.bootstrap, group_id=group, **options)
    if not topics:
        raise InvalidConfigError("--topics is required for a function other than the scheduler")
    return MappingConfig(
        function=a.function,
        topics=topics,
        group_id=a.group,
        bootstrap_servers=a.bootstrap,
        retry=a.retry,
        **options,
    )


def main(argv: list[str] | None = None) -> int:
    """``python -m infra.event_source --bootstrap HOST:PORT [...]``; the handler's runtime
    reads ``STRATA_ZOOKEEPER_CONNECT``. Prints one JSON line when running; stops on SIGTERM."""
    logging.basicConfig(
        level=os.environ.get("STRATA_LOG_LEVEL", "INFO"),
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    logging.getLogger("kazoo").setLevel(logging.WARNING)
    config = parse_args(argv)
    runner = EventSourceRunner(config)

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        print(
            json.dumps(
                {
                    "event": "running",
                    "function": config.function,
                    "group": config.group_id,
                    "pid": os.getpid(),
                }
            ),
            flush=True,
        )
        await runner.run(stop)

    asyncio.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
