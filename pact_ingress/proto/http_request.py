"""What the terminating edge decides from a request head, before any body byte. Pure.

Theory of operation
-------------------
Terminate mode promises that nothing unchecked reaches a node whose route requires
seals. The seal check only means something if the edge and the node agree on *which
resource* a request names; every parser differential between them (absolute-form
targets, ``;params``, case, percent-escapes, ``..``) is a bypass. So the edge does not
forward the client's target at all: it parses it here, refuses what it cannot read
unambiguously, and sends the node the **normalised origin-form path it checked**.

A target is accepted in origin form (``/path?query``) or absolute form
(``https://host[:port]/path?query``, which RFC 9112 §3.2.2 obliges servers to accept;
its authority is checked like ``Host``). Asterisk form (``OPTIONS *``), authority form
(``CONNECT``), fragments, user-info, bytes outside visible ASCII, and characters RFC 3986
does not allow in a path are refused with 400.

Path normalisation (what the node receives):

1. split into segments on ``/``; in each segment drop ``;params`` (servlet-style
   containers and Java's ``HttpServer`` route ``/mcp;x`` to ``/mcp``);
2. decode percent-escapes of *unreserved* characters (``%6D`` → ``m``; RFC 3986 §6.2.2.2
   says they are equivalent); other escapes are kept, upper-cased; a malformed escape is
   a 400;
3. resolve ``.`` and ``..`` segments and drop empty ones (``//mcp`` → ``/mcp``), keeping
   one trailing slash if the target had one.

Which requests the seal posture judges (:func:`in_mcp_scope`): any whose normalised
path, compared case-insensitively and with ``%2F``/``%5C`` read as slashes, is the
route's ``mcp_path`` or lies below it — as it stands, or with the empty and dot segments
those slashes make merged and resolved (``/%2Fmcp``, ``/x%2F..%2Fmcp``), as a router
that decodes them may. :func:`judge_scope` then sorts a request into

* ``MCP_POST`` — a POST in scope: the body is read and judged by ``proto.posture``;
* ``PLAIN`` — forwarded untouched (SSE ``GET``, session ``DELETE``, a landing page);
* a refusal — a body-carrying request in scope that is not a POST (405), a JSON body
  outside scope on a sealed route (403: a node may dispatch on the body, not the path),
  or a compressed body in scope (415: the node would inflate what the edge judged raw).

Anywhere, a method of :data:`NO_CONTENT_METHODS` that carries content is refused (400):
its content means nothing, and a node that ignores it would read it as its next request
on a pooled connection, one no posture judged. Whether content came is known only once
the stream shows it (an HTTP/2 stream may end with an empty DATA frame), so the caller
decides that, after this sorting.

HTTP/1.1 framing (``Content-Length`` with ``Transfer-Encoding``, folded lines, duplicate
lengths) is refused by the parser itself (``proto.http1_server``, llhttp), before any of
this runs.
"""

from __future__ import annotations

import enum
import functools
import re
from collections.abc import Iterable
from dataclasses import dataclass

from pact_ingress.proto.routing import wildcard_covers

#: Longest request target accepted; longer is a 414. Far above any MCP or SSE URL and
#: below the head limit, so one long target cannot be most of a head.
MAX_TARGET_BYTES = 8 * 1024

_UNRESERVED = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~")
#: RFC 3986 pchar minus percent: unreserved, sub-delims, ":" and "@", plus "/".
_PATH_BYTES = _UNRESERVED | frozenset(b"!$&'()*+,;=:@/%")
#: Query bytes: pchar, "/" and "?" (RFC 3986 §3.4); "%" escapes are left as sent.
_QUERY_BYTES = _PATH_BYTES | frozenset(b"?")
_HEX = frozenset(b"0123456789abcdefABCDEF")
_SCHEME = re.compile(rb"(?i:https?)://")


class BadRequest(Exception):
    """The head cannot be judged unambiguously: answer `status` and close."""

    def __init__(self, why: str, status: int = 400) -> None:
        super().__init__(why)
        self.why = why
        self.status = status


@dataclass(frozen=True)
class Target:
    path: str  # normalised, always starts with "/"
    query: str | None  # as sent, without "?"
    authority: str | None  # host of an absolute-form target, lower-case, no port

    @property
    def origin_form(self) -> bytes:
        """The target the node receives."""
        if self.query is None:
            return self.path.encode("ascii")
        return f"{self.path}?{self.query}".encode("ascii")


#: Targets and Host values up to this long are remembered (the same few recur on every
#: request of a client); longer ones are parsed each time, so the caches stay small.
MEMO_BYTES = 256
MEMO_ENTRIES = 1024


def parse_target(raw: bytes) -> Target:
    """The request target as the node will see it; raises `BadRequest`."""
    if len(raw) <= MEMO_BYTES:
        return _parse_target_memo(raw)  # a refusal is not remembered: it raises again
    return _parse_target(raw)


def _parse_target(raw: bytes) -> Target:
    if len(raw) > MAX_TARGET_BYTES:
        raise BadRequest("request target too long", 414)
    authority = None
    if raw.startswith(b"/"):
        rest = raw
    elif _SCHEME.match(raw):
        after = raw[raw.index(b"//") + 2:]
        cut = min((i for i in (after.find(b"/"), after.find(b"?")) if i >= 0), default=len(after))
        authority_bytes, rest = after[:cut], after[cut:]
        if b"@" in authority_bytes:
            raise BadRequest("user-info in the request target")
        authority = authority_host(authority_bytes)
        if authority is None:
            raise BadRequest("bad authority in the request target")
        if not rest.startswith(b"/"):
            rest = b"/" + rest
    else:
        raise BadRequest("request target must be origin-form or absolute-form")
    path, question, query = rest.partition(b"?")
    if not _PATH_BYTES.issuperset(path):
        raise BadRequest("character not allowed in a path")
    if question and not _QUERY_BYTES.issuperset(query):
        raise BadRequest("character not allowed in a query")
    return Target(normalise_path(path), query.decode("ascii") if question else None, authority)


def normalise_path(path: bytes) -> str:
    """The path a node receives (see the module docstring); raises `BadRequest`."""
    segments = path.split(b"/")
    out = _resolved(_decode_unreserved(segment.split(b";", 1)[0]) for segment in segments)
    trailing = len(segments) > 1 and segments[-1].split(b";", 1)[0] in (b"", b".", b"..")
    text = "/" + "/".join(out)
    return text + "/" if trailing and out else text


def _decode_unreserved(segment: bytes) -> str:
    if b"%" not in segment:
        return segment.decode("ascii")
    parts = segment.split(b"%")
    out = [parts[0].decode("ascii")]
    for part in parts[1:]:
        if len(part) < 2 or not _HEX.issuperset(part[:2]):
            raise BadRequest("malformed percent-escape in the path")
        byte = int(part[:2], 16)
        escaped = chr(byte) if byte in _UNRESERVED else "%" + part[:2].decode().upper()
        out.append(escaped + part[2:].decode("ascii"))
    return "".join(out)


def in_mcp_scope(path: str, mcp_path: str) -> bool:
    """Is the normalised `path` the route's MCP endpoint or below it?"""
    if len(path) <= MEMO_BYTES:
        return _in_mcp_scope_memo(path, mcp_path)
    return _in_mcp_scope(path, mcp_path)


def _in_mcp_scope(path: str, mcp_path: str) -> bool:
    folded = _fold(path)
    scope = _mcp_scope(mcp_path)
    if scope == "" or folded == scope or folded.startswith(scope + "/"):
        return True
    # A router that reads the escaped slashes as slashes may also merge the empty
    # segments they make or resolve the dot segments between them (nginx matches
    # locations so, Go's ServeMux cleans the path): `/%2Fmcp` and `/x%2F..%2Fmcp` are the
    # endpoint to it. Judged in either reading, the one above or this one.
    if "%" not in path:
        return False  # no escaped slash: normalising left no empty or dot segment
    resolved = _resolve(folded)
    return resolved == scope or resolved.startswith(scope + "/")


def _resolve(folded: str) -> str:
    """`folded` with empty and `.` segments dropped and `..` resolved (no trailing /)."""
    return "/" + "/".join(_resolved(folded.split("/")))


def _resolved(segments: Iterable[str]) -> list[str]:
    """Path segments with the empty and `.` ones dropped and each `..` taking the one
    before it away (none above the root)."""
    out: list[str] = []
    for segment in segments:
        if segment in ("", "."):
            continue
        if segment == "..":
            if out:
                out.pop()
            continue
        out.append(segment)
    return out


@functools.lru_cache(maxsize=256)
def _mcp_scope(mcp_path: str) -> str:
    """The folded MCP path of a route (configured: a handful of values)."""
    return _fold(normalise_path(mcp_path.encode("ascii")))


def _fold(path: str) -> str:
    return path.casefold().replace("%2f", "/").replace("%5c", "/").rstrip("/")


def authority_host(value: bytes | None) -> str | None:
    """The host of a Host / :authority value, lower-case, without port; None if bad."""
    if not value:
        return None
    if len(value) <= MEMO_BYTES:
        return _authority_host_memo(value)
    return _authority_host(value)


def _authority_host(value: bytes) -> str | None:
    try:
        text = value.decode("ascii").strip().lower()
    except UnicodeDecodeError:
        return None
    if text.startswith("["):
        end = text.find("]")
        rest = text[end + 1:] if end > 0 else "x"
        if rest and not (rest.startswith(":") and rest[1:].isdigit()):
            return None
        return text[: end + 1]
    host, colon, port = text.partition(":")
    if colon and not port.isdigit():
        return None
    host = host.rstrip(".")
    if not host or not re.fullmatch(r"[a-z0-9_.-]+", host):
        return None
    return host


_parse_target_memo = functools.lru_cache(maxsize=MEMO_ENTRIES)(_parse_target)
_authority_host_memo = functools.lru_cache(maxsize=MEMO_ENTRIES)(_authority_host)
_in_mcp_scope_memo = functools.lru_cache(maxsize=MEMO_ENTRIES)(_in_mcp_scope)


def host_matches(host: str, sni: str | None, route_host: str) -> bool:
    """Does a request for `host` belong on a connection for `sni` on route `route_host`?

    With an SNI the request must name exactly it (no domain fronting; on HTTP/2 a 421
    makes the client open a connection for the other name). Without one (an exact route,
    or a client that sent none) the route's own rule decides.
    """
    if sni is not None:
        return host == sni.lower().rstrip(".")
    if route_host.startswith("*."):
        return wildcard_covers(route_host, host)
    return host == route_host


def check_host(host_header: bytes | None, target: Target, sni: str | None,
               route_host: str) -> str:
    """The host this request is for, or `BadRequest` (400 unreadable, 421 elsewhere)."""
    host = authority_host(host_header) if host_header is not None else None
    if host_header is not None and host is None:
        raise BadRequest("bad Host header")
    if target.authority is not None:
        if host is not None and host != target.authority:
            raise BadRequest("Host header and request target disagree")
        host = target.authority
    if host is None:
        raise BadRequest("no Host header")
    if not host_matches(host, sni, route_host):
        raise BadRequest("misdirected request: this connection serves another host", 421)
    return host


class Scope(enum.Enum):
    MCP_POST = "mcp_post"  # judged by the seal posture
    PLAIN = "plain"  # forwarded as it is


#: The members as plain globals for the per-request paths. On Python 3.11 an Enum class
#: attribute (`Scope.PLAIN`) goes through the metaclass's `__getattr__` hook, about ten
#: times the cost of a global load; the same holds for every enum a request touches.
MCP_POST, PLAIN = Scope.MCP_POST, Scope.PLAIN


#: Methods that carry no body and may reach the MCP endpoint (SSE stream, session end).
_BODILESS_MCP_METHODS = frozenset({"GET", "HEAD", "DELETE", "OPTIONS"})
#: Methods whose request content has no meaning (RFC 9110 §9.3.1, §9.3.2).
NO_CONTENT_METHODS = frozenset({"GET", "HEAD"})


def is_json_type(content_type: bytes | None) -> bool:
    """Could a node read this body as JSON? `application/json`, `text/json`, any `+json`
    type — and, since servers differ in how they read a list or a malformed value, any
    value that mentions json at all."""
    return content_type is not None and b"json" in content_type.lower()


#: Fields a node reads one value of, and that decide what the edge judges: a second
#: copy would let the edge judge one value while the node acts on the other.
SINGLE_VALUED = (b"content-type", b"content-encoding")


def check_single_valued(headers: Iterable[tuple[bytes, bytes]]) -> None:
    """`BadRequest` (400) when a field of `SINGLE_VALUED` appears more than once."""
    seen: set[bytes] = set()
    for name, _ in headers:
        if name in SINGLE_VALUED:
            if name in seen:
                raise BadRequest(f"more than one {name.decode()} field")
            seen.add(name)


def judge_scope(method: str, target: Target, mcp_path: str, *, has_body: bool,
                content_type: bytes | None, content_encoding: bytes | None) -> Scope:
    """Sort a request on a sealed route (see the module docstring); raises `BadRequest`."""
    if in_mcp_scope(target.path, mcp_path):
        if method == "POST":
            if content_encoding is not None and content_encoding.strip().lower() != b"identity":
                raise BadRequest("compressed bodies are not accepted at the MCP endpoint", 415)
            return MCP_POST
        if method in _BODILESS_MCP_METHODS and not has_body:
            return PLAIN
        raise BadRequest(f"{method} with a body is not accepted at the MCP endpoint", 405)
    if has_body and is_json_type(content_type):
        raise BadRequest("JSON bodies are accepted only at the MCP endpoint", 403)
    return PLAIN


def header(headers: Iterable[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    """The first value of header `name` (lower-case), or None."""
    for key, value in headers:
        if key == name:
            return value
    return None


#: A declared length of more significant digits than this is more than any body could be.
MAX_LENGTH_DIGITS = 19
#: What such a length reads as: still more than any body, and no digit string int() is
#: asked to convert (CPython refuses more than 4300 digits, raising ValueError).
HUGE_LENGTH = 1 << 64


def declared_length(value: bytes) -> int | None:
    """A `Content-Length` value: ASCII digits (leading zeros allowed, RFC 9110's
    1*DIGIT) as their number, capped at `HUGE_LENGTH`; None for anything else. Both
    HTTP versions read it so: llhttp, which checks the HTTP/1.1 field, takes any number
    of leading zeros too."""
    if not value.isdigit():  # bytes: ASCII digits only (int() would take "+5", " 5", "5_0")
        return None
    significant = value.lstrip(b"0")
    if len(significant) > MAX_LENGTH_DIGITS:
        return HUGE_LENGTH
    return int(significant) if significant else 0
