"""The local handler runtime: the Lambda handlers served over HTTP on loopback.

``python -m infra.local_runtime --port 0 --zookeeper 127.0.0.1:2181/strata`` serves the very
same ``handler(event, context)`` functions that run in AWS Lambda behind API Gateway: each
HTTP request becomes an HTTP API (payload 2.0) proxy event, the handler's proxy response
becomes the HTTP response. When it is ready it prints one JSON line on stdout::

    {"event": "listening", "url": "http://127.0.0.1:40123"}

and it stops cleanly on SIGTERM or SIGINT (closing the handlers' ZooKeeper session).

Bounds, as an API Gateway in front would impose them:

* a request body over ``--max-body-bytes`` (1 MiB) gets 413 before the body is read (then up
  to 4 MiB of it is read and dropped, within the request timeout, so that the client sees
  the 413 rather than a reset); a body without Content-Length (chunked) gets 411;
* a client that is silent for ``--request-timeout`` s (10) while sending its request, or
  idle that long on a keep-alive connection, is disconnected (with a 408 if its body stalls);
* at most ``--max-connections`` (64) connections are served at once; more get 503 at once;
* each invocation gets a context whose ``get_remaining_time_in_millis`` counts down from
  ``--handler-timeout`` s (30), as Lambda's does; the handlers bound their work by it.

With ``--authenticate`` (a secured local stack) every request must carry HTTP Basic
credentials of a SCRAM user in ZooKeeper (``infra.basic_auth``): a missing or wrong one gets
401; a right one reaches the handler with its principal where a Lambda authorizer puts it
(``requestContext.authorizer.lambda.principal``) and without the ``Authorization`` header.

Errors produced here have the handlers' error body (``handlers.http.error_body``).
:func:`start_local_runtime` runs it as a child process for the local stack; tests start it
through their process group and read the URL with :func:`wait_for_listening`.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import importlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from handlers.http import (
    InternalError,
    LengthRequiredError,
    MethodNotAllowedError,
    PayloadTooLargeError,
    RequestReadTimeoutError,
    error_body,
    error_response,
    status_for,
)
from infra.basic_auth import BasicAuthenticator
from infra.processes import (
    ChildProcess,
    LocalStackError,
    log_tail,
    spawn,
    terminate,
    wait_until_ready,
)
from storage import jsonlog
from storage.errors import InvalidConfigError, InvalidRequestError, NetworkError, StrataError
from storage.metadata.users import ScramCredential, UserStore

log = logging.getLogger("infra.local_runtime")

HOST = "127.0.0.1"
MAX_BODY_BYTES = 1 << 20
REQUEST_TIMEOUT = 10.0
HANDLER_TIMEOUT = 30.0
MAX_CONNECTIONS = 64
DRAIN_BYTES = 4 << 20
"""At most this much of a refused body is read and dropped before the connection closes."""
FUNCTION_NAME = "strata-admin"
ALLOWED_METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS")

Handler = Callable[[Mapping[str, Any], Any], Mapping[str, Any]]


@dataclass(frozen=True, slots=True, kw_only=True)
class Mount:
    """Requests whose path starts with ``prefix`` go to ``handler`` (``module:function``)."""

    prefix: str
    handler: str
    function_name: str

    def load(self) -> Handler:
        module, _, name = self.handler.partition(":")
        fn: Handler = getattr(importlib.import_module(module), name)
        return fn


MOUNTS: tuple[Mount, ...] = (
    Mount(prefix="/", handler="handlers.admin:handler", function_name=FUNCTION_NAME),
)
"""Longest prefix wins. The admin API answers every path (its own 404 for unknown ones)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RuntimeOptions:
    host: str = HOST
    port: int = 0
    max_body_bytes: int = MAX_BODY_BYTES
    request_timeout: float = REQUEST_TIMEOUT
    handler_timeout: float = HANDLER_TIMEOUT
    max_connections: int = MAX_CONNECTIONS
    mounts: tuple[Mount, ...] = MOUNTS
    authenticate: bool = False
    """HTTP Basic against the SCRAM users in ZooKeeper (``infra.basic_auth``)."""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise InvalidConfigError(f"port {self.port} is out of range")
        for name in ("max_body_bytes", "request_timeout", "handler_timeout", "max_connections"):
            if not getattr(self, name) > 0:
                raise InvalidConfigError(f"{name.replace('_', '-')} must be positive")


@dataclass(slots=True)
class LambdaContext:
    """The parts of Lambda's context object that handlers use."""

    function_name: str
    aws_request_id: str
    timeout: float
    function_version: str = "$LATEST"
    memory_limit_in_mb: int = 512
    log_group_name: str = ""
    log_stream_name: str = "local"
    invoked_function_arn: str = ""
    _deadline: float = field(default=0.0, repr=False)

    def __post_init__(self) -> None:
        self._deadline = time.monotonic() + self.timeout
        self.log_group_name = self.log_group_name or f"/aws/lambda/{self.function_name}"
        self.invoked_function_arn = (
            self.invoked_function_arn
            or f"arn:aws:lambda:local:000000000000:function:{self.function_name}"
        )

    def get_remaining_time_in_millis(self) -> int:
        return max(0, int((self._deadline - time.monotonic()) * 1000))


def build_event(
    *,
    method: str,
    target: str,
    headers: Mapping[str, str],
    body: bytes,
    source_ip: str,
    request_id: str,
) -> dict[str, Any]:
    """An HTTP API (payload 2.0) proxy event, as API Gateway sends it to a Lambda."""
    parts = urllib.parse.urlsplit(target)
    query: dict[str, str] = {}
    for key, value in urllib.parse.parse_qsl(parts.query, keep_blank_values=True):
        query[key] = f"{query[key]},{value}" if key in query else value
    try:
        text, encoded = body.decode("utf-8"), False
    except UnicodeDecodeError:
        text, encoded = base64.b64encode(body).decode("ascii"), True
    now = time.time()
    event: dict[str, Any] = {
        "version": "2.0",
        "routeKey": "$default",
        "rawPath": parts.path or "/",
        "rawQueryString": parts.query,
        "headers": dict(headers),
        "requestContext": {
            "accountId": "000000000000",
            "apiId": "local",
            "domainName": headers.get("host", HOST),
            "domainPrefix": "local",
            "http": {
                "method": method,
                "path": urllib.parse.unquote(parts.path or "/"),
                "protocol": "HTTP/1.1",
                "sourceIp": source_ip,
                "userAgent": headers.get("user-agent", ""),
            },
            "requestId": request_id,
            "routeKey": "$default",
            "stage": "$default",
            "time": time.strftime("%d/%b/%Y:%H:%M:%S +0000", time.gmtime(now)),
            "timeEpoch": int(now * 1000),
        },
        "isBase64Encoded": encoded,
    }
    if query:
        event["queryStringParameters"] = query
    if body:
        event["body"] = text
    return event


class _RequestHandler(BaseHTTPRequestHandler):
    server: LocalRuntimeServer
    protocol_version = "HTTP/1.1"
    server_version = "strata-local-runtime"

    def do_GET(self) -> None:
        self._invoke()

    do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = do_OPTIONS = do_GET

    def version_string(self) -> str:
        return self.server_version

    def _invoke(self) -> None:
        options = self.server.options
        if "chunked" in self.headers.get("transfer-encoding", "").lower():
            self._send_error(LengthRequiredError("send the body with a Content-Length"))
            return
        try:
            length = int(self.headers.get("content-length") or 0)
            if length < 0:
                raise ValueError
        except ValueError:
            self._send_error(InvalidRequestError("bad Content-Length"))
            return
        if length > options.max_body_bytes:
            self._send_error(
                PayloadTooLargeError(
                    f"request body of {length} bytes is over the limit of "
                    f"{options.max_body_bytes} bytes"
                )
            )
            self._drain(min(length, DRAIN_BYTES))
            return
        try:
            body = self.rfile.read(length)
        except TimeoutError:
            self._send_error(RequestReadTimeoutError("the request body did not arrive in time"))
            return
        if len(body) < length:
            self.close_connection = True
            return  # the client went away mid-body
        mount = self.server.mount_for(urllib.parse.urlsplit(self.path).path)
        request_id = uuid.uuid4().hex
        headers: dict[str, str] = {}
        for name, value in self.headers.items():
            key = name.lower()
            headers[key] = f"{headers[key]},{value}" if key in headers else value
        principal = None
        authenticator = self.server.authenticator
        if authenticator is not None:
            try:
                principal = authenticator.authenticate(
                    headers.pop("authorization", None), self.client_address[0]
                )
            except StrataError as exc:
                answer = error_response(exc).to_proxy()
                self._send(answer["statusCode"], answer["headers"], answer["body"].encode())
                log.info("%s %s -> %d", self.command, self.path, answer["statusCode"])
                return
            except Exception:
                log.exception("authentication failed unexpectedly (request %s)", request_id)
                self._send_error(InternalError(f"internal error (request id {request_id})"))
                return
        event = build_event(
            method=self.command,
            target=self.path,
            headers=headers,
            body=body,
            source_ip=self.client_address[0],
            request_id=request_id,
        )
        if principal is not None:
            event["requestContext"]["authorizer"] = {"lambda": {"principal": principal}}
        context = LambdaContext(
            function_name=mount.function_name,
            aws_request_id=request_id,
            timeout=options.handler_timeout,
        )
        started = time.monotonic()
        try:
            result = self.server.handler(mount)(event, context)
            status, out_headers, payload = _proxy_response(result)
        except Exception:
            log.exception("handler %s failed (request %s)", mount.handler, request_id)
            self._send_error(NetworkError(f"the handler failed (request id {request_id})"), 502)
            return
        self._send(status, out_headers, payload)
        log.info(
            "%s %s -> %d in %.1f ms",
            self.command,
            self.path,
            status,
            (time.monotonic() - started) * 1000,
        )

    def _drain(self, limit: int) -> None:
        """Read and drop up to ``limit`` bytes of an unwanted body, so that a client still
        sending it reads our answer instead of a reset connection (a lingering close)."""
        with contextlib.suppress(OSError):
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_WR)
            while limit > 0 and (chunk := self.rfile.read1(min(limit, 65536))):
                limit -= len(chunk)

    def _send(self, status: int, headers: Mapping[str, str], payload: bytes) -> None:
        self.send_response(status)
        for name, value in headers.items():
            if name.lower() not in ("content-length", "connection", "transfer-encoding"):
                self.send_header(name, value)
        self.send_header("content-length", str(len(payload)))
        if self.close_connection:
            self.send_header("connection", "close")
        self.end_headers()
        if self.command != "HEAD" and payload:
            self.wfile.write(payload)

    def _send_error(self, exc: StrataError, status: int | None = None) -> None:
        # the request was not (or not wholly) read: do not reuse the connection
        self.close_connection = True
        payload = json.dumps(error_body(exc)).encode()
        self._send(status or status_for(exc), {"content-type": "application/json"}, payload)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """http.server's own errors (bad request line, header too long...), in our body shape."""
        self.close_connection = True
        exc: StrataError = InvalidRequestError(message or HTTPStatus(code).phrase)
        if code == HTTPStatus.NOT_IMPLEMENTED:  # a method we have no do_* for: the caller's error
            exc = MethodNotAllowedError(str(self.command), self.path, ALLOWED_METHODS)
            code = status_for(exc)
        payload = json.dumps(error_body(exc)).encode()
        with contextlib.suppress(OSError):
            self._send(code, {"content-type": "application/json"}, payload)

    def handle_one_request(self) -> None:
        try:
            super().handle_one_request()
        except TimeoutError:
            self.close_connection = True  # idle keep-alive or a half-sent request line
        except ConnectionError:
            self.close_connection = True

    def log_message(self, format: str, *args: Any) -> None:
        log.debug(format, *args)


def _proxy_response(result: Mapping[str, Any]) -> tuple[int, dict[str, str], bytes]:
    """A handler's proxy response as (status, headers, body bytes)."""
    if not isinstance(result, Mapping):
        raise TypeError(f"the handler returned {type(result).__name__}, not a dict")
    if "statusCode" not in result:
        # payload 2.0 also accepts a bare JSON value as a 200
        return 200, {"content-type": "application/json"}, json.dumps(result).encode()
    status = int(result["statusCode"])
    headers = {str(k): str(v) for k, v in (result.get("headers") or {}).items()}
    body = result.get("body") or ""
    payload = base64.b64decode(body) if result.get("isBase64Encoded") else str(body).encode()
    return status, headers, payload


class LocalRuntimeServer(ThreadingHTTPServer):
    """A thread per connection, at most ``max_connections`` of them."""

    daemon_threads = True
    block_on_close = False

    def __init__(self, options: RuntimeOptions) -> None:
        self.options = options
        self._slots = threading.BoundedSemaphore(options.max_connections)
        self._handlers: dict[str, Handler] = {m.handler: m.load() for m in options.mounts}
        self._mounts = sorted(options.mounts, key=lambda m: len(m.prefix), reverse=True)
        self.authenticator = BasicAuthenticator(_zookeeper_users) if options.authenticate else None
        # the socket timeout of every connection (StreamRequestHandler.timeout)
        handler = type("RequestHandler", (_RequestHandler,), {"timeout": options.request_timeout})
        super().__init__((options.host, options.port), handler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host!s}:{port}"

    def mount_for(self, path: str) -> Mount:
        for mount in self._mounts:
            if path.startswith(mount.prefix):
                return mount
        return self._mounts[-1]

    def handler(self, mount: Mount) -> Handler:
        return self._handlers[mount.handler]

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self._refuse(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def _refuse(self, request: socket.socket) -> None:
        body = json.dumps(error_body(NetworkError("too many connections; try again"))).encode()
        head = (
            "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nretry-after: 1\r\nconnection: close\r\n\r\n"
        )
        with contextlib.suppress(OSError):
            request.settimeout(1.0)
            request.sendall(head.encode() + body)
        self.shutdown_request(request)


def _zookeeper_users(user: str) -> dict[str, ScramCredential] | None:
    """A user's verifiers, read through the handlers' ZooKeeper session."""
    from handlers.runtime import shared_runtime

    runtime = shared_runtime()
    return runtime.call(
        lambda store: UserStore(store.zk).get(user), timeout=runtime.config.call_timeout
    )


def serve(options: RuntimeOptions, *, ready: Callable[[str], None]) -> None:
    """Serve until SIGTERM or SIGINT (main thread only); ``ready(url)`` once listening."""
    from handlers.runtime import close_shared_runtime

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    server = LocalRuntimeServer(options)
    thread = threading.Thread(target=server.serve_forever, args=(0.1,), name="http", daemon=True)
    thread.start()
    try:
        ready(server.url)
        stop.wait()
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5.0)
        close_shared_runtime()
    log.info("stopped")


def parse_args(argv: list[str] | None = None) -> tuple[RuntimeOptions, str]:
    p = argparse.ArgumentParser(description="Serve the Strata handlers over HTTP on loopback")
    p.add_argument("--host", default=HOST)
    p.add_argument("--port", type=int, default=0, help="0: any free port")
    p.add_argument("--zookeeper", required=True, help="host:port[/chroot]")
    p.add_argument("--max-body-bytes", type=int, default=MAX_BODY_BYTES)
    p.add_argument("--request-timeout", type=float, default=REQUEST_TIMEOUT, help="seconds")
    p.add_argument("--handler-timeout", type=float, default=HANDLER_TIMEOUT, help="seconds")
    p.add_argument("--max-connections", type=int, default=MAX_CONNECTIONS)
    p.add_argument(
        "--authenticate",
        action="store_true",
        help="require HTTP Basic credentials of a SCRAM user in ZooKeeper",
    )
    args = p.parse_args(argv)
    options = RuntimeOptions(
        host=args.host,
        port=args.port,
        max_body_bytes=args.max_body_bytes,
        request_timeout=args.request_timeout,
        handler_timeout=args.handler_timeout,
        max_connections=args.max_connections,
        authenticate=args.authenticate,
    )
    return options, args.zookeeper


def main(argv: list[str] | None = None) -> int:
    jsonlog.configure()
    try:
        options, zookeeper = parse_args(argv)
    except StrataError as exc:
        print(f"local_runtime: {exc}", file=sys.stderr)
        return 2
    os.environ["STRATA_ZOOKEEPER_CONNECT"] = zookeeper

    def ready(url: str) -> None:
        print(json.dumps({"event": "listening", "url": url}), flush=True)

    serve(options, ready=ready)
    return 0


# ---------------------------------------------------------------- as a child process


def listening_url(log_path: Path) -> str | None:
    """The URL from the ``{"event": "listening"}`` line of a runtime's output, if printed yet."""
    try:
        text = log_path.read_text(errors="replace")
    except FileNotFoundError:
        return None
    for line in text.splitlines():
        if '"listening"' not in line:
            continue
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            if isinstance(record, dict) and record.get("event") == "listening":
                return str(record["url"])
    return None


def wait_for_listening(
    process: subprocess.Popen[bytes], log_path: Path, *, timeout: float = 20.0
) -> str:
    """Wait until the child at ``process`` (output in ``log_path``) listens; return its URL."""
    wait_until_ready(
        process,
        lambda: listening_url(log_path) is not None,
        what="the local handler runtime",
        log_path=log_path,
        timeout=timeout,
    )
    url = listening_url(log_path)
    if url is None:  # pragma: no cover - wait_until_ready returned, so it is there
        raise LocalStackError(f"no listening line in {log_path}:\n{log_tail(log_path)}")
    return url


def command(zookeeper: str, *, port: int = 0, extra: tuple[str, ...] = ()) -> list[str]:
    """The command line that starts the runtime with this interpreter."""
    return [
        sys.executable,
        "-m",
        "infra.local_runtime",
        "--port",
        str(port),
        "--zookeeper",
        zookeeper,
        *extra,
    ]


@dataclass(frozen=True, slots=True, kw_only=True)
class LocalRuntimeProcess(ChildProcess):
    """A running local runtime child; stop it with :meth:`stop` or a ``with`` block."""

    url: str
    log_path: Path


def start_local_runtime(
    zookeeper: str,
    *,
    log_path: Path,
    port: int = 0,
    extra_args: tuple[str, ...] = (),
    startup_timeout: float = 20.0,
    die_with_parent: bool = True,
    env: dict[str, str] | None = None,
) -> LocalRuntimeProcess:
    """Start the runtime as a child process (output in ``log_path``) and wait until it listens."""
    process = spawn(
        command(zookeeper, port=port, extra=extra_args),
        log_path=log_path,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        die_with_parent=die_with_parent,
    )
    try:
        url = wait_for_listening(process, log_path, timeout=startup_timeout)
    except BaseException:
        terminate(process)
        raise
    return LocalRuntimeProcess(url=url, log_path=log_path, _process=process)


if __name__ == "__main__":
    sys.exit(main())
