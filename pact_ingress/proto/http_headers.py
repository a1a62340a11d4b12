"""Header hygiene at the terminating edge, both directions. Pure.

Toward the node the edge is the only source of truth about who is calling from where,
so every header a client could use to claim an origin address or smuggle PACT metadata
the node might trust is removed, and one `Forwarded` element for this hop is added:

* `Forwarded`, `Via`, `X-Real-IP`, `X-Client-IP`, `Client-IP`, `True-Client-IP`,
  `X-Cluster-Client-IP`, `CF-Connecting-IP`, `Fastly-Client-IP`, and every name starting
  `X-Forwarded-`, `X-Original-`, `X-Pact-` or `Proxy-`;
* every name containing `_`: several servers (Werkzeug, CGI/WSGI gateways, uvicorn's
  scope users) read `X_Forwarded_For` as `X-Forwarded-For`, so an underscore spelling
  would slip past a list of dashed names. Real clients never need one.

Hop-by-hop fields (RFC 9110 §7.6.1: `Connection` and every field it names,
`Keep-Alive`, `Proxy-Connection`, `TE` except `trailers`, `Transfer-Encoding`,
`Upgrade`), `Expect` (the edge answers `100-continue` itself) and body framing are
removed in both directions; the engine frames each leg itself.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

Headers = list[tuple[bytes, bytes]]

HOP_BY_HOP = frozenset(
    {b"connection", b"keep-alive", b"proxy-connection", b"te", b"transfer-encoding",
     b"upgrade", b"expect"}
)
SPOOFABLE = frozenset({
    b"forwarded", b"via", b"x-real-ip", b"x-client-ip", b"client-ip", b"true-client-ip",
    b"x-cluster-client-ip", b"cf-connecting-ip", b"fastly-client-ip",
    b"x-rewrite-url",  # like X-Original-URL: some frameworks route by it, not the target
})
SPOOFABLE_PREFIXES = (b"x-forwarded-", b"x-original-", b"x-pact-", b"proxy-")
#: Response fields dropped by their start: pseudo-headers and every `proxy-` name.
_DROPPED_PREFIXES = (b":", b"proxy-")

# What becomes of a field, by its lower-case name, in each direction. Every field of
# every request and answer is judged, and the judgement (set lookups, prefix tests, the
# underscore search) is several times the cost of a dict lookup, so verdicts are kept
# by name; a client can invent names without end, so only the first `MAX_VERDICTS`
# are kept (the rest are judged each time, as before). The verdicts are plain ints, not
# an Enum: on Python 3.11 each load of an Enum member goes through the metaclass's
# `__getattr__` hook, and these are read once per field.
KEEP, DROP, TE, CONNECTION = 0, 1, 2, 3
MAX_VERDICTS = 2048
_request_verdicts: dict[bytes, int] = {}
_response_verdicts: dict[bytes, int] = {}


def request_verdict(lname: bytes) -> int:
    """What becomes of a request field named `lname` on its way to the node."""
    verdict = _request_verdicts.get(lname)
    if verdict is None:
        if lname == b"te":
            verdict = TE
        elif lname == b"connection":
            verdict = CONNECTION
        elif (lname in (b"host", b"content-length") or lname.startswith(b":")
              or lname in HOP_BY_HOP or is_spoofable(lname)):
            verdict = DROP  # (every proxy- name is spoofable)
        else:
            verdict = KEEP
        if len(_request_verdicts) < MAX_VERDICTS:
            _request_verdicts[lname] = verdict
    return verdict


def response_verdict(lname: bytes) -> int:
    """What becomes of an answer's field named `lname` on its way to the client."""
    verdict = _response_verdicts.get(lname)
    if verdict is None:
        if lname == b"connection":
            verdict = CONNECTION
        elif lname in HOP_BY_HOP or lname.startswith(_DROPPED_PREFIXES):
            verdict = DROP
        else:
            verdict = KEEP
        if len(_response_verdicts) < MAX_VERDICTS:
            _response_verdicts[lname] = verdict
    return verdict


def _connection_tokens(headers: Iterable[tuple[bytes, bytes]]) -> set[bytes]:
    named: set[bytes] = set()
    for name, value in headers:
        if name.lower() == b"connection":
            named.update(t.strip().lower() for t in value.split(b",") if t.strip())
    return named


def clean_response_headers(headers: Iterable[tuple[bytes, bytes]]) -> Headers:
    """The node's response headers minus hop-by-hop ones (and any pseudo-headers)."""
    out: Headers = []
    named: set[bytes] | None = None  # what Connection names, once it was seen
    for name, value in headers:
        lname = name.lower()
        verdict = response_verdict(lname)
        if verdict == KEEP:
            out.append((lname, value))
        elif verdict == CONNECTION:
            named = _connection_tokens(((lname, value),)) | (named or set())
    if named:  # rare: one pass per response otherwise
        out = [field for field in out if field[0] not in named]
    return out


@functools.lru_cache(maxsize=1024)
def _host_value(host: str) -> bytes:
    # An ASCII name (every route's, once normalised) needs no IDNA codec; that codec's
    # module is imported on its first use, which opens a file: out of fds, the first
    # request of a worker would fail on it.
    if host.isascii():
        return host.encode("ascii")
    return host.encode("idna")


@functools.lru_cache(maxsize=4096)
def forwarded_value(client_ip: str, host: str) -> bytes:
    """RFC 7239 `Forwarded` element for this hop (IPv6 quoted and bracketed). The same
    few (client, host) pairs recur on every request, so their values are remembered."""
    if ":" in client_ip:
        # without its zone (fe80::1%eth0): an interface of this host, nothing the node
        # could use, and no part of RFC 7239's "[" IPv6address "]"
        node = f'"[{client_ip.partition("%")[0]}]"'
    else:
        node = client_ip
    return f"for={node};proto=https;host={host}".encode("ascii")


def is_spoofable(name: bytes) -> bool:
    """Would a node trust this (lower-case) request header to mean something about the
    caller that only the edge may say?"""
    return (name in SPOOFABLE or name.startswith(SPOOFABLE_PREFIXES)
            or name.find(b"_") != -1)  # (`find`: `bytes in bytes` builds a TypeError first)


def clean_request_headers(
    headers: Iterable[tuple[bytes, bytes]], *, client_ip: str, host: str
) -> Headers:
    """Request headers for the node: no hop-by-hop, no spoofable, one `Forwarded`.

    `Host` is set to `host`; `TE: trailers` survives when the client asked for it. Body
    framing (`Content-Length`/`Transfer-Encoding`) is the caller's to set afterwards.
    """
    out: Headers = [(b"host", _host_value(host))]
    wants_trailers = False
    named: set[bytes] | None = None  # what Connection names, once it was seen
    for name, value in headers:
        lname = name.lower()
        verdict = request_verdict(lname)
        if verdict == KEEP:
            out.append((lname, value))
        elif verdict == TE:
            wants_trailers |= b"trailers" in [t.strip().lower() for t in value.split(b",")]
        elif verdict == CONNECTION:
            named = _connection_tokens(((lname, value),)) | (named or set())
    if named:  # rare: one pass per request otherwise
        out = [field for field in out if field[0] not in named or field[0] == b"host"]
    if wants_trailers:
        out.append((b"te", b"trailers"))
    out.append((b"forwarded", forwarded_value(client_ip, host)))
    return out
