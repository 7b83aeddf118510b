"""The one exception hierarchy of Strata.

Every error that crosses a module boundary is a :class:`StrataError`. Each class says whether
retrying the same request can succeed (``retriable``) and carries the wire error ``code`` that
the protocol sends for it; :func:`for_code` maps a code back to its class, so the SDK raises
the same types as the agents. Third-party exceptions (OSError, botocore, kazoo) are translated
at one boundary per adapter and never leak out.

    StrataError
    ├── InvalidRequestError            (the caller sent something wrong; not retriable)
    │   ├── CorruptBatchError          bad CRC, bad length, malformed body
    │   ├── UnsupportedVersionError    unknown batch magic / protocol version
    │   ├── BatchTooLargeError         batch over max.message.bytes
    │   ├── InvalidConfigError         a config value out of range
    │   └── InvalidOffsetError         truncate/seek target the log cannot honour
    ├── OffsetOutOfRangeError          offset below the log start or above the log end
    ├── StorageError                   local disk trouble (I/O error, disk full); retriable
    │   └── CorruptSegmentError        stored bytes failed verification; segment quarantined
    └── LogClosedError                 the log was closed under the caller; retriable
"""

from __future__ import annotations

from typing import ClassVar


class StrataError(Exception):
    """Root of every Strata error."""

    code: ClassVar[int] = -1
    retriable: ClassVar[bool] = False


class InvalidRequestError(StrataError):
    code = 42


class CorruptBatchError(InvalidRequestError):
    """A record batch failed a check: CRC, length, layout, or contents."""

    code = 2

    def __init__(self, message: str, *, position: int | None = None) -> None:
        super().__init__(message if position is None else f"{message} (at byte {position})")
        self.reason = message
        self.position = position


class UnsupportedVersionError(InvalidRequestError):
    code = 35


class BatchTooLargeError(InvalidRequestError):
    code = 10

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"record batch of {size} bytes exceeds the limit of {limit} bytes")
        self.size = size
        self.limit = limit


class InvalidConfigError(InvalidRequestError):
    code = 40


class InvalidOffsetError(InvalidRequestError):
    code = 44


class OffsetOutOfRangeError(StrataError):
    code = 1

    def __init__(self, offset: int, log_start: int, log_end: int) -> None:
        super().__init__(f"offset {offset} is outside the log [{log_start}, {log_end}]")
        self.offset = offset
        self.log_start = log_start
        self.log_end = log_end


class StorageError(StrataError):
    code = 56
    retriable = True


class CorruptSegmentError(StorageError):
    """Verified bytes on disk are damaged. The segment is quarantined, never skipped."""

    code = 57
    retriable = False

    def __init__(self, message: str, *, path: str, position: int | None = None) -> None:
        super().__init__(
            f"{message}: {path}" + ("" if position is None else f" at byte {position}")
        )
        self.path = path
        self.position = position


class LogClosedError(StrataError):
    code = 58
    retriable = True


_BY_CODE: dict[int, type[StrataError]] = {}


def _register() -> None:
    stack: list[type[StrataError]] = [StrataError]
    while stack:
        cls = stack.pop()
        _BY_CODE.setdefault(cls.code, cls)
        stack.extend(cls.__subclasses__())


def for_code(code: int) -> type[StrataError]:
    """The error class for a wire error code (StrataError for codes this version does not know)."""
    if not _BY_CODE:
        _register()
    return _BY_CODE.get(code, StrataError)
