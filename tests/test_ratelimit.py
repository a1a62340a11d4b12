"""GCRA call budgets per IP and key (spec §12), driven by explicit `now` values."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pact_ingress.config import Limits
from pact_ingress.proto.ratelimit import (
    ALLOWED,
    SECONDS_PER_HOUR,
    SWEEP_PER_CHECK,
    Allowed,
    Budget,
    Limited,
    RateLimiter,
    burst_for,
    client_bucket,
)

T0 = 1_000_000.0
KEY_A, KEY_B = "sha256:" + "A" * 43, "sha256:" + "B" * 43


def _admitted(limiter: RateLimiter, ip: str | None, key: str | None, now: float, n: int) -> int:
    return sum(isinstance(limiter.check(ip, key, now), Allowed) for _ in range(n))


@pytest.mark.parametrize(
    "rate, burst", [(3000, 300), (600, 60), (60, 6), (10, 5), (5, 5), (2, 2), (1, 1)]
)
def test_burst_is_a_tenth_at_least_a_handful_at_most_the_rate(rate: int, burst: int) -> None:
    assert burst_for(rate) == burst


def test_fresh_bucket_admits_the_burst_then_refuses_with_retry_after() -> None:
    limiter = RateLimiter(per_ip_key_per_hour=600, per_ip_per_hour=100_000)
    assert _admitted(limiter, "192.0.2.1", KEY_A, T0, 60) == 60
    assert limiter.check("192.0.2.1", KEY_A, T0) == Limited(6)  # T = 3600/600 = 6 s


def test_refusal_charges_nothing() -> None:
    limiter = RateLimiter(per_ip_key_per_hour=600, per_ip_per_hour=100_000)
    _admitted(limiter, "192.0.2.1", KEY_A, T0, 60)
    for _ in range(50):  # hammering while limited does not push the next slot away
        assert limiter.check("192.0.2.1", KEY_A, T0 + 1) == Limited(5)
    assert limiter.check("192.0.2.1", KEY_A, T0 + 6) is ALLOWED
    assert limiter.check("192.0.2.1", KEY_A, T0 + 6) == Limited(6)


def test_retry_after_is_whole_seconds_rounded_up_and_at_least_one() -> None:
    limiter = RateLimiter(per_ip_key_per_hour=7, per_ip_per_hour=100_000)  # T ≈ 514.29 s
    assert _admitted(limiter, "192.0.2.1", KEY_A, T0, 5) == 5  # float slack: all 5 fit
    assert limiter.check("192.0.2.1", KEY_A, T0) == Limited(515)
    assert limiter.check("192.0.2.1", KEY_A, T0 + 514.2) == Limited(1)
    assert limiter.check("192.0.2.1", KEY_A, T0 + 514.28) == Limited(1)
    assert limiter.check("192.0.2.1", KEY_A, T0 + 514.3) is ALLOWED


def test_sustained_rate_over_an_hour_is_burst_plus_rate() -> None:
    limiter = RateLimiter(per_ip_key_per_hour=600, per_ip_per_hour=100_000)
    admitted = sum(
        isinstance(limiter.check("192.0.2.1", KEY_A, T0 + s), Allowed) for s in range(3600)
    )
    assert admitted == 60 + 599  # the burst at t=0, then one per 6 s for t = 6 … 3594


def test_per_ip_ceiling_spans_keys() -> None:
    limiter = RateLimiter(per_ip_key_per_hour=100, per_ip_per_hour=20)  # bursts 10 and 5
    assert _admitted(limiter, "192.0.2.1", KEY_A, T0, 10) == 5
    assert isinstance(limiter.check("192.0.2.1", KEY_B, T0), Limited)
    assert limiter.check("192.0.2.2", KEY_B, T0) is ALLOWED


def test_all_or_nothing_across_buckets() -> None:
    limiter = RateLimiter(per_ip_key_per_hour=100, per_ip_per_hour=20)  # T 36 s and 180 s
    _admitted(limiter, "192.0.2.1", KEY_B, T0, 5)  # the IP ceiling is spent by key B
    assert limiter.check("192.0.2.1", KEY_A, T0) == Limited(180)
    # key A's own bucket was not charged by those refusals: from another IP (fresh
    # ceiling) it still has its whole burst of 10... of which that IP's ceiling allows 5.
    assert _admitted(limiter, "192.0.2.9", KEY_A, T0, 10) == 5


def test_key_absent_budgets_by_ip_ceiling_alone() -> None:
    limiter = RateLimiter(per_ip_key_per_hour=10, per_ip_per_hour=100)  # bursts 5, 10
    assert _admitted(limiter, "192.0.2.1", None, T0, 20) == 10
    assert isinstance(limiter.check("192.0.2.1", KEY_A, T0), Limited)  # same ceiling


def test_ip_absent_budgets_by_key_alone() -> None:
    limiter = RateLimiter(per_ip_key_per_hour=10, per_ip_per_hour=10_000)
    assert _admitted(limiter, None, KEY_A, T0, 20) == 5
    assert limiter.check(None, KEY_B, T0) is ALLOWED  # another key, another budget
    assert limiter.check("192.0.2.1", KEY_A, T0) is ALLOWED  # with an IP: the pair budget


def test_both_absent_share_one_anonymous_bucket() -> None:
    limiter = RateLimiter(per_ip_key_per_hour=10_000, per_ip_per_hour=50)  # burst 5
    assert _admitted(limiter, None, None, T0, 20) == 5
    assert isinstance(limiter.check(None, None, T0 + 1), Limited)
    assert limiter.check("192.0.2.1", None, T0) is ALLOWED


def test_ipv6_is_budgeted_per_64_and_mapped_v4_as_v4() -> None:
    assert client_bucket("2001:db8::1") == client_bucket("2001:db8::ffff:2") == "2001:db8::/64"
    assert client_bucket("2001:db8:0:1::1") == "2001:db8:0:1::/64"
    assert client_bucket("::ffff:192.0.2.7") == client_bucket("192.0.2.7") == "192.0.2.7"
    assert client_bucket("fe80::1%eth0") == "fe80::/64"
    assert client_bucket("unix:/run/x.sock") == "unix:/run/x.sock"
    assert client_bucket(None) is None
    limiter = RateLimiter(per_ip_key_per_hour=10_000, per_ip_per_hour=50)
    assert _admitted(limiter, "2001:db8::1", None, T0, 5) == 5
    assert isinstance(limiter.check("2001:db8::2", None, T0), Limited)


def test_batches_are_charged_per_element_all_or_nothing() -> None:
    limiter = RateLimiter(per_ip_key_per_hour=60, per_ip_per_hour=10_000)  # burst 6
    assert limiter.check_calls("192.0.2.1", [KEY_A, KEY_A, KEY_B], T0) is ALLOWED
    assert _admitted(limiter, "192.0.2.1", KEY_B, T0, 10) == 5  # B had 1 charged
    assert isinstance(limiter.check_calls("192.0.2.1", [KEY_A, KEY_B], T0), Limited)
    assert _admitted(limiter, "192.0.2.1", KEY_A, T0, 10) == 4  # A had 2 charged, not 3


def test_a_batch_larger_than_the_burst_runs_into_debt() -> None:
    limiter = RateLimiter(per_ip_key_per_hour=60, per_ip_per_hour=10_000)  # burst 6, T 60
    assert limiter.check("192.0.2.1", KEY_A, T0, cost=10) is ALLOWED
    assert limiter.check("192.0.2.1", KEY_A, T0) == Limited(300)  # tat = T0 + 600


def test_nothing_to_charge_is_allowed_and_stores_nothing() -> None:
    limiter = RateLimiter()
    assert limiter.check_calls("192.0.2.1", [], T0) is ALLOWED
    assert limiter.check("192.0.2.1", KEY_A, T0, cost=0) is ALLOWED
    assert len(limiter) == 0


def test_scopes_and_per_call_budgets_are_separate() -> None:
    limiter = RateLimiter(per_ip_key_per_hour=600, per_ip_per_hour=3000)
    tight = Budget(per_ip_key_per_hour=1, per_ip_per_hour=1)
    assert limiter.check("192.0.2.1", KEY_A, T0, budget=tight, scope="a.example") is ALLOWED
    assert limiter.check("192.0.2.1", KEY_A, T0, budget=tight, scope="a.example") == Limited(3600)
    assert limiter.check("192.0.2.1", KEY_A, T0, budget=tight, scope="b.example") is ALLOWED
    assert limiter.check("192.0.2.1", KEY_A, T0) is ALLOWED  # default scope, default budget


@pytest.mark.parametrize("before, after", [(2, 1000), (600, 3000), (1000, 100), (3, 2)])
def test_a_changed_budget_starts_from_a_full_bucket(before: int, after: int) -> None:
    """A reload that changes a budget: what was spent under the old one is not carried
    over as time (at a small old rate that was most of an hour, so raising the limit did
    not free a throttled client): the new budget starts full. A budget changed back finds
    its bucket as it was left, until that expires."""
    limiter = RateLimiter()
    old = Budget(per_ip_key_per_hour=before, per_ip_per_hour=before)
    new = Budget(per_ip_key_per_hour=after, per_ip_per_hour=after)
    ip = "192.0.2.9"
    spent = _admitted_with(limiter, ip, old, T0, burst_for(before) + 1)
    assert spent == burst_for(before)  # throttled under the old budget
    assert _admitted_with(limiter, ip, new, T0 + 1, burst_for(after) + 1) == burst_for(after)
    assert isinstance(limiter.check(ip, KEY_A, T0 + 1, budget=old), Limited)  # old spent


def _admitted_with(limiter: RateLimiter, ip: str, budget: Budget, now: float, n: int) -> int:
    return sum(isinstance(limiter.check(ip, KEY_A, now, budget=budget), Allowed)
               for _ in range(n))


def test_budget_validation_and_from_limits() -> None:
    assert Budget.from_limits(Limits(calls_per_hour_per_ip_key=60)) == Budget(60, 3000)
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError):
            Budget(bad, 10)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        RateLimiter(max_entries=1)


def test_idle_entries_expire_without_a_timer() -> None:
    limiter = RateLimiter(per_ip_key_per_hour=600, per_ip_per_hour=600)  # T = 6 s for both
    for i in range(3):
        limiter.check(f"192.0.2.{i}", KEY_A, T0)
    assert len(limiter) == 6  # a pair bucket and an IP bucket each
    limiter.check("198.51.100.1", KEY_B, T0 + 5)
    assert len(limiter) == 8  # nothing idle yet: one call leaves tat = now + T
    limiter.check("198.51.100.1", KEY_B, T0 + 10)
    assert len(limiter) == 2  # the three idle clients' buckets were swept


def test_sweep_is_bounded_per_check() -> None:
    limiter = RateLimiter(per_ip_key_per_hour=600, per_ip_per_hour=3000)
    for i in range(50):
        limiter.check(f"192.0.2.{i}", None, T0)
    limiter.check("198.51.100.1", None, T0 + 100)
    assert len(limiter) == 50 - SWEEP_PER_CHECK + 1
    for _ in range(10):
        limiter.check("198.51.100.1", None, T0 + 100)
    assert len(limiter) == 1


def test_hard_cap_evicts_least_recently_used() -> None:
    limiter = RateLimiter(per_ip_key_per_hour=60, per_ip_per_hour=10_000, max_entries=4)
    _admitted(limiter, "192.0.2.1", KEY_A, T0, 6)  # client 1 spends its key burst
    assert isinstance(limiter.check("192.0.2.1", KEY_A, T0), Limited)
    limiter.check("192.0.2.2", KEY_A, T0)  # client 2: table is full (4 entries)
    assert len(limiter) == 4
    limiter.check("192.0.2.3", KEY_A, T0)  # client 3 pushes out client 1, the coldest
    assert len(limiter) == 4
    assert limiter.check("192.0.2.1", KEY_A, T0) is ALLOWED  # forgotten: errs to admit


def test_hot_entries_survive_eviction() -> None:
    limiter = RateLimiter(per_ip_key_per_hour=10_000, per_ip_per_hour=50, max_entries=3)
    _admitted(limiter, "192.0.2.1", None, T0, 5)  # hot IP, ceiling spent
    for i in range(10):  # a stream of new keys from the same IP keeps that IP warm
        assert isinstance(limiter.check("192.0.2.1", f"k{i}", T0), Limited)
        limiter.check(f"198.51.100.{i}", None, T0)
        assert isinstance(limiter.check("192.0.2.1", None, T0), Limited)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(min_value=0, max_value=120, allow_nan=False), min_size=1, max_size=200))
def test_never_more_than_burst_plus_elapsed_over_interval(gaps: list[float]) -> None:
    limiter = RateLimiter(per_ip_key_per_hour=60, per_ip_per_hour=100_000)  # B 6, T 60
    now, admitted = T0, 0
    for gap in gaps:
        now += gap
        admitted += isinstance(limiter.check("192.0.2.1", KEY_A, now), Allowed)
    assert admitted <= 6 + (now - T0) / 60 + 1e-6


@pytest.mark.parametrize("ceiling", [1, 2, 7, 60, 3600, 100_000])
def test_the_ip_unit_fast_path_decides_as_the_general_one(ceiling: int) -> None:
    """`check_ip_unit` (the edge's per-request unit, `_wait` and `_charge` inline) and
    the general path (`keys` as a list takes it) agree on every call of a bounded,
    irregular sequence: the same decisions, the same retry-afters, the same state."""
    fast, slow = RateLimiter(), RateLimiter()
    budget = Budget(10, ceiling)
    now = 1000.0
    for step in range(400):
        now += (step * 7919 % 13) / 10 * (SECONDS_PER_HOUR / ceiling) / 3
        ip = f"10.0.0.{step % 3}"
        a = fast.check_calls(ip, (None,), now, budget=budget, scope="r")
        b = slow.check_calls(ip, [None], now, budget=budget, scope="r")
        assert a == b, (step, a, b)
    assert dict(fast._tat) == dict(slow._tat)
