"""Real agent processes on loopback for integration tests, plus a raw protocol client.

``Cluster`` starts ``python -m broker_agents.main`` children through the test's
``ProcessGroup`` (so every one is stopped at teardown, even on failure), waits for each to
print its "listening" line, and can kill (-9), stop and restart them. ``WireClient`` speaks
the protocol with ``storage.protocol`` directly, for tests that must send what no SDK would.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import ssl
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sdk import Consumer
from storage.codec import decode_batches
from storage.errors import NotLeaderError
from storage.metadata import AsyncZooKeeper, MetadataStore, TopicSpec
from storage.protocol import encode_request, parse_response, read_size
from storage.protocol import messages as m
from tests.harness import ManagedProcess, ProcessGroup, ZooKeeperChroot

ROOT = Path(__file__).resolve().parent.parent
SESSION_TIMEOUT_MS = 4000


@dataclass
class AgentHandle:
    agent_id: int
    process: ManagedProcess
    host: str
    port: int
    metrics_url: str = ""
    kafka: str | None = None  # the Kafka listener's host:port, when it has one

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


class Cluster:
    def __init__(
        self,
        processes: ProcessGroup,
        zk: ZooKeeperChroot,
        data_root: Path,
        *,
        session_timeout_ms: int = SESSION_TIMEOUT_MS,
    ) -> None:
        self.processes = processes
        self.zk = zk
        self.data_root = data_root
        self.session_timeout_ms = session_timeout_ms
        self.agents: dict[int, AgentHandle] = {}
        #: how this test's own raw requests (``metadata``) reach a TLS or SASL listener
        self.client_ssl: ssl.SSLContext | None = None
        self.client_login: Any = None  # an ``sdk.auth.ScramLogin``

    # ---- processes --------------------------------------------------------------------
    def start_agent(
        self,
        agent_id: int,
        *configs: str,
        timeout: float = 30.0,
        env: dict[str, str] | None = None,
    ) -> AgentHandle:
        argv = [
            sys.executable,
            "-m",
            "broker_agents.main",
            "--agent-id",
            str(agent_id),
            "--zookeeper",
            self.zk.connect_string,
            "--data-dir",
            str(self.data_root / f"agent-{agent_id}"),
            "--session-timeout-ms",
            str(self.session_timeout_ms),
        ]
        for c in configs:
            argv += ["--config", c]
        proc = self.processes.start(argv, name=f"agent-{agent_id}", cwd=ROOT, env=env)
        deadline = time.monotonic() + timeout
        while True:
            for line in proc.log_text().splitlines():
                if line.startswith('{"event": "listening"'):
                    info = json.loads(line)
                    handle = AgentHandle(
                        agent_id,
                        proc,
                        info["host"],
                        info["port"],
                        info.get("metrics_url", ""),
                        info.get("kafka"),
                    )
                    self.agents[agent_id] = handle
                    self._wait_seen(agent_id)
                    return handle
            if not proc.alive:
                raise RuntimeError(
                    f"agent {agent_id} exited while starting:\n{proc.log_text()[-3000:]}"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"agent {agent_id} not listening after {timeout} s:\n{proc.log_text()[-3000:]}"
                )
            time.sleep(0.02)

    def _wait_seen(self, agent_id: int, timeout: float = 10.0) -> None:
        """Until the first other agent (the controller, as a rule) lists the new one: a topic
        created a moment after an agent starts would otherwise be placed without it (seen in
        CI: RF 2 placed on one agent). Best effort: a frozen or stopped peer ends the wait."""
        if not any(a != agent_id for a in self.agents):
            return
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                md = self.metadata(avoid={agent_id})
            except Exception:  # none answers (or refuses this client): go on
                return
            if any(a.agent_id == agent_id for a in md.agents):
                return
            time.sleep(0.02)

    def start(self, n: int) -> list[AgentHandle]:
        return [self.start_agent(i) for i in range(1, n + 1)]

    def kill(self, agent_id: int, sig: int = signal.SIGKILL) -> None:
        handle = self.agents[agent_id]
        self.processes.kill(handle.process.pid, sig)
        if sig == signal.SIGKILL:
            handle.process.wait(10)

    def stop(self, agent_id: int) -> None:
        self.processes.stop(self.agents[agent_id].process.pid)

    def alive(self) -> list[AgentHandle]:
        return [a for a in self.agents.values() if a.process.alive]

    @property
    def bootstrap(self) -> str:
        return ",".join(a.address for a in self.alive())

    @property
    def kafka_bootstrap(self) -> str:
        """The Kafka listeners of the live agents (``kafka.listener`` set at start)."""
        return ",".join(a.kafka for a in self.alive() if a.kafka)

    # ---- metadata ---------------------------------------------------------------------
    def create_topic(
        self,
        name: str,
        partitions: int,
        replication_factor: int = 1,
        configs: dict[str, Any] | None = None,
    ) -> None:
        async def run() -> None:
            zk = AsyncZooKeeper(self.zk.connect_string)
            await zk.start()
            try:
                spec = TopicSpec.build(
                    name=name,
                    partitions=partitions,
                    replication_factor=replication_factor,
                    config=configs or {},
                    topic_id=uuid.uuid4().hex,
                    created_ms=int(time.time() * 1000),
                )
                await MetadataStore(zk).create_topic(spec)
            finally:
                await zk.stop()

        asyncio.run(run())

    def call(self, agent: AgentHandle, key: int, body: m.Message) -> Any:
        """One request to ``agent`` over the cluster's client TLS/SASL settings."""
        return asyncio.run(
            WireClient.call_once(
                agent.host, agent.port, key, body, ssl=self.client_ssl, login=self.client_login
            )
        )

    def metadata(
        self, topics: list[str] | None = None, *, avoid: set[int] | None = None
    ) -> m.MetadataResponse:
        """Metadata from the first agent that answers; ``avoid`` skips agents (say, a frozen one,
        which would accept the connection and never answer)."""
        last: Exception | None = None
        for agent in self.alive():
            if avoid and agent.agent_id in avoid:
                continue
            try:
                resp: m.MetadataResponse = self.call(
                    agent, m.ApiKey.METADATA, m.MetadataRequest(topics)
                )
                return resp
            except (OSError, TimeoutError) as exc:
                last = exc
        raise RuntimeError(f"no agent answered Metadata: {last}")

    def wait_for_leaders(
        self, topic: str, *, timeout: float = 30.0, exclude: set[int] | None = None
    ) -> dict[int, m.PartitionMetadata]:
        """Poll Metadata until every partition of ``topic`` has a live leader (not in ``exclude``)
        and that leader serves it (ZooKeeper names a leader a moment before the agent opens the
        partition; until then it answers NOT_LEADER)."""
        deadline = time.monotonic() + timeout
        while True:
            md = self.metadata([topic], avoid=exclude)
            live = {a.agent_id for a in md.agents}
            t = md.topics[0]
            if (
                t.error_code == 0
                and t.partitions
                and all(
                    p.error_code == 0
                    and p.leader_id in live
                    and p.leader_id not in (exclude or set())
                    for p in t.partitions
                )
                and self._leaders_serve(topic, t.partitions)
            ):
                return {p.partition: p for p in t.partitions}
            if time.monotonic() > deadline:
                raise TimeoutError(f"partitions of {topic} without a live leader: {t}")
            time.sleep(0.05)

    def _leaders_serve(self, topic: str, partitions: list[m.PartitionMetadata]) -> bool:
        by_leader: dict[int, list[int]] = {}
        for p in partitions:
            by_leader.setdefault(p.leader_id, []).append(p.partition)
        for leader, ids in by_leader.items():
            agent = self.agents.get(leader)
            if agent is None:
                return True  # not one of ours (started elsewhere): Metadata is all we know
            request = m.ListOffsetsRequest(
                [m.ListOffsetsTopic(topic, [m.ListOffsetsPartition(i, -1) for i in ids])]
            )
            try:
                resp: m.ListOffsetsResponse = self.call(agent, m.ApiKey.LIST_OFFSETS, request)
            except (OSError, TimeoutError):
                return False
            if any(r.error_code == NotLeaderError.code for t in resp.topics for r in t.partitions):
                return False
        return True


class WireClient:
    """A raw protocol connection to one agent (asyncio)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.correlation = 0

    @classmethod
    async def connect(
        cls, host: str, port: int, *, ssl: ssl.SSLContext | None = None
    ) -> WireClient:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port, ssl=ssl), 5)
        return cls(reader, writer)

    async def send(self, key: int, body: m.Message, *, version: int = 0) -> int:
        self.correlation += 1
        self.writer.writelines(
            encode_request(key, self.correlation, "test", body, api_version=version)
        )
        await self.writer.drain()
        return self.correlation

    async def receive(self, wait_s: float = 10.0) -> Any:
        async with asyncio.timeout(wait_s):
            size = read_size(await self.reader.readexactly(4), 1 << 30)
            return parse_response(await self.reader.readexactly(size))

    async def call(self, key: int, body: m.Message, wait_s: float = 10.0) -> Any:
        cid = await self.send(key, body)
        frame = await self.receive(wait_s)
        assert frame.correlation_id == cid
        err = frame.error()
        if err is not None:
            raise err
        return m.APIS[key].response.decode(frame.body)

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(OSError):
            await self.writer.wait_closed()

    async def login(self, login: Any) -> None:
        """Authenticate (SASL listener) with an ``sdk.auth.ScramLogin``."""

        async def send(body: m.Message) -> Any:
            key = next(a.key for a in m.APIS.values() if isinstance(body, a.request))
            return await self.call(key, body)

        await login(send)

    @classmethod
    async def call_once(
        cls,
        host: str,
        port: int,
        key: int,
        body: m.Message,
        *,
        ssl: ssl.SSLContext | None = None,
        login: Any = None,
    ) -> Any:
        client = await cls.connect(host, port, ssl=ssl)
        try:
            if login is not None:
                await client.login(login)
            return await client.call(key, body)
        finally:
            await client.close()


def produce_request(
    topic: str, partition: int, records: Any, acks: int = 1, timeout_ms: int = 10000
) -> m.ProduceRequest:
    return m.ProduceRequest(
        acks, timeout_ms, [m.ProduceTopic(topic, [m.ProducePartition(partition, records)])]
    )


def fetch_request(
    topic: str,
    partition: int,
    offset: int,
    *,
    max_wait_ms: int = 0,
    min_bytes: int = 1,
    max_bytes: int = 1 << 20,
    filter: str | None = None,
) -> m.FetchRequest:
    return m.FetchRequest(
        -1,
        max_wait_ms,
        min_bytes,
        max_bytes,
        0,
        [m.FetchTopic(topic, [m.FetchPartition(partition, offset, max_bytes, -1, filter)])],
    )


def fetch_values(agent: AgentHandle, topic: str, partition: int = 0) -> list[bytes]:
    """The values ``agent`` serves of ``topic-partition`` from offset 0 (one Fetch, as a
    consumer would: up to the high watermark, 1 MiB at most)."""

    async def run() -> list[bytes]:
        resp = await WireClient.call_once(
            agent.host, agent.port, m.ApiKey.FETCH, fetch_request(topic, partition, 0)
        )
        records = resp.topics[0].partitions[0].records
        values: list[bytes] = (
            [] if records is None else decode_batches(records).column("value").to_pylist()
        )
        return values

    return asyncio.run(run())


async def read_records(consumer: Consumer, count: int, deadline_s: float = 30) -> list[Any]:
    """``count`` records from the consumer's assignment, as ``getmany`` gives them."""
    got: list[Any] = []
    async with asyncio.timeout(deadline_s):
        while len(got) < count:
            for records in (await consumer.getmany(timeout_ms=500)).values():
                got.extend(records)
    return got


def check_acknowledged(tables: dict[int, Any], acked: dict[bytes, tuple[int, int]]) -> int:
    """The no-loss check of a produce run through failures: per partition (``tables``: Arrow
    tables with ``offset`` and ``value``, read from the beginning) offsets have no gap and
    values (increasing per producer) never go backwards; every acknowledged value sits at the
    (partition, offset) its acknowledgement named. Returns the number of duplicates."""
    consumed: dict[tuple[int, int], bytes] = {}
    duplicates = 0
    for p, table in tables.items():
        offsets = table.column("offset").to_pylist()
        values = table.column("value").to_pylist()
        assert offsets == list(range(offsets[0], offsets[0] + len(offsets))), "gap in offsets"
        seen: set[bytes] = set()
        last = b""
        for offset, value in zip(offsets, values, strict=True):
            consumed[(p, offset)] = value
            if value in seen:
                duplicates += 1
                continue
            seen.add(value)
            # per-partition order: a value never comes after a larger one
            assert value > last, (p, offset, value, last)
            last = value
    # every acknowledged message is there, at the offset its acknowledgement named
    for value, where in acked.items():
        assert consumed.get(where) == value, (value, where, consumed.get(where))
    return duplicates
