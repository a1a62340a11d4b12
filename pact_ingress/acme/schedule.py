"""Renewal timing, backoff and issuance budgets: pure functions of `now` (no clock reads).

Renewal: when the CA offers ARI (RFC 9773) its suggested time wins; otherwise a
certificate is renewed once a third of its lifetime remains, minus a random jitter (up to
`jitter_fraction` of the lifetime) so many certificates issued together do not all renew
in the same minute.

Budgets keep us far inside Let's Encrypt's limits (300 new orders per account per 3 h;
5 failed validations per hostname per hour): `Policy` defaults are 50 orders per 3 h and
3 failed validations per host per hour. When a budget is spent the order is *deferred*
(logged, retried when the window frees up), never dropped.
"""

from __future__ import annotations

import collections
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Policy:
    """Every knob of certificate automation, with production defaults."""

    #: Renew when this fraction of the lifetime remains (no ARI).
    renew_fraction: float = 1 / 3
    #: Renew up to this fraction of the lifetime earlier, at random (spreads load).
    jitter_fraction: float = 0.02
    #: First retry delay after a failed order; doubles per consecutive failure.
    backoff_base: float = 60.0
    #: Longest retry delay (a failing CA is still retried a few times a day).
    backoff_max: float = 6 * 3600.0
    #: New orders per account per window (Let's Encrypt: 300 per 3 h).
    orders_per_window: int = 50
    order_window: float = 3 * 3600.0
    #: Failed validations per host per window (Let's Encrypt: 5 per hour).
    failed_validations_per_host: int = 3
    failed_validation_window: float = 3600.0
    #: Orders running at once (each holds one worker thread).
    max_concurrent_orders: int = 4
    #: Longest one order may take, seconds (validation + finalization).
    order_timeout: float = 120.0
    #: The scheduler re-reads the wall clock at least this often (clocks jump; configs change).
    max_sleep: float = 300.0
    #: ARI (RFC 9773): re-ask the CA's renewal window this often when it gives no hint
    #: (the acme library suggests 6 h, the draft's default Retry-After).
    ari_check_interval: float = 6 * 3600.0
    #: How often at most "issuance in progress" is logged per host on handshakes.
    missing_log_interval: float = 10.0


def renewal_time(not_before: float, not_after: float, policy: Policy, rng: random.Random,
                 *, issued_at: float | None = None) -> float:
    """When to renew a certificate valid from `not_before` to `not_after` (no ARI).

    With `issued_at` (a certificate we just received), a time already past — a CA that
    backdates `not_before` far — becomes the same point of the *remaining* lifetime, so a
    fresh certificate never triggers an immediate re-order loop.
    """
    lifetime = max(0.0, not_after - not_before)
    jitter = rng.uniform(0.0, policy.jitter_fraction * lifetime)
    at = not_after - lifetime * policy.renew_fraction - jitter
    if issued_at is not None and at <= issued_at:
        at = issued_at + max(0.0, not_after - issued_at) * (1 - policy.renew_fraction)
    return at


def backoff_delay(failures: int, policy: Policy) -> float:
    """Delay before the next attempt after `failures` consecutive failures (≥ 1)."""
    exponent = min(max(failures - 1, 0), 32)  # cap the exponent: 2**32 * base ≫ backoff_max
    return min(policy.backoff_base * (2 ** exponent), policy.backoff_max)


class SlidingWindow:
    """At most `cap` events in any `window` seconds; times are passed in."""

    def __init__(self, cap: int, window: float) -> None:
        self.cap = cap
        self.window = window
        self._events: collections.deque[float] = collections.deque(maxlen=max(cap, 1))

    def _expire(self, now: float) -> None:
        while self._events and self._events[0] <= now - self.window:
            self._events.popleft()

    def available_at(self, now: float) -> float:
        """`now` when an event is allowed now, else the earliest time one will be."""
        self._expire(now)
        if len(self._events) < self.cap:
            return now
        return self._events[0] + self.window

    def record(self, now: float) -> None:
        self._expire(now)
        self._events.append(now)
