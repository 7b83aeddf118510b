"""A real ZooKeeper server as a child process, for the local stack and the integration tests.

No ZooKeeper download: pyspark's distribution ships the server's jars (``zookeeper``,
``zookeeper-jute``, netty, slf4j, log4j) under ``pyspark/jars/``, so the machine needs only a
Java runtime (17, as Spark wants). The server runs standalone
(``org.apache.zookeeper.server.ZooKeeperServerMain``) from a ``zoo.cfg`` written into the state
directory:

* data (snapshots, transaction log) in ``<state_dir>/data`` — kept across restarts, so a
  local stack stopped and started again finds its metadata; autopurge keeps three snapshots;
* the client port on loopback only (``clientPortAddress=127.0.0.1``); no admin server
  (it would take port 8080); only the ``ruok``, ``srvr`` and ``mntr`` four-letter words;
* ``tickTime`` 500 ms and ``minSessionTimeout`` 1000 ms, so tests can use short session
  timeouts; ``maxSessionTimeout`` 60 s;
* log4j output in ``<state_dir>/zookeeper.log`` (rolled by size); the JVM's own stdout and
  stderr in ``<state_dir>/zookeeper.out``, normally empty.

Readiness: the server answers ``ruok`` with ``imok`` and ``srvr`` with its mode (``srvr``
answers "not currently serving requests" until the database is loaded), probed every 50 ms
up to a deadline. :meth:`ZooKeeperServer.stop` sends SIGTERM, waits, then SIGKILLs.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path

from infra.processes import ChildProcess, LocalStackError, start_on_port

MAIN_CLASS = "org.apache.zookeeper.server.ZooKeeperServerMain"
HOST = "127.0.0.1"

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


def _serving(host: str, port: int) -> bool:
    try:
        return four_letter_word(
            host, port, "ruok", timeout=0.5
        ) == "imok" and "Mode: " in four_letter_word(host, port, "srvr", timeout=0.5)
    except OSError:
        return False


@dataclass(frozen=True, slots=True, kw_only=True)
class ZooKeeperServer(ChildProcess):
    """A running standalone ZooKeeper; stop it with :meth:`stop` or a ``with`` block."""

    host: str
    port: int
    state_dir: Path
    log_path: Path

    @property
    def connect_string(self) -> str:
        """``host:port``, as kazoo takes it (append ``/chroot`` for a chroot)."""
        return f"{self.host}:{self.port}"

    def four_letter_word(self, word: str, *, timeout: float = 1.0) -> str:
        return four_letter_word(self.host, self.port, word, timeout=timeout)


def write_config(state_dir: Path, *, port: int) -> Path:
    """Write ``zoo.cfg`` and ``log4j2.properties`` into ``state_dir``; return zoo.cfg's path."""
    data_dir = state_dir / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    cfg = state_dir / "zoo.cfg"
    cfg.write_text(
        "\n".join(
            [
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
                "",
            ]
        )
    )
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
        return [
            java,
            f"-Xmx{heap_mb}m",
            "-XX:+UseSerialGC",
            "-XX:TieredStopAtLevel=1",
            f"-Dlog4j2.configurationFile={state_dir / 'log4j2.properties'}",
            "-Dzookeeper.jmx.log4j.disable=true",
            "-cp",
            classpath,
            MAIN_CLASS,
            str(write_config(state_dir, port=port)),
        ]

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
