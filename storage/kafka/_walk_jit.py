"""The compiled half of ``storage.kafka.walk`` (see there): importing this module imports
numba, so only ``walk`` imports it, and only when it is asked to walk.

Functions at module level, so numba's on-disk cache (``cache=True``) finds them again in the
next process rather than compiling anew."""

from __future__ import annotations

from typing import Any

import numba
import numpy as np


@numba.njit(cache=True, nogil=True, boundscheck=False)
def varint(arr: Any, p: int, end: int, max_shift: int) -> Any:
    """The zigzag varint at ``p`` (ending before ``end``): (value, next position);
    next -1 when it runs past ``end`` or is too long."""
    raw = np.uint64(0)
    shift = 0
    while True:
        if p >= end or shift > max_shift:
            return 0, -1
        b = np.uint64(arr[p])
        p += 1
        raw |= (b & np.uint64(0x7F)) << np.uint64(shift)
        if b < 0x80:
            break
        shift += 7
    value = np.int64(raw >> np.uint64(1)) ^ -np.int64(raw & np.uint64(1))
    return value, p


@numba.njit(cache=True, nogil=True, boundscheck=False)
def field(arr: Any, p: int, end: int, max_shift: int) -> Any:
    """A varint field of the record ending at ``end``: (value, next position, 0), or with
    error code 9 when the record ends before it, 6 when it ends inside it."""
    if p >= end:
        return 0, p, 9
    value, q = varint(arr, p, end, max_shift)
    if q < 0:
        return 0, p, 6
    return value, q, 0


@numba.njit(cache=True, nogil=True, boundscheck=False)
def kernel(arr: Any, n: int, out: Any) -> Any:
    """Fill ``out`` (``walk.FIELDS`` x ``n``); 0, or (record << 32) | error code (``walk.ERRORS``)."""
    total = arr.shape[0]
    pos = 0
    for i in range(n):
        fail = np.int64(i) << np.int64(32)
        if pos >= total:
            return fail | 4
        length, p = varint(arr, pos, total, 28)
        if p < 0:
            return fail | 1
        if length < 0:
            return fail | 2
        if length == 0:
            return fail | 3
        end = p + length
        if end > total:
            return fail | 4
        if arr[p] != 0:
            return fail | 5
        p += 1
        # timestamp delta, offset delta, key length, (key), value length, (value),
        # header count: each varint must start, and end, inside the record
        ts, p, err = field(arr, p, end, 63)
        if err:
            return fail | err
        delta, p, err = field(arr, p, end, 28)
        if err:
            return fail | err
        if delta != i:
            return fail | 7
        key_len, p, err = field(arr, p, end, 28)
        if err:
            return fail | err
        key_start = p
        p += max(key_len, 0)
        value_len, p, err = field(arr, p, end, 28)
        if err:
            return fail | err
        value_start = p
        p += max(value_len, 0)
        if key_len < -1 or value_len < -1:
            return fail | 8
        headers, p, err = field(arr, p, end, 28)
        if err:
            return fail | err
        if headers < 0:
            return fail | 10
        if headers == 0 and p != end:
            return fail | 11
        out[0, i] = ts
        out[1, i] = key_start
        out[2, i] = key_len
        out[3, i] = value_start
        out[4, i] = value_len
        out[5, i] = headers
        out[6, i] = p
        out[7, i] = end
        pos = end
    if pos != total:
        return (np.int64(n) << np.int64(32)) | 12
    return 0
