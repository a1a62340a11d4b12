"""Flood defences for HTTP/2 client connections. Pure: events and `now` in, a verdict out.

HTTP/2 lets a client make the server work without making requests that cost it
anything: reset every stream right after opening it ("rapid reset"), send PINGs or
SETTINGS that must each be answered, or open streams and never finish them. h2 answers
all of these correctly, and would go on answering for ever. A `FloodGuard` per
connection keeps one token bucket per kind of cheap frame; when a bucket runs dry the
connection is closed with GOAWAY(ENHANCE_YOUR_CALM), and the kind is reported for the
counter. The allowances are far above what a real client does (browsers and MCP SDKs
send a handful of PINGs and SETTINGS per connection, and cancel streams one at a time),
so only a connection doing little else trips them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class Flood(enum.Enum):
    RESET = "reset"  # client RST_STREAM
    PING = "ping"
    SETTINGS = "settings"
    PRIORITY = "priority"  # PRIORITY frames: free to send, answered with bookkeeping
    EMPTY_DATA = "empty_data"  # DATA frames with no payload that do not end the stream
    WINDOW_UPDATE = "window_update"  # beyond what the data we send explains
    UNKNOWN = "unknown"  # frame types HTTP/2 does not define (ignored by the RFC, not free)

    # members are singletons: hashing by identity is exact, and much cheaper than Enum's
    # own hash (a Python call) on the per-response `credit`
    __hash__ = object.__hash__


#: The member charged or credited per answer, as a plain global: on Python 3.11 an Enum
#: class attribute goes through the metaclass's `__getattr__` hook, about ten times the
#: cost of a global load.
WINDOW_UPDATE = Flood.WINDOW_UPDATE


@dataclass(frozen=True)
class Allowance:
    burst: float  # frames accepted at once
    per_second: float  # sustained rate


#: Per connection. Resets: a client cancelling many SSE streams at once stays well under
#: 200; PINGs and SETTINGS: a keep-alive ping every few seconds is the norm.
ALLOWANCES = {
    Flood.RESET: Allowance(burst=200, per_second=50),
    Flood.PING: Allowance(burst=50, per_second=10),
    Flood.SETTINGS: Allowance(burst=50, per_second=10),
    Flood.PRIORITY: Allowance(burst=500, per_second=100),
    Flood.EMPTY_DATA: Allowance(burst=100, per_second=20),
    # A receiver opens its window as our DATA arrives: `credit` gives one frame back per
    # WINDOW_CREDIT_BYTES we send, so a fast download never trips; only updates that no
    # data explains draw on the bucket.
    Flood.WINDOW_UPDATE: Allowance(burst=500, per_second=100),
    # GREASE frames (a browser sends one or two per connection) are the legitimate case.
    Flood.UNKNOWN: Allowance(burst=100, per_second=20),
}

#: Response bytes sent per WINDOW_UPDATE frame the client may send back for free (a
#: client updates both the stream and the connection window, typically per half window).
WINDOW_CREDIT_BYTES = 4096


@dataclass
class FloodGuard:
    allowances: dict[Flood, Allowance] = field(default_factory=lambda: dict(ALLOWANCES))
    _tokens: dict[Flood, float] = field(default_factory=dict)
    _at: dict[Flood, float] = field(default_factory=dict)

    def charge(self, kind: Flood, now: float) -> bool:
        """Count one frame of `kind`; False when the connection has flooded."""
        allowance = self.allowances[kind]
        tokens = self._tokens.get(kind, allowance.burst)
        last = self._at.get(kind, now)
        tokens = min(allowance.burst, tokens + (now - last) * allowance.per_second)
        self._at[kind] = now
        if tokens < 1:
            self._tokens[kind] = tokens
            return False
        self._tokens[kind] = tokens - 1
        return True

    def credit(self, kind: Flood, frames: float) -> None:
        """Give `frames` back to `kind`'s bucket (never above its burst): work the
        connection did that explains frames of that kind."""
        allowance = self.allowances[kind]
        tokens = self._tokens.get(kind, allowance.burst)
        self._tokens[kind] = min(allowance.burst, tokens + frames)
