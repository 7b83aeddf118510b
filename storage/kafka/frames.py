"""Kafka's frames: the size prefix, request headers, response headers (sans-IO).

::

    request    int32 size | int16 api_key | int16 api_version | int32 correlation_id
               | nullable string client_id (int16 length, even in flexible versions)
               | tagged fields (header v2: flexible request versions only) | body
    response   int32 size | int32 correlation_id
               | tagged fields (header v1: flexible response versions, ApiVersions excepted)
               | body

Big-endian, ``size`` counts the bytes after itself. Responses go back in request order;
``acks=0`` produce requests get none.

Errors at the frame boundary, Kafka's way, without dropping the connection:

* an API key that is not served, or a version outside the served range: the answer is the
  correlation id and ``UNSUPPORTED_VERSION`` (35) as the first field — for ApiVersions a
  whole v0 response listing what is served (what clients read to pick versions again);
* a body that does not parse: the API's response at that version with ``INVALID_REQUEST``
  (42) in its error fields (``error_response``);
* a size prefix over the listener's limit, or negative: ``FrameTooLargeError`` /
  ``MalformedFrameError`` from ``read_size`` (the listener then reads the request header,
  discards the rest of the frame without holding it, and answers as above with
  ``MESSAGE_TOO_LARGE`` (10)).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

from storage.errors import FrameTooLargeError, MalformedFrameError, UnsupportedVersionError
from storage.kafka.messages import API_VERSIONS_RESPONSE, SERVED, Api, ApiKey
from storage.kafka.wire import STRING, skip_tagged_fields

_SIZE = struct.Struct(">i")
_HEADER = struct.Struct(">hhi")
_CORRELATION = struct.Struct(">i")
_ERROR = struct.Struct(">h")
#: the fixed part of a request header (api key, version, correlation id)
FIXED_HEADER = _HEADER.size
_client_id, _ = STRING.coder(False, True)[:2]


def read_size(prefix: Any, max_frame: int) -> int:
    """The size in a 4-byte big-endian frame prefix, checked against ``max_frame``."""
    if len(prefix) != _SIZE.size:
        raise MalformedFrameError(f"a frame size prefix is 4 bytes, not {len(prefix)}")
    (size,) = _SIZE.unpack(prefix)
    if size < 0:
        raise MalformedFrameError(f"negative frame size {size}")
    if size > max_frame:
        raise FrameTooLargeError(size, max_frame)
    return int(size)


@dataclass(frozen=True, slots=True)
class RequestHeader:
    api_key: int
    api_version: int
    correlation_id: int
    client_id: str | None
    api: Api | None  # None: not served (or the version is not)


def parse_fixed(frame: Any) -> tuple[int, int, int]:
    """(api_key, api_version, correlation_id) of a request frame."""
    if len(frame) < FIXED_HEADER:
        raise MalformedFrameError(f"request frame of {len(frame)} bytes is shorter than a header")
    key, version, correlation = _HEADER.unpack_from(frame, 0)
    return int(key), int(version), int(correlation)


def parse_request(frame: Any) -> tuple[RequestHeader, memoryview]:
    """The header and body of a request frame (without its size prefix).

    ``RequestHeader.api`` is None when the API or its version is not served: the body is
    then not looked at (its header version is unknown). ``MalformedFrameError`` when even
    the header does not parse."""
    view = memoryview(frame).cast("B")
    key, version, correlation = parse_fixed(view)
    api = SERVED.get(key)
    if api is None or not api.min_version <= version <= api.max_version:
        return RequestHeader(key, version, correlation, None, None), view[len(view) :]
    client_id, pos = _client_id(view, FIXED_HEADER)
    if api.request_header_version(version) >= 2:
        pos = skip_tagged_fields(view, pos)
    return RequestHeader(key, version, correlation, client_id, api), view[pos:]


def decode_body(header: RequestHeader, body: memoryview) -> dict[str, Any]:
    """The request's fields; ``MalformedFrameError`` if the body does not parse exactly."""
    if header.api is None:
        raise UnsupportedVersionError(f"API {header.api_key} v{header.api_version} not served")
    result: dict[str, Any] = header.api.request.decode(body, header.api_version)
    return result


def encode_response(header: RequestHeader, body: dict[str, Any]) -> list[Any]:
    """The parts of a response frame (size prefix first)."""
    assert header.api is not None
    parts: list[Any] = [b"", _CORRELATION.pack(header.correlation_id)]
    if header.api.response_header_version(header.api_version) >= 1:
        parts.append(b"\x00")
    parts.extend(header.api.response.encode(body, header.api_version))
    parts[0] = _SIZE.pack(sum(memoryview(p).nbytes for p in parts[1:]))
    return parts


def served_versions() -> list[dict[str, int]]:
    return [
        {"api_key": a.key, "min_version": a.min_version, "max_version": a.max_version}
        for a in sorted(SERVED.values(), key=lambda a: a.key)
    ]


def unsupported_response(api_key: int, correlation_id: int) -> list[Any]:
    """The answer to an API or version that is not served (see the module docstring)."""
    if api_key == ApiKey.API_VERSIONS:
        body = API_VERSIONS_RESPONSE.encode(
            {"error_code": UnsupportedVersionError.code, "api_keys": served_versions()}, 0
        )
    else:
        body = [_ERROR.pack(UnsupportedVersionError.code)]
    parts: list[Any] = [b"", _CORRELATION.pack(correlation_id), *body]
    parts[0] = _SIZE.pack(sum(memoryview(p).nbytes for p in parts[1:]))
    return parts


def error_response(header: RequestHeader, code: int) -> list[Any]:
    """The API's response at the request's version, every top-level error field set to
    ``code`` and every list empty (for a request whose body could not be handled)."""
    assert header.api is not None
    body: dict[str, Any] = {"error_code": code}
    return encode_response(header, body)


def encode_request(
    api_key: int,
    api_version: int,
    correlation_id: int,
    client_id: str | None,
    body: dict[str, Any],
) -> bytes:
    """A whole request frame (tests, tools)."""
    api = SERVED[api_key]
    parts: list[Any] = [_HEADER.pack(api_key, api_version, correlation_id)]
    STRING.coder(False, True)[1](client_id, parts)
    if api.request_header_version(api_version) >= 2:
        parts.append(b"\x00")
    parts.extend(api.request.encode(body, api_version))
    data = b"".join(bytes(p) for p in parts)
    return _SIZE.pack(len(data)) + data


def parse_response(frame: Any, api_key: int, api_version: int) -> tuple[int, dict[str, Any]]:
    """(correlation_id, body) of a response frame without its size prefix (tests, tools)."""
    view = memoryview(frame).cast("B")
    if len(view) < 4:
        raise MalformedFrameError("response shorter than its header")
    (correlation,) = _CORRELATION.unpack_from(view, 0)
    api = SERVED[api_key]
    pos = 4
    if api.response_header_version(api_version) >= 1:
        pos = skip_tagged_fields(view, pos)
    return int(correlation), api.response.decode(view[pos:], api_version)
