"""Kafka clients in tests: a kafka-python producer whose start must fail, without leaking its
sockets, and reading one raw Kafka answer frame."""

from __future__ import annotations

import struct
from typing import Any

import pytest


def refused_kafka_producer(kp: Any, **conf: Any) -> None:
    """A ``KafkaProducer`` whose constructor must fail (refused login, wrong protocol).

    kafka-python does not close the network client of a producer that fails to start: its
    selector's wake-up socket pair (and I/O thread) stay behind, and the socket pair reaches
    the garbage collector in whichever test runs later, as an unraisable ResourceWarning. The
    producer is given a client factory that remembers what it made, and that is closed here.
    """
    made: list[Any] = []
    default = kp.KafkaProducer.DEFAULT_CONFIG["kafka_client"]

    def client(**kwargs: Any) -> Any:
        made.append(default(**kwargs))
        return made[-1]

    try:
        with pytest.raises(kp.errors.KafkaError):
            kp.KafkaProducer(kafka_client=client, **conf)
    finally:
        for c in made:
            c.close()
    assert made, "the producer made no client: nothing was tried"


def read_kafka_frame(sock: Any) -> bytes:
    """One whole Kafka answer frame from a blocking socket, without its size prefix."""

    def exact(n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = sock.recv(n - len(buf))
            assert chunk, "connection closed instead of an answer"
            buf += chunk
        return buf

    (size,) = struct.unpack(">i", exact(4))
    return exact(size)
