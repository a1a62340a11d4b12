"""Call budgets per client IP and caller key (spec §12), as pure code with `now` passed in.

Theory of operation
-------------------
Each budget is a GCRA bucket (the "generic cell rate algorithm", i.e. a token bucket
stored as one number): the bucket remembers its *theoretical arrival time* ``tat``. A
budget of ``rate`` calls/hour has emission interval ``T = 3600 / rate`` seconds and a
burst of ``B`` calls. A call costing ``n`` is admitted when ``max(tat, now) + n·T − now
≤ B·T`` and then moves ``tat`` to ``max(tat, now) + n·T``. A bucket whose ``tat ≤ now``
is indistinguishable from a fresh one, which is what makes expiry free: such entries are
simply deleted.

Which buckets a call draws on (all must admit, or nothing is consumed):

=============  =============================================  ==========================
ip, key        buckets                                        rates
=============  =============================================  ==========================
both           (ip, key) and the ip ceiling                   per_ip_key, per_ip
ip only        the ip ceiling                                 per_ip
key only       (no ip, key) — the key budgets alone           per_ip_key
neither        one shared anonymous bucket                    per_ip
=============  =============================================  ==========================

so neither absence buys an unmetered path (§12). IPv6 clients are bucketed by their /64
(one subscriber usually holds a whole /64, so per-address buckets would be free to
multiply); IPv4-mapped addresses count as their IPv4 address.

Burst: ``B = min(rate, max(MIN_BURST, ceil(rate / BURST_DIVISOR)))`` — a tenth of the
hourly budget may arrive at once, but never fewer than a handful of calls (so an MCP
exchange of a few back-to-back calls passes at any setting) and never more than the
budget itself. Over any window of W seconds at most ``B + W/T`` calls pass: the hourly
figure is the sustained rate, a full bucket adds at most a tenth on top.

A batch costing more than ``B`` would never fit; it is admitted when the bucket is full
and leaves the bucket in debt (``tat`` far ahead), so the caller pays afterwards instead
of being refused forever. Units the request prepaid (the edge's one IP unit at the head)
count towards that fill: a bucket that was full before them admits the rest. A refusal's
``retry_after`` counts them again: the refused request's prepaid units stay spent, and
its retry prepays anew, so the wait is until the bucket holds the whole request.

Per-route limits: one limiter serves the whole process; each call names its ``scope``
(the route's host) and the route's ``Budget``. Buckets of different scopes never mix,
and all of them share one memory cap. A bucket is also named by its hourly rate, so a
reload that changes a budget starts it from a full bucket: ``tat`` is what was spent
measured in the old rate's time, and carried over to a new rate it would mean another
amount (at 2 calls/hour a throttled client's ``tat`` is most of an hour ahead, which at
1,000/hour would keep it refused long after the limit was raised to free it). The old
buckets expire as any idle one does.

Memory: entries sit in an insertion-ordered dict, moved to the end when used. Each
check first looks at the ``SWEEP_PER_CHECK`` coldest entries and drops the expired ones,
so idle clients vanish without a timer (an entry expires at most ``B·T`` — about six
minutes at the default rates — after its last use, debt aside); when the hard cap
``max_entries`` is reached anyway, the least recently used entry is evicted (forgetting
a budget errs towards admitting; an IP that keeps calling stays hot and keeps its
ceiling, however many fresh keys it mints).
"""

from __future__ import annotations

import functools
import ipaddress
import math
from collections import Counter, OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from pact_ingress.model import Limits

SECONDS_PER_HOUR = 3600.0
#: A tenth of the hourly budget may come at once...
BURST_DIVISOR = 10
#: ...but at least this many calls (an MCP exchange of a few quick calls always passes).
MIN_BURST = 5
#: Default entry cap. Measured on CPython 3.11: ~350 bytes per entry with an IPv6 /64
#: and a fingerprint as key, so 100k entries ≈ 35 MB — enough for 50k clients holding
#: both a pair bucket and an IP bucket, small enough for a 1 GB VPS.
DEFAULT_MAX_ENTRIES = 100_000
#: Coldest entries examined per check: more than the two a single call adds, so the table
#: shrinks back to the active set without a sweeper task.
SWEEP_PER_CHECK = 8
#: Float slack so B back-to-back calls at an interval like 3600/7 are not refused by a
#: rounding error in the last bit.
_EPSILON = 1e-6
#: IPv6 clients are budgeted per /64 (see the module docstring).
IPV6_PREFIX = 64

#: (kind, scope, client, caller key, hourly rate): see "Per-route limits" above.
BucketId = tuple[str, str, str | None, str | None, int]


@dataclass(frozen=True)
class Budget:
    """The two hourly rates a route enforces (from its `limits` block)."""

    per_ip_key_per_hour: int
    per_ip_per_hour: int

    def __post_init__(self) -> None:
        for rate in (self.per_ip_key_per_hour, self.per_ip_per_hour):
            if isinstance(rate, bool) or not isinstance(rate, int) or rate <= 0:
                raise ValueError("hourly call rates must be positive integers")

    @classmethod
    def from_limits(cls, limits: Limits) -> Budget:
        return cls(limits.calls_per_hour_per_ip_key, limits.calls_per_hour_per_ip)

    @functools.cached_property
    def ip_burst(self) -> int:
        """`burst_for(per_ip_per_hour)`, worked out once per budget."""
        return burst_for(self.per_ip_per_hour)


@dataclass(frozen=True)
class Allowed:
    """The call fits the budget and has been charged."""


@dataclass(frozen=True)
class Limited:
    """Over budget; nothing was charged. `retry_after` is whole seconds, ≥ 1."""

    retry_after: int


Decision = Allowed | Limited
ALLOWED = Allowed()


@functools.lru_cache(maxsize=64)
def burst_for(rate: int) -> int:
    """The burst (calls admitted back to back from a full bucket) for an hourly rate."""
    return min(rate, max(MIN_BURST, math.ceil(rate / BURST_DIVISOR)))


def client_bucket(ip: str | None) -> str | None:
    """The string an IP is budgeted under: IPv4 as is, IPv6 by its /64."""
    if ip is None:
        return None
    if len(ip) <= 64:  # any address (and its zone); a peer name of any length is not kept
        return _client_bucket_memo(ip)
    return _client_bucket(ip)


def _client_bucket(ip: str) -> str:
    try:
        address = ipaddress.ip_address(ip.split("%", 1)[0])
    except ValueError:
        return ip  # not an address (e.g. a unix socket peer name): budget it verbatim
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, IPV6_PREFIX), strict=False))
    return str(address)


#: Every request asks for its client's bucket, and parsing the address is the dearest
#: part of a rate-limit decision; the same few addresses recur.
_client_bucket_memo = functools.lru_cache(maxsize=4096)(_client_bucket)


class RateLimiter:
    """GCRA budgets per (IP, key) with a per-IP ceiling, bounded in memory. Pure: no clock."""

    def __init__(
        self,
        per_ip_key_per_hour: int = Limits.calls_per_hour_per_ip_key,
        per_ip_per_hour: int = Limits.calls_per_hour_per_ip,
        max_entries: int = DEFAULT_MAX_ENTRIES,
    ) -> None:
        if max_entries < 2:
            raise ValueError("max_entries must leave room for a pair and an IP bucket")
        self.default_budget = Budget(per_ip_key_per_hour, per_ip_per_hour)
        self.max_entries = max_entries
        self._tat: OrderedDict[BucketId, float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._tat)

    def check(
        self,
        ip: str | None,
        key: str | None,
        now: float,
        cost: int = 1,
        *,
        budget: Budget | None = None,
        scope: str = "",
    ) -> Decision:
        """Charge `cost` calls by `key` from `ip`, or refuse without charging."""
        return self.check_calls(ip, [key] * cost, now, budget=budget, scope=scope)

    def check_calls(
        self,
        ip: str | None,
        keys: Iterable[str | None],
        now: float,
        *,
        budget: Budget | None = None,
        scope: str = "",
        prepaid: int = 0,
    ) -> Decision:
        """Charge one call per entry of `keys` (e.g. the elements of a JSON-RPC batch),
        all or nothing. `prepaid` calls were already charged to the IP ceiling (the edge
        charges every request one IP unit before it reads the body)."""
        budget = budget or self.default_budget
        if type(keys) is tuple and keys == (None,) and ip is not None and not prepaid:
            # one keyless call from a known IP (the edge's per-request unit): one bucket
            return self.check_ip_unit(client_bucket(ip), now, budget, scope)
        demands = self._demands(client_bucket(ip), Counter(keys), budget, scope, prepaid)
        self._sweep(now)
        if not demands:
            return ALLOWED
        waits = [(self._wait(bucket, *demand, now), demand[3] * demand[1])
                 for bucket, demand in demands.items()]
        if max(wait for wait, _ in waits) > _EPSILON:
            self._touch(demands)
            # (see the module docstring: a retry prepays its units again)
            worst = max(wait + again for wait, again in waits)
            return Limited(max(1, math.ceil(worst - _EPSILON)))
        for bucket, (cost, interval, _, _) in demands.items():
            self._charge(bucket, max(self._tat.get(bucket, now), now) + cost * interval)
        return ALLOWED

    # -- internals ------------------------------------------------------------------------

    def check_ip_unit(self, ip: str | None, now: float, budget: Budget, scope: str
                      ) -> Decision:
        """`check_calls(ip, (None,), now)` for an `ip` already made `client_bucket(ip)`
        (the edge's per-request unit, its connection's bucket computed once): what
        `_demands` would make of it is the IP ceiling's bucket alone, at cost 1. `_wait`
        and `_charge` inline, on the edge's every request."""
        ceiling = budget.per_ip_per_hour
        interval, burst = SECONDS_PER_HOUR / ceiling, budget.ip_burst
        bucket: BucketId = ("ip", scope, ip, None, ceiling)
        self._sweep(now)
        tat = self._tat
        start = tat.get(bucket, now)
        if start < now:
            start = now
        wait = start - (burst - 1) * interval - now  # (`_wait` at cost 1: burst ≥ 1)
        if wait > _EPSILON:
            self._touch((bucket,))
            return Limited(max(1, math.ceil(wait - _EPSILON)))
        if bucket in tat:
            tat.move_to_end(bucket)
        elif len(tat) >= self.max_entries:
            tat.popitem(last=False)  # least recently used
        tat[bucket] = start + interval
        return ALLOWED

    @staticmethod
    def _demands(
        ip: str | None, per_key: Counter[str | None], budget: Budget, scope: str,
        prepaid: int = 0,
    ) -> dict[BucketId, tuple[int, float, int, int]]:
        """bucket → (cost, emission interval, burst, prepaid) for this request: `cost`
        still to charge, after the `prepaid` units this request already charged there."""
        pair_interval = SECONDS_PER_HOUR / budget.per_ip_key_per_hour
        pair_burst = burst_for(budget.per_ip_key_per_hour)
        demands: dict[BucketId, tuple[int, float, int, int]] = {}
        for key, count in per_key.items():
            if key is not None and count > 0:
                demands[("pair", scope, ip, key, budget.per_ip_key_per_hour)] = (
                    count, pair_interval, pair_burst, 0)
        # The IP ceiling counts every call from a known IP; without an IP, only keyless
        # calls fall to the shared anonymous bucket (keyed calls have their key budget).
        ceiling_cost = sum(per_key.values()) if ip is not None else per_key.get(None, 0)
        ceiling_cost -= prepaid
        if ceiling_cost > 0:
            ceiling = budget.per_ip_per_hour
            demands[("ip", scope, ip, None, ceiling)] = (
                ceiling_cost, SECONDS_PER_HOUR / ceiling, burst_for(ceiling), prepaid,
            )
        return demands

    def _wait(self, bucket: BucketId, cost: int, interval: float, burst: int, prepaid: int,
              now: float) -> float:
        """Seconds until `bucket` admits `cost` (≤ 0 when it admits now). Over the burst
        it admits from a full bucket, the request's `prepaid` units counted in."""
        start = max(self._tat.get(bucket, now), now)
        fit = min(cost, max(0, burst - prepaid))
        return start + fit * interval - burst * interval - now

    def _touch(self, buckets: Iterable[BucketId]) -> None:
        """Mark buckets as recently used without charging them: a client that keeps
        knocking while limited stays hot, so a flood of others cannot evict its debt."""
        for bucket in buckets:
            if bucket in self._tat:
                self._tat.move_to_end(bucket)

    def _charge(self, bucket: BucketId, tat: float) -> None:
        if bucket in self._tat:
            self._tat.move_to_end(bucket)
        elif len(self._tat) >= self.max_entries:
            self._tat.popitem(last=False)  # least recently used
        self._tat[bucket] = tat

    def _sweep(self, now: float) -> None:
        """Drop the expired among the SWEEP_PER_CHECK coldest entries. (A counted loop,
        not a list of an `islice`: this runs on every check, and those two objects cost
        more than looking at the one or two entries a quiet table holds.)"""
        tat = self._tat
        expired: list[BucketId] | None = None
        left = SWEEP_PER_CHECK
        for bucket, until in tat.items():
            if until <= now:
                if expired is None:
                    expired = [bucket]
                else:
                    expired.append(bucket)
            left -= 1
            if not left:
                break
        if expired is not None:
            for bucket in expired:
                del tat[bucket]
