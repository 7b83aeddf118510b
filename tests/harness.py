"""Real servers for integration tests: ZooKeeper chroots, moto buckets, child processes.

The fixtures in ``conftest.py`` are thin wrappers over this module, so a test that needs a
variation (two clients, a process started late, a session expired on purpose) builds it from
the same pieces:

* one ZooKeeper server per test session (``infra.zookeeper``), and per test a chroot
  ``/strata-test/<test>-<hex>`` (:func:`create_chroot` / :func:`delete_chroot`) — tests never
  see each other's znodes;
* one moto server per test session (``infra.moto_s3``), reset before each test, and per test a
  fresh bucket (:class:`S3Target`);
* :class:`ProcessGroup` for agent processes: logs under the test's ``tmp_path``, and at
  teardown everything still alive is stopped (SIGTERM, deadline, SIGKILL), pass or fail;
* :func:`expire_session`: a real server-side session expiry, as leadership tests need;
* for fault tests, a three-server ensemble per test module (``infra.zookeeper``
  :class:`~infra.zookeeper.ZooKeeperEnsemble`: ``leader()``, ``modes()``, ``kill(id)``,
  ``stop(id)``, ``start(id)``, ``wait_for_quorum()``) and per test a chroot on it;
  :func:`restore_ensemble` brings back whatever the previous test left down or frozen.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import subprocess
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import boto3
import kazoo.protocol.connection
import kazoo.retry
from botocore.config import Config
from kazoo.client import KazooClient, KazooState
from kazoo.exceptions import NoNodeError, NotEmptyError

from infra.processes import free_port, log_tail, signal_group, spawn, terminate
from infra.zookeeper import ZooKeeperEnsemble

__all__ = [
    "CHROOT_ROOT",
    "ManagedProcess",
    "ProcessGroup",
    "S3Target",
    "ZooKeeperChroot",
    "close_client",
    "create_chroot",
    "delete_chroot",
    "expire_session",
    "free_port",
    "give_kazoo_its_own_random",
    "kazoo_client",
    "new_s3_target",
    "restore_ensemble",
]

CHROOT_ROOT = "/strata-test"
ZK_SESSION_TIMEOUT = 10.0
"""Session timeout of the test clients (s); the server accepts 1-60 s."""
ZK_CONNECT_TIMEOUT = 10.0
"""Deadline for a test client's first connection (s)."""


# ---------------------------------------------------------------- ZooKeeper


@dataclass(frozen=True, slots=True)
class ZooKeeperChroot:
    """A test's own subtree of the session's ZooKeeper."""

    server: str
    """``host:port`` of the server (no chroot)."""
    path: str
    """The chroot, e.g. ``/strata-test/test_x-1f2e3d4c``."""

    @property
    def connect_string(self) -> str:
        """``host:port/chroot``: what agents and clients of this test connect to."""
        return f"{self.server}{self.path}"

    def __str__(self) -> str:
        return self.connect_string


def give_kazoo_its_own_random() -> None:
    """Make kazoo draw its jitter from a private ``random.Random``, not the global one.

    kazoo's connection thread calls ``random.randint`` on every loop turn (each ping) and its
    retries call ``random.uniform``. Hypothesis takes any change of the global random state
    during a draw for a strategy that uses ``random`` and warns
    (``HypothesisDeprecationWarning: Do not use the `random` module inside strategies``) —
    an error under ``filterwarnings = error`` — so any live kazoo client, in any thread, made
    property tests fail at random. Called once by ``conftest.py``.
    """
    rng = random.Random()
    kazoo.protocol.connection.random = rng
    kazoo.retry.random = rng


def _znode_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text)[:80] or "test"


def kazoo_client(hosts: str, *, session_timeout: float = ZK_SESSION_TIMEOUT) -> KazooClient:
    """A started kazoo client on ``hosts`` (raises if not connected within the deadline)."""
    client = KazooClient(hosts=hosts, timeout=session_timeout)
    try:
        client.start(timeout=ZK_CONNECT_TIMEOUT)
    except BaseException:
        client.close()
        raise
    return client


def close_client(client: KazooClient) -> None:
    """Stop (closing the session) and release a kazoo client; never raises on teardown."""
    with contextlib.suppress(Exception):
        client.stop()
    client.close()


def create_chroot(admin: KazooClient, server: str, test_name: str) -> ZooKeeperChroot:
    """Create a fresh chroot for ``test_name`` through ``admin`` (a client on the root)."""
    path = f"{CHROOT_ROOT}/{_znode_name(test_name)}-{uuid.uuid4().hex[:8]}"
    admin.ensure_path(path)
    return ZooKeeperChroot(server=server, path=path)


def delete_chroot(admin: KazooClient, chroot: ZooKeeperChroot, *, timeout: float = 10.0) -> None:
    """Delete the chroot and everything under it.

    Retried while live sessions of the test (processes still stopping) add children under it.
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            admin.delete(chroot.path, recursive=True)
            return
        except NoNodeError:
            return
        except NotEmptyError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.05)


def expire_session(client: KazooClient, *, timeout: float = 15.0) -> None:
    """Expire ``client``'s session on the server, as a long partition would, and wait for it.

    The trick from kazoo's old test harness: a second client connects with the same session id
    and password — the server moves the session to it and drops ``client``'s connection — and
    closes the session. The server deletes the session's ephemeral nodes before it answers the
    close, so they are gone when this returns. ``client`` then finds its session expired
    (state LOST) and kazoo opens a new session (CONNECTED); both are waited for, up to
    ``timeout`` s, so the caller continues on the new session.
    """
    client_id = client.client_id
    if client_id is None:
        raise RuntimeError("expire_session needs a connected client")
    lost = threading.Event()
    reconnected = threading.Event()

    def listener(state: str) -> bool:
        if state == KazooState.LOST:
            lost.set()
        elif state == KazooState.CONNECTED and lost.is_set():
            reconnected.set()
            return True  # remove this listener
        return False

    client.add_listener(listener)
    try:
        hosts = ",".join(f"{host}:{port}" for host, port in client.hosts)
        thief = KazooClient(hosts=hosts, client_id=client_id, timeout=ZK_SESSION_TIMEOUT)
        try:
            thief.start(timeout=ZK_CONNECT_TIMEOUT)
            thief.stop()  # closeSession: the server expires the session and its ephemerals
        finally:
            thief.close()
        if not lost.wait(timeout):
            raise TimeoutError(f"the client did not see its session expire within {timeout} s")
        if not reconnected.wait(timeout):
            raise TimeoutError(f"the client did not get a new session within {timeout} s")
    finally:
        client.remove_listener(listener)


def restore_ensemble(ensemble: ZooKeeperEnsemble, *, timeout: float = 40.0) -> int:
    """Every member of ``ensemble`` running and serving again; the leader's id.

    Thaws members (SIGCONT, harmless to a running one), restarts the ones that are down and
    waits for all of them to serve: a test that stopped or froze members leaves a whole
    ensemble to the next one.
    """
    for server_id in ensemble.server_ids:
        if ensemble.running(server_id):
            ensemble.kill(server_id, signal.SIGCONT)
    down = [i for i in ensemble.server_ids if not ensemble.running(i)]
    if down:
        ensemble.start(*down, wait=False)
    return ensemble.wait_for_quorum(timeout=timeout, members=ensemble.server_ids)


# ---------------------------------------------------------------- S3 (moto)


@dataclass(frozen=True, slots=True)
class S3Target:
    """Where a test's objects go: moto's endpoint, fake credentials, the test's own bucket."""

    endpoint_url: str
    bucket: str
    region: str = "us-east-1"
    access_key_id: str = "testing"
    secret_access_key: str = "testing"
    client: Any = field(default=None, repr=False, compare=False)
    """A boto3 S3 client on the endpoint (connect/read timeouts set)."""

    def new_client(self) -> Any:
        """Another boto3 S3 client, with deadlines: 2 s to connect, 10 s per read."""
        session = boto3.session.Session(
            aws_access_key_id=self.access_key_id,
            aws_secret_access_key=self.secret_access_key,
            region_name=self.region,
        )
        return session.client(
            "s3",
            endpoint_url=self.endpoint_url,
            config=Config(
                connect_timeout=2,
                read_timeout=10,
                retries={"max_attempts": 2, "mode": "standard"},
                s3={"addressing_style": "path"},
            ),
        )

    def env(self) -> dict[str, str]:
        """Environment variables that point a child process's boto3 at this target."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_ACCESS_KEY_ID": self.access_key_id,
            "AWS_SECRET_ACCESS_KEY": self.secret_access_key,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_REGION": self.region,
            "STRATA_BUCKET": self.bucket,
        }


def new_s3_target(endpoint_url: str, test_name: str) -> S3Target:
    """Create a fresh bucket for ``test_name`` and return its target, client included."""
    slug = re.sub(r"[^a-z0-9-]", "-", test_name.lower()).strip("-")[:30].strip("-")
    bucket = f"strata-{slug}-{uuid.uuid4().hex[:12]}" if slug else f"strata-{uuid.uuid4().hex}"
    target = S3Target(endpoint_url=endpoint_url, bucket=bucket)
    client = target.new_client()
    client.create_bucket(Bucket=bucket)
    return S3Target(endpoint_url=endpoint_url, bucket=bucket, client=client)


# ---------------------------------------------------------------- processes


@dataclass(frozen=True, slots=True)
class ManagedProcess:
    """A child started by a :class:`ProcessGroup`."""

    name: str
    argv: tuple[str, ...]
    log_path: Path
    popen: subprocess.Popen[bytes] = field(repr=False, compare=False)

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def wait(self, timeout: float) -> int:
        return self.popen.wait(timeout=timeout)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


class ProcessGroup:
    """Child processes of one test: started with logs under ``log_dir``, all stopped at the end.

    ``start`` runs a command in its own session (its children go with it) with stdout+stderr
    in ``<log_dir>/<name>.log``. ``kill`` signals one child (SIGKILL by default: a crash);
    ``stop`` stops one gracefully. ``close`` — the fixture's teardown, also on failure —
    stops every child still alive: SIGTERM, ``stop_timeout`` s, SIGKILL, reaped.
    """

    def __init__(self, log_dir: Path, *, stop_timeout: float = 5.0) -> None:
        self.log_dir = log_dir
        self.stop_timeout = stop_timeout
        self._processes: dict[int, ManagedProcess] = {}
        self._closed = False

    def start(
        self,
        argv: Sequence[str],
        *,
        name: str | None = None,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
    ) -> ManagedProcess:
        """Start ``argv``; ``env`` is added to (and overrides) this process's environment."""
        if self._closed:
            raise RuntimeError("the ProcessGroup is closed")
        base = _znode_name(name or Path(argv[0]).name)
        log_path = self.log_dir / f"{base}.log"
        n = 1
        while log_path.exists() or any(p.log_path == log_path for p in self):
            log_path = self.log_dir / f"{base}.{n}.log"
            n += 1
        child_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        popen = spawn(argv, log_path=log_path, env=child_env, cwd=cwd)
        process = ManagedProcess(
            name=log_path.stem, argv=tuple(argv), log_path=log_path, popen=popen
        )
        self._processes[popen.pid] = process
        return process

    def __iter__(self) -> Iterator[ManagedProcess]:
        return iter(list(self._processes.values()))

    def get(self, pid: int) -> ManagedProcess:
        try:
            return self._processes[pid]
        except KeyError:
            raise KeyError(f"pid {pid} was not started by this ProcessGroup") from None

    @property
    def pids(self) -> list[int]:
        """PIDs of the children still running."""
        return [p.pid for p in self if p.alive]

    def kill(self, pid: int, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to one child (not its group); a child already gone is not an error."""
        process = self.get(pid)
        if process.alive:
            process.popen.send_signal(sig)

    def stop(self, pid: int, *, timeout: float | None = None) -> int:
        """Stop one child and its group (SIGTERM, deadline, SIGKILL); return its exit status."""
        return terminate(self.get(pid).popen, timeout=timeout or self.stop_timeout)

    def close(self) -> None:
        """Stop every child still running (SIGTERM to all first, so they stop in parallel)."""
        self._closed = True
        processes = list(self)
        for process in processes:
            if process.alive:
                signal_group(process.popen, signal.SIGTERM)
        deadline = time.monotonic() + self.stop_timeout
        for process in processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
        for process in processes:
            signal_group(process.popen, signal.SIGKILL)  # what ignored SIGTERM, and grandchildren
            process.popen.wait(timeout=self.stop_timeout)

    def describe(self, limit: int = 2000) -> str:
        """Each child's status and the tail of its log (printed when a test fails)."""
        parts = []
        for p in self:
            status = "running" if p.alive else f"exit {p.returncode}"
            parts.append(f"--- {p.name} pid {p.pid} ({status}): {' '.join(p.argv)}")
            parts.append(log_tail(p.log_path, limit))
        return "\n".join(parts)

    def __enter__(self) -> ProcessGroup:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def rss_bytes(pid: int) -> int:
    """Resident set size of process ``pid`` (``VmRSS``), in bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def scrape_metrics(url: str) -> str:
    """The Prometheus text page an agent serves at ``url``."""
    with urllib.request.urlopen(url, timeout=5) as reply:
        assert reply.status == 200
        assert reply.headers["content-type"].startswith("text/plain")
        body: bytes = reply.read()
        return body.decode()


def metric_value(text: str, name: str) -> float:
    """The sum of every sample of ``name`` (all label sets) on a Prometheus text page."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total
