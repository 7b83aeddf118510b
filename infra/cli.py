"""``strata``: the command line (topics, produce, consume, groups, replay, the local stack).

Built on Typer (Click) with Rich for tables and progress bars. Where to connect comes from
``--bootstrap`` / ``--admin-url`` (or ``STRATA_BOOTSTRAP`` / ``STRATA_ADMIN_URL``), and
otherwise from the running local stack's ``var/local/stack.json``. ``--output json`` prints
machine-readable JSON (one document per command; ``consume`` prints one JSON object a line).
Errors print one line, ``error: ...``, on stderr and exit with status 1 (2 for bad usage);
Ctrl-C exits with 130.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime as dt
import enum
import json
import os
import sys
import time
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from infra import local
from infra.processes import LocalStackError
from sdk import Consumer, Producer, TopicPartition
from sdk.admin import DeletionStatus, SyncAdmin, TopicDescription
from sdk.config import CLIENT_SECURITY_ENV, client_config, client_security
from storage.errors import (
    GroupIdNotFoundError,
    RequestTimedOutError,
    StrataError,
    UnknownTopicOrPartitionError,
)
from storage.metadata import AsyncZooKeeper
from storage.metadata.groups import GroupRecord, GroupStore

T = TypeVar("T")

app = typer.Typer(
    name="strata",
    help="Strata: topics, produce, consume, consumer groups, replay, and the local stack.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
topics_app = typer.Typer(
    help="Create, list, describe, alter and delete topics.", no_args_is_help=True
)
groups_app = typer.Typer(
    help="Consumer groups: list, describe, reset offsets.", no_args_is_help=True
)
delays_app = typer.Typer(
    help="Delayed records: status of the delay levels, cancel, create the level topics.",
    no_args_is_help=True,
)
retry_app = typer.Typer(
    help="Retry policies of consumer groups, and the retry routers' counters.",
    no_args_is_help=True,
)
dlq_app = typer.Typer(
    help="Dead-letter topics: count, peek, redrive back to a topic.", no_args_is_help=True
)
agents_app = typer.Typer(
    help="Agents: replica and leader counts, decommission.", no_args_is_help=True
)
cluster_app = typer.Typer(
    help="Balancing replicas and preferred leaders across the agents.", no_args_is_help=True
)
local_app = typer.Typer(help="The local stack: moto S3, ZooKeeper, agents, admin API.", no_args_is_help=True)  # fmt: skip
app.add_typer(topics_app, name="topics")
app.add_typer(groups_app, name="groups")
app.add_typer(delays_app, name="delays")
app.add_typer(retry_app, name="retry")
app.add_typer(dlq_app, name="dlq")
app.add_typer(agents_app, name="agents")
app.add_typer(cluster_app, name="cluster")
app.add_typer(local_app, name="local")
users_app = typer.Typer(help="SCRAM users (docs/security.md).", no_args_is_help=True)
acls_app = typer.Typer(help="ACLs: who may do what (docs/security.md).", no_args_is_help=True)
app.add_typer(users_app, name="users")
quotas_app = typer.Typer(
    help="Quotas: bytes and requests per second per principal (docs/security.md).",
    no_args_is_help=True,
)
app.add_typer(acls_app, name="acls")
app.add_typer(quotas_app, name="quotas")

out = Console(soft_wrap=True)
err = Console(stderr=True)


class Output(enum.StrEnum):
    text = "text"
    json = "json"


@dataclass(slots=True)
class Context:
    bootstrap: str | None
    admin_url: str | None
    zookeeper_connect: str | None
    output: Output
    state_dir: Path

    def _stack(self) -> local.StackState | None:
        return local.read_state(self.state_dir)

    def servers(self) -> str:
        if self.bootstrap:
            return self.bootstrap
        stack = self._stack()
        if stack is None:
            raise UsageError(
                "no agents to talk to: pass --bootstrap host:port (or set STRATA_BOOTSTRAP), "
                "or start the local stack with `strata local up --detach`"
            )
        # a secure stack: its client settings, unless STRATA_CLIENT_* says otherwise (every
        # client this process makes reads them there: sdk.config.client_config)
        for key, value in stack.client.items():
            os.environ.setdefault(CLIENT_SECURITY_ENV[key], value)
        return stack.bootstrap

    def zookeeper(self) -> str:
        if self.zookeeper_connect:
            return self.zookeeper_connect
        stack = self._stack()
        if stack is None:
            raise UsageError(
                "group membership is read from ZooKeeper: pass --zookeeper host:port/chroot "
                "(or set STRATA_ZOOKEEPER), or start the local stack"
            )
        return stack.zookeeper_connect

    def admin(self) -> SyncAdmin:
        url = self.admin_url
        if not url:
            stack = self._stack()
            if stack is None:
                raise UsageError(
                    "no admin API to talk to: pass --admin-url (or set STRATA_ADMIN_URL), or "
                    "start the local stack with `strata local up --detach`"
                )
            url = stack.admin_url
        # the credentials in STRATA_CLIENT_*, else a secure local stack's admin user's
        settings = client_security()
        stack = self._stack() if not settings else None
        if stack is not None and url == stack.admin_url:
            settings = dict(stack.client)
        return SyncAdmin(url, timeout=30.0, config=settings)

    @property
    def json(self) -> bool:
        return self.output == Output.json

    def emit(self, data: Any) -> None:
        out.print_json(json.dumps(data, default=str)) if self.json else out.print(data)


_context: Context | None = None


def _ctx() -> Context:
    """The global options of this invocation (set by :func:`main`)."""
    if _context is None:  # pragma: no cover - typer always runs the callback first
        raise RuntimeError("no command-line context")
    return _context


class UsageError(typer.BadParameter):
    """A usage problem that is not one option's value (exit status 2, like Click's)."""


@app.callback()
def main(
    bootstrap: Annotated[
        str | None,
        typer.Option(envvar="STRATA_BOOTSTRAP", help="Agents, host:port[,host:port...]"),
    ] = None,
    admin_url: Annotated[
        str | None, typer.Option(envvar="STRATA_ADMIN_URL", help="The admin API's base URL")
    ] = None,
    zookeeper: Annotated[
        str | None,
        typer.Option(envvar="STRATA_ZOOKEEPER", help="host:port/chroot (groups list/describe)"),
    ] = None,
    output: Annotated[Output, typer.Option("--output", "-o", help="text or json")] = Output.text,
    state_dir: Annotated[
        Path, typer.Option(envvar="STRATA_LOCAL_DIR", help="The local stack's directory")
    ] = local.DEFAULT_STATE_DIR,
) -> None:
    global _context
    _context = Context(bootstrap, admin_url, zookeeper, output, state_dir)


def _run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


@contextlib.contextmanager
def _errors() -> Iterator[None]:
    """Turn the errors a user can cause or fix into one line and exit status 1."""
    try:
        yield
    except (StrataError, LocalStackError) as exc:
        name = type(exc).__name__
        err.print(f"[bold red]error:[/] {exc} [dim]({name})[/]", highlight=False)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        raise typer.Exit(130) from None


def _parse_configs(items: list[str]) -> dict[str, Any]:
    configs: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"{item!r} is not key=value", param_hint="--config")
        configs[key.strip()] = _scalar(value.strip())
    return configs


def _scalar(text: str) -> Any:
    if text.lower() in ("null", "none", "default"):
        return None
    try:
        return int(text)
    except ValueError:
        return text


# ---------------------------------------------------------------- topics


def _describe_table(d: TopicDescription) -> Table:
    table = Table(title=f"{d.name}  ({d.partitions} partitions, RF {d.replication_factor})")
    for col in ("partition", "status", "leader", "epoch", "replicas", "isr"):
        table.add_column(col, justify="right" if col != "status" else "left")
    for p in d.partition_states:
        table.add_row(
            str(p.partition),
            p.status.value,
            str(p.leader),
            str(p.leader_epoch),
            ",".join(map(str, p.replicas)),
            ",".join(map(str, p.isr)),
        )
    return table


@topics_app.command("create")
def topics_create(
    name: str,
    partitions: Annotated[int, typer.Option("--partitions", "-p", min=1)] = 1,
    replication_factor: Annotated[
        int | None,
        typer.Option("--replication-factor", "-r", min=1, help="Default: min(3, agents)"),
    ] = None,
    config: Annotated[
        list[str] | None, typer.Option("--config", "-c", help="key=value (repeatable)")
    ] = None,
) -> None:
    """Create a topic."""
    ctx = _ctx()
    with _errors():
        d = ctx.admin().create_topic(
            name, partitions, replication_factor, _parse_configs(config or [])
        )
    if ctx.json:
        ctx.emit(d.to_json())
    else:
        out.print(
            f"created topic [bold]{d.name}[/] ({d.partitions} partitions, RF {d.replication_factor})"
        )


@topics_app.command("list")
def topics_list() -> None:
    """List topics (and, marked, those being deleted)."""
    ctx = _ctx()
    with _errors():
        admin = ctx.admin()
        names = admin.list_topics()
        deleting = admin.list_deleting_topics()
    if ctx.json:
        ctx.emit({"topics": names, "deleting": deleting})
    else:
        for name in names:
            out.print(name, highlight=False)
        for name in deleting:
            out.print(f"{name} [dim](being deleted)[/]", highlight=False)


@topics_app.command("describe")
def topics_describe(name: str) -> None:
    """Partitions (leader, replicas, ISR) and configs of a topic."""
    ctx = _ctx()
    with _errors():
        d = ctx.admin().describe_topic(name)
    if ctx.json:
        ctx.emit(d.to_json())
        return
    out.print(_describe_table(d))
    configs = Table("config", "value", title="configs")
    for key, value in sorted(d.configs.items()):
        configs.add_row(key, str(value))
    out.print(configs)
    if d.deletion is not None:
        out.print(_deletion_line(d.deletion))


def _deletion_line(s: DeletionStatus) -> str:
    """One line on a delete in progress (``docs/operations.md``, *Deleting a topic*)."""
    age = max(0.0, time.time() - s.requested_ms / 1000)
    text = f"[bold yellow]being deleted[/]: step {s.step_number}/7 {s.step}, asked {age:.0f} s ago"
    if s.objects_total >= 0:
        text += f"; {s.objects_deleted:,} of {s.objects_total:,} segment objects deleted"
        text += f", {s.objects_left:,} left"
    if s.waiting_for:
        text += f"; waiting for agents {', '.join(map(str, s.waiting_for))}"
    if s.last_error:
        text += f"; last error: {s.last_error}"
    return text


@topics_app.command("alter")
def topics_alter(
    name: str,
    config: Annotated[
        list[str] | None, typer.Option("--config", "-c", help="key=value; value 'default' resets")
    ] = None,
    partitions: Annotated[
        int | None, typer.Option("--partitions", "-p", min=1, help="Grow to this many partitions")
    ] = None,
) -> None:
    """Change configs and/or grow the partition count."""
    ctx = _ctx()
    if not config and partitions is None:
        raise UsageError("nothing to alter: give --config key=value and/or --partitions N")
    with _errors():
        admin = ctx.admin()
        d = admin.describe_topic(name)
        if config:
            d = admin.alter_configs(name, _parse_configs(config))
        if partitions is not None and partitions != d.partitions:
            d = admin.create_partitions(name, partitions)
    if ctx.json:
        ctx.emit(d.to_json())
    else:
        out.print(f"altered topic [bold]{d.name}[/] ({d.partitions} partitions)")


@topics_app.command("delete")
def topics_delete(
    name: str,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask")] = False,
    wait: Annotated[
        float | None,
        typer.Option("--wait", help="Wait up to this many seconds for the delete to complete"),
    ] = None,
) -> None:
    """Delete a topic and its data (offsets, tiered objects, snapshots) in the background."""
    ctx = _ctx()
    if not yes and sys.stdin.isatty():
        typer.confirm(f"delete topic {name} and all its data?", abort=True)
    with _errors():
        admin = ctx.admin()
        d = admin.delete_topic(name)
        done = False
        if wait is not None:
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline:
                try:
                    d = admin.describe_topic(name)
                except UnknownTopicOrPartitionError:
                    done = True
                    break
                time.sleep(0.5)
            if not done:
                raise RequestTimedOutError(
                    f"topic {name!r} is still being deleted after {wait:g} s "
                    f"(step {d.deletion.step if d.deletion else '?'}); see topics describe"
                )
    if ctx.json:
        ctx.emit({"deleted": name, "done": done, "deletion": d.to_json()["deletion"]})
    elif done:
        out.print(f"deleted topic [bold]{name}[/]")
    else:
        out.print(f"deleting topic [bold]{name}[/] (in the background; see topics describe)")


@topics_app.command("reassign")
def topics_reassign(
    name: str,
    partition: int,
    replicas: Annotated[str, typer.Option(help="Agent ids, the preferred leader first: 4,1,2")],
) -> None:
    """Move a partition onto other agents; the new replicas catch up before old ones go."""
    ctx = _ctx()
    try:
        ids = [int(x) for x in replicas.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--replicas {replicas!r}: comma-separated agent ids") from None
    with _errors():
        state = ctx.admin().reassign_partition(name, partition, ids)
    if ctx.json:
        ctx.emit(state)
    else:
        out.print(
            f"{name}-{partition}: moving to {ids} (adding {state['adding']},"
            f" removing {state['removing']})"
        )


# ---------------------------------------------------------------- agents and balancing


@agents_app.command("list")
def agents_list() -> None:
    """Agents with their replica and leader counts."""
    ctx = _ctx()
    with _errors():
        agents = ctx.admin().list_agents()
    if ctx.json:
        ctx.emit({"agents": agents})
        return
    table = Table("agent", "address", "alive", "replicas", "leaders", "decommissioning")
    for a in agents:
        address = f"{a['host']}:{a['port']}" if a["alive"] else "-"
        table.add_row(
            str(a["agent_id"]),
            address,
            "yes" if a["alive"] else "no",
            str(a["replicas"]),
            str(a["leaders"]),
            "yes" if a["decommissioning"] else "",
        )
    out.print(table)


@agents_app.command("decommission")
def agents_decommission(
    agent_id: int,
    undo: Annotated[bool, typer.Option("--undo", help="Let the agent hold replicas again")] = False,
) -> None:
    """Drain an agent: its replicas move to the others; then it can be stopped for good."""
    ctx = _ctx()
    with _errors():
        admin = ctx.admin()
        entry = admin.recommission_agent(agent_id) if undo else admin.decommission_agent(agent_id)
    if ctx.json:
        ctx.emit(entry)
    elif undo:
        out.print(f"agent {agent_id} may hold replicas again")
    else:
        out.print(
            f"decommissioning agent {agent_id}: {entry['replicas']} replicas to move"
            " (see agents list)"
        )


@users_app.command("list")
def users_list() -> None:
    """Users and the SCRAM mechanisms each has a credential for."""
    ctx = _ctx()
    with _errors():
        users = ctx.admin().list_users()
    if ctx.json:
        ctx.emit({"users": users})
        return
    table = Table("user", "mechanisms")
    for name, mechs in users.items():
        table.add_row(name, ", ".join(mechs))
    out.print(table)


@users_app.command("set")
def users_set(
    name: str,
    mechanism: Annotated[
        list[str] | None, typer.Option("--mechanism", help="SCRAM-SHA-256 / SCRAM-SHA-512")
    ] = None,
) -> None:
    """Create a user or change its password (asked for, or STRATA_USER_PASSWORD)."""
    ctx = _ctx()
    password = os.environ.get("STRATA_USER_PASSWORD") or typer.prompt(
        "password", hide_input=True, confirmation_prompt=True
    )
    with _errors():
        entry = ctx.admin().set_user(name, password, mechanism or None)
    if ctx.json:
        ctx.emit(entry)
    else:
        out.print(f"user {name}: {', '.join(entry['mechanisms'])}")


@users_app.command("delete")
def users_delete(name: str) -> None:
    """Delete a user (its open connections stay; new logins fail)."""
    ctx = _ctx()
    with _errors():
        deleted = ctx.admin().delete_user(name)
    if ctx.json:
        ctx.emit({"deleted": deleted})
    else:
        out.print(f"user {name} {'deleted' if deleted else 'did not exist'}")


def _binding(
    principal: str, resource: str, operation: str, deny: bool, prefixed: bool
) -> dict[str, str]:
    rtype, _, name = resource.partition(":")
    if not name:
        raise typer.BadParameter("--resource is TYPE:NAME, e.g. topic:orders or group:billing")
    return {
        "principal": principal,
        "resource_type": rtype,
        "name": name,
        "operation": operation,
        "permission": "deny" if deny else "allow",
        "pattern_type": "prefixed" if prefixed else "literal",
    }


@acls_app.command("list")
def acls_list() -> None:
    """Every ACL binding."""
    ctx = _ctx()
    with _errors():
        acls = ctx.admin().list_acls()
    if ctx.json:
        ctx.emit({"acls": acls})
        return
    table = Table("principal", "permission", "operation", "resource", "name", "pattern")
    for a in acls:
        table.add_row(
            a["principal"],
            a["permission"],
            a["operation"],
            a["resource_type"],
            a["name"],
            a["pattern_type"],
        )
    out.print(table)


@acls_app.command("add")
def acls_add(
    principal: Annotated[str, typer.Option("--principal", help="User:<name> or User:*")],
    resource: Annotated[
        str, typer.Option("--resource", help="topic|group|cluster|transactional_id:NAME")
    ],
    operation: Annotated[
        str, typer.Option("--operation", help="read|write|create|delete|alter|describe|all")
    ],
    deny: Annotated[bool, typer.Option("--deny", help="A deny (deny wins)")] = False,
    prefixed: Annotated[bool, typer.Option("--prefixed", help="NAME is a prefix")] = False,
) -> None:
    """Add one ACL binding."""
    ctx = _ctx()
    with _errors():
        added = ctx.admin().add_acls([_binding(principal, resource, operation, deny, prefixed)])
    if ctx.json:
        ctx.emit({"acls": added})
    else:
        out.print(f"added {len(added)} ACL")


@acls_app.command("remove")
def acls_remove(
    principal: Annotated[str, typer.Option("--principal")],
    resource: Annotated[str, typer.Option("--resource")],
    operation: Annotated[str, typer.Option("--operation")],
    deny: Annotated[bool, typer.Option("--deny")] = False,
    prefixed: Annotated[bool, typer.Option("--prefixed")] = False,
) -> None:
    """Remove one ACL binding."""
    ctx = _ctx()
    with _errors():
        removed = ctx.admin().remove_acls(
            [_binding(principal, resource, operation, deny, prefixed)]
        )
    if ctx.json:
        ctx.emit({"removed": removed})
    else:
        out.print(f"removed {removed} ACL")


QUOTA_RATES = ("producer_byte_rate", "consumer_byte_rate", "request_rate")


@quotas_app.command("list")
def quotas_list() -> None:
    """Every quota (User:* is the default for principals without their own); - is unlimited."""
    ctx = _ctx()
    with _errors():
        quotas = ctx.admin().list_quotas()
    if ctx.json:
        ctx.emit({"quotas": quotas})
        return
    table = Table("principal", "producer bytes/s", "consumer bytes/s", "requests/s")
    for principal, rates in quotas.items():
        table.add_row(principal, *(str(rates.get(k, "-")) for k in QUOTA_RATES))
    out.print(table)


@quotas_app.command("set")
def quotas_set(
    principal: Annotated[str, typer.Option("--principal", help="User:<name> or User:*")],
    producer_byte_rate: Annotated[
        int | None, typer.Option("--producer-byte-rate", help="Bytes produced per second")
    ] = None,
    consumer_byte_rate: Annotated[
        int | None, typer.Option("--consumer-byte-rate", help="Bytes fetched per second")
    ] = None,
    request_rate: Annotated[
        int | None, typer.Option("--request-rate", help="Requests per second")
    ] = None,
) -> None:
    """Replace a principal's quota: rates left out are unlimited (none given: removed)."""
    ctx = _ctx()
    with _errors():
        entry = ctx.admin().set_quota(
            principal, producer_byte_rate, consumer_byte_rate, request_rate
        )
    if ctx.json:
        ctx.emit(entry)
        return
    rates = ", ".join(f"{k}={v}" for k, v in entry["quota"].items())
    said = f": {rates}" if rates else " removed (User:*'s applies, if any)"
    out.print(f"quota of {principal}{said}", highlight=False)


@quotas_app.command("delete")
def quotas_delete(
    principal: Annotated[str, typer.Option("--principal", help="User:<name> or User:*")],
) -> None:
    """Remove a principal's quota (it falls back to User:*'s, if any)."""
    ctx = _ctx()
    with _errors():
        deleted = ctx.admin().delete_quota(principal)
    if ctx.json:
        ctx.emit({"deleted": deleted})
    else:
        out.print(
            f"quota of {principal} {'deleted' if deleted else 'did not exist'}", highlight=False
        )


@cluster_app.command("rebalance")
def cluster_rebalance(
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Show the plan only")] = False,
) -> None:
    """Spread replicas and preferred leaders evenly; the controller moves a few at a time."""
    ctx = _ctx()
    with _errors():
        plan = ctx.admin().rebalance(dry_run=dry_run)
    if ctx.json:
        ctx.emit(plan)
        return
    table = Table("partition", "replicas now", "after", "copies", title="moves")
    for m in plan["moves"]:
        table.add_row(
            f"{m['topic']}-{m['partition']}",
            ",".join(map(str, m["before"])),
            ",".join(map(str, m["after"])),
            ",".join(map(str, m["copies"])) or "-",
        )
    out.print(table)
    counts = Table("agent", "replicas", "preferred leaders", title="after the plan")
    for a, n in plan["replicas"].items():
        counts.add_row(a, str(n), str(plan["preferred_leaders"].get(a, 0)))
    out.print(counts)
    verb = "would move" if dry_run else "moving"
    out.print(f"{verb} {len(plan['moves'])} partition(s)")


@cluster_app.command("elect-leaders")
def cluster_elect_leaders(
    topic: Annotated[list[str] | None, typer.Option(help="Only these topics")] = None,
) -> None:
    """Move leadership to each partition's first replica (its preferred leader) if in sync."""
    ctx = _ctx()
    with _errors():
        ctx.admin().elect_preferred_leaders(topic or None)
    if ctx.json:
        ctx.emit({"requested": topic or "all"})
    else:
        out.print(f"preferred-leader election requested for {', '.join(topic or ['all topics'])}")


# ---------------------------------------------------------------- produce


@dataclass(slots=True)
class _Message:
    value: bytes | None
    key: bytes | None
    headers: list[tuple[str, bytes]]
    tags: list[str]
    partition: int | None


def _as_bytes(value: Any) -> bytes | None:
    if value is None:
        return None
    if isinstance(value, str):
        return value.encode()
    return json.dumps(value, separators=(",", ":")).encode()


def parse_message(
    line: str, *, as_json: bool, key: str | None, headers: list[tuple[str, bytes]], tags: list[str]
) -> _Message:
    """One stdin line as a message. With ``as_json`` the line is an object with ``value``
    (a string, or any JSON value, sent as compact JSON) and optional ``key``, ``headers``
    (object), ``tags`` (list) and ``partition``; the command-line ones are defaults."""
    if not as_json:
        return _Message(line.encode(), _as_bytes(key), headers, tags, None)
    try:
        obj = json.loads(line)
    except ValueError as exc:
        raise typer.BadParameter(f"not JSON: {exc}: {line[:80]!r}") from None
    if not isinstance(obj, dict) or "value" not in obj:
        raise typer.BadParameter(f'a JSON line must be an object with "value": {line[:80]!r}')
    hdrs = headers + [(str(k), _as_bytes(v) or b"") for k, v in (obj.get("headers") or {}).items()]
    return _Message(
        _as_bytes(obj["value"]),
        _as_bytes(obj.get("key", key)),
        hdrs,
        tags + [str(t) for t in obj.get("tags") or []],
        obj.get("partition"),
    )


def _progress(total: int | None, description: str, *, enabled: bool) -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TaskProgressColumn(),
        TimeElapsedColumn(),
        console=err,
        disable=not enabled,
        transient=False,
    )


async def _produce(
    servers: str,
    topic: str,
    lines: Iterator[str],
    make: Callable[[str], _Message],
    *,
    acks: str,
    progress: Progress,
) -> dict[int, tuple[int, int, int]]:
    """Send every line; return {partition: (count, first offset, last offset)}."""
    task = progress.add_task(f"produce → {topic}", total=None)
    per_partition: dict[int, tuple[int, int, int]] = {}

    def done(fut: asyncio.Future[Any]) -> None:
        if fut.cancelled() or fut.exception() is not None:
            return
        md = fut.result()
        count, first, last = per_partition.get(md.partition, (0, md.offset, md.offset))
        per_partition[md.partition] = (count + 1, min(first, md.offset), max(last, md.offset))
        progress.advance(task)

    async with Producer(client_config(servers, {"acks": acks, "linger.ms": 5})) as producer:
        futures = []
        for line in lines:
            msg = make(line)
            fut = await producer.send(
                topic, msg.value, msg.key, msg.headers or None, msg.tags or None, msg.partition
            )
            fut.add_done_callback(done)
            futures.append(fut)
            if len(futures) >= 10_000:
                await asyncio.gather(*futures)
                futures.clear()
        await producer.flush()
        await asyncio.gather(*futures)
    return per_partition


@app.command()
def produce(
    topic: str,
    key: Annotated[str | None, typer.Option("--key", "-k", help="Key of every message")] = None,
    header: Annotated[
        list[str] | None, typer.Option("--header", "-H", help="name=value (repeatable)")
    ] = None,
    tag: Annotated[list[str] | None, typer.Option("--tag", "-t", help="Tag (repeatable)")] = None,
    json_lines: Annotated[
        bool,
        typer.Option(
            "--json", help='Each line is {"value", "key", "headers", "tags", "partition"}'
        ),
    ] = False,
    acks: Annotated[str, typer.Option(help="0, 1 or all")] = "all",
    progress: Annotated[
        bool | None, typer.Option("--progress/--no-progress", help="Default: when on a terminal")
    ] = None,
) -> None:
    """Produce one message per line of stdin."""
    ctx = _ctx()
    headers = []
    for item in header or []:
        name, sep, value = item.partition("=")
        if not sep:
            raise typer.BadParameter(f"{item!r} is not name=value", param_hint="--header")
        headers.append((name, value.encode()))

    def make(line: str) -> _Message:
        return parse_message(line, as_json=json_lines, key=key, headers=headers, tags=tag or [])

    lines = (ln.rstrip("\n") for ln in sys.stdin if ln.strip())
    show = err.is_terminal if progress is None else progress
    started = time.perf_counter()
    with _errors(), _progress(None, topic, enabled=show) as bar:
        result = _run(_produce(ctx.servers(), topic, lines, make, acks=acks, progress=bar))
    seconds = time.perf_counter() - started
    total = sum(c for c, _, _ in result.values())
    if ctx.json:
        ctx.emit(
            {
                "topic": topic,
                "messages": total,
                "seconds": round(seconds, 3),
                "partitions": {
                    str(p): {"messages": c, "first_offset": f, "last_offset": la}
                    for p, (c, f, la) in sorted(result.items())
                },
            }
        )
    else:
        out.print(f"produced {total:,} messages to [bold]{topic}[/] in {seconds:.2f} s")


# ---------------------------------------------------------------- consume


def parse_timestamp(text: str) -> int:
    """Milliseconds since the epoch, from an integer or an ISO 8601 date/time (UTC if naive)."""
    with contextlib.suppress(ValueError):
        return int(text)
    try:
        when = dt.datetime.fromisoformat(text)
    except ValueError:
        raise typer.BadParameter(
            f"{text!r} is neither epoch milliseconds nor an ISO 8601 time", param_hint="--timestamp"
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.UTC)
    return int(when.timestamp() * 1000)


def _text(data: bytes | None) -> str | None:
    if data is None:
        return None
    try:
        return data.decode()
    except UnicodeDecodeError:
        return "base64:" + base64.b64encode(data).decode()


def record_json(r: Any) -> dict[str, Any]:
    return {
        "topic": r.topic,
        "partition": r.partition,
        "offset": r.offset,
        "timestamp": r.timestamp,
        "key": _text(r.key),
        "value": _text(r.value),
        "headers": {k: _text(v) for k, v in r.headers},
        "tags": list(r.tags),
    }


@dataclass(frozen=True, slots=True)
class ConsumeRequest:
    topic: str
    group: str | None
    partitions: list[int] | None
    offset: int | None
    timestamp: int | None
    from_beginning: bool
    follow: bool
    max_messages: int | None
    idle_s: float


async def consume_records(
    servers: str, req: ConsumeRequest, partition_count: int, sink: Callable[[Any], None]
) -> int:
    """Consume per ``req`` and hand each record to ``sink``; return how many."""
    config = client_config(
        servers,
        {"auto.offset.reset": "earliest" if req.from_beginning or req.group is None else "latest"},
    )
    if req.group is not None:
        config |= {"group.id": req.group, "enable.auto.commit": False}
    count = 0
    async with Consumer(config) as consumer:
        ends: dict[TopicPartition, int] | None = None
        if req.group is not None and req.partitions is None:
            consumer.subscribe([req.topic])
        else:
            tps = [TopicPartition(req.topic, p) for p in (req.partitions or range(partition_count))]
            consumer.assign(tps)
            if req.timestamp is not None:
                found = await consumer.offsets_for_times({tp: req.timestamp for tp in tps})
                ends_now = await consumer.end_offsets(tps)
                for tp in tps:
                    hit = found.get(tp)
                    consumer.seek(tp, hit.offset if hit is not None else ends_now[tp])
            elif req.offset is not None:
                for tp in tps:
                    consumer.seek(tp, req.offset)
            elif req.group is None and not req.from_beginning and req.follow:
                consumer.seek_to_end(*tps)
            if not req.follow:
                ends = await consumer.end_offsets(tps)
        idle_since = time.monotonic()
        while True:
            got = await consumer.getmany(timeout_ms=200)
            for records in got.values():
                for r in records:
                    sink(r)
                    count += 1
                    if req.max_messages is not None and count >= req.max_messages:
                        break
            if got or not consumer.assignment():  # idle counts once partitions are assigned
                idle_since = time.monotonic()
                if req.group is not None:
                    await consumer.commit()
            if req.max_messages is not None and count >= req.max_messages:
                break
            if ends is not None and await _reached_all(consumer, ends):
                break
            if not req.follow and ends is None and time.monotonic() - idle_since > req.idle_s:
                break
        if req.group is not None and count:
            await consumer.commit()
    return count


async def _reached_all(consumer: Consumer, ends: dict[TopicPartition, int]) -> bool:
    for tp, end in ends.items():
        if await consumer.position(tp) < end:
            return False
    return True


@app.command()
def consume(
    topic: str,
    group: Annotated[
        str | None, typer.Option("--group", "-g", help="Consume as this group")
    ] = None,
    partition: Annotated[
        list[int] | None, typer.Option("--partition", "-p", help="Only these partitions")
    ] = None,
    offset: Annotated[int | None, typer.Option(help="Start at this offset")] = None,
    timestamp: Annotated[
        str | None, typer.Option(help="Start at this time (epoch ms or ISO 8601)")
    ] = None,
    from_beginning: Annotated[bool, typer.Option("--from-beginning")] = False,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep waiting for more")] = False,
    max_messages: Annotated[int | None, typer.Option("--max-messages", "-n", min=1)] = None,
    idle: Annotated[
        float, typer.Option(help="Group mode without --follow: stop after this idle time (s)")
    ] = 3.0,
    show_keys: Annotated[bool, typer.Option("--keys", help="Print key<TAB>value")] = False,
) -> None:
    """Print messages: values one per line, or JSON objects with --output json.

    Without --follow it stops at the end offsets as of its start (or, in a group, after
    --idle seconds without messages).
    """
    ctx = _ctx()
    start_ts = parse_timestamp(timestamp) if timestamp is not None else None
    req = ConsumeRequest(
        topic, group, partition, offset, start_ts, from_beginning, follow, max_messages, idle
    )

    def sink(r: Any) -> None:
        if ctx.json:
            sys.stdout.write(json.dumps(record_json(r)) + "\n")
        elif show_keys:
            sys.stdout.write(f"{_text(r.key) or ''}\t{_text(r.value) or ''}\n")
        else:
            sys.stdout.write(f"{_text(r.value) or ''}\n")

    with _errors():
        count_partitions = 0
        if group is None or partition is not None:
            count_partitions = ctx.admin().describe_topic(topic).partitions
        count = _run(consume_records(ctx.servers(), req, count_partitions, sink))
        sys.stdout.flush()
    if not ctx.json:
        err.print(f"[dim]{count:,} messages[/]")


# ---------------------------------------------------------------- groups
#
# Reads of group membership come from ZooKeeper (read-only: list, members, the topics a group
# has offsets for); committed offsets are read and reset through the group coordinator (the
# agents' OffsetFetch / OffsetCommit), so a coordinator's cached offsets never go stale. A
# reset is a commit with no generation, which the coordinator accepts only for a group
# without members.


async def _with_groups(zookeeper: str, fn: Callable[[GroupStore], Coroutine[Any, Any, T]]) -> T:
    zk = AsyncZooKeeper(zookeeper, session_timeout=10.0, request_timeout=5.0)
    await zk.start()
    try:
        return await fn(GroupStore(zk))
    finally:
        await zk.stop()


async def _group_offsets(
    servers: str, group: str, topics: list[str]
) -> list[tuple[str, int, int | None, int]]:
    """(topic, partition, committed or None, end offset) for every partition of ``topics``."""
    rows: list[tuple[str, int, int | None, int]] = []
    async with (
        Consumer(client_config(servers, {"group.id": group})) as consumer,
        Producer(client_config(servers)) as producer,
    ):
        for topic in topics:
            tps = [TopicPartition(topic, p) for p in await producer.partitions_for(topic)]
            ends = await consumer.end_offsets(tps)
            for tp in tps:
                committed = await consumer.committed(tp)
                rows.append(
                    (topic, tp.partition, None if committed is None else committed.offset, ends[tp])
                )
    return rows


@groups_app.command("list")
def groups_list() -> None:
    """List consumer groups."""
    ctx = _ctx()
    with _errors():
        names = _run(_with_groups(ctx.zookeeper(), lambda store: store.list_groups()))
    if ctx.json:
        ctx.emit({"groups": names})
    else:
        for name in names:
            out.print(name, highlight=False)


@groups_app.command("describe")
def groups_describe(group: str) -> None:
    """Members, committed offsets and lag (in messages) of a group."""
    ctx = _ctx()

    async def read(store: GroupStore) -> tuple[GroupRecord | None, list[str], bool]:
        record, _ = await store.get_state(group)
        # offsets of deleted topics (or of an older incarnation of a name) are never shown
        return record, sorted(await store.live_offsets(group)), await store.exists(group)

    with _errors():
        record, topics, exists = _run(_with_groups(ctx.zookeeper(), read))
        if record is None and not exists:
            raise GroupIdNotFoundError(f"no group {group!r}")
        rows = _run(_group_offsets(ctx.servers(), group, topics))
    members = [m.member_id for m in record.members] if record is not None else []
    lag_rows = [
        {
            "topic": t,
            "partition": p,
            "committed": c,
            "end_offset": e,
            "lag": None if c is None else max(0, e - c),
        }
        for t, p, c, e in rows
    ]
    if ctx.json:
        ctx.emit(
            {
                "group": group,
                "phase": record.phase if record is not None else "empty",
                "generation": record.generation if record is not None else 0,
                "members": members,
                "offsets": lag_rows,
                "total_lag": sum(r["lag"] or 0 for r in lag_rows),
            }
        )
        return
    phase = record.phase if record is not None else "empty"
    out.print(f"group [bold]{group}[/]: {phase}, {len(members)} member(s)")
    table = Table("topic", "partition", "committed", "end offset", "lag")
    for r in lag_rows:
        table.add_row(
            str(r["topic"]),
            str(r["partition"]),
            "-" if r["committed"] is None else str(r["committed"]),
            str(r["end_offset"]),
            "-" if r["lag"] is None else str(r["lag"]),
        )
    out.print(table)


async def reset_offsets(
    servers: str,
    group: str,
    topic: str,
    *,
    to_offset: int | None,
    to_earliest: bool,
    to_latest: bool,
    to_timestamp: int | None,
    shift_by: int | None,
) -> dict[TopicPartition, int]:
    """Commit new offsets for every partition of ``topic`` (the group must have no members)."""
    async with (
        Consumer(client_config(servers, {"group.id": group})) as consumer,
        Producer(client_config(servers)) as producer,
    ):
        tps = [TopicPartition(topic, p) for p in await producer.partitions_for(topic)]
        starts = await consumer.beginning_offsets(tps)
        ends = await consumer.end_offsets(tps)
        targets: dict[TopicPartition, int] = {}
        if to_timestamp is not None:
            found = await consumer.offsets_for_times({tp: to_timestamp for tp in tps})
        for tp in tps:
            if to_earliest:
                target = starts[tp]
            elif to_latest:
                target = ends[tp]
            elif to_offset is not None:
                target = to_offset
            elif to_timestamp is not None:
                hit = found.get(tp)
                target = ends[tp] if hit is None else hit.offset
            else:
                committed = await consumer.committed(tp)
                target = (ends[tp] if committed is None else committed.offset) + (shift_by or 0)
            targets[tp] = min(max(target, starts[tp]), ends[tp])
        await consumer.commit(targets)
    return targets


@groups_app.command("reset")
def groups_reset(
    group: str,
    topic: Annotated[str, typer.Option("--topic", "-t", help="Reset this topic's offsets")],
    to_earliest: Annotated[bool, typer.Option("--to-earliest")] = False,
    to_latest: Annotated[bool, typer.Option("--to-latest")] = False,
    to_offset: Annotated[int | None, typer.Option("--to-offset")] = None,
    to_datetime: Annotated[
        str | None, typer.Option("--to-datetime", help="Epoch ms or ISO 8601")
    ] = None,
    shift_by: Annotated[int | None, typer.Option("--shift-by")] = None,
) -> None:
    """Move a group's committed offsets (the group must have no active members)."""
    ctx = _ctx()
    chosen = [to_earliest, to_latest, to_offset is not None, to_datetime is not None]
    chosen.append(shift_by is not None)
    if sum(chosen) != 1:
        raise UsageError(
            "choose exactly one of --to-earliest, --to-latest, --to-offset, --to-datetime, "
            "--shift-by"
        )
    ts = parse_timestamp(to_datetime) if to_datetime is not None else None
    with _errors():
        targets = _run(
            reset_offsets(
                ctx.servers(),
                group,
                topic,
                to_offset=to_offset,
                to_earliest=to_earliest,
                to_latest=to_latest,
                to_timestamp=ts,
                shift_by=shift_by,
            )
        )
    if ctx.json:
        ctx.emit(
            {
                "group": group,
                "topic": topic,
                "offsets": {str(tp.partition): o for tp, o in targets.items()},
            }
        )
    else:
        for tp, offset in sorted(targets.items()):
            out.print(f"{group} {tp.topic}-{tp.partition} -> {offset}")


@groups_app.command("delete")
def groups_delete(
    group: str, yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask")] = False
) -> None:
    """Delete a group with no active members: its committed offsets and metadata."""
    ctx = _ctx()
    if not yes and sys.stdin.isatty():
        typer.confirm(f"delete group {group} and its committed offsets?", abort=True)
    with _errors():
        ctx.admin().delete_group(group)
    ctx.emit({"deleted": group}) if ctx.json else out.print(f"deleted group [bold]{group}[/]")


# ---------------------------------------------------------------- delays


@delays_app.command("status")
def delays_status() -> None:
    """Pending records per delay level, cancels, and each scheduler's counters and lateness."""
    ctx = _ctx()
    with _errors(), ctx.admin() as admin:
        status = admin.delays_status()
    if ctx.json:
        ctx.emit(status)
        return
    table = Table("level", "delay", "pending", box=None)
    for level in status["levels"]:
        table.add_row(level["topic"], _duration(level["delay_ms"]), str(level["pending"]))
    out.print(table)
    out.print(f"pending {status['pending']}, cancelled (kept) {status['cancels']}")
    for name, stats in sorted(status["schedulers"].items()):
        bounds, counts = stats["lateness_buckets_ms"], stats["lateness_counts"]
        lateness = ", ".join(
            f"<={b}ms {c}" for b, c in zip([*bounds, "inf"], counts, strict=True) if c
        )
        out.print(
            f"{name}: delivered {stats['delivered']}, hops {stats['hops']}, cancelled "
            f"{stats['cancelled']}, dropped {stats['dropped']}, redone {stats['redone']}; "
            f"lateness {lateness or '-'}"
        )


def _duration(ms: int) -> str:
    for unit, size in (("d", 86_400_000), ("h", 3_600_000), ("min", 60_000), ("s", 1000)):
        if ms >= size:
            return f"{ms / size:.3g} {unit}"
    return f"{ms} ms"


@delays_app.command("cancel")
def delays_cancel(schedule_id: str) -> None:
    """Cancel a delayed record by the id its send returned; says whether it was in time."""
    ctx = _ctx()
    with _errors(), ctx.admin() as admin:
        cancelled = admin.cancel_scheduled(schedule_id)
    if ctx.json:
        ctx.emit({"schedule_id": schedule_id, "cancelled": cancelled})
    else:
        out.print("cancelled in time" if cancelled else "too late: it was delivered already")
    if not cancelled:
        raise typer.Exit(3)


@delays_app.command("init")
def delays_init(
    partitions: Annotated[int | None, typer.Option(help="Lanes per level (default 4)")] = None,
    replication_factor: Annotated[int | None, typer.Option()] = None,
) -> None:
    """Create the delay level topics that are missing (``strata local up`` does it)."""
    ctx = _ctx()
    with _errors(), ctx.admin() as admin:
        result = admin.create_delay_topics(partitions, replication_factor)
    ctx.emit(result) if ctx.json else out.print(
        f"created {len(result['created'])}, existing {len(result['existing'])}"
    )


# ---------------------------------------------------------------- retries and dead letters


@retry_app.command("set")
def retry_set(group: str, topic: str, policy: Annotated[str, typer.Argument(help="JSON")]) -> None:
    """Declare GROUP's retry policy for TOPIC, e.g. '{"initial_ms": 1000, "max_attempts": 8,
    "dead_letter_topic": "orders.dlq"}' (docs/retries.md); creates the topics it needs."""
    ctx = _ctx()
    try:
        body = json.loads(policy)
    except ValueError as exc:
        raise typer.BadParameter(f"not JSON: {exc}", param_hint="POLICY") from None
    with _errors(), ctx.admin() as admin:
        result = admin.set_retry_policy(group, topic, body)
    if ctx.json:
        ctx.emit(result)
        return
    out.print(f"{group} / {topic}: {json.dumps(result['policy'])}")
    if result["created"]:
        out.print("created " + ", ".join(result["created"]))


@retry_app.command("get")
def retry_get(group: str, topic: str) -> None:
    """GROUP's retry policy for TOPIC."""
    ctx = _ctx()
    with _errors(), ctx.admin() as admin:
        policy = admin.get_retry_policy(group, topic)
    ctx.emit(policy.to_json()) if ctx.json else out.print(json.dumps(policy.to_json()))


@retry_app.command("status")
def retry_status() -> None:
    """Each retry router's counters: retries by attempt, records dead-lettered per topic."""
    ctx = _ctx()
    with _errors(), ctx.admin() as admin:
        status = admin.retry_status()
    if ctx.json:
        ctx.emit(status)
        return
    for name, stats in sorted(status["routers"].items()):
        by_attempt = ", ".join(
            f"#{a}: {c}"
            for a, c in sorted(stats["retries_by_attempt"].items(), key=lambda x: int(x[0]))
        )
        dead = ", ".join(f"{t}: {c}" for t, c in sorted(stats["dead_lettered"].items()))
        out.print(
            f"{name}: retries by attempt {by_attempt or '-'}; dead-lettered {dead or '-'}; "
            f"parked {stats['parked']}; copies dropped {stats.get('copies', 0)}"
        )


@dlq_app.command("count")
def dlq_count(topic: str) -> None:
    """How many records TOPIC (a dead-letter topic) holds."""
    ctx = _ctx()
    with _errors(), ctx.admin() as admin:
        count = admin.dlq_count(topic)
    ctx.emit({"topic": topic, "count": count}) if ctx.json else out.print(f"{topic}: {count}")


@dlq_app.command("peek")
def dlq_peek(
    topic: str, limit: Annotated[int, typer.Option(help="How many (oldest first)")] = 10
) -> None:
    """The oldest records of a dead-letter topic: origin, attempts, last error."""
    ctx = _ctx()
    with _errors(), ctx.admin() as admin:
        records = admin.dlq_peek(topic, limit)
    if ctx.json:
        ctx.emit(records)
        return
    table = Table("partition", "offset", "group", "from", "attempts", "last error", box=None)
    for r in records:
        o = r["original"]
        table.add_row(
            str(r["partition"]),
            str(r["offset"]),
            r["group"],
            f"{o['topic']}[{o['partition']}]@{o['offset']}",
            str(r["attempts"]),
            (r["last_error"] or "")[:60],
        )
    out.print(table)


def _rate(text: str) -> int:
    number = text.removesuffix("/s")
    if not number.isdigit() or int(number) < 1:
        raise typer.BadParameter(f"{text!r} is not a rate like 100/s", param_hint="--rate")
    return int(number)


@dlq_app.command("redrive")
def dlq_redrive(
    source: Annotated[str, typer.Argument(help="The dead-letter topic")] = "",
    to: Annotated[str, typer.Option(help="The topic to move the records to")] = "",
    rate: Annotated[str, typer.Option(help="Records per second, e.g. 100/s")] = "100/s",
    filter_: Annotated[
        str | None, typer.Option("--filter", help="Only records with this header=value")
    ] = None,
    dry_run: Annotated[bool, typer.Option(help="Count what would move; move nothing")] = False,
    resume: Annotated[str | None, typer.Option(help="Continue the redrive with this id")] = None,
) -> None:
    """Move records from a dead-letter topic back to a topic, rate-limited, with a progress
    bar. Interrupted (Ctrl-C, a crash), it can be resumed with --resume ID: nothing is sent
    twice. `strata dlq cancel ID` stops it."""
    ctx = _ctx()
    with _errors(), ctx.admin() as admin:
        if resume:
            task = admin.redrive_status(resume)
        else:
            if not source or not to:
                raise UsageError("give the dead-letter topic and --to (or --resume ID)")
            task = admin.redrive(source, to, _rate(rate), filter_, dry_run)
            err.print(f"redrive {task['id']}: {task['total']} record(s) in {task['source']}")
        with _progress(task["total"], "redrive", enabled=not ctx.json) as progress:
            bar = progress.add_task(f"{task['source']} → {task['target']}", total=task["total"])
            while task["state"] == "running":
                task = admin.redrive_run(str(task["id"]))
                progress.update(bar, completed=task["scanned"])
    ctx.emit(task) if ctx.json else out.print(
        f"{task['state']}: moved {task['moved']}, skipped {task['skipped']} (filter)"
        + (" [dry run: nothing sent]" if task["dry_run"] else "")
    )


@dlq_app.command("status")
def dlq_status(task_id: Annotated[str | None, typer.Argument()] = None) -> None:
    """A redrive's progress (every redrive without an id)."""
    ctx = _ctx()
    with _errors(), ctx.admin() as admin:
        tasks = [admin.redrive_status(task_id)] if task_id else admin.redrives()
    if ctx.json:
        ctx.emit(tasks)
        return
    for t in tasks:
        out.print(
            f"{t['id']} {t['source']} → {t['target']} {t['state']}: "
            f"{t['scanned']}/{t['total']} scanned, {t['moved']} moved, {t['skipped']} skipped"
        )


@dlq_app.command("cancel")
def dlq_cancel(task_id: str) -> None:
    """Cancel a redrive (what it moved stays moved)."""
    ctx = _ctx()
    with _errors(), ctx.admin() as admin:
        task = admin.redrive_cancel(task_id)
    ctx.emit(task) if ctx.json else out.print(f"{task_id}: {task['state']}")


# ---------------------------------------------------------------- replay


async def replay_range(
    servers: str,
    source: str,
    target: str,
    partitions: list[int],
    start: int,
    end: int | None,
    on_progress: Callable[[int], None],
) -> int:
    """Copy offsets [start, end) of ``source``'s partitions into ``target`` (same partition
    number when the target has it; keys, headers, tags and timestamps kept)."""
    copied = 0
    async with (
        Consumer(client_config(servers, {"auto.offset.reset": "earliest"})) as consumer,
        Producer(client_config(servers, {"acks": "all", "linger.ms": 5})) as producer,
    ):
        target_partitions = set(await producer.partitions_for(target))
        tps = [TopicPartition(source, p) for p in partitions]
        consumer.assign(tps)
        stops = await consumer.end_offsets(tps)
        if end is not None:
            stops = {tp: min(end, e) for tp, e in stops.items()}
        for tp in tps:
            consumer.seek(tp, start)
        futures: list[asyncio.Future[Any]] = []
        remaining = {tp for tp in tps if stops[tp] > start}
        while remaining:
            got = await consumer.getmany(*remaining, timeout_ms=500)
            for tp, records in got.items():
                for r in records:
                    if r.offset >= stops[tp]:
                        remaining.discard(tp)
                        break
                    futures.append(
                        await producer.send(
                            target,
                            r.value,
                            r.key,
                            list(r.headers) or None,
                            list(r.tags) or None,
                            r.partition if r.partition in target_partitions else None,
                            r.timestamp,
                        )
                    )
                    copied += 1
                if await consumer.position(tp) >= stops[tp]:
                    remaining.discard(tp)
            on_progress(copied)
            if len(futures) > 10_000:
                await asyncio.gather(*futures)
                futures.clear()
        await producer.flush()
        await asyncio.gather(*futures)
    return copied


@app.command()
def replay(
    source: str,
    target: str,
    start: Annotated[int, typer.Option("--from", help="First offset (each partition)")] = 0,
    end: Annotated[
        int | None, typer.Option("--to", help="Stop before this offset (default: the end)")
    ] = None,
    partition: Annotated[list[int] | None, typer.Option("--partition", "-p")] = None,
    create: Annotated[
        bool, typer.Option(help="Create the target topic like the source if it is missing")
    ] = True,
) -> None:
    """Copy a range of a topic's history (from agents or object storage) into another topic."""
    ctx = _ctx()
    with _errors():
        admin = ctx.admin()
        src = admin.describe_topic(source)
        if create and target not in admin.list_topics():
            admin.create_topic(target, src.partitions, src.replication_factor)
        parts = partition or list(range(src.partitions))
        with _progress(None, "replay", enabled=err.is_terminal) as bar:
            task = bar.add_task(f"replay {source} → {target}", total=None)
            copied = _run(
                replay_range(
                    ctx.servers(),
                    source,
                    target,
                    parts,
                    start,
                    end,
                    lambda n: bar.update(task, completed=n),
                )
            )
    if ctx.json:
        ctx.emit({"source": source, "target": target, "messages": copied})
    else:
        out.print(f"replayed {copied:,} messages from [bold]{source}[/] to [bold]{target}[/]")


# ---------------------------------------------------------------- local stack


def _endpoints_table(state: local.StackState) -> Table:
    table = Table("component", "endpoint", "pid", title=f"Strata local stack ({state.state_dir})")
    table.add_row("s3 (moto)", f"{state.s3_endpoint}  bucket {state.bucket}", str(state.s3_pid))
    for z in state.zookeepers:
        table.add_row(z.name, z.address, str(z.pid))
    for a in state.agents:
        table.add_row(
            f"agent {a.agent_id}",
            f"{a.address}  kafka {a.kafka or '-'}  metrics {a.metrics_url}",
            str(a.pid),
        )
    table.add_row("admin api", state.admin_url, str(state.admin_pid))
    table.caption = f"ZooKeeper connect string: {state.zookeeper_connect}"
    return table


def _stack_config(
    state_dir: Path,
    agents: int,
    zookeepers: int,
    agent_config: list[str] | None,
    secure: bool = False,
) -> local.StackConfig:
    return local.StackConfig(
        state_dir=state_dir,
        agents=agents,
        zookeepers=zookeepers,
        agent_configs=tuple(agent_config or ()),
        secure=secure,
    )


@local_app.command("up")
def local_up(
    agents: Annotated[int, typer.Option(min=1, max=32)] = 3,
    zookeepers: Annotated[
        int, typer.Option(help="ZooKeeper servers: 1 (standalone) or an ensemble of 3 or 5")
    ] = 1,
    detach: Annotated[bool, typer.Option("--detach", "-d", help="Run in the background")] = False,
    agent_config: Annotated[
        list[str] | None, typer.Option(help="key=value for every agent (repeatable)")
    ] = None,
    state_dir: Annotated[Path | None, typer.Option(help="Default: var/local")] = None,
    secure: Annotated[
        bool,
        typer.Option(
            "--secure",
            help="TLS + SCRAM + ACLs: a throwaway CA and users (client.properties in the state dir)",
        ),
    ] = False,
    quiet: Annotated[bool, typer.Option(hidden=True)] = False,
    clean: Annotated[bool, typer.Option(hidden=True)] = True,
) -> None:
    """Start the stack; in the foreground until Ctrl-C, or in the background with --detach."""
    ctx = _ctx()
    started = time.monotonic()
    with _errors():
        config = _stack_config(state_dir or ctx.state_dir, agents, zookeepers, agent_config, secure)
        if detach:
            with err.status("starting the local stack…", spinner="dots"):
                state = local.up_detached(config)
            took = time.monotonic() - started
            if ctx.json:
                ctx.emit(state.to_json() | {"healthy_after_s": round(took, 2)})
            else:
                out.print(_endpoints_table(state))
                out.print(f"healthy in {took:.1f} s; stop it with [bold]strata local down[/]")
            return

        def ready(state: local.StackState) -> None:
            if quiet:
                return
            if ctx.json:
                ctx.emit(state.to_json())
            else:
                out.print(_endpoints_table(state))
                out.print(
                    f"healthy in {time.monotonic() - started:.1f} s; "
                    f"export STRATA_BOOTSTRAP={state.bootstrap} "
                    f"STRATA_ADMIN_URL={state.admin_url}\nCtrl-C stops it."
                )

        local.supervise(config, on_ready=ready, clean=clean)
    if not quiet and not ctx.json:
        out.print("stopped")


@local_app.command("down")
def local_down(state_dir: Annotated[Path | None, typer.Option()] = None) -> None:
    """Stop the stack and every process it started."""
    ctx = _ctx()
    directory = state_dir or ctx.state_dir
    was = local.read_state(directory)
    with _errors():
        killed = local.down(directory)
    if ctx.json:
        ctx.emit({"stopped": was is not None, "killed_after_timeout": killed})
    elif was is None:
        out.print("no local stack is running")
    else:
        out.print("local stack stopped" + (f" (had to kill {killed})" if killed else ""))


@local_app.command("status")
def local_status(state_dir: Annotated[Path | None, typer.Option()] = None) -> None:
    """Probe every component; exit 1 unless all are healthy (3 when none runs)."""
    ctx = _ctx()
    state = local.read_state(state_dir or ctx.state_dir)
    if state is None:
        ctx.emit({"running": False}) if ctx.json else out.print("no local stack is running")
        raise typer.Exit(3)
    components = local.status(state)
    healthy = all(c.healthy for c in components)
    if ctx.json:
        ctx.emit(
            {
                "running": True,
                "status": state.status,
                "healthy": healthy,
                "healthy_after_s": state.healthy_after_s,
                "bootstrap": state.bootstrap,
                "admin_url": state.admin_url,
                "zookeeper_connect": state.zookeeper_connect,
                "components": [
                    {
                        "name": c.name,
                        "endpoint": c.endpoint,
                        "pid": c.pid,
                        "healthy": c.healthy,
                        "detail": c.detail,
                    }
                    for c in components
                ],
            }
        )
    else:
        table = Table("component", "endpoint", "pid", "health", "detail", title="local stack")
        for c in components:
            mark = "[green]ok[/]" if c.healthy else "[red]DOWN[/]"
            table.add_row(c.name, c.endpoint, str(c.pid), mark, c.detail)
        table.caption = f"ZooKeeper connect string: {state.zookeeper_connect}"
        out.print(table)
    if not healthy:
        raise typer.Exit(1)


def run() -> None:  # pragma: no cover - the console script
    app()


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    app()
