"""The ``strata`` CLI end to end against the local stack (``strata local up --detach``).

One stack per module (moto, ZooKeeper, 3 agents, the admin runtime) in a temporary state
directory; every test drives the CLI as a user would, in a child process with a deadline.
The last test stops the stack and checks that no process it started is left.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from infra import local
from sdk import Consumer, Producer, TopicPartition
from storage.errors import AuthenticationFailedError
from tests.harness import metric_value, scrape_metrics

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


def strata(
    state_dir: Path, *args: str, stdin: str = "", timeout: float = 60.0, check: bool = True
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STRATA_")}
    result = subprocess.run(
        [sys.executable, "-m", "infra.cli", "--state-dir", str(state_dir), *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=env,
    )
    if check and result.returncode != 0:
        raise AssertionError(
            f"strata {' '.join(args)} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
        )
    return result


def as_json(result: subprocess.CompletedProcess[str]) -> Any:
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict[str, Any]]]:
    state_dir = tmp_path_factory.mktemp("local") / "stack"
    started = time.monotonic()
    try:
        up = strata(state_dir, "-o", "json", "local", "up", "--detach", timeout=90)
        took = time.monotonic() - started
        yield state_dir, as_json(up) | {"measured_s": took}
    finally:
        local.down(state_dir)


def test_up_detach_is_healthy_and_status_shows_every_component(
    stack: tuple[Path, dict[str, Any]],
) -> None:
    state_dir, up = stack
    # how fast is a figure for docs/operations.md, not an assertion: `up` must come back
    # healthy within its own deadline (90 s), whatever the machine's load
    assert up["status"] == "healthy", up
    print(f"strata local up --detach: healthy after {up['measured_s']:.1f} s")
    status = as_json(strata(state_dir, "-o", "json", "local", "status"))
    names = [c["name"] for c in status["components"]]
    assert names == [
        "s3 (moto)",
        "zookeeper",
        "agent 1",
        "agent 2",
        "agent 3",
        "admin api",
        "delay scheduler",
    ]
    assert status["healthy"] and all(c["healthy"] for c in status["components"]), status
    text = strata(state_dir, "local", "status").stdout
    assert "agent 3" in text and "DOWN" not in text
    delays = as_json(strata(state_dir, "-o", "json", "delays", "status"))
    assert len(delays["levels"]) == 29 and delays["pending"] == 0, delays
    bad = strata(state_dir, "delays", "cancel", "not-an-id", check=False)
    assert bad.returncode == 1 and "InvalidDelayError" in bad.stderr, bad.stderr


def test_topics_produce_consume_group_reset(stack: tuple[Path, dict[str, Any]]) -> None:
    state_dir, _ = stack
    created = as_json(strata(state_dir, "-o", "json", "topics", "create", "cli", "-p", "3"))
    assert created["partitions"] == 3 and created["replication_factor"] == 3
    assert "cli" in as_json(strata(state_dir, "-o", "json", "topics", "list"))["topics"]
    bad = strata(state_dir, "topics", "create", "bad/name", check=False)
    assert bad.returncode == 1 and bad.stderr.startswith("error:"), bad.stderr

    lines = "".join(f"message {i}\n" for i in range(1000))
    produced = as_json(strata(state_dir, "-o", "json", "produce", "cli", stdin=lines))
    assert produced["messages"] == 1000
    jsonl = "".join(
        json.dumps({"value": {"n": i}, "key": f"k{i % 7}", "headers": {"h": "v"}, "tags": ["t"]})
        + "\n"
        for i in range(200)
    )
    assert (
        as_json(strata(state_dir, "-o", "json", "produce", "cli", "--json", stdin=jsonl))[
            "messages"
        ]
        == 200
    )

    everything = strata(state_dir, "-o", "json", "consume", "cli").stdout.splitlines()
    records = [json.loads(line) for line in everything]
    assert len(records) == 1200
    assert sorted(r["value"] for r in records if r["value"].startswith("message")) == sorted(
        f"message {i}" for i in range(1000)
    )
    tagged = [r for r in records if r["tags"] == ["t"]]
    assert len(tagged) == 200 and all(r["headers"] == {"h": "v"} for r in tagged)

    # a group reads everything once, commits, and then has nothing left
    first = strata(state_dir, "consume", "cli", "-g", "readers", "--from-beginning", "--idle", "1")
    assert len(first.stdout.splitlines()) == 1200
    described = as_json(strata(state_dir, "-o", "json", "groups", "describe", "readers"))
    assert described["total_lag"] == 0 and len(described["offsets"]) == 3
    assert "readers" in as_json(strata(state_dir, "-o", "json", "groups", "list"))["groups"]

    # reset to offset 10 on every partition: the group re-reads the rest
    reset = as_json(
        strata(
            state_dir, "-o", "json", "groups", "reset", "readers", "-t", "cli", "--to-offset", "10"
        )
    )
    assert set(reset["offsets"].values()) == {10}
    described = as_json(strata(state_dir, "-o", "json", "groups", "describe", "readers"))
    assert described["total_lag"] == 1200 - 30
    again = strata(state_dir, "consume", "cli", "-g", "readers", "--idle", "1")
    assert len(again.stdout.splitlines()) == 1170
    strata(state_dir, "groups", "delete", "readers", "--yes")
    assert "readers" not in as_json(strata(state_dir, "-o", "json", "groups", "list"))["groups"]

    # replay a range into a new topic
    replayed = as_json(
        strata(state_dir, "-o", "json", "replay", "cli", "cli-copy", "--from", "10", "--to", "20")
    )
    assert replayed["messages"] == 30
    assert len(strata(state_dir, "consume", "cli-copy").stdout.splitlines()) == 30

    altered = as_json(
        strata(state_dir, "-o", "json", "topics", "alter", "cli", "-c", "retention.ms=3600000")
    )
    assert altered["configs"]["retention.ms"] == 3600000
    deleted = as_json(
        strata(state_dir, "-o", "json", "topics", "delete", "cli-copy", "--yes", "--wait", "60")
    )
    assert deleted["done"] is True
    listed = as_json(strata(state_dir, "-o", "json", "topics", "list"))
    assert "cli-copy" not in listed["topics"] and "cli-copy" not in listed["deleting"]


def test_every_agent_serves_prometheus_metrics(stack: tuple[Path, dict[str, Any]]) -> None:
    state_dir, up = stack
    strata(state_dir, "topics", "create", "metered", "-p", "3")
    strata(state_dir, "produce", "metered", stdin="".join(f"m{i}\n" for i in range(300)))
    pages = [scrape_metrics(a["metrics_url"]) for a in up["agents"]]
    merged = "\n".join(pages)
    for name in (
        "strata_request_duration_seconds_bucket",
        "strata_network_in_bytes_total",
        "strata_network_out_bytes_total",
        "strata_fsync_duration_seconds_count",
        "strata_partition_isr_size",
        "strata_under_replicated_partitions",
        "strata_tier_unuploaded_bytes",
        "strata_tier_upload_duration_seconds_count",
        "strata_group_lag_messages",
        "strata_group_lag_seconds",
    ):
        assert name in merged, name
    assert metric_value(merged, 'strata_requests_total{api="produce"}') >= 1
    assert metric_value(merged, "strata_network_in_bytes_total") > 300
    assert metric_value(merged, "strata_fsync_duration_seconds_count") >= 1
    assert metric_value(merged, "strata_under_replicated_partitions") == 0
    assert metric_value(merged, "strata_partitions_leader") >= 3
    health = up["agents"][0]["metrics_url"].rsplit("/", 1)[0] + "/health"
    with urllib.request.urlopen(health, timeout=5) as reply:
        assert reply.status == 200


def test_every_agent_has_a_kafka_listener_that_kafka_clients_use(
    stack: tuple[Path, dict[str, Any]],
) -> None:
    """`up` turns the Kafka listener on for each agent and prints it; a Kafka client lists
    the three agents as brokers, produces and reads back."""
    import confluent_kafka as ck
    from confluent_kafka.admin import AdminClient, NewTopic

    state_dir, up = stack
    addresses = [a["kafka"] for a in up["agents"]]
    assert all(addresses), up["agents"]
    bootstrap = ",".join(addresses)
    admin = AdminClient({"bootstrap.servers": bootstrap})
    created = admin.create_topics([NewTopic("via-kafka", 2, 1)])
    created["via-kafka"].result(30)
    assert {b.port for b in admin.list_topics(timeout=30).brokers.values()} == {
        int(a.rsplit(":", 1)[1]) for a in addresses
    }
    producer = ck.Producer({"bootstrap.servers": bootstrap})
    for i in range(10):
        producer.produce("via-kafka", f"k{i}".encode(), key=b"k")
    assert producer.flush(30) == 0
    consumed = strata(
        state_dir, "-o", "json", "consume", "via-kafka", "--from-beginning", "-n", "10"
    )
    assert "k9" in consumed.stdout
    # the Kafka listener's requests are in the agents' metrics, under their Kafka names
    merged = "\n".join(scrape_metrics(a["metrics_url"]) for a in up["agents"])
    assert metric_value(merged, 'strata_requests_total{api="kafka_produce"}') >= 1
    assert 'strata_requests_total{api="kafka_metadata"}' in merged
    assert 'strata_request_duration_seconds_count{api="kafka_produce"}' in merged


def test_down_leaves_no_process_behind(stack: tuple[Path, dict[str, Any]]) -> None:
    state_dir, _ = stack
    state = local.read_state(state_dir)
    assert state is not None
    pids = [state.supervisor_pid, *state.pids()]
    assert len(pids) == 8  # supervisor, delay scheduler, admin, 3 agents, ZooKeeper, moto
    assert "stopped" in strata(state_dir, "local", "down").stdout
    deadline = time.monotonic() + 10
    while any(local._alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in pids if local._alive(p)]
    status = strata(state_dir, "local", "status", check=False)
    assert status.returncode == 3 and "no local stack" in status.stdout


def test_a_secure_stack_serves_its_users_and_refuses_others(tmp_path: Path) -> None:
    """``up --secure``: agents on SASL_SSL with ACLs; the CLI uses the stack's client settings
    by itself (the admin API wants them too), the delay scheduler logs in as the stack's admin
    and delivers, and a client with a wrong password is refused."""
    state_dir = tmp_path / "stack"
    try:
        up = as_json(
            strata(
                state_dir,
                "-o",
                "json",
                "local",
                "up",
                "--detach",
                "--secure",
                "--agents",
                "1",
                timeout=90,
            )
        )
        client = up["client"]
        assert client["security.protocol"] == "SASL_SSL" and client["sasl.username"] == "admin"
        for name in ("client.properties", "stack.json"):
            assert (state_dir / name).stat().st_mode & 0o777 == 0o600, name
        strata(state_dir, "topics", "create", "s", "-p", "1")
        # the admin API asks for credentials (the CLI sent the stack's admin user's)
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"{up['admin_url']}/topics", timeout=5)
        refused.value.close()
        assert refused.value.code == 401
        # `local status` probes the admin API with the stack's credentials
        assert as_json(strata(state_dir, "-o", "json", "local", "status"))["healthy"]
        lines = "".join(f"secret {i}\n" for i in range(100))
        assert (
            as_json(strata(state_dir, "-o", "json", "produce", "s", stdin=lines))["messages"] == 100
        )
        assert len(strata(state_dir, "consume", "s").stdout.splitlines()) == 100

        conf = {"bootstrap.servers": up["bootstrap"], **client}

        async def delayed() -> list[bytes]:
            async with Producer(conf) as producer:
                await producer.send_and_wait("s", b"later", partition=0, delay_ms=1000)
            async with Consumer(conf | {"fetch.max.wait.ms": 200}) as consumer:
                consumer.assign([TopicPartition("s", 0)])
                consumer.seek(TopicPartition("s", 0), 100)
                async with asyncio.timeout(60):
                    while True:
                        got = await consumer.getmany(timeout_ms=500)
                        values = [r.value for rs in got.values() for r in rs]
                        if values:
                            return values

        assert asyncio.run(delayed()) == [b"later"]

        async def wrong() -> None:
            async with Producer(conf | {"sasl.password": "wrong"}) as producer:
                await producer.send_and_wait("s", b"x", partition=0)

        with pytest.raises(AuthenticationFailedError):
            asyncio.run(wrong())
    finally:
        local.down(state_dir)


def test_zookeepers_must_be_1_3_or_5(tmp_path: Path) -> None:
    result = strata(tmp_path / "stack", "local", "up", "--zookeepers", "2", check=False)
    assert result.returncode == 1
    assert "zookeepers must be one of 1, 3, 5, not 2" in result.stderr


def test_an_ensemble_of_three_serves_with_one_server_killed(tmp_path: Path) -> None:
    """``up --zookeepers 3``: three ZooKeeper servers, one leading; the agents' connect string
    lists all three, and with the leader killed -9 they serve on the two others (status shows
    the stack degraded, the dead server down and the agents' sessions fine)."""
    state_dir = tmp_path / "stack"
    try:
        up = as_json(
            strata(
                state_dir,
                "-o",
                "json",
                "local",
                "up",
                "--detach",
                "--agents",
                "1",
                "--zookeepers",
                "3",
                timeout=90,
            )
        )
        servers = [z["address"] for z in up["zookeepers"]]
        assert len(servers) == 3
        assert up["zookeeper_connect"] == ",".join(servers) + "/strata"

        status = as_json(strata(state_dir, "-o", "json", "local", "status"))
        assert status["zookeeper_connect"] == up["zookeeper_connect"]
        zookeepers = {c["name"]: c for c in status["components"] if c["name"].startswith("zoo")}
        assert sorted(zookeepers) == ["zookeeper 1", "zookeeper 2", "zookeeper 3"]
        modes = sorted(c["detail"] for c in zookeepers.values())
        assert modes == ["mode: follower", "mode: follower", "mode: leader"], modes
        assert status["healthy"], status

        leader = next(c for c in zookeepers.values() if c["detail"] == "mode: leader")
        os.kill(leader["pid"], 9)
        deadline = time.monotonic() + 30
        while True:  # what `status` shows, probed in this process (a CLI run takes seconds)
            state = local.read_state(state_dir)
            assert state is not None
            by_name = {c.name: c for c in local.status(state)}
            modes = [by_name[n].detail for n in sorted(zookeepers)]
            if (
                state.status == "degraded"
                and by_name[leader["name"]].detail == "mode: down"
                and modes.count("mode: leader") == 1
                and by_name["agent 1"].healthy
            ):
                break
            assert time.monotonic() < deadline, (state, by_name)
            time.sleep(0.1)  # polling the supervisor's state file: no event to await
        status = as_json(strata(state_dir, "-o", "json", "local", "status", check=False))
        assert status["status"] == "degraded" and not status["healthy"], status
        created = as_json(strata(state_dir, "-o", "json", "topics", "create", "t", "-p", "1"))
        assert created["partitions"] == 1
    finally:
        local.down(state_dir)
