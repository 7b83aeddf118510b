"""What an idle agent that is the controller costs, by partition count (and by source tree).

Run with ``python -m bench.controller_idle_bench [--partitions N ...] [--trees DIR ...]
[--rounds R] [--idle S]``. Starts a real ZooKeeper; per round, and per tree in turn (rounds
alternate the trees, so both see the same machine), one agent (replication factor 1) whose
``PYTHONPATH`` is that tree, a topic of N partitions, a wait until the agent leads every
partition plus ``SETTLE_S``, and then ``--idle`` seconds with nothing to do, over which it
measures:

* **CPU**: the agent's user + system CPU seconds per second of wall time (``/proc``), and the
  ZooKeeper server's (which served every state once a second before);
* **loop lag**: the agent's ``strata_event_loop_lag_seconds`` histogram over the window (a
  wake-up asked for every 50 ms): the mean lag, and the largest bucket any lag fell in.

Figures are the median (and range) of the rounds. ``--trees`` defaults to this checkout; give
two to compare a change with its base (e.g. ``--trees /work/main .``).

``--passes`` measures instead, in this process on the real ZooKeeper (no agent, so no cost of
hosting the partitions), what one controller pass over a topic of N partitions holds the event
loop for: a full pass that decodes every state (what every pass did once a second before the
controller became event-driven), a full pass over unchanged states (the safety net, every
``SAFETY_NET_INTERVAL``), and a turn with nothing changed (what it does every second now).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import shutil
import tempfile
import time
import urllib.request
from pathlib import Path

from bench.common import cpu_seconds, create_topic, spread
from bench.many_partitions_bench import leaders
from infra.agents import start_agent
from infra.zookeeper import start_zookeeper
from storage.metadata import AsyncZooKeeper

ROOT = Path(__file__).resolve().parent.parent
SETTLE_S = 5.0
DEADLINE_S = 120.0
LAG = "strata_event_loop_lag_seconds"


def lag_histogram(url: str) -> dict[str, float]:
    """The loop-lag histogram's cumulative buckets (by ``le``), ``sum`` and ``count``."""
    out: dict[str, float] = {}
    with urllib.request.urlopen(url, timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(f"{LAG}_bucket"):
                le = line.split('le="', 1)[1].split('"', 1)[0]
                out[le] = float(line.split()[-1])
            elif line.startswith(f"{LAG}_sum "):
                out["sum"] = float(line.split()[-1])
            elif line.startswith(f"{LAG}_count "):
                out["count"] = float(line.split()[-1])
    return out


def one(
    zk_connect: str, zk_pid: int, work: Path, tree: Path, partitions: int, index: int, idle: float
) -> dict[str, float]:
    connect = f"{zk_connect}/idle-{index}"
    agent = start_agent(1, connect, work / f"agent-{index}", env={"PYTHONPATH": str(tree)})
    try:
        asyncio.run(create_topic(connect, "idle", partitions))
        start = time.monotonic()
        while leaders(agent) < partitions:
            if time.monotonic() - start > DEADLINE_S:
                raise TimeoutError(f"agent leads {leaders(agent)} of {partitions}")
            time.sleep(0.2)
        time.sleep(SETTLE_S)
        before = lag_histogram(agent.metrics_url)
        cpu0, zk0, t0 = cpu_seconds(agent.pid), cpu_seconds(zk_pid), time.monotonic()
        time.sleep(idle)
        cpu1, zk1, t1 = cpu_seconds(agent.pid), cpu_seconds(zk_pid), time.monotonic()
        after = lag_histogram(agent.metrics_url)
    finally:
        agent.stop(timeout=60)
    probes = after["count"] - before["count"]
    worst = 0.0
    for le in sorted((k for k in after if k not in ("sum", "count")), key=float):
        below = after.get(le, 0) - before.get(le, 0)
        if below < probes:  # some lag above this bucket's bound
            worst = math.inf if le == "+Inf" else float(le)
    bounds = sorted(float(k) for k in after if k not in ("sum", "count", "+Inf"))
    higher = [b for b in bounds if b > worst]
    return {
        "cpu_s_per_s": (cpu1 - cpu0) / (t1 - t0),
        "zk_cpu_s_per_s": (zk1 - zk0) / (t1 - t0),
        "mean_lag_ms": 1000 * (after["sum"] - before["sum"]) / max(probes, 1),
        "max_lag_below_ms": 1000 * (higher[0] if higher else math.inf),
    }


async def pass_costs(connect: str, partitions: int, rounds: int) -> dict[str, list[float]]:
    """Seconds of each kind of pass (see the module docstring), ``rounds`` of each."""
    from broker_agents.controller import Controller
    from broker_agents.view import ClusterView
    from storage.metadata import AgentRegistration, MetadataStore

    zk = AsyncZooKeeper(connect)
    await zk.start()
    try:
        store = MetadataStore(zk)
        await store.init()
        await create_topic(connect, "idle", partitions)
        view = ClusterView(
            agents={
                1: AgentRegistration(agent_id=1, host="h", port=1, started_ms=0, incarnation="i")
            }
        )
        controller = Controller(1, zk, store, view)
        controller.epoch = 1
        await controller.reconcile()  # creates the states
        await controller._pass()  # decides again what it wrote
        out: dict[str, list[float]] = {"decode_all_s": [], "safety_net_s": [], "quiet_turn_s": []}
        for _ in range(rounds):
            controller._decoded.clear()
            t = time.perf_counter()
            await controller.reconcile()
            out["decode_all_s"].append(time.perf_counter() - t)
            t = time.perf_counter()
            await controller.reconcile()
            out["safety_net_s"].append(time.perf_counter() - t)
            t = time.perf_counter()
            await controller._pass()
            out["quiet_turn_s"].append(time.perf_counter() - t)
        return out
    finally:
        await zk.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Strata: an idle controller's cost")
    parser.add_argument("--partitions", type=int, nargs="+", default=[1024])
    parser.add_argument("--trees", type=Path, nargs="+", default=[ROOT])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--idle", type=float, default=20.0)
    parser.add_argument("--dir", type=Path, default=ROOT / "var" / "bench")
    parser.add_argument("--passes", action="store_true", help="time controller passes instead")
    args = parser.parse_args(argv)
    args.dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=args.dir))
    zk = start_zookeeper(work / "zookeeper")
    if args.passes:
        try:
            print("| partitions | pass | ms (median, range) |")
            print("|---:|---|---:|")
            for i, n in enumerate(args.partitions):
                costs = asyncio.run(pass_costs(f"{zk.connect_string}/passes-{i}", n, args.rounds))
                for kind, values in costs.items():
                    s = spread([v * 1000 for v in values])
                    print(f"| {n:,} | {kind} | {s['median']:.1f} ({s['min']:.1f}-{s['max']:.1f}) |")
        finally:
            zk.stop()
            shutil.rmtree(work, ignore_errors=True)
        return 0
    rows: dict[tuple[int, str], list[dict[str, float]]] = {}
    index = 0
    try:
        for _ in range(args.rounds):
            for n in args.partitions:
                for tree in args.trees:
                    index += 1
                    row = one(zk.connect_string, zk.pid, work, tree.resolve(), n, index, args.idle)
                    print(n, tree, {k: round(v, 3) for k, v in row.items()}, flush=True)
                    rows.setdefault((n, str(tree)), []).append(row)
    finally:
        zk.stop()
        shutil.rmtree(work, ignore_errors=True)
    print(
        "| partitions | tree | agent CPU s/s | ZooKeeper CPU s/s | mean loop lag ms"
        " | worst loop lag < ms |"
    )
    print("|---:|---|---:|---:|---:|---:|")
    for (n, tree), got in rows.items():
        cells = []
        for key in ("cpu_s_per_s", "zk_cpu_s_per_s", "mean_lag_ms", "max_lag_below_ms"):
            s = spread([r[key] for r in got])
            cells.append(f"{s['median']:.3g} ({s['min']:.3g}-{s['max']:.3g})")
        print(f"| {n:,} | {tree} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
