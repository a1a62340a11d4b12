"""The node side's HTTP/2 client state machine (`proto.h2_client`), against three real
servers and against a hostile node.

- the `h2` library's server end, in memory: an independent implementation that
  validates every frame and header block we send, driven byte for byte;
- hypercorn and nghttpd over TLS on loopback (ALPN h2), with request and answer bodies
  several times every window, many streams at once, and the bodies compared whole;
- frames written by hand for everything a node must not do: each answer is the
  defined one (a stream reset that leaves the other streams running, or GOAWAY with
  the RFC's code), and nothing is read after a connection error.
"""

from __future__ import annotations

import hashlib
import random
import select
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import h2.config
import h2.connection
import h2.events
import h2.settings
import hpack
import pytest

from pact_ingress.identity import keygen
from pact_ingress.proto import h2_hpack
from pact_ingress.proto.h2_client import (
    GoAwayReceived,
    H2Client,
    MalformedResponse,
    ResponseReceived,
    split_response,
)
from pact_ingress.proto.h2_frames import (
    ACK as ACK_FLAG,
)
from pact_ingress.proto.h2_frames import (
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    GOAWAY,
    GOAWAY_HEAD,
    HEAD,
    HEADERS,
    PADDED,
    PING,
    PRIORITY,
    PUSH_PROMISE,
    RST_STREAM,
    SETTING,
    SETTINGS,
    U32,
    WINDOW_UPDATE,
    ConnectionError_,
    DataReceived,
    ErrorCode,
    Setting,
    StreamClosed,
    StreamEnded,
    StreamReset,
    frame,
    settings_frame,
)
from tests.netutil import client_context, free_port
from tests.tools import require

#: What a non-blocking TLS socket raises when it must wait.
SSL_WANT = (ssl.SSLWantReadError, ssl.SSLWantWriteError, BlockingIOError)

GET = [(b":method", b"GET"), (b":scheme", b"https"), (b":path", b"/"),
       (b":authority", b"node.test")]


def post(path: bytes = b"/echo") -> list[tuple[bytes, bytes]]:
    return [(b":method", b"POST"), (b":scheme", b"https"), (b":path", path),
            (b":authority", b"node.test")]


def pattern(n: int, seed: int = 0) -> bytes:
    """`n` bytes that differ by position and by `seed`: a reordered, dropped or repeated
    chunk changes the digest."""
    block = hashlib.sha256(str(seed).encode()).digest()
    return (block * (n // len(block) + 1))[:n]


# -- against the h2 library's server, in memory ---------------------------------------

class Pair:
    """Our client and h2's server, bytes moved between them by `pump`."""

    def __init__(self, client: H2Client | None = None, **server_settings: int) -> None:
        self.client = client or H2Client()
        self.server = h2.connection.H2Connection(h2.config.H2Configuration(
            client_side=False, header_encoding=None))
        self.server.local_settings = h2.settings.Settings(
            client=False, initial_values={
                h2.settings.SettingCodes[name.upper()]: value
                for name, value in server_settings.items()} or None)
        self.server.initiate_connection()
        self.client.initiate_connection()
        self.at_client: list[object] = []
        self.at_server: list[object] = []
        self.pump()

    def pump(self) -> None:
        for _ in range(10_000):
            out = bytes(self.client.take_output())
            if out:
                self.at_server += self.server.receive_data(out)
            back = self.server.data_to_send()
            if back:
                self.at_client += self.client.receive_data(back)
            if not out and not back:
                return
        raise AssertionError("the two ends never went quiet")

    def server_events(self, kind: type) -> list:
        return [e for e in self.at_server if isinstance(e, kind)]

    def client_events(self, kind: type) -> list:
        return [e for e in self.at_client if isinstance(e, kind)]

    def body_at_client(self, sid: int) -> bytes:
        out = b""
        for e in self.client_events(DataReceived):
            if e.stream_id == sid:
                out += e.data
        return out


def test_a_request_and_its_answer_with_every_check_passed_by_h2() -> None:
    pair = Pair()
    sid = pair.client.send_request(GET + [(b"user-agent", b"pact")])
    pair.pump()
    (got,) = pair.server_events(h2.events.RequestReceived)
    assert got.stream_id == sid == 1
    assert dict(got.headers)[b":path"] == b"/" and dict(got.headers)[b"user-agent"] == b"pact"
    assert got.stream_ended is not None
    pair.server.send_headers(sid, [(b":status", b"200"), (b"content-length", b"5"),
                                   (b"content-type", b"text/plain")])
    pair.server.send_data(sid, b"hello", end_stream=True)
    pair.pump()
    (head,) = pair.client_events(ResponseReceived)
    assert (head.stream_id, head.status, head.ended) == (sid, 200, False)
    assert head.headers == [(b"content-length", b"5"), (b"content-type", b"text/plain")]
    (data,) = pair.client_events(DataReceived)
    assert (data.data, data.ended, data.flow_length) == (b"hello", True, 5)
    assert sid not in pair.client.streams  # ended both ways: forgotten


def test_bodies_both_ways_many_times_every_window_arrive_whole() -> None:
    """Sixteen streams, each uploading 200 KB and downloading 600 KB, with windows of
    64 KiB on the node's side and 128 KiB on ours: nothing moves without WINDOW_UPDATEs,
    which only come as each end acknowledges."""
    pair = Pair(H2Client(initial_window=128 * 1024, connection_window=256 * 1024))
    c, s = pair.client, pair.server
    sent: dict[int, bytes] = {}
    for i in range(16):
        sid = c.send_request(post(), end_stream=False)
        sent[sid] = pattern(200_000, sid)
        c.send_data(sid, sent[sid], end_stream=True)
    assert any(c.pending(sid) for sid in sent)  # the node's windows hold them back
    uploaded = {sid: b"" for sid in sent}
    answers = {sid: pattern(600_000, sid + 1000) for sid in sent}
    answered: set[int] = set()
    offsets = dict.fromkeys(sent, 0)
    got = {sid: b"" for sid in sent}
    seen_server = seen_client = 0
    for _ in range(5_000):
        pair.pump()
        for e in pair.at_server[seen_server:]:
            if isinstance(e, h2.events.DataReceived):
                uploaded[e.stream_id] += e.data
                s.acknowledge_received_data(e.flow_controlled_length, e.stream_id)
            if isinstance(e, h2.events.StreamEnded):
                s.send_headers(e.stream_id, [(b":status", b"200"), (
                    b"content-length", str(len(answers[e.stream_id])).encode())])
                answered.add(e.stream_id)
        seen_server = len(pair.at_server)
        for e in pair.at_client[seen_client:]:
            if isinstance(e, DataReceived):
                got[e.stream_id] += e.data
                c.acknowledge(e.flow_length, e.stream_id)
        seen_client = len(pair.at_client)
        for sid in answered:
            left = len(answers[sid]) - offsets[sid]
            if not left:
                continue
            room = min(s.local_flow_control_window(sid), s.max_outbound_frame_size, left)
            if room > 0:
                chunk = answers[sid][offsets[sid]:offsets[sid] + room]
                offsets[sid] += room
                s.send_data(sid, chunk, end_stream=offsets[sid] == len(answers[sid]))
        if got == answers:
            break
    assert uploaded == sent
    assert got == answers
    assert not c.streams and not c._blocked


def test_an_answer_nobody_takes_stops_the_node_at_our_window() -> None:
    pair = Pair(H2Client(initial_window=100_000))
    c, s = pair.client, pair.server
    sid = c.send_request(GET)
    pair.pump()
    s.send_headers(sid, [(b":status", b"200")])
    pair.pump()
    sent = 0
    while (room := min(s.local_flow_control_window(sid), 16384)) > 0:
        s.send_data(sid, b"x" * room)
        sent += room
        pair.pump()
    assert sent == 100_000  # the stream's window, and not a byte more
    assert len(pair.body_at_client(sid)) == 100_000
    taken = sum(e.flow_length for e in pair.client_events(DataReceived))
    c.acknowledge(taken, sid)  # passed on: the window comes back
    pair.pump()
    assert s.local_flow_control_window(sid) == 100_000


def test_a_body_waits_for_the_node_s_window_and_goes_when_it_grows() -> None:
    pair = Pair(H2Client(), initial_window_size=1000)
    c = pair.client
    sid = c.send_request(post(), end_stream=False)
    c.send_data(sid, pattern(5000), end_stream=True)
    pair.pump()
    assert c.pending(sid) == 4000
    got = b"".join(e.data for e in pair.server_events(h2.events.DataReceived))
    assert got == pattern(5000)[:1000]
    pair.server.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 10_000})
    pair.pump()
    got = b"".join(e.data for e in pair.server_events(h2.events.DataReceived))
    assert got == pattern(5000) and c.pending(sid) == 0
    assert pair.server_events(h2.events.StreamEnded)


def test_the_node_s_stream_limit_is_kept() -> None:
    pair = Pair(H2Client(), max_concurrent_streams=2)
    c = pair.client
    a, b = c.send_request(GET), c.send_request(GET)
    assert not c.can_open()
    with pytest.raises(StreamClosed):
        c.send_request(GET)
    pair.pump()
    pair.server.send_headers(a, [(b":status", b"204")], end_stream=True)
    pair.pump()
    assert c.can_open() and [e.stream_id for e in pair.client_events(ResponseReceived)] == [a]
    assert c.send_request(GET) == b + 2


def test_goaway_hands_back_the_streams_the_node_never_took() -> None:
    pair = Pair()
    c = pair.client
    ids = [c.send_request(GET) for _ in range(4)]
    pair.pump()
    pair.server.send_headers(ids[0], [(b":status", b"200")], end_stream=True)
    pair.server.close_connection(error_code=0, last_stream_id=ids[1])
    pair.pump()
    (away,) = pair.client_events(GoAwayReceived)
    assert (away.code, away.last_stream_id, away.unprocessed) == (0, ids[1], ids[2:])
    assert not c.can_open()
    assert set(c.streams) == {ids[1]}  # still to be answered
    assert [e.stream_id for e in pair.client_events(ResponseReceived)] == [ids[0]]


def test_refused_stream_trailers_ping_and_head() -> None:
    pair = Pair()
    c, s = pair.client, pair.server
    refused = c.send_request(GET)
    trailed = c.send_request(GET)
    headed = c.send_request([(b":method", b"HEAD"), *GET[1:]])
    pair.pump()
    s.reset_stream(refused, error_code=ErrorCode.REFUSED_STREAM)
    s.send_headers(trailed, [(b":status", b"200")])
    s.send_data(trailed, b"abc")
    s.send_headers(trailed, [(b"x-sum", b"1")], end_stream=True)
    s.send_headers(headed, [(b":status", b"200"), (b"content-length", b"123")],
                   end_stream=True)
    s.ping(b"12345678")
    pair.pump()
    (reset,) = pair.client_events(StreamReset)
    assert (reset.stream_id, reset.code, reset.remote) == (refused, ErrorCode.REFUSED_STREAM,
                                                            True)
    assert [e.stream_id for e in pair.client_events(StreamEnded)] == [trailed]
    assert pair.body_at_client(trailed) == b"abc"
    heads = {e.stream_id: e for e in pair.client_events(ResponseReceived)}
    assert heads[headed].ended and heads[headed].headers == [(b"content-length", b"123")]
    assert [e.ping_data for e in pair.server_events(h2.events.PingAckReceived)] == [
        b"12345678"]
    assert not c.streams


def test_a_stream_we_reset_takes_no_more_and_its_late_data_gives_the_window_back() -> None:
    pair = Pair(H2Client(initial_window=65535, connection_window=65535))
    c, s = pair.client, pair.server
    gone, kept = c.send_request(GET), c.send_request(GET)
    pair.pump()
    s.send_headers(gone, [(b":status", b"200")])
    s.send_headers(kept, [(b":status", b"200")])
    pair.pump()
    c.reset_stream(gone, ErrorCode.CANCEL)
    # the node sends before it sees the reset: its window is the connection's too
    s.send_data(gone, b"z" * 16384)
    s.send_data(gone, b"z" * 16384)
    c_out = bytes(c.take_output())
    late = c.receive_data(s.data_to_send())
    assert [type(e) for e in late] == [DataReceived, DataReceived]
    assert all(e.flow_length == 0 for e in late)  # nothing owed: given back already
    pair.at_server += s.receive_data(c_out)
    pair.pump()
    assert [e.stream_id for e in pair.server_events(h2.events.StreamReset)] == [gone]
    # the connection window is whole again: the kept stream can take a full window
    for _ in range(3):  # more than what is left unless the late DATA was given back
        s.send_data(kept, b"k" * 16384)
    pair.pump()
    assert len(pair.body_at_client(kept)) == 16384 * 3


def test_a_long_head_goes_out_in_continuation_frames_and_h2_takes_it() -> None:
    pair = Pair()
    big = [(f"x-field-{i}".encode(), b"v" * 400) for i in range(100)]  # ~42 KB
    sid = pair.client.send_request(GET + big)
    pair.pump()
    (got,) = pair.server_events(h2.events.RequestReceived)
    assert got.stream_id == sid and got.headers[4:] == big


# -- real nodes over TLS -------------------------------------------------------------

APP = '''
async def app(scope, receive, send):
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    path = scope["path"]
    if path == "/echo":
        out = body
    else:
        n = int(path.rsplit("/", 1)[1])
        out = (b"0123456789abcdef" * (n // 16 + 1))[:n]
    await send({"type": "http.response.start", "status": 200, "headers": [
        (b"content-length", str(len(out)).encode()), (b"x-got", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": out})
'''


def _wait_port(port: int, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the node exited: {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise AssertionError("the node never listened")


def drive(port: int, requests: list[tuple[list[tuple[bytes, bytes]], bytes]],
          client: H2Client) -> dict[int, tuple[int, list[tuple[bytes, bytes]], bytes]]:
    """`requests` on one TLS connection (ALPN h2), all at once; each answer by stream
    id once every stream ended, read by a plain blocking loop (bounded in time)."""
    ctx = client_context(alpn=["h2"])
    raw = socket.create_connection(("127.0.0.1", port), timeout=10)
    with ctx.wrap_socket(raw, server_hostname="localhost") as tls:
        assert tls.selected_alpn_protocol() == "h2"
        client.initiate_connection()
        heads: dict[int, ResponseReceived] = {}
        bodies: dict[int, bytearray] = {}
        done: set[int] = set()
        for headers, body in requests:
            sid = client.send_request(headers, end_stream=not body)
            bodies[sid] = bytearray()
            if body:
                client.send_data(sid, body, end_stream=True)
        deadline = time.monotonic() + 30
        tls.setblocking(False)
        while len(done) < len(bodies):
            assert time.monotonic() < deadline, "the node never answered every stream"
            out = client.take_output()
            while out:
                try:
                    sent = tls.send(out)
                except SSL_WANT:
                    select.select([], [tls], [], 1)
                    continue
                del out[:sent]
            select.select([tls], [], [], 1)
            try:
                data = tls.recv(65536)
            except SSL_WANT:
                continue
            assert data, "the node closed the connection"
            for e in client.receive_data(data):
                if isinstance(e, ResponseReceived):
                    heads[e.stream_id] = e
                    if e.ended:
                        done.add(e.stream_id)
                elif isinstance(e, DataReceived):
                    bodies[e.stream_id] += e.data
                    client.acknowledge(e.flow_length, e.stream_id)
                    if e.ended:
                        done.add(e.stream_id)
                elif isinstance(e, StreamEnded):
                    done.add(e.stream_id)
                elif isinstance(e, StreamReset):
                    raise AssertionError(f"stream {e.stream_id} reset: {e.code}")
    return {sid: (heads[sid].status, heads[sid].headers, bytes(bodies[sid])) for sid in bodies}




def _mixed_requests(authority: bytes) -> tuple[list, dict[int, bytes]]:
    """Eight uploads of 300 KB to /echo and eight downloads of 1 MB, interleaved; what
    each stream's body must be, by stream id (1, 3, 5, ...)."""
    requests, expected = [], {}
    for i in range(16):
        sid = 2 * i + 1
        if i % 2:
            body = pattern(300_000, sid)
            requests.append(([(b":method", b"POST"), (b":scheme", b"https"),
                              (b":path", b"/echo"), (b":authority", authority)], body))
            expected[sid] = body
        else:
            requests.append(([(b":method", b"GET"), (b":scheme", b"https"),
                              (b":path", b"/big/1000000"), (b":authority", authority)], b""))
            expected[sid] = b""
    return requests, expected


def test_hypercorn_node_serves_many_streams_with_bodies_whole(tmp_path: Path) -> None:
    ident = keygen(tmp_path / "node.key")
    (tmp_path / "echoapp.py").write_text(APP)
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "hypercorn", "--certfile", str(ident.cert_path),
         "--keyfile", str(ident.key_path), "--bind", f"127.0.0.1:{port}", "echoapp:app"],
        cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_port(port, proc)
        requests, expected = _mixed_requests(b"localhost")
        # small windows: every body is several windows long both ways
        got = drive(port, requests, H2Client(initial_window=65535, connection_window=131072))
    finally:
        proc.terminate()
        proc.wait(10)
    big = (b"0123456789abcdef" * 62_500)
    for sid, (status, headers, body) in got.items():
        assert status == 200
        want = expected[sid] or big
        assert hashlib.sha256(body).digest() == hashlib.sha256(want).digest(), sid
        assert dict(headers)[b"content-length"] == str(len(want)).encode()
        assert dict(headers)[b"x-got"] == str(len(expected[sid])).encode()


def test_nghttpd_node_serves_many_streams_with_bodies_whole(tmp_path: Path) -> None:
    nghttpd = require("nghttpd")
    ident = keygen(tmp_path / "node.key")
    docs = tmp_path / "docs"
    (docs / "big").mkdir(parents=True)
    big = pattern(1_000_000, 7)
    (docs / "big" / "1000000").write_bytes(big)
    port = free_port()
    proc = subprocess.Popen(
        [nghttpd, "--echo-upload", "-a", "127.0.0.1", "-d", str(docs), str(port),
         str(ident.key_path), str(ident.cert_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_port(port, proc)
        requests, expected = _mixed_requests(b"localhost")
        got = drive(port, requests, H2Client(initial_window=65535, connection_window=131072))
    finally:
        proc.terminate()
        proc.wait(10)
    for sid, (status, _headers, body) in got.items():
        assert status == 200
        assert hashlib.sha256(body).digest() == hashlib.sha256(expected[sid] or big).digest()


# -- a hostile node -------------------------------------------------------------------

def opened(n: int = 1, **kw: int) -> H2Client:
    """A client past the node's preface with `n` GET streams open (1, 3, ...)."""
    c = H2Client(**kw)
    c.initiate_connection()
    c.receive_data(settings_frame(()))
    for _ in range(n):
        c.send_request(GET)
    c.take_output()
    return c


def encoded(fields: list[tuple[bytes, bytes]]) -> bytes:
    """A block as a node that honours our table size of 0 writes it."""
    encoder = hpack.Encoder()
    encoder.header_table_size = 0  # the block starts with the size update we asked for
    return encoder.encode(fields)


def head(sid: int, fields: list[tuple[bytes, bytes]], end: bool = False) -> bytes:
    block = encoded(fields)
    return frame(HEADERS, END_HEADERS | (END_STREAM if end else 0), sid, block)


def sent_frames(c: H2Client) -> list[tuple[int, int, int, bytes]]:
    """The frames `c` queued: (type, flags, stream id, payload)."""
    out, frames, pos = bytes(c.take_output()), [], 0
    while pos < len(out):
        h, flags, sid = HEAD.unpack_from(out, pos)
        frames.append((h & 0xFF, flags, sid, out[pos + 9:pos + 9 + (h >> 8)]))
        pos += 9 + (h >> 8)
    return frames


OK = [(b":status", b"200")]


@pytest.mark.parametrize("fields", [
    [(b":status", b"200"), (b"x-a", b"one\r\nx-injected: yes")],
    [(b":status", b"200"), (b"x-a", b"nul\x00")],
    [(b":status", b"200"), (b"X-Upper", b"1")],
    [(b":status", b"200"), (b"bad name", b"1")],
    [(b":status", b"200"), (b"connection", b"close")],
    [(b":status", b"200"), (b"transfer-encoding", b"chunked")],
    [(b":status", b"200"), (b"keep-alive", b"5")],
    [(b":status", b"200"), (b"upgrade", b"h2c")],
    [(b":status", b"200"), (b":status", b"200")],
    [(b":status", b"2000")],
    [(b":status", b"ok!")],
    [(b"x-a", b"1")],
    [(b":status", b"200"), (b":path", b"/")],
    [(b"x-a", b"1"), (b":status", b"200")],
    [(b":status", b"200"), (b"content-length", b"abc")],
    [(b":status", b"200"), (b"content-length", b"1"), (b"content-length", b"2")],
    [(b":status", b"200"), (b"x-a", b" padded")],
    [(b":status", b"101")],
], ids=lambda f: repr(f)[:60])
def test_a_malformed_answer_resets_its_stream_and_the_others_go_on(fields) -> None:
    c = opened(2)
    events = c.receive_data(head(1, fields, end=True) + head(3, OK, end=True))
    reset, answered = events
    assert isinstance(reset, StreamReset)
    assert (reset.stream_id, reset.code, reset.remote) == (1, ErrorCode.PROTOCOL_ERROR, False)
    assert isinstance(answered, ResponseReceived) and answered.stream_id == 3
    assert (RST_STREAM, 0, 1, U32.pack(ErrorCode.PROTOCOL_ERROR)) in sent_frames(c)
    # what the node sent on the reset stream before it saw the reset is ignored
    assert [type(e) for e in c.receive_data(frame(DATA, END_STREAM, 1, b"late"))] == [
        DataReceived]
    assert not c.closed


@pytest.mark.parametrize("fields", [
    [(b":status", b"200"), (b"x-a", b"tab\tinside"), (b"content-length", b"0"),
     (b"content-length", b"0")],
    [(b":status", b"404"), (b"set-cookie", b"a=b"), (b"x-empty", b"")],
])
def test_well_formed_answers_pass_the_check(fields) -> None:
    status, headers, _ = split_response(fields)
    assert status == int(fields[0][1]) and headers == fields[1:]


def test_split_response_says_why() -> None:
    with pytest.raises(MalformedResponse, match="control character"):
        split_response([(b":status", b"200"), (b"a", b"x\ny")])


@pytest.mark.parametrize("case", ["more", "less", "before-head", "on-head", "on-204",
                                  "trailers-open", "trailers-pseudo", "interim-ended",
                                  "nine-interims"])
def test_an_answer_that_breaks_its_own_framing_resets_its_stream(case: str) -> None:
    c = opened(1)
    if case == "on-head":
        c = H2Client()
        c.initiate_connection()
        c.receive_data(settings_frame(()))
        c.send_request([(b":method", b"HEAD"), *GET[1:]])
        c.take_output()
    wire = {
        "more": head(1, OK + [(b"content-length", b"3")]) + frame(DATA, END_STREAM, 1, b"four"),
        "less": head(1, OK + [(b"content-length", b"5")]) + frame(DATA, END_STREAM, 1, b"four"),
        "before-head": frame(DATA, 0, 1, b"body"),
        "on-head": head(1, OK) + frame(DATA, END_STREAM, 1, b"x"),
        "on-204": head(1, [(b":status", b"204")]) + frame(DATA, END_STREAM, 1, b"x"),
        "trailers-open": head(1, OK) + head(1, [(b"x-t", b"1")]),
        "trailers-pseudo": head(1, OK) + head(1, [(b":status", b"200")], end=True),
        "interim-ended": head(1, [(b":status", b"100")], end=True),
        "nine-interims": head(1, [(b":status", b"103")]) * 9,
    }[case]
    events = c.receive_data(wire)
    resets = [e for e in events if isinstance(e, StreamReset)]
    assert [(e.stream_id, e.code) for e in resets] == [(1, ErrorCode.PROTOCOL_ERROR)]
    assert not [e for e in events if isinstance(e, DataReceived) and e.ended]
    assert 1 not in c.streams and not c.closed


def test_interim_answers_are_passed_over() -> None:
    c = opened(1)
    events = c.receive_data(head(1, [(b":status", b"100")]) + head(1, [(b":status", b"103")])
                            + head(1, OK, end=True))
    assert [(type(e), getattr(e, "status", None)) for e in events] == [(ResponseReceived, 200)]


def _block_of(n_fields: int, size: int) -> bytes:
    """A response block of `n_fields` fields of `size` bytes each, Huffman coded (each
    value in about five eighths of its length)."""
    return encoded([(b":status", b"200")] + [
        (f"x-{i}".encode(), b"a" * size) for i in range(n_fields)])


@pytest.mark.parametrize("case, code", [
    ("push-promise", ErrorCode.PROTOCOL_ERROR),
    ("even-stream", ErrorCode.PROTOCOL_ERROR),
    ("never-opened", ErrorCode.PROTOCOL_ERROR),
    ("stream-window", ErrorCode.FLOW_CONTROL_ERROR),
    ("connection-window", ErrorCode.FLOW_CONTROL_ERROR),
    ("frame-too-big", ErrorCode.FRAME_SIZE_ERROR),
    ("enable-push", ErrorCode.PROTOCOL_ERROR),
    ("continuation-flood", ErrorCode.ENHANCE_YOUR_CALM),
    ("continuation-interrupted", ErrorCode.PROTOCOL_ERROR),
    ("continuation-alone", ErrorCode.PROTOCOL_ERROR),
    ("undecodable", ErrorCode.COMPRESSION_ERROR),
    ("table-grown", ErrorCode.COMPRESSION_ERROR),
    ("list-far-too-large", ErrorCode.ENHANCE_YOUR_CALM),
    ("data-after-end", ErrorCode.STREAM_CLOSED),
    ("ping-size", ErrorCode.FRAME_SIZE_ERROR),
    ("settings-size", ErrorCode.FRAME_SIZE_ERROR),
    ("window-zero", ErrorCode.PROTOCOL_ERROR),
    ("rst-stream-0", ErrorCode.PROTOCOL_ERROR),
    ("goaway-on-stream", ErrorCode.PROTOCOL_ERROR),
    ("initial-window-huge", ErrorCode.FLOW_CONTROL_ERROR),
])
def test_a_node_that_breaks_the_protocol_gets_goaway_with_the_rfc_s_code(case, code) -> None:
    c = opened(1, initial_window=65535, connection_window=65535)
    wire = {
        "push-promise": frame(PUSH_PROMISE, END_HEADERS, 1, U32.pack(2) + b"\x82"),
        "even-stream": head(2, OK),
        "never-opened": head(5, OK),
        "stream-window": head(1, OK) + b"".join(frame(DATA, 0, 1, b"x" * 16384)
                                                for _ in range(4)) + frame(DATA, 0, 1, b"x" * 4),
        "connection-window": b"",  # built below: two streams, each within its window
        "frame-too-big": frame(DATA, 0, 1, b"x" * 16385),
        "enable-push": settings_frame(((Setting.ENABLE_PUSH, 1),)),
        "continuation-flood": frame(HEADERS, 0, 1, b"\x88")
        + frame(CONTINUATION, 0, 1, b"") * 70,
        "continuation-interrupted": frame(HEADERS, 0, 1, b"\x88") + frame(PING, 0, 0, b"8" * 8),
        "continuation-alone": frame(CONTINUATION, END_HEADERS, 1, b"\x88"),
        "undecodable": frame(HEADERS, END_HEADERS, 1, b"\xff\xff\xff\xff\xff\xff"),
        "table-grown": frame(HEADERS, END_HEADERS, 1, b"\x3f\xe1\x1f\x88"),  # size 4096
        "list-far-too-large": b"",  # built below
        "data-after-end": head(1, OK, end=True) + frame(DATA, 0, 1, b"x"),
        "ping-size": frame(PING, 0, 0, b"1234"),
        "settings-size": frame(SETTINGS, 0, 0, b"12345"),
        "window-zero": frame(WINDOW_UPDATE, 0, 0, U32.pack(0)),
        "rst-stream-0": frame(RST_STREAM, 0, 0, U32.pack(0)),
        "goaway-on-stream": frame(GOAWAY, 0, 1, GOAWAY_HEAD.pack(0, 0)),
        "initial-window-huge": settings_frame(((Setting.INITIAL_WINDOW_SIZE, 2**31),)),
    }[case]
    if case == "connection-window":
        c = opened(2, initial_window=65535 * 2, connection_window=65535)
        wire = head(1, OK) + head(3, OK) + b"".join(
            frame(DATA, 0, sid, b"x" * 16000) for sid in (1, 3) for _ in range(3))
    if case == "list-far-too-large":
        block = _block_of(300, 2000)  # ~600 KB decoded: over four times the cap
        wire = frame(HEADERS, 0, 1, block[:16000]) + b"".join(
            frame(CONTINUATION, END_HEADERS if i + 16000 >= len(block) else 0, 1,
                  block[i:i + 16000]) for i in range(16000, len(block), 16000))
    with pytest.raises(ConnectionError_) as caught:
        c.receive_data(wire)
    assert caught.value.code == code
    goaway = [f for f in sent_frames(c) if f[0] == GOAWAY]
    assert goaway and GOAWAY_HEAD.unpack_from(goaway[-1][3])[1] == code
    assert c.closed and not c.can_open()
    assert c.receive_data(head(1, OK)) == []  # nothing is read after it


def test_a_list_over_the_cap_resets_only_its_stream() -> None:
    c = opened(2)
    block = _block_of(36, 2000)  # ~73 KB decoded: over the cap, under four times it
    assert len(block) < 64 * 1024  # and within the cap on a compressed block
    wire = frame(HEADERS, 0, 1, block[:16000]) + b"".join(
        frame(CONTINUATION, END_HEADERS if i + 16000 >= len(block) else 0, 1,
              block[i:i + 16000]) for i in range(16000, len(block), 16000))
    events = c.receive_data(wire + head(3, OK, end=True))
    assert [(type(e), e.stream_id) for e in events] == [(StreamReset, 1), (ResponseReceived, 3)]


def test_the_preface_must_be_settings() -> None:
    c = H2Client()
    c.initiate_connection()
    with pytest.raises(ConnectionError_) as caught:
        c.receive_data(frame(PING, 0, 0, b"12345678"))
    assert caught.value.code == ErrorCode.PROTOCOL_ERROR


def test_our_preface_asks_for_no_push_and_no_table() -> None:
    c = H2Client(initial_window=123_456)
    c.initiate_connection()
    out = bytes(c.take_output())
    assert out.startswith(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
    h, _flags, _sid = HEAD.unpack_from(out, 24)
    assert h & 0xFF == SETTINGS
    payload = out[33:33 + (h >> 8)]
    values = dict(struct_pairs(payload))
    assert values[Setting.HEADER_TABLE_SIZE] == 0 and values[Setting.ENABLE_PUSH] == 0
    assert values[Setting.INITIAL_WINDOW_SIZE] == 123_456


def struct_pairs(payload: bytes) -> list[tuple[int, int]]:
    return [SETTING.unpack_from(payload, i) for i in range(0, len(payload), 6)]


def test_a_repeated_answer_block_is_decoded_once() -> None:
    c = opened(3)
    block = h2_hpack.TABLE_SIZE_ZERO + h2_hpack.encode(
        [(b":status", b"200"), (b"content-length", b"0")])
    events = c.receive_data(b"".join(frame(HEADERS, END_HEADERS | END_STREAM, sid, block)
                                     for sid in (1, 3, 5)))
    assert [(e.stream_id, e.status) for e in events] == [(1, 200), (3, 200), (5, 200)]
    assert list(c._decoded) == [block]


# -- any bytes at all ------------------------------------------------------------------

def test_an_answer_cut_anywhere_reads_the_same_as_in_one_piece() -> None:
    """The same wire fed whole and byte by byte (frame heads and blocks split at every
    position) gives the same events and the same frames back."""
    wire = (settings_frame(((Setting.MAX_CONCURRENT_STREAMS, 10),))
            + head(1, OK + [(b"content-length", b"6")])
            + frame(DATA, 0, 1, b"abc") + frame(PING, 0, 0, b"pingpong")
            + frame(DATA, END_STREAM, 1, b"def")
            + frame(HEADERS, 0, 3, encoded(OK)[:1]) + frame(CONTINUATION, END_HEADERS, 3,
                                                           encoded(OK)[1:])
            + frame(RST_STREAM, 0, 3, U32.pack(ErrorCode.CANCEL)))

    def run(pieces: list[bytes]) -> tuple[list[tuple], bytes]:
        c = H2Client()
        c.initiate_connection()
        c.send_request(GET)
        c.send_request(GET)
        c.take_output()
        events = [e for piece in pieces for e in c.receive_data(piece)]
        return ([(type(e).__name__, *(getattr(e, s) for s in e.__slots__)) for e in events],
                bytes(c.take_output()))

    whole = run([wire])
    assert [e[0] for e in whole[0]] == ["SettingsChanged", "ResponseReceived", "DataReceived",
                                        "PingReceived", "DataReceived", "ResponseReceived",
                                        "StreamReset"]
    assert run([wire[i:i + 1] for i in range(len(wire))]) == whole


def _plausible_frame(rng: random.Random, c: H2Client) -> bytes:
    """A frame a node could send: mostly well-formed for its type, mostly on a stream
    still open; one in a hundred on any stream id, one in a hundred garbled in every
    field, one in a hundred a GOAWAY."""
    sid = rng.choice(list(c.streams) or [1]) if rng.random() < 0.99 else rng.randrange(1, 40)
    kind = rng.choice(["head", "data", "data", "trailers", "priority", "rst", "settings",
                       "ack", "ping", "window", "window", "unknown"])
    if rng.random() < 0.01:
        kind = "garbage"
    elif rng.random() < 0.01:
        kind = "goaway"
    if kind == "head":
        return head(sid, rng.choice([OK, OK + [(b"content-length", b"3")],
                                     [(b":status", b"103")], [(b":status", b"204")],
                                     OK + [(b"x-bad", b"a\rb")]]), end=rng.random() < 0.3)
    if kind == "data":
        flags = rng.choice([0, 0, END_STREAM, PADDED])
        body = b"x" * rng.randrange(4)
        return frame(DATA, flags, sid, b"\x01" + body + b"\x00" if flags == PADDED else body)
    if kind == "trailers":
        return head(sid, [(b"x-sum", b"1")], end=rng.random() < 0.9)
    if kind == "priority":
        return frame(PRIORITY, 0, sid, U32.pack(rng.choice([0, sid])) + b"\x10")
    if kind == "rst":
        return frame(RST_STREAM, 0, sid, U32.pack(rng.choice(list(ErrorCode))))
    if kind == "settings":
        return settings_frame(tuple(rng.choice([
            (Setting.HEADER_TABLE_SIZE, 4096), (Setting.MAX_CONCURRENT_STREAMS, 3),
            (Setting.MAX_CONCURRENT_STREAMS, 100), (Setting.INITIAL_WINDOW_SIZE, 100),
            (Setting.INITIAL_WINDOW_SIZE, 1 << 20), (Setting.MAX_FRAME_SIZE, 1 << 15)])
            for _ in range(rng.randrange(3))))
    if kind == "ack":
        return frame(SETTINGS, ACK_FLAG, 0)
    if kind == "ping":
        return frame(PING, rng.choice([0, ACK_FLAG]), 0, b"p" * 8)
    if kind == "window":
        return frame(WINDOW_UPDATE, 0, rng.choice([0, sid]), U32.pack(rng.randrange(1, 5000)))
    if kind == "unknown":
        return frame(rng.randrange(0x0A, 0xFF), rng.randrange(256), sid, b"?" * rng.randrange(9))
    if kind == "goaway":
        return frame(GOAWAY, 0, 0, GOAWAY_HEAD.pack(rng.choice([0, 7, 15, 99]), 0))
    return frame(rng.randrange(10), rng.randrange(256), rng.randrange(20),  # garbage
                 bytes(rng.randrange(256) for _ in range(rng.randrange(10))))


#: How many frames each seed's client took before its connection ended, by seed.
REACHED: dict[int, int] = {}


@pytest.mark.parametrize("seed", range(40))
def test_a_node_sending_random_frames_gets_events_or_goaway_and_nothing_grows(seed) -> None:
    """Frames of every type a node could send, mostly well-formed, with new streams
    opened as the node allows: the client answers with events or a connection error
    (`ConnectionError_`, GOAWAY queued), never another exception; its buffer never holds
    more than one frame, its streams never more than it may open."""
    rng = random.Random(seed)
    c = H2Client(max_concurrent_streams=8)
    c.initiate_connection()
    c.receive_data(settings_frame(()))
    for _ in range(8):
        c.send_request(GET)
    c.take_output()
    fed, total = 0, 300
    for i in range(total):
        wire = _plausible_frame(rng, c)
        try:
            for at in range(0, len(wire), 7):  # split inside frame heads and payloads
                c.receive_data(wire[at:at + 7])
        except ConnectionError_ as exc:
            assert c.closed and isinstance(exc.code, ErrorCode)
            assert c.receive_data(head(1, OK)) == []
            break
        fed = i + 1
        assert len(c._buf) <= 9 + 16384
        assert len(c.streams) <= 8 and all(s & 1 for s in c.streams)
        while c.can_open():
            c.send_request(GET)
        c.take_output()
        if not c.streams:  # after GOAWAY, every stream answered: the connection is done
            break
    assert len(c._reset_by_us) <= 256
    REACHED[seed] = fed


def test_the_random_frames_went_deep() -> None:
    """The fuzz above is worth something only if clients got well into their frames."""
    if len(REACHED) < 40:
        for seed in range(40):
            test_a_node_sending_random_frames_gets_events_or_goaway_and_nothing_grows(seed)
    reached = sorted(REACHED.values())
    assert reached[len(reached) // 2] >= 30, reached
