"""The "consumer" protocol's payloads, carried as opaque bytes by JoinGroup and SyncGroup.

The coordinator never decodes these (Kafka's split: the group protocol is generic, the
consumer protocol is the clients' business); members encode their subscription into
``JoinGroupProtocol.metadata`` and the leader encodes each member's assignment into
``SyncGroupAssignment.assignment``. Same schema language and byte rules as ``messages``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from storage.protocol.schema import BYTES, INT32, STRING, Array, Message, struct_of


@dataclass(slots=True)
class TopicPartitions(Message):
    topic: str
    partitions: list[int]
    SCHEMA = (("topic", STRING), ("partitions", Array(INT32)))


@dataclass(slots=True)
class ConsumerSubscription(Message):
    topics: list[str]
    owned_partitions: list[TopicPartitions]  # what the member holds (cooperative protocol)
    generation: int  # the generation in which it got them (-1: none)
    user_data: Any = None
    SCHEMA = (
        ("topics", Array(STRING)),
        ("owned_partitions", Array(struct_of(TopicPartitions))),
        ("generation", INT32),
        ("user_data", BYTES),
    )


@dataclass(slots=True)
class ConsumerAssignment(Message):
    partitions: list[TopicPartitions]
    user_data: Any = None
    SCHEMA = (("partitions", Array(struct_of(TopicPartitions))), ("user_data", BYTES))


def encode(message: Message) -> bytes:
    return b"".join(bytes(part) for part in message.encode())
