"""API Gateway proxy events in, proxy responses out: parsing, routing, and the error statuses.

Handlers behind API Gateway (REST API payload 1.0, HTTP API payload 2.0) and behind the local
runtime (``infra.local_runtime``, which builds 2.0 events) share this module:

* :meth:`Request.from_event` reads either payload version: method, path (split into
  percent-decoded segments, so a topic name with an encoded ``/`` is one segment and gets a
  typed "invalid topic name" rather than a missing route), headers, query, and the body
  (base64 when ``isBase64Encoded``);
* :class:`Router` matches ``(method, segments)`` against a table of routes;
  no path -> 404, a path without that method -> 405;
* :func:`status_for` is the one place that gives every error its HTTP status, and
  :func:`error_response` the one body shape::

      {"error": {"type": "InvalidTopicError", "code": 17, "message": "...", "retriable": false}}

  ``code`` is the wire code of ``storage.errors``, so a client turns the body back into the
  same exception class with ``storage.errors.from_wire``. Anything that is not a
  :class:`StrataError` is a bug: it is logged with its traceback and answered with a 500 that
  shows only a request id.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import urllib.parse
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from storage.errors import (
    GroupIdNotFoundError,
    InvalidRequestError,
    NodeNotFoundError,
    NonEmptyGroupError,
    RequestTimedOutError,
    StrataError,
    TopicAlreadyExistsError,
    TopicDeletionInProgressError,
    UnknownTopicOrPartitionError,
)

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


@dataclass(frozen=True, slots=True)
class Route:
    """``pattern`` is a path such as ``/topics/{name}/partitions``."""

    method: str
    pattern: str
    endpoint: Endpoint

    @property
    def parts(self) -> tuple[str, ...]:
        return tuple(self.pattern.split("/")[1:])


class Router:
    """Routes proxy events to endpoints.

    ``invocation(context)`` builds what endpoints get as their second argument (for the
    handlers: a :class:`handlers.runtime.Invocation`, the call's deadline and runtime).
    """

    def __init__(self, routes: Sequence[Route], *, invocation: Callable[[Any], Any]) -> None:
        self.routes = tuple(routes)
        self.invocation = invocation

    def match(self, request: Request) -> tuple[Endpoint, dict[str, str]]:
        allowed: list[str] = []
        for route in self.routes:
            params = _match(route.parts, request.segments)
            if params is None:
                continue
            if route.method == request.method:
                return route.endpoint, params
            allowed.append(route.method)
        if allowed:
            raise MethodNotAllowedError(request.method, request.path, allowed)
        raise RouteNotFoundError(f"no such path: {request.path}")

    def serve(self, event: Mapping[str, Any], context: Any) -> dict[str, Any]:
        """Answer one proxy event with a proxy response; never raises."""
        try:
            request = Request.from_event(event)
            endpoint, params = self.match(request)
            response = endpoint(request, self.invocation(context), **params)
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
