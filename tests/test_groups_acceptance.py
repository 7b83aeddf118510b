"""Consumer groups, acceptance: real agents, real ZooKeeper, consumer *processes*
(``tests/group_consumer.py``), steady production.

* 3 members on a 12-partition topic; a 4th joins; one is killed with SIGKILL; one stops
  gracefully. Within each generation no partition has two owners; no partition is unowned for
  longer than the session timeout + 2 s; every produced message is consumed at least once
  (commit after processing: nothing skipped); no rebalance storm. Run with the cooperative
  (``cooperative-sticky``) and an eager (``range``) assignor.
* at-most-once never redelivers a committed offset; at-least-once redelivers exactly the
  uncommitted tail after a crash (and a static member's restart causes no rebalance).
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from sdk import Consumer, Producer, TopicPartition
from tests.cluster import ROOT, Cluster
from tests.harness import ManagedProcess, ProcessGroup, ZooKeeperChroot

SESSION_MS = 3000
GROUP_CONFIGS = ("group.initial.rebalance.delay.ms=0", "group.min.session.timeout.ms=500")


@pytest.fixture
def cluster(processes: ProcessGroup, zk_chroot: ZooKeeperChroot, tmp_path: Path) -> Cluster:
    c = Cluster(processes, zk_chroot, tmp_path / "data")
    for agent_id in (1, 2):
        c.start_agent(agent_id, *GROUP_CONFIGS)
    return c


def start_member(
    cluster: Cluster, tmp_path: Path, name: str, topic: str, *extra: str
) -> tuple[ManagedProcess, Path]:
    log = tmp_path / f"{name}.jsonl"
    argv = [
        sys.executable,
        "-m",
        "tests.group_consumer",
        "--bootstrap",
        cluster.bootstrap,
        "--group",
        "g",
        "--topic",
        topic,
        "--log",
        str(log),
        "--session-timeout-ms",
        str(SESSION_MS),
        *extra,
    ]
    return cluster.processes.start(argv, name=name, cwd=ROOT), log


def events(log: Path) -> list[dict[str, Any]]:
    if not log.exists():
        return []
    text = log.read_text()
    whole = text[: text.rfind("\n") + 1]  # a line still being written is left for later
    return [json.loads(line) for line in whole.splitlines() if line.strip()]


def owned_now(log: Path) -> list[int] | None:
    owned = [e for e in events(log) if e["ev"] == "owned"]
    return owned[-1]["parts"] if owned else None


def wait_until(
    check: Any, what: str, within: float = 30.0, logs: dict[str, Path] | None = None
) -> None:
    """Poll ``check``; on timeout the error shows the last events of each member's ``logs``."""
    deadline = time.monotonic() + within
    while not check():
        if time.monotonic() > deadline:
            tails = "".join(f"\n  {n}: {events(log)[-6:]}" for n, log in (logs or {}).items())
            raise AssertionError(f"timed out waiting for {what}{tails}")
        time.sleep(0.05)


class SteadyProducer:
    """Produces small batches to every partition at a steady pace in a thread."""

    def __init__(self, bootstrap: str, topic: str, partitions: int) -> None:
        self.bootstrap, self.topic, self.partitions = bootstrap, topic, partitions
        self.stop = threading.Event()
        self.sent = 0
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _run(self) -> None:
        async with Producer({"bootstrap.servers": self.bootstrap, "acks": 1}) as producer:
            i = 0
            while not self.stop.is_set():
                for p in range(self.partitions):
                    await producer.send_batch(self.topic, [b"m%d" % i] * 5, partition=p)
                    self.sent += 5
                i += 1
                await producer.flush()
                await asyncio.sleep(0.05)


def end_offsets(bootstrap: str, topic: str, partitions: int) -> dict[int, int]:
    async def run() -> dict[int, int]:
        async with Consumer({"bootstrap.servers": bootstrap}) as c:
            ends = await c.end_offsets([TopicPartition(topic, p) for p in range(partitions)])
        return {tp.partition: o for tp, o in ends.items()}

    return asyncio.run(run())


def consumed(logs: list[Path]) -> dict[int, set[int]]:
    out: dict[int, set[int]] = defaultdict(set)
    for log in logs:
        for e in events(log):
            if e["ev"] == "rec":
                out[e["p"]].update(range(e["first"], e["last"] + 1))
    return out


@pytest.mark.parametrize("strategy", ["cooperative-sticky", "range"])
def test_group_of_consumer_processes_rebalances_without_double_owners_or_loss(
    cluster: Cluster, tmp_path: Path, strategy: str
) -> None:
    partitions = 12
    cluster.create_topic("events", partitions)
    cluster.wait_for_leaders("events")
    producer = SteadyProducer(cluster.bootstrap, "events", partitions)
    producer.thread.start()
    members: dict[str, tuple[ManagedProcess, Path]] = {}
    ended: dict[str, float] = {}  # member -> when its ownership ended (kill / graceful stop)

    def balanced(names: list[str]) -> bool:
        sets = [owned_now(members[n][1]) for n in names]
        if any(s is None for s in sets):
            return False
        flat = [p for s in sets for p in s or []]
        sizes = sorted(len(s or []) for s in sets)
        return sorted(flat) == list(range(partitions)) and sizes[-1] - sizes[0] <= 1

    try:
        for name in ("c1", "c2", "c3"):
            members[name] = start_member(cluster, tmp_path, name, "events", "--strategy", strategy)
        logs = {n: log for n, (_, log) in members.items()}
        wait_until(lambda: balanced(["c1", "c2", "c3"]), "3 members share 12 partitions", logs=logs)
        members["c4"] = start_member(cluster, tmp_path, "c4", "events", "--strategy", strategy)
        logs["c4"] = members["c4"][1]
        wait_until(
            lambda: balanced(["c1", "c2", "c3", "c4"]), "4 members share 12 partitions", logs=logs
        )
        time.sleep(0.5)  # steady consumption under 4 members
        cluster.processes.kill(members["c2"][0].pid, signal.SIGKILL)
        ended["c2"] = time.time()
        members["c2"][0].wait(10)
        wait_until(
            lambda: balanced(["c1", "c3", "c4"]),
            "c2's partitions move",
            SESSION_MS / 1000 + 15,
            logs=logs,
        )
        cluster.processes.stop(members["c3"][0].pid)
        ended["c3"] = time.time()
        wait_until(lambda: balanced(["c1", "c4"]), "c3's partitions move", logs=logs)
        producer.stop.set()
        producer.thread.join(30)
        ends = end_offsets(cluster.bootstrap, "events", partitions)
        logs = [log for _, log in members.values()]

        def caught_up() -> bool:
            got = consumed(logs)
            return all(got[p] >= set(range(ends[p])) for p in range(partitions))

        wait_until(caught_up, "every produced message consumed", 30)
        for name in ("c1", "c4"):
            cluster.processes.stop(members[name][0].pid)
            ended[name] = time.time()
    finally:
        producer.stop.set()

    assert producer.sent > 1000
    # 1. within a generation, no partition has two owners
    by_generation: dict[int, dict[int, set[str]]] = defaultdict(lambda: defaultdict(set))
    for name, (_, log) in members.items():
        for e in events(log):
            if e["ev"] == "owned" and e["gen"] >= 0:
                for p in e["parts"]:
                    by_generation[e["gen"]][p].add(name)
    for gen, owners in by_generation.items():
        doubles = {p: o for p, o in owners.items() if len(o) > 1}
        assert not doubles, f"generation {gen}: partitions with two owners {doubles}"
    # no rebalance storm: each of the 4 joins takes at most two generations (cooperative:
    # assign what is free, then hand over what was revoked), the kill, the leave and the final
    # stop one each: 11 (7-10 seen, also with two CPU hogs beside the test), 3 to spare for a
    # slow machine. A commit failing for a generation the member was already leaving used to
    # start yet another rebalance (17-23 generations here, 291 in a bad run)
    assert max(by_generation) <= 14, f"rebalance storm: generations {sorted(by_generation)}"
    # records are only ever processed by the partition's owner of that generation
    for name, (_, log) in members.items():
        for e in events(log):
            if e["ev"] == "rec":
                assert by_generation[e["gen"]][e["p"]] == {name}, e
    # 2. no partition unowned for longer than session timeout + 2 s (after the first full
    # assignment and until the final shutdown)
    intervals: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for name, (_, log) in members.items():
        evs = [e for e in events(log) if e["ev"] in ("owned", "revoked")]
        held: dict[int, float] = {}
        for e in evs:
            now = set(e["parts"]) if e["ev"] == "owned" else set(held) - set(e["parts"])
            for p in set(held) - now:
                intervals[p].append((held.pop(p), e["t"]))
            for p in now - set(held):
                held[p] = e["t"]
        end = ended.get(name, time.time())
        for p, start in held.items():
            intervals[p].append((start, end))
    start_all = max(min(s for s, _ in intervals[p]) for p in range(partitions))
    stop_all = min(ended["c1"], ended["c4"])
    worst = 0.0
    for p in range(partitions):
        spans = sorted(intervals[p])
        covered_until = start_all
        for s, e in spans:
            if s > covered_until and s < stop_all:
                worst = max(worst, s - covered_until)
            covered_until = max(covered_until, e)
    assert worst <= SESSION_MS / 1000 + 2, f"a partition was unowned for {worst:.2f} s"
    # 3. every produced message consumed at least once; nothing skipped
    got = consumed([log for _, log in members.values()])
    for p in range(partitions):
        missing = set(range(ends[p])) - got[p]
        assert not missing, f"partition {p}: {len(missing)} messages never consumed"
    print(f"produced {sum(ends.values())}, generations {sorted(by_generation)}, gap {worst:.2f} s")


def _produce(cluster: Cluster, topic: str, n: int, partitions: int) -> None:
    async def run() -> None:
        async with Producer({"bootstrap.servers": cluster.bootstrap, "acks": -1}) as producer:
            for p in range(partitions):
                await producer.send_batch(topic, [b"x%d" % i for i in range(n)], partition=p)

    asyncio.run(run())


def _run_crash_and_restart(cluster: Cluster, tmp_path: Path, mode: str) -> tuple[Any, Any]:
    cluster.create_topic("jobs", 2)
    cluster.wait_for_leaders("jobs")
    _produce(cluster, "jobs", 400, 2)
    # a session long enough that the crashed member's static place is still held when its
    # restart joins, however long a busy machine takes to start a Python process (3 s did not)
    extra = ["--mode", mode, "--instance-id", "worker-1", "--max-poll-records", "50"]
    extra += ["--session-timeout-ms", "30000"]
    first, log1 = start_member(
        cluster, tmp_path, "first", "jobs", *extra, "--crash-after-batches", "3"
    )
    first.wait(60)
    assert first.returncode == 3, first.log_text()[-2000:]
    second, log2 = start_member(cluster, tmp_path, "second", "jobs", *extra)
    # both partitions have records left: wait until the restart has read from each of them
    wait_until(
        lambda: sum(1 for v in consumed([log2]).values() if v) >= 2,
        "the restart consumes from both partitions",
    )
    cluster.processes.stop(second.pid)
    return events(log1), events(log2)


def _last_commits(evs: list[dict[str, Any]]) -> dict[int, int]:
    out: dict[int, int] = {}
    for e in evs:
        if e["ev"] == "commit":
            out.update({int(p): o for p, o in e["offsets"].items()})
    return out


def _first_offsets(evs: list[dict[str, Any]]) -> dict[int, int]:
    out: dict[int, int] = {}
    for e in evs:
        if e["ev"] == "rec":
            out.setdefault(e["p"], e["first"])
    return out


def test_at_least_once_redelivers_exactly_the_uncommitted_tail(
    cluster: Cluster, tmp_path: Path
) -> None:
    before, after = _run_crash_and_restart(cluster, tmp_path, "at-least-once")
    committed = _last_commits(before)
    processed = consumed_from(before)
    uncommitted = {
        p: {o for o in offs if o >= committed.get(p, 0)} for p, offs in processed.items()
    }
    assert any(uncommitted.values()), "the crash left processed-but-uncommitted records"
    first = _first_offsets(after)
    for p, offs in uncommitted.items():
        if offs:
            # the restart starts exactly at the committed offset: the uncommitted tail again
            assert first[p] == committed.get(p, 0) == min(offs), (p, first, committed)
    # static membership: the restart took its old place without a rebalance
    gens = {e["gen"] for e in before + after if e["ev"] == "owned" and e["gen"] >= 0}
    assert len(gens) == 1, gens


def test_at_most_once_never_redelivers_a_committed_offset(cluster: Cluster, tmp_path: Path) -> None:
    before, after = _run_crash_and_restart(cluster, tmp_path, "at-most-once")
    committed = _last_commits(before)
    assert committed
    first = _first_offsets(after)
    for p, offset in first.items():
        assert offset >= committed.get(p, 0), (p, offset, committed)
    # the batch committed just before the crash was never processed (at-most-once loses it)
    processed = consumed_from(before)
    again = consumed_from(after)
    for p, offs in again.items():
        assert not {o for o in offs if o < committed.get(p, 0)}, p
    assert processed


def consumed_from(evs: list[dict[str, Any]]) -> dict[int, set[int]]:
    out: dict[int, set[int]] = defaultdict(set)
    for e in evs:
        if e["ev"] == "rec":
            out[e["p"]].update(range(e["first"], e["last"] + 1))
    return out
