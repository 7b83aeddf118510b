"""The Kafka listener's codec: Kafka frames in, ``KafkaApis`` handlers called, Kafka frames out.

``AgentServer`` does the rest exactly as for the native listener (one reader and one writer
task per connection, responses in request order, the request byte budget, idle and frame
timeouts), so the Kafka listener inherits its limits. What is Kafka's here, at the frame
boundary (``storage.kafka.frames``):

* an API or version that is not served: ``UNSUPPORTED_VERSION`` (for ApiVersions a whole v0
  answer listing what is served), connection kept;
* a body that does not parse: the API's response with ``INVALID_REQUEST`` (42);
* a frame over ``socket.request.max.bytes``: skipped as it arrives (never held) and answered
  with ``MESSAGE_TOO_LARGE`` (10) in the API's response (for Produce the response names no
  partition: nothing of the request could be read);
* a handler's typed error: the API's response with that error's Kafka code; any other
  exception is a bug: logged, ``UNKNOWN_SERVER_ERROR``, and the connection keeps serving.
"""

from __future__ import annotations

import logging
from typing import Any

from broker_agents.kafka.apis import KafkaApis
from broker_agents.security.authenticator import Authenticator, Session
from broker_agents.security.quotas import Quotas, Throttled, throttle
from storage.errors import MalformedFrameError, StrataError, UnsupportedSaslMechanismError
from storage.kafka import frames as kf
from storage.kafka.errors import MESSAGE_TOO_LARGE, UNKNOWN_SERVER_ERROR, code_of
from storage.kafka.messages import ApiKey
from storage.protocol.messages import ApiKey as NativeKey

log = logging.getLogger(__name__)


class KafkaRequest:
    __slots__ = ("api_key", "body", "header")

    def __init__(self, header: kf.RequestHeader, body: memoryview) -> None:
        self.header = header
        self.body = body
        self.api_key = header.api_key


class KafkaCodec:
    answers_oversize = True
    pre_auth_apis: frozenset[int] = frozenset(
        {ApiKey.API_VERSIONS, ApiKey.SASL_HANDSHAKE, ApiKey.SASL_AUTHENTICATE}
    )

    def __init__(
        self, apis: KafkaApis, auth: Authenticator | None = None, quotas: Quotas | None = None
    ) -> None:
        self.apis = apis
        self.auth = auth
        self.quotas = quotas

    def refuse(self, request: KafkaRequest, exc: StrataError) -> list[Any]:
        header = request.header
        if header.api is None:
            return kf.unsupported_response(header.api_key, header.correlation_id)
        return kf.error_response(header, code_of(exc))

    async def _sasl(
        self, header: kf.RequestHeader, body: dict[str, Any], session: Session | None
    ) -> list[Any]:
        """Kafka's SaslHandshake v1 / SaslAuthenticate: the same exchange as the native one;
        a SaslAuthenticate failure is answered in the body (error code and message)."""
        try:
            if self.auth is None or session is None:
                raise UnsupportedSaslMechanismError("this listener does not use SASL")
            if header.api_key == ApiKey.SASL_HANDSHAKE:
                offered = self.auth.handshake(session, body["mechanism"])
                return kf.encode_response(header, {"error_code": 0, "mechanisms": offered})
            answer = await self.auth.authenticate(session, body["auth_bytes"])
        except StrataError as exc:
            out: dict[str, Any] = {"error_code": code_of(exc), "error_message": str(exc)}
            if header.api_key == ApiKey.SASL_HANDSHAKE:
                out["mechanisms"] = list(self.auth.settings.mechanisms) if self.auth else []
            return kf.encode_response(header, out)
        return kf.encode_response(
            header, {"error_code": 0, "auth_bytes": answer, "session_lifetime_ms": 0}
        )

    def read_size(self, prefix: Any, max_frame: int) -> int:
        return kf.read_size(prefix, max_frame)

    def parse(self, frame: Any) -> KafkaRequest:
        header, body = kf.parse_request(frame)
        return KafkaRequest(header, body)

    def too_large(self, head: bytes, size: int) -> list[Any]:
        try:
            header, _ = kf.parse_request(head)
        except MalformedFrameError:
            header = kf.RequestHeader(-1, -1, -1, None, None)
        if header.api is None:
            return kf.unsupported_response(header.api_key, header.correlation_id)
        return kf.error_response(header, MESSAGE_TOO_LARGE)

    async def handle(
        self, request: KafkaRequest, session: Session | None = None
    ) -> list[Any] | Throttled | None:
        header = request.header
        if header.api is None:
            return kf.unsupported_response(header.api_key, header.correlation_id)
        try:
            body = kf.decode_body(header, request.body)
        except StrataError as exc:
            log.warning(
                "Kafka %s v%d from %s does not parse: %s",
                header.api.key.name,
                header.api_version,
                header.client_id,
                exc,
            )
            return kf.error_response(header, code_of(exc))
        if header.api_key in (ApiKey.SASL_HANDSHAKE, ApiKey.SASL_AUTHENTICATE):
            return await self._sasl(header, body, session)
        handler = self.apis.handlers[header.api_key]
        try:
            response = await handler(body, header.api_version)
        except StrataError as exc:
            return kf.error_response(header, code_of(exc))
        except Exception:  # a bug: answer and keep serving the others
            log.exception("Kafka %s handler failed", header.api.key.name)
            return kf.error_response(header, UNKNOWN_SERVER_ERROR)
        if self.quotas is None or not self.quotas.active:  # the common path: no call more
            return None if response is None else kf.encode_response(header, response)
        # acks=0 (no answer) is counted too; the quotas know the native keys
        return throttle(
            self.quotas,
            _QUOTA_KEYS.get(header.api_key, -1),
            body,
            len(request.body),
            response,
            lambda r: kf.encode_response(header, r),
            _set_throttle,
        )


_QUOTA_KEYS: dict[int, int] = {ApiKey.PRODUCE: NativeKey.PRODUCE, ApiKey.FETCH: NativeKey.FETCH}


def _set_throttle(response: Any, ms: int) -> bool:
    """Kafka's answers carry ``throttle_time_ms`` from their v1 (a version without the field
    leaves it out when encoding)."""
    if isinstance(response, dict):
        response["throttle_time_ms"] = ms
        return True
    return False
