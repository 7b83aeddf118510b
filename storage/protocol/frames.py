"""Frames: the envelope around every request and response on a connection.

::

    request   int32 size | int16 api_key | int16 api_version | int32 correlation_id
              | string client_id | body
    response  int32 size | int32 correlation_id | int16 error_code
              | body                (error_code == 0: the API's response body)
              | string message      (error_code != 0: nothing else follows)

``size`` counts the bytes after itself. A connection carries any number of requests without
waiting for answers (pipelining); responses come back in request order and are matched by
``correlation_id``. A produce request with ``acks=0`` gets no response at all.

``FrameSplitter`` is the sans-IO reader: ``feed`` bytes, take whole frames out. A size field
beyond the connection's limit raises ``FrameTooLargeError`` before anything is buffered
toward it; what cannot be parsed raises ``MalformedFrameError`` — the connection is then
closed, since the stream can no longer be trusted.

A request whose header parses but whose API key or version is unknown, or whose body does
not parse, gets a response with a non-zero ``error_code`` (``UNSUPPORTED_VERSION``,
``INVALID_REQUEST``) and the connection stays open.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

from storage.errors import (
    FrameTooLargeError,
    MalformedFrameError,
    StrataError,
    UnsupportedVersionError,
    from_wire,
)
from storage.protocol.messages import APIS
from storage.protocol.schema import STRING, Message

DEFAULT_MAX_FRAME = 64 << 20
_SIZE = struct.Struct("<i")
_REQUEST_HEADER = struct.Struct("<hhi")
_RESPONSE_HEADER = struct.Struct("<ih")


@dataclass(frozen=True, slots=True)
class RequestFrame:
    api_key: int
    api_version: int
    correlation_id: int
    client_id: str | None
    body: memoryview


@dataclass(frozen=True, slots=True)
class ResponseFrame:
    correlation_id: int
    error_code: int
    body: memoryview

    def error(self) -> StrataError | None:
        if not self.error_code:
            return None
        message, end = STRING.decode(self.body, 0) if self.body else (None, 0)
        if end != len(self.body):
            raise MalformedFrameError(
                f"{len(self.body) - end} unexpected bytes after an error message"
            )
        return from_wire(self.error_code, message)


#: parts up to this size are joined with their small neighbours; larger ones (record batches)
#: are sent as they are, without a copy
SMALL_PART = 4096


def _framed(parts: list[Any]) -> list[Any]:
    """``parts`` (``parts[0]`` the frame header) with the size prefix in front and every run
    of small ``bytes`` joined into one: a response of a few dozen fields leaves as one buffer,
    so the send path and the kernel see one piece instead of one per field."""
    out: list[Any] = []
    run: list[bytes] = []
    total = 0
    for p in parts:
        if type(p) is bytes and len(p) <= SMALL_PART:
            run.append(p)
            total += len(p)
            continue
        if run:
            out.append(b"".join(run))
            run = []
        out.append(p)
        total += memoryview(p).nbytes
    if run:
        out.append(b"".join(run))
    out[0] = _SIZE.pack(total) + out[0]  # (the header is small: always in the first run)
    return out


def encode_request(
    api_key: int, correlation_id: int, client_id: str | None, body: Message, api_version: int = 0
) -> list[Any]:
    """The parts of a request frame (``transport.writelines`` them; bytes fields are not copied)."""
    parts: list[Any] = [_REQUEST_HEADER.pack(api_key, api_version, correlation_id)]
    STRING.encode(client_id, parts)
    parts.extend(body.encode())
    return _framed(parts)


def encode_response(correlation_id: int, body: Message) -> list[Any]:
    parts: list[Any] = [_RESPONSE_HEADER.pack(correlation_id, 0)]
    parts.extend(body.encode())
    return _framed(parts)


def encode_error_response(correlation_id: int, error_code: int, message: str) -> list[Any]:
    if not error_code:
        raise ValueError("an error response needs a non-zero error code")
    parts: list[Any] = [_RESPONSE_HEADER.pack(correlation_id, error_code)]
    STRING.encode(message[:1000], parts)
    return _framed(parts)


def parse_request(frame: Any) -> RequestFrame:
    """Header fields and body of one request frame (without its size prefix)."""
    view = memoryview(frame)
    if len(view) < _REQUEST_HEADER.size + 2:
        raise MalformedFrameError(f"request frame of {len(view)} bytes is shorter than its header")
    api_key, api_version, correlation_id = _REQUEST_HEADER.unpack_from(view, 0)
    client_id, pos = STRING.decode(view, _REQUEST_HEADER.size)
    return RequestFrame(api_key, api_version, correlation_id, client_id, view[pos:])


def parse_response(frame: Any) -> ResponseFrame:
    view = memoryview(frame)
    if len(view) < _RESPONSE_HEADER.size:
        raise MalformedFrameError(f"response frame of {len(view)} bytes is shorter than its header")
    correlation_id, error_code = _RESPONSE_HEADER.unpack_from(view, 0)
    return ResponseFrame(correlation_id, error_code, view[_RESPONSE_HEADER.size :])


def decode_request_body(frame: RequestFrame) -> Message:
    """The request dataclass of a frame; ``UnsupportedVersionError`` / ``MalformedFrameError``."""
    api = APIS.get(frame.api_key)
    if api is None:
        raise UnsupportedVersionError(f"unknown API key {frame.api_key}")
    if not api.min_version <= frame.api_version <= api.max_version:
        raise UnsupportedVersionError(
            f"API {api.key.name} version {frame.api_version} not in [{api.min_version}, {api.max_version}]"
        )
    result: Message = api.request.decode(frame.body)
    return result


class FrameSplitter:
    """Sans-IO: splits a byte stream into size-prefixed frames, with a bounded buffer."""

    def __init__(self, max_frame: int = DEFAULT_MAX_FRAME) -> None:
        self.max_frame = max_frame
        self._buf = bytearray()
        self._pos = 0

    @property
    def buffered(self) -> int:
        return len(self._buf) - self._pos

    def feed(self, data: Any) -> None:
        if self._pos and self._pos * 2 > len(self._buf):
            del self._buf[: self._pos]
            self._pos = 0
        self._buf += data

    def next_frame(self) -> bytes | None:
        """The next whole frame (without its size prefix), or None if more bytes are needed."""
        if self.buffered < 4:
            return None
        (size,) = _SIZE.unpack_from(self._buf, self._pos)
        self.check_size(size)
        if self.buffered < 4 + size:
            return None
        start = self._pos + 4
        frame = bytes(self._buf[start : start + size])
        self._pos = start + size
        return frame

    def check_size(self, size: int) -> None:
        if size < 0:
            raise MalformedFrameError(f"negative frame size {size}")
        if size > self.max_frame:
            raise FrameTooLargeError(size, self.max_frame)


def read_size(prefix: bytes | memoryview, max_frame: int) -> int:
    """The size in a 4-byte frame prefix, checked against ``max_frame`` (for stream readers)."""
    if len(prefix) != _SIZE.size:
        raise MalformedFrameError(f"a frame size prefix is 4 bytes, not {len(prefix)}")
    (size,) = _SIZE.unpack(prefix)
    if size < 0:
        raise MalformedFrameError(f"negative frame size {size}")
    if size > max_frame:
        raise FrameTooLargeError(size, max_frame)
    return int(size)
