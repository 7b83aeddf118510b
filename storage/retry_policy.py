"""A consumer group's retry policy for one topic (pure: no I/O).

One policy says everything about a record that its consumer could not process: how long to
wait before each new attempt, how many attempts it gets, and where it goes after the last::

    {"backoff": "exponential", "initial_ms": 1000, "multiplier": 2, "max_ms": 3600000,
     "jitter": true, "max_attempts": 8, "dead_letter_topic": "orders.dlq"}

It is stored in ZooKeeper with the group (``storage.metadata.retry``), set through the admin
API, the ``strata retry set`` command or ``Admin.set_retry_policy``, and applied by the retry
router (``handlers.retry``). ``docs/retries.md`` tells the whole story.

**Attempts.** Attempt 1 is the first delivery. A record that fails attempt ``n`` is delivered
again after :meth:`RetryPolicy.backoff_ms` ``(n)`` unless ``n >= max_attempts``, in which case
it goes to the dead-letter topic. ``max_attempts: 1`` means "no retry, straight to the DLQ".

**Deterministic jitter.** The jitter of a record's wait is drawn from a hash of the record's
identity and attempt (its ``seed``), not from a random source: a router that redoes a routing
after a crash computes the same due time, so the redo writes the same batch.
"""

from __future__ import annotations

import hashlib
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from storage.errors import InvalidRetryPolicyError
from storage.names import validate_topic_name

MAX_BACKOFF_MS = 365 * 24 * 3600 * 1000
"""A wait may not pass a year (the delay levels' default ``delay.max.ms``)."""
MAX_ATTEMPTS = 1000


class RetryPolicy(BaseModel):
    """A validated retry policy (see the module docstring). ``RetryPolicy.parse`` raises
    ``InvalidRetryPolicyError`` naming every bad field."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    backoff: Literal["exponential", "fixed"] = "exponential"
    initial_ms: int = Field(1000, ge=0, le=MAX_BACKOFF_MS)
    multiplier: float = Field(2.0, ge=1.0, le=100.0)
    max_ms: int = Field(3_600_000, ge=0, le=MAX_BACKOFF_MS)
    jitter: bool = True
    """Spread each wait over [wait/2, wait] (never longer than the policy says)."""
    max_attempts: int = Field(8, ge=1, le=MAX_ATTEMPTS)
    dead_letter_topic: str | None = None
    """Where records go after ``max_attempts``; ``None``: ``<topic>.dlq``."""

    @model_validator(mode="after")
    def _consistent(self) -> RetryPolicy:
        if self.max_ms < self.initial_ms:
            raise ValueError(f"max_ms ({self.max_ms}) is below initial_ms ({self.initial_ms})")
        if self.dead_letter_topic is not None:
            validate_topic_name(self.dead_letter_topic)
        return self

    @classmethod
    def parse(cls, values: Any, *, topic: str | None = None) -> RetryPolicy:
        """Validate ``values`` (a mapping or a policy) for ``topic`` (the source topic: the
        dead-letter topic may not be it)."""
        if isinstance(values, RetryPolicy):
            policy = values
        else:
            try:
                policy = cls.model_validate(values)
            except ValidationError as exc:
                problems = []
                for err in exc.errors():
                    where = ".".join(str(p) for p in err["loc"]) or "policy"
                    problems.append(f"{where}: {err['msg']} (got {err.get('input')!r})")
                raise InvalidRetryPolicyError(
                    "invalid retry policy: " + "; ".join(problems)
                ) from None
            except Exception as exc:  # a bad topic name raised inside a validator
                raise InvalidRetryPolicyError(f"invalid retry policy: {exc}") from None
        if topic is not None and policy.dlq_for(topic) == topic:
            raise InvalidRetryPolicyError(
                f"invalid retry policy: dead_letter_topic is the source topic {topic!r} "
                "(records would come back for ever)"
            )
        return policy

    def dlq_for(self, topic: str) -> str:
        return self.dead_letter_topic or f"{topic}.dlq"

    def backoff_ms(self, attempt: int, seed: str = "") -> int:
        """The wait after failed attempt ``attempt`` (1 = the first delivery)."""
        steps = max(0, attempt - 1)
        if self.backoff == "fixed":
            wait = float(self.initial_ms)
        else:
            wait = self.initial_ms * self.multiplier ** min(steps, 200)
        wait = min(wait, float(self.max_ms))
        if self.jitter and wait > 0:
            digest = hashlib.blake2b(f"{seed}/{attempt}".encode(), digest_size=8).digest()
            wait *= 0.5 + 0.5 * (int.from_bytes(digest, "big") / 2**64)
        return int(wait)

    def park_ms(self, parks: int) -> int:
        """The wait of a record parked behind its key for the ``parks``-th time
        (``retry.ordering=key``): ``initial_ms`` more each time, at most ``max_ms``."""
        return min(self.max_ms, max(self.initial_ms, 1) * max(parks, 1))

    def gives_up(self, attempt: int) -> bool:
        """Whether a record that failed attempt ``attempt`` goes to the dead-letter topic."""
        return attempt >= self.max_attempts

    def to_json(self) -> dict[str, Any]:
        return self.model_dump()


DEFAULT_POLICY = RetryPolicy()
"""What the router applies to a group and topic without a policy of their own."""
