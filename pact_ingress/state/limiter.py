"""The rate limiter as the terminate engine sees it: one awaitable decision per charge.

`Limiter` is the interface; `LocalLimiter` is the pure `proto.ratelimit.RateLimiter`
behind it (this process's own buckets, what a single instance always had), and
`pact_ingress.state.redis.RedisLimiter` keeps the same buckets in Redis so several
instances charge one budget. The decision is awaitable because the shared one is a
network round trip; the local one completes without yielding.

Callers pass `now` on their own clock (the trio clock): the local limiter uses it, the
shared one ignores it and reads Redis's clock inside its script, so instances whose
clocks disagree still agree on every bucket.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from pact_ingress.proto.ratelimit import Budget, Decision, RateLimiter


class Limiter(Protocol):
    """Charges calls against GCRA budgets, all or nothing (see `proto.ratelimit`)."""

    async def check_calls(
        self,
        ip: str | None,
        keys: Iterable[str | None],
        now: float,
        *,
        budget: Budget | None = None,
        scope: str = "",
        prepaid: int = 0,
    ) -> Decision: ...


class LocalLimiter:
    """This process's own buckets: `RateLimiter`, awaitable."""

    def __init__(self, pure: RateLimiter | None = None) -> None:
        self.pure = pure or RateLimiter()

    @property
    def default_budget(self) -> Budget:
        return self.pure.default_budget

    async def check_calls(
        self,
        ip: str | None,
        keys: Iterable[str | None],
        now: float,
        *,
        budget: Budget | None = None,
        scope: str = "",
        prepaid: int = 0,
    ) -> Decision:
        return self.pure.check_calls(ip, keys, now, budget=budget, scope=scope, prepaid=prepaid)
