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
from storage.errors import MalformedFrameError, StrataError
from storage.kafka import frames as kf
from storage.kafka.errors import MESSAGE_TOO_LARGE, UNKNOWN_SERVER_ERROR, code_of

log = logging.getLogger(__name__)


class KafkaRequest:
    __slots__ = ("api_key", "body", "header")

    def __init__(self, header: kf.RequestHeader, body: memoryview) -> None:
        self.header = header
        self.body = body
        self.api_key = header.api_key


class KafkaCodec:
    answers_oversize = True

    def __init__(self, apis: KafkaApis) -> None:
        self.apis = apis

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

    async def handle(self, request: KafkaRequest) -> list[Any] | None:
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
        handler = self.apis.handlers[header.api_key]
        try:
            response = await handler(body, header.api_version)
        except StrataError as exc:
            return kf.error_response(header, code_of(exc))
        except Exception:  # a bug: answer and keep serving the others
            log.exception("Kafka %s handler failed", header.api.key.name)
            return kf.error_response(header, UNKNOWN_SERVER_ERROR)
        if response is None:
            return None  # acks=0
        return kf.encode_response(header, response)
