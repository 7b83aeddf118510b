"""The one exception hierarchy of Strata.

Every error that crosses a module boundary is a :class:`StrataError`. Each class says whether
retrying the same request can succeed (``retriable``) and carries the wire error ``code`` that
the protocol sends for it; :func:`for_code` maps a code back to its class, so the SDK raises
the same types as the agents. Third-party exceptions (OSError, botocore, kazoo) are translated
at one boundary per adapter and never leak out.

    StrataError
    ├── InvalidRequestError            (the caller sent something wrong; not retriable)
    │   ├── CorruptBatchError          bad CRC, bad length, malformed body
    │   ├── UnsupportedVersionError    unknown batch magic / API key / API version
    │   ├── BatchTooLargeError         batch over max.message.bytes
    │   ├── InvalidConfigError         a config value out of range
    │   ├── InvalidRequiredAcksError   acks other than 0, 1, -1
    │   ├── InvalidOffsetError         truncate/seek target the log cannot honour
    │   ├── InvalidTopicError          a topic name outside [a-zA-Z0-9._-]{1,249}, "." or ".."
    │   ├── InvalidPartitionsError     a partition count that is not allowed
    │   ├── InvalidReplicationFactorError  more replicas than live agents, or out of range
    │   ├── TopicAlreadyExistsError
    │   ├── InvalidFilterError         a filter expression that does not parse (``position``)
    │   ├── InvalidDelayError          a bad delay: negative, over delay.max.ms, or ambiguous
    │   ├── InvalidRetryPolicyError    a retry policy that cannot work (``storage.retry_policy``)
    │   ├── InvalidRecordError         a batch no producer may send (a control batch)
    │   ├── InvalidTransactionTimeoutError  transaction.timeout.ms above the agents' maximum
    │   └── MalformedFrameError        a protocol frame that does not parse
    │       └── FrameTooLargeError     a frame over the connection's maximum size
    ├── OffsetOutOfRangeError          offset below the log start or above the log end
    ├── UnknownTopicOrPartitionError   retriable: metadata may be catching up
    ├── UnknownTopicIdError            retriable: no topic has the id the request names
    ├── InconsistentTopicIdError       retriable: the topic's id is not the one the request names
    ├── TopicDeletionInProgressError   retriable: the name is taken until its delete completes
    ├── NotLeaderError                 retriable: carries the leader the agent knows
    ├── FencedLeaderEpochError         a request or agent with a stale leader epoch
    ├── LeaderNotAvailableError        retriable: an election is under way
    ├── NotControllerError             retriable
    ├── RequestTimedOutError           retriable
    ├── NotEnoughReplicasError         retriable
    ├── NotEnoughReplicasAfterAppendError  retriable: the ISR shrank while acks=all waited
    ├── NetworkError                   retriable: connection refused, reset or timed out
    ├── OutOfOrderSequenceError        retriable: an idempotent batch skipped a sequence number
    ├── DuplicateSequenceError         an idempotent batch repeated outside a one-batch run
    ├── InvalidProducerEpochError      an idempotent batch of an older producer epoch
    │   └── ProducerFencedError        a newer producer took this transactional.id (fatal)
    ├── TransactionError               transactions (Kafka's transaction error codes)
    │   ├── InvalidTxnStateError       a request the transaction's state does not allow
    │   ├── InvalidProducerIdMappingError  the producer id is not the transactional.id's
    │   ├── ConcurrentTransactionsError  retriable: the previous transaction is completing
    │   ├── TransactionCoordinatorFencedError  a marker from a coordinator that lost the id
    │   └── UnstableOffsetCommitError  retriable: a transaction's offsets are not settled yet
    ├── GroupError                     consumer groups (Kafka's group error codes)
    │   ├── CoordinatorNotAvailableError  retriable: no live coordinator / loading
    │   ├── NotCoordinatorError        retriable: ask FindCoordinator again
    │   ├── IllegalGenerationError     a member of an old generation (rejoin)
    │   ├── InconsistentGroupProtocolError  no assignor every member supports
    │   ├── UnknownMemberIdError       the coordinator does not know the member (rejoin)
    │   ├── RebalanceInProgressError   the group is rebalancing (rejoin)
    │   ├── GroupIdNotFoundError       no such group
    │   ├── NonEmptyGroupError         the group has members (admin reset/delete refused)
    │   ├── FencedInstanceIdError      another process took this group.instance.id
    │   ├── InconsistentFilterError    a member's subscription filter differs from the group's
    │   └── InvalidSessionTimeoutError session.timeout.ms outside the agent's bounds
    ├── MetadataError                  ZooKeeper said no
    │   ├── NodeNotFoundError
    │   ├── NodeExistsError
    │   ├── VersionConflictError       a compare-and-set lost a race; re-read and retry
    │   └── MetadataUnavailableError   retriable: connection lost, session expired, deadline passed
    ├── StorageError                   local disk trouble (I/O error, disk full); retriable
    │   ├── CorruptSegmentError        stored bytes failed verification; segment quarantined
    │   ├── UploadBacklogError         retriable: too many bytes wait for the object tier
    │   ├── LogDirFullError            retriable: the data directory is short of free space
    │   └── ObjectStoreError           retriable: S3 throttled, timed out, unreachable
    │       ├── ObjectExistsError      a create-only put found the key taken (HTTP 412)
    │       └── ObjectNotFoundError    no such key (HTTP 404)
    ├── LogClosedError                 the log was closed under the caller; retriable
    └── SecurityError                  who the caller is, or what it may do (docs/security.md)
        ├── AuthenticationFailedError  wrong password, unknown user, replayed SCRAM exchange
        │   ├── SslAuthenticationError  the TLS handshake failed (unknown CA, expired, plaintext)
        │   └── IllegalSaslStateError  a SASL request out of order (before the handshake ...)
        ├── UnsupportedSaslMechanismError  a mechanism the listener does not offer
        └── AuthorizationError         authenticated, but the ACLs do not allow it
            ├── TopicAuthorizationFailedError
            ├── GroupAuthorizationFailedError
            ├── ClusterAuthorizationFailedError
            └── TransactionalIdAuthorizationFailedError

Codes are Kafka's where Kafka has the same error, so people and tools recognise them;
errors Kafka does not have use codes from 1000 up, one per class.
"""

from __future__ import annotations

from typing import ClassVar


class StrataError(Exception):
    """Root of every Strata error."""

    code: ClassVar[int] = -1
    retriable: ClassVar[bool] = False
    # defaults for the data some subclasses carry, so that an error rebuilt from a wire code
    # (``from_wire``) has every attribute its class promises
    position: int | None = None
    leader_id: int = -1
    leader_epoch: int = -1
    reason: str = ""
    offset: int = -1
    log_start: int = -1
    log_end: int = -1
    size: int = -1
    limit: int = -1
    path: str = ""


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


class InvalidRequiredAcksError(InvalidRequestError):
    """A produce request's acks is not 0, 1 or -1 (all)."""

    code = 21


class InvalidOffsetError(InvalidRequestError):
    code = 1001


class InvalidTopicError(InvalidRequestError):
    code = 17


class InvalidPartitionsError(InvalidRequestError):
    code = 37


class InvalidReplicationFactorError(InvalidRequestError):
    code = 38


class TopicAlreadyExistsError(InvalidRequestError):
    code = 36


class InvalidFilterError(InvalidRequestError):
    """A filter expression (``storage.filters``) that does not parse or is out of bounds;
    ``position`` is the 0-based character index of the mistake in the expression."""

    code = 1010

    def __init__(self, message: str, *, position: int | None = None) -> None:
        super().__init__(message)
        self.reason = message
        self.position = position


class InvalidDelayError(InvalidRequestError):
    """A delayed send the producer refuses before storing anything: a negative delay, one
    over the topic's ``delay.max.ms``, both ``delay_ms`` and ``deliver_at_ms``, an unknown
    delay level, or a malformed schedule id."""

    code = 1040


class InvalidRetryPolicyError(InvalidConfigError):
    """A retry policy refused before it is stored: a negative backoff, ``max_attempts`` below
    1, a dead-letter topic that is the source topic, an unknown field (``storage.retry_policy``)."""

    code = 1041


class InvalidRecordError(InvalidRequestError):
    """A batch that no producer may send: control batches (transaction markers) are written by
    the transaction coordinator only."""

    code = 87


class InvalidTransactionTimeoutError(InvalidRequestError):
    """``transaction.timeout.ms`` is not positive or above the agents'
    ``transaction.max.timeout.ms``."""

    code = 50


class MalformedFrameError(InvalidRequestError):
    """A protocol frame (or a field in it) that does not parse."""

    code = 42


class FrameTooLargeError(MalformedFrameError):
    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"frame of {size} bytes exceeds the limit of {limit} bytes")
        self.size = size
        self.limit = limit


class UnknownTopicOrPartitionError(StrataError):
    code = 3
    retriable = True


class UnknownTopicIdError(StrataError):
    """The request names a topic id this agent knows no topic by: the topic was deleted (or
    is being deleted), or the agent's metadata is behind. Refresh metadata and go on (KIP-516)."""

    code = 100
    retriable = True


class InconsistentTopicIdError(StrataError):
    """The topic's log has another id than the request names: the topic was deleted and
    created again under the same name. The caller holds the old incarnation's metadata;
    refresh it (a consumer then starts the new incarnation from ``auto.offset.reset``)."""

    code = 103
    retriable = True


class TopicDeletionInProgressError(StrataError):
    """The topic name is being deleted; it can be created again once the delete completes
    (``docs/operations.md``, *Deleting a topic*)."""

    code = 1030
    retriable = True


class NotLeaderError(StrataError):
    """This agent does not lead the partition; ``leader_id`` is the leader it knows (-1: none)."""

    code = 6
    retriable = True

    def __init__(
        self, message: str = "not the leader", *, leader_id: int = -1, leader_epoch: int = -1
    ) -> None:
        super().__init__(message)
        self.leader_id = leader_id
        self.leader_epoch = leader_epoch


class FencedLeaderEpochError(StrataError):
    code = 74
    retriable = True


class LeaderNotAvailableError(StrataError):
    code = 5
    retriable = True


class NotControllerError(StrataError):
    code = 41
    retriable = True


class RequestTimedOutError(StrataError):
    code = 7
    retriable = True


class NotEnoughReplicasError(StrataError):
    code = 19
    retriable = True


class NotEnoughReplicasAfterAppendError(StrataError):
    code = 20
    retriable = True


class NetworkError(StrataError):
    code = 13
    retriable = True


class OutOfOrderSequenceError(StrataError):
    """The batch's first sequence number is not the one after the producer's last batch (an
    earlier batch of the producer is missing: it failed, or is still being retried)."""

    code = 45
    retriable = True


class DuplicateSequenceError(StrataError):
    """A batch repeats one already stored, but arrived in a run with other batches: the
    agent can answer a duplicate's original offset only when it is sent alone."""

    code = 46


class InvalidProducerEpochError(StrataError):
    """The batch carries an older epoch of its producer id than the partition has seen.

    For a transactional producer: its transaction was aborted by the coordinator (it passed
    ``transaction.timeout.ms``), or a newer instance fenced it; ``abort_transaction()`` tells
    which (``ProducerFencedError`` from the coordinator is the second case)."""

    code = 47


class ProducerFencedError(InvalidProducerEpochError):
    """Another producer initialized the same ``transactional.id`` (a higher epoch): this one is
    a zombie and may neither write nor commit. Fatal: close the producer."""

    code = 90


class TransactionError(StrataError):
    """Root of the transaction coordinator's errors; ``code`` is Kafka's."""

    code = 1050


class InvalidTxnStateError(TransactionError):
    """The request does not fit the transaction's state (e.g. a commit after the coordinator
    aborted it, or an EndTxn with no transaction open)."""

    code = 48


class InvalidProducerIdMappingError(TransactionError):
    """The producer id in the request is not the one the ``transactional.id`` has."""

    code = 49


class ConcurrentTransactionsError(TransactionError):
    """The previous transaction of this ``transactional.id`` is still writing its markers."""

    code = 51
    retriable = True


class TransactionCoordinatorFencedError(TransactionError):
    """A transaction marker from a coordinator that no longer decides for the producer (its
    token is older than one the partition has applied)."""

    code = 52


class UnstableOffsetCommitError(TransactionError):
    """An offset fetch asked for a stable offset while a transaction's offsets for the partition
    are not settled (committed or aborted) yet: ask again shortly (KIP-447)."""

    code = 88
    retriable = True


class GroupError(StrataError):
    """Root of the consumer-group errors; ``code`` is Kafka's."""

    code = 1009


class CoordinatorNotAvailableError(GroupError):
    code = 15
    retriable = True


class NotCoordinatorError(GroupError):
    code = 16
    retriable = True


class IllegalGenerationError(GroupError):
    """A request (a commit, a heartbeat, a sync) from a member of an older generation."""

    code = 22


class InconsistentGroupProtocolError(GroupError):
    """The member's protocol type or assignors do not match the group's."""

    code = 23


class UnknownMemberIdError(GroupError):
    code = 25


class InvalidSessionTimeoutError(GroupError):
    code = 26


class RebalanceInProgressError(GroupError):
    code = 27


class NonEmptyGroupError(GroupError):
    code = 68


class GroupIdNotFoundError(GroupError):
    code = 69


class FencedInstanceIdError(GroupError):
    code = 82


class InconsistentFilterError(GroupError):
    """A member joined with another subscription filter than the group's members have: a
    group has one subscription (as in RocketMQ), so its members split the partitions of one
    filtered stream."""

    code = 1011


class MetadataError(StrataError):
    code = 1004


class NodeNotFoundError(MetadataError):
    code = 1005


class NodeExistsError(MetadataError):
    code = 1006


class VersionConflictError(MetadataError):
    code = 1007
    retriable = True


class MetadataUnavailableError(MetadataError):
    code = 1008
    retriable = True


class OffsetOutOfRangeError(StrataError):
    code = 1

    def __init__(self, offset: int = -1, log_start: int = -1, log_end: int = -1) -> None:
        super().__init__(f"offset {offset} is outside the log [{log_start}, {log_end}]")
        self.offset = offset
        self.log_start = log_start
        self.log_end = log_end


class StorageError(StrataError):
    code = 56
    retriable = True


class CorruptSegmentError(StorageError):
    """Verified bytes on disk are damaged. The segment is quarantined, never skipped."""

    code = 1002
    retriable = False

    def __init__(self, message: str, *, path: str, position: int | None = None) -> None:
        super().__init__(
            f"{message}: {path}" + ("" if position is None else f" at byte {position}")
        )
        self.path = path
        self.position = position


class UploadBacklogError(StorageError):
    """Backpressure: the bytes not yet in the object tier reached the agent's bound."""

    code = 1020
    retriable = True


class LogDirFullError(StorageError):
    """Backpressure: the data directory's free space fell below ``log.dir.min.free.bytes``
    (an object tier too slow or down to take segments off the disk, or retention too long
    for the disk); produce again once space returns."""

    code = 1024
    retriable = True


class ObjectStoreError(StorageError):
    """The object store (S3) failed a call: throttled, timed out, reset, or refused it."""

    code = 1021
    retriable = True


class ObjectExistsError(ObjectStoreError):
    """A create-only put (``If-None-Match: *``) found the key already taken (HTTP 412)."""

    code = 1022
    retriable = False


class ObjectNotFoundError(ObjectStoreError):
    code = 1023
    retriable = False


class LogClosedError(StrataError):
    code = 1003
    retriable = True


class SecurityError(StrataError):
    """Authentication and authorization (``docs/security.md``); never retriable: the same
    credentials or the same ACLs give the same answer."""

    code = 1060


class AuthenticationFailedError(SecurityError):
    """The client could not prove who it is (Kafka's SASL_AUTHENTICATION_FAILED). The message
    never says whether the user exists."""

    code = 58


class SslAuthenticationError(AuthenticationFailedError):
    """The TLS handshake failed: an unknown CA, an expired or self-signed certificate, a
    name that does not match, or a plaintext peer (raised by the client side only)."""

    code = 1061


class IllegalSaslStateError(AuthenticationFailedError):
    """A SASL request out of order: authenticate before the handshake, a second handshake,
    or any other request before authentication finished (Kafka's ILLEGAL_SASL_STATE)."""

    code = 34


class UnsupportedSaslMechanismError(SecurityError):
    code = 33


class AuthorizationError(SecurityError):
    """The principal is known but the ACLs do not allow the operation."""

    code = 1062


class TopicAuthorizationFailedError(AuthorizationError):
    code = 29


class GroupAuthorizationFailedError(AuthorizationError):
    code = 30


class ClusterAuthorizationFailedError(AuthorizationError):
    code = 31


class TransactionalIdAuthorizationFailedError(AuthorizationError):
    code = 53


_BY_CODE: dict[int, type[StrataError]] = {}


def _register() -> None:
    stack: list[type[StrataError]] = [StrataError]
    while stack:
        cls = stack.pop()
        _BY_CODE.setdefault(cls.code, cls)
        stack.extend(cls.__subclasses__())


def for_code(code: int) -> type[StrataError]:
    """The error class for a wire error code (StrataError for codes this version does not know)."""
    if code not in _BY_CODE:
        _register()  # cheap, and picks up classes defined since the last call
    return _BY_CODE.get(code, StrataError)


def from_wire(code: int, message: str | None = None) -> StrataError:
    """An exception instance for an error code received from the wire."""
    cls = for_code(code)
    text = message or f"{cls.__name__} (error code {code})"
    err = cls.__new__(cls)
    Exception.__init__(err, text)
    if cls.code != code:
        err.code = code  # type: ignore[misc]
    return err
