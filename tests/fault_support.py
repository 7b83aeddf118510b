"""Faults for integration tests: power loss of real agents, and a record of what was acknowledged.

* ``start_recorded`` starts an agent whose data directory is recorded by
  ``storage.wal.crashfs`` (``STRATA_CRASHFS``); ``power_loss`` kills it with SIGKILL and then
  drops every byte and name its fsyncs had not made durable, as a power cut would.
* ``Ledger`` and ``produce`` send numbered batches over one connection, pipelined, and note
  which were acknowledged; ``check_log`` says whether what a partition holds afterwards is
  consistent with that: offsets from 0 without a gap, each connection's records in the order
  sent (a prefix of them: a lost tail is allowed, a hole, a duplicate or a stranger is not),
  and everything that must have survived present.
"""

from __future__ import annotations

import asyncio
import itertools
import re
import time
import urllib.request
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from storage.codec import decode_batch, decode_batches, encode_batch, iter_batches
from storage.errors import LeaderNotAvailableError, StrataError, from_wire
from storage.protocol import messages as m
from storage.wal import crashfs
from tests.cluster import AgentHandle, Cluster, WireClient, fetch_request, produce_request

# ---------------------------------------------------------------- power loss


def journal_dir(cluster: Cluster, agent_id: int) -> Path:
    return cluster.data_root.parent / "crashfs" / f"agent-{agent_id}"


def data_dir(cluster: Cluster, agent_id: int) -> Path:
    return cluster.data_root / f"agent-{agent_id}"


def start_recorded(
    cluster: Cluster, agent_id: int, *configs: str, env: dict[str, str] | None = None
) -> AgentHandle:
    """Start (or restart) an agent whose data directory a power loss (or a quota) can hit."""
    journal = journal_dir(cluster, agent_id)
    if not journal.exists():
        crashfs.start_recording(data_dir(cluster, agent_id), journal)
    return cluster.start_agent(agent_id, *configs, env={**(env or {}), crashfs.ENV: str(journal)})


def power_loss(cluster: Cluster, *agent_ids: int) -> None:
    """SIGKILL the agents, then keep only what their fsyncs made durable."""
    for a in agent_ids:
        cluster.kill(a)
    for a in agent_ids:
        crashfs.drop_unsynced(journal_dir(cluster, a))


def fsync_count(agent: AgentHandle) -> int:
    """Group-commit fsyncs the agent has completed (its Prometheus histogram's count)."""
    with urllib.request.urlopen(agent.metrics_url, timeout=5) as resp:
        text = resp.read().decode()
    found = re.search(r"^strata_fsync_duration_seconds_count(?:\{\})? (\S+)$", text, re.M)
    return int(float(found.group(1))) if found else 0


# ---------------------------------------------------------------- what was acknowledged


@dataclass
class Ledger:
    """Values sent, per connection ("phase"), in order; and those acknowledged."""

    phases: list[list[bytes]] = field(default_factory=list)
    acked: list[bytes] = field(default_factory=list)
    batches: int = 0
    _waiters: list[asyncio.Future[None]] = field(default_factory=list)

    def batch(self, size: int, value_size: int) -> list[bytes]:
        self.batches += 1
        b = self.batches
        return [(b"b%d.%d." % (b, i)).ljust(value_size, b"x") for i in range(size)]

    def acknowledged(self, values: list[bytes]) -> None:
        self.acked.extend(values)
        for w in self._waiters:
            if not w.done():
                w.set_result(None)
        self._waiters.clear()

    async def wait_acked(self, count: int) -> None:
        """Until ``count`` records are acknowledged (by ``produce`` tasks on this loop; 60 s)."""
        async with asyncio.timeout(60):
            while len(self.acked) < count:
                waiter = asyncio.get_running_loop().create_future()
                self._waiters.append(waiter)
                await waiter


async def produce(
    agent: AgentHandle,
    topic: str,
    partition: int,
    ledger: Ledger,
    *,
    acks: int,
    batches: int,
    in_flight: int = 8,
    records: int = 4,
    value_size: int = 256,
    timeout_ms: int = 10_000,
) -> list[int]:
    """Send ``batches`` batches on one connection, ``in_flight`` at a time; returns the error
    codes of those that failed. Stops early (quietly) when the connection breaks."""
    ledger.phases.append([])
    sent: list[bytes] = ledger.phases[-1]
    errors: list[int] = []
    try:
        client = await WireClient.connect(agent.host, agent.port)
    except OSError:
        return errors
    window = asyncio.Semaphore(in_flight)
    waiting: deque[list[bytes]] = deque()  # sent, not answered yet
    news = asyncio.Event()
    finished = False

    async def receive() -> None:
        while waiting or not finished:
            if not waiting:
                await news.wait()
                news.clear()
                continue
            frame = await client.receive(timeout_ms / 1000 + 10)
            values = waiting.popleft()
            window.release()
            result = m.ProduceResponse.decode(frame.body).topics[0].partitions[0]
            if result.error_code == 0:
                ledger.acknowledged(values)
            else:
                errors.append(result.error_code)

    receiver = asyncio.create_task(receive())
    try:
        for _ in range(batches):
            slot = asyncio.ensure_future(window.acquire())
            await asyncio.wait({slot, receiver}, return_when=asyncio.FIRST_COMPLETED)
            if receiver.done():
                slot.cancel()
                break
            values = ledger.batch(records, value_size)
            sent.extend(values)
            waiting.append(values)
            news.set()
            await client.send(
                m.ApiKey.PRODUCE,
                produce_request(topic, partition, encode_batch(values), acks, timeout_ms),
            )
        finished = True
        news.set()
        await receiver
    except (OSError, asyncio.IncompleteReadError, TimeoutError):
        pass  # the agent went away: what it answered is in the ledger
    finally:
        receiver.cancel()
        await asyncio.gather(receiver, return_exceptions=True)
        await client.close()
    return errors


# ---------------------------------------------------------------- what a partition holds


async def read_log(cluster: Cluster, topic: str, partition: int) -> list[tuple[int, bytes]]:
    """(offset, value) of every record below the partition leader's high watermark. The leader
    is looked up each attempt; while none serves the partition yet (retriable errors: a
    restarted agent's view may still be stale) it is asked again, for up to 30 s."""
    deadline = time.monotonic() + 30
    while True:
        try:
            md = await asyncio.to_thread(cluster.metadata, [topic])
            leader = md.topics[0].partitions[partition].leader_id
            agent = cluster.agents.get(leader)
            if agent is None or not agent.process.alive:
                raise LeaderNotAvailableError(f"{topic}-{partition} has no live leader")
            return await _read_log(agent, topic, partition)
        except (StrataError, OSError, IndexError) as exc:
            retriable = not isinstance(exc, StrataError) or exc.retriable
            if not retriable or time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)


async def _read_log(agent: AgentHandle, topic: str, partition: int) -> list[tuple[int, bytes]]:
    out: list[tuple[int, bytes]] = []
    client = await WireClient.connect(agent.host, agent.port)
    try:
        while True:
            resp = await client.call(
                m.ApiKey.FETCH, fetch_request(topic, partition, len(out), max_bytes=4 << 20)
            )
            r = resp.topics[0].partitions[0]
            if r.error_code:
                raise from_wire(r.error_code)
            if r.records is None or len(r.records) == 0:
                return out
            table = decode_batches(r.records)
            for offset, value in zip(
                table.column("offset").to_pylist(), table.column("value").to_pylist(), strict=True
            ):
                if offset >= len(out):
                    out.append((offset, value))
    finally:
        await client.close()


def values_on_disk(directory: Path) -> list[bytes]:
    """Values in a partition's segment files, read-only (whole batches only)."""
    values: list[bytes] = []
    for path in sorted(directory.glob("*.log")):
        data = path.read_bytes()
        try:
            for _, pos in iter_batches(data):
                values += decode_batch(data, pos).column("value").to_pylist()
        except StrataError:
            break  # an append in progress
    return values


def check_log(
    log: list[tuple[int, bytes]], ledger: Ledger, must_have: Iterable[bytes]
) -> list[bytes]:
    """Assert ``log`` is consistent with ``ledger`` and holds every value of ``must_have``;
    returns the acknowledged values it lost.

    Consistent: offsets from 0 without a gap; every value one that was sent, at most once, in
    the order sent (connections one after another); a batch may be missing only if it was
    never acknowledged or if it is part of the lost tail of its connection (nothing of that
    connection sent after it survived).
    """
    offsets = [o for o, _ in log]
    assert offsets == list(range(len(log))), "offsets are not contiguous from 0"
    order = {v: (p, i) for p, phase in enumerate(ledger.phases) for i, v in enumerate(phase)}
    values = [v for _, v in log]
    unknown = [v for v in values if v not in order]
    assert not unknown, f"never sent: {unknown[0][:20]!r}"
    positions = [order[v] for v in values]
    for a, (x, y) in enumerate(itertools.pairwise(positions)):
        assert x < y, f"offset {a + 1} holds {values[a + 1][:20]!r}: out of order or twice"
    held = set(values)
    missing = [v for v in must_have if v not in held]
    assert not missing, f"{len(missing)} records that must have survived are gone: {missing[:3]}"
    lost = [v for v in ledger.acked if v not in held]
    last_kept: dict[int, int] = {}
    for p, i in positions:
        last_kept[p] = i
    for v in lost:
        p, i = order[v]
        assert i > last_kept.get(p, -1), f"a hole: acknowledged {v[:20]!r} lost, later ones kept"
    return lost
