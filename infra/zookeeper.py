"""Real ZooKeeper servers as child processes, for the local stack and the integration tests.

No ZooKeeper download: pyspark's distribution ships the server's jars (``zookeeper``,
``zookeeper-jute``, netty, slf4j, log4j) under ``pyspark/jars/``, so the machine needs only a
Java runtime (17, as Spark wants). Two shapes:

* **standalone** (:func:`start_zookeeper`): one server,
  ``org.apache.zookeeper.server.ZooKeeperServerMain``;
* **ensemble** (:func:`start_ensemble`): N servers (3 by default) that form a quorum,
  ``org.apache.zookeeper.server.quorum.QuorumPeerMain``. Each has its own state directory
  ``<state_dir>/zk-<id>`` with a ``myid`` file, and the same ``server.<id>=127.0.0.1:<quorum
  port>:<election port>`` lines; clients list every member in their connect string. A write
  needs a majority (2 of 3): with one member down the ensemble serves (after electing a new
  leader if it was the leader); with two down the survivor stops serving its clients until a
  majority is back. :class:`ZooKeeperEnsemble` can kill, stop and restart single members on
  the same ports and data, which is what fault tests need.

Every server gets a ``zoo.cfg`` written into its state directory:

* data (snapshots, transaction log) in ``<state_dir>/data`` — kept across restarts, so a
  local stack stopped and started again finds its metadata; autopurge keeps three snapshots;
* the client port on loopback only (``clientPortAddress=127.0.0.1``); no admin server
  (it would take port 8080); only the ``ruok``, ``srvr`` and ``mntr`` four-letter words;
* ``tickTime`` 500 ms and ``minSessionTimeout`` 1000 ms, so tests can use short session
  timeouts; ``maxSessionTimeout`` 60 s; in an ensemble ``initLimit`` 10 ticks (5 s for a
  follower to sync with a new leader) and ``syncLimit`` 4 ticks (a follower silent for 2 s is
  dropped, and so is a leader that loses its majority for that long);
* log4j output in ``<state_dir>/zookeeper.log`` (rolled by size); the JVM's own stdout and
  stderr in ``<state_dir>/zookeeper.out``, normally empty.

Readiness: the server answers ``ruok`` with ``imok`` and ``srvr`` with its mode (``srvr``
answers "not currently serving requests" until the database is loaded, and, in an ensemble,
while the member has no quorum), probed every 50 ms up to a deadline.
:meth:`ZooKeeperServer.stop` sends SIGTERM, waits, then SIGKILLs.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Self

from infra.processes import (
    POLL_INTERVAL,
    PORT_ATTEMPTS,
    ChildProcess,
    ExitedWhileStarting,
    LocalStackError,
    free_ports,
    spawn,
    start_on_port,
    terminate,
)

MAIN_CLASS = "org.apache.zookeeper.server.ZooKeeperServerMain"
QUORUM_MAIN_CLASS = "org.apache.zookeeper.server.quorum.QuorumPeerMain"
HOST = "127.0.0.1"
SERVING_MODES = ("standalone", "leader", "follower")
"""What ``srvr`` reports as ``Mode:`` for a server that serves its clients."""

_LOG4J2_PROPERTIES = """\
status = warn
appender.file.type = RollingFile
appender.file.name = file
appender.file.fileName = {log}
appender.file.filePattern = {log}.%i
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = %d{{ISO8601}} %-5p [%t] %c{{1}} - %m%n
appender.file.policies.type = Policies
appender.file.policies.size.type = SizeBasedTriggeringPolicy
appender.file.policies.size.size = 10MB
appender.file.strategy.type = DefaultRolloverStrategy
appender.file.strategy.max = 3
rootLogger.level = info
rootLogger.appenderRef.file.ref = file
"""


def find_java() -> str:
    """The ``java`` executable: ``$JAVA_HOME/bin/java`` if set, else the one on ``PATH``."""
    java_home = os.environ.get("JAVA_HOME")
    if java_home:
        candidate = Path(java_home) / "bin" / "java"
        if os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which("java")
    if found is None:
        raise LocalStackError(
            "Java not found: ZooKeeper needs a Java runtime (17) on PATH or in JAVA_HOME "
            "(Debian/Ubuntu: apt-get install openjdk-17-jre-headless)"
        )
    return found


def find_jars_dir() -> Path:
    """pyspark's ``jars/`` directory, checked to hold ZooKeeper's server jars."""
    spec = importlib.util.find_spec("pyspark")
    if spec is None or not spec.submodule_search_locations:
        raise LocalStackError(
            "pyspark is not installed: its jars/ directory provides the ZooKeeper server "
            "(pip install -c constraints.txt -e '.[dev]')"
        )
    jars = Path(next(iter(spec.submodule_search_locations))) / "jars"
    for prefix in ("zookeeper-3", "zookeeper-jute-"):
        if not any(jars.glob(f"{prefix}*.jar")):
            raise LocalStackError(f"no {prefix}*.jar in {jars}: the pyspark install is incomplete")
    return jars


def four_letter_word(host: str, port: int, word: str, *, timeout: float = 1.0) -> str:
    """Send a four-letter command (``ruok``, ``srvr``, ``mntr``) and return the whole answer."""
    chunks: list[bytes] = []
    with socket.create_connection((host, port), timeout=timeout) as sock:
        sock.sendall(word.encode("ascii"))
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks).decode("utf-8", "replace")


def server_mode(host: str, port: int, *, timeout: float = 1.0) -> str:
    """What the server at ``host:port`` says it is: ``standalone``, ``leader`` or ``follower``
    while it serves clients; ``not serving`` while it answers without serving (starting, or an
    ensemble member without a quorum); ``down`` when nothing answers in time."""
    try:
        answer = four_letter_word(host, port, "srvr", timeout=timeout)
    except OSError:
        return "down"
    for line in answer.splitlines():
        if line.startswith("Mode: "):
            return line.removeprefix("Mode: ").strip()
    return "not serving"


def _serving(host: str, port: int) -> bool:
    try:
        if four_letter_word(host, port, "ruok", timeout=0.5) != "imok":
            return False
    except OSError:
        return False
    return server_mode(host, port, timeout=0.5) in SERVING_MODES


@dataclass(frozen=True, slots=True, kw_only=True)
class ZooKeeperServer(ChildProcess):
    """A running standalone ZooKeeper; stop it with :meth:`stop` or a ``with`` block."""

    host: str
    port: int
    state_dir: Path
    log_path: Path
    server_id: int = 0
    """The member's id in an ensemble (its ``myid``); 0 for a standalone server."""

    @property
    def connect_string(self) -> str:
        """``host:port``, as kazoo takes it (append ``/chroot`` for a chroot)."""
        return f"{self.host}:{self.port}"

    def four_letter_word(self, word: str, *, timeout: float = 1.0) -> str:
        return four_letter_word(self.host, self.port, word, timeout=timeout)

    def mode(self, *, timeout: float = 1.0) -> str:
        """See :func:`server_mode`."""
        return server_mode(self.host, self.port, timeout=timeout)


@dataclass(frozen=True, slots=True)
class Peer:
    """One ensemble member's ports (all on ``127.0.0.1``)."""

    server_id: int
    client_port: int
    quorum_port: int
    """Followers connect to the leader here."""
    election_port: int
    """Leader election runs here."""

    @property
    def server_line(self) -> str:
        return f"server.{self.server_id}={HOST}:{self.quorum_port}:{self.election_port}"


def write_config(
    state_dir: Path, *, port: int, peers: Sequence[Peer] = (), server_id: int = 0
) -> Path:
    """Write ``zoo.cfg`` and ``log4j2.properties`` into ``state_dir``; return zoo.cfg's path.

    With ``peers`` (every member, this one included) the server is ensemble member
    ``server_id``: the ``server.N`` lines go into zoo.cfg and ``myid`` into the data directory.
    """
    data_dir = state_dir / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    lines = [
        f"dataDir={data_dir}",
        f"clientPort={port}",
        f"clientPortAddress={HOST}",
        "tickTime=500",
        "minSessionTimeout=1000",
        "maxSessionTimeout=60000",
        "maxClientCnxns=500",
        "admin.enableServer=false",
        "4lw.commands.whitelist=ruok,srvr,mntr",
        "autopurge.snapRetainCount=3",
        "autopurge.purgeInterval=1",
    ]
    if peers:
        if server_id not in {p.server_id for p in peers}:
            raise LocalStackError(f"server {server_id} is not one of the peers {peers}")
        lines += ["initLimit=10", "syncLimit=4", *(p.server_line for p in peers)]
        (data_dir / "myid").write_text(f"{server_id}\n")
    cfg = state_dir / "zoo.cfg"
    cfg.write_text("\n".join([*lines, ""]))
    log4j = state_dir / "log4j2.properties"
    log4j.write_text(_LOG4J2_PROPERTIES.format(log=state_dir / "zookeeper.log"))
    return cfg


def start_zookeeper(
    state_dir: Path,
    *,
    port: int | None = None,
    startup_timeout: float = 20.0,
    heap_mb: int = 256,
    die_with_parent: bool = True,
) -> ZooKeeperServer:
    """Start a standalone ZooKeeper on ``127.0.0.1`` and return once it serves requests.

    ``port=None`` picks a free port (and tries another if it is taken before the server
    binds it). ``die_with_parent=False`` lets the server outlive this process (the local
    stack's ``up``); the default ties it to us (tests). Raises :class:`LocalStackError` if
    Java or the jars are missing, or the server does not come up within
    ``startup_timeout`` s.
    """
    java = find_java()
    classpath = str(find_jars_dir() / "*")
    state_dir = state_dir.resolve()
    state_dir.mkdir(parents=True, exist_ok=True)

    def argv(port: int) -> list[str]:
        cfg = write_config(state_dir, port=port)
        return _java_argv(java, classpath, state_dir, heap_mb, MAIN_CLASS, cfg)

    log_path = state_dir / "zookeeper.log"
    process, chosen = start_on_port(
        argv,
        lambda p: functools.partial(_serving, HOST, p),
        host=HOST,
        port=port,
        what="ZooKeeper",
        output_path=state_dir / "zookeeper.out",
        log_path=log_path,
        timeout=startup_timeout,
        die_with_parent=die_with_parent,
    )
    return ZooKeeperServer(
        host=HOST, port=chosen, state_dir=state_dir, log_path=log_path, _process=process
    )


def _java_argv(
    java: str, classpath: str, state_dir: Path, heap_mb: int, main_class: str, cfg: Path
) -> list[str]:
    return [
        java,
        f"-Xmx{heap_mb}m",
        "-XX:+UseSerialGC",
        "-XX:TieredStopAtLevel=1",
        f"-Dlog4j2.configurationFile={state_dir / 'log4j2.properties'}",
        "-Dzookeeper.jmx.log4j.disable=true",
        "-cp",
        classpath,
        main_class,
        str(cfg),
    ]


class ZooKeeperEnsemble:
    """A running ensemble (see the module docstring); stop it with :meth:`close` or ``with``.

    Members are numbered 1..N. :meth:`kill`, :meth:`stop` and :meth:`start` act on single
    members; a restarted member keeps its ports and its data directory, so it rejoins as the
    same server. :meth:`modes` asks every member what it is (``leader``, ``follower``,
    ``not serving``, ``down``).
    """

    def __init__(
        self,
        state_dir: Path,
        peers: Sequence[Peer],
        *,
        java: str,
        classpath: str,
        heap_mb: int,
        die_with_parent: bool,
    ) -> None:
        self.state_dir = state_dir
        self.peers = {p.server_id: p for p in peers}
        self._java = java
        self._classpath = classpath
        self._heap_mb = heap_mb
        self._die_with_parent = die_with_parent
        self._processes: dict[int, subprocess.Popen[bytes]] = {}

    # ---- addresses and state ------------------------------------------------------------
    @property
    def connect_string(self) -> str:
        """Every member's ``host:port``, comma-separated, as kazoo takes it (append
        ``/chroot`` for a chroot): a client moves to another member when its own goes away."""
        return ",".join(f"{HOST}:{p.client_port}" for p in self.peers.values())

    @property
    def server_ids(self) -> list[int]:
        return sorted(self.peers)

    def server(self, server_id: int) -> ZooKeeperServer:
        """Member ``server_id`` as a :class:`ZooKeeperServer` (its current process)."""
        process = self._processes.get(server_id)
        if process is None:
            raise LocalStackError(f"ZooKeeper {server_id} was never started")
        directory = self.member_dir(server_id)
        return ZooKeeperServer(
            host=HOST,
            port=self.peers[server_id].client_port,
            state_dir=directory,
            log_path=directory / "zookeeper.log",
            server_id=server_id,
            _process=process,
        )

    @property
    def servers(self) -> list[ZooKeeperServer]:
        return [self.server(i) for i in self.server_ids if i in self._processes]

    def member_dir(self, server_id: int) -> Path:
        return self.state_dir / f"zk-{server_id}"

    def running(self, server_id: int) -> bool:
        process = self._processes.get(server_id)
        return process is not None and process.poll() is None

    def modes(self, *, timeout: float = 1.0) -> dict[int, str]:
        """Each member's :func:`server_mode` (``down`` for a member that is not running)."""
        return {
            i: server_mode(HOST, p.client_port, timeout=timeout) if self.running(i) else "down"
            for i, p in self.peers.items()
        }

    def leader(self) -> int | None:
        """The member that reports itself leader right now (None: no leader at the moment)."""
        return next((i for i, mode in self.modes().items() if mode == "leader"), None)

    def wait_for_quorum(self, *, timeout: float = 30.0, members: Iterable[int] = ()) -> int:
        """Wait until a majority of the members serve clients, one of them leading, and so
        do all of ``members``; return the leader's id. Raises :class:`LocalStackError` at the
        deadline, :class:`ExitedWhileStarting` if one of ``members`` exits meanwhile."""
        wanted = sorted(members)
        majority = len(self.peers) // 2 + 1
        deadline = time.monotonic() + timeout
        while True:
            modes = self.modes(timeout=0.5)
            leader = next((i for i, mode in modes.items() if mode == "leader"), None)
            serving = {i for i, mode in modes.items() if mode in SERVING_MODES}
            if leader is not None and len(serving) >= majority and serving.issuperset(wanted):
                return leader
            for i in wanted:
                process = self._processes.get(i)
                if process is not None and process.poll() is not None:
                    log = self.member_dir(i) / "zookeeper.log"
                    raise ExitedWhileStarting(
                        f"ZooKeeper {i} exited with status {process.returncode}; end of "
                        f"{log}:\n{_tail(log)}",
                        returncode=process.returncode,
                    )
            if time.monotonic() >= deadline:
                raise LocalStackError(
                    f"the ZooKeeper ensemble had no quorum (or members {wanted} did not serve) "
                    f"after {timeout:g} s: {modes}"
                )
            time.sleep(POLL_INTERVAL)

    def _running_ids(self) -> list[int]:
        return [i for i in self.server_ids if self.running(i)]

    @property
    def pids(self) -> list[int]:
        return [self._processes[i].pid for i in self._running_ids()]

    # ---- faults -------------------------------------------------------------------------
    def kill(self, server_id: int, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to member ``server_id`` (SIGKILL: a crash, waited for; SIGSTOP and
        SIGCONT freeze and thaw it). A member already gone is not an error."""
        process = self._processes[server_id]
        if process.poll() is None:
            process.send_signal(sig)
            if sig == signal.SIGKILL:
                process.wait(timeout=10)

    def stop(self, server_id: int, *, timeout: float = 10.0) -> int:
        """Stop member ``server_id`` (SIGTERM, ``timeout``, SIGKILL); its exit status."""
        return terminate(self._processes[server_id], timeout=timeout)

    def start(self, *server_ids: int, timeout: float = 30.0, wait: bool = True) -> None:
        """(Re)start members that are not running, on their ports and data. With ``wait``,
        return once they serve (which needs a majority running; see :meth:`wait_for_quorum`)."""
        for i in server_ids:
            if self.running(i):
                raise LocalStackError(f"ZooKeeper {i} is already running")
        for i in server_ids:
            self._spawn(i)
        if wait:
            self.wait_for_quorum(timeout=timeout, members=server_ids)

    def _spawn(self, server_id: int) -> None:
        directory = self.member_dir(server_id)
        directory.mkdir(parents=True, exist_ok=True)
        cfg = write_config(
            directory,
            port=self.peers[server_id].client_port,
            peers=list(self.peers.values()),
            server_id=server_id,
        )
        argv = _java_argv(
            self._java, self._classpath, directory, self._heap_mb, QUORUM_MAIN_CLASS, cfg
        )
        self._processes[server_id] = spawn(
            argv, log_path=directory / "zookeeper.out", die_with_parent=self._die_with_parent
        )

    # ---- lifecycle ----------------------------------------------------------------------
    def close(self, *, timeout: float = 10.0) -> None:
        """Stop every member (SIGTERM to all first, so they stop in parallel)."""
        for process in self._processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self._processes.values():
            terminate(process, timeout=timeout)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _tail(path: Path, limit: int = 3000) -> str:
    with contextlib.suppress(FileNotFoundError):
        return path.read_text(errors="replace")[-limit:]
    return ""


def start_ensemble(
    state_dir: Path,
    *,
    size: int = 3,
    startup_timeout: float = 40.0,
    heap_mb: int = 256,
    die_with_parent: bool = True,
) -> ZooKeeperEnsemble:
    """Start ``size`` ensemble members on free loopback ports; return once all serve.

    ``size`` must be odd (an even ensemble survives no more failures than the odd one below
    it). The members start at once; if one exits while starting (a port taken meanwhile),
    all are stopped and the ensemble is tried again on fresh ports (up to ``PORT_ATTEMPTS``).
    ``die_with_parent`` as in :func:`start_zookeeper`.
    """
    if size < 1 or size % 2 == 0:
        raise LocalStackError(f"a ZooKeeper ensemble needs an odd number of servers, not {size}")
    java = find_java()
    classpath = str(find_jars_dir() / "*")
    state_dir = state_dir.resolve()
    for attempt in range(1, PORT_ATTEMPTS + 1):
        ports = free_ports(3 * size)
        peers = [Peer(i + 1, *ports[3 * i : 3 * i + 3]) for i in range(size)]
        ensemble = ZooKeeperEnsemble(
            state_dir,
            peers,
            java=java,
            classpath=classpath,
            heap_mb=heap_mb,
            die_with_parent=die_with_parent,
        )
        try:
            ensemble.start(*ensemble.server_ids, timeout=startup_timeout)
        except ExitedWhileStarting:
            ensemble.close()
            if attempt == PORT_ATTEMPTS:
                raise
            for i in ensemble.server_ids:  # the next attempt starts from empty members
                shutil.rmtree(ensemble.member_dir(i), ignore_errors=True)
            continue
        except BaseException:
            ensemble.close()
            raise
        return ensemble
    raise AssertionError("unreachable")
