"""The walk of a Kafka record set, compiled: one pass over the bytes, no Python per record.

A Kafka record starts with its length (a zigzag varint), so where record ``i + 1`` starts is
known only once record ``i``'s length has been read: a sequential walk, which numpy cannot
vectorize. In CPython it cost about 0.25 µs a record (a table lookup per record to find the
starts, then some thirty numpy calls to read the fields), a tenth of the agent's CPU on the
Kafka listener's produce path. ``numba`` compiles the loop (``storage.kafka._walk_jit``) to
machine code, cached on disk beside the source (``__pycache__``), so it is compiled once per
installation, not per process: one pass reads every record's framing and fields, about
0.01 µs a record.

``numba`` is optional. Without it (the SDK's install, the Lambda package), ``available()`` is
False and ``storage.kafka.batch`` walks with numpy as before; both give the same answers and
the same verdicts (``tests/test_kafka_walk.py`` holds them to each other). It is imported on
the first walk, never at import time: processes that never see a Kafka batch do not pay for
it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

#: rows of the array ``scan`` fills, one column per record, in ``storage.kafka.batch.Scan``'s
#: field order: timestamp delta, key start, key length, value start, value length, header
#: count, where the headers start, where the record ends
FIELDS = 8

#: what ``scan``'s error codes mean (worded as the numpy walk's messages, where it has one)
ERRORS = {
    1: "a Kafka record's length is not a valid varint",
    2: "a Kafka record has a negative length",
    3: "a Kafka record has a length of zero",
    4: "Kafka batch records run past the batch's end",
    5: "a Kafka record has non-zero attributes",
    6: "a Kafka record ends inside a varint",
    7: "a produced batch's offset deltas must be 0, 1, 2, ...",
    8: "a Kafka record has a negative key or value length",
    9: "a Kafka record ends before its fields do",
    10: "a Kafka record has a negative header count",
    11: "a Kafka record's fields do not fill its length",
    12: "Kafka batch records end before the batch does",
}

_kernel: Callable[..., int] | None = None
_tried = False


def available() -> bool:
    """Whether the compiled walk can be used: numba is installed, the walk compiles (or
    loads from the cache) and walks a record right, and ``STRATA_KAFKA_WALK=numpy`` does not
    switch it off. Decided on the first call, which pays for the import and the load."""
    global _kernel, _tried
    if not _tried:
        _tried = True
        if os.environ.get("STRATA_KAFKA_WALK", "") != "numpy":
            _kernel = _compile()
    return _kernel is not None


#: one record (length 7; attributes, timestamp and offset deltas 0, a null key, the value
#: ``b"v"``, no headers): what ``_compile`` walks to prove the compiled walk
_ONE_RECORD = bytes([0x0E, 0, 0, 0, 0x01, 0x02, ord("v"), 0])


def scan(data: Any, n: int) -> tuple[np.ndarray, int, int]:
    """Walk the ``n`` records of ``data``: (fields: int64 ``FIELDS`` x ``n``, error code, the
    record it concerns); code 0 when every record is well framed. Needs ``available()``."""
    assert _kernel is not None
    out = np.empty((FIELDS, n), dtype=np.int64)
    arr = np.frombuffer(data, dtype=np.uint8)
    code = _kernel(arr, n, out)
    return out, code & 0xFFFFFFFF, code >> 32


def _compile() -> Callable[..., int] | None:
    try:
        from storage.kafka import _walk_jit
    except ImportError:  # numba is not installed
        return None
    kernel: Callable[..., int] = _walk_jit.kernel
    try:
        out = np.empty((FIELDS, 1), dtype=np.int64)
        code = kernel(np.frombuffer(_ONE_RECORD, dtype=np.uint8), 1, out)
        if code or out[:, 0].tolist() != [0, 5, -1, 6, 1, 0, 8, 8]:
            raise RuntimeError(f"walked one record to {code}, {out[:, 0].tolist()}")
    except Exception as exc:  # a numba that cannot compile it here: numpy walks instead
        log.warning("the compiled Kafka record walk is not used: %s", exc)
        return None
    return kernel
