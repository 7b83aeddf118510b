"""API Gateway proxy events in, proxy responses out: parsing, routing, and the error statuses.

Handlers behind API Gateway (REST API payload 1.0, HTTP API payload 2.0) and behind the local
runtime (``infra.local_runtime``, which builds 2.0 events) share this module:

* :meth:`Request.from_event` reads either payload version: method, path (split into
  percent-decoded segments, so a topic name with an encoded ``/`` is one segment and gets a
  typed "invalid topic name" rather than a missing route), headers, query, and the body
  (base64 when ``isBase64Encoded``);
* :class:`Router` matches ``(method, segments)`` against a table of routes;
  no path -> 404, a path without that method -> 405;
* :func:`principal_of` finds who is calling (below);
* every :class:`Route` carries the :class:`Rule` that says what its caller needs (ACLs in
  Kafka's model); the router hands it to its ``guard`` (``handlers.access``) before the
  endpoint runs, and lets the guard filter a listing's answer;
* :func:`status_for` is the one place that gives every error its HTTP status, and
  :func:`error_response` the one body shape::

      {"error": {"type": "InvalidTopicError", "code": 17, "message": "...", "retriable": false}}

  ``code`` is the wire code of ``storage.errors``, so a client turns the body back into the
  same exception class with ``storage.errors.from_wire``. Anything that is not a
  :class:`StrataError` is a bug: it is logged with its traceback and answered with a 500 that
  shows only a request id.

**Who is calling** (:func:`principal_of`), Kafka's ``User:<name>`` form:

* API Gateway with IAM authorization: the caller's ARN, ``requestContext.authorizer.iam.userArn``
  (payload 2.0) or ``requestContext.identity.userArn`` (1.0), as ``User:<arn>``; an
  assumed-role session (``arn:aws:sts::<account>:assumed-role/<role>/<session>``) counts as
  its role, ``User:arn:aws:iam::<account>:role/<role>``, so that ACLs name roles, not sessions;
* a Lambda authorizer's context ``principal`` (``requestContext.authorizer.lambda.principal``
  in 2.0, ``requestContext.authorizer.principal`` in 1.0), which is how the local runtime
  passes the user it authenticated; ``alice`` and ``User:alice`` are the same;
* otherwise ``User:ANONYMOUS``.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import re
import urllib.parse
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from storage.errors import (
    AuthenticationFailedError,
    AuthorizationError,
    ClusterAuthorizationFailedError,
    GroupAuthorizationFailedError,
    GroupIdNotFoundError,
    InvalidRequestError,
    NodeNotFoundError,
    NonEmptyGroupError,
    RequestTimedOutError,
    StrataError,
    TopicAlreadyExistsError,
    TopicAuthorizationFailedError,
    TopicDeletionInProgressError,
    TransactionalIdAuthorizationFailedError,
    UnknownTopicOrPartitionError,
)
from storage.metadata.acls import CLUSTER_NAME, Operation, ResourceType

log = logging.getLogger(__name__)

JSON_TYPE = "application/json"
M = TypeVar("M", bound=BaseModel)


class RouteNotFoundError(InvalidRequestError):
    """No route has this path."""


class MethodNotAllowedError(InvalidRequestError):
    """The path exists, but not with this method (``allowed`` lists the methods it has)."""

    def __init__(self, method: str, path: str, allowed: Sequence[str]) -> None:
        super().__init__(f"{method} is not allowed on {path}; allowed: {', '.join(allowed)}")
        self.allowed = tuple(allowed)


class PayloadTooLargeError(InvalidRequestError):
    """The request body is over the size limit."""


class LengthRequiredError(InvalidRequestError):
    """A request body without a Content-Length (chunked uploads are not accepted)."""


class RequestReadTimeoutError(InvalidRequestError):
    """The client did not send the whole request in time."""


class InternalError(StrataError):
    """A bug or a misconfigured deployment: never the caller's fault, never retriable."""


# The one table of HTTP statuses. The most specific class in an error's MRO wins; errors not
# listed get 503 if retriable (ZooKeeper unavailable, a compare-and-set that kept losing),
# else 500.
_STATUS: dict[type[StrataError], int] = {
    InvalidRequestError: 400,
    AuthenticationFailedError: 401,
    AuthorizationError: 403,
    TopicAuthorizationFailedError: 403,
    GroupAuthorizationFailedError: 403,
    ClusterAuthorizationFailedError: 403,
    TransactionalIdAuthorizationFailedError: 403,
    RouteNotFoundError: 404,
    MethodNotAllowedError: 405,
    RequestReadTimeoutError: 408,
    TopicAlreadyExistsError: 409,
    TopicDeletionInProgressError: 409,
    LengthRequiredError: 411,
    PayloadTooLargeError: 413,
    UnknownTopicOrPartitionError: 404,
    RequestTimedOutError: 504,
    GroupIdNotFoundError: 404,
    NodeNotFoundError: 404,
    NonEmptyGroupError: 409,
}


def status_for(exc: StrataError) -> int:
    for cls in type(exc).__mro__:
        status = _STATUS.get(cls)
        if status is not None:
            return status
    return 503 if exc.retriable else 500


def error_body(exc: StrataError) -> dict[str, Any]:
    return {
        "error": {
            "type": type(exc).__name__,
            "code": exc.code,
            "message": str(exc),
            "retriable": exc.retriable,
        }
    }


def error_response(exc: StrataError) -> Response:
    headers = {}
    if isinstance(exc, AuthenticationFailedError):
        headers["www-authenticate"] = 'Basic realm="strata", charset="UTF-8"'
    if isinstance(exc, MethodNotAllowedError):
        headers["allow"] = ", ".join(exc.allowed)
    if exc.retriable and status_for(exc) == 503:
        headers["retry-after"] = "1"
    return Response(status_for(exc), error_body(exc), headers=headers)


@dataclass(frozen=True, slots=True)
class Response:
    """A JSON response (``body=None``: no content, as for 204)."""

    status: int
    body: Any = None
    headers: Mapping[str, str] = field(default_factory=dict)

    def to_proxy(self) -> dict[str, Any]:
        """The proxy integration's response (the same for payload 1.0 and 2.0)."""
        headers = dict(self.headers)
        text = ""
        if self.body is not None:
            headers["content-type"] = JSON_TYPE
            text = json.dumps(self.body, ensure_ascii=False)
        return {
            "statusCode": self.status,
            "headers": headers,
            "body": text,
            "isBase64Encoded": False,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class Request:
    method: str
    path: str
    segments: tuple[str, ...]
    """The path's segments, each percent-decoded (``/topics/a%2Fb`` -> ``("topics", "a/b")``)."""
    headers: Mapping[str, str]
    """Lower-case names; repeated headers joined with ``,`` (as payload 2.0 does)."""
    query: Mapping[str, str]
    body: bytes
    principal: str = "User:ANONYMOUS"
    """Who is calling (:func:`principal_of`)."""

    @classmethod
    def from_event(cls, event: Mapping[str, Any]) -> Request:
        """Read an API Gateway proxy event (payload 1.0 or 2.0); a malformed one -> 400."""
        if not isinstance(event, Mapping):
            raise InvalidRequestError("the event is not an API Gateway proxy event")
        context = event.get("requestContext") or {}
        if event.get("version") == "2.0" or "rawPath" in event:
            http = context.get("http") or {}
            method = http.get("method")
            path = event.get("rawPath") or http.get("path")
            stage = context.get("stage")
            # HTTP API puts a named stage in front of the path (not the $default stage)
            if isinstance(stage, str) and stage != "$default" and isinstance(path, str):
                prefix = f"/{stage}"
                if path == prefix or path.startswith(prefix + "/"):
                    path = path[len(prefix) :] or "/"
        else:
            method = event.get("httpMethod")
            path = event.get("path")
        if not isinstance(method, str) or not isinstance(path, str) or not path.startswith("/"):
            raise InvalidRequestError("the event has no HTTP method or path")
        raw_headers = event.get("headers") or {}
        headers = {str(k).lower(): str(v) for k, v in raw_headers.items()}
        query = {str(k): str(v) for k, v in (event.get("queryStringParameters") or {}).items()}
        return cls(
            method=method.upper(),
            path=path,
            # bytes that are not UTF-8 become U+FFFD, which no name allows
            segments=tuple(urllib.parse.unquote(s, errors="replace") for s in path.split("/")[1:]),
            headers=headers,
            query=query,
            body=_event_body(event),
            principal=principal_of(event),
        )

    def json(self) -> dict[str, Any]:
        """The body as a JSON object; missing, malformed or not an object -> 400."""
        if not self.body.strip():
            raise InvalidRequestError("the request needs a JSON object as its body")
        try:
            value = json.loads(self.body)
        except (UnicodeDecodeError, ValueError) as exc:
            raise InvalidRequestError(f"the request body is not valid JSON: {exc}") from None
        except RecursionError:
            raise InvalidRequestError("the request body nests too deeply") from None
        if not isinstance(value, dict):
            raise InvalidRequestError(
                f"the request body must be a JSON object, not {type(value).__name__}"
            )
        return value


ANONYMOUS = "User:ANONYMOUS"
_ASSUMED_ROLE = re.compile(
    r"^arn:(?P<partition>aws[a-z-]*):sts::(?P<account>\d{12}):assumed-role/(?P<role>[^/]+)/[^/]+$"
)


def iam_principal(arn: str) -> str:
    """``User:<arn>``; an assumed-role session's ARN becomes its role's."""
    found = _ASSUMED_ROLE.match(arn)
    if found is not None:
        return f"User:arn:{found['partition']}:iam::{found['account']}:role/{found['role']}"
    return f"User:{arn}"


def _at(tree: Any, *keys: str) -> Any:
    for key in keys:
        if not isinstance(tree, Mapping):
            return None
        tree = tree.get(key)
    return tree


def principal_of(event: Mapping[str, Any]) -> str:
    """Who sent ``event`` (see the module's docstring); ``User:ANONYMOUS`` if no one says."""
    context = event.get("requestContext")
    arn = _at(context, "authorizer", "iam", "userArn") or _at(context, "identity", "userArn")
    if isinstance(arn, str) and arn.startswith("arn:"):
        return iam_principal(arn)
    named = _at(context, "authorizer", "lambda", "principal")
    if named is None:
        named = _at(context, "authorizer", "principal")
    if isinstance(named, str) and named.strip() and named.strip() != "User:":
        named = named.strip()
        return named if named.startswith("User:") else f"User:{named}"
    return ANONYMOUS


def _event_body(event: Mapping[str, Any]) -> bytes:
    body = event.get("body")
    if body is None:
        return b""
    if not isinstance(body, str):
        raise InvalidRequestError("the event's body is not a string")
    if event.get("isBase64Encoded"):
        try:
            return base64.b64decode(body, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidRequestError("the event's body is not valid base64") from None
    return body.encode("utf-8", "surrogatepass")


def parse_body(
    model: type[M],
    data: Mapping[str, Any],
    *,
    errors: Mapping[str, type[InvalidRequestError]] = {},
) -> M:
    """Validate a JSON body with ``model``; a bad field raises the class ``errors`` names for it.

    The first bad field decides the class (``InvalidRequestError`` for fields not listed);
    the message names every bad field.
    """
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        problems = exc.errors()
        first = str(problems[0]["loc"][0]) if problems and problems[0]["loc"] else ""
        raise errors.get(first, InvalidRequestError)(describe_errors(exc)) from None


def describe_errors(exc: ValidationError) -> str:
    """pydantic's errors as one line: ``field: problem (got value); ...``."""
    parts = []
    for p in exc.errors():
        where = ".".join(str(x) for x in p["loc"]) or "body"
        text = f"{where}: {p['msg']}"
        if p["type"] not in ("missing", "extra_forbidden"):
            shown = repr(p["input"])
            text += f" (got {shown if len(shown) <= 80 else shown[:77] + '...'})"
        parts.append(text)
    return "; ".join(parts)


Endpoint = Callable[..., Response]
"""``endpoint(request, invocation, **path_params) -> Response``."""


# ---------------------------------------------------------------- what a route needs


@dataclass(frozen=True, slots=True)
class Source:
    """Where a needed resource's name comes from: ``text`` says it in the docs' table,
    ``resolve(request, params, store)`` finds it (``store`` for names kept in ZooKeeper, such
    as a redrive task's topics)."""

    text: str
    resolve: Callable[[Request, Mapping[str, str], Any], Awaitable[str]]


def path_param(param: str) -> Source:
    """The path parameter ``{param}``."""

    async def resolve(request: Request, params: Mapping[str, str], store: Any) -> str:
        return params[param]

    return Source(f"`{{{param}}}`", resolve)


def body_field(field_name: str) -> Source:
    """The JSON body's string field ``field_name`` (missing or not a string: 400)."""

    async def resolve(request: Request, params: Mapping[str, str], store: Any) -> str:
        value = request.json().get(field_name)
        if not isinstance(value, str):
            raise InvalidRequestError(f"{field_name}: a string is required")
        return value

    return Source(f"body `{field_name}`", resolve)


def computed(text: str, fn: Callable[[Request, Mapping[str, str]], str]) -> Source:
    """A name derived from the request by ``fn`` (which raises a typed error if it cannot)."""

    async def resolve(request: Request, params: Mapping[str, str], store: Any) -> str:
        return fn(request, params)

    return Source(text, resolve)


async def _cluster(request: Request, params: Mapping[str, str], store: Any) -> str:
    return CLUSTER_NAME


THE_CLUSTER = Source("the cluster", _cluster)


@dataclass(frozen=True, slots=True)
class Need:
    """``operation`` on the resource of type ``resource`` that ``name`` names."""

    operation: Operation
    resource: ResourceType
    name: Source

    def __str__(self) -> str:
        op = self.operation.capitalize()
        if self.name.text.startswith("the "):
            return f"{op} on {self.name.text}"
        return f"{op} on {self.resource.replace('_', ' ')} {self.name.text}"


@dataclass(frozen=True, slots=True)
class AnyOf:
    """One of ``needs`` is enough (Create on the topic, or on the cluster)."""

    needs: tuple[Need, ...]

    def __str__(self) -> str:
        return " or ".join(map(str, self.needs))


@dataclass(frozen=True, slots=True)
class Listing:
    """A 200 answer's ``body[key]`` leaves out the entries the caller may not ``operation``:
    entries are names, or objects whose ``field`` is the name."""

    key: str
    resource: ResourceType
    field: str | None = None
    operation: Operation = Operation.DESCRIBE

    def __str__(self) -> str:
        what = self.resource.replace("_", " ")
        if self.field is None:
            return f"`{self.key}` lists only the {what}s it may {self.operation}"
        return f"`{self.key}` lists only entries whose `{self.field}` is a {what} it may {self.operation}"


@dataclass(frozen=True, slots=True)
class Rule:
    """What a route's caller needs: every one of ``needs``; ``shows`` filters a listing."""

    needs: tuple[Need | AnyOf, ...] = ()
    shows: tuple[Listing, ...] = ()

    def __str__(self) -> str:
        parts = [str(n) for n in self.needs] or ["nothing"]
        return "; ".join(parts + [str(s) for s in self.shows])


def needs(*required: Need | AnyOf, shows: tuple[Listing, ...] = ()) -> Rule:
    return Rule(tuple(required), shows)


def on_topic(operation: Operation, name: Source) -> Need:
    return Need(operation, ResourceType.TOPIC, name)


def on_group(operation: Operation, name: Source) -> Need:
    return Need(operation, ResourceType.GROUP, name)


def on_cluster(operation: Operation) -> Need:
    return Need(operation, ResourceType.CLUSTER, THE_CLUSTER)


CLUSTER_DESCRIBE = needs(on_cluster(Operation.DESCRIBE))
"""The rule of a route that shows cluster-wide state (agents, users, ACLs, quotas)."""
CLUSTER_ALTER = needs(on_cluster(Operation.ALTER))
"""The rule of a route that changes cluster-wide state."""


@dataclass(frozen=True, slots=True)
class Route:
    """``pattern`` is a path such as ``/topics/{name}/partitions``; ``rule`` says what the
    caller needs (checked when the admin API's authorizer is on: ``handlers.access``)."""

    method: str
    pattern: str
    endpoint: Endpoint
    rule: Rule

    @property
    def parts(self) -> tuple[str, ...]:
        return tuple(self.pattern.split("/")[1:])


Guard = Callable[[Request, Route, Mapping[str, str], Any], Callable[[Response], Response] | None]
"""``guard(request, route, params, invocation)`` raises an ``AuthorizationError`` when the
caller may not use the route; it may return a function that filters the endpoint's answer."""


class Router:
    """Routes proxy events to endpoints.

    ``invocation(context)`` builds what endpoints get as their second argument (for the
    handlers: a :class:`handlers.runtime.Invocation`, the call's deadline and runtime);
    ``guard`` (if any) checks each call before its endpoint runs.
    """

    def __init__(
        self,
        routes: Sequence[Route],
        *,
        invocation: Callable[[Any], Any],
        guard: Guard | None = None,
    ) -> None:
        self.routes = tuple(routes)
        self.invocation = invocation
        self.guard = guard

    def match(self, request: Request) -> tuple[Route, dict[str, str]]:
        allowed: list[str] = []
        for route in self.routes:
            params = _match(route.parts, request.segments)
            if params is None:
                continue
            if route.method == request.method:
                return route, params
            allowed.append(route.method)
        if allowed:
            raise MethodNotAllowedError(request.method, request.path, allowed)
        raise RouteNotFoundError(f"no such path: {request.path}")

    def serve(self, event: Mapping[str, Any], context: Any) -> dict[str, Any]:
        """Answer one proxy event with a proxy response; never raises."""
        try:
            request = Request.from_event(event)
            route, params = self.match(request)
            invocation = self.invocation(context)
            shown = None
            if self.guard is not None:
                shown = self.guard(request, route, params, invocation)
            response = route.endpoint(request, invocation, **params)
            if shown is not None:
                response = shown(response)
        except StrataError as exc:
            response = error_response(exc)
        except Exception:
            request_id = uuid.uuid4().hex
            log.exception("unexpected error (request id %s)", request_id)
            response = error_response(InternalError(f"internal error (request id {request_id})"))
        return response.to_proxy()


def _match(parts: tuple[str, ...], segments: tuple[str, ...]) -> dict[str, str] | None:
    if len(parts) != len(segments):
        return None
    params = {}
    for part, segment in zip(parts, segments, strict=True):
        if part.startswith("{") and part.endswith("}"):
            params[part[1:-1]] = segment
        elif part != segment:
            return None
    return params
