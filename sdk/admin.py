"""The admin client: topics, partitions and configs over the admin HTTP API.

``Admin`` is async, ``SyncAdmin`` blocks; both send the same requests through one transport
(``urllib`` from the standard library, run in a worker thread for ``Admin``)::

    async with Admin("http://127.0.0.1:8080") as admin:
        await admin.create_topic("orders", partitions=6, configs={"retention.ms": 86_400_000})
        description = await admin.describe_topic("orders")

Every request has a deadline: ``timeout`` seconds for connecting and for each read (the server
answers within its own deadline, shorter than the default here); ``Admin`` also bounds each
whole call.
An error answer (``{"error": {"type", "code", "message", "retriable"}}``) is raised as the
``storage.errors`` class its code names (``from_wire``), so ``InvalidTopicError``,
``TopicAlreadyExistsError``, ``UnknownTopicOrPartitionError``... are the same classes the
agents raise. A refused or reset connection is ``NetworkError``, a missed deadline
``RequestTimedOutError`` (both retriable).

**Signing.** The deployed admin API is an IAM-authorised HTTP API (``template.yaml``): its
requests must carry an AWS Signature Version 4 for ``execute-api``. ``sign="auto"`` (the
default) signs when the URL is an API Gateway endpoint
(``https://<id>.execute-api.<region>.amazonaws.com``), with the region taken from the host and
the credentials botocore finds (environment, profile, instance role); the local stack's
loopback URL stays unsigned. ``sign=True`` with ``region=`` signs any URL (a custom domain).
The signature is botocore's ``SigV4Auth``, over the exact bytes sent.

**Credentials.** ``config`` takes a client's settings, Kafka's names (:class:`AdminConfig`):
with ``sasl.username`` and ``sasl.password`` and no signing, each request carries them as HTTP
Basic credentials, which the local runtime of a secured stack checks against its SCRAM users
(``docs/security.md``). A client's settings, such as a secured stack's ``client``, can be
passed whole. The password goes in clear over ``http``, so it is sent that way to a loopback
address only.

The wire shapes (:class:`TopicDescription`, :class:`PartitionInfo`) are defined here, once:
the admin handler builds its answers with them. This module imports neither kazoo nor
``broker_agents``; the SDK never talks to ZooKeeper.
"""

from __future__ import annotations

import asyncio
import base64
import enum
import http.client
import ipaddress
import json
import re
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError

from storage.errors import (
    InvalidConfigError,
    InvalidRequestError,
    NetworkError,
    RequestTimedOutError,
    StrataError,
    from_wire,
)
from storage.retry_policy import RetryPolicy

DEFAULT_TIMEOUT = 30.0
MAX_RESPONSE_BYTES = 64 << 20
"""An answer larger than this is refused (a describe of 10,000 partitions is ~1.5 MB)."""


class PartitionStatus(enum.StrEnum):
    ONLINE = "online"
    """Has a leader."""
    OFFLINE = "offline"
    """Has a state, but no live leader (leader -1)."""
    PENDING = "pending"
    """The controller has not created its state yet (no agents, or not reconciled yet)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PartitionInfo:
    partition: int
    status: PartitionStatus
    leader: int = -1
    """The leader agent id; -1 when offline or pending."""
    leader_epoch: int = -1
    replicas: tuple[int, ...] = ()
    isr: tuple[int, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "partition": self.partition,
            "status": self.status.value,
            "leader": self.leader,
            "leader_epoch": self.leader_epoch,
            "replicas": list(self.replicas),
            "isr": list(self.isr),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PartitionInfo:
        return cls(
            partition=int(data["partition"]),
            status=PartitionStatus(data["status"]),
            leader=int(data["leader"]),
            leader_epoch=int(data["leader_epoch"]),
            replicas=tuple(int(r) for r in data["replicas"]),
            isr=tuple(int(r) for r in data["isr"]),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class DeletionStatus:
    """How far a topic's delete has got (``docs/operations.md``, *Deleting a topic*)."""

    step: str
    """The step in progress: stop_serving, remove_local_logs, remove_snapshots,
    delete_objects, remove_offsets, remove_metadata."""
    step_number: int
    """2-7, as numbered in the docs (step 1, marking the topic, is done)."""
    requested_ms: int
    updated_ms: int
    objects_total: int = -1
    """Segment objects found when step 5 started (-1: not counted yet)."""
    objects_deleted: int = 0
    objects_left: int = -1
    waiting_for: tuple[int, ...] = ()
    """Live agents that have not yet removed their local logs (step 3)."""
    last_error: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "step_number": self.step_number,
            "requested_ms": self.requested_ms,
            "updated_ms": self.updated_ms,
            "objects_total": self.objects_total,
            "objects_deleted": self.objects_deleted,
            "objects_left": self.objects_left,
            "waiting_for": list(self.waiting_for),
            "last_error": self.last_error,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> DeletionStatus:
        return cls(
            step=str(data["step"]),
            step_number=int(data["step_number"]),
            requested_ms=int(data["requested_ms"]),
            updated_ms=int(data["updated_ms"]),
            objects_total=int(data.get("objects_total", -1)),
            objects_deleted=int(data.get("objects_deleted", 0)),
            objects_left=int(data.get("objects_left", -1)),
            waiting_for=tuple(int(a) for a in data.get("waiting_for", ())),
            last_error=str(data.get("last_error", "")),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class TopicDescription:
    name: str
    topic_id: str
    created_ms: int
    partitions: int
    replication_factor: int
    configs: Mapping[str, Any] = field(default_factory=dict)
    """Every topic config by its Kafka dotted name (``retention.ms``, ...)."""
    partition_states: tuple[PartitionInfo, ...] = ()
    deletion: DeletionStatus | None = None
    """Set while the topic is being deleted (it cannot be used, nor created again, meanwhile)."""

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "topic_id": self.topic_id,
            "created_ms": self.created_ms,
            "partitions": self.partitions,
            "replication_factor": self.replication_factor,
            "configs": dict(self.configs),
            "partition_states": [p.to_json() for p in self.partition_states],
            "deletion": None if self.deletion is None else self.deletion.to_json(),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> TopicDescription:
        deletion = data.get("deletion")
        return cls(
            name=str(data["name"]),
            topic_id=str(data["topic_id"]),
            created_ms=int(data["created_ms"]),
            partitions=int(data["partitions"]),
            replication_factor=int(data["replication_factor"]),
            configs=dict(data["configs"]),
            partition_states=tuple(PartitionInfo.from_json(p) for p in data["partition_states"]),
            deletion=None if deletion is None else DeletionStatus.from_json(deletion),
        )


def error_from_body(status: int, body: bytes) -> StrataError:
    """The typed exception for an error answer (by its wire code; by status if unreadable)."""
    try:
        err = json.loads(body)["error"]
        code, message, retriable = int(err["code"]), str(err["message"]), err.get("retriable")
    except (ValueError, KeyError, TypeError):
        text = body[:200].decode("utf-8", "replace")
        if status in (502, 503):
            return NetworkError(f"HTTP {status} from the admin API: {text}")
        if status == 504:
            return RequestTimedOutError(f"HTTP {status} from the admin API: {text}")
        if 400 <= status < 500:
            return InvalidRequestError(f"HTTP {status} from the admin API: {text}")
        return StrataError(f"HTTP {status} from the admin API: {text}")
    exc = from_wire(code, message)
    if retriable is True and not exc.retriable:
        # several errors share a code (59: metadata); keep what the server said of this one
        exc.retriable = True  # type: ignore[misc]
    return exc


_API_GATEWAY = re.compile(r"^[a-z0-9]+\.execute-api\.([a-z0-9-]+)\.amazonaws\.com$")
SIGNED_SERVICE = "execute-api"


class SigV4Signer:
    """Signs admin requests with botocore's SigV4 for API Gateway (``execute-api``)."""

    def __init__(self, region: str, credentials: Any = None) -> None:
        if credentials is None:
            from botocore.session import get_session

            credentials = get_session().get_credentials()
        if credentials is None:
            raise InvalidRequestError(
                "signing admin requests needs AWS credentials (environment, profile or role)"
            )
        self.region = region
        self.credentials = credentials

    def sign(self, method: str, url: str, data: bytes | None, headers: dict[str, str]) -> None:
        """Add the ``Authorization``, ``X-Amz-Date`` (and token) headers to ``headers``."""
        from botocore.auth import SigV4Auth
        from botocore.awsrequest import AWSRequest

        req = AWSRequest(method=method, url=url, data=data or b"", headers=headers)
        SigV4Auth(self.credentials.get_frozen_credentials(), SIGNED_SERVICE, self.region).add_auth(
            req
        )
        headers.update(dict(req.headers.items()))


def signer_for(
    url: str, sign: bool | str = "auto", region: str | None = None, credentials: Any = None
) -> SigV4Signer | None:
    """The signer ``url`` needs: ``sign="auto"`` signs API Gateway URLs only (region from the
    host unless given); ``True`` always (then a region is needed); ``False`` never."""
    if sign is False:
        return None
    host = urllib.parse.urlsplit(url).hostname or ""
    found = _API_GATEWAY.match(host)
    if sign == "auto" and found is None:
        return None
    if sign not in (True, "auto"):
        raise InvalidRequestError(f"sign must be True, False or 'auto', got {sign!r}")
    region = region or (found.group(1) if found else None)
    if region is None:
        raise InvalidRequestError(f"signing requests to {host!r} needs a region")
    return SigV4Signer(region, credentials)


class AdminConfig(BaseModel):
    """The admin client's settings: a client's security settings, Kafka's names.

    ``sasl.username`` / ``sasl.password``: HTTP Basic credentials (unless requests are signed
    for AWS). The other settings concern the agents' listeners (an ``https`` admin URL is
    checked against the system's CAs); they are accepted so that a client's settings can be
    passed whole.
    """

    model_config = ConfigDict(frozen=True, populate_by_name=True, extra="forbid")

    sasl_username: str | None = Field(None, alias="sasl.username", min_length=1, pattern=r"^[^:]+$")
    sasl_password: SecretStr | None = Field(None, alias="sasl.password")
    ssl_cafile: str | None = Field(None, alias="ssl.cafile")
    ssl_certfile: str | None = Field(None, alias="ssl.certfile")
    ssl_keyfile: str | None = Field(None, alias="ssl.keyfile")
    security_protocol: str | None = Field(None, alias="security.protocol")
    sasl_mechanism: str | None = Field(None, alias="sasl.mechanism")

    @classmethod
    def parse(cls, values: Mapping[str, Any] | AdminConfig | None) -> AdminConfig:
        if isinstance(values, AdminConfig):
            return values
        try:
            config = cls.model_validate(dict(values or {}))
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(map(str, e['loc'])) or 'config'}: {e['msg']}" for e in exc.errors()
            )
            raise InvalidConfigError(f"invalid AdminConfig: {problems}") from None
        if (config.sasl_username is None) != (config.sasl_password is None):
            raise InvalidConfigError(
                "invalid AdminConfig: sasl.username and sasl.password go together"
            )
        return config

    def basic_auth(self) -> str | None:
        """The ``Authorization`` header's value, if there are credentials."""
        if self.sasl_username is None or self.sasl_password is None:
            return None
        pair = f"{self.sasl_username}:{self.sasl_password.get_secret_value()}"
        return "Basic " + base64.b64encode(pair.encode()).decode("ascii")


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _Transport:
    """Blocking JSON-over-HTTP requests with a deadline; errors as ``StrataError``."""

    def __init__(
        self,
        url: str,
        timeout: float,
        signer: SigV4Signer | None = None,
        config: AdminConfig | None = None,
    ) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise InvalidRequestError(f"admin URL {url!r} is not http(s)://host:port[/prefix]")
        if not timeout > 0:
            raise InvalidRequestError(f"timeout must be positive, got {timeout!r}")
        config = config or AdminConfig()
        self.base = url.rstrip("/")
        self.timeout = timeout
        self.signer = signer
        self._authorization = None if signer is not None else config.basic_auth()
        if self._authorization and parts.scheme == "http" and not _loopback(parts.hostname or ""):
            raise InvalidConfigError(
                f"the admin API at {parts.hostname} is plain http: sasl.password would cross "
                "the network in clear text (use https, or a loopback address)"
            )
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def request(self, method: str, path: str, body: Mapping[str, Any] | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        headers = {"accept": "application/json"}
        if data is not None:
            headers["content-type"] = "application/json"
        if self._authorization is not None:
            headers["authorization"] = self._authorization
        if self.signer is not None:
            self.signer.sign(method, self.base + path, data, headers)
        req = urllib.request.Request(self.base + path, data=data, method=method, headers=headers)
        try:
            with self._opener.open(req, timeout=self.timeout) as resp:
                payload = resp.read(MAX_RESPONSE_BYTES + 1)
        except urllib.error.HTTPError as exc:
            try:
                text = exc.read(MAX_RESPONSE_BYTES)
            except (OSError, http.client.HTTPException):
                text = b""
            finally:
                exc.close()
            raise error_from_body(exc.code, text) from None
        except TimeoutError as exc:
            raise RequestTimedOutError(
                f"{method} {path}: no answer within {self.timeout} s"
            ) from exc
        except urllib.error.URLError as exc:
            if isinstance(exc.reason, TimeoutError):
                raise RequestTimedOutError(
                    f"{method} {path}: no answer within {self.timeout} s"
                ) from exc
            raise NetworkError(f"{method} {path}: {exc.reason}") from exc
        except (OSError, http.client.HTTPException) as exc:
            raise NetworkError(f"{method} {path}: {type(exc).__name__}: {exc}") from exc
        if len(payload) > MAX_RESPONSE_BYTES:
            raise NetworkError(f"{method} {path}: answer over {MAX_RESPONSE_BYTES} bytes")
        if not payload:
            return None
        try:
            return json.loads(payload)
        except ValueError as exc:
            raise NetworkError(f"{method} {path}: the answer is not JSON: {exc}") from None


def _topic(name: str) -> str:
    return "/topics/" + urllib.parse.quote(name, safe="")


def _group(group: str) -> str:
    return "/groups/" + urllib.parse.quote(group, safe="")


def _path(segment: str) -> str:
    return urllib.parse.quote(segment, safe="")


class SyncAdmin:
    """The blocking admin client (one HTTP request per call, ``timeout`` s each)."""

    def __init__(
        self,
        url: str,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        sign: bool | str = "auto",
        region: str | None = None,
        credentials: Any = None,
        config: Mapping[str, Any] | AdminConfig | None = None,
    ) -> None:
        self._http = _Transport(
            url, timeout, signer_for(url, sign, region, credentials), AdminConfig.parse(config)
        )

    @property
    def timeout(self) -> float:
        return self._http.timeout

    def create_topic(
        self,
        name: str,
        partitions: int,
        replication_factor: int | None = None,
        configs: Mapping[str, Any] | None = None,
    ) -> TopicDescription:
        """Create a topic; ``replication_factor=None``: min(3, live agents)."""
        body: dict[str, Any] = {"name": name, "partitions": partitions}
        if replication_factor is not None:
            body["replication_factor"] = replication_factor
        if configs:
            body["configs"] = dict(configs)
        return TopicDescription.from_json(self._http.request("POST", "/topics", body))

    def list_topics(self) -> list[str]:
        """The topics that exist (not those being deleted)."""
        return [str(n) for n in self._http.request("GET", "/topics")["topics"]]

    def list_deleting_topics(self) -> list[str]:
        """The topics whose delete has not completed yet."""
        return [str(n) for n in self._http.request("GET", "/topics").get("deleting", [])]

    def describe_topic(self, name: str) -> TopicDescription:
        return TopicDescription.from_json(self._http.request("GET", _topic(name)))

    def delete_topic(self, name: str) -> TopicDescription:
        """Start deleting a topic; the answer says how far the delete is (``deletion``).

        The topic stops being served at once; its data, offsets and metadata go in the
        background, and the name can be created again once ``describe_topic`` raises
        ``UnknownTopicOrPartitionError``. Deleting a topic already being deleted is a no-op."""
        return TopicDescription.from_json(self._http.request("DELETE", _topic(name)))

    def create_partitions(self, name: str, count: int) -> TopicDescription:
        """Grow the topic to ``count`` partitions in total (more than it has)."""
        answer = self._http.request("POST", _topic(name) + "/partitions", {"count": count})
        return TopicDescription.from_json(answer)

    def alter_configs(self, name: str, configs: Mapping[str, Any]) -> TopicDescription:
        """Change some configs (dotted names); a value of ``None`` restores the default."""
        answer = self._http.request("PATCH", _topic(name) + "/configs", {"configs": dict(configs)})
        return TopicDescription.from_json(answer)

    # ---- consumer groups (handlers/groups.py describes the shapes) ----------------------
    def list_groups(self) -> list[dict[str, Any]]:
        return list(self._http.request("GET", "/groups")["groups"])

    def describe_group(self, group: str) -> dict[str, Any]:
        """Members, assignment, committed offsets and lag (messages, seconds) per partition."""
        return dict(self._http.request("GET", _group(group)))

    def reset_offsets(
        self,
        group: str,
        topic: str,
        to: str | Mapping[str, int],
        partitions: list[int] | None = None,
    ) -> dict[int, int]:
        """Reset an inactive group's offsets: ``to`` is "earliest", "latest",
        ``{"timestamp": ms}`` or ``{"offset": n}``."""
        body: dict[str, Any] = {"topic": topic, "to": to if isinstance(to, str) else dict(to)}
        if partitions is not None:
            body["partitions"] = list(partitions)
        answer = self._http.request("POST", _group(group) + "/offsets", body)
        return {int(p): int(o) for p, o in answer["offsets"].items()}

    def delete_group(self, group: str) -> None:
        self._http.request("DELETE", _group(group))

    # ---- delayed records (docs/delays.md) ------------------------------------------------
    def create_delay_topics(
        self, partitions: int | None = None, replication_factor: int | None = None
    ) -> dict[str, list[str]]:
        """Create the delay level topics that are missing: ``{"created", "existing"}``."""
        body: dict[str, Any] = {}
        if partitions is not None:
            body["partitions"] = partitions
        if replication_factor is not None:
            body["replication_factor"] = replication_factor
        answer = self._http.request("POST", "/delays/topics", body)
        return {k: list(v) for k, v in answer.items()}

    def cancel_scheduled(self, schedule_id: str) -> bool:
        """Cancel a delayed record: True if it was in time (it will never be delivered),
        False if it was delivered already."""
        answer = self._http.request("POST", "/delays/cancel", {"schedule_id": schedule_id})
        return bool(answer["cancelled"])

    def delays_status(self) -> dict[str, Any]:
        """Pending records per level, cancels, and the schedulers' counters and lateness."""
        return dict(self._http.request("GET", "/delays/status"))

    # ---- retries and dead letters (docs/retries.md) --------------------------------------
    def set_retry_policy(
        self, group: str, topic: str, policy: RetryPolicy | Mapping[str, Any]
    ) -> dict[str, Any]:
        """Declare ``group``'s retry policy for ``topic`` (checked here first:
        ``InvalidRetryPolicyError``); creates the retry and dead-letter topics if missing."""
        checked = RetryPolicy.parse(policy, topic=topic)
        path = f"{_group(group)}/retry/{urllib.parse.quote(topic, safe='')}"
        return dict(self._http.request("PUT", path, checked.to_json()))

    def get_retry_policy(self, group: str, topic: str) -> RetryPolicy:
        path = f"{_group(group)}/retry/{urllib.parse.quote(topic, safe='')}"
        return RetryPolicy.parse(self._http.request("GET", path))

    def delete_retry_policy(self, group: str, topic: str) -> None:
        self._http.request("DELETE", f"{_group(group)}/retry/{urllib.parse.quote(topic, safe='')}")

    def retry_status(self) -> dict[str, Any]:
        """The retry routers' counters: retries by attempt, dead-lettered per topic."""
        return dict(self._http.request("GET", "/retry/status"))

    def dlq_count(self, topic: str) -> int:
        return int(
            self._http.request("GET", f"/dlq/{urllib.parse.quote(topic, safe='')}/count")["count"]
        )

    def dlq_peek(self, topic: str, limit: int = 10) -> list[dict[str, Any]]:
        path = f"/dlq/{urllib.parse.quote(topic, safe='')}/peek?limit={int(limit)}"
        return list(self._http.request("GET", path)["records"])

    def redrive(
        self,
        source: str,
        to: str,
        rate: int,
        header_filter: str | None = None,
        dry_run: bool = False,
    ) -> dict[str, Any]:
        """Make a redrive task from dead-letter topic ``source`` to ``to`` at ``rate``
        records/s (``header_filter``: ``"name=value"``); run it with :meth:`redrive_run`."""
        body: dict[str, Any] = {"to": to, "rate": rate, "dry_run": dry_run}
        if header_filter:
            body["filter"] = header_filter
        path = f"/dlq/{urllib.parse.quote(source, safe='')}/redrive"
        return dict(self._http.request("POST", path, body))

    def redrive_run(self, task_id: str) -> dict[str, Any]:
        """Move records for one invocation's time; the task's progress (call again until
        its state is not ``running``)."""
        return dict(self._http.request("POST", f"/dlq/redrives/{task_id}/run"))

    def redrive_status(self, task_id: str) -> dict[str, Any]:
        return dict(self._http.request("GET", f"/dlq/redrives/{task_id}"))

    def redrive_cancel(self, task_id: str) -> dict[str, Any]:
        return dict(self._http.request("DELETE", f"/dlq/redrives/{task_id}"))

    def redrives(self) -> list[dict[str, Any]]:
        return list(self._http.request("GET", "/dlq/redrives")["tasks"])

    # ---- cluster: agents, balancing, reassignment (docs/operations.md) --------------------
    def list_agents(self) -> list[dict[str, Any]]:
        """Live agents and dead ones still holding replicas: replica and leader counts, and
        whether each is being decommissioned."""
        return list(self._http.request("GET", "/agents")["agents"])

    def decommission_agent(self, agent_id: int) -> dict[str, Any]:
        """Move every replica off ``agent_id`` (then it can be stopped for good)."""
        return dict(self._http.request("POST", f"/agents/{int(agent_id)}/decommission"))

    def recommission_agent(self, agent_id: int) -> dict[str, Any]:
        """Undo :meth:`decommission_agent`: the agent may hold replicas again."""
        return dict(self._http.request("DELETE", f"/agents/{int(agent_id)}/decommission"))

    def rebalance(self, dry_run: bool = False) -> dict[str, Any]:
        """The moves that spread replicas and preferred leaders evenly; carried out by the
        controller (a few at a time) unless ``dry_run``."""
        return dict(self._http.request("GET" if dry_run else "POST", "/cluster/rebalance"))

    def elect_preferred_leaders(self, topics: list[str] | None = None) -> None:
        """Move leadership to each partition's first replica where it is in sync."""
        self._http.request("POST", "/cluster/preferred-leaders", {"topics": topics})

    # ---- users and ACLs (docs/security.md) ----------------------------------------------------
    def list_users(self) -> dict[str, list[str]]:
        """Every SCRAM user and the mechanisms it has a credential for."""
        return dict(self._http.request("GET", "/users")["users"])

    def set_user(
        self, name: str, password: str, mechanisms: list[str] | None = None
    ) -> dict[str, Any]:
        """Create a user or change its password (salted by the admin API, never stored)."""
        body: dict[str, Any] = {"password": password}
        if mechanisms is not None:
            body["mechanisms"] = mechanisms
        return dict(self._http.request("PUT", f"/users/{_path(name)}", body))

    def delete_user(self, name: str) -> bool:
        return bool(self._http.request("DELETE", f"/users/{_path(name)}")["deleted"])

    def list_acls(self) -> list[dict[str, str]]:
        return list(self._http.request("GET", "/acls")["acls"])

    def add_acls(self, acls: list[dict[str, str]]) -> list[dict[str, str]]:
        """Add bindings (``principal``, ``resource_type``, ``name``, ``operation``,
        ``permission``, ``pattern_type``; docs/security.md)."""
        return list(self._http.request("POST", "/acls", {"acls": acls})["acls"])

    def remove_acls(self, acls: list[dict[str, str]]) -> int:
        return int(self._http.request("DELETE", "/acls", {"acls": acls})["removed"])

    # ---- quotas (docs/security.md) -------------------------------------------------------------
    def list_quotas(self) -> dict[str, dict[str, int]]:
        """Every principal's quota (``User:*``: the default), its rates per second."""
        return dict(self._http.request("GET", "/quotas")["quotas"])

    def set_quota(
        self,
        principal: str,
        producer_byte_rate: int | None = None,
        consumer_byte_rate: int | None = None,
        request_rate: int | None = None,
    ) -> dict[str, Any]:
        """Replace ``principal``'s quota (``User:<name>`` or ``User:*``); a rate left out is
        unlimited, and with none given the quota is removed."""
        rates = {
            "producer_byte_rate": producer_byte_rate,
            "consumer_byte_rate": consumer_byte_rate,
            "request_rate": request_rate,
        }
        body = {k: v for k, v in rates.items() if v is not None}
        return dict(self._http.request("PUT", f"/quotas/{_path(principal)}", body))

    def delete_quota(self, principal: str) -> bool:
        """Remove ``principal``'s quota; False if it had none."""
        return bool(self._http.request("DELETE", f"/quotas/{_path(principal)}")["deleted"])

    def reassign_partition(self, topic: str, partition: int, replicas: list[int]) -> dict[str, Any]:
        """Move ``topic``'s ``partition`` onto ``replicas`` (the first: preferred leader)."""
        path = f"/topics/{urllib.parse.quote(topic, safe='')}/partitions/{int(partition)}"
        return dict(self._http.request("POST", path + "/reassignment", {"replicas": replicas}))

    def close(self) -> None:
        """Nothing to release (a connection per request); for symmetry with ``Admin``."""

    def __enter__(self) -> SyncAdmin:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class Admin:
    """The async admin client; each call runs one request in a worker thread."""

    def __init__(
        self,
        url: str,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        sign: bool | str = "auto",
        region: str | None = None,
        credentials: Any = None,
        config: Mapping[str, Any] | AdminConfig | None = None,
    ) -> None:
        self._sync = SyncAdmin(
            url, timeout=timeout, sign=sign, region=region, credentials=credentials, config=config
        )

    @property
    def timeout(self) -> float:
        return self._sync.timeout

    async def _call(self, fn: Any, *args: Any) -> Any:
        # the socket timeout bounds each step; this bounds the whole call (with slack for a
        # busy thread pool)
        try:
            async with asyncio.timeout(self.timeout * 2 + 1):
                return await asyncio.to_thread(fn, *args)
        except TimeoutError:
            raise RequestTimedOutError(f"no answer within {self.timeout * 2 + 1:g} s") from None

    async def create_topic(
        self,
        name: str,
        partitions: int,
        replication_factor: int | None = None,
        configs: Mapping[str, Any] | None = None,
    ) -> TopicDescription:
        """Create a topic; ``replication_factor=None``: min(3, live agents)."""
        result: TopicDescription = await self._call(
            self._sync.create_topic, name, partitions, replication_factor, configs
        )
        return result

    async def list_topics(self) -> list[str]:
        """The topics that exist (not those being deleted)."""
        result: list[str] = await self._call(self._sync.list_topics)
        return result

    async def list_deleting_topics(self) -> list[str]:
        result: list[str] = await self._call(self._sync.list_deleting_topics)
        return result

    async def describe_topic(self, name: str) -> TopicDescription:
        result: TopicDescription = await self._call(self._sync.describe_topic, name)
        return result

    async def delete_topic(self, name: str) -> TopicDescription:
        """Start deleting a topic (see ``SyncAdmin.delete_topic``)."""
        result: TopicDescription = await self._call(self._sync.delete_topic, name)
        return result

    async def create_partitions(self, name: str, count: int) -> TopicDescription:
        """Grow the topic to ``count`` partitions in total (more than it has)."""
        result: TopicDescription = await self._call(self._sync.create_partitions, name, count)
        return result

    async def alter_configs(self, name: str, configs: Mapping[str, Any]) -> TopicDescription:
        """Change some configs (dotted names); a value of ``None`` restores the default."""
        result: TopicDescription = await self._call(self._sync.alter_configs, name, configs)
        return result

    async def list_groups(self) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = await self._call(self._sync.list_groups)
        return result

    async def describe_group(self, group: str) -> dict[str, Any]:
        result: dict[str, Any] = await self._call(self._sync.describe_group, group)
        return result

    async def reset_offsets(
        self,
        group: str,
        topic: str,
        to: str | Mapping[str, int],
        partitions: list[int] | None = None,
    ) -> dict[int, int]:
        result: dict[int, int] = await self._call(
            self._sync.reset_offsets, group, topic, to, partitions
        )
        return result

    async def delete_group(self, group: str) -> None:
        await self._call(self._sync.delete_group, group)

    async def create_delay_topics(
        self, partitions: int | None = None, replication_factor: int | None = None
    ) -> dict[str, list[str]]:
        result: dict[str, list[str]] = await self._call(
            self._sync.create_delay_topics, partitions, replication_factor
        )
        return result

    async def cancel_scheduled(self, schedule_id: str) -> bool:
        """Cancel a delayed record: True if it was in time, False if already delivered."""
        result: bool = await self._call(self._sync.cancel_scheduled, schedule_id)
        return result

    async def set_retry_policy(
        self, group: str, topic: str, policy: RetryPolicy | Mapping[str, Any]
    ) -> dict[str, Any]:
        return dict(await self._call(self._sync.set_retry_policy, group, topic, policy))

    async def get_retry_policy(self, group: str, topic: str) -> RetryPolicy:
        policy: RetryPolicy = await self._call(self._sync.get_retry_policy, group, topic)
        return policy

    async def dlq_count(self, topic: str) -> int:
        return int(await self._call(self._sync.dlq_count, topic))

    async def dlq_peek(self, topic: str, limit: int = 10) -> list[dict[str, Any]]:
        return list(await self._call(self._sync.dlq_peek, topic, limit))

    async def delays_status(self) -> dict[str, Any]:
        result: dict[str, Any] = await self._call(self._sync.delays_status)
        return result

    async def list_agents(self) -> list[dict[str, Any]]:
        return list(await self._call(self._sync.list_agents))

    async def decommission_agent(self, agent_id: int) -> dict[str, Any]:
        return dict(await self._call(self._sync.decommission_agent, agent_id))

    async def recommission_agent(self, agent_id: int) -> dict[str, Any]:
        return dict(await self._call(self._sync.recommission_agent, agent_id))

    async def rebalance(self, dry_run: bool = False) -> dict[str, Any]:
        return dict(await self._call(self._sync.rebalance, dry_run))

    async def elect_preferred_leaders(self, topics: list[str] | None = None) -> None:
        await self._call(self._sync.elect_preferred_leaders, topics)

    async def reassign_partition(
        self, topic: str, partition: int, replicas: list[int]
    ) -> dict[str, Any]:
        return dict(await self._call(self._sync.reassign_partition, topic, partition, replicas))

    async def list_users(self) -> dict[str, list[str]]:
        return dict(await self._call(self._sync.list_users))

    async def set_user(
        self, name: str, password: str, mechanisms: list[str] | None = None
    ) -> dict[str, Any]:
        return dict(await self._call(self._sync.set_user, name, password, mechanisms))

    async def delete_user(self, name: str) -> bool:
        return bool(await self._call(self._sync.delete_user, name))

    async def list_acls(self) -> list[dict[str, str]]:
        return list(await self._call(self._sync.list_acls))

    async def add_acls(self, acls: list[dict[str, str]]) -> list[dict[str, str]]:
        return list(await self._call(self._sync.add_acls, acls))

    async def remove_acls(self, acls: list[dict[str, str]]) -> int:
        return int(await self._call(self._sync.remove_acls, acls))

    async def list_quotas(self) -> dict[str, dict[str, int]]:
        return dict(await self._call(self._sync.list_quotas))

    async def set_quota(
        self,
        principal: str,
        producer_byte_rate: int | None = None,
        consumer_byte_rate: int | None = None,
        request_rate: int | None = None,
    ) -> dict[str, Any]:
        return dict(
            await self._call(
                self._sync.set_quota,
                principal,
                producer_byte_rate,
                consumer_byte_rate,
                request_rate,
            )
        )

    async def delete_quota(self, principal: str) -> bool:
        return bool(await self._call(self._sync.delete_quota, principal))

    async def close(self) -> None:
        self._sync.close()

    async def __aenter__(self) -> Admin:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()
