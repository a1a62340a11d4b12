"""The ingress's tunnel token table (sans-I/O, `now` passed in): single use, bound to
its session's key, void after its kind's TTL, forgotten with its session."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from pact_ingress.proto.tunnel import frames as tf
from pact_ingress.proto.tunnel.session import (
    SPARE_MAX,
    SPARE_MIN,
    TOKEN_TTL,
    BadToken,
    Grants,
    Kind,
    TokenTable,
    spare_target,
)


@dataclass(eq=False)
class Owner:
    tenant: str
    fingerprint: str
    grants: Grants = field(default_factory=Grants)


def refused(table: TokenTable[Owner], token: bytes, key: str | None, now: float) -> str:
    with pytest.raises(BadToken) as info:
        table.redeem(token, key, now)
    return info.value.event


def test_a_token_is_redeemed_once_and_settled_with_its_latency() -> None:
    table: TokenTable[Owner] = TokenTable()
    alina = Owner("alina", "fp-a")
    token = table.issue(alina, Kind.TOKEN, 10.0)
    assert len(token) == tf.TOKEN_BYTES and alina.grants.tokens == {token: 10.0}
    assert table.redeem(token, None, 10.5) is alina
    assert alina.grants.tokens  # still outstanding until its connection is pooled
    assert refused(table, token, None, 10.6) == "bad_token"  # used up
    assert alina.grants.settle(token, 10.7) == pytest.approx(0.7)
    assert not alina.grants.tokens


def test_a_spare_settles_as_a_replacement() -> None:
    table: TokenTable[Owner] = TokenTable()
    alina = Owner("alina", "fp-a")
    spare = table.issue(alina, Kind.SPARE, 0.0)
    assert alina.grants.kind_of(spare) is Kind.SPARE
    assert table.redeem(spare, "fp-a", TOKEN_TTL + 1) is alina  # SPARE_TTL is longer
    assert alina.grants.settle(spare, TOKEN_TTL + 1) is None
    assert not alina.grants.spares


def test_another_key_is_refused_and_the_token_used_up() -> None:
    table: TokenTable[Owner] = TokenTable()
    bob = Owner("bob", "fp-b")
    token = table.issue(bob, Kind.TOKEN, 0.0)
    assert refused(table, token, "fp-a", 1.0) == "token_mismatch"
    assert not bob.grants.tokens and len(table) == 0


def test_expiry_at_redeem_and_by_sweep() -> None:
    table: TokenTable[Owner] = TokenTable()
    alina = Owner("alina", "fp-a")
    late = table.issue(alina, Kind.TOKEN, 0.0)
    assert refused(table, late, None, TOKEN_TTL + 0.1) == "bad_token"
    swept = table.issue(alina, Kind.TOKEN, 0.0)
    spare = table.issue(alina, Kind.SPARE, 0.0)
    table.expire(alina, TOKEN_TTL + 0.1)  # the TOKEN is void, the SPARE is not
    assert refused(table, swept, None, 1.0) == "bad_token"
    assert alina.grants.spares == {spare: 0.0}
    table.expire(alina, tf.SPARE_TTL + 0.1)
    assert not alina.grants.spares and len(table) == 0


def test_a_session_that_ends_takes_its_tokens_with_it() -> None:
    table: TokenTable[Owner] = TokenTable()
    alina, bob = Owner("alina", "fp-a"), Owner("bob", "fp-b")
    mine = [table.issue(alina, kind, 0.0) for kind in (Kind.TOKEN, Kind.SPARE)]
    theirs = table.issue(bob, Kind.TOKEN, 0.0)
    table.forget(alina)
    assert all(refused(table, t, None, 1.0) == "bad_token" for t in mine)
    assert table.redeem(theirs, None, 1.0) is bob


def test_spare_target_is_twice_the_pool_within_bounds() -> None:
    assert spare_target(1) == SPARE_MIN
    assert spare_target(20) == 40
    assert spare_target(1000) == SPARE_MAX
