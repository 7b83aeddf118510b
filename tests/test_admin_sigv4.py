"""The admin client signs its requests with SigV4 for the IAM-authorised admin API (#25).

A real HTTP server on loopback stands where API Gateway would; it checks each request the way
API Gateway does: it rebuilds the canonical request from what arrived (method, path, the
headers the client says it signed, the body) and lets botocore's own ``SigV4Auth`` compute
the signature at the request's ``X-Amz-Date``; only a match is answered. A body changed on
the way, a wrong secret, or an unsigned request is refused with 403.
"""

from __future__ import annotations

import http.server
import json
import re
import threading
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
from botocore.auth import SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials

from sdk.admin import SIGNED_SERVICE, SyncAdmin, signer_for
from storage.errors import InvalidRequestError, StrataError

REGION = "eu-west-1"
KEY, SECRET = "AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY"
AUTH = re.compile(
    r"^AWS4-HMAC-SHA256 Credential=(?P<key>[^/]+)/(?P<date>\d{8})/(?P<region>[^/]+)/"
    r"(?P<service>[^/]+)/aws4_request, SignedHeaders=(?P<signed>[^,]+), Signature=(?P<sig>[0-9a-f]{64})$"
)


def verify(method: str, url: str, headers: dict[str, str], body: bytes, secret: str) -> bool:
    """API Gateway's check, with botocore computing the signature."""
    found = AUTH.match(headers.get("authorization", ""))
    if found is None or (found["region"], found["service"]) != (REGION, SIGNED_SERVICE):
        return False
    signed = found["signed"].split(";")
    request = AWSRequest(
        method=method, url=url, data=body, headers={h: headers[h] for h in signed if h != "host"}
    )
    request.context["timestamp"] = headers["x-amz-date"]
    auth = SigV4Auth(Credentials(found["key"], secret), SIGNED_SERVICE, REGION)
    canonical = auth.canonical_request(request)
    expected = auth.signature(auth.string_to_sign(request, canonical), request)
    return bool(expected == found["sig"])


DESCRIPTION = json.dumps(
    {
        "name": "orders",
        "topic_id": "0" * 32,
        "created_ms": 0,
        "partitions": 3,
        "replication_factor": 1,
        "configs": {},
        "partition_states": [],
    }
).encode()


class _Gateway(http.server.BaseHTTPRequestHandler):
    tamper = False
    seen: ClassVar[list[dict[str, Any]]] = []

    def _handle(self) -> None:
        body = self.rfile.read(int(self.headers.get("content-length") or 0))
        if _Gateway.tamper and body:
            body = body.replace(b"orders", b"ordars")
        headers = {k.lower(): v for k, v in self.headers.items()}
        url = f"http://{self.headers['host']}{self.path}"
        ok = verify(self.command, url, headers, body, SECRET)
        _Gateway.seen.append({"path": self.path, "ok": ok, "headers": headers})
        if ok:
            status, answer = 200, b'{"topics": []}' if self.command == "GET" else DESCRIPTION
        else:
            status = 403
            answer = json.dumps({"message": "Forbidden"}).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    do_GET = do_POST = do_DELETE = _handle

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def gateway() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Gateway)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    _Gateway.tamper = False
    _Gateway.seen = []
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/prod"
    finally:
        server.shutdown()
        server.server_close()


def test_signed_requests_pass_botocores_check_and_unsigned_or_tampered_ones_fail(
    gateway: str,
) -> None:
    admin = SyncAdmin(gateway, sign=True, region=REGION, credentials=Credentials(KEY, SECRET))
    assert admin.list_topics() == []
    assert admin.create_topic("orders", 3).name == "orders"  # a request with a body
    assert [s["ok"] for s in _Gateway.seen] == [True, True]
    assert _Gateway.seen[1]["headers"]["content-type"] == "application/json"

    _Gateway.tamper = True  # the body changed after signing: the signature no longer holds
    with pytest.raises(StrataError, match="403"):
        admin.create_topic("orders", 3)
    _Gateway.tamper = False

    wrong = SyncAdmin(gateway, sign=True, region=REGION, credentials=Credentials(KEY, "nope"))
    with pytest.raises(StrataError, match="403"):
        wrong.list_topics()
    unsigned = SyncAdmin(gateway)  # loopback: "auto" does not sign
    with pytest.raises(StrataError, match="403"):
        unsigned.list_topics()
    assert "authorization" not in _Gateway.seen[-1]["headers"]
    assert [s["ok"] for s in _Gateway.seen[2:]] == [False, False, False]


def test_auto_signs_api_gateway_urls_with_their_region_and_nothing_else() -> None:
    creds = Credentials(KEY, SECRET)
    signer = signer_for(
        "https://a1b2c3.execute-api.ap-south-1.amazonaws.com/prod", credentials=creds
    )
    assert signer is not None and signer.region == "ap-south-1"
    assert signer_for("http://127.0.0.1:8080", credentials=creds) is None
    assert signer_for("https://admin.example.com", credentials=creds) is None
    assert signer_for("https://a1b2c3.execute-api.ap-south-1.amazonaws.com", False) is None
    with pytest.raises(InvalidRequestError, match="region"):
        signer_for("https://admin.example.com", True, credentials=creds)
