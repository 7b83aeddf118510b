"""Strata's error codes as Kafka clients understand them (one place).

Strata uses Kafka's code wherever Kafka has the same error (``storage/errors.py``), so those
pass through. Codes from 1000 up are Strata's own and mean nothing to a Kafka client; they
become the nearest Kafka error with the same retry behaviour:

==========================================  ==============================================
Strata                                      Kafka
==========================================  ==============================================
UploadBacklogError, LogDirFullError,        KAFKA_STORAGE_ERROR (56, retriable: the client
ObjectStoreError, CorruptSegmentError,      refreshes metadata and retries)
StorageError
LogClosedError                              NOT_LEADER_OR_FOLLOWER (6, retriable)
MetadataUnavailableError                    REQUEST_TIMED_OUT (7, retriable)
InvalidOffsetError                          INVALID_REQUEST (42)
TopicDeletionInProgressError                UNKNOWN_TOPIC_OR_PARTITION (3, retriable:
                                            the name is being deleted)
anything else of Strata's own               UNKNOWN_SERVER_ERROR (-1)
==========================================  ==============================================
"""

from __future__ import annotations

from storage.errors import (
    InvalidOffsetError,
    LogClosedError,
    MetadataUnavailableError,
    StorageError,
    StrataError,
    TopicDeletionInProgressError,
    for_code,
)

UNKNOWN_SERVER_ERROR = -1
NONE = 0
UNKNOWN_TOPIC_OR_PARTITION = 3
MESSAGE_TOO_LARGE = 10
INVALID_REQUEST = 42
KAFKA_STORAGE_ERROR = 56
REQUEST_TIMED_OUT = 7
NOT_LEADER_OR_FOLLOWER = 6
#: the first of Strata's own codes
_OWN = 1000


def kafka_code(code: int) -> int:
    """The Kafka error code for a Strata wire code."""
    if code < _OWN:
        return code
    cls = for_code(code)
    if issubclass(cls, StorageError):
        return KAFKA_STORAGE_ERROR
    if issubclass(cls, LogClosedError):
        return NOT_LEADER_OR_FOLLOWER
    if issubclass(cls, MetadataUnavailableError):
        return REQUEST_TIMED_OUT
    if issubclass(cls, InvalidOffsetError):
        return INVALID_REQUEST
    if issubclass(cls, TopicDeletionInProgressError):
        return UNKNOWN_TOPIC_OR_PARTITION
    return UNKNOWN_SERVER_ERROR


def code_of(exc: BaseException) -> int:
    """The Kafka error code of an exception (UNKNOWN_SERVER_ERROR for a non-Strata one)."""
    return kafka_code(exc.code) if isinstance(exc, StrataError) else UNKNOWN_SERVER_ERROR
