"""The local stack: moto (S3), ZooKeeper, N agents and the admin runtime, all on loopback.

One **supervisor** process owns the stack. It starts, in order, moto in server mode (and
creates the bucket), ZooKeeper (one standalone server, or with ``zookeepers=3`` an ensemble of
three that keeps serving when one fails), the agents (tiering to the bucket, Prometheus
endpoints on free ports), the local handler runtime (the admin API over HTTP) and the delay
scheduler (the delay level topics, and ``infra.event_source`` feeding them to
``handlers.scheduler``); it writes
what it started to ``<state_dir>/stack.json``; then it watches its children until SIGTERM or
SIGINT, and stops them in reverse order (agents before ZooKeeper, so that they leave
cleanly). Every child dies with the supervisor (``PR_SET_PDEATHSIG``), so even a supervisor
killed with SIGKILL leaves no server behind.

``strata local up`` runs the supervisor in the foreground; ``up --detach`` starts it as a
background process in its own session and returns once ``stack.json`` says *healthy*;
``down`` sends the supervisor SIGTERM, waits for it, then makes sure that no process it
recorded survives; ``status`` probes every component.

Everything lives under one directory (``var/local`` by default): ``stack.json``,
``stack.log`` (the supervisor), ``moto/``, ``zookeeper/`` (an ensemble: ``zookeeper/zk-<n>/``),
``agent-<id>/`` (WAL) and ``agent-<id>.log``, ``admin.log``. ``up`` starts from an empty
directory: moto keeps its objects in memory only, so metadata kept from a previous run would
point at objects that are gone.

``secure=True`` (``strata local up --secure``) closes the stack as docs/security.md describes:
a throwaway CA under ``tls/`` signs the agents' certificate; users ``agents`` and ``admin``
(SCRAM-SHA-512, random passwords) are made in ZooKeeper; the agents listen with SASL_SSL on
both listeners and check ACLs, with ``User:agents`` and ``User:admin`` as super users; the
admin runtime and the delay scheduler log in as ``admin`` (``STRATA_CLIENT_*``); the admin
runtime itself asks for HTTP Basic credentials of those users and checks ACLs on its routes
(``STRATA_ADMIN_AUTHORIZER``, the same super users). The client
settings for ``admin`` are in ``stack.json`` (``client``; the state directory is the owner's
alone) and in ``client.properties``; the ``strata`` CLI uses them by itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import boto3
from botocore.config import Config as BotoConfig

from infra.agents import AgentProcess, spawn_agent
from infra.certs import ThrowawayCA
from infra.event_source import EventSourceProcess, start_event_source
from infra.local_runtime import LocalRuntimeProcess, start_local_runtime
from infra.moto_s3 import MotoServer, start_moto
from infra.processes import LocalStackError, spawn, terminate
from infra.zookeeper import (
    SERVING_MODES,
    ZooKeeperEnsemble,
    ZooKeeperServer,
    server_mode,
    start_ensemble,
    start_zookeeper,
)
from sdk.admin import AdminConfig, SyncAdmin
from sdk.config import CLIENT_SECURITY_ENV
from storage import jsonlog
from storage.metadata import AsyncZooKeeper
from storage.metadata.users import ScramCredential, UserStore

log = logging.getLogger("infra.local")

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_STATE_DIR = ROOT / "var" / "local"
STATE_FILE = "stack.json"
BUCKET = "strata-local"
CHROOT = "/strata"
REGION = "us-east-1"
ZOOKEEPER_SIZES = (1, 3, 5)
"""Servers the stack's ZooKeeper may have: an even ensemble survives no more failures than
the odd one below it."""
HEALTHY_TIMEOUT = 60.0
"""``up --detach`` gives up (and stops what started) after this many seconds."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StackConfig:
    state_dir: Path = DEFAULT_STATE_DIR
    agents: int = 3
    zookeepers: int = 1
    """1: a standalone ZooKeeper; 3 or 5: an ensemble (a quorum of that many servers)."""
    bucket: str = BUCKET
    agent_configs: tuple[str, ...] = ()
    """Extra ``key=value`` agent configs (``AgentConfig`` names)."""
    secure: bool = False
    """TLS + SCRAM + ACLs (see the module's docstring)."""

    def __post_init__(self) -> None:
        if not 1 <= self.agents <= 32:
            raise LocalStackError(f"agents must be between 1 and 32, not {self.agents}")
        if self.zookeepers not in ZOOKEEPER_SIZES:
            raise LocalStackError(
                f"zookeepers must be one of {', '.join(map(str, ZOOKEEPER_SIZES))}, "
                f"not {self.zookeepers}"
            )


def s3_env(endpoint_url: str, bucket: str) -> dict[str, str]:
    """What points a process's boto3 (and the agents' tier) at the local S3."""
    return {
        "AWS_ENDPOINT_URL": endpoint_url,
        "AWS_ACCESS_KEY_ID": "local",
        "AWS_SECRET_ACCESS_KEY": "local",
        "AWS_DEFAULT_REGION": REGION,
        "AWS_REGION": REGION,
        "STRATA_BUCKET": bucket,
    }


def s3_client(endpoint_url: str) -> Any:
    return boto3.session.Session(
        aws_access_key_id="local", aws_secret_access_key="local", region_name=REGION
    ).client(
        "s3",
        endpoint_url=endpoint_url,
        config=BotoConfig(
            connect_timeout=2,
            read_timeout=10,
            retries={"max_attempts": 3, "mode": "standard"},
            s3={"addressing_style": "path"},
        ),
    )


# ---------------------------------------------------------------- a secure stack
SECURE_USERS = ("agents", "admin")
MECHANISM = "SCRAM-SHA-512"


@dataclass(frozen=True, slots=True, kw_only=True)
class Security:
    """A secure stack's throwaway CA, the agents' certificate and the users' passwords."""

    cafile: Path
    certfile: Path
    keyfile: Path
    passwords: dict[str, str]

    @classmethod
    def create(cls, directory: Path) -> Security:
        ca = ThrowawayCA.create(directory)
        agent = ca.issue("agent")
        passwords = {user: secrets.token_urlsafe(18) for user in SECURE_USERS}
        return cls(
            cafile=ca.cafile, certfile=agent.certfile, keyfile=agent.keyfile, passwords=passwords
        )

    def agent_configs(self) -> dict[str, object]:
        return {
            "listener.security.protocol": "SASL_SSL",
            "kafka.listener.security.protocol": "SASL_SSL",
            "ssl.certfile": str(self.certfile),
            "ssl.keyfile": str(self.keyfile),
            "ssl.cafile": str(self.cafile),
            "sasl.enabled.mechanisms": MECHANISM,
            "inter.agent.sasl.mechanism": MECHANISM,
            "inter.agent.sasl.username": "agents",
            "inter.agent.sasl.password": self.passwords["agents"],
            "authorizer.enable": "true",
            "super.users": ";".join(f"User:{u}" for u in SECURE_USERS),
        }

    def client(self, user: str = "admin") -> dict[str, str]:
        return {
            "security.protocol": "SASL_SSL",
            "ssl.cafile": str(self.cafile),
            "sasl.mechanism": MECHANISM,
            "sasl.username": user,
            "sasl.password": self.passwords[user],
        }

    def admin_runtime_env(self) -> dict[str, str]:
        """The admin runtime's: it logs in to the agents as ``admin`` and checks ACLs on its
        own routes (``handlers.access``)."""
        return {
            **self.client_env(),
            "STRATA_ADMIN_AUTHORIZER": "1",
            "STRATA_SUPER_USERS": ",".join(f"User:{u}" for u in SECURE_USERS),
        }

    def client_env(self, user: str = "admin") -> dict[str, str]:
        """The same as ``STRATA_CLIENT_*`` (``sdk.config.CLIENT_SECURITY_ENV``)."""
        return {CLIENT_SECURITY_ENV[k]: v for k, v in self.client(user).items()}

    async def add_users(self, zookeeper: str) -> None:
        zk = AsyncZooKeeper(zookeeper)
        await zk.start()
        try:
            users = UserStore(zk)
            for user, password in self.passwords.items():
                cred = await asyncio.to_thread(ScramCredential.make, MECHANISM, password, 4096)
                await users.set(user, MECHANISM, cred)
        finally:
            await zk.stop()


# ---------------------------------------------------------------- the state file


@dataclass(frozen=True, slots=True, kw_only=True)
class AgentInfo:
    agent_id: int
    address: str
    metrics_url: str
    pid: int
    log: str
    kafka: str = ""  # the Kafka listener (docs/kafka.md)


@dataclass(frozen=True, slots=True, kw_only=True)
class ZooKeeperInfo:
    server_id: int
    """The member's ``myid`` in an ensemble; 0 for a standalone server."""
    address: str
    pid: int

    @property
    def name(self) -> str:
        return f"zookeeper {self.server_id}" if self.server_id else "zookeeper"


@dataclass(frozen=True, slots=True, kw_only=True)
class StackState:
    """What ``stack.json`` holds: enough for ``status``, ``down`` and the CLI's defaults."""

    status: str  # "starting" | "healthy" | "degraded" | "stopping"
    supervisor_pid: int
    state_dir: str
    started_at: float
    healthy_after_s: float | None = None
    s3_endpoint: str = ""
    s3_pid: int = 0
    bucket: str = ""
    zookeeper: str = ""
    """The connect string without the chroot: every server's ``host:port``, comma-separated."""
    zookeepers: list[ZooKeeperInfo] = field(default_factory=list)
    chroot: str = CHROOT
    agents: list[AgentInfo] = field(default_factory=list)
    admin_url: str = ""
    admin_pid: int = 0
    scheduler_pid: int = 0
    scheduler_log: str = ""
    problems: list[str] = field(default_factory=list)
    client: dict[str, str] = field(default_factory=dict)
    """A secure stack's client settings (Kafka's names), for its ``admin`` user."""

    @property
    def bootstrap(self) -> str:
        return ",".join(a.address for a in self.agents)

    @property
    def zookeeper_connect(self) -> str:
        return f"{self.zookeeper}{self.chroot}"

    def pids(self) -> list[int]:
        return [
            p for p in (self.scheduler_pid, self.admin_pid, *(a.pid for a in self.agents)) if p
        ] + [p for p in (*(z.pid for z in self.zookeepers), self.s3_pid) if p]

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["bootstrap"] = self.bootstrap
        data["zookeeper_connect"] = self.zookeeper_connect
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StackState:
        values = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        values["agents"] = [AgentInfo(**a) for a in data.get("agents", [])]
        values["zookeepers"] = [ZooKeeperInfo(**z) for z in data.get("zookeepers", [])]
        return cls(**values)


def _write_properties(path: Path, settings: dict[str, str]) -> None:
    """Kafka's client.properties form, readable by the owner only (it holds a password)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.writelines(f"{k}={v}\n" for k, v in settings.items())


def write_state(state: StackState) -> None:
    path = Path(state.state_dir) / STATE_FILE
    tmp = path.with_suffix(".tmp")
    # the owner's alone: a secure stack's client settings hold a password
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(state.to_json(), indent=2))
    os.replace(tmp, path)


def read_state(state_dir: Path = DEFAULT_STATE_DIR) -> StackState | None:
    """The recorded stack (None: no stack.json, or its supervisor is gone)."""
    try:
        data = json.loads((state_dir / STATE_FILE).read_text())
    except (FileNotFoundError, ValueError):
        return None
    state = StackState.from_json(data)
    return state if _alive(state.supervisor_pid) else None


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie child of ours counts as gone
    with contextlib.suppress(OSError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        if stat.rsplit(")", 1)[1].split()[0] == "Z":
            return False
    return True


# ---------------------------------------------------------------- the supervisor


class Stack:
    """The running components (the supervisor's view)."""

    def __init__(self, config: StackConfig) -> None:
        self.config = config
        self.state_dir = config.state_dir.resolve()
        self.moto: MotoServer | None = None
        self.zookeeper: ZooKeeperServer | ZooKeeperEnsemble | None = None
        self.agents: list[AgentProcess] = []
        self.admin: LocalRuntimeProcess | None = None
        self.scheduler: EventSourceProcess | None = None
        self.security: Security | None = None
        self.started_at = time.time()
        self.state = StackState(
            status="starting",
            supervisor_pid=os.getpid(),
            state_dir=str(self.state_dir),
            started_at=self.started_at,
        )

    def start(self) -> StackState:
        """Start every component in order; on any failure stop what started and raise."""
        t0 = time.monotonic()
        self.state_dir.mkdir(parents=True, exist_ok=True)
        write_state(self.state)
        try:
            self.moto = start_moto(self.state_dir / "moto")
            s3_client(self.moto.endpoint_url).create_bucket(Bucket=self.config.bucket)
            log.info("moto (S3) at %s, bucket %s", self.moto.endpoint_url, self.config.bucket)
            if self.config.zookeepers == 1:
                self.zookeeper = start_zookeeper(self.state_dir / "zookeeper")
            else:
                self.zookeeper = start_ensemble(
                    self.state_dir / "zookeeper", size=self.config.zookeepers
                )
            log.info("ZooKeeper at %s", self.zookeeper.connect_string)
            zk = self.zookeeper.connect_string + CHROOT
            env = s3_env(self.moto.endpoint_url, self.config.bucket)
            configs: dict[str, object] = {
                "s3.bucket": self.config.bucket,
                "s3.endpoint.url": self.moto.endpoint_url,
                "s3.region": REGION,
                # one developer's consumers join at once: do not wait 3 s for more members
                "group.initial.rebalance.delay.ms": 300,
            }
            client_env: dict[str, str] = {}
            admin_env: dict[str, str] = {}
            admin_args: tuple[str, ...] = ()
            if self.config.secure:
                self.security = Security.create(self.state_dir / "tls")
                asyncio.run(self.security.add_users(zk))
                configs.update(self.security.agent_configs())
                client_env = self.security.client_env()
                admin_env = self.security.admin_runtime_env()
                admin_args = ("--authenticate",)
                _write_properties(self.state_dir / "client.properties", self.security.client())
            for item in self.config.agent_configs:
                key, _, value = item.partition("=")
                configs[key] = value
            self.agents = start_agents(
                self.config.agents, zk, self.state_dir, configs=configs, env=env
            )
            self.admin = start_local_runtime(
                zk, log_path=self.state_dir / "admin.log", env=admin_env, extra_args=admin_args
            )
            log.info("admin API at %s", self.admin.url)
            self.scheduler = start_delay_scheduler(
                self.admin.url,
                self.agents,
                zk,
                self.state_dir,
                env=client_env,
                admin_config=self.security.client() if self.security is not None else {},
            )
            log.info("delay scheduler started (pid %d)", self.scheduler.pid)
        except BaseException:
            self.stop()
            raise
        self.state = StackState(
            status="healthy",
            supervisor_pid=os.getpid(),
            state_dir=str(self.state_dir),
            started_at=self.started_at,
            healthy_after_s=round(time.monotonic() - t0, 2),
            s3_endpoint=self.moto.endpoint_url,
            s3_pid=self.moto.pid,
            bucket=self.config.bucket,
            zookeeper=self.zookeeper.connect_string,
            zookeepers=[
                ZooKeeperInfo(server_id=z.server_id, address=z.connect_string, pid=z.pid)
                for z in _zookeeper_servers(self.zookeeper)
            ],
            agents=[
                AgentInfo(
                    agent_id=a.agent_id,
                    address=a.address,
                    metrics_url=a.metrics_url,
                    pid=a.pid,
                    kafka=a.kafka,
                    log=str(a.log_path),
                )
                for a in self.agents
            ],
            admin_url=self.admin.url,
            admin_pid=self.admin.pid,
            scheduler_pid=self.scheduler.pid,
            scheduler_log=str(self.scheduler.log_path),
            client=self.security.client() if self.security is not None else {},
        )
        write_state(self.state)
        log.info("healthy after %.2f s", self.state.healthy_after_s or 0)
        return self.state

    def problems(self) -> list[str]:
        """Components whose process has exited."""
        out = []
        if self.moto is not None and not self.moto.running:
            out.append("moto (S3) exited")
        if self.zookeeper is not None:
            for z in _zookeeper_servers(self.zookeeper):
                if not z.running:
                    out.append(
                        f"ZooKeeper {z.server_id} exited" if z.server_id else "ZooKeeper exited"
                    )
        for a in self.agents:
            if a.process.poll() is not None:
                out.append(f"agent {a.agent_id} exited (see {a.log_path})")
        if self.admin is not None and not self.admin.running:
            out.append(f"admin runtime exited (see {self.admin.log_path})")
        if self.scheduler is not None and not self.scheduler.running:
            out.append(f"delay scheduler exited (see {self.scheduler.log_path})")
        return out

    def watch(self, stop: threading.Event, interval: float = 0.5) -> None:
        """Until ``stop`` is set: record components that died in stack.json (degraded)."""
        known: list[str] = []
        while not stop.wait(interval):
            problems = self.problems()
            if problems != known:
                known = problems
                for problem in problems:
                    log.error("%s", problem)
                status = "degraded" if problems else "healthy"
                self.state = _replace(self.state, status=status, problems=problems)
                write_state(self.state)

    def stop(self) -> None:
        """Stop everything that started: admin, agents (in parallel), ZooKeeper, moto."""
        if self.state.status != "starting":
            self.state = _replace(self.state, status="stopping")
            with contextlib.suppress(OSError):
                write_state(self.state)
        if self.scheduler is not None:
            self.scheduler.stop()
        if self.admin is not None:
            self.admin.stop()
        threads = [threading.Thread(target=a.stop) for a in self.agents]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if isinstance(self.zookeeper, ZooKeeperEnsemble):
            self.zookeeper.close()
        elif self.zookeeper is not None:
            self.zookeeper.stop()
        if self.moto is not None:
            self.moto.stop()
        with contextlib.suppress(FileNotFoundError):
            (self.state_dir / STATE_FILE).unlink()
        log.info("stopped")


def _zookeeper_servers(zookeeper: ZooKeeperServer | ZooKeeperEnsemble) -> list[ZooKeeperServer]:
    if isinstance(zookeeper, ZooKeeperEnsemble):
        return zookeeper.servers
    return [zookeeper]


def start_delay_scheduler(
    admin_url: str,
    agents: list[AgentProcess],
    zookeeper: str,
    state_dir: Path,
    *,
    env: dict[str, str] | None = None,
    admin_config: dict[str, str] | None = None,
) -> EventSourceProcess:
    """Create the delay level topics (through the admin API, with ``admin_config``'s
    credentials) and start the event-source runner that feeds them to the scheduler handler
    (``docs/delays.md``)."""
    with SyncAdmin(admin_url, config=admin_config) as admin:
        admin.create_delay_topics()
    bootstrap = ",".join(a.address for a in agents)
    # not waited for: it imports, connects and joins its group while the stack is in use
    return start_event_source(
        bootstrap, zookeeper, log_path=state_dir / "scheduler.log", wait=False, env=env
    )


def _replace(state: StackState, **changes: Any) -> StackState:
    values = {f: getattr(state, f) for f in state.__dataclass_fields__}
    values.update(changes)
    return StackState(**values)


def _port_if_free(host: str, port: int) -> int:
    """``port`` if nothing listens there now, else 0 (any free port)."""
    with socket.socket() as probe:
        try:
            probe.bind((host, port))
        except OSError:
            return 0
    return port


def start_agents(
    n: int,
    zookeeper: str,
    state_dir: Path,
    *,
    configs: dict[str, object],
    env: dict[str, str],
    timeout: float = 30.0,
) -> list[AgentProcess]:
    """Start agents 1..n at once, then wait for each (they start in parallel). Agent i
    listens on Kafka's usual port 9091 + i (9092, 9093, 9094, ...) when it is free and no
    port was configured, else on any free port; its Kafka listener on 19091 + i (19092, ...)
    likewise, unless ``kafka.listener`` is configured."""

    def kafka_listener(agent_id: int) -> dict[str, object]:
        if "kafka.listener" in configs:
            return {}
        host = str(configs.get("listen.host", "127.0.0.1"))
        return {"kafka.listener": f"{host}:{_port_if_free(host, 19091 + agent_id)}"}

    pending = [
        spawn_agent(
            agent_id,
            zookeeper,
            state_dir / f"agent-{agent_id}",
            log_path=state_dir / f"agent-{agent_id}.log",
            configs={**configs, **kafka_listener(agent_id)}
            if "listen.port" in configs
            else {
                **configs,
                **kafka_listener(agent_id),
                "listen.port": _port_if_free(
                    str(configs.get("listen.host", "127.0.0.1")), 9091 + agent_id
                ),
            },
            env=env,
        )
        for agent_id in range(1, n + 1)
    ]
    started: list[AgentProcess] = []
    try:
        for p in pending:
            started.append(p.wait(timeout))
    except BaseException:
        for p in pending:
            terminate(p.process)
        raise
    return started


def _refuse_if_running(state_dir: Path) -> None:
    existing = read_state(state_dir)
    if existing is not None:
        raise LocalStackError(
            f"a local stack is already running in {state_dir} (supervisor pid "
            f"{existing.supervisor_pid}); stop it with `strata local down`"
        )


def _fresh(state_dir: Path) -> None:
    """Empty ``state_dir`` (after checking that no stack runs there)."""
    _refuse_if_running(state_dir)
    shutil.rmtree(state_dir, ignore_errors=True)
    state_dir.mkdir(parents=True)


def supervise(
    config: StackConfig,
    *,
    on_ready: Callable[[StackState], None] | None = None,
    clean: bool = True,
) -> int:
    """Run the stack in this process until SIGTERM or SIGINT (the foreground ``up``).

    ``clean``: start from an empty state directory (``up --detach`` has emptied it already).
    """
    state_dir = config.state_dir.resolve()
    if clean:
        _fresh(state_dir)
    else:
        _refuse_if_running(state_dir)
    log_file = logging.FileHandler(state_dir / "stack.log")
    log_file.setFormatter(jsonlog.json_formatter())
    logging.getLogger().addHandler(log_file)
    logging.getLogger().setLevel(logging.INFO)
    stop = threading.Event()
    previous = {
        sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)
    }
    stack = Stack(config)
    try:
        state = stack.start()
        if on_ready is not None:
            on_ready(state)
        if not stop.is_set():
            stack.watch(stop)
    finally:
        stack.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        logging.getLogger().removeHandler(log_file)
        log_file.close()
    return 0


# ---------------------------------------------------------------- up --detach, down, status


def up_detached(config: StackConfig, *, timeout: float = HEALTHY_TIMEOUT) -> StackState:
    """Start the supervisor in the background; return once stack.json says healthy."""
    state_dir = config.state_dir.resolve()
    _fresh(state_dir)
    argv = [
        sys.executable,
        "-m",
        "infra.cli",
        "local",
        "up",
        "--agents",
        str(config.agents),
        "--zookeepers",
        str(config.zookeepers),
        "--state-dir",
        str(state_dir),
        "--quiet",
        "--no-clean",
    ]
    for item in config.agent_configs:
        argv += ["--agent-config", item]
    if config.secure:
        argv.append("--secure")
    log_path = state_dir / "stack.out"
    process = spawn(argv, log_path=log_path, cwd=ROOT, die_with_parent=False)
    deadline = time.monotonic() + timeout
    while True:
        returncode = process.poll()
        if returncode is not None:
            raise LocalStackError(
                f"the local stack failed to start (status {returncode}); see {log_path} and "
                f"{state_dir / 'stack.log'}:\n{_tail(log_path)}"
            )
        state = read_state(state_dir)
        if state is not None and state.supervisor_pid == process.pid:
            if state.status == "healthy":
                return state
            if state.status == "degraded":
                down(state_dir)
                raise LocalStackError(f"the local stack is degraded: {state.problems}")
        if time.monotonic() > deadline:
            down(state_dir)
            raise LocalStackError(f"the local stack was not healthy after {timeout:g} s")
        time.sleep(0.05)


def _tail(path: Path, limit: int = 3000) -> str:
    with contextlib.suppress(FileNotFoundError):
        return path.read_text(errors="replace")[-limit:]
    return ""


def down(state_dir: Path = DEFAULT_STATE_DIR, *, timeout: float = 30.0) -> list[int]:
    """Stop the stack; return the pids that had to be killed after the supervisor's own stop.

    SIGTERM to the supervisor (which stops its children in order), a wait, then SIGKILL to
    every recorded process group still alive. No stack running is not an error.
    """
    state_dir = state_dir.resolve()
    try:
        data = json.loads((state_dir / STATE_FILE).read_text())
    except (FileNotFoundError, ValueError):
        return []
    state = StackState.from_json(data)
    if _alive(state.supervisor_pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(state.supervisor_pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while _alive(state.supervisor_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if _alive(state.supervisor_pid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(state.supervisor_pid, signal.SIGKILL)
    killed = []
    for pid in state.pids():
        if _alive(pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
            killed.append(pid)
    with contextlib.suppress(FileNotFoundError):
        (state_dir / STATE_FILE).unlink()
    return killed


@dataclass(frozen=True, slots=True)
class ComponentStatus:
    name: str
    endpoint: str
    pid: int
    healthy: bool
    detail: str


def status(state: StackState) -> list[ComponentStatus]:
    """Probe every component of a running stack (each probe bounded to ~1 s)."""
    out = [
        ComponentStatus(
            "s3 (moto)",
            f"{state.s3_endpoint} bucket {state.bucket}",
            state.s3_pid,
            *_probe_s3(state.s3_endpoint, state.bucket),
        ),
        *(
            ComponentStatus(z.name, z.address, z.pid, *_probe_zk(z.address))
            for z in state.zookeepers
        ),
    ]
    for a in state.agents:
        out.append(
            ComponentStatus(
                f"agent {a.agent_id}",
                f"{a.address} kafka {a.kafka or '-'} metrics {a.metrics_url}",
                a.pid,
                *_probe_agent(a),
            )
        )
    out.append(ComponentStatus("admin api", state.admin_url, state.admin_pid, *_probe_admin(state)))
    if state.scheduler_pid:
        alive = _alive(state.scheduler_pid)
        out.append(
            ComponentStatus(
                "delay scheduler",
                state.scheduler_log,
                state.scheduler_pid,
                alive,
                "running" if alive else "not running",
            )
        )
    return out


def _http_ok(url: str, headers: dict[str, str] | None = None) -> tuple[bool, str]:
    try:
        request = urllib.request.Request(url, headers=headers or {})
        with urllib.request.urlopen(request, timeout=1.0) as reply:
            return reply.status == 200, f"HTTP {reply.status}"
    except urllib.error.HTTPError as exc:
        return False, f"HTTP {exc.code}"
    except OSError as exc:
        return False, str(exc)


def _probe_s3(endpoint: str, bucket: str) -> tuple[bool, str]:
    return _http_ok(f"{endpoint}/{bucket}?list-type=2&max-keys=1")


def _probe_zk(host_port: str) -> tuple[bool, str]:
    """Healthy while the server serves clients; the detail is its mode (``standalone``,
    ``leader``, ``follower``; ``not serving``: an ensemble member without a quorum)."""
    host, _, port = host_port.rpartition(":")
    mode = server_mode(host, int(port), timeout=1.0)
    return mode in SERVING_MODES, f"mode: {mode}"


def _probe_agent(agent: AgentInfo) -> tuple[bool, str]:
    host, _, port = agent.address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=1.0):
            pass
    except OSError as exc:
        return False, f"protocol port: {exc}"
    if not agent.metrics_url:
        return True, "serving"
    ok, detail = _http_ok(agent.metrics_url.rsplit("/", 1)[0] + "/health")
    return ok, "serving, ZooKeeper session ok" if ok else f"health: {detail}"


def _probe_admin(state: StackState) -> tuple[bool, str]:
    # a secure stack's runtime wants the admin user's credentials
    basic = AdminConfig.parse(state.client).basic_auth()
    ok, detail = _http_ok(f"{state.admin_url}/topics", {"authorization": basic} if basic else {})
    return ok, "serving" if ok else detail


def measure_healthy(config: StackConfig) -> float:
    """Seconds from ``up --detach`` to healthy (the figure docs/operations.md quotes)."""
    t0 = time.monotonic()
    up_detached(config)
    return time.monotonic() - t0


__all__ = [
    "ComponentStatus",
    "StackConfig",
    "StackState",
    "down",
    "measure_healthy",
    "read_state",
    "status",
    "supervise",
    "up_detached",
]
