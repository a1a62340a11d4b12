"""The ingress's session logic that needs no I/O: the token table and the pool sizer.

Time is a parameter (`now`, from whatever clock the caller runs on); nothing here reads a
clock, touches a socket or knows about trio, so the rules are tested as plain values.

* **Tokens.** A control session grants two kinds (`Kind`): a TOKEN ("dial one data
  connection now") and a SPARE ("keep this; dial with it to replace a data connection
  that started carrying a stream"). Each is 256 random bits, single-use, void after its
  kind's TTL, and belongs to the session that issued it. `Grants` is one session's
  outstanding tokens; `TokenTable` maps every outstanding token to its session, so a
  data connection presenting one is redeemed in one lookup — and used up whatever the
  outcome.
* **Pool size.** `PoolSizer` turns the open rate and the refill latency into the number
  of idle data connections a session should keep.
"""

from __future__ import annotations

import math
import secrets
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Generic, Protocol, TypeVar

from pact_ingress.proto.tunnel import frames

#: A token not used by then is void: a connector that got it dials within milliseconds
#: to a few RTTs; 30 s covers a slow handshake without keeping stale credentials around.
TOKEN_TTL = 30.0
#: Idle data connections per session: never fewer than POOL_MIN, never more than POOL_MAX
#: (each is one fd here and one at the connector).
POOL_MIN = 4
POOL_MAX = 64
#: SPARE tokens a session keeps at its connector: twice the pool target, at least
#: SPARE_MIN, at most SPARE_MAX; topped up, in one TLS record, once below half of it (so
#: a top-up costs one control write per SPARE_MIN / 2 streams or more).
SPARE_MIN = 16
SPARE_MAX = 128
#: Window for estimating the open rate (pool sizing).
RATE_WINDOW = 5.0
#: Refill latency (token sent → data connection pooled) assumed before any was measured:
#: a slow home uplink; the first refills replace it.
INITIAL_REFILL_LATENCY = 0.05
#: The refill latency is the minimum of the refills of the last this many seconds.
LATENCY_WINDOW = 10


class Kind(Enum):
    TOKEN = "token"  # dial now
    SPARE = "spare"  # dial to replace a data connection that carries a stream


def ttl(kind: Kind) -> float:
    """How long a token of `kind` stays valid after it was issued."""
    return TOKEN_TTL if kind is Kind.TOKEN else frames.SPARE_TTL


def spare_target(pool_target: int) -> int:
    """SPAREs a session should have out for a pool of `pool_target` idle connections."""
    return min(SPARE_MAX, max(SPARE_MIN, 2 * pool_target))


@dataclass
class Grants:
    """One session's outstanding tokens, by kind: token → when it was issued."""

    tokens: dict[bytes, float] = field(default_factory=dict)
    spares: dict[bytes, float] = field(default_factory=dict)

    def table(self, kind: Kind) -> dict[bytes, float]:
        return self.tokens if kind is Kind.TOKEN else self.spares

    def kind_of(self, token: bytes) -> Kind | None:
        if token in self.spares:
            return Kind.SPARE
        if token in self.tokens:
            return Kind.TOKEN
        return None

    def expire(self, now: float) -> list[bytes]:
        """Drop the tokens past their TTL at `now`; returns them."""
        gone: list[bytes] = []
        for kind in Kind:
            table, limit = self.table(kind), ttl(kind)
            for token, issued in list(table.items()):
                if now - issued > limit:
                    del table[token]
                    gone.append(token)
        return gone

    def settle(self, token: bytes, now: float) -> float | None:
        """A redeemed token's data connection is pooled: forget the token. For a TOKEN,
        the refill latency (issued → pooled); None for a SPARE (a replacement)."""
        if self.spares.pop(token, None) is not None:
            return None
        return now - self.tokens.pop(token, now)

    def clear(self) -> list[bytes]:
        """Forget every token (the session ended); returns them."""
        gone = [*self.tokens, *self.spares]
        self.tokens.clear()
        self.spares.clear()
        return gone


class Holder(Protocol):
    """What a token is issued to: a session of one tenant's key."""

    @property
    def tenant(self) -> str: ...

    @property
    def fingerprint(self) -> str: ...

    @property
    def grants(self) -> Grants: ...


H = TypeVar("H", bound=Holder)


class BadToken(Exception):
    """A presented token is refused: `event` is the counter label."""

    def __init__(self, event: str, detail: str) -> None:
        super().__init__(detail)
        self.event = event


class TokenTable(Generic[H]):
    """Every outstanding token of every session → the session it was issued to."""

    def __init__(self) -> None:
        self._owner: dict[bytes, H] = {}

    def __len__(self) -> int:
        return len(self._owner)

    def __contains__(self, token: object) -> bool:
        return token in self._owner

    def issue(self, owner: H, kind: Kind, now: float, token: bytes | None = None) -> bytes:
        """A new token of `kind` for `owner` (random unless given)."""
        if token is None:
            token = secrets.token_bytes(frames.TOKEN_BYTES)
        owner.grants.table(kind)[token] = now
        self._owner[token] = owner
        return token

    def redeem(self, token: bytes, key: str | None, now: float) -> H:
        """The session a presented token was issued to; BadToken if refused. The token
        is used up whatever the outcome (it stays in its session's `Grants` until
        `settle`, so it still counts as outstanding while the connection is set up).

        `key` (TLS data connections) must be the session's fingerprint; a raw data
        connection has none: the token, issued only inside that session's pinned TLS, is
        its credential.
        """
        owner = self._owner.pop(token, None)
        if owner is None:
            raise BadToken("bad_token", "unknown, used or expired token")
        kind = owner.grants.kind_of(token)
        if kind is None:
            raise BadToken("bad_token", "unknown, used or expired token")
        table = owner.grants.table(kind)
        if key is not None and owner.fingerprint != key:
            del table[token]
            raise BadToken("token_mismatch",
                           f"token of tenant {owner.tenant} presented by this key")
        if now - table[token] > ttl(kind):
            del table[token]
            raise BadToken("bad_token", "expired token")
        return owner

    def expire(self, owner: H, now: float) -> None:
        """Void `owner`'s tokens past their TTL."""
        for token in owner.grants.expire(now):
            self._owner.pop(token, None)

    def forget(self, owner: H) -> None:
        """Void all of `owner`'s tokens (its session ended)."""
        for token in owner.grants.clear():
            self._owner.pop(token, None)


class PoolSizer:
    """Pool target = POOL_MIN + 2 × (opens/s × refill latency), clamped.

    The refill latency is the *minimum* over the last LATENCY_WINDOW seconds, not an
    average: refills queue behind each other (and, with TLS data connections, behind each
    other's handshakes), so an average measures our own burst and feeds back — a bigger
    target means more concurrent refills, slower refills, a bigger target, up to
    POOL_MAX. The minimum is the path's own cost (as min-RTT in congestion control);
    queueing can only add to it. A path that really got slower raises the minimum once
    the faster samples leave the window; until then `open_stream` waiters add to the
    target directly (the server's `_target`).
    """

    def __init__(self) -> None:
        self.takes: deque[float] = deque(maxlen=4096)
        # (second, fastest refill in it): a window minimum in O(window) space, however
        # many refills a burst brings
        self.fastest: deque[tuple[int, float]] = deque()

    def took(self, now: float) -> None:
        self.takes.append(now)

    def refilled(self, now: float, latency: float) -> None:
        """A data connection arrived `latency` seconds after its token was sent."""
        second = math.floor(now)
        if self.fastest and self.fastest[-1][0] == second:
            self.fastest[-1] = (second, min(self.fastest[-1][1], latency))
        else:
            self.fastest.append((second, latency))

    def latency(self, now: float) -> float:
        while len(self.fastest) > 1 and self.fastest[0][0] < now - LATENCY_WINDOW:
            self.fastest.popleft()  # the newest second stays: better than a guess
        if not self.fastest:
            return INITIAL_REFILL_LATENCY
        return min(latency for _, latency in self.fastest)

    def target(self, now: float) -> int:
        while self.takes and self.takes[0] < now - RATE_WINDOW:
            self.takes.popleft()
        rate = len(self.takes) / RATE_WINDOW
        return min(POOL_MAX, POOL_MIN + math.ceil(2 * rate * self.latency(now)))
