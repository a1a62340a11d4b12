"""RouteTable: exact before wildcard, longest wildcard suffix wins, any depth below the
suffix, case/trailing-dot tolerance, duplicates refused, and agreement with a brute-force
reference on random names."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pact_ingress.config import Address, Backend, Route
from pact_ingress.config import normalize_hostname as config_normalize_hostname
from pact_ingress.model import normalize_hostname
from pact_ingress.proto.routing import RouteTable, wildcard_covers


def route(host: str, tenant: str = "t") -> Route:
    return Route(host=host, tenant=tenant, mode="passthrough",
                 backend=Backend(Address("127.0.0.1", 8443)))  # fmt: skip


HOSTS = ["alina.family.example", "*.alina.family.example", "*.family.example",
         "mcp.alina.family.example", "*.b.example", "Upper.Example."]  # fmt: skip
TABLE = RouteTable.build(route(h, tenant=h) for h in HOSTS)


@pytest.mark.parametrize(
    ("sni", "expected"),
    [
        ("alina.family.example", "alina.family.example"),  # exact
        ("mcp.alina.family.example", "mcp.alina.family.example"),  # exact beats wildcard
        ("x.alina.family.example", "*.alina.family.example"),  # longest suffix wins
        ("y.x.alina.family.example", "*.alina.family.example"),  # any depth
        ("bob.family.example", "*.family.example"),
        ("a.b.c.family.example", "*.family.example"),
        ("x.b.example", "*.b.example"),
        ("b.example", None),  # a wildcard never matches its own suffix
        ("family.example", None),
        ("example", None),
        ("other.example", None),
        ("ALINA.Family.Example", "alina.family.example"),  # case-insensitive
        ("alina.family.example.", "alina.family.example"),  # trailing dot
        ("X.B.EXAMPLE.", "*.b.example"),
        ("upper.example", "Upper.Example."),  # configured host normalised too
        ("", None),
        (None, None),
    ],
)
def test_lookup(sni: str | None, expected: str | None) -> None:
    found = TABLE.lookup(sni)
    assert (found.tenant if found else None) == expected


def test_len_and_empty_table() -> None:
    assert len(TABLE) == len(HOSTS)
    empty = RouteTable.build([])
    assert len(empty) == 0 and empty.lookup("a.example") is None


def test_exact_only_table_skips_the_walk() -> None:
    table = RouteTable.build([route("a.example")])
    assert table.lookup("x.a.example") is None
    assert table.lookup("a.example") is not None


@pytest.mark.parametrize(
    "hosts",
    [["a.example", "a.example"], ["a.example", "A.Example."], ["*.a.example", "*.A.EXAMPLE"]],
)
def test_duplicate_hosts_are_refused(hosts: list[str]) -> None:
    with pytest.raises(ValueError, match="twice"):
        RouteTable.build(route(h) for h in hosts)


def test_wildcard_and_exact_of_the_same_suffix_coexist() -> None:
    table = RouteTable.build([route("a.example", "exact"), route("*.a.example", "wild")])
    assert [table.lookup(n).tenant for n in ("a.example", "x.a.example")] == ["exact", "wild"]  # type: ignore[union-attr]


@pytest.mark.parametrize("host", ["*", "*.", "a.*.example", "x*.example", "*.*.example"])
def test_bad_wildcards_are_refused(host: str) -> None:
    with pytest.raises(ValueError, match="first label"):
        RouteTable.build([route(host)])


def reference(hosts: list[str], sni: str) -> str | None:
    """Brute force: exact, else the longest matching wildcard suffix."""
    if sni in hosts:
        return sni
    matches = [h for h in hosts if h.startswith("*.") and sni.endswith(h[1:])]
    return max(matches, key=len, default=None)


labels = st.sampled_from(["a", "b", "c", "example"])
names = st.lists(labels, min_size=1, max_size=5).map(".".join)


@given(st.sets(st.one_of(names, names.map(lambda n: "*." + n)), max_size=12), names)
@settings(max_examples=300, deadline=None)
def test_agrees_with_brute_force(hosts: set[str], sni: str) -> None:
    table = RouteTable.build(route(h, tenant=h) for h in hosts)
    found = table.lookup(sni)
    assert (found.tenant if found else None) == reference(sorted(hosts), sni)


@pytest.mark.parametrize(
    "spelling", ["A.Example.", "x.example", "MCP.Alina.Example.", "xn--Bcher-KVA.example."]
)
def test_routing_and_config_agree_on_spelling(spelling: str) -> None:
    """The loader stores a host as `normalize_hostname` spells it; the router normalises
    both the configured host and the SNI the same way, so each finds the other."""
    assert config_normalize_hostname is normalize_hostname  # one function, not two
    canonical = config_normalize_hostname(spelling)
    assert canonical == normalize_hostname(spelling, validate=False)
    assert RouteTable.build([route(canonical)]).lookup(spelling) is not None
    assert RouteTable.build([route(spelling)]).lookup(canonical) is not None
    wild = config_normalize_hostname("*." + spelling, wildcard=True)
    assert RouteTable.build([route(wild)]).lookup("sub." + spelling) is not None
    assert wildcard_covers("*." + spelling, "sub." + canonical)
