"""Sans-I/O ClientHello parsing: enough of a caller's first flight to route it.

Theory of operation
-------------------
The router must choose a backend from the ClientHello (SNI, ALPN) *before* any TLS is
spoken, and in passthrough mode it must not consume those bytes: it peeks, parses, and
later replays everything it read to the backend. So the parser is a pure function of "all
bytes received so far on this connection":

    parse_client_hello(data) -> ClientHello   the hello is complete (extra bytes ignored)
                             -> None          need more bytes
                             raises ClientHelloError   never going to be a valid hello

The caller appends each `receive_some()` chunk to one buffer and calls again. Each call
re-walks the buffer from the start; that is linear in the buffer, and the buffer is
bounded: at most `MAX_HANDSHAKE_RECORDS` record headers plus `MAX_CLIENT_HELLO` handshake
bytes can precede a verdict, so a client trickling one byte per segment costs at most a
few hundred header reads per wake-up, the same order as the wake-up itself.

Layers, outside in:

1. Records (RFC 8446 §5.1). Each is `type(1) version(2) length(2) fragment`. A ClientHello
   may be split over several handshake(22) records, and each record over several TCP
   segments. We collect the fragments of consecutive handshake records until the
   handshake message they carry is complete. Anything else before that point (another
   record type, a zero-length handshake record, a record over 2^14 bytes) is malformed.
   The very first bytes are checked as soon as they arrive, so an HTTP request or an
   SSLv2-style hello on the TLS port fails with `not_tls` after one byte, not a timeout.
2. The handshake header: `msg_type(1) length(3)`. `msg_type` must be client_hello(1); the
   length is checked against `MAX_CLIENT_HELLO` as soon as it is known, before the body.
3. The ClientHello body (RFC 8446 §4.1.2, RFC 5246 §7.4.1.2): version, random, session
   id, cipher suites, compression methods, extensions. Every vector length is checked
   against what remains; the body must be consumed exactly. Extensions: no duplicates
   (RFC 8446 §4.2); server_name (RFC 6066 §3) host_name entry validated and normalised;
   ALPN (RFC 7301) decoded; supported_versions kept.

Bytes after the ClientHello (a second record, early application data, or handshake
bytes coalesced into the same record) are ignored: they belong to whoever terminates TLS.

Why our own parser: no maintained sans-I/O ClientHello parser exists for Python. The
`cryptography` package has no TLS message parsers; pyOpenSSL only sees a hello inside a
live handshake. mitmproxy (read, not copied) does the same as we do: it checks the
record magic, concatenates handshake-record payloads until the 4-byte handshake header's
length is satisfied, returns None while incomplete, and then parses the message (with a
generated kaitai-struct parser). Its test suite fuzzes truncated hellos with Hypothesis,
as ours does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pact_ingress.errors import RemoteProtocolError
from pact_ingress.proto import tls_alert

# A ClientHello (handshake header + body) larger than this is refused. Real hellos are far
# smaller: ~250-600 bytes classically, ~1.9 KB with a post-quantum (X25519MLKEM768) key
# share as Chromium sends. 16 KiB leaves room for several PQ shares and long PSK tickets
# while bounding the memory a half-open connection can make us hold.
MAX_CLIENT_HELLO = 16384

# Handshake records allowed before the ClientHello is complete. TLS stacks send one
# record (two only above 2^14 bytes); censorship-circumvention tools re-fragment the hello
# into records of tens of bytes (tens to ~200 records). 256 admits those and bounds the
# per-call re-walk a byte-trickling client can cause. Empty handshake records are illegal
# (RFC 8446 §5.1), so each record advances the hello by at least one byte.
MAX_HANDSHAKE_RECORDS = 256

# RFC 8446 §5.1: a plaintext record fragment is at most 2^14 bytes.
MAX_RECORD_PAYLOAD = 16384

_CONTENT_HANDSHAKE = 22
_HANDSHAKE_CLIENT_HELLO = 1
_EXT_SERVER_NAME = 0
_EXT_ALPN = 16
_EXT_SUPPORTED_VERSIONS = 43
_SNI_HOST_NAME = 0
_MAX_HOSTNAME = 253  # DNS limit on a textual name without its trailing dot
_MAX_LABEL = 63
_HOST_CHARS = frozenset(b"abcdefghijklmnopqrstuvwxyz0123456789-_.")


class ClientHelloError(RemoteProtocolError):
    """The first bytes of a connection are not (and will never become) a usable ClientHello.

    `reason` is a short machine string for metrics and logs: `not_tls`, `not_client_hello`,
    `too_large`, `too_many_records`, `malformed`, `bad_sni`. `alert` is the TLS alert to
    answer with, or None when the peer is not speaking TLS or should just be dropped.
    """

    def __init__(self, reason: str, message: str, *, alert: int | None = None) -> None:
        super().__init__(f"{reason}: {message}", alert=alert)
        self.reason = reason


@dataclass(frozen=True)
class ClientHello:
    """What the router needs from a ClientHello.

    `sni` is the host_name, lower-cased, one trailing dot removed, or None when absent.
    `alpn` is the offered protocol list in client order (latin-1 decoded, so any byte
    string round-trips). `raw_len` is how many bytes of the connection, from its first
    byte, reach through the ClientHello's last byte (record headers included).
    """

    sni: str | None
    alpn: tuple[str, ...]
    legacy_version: int
    record_version: int
    raw_len: int
    supported_versions: tuple[int, ...] = ()
    extensions: tuple[int, ...] = ()  # extension types in the order sent


def parse_client_hello(data: bytes | bytearray) -> ClientHello | None:
    """Parse the ClientHello at the start of `data`; None if more bytes are needed."""
    found = _reassemble(data)
    if found is None:
        return None
    message, raw_len = found
    return _parse_body(message, record_version=(data[1] << 8) | data[2], raw_len=raw_len)


# --- layer 1 and 2: records and the handshake header -------------------------------------


def _check_first_bytes(data: bytes | bytearray) -> None:
    """Fail fast when the connection plainly does not start with a TLS handshake record."""
    first = data[0]
    if first != _CONTENT_HANDSHAKE:
        what = "an SSLv2-style hello" if first & 0x80 else f"first byte {first:#04x}"
        raise ClientHelloError("not_tls", f"{what}, not a TLS handshake record")
    if len(data) >= 2 and data[1] != 3:
        raise ClientHelloError("not_tls", f"record major version {data[1]}")
    if len(data) >= 3 and data[2] > 3:
        raise ClientHelloError("not_tls", f"record version 3.{data[2]}")


def _malformed(message: str, alert: int = tls_alert.DECODE_ERROR) -> ClientHelloError:
    return ClientHelloError("malformed", message, alert=alert)


def _check_record_header(data: bytes | bytearray, pos: int, length: int) -> None:
    if data[pos] != _CONTENT_HANDSHAKE:
        raise _malformed(
            f"record type {data[pos]} before the ClientHello ended", tls_alert.UNEXPECTED_MESSAGE
        )
    if data[pos + 1] != 3 or data[pos + 2] > 3:
        raise _malformed(f"record version {data[pos + 1]}.{data[pos + 2]}")
    if length == 0:
        raise _malformed("empty handshake record")
    if length > MAX_RECORD_PAYLOAD:
        raise _malformed(f"record of {length} bytes", tls_alert.RECORD_OVERFLOW)


def _handshake_length(data: bytes | bytearray, spans: Sequence[tuple[int, int]]) -> int:
    """Total length (header included) announced by the handshake header in `spans`."""
    header = _gather(data, spans, 4)
    if header[0] != _HANDSHAKE_CLIENT_HELLO:
        raise ClientHelloError(
            "not_client_hello",
            f"handshake message type {header[0]}",
            alert=tls_alert.UNEXPECTED_MESSAGE,
        )
    total = 4 + int.from_bytes(header[1:4], "big")
    if total > MAX_CLIENT_HELLO:
        raise ClientHelloError("too_large", f"ClientHello of {total} bytes")
    return total


def _gather(data: bytes | bytearray, spans: Sequence[tuple[int, int]], count: int) -> bytes:
    """The first `count` bytes of the concatenated record fragments `spans`."""
    start, end = spans[0]
    if end - start >= count:  # the common case: one record holds it all
        return bytes(data[start : start + count])
    joined = b"".join(data[s:e] for s, e in spans)
    return joined[:count]


def _reassemble(data: bytes | bytearray) -> tuple[bytes, int] | None:
    """Return (handshake message, raw_len) once the whole ClientHello has arrived."""
    n = len(data)
    if n == 0:
        return None
    _check_first_bytes(data)
    spans: list[tuple[int, int]] = []
    have = 0
    need: int | None = None
    pos = 0
    while n - pos >= 5:  # each pass consumes one record header; bounded by the record cap
        if len(spans) == MAX_HANDSHAKE_RECORDS:
            raise ClientHelloError("too_many_records", f"more than {MAX_HANDSHAKE_RECORDS}")
        length = (data[pos + 3] << 8) | data[pos + 4]
        _check_record_header(data, pos, length)
        record_end = pos + 5 + length
        spans.append((pos + 5, min(record_end, n)))
        have_before = have
        have += spans[-1][1] - (pos + 5)
        if need is None and have >= 4:
            need = _handshake_length(data, spans)
        if need is not None and have >= need:
            raw_len = pos + 5 + (need - have_before)
            return _gather(data, spans, need), raw_len
        if record_end > n:
            return None
        pos = record_end
    if pos < n and data[pos] != _CONTENT_HANDSHAKE:
        raise _malformed(
            f"record type {data[pos]} before the ClientHello ended", tls_alert.UNEXPECTED_MESSAGE
        )
    return None


# --- layer 3: the ClientHello body -------------------------------------------------------


class _Cursor:
    """Bounds-checked reads over one bytes object; every overrun is `malformed`."""

    __slots__ = ("buf", "pos", "end")

    def __init__(self, buf: bytes, pos: int = 0, end: int | None = None) -> None:
        self.buf = buf
        self.pos = pos
        self.end = len(buf) if end is None else end

    def remaining(self) -> int:
        return self.end - self.pos

    def take(self, count: int, what: str) -> bytes:
        if count > self.end - self.pos:
            raise _malformed(f"{what} overruns its container")
        chunk = self.buf[self.pos : self.pos + count]
        self.pos += count
        return chunk

    def take_all(self) -> bytes:
        return self.take(self.end - self.pos, "rest")

    def uint(self, size: int, what: str) -> int:
        return int.from_bytes(self.take(size, what), "big")

    def vector(self, len_size: int, what: str) -> _Cursor:
        """A sub-cursor over a length-prefixed vector; advances past it."""
        length = self.uint(len_size, what)
        if length > self.end - self.pos:
            raise _malformed(f"{what} overruns its container")
        sub = _Cursor(self.buf, self.pos, self.pos + length)
        self.pos += length
        return sub


def _parse_body(message: bytes, *, record_version: int, raw_len: int) -> ClientHello:
    body = _Cursor(message, 4)
    legacy_version = body.uint(2, "legacy_version")
    if legacy_version >> 8 != 3:
        raise _malformed(f"legacy_version {legacy_version:#06x}", tls_alert.PROTOCOL_VERSION)
    body.take(32, "random")
    if body.vector(1, "session_id").remaining() > 32:
        raise _malformed("session_id longer than 32 bytes", tls_alert.ILLEGAL_PARAMETER)
    suites = body.vector(2, "cipher_suites").remaining()
    if suites == 0 or suites % 2:
        raise _malformed(f"cipher_suites of {suites} bytes")
    if body.vector(1, "compression_methods").remaining() == 0:
        raise _malformed("no compression methods")
    extensions = _split_extensions(body) if body.remaining() else {}
    if body.remaining():
        raise _malformed(f"{body.remaining()} bytes after the extensions")
    return ClientHello(
        sni=_server_name(extensions.get(_EXT_SERVER_NAME)),
        alpn=_alpn(extensions.get(_EXT_ALPN)),
        legacy_version=legacy_version,
        record_version=record_version,
        raw_len=raw_len,
        supported_versions=_supported_versions(extensions.get(_EXT_SUPPORTED_VERSIONS)),
        extensions=tuple(extensions),
    )


def _split_extensions(body: _Cursor) -> dict[int, _Cursor]:
    """Map extension type → cursor over its data, in the order sent (dicts keep order)."""
    block = body.vector(2, "extensions")
    found: dict[int, _Cursor] = {}
    while block.remaining():  # each pass consumes ≥ 4 bytes of a bounded block
        ext_type = block.uint(2, "extension type")
        ext_data = block.vector(2, f"extension {ext_type}")
        if ext_type in found:
            raise _malformed(f"extension {ext_type} sent twice", tls_alert.ILLEGAL_PARAMETER)
        found[ext_type] = ext_data
    return found


def _server_name(ext: _Cursor | None) -> str | None:
    if ext is None:
        return None
    names = ext.vector(2, "server_name_list")
    if ext.remaining() or not names.remaining():
        raise _malformed("server_name extension framing")
    host: bytes | None = None
    while names.remaining():  # each pass consumes ≥ 3 bytes
        name_type = names.uint(1, "name_type")
        name = names.vector(2, "host_name").take_all()
        if name_type != _SNI_HOST_NAME:
            continue  # RFC 6066 leaves room for other types; none exist, ignore them
        if host is not None:
            raise _malformed("two host_name entries", tls_alert.ILLEGAL_PARAMETER)
        host = name
    return None if host is None else normalize_hostname(host)


def _alpn(ext: _Cursor | None) -> tuple[str, ...]:
    if ext is None:
        return ()
    names = ext.vector(2, "protocol_name_list")
    if ext.remaining() or not names.remaining():
        raise _malformed("ALPN extension framing")
    protocols: list[str] = []
    while names.remaining():  # each pass consumes ≥ 2 bytes
        name = names.vector(1, "protocol name").take_all()
        if not name:
            raise _malformed("empty ALPN protocol name")
        protocols.append(name.decode("latin-1"))
    return tuple(protocols)


def _supported_versions(ext: _Cursor | None) -> tuple[int, ...]:
    if ext is None:
        return ()
    versions = ext.vector(1, "supported_versions")
    if ext.remaining() or versions.remaining() < 2 or versions.remaining() % 2:
        raise _malformed("supported_versions extension framing")
    raw = versions.take_all()
    return tuple(int.from_bytes(raw[i : i + 2], "big") for i in range(0, len(raw), 2))


def normalize_hostname(raw: bytes) -> str:
    """Validate an SNI host_name and return it lower-cased without its trailing dot.

    Accepts ASCII letters, digits, '-', '_' and dots; IDNs arrive as A-labels ("xn--"),
    so they pass. Labels are 1-63 bytes, the whole name ≤ 253. Raises `bad_sni` otherwise.
    """
    if raw.endswith(b"."):
        raw = raw[:-1]
    name = raw.lower()
    bad = not name or len(name) > _MAX_HOSTNAME or not _HOST_CHARS.issuperset(name)
    if bad or any(not 0 < len(label) <= _MAX_LABEL for label in name.split(b".")):
        shown = raw[:80].decode("ascii", "backslashreplace")
        raise ClientHelloError("bad_sni", f"invalid host_name {shown!r}",
                               alert=tls_alert.ILLEGAL_PARAMETER)
    return name.decode("ascii")
