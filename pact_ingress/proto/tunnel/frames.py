"""Tunnel control framing (sans-I/O): messages ↔ bytes, with caps.

The reverse tunnel has two kinds of connection (theory in `net/tunnel/server.py`):
control connections, which carry only these small messages inside pinned mutual TLS,
and data connections, which carry one `DataHello`/`DataOk` exchange and then raw bytes.
A data connection is either *raw* — `RAW_DATA_MAGIC` then the DATA_HELLO frame in the
clear, the default — or, as a fallback, the same exchange inside pinned mutual TLS (then
unwrapped). Nothing here touches a socket or a clock; `FrameBudget` takes `now`.

Wire format of one frame::

    type (u8) | length (u16, big endian) | payload (length bytes, ≤ MAX_PAYLOAD)

Payloads are fixed layouts (below); a frame of a known type whose payload does not have
its exact layout, an unknown type, or an over-long length is a `FrameError` (the peer is
broken or hostile; the connection is dropped). `Decoder.next_message()` returns `None`
while a frame is incomplete, so input may arrive split at any byte offset.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum

from pact_ingress.errors import RemoteProtocolError

#: The only version spoken; a HELLO with another is refused (no downgrade games). 2 added
#: SPARE frames, which a version-1 connector would take for garbage: refused with a
#: GOAWAY that says which version is expected instead.
VERSION = 2
#: Control messages are tiny (the largest is GOAWAY with a short reason). 1 KiB leaves
#: room for growth and bounds what a peer can make us buffer per frame.
MAX_PAYLOAD = 1024
#: A decoder never holds more than this many undecoded bytes. Readers feed at most one
#: receive_some() chunk at a time and drain the decoder before the next one, so this is
#: only reached by a peer sending a flood in one burst.
MAX_BUFFERED = 64 * 1024
#: Random bytes in a data-connection token (256 bits: unguessable, see the server).
TOKEN_BYTES = 32
#: A SPARE token is void this long after the ingress sent it; connectors use theirs within
#: half of it (so clock skew between the two ends never matters) and forget older ones.
SPARE_TTL = 300.0
#: Session and instance ids: 128 random bits, for logs and correlation only.
ID_BYTES = 16
#: A GOAWAY's human-readable reason is cut to this many UTF-8 bytes.
MAX_REASON = 200
_HEADER = struct.Struct("!BH")
#: First bytes of a raw data connection. The router on :443 checks for it before it
#: parses a TLS ClientHello: a TLS record starts with 0x16, this with "P", so the two can
#: never be confused, and a few bytes decide. Versioned like the ALPN names.
RAW_DATA_MAGIC = b"PACT-TUNNEL-DATA/1\r\n"


class FrameError(RemoteProtocolError):
    """The peer sent bytes that are not a valid tunnel frame."""


class FrameType(IntEnum):
    HELLO = 1  # connector → ingress, first frame on a control connection
    WELCOME = 2  # ingress → connector, answer to HELLO
    PING = 3  # either way
    PONG = 4  # either way, echoes the PING's nonce
    TOKEN = 5  # ingress → connector: dial one data connection with this token
    GOAWAY = 6  # either way: no new streams on this connection, then close
    DATA_HELLO = 7  # connector → ingress, first frame on a data connection
    DATA_OK = 8  # ingress → connector: token accepted, both ends now unwrap TLS
    SPARE = 9  # ingress → connector: keep this token to replace a data connection once used
    WAKE = 10  # ingress → connector: mail is queued at the relay (no payload, no content)


class GoawayCode(IntEnum):
    SHUTDOWN = 0  # ingress stopping: reconnect after retry_after
    DRAINING = 1  # connector stopping: send no new streams
    UNKNOWN_KEY = 2  # the connector's key is not a pin of any tenant
    KEY_UNPINNED = 3  # after a reload the key no longer belongs to this tenant
    PROTOCOL_ERROR = 4  # the peer broke the protocol
    OVER_CAPACITY = 5  # too many tunnel connections for this tenant


#: HELLO's slot byte carries capability flags in its top bit(s). Slots are < 16 (the
#: connector's `connections` cap), and an ingress that predates a flag reads the byte for
#: logs only, so a flag costs no version bump. An ingress sends a WAKE only to a connector
#: that set CAP_WAKE: one that predates WAKE would drop the link on an unknown frame type.
CAP_WAKE = 0x80
_SLOT_MASK = 0x7F


@dataclass(frozen=True)
class Hello:
    version: int
    slot: int  # which of the connector's `connections` slots (logs only)
    instance: bytes  # random per connector process (logs: tells restarts apart)
    wake: bool = False  # the connector understands WAKE frames (CAP_WAKE)


@dataclass(frozen=True)
class Welcome:
    session: bytes
    heartbeat_ms: int  # the ingress's ping interval; the connector uses the smaller


@dataclass(frozen=True)
class Ping:
    nonce: int


@dataclass(frozen=True)
class Pong:
    nonce: int


@dataclass(frozen=True)
class Token:
    token: bytes


@dataclass(frozen=True)
class Spare:
    token: bytes


@dataclass(frozen=True)
class Goaway:
    code: GoawayCode
    retry_after_ms: int = 0
    reason: str = ""


@dataclass(frozen=True)
class DataHello:
    token: bytes


@dataclass(frozen=True)
class DataOk:
    pass


@dataclass(frozen=True)
class Wake:
    pass


Message = Hello | Welcome | Ping | Pong | Token | Spare | Goaway | DataHello | DataOk | Wake

_HELLO = struct.Struct(f"!BB{ID_BYTES}s")
_WELCOME = struct.Struct(f"!{ID_BYTES}sI")
_U64 = struct.Struct("!Q")
_GOAWAY = struct.Struct("!BI")


def encode(msg: Message) -> bytes:
    """One frame for `msg`."""
    kind, payload = _payload(msg)
    if len(payload) > MAX_PAYLOAD:  # only a GOAWAY reason could, and it is cut first
        raise ValueError("payload over MAX_PAYLOAD")
    return _HEADER.pack(kind, len(payload)) + payload


def _payload(msg: Message) -> tuple[FrameType, bytes]:
    match msg:
        case Hello(version, slot, instance, wake):
            if not 0 <= slot <= _SLOT_MASK:
                raise ValueError("slot out of range")
            flags = CAP_WAKE if wake else 0
            return FrameType.HELLO, _HELLO.pack(version, slot | flags,
                                                _exact(instance, ID_BYTES))
        case Welcome(session, heartbeat_ms):
            return FrameType.WELCOME, _WELCOME.pack(_exact(session, ID_BYTES), heartbeat_ms)
        case Ping(nonce):
            return FrameType.PING, _U64.pack(nonce)
        case Pong(nonce):
            return FrameType.PONG, _U64.pack(nonce)
        case Token(token):
            return FrameType.TOKEN, _exact(token, TOKEN_BYTES)
        case Spare(token):
            return FrameType.SPARE, _exact(token, TOKEN_BYTES)
        case Goaway(code, retry_after_ms, reason):
            text = reason.encode("utf-8")[:MAX_REASON]
            return FrameType.GOAWAY, _GOAWAY.pack(code, retry_after_ms) + text
        case DataHello(token):
            return FrameType.DATA_HELLO, _exact(token, TOKEN_BYTES)
        case DataOk():
            return FrameType.DATA_OK, b""
        case Wake():
            return FrameType.WAKE, b""
    raise TypeError(f"not a tunnel message: {msg!r}")


def raw_data_preamble(token: bytes) -> bytes:
    """What a connector sends first on a raw data connection: magic, then DATA_HELLO."""
    return RAW_DATA_MAGIC + encode(DataHello(token))


def raw_data_prefix(buf: bytes | bytearray) -> bool | None:
    """Is `buf` the start of a raw data connection? True: yes (the whole magic is there);
    None: could still be (a proper prefix of the magic); False: no."""
    head = bytes(buf[:len(RAW_DATA_MAGIC)])
    if not RAW_DATA_MAGIC.startswith(head):
        return False
    return True if len(head) == len(RAW_DATA_MAGIC) else None


def _exact(value: bytes, size: int) -> bytes:
    if len(value) != size:
        raise ValueError(f"expected {size} bytes, got {len(value)}")
    return value


def decode_payload(kind: int, payload: bytes) -> Message:
    """The message of one frame; FrameError for unknown types or wrong layouts."""
    try:
        ftype = FrameType(kind)
    except ValueError:
        raise FrameError(f"unknown frame type {kind}") from None
    try:
        return _DECODERS[ftype](payload)
    except (struct.error, ValueError) as exc:
        raise FrameError(f"bad {ftype.name} frame: {exc}") from None


def _fixed(payload: bytes, size: int) -> bytes:
    if len(payload) != size:
        raise ValueError(f"payload is {len(payload)} bytes, expected {size}")
    return payload


def _decode_goaway(payload: bytes) -> Goaway:
    code, retry = _GOAWAY.unpack_from(payload)
    reason = payload[_GOAWAY.size:]
    if len(reason) > MAX_REASON:
        raise ValueError("reason too long")
    return Goaway(GoawayCode(code), retry, reason.decode("utf-8", "replace"))


def _decode_hello(payload: bytes) -> Hello:
    version, slot, instance = _HELLO.unpack(_fixed(payload, _HELLO.size))
    return Hello(version, slot & _SLOT_MASK, instance, bool(slot & CAP_WAKE))


_DECODERS = {
    FrameType.HELLO: _decode_hello,
    FrameType.WELCOME: lambda p: Welcome(*_WELCOME.unpack(_fixed(p, _WELCOME.size))),
    FrameType.PING: lambda p: Ping(*_U64.unpack(_fixed(p, 8))),
    FrameType.PONG: lambda p: Pong(*_U64.unpack(_fixed(p, 8))),
    FrameType.TOKEN: lambda p: Token(_fixed(p, TOKEN_BYTES)),
    FrameType.SPARE: lambda p: Spare(_fixed(p, TOKEN_BYTES)),
    FrameType.GOAWAY: _decode_goaway,
    FrameType.DATA_HELLO: lambda p: DataHello(_fixed(p, TOKEN_BYTES)),
    FrameType.DATA_OK: lambda p: DataOk() if not p else _raise("DATA_OK has no payload"),
    FrameType.WAKE: lambda p: Wake() if not p else _raise("WAKE has no payload"),
}


def _raise(message: str) -> Message:
    raise ValueError(message)


class Decoder:
    """Incremental decoder: `feed(bytes)`, then `next_message()` until it returns None."""

    def __init__(self) -> None:
        self._buf = bytearray()

    @property
    def buffered(self) -> int:
        return len(self._buf)

    def feed(self, data: bytes | bytearray) -> None:
        if len(self._buf) + len(data) > MAX_BUFFERED:
            raise FrameError("too many undecoded bytes buffered")
        self._buf += data

    def next_message(self) -> Message | None:
        if len(self._buf) < _HEADER.size:
            return None
        kind, length = _HEADER.unpack_from(self._buf)
        if length > MAX_PAYLOAD:
            raise FrameError(f"frame length {length} over cap {MAX_PAYLOAD}")
        if kind not in FrameType._value2member_map_:
            raise FrameError(f"unknown frame type {kind}")  # fail before buffering more
        end = _HEADER.size + length
        if len(self._buf) < end:
            return None
        payload = bytes(self._buf[_HEADER.size:end])
        del self._buf[:end]
        return decode_payload(kind, payload)


class FrameBudget:
    """Token bucket for frames a peer may send us: `rate` per second, `burst` at once.

    Legitimate peers send a handful of frames per heartbeat interval; anything faster is
    a flood. Pure: the caller passes `now` (trio.current_time()).
    """

    def __init__(self, rate: float, burst: int, now: float) -> None:
        self.rate = rate
        self.burst = burst
        self._tokens = float(burst)
        self._at = now

    def take(self, now: float) -> bool:
        self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
        self._at = now
        if self._tokens < 1.0:
            return False
        self._tokens -= 1.0
        return True
