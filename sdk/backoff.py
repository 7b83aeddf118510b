"""Retry backoff: Kafka's exponential backoff with jitter, as an injectable object."""

from __future__ import annotations

import random


class ExponentialBackoff:
    """``base * 2**attempt`` capped at ``maximum``, times a random factor in [1-jitter, 1+jitter].

    Kafka's rule for ``retry.backoff.ms`` / ``retry.backoff.max.ms``: attempt 0 waits about
    ``base``; a ``maximum`` below ``base`` means a constant ``base``. Returns seconds.
    """

    def __init__(
        self,
        base_ms: float,
        maximum_ms: float,
        *,
        jitter: float = 0.2,
        rng: random.Random | None = None,
    ) -> None:
        if base_ms < 0 or not 0 <= jitter < 1:
            raise ValueError("backoff base must be >= 0 and jitter in [0, 1)")
        self.base = base_ms / 1000
        self.maximum = max(base_ms, maximum_ms) / 1000
        self.jitter = jitter
        # the random module's own generator unless one is given: seeding a new ``Random``
        # reads the OS's entropy, and backoffs are made often (one per exactly-once send);
        # the module's is reseeded in a forked child, so children do not jitter alike
        self._random = rng.random if rng is not None else random.random

    def __call__(self, attempt: int) -> float:
        term = min(self.maximum, self.base * (2 ** min(attempt, 62)))
        if self.jitter:
            term *= 1 - self.jitter + self._random() * 2 * self.jitter
        return float(term)
