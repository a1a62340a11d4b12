"""The HTTP/2 client leg attacked frame by frame, through a real `serve` over TLS.

A hostile client and a protocol lawyer (RFC 9113, RFC 7541) against the terminate edge:
frames in the wrong place, windows pushed past their bounds, header blocks that cannot
be decoded, requests that are malformed in HTTP/2's terms, and resets the edge is made to
send. Every test asserts invariants: the connection or stream error the RFC names,
nothing reaching the node that should not (and bodies that should arrive whole), the
edge's counters back to the truth, and another client still served.

The client here is a bare frame writer (`Raw`): it sends exactly the bytes a test
builds, with an HPACK encoder for header blocks, and parses the frames the edge sends
back without judging them.
"""

from __future__ import annotations

import hashlib
import json
import select
import shutil
import signal
import socket
import ssl
import struct
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import hpack
import httpx
import pytest

from tests.terminate_env import (
    ATTACKER_IP,
    BYSTANDER_IP,
    HOST,
    LOOPBACK,
    WAIT,
    tarpit_route,
    tls_socket,
)
from tests.terminate_env import (
    ServeEnv as Env,
)

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, \
    CONTINUATION = range(10)
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20
# error codes (RFC 9113 §7)
NO_ERROR, PROTOCOL_ERROR, FLOW_CONTROL_ERROR, STREAM_CLOSED, FRAME_SIZE_ERROR, \
    REFUSED_STREAM, CANCEL, COMPRESSION_ERROR, ENHANCE_YOUR_CALM = 0, 1, 3, 5, 6, 7, 8, 9, 11

#: The receive windows the edge grants (README): 65,535 bytes per stream, and for the
#: connection 100 streams' worth, raised from 65,535 by one WINDOW_UPDATE at the start.
STREAM_WINDOW = 65_535
CONNECTION_WINDOW = 100 * STREAM_WINDOW


def frame(kind: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I B I", len(payload) << 8 | kind, flags, sid) + payload


def u32(n: int) -> bytes:
    return struct.pack(">I", n)


def settings(*pairs: tuple[int, int]) -> bytes:
    return frame(SETTINGS, 0, 0, b"".join(struct.pack(">HI", k, v) for k, v in pairs))


class Raw:
    """One TLS connection speaking frames exactly as the test writes them."""

    def __init__(self, env: Env | None, *, source: str = ATTACKER_IP, host: str = HOST,
                 first: bytes | None = None, rcvbuf: int | None = None,
                 sock: ssl.SSLSocket | None = None) -> None:
        """To `env`'s edge, or over `sock` (a TLS socket already connected elsewhere)."""
        self.host = host
        if sock is None:
            assert env is not None
            sock = tls_socket(env.serve.port, host, source=source, alpn=("h2",),
                              rcvbuf=rcvbuf)
        self.sock = sock
        assert self.sock.selected_alpn_protocol() == "h2"
        self.enc = hpack.Encoder()
        self.dec = hpack.Decoder()
        self.buf = b""
        self.frames: list[tuple[int, int, int, bytes]] = []
        self.eof = False
        self.unacked: dict[int, int] = {}  # DATA bytes not yet given back, per stream and 0
        self.send(PREFACE + (settings() if first is None else first))

    def send(self, *data: bytes) -> None:
        try:
            self.sock.sendall(b"".join(data))
        except TimeoutError:
            self.eof = True  # the edge does not read
        except OSError:
            self.take_rest()

    def take_rest(self) -> None:
        """A send failed: the edge closed first (a reset, once it has dropped what we
        sent for long enough). What it sent before is still in our kernel, which a reset
        does not take back: read it, then call the connection ended."""
        deadline = time.monotonic() + 5
        for _ in range(4096):  # bounded; a reset connection answers each read at once
            before = (len(self.frames), len(self.buf))
            if (time.monotonic() > deadline or not self.read(0.5)
                    or (len(self.frames), len(self.buf)) == before):
                break
        self.eof = True

    def block(self, path: str = "/ok", method: str = "GET",
              extra: list[tuple[bytes, bytes]] | None = None, *,
              pseudo: list[tuple[bytes, bytes]] | None = None) -> bytes:
        fields = pseudo if pseudo is not None else [
            (b":method", method.encode()), (b":scheme", b"https"),
            (b":authority", self.host.encode()), (b":path", path.encode())]
        return self.enc.encode(fields + (extra or []))

    def headers(self, sid: int, path: str = "/ok", *, end: bool = True, method: str = "GET",
                extra: list[tuple[bytes, bytes]] | None = None) -> bytes:
        flags = END_HEADERS | (END_STREAM if end else 0)
        return frame(HEADERS, flags, sid, self.block(path, method, extra))

    def post(self, sid: int, body: bytes, path: str = "/mcp",
             ctype: bytes = b"application/json", length: int | None = None) -> bytes:
        """HEADERS + DATA of one POST (one DATA frame per 16 KiB), for one write."""
        extra = [(b"content-type", ctype), (b"accept", b"application/json, text/event-stream"),
                 (b"content-length", str(len(body) if length is None else length).encode())]
        out = [frame(HEADERS, END_HEADERS | (0 if body else END_STREAM), sid,
                     self.block(path, "POST", extra))]
        for i in range(0, len(body), 16384):
            piece = body[i:i + 16384]
            out.append(frame(DATA, END_STREAM if i + 16384 >= len(body) else 0, sid, piece))
        return b"".join(out)

    def read(self, timeout: float = WAIT) -> bool:
        """One read; False at the end of the connection."""
        if self.eof:
            return False
        self.sock.settimeout(timeout)
        try:
            data = self.sock.recv(65536)
        except TimeoutError:
            return True
        except OSError:
            data = b""
        if not data:
            self.eof = True
            return False
        self.buf += data
        self._parse()
        return True

    def _parse(self) -> None:
        """The whole frames in `buf`, onto `frames`."""
        while len(self.buf) >= 9:
            head, flags, sid = struct.unpack_from(">I B I", self.buf)
            length = head >> 8
            if len(self.buf) < 9 + length:
                break
            payload = self.buf[9:9 + length]
            self.buf = self.buf[9 + length:]
            self.frames.append((head & 0xFF, flags, sid & 0x7FFFFFFF, payload))
            if head & 0xFF == DATA and length:  # keep the answers coming, as h2 does:
                self._consumed(0, length)  # a WINDOW_UPDATE per half window consumed
                self._consumed(sid & 0x7FFFFFFF, length)

    def _consumed(self, sid: int, length: int) -> None:
        self.unacked[sid] = self.unacked.get(sid, 0) + length
        if self.unacked[sid] >= 32768:
            self.send(frame(WINDOW_UPDATE, 0, sid, u32(self.unacked.pop(sid))))

    def until(self, done: Callable[[], bool], timeout: float = WAIT) -> bool:
        deadline = time.monotonic() + timeout
        while not done() and time.monotonic() < deadline:
            if not self.read(max(0.05, deadline - time.monotonic())):
                break
        return done()

    def goaway(self, timeout: float = WAIT) -> int | None:
        """The error code of the GOAWAY the edge sent (waiting for it), or None."""
        self.until(lambda: any(f[0] == GOAWAY for f in self.frames), timeout)
        codes = [struct.unpack(">II", f[3][:8])[1] for f in self.frames if f[0] == GOAWAY]
        return codes[0] if codes else None

    def resets(self, sid: int) -> list[int]:
        return [struct.unpack(">I", f[3])[0] for f in self.frames
                if f[0] == RST_STREAM and f[2] == sid]

    def reset(self, sid: int, timeout: float = WAIT) -> int | None:
        self.until(lambda: bool(self.resets(sid)) or self.ended(sid), timeout)
        codes = self.resets(sid)
        return codes[0] if codes else None

    def ended(self, sid: int) -> bool:
        return any(f[2] == sid and f[0] in (DATA, HEADERS) and f[1] & END_STREAM
                   for f in self.frames)

    def answer(self, sid: int, timeout: float = WAIT) -> tuple[int | None, bytes]:
        """(:status, body) of stream `sid`, once it ended (None: no answer)."""
        self.until(lambda: self.ended(sid) or bool(self.resets(sid)), timeout)
        status = None
        body = b""
        for kind, _flags, fsid, payload in self.frames:
            if fsid != sid:
                continue
            if kind == HEADERS and status is None:
                status = int(dict(self.dec.decode(payload, raw=True))[b":status"])
            elif kind == DATA:
                body += payload
        return status, body

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


# === the rig ===========================================================================

#: Budgets far above what these tests send: what is tested is the HTTP/2 leg, not the
#: rate limiter (which would answer 429 long before most floods here got going).
LIMITS = {"calls_per_hour_per_ip_key": 10**6, "calls_per_hour_per_ip": 10**6,
          "max_requests_in_flight_per_ip": 300}


#: A terminate route whose node accepts no connection: the edge's handshake with it
#: waits in the listener's backlog, so a request there never has its body taken.
TARPIT_HOST = "tarpit.attack.test"

#: A terminate route to the same node with a short write deadline of its own (the
#: route's `client_write_timeout`): a client that stalls there is dropped in seconds, not
#: after the default 30 s. Long enough that what a stall test does while the client
#: stalls (serving others, about a second) is done well before it.
STALL_HOST = "stall.attack.test"
STALL_WRITE_TIMEOUT = 10


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    with socket.create_server((LOOPBACK, 0), backlog=64) as tarpit:
        route = tarpit_route(TARPIT_HOST, tarpit.getsockname()[1])
        env = Env.start(tmp_path_factory.mktemp("h2attacks"), limits=LIMITS,
                        extra_routes=route,
                        node_routes=((STALL_HOST,
                                      f"{{client_write_timeout: {STALL_WRITE_TIMEOUT}s}}"),))
        env.tarpit = tarpit  # type: ignore[attr-defined]
        yield env
        env.stop()


@pytest.fixture
def env(shared: Env) -> Iterator[Env]:
    env = shared.fresh()
    yield env
    # after every attack: another client is served, and no connection is left counted
    assert _bystander(env) == 200
    assert env.serve.wait_open_connections(0) == 0


def _bystander(env: Env) -> int | None:
    c = Raw(env, source=BYSTANDER_IP)
    try:
        c.send(c.headers(1, "/bystander"))
        return c.answer(1)[0]
    finally:
        c.close()


def _complete(env: Env, target: str) -> list[bytes]:
    """Bodies of the complete requests the node got for `target`."""
    return [r.body for r in env.node.requests() if r.target == target and r.complete]


def _reached(env: Env, marker: str) -> int:
    return len([r for r in env.node.requests() if marker in r.target])


def _digest(body: bytes) -> dict[str, object]:
    return {"bytes": len(body), "sha256": hashlib.sha256(body).hexdigest()}


def _served_after(c: Raw, sid: int, path: str = "/after") -> None:
    """The connection still serves: a GET on stream `sid` is answered 200."""
    c.send(c.headers(sid, path))
    assert c.answer(sid)[0] == 200, c.frames[-5:]


def _open_upload(c: Raw, sid: int, path: str = "/held", length: int | None = 10) -> bytes:
    """HEADERS of a POST whose body is still to come: the stream stays open. Without
    `length`, the body's end is END_STREAM alone."""
    extra = [(b"content-type", b"application/octet-stream")]
    if length is not None:
        extra.append((b"content-length", str(length).encode()))
    return frame(HEADERS, END_HEADERS, sid, c.block(path, "POST", extra))


# === resets the client makes the edge send are metered like its own ===================


def _provoke(kind: str) -> Callable[[Raw], None]:
    def wu0(c: Raw) -> None:  # WINDOW_UPDATE of 0 on an open stream: a stream error
        c.send(*(_open_upload(c, sid, "/provoked") + frame(WINDOW_UPDATE, 0, sid, u32(0))
                 for sid in range(1, 1200, 2)))

    def malformed(c: Raw) -> None:  # an upper-case field name: a malformed request
        c.send(*(c.headers(sid, "/provoked", extra=[(b"X-Upper", b"1")])
                 for sid in range(1, 1200, 2)))

    def length(c: Raw) -> None:  # more DATA than Content-Length
        c.send(*(c.post(sid, b"123456", "/provoked", b"application/octet-stream", length=5)
                 for sid in range(1, 1200, 2)))

    def refused(c: Raw) -> None:  # streams beyond SETTINGS_MAX_CONCURRENT_STREAMS
        c.send(*(_open_upload(c, sid, "/held") for sid in range(1, 201, 2)))
        c.send(*(c.headers(sid, "/provoked") for sid in range(201, 2400, 2)))

    return {"wu0": wu0, "malformed": malformed, "length": length, "refused": refused}[kind]


@pytest.mark.parametrize("kind", ["wu0", "malformed", "length", "refused"])
def test_provoked_resets_end_the_connection(env: Env, kind: str) -> None:
    """'MadeYouReset': a client that makes the edge reset its streams (a frame that is a
    stream error, a malformed request, a stream beyond the limit) frees each stream as
    cheaply as a rapid reset; the reset meter must see those too (GOAWAY
    ENHANCE_YOUR_CALM), not only the RST_STREAMs the client sends itself."""
    c = Raw(env)
    try:
        _provoke(kind)(c)
        assert c.goaway() == ENHANCE_YOUR_CALM, (kind, len(c.frames))
        assert c.until(lambda: c.eof), "the edge did not close the connection"
    finally:
        c.close()
    assert 'kind="reset"' in env.serve.metrics()
    assert _complete(env, "/provoked") == []


# === requests HTTP/2 calls malformed: a stream error, nothing reaches the node ========

_BASE = [(b":method", b"GET"), (b":scheme", b"https"), (b":authority", HOST.encode()),
         (b":path", b"/malformed")]

MALFORMED = {
    "method with spaces": [(b":method", b"GET /x HTTP/1.1 z"), *_BASE[1:]],
    "method with a slash": [(b":method", b"GET/"), *_BASE[1:]],
    "empty method": [(b":method", b""), *_BASE[1:]],
    "pseudo after regular": [*_BASE[:3], (b"accept", b"*/*"), _BASE[3]],
    "duplicate path": [*_BASE, (b":path", b"/other")],
    "response pseudo": [*_BASE, (b":status", b"200")],
    "unknown pseudo": [*_BASE, (b":evil", b"1")],
    "no authority nor host": [*_BASE[:2], _BASE[3]],
    "authority and host differ": [*_BASE, (b"host", b"other.test")],
    "two hosts": [*_BASE[:2], _BASE[3], (b"host", HOST.encode()), (b"host", HOST.encode())],
    "upper-case name": [*_BASE, (b"Accept", b"*/*")],
    "connection": [*_BASE, (b"connection", b"close")],
    "keep-alive": [*_BASE, (b"keep-alive", b"timeout=5")],
    "transfer-encoding": [*_BASE, (b"transfer-encoding", b"chunked")],
    "upgrade": [*_BASE, (b"upgrade", b"h2c")],
    "te gzip": [*_BASE, (b"te", b"gzip")],
    "empty path": [*_BASE[:3], (b":path", b"")],
    "no path": _BASE[:3],
    "no scheme": [_BASE[0], *_BASE[2:]],
    "connect with path": [(b":method", b"CONNECT"), *_BASE[1:]],
    "protocol without connect": [*_BASE, (b":protocol", b"websocket")],
    "newline in a value": [*_BASE, (b"x-a", b"1\r\nx-b: 2")],
    "nul in a value": [*_BASE, (b"x-a", b"1\x002")],
    "space around a value": [*_BASE, (b"x-a", b" 1")],
    "colon in a name": [*_BASE, (b"x:a", b"1")],
    "content-length not digits": [*_BASE, (b"content-length", b"+0")],
    "content-lengths differ": [*_BASE, (b"content-length", b"0"), (b"content-length", b"5")],
    "no method": _BASE[1:],
    "extended connect": [(b":method", b"CONNECT"), *_BASE[1:], (b":protocol", b"websocket")],
    "control byte in a value": [*_BASE, (b"x-a", b"1\x012")],
    "tab after a value": [*_BASE, (b"x-a", b"1\t")],
    "non-token name": [*_BASE, (b"x(a)", b"1")],
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_request_is_reset(env: Env, case: str) -> None:
    c = Raw(env)
    try:
        c.send(frame(HEADERS, END_HEADERS | END_STREAM, 1, c.block(pseudo=MALFORMED[case])))
        assert c.reset(1) == PROTOCOL_ERROR, (case, c.frames)
        _served_after(c, 3)  # a stream error: the connection goes on
    finally:
        c.close()
    assert _reached(env, "/malformed") == 0, case


def test_trailers_with_a_pseudo_header_are_reset(env: Env) -> None:
    """Trailers may carry no pseudo-header (RFC 9113 §8.1): the stream is reset, and no
    complete request reaches the node (no Content-Length: only the end of the stream
    completes the body)."""
    c = Raw(env)
    try:
        c.send(_open_upload(c, 1, "/trailers", None), frame(DATA, 0, 1, b"hello"),
               frame(HEADERS, END_HEADERS | END_STREAM, 1, c.enc.encode([(b":path", b"/x")])))
        assert c.reset(1) == PROTOCOL_ERROR
        # trailers without END_STREAM are malformed too
        c.send(_open_upload(c, 3, "/trailers", None), frame(DATA, 0, 3, b"hello"),
               frame(HEADERS, END_HEADERS, 3, c.enc.encode([(b"x-t", b"1")])))
        assert c.reset(3) == PROTOCOL_ERROR
        # and well-formed trailers end the request, whose body arrives whole
        c.send(_open_upload(c, 5, "/trailers-ok", None), frame(DATA, 0, 5, b"hello"),
               frame(HEADERS, END_HEADERS | END_STREAM, 5, c.enc.encode([(b"x-t", b"1")])))
        status, body = c.answer(5)
        assert status == 200 and json.loads(body)["bytes"] == 5, body
    finally:
        c.close()
    assert _complete(env, "/trailers") == []
    assert _complete(env, "/trailers-ok") == [b"hello"]


@pytest.mark.parametrize("sent", [b"1234", b"123456"])
def test_content_length_against_data(env: Env, sent: bytes) -> None:
    """DATA short of, or beyond, Content-Length: a stream error (RFC 9113 §8.1.1); the
    node never gets a complete request with the wrong body."""
    c = Raw(env)
    try:
        c.send(c.post(1, sent, "/length", b"application/octet-stream", length=5))
        assert c.reset(1) == PROTOCOL_ERROR, c.frames
        _served_after(c, 3)
    finally:
        c.close()
    assert _complete(env, "/length") == []


# === connection errors: GOAWAY with the code RFC 9113 names, nothing at the node ======

def _hpack_int(value: int, prefix: int, first: int) -> bytes:
    """An HPACK integer (RFC 7541 §5.1) with `prefix` bits in the first byte."""
    top = (1 << prefix) - 1
    if value < top:
        return bytes([first | value])
    out = [first | top]
    value -= top
    while value >= 128:
        out.append(value % 128 | 128)
        value //= 128
    return bytes([*out, value])


def _req(c: Raw, sid: int = 1, flags: int = END_HEADERS | END_STREAM) -> bytes:
    return frame(HEADERS, flags, sid, c.block("/conn-err"))


#: name -> (the frames after the preface and SETTINGS, the GOAWAY error code)
CONNECTION_ERRORS: dict[str, tuple[Callable[[Raw], bytes], int]] = {
    # header blocks cut by another frame (RFC 9113 §6.10)
    "headers then data": (lambda c: frame(HEADERS, 0, 1, c.block("/conn-err"))
                          + frame(DATA, END_STREAM, 1, b"x"), PROTOCOL_ERROR),
    "headers then ping": (lambda c: frame(HEADERS, END_STREAM, 1, c.block("/conn-err"))
                          + frame(PING, 0, 0, bytes(8)), PROTOCOL_ERROR),
    "headers then headers": (lambda c: frame(HEADERS, END_STREAM, 1, c.block("/conn-err"))
                             + _req(c, 3), PROTOCOL_ERROR),
    "continuation of another stream": (
        lambda c: frame(HEADERS, END_STREAM, 1, c.block("/conn-err"))
        + frame(CONTINUATION, END_HEADERS, 3, b""), PROTOCOL_ERROR),
    "continuation alone": (lambda c: frame(CONTINUATION, END_HEADERS, 1, c.block("/conn-err")),
                           PROTOCOL_ERROR),
    "continuation after a complete block": (
        lambda c: _req(c, 1, END_HEADERS) + frame(CONTINUATION, END_HEADERS, 1, b""),
        PROTOCOL_ERROR),
    "empty continuation flood": (
        lambda c: frame(HEADERS, END_STREAM, 1, c.block("/conn-err"))
        + frame(CONTINUATION, 0, 1, b"") * 1000, ENHANCE_YOUR_CALM),
    "continuation block past 64 KiB": (
        lambda c: frame(HEADERS, END_STREAM, 1, c.block("/conn-err"))
        + frame(CONTINUATION, 0, 1, b"\x82" * 16384) * 5, ENHANCE_YOUR_CALM),
    # stream ids (RFC 9113 §5.1, §5.1.1)
    "headers on stream 0": (lambda c: _req(c, 0), PROTOCOL_ERROR),
    "headers on an even stream": (lambda c: _req(c, 2), PROTOCOL_ERROR),
    "data on an idle stream": (lambda c: frame(DATA, END_STREAM, 1, b"x"), PROTOCOL_ERROR),
    "data on stream 0": (lambda c: frame(DATA, 0, 0, b"x"), PROTOCOL_ERROR),
    "rst_stream on an idle stream": (lambda c: frame(RST_STREAM, 0, 1, u32(8)),
                                     PROTOCOL_ERROR),
    "rst_stream on stream 0": (lambda c: frame(RST_STREAM, 0, 0, u32(8)), PROTOCOL_ERROR),
    "window_update on an idle stream": (lambda c: frame(WINDOW_UPDATE, 0, 1, u32(1)),
                                        PROTOCOL_ERROR),
    "push_promise from a client": (lambda c: frame(PUSH_PROMISE, END_HEADERS, 1,
                                                   u32(2) + c.block()), PROTOCOL_ERROR),
    "priority on stream 0": (lambda c: frame(PRIORITY, 0, 0, u32(1) + b"\x10"),
                             PROTOCOL_ERROR),
    # fixed frame sizes (RFC 9113 §6)
    "priority of 4 bytes": (lambda c: frame(PRIORITY, 0, 1, u32(3)), FRAME_SIZE_ERROR),
    "rst_stream of 5 bytes": (lambda c: _req(c, 1, END_HEADERS)
                              + frame(RST_STREAM, 0, 1, u32(8) + b"\0"), FRAME_SIZE_ERROR),
    "ping of 7 bytes": (lambda c: frame(PING, 0, 0, bytes(7)), FRAME_SIZE_ERROR),
    "ping on a stream": (lambda c: frame(PING, 0, 1, bytes(8)), PROTOCOL_ERROR),
    "window_update of 3 bytes": (lambda c: frame(WINDOW_UPDATE, 0, 0, b"\0\0\1"),
                                 FRAME_SIZE_ERROR),
    "settings of 5 bytes": (lambda c: frame(SETTINGS, 0, 0, bytes(5)), FRAME_SIZE_ERROR),
    "settings ack with a payload": (lambda c: frame(SETTINGS, ACK, 0, bytes(6)),
                                    FRAME_SIZE_ERROR),
    "settings on a stream": (lambda c: frame(SETTINGS, 0, 1), PROTOCOL_ERROR),
    "goaway on a stream": (lambda c: frame(GOAWAY, 0, 1, bytes(8)), PROTOCOL_ERROR),
    "frame over max frame size": (lambda c: _req(c, 1, END_HEADERS)
                                  + frame(DATA, END_STREAM, 1, bytes(16385)),
                                  FRAME_SIZE_ERROR),
    # SETTINGS values (RFC 9113 §6.5.2)
    "enable_push 2": (lambda c: settings((2, 2)), PROTOCOL_ERROR),
    "max_frame_size below 16384": (lambda c: settings((5, 16383)), PROTOCOL_ERROR),
    "max_frame_size 2^24": (lambda c: settings((5, 2**24)), PROTOCOL_ERROR),
    "initial_window_size 2^31": (lambda c: settings((4, 2**31)), FLOW_CONTROL_ERROR),
    "initial_window_size overflows an open stream": (
        lambda c: _open_upload(c, 1, "/conn-err") + frame(WINDOW_UPDATE, 0, 1, u32(2**31 - 65536))
        + settings((4, 65536)), FLOW_CONTROL_ERROR),
    # flow control (RFC 9113 §6.9)
    "window_update 0 on the connection": (lambda c: frame(WINDOW_UPDATE, 0, 0, u32(0)),
                                          PROTOCOL_ERROR),
    "connection window past 2^31-1": (lambda c: frame(WINDOW_UPDATE, 0, 0, u32(2**31 - 65535)),
                                      FLOW_CONTROL_ERROR),
    # padding (RFC 9113 §6.1, §6.2)
    "data padding as long as the frame": (
        lambda c: _open_upload(c, 1, "/conn-err") + frame(DATA, PADDED, 1, b"\x05abcd"),
        PROTOCOL_ERROR),
    "data padded with no pad length": (
        lambda c: _open_upload(c, 1, "/conn-err") + frame(DATA, PADDED, 1, b""),
        PROTOCOL_ERROR),
    "headers padding longer than the frame": (
        lambda c: frame(HEADERS, END_HEADERS | END_STREAM | PADDED, 1,
                        b"\xff" + c.block("/conn-err")), PROTOCOL_ERROR),
    "headers priority field cut short": (
        lambda c: frame(HEADERS, END_HEADERS | END_STREAM | PRIORITY_FLAG, 1, b"\0\0"),
        FRAME_SIZE_ERROR),
    # HPACK (RFC 7541)
    "table size update above the setting": (
        lambda c: frame(HEADERS, END_HEADERS | END_STREAM, 1,
                        _hpack_int(4097, 5, 0x20) + c.block("/conn-err")), COMPRESSION_ERROR),
    "table size update after a field": (
        lambda c: frame(HEADERS, END_HEADERS | END_STREAM, 1,
                        c.block("/conn-err") + _hpack_int(0, 5, 0x20)), COMPRESSION_ERROR),
    "index 0": (lambda c: frame(HEADERS, END_HEADERS | END_STREAM, 1, b"\x80"),
                COMPRESSION_ERROR),
    "index beyond the tables": (lambda c: frame(HEADERS, END_HEADERS | END_STREAM, 1,
                                                _hpack_int(5000, 7, 0x80)), COMPRESSION_ERROR),
    "literal longer than the block": (
        lambda c: frame(HEADERS, END_HEADERS | END_STREAM, 1,
                        b"\x00" + _hpack_int(2**32, 7, 0) + b"a"), COMPRESSION_ERROR),
    "integer of 200 continuation bytes": (
        lambda c: frame(HEADERS, END_HEADERS | END_STREAM, 1, b"\xff" + b"\xff" * 200 + b"\x01"),
        COMPRESSION_ERROR),
    "huffman padding not ones": (lambda c: frame(HEADERS, END_HEADERS | END_STREAM, 1,
                                                 b"\x00\x81\x00\x01a"), COMPRESSION_ERROR),
    "huffman with EOS": (lambda c: frame(HEADERS, END_HEADERS | END_STREAM, 1,
                                         b"\x00\x84\xff\xff\xff\xff\x01a"), COMPRESSION_ERROR),
    "indexed fields past the header list size": (
        lambda c: frame(HEADERS, END_HEADERS | END_STREAM, 1, b"\x82" * 16000),
        ENHANCE_YOUR_CALM),
    # past four times the header list size (a list between is a 431 on its stream)
    "a dynamic entry repeated past the header list size": (
        lambda c: frame(HEADERS, END_HEADERS | END_STREAM, 1,
                        hpack.Encoder().encode([(b"x-big", b"v" * 4000)]) + b"\xbe" * 20),
        ENHANCE_YOUR_CALM),
}


@pytest.mark.parametrize("case", sorted(CONNECTION_ERRORS))
def test_connection_error(env: Env, case: str) -> None:
    build, code = CONNECTION_ERRORS[case]
    c = Raw(env)
    try:
        c.send(build(c))
        assert c.goaway() == code, (case, c.frames[-3:])
        assert c.until(lambda: c.eof), "the edge did not close the connection"
    finally:
        c.close()
    assert _complete(env, "/conn-err") == [], case


def test_data_past_the_stream_window(env: Env) -> None:
    """DATA beyond the stream window the edge granted is a connection error, though the
    connection window has room for it. The edge grants more as the node takes the body,
    so the upload goes to a route whose node never finishes its handshake: nothing is
    taken, the stream's window stays the first 65,535 bytes."""
    c = Raw(env, host=TARPIT_HOST)
    try:
        c.send(_open_upload(c, 1, "/conn-err", None))
        # the edge is connecting to that node (its connection waits in the backlog)
        assert select.select([env.tarpit], [], [], WAIT)[0], "the edge never connected"
        c.send(*(frame(DATA, 0, 1, bytes(16384)) for _ in range(3)),
               frame(DATA, 0, 1, bytes(16383)))  # the whole window, then one byte more
        c.send(frame(DATA, 0, 1, b"x"))
        assert c.goaway() == FLOW_CONTROL_ERROR, c.frames[-3:]
        # nothing given back: the one WINDOW_UPDATE is the connection's, at the start
        updates = [(f[2], int.from_bytes(f[3], "big")) for f in c.frames
                   if f[0] == WINDOW_UPDATE]
        assert updates == [(0, CONNECTION_WINDOW - STREAM_WINDOW)], updates
        assert c.until(lambda: c.eof), "the edge did not close the connection"
    finally:
        c.close()


def test_not_a_preface(env: Env) -> None:
    """HTTP/1.1 on a connection that chose h2, or a preface one byte wrong: the edge
    closes the connection (its preface and a GOAWAY first, if anything), and nothing
    reaches the node."""
    for first in (b"GET /conn-err HTTP/1.1\r\nHost: x\r\n\r\n",
                  PREFACE[:-1] + b"\r" + settings()):
        sock = tls_socket(env.serve.port, HOST, source=ATTACKER_IP, alpn=("h2",))
        got, closed = b"", False
        try:
            sock.sendall(first)
            deadline = time.monotonic() + WAIT
            while time.monotonic() < deadline:
                chunk = sock.recv(65536)
                if not chunk:
                    closed = True
                    break
                got += chunk
        except OSError:
            closed = True
        finally:
            sock.close()
        assert closed, first
        kinds = []
        while len(got) >= 9:
            length = int.from_bytes(got[:3], "big")
            kinds.append(got[3])
            got = got[9 + length:]
        # our preface (SETTINGS, and the WINDOW_UPDATE raising the connection window)
        # may have left before the bad bytes were read: nothing else
        assert set(kinds) <= {SETTINGS, WINDOW_UPDATE, GOAWAY}, kinds
    assert _reached(env, "/conn-err") == 0


def test_first_frame_must_be_settings(env: Env) -> None:
    c = Raw(env, first=frame(PING, 0, 0, bytes(8)))
    try:
        assert c.goaway() == PROTOCOL_ERROR
    finally:
        c.close()


# === stream errors: RST_STREAM on that stream, the connection goes on =================

#: name -> (frames on open stream 1 (a POST still waiting for its body), the reset code)
STREAM_ERRORS: dict[str, tuple[Callable[[Raw], bytes], int]] = {
    "window_update 0": (lambda c: frame(WINDOW_UPDATE, 0, 1, u32(0)), PROTOCOL_ERROR),
    "stream window past 2^31-1": (lambda c: frame(WINDOW_UPDATE, 0, 1, u32(2**31 - 65535)),
                                  FLOW_CONTROL_ERROR),
    "priority on itself": (lambda c: frame(PRIORITY, 0, 1, u32(1) + b"\x10"), PROTOCOL_ERROR),
    "data beyond content-length": (lambda c: frame(DATA, 0, 1, bytes(11)), PROTOCOL_ERROR),
    "end before content-length": (lambda c: frame(DATA, END_STREAM, 1, bytes(9)),
                                  PROTOCOL_ERROR),
    "trailers that do not end the stream": (
        lambda c: frame(HEADERS, END_HEADERS, 1, c.enc.encode([(b"x-t", b"1")])),
        PROTOCOL_ERROR),
}


@pytest.mark.parametrize("case", sorted(STREAM_ERRORS))
def test_stream_error(env: Env, case: str) -> None:
    build, code = STREAM_ERRORS[case]
    c = Raw(env)
    try:
        c.send(_open_upload(c, 1, "/stream-err", 10), build(c))
        assert c.reset(1) == code, (case, c.frames[-3:])
        _served_after(c, 3)
        # frames the client sent before it saw the reset are ignored, not an error
        c.send(frame(DATA, END_STREAM, 1, bytes(10)), frame(WINDOW_UPDATE, 0, 1, u32(1)))
        _served_after(c, 5)
    finally:
        c.close()
    assert _complete(env, "/stream-err") == [], case


def test_data_on_a_half_closed_stream(env: Env) -> None:
    """DATA after END_STREAM while the answer is still coming: STREAM_CLOSED on that
    stream (RFC 9113 §5.1), and the answer is not sent on."""
    c = Raw(env)
    try:
        c.send(c.headers(1, "/stream?n=50&interval=0.1"))
        c.until(lambda: any(f[0] == DATA and f[2] == 1 for f in c.frames))
        c.send(frame(DATA, 0, 1, b"late"))
        assert c.reset(1) == STREAM_CLOSED
        _served_after(c, 3)
    finally:
        c.close()


def test_priority_on_idle_streams_is_allowed(env: Env) -> None:
    """PRIORITY may name an idle stream, and a stream may be opened after it was named
    (RFC 9113 §5.1); neither opens a stream nor moves the stream ids on."""
    c = Raw(env)
    try:
        c.send(frame(PRIORITY, 0, 9, u32(7) + b"\x10"), frame(PRIORITY, 0, 3, u32(0) + b"\x10"),
               c.headers(3, "/prio"), c.headers(9, "/prio"))
        assert c.answer(3)[0] == 200 and c.answer(9)[0] == 200
        assert c.goaway(0.2) is None
    finally:
        c.close()


def test_unknown_settings_and_frames_are_ignored(env: Env) -> None:
    c = Raw(env, first=settings((0x99, 7), (0xFFFF, 2**32 - 1), (8, 1), (2, 0), (1, 0)))
    try:
        c.send(frame(0x21, 0xFF, 1, b"grease"), frame(0x21, 0, 0, b""))
        _served_after(c, 1)
        assert c.goaway(0.2) is None
    finally:
        c.close()


@pytest.mark.parametrize("how", ["a stream that ended", "an id the client skipped"])
def test_lower_stream_id_ends_the_connection(env: Env, how: str) -> None:
    """HEADERS opening a stream id below one already used (RFC 9113 §5.1.1): a connection
    error (PROTOCOL_ERROR), whether the id was served before or skipped; nothing of it
    reaches the node."""
    c = Raw(env)
    try:
        if how == "a stream that ended":
            _served_after(c, 1)
            _served_after(c, 5)
            c.send(c.headers(1, "/lower"))
        else:
            _served_after(c, 7)
            c.send(c.headers(3, "/lower"))
        assert c.goaway() == PROTOCOL_ERROR, c.frames[-3:]
        assert c.until(lambda: c.eof), "the edge did not close the connection"
    finally:
        c.close()
    assert _reached(env, "/lower") == 0


def test_trailers_on_a_stream_the_edge_reset_are_ignored(env: Env) -> None:
    """A client may send trailers on a stream before it sees the edge's reset of it (a
    refused stream, a stream error): they are ignored (§5.1), the connection serves on."""
    c = Raw(env)
    try:
        c.send(_open_upload(c, 1, "/reset-late", 10), frame(WINDOW_UPDATE, 0, 1, u32(0)))
        assert c.reset(1) == PROTOCOL_ERROR
        c.send(frame(HEADERS, END_HEADERS | END_STREAM, 1, c.enc.encode([(b"x-t", b"1")])))
        _served_after(c, 3)
        assert c.goaway(0.2) is None
    finally:
        c.close()
    assert _complete(env, "/reset-late") == []  # its head may have gone ahead, no body


def test_headers_depending_on_their_own_stream_are_reset(env: Env) -> None:
    """HEADERS whose priority names the stream itself (RFC 9113 §5.3.1): that stream is
    reset with PROTOCOL_ERROR, before anything reaches the node, whether the block comes
    whole or in CONTINUATION frames; the HPACK table stays in step (the next request,
    which refers to the entries those blocks added, is served)."""
    c = Raw(env)
    try:
        prio = u32(1) + b"\x10"
        block = c.block("/self-dep", extra=[(b"x-dyn", b"one")])
        c.send(frame(HEADERS, END_HEADERS | END_STREAM | PRIORITY_FLAG, 1, prio + block))
        assert c.reset(1) == PROTOCOL_ERROR, c.frames[-3:]
        prio = u32(3) + b"\x10"
        block = c.block("/self-dep", extra=[(b"x-dyn", b"two")])
        c.send(frame(HEADERS, END_STREAM | PRIORITY_FLAG, 3, prio + block[:3]),
               frame(CONTINUATION, END_HEADERS, 3, block[3:]))
        assert c.reset(3) == PROTOCOL_ERROR, c.frames[-3:]
        c.send(c.headers(5, "/self-dep-after", extra=[(b"x-dyn", b"two")]))
        assert c.answer(5)[0] == 200
        assert c.goaway(0.2) is None
    finally:
        c.close()
    assert _reached(env, "/self-dep") == 1  # only /self-dep-after


# === flow control: answers wait for the client's window, and arrive whole ============

def _data_bytes(c: Raw, sid: int) -> int:
    return sum(len(f[3]) for f in c.frames if f[0] == DATA and f[2] == sid)


def test_answer_waits_for_a_window_opened_by_settings(env: Env) -> None:
    """SETTINGS_INITIAL_WINDOW_SIZE 0: the head comes, no DATA; raising the setting
    mid-stream (RFC 9113 §6.9.2) lets the whole answer through."""
    c = Raw(env, first=settings((4, 0)))
    try:
        c.send(c.headers(1, "/big?bytes=200000"))
        assert c.until(lambda: any(f[0] == HEADERS and f[2] == 1 for f in c.frames))
        c.until(lambda: False, 0.3)
        assert _data_bytes(c, 1) == 0
        c.send(settings((4, 65535)))
        assert c.until(lambda: c.ended(1)), _data_bytes(c, 1)
        assert _data_bytes(c, 1) == 200000
    finally:
        c.close()


def test_answer_through_a_window_made_negative(env: Env) -> None:
    """The client shrinks the initial window below what is already in flight: the stream
    window goes negative, nothing is sent until WINDOW_UPDATEs (here a larger setting)
    bring it back above zero, and then the answer arrives whole."""
    c = Raw(env, first=settings((4, 1000)))
    try:
        c.send(c.headers(1, "/big?bytes=150000"))
        assert c.until(lambda: _data_bytes(c, 1) >= 1000)
        c.send(settings((4, 0)))  # window: 0 - 1000 = -1000
        c.until(lambda: False, 0.3)
        assert _data_bytes(c, 1) == 1000
        c.send(settings((4, 500)))  # -500: still nothing may be sent
        c.until(lambda: False, 0.3)
        assert _data_bytes(c, 1) == 1000
        c.send(settings((4, 65535)))
        assert c.until(lambda: c.ended(1)), _data_bytes(c, 1)
        assert _data_bytes(c, 1) == 150000
    finally:
        c.close()


# === bodies arrive whole ===========================================================

SIZES = [0, 1, 16383, 16384, 65535]


def _body(n: int) -> bytes:
    return bytes(i * 7 % 251 for i in range(n))


def test_raw_bodies_in_one_write(env: Env) -> None:
    """HEADERS and every DATA frame of each request in one write (one read at the edge),
    all requests on one connection, each up to a full stream window."""
    c = Raw(env)
    try:
        for i, n in enumerate(SIZES):
            sid = 1 + 2 * i
            c.send(c.post(sid, _body(n), f"/raw-{n}", b"application/octet-stream"))
            status, answer = c.answer(sid)
            assert status == 200 and json.loads(answer) == {
                **_digest(_body(n)), "target": f"/raw-{n}"}, (n, answer)
    finally:
        c.close()
    for n in SIZES:
        assert _complete(env, f"/raw-{n}") == [_body(n)], n


def test_padded_bodies_arrive_whole(env: Env) -> None:
    """DATA with padding, including frames that are all padding, and padding counted
    against the windows (a 64 KiB body padded to twice that still gets through)."""
    c = Raw(env)
    body = _body(65000)
    try:
        frames = [_open_upload(c, 1, "/padded", len(body))]
        for i in range(0, len(body), 1000):
            frames.append(frame(DATA, PADDED, 1, b"\xff" + bytes(255)))  # padding only
            frames.append(frame(DATA, PADDED, 1, b"\x10" + body[i:i + 1000] + bytes(16)))
        frames.append(frame(DATA, PADDED | END_STREAM, 1, b"\x00"))
        # the windows are 64 KiB: send as the edge gives them back
        wire = b"".join(frames)
        sent = 0
        while sent < len(wire):
            c.send(wire[sent:sent + 30000])
            sent += 30000
            c.until(lambda: False, 0.05)
        status, answer = c.answer(1)
        assert status == 200 and json.loads(answer)["sha256"] == _digest(body)["sha256"]
    finally:
        c.close()
    assert _complete(env, "/padded") == [body]


CLIENT_SIZES = [0, 1, 16383, 16384, 65535, 65536, 1 << 20]


def test_curl_bodies_arrive_whole(env: Env, tmp_path: Path) -> None:
    curl = shutil.which("curl")
    assert curl, "curl is not installed"
    for n in CLIENT_SIZES:
        path = tmp_path / f"{n}.bin"
        path.write_bytes(_body(n))
        proc = subprocess.run(
            [curl, "-sk", "--http2", "--data-binary", f"@{path}",
             "-H", "content-type: application/octet-stream", "--resolve",
             f"{HOST}:{env.serve.port}:{LOOPBACK}", f"https://{HOST}:{env.serve.port}/curl-{n}"],
            capture_output=True, timeout=60, check=False)
        assert json.loads(proc.stdout) == {**_digest(_body(n)), "target": f"/curl-{n}"}, (
            n, proc.stdout[:300], proc.stderr[-300:])
        assert _complete(env, f"/curl-{n}") == [_body(n)], n


def test_httpx_bodies_arrive_whole(env: Env) -> None:
    """httpx over h2 on one connection: bodies that fit the connection's first window
    together concurrently, then each of the others alone. (httpcore's upload waits for
    window on a blocking read of the connection; when another stream's read took the
    WINDOW_UPDATE meanwhile, the upload waits for a frame that never comes, so
    concurrent uploads that need window stall in the client until its timeout, whatever
    the server does.)"""
    together: list[int] = []
    for n in CLIENT_SIZES:
        if sum(together) + n <= 65535:
            together.append(n)
    assert len(together) >= 4
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE

    async def run() -> list[httpx.Response]:
        import trio
        transport = httpx.AsyncHTTPTransport(http2=True, verify=ctx)
        async with httpx.AsyncClient(transport=transport, timeout=60,
                                     base_url=f"https://{LOOPBACK}:{env.serve.port}") as client:
            out: dict[int, httpx.Response] = {}

            async def one(n: int) -> None:
                out[n] = await client.post(
                    f"/httpx-{n}", content=_body(n),
                    headers={"host": HOST, "content-type": "application/octet-stream"},
                    extensions={"sni_hostname": HOST})
            async with trio.open_nursery() as nursery:
                for n in together:
                    nursery.start_soon(one, n)
            for n in CLIENT_SIZES:
                if n not in together:
                    await one(n)
            assert len(client._transport._pool.connections) == 1  # type: ignore[attr-defined]
            return [out[n] for n in CLIENT_SIZES]

    import trio
    answers = trio.run(run)
    for n, res in zip(CLIENT_SIZES, answers, strict=True):
        assert res.http_version == "HTTP/2" and res.status_code == 200, (n, res.text[:200])
        assert res.json() == {**_digest(_body(n)), "target": f"/httpx-{n}"}, n
        assert _complete(env, f"/httpx-{n}") == [_body(n)], n


# === streams, slots and the connection's end =======================================

def test_streams_beyond_the_limit_are_refused_and_the_rest_served(env: Env) -> None:
    """100 uploads held open (SETTINGS_MAX_CONCURRENT_STREAMS): the next stream is
    refused (REFUSED_STREAM: the client may retry it), and once one upload ends the
    connection takes a new stream again; every upload that ends arrives whole."""
    c = Raw(env)
    try:
        c.send(*(_open_upload(c, sid, f"/held-{sid}", None) for sid in range(1, 201, 2)))
        c.send(c.headers(201, "/refused"))
        assert c.reset(201) == REFUSED_STREAM
        c.send(frame(DATA, END_STREAM, 1, b"one"))
        status, answer = c.answer(1)
        assert status == 200 and json.loads(answer)["bytes"] == 3
        _served_after(c, 203)
        c.send(*(frame(DATA, END_STREAM, sid, b"%d" % sid) for sid in range(3, 201, 2)))
        for sid in range(3, 201, 2):
            assert c.answer(sid)[0] == 200, sid
    finally:
        c.close()
    assert _reached(env, "/refused") == 0
    assert all(_complete(env, f"/held-{sid}") == [b"%d" % sid] for sid in range(3, 201, 2))


def test_whole_answers_to_a_client_that_reads_late_arrive_in_order(env: Env) -> None:
    """Small answers are sent by their stream's own task while the writer is idle. A
    client with a small receive buffer that reads nothing until all its streams were
    answered: the kernel takes part of those sends, the rest is held and must leave
    before anything sent later. Every answer arrives whole (a TLS record out of order
    would break the connection), and the connection serves on."""
    pad = "p" * 3000
    # windows wide open: what holds the answers back is the kernel, not flow control
    c = Raw(env, rcvbuf=4096, first=settings((4, 2**31 - 1)))
    c.send(frame(WINDOW_UPDATE, 0, 0, u32(2**31 - 1 - 65535)))
    try:
        for round_ in range(2):
            sids = range(1 + 200 * round_, 200 * (round_ + 1), 2)
            c.send(*(c.headers(sid, f"/whole-{sid}-{pad}") for sid in sids))
            deadline = time.monotonic() + 10  # until the node answered them all
            while (_reached(env, f"/whole-{sids[-1]}-") == 0 and time.monotonic() < deadline):
                time.sleep(0.05)
            time.sleep(0.3)  # the answers pile up behind the closed receive window
            for sid in sids:
                status, answer = c.answer(sid)
                assert status == 200, sid
                assert json.loads(answer)["target"] == f"/whole-{sid}-{pad}", sid
        _served_after(c, 401)
    finally:
        c.close()


def test_client_that_leaves_while_answers_are_held(env: Env) -> None:
    """The same pile-up, then the client resets the connection instead of reading: what
    is held cannot be sent, the connection ends (the fixture: no connection left counted,
    another client served)."""
    c = Raw(env, rcvbuf=4096, first=settings((4, 2**31 - 1)))
    c.send(frame(WINDOW_UPDATE, 0, 0, u32(2**31 - 1 - 65535)))
    pad = "p" * 3000
    sids = range(1, 200, 2)
    c.send(*(c.headers(sid, f"/whole-gone-{sid}-{pad}") for sid in sids))
    deadline = time.monotonic() + 10
    while _reached(env, f"/whole-gone-{sids[-1]}-") == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    c.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    c.close()  # RST: the edge's next send fails


def test_client_goaway_lets_the_open_stream_finish(env: Env) -> None:
    c = Raw(env)
    try:
        c.send(c.headers(1, "/stream?n=5&interval=0.1"))
        c.until(lambda: any(f[0] == HEADERS and f[2] == 1 for f in c.frames))
        c.send(frame(GOAWAY, 0, 0, u32(0) + u32(NO_ERROR)))
        status, _ = c.answer(1)
        assert status == 200 and c.ended(1)
        assert c.until(lambda: c.eof), "the edge kept the connection after the client's GOAWAY"
    finally:
        c.close()


@pytest.mark.parametrize("cut", [3, 9, 20])
def test_abort_mid_frame(env: Env, cut: int) -> None:
    """The client goes away inside a frame (its header, its payload) while an upload is
    open: the stream and the connection are released (the fixture checks the count)."""
    c = Raw(env)
    wire = _open_upload(c, 1, "/aborted", 100) + frame(DATA, 0, 1, bytes(50))
    c.send(wire + frame(DATA, END_STREAM, 1, bytes(50))[:cut])
    c.until(lambda: False, 0.2)
    c.close()
    assert _complete(env, "/aborted") == []


def test_zero_window_stall_ends(env: Env) -> None:
    """A client that never opens its window: the answer waits at most the write
    deadline (the stall route's short one), then the stream is cancelled (RST_STREAM
    CANCEL) and the connection goes on serving; the node's answer is not held for ever."""
    c = Raw(env, host=STALL_HOST, first=settings((4, 0)))
    try:
        c.send(c.headers(1, "/big?bytes=100000"))
        assert c.until(lambda: bool(c.resets(1)), 60), "the stalled stream never ended"
        assert c.resets(1) == [CANCEL] and _data_bytes(c, 1) == 0
        c.send(settings((4, 65535)))
        _served_after(c, 3)
    finally:
        c.close()


def test_a_flood_that_goes_on_after_goaway_is_closed(env: Env) -> None:
    """A PING flood that does not stop at the edge's GOAWAY: the client gets the GOAWAY
    (the edge reads and drops what it still sends for a moment before closing, so no
    reset throws it away), and the connection is closed while the client is still
    sending: the lingering close is bounded, not held open by the flooder."""
    c = Raw(env)
    try:
        burst = frame(PING, 0, 0, bytes(8)) * 50
        deadline = time.monotonic() + 20  # far beyond the linger: a bound for the loop
        while not c.eof and time.monotonic() < deadline:
            c.send(burst)
            c.read(0.01)
        assert c.eof, "the connection stayed open while the client kept flooding"
        assert c.goaway(0) == ENHANCE_YOUR_CALM
    finally:
        c.close()


def test_pings_do_not_keep_an_idle_connection(tmp_path: Path) -> None:
    """A connection with no stream open ends after idle_timeout even while the client
    pings within its allowance (else each connection of the per-IP cap is held for
    ever at no cost); a connection that keeps making requests is not idle."""
    env = Env.start(tmp_path, limits={**LIMITS, "idle_timeout": 1})
    try:
        c = Raw(env)
        try:
            deadline = time.monotonic() + 3 * WAIT
            while not c.eof and time.monotonic() < deadline:
                c.send(frame(PING, 0, 0, bytes(8)))  # 4 per second: under the allowance
                c.until(lambda: c.eof, 0.25)
            assert c.eof, "a pinging connection with no stream was kept"
            assert not any(f[0] == GOAWAY and struct.unpack(">II", f[3][:8])[1]
                           == ENHANCE_YOUR_CALM for f in c.frames)
        finally:
            c.close()
        c = Raw(env)
        try:
            for sid in range(1, 12, 2):  # a request every half idle_timeout
                _served_after(c, sid)
                c.until(lambda: False, 0.5)
            assert not c.eof
        finally:
            c.close()
        assert env.serve.wait_open_connections(0) == 0
    finally:
        env.stop()


NODE_CLIENT = r"""
const http2 = require('http2'), tls = require('tls');
const [port, host, ...sizes] = process.argv.slice(1);
const client = http2.connect(`https://${host}:${port}`, {
  createConnection: () => tls.connect({host: '127.0.0.1', port: Number(port), servername: host,
                                       ALPNProtocols: ['h2'], rejectUnauthorized: false})});
const out = {};
let left = sizes.length;
for (const s of sizes) {
  const n = Number(s), body = Buffer.alloc(n);
  for (let i = 0; i < n; i++) body[i] = (i * 7) % 251;
  const req = client.request({':method': 'POST', ':path': `/node-${n}`,
                              'content-type': 'application/octet-stream'});
  let data = '';
  req.on('data', c => { data += c; });
  req.on('close', () => {
    out[n] = data;
    if (--left === 0) { console.log(JSON.stringify(out)); client.close(); }
  });
  req.end(body);
}
setTimeout(() => { console.log(JSON.stringify(out)); process.exit(3); }, 50000).unref();
"""


def test_node_bodies_arrive_whole(env: Env) -> None:
    """Node's http2 client, every size on one connection at once."""
    node = shutil.which("node")
    assert node, "node is not installed"
    proc = subprocess.run([node, "-e", NODE_CLIENT, str(env.serve.port), HOST,
                           *map(str, CLIENT_SIZES)],
                          capture_output=True, text=True, timeout=60, check=False)
    lines = proc.stdout.strip().splitlines()
    answers = json.loads(lines[-1]) if lines else {}
    for n in CLIENT_SIZES:
        assert json.loads(answers.get(str(n)) or "null") == {
            **_digest(_body(n)), "target": f"/node-{n}"}, (n, proc.stderr[-300:])
        assert _complete(env, f"/node-{n}") == [_body(n)], n


def test_drain_ends_despite_a_zero_window_stall(tmp_path: Path) -> None:
    """SIGTERM while a client holds an answer behind a closed window: the drain does not
    wait for it for ever; the process exits cleanly and the client's connection ends.
    The write deadline is shortened (it is what ends the stall; the drain's own deadline,
    30 s, would only come later)."""
    env = Env.start(tmp_path, limits={**LIMITS, "client_write_timeout": "3s"})
    try:
        c = Raw(env, first=settings((4, 0)))
        try:
            c.send(c.headers(1, "/big?bytes=1000000"))
            assert c.until(lambda: any(f[0] == HEADERS and f[2] == 1 for f in c.frames))
            env.serve.proc.send_signal(signal.SIGTERM)
            assert env.serve.proc.wait(timeout=120) == 0, env.serve.logs()[-2000:]
            assert c.until(lambda: c.eof, WAIT)
            assert _data_bytes(c, 1) == 0
        finally:
            c.close()
    finally:
        env.stop()


def _granted(c: Raw, sid: int, start: int) -> int:
    """`start` plus every WINDOW_UPDATE the edge sent for `sid` (0: the connection)."""
    return start + sum(int.from_bytes(f[3], "big") & 0x7FFFFFFF for f in c.frames
                       if f[0] == WINDOW_UPDATE and f[2] == sid)


def _padded_upload(c: Raw, sid: int, body: bytes, sent: list[int], *, piece: int = 700,
                   pad: int = 40, end: bool = True) -> None:
    """`body` on stream `sid` in short padded DATA frames, within both windows the edge
    granted (read from its WINDOW_UPDATEs); `sent[0]` counts the connection's
    flow-controlled bytes, padding included."""
    stream_sent = 0
    deadline = time.monotonic() + WAIT
    view = memoryview(body)
    while view or end:
        data = bytes(view[:piece])
        last = end and len(view) <= piece
        payload = bytes([pad]) + data + bytes(pad)
        size = len(payload)
        def room(size: int = size, stream_sent: int = stream_sent) -> bool:
            return (_granted(c, 0, 65_535) - sent[0] >= size
                    and _granted(c, sid, STREAM_WINDOW) - stream_sent >= size)
        if not c.until(lambda: room() or bool(c.resets(sid)) or c.ended(sid), 0.5):
            assert time.monotonic() < deadline, ("no window", sid, sent[0], stream_sent)
            continue
        if c.resets(sid) or c.ended(sid):
            return
        c.send(frame(DATA, PADDED | (END_STREAM if last else 0), sid, payload))
        sent[0] += size
        stream_sent += size
        view = view[piece:]
        if last:
            return
        if not view and not end:
            return


def test_the_connection_window_is_given_back_exactly_over_many_streams(env: Env) -> None:
    """One long connection, many uploads in short padded DATA frames (gathered into runs
    at the edge): some read whole by the node, some reset by the client halfway, some
    answered early by the edge (over max_body_bytes) with the client sending on. Every
    flow-controlled byte, padding included, comes back to the connection window: once
    all is over, at most the half window the edge waits for before a WINDOW_UPDATE is
    still owed, and a further upload of 1 MiB completes."""
    c = Raw(env)
    sent = [0]
    try:
        sid = 1
        for i in range(30):  # bounded
            body = _body(5000 + i * 37)
            kind = i % 3
            if kind == 0:  # read whole
                c.send(_open_upload(c, sid, f"/exact-{i}", len(body)))
                _padded_upload(c, sid, body, sent)
                status, answer = c.answer(sid)
                assert status == 200 and json.loads(answer)["sha256"] == _digest(body)["sha256"]
            elif kind == 1:  # reset by the client halfway
                c.send(_open_upload(c, sid, f"/exact-reset-{i}", len(body)))
                _padded_upload(c, sid, body[:2500], sent, end=False)
                c.send(frame(RST_STREAM, 0, sid, u32(CANCEL)))
            else:  # answered early: the edge refuses the length; the client sends on
                c.send(_open_upload(c, sid, f"/exact-early-{i}", 7 * 1024 * 1024))
                c.until(lambda s=sid: c.ended(s) or bool(c.resets(s)))
                # the client may not have seen the answer yet: DATA in flight
                c.send(frame(DATA, PADDED, sid, bytes([200]) + b"z" * 300 + bytes(200)))
                sent[0] += 501
            sid += 2
        _served_after(c, sid)
        sid += 2
        owed = sent[0] - (_granted(c, 0, 65_535) - (CONNECTION_WINDOW - 65_535))
        assert c.until(lambda: sent[0] - (_granted(c, 0, 65_535)
                                          - (CONNECTION_WINDOW - 65_535)) < 32_768, 5), owed
        big = _body(1 << 20)  # short padded frames: runs, each owing back its padding
        c.send(_open_upload(c, sid, "/exact-after", len(big)))
        _padded_upload(c, sid, big, sent, piece=900, pad=100)
        status, answer = c.answer(sid)
        assert status == 200 and json.loads(answer)["sha256"] == _digest(big)["sha256"]
    finally:
        c.close()
