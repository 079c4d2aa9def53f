"""What a tenant's limits allow: the token bucket, and the refusal with its ``Retry-After``.

Pure arithmetic, no state of its own: `control_plane.quotas.QuotaBook` applies it to
what the store answered at admission, or, while the database is unreachable, to its own copy
of the levels.
"""

from __future__ import annotations

import math

from control_plane.errors import ResourceExhaustedError

REASONS = ("max_concurrent", "requests_per_minute", "tokens_per_minute")
"""The limits a refusal can name, in the order they are checked."""


class QuotaExceededError(ResourceExhaustedError):
    """A tenant over one of its limits (gRPC RESOURCE_EXHAUSTED, HTTP 429).

    Attributes:
        tenant: the tenant refused.
        reason: the limit passed: one of `REASONS`.
        retry_after_s: whole seconds (≥ 1) before the request could pass.
    """

    def __init__(self, tenant: str, reason: str, message: str, retry_after_s: int) -> None:
        super().__init__(f"tenant '{tenant}': {message}; retry after {retry_after_s} s")
        self.tenant = tenant
        self.reason = reason
        self.retry_after_s = retry_after_s


class TokenBucket:
    """A token bucket as one replica sees it: ``capacity`` refilled at ``capacity / 60`` per
    second from ``level`` at time ``at`` (seconds of the caller's clock). The level may be
    negative (admissions decided alone during a database outage); it refills from there.

    Args:
        per_minute: the limit (capacity and refill per minute, > 0).
        level: tokens in the bucket at ``at``.
        at: the time of ``level``.
    """

    def __init__(self, per_minute: float, level: float, at: float) -> None:
        if per_minute <= 0:
            raise ValueError(f"a bucket needs a positive limit, got {per_minute}")
        self.capacity = float(per_minute)
        self.rate = self.capacity / 60.0
        self._level = min(self.capacity, float(level))
        self._at = at

    def level(self, now: float) -> float:
        """Tokens in the bucket at ``now`` (refilled since the last change, at most the capacity)."""
        return min(self.capacity, self._level + max(0.0, now - self._at) * self.rate)

    def take(self, n: float, now: float) -> None:
        """Remove ``n`` tokens at ``now`` (a negative ``n`` gives back, never past the capacity)."""
        self._level = min(self.capacity, self.level(now) - n)
        self._at = max(now, self._at)

    def wait_s(self, n: float, now: float) -> float:
        """Seconds from ``now`` until the bucket holds ``n`` tokens (0 when it does)."""
        return max(0.0, n - self.level(now)) / self.rate


def rebucket(bucket: TokenBucket | None, per_minute: int, now: float) -> TokenBucket | None:
    """A bucket for a (new) limit: None for 0 (unlimited); full when there was none; else the
    old level, at most the new capacity."""
    if not per_minute:
        return None
    level = bucket.level(now) if bucket is not None else float(per_minute)
    return TokenBucket(per_minute, level, now)


def retry_after(wait_s: float) -> int:
    """``Retry-After`` seconds for a wait: whole seconds rounded up, at least 1."""
    return max(1, math.ceil(wait_s - 1e-9))


def refusal(
    tenant: str,
    *,
    need: float,
    in_flight: int,
    max_concurrent: int,
    requests_level: float,
    requests_per_minute: int,
    tokens_level: float,
    tokens_per_minute: int,
) -> QuotaExceededError | None:
    """The refusal of one more request of ``tenant`` reserving ``need`` tokens, or None when
    every limit allows it; limits are checked in `REASONS` order (0: unlimited).

    Args:
        in_flight: its requests in flight now (over all replicas).
        requests_level / tokens_level: its buckets' levels now.
    """
    if max_concurrent and in_flight >= max_concurrent:
        return QuotaExceededError(
            tenant, "max_concurrent", f"{in_flight} requests in flight, max_concurrent {max_concurrent}", 1
        )
    if requests_per_minute and requests_level < 1.0:
        wait = (1.0 - requests_level) / (requests_per_minute / 60.0)
        return QuotaExceededError(
            tenant, "requests_per_minute", f"over requests_per_minute {requests_per_minute}", retry_after(wait)
        )
    if tokens_per_minute and tokens_level < need:
        wait = (need - tokens_level) / (tokens_per_minute / 60.0)
        return QuotaExceededError(
            tenant,
            "tokens_per_minute",
            f"over tokens_per_minute {tokens_per_minute} (the request needs {int(need)} tokens, "
            f"{max(0, int(tokens_level))} are left)",
            retry_after(wait),
        )
    return None
