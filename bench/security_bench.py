"""TLS + SCRAM vs plaintext: the same produce and consume load through a PLAINTEXT agent and a
SASL_SSL agent (TLS, SCRAM-SHA-512), in the same run.

Run with ``make bench-security`` (``python -m bench.security_bench [--write-docs]``). One
ZooKeeper, two single-agent clusters on it (chroots ``/plain`` and ``/secure``), both running
for the whole run, on the same disk, with the same settings but one:

* ``plaintext``: ``listener.security.protocol=PLAINTEXT``, clients anonymous;
* ``secured``: ``listener.security.protocol=SASL_SSL``: a certificate from a throwaway CA
  (``infra/certs.py``), a SCRAM user created in that cluster's ZooKeeper as the tests do, the
  SDK logging in with SCRAM-SHA-512 over TLS (the client verifies the agent's certificate).

Two agents rather than one agent restarted per protocol: both stay warm, and the one not under
load sits idle, for either side alike. For each round and each topic layout (``--partitions``,
fresh topics for every run), each side in turn — the order alternating from round to round
(plaintext first, then secured first, ...) so drift on a busy machine falls on both — does:

* **produce**: 1 KiB values through the SDK's ``send_batch`` (1,000 records per call, acks=1,
  linger 5 ms, 1 MiB batches, the default ``fsync.policy=always``) for ``--seconds``, then
  ``flush``; msgs/s and MB/s from the first send to the last acknowledgement;
* **consume**: one consumer reads those records back from the beginning, once through
  ``getmany_arrow`` (Arrow tables) and once through ``getmany`` (a record object each); msgs/s.

The disk is settled (``bench.common.settle_writeback``) before every produce. Each figure is
the median of the rounds with its range; each ratio (secured ÷ plaintext) is taken within a
round and the median of those reported. Beside each, the agent's CPU time per message over the
run (``/proc/<pid>/stat``) and the client's (this process's ``time.process_time``), which a
loaded machine blurs less than it blurs rates.

``--profile DIR``: in the first round, py-spy (``make bench-venv``) samples the agent and this
process during every measured run (raw stacks in ``DIR/<side>-p<N>-<measure>-<agent|client>.txt``)
and a summary says where each event loop spends its busy time: in OpenSSL (``SSLObject.read``
and ``write``), in asyncio's TLS protocol around it (``asyncio/sslproto.py``), in socket sends
and receives, or elsewhere. Sampling slows what it samples: a profiled run's rates are not
the ones to publish.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.common import cpu_seconds, create_topic, publish, settle_writeback, spread
from bench.kafka_bench import sdk_consume
from infra.agents import AgentProcess, start_agent
from infra.certs import ThrowawayCA
from infra.zookeeper import start_zookeeper
from sdk import Producer
from storage.metadata import AsyncZooKeeper
from storage.metadata.users import ScramCredential, UserStore

ROOT = Path(__file__).resolve().parent.parent
SIDES = ("plaintext", "secured")
MEASURES = ("produce", "consume_arrow", "consume")
USER, PASSWORD = "bench", "bench-secret-4c1e"
MECHANISM = "SCRAM-SHA-512"
CHUNK = 1000
#: the time a fresh topic's leader gets to be elected before the rounds start
LEADERS_DEADLINE_S = 30.0


async def add_user(zk_connect: str, name: str, password: str) -> None:
    """Create SCRAM user ``name`` in the cluster's ZooKeeper (salted verifiers, both
    mechanisms), as ``Admin.set_user`` would."""
    zk = AsyncZooKeeper(zk_connect)
    await zk.start()
    try:
        store = UserStore(zk)
        for mech in ("SCRAM-SHA-256", "SCRAM-SHA-512"):
            cred = await asyncio.to_thread(ScramCredential.make, mech, password)
            await store.set(name, mech, cred)
    finally:
        await zk.stop()


async def produce_for(
    bootstrap: str, topic: str, seconds: float, value: bytes, security: Mapping[str, Any]
) -> dict[str, float]:
    """``send_batch`` ``CHUNK`` values at a time for ``seconds``, then ``flush``; every record
    must be acknowledged."""
    config = {
        **security,
        "bootstrap.servers": bootstrap,
        "acks": 1,
        "linger.ms": 5,
        "batch.size": 1 << 20,
        "max.request.size": 4 << 20,  # a partition's queued batches travel together
        "buffer.memory": 256 << 20,
        "max.in.flight.requests.per.connection": 5,
    }
    chunk = [value] * CHUNK
    async with Producer(config) as producer:
        # connected, logged in and the leaders known before the clock starts, on both sides
        deadline = time.monotonic() + LEADERS_DEADLINE_S
        while True:
            try:
                await (await producer.send_batch(topic, chunk[:1]))
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.1)
        futures = []
        start = time.perf_counter()
        stop = start + seconds
        while time.perf_counter() < stop:
            futures.append(await producer.send_batch(topic, chunk))
        await producer.flush()
        elapsed = time.perf_counter() - start
    acked = sum(r.record_count for f in futures for r in f.result())
    sent = len(futures) * CHUNK
    if acked != sent:
        raise RuntimeError(f"{acked} records acknowledged of {sent}")
    return {
        "messages": sent,
        "seconds": elapsed,
        "msgs_per_s": sent / elapsed,
        "mb_per_s": sent * len(value) / 1e6 / elapsed,
    }


def _client_security(side: str, ca: ThrowawayCA) -> dict[str, Any]:
    if side == "plaintext":
        return {}
    return {
        "security.protocol": "SASL_SSL",
        "ssl.cafile": str(ca.cafile),
        "sasl.mechanism": MECHANISM,
        "sasl.username": USER,
        "sasl.password": PASSWORD,
    }


def _agent_configs(side: str, ca: ThrowawayCA) -> dict[str, object]:
    if side == "plaintext":
        return {"listener.security.protocol": "PLAINTEXT"}
    issued = ca.issue("agent")
    return {
        "listener.security.protocol": "SASL_SSL",
        "ssl.certfile": issued.certfile,
        "ssl.keyfile": issued.keyfile,
        "ssl.cafile": ca.cafile,
        "sasl.enabled.mechanisms": MECHANISM,
    }


@contextmanager
def sampled(pid: int, out: Path | None) -> Iterator[None]:
    """py-spy samples process ``pid`` (raw stacks to ``out``) while the block runs."""
    if out is None:
        yield
        return
    pyspy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or "py-spy"
    argv = [pyspy, "record", "-r", "200", "--format", "raw", "-o", str(out), "-p", str(pid)]
    spy = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.5)  # attached before the run starts
    try:
        yield
    finally:
        spy.send_signal(signal.SIGINT)  # py-spy writes its output, then exits
        spy.wait(timeout=30)


#: where an event loop's busy samples fall, by the innermost frame and the frames around it
CATEGORIES = (
    ("OpenSSL decrypt (SSLObject.read)", lambda leaf, _: leaf.startswith("SSLObject.read ")),
    ("OpenSSL encrypt (SSLObject.write)", lambda leaf, _: leaf.startswith("SSLObject.write ")),
    ("asyncio sslproto.py around it", lambda _, stack: "asyncio/sslproto.py" in stack),
    (
        "socket send/recv",
        lambda leaf, _: "_SelectorSocketTransport" in leaf or "_send_direct" in leaf,
    ),
)


def summarize(path: Path) -> dict[str, float]:
    """Share of the main thread's busy samples (not waiting in ``select``) per category."""
    counts: collections.Counter[str] = collections.Counter()
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        frames = [re.sub(r":\d+\)$", ")", f) for f in stack.split(";")]
        if not frames or not frames[0].startswith("_run_module_as_main"):
            continue  # another thread (fsync workers, the SDK's helpers)
        leaf = frames[-1]
        if leaf.startswith("EpollSelector.select ") or "settle_writeback" in stack:
            continue
        cat = next((name for name, hit in CATEGORIES if hit(leaf, stack)), "everything else")
        counts[cat] += int(n)
        counts["busy samples"] += int(n)
    busy = counts.pop("busy samples", 0)
    return {"busy samples": busy, **{k: 100 * v / max(busy, 1) for k, v in counts.items()}}


def _ratio(a: list[float], b: list[float]) -> dict[str, float]:
    return spread([x / y for x, y in zip(a, b, strict=True)])


def render(r: dict[str, Any]) -> str:
    names = {
        "produce": "produce, `send_batch`",
        "consume_arrow": "consume, `getmany_arrow`",
        "consume": "consume, `getmany`",
    }

    def rate(s: dict[str, float], mb: dict[str, float] | None) -> str:
        text = f"**{s['median']:,.0f}** ({s['min']:,.0f}-{s['max']:,.0f})"
        return text + (f", {mb['median']:.0f} MB/s" if mb is not None else "")

    lines = [
        "<!-- security-bench:begin (generated by `make bench-security`; do not edit by hand) -->",
        f"Measured {r['date']} on {r['machine']} with `{r['command']}`: one agent per protocol,"
        f" {r['size']} B values, acks=1, `fsync.policy=always`, {r['seconds']:g} s of produce"
        f" per run, {r['rounds']} rounds alternating which side goes first; msgs/s median"
        " (range), ratio = median of the per-round ratios (range).",
        "",
        "| partitions | measure | PLAINTEXT msgs/s | SASL_SSL + SCRAM-SHA-512 msgs/s |"
        " secured ÷ plaintext | CPU µs/msg, agent: plain → secured | client: plain → secured |"
        " CPU/msg plain ÷ secured |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    worst = float("inf")
    for layout in r["layouts"]:
        p = layout["partitions"]
        for m in MEASURES:
            plain, sec = layout["plaintext"][m], layout["secured"][m]
            ratio, cpu, ccpu = layout["ratio"][m], layout["agent_cpu_us"], layout["client_cpu_us"]
            worst = min(worst, ratio["median"])
            mb = m == "produce"
            lines.append(
                f"| {p} | {names[m]} |"
                f" {rate(plain, layout['plaintext']['produce_mb'] if mb else None)} |"
                f" {rate(sec, layout['secured']['produce_mb'] if mb else None)} |"
                f" **{ratio['median']:.2f}x** ({ratio['min']:.2f}-{ratio['max']:.2f}) |"
                f" {cpu['plaintext'][m]['median']:.1f} → {cpu['secured'][m]['median']:.1f} |"
                f" {ccpu['plaintext'][m]['median']:.1f} → {ccpu['secured'][m]['median']:.1f} |"
                f" {layout['cpu_ratio'][m]['median']:.2f}x |"
            )
    ok = "met" if worst >= 0.7 else "**missed**"
    lines += [
        "",
        f"Target secured ≥ 0.7x plaintext: {ok} (lowest median ratio {worst:.2f}x). The last"
        " column is the ratio the rates would show if they followed the CPU time the agent and"
        " the client spend per message (agent + client, plaintext ÷ secured, median of the"
        " rounds): steadier than the rates on a busy machine.",
        "<!-- security-bench:end -->",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="TLS + SCRAM vs plaintext throughput")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=3.0, help="produce time per run")
    parser.add_argument("--partitions", type=int, nargs="+", default=[1, 6])
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--dir", type=Path, default=ROOT / "var" / "bench")
    parser.add_argument("--write-docs", action="store_true")
    parser.add_argument("--profile", type=Path, help="py-spy the first round into this dir")
    args = parser.parse_args(argv)
    args.dir.mkdir(parents=True, exist_ok=True)
    if args.profile is not None:
        args.profile.mkdir(parents=True, exist_ok=True)
    profiles: list[Path] = []

    def spied(pid: int, rnd: int, name: str) -> Any:
        if args.profile is None or rnd > 0:
            return sampled(pid, None)
        profiles.append(args.profile / f"{name}.txt")
        return sampled(pid, profiles[-1])

    def spy(agent_pid: int, rnd: int, name: str) -> Any:
        stack = contextlib.ExitStack()
        stack.enter_context(spied(agent_pid, rnd, f"{name}-agent"))
        stack.enter_context(spied(os.getpid(), rnd, f"{name}-client"))
        return stack

    work = Path(tempfile.mkdtemp(dir=args.dir))
    value = os.urandom(args.size)
    ca = ThrowawayCA.create(work / "ca")
    zk = start_zookeeper(work / "zookeeper")
    agents: dict[str, AgentProcess] = {}
    # samples[partitions][side][measure]: one value per round
    samples: dict[int, dict[str, dict[str, list[float]]]] = {
        p: {s: {m: [] for m in (*MEASURES, "produce_mb")} for s in SIDES} for p in args.partitions
    }
    # CPU time per message over each run, of the agent and of this (the client) process
    cpu_us: dict[int, dict[str, dict[str, list[float]]]] = {
        p: {s: {m: [] for m in MEASURES} for s in SIDES} for p in args.partitions
    }
    client_us: dict[int, dict[str, dict[str, list[float]]]] = {
        p: {s: {m: [] for m in MEASURES} for s in SIDES} for p in args.partitions
    }
    try:
        connect = {side: f"{zk.connect_string}/{side}" for side in SIDES}
        asyncio.run(add_user(connect["secured"], USER, PASSWORD))
        for side in SIDES:
            agents[side] = start_agent(
                1, connect[side], work / side / "agent-1", configs=_agent_configs(side, ca)
            )
        security = {side: _client_security(side, ca) for side in SIDES}

        def topic(side: str, p: int, rnd: int) -> str:
            return f"{side}-p{p}-r{rnd}"

        for rnd in range(args.rounds):
            for p in args.partitions:
                for side in SIDES:
                    asyncio.run(create_topic(connect[side], topic(side, p, rnd), p))
        for rnd in range(args.rounds):
            order = SIDES if rnd % 2 == 0 else SIDES[::-1]
            for p in args.partitions:
                for side in order:
                    agent, t = agents[side], topic(side, p, rnd)
                    settle_writeback(args.dir)
                    with spy(agent.pid, rnd, f"{side}-p{p}-produce"):
                        before, mine = cpu_seconds(agent.pid), time.process_time()
                        prod = asyncio.run(
                            produce_for(agent.address, t, args.seconds, value, security[side])
                        )
                    n = int(prod["messages"])
                    cpu_us[p][side]["produce"].append((cpu_seconds(agent.pid) - before) / n * 1e6)
                    client_us[p][side]["produce"].append((time.process_time() - mine) / n * 1e6)
                    samples[p][side]["produce"].append(prod["msgs_per_s"])
                    samples[p][side]["produce_mb"].append(prod["mb_per_s"])
                    for m, arrow in (("consume_arrow", True), ("consume", False)):
                        with spy(agent.pid, rnd, f"{side}-p{p}-{m}"):
                            before, mine = cpu_seconds(agent.pid), time.process_time()
                            rate = asyncio.run(
                                sdk_consume(agent.address, t, n, arrow, p, security[side])
                            )
                        samples[p][side][m].append(rate)
                        cpu_us[p][side][m].append((cpu_seconds(agent.pid) - before) / n * 1e6)
                        client_us[p][side][m].append((time.process_time() - mine) / n * 1e6)
                print(
                    f"round {rnd + 1}, {p} partition(s):",
                    {s: {m: round(samples[p][s][m][-1]) for m in MEASURES} for s in SIDES},
                    flush=True,
                )
    finally:
        for agent in agents.values():
            agent.stop()
        zk.stop()
        shutil.rmtree(work, ignore_errors=True)

    layouts = []
    for p in args.partitions:
        s, c, cc = samples[p], cpu_us[p], client_us[p]
        layouts.append(
            {
                "partitions": p,
                **{side: {m: spread(v) for m, v in s[side].items()} for side in SIDES},
                "ratio": {m: _ratio(s["secured"][m], s["plaintext"][m]) for m in MEASURES},
                # what the ratio would be if the rate followed the CPU the agent and the client
                # spend per message (a machine where both compete for every core)
                "cpu_ratio": {
                    m: _ratio(
                        [a + b for a, b in zip(c["plaintext"][m], cc["plaintext"][m], strict=True)],
                        [a + b for a, b in zip(c["secured"][m], cc["secured"][m], strict=True)],
                    )
                    for m in MEASURES
                },
                "agent_cpu_us": {
                    side: {m: spread(v) for m, v in c[side].items()} for side in SIDES
                },
                "client_cpu_us": {
                    side: {m: spread(v) for m, v in cc[side].items()} for side in SIDES
                },
            }
        )
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{os.cpu_count()} cores, {platform.machine()}, Python {platform.python_version()}",
        "command": "make bench-security"
        if args.rounds == 3 and args.seconds == 3.0 and args.partitions == [1, 6]
        else "python -m bench.security_bench "
        + f"--rounds {args.rounds} --seconds {args.seconds:g} "
        + f"--partitions {' '.join(map(str, args.partitions))}",
        "size": args.size,
        "rounds": args.rounds,
        "seconds": args.seconds,
        "layouts": layouts,
        "ratio_min_median": min(
            layout["ratio"][m]["median"] for layout in layouts for m in MEASURES
        ),
        "_samples": samples,
        "_agent_cpu_us": cpu_us,
        "_client_cpu_us": client_us,
    }
    publish("security", render(result), result, write_docs=args.write_docs)
    for path in profiles:
        if path.exists():
            shares = summarize(path)
            busy = shares.pop("busy samples")
            print(
                f"{path.stem}: {busy:.0f} busy samples;",
                ", ".join(
                    f"{k} {v:.0f}%" for k, v in sorted(shares.items(), key=lambda kv: -kv[1])
                ),
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
