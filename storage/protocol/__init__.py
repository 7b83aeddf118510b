"""The wire protocol between clients and agents (and between agents): sans-IO codec.

``schema`` is the field-type language, ``messages`` the request/response bodies per API,
``frames`` the envelope. The SDK and the agents both use exactly this code.
"""

from storage.protocol.frames import (
    DEFAULT_MAX_FRAME,
    FrameSplitter,
    RequestFrame,
    ResponseFrame,
    decode_request_body,
    encode_error_response,
    encode_request,
    encode_response,
    parse_request,
    parse_response,
    read_size,
)
from storage.protocol.messages import APIS, ApiKey

__all__ = [
    "APIS",
    "DEFAULT_MAX_FRAME",
    "ApiKey",
    "FrameSplitter",
    "RequestFrame",
    "ResponseFrame",
    "decode_request_body",
    "encode_error_response",
    "encode_request",
    "encode_response",
    "parse_request",
    "parse_response",
    "read_size",
]
