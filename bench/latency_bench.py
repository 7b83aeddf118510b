"""End-to-end and produce->ack latency, and a soak that reports every stall (#31).

Run with ``make bench-latency`` (``python -m bench.latency_bench [--write-docs]``). Starts a
real ZooKeeper, a cluster of three agents (and moto as S3 for the soak) and one of a single
agent (for the acks=1 rows, the setup #31 measured them with), then for each row runs a
**producer process** and a **consumer process** (``--role``: this module again), so neither
one's event loop delays the other's clock readings:

* the producer sends 1 KiB values at a fixed rate with ``linger.ms=0`` (keyless, round robin
  over 6 partitions); each value starts with ``time.monotonic_ns()`` at the send (the
  monotonic clock is one clock for every process of the machine), and records the
  produce->ack latency of each record;
* the consumer is assigned all 6 partitions and long-polls (``fetch.max.wait.ms=500``); it
  records, for each record, the time from that send to the moment it holds the record.

Both record into HDR histograms (``hdrhistogram``, 1 µs to 60 s, 3 significant digits) and
hand them back encoded. Rows: acks=1 on a topic with replication factor 1 (on the one-agent
cluster), acks=all on one with replication factor 3 (``min.insync.replicas=2``), at 1,000 and
10,000 msgs/s, each under ``fsync.policy=always`` (the default: an ack waits for the fsync of
every in-sync replica) and ``interval`` (Kafka's acks=all: in the memory of every in-sync
replica, fsynced within ``wal.fsync.interval.ms``), a topic each (``--fsync-policies``). Each
row runs ``--runs`` times (3), alternated with the others, and a figure is the median of its
runs with the min-max beside it.

**Produce→ack alone** (#27): the producer process with nothing else running, 1 KiB at
1,000 msgs/s, ``linger.ms=0``: acks=1 on replication factor 1 and acks=all on 3, each under
``fsync.policy=always`` and ``interval`` (a topic each), alternated with the other rows. Beside
them, the **floors, measured in the same run**: a 4 KiB append + ``fdatasync`` on the agents'
disk, an empty request (``ApiVersions``) through an agent and back, and one 1-record acks=1
produce under ``interval`` through an agent and back, each closed-loop, p50 and p99.

**Soak** (``--soak-minutes N``): acks=all, RF 3, keyed, 2,000 msgs/s, tiering on (segments of
8 MiB uploaded to moto, local retention 0), for N minutes. Producer and consumer report every
gap over 100 ms between consecutive acknowledgements (while sends were outstanding) or between
consecutive deliveries, with its time; the report lists each gap with the agents' log lines
from 1 s before it to its end (segment rolls and uploads, ZooKeeper, ISR changes, and the
agents' own ``event loop stalled`` lines).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from hdrh.histogram import HdrHistogram

from bench.common import publish, settle_writeback
from infra.agents import AgentProcess, start_agent
from infra.local import s3_client, s3_env
from infra.moto_s3 import start_moto
from infra.zookeeper import start_zookeeper
from sdk import Consumer, Producer
from sdk.connection import Connection
from storage.metadata import AsyncZooKeeper, MetadataStore, TopicSpec
from storage.protocol.messages import ApiVersionsRequest

ROOT = Path(__file__).resolve().parent.parent
PARTITIONS = 6
SIZE = 1024
GAP_NS = 100_000_000
"""A gap in acks or deliveries at least this long is reported by the soak."""
SOAK_RATE = 2_000
BUCKET = "strata-latency"
ROWS = (("1", 1, 1_000), ("1", 1, 10_000), ("all", 3, 1_000), ("all", 3, 10_000))
#: the e2e rows run under each of these ``fsync.policy`` values (a topic each): ``always``, the
#: default (every in-sync replica's fsync before an ack), and ``interval`` (Kafka's model:
#: acks=all = in the memory of every in-sync replica; on disk within ``wal.fsync.interval.ms``)
E2E_POLICIES = ("always", "interval")
#: produce->ack with the producer alone (#27): (acks, replication factor, fsync.policy)
ACK_ROWS = (("1", 1, "always"), ("1", 1, "interval"), ("all", 3, "always"), ("all", 3, "interval"))
ACK_RATE = 1_000
ACK_TARGET_MS = {"1": 1.0, "all": 5.0}
FLOOR_SAMPLES = 2_000
DOCS_IMG = ROOT / "docs" / "img"


def _histogram() -> HdrHistogram:
    return HdrHistogram(1, 60_000_000, 3)  # microseconds


def _summary(h: HdrHistogram) -> dict[str, float]:
    return {
        "count": h.get_total_count(),
        "p50_ms": h.get_value_at_percentile(50) / 1000,
        "p99_ms": h.get_value_at_percentile(99) / 1000,
        "p999_ms": h.get_value_at_percentile(99.9) / 1000,
        "max_ms": h.get_max_value() / 1000,
    }


# ---------------------------------------------------------------- the two roles


async def _produce(args: argparse.Namespace) -> dict[str, Any]:
    acks: int | str = "all" if args.acks == "all" else int(args.acks)
    config = {
        "bootstrap.servers": args.bootstrap,
        "acks": acks,
        "linger.ms": 0,
        "enable.idempotence": acks == "all",
    }
    acked = _histogram()
    gaps: list[dict[str, Any]] = []
    last_ack = [0]
    outstanding = [0]

    def done(sent: int, fut: asyncio.Future[Any]) -> None:
        now = time.monotonic_ns()
        outstanding[0] -= 1
        if fut.exception() is None:
            acked.record_value(max(1, (now - sent) // 1000))
        if last_ack[0] and now - last_ack[0] >= GAP_NS and args.gaps:
            gaps.append({"kind": "ack", "end_wall": time.time(), "ms": (now - last_ack[0]) / 1e6})
        last_ack[0] = now

    async with Producer(config) as producer:
        await producer.partitions_for(args.topic)
        total = int(args.rate * args.seconds)
        interval = 1e9 / args.rate
        pad = os.urandom(SIZE - 8)
        start = time.monotonic_ns() + 200_000_000  # the consumer is polling by then
        futures = []
        for i in range(total):
            pause = (start + i * interval - time.monotonic_ns()) / 1e9
            if pause > 0:
                await asyncio.sleep(pause)
            sent = time.monotonic_ns()
            if not outstanding[0]:
                last_ack[0] = sent  # nothing was owed before: no gap runs over idle time
            outstanding[0] += 1
            key = b"k%d" % (i % 64) if args.keyed else None
            fut = await producer.send(
                args.topic,
                sent.to_bytes(8, "big") + pad,
                key=key,
                partition=None if args.keyed else i % PARTITIONS,
            )
            fut.add_done_callback(functools.partial(done, sent))
            futures.append(fut)
            if len(futures) >= 10_000:
                await asyncio.gather(*futures[:5_000], return_exceptions=True)
                del futures[:5_000]
        await asyncio.gather(*futures, return_exceptions=True)
    return {"ack": acked.encode().decode(), "gaps": gaps, "sent": total}


async def _consume(args: argparse.Namespace) -> dict[str, Any]:
    config = {
        "bootstrap.servers": args.bootstrap,
        "auto.offset.reset": "latest",
        "fetch.max.wait.ms": 500,
    }
    e2e = _histogram()
    gaps: list[dict[str, Any]] = []
    expected = int(args.rate * args.seconds)
    got = 0
    last = 0
    async with Consumer(config) as consumer:
        consumer.assign([(args.topic, p) for p in range(PARTITIONS)])
        for p in range(PARTITIONS):
            await consumer.position((args.topic, p))  # at the end before the producer starts
        print(json.dumps({"ready": True}), flush=True)
        deadline = time.monotonic() + args.seconds + 60
        while got < expected and time.monotonic() < deadline:
            batches = await consumer.getmany_arrow(timeout_ms=1000)
            now = time.monotonic_ns()
            for table in batches.values():
                for value in table.column("value").to_pylist():
                    e2e.record_value(max(1, (now - int.from_bytes(value[:8], "big")) // 1000))
                got += table.num_rows
            if batches:
                if last and now - last >= GAP_NS and args.gaps:
                    gaps.append(
                        {"kind": "delivery", "end_wall": time.time(), "ms": (now - last) / 1e6}
                    )
                last = now
    return {"e2e": e2e.encode().decode(), "gaps": gaps, "received": got}


def _role_main(args: argparse.Namespace) -> int:
    run = _produce if args.role == "producer" else _consume
    print(json.dumps({"result": asyncio.run(run(args))}), flush=True)
    return 0


# ---------------------------------------------------------------- the driver


def _role(
    role: str,
    bootstrap: str,
    topic: str,
    acks: str,
    rate: int,
    seconds: float,
    *,
    keyed: bool = False,
    gaps: bool = False,
) -> subprocess.Popen[str]:
    argv = [
        sys.executable, "-m", "bench.latency_bench", "--role", role, "--bootstrap", bootstrap,
        "--topic", topic, "--acks", acks, "--rate", str(rate), "--seconds", str(seconds),
    ]  # fmt: skip
    if keyed:
        argv.append("--keyed")
    if gaps:
        argv.append("--gaps")
    return subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, text=True)


def _result(proc: subprocess.Popen[str], timeout: float) -> dict[str, Any]:
    out, _ = proc.communicate(timeout=timeout)
    for line in out.splitlines():
        if line.startswith('{"result"'):
            result: dict[str, Any] = json.loads(line)["result"]
            return result
    raise RuntimeError(f"{proc.args!r} printed no result (exit {proc.returncode})")


def run_row(
    bootstrap: str, topic: str, acks: str, rate: int, seconds: float, **kw: bool
) -> dict[str, Any]:
    consumer = _role("consumer", bootstrap, topic, acks, rate, seconds, **kw)
    assert consumer.stdout is not None
    ready = consumer.stdout.readline()  # the consumer is at the end of every partition
    if '"ready"' not in ready:
        raise RuntimeError(f"the consumer did not start: {ready!r}")
    producer = _role("producer", bootstrap, topic, acks, rate, seconds, **kw)
    timeout = seconds + 120
    prod = _result(producer, timeout)
    cons = _result(consumer, timeout)
    return {"producer": prod, "consumer": cons}


async def _create(connect: str, name: str, rf: int, configs: dict[str, Any]) -> None:
    zk = AsyncZooKeeper(connect)
    await zk.start()
    try:
        spec = TopicSpec.build(
            name=name, partitions=PARTITIONS, replication_factor=rf, config=configs,
            topic_id=uuid.uuid4().hex, created_ms=int(time.time() * 1000),
        )  # fmt: skip
        await MetadataStore(zk).create_topic(spec)
    finally:
        await zk.stop()


async def _warm(bootstrap: str, topic: str) -> None:
    async with Producer({"bootstrap.servers": bootstrap, "acks": "all"}) as producer:
        await producer.partitions_for(topic)
        for p in range(PARTITIONS):
            await producer.send_and_wait(topic, b"warm-up", partition=p)


def _ms(samples_ns: list[int]) -> dict[str, float]:
    h = _histogram()
    for ns in samples_ns:
        h.record_value(max(1, ns // 1000))
    summary = _summary(h)
    return {"p50_ms": summary["p50_ms"], "p99_ms": summary["p99_ms"]}


def disk_floor(directory: Path, n: int = FLOOR_SAMPLES) -> dict[str, float]:
    """4 KiB appends, each followed by ``fdatasync``: what one acknowledged write under
    ``always`` costs the disk, before any Python."""
    path = directory / f"floor-{os.getpid()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    block, took = os.urandom(4096), []
    try:
        for i in range(n):
            t = time.perf_counter_ns()
            os.pwrite(fd, block, i * len(block))
            os.fdatasync(fd)
            took.append(time.perf_counter_ns() - t)
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)
    return _ms(took)


async def round_trip_floors(address: str, topic: str, n: int = FLOOR_SAMPLES) -> dict[str, Any]:
    """Closed loops through one agent: an empty request (``ApiVersions``: framing, the
    server's request path and two loopback hops, no work) and a 1-record acks=1 produce."""
    host, port = address.rsplit(":", 1)
    conn = Connection(host, int(port))
    await conn.connect()
    try:
        took = []
        for i in range(n + 100):
            t = time.perf_counter_ns()
            await conn.request(ApiVersionsRequest())
            if i >= 100:  # warm-up
                took.append(time.perf_counter_ns() - t)
        empty = _ms(took)
    finally:
        await conn.close()
    return {"empty": empty, "produce": await _closed_loop(address, topic, 1, n)}


async def _closed_loop(bootstrap: str, topic: str, acks: int | str, n: int) -> dict[str, float]:
    """One record at a time to partition 0, each sent once the previous one is acknowledged."""
    config = {"bootstrap.servers": bootstrap, "acks": acks, "linger.ms": 0}
    async with Producer(config) as producer:
        value, took = os.urandom(SIZE), []
        for i in range(n + 100):
            t = time.perf_counter_ns()
            await producer.send_and_wait(topic, value, partition=0)
            if i >= 100:  # warm-up
                took.append(time.perf_counter_ns() - t)
    return _ms(took)


def _ack_topic(rf: int, policy: str) -> str:
    return f"ack-rf{rf}-{policy}"


def run_ack_row(bootstrap: str, acks: str, rf: int, policy: str, seconds: float) -> dict[str, Any]:
    producer = _role("producer", bootstrap, _ack_topic(rf, policy), acks, ACK_RATE, seconds)
    return {"producer": _result(producer, seconds + 120)}


async def _floors_via_leader(
    connect: str, agents: list[AgentProcess], fallback: str
) -> dict[str, Any]:
    """The round-trip floors through the agent that leads partition 0 of the acks=1
    ``interval`` topic (the produce loop writes there)."""
    zk = AsyncZooKeeper(connect)
    await zk.start()
    try:
        found = await MetadataStore(zk).get_partition_state(_ack_topic(1, "interval"), 0)
    finally:
        await zk.stop()
    led_by = found[0].leader if found is not None else None
    leader = next((a.address for a in agents if a.agent_id == led_by), fallback)
    floors = await round_trip_floors(leader, _ack_topic(1, "interval"))
    bootstrap = ",".join(a.address for a in agents)
    floors["produce_all"] = await _closed_loop(
        bootstrap, _ack_topic(3, "interval"), "all", FLOOR_SAMPLES // 2
    )
    return floors


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _decode(text: str) -> HdrHistogram:
    return HdrHistogram.decode(text.encode())


def _median_row(runs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    summaries = [
        _summary(_decode(r["producer"]["ack"] if kind == "ack" else r["consumer"]["e2e"]))
        for r in runs
    ]
    out: dict[str, Any] = {}
    for field in ("p50_ms", "p99_ms", "p999_ms", "max_ms"):
        values = [s[field] for s in summaries]
        out[field] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
    return out


def _plot(curves: dict[str, HdrHistogram], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for label, h in curves.items():
        xs, ys = [], []
        for item in h.get_percentile_iterator(5):
            p = item.percentile_level_iterated_to
            if p >= 100:
                break
            xs.append(1 / (1 - p / 100))
            ys.append(item.value_iterated_to / 1000)
        ax.plot(xs, ys, label=label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ticks = [1, 2, 10, 100, 1000, 10000]
    ax.set_xticks(ticks, ["0%", "50%", "90%", "99%", "99.9%", "99.99%"])
    ax.set_xlabel("percentile")
    ax.set_ylabel("end-to-end latency (ms)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


#: #31's end-to-end targets at 1,000 msgs/s: acks -> (p99 ms, max ms)
E2E_TARGET_MS = {"1": (5.0, 50.0), "all": (10.0, 100.0)}


def _e2e_verdicts(r: dict[str, Any]) -> list[str]:
    out = []
    for row in r["rows"]:
        if row["rate"] != 1_000:
            continue
        p99, top = row["e2e"]["p99_ms"]["median"], row["e2e"]["max_ms"]["median"]
        t99, tmax = E2E_TARGET_MS[row["acks"]]
        met = p99 <= t99 and top <= tmax
        out.append(
            f"acks={row['acks']} `{row['policy']}` p99 {p99:.2f} ms (≤ {t99:g}), max {top:.2f} ms"
            f" (≤ {tmax:g}): {'met' if met else '**missed**'}"
        )
    return out


def _fmt(cell: dict[str, float]) -> str:
    return f"{cell['median']:.2f} ({cell['min']:.2f}-{cell['max']:.2f})"


def render(r: dict[str, Any]) -> str:
    rows = []
    for row in r["rows"]:
        for kind in ("e2e", "ack"):
            c = row[kind]
            rows.append(
                f"| acks={row['acks']}, RF {row['rf']} | `{row['policy']}` | {row['rate']:,} | {kind} |"
                f" {_fmt(c['p50_ms'])} | {_fmt(c['p99_ms'])} | {_fmt(c['p999_ms'])} | {_fmt(c['max_ms'])} |"
            )
    lines = [
        "<!-- latency-bench:begin (generated by `make bench-latency`; do not edit by hand) -->",
        f"Measured {r['date']} on {r['machine']} with `{r['command']}`: acks=1 on a cluster of"
        " one agent, acks=all on one of three (both running throughout, one idle while the other"
        f" works), {PARTITIONS} partitions, 1 KiB values, `linger.ms=0`, producer and consumer in separate"
        f" processes (the consumer long-polls all partitions, `fetch.max.wait.ms=500`),"
        f" {r['seconds']:g} s per run, a topic per `fsync.policy` (`always` is the default)."
        f" Each cell: median of {r['runs']} alternated runs (min-max), milliseconds. *e2e*: send → the consumer holds"
        " the record; *ack*: send → acknowledgement.",
        "",
        "| setup | `fsync.policy` | msgs/s | path | p50 | p99 | p99.9 | max |",
        "|---|---|---:|---|---:|---:|---:|---:|",
        *rows,
        "",
        "#31's targets (e2e at 1,000 msgs/s, medians): " + "; ".join(_e2e_verdicts(r)) + ".",
        "",
        "![End-to-end latency by percentile](img/latency-cdf.png)",
    ]
    if not r["rows"]:
        lines = lines[:1]
    lines += _render_ack_alone(r)
    if "soak" in r:
        s = r["soak"]
        lines += [
            "",
            f"Soak: {s['minutes']:g} min, acks=all, RF 3, keyed, {SOAK_RATE:,} msgs/s, tiering on:"
            f" {s['sent']:,} sent, {s['received']:,} received; gaps ≥ 100 ms: {len(s['gaps'])}"
            + (" (longest " + f"{max(g['ms'] for g in s['gaps']):.0f} ms)" if s["gaps"] else "")
            + f"; end-to-end p99 {s['e2e']['p99_ms']:.2f} ms, max {s['e2e']['max_ms']:.2f} ms.",
        ]
    lines.append("<!-- latency-bench:end -->")
    return "\n".join(lines)


def _render_ack_alone(r: dict[str, Any]) -> list[str]:
    rows, verdicts = [], []
    for row in r.get("ack_rows", []):
        c = row["ack"]
        rows.append(
            f"| acks={row['acks']}, RF {row['rf']} | `{row['policy']}` | {_fmt(c['p50_ms'])} |"
            f" {_fmt(c['p99_ms'])} | {_fmt(c['p999_ms'])} | {_fmt(c['max_ms'])} |"
        )
        target = ACK_TARGET_MS[row["acks"]]
        p99 = c["p99_ms"]["median"]
        verdicts.append(
            f"acks={row['acks']} `{row['policy']}` p99 {p99:.2f} ms against ≤ {target:g} ms:"
            f" {'met' if p99 <= target else '**missed**'}"
        )
    if not rows:
        return []
    f = r["floors"]

    def floor(what: str) -> str:
        return f"p50 {_fmt(f[what]['p50_ms'])}, p99 {_fmt(f[what]['p99_ms'])} ms"

    return [
        "",
        f"**Produce→ack with the producer alone** (#27): {ACK_RATE:,} msgs/s of 1 KiB,"
        " `linger.ms=0`, the producer process the only client; a topic per row, 6 partitions"
        f" over the three agents. Median of {r['runs']} alternated runs (min-max), ms.",
        "",
        "| setup | `fsync.policy` | p50 | p99 | p99.9 | max |",
        "|---|---|---:|---:|---:|---:|",
        *rows,
        "",
        "Targets: " + "; ".join(verdicts) + ".",
        "",
        f"**Floors, measured in the same run** (closed loops of {FLOOR_SAMPLES:,} requests, median"
        " of the runs (min-max)):",
        f"* 4 KiB append + `fdatasync` on the agents' disk: {floor('disk')};",
        "* an empty request (`ApiVersions`) through an agent and back, over loopback:"
        f" {floor('empty')};",
        "* a 1-record acks=1 produce through an agent and back (`interval`, nothing else"
        f" running): {floor('produce')};",
        "* a 1-record acks=all produce on replication factor 3, one at a time (`interval`:"
        " the leader's append, both followers' fetch and next fetch, the high watermark):"
        f" {floor('produce_all')}.",
    ]


def _agent_lines(agents: list[AgentProcess], start: float, end: float) -> list[str]:
    out = []
    for a in agents:
        for line in a.log_path.read_text(errors="replace").splitlines():
            try:
                rec = json.loads(line)
                ts = time.mktime(time.strptime(rec["ts"].split(",")[0], "%Y-%m-%d %H:%M:%S"))
            except (ValueError, KeyError, TypeError):
                continue
            if start - 1 <= ts <= end + 1:
                out.append(f"agent {a.agent_id}: {rec.get('msg', '')[:160]}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Strata end-to-end latency benchmark")
    parser.add_argument("--role", choices=["producer", "consumer"])
    parser.add_argument("--bootstrap")
    parser.add_argument("--topic")
    parser.add_argument("--acks", default="1")
    parser.add_argument("--rate", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--keyed", action="store_true")
    parser.add_argument("--gaps", action="store_true")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--soak-minutes", type=float, default=0.0)
    parser.add_argument("--dir", type=Path, default=ROOT / "var" / "bench")
    parser.add_argument("--write-docs", action="store_true")
    parser.add_argument(
        "--skip-e2e", action="store_true", help="only produce->ack alone and the floors"
    )
    parser.add_argument(
        "--fsync-policies",
        default=",".join(E2E_POLICIES),
        help="the e2e rows' topics' fsync.policy values, comma-separated",
    )
    parser.add_argument("--skip-alone", action="store_true", help="no produce->ack alone rows")
    args = parser.parse_args(argv)
    if args.role:
        return _role_main(args)

    args.dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=args.dir))
    zk = start_zookeeper(work / "zookeeper")
    moto = start_moto(work / "moto") if args.soak_minutes else None
    agents: list[AgentProcess] = []  # the three-agent cluster
    solo: AgentProcess | None = None  # the one-agent cluster of the acks=1 rows
    try:
        connect = f"{zk.connect_string}/latency"
        env: dict[str, str] | None = None
        configs: dict[str, object] | None = None
        if moto is not None:
            s3_client(moto.endpoint_url).create_bucket(Bucket=BUCKET)
            env = s3_env(moto.endpoint_url, BUCKET)
            configs = {"s3.bucket": BUCKET, "s3.endpoint.url": moto.endpoint_url}
        agents = [
            start_agent(i, connect, work / f"agent-{i}", configs=configs, env=env)
            for i in (1, 2, 3)
        ]
        bootstrap = ",".join(a.address for a in agents)
        # the acks=1 rows run on a cluster of one agent of their own (#31's setup): the
        # producer and the consumer talk to one agent, as a single-node deployment does
        solo_connect = f"{zk.connect_string}/latency-solo"
        solo = start_agent(4, solo_connect, work / "agent-solo")
        policies = [p for p in args.fsync_policies.split(",") if p]
        e2e_at = {1: (solo_connect, solo.address), 3: (connect, bootstrap)}
        for rf, (where, servers) in e2e_at.items():
            for policy in policies:
                e2e_configs = {"min.insync.replicas": min(rf, 2), "fsync.policy": policy}
                asyncio.run(_create(where, f"latency-rf{rf}-{policy}", rf, e2e_configs))
                asyncio.run(_warm(servers, f"latency-rf{rf}-{policy}"))
        for _, rf, policy in ACK_ROWS:
            name = _ack_topic(rf, policy)
            topic_configs = {"min.insync.replicas": min(rf, 2), "fsync.policy": policy}
            asyncio.run(_create(connect, name, rf, topic_configs))
            asyncio.run(_warm(bootstrap, name))
        results: dict[tuple[str, int, int, str], list[dict[str, Any]]] = {
            (*row, policy): [] for policy in policies for row in ROWS
        }
        acked: dict[tuple[str, int, str], list[dict[str, Any]]] = {row: [] for row in ACK_ROWS}
        floors: list[dict[str, Any]] = []
        for _ in range(args.runs):
            settle_writeback(args.dir)
            floor = {"disk": disk_floor(args.dir)}
            floor.update(asyncio.run(_floors_via_leader(connect, agents, agents[0].address)))
            floors.append(floor)
            for acks, rf, rate, policy in () if args.skip_e2e else list(results):
                settle_writeback(args.dir)
                topic = f"latency-rf{rf}-{policy}"
                results[(acks, rf, rate, policy)].append(
                    run_row(e2e_at[rf][1], topic, acks, rate, args.seconds)
                )
                print(f"acks={acks} RF {rf} {rate}/s {policy} done", file=sys.stderr)
            for acks, rf, policy in () if args.skip_alone else ACK_ROWS:
                settle_writeback(args.dir)
                acked[(acks, rf, policy)].append(
                    run_ack_row(bootstrap, acks, rf, policy, args.seconds)
                )
                print(f"alone: acks={acks} RF {rf} {policy} done", file=sys.stderr)
        report: dict[str, Any] = {
            "date": time.strftime("%Y-%m-%d"),
            "machine": f"{os.cpu_count()} cores, {platform.machine()}, Python {platform.python_version()}",
            "command": "make bench-latency",
            "seconds": args.seconds,
            "runs": args.runs,
            "rows": [
                {
                    "acks": acks,
                    "rf": rf,
                    "rate": rate,
                    "policy": policy,
                    "e2e": _median_row(runs, "e2e"),
                    "ack": _median_row(runs, "ack"),
                }
                for (acks, rf, rate, policy), runs in results.items()
                if runs
            ],
            "ack_rows": [
                {"acks": acks, "rf": rf, "policy": policy, "ack": _median_row(runs, "ack")}
                for (acks, rf, policy), runs in acked.items()
                if runs
            ],
            "floors": {
                what: {q: _spread([f[what][q] for f in floors]) for q in ("p50_ms", "p99_ms")}
                for what in ("disk", "empty", "produce", "produce_all")
            },
        }
        curves = {}
        for (acks, rf, rate, policy), runs in results.items() if not args.skip_e2e else ():
            merged = _histogram()
            for r in runs:
                merged.add(_decode(r["consumer"]["e2e"]))
            curves[f"acks={acks}, RF {rf}, {rate:,}/s, {policy}"] = merged
        if curves:
            _plot(curves, DOCS_IMG / "latency-cdf.png" if args.write_docs else work / "cdf.png")
        if args.soak_minutes:
            report["soak"] = soak(connect, bootstrap, agents, args.soak_minutes)
    finally:
        for a in [*agents, *([solo] if solo is not None else [])]:
            a.stop()
        if moto is not None:
            moto.stop()
        zk.stop()
        shutil.rmtree(work, ignore_errors=True)
    publish("latency", render(report), report, write_docs=args.write_docs)
    if "soak" in report:
        for gap in report["soak"]["gaps"]:
            print(
                f"\ngap of {gap['ms']:.0f} ms in {gap['kind']}s ending {time.ctime(gap['end_wall'])}"
            )
            for line in gap["agents"]:
                print("  " + line)
    return 0


def soak(
    connect: str, bootstrap: str, agents: list[AgentProcess], minutes: float
) -> dict[str, Any]:
    topic = "latency-soak"
    configs = {
        "min.insync.replicas": 2,
        "segment.bytes": 8 << 20,
        "local.retention.ms": 0,
    }
    asyncio.run(_create(connect, topic, 3, configs))
    asyncio.run(_warm(bootstrap, topic))
    seconds = minutes * 60
    r = run_row(bootstrap, topic, "all", SOAK_RATE, seconds, keyed=True, gaps=True)
    gaps = r["producer"]["gaps"] + r["consumer"]["gaps"]
    for gap in gaps:
        gap["agents"] = _agent_lines(agents, gap["end_wall"] - gap["ms"] / 1000, gap["end_wall"])
    return {
        "minutes": minutes,
        "sent": r["producer"]["sent"],
        "received": r["consumer"]["received"],
        "gaps": sorted(gaps, key=lambda g: g["end_wall"]),
        "e2e": _summary(_decode(r["consumer"]["e2e"])),
        "ack": _summary(_decode(r["producer"]["ack"])),
    }


if __name__ == "__main__":
    raise SystemExit(main())
