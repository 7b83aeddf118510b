"""Partitions are cheap (#30): keyed produce and consume on one agent as the partition count grows.

Run with ``make bench-partitions`` (``python -m bench.partitions_bench [--write-docs]``). One
ZooKeeper, one agent process, RF 1, 1 KiB values with random keys (the "events keyed by
customer id" topic). For every row, a partition count (16, 256, 1,024, 4,096 by default) under a
topic ``fsync.policy`` (``always``, ``interval``):

* **produce**: ``Producer.send_batch`` of 1,024 keyed records at a time for ``--seconds``
  (acks=1, linger 5 ms, 1 MiB batches, 4 MiB requests), msgs/s from the first call to the last
  acknowledgement;
* **consume** of exactly what that produce stored, by one consumer assigned every partition
  (positioned at each partition's end before the produce): once with ``getmany_arrow``, then
  once with ``getmany``;
* for each phase the agent's **CPU seconds per 1,000 records** (user + system of the agent
  process, ``/proc/<pid>/stat``) and, for produce, the agent's **fsyncs per second** (the
  ``strata_fsync_duration_seconds`` histogram's count on its ``/metrics``: one per group-commit
  fsync).

``--rounds`` rounds (3 by default), each running every row; odd rounds run the rows in the
reverse order. Every figure is the median over the rounds (with its min-max range), and each
ratio against the 16-partition row of the same policy is taken within a round, then medianed.

Each row set (policy, partitions) has its own ZooKeeper chroot and agent data directory, and
its agent runs only while its row does, so that one row's idle partitions (and their
``interval`` tickers) cost nothing in another's. The topic is created once and reused by later
rounds; it is created afresh (new chroot, new data directory) only when its data directory has
grown past ``--max-row-gib``, to bound the disk a full run takes (the 16-partition rows write
about 2 GB a round). ``--agent-setting KEY=VALUE`` passes agent settings as ``STRATA_AGENT_*``
variables (for example an agent-wide WAL switched on and off, to compare two runs; ``--label``
keeps their results apart).

Results: ``bench/results/partitions[-<label>].json`` (medians, ranges, ratios, rounds), a plot,
and with ``--write-docs`` the "Partitions are cheap" section of ``docs/benchmarks.md``
(``--from-json`` renders a saved result again).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import platform
import shutil
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import cpu_seconds, create_topic, publish, save_result, settle_writeback, spread
from broker_agents.config import ENV_PREFIX, AgentConfig
from infra.agents import AgentProcess, start_agent
from infra.zookeeper import start_zookeeper
from sdk import Consumer, Producer, StoredRuns, TopicPartition
from storage.config import LogConfig

ROOT = Path(__file__).resolve().parent.parent
TOPIC = "keyed"
MiB = 1 << 20
SIZE = 1024
CHUNK = 1024
KEY_BYTES = 16
#: distinct lists of ``CHUNK`` random keys cycled through by the producer (fresh keys per call
#: would cost the producer per-record Python work that is not the SDK's)
KEY_SETS = 64
PARTITIONS = (16, 256, 1024, 4096)
QUICK_PARTITIONS = (16, 256)
POLICIES = ("always", "interval")
INTERVAL_MS = LogConfig.model_fields["fsync_interval_ms"].default
FSYNC_METRIC = "strata_fsync_duration_seconds_count"
#: fsyncs/s under ``always`` "do not grow" while each row's is at most this times the base row's
FSYNC_GROWTH_TOLERANCE = 1.25
#: targets of #30, as (phase, partitions, minimum ratio to the base row)
TARGETS = (
    ("produce", 1024, 0.5),
    ("produce", 4096, 0.3),
    ("consume_arrow", 1024, 0.5),
    ("consume_getmany", 1024, 0.5),
)
PHASE_NAMES = {
    "produce": "produce",
    "consume_arrow": "consume (`getmany_arrow`)",
    "consume_getmany": "consume (`getmany`)",
}
CONSUME_LIMIT_S = 300.0
WARM_LIMIT_S = 600.0


# ------------------------------------------------------------------ measuring


def _producer_config(bootstrap: str) -> dict[str, Any]:
    return {
        "bootstrap.servers": bootstrap,
        "acks": 1,
        "linger.ms": 5,
        "batch.size": MiB,
        "max.request.size": 4 * MiB,
        "buffer.memory": 256 * MiB,
        "max.in.flight.requests.per.connection": 5,
    }


def _consumer_config(bootstrap: str) -> dict[str, Any]:
    return {
        "bootstrap.servers": bootstrap,
        "auto.offset.reset": "earliest",
        "max.partition.fetch.bytes": 8 * MiB,
    }


def fsync_count(metrics_url: str) -> float:
    """The agent's group-commit fsyncs so far (its ``/metrics``)."""
    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        text = response.read().decode()
    for line in text.splitlines():
        if line.startswith(FSYNC_METRIC + " "):
            return float(line.split()[1])
    raise RuntimeError(f"{metrics_url} has no {FSYNC_METRIC}")


@dataclass(frozen=True)
class AgentProbe:
    """Before/after readings: the agent process's CPU seconds and fsyncs, and the CPU seconds
    of this process (the client: the producer or consumer, every thread of it)."""

    pid: int
    metrics_url: str

    def read(self) -> tuple[float, float, float]:
        return cpu_seconds(self.pid), fsync_count(self.metrics_url), time.process_time()


def phase_figures(
    records: int, seconds: float, before: tuple[float, ...], after: tuple[float, ...]
) -> dict[str, float]:
    """One phase's figures from its record count, duration and the probe's readings (the
    client's CPU only when the readings have it)."""
    cpu = after[0] - before[0]
    fsyncs = after[1] - before[1]
    client = after[2] - before[2] if len(after) > 2 else float("nan")
    return {
        "client_cpu_s_per_1k": client / records * 1000 if records else float("nan"),
        "records": records,
        "seconds": seconds,
        "msgs_per_s": records / seconds,
        "mb_per_s": records * SIZE / 1e6 / seconds,
        "agent_cpu_s": cpu,
        "cpu_s_per_1k": cpu / records * 1000 if records else float("nan"),
        "fsyncs": fsyncs,
        "fsyncs_per_s": fsyncs / seconds,
    }


async def warm(bootstrap: str, partitions: int) -> None:
    """One record to every partition: returns once every partition has a serving leader."""
    config = {
        "bootstrap.servers": bootstrap,
        "acks": 1,
        "delivery.timeout.ms": int(WARM_LIMIT_S * 1000),  # partitions of a new topic come slowly
    }
    async with Producer(config) as producer:
        await producer.partitions_for(TOPIC)
        async with asyncio.timeout(WARM_LIMIT_S):
            futures = [await producer.send(TOPIC, b"warm", partition=p) for p in range(partitions)]
            await asyncio.gather(*futures)


async def end_offsets(bootstrap: str, partitions: int) -> list[int]:
    async with Consumer({"bootstrap.servers": bootstrap}) as consumer:
        tps = [TopicPartition(TOPIC, p) for p in range(partitions)]
        ends = await consumer.end_offsets(tps)
        return [ends[tp] for tp in tps]


async def produce(bootstrap: str, seconds: float, probe: AgentProbe) -> dict[str, float]:
    """``send_batch`` of ``CHUNK`` keyed records at a time for ``seconds``, then flush."""
    values = [os.urandom(SIZE)] * CHUNK
    raw = os.urandom(KEY_BYTES * CHUNK * KEY_SETS)
    key_sets = [
        [
            raw[o : o + KEY_BYTES]
            for o in range(s * CHUNK * KEY_BYTES, (s + 1) * CHUNK * KEY_BYTES, KEY_BYTES)
        ]
        for s in range(KEY_SETS)
    ]
    async with Producer(_producer_config(bootstrap)) as producer:
        await producer.partitions_for(TOPIC)
        before = probe.read()
        start = time.perf_counter()
        end = start + seconds
        # the calls' futures in flight, folded into ``stored`` in order as they complete (a
        # call over many partitions completes out of order: the ones behind a slow one wait
        # here with their results, which are compact: StoredRuns)
        futures: collections.deque[asyncio.Future[StoredRuns]] = collections.deque()
        stored = 0
        i = 0
        while time.perf_counter() < end:
            keys = key_sets[i % KEY_SETS]
            futures.append(await producer.send_batch(TOPIC, values, keys=keys))
            i += 1
            while futures and futures[0].done():
                stored += futures.popleft().result().record_count
        await producer.flush()
        elapsed = time.perf_counter() - start
        after = probe.read()
        stored += sum(f.result().record_count for f in futures)
    if stored != i * CHUNK:
        raise RuntimeError(f"{stored} records acknowledged of {i * CHUNK}")
    return phase_figures(stored, elapsed, before, after)


async def consume(
    bootstrap: str, starts: list[int], ends: list[int], arrow: bool, probe: AgentProbe
) -> dict[str, float]:
    """Read partitions ``[starts, ends)`` with one consumer assigned every partition."""
    expected = sum(ends) - sum(starts)
    async with Consumer(_consumer_config(bootstrap)) as consumer:
        tps = [TopicPartition(TOPIC, p) for p in range(len(starts))]
        consumer.assign(tps)
        for tp, offset in zip(tps, starts, strict=True):
            consumer.seek(tp, offset)
        got = 0
        before = probe.read()
        start = time.perf_counter()
        async with asyncio.timeout(CONSUME_LIMIT_S):
            while got < expected:
                if arrow:
                    tables = await consumer.getmany_arrow(timeout_ms=500)
                    got += sum(t.num_rows for t in tables.values())
                else:
                    batches = await consumer.getmany(timeout_ms=500)
                    got += sum(len(records) for records in batches.values())
        elapsed = time.perf_counter() - start
        after = probe.read()
    if got != expected:
        raise RuntimeError(f"consumed {got} records, {expected} were produced")
    return phase_figures(got, elapsed, before, after)


# ------------------------------------------------------------------ rows


def row_key(policy: str, partitions: int) -> str:
    return f"{policy}-{partitions}"


def row_order(
    partitions: list[int], index: int, policies: tuple[str, ...] = POLICIES
) -> list[tuple[str, int]]:
    """Round ``index``'s rows: every policy at every partition count, reversed in odd rounds."""
    rows = [(policy, n) for policy in policies for n in partitions]
    return rows[::-1] if index % 2 else rows


def agent_env(settings: list[str]) -> dict[str, str]:
    """``KEY=VALUE`` items (``wal.mode=x``, ``WAL_MODE=x`` or ``STRATA_AGENT_WAL_MODE=x``) as
    the agent's ``STRATA_AGENT_*`` variables. A key this checkout's agent does not know is an
    error: the agent would ignore it, and two "different" runs would measure the same thing."""
    known = {
        ENV_PREFIX + (f.alias or name).replace(".", "_").upper()
        for name, f in AgentConfig.model_fields.items()
    }
    env = {}
    for item in settings:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--agent-setting {item!r}: expected KEY=VALUE")
        name = key.replace(".", "_").upper()
        if not name.startswith(ENV_PREFIX):
            name = ENV_PREFIX + name
        if name not in known:
            raise SystemExit(f"--agent-setting {item!r}: the agent has no setting {name}")
        env[name] = value
    return env


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


@dataclass
class RowSet:
    """One (policy, partitions): its chroot and data directory, created afresh as needed."""

    policy: str
    partitions: int
    work: Path
    generation: int = -1

    @property
    def data_dir(self) -> Path:
        return self.work / f"{row_key(self.policy, self.partitions)}-g{self.generation}"

    def chroot(self, zk: str) -> str:
        return f"{zk}/bench-{row_key(self.policy, self.partitions)}-g{self.generation}"


@contextmanager
def _agent(row: RowSet, zk: str, env: dict[str, str]) -> Iterator[AgentProcess]:
    agent = start_agent(1, row.chroot(zk), row.data_dir, env=env, startup_timeout=WARM_LIMIT_S)
    try:
        yield agent
    finally:
        agent.stop(timeout=60)


def run_row(row: RowSet, zk: str, args: argparse.Namespace, env: dict[str, str]) -> dict[str, Any]:
    """One row: the agent of this row set up (its topic created if new), warm, produce,
    consume twice, agent stopped."""
    fresh = row.generation < 0 or _dir_bytes(row.data_dir) > args.max_row_gib * (1 << 30)
    created_s = None
    if fresh:
        if row.generation >= 0:
            shutil.rmtree(row.data_dir, ignore_errors=True)
        row.generation += 1
    stage = "agent start"
    try:
        with _agent(row, zk, env) as agent:
            if fresh:
                stage = "topic creation"
                started = time.perf_counter()
                config = {"fsync.policy": row.policy}
                asyncio.run(create_topic(row.chroot(zk), TOPIC, row.partitions, config))
                stage = "warm-up"
                asyncio.run(warm(agent.address, row.partitions))
                created_s = time.perf_counter() - started
            else:
                stage = "warm-up"
                asyncio.run(warm(agent.address, row.partitions))
            probe = AgentProbe(agent.pid, agent.metrics_url)
            starts = asyncio.run(end_offsets(agent.address, row.partitions))
            settle_writeback(args.dir)
            stage = "produce"
            out: dict[str, Any] = {
                "produce": asyncio.run(produce(agent.address, args.seconds, probe))
            }
            ends = asyncio.run(end_offsets(agent.address, row.partitions))
            for phase, arrow in (("consume_arrow", True), ("consume_getmany", False)):
                stage = phase
                out[phase] = asyncio.run(consume(agent.address, starts, ends, arrow, probe))
    except Exception as exc:
        raise RuntimeError(f"{stage}: {type(exc).__name__}: {exc}") from exc
    out["fresh_topic"] = fresh
    if created_s is not None:
        out["created_s"] = created_s
    return out


def one_round(
    rows: dict[str, RowSet], zk: str, args: argparse.Namespace, env: dict[str, str], index: int
) -> dict[str, Any]:
    r: dict[str, Any] = {}
    for policy, n in row_order(args.partitions, index, args.policies):
        key = row_key(policy, n)
        try:
            r[key] = run_row(rows[key], zk, args, env)
        except Exception as exc:  # reported, not fatal: the other rows still count
            r[key] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            print(f"round {index + 1} {key}: {r[key]['error']}", flush=True)
            continue
        p, c = r[key]["produce"], r[key]["consume_arrow"]
        print(
            f"round {index + 1} {key}: produce {p['msgs_per_s']:,.0f} msgs/s,"
            f" {p['fsyncs_per_s']:,.0f} fsyncs/s, {p['cpu_s_per_1k']:.4f} CPU s/1k"
            f" (client {p['client_cpu_s_per_1k']:.4f});"
            f" consume arrow {c['msgs_per_s']:,.0f},"
            f" getmany {r[key]['consume_getmany']['msgs_per_s']:,.0f} msgs/s",
            flush=True,
        )
    return r


# ------------------------------------------------------------------ summarising (pure)


FIGURES = {
    "produce": ("msgs_per_s", "fsyncs_per_s", "cpu_s_per_1k", "client_cpu_s_per_1k"),
    "consume_arrow": ("msgs_per_s", "cpu_s_per_1k"),
    "consume_getmany": ("msgs_per_s", "cpu_s_per_1k"),
}
RATIO_FIGURES = {
    "produce": ("msgs_per_s", "fsyncs_per_s"),
    "consume_arrow": ("msgs_per_s",),
    "consume_getmany": ("msgs_per_s",),
}


def _measured(r: dict[str, Any], key: str) -> bool:
    return key in r and "error" not in r[key]


def summarize(rounds: list[dict[str, Any]], partitions: list[int]) -> dict[str, Any]:
    """Each row's figures as median and range over the rounds, and its ratios to the base row
    (the smallest partition count) of the same policy, taken within each round then medianed."""
    base = min(partitions)
    rows: dict[str, Any] = {}
    errors: dict[str, list[str]] = {}
    for policy in POLICIES:
        for n in partitions:
            key = row_key(policy, n)
            errors[key] = [r[key]["error"] for r in rounds if "error" in r.get(key, {})]
            present = [r[key] for r in rounds if _measured(r, key)]
            if not present:
                continue
            row: dict[str, Any] = {"policy": policy, "partitions": n, "rounds": len(present)}
            for phase, names in FIGURES.items():
                row[phase] = {  # a figure older results lack is nan
                    name: spread([x[phase].get(name, float("nan")) for x in present])
                    for name in names
                }
            ratios: dict[str, Any] = {}
            for phase, names in RATIO_FIGURES.items():
                for name in names:
                    b = row_key(policy, base)
                    within = [
                        r[key][phase][name] / r[b][phase][name]
                        for r in rounds
                        if _measured(r, key) and _measured(r, b) and r[b][phase][name]
                    ]
                    if within:
                        ratios[f"{phase}.{name}"] = spread(within)
            row["ratio"] = ratios
            rows[key] = row
    return {
        "base_partitions": base,
        "rows": rows,
        "errors": {k: v for k, v in errors.items() if v},
    }


def targets(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """#30's targets, each with the measured median ratio and whether it is met (``None``:
    the row was not measured)."""
    rows = summary["rows"]
    out: list[dict[str, Any]] = []
    for policy in POLICIES:
        for phase, n, minimum in TARGETS:
            ratio = rows.get(row_key(policy, n), {}).get("ratio", {}).get(f"{phase}.msgs_per_s")
            value = None if ratio is None else ratio["median"]
            out.append(
                {
                    "what": f"{PHASE_NAMES[phase]} at {n:,} partitions, `{policy}`",
                    "target": f"≥ {minimum:g}x",
                    "ratio": value,
                    "met": None if value is None else value >= minimum,
                }
            )
    growth = [
        row["ratio"]["produce.fsyncs_per_s"]["median"]
        for key, row in rows.items()
        if row["policy"] == "always"
        and row["partitions"] != summary["base_partitions"]
        and "produce.fsyncs_per_s" in row["ratio"]
    ]
    worst = max(growth) if growth else None
    out.append(
        {
            "what": "agent fsyncs/s under `always` do not grow with partitions (the highest"
            " row's ratio to the base row)",
            "target": f"≤ {FSYNC_GROWTH_TOLERANCE:g}x",
            "ratio": worst,
            "met": None if worst is None else worst <= FSYNC_GROWTH_TOLERANCE,
        }
    )
    return out


def _cell(s: dict[str, float], fmt: str = "{:,.0f}") -> str:
    if s["min"] == s["max"]:
        return fmt.format(s["median"])
    return f"{fmt.format(s['median'])} ({fmt.format(s['min'])}-{fmt.format(s['max'])})"


def _ratio(row: dict[str, Any], name: str) -> str:
    r = row["ratio"].get(name)
    return "—" if r is None else _cell(r, "{:.2f}x")


def render(r: dict[str, Any]) -> str:
    s = r["summary"]
    base = s["base_partitions"]
    settings = r.get("agent_settings") or {}
    rounds = r["rounds_run"]
    lines = [
        "<!-- partitions-bench:begin (generated by `make bench-partitions`; do not edit by hand) -->",
        f"Measured {r['date']} on {r['machine']} with `{r['command']}`"
        f" (about {r['elapsed_s'] / 60:.0f} min){', ' + r['note'] if r.get('note') else ''}:"
        f" one agent, RF 1, keyed {SIZE:,} B values (random {KEY_BYTES}-byte keys), `send_batch`"
        f" of {CHUNK:,} records at a time for {r['seconds']:g} s per row (acks=1, linger 5 ms,"
        " 1 MiB batches), then one consumer assigned every partition reads exactly what was"
        f" produced, with `getmany_arrow` and then `getmany`. **{rounds} round(s)**, the rows'"
        " order reversed in odd rounds; each cell the median over the rounds (min-max); each"
        f" ratio ÷ the {base}-partition row of the same policy, taken within a round, then the"
        f" median. `interval` fsyncs every {r['interval_ms']} ms. Agent settings:"
        + (
            " " + ", ".join(f"`{k}={v}`" for k, v in settings.items()) if settings else " defaults."
        ),
        "",
        "| `fsync.policy` | partitions | produce msgs/s | ÷ base | agent fsyncs/s | ÷ base |"
        " agent CPU s / 1k records | producer CPU s / 1k records |"
        " consume `getmany_arrow` msgs/s | ÷ base |"
        " consume `getmany` msgs/s | ÷ base | agent CPU s / 1k consumed (arrow) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in s["rows"].values():
        p, ca, cg = row["produce"], row["consume_arrow"], row["consume_getmany"]
        lines.append(
            f"| `{row['policy']}` | {row['partitions']:,} | {_cell(p['msgs_per_s'])} |"
            f" {_ratio(row, 'produce.msgs_per_s')} | {_cell(p['fsyncs_per_s'])} |"
            f" {_ratio(row, 'produce.fsyncs_per_s')} | {_cell(p['cpu_s_per_1k'], '{:.4f}')} |"
            f" {_cell(p['client_cpu_s_per_1k'], '{:.4f}')} |"
            f" {_cell(ca['msgs_per_s'])} | {_ratio(row, 'consume_arrow.msgs_per_s')} |"
            f" {_cell(cg['msgs_per_s'])} | {_ratio(row, 'consume_getmany.msgs_per_s')} |"
            f" {_cell(ca['cpu_s_per_1k'], '{:.4f}')} |"
        )
    for key, errors in s.get("errors", {}).items():
        lines.append(f"| {key} failed in {len(errors)} round(s): {errors[0]} ||||||||||||")
    lines += ["", "Targets of #30 (median of the within-round ratios):", ""]
    for t in targets(s):
        verdict = "not measured" if t["met"] is None else "met" if t["met"] else "**missed**"
        value = "" if t["ratio"] is None else f" ({t['ratio']:.2f}x)"
        lines.append(f"* {t['what']} {t['target']}: {verdict}{value}")
    created = r.get("created_s", {})
    if created:
        lines += [
            "",
            "Topic creation (create + one record to every partition; a row set's topic is reused"
            " by later rounds unless its data outgrew the per-row cap): "
            + ", ".join(f"{k} {v:.1f} s" for k, v in created.items())
            + ".",
        ]
    lines += [
        "",
        f"![keyed produce and consume by partition count](img/{r['plot']})",
        "<!-- partitions-bench:end -->",
    ]
    return "\n".join(lines)


def plot(r: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullLocator

    rows = r["summary"]["rows"]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.2))
    panels = (
        (axes[0], (("produce", "produce", "-"),), "msgs_per_s", "produce, msgs/s"),
        (
            axes[1],
            (("consume_arrow", "getmany_arrow", "-"), ("consume_getmany", "getmany", "--")),
            "msgs_per_s",
            "consume, msgs/s",
        ),
        (axes[2], (("produce", "produce", "-"),), "fsyncs_per_s", "agent fsyncs/s while producing"),
    )
    counts = sorted({row["partitions"] for row in rows.values()})
    colors = {"always": "tab:blue", "interval": "tab:orange"}
    for ax, phases, name, title in panels:
        for policy in POLICIES:
            for phase, label, style in phases:
                points = sorted(
                    (row["partitions"], row[phase][name])
                    for row in rows.values()
                    if row["policy"] == policy
                )
                if not points:
                    continue
                xs = [x for x, _ in points]
                ys = np.array([c["median"] for _, c in points])
                err = np.array(
                    [
                        [c["median"] - c["min"] for _, c in points],
                        [c["max"] - c["median"] for _, c in points],
                    ]
                )
                ax.errorbar(
                    xs,
                    ys,
                    yerr=err,
                    marker="o",
                    ls=style,
                    color=colors[policy],
                    capsize=3,
                    label=f"{label}, {policy}",
                )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(counts, [f"{n:,}" for n in counts])
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xlabel("partitions (log)")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("One agent, RF 1, keyed 1 KiB records (median of the rounds, min-max bars)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------ main


def command(argv: list[str]) -> str:
    """The make command of this run, for the docs (without ``--write-docs``, which the target
    passes, and ``--note``, which the docs show anyway)."""
    shown: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--note":
            skip = True
        elif arg != "--write-docs" and not arg.startswith("--note="):
            shown.append(arg)
    return "make bench-partitions" + (f' BENCH_ARGS="{" ".join(shown)}"' if shown else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Strata: keyed produce/consume by partition count")
    parser.add_argument("--rounds", type=int, default=3, help="alternated rounds (medians)")
    parser.add_argument("--seconds", type=float, default=8.0, help="produce time per row")
    parser.add_argument(
        "--partitions",
        type=lambda s: sorted({int(x) for x in s.split(",")}),
        help="comma-separated partition counts (default 16,256,1024,4096; --quick 16,256);"
        " the smallest is the base of the ratios",
    )
    parser.add_argument(
        "--policies",
        type=lambda s: tuple(p for p in POLICIES if p in s.split(",")),
        default=POLICIES,
        help="comma-separated fsync policies (default always,interval)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: 16,256 partitions, 2 s rows, 1 round"
    )
    parser.add_argument(
        "--agent-setting",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an agent setting (STRATA_AGENT_* variable), repeatable",
    )
    parser.add_argument("--max-row-gib", type=float, default=3.0, help="fresh topic past this")
    parser.add_argument("--label", default="", help="results under partitions-<label>.json")
    parser.add_argument("--note", default="", help="said after the command in the docs")
    parser.add_argument("--dir", type=Path, default=ROOT / "var" / "bench")
    parser.add_argument("--write-docs", action="store_true")
    parser.add_argument("--from-json", type=Path, help="render (and plot) a saved result again")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    name = f"partitions-{args.label}" if args.label else "partitions"
    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        saved["targets"] = targets(saved["summary"])
        plot(saved, ROOT / ("docs" if args.write_docs else "bench/results") / "img" / saved["plot"])
        publish(name, render(saved), saved, write_docs=args.write_docs)
        return 0
    if args.quick:
        args.seconds, args.rounds = 2.0, 1
    if args.partitions is None:
        args.partitions = list(QUICK_PARTITIONS if args.quick else PARTITIONS)
    env = agent_env(args.agent_setting)

    began = time.perf_counter()
    args.dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=args.dir, prefix="partitions-"))
    zk = start_zookeeper(work / "zookeeper")
    rounds: list[dict[str, Any]] = []
    created: dict[str, float] = {}
    try:
        rows = {
            row_key(policy, n): RowSet(policy, n, work)
            for policy, n in row_order(args.partitions, 0, args.policies)
        }
        for index in range(args.rounds):
            r = one_round(rows, zk.connect_string, args, env, index)
            for key, row in r.items():
                if "created_s" in row:
                    created.setdefault(key, row["created_s"])
            rounds.append(r)
            save_result(f"{name}-rounds", rounds)  # a run cut short keeps its rounds
    finally:
        zk.stop()
        shutil.rmtree(work, ignore_errors=True)
    plot_name = f"bench-{name}.png"
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{os.cpu_count()} cores, {platform.machine()}, Python {platform.python_version()}",
        "command": command(argv),
        "note": args.note,
        "seconds": args.seconds,
        "rounds_run": len(rounds),
        "interval_ms": INTERVAL_MS,
        "agent_settings": env,
        "elapsed_s": time.perf_counter() - began,
        "created_s": created,
        "plot": plot_name,
        "summary": summarize(rounds, args.partitions),
        "rounds": rounds,
    }
    result["targets"] = targets(result["summary"])
    save_result(name, result)  # before rendering: a render bug loses no run (--from-json)
    plot(result, ROOT / ("docs" if args.write_docs else "bench/results") / "img" / plot_name)
    publish(name, render(result), result, write_docs=args.write_docs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
