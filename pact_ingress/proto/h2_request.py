"""Is an HTTP/2 request header block well formed (RFC 9113 §8.2, §8.3)? Pure.

The HTTP/2 state machine (`proto.h2_server`) leaves header blocks unchecked; this
checks a request block in one pass, as strictly as the h2 library would and stricter in
two places because the next hop is HTTP/1.1: field names must be RFC 9110 tokens in
lower case (h2 accepts any visible ASCII but upper case and ':'), and values may carry
no control character but HTAB (h2 refuses only NUL, CR and LF). Anything it refuses is a
malformed request, which RFC 9113 §8.1.1 makes a stream error (PROTOCOL_ERROR).

The rules: pseudo-header fields first, each at most once, only the request ones
(`:method`, `:scheme`, `:authority`, `:path`); `:method` always; `:scheme` and `:path`
(non-empty) except on a plain CONNECT, which must have neither; no `:protocol` — the
edge never sends SETTINGS_ENABLE_CONNECT_PROTOCOL, so extended CONNECT is not offered
(RFC 8441 §4), as HTTP/1.1 upgrades and CONNECT are not; `:method` a token; no
connection-specific field (`Connection`, `Keep-Alive`, `Proxy-Connection`,
`Transfer-Encoding`, `Upgrade`); `TE` only as `trailers`; at least one of `:authority`
and `Host`, equal when both, and at most one `Host`; `Content-Length` fields that agree;
no value starting or ending with whitespace. Split `Cookie` fields are joined into one
(RFC 9113 §8.2.3), which h2 would otherwise do in yet another generator.

The checks that look at every field are made once per block, not once per field: all
names in one regular-expression match, all values in one search.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

Header = tuple[bytes, bytes]

#: One or more lower-case tokens separated by commas: every field name of a block at once
#: (the node side's response check, `proto.h2_client`, uses these rules too).
FIELD_NAMES = re.compile(rb"[!#$%&'*+.^_`|~0-9a-z-]+(?:,[!#$%&'*+.^_`|~0-9a-z-]+)*")
#: A method (RFC 9110 §9.1): a token, in any case. It becomes the next hop's request line.
_METHOD = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
#: A control character other than HTAB, in any value of a block at once (joined by HTAB).
CONTROL = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")
WHITESPACE = (b" ", b"\t")
_PSEUDO = frozenset({b":method", b":scheme", b":authority", b":path", b":protocol"})
CONNECTION_SPECIFIC = frozenset({
    b"connection", b"proxy-connection", b"keep-alive", b"transfer-encoding", b"upgrade",
})


class MalformedRequest(ValueError):
    """The header block breaks a rule of RFC 9113 §8.2/§8.3 (the message says which)."""


def split_request(headers: Iterable[Header]) -> tuple[dict[bytes, bytes], list[Header]]:
    """The pseudo-header fields (by name) and the ordinary fields (in order, `Cookie`
    fields joined into one, RFC 9113 §8.2.3) of a valid request header block;
    `MalformedRequest` otherwise."""
    pseudo: dict[bytes, bytes] = {}
    fields: list[Header] = []
    cookies: list[bytes] = []
    host: bytes | None = None
    length: bytes | None = None
    for name, value in headers:
        if value[:1] in WHITESPACE or value[-1:] in WHITESPACE:
            raise MalformedRequest(f"whitespace around the value of {name!r}")
        if name[:1] == b":":
            if fields or cookies:
                raise MalformedRequest(f"pseudo-header {name!r} after a regular field")
            if name not in _PSEUDO:
                raise MalformedRequest(f"pseudo-header {name!r} not allowed in a request")
            if name in pseudo:
                raise MalformedRequest(f"pseudo-header {name!r} repeated")
            pseudo[name] = value
        elif name == b"cookie":
            cookies.append(value)
        else:
            if name in CONNECTION_SPECIFIC:
                raise MalformedRequest(f"connection-specific field {name!r}")
            if name == b"te" and value.lower() != b"trailers":
                raise MalformedRequest("TE other than trailers")
            if name == b"host":
                if host is not None:
                    raise MalformedRequest("more than one Host field")
                host = value
            elif name == b"content-length":
                # differing lengths cannot both frame the body (RFC 9110 §8.6)
                if length is not None and value != length:
                    raise MalformedRequest("Content-Length fields differ")
                length = value
            fields.append((name, value))
    if fields and not FIELD_NAMES.fullmatch(b",".join([n for n, _ in fields])):
        raise MalformedRequest("a field name is not a lower-case token")
    values = [v for _, v in fields]
    values += pseudo.values()
    values += cookies
    if CONTROL.search(b"\t".join(values)):
        raise MalformedRequest("a control character in a field value")
    crumbs = [c for c in cookies if c]  # an empty one would leave a dangling "; "
    if crumbs:
        fields.append((b"cookie", b"; ".join(crumbs)))
    _check_pseudo(pseudo, host)
    return pseudo, fields


def _check_pseudo(pseudo: dict[bytes, bytes], host: bytes | None) -> None:
    method = pseudo.get(b":method")
    if method is None:
        raise MalformedRequest("no :method")
    if not _METHOD.fullmatch(method):
        raise MalformedRequest(":method is not a token")
    if b":protocol" in pseudo:
        # it would reach the node as an HTTP/1.1 CONNECT with a body no one judged
        raise MalformedRequest(":protocol, but extended CONNECT is not offered")
    if method == b"CONNECT":
        if b":scheme" in pseudo or b":path" in pseudo:
            raise MalformedRequest("CONNECT with :scheme or :path")
    elif b":scheme" not in pseudo or b":path" not in pseudo:
        raise MalformedRequest("no :scheme or no :path")
    if b":path" in pseudo and not pseudo[b":path"]:
        raise MalformedRequest("empty :path")
    authority = pseudo.get(b":authority")
    if authority is None and host is None:
        raise MalformedRequest("neither :authority nor Host")
    if authority is not None and host is not None and authority != host:
        raise MalformedRequest(":authority and Host differ")
