"""SNI → route lookup: exact names first, then `*.suffix` wildcards, longest suffix wins.

Semantics (chosen, not inherited from certificate matching):

* Names are compared case-insensitively, with one trailing dot ignored, on both the
  configured host and the looked-up SNI.
* An exact route (`alina.family.example`) beats any wildcard.
* A wildcard `*.a.example` matches any name *below* `a.example`, at any depth:
  `x.a.example` and `y.x.a.example`, but never `a.example` itself. This differs from TLS
  certificate wildcards (RFC 6125 §6.4.3: exactly one label) on purpose: a route sends a
  whole subtree to one tenant's node, which then presents whatever certificates it has.
* When several wildcards match, the longest suffix wins: with `*.a.example` and
  `*.x.a.example`, `y.x.a.example` goes to `*.x.a.example`.
* A host configured twice (after normalisation) is a ValueError; the config loader checks
  this too, with file:line, so this is the last line of defence.

Lookup is a dict probe for the exact name, then one probe per parent suffix, walking up
from the longest: O(labels) ≤ 127 probes, no scan over routes, no allocation beyond the
suffix slices. The table is immutable; a reload builds a new one and swaps it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from pact_ingress.model import Route, normalize_hostname


def wildcard_covers(pattern: str, host: str) -> bool:
    """Does wildcard route host `pattern` (``*.suffix``) cover `host`? Any depth below
    the suffix, never the suffix itself — the rule `RouteTable.lookup` applies."""
    suffix = normalize_hostname(pattern, validate=False)[1:]  # ".suffix"
    name = normalize_hostname(host, validate=False)
    return len(name) > len(suffix) and name.endswith(suffix)


@dataclass(frozen=True)
class RouteTable:
    """Immutable SNI route table; build with `RouteTable.build(routes)`."""

    exact: dict[str, Route]
    wildcard: dict[str, Route]  # key: the suffix after "*.", e.g. "a.example"

    @classmethod
    def build(cls, routes: Iterable[Route]) -> RouteTable:
        exact: dict[str, Route] = {}
        wildcard: dict[str, Route] = {}
        for route in routes:
            host = normalize_hostname(route.host, validate=False)
            if host.startswith("*."):
                table, key = wildcard, host[2:]
            else:
                table, key = exact, host
            if not key or "*" in key:
                raise ValueError(f"route host {route.host!r}: '*' only as the whole first label")
            if key in table:
                raise ValueError(f"route host {route.host!r} is configured twice")
            table[key] = route
        return cls(exact, wildcard)

    def lookup(self, sni: str | None) -> Route | None:
        """The route for `sni`, or None (no SNI, or no route matches)."""
        if not sni:
            return None
        name = normalize_hostname(sni, validate=False)
        route = self.exact.get(name)
        if route is not None or not self.wildcard:
            return route
        dot = name.find(".")
        while dot != -1:  # one pass per label: bounded by the name's length
            route = self.wildcard.get(name[dot + 1 :])
            if route is not None:
                return route
            dot = name.find(".", dot + 1)
        return None

    def __len__(self) -> int:
        return len(self.exact) + len(self.wildcard)
