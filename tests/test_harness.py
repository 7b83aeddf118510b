"""The test harness itself: real ZooKeeper, real moto server, child processes that never leak."""

from __future__ import annotations

import os
import random
import re
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from botocore.exceptions import ClientError
from kazoo.client import KazooClient, KazooState

from infra.moto_s3 import MotoServer
from infra.processes import ExitedWhileStarting, LocalStackError
from infra.zookeeper import ZooKeeperEnsemble, ZooKeeperServer, start_zookeeper
from tests.harness import (
    ProcessGroup,
    S3Target,
    ZooKeeperChroot,
    close_client,
    create_chroot,
    delete_chroot,
    expire_session,
    free_port,
    kazoo_client,
    restore_ensemble,
)

ROOT = Path(__file__).resolve().parent.parent


def _gone(pid: int, timeout: float = 5.0) -> bool:
    """True once ``pid`` no longer runs (absent, or a zombie nobody has reaped yet)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except (FileNotFoundError, ProcessLookupError):
            return True
        if stat.rsplit(")", 1)[1].split()[0] in ("Z", "X"):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)


# ---------------------------------------------------------------- ZooKeeper


def test_zookeeper_is_a_real_standalone_server_on_loopback(zk_server: ZooKeeperServer) -> None:
    assert zk_server.host == "127.0.0.1"
    assert zk_server.running
    assert zk_server.four_letter_word("ruok") == "imok"
    assert "Mode: standalone" in zk_server.four_letter_word("srvr")
    assert "zk_server_state\tstandalone" in zk_server.four_letter_word("mntr")
    assert "ZooKeeperServerMain" in zk_server.log_path.read_text()


def test_znodes_live_inside_the_chroot(
    zk_server: ZooKeeperServer, zk_chroot: ZooKeeperChroot, zk_client: KazooClient
) -> None:
    assert zk_chroot.connect_string == f"{zk_server.connect_string}{zk_chroot.path}"
    assert zk_client.get_children("/") == []
    zk_client.create("/topics/orders", b"3", makepath=True)
    assert zk_client.get("/topics/orders")[0] == b"3"
    root = kazoo_client(zk_server.connect_string)
    try:
        assert root.get(f"{zk_chroot.path}/topics/orders")[0] == b"3"
        assert not root.exists("/topics")
    finally:
        close_client(root)


@pytest.mark.parametrize("run", [1, 2])
def test_each_test_gets_an_empty_chroot_of_its_own(zk_client: KazooClient, run: int) -> None:
    # both runs create the same path: the second would hit NodeExists if chroots were shared
    assert zk_client.get_children("/") == []
    zk_client.create("/controller", str(run).encode())


def test_two_chroots_do_not_see_each_other(zk_server: ZooKeeperServer) -> None:
    admin = kazoo_client(zk_server.connect_string)
    a = create_chroot(admin, zk_server.connect_string, "iso")
    b = create_chroot(admin, zk_server.connect_string, "iso")
    client_a = kazoo_client(a.connect_string)
    client_b = kazoo_client(b.connect_string)
    try:
        assert a.path != b.path
        client_a.create("/leader", b"a")
        assert client_b.exists("/leader") is None
        client_b.create("/leader", b"b")
        assert client_a.get("/leader")[0] == b"a"
    finally:
        close_client(client_a)
        close_client(client_b)
        delete_chroot(admin, a)
        delete_chroot(admin, b)
        close_client(admin)


def test_delete_chroot_removes_the_whole_subtree(zk_server: ZooKeeperServer) -> None:
    admin = kazoo_client(zk_server.connect_string)
    chroot = create_chroot(admin, zk_server.connect_string, "teardown")
    client = kazoo_client(chroot.connect_string)
    try:
        client.create("/a/b/c", b"", makepath=True)
        client.create("/agents/1", b"", ephemeral=True, makepath=True)
        delete_chroot(admin, chroot)
        assert admin.exists(chroot.path) is None
        delete_chroot(admin, chroot)  # twice is fine
    finally:
        close_client(client)
        close_client(admin)


def test_expire_session_deletes_ephemerals_and_the_client_gets_a_new_session(
    zk_chroot: ZooKeeperChroot, zk_client: KazooClient
) -> None:
    observer = kazoo_client(zk_chroot.connect_string)
    try:
        zk_client.create("/leader", b"agent-1", ephemeral=True)
        assert observer.exists("/leader") is not None
        old_session, _ = zk_client.client_id
        states: list[str] = []
        zk_client.add_listener(states.append)

        expire_session(zk_client)

        assert observer.exists("/leader") is None
        assert KazooState.LOST in states
        assert zk_client.state == KazooState.CONNECTED
        assert zk_client.client_id[0] != old_session
        zk_client.create("/leader", b"agent-1 again", ephemeral=True)  # usable at once
    finally:
        close_client(observer)


@pytest.mark.parametrize(("asked", "negotiated"), [(1.0, 1000), (0.2, 1000), (120.0, 60000)])
def test_session_timeouts_are_clamped_to_1_to_60_s(
    zk_chroot: ZooKeeperChroot, caplog: pytest.LogCaptureFixture, asked: float, negotiated: int
) -> None:
    caplog.set_level(5, logger="kazoo.client")  # kazoo's BLATHER level logs the negotiation
    client = kazoo_client(zk_chroot.connect_string, session_timeout=asked)
    try:
        client.create("/x", b"")
        assert f"negotiated session timeout: {negotiated}\n" in caplog.text
    finally:
        close_client(client)


def test_a_live_kazoo_client_leaves_the_global_random_state_alone(
    zk_chroot: ZooKeeperChroot,
) -> None:
    # kazoo's connection loop draws jitter every turn; on the global RNG that would break
    # Hypothesis draws in whatever test runs meanwhile (see give_kazoo_its_own_random)
    client = kazoo_client(zk_chroot.connect_string, session_timeout=1.0)  # a turn every ~0.3 s
    try:
        before = random.getstate()
        time.sleep(1.0)
        client.exists("/")
        assert random.getstate() == before
    finally:
        close_client(client)


def test_start_zookeeper_reports_a_port_it_cannot_bind(tmp_path: Path) -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        with pytest.raises(
            ExitedWhileStarting, match=re.escape(f"ZooKeeper on 127.0.0.1:{port} exited")
        ):
            start_zookeeper(tmp_path / "zk", port=port, startup_timeout=20)


def test_start_zookeeper_without_java_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("JAVA_HOME", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(LocalStackError, match="Java not found"):
        start_zookeeper(tmp_path / "zk")


def test_an_ensemble_elects_a_new_leader_and_a_restarted_member_catches_up(
    zk_ensemble: ZooKeeperEnsemble, zk_ensemble_chroot: ZooKeeperChroot
) -> None:
    assert sorted(zk_ensemble.modes().values()) == ["follower", "follower", "leader"]
    assert zk_ensemble_chroot.connect_string.count(",") == 2  # every member listed
    client = kazoo_client(zk_ensemble_chroot.connect_string)
    try:
        client.create("/x", b"before")
        old = zk_ensemble.leader()
        assert old is not None
        zk_ensemble.kill(old)
        assert zk_ensemble.modes()[old] == "down"
        new = zk_ensemble.wait_for_quorum()
        assert new != old
        client.retry(client.set, "/x", b"while down")  # the client moves to a live member
        zk_ensemble.start(old)
        assert zk_ensemble.modes()[old] == "follower"
    finally:
        close_client(client)
    direct = kazoo_client(zk_ensemble.server(old).connect_string + zk_ensemble_chroot.path)
    try:
        direct.sync("/x")
        assert direct.get("/x")[0] == b"while down"
    finally:
        close_client(direct)


def test_two_members_down_leave_no_quorum_until_restore_ensemble(
    zk_ensemble: ZooKeeperEnsemble, zk_ensemble_chroot: ZooKeeperChroot
) -> None:
    survivor, *others = zk_ensemble.server_ids
    for server_id in others:
        zk_ensemble.stop(server_id)
    deadline = time.monotonic() + 10
    while zk_ensemble.modes()[survivor] != "not serving":  # a leader notices after syncLimit
        assert time.monotonic() < deadline, zk_ensemble.modes()
        time.sleep(0.05)
    restore_ensemble(zk_ensemble)
    assert sorted(zk_ensemble.modes().values()) == ["follower", "follower", "leader"]


# ---------------------------------------------------------------- S3 (moto server)


def test_moto_put_and_get(s3: S3Target) -> None:
    s3.client.put_object(Bucket=s3.bucket, Key="segments/0.log", Body=b"bytes")
    assert s3.client.get_object(Bucket=s3.bucket, Key="segments/0.log")["Body"].read() == b"bytes"
    ranged = s3.client.get_object(Bucket=s3.bucket, Key="segments/0.log", Range="bytes=1-3")
    assert ranged["Body"].read() == b"yte"


def test_moto_create_only_put_refuses_the_second_writer(s3: S3Target) -> None:
    s3.client.put_object(Bucket=s3.bucket, Key="seg", Body=b"first", IfNoneMatch="*")
    with pytest.raises(ClientError) as caught:
        s3.client.put_object(Bucket=s3.bucket, Key="seg", Body=b"second", IfNoneMatch="*")
    assert caught.value.response["Error"]["Code"] == "PreconditionFailed"
    assert caught.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412
    assert s3.client.get_object(Bucket=s3.bucket, Key="seg")["Body"].read() == b"first"


def test_moto_reset_empties_everything(s3_server: MotoServer, s3: S3Target) -> None:
    s3.client.put_object(Bucket=s3.bucket, Key="k", Body=b"v")
    s3_server.reset()
    assert s3.client.list_buckets()["Buckets"] == []


def test_each_test_starts_with_only_its_own_empty_bucket(s3: S3Target) -> None:
    assert [b["Name"] for b in s3.client.list_buckets()["Buckets"]] == [s3.bucket]
    assert s3.client.list_objects_v2(Bucket=s3.bucket)["KeyCount"] == 0


def test_a_child_process_reaches_the_same_s3_through_env(
    s3: S3Target, processes: ProcessGroup
) -> None:
    script = (
        "import boto3, os; "
        "boto3.client('s3').put_object(Bucket=os.environ['STRATA_BUCKET'], Key='from-child', "
        "Body=b'hi')"
    )
    child = processes.start([sys.executable, "-c", script], name="writer", env=s3.env())
    assert child.wait(timeout=30) == 0, child.log_text()
    assert s3.client.get_object(Bucket=s3.bucket, Key="from-child")["Body"].read() == b"hi"


# ---------------------------------------------------------------- processes


def test_free_port_is_bindable_on_loopback() -> None:
    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_process_group_logs_output_and_kills_on_request(tmp_path: Path) -> None:
    with ProcessGroup(tmp_path) as group:
        child = group.start(
            [sys.executable, "-c", "import os, time; print('pid', os.getpid()); time.sleep(60)"],
            name="agent-1",
        )
        deadline = time.monotonic() + 10
        while "pid" not in child.log_text() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert child.log_text().strip() == f"pid {child.pid}"
        assert child.log_path == tmp_path / "agent-1.log"
        assert group.pids == [child.pid]
        group.kill(child.pid)
        assert child.wait(timeout=5) == -9
        assert group.pids == []
        again = group.start([sys.executable, "-c", "pass"], name="agent-1")
        assert again.log_path == tmp_path / "agent-1.1.log"  # a restart keeps the old log
        assert again.wait(timeout=10) == 0


def test_process_group_close_kills_stubborn_children_and_grandchildren(tmp_path: Path) -> None:
    stubborn = textwrap.dedent(
        """
        import signal, subprocess, sys, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        print(grandchild.pid, flush=True)
        time.sleep(60)
        """
    )
    group = ProcessGroup(tmp_path, stop_timeout=0.5)
    child = group.start([sys.executable, "-c", stubborn], name="stubborn")
    deadline = time.monotonic() + 10
    while not child.log_text().strip() and time.monotonic() < deadline:
        time.sleep(0.02)
    grandchild = int(child.log_text().split()[0])
    started = time.monotonic()
    group.close()
    assert time.monotonic() - started < 3
    assert child.returncode == -9  # it ignored SIGTERM
    assert _gone(child.pid) and _gone(grandchild)
    with pytest.raises(RuntimeError, match="closed"):
        group.start([sys.executable, "-c", "pass"])


def test_processes_fixture_stops_children_even_when_the_test_fails(tmp_path: Path) -> None:
    """Run a failing test in an inner pytest; its child must be gone and its log shown."""
    pid_file = tmp_path / "pid"
    inner = tmp_path / "inner"
    inner.mkdir()
    (inner / "conftest.py").write_text("from tests.conftest import *  # noqa: F403\n")
    (inner / "test_inner.py").write_text(
        textwrap.dedent(
            f"""
            import sys, time
            from pathlib import Path

            def test_fails_with_a_child_running(processes):
                child = processes.start(
                    [sys.executable, "-c", "print('child says hi', flush=True); "
                     "import time; time.sleep(60)"],
                    name="agent",
                )
                Path({str(pid_file)!r}).write_text(str(child.pid))
                deadline = time.monotonic() + 10
                while "hi" not in child.log_text() and time.monotonic() < deadline:
                    time.sleep(0.02)
                assert False, "on purpose"
            """
        )
    )
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(inner),
         "--basetemp", str(tmp_path / "basetemp")],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    assert run.returncode == 1, run.stdout + run.stderr
    assert "1 failed" in run.stdout
    assert "child says hi" in run.stdout  # the log tail, printed at teardown
    assert _gone(int(pid_file.read_text()))
