"""Units of one resource held per client, with a cap per client and a cap in total. Pure.

The terminating edge has resources that one client could otherwise take whole: bytes of
request bodies it buffers, and in-flight requests toward a route's node (an HTTP/1.1
node needs a pooled connection per request). A `Shares` table lets each client hold at
most `per_client` units and everyone together at most `total`; whoever asks beyond that
is refused at once (and answered), never queued, so a flood from one address costs the
others nothing. Clients are the rate limiter's buckets (an IPv6 /64 is one client).
"""

from __future__ import annotations

import enum
from collections import Counter


class Refused(enum.Enum):
    CLIENT = "client"  # this client holds its whole share
    TOTAL = "total"  # everyone together hold the whole resource


class Shares:
    def __init__(self, per_client: int, total: int) -> None:
        if per_client <= 0 or total < per_client:
            raise ValueError("need 0 < per_client <= total")
        self.per_client = per_client
        self.total = total
        self.held = 0
        self._by_client: Counter[str] = Counter()

    def take(self, client: str, units: int) -> Refused | None:
        """Hold `units` more for `client`, or refuse (holding nothing more)."""
        if self._by_client[client] + units > self.per_client:
            if not self._by_client[client]:
                del self._by_client[client]
            return Refused.CLIENT
        if self.held + units > self.total:
            if not self._by_client[client]:
                del self._by_client[client]
            return Refused.TOTAL
        self._by_client[client] += units
        self.held += units
        return None

    def give(self, client: str, units: int) -> None:
        """Return `units` `client` held (never more than it holds)."""
        units = min(units, self._by_client[client])
        self.held -= units
        left = self._by_client[client] - units
        if left:
            self._by_client[client] = left
        else:
            del self._by_client[client]

    def of(self, client: str) -> int:
        return self._by_client.get(client, 0)

    def __len__(self) -> int:
        """Clients holding anything (the table never keeps empty entries)."""
        return len(self._by_client)
