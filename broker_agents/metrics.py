"""Prometheus metrics of one agent, served over HTTP (``GET /metrics``) on loopback.

Two kinds of metric, kept apart:

* **events** (counters and histograms) are recorded by small hooks where things happen: the
  TCP server reports each request's API and duration and the bytes it read and wrote
  (``AgentServer.observer``), group commit reports each fsync's duration
  (``storage.wal.group_commit.set_fsync_observer``), the uploader each segment upload
  (``Tiering.on_upload``);
* **stalls**: a probe on the event loop (``LoopLagProbe``) asks to be woken every
  ``LAG_INTERVAL`` and records how late it was (``strata_event_loop_lag_seconds``): everything
  the agent does waits that long too, so a request's latency has this as its floor. Pauses
  of Python's cyclic garbage collector are timed by generation (``strata_gc_pause_seconds``).
  A lag over ``LAG_WARN`` is also logged, with its time, to be matched with what else
  happened then;
* **state** (gauges: ISR sizes, under-replicated partitions, un-uploaded bytes, offsets,
  consumer-group lag) is read from the agent's own structures at scrape time by
  :class:`_StateCollector`, so nothing has to keep a gauge up to date.

Everything runs on the agent's event loop: the HTTP endpoint is an ``asyncio`` server and the
scrape renders the registry there, so no thread reads the agent's dictionaries while the loop
changes them. Each agent has its own :class:`CollectorRegistry` (no process globals), which
also lets tests build several.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from storage.codec.header import HEADER_SIZE, read_header
from storage.errors import StrataError
from storage.kafka.messages import ApiKey as KafkaApiKey
from storage.protocol import messages as m

if TYPE_CHECKING:
    from broker_agents.partitions import Partition, PartitionManager
    from broker_agents.view import ClusterView
    from storage.filters import FilterScan


class AgentState(Protocol):
    """What the metrics read of the agent at scrape time (``Agent`` has these)."""

    @property
    def partitions(self) -> PartitionManager: ...
    @property
    def offline(self) -> set[tuple[str, int]]: ...
    @property
    def tiering(self) -> Any: ...  # ``.pending``: {(topic, partition): bytes not yet uploaded}
    @property
    def groups(self) -> Any: ...  # the group coordinator, for lag
    @property
    def view(self) -> ClusterView: ...  # topics (and their deletes in progress)
    @property
    def quotas(self) -> Any: ...  # ``.throttled`` answers held, ``.throttled_s`` in all
    @property
    def orphans(self) -> Any: ...  # ``.orphans_aborted``: hanging transactions aborted here


log = logging.getLogger(__name__)

LATENCY_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
LAG_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
)  # fmt: skip
LAG_INTERVAL = 0.05
"""How often the loop-lag probe asks to be woken (seconds)."""
LAG_WARN = 0.5
"""A lag at least this long is logged as a stall."""
UPLOAD_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
MAX_REQUEST_HEAD = 8192
"""A scrape request whose head (request line + headers) is longer is refused."""
REQUEST_TIMEOUT = 5.0


def _api_name(api_key: int) -> str:
    try:
        return m.ApiKey(api_key).name.lower()
    except ValueError:
        return str(api_key)


def _kafka_api_name(api_key: int) -> str:
    """A Kafka listener's API as a label value: ``kafka_produce``, ``kafka_fetch``..."""
    try:
        return f"kafka_{KafkaApiKey(api_key).name.lower()}"
    except ValueError:
        return f"kafka_{api_key}"


class KafkaListenerObserver:
    """``ServerObserver`` of the Kafka listener: requests under ``kafka_<api>`` labels, bytes
    in the agent's network counters."""

    def __init__(self, metrics: AgentMetrics) -> None:
        self._metrics = metrics
        self._per_api: dict[int, tuple[Any, Any]] = {}

    def bytes_in(self, n: int) -> None:
        self._metrics.bytes_in(n)

    def bytes_out(self, n: int) -> None:
        self._metrics.bytes_out(n)

    def request_done(self, api_key: int, seconds: float, failed: bool) -> None:
        self._metrics.observe_request(self._per_api, _kafka_api_name, api_key, seconds)


class AgentMetrics:
    """The agent's registry, its event hooks, and its HTTP endpoint."""

    def __init__(self, agent: AgentState) -> None:
        self.agent = agent
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("strata_requests", "Requests handled, by API", ["api"], registry=r)
        self.request_seconds = Histogram(
            "strata_request_duration_seconds",
            "Time from a request's arrival to its response being ready, by API",
            ["api"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.bytes_in_total = Counter(
            "strata_network_in_bytes", "Bytes of request frames read", registry=r
        )
        self.bytes_out_total = Counter(
            "strata_network_out_bytes", "Bytes of response frames written", registry=r
        )
        self.fsync_seconds = Histogram(
            "strata_fsync_duration_seconds",
            "Duration of each group-commit fsync",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.upload_seconds = Histogram(
            "strata_tier_upload_duration_seconds",
            "Duration of each sealed-segment upload to object storage",
            buckets=UPLOAD_BUCKETS,
            registry=r,
        )
        self.uploaded_bytes = Counter(
            "strata_tier_uploaded_bytes", "Bytes of segment objects uploaded", registry=r
        )
        self.filter_batches = Counter(
            "strata_fetch_filter_batches",
            "Batches looked at by filtered fetches, by what was done with them: skipped (by"
            " the summary or after decoding), sent whole, or sent with a selection",
            ["outcome"],
            registry=r,
        )
        self.filter_decoded = Counter(
            "strata_fetch_filter_decoded_batches",
            "Batches filtered fetches decoded (their summary could not decide, or none)",
            registry=r,
        )
        self.filter_scanned = Counter(
            "strata_fetch_filter_scanned_bytes",
            "Bytes of batches looked at by filtered fetches",
            registry=r,
        )
        self.filter_sent = Counter(
            "strata_fetch_filter_sent_bytes",
            "Bytes of batches filtered fetches sent",
            registry=r,
        )
        self.loop_lag = Histogram(
            "strata_event_loop_lag_seconds",
            f"How late a wake-up asked for every {int(LAG_INTERVAL * 1000)} ms ran: how long the"
            " event loop was busy or blocked (every request waited as long)",
            buckets=LAG_BUCKETS,
            registry=r,
        )
        self.gc_seconds = Histogram(
            "strata_gc_pause_seconds",
            "Pauses of Python's cyclic garbage collector, by generation",
            ["generation"],
            buckets=LAG_BUCKETS,
            registry=r,
        )
        r.register(_StateCollector(agent))
        #: api key -> its children of ``requests`` and ``request_seconds`` (no label lookup
        #: per request)
        self._per_api: dict[int, tuple[Any, Any]] = {}
        self._server: asyncio.Server | None = None
        self._lag_probe: asyncio.Task[None] | None = None
        self._gc_started = 0.0

    # ---- hooks (ServerObserver, fsync observer, Tiering.on_upload) --------------------------
    def request_done(self, api_key: int, seconds: float, failed: bool) -> None:
        self.observe_request(self._per_api, _api_name, api_key, seconds)

    def observe_request(
        self,
        per_api: dict[int, tuple[Any, Any]],
        name_of: Callable[[int], str],
        api_key: int,
        seconds: float,
    ) -> None:
        """Count a request and its duration under ``name_of(api_key)``; ``per_api`` keeps a
        listener's label children by API key (no label lookup per request; as many as the
        label values the registry keeps anyway)."""
        children = per_api.get(api_key)
        if children is None:
            api = name_of(api_key)
            children = per_api[api_key] = (
                self.requests.labels(api),
                self.request_seconds.labels(api),
            )
        children[0].inc()
        children[1].observe(seconds)

    def kafka_observer(self) -> KafkaListenerObserver:
        """The hooks for the Kafka listener's server: the same metrics, its APIs labelled
        ``kafka_<name>`` (Kafka's API keys are not the native ones)."""
        return KafkaListenerObserver(self)

    def bytes_in(self, n: int) -> None:
        self.bytes_in_total.inc(n)

    def bytes_out(self, n: int) -> None:
        self.bytes_out_total.inc(n)

    def observe_fsync(self, seconds: float) -> None:
        self.fsync_seconds.observe(seconds)

    def observe_filter_scan(self, scan: FilterScan) -> None:
        self.filter_batches.labels("skipped").inc(scan.skipped_batches)
        self.filter_batches.labels("whole").inc(scan.whole_batches)
        self.filter_batches.labels("selected").inc(len(scan.selections))
        self.filter_decoded.inc(scan.decoded_batches)
        self.filter_scanned.inc(scan.scanned)
        self.filter_sent.inc(scan.bytes)

    def observe_upload(self, seconds: float, nbytes: int) -> None:
        self.upload_seconds.observe(seconds)
        self.uploaded_bytes.inc(nbytes)

    def render(self) -> bytes:
        return generate_latest(self.registry) + partition_gauges(self.agent)

    # ---- stalls -----------------------------------------------------------------------------
    async def _probe_lag(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            asked = loop.time()
            await asyncio.sleep(LAG_INTERVAL)
            lag = max(0.0, loop.time() - asked - LAG_INTERVAL)
            self.loop_lag.observe(lag)
            if lag >= LAG_WARN:
                log.warning("event loop stalled for %.0f ms", lag * 1000)

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        elif self._gc_started:
            self.gc_seconds.labels(str(info.get("generation", "?"))).observe(
                time.perf_counter() - self._gc_started
            )
            self._gc_started = 0.0

    # ---- the endpoint -----------------------------------------------------------------------
    async def start(self, host: str, port: int) -> int:
        """Serve ``GET /metrics`` on ``host:port`` (0: any free port); return the port."""
        self._server = await asyncio.start_server(self._serve, host, port)
        self._lag_probe = asyncio.create_task(self._probe_lag(), name="loop-lag-probe")
        gc.callbacks.append(self._on_gc)
        bound: int = self._server.sockets[0].getsockname()[1]
        return bound

    async def stop(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        if self._lag_probe is not None:
            self._lag_probe.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._lag_probe
            self._lag_probe = None
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                async with asyncio.timeout(2.0):
                    await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(REQUEST_TIMEOUT):
                head = await reader.readuntil(b"\r\n\r\n")
            if len(head) > MAX_REQUEST_HEAD:
                raise ValueError("request head too long")
            method, target, *_ = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ")
            path = target.split("?", 1)[0]
            if method not in ("GET", "HEAD"):
                status, ctype, body = "405 Method Not Allowed", "text/plain", b"GET only\n"
            elif path in ("/metrics", "/"):
                status, ctype, body = "200 OK", CONTENT_TYPE_LATEST, self.render()
            elif path == "/health":
                ok = self.agent.partitions.session_ok
                status = "200 OK" if ok else "503 Service Unavailable"
                ctype, body = "text/plain", b"ok\n" if ok else b"no ZooKeeper session\n"
            else:
                status, ctype, body = "404 Not Found", "text/plain", b"try /metrics\n"
            writer.write(
                f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
                + (body if method != "HEAD" else b"")
            )
            async with asyncio.timeout(REQUEST_TIMEOUT):
                await writer.drain()
        except (TimeoutError, ValueError, ConnectionError, asyncio.LimitOverrunError):
            pass
        except asyncio.IncompleteReadError:
            pass
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()


class _StateCollector(Collector):
    """Gauges computed from the agent's state at each scrape."""

    def __init__(self, agent: AgentState) -> None:
        self.agent = agent

    def describe(self) -> list[Metric]:
        return []  # computed at scrape time; no fixed description

    def collect(self) -> Iterator[Metric]:
        agent = self.agent
        led = GaugeMetricFamily("strata_partitions_leader", "Partitions this agent leads")
        hosted = GaugeMetricFamily("strata_partitions_hosted", "Partitions this agent hosts")
        under = GaugeMetricFamily(
            "strata_under_replicated_partitions",
            "Partitions led here whose ISR is smaller than their replica set",
        )
        unuploaded = GaugeMetricFamily(
            "strata_tier_unuploaded_bytes",
            "Bytes of local segments not yet committed to object storage (partitions led here)",
        )
        n_led = n_under = 0
        parts = list(agent.partitions.partitions.values())
        for p in parts:
            if p.role != "leader":
                continue
            n_led += 1
            if len(p.state.isr) < len(p.state.replicas):
                n_under += 1
        led.add_metric([], n_led)
        hosted.add_metric([], len(parts))
        under.add_metric([], n_under)
        unuploaded.add_metric([], sum(agent.tiering.pending.values()))
        up = GaugeMetricFamily("strata_agent_session_ok", "1 while the ZooKeeper session is good")
        up.add_metric([], 1 if agent.partitions.session_ok else 0)
        offline = GaugeMetricFamily(
            "strata_offline_replicas",
            "Partitions this agent should host but whose local log it cannot open",
        )
        offline.add_metric([], len(agent.offline))
        yield from (led, hosted, under, unuploaded, up, offline)
        held = CounterMetricFamily(
            "strata_quota_throttled_responses",
            "Answers after which a connection was muted: its principal was over quota",
        )
        held.add_metric([], agent.quotas.throttled)
        held_s = CounterMetricFamily(
            "strata_quota_throttle_seconds", "Time connections were muted for quotas, in all"
        )
        held_s.add_metric([], agent.quotas.throttled_s)
        hanging = CounterMetricFamily(
            "strata_transactions_hanging_aborted",
            "Hanging transactions (open on a partition led here past transaction.max.timeout.ms,"
            " no coordinator ending them) this agent aborted",
        )
        hanging.add_metric([], agent.orphans.orphans_aborted)
        yield from (held, held_s, hanging)
        yield from _deletions(agent)
        yield from _group_lag(agent)


def partition_gauges(agent: AgentState) -> bytes:
    """The per-partition gauges in Prometheus' text format, written here rather than through
    ``prometheus_client``, which spends ~6 µs on each sample: at 10,000 partitions (40,000
    samples) a scrape held the event loop for ~250 ms, and a poll every 0.2 s made hosting
    the partitions of a restart several times slower (``make bench-many-partitions``).
    Topic names are restricted to ``[a-zA-Z0-9._-]`` (``storage.names``), so labels need no
    escaping."""
    hosted = [
        (f'{{topic="{p.topic}",partition="{p.index}"}} ', p)
        for p in list(agent.partitions.partitions.values())
    ]
    led = [(label, p) for label, p in hosted if p.role == "leader"]
    families = (
        (
            "strata_partition_isr_size",
            "In-sync replicas of each partition led here",
            (f"{label}{len(p.state.isr)}" for label, p in led),
        ),
        (
            "strata_partition_replicas",
            "Assigned replicas of each partition led here",
            (f"{label}{len(p.state.replicas)}" for label, p in led),
        ),
        (
            "strata_partition_high_watermark",
            "High watermark (leaders)",
            (f"{label}{p.high_watermark}" for label, p in led),
        ),
        (
            "strata_partition_log_end_offset",
            "Local log end offset",
            (f"{label}{p.log.log_end_offset}" for label, p in hosted),
        ),
    )
    out: list[str] = []
    for name, doc, samples in families:
        out.append(f"# HELP {name} {doc}\n# TYPE {name} gauge\n")
        out.extend(f"{name}{sample}\n" for sample in samples)
    return "".join(out).encode()


def _deletions(agent: AgentState) -> Iterator[Metric]:
    """Deletes in progress, from the topic specs every agent watches (the same everywhere)."""
    pending = GaugeMetricFamily(
        "strata_topics_pending_deletion",
        "Topics marked for deletion whose delete has not completed",
    )
    left = GaugeMetricFamily(
        "strata_topic_deletion_objects_left",
        "Segment objects a topic's delete has yet to remove (-1 until they are counted)",
        labels=["topic"],
    )
    count = 0
    for name, spec in sorted(agent.view.topics.items()):
        if spec.deletion is not None:
            count += 1
            left.add_metric([name], spec.deletion.objects_left)
    pending.add_metric([], count)
    yield pending
    yield left


def _group_lag(agent: AgentState) -> Iterator[Metric]:
    """Lag of the consumer groups coordinated here, on the partitions led here."""
    labels = ["group", "topic", "partition"]
    messages = GaugeMetricFamily(
        "strata_group_lag_messages",
        "Messages between a group's committed offset and the high watermark",
        labels=labels,
    )
    seconds = GaugeMetricFamily(
        "strata_group_lag_seconds",
        "Age of the oldest message a group has not committed past (0 when caught up)",
        labels=labels,
    )
    for group, topic, partition, committed in _committed_offsets(agent):
        p = agent.partitions.partitions.get((topic, partition))
        if p is None or p.role != "leader":
            continue
        end = p.high_watermark
        lag = max(0, end - committed)
        key = [group, topic, str(partition)]
        messages.add_metric(key, lag)
        age = 0.0
        if lag:
            ts = _timestamp_at(p, committed)
            if ts is not None:
                age = max(0.0, time.time() - ts / 1000)
        seconds.add_metric(key, age)
    yield messages
    yield seconds


def _committed_offsets(agent: AgentState) -> Iterator[tuple[str, str, int, int]]:
    """(group, topic, partition, committed offset) held by this agent's group coordinator.

    The coordinator keeps, per group, ``offsets[topic] = (TopicCommits, zk version)``
    (``broker_agents.groups``); an agent without one reports no lag. Offsets of another
    incarnation than the hosted partition's are not this partition's lag.
    """
    coordinator: Any = getattr(agent, "groups", None)
    groups: dict[str, Any] = getattr(coordinator, "groups", {})
    for group_id, group in list(groups.items()):
        for topic, (commits, _version) in list(group.offsets.items()):
            for partition, committed in list(commits.offsets.items()):
                p = agent.partitions.partitions.get((topic, int(partition)))
                if p is not None and not commits.belongs_to(p.topic_id):
                    continue
                yield group_id, topic, int(partition), int(committed.offset)


def _timestamp_at(p: Partition, offset: int) -> int | None:
    """First timestamp (ms) of the local batch holding ``offset`` (None: not on local disk)."""
    plog = p.log
    if offset < plog.log_start_offset or offset >= plog.log_end_offset:
        return None
    try:
        chunk = plog.read(offset, HEADER_SIZE)
        return read_header(chunk.data).first_timestamp
    except StrataError:
        return None
