"""A hostile or broken home node, through a real `pact-ingress serve` on loopback.

The node here is scripted at the byte level (stdlib ssl, pinned mTLS as the edge
demands): each request's path names what it answers, so one node can send a second
response after the first, lie about lengths, flood interim heads, name hop-by-hop
fields, or never end a trailer. Many clients of one route share the edge's pool to
that node, so what is asserted is:

* no client ever gets bytes the node wrote for another request (each normal answer
  carries its own request's target, so a desync shows as a foreign target);
* every client gets a defined answer (the node's intact, or 502/504), on HTTP/1.1 and
  HTTP/2 alike, and its connection slot is given back (`/status`);
* what the edge must not pass on (hop-by-hop fields, HTTP/2 connection-specific fields)
  never reaches a client;
* the edge's memory stays bounded whatever the node sends (`VmHWM` of the serve
  process, which serves everything itself here: `--workers 1`).

Every wait is bounded; nothing asserts timing.
"""

from __future__ import annotations

import contextlib
import json
import socket
import ssl
import struct
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import h2.settings
import pytest

from pact_ingress.identity import Identity
from tests.netutil import bio_handshake, free_port
from tests.terminate_env import (
    LOOPBACK,
    OPT_HOST,
    WAIT,
    H2Conn,
    H2Result,
    Serve,
    Uploading,
    close_node,
    forget,
    make_identities,
    read_response,
    request_bytes,
    tarpit_route,
    tls_socket,
)

# --- the scripted node -----------------------------------------------------------------------


@dataclass
class Req:
    method: str
    target: str
    body: bytes
    fields: dict[str, str]

    @property
    def path(self) -> str:
        return urlsplit(self.target).path

    @property
    def query(self) -> dict[str, str]:
        return {k: v[0] for k, v in parse_qs(urlsplit(self.target).query).items()}


def answer(target: str, status: int = 200, extra: bytes = b"") -> bytes:
    """A well-formed response carrying its request's target."""
    body = json.dumps({"target": target}).encode()
    return (b"HTTP/1.1 %d OK\r\ncontent-type: application/json\r\n%scontent-length: %d\r\n\r\n"
            % (status, extra, len(body)) + body)


class Conn:
    """One node-side connection: the TLS socket and a read buffer."""

    def __init__(self, tls: ssl.SSLSocket) -> None:
        self.tls, self.buf = tls, b""

    def _fill(self) -> None:
        data = self.tls.recv(65536)
        if not data:
            raise EOFError()
        self.buf += data

    def read_head(self) -> Req:
        while b"\r\n\r\n" not in self.buf:
            self._fill()
        head, self.buf = self.buf.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        method, target, _ = lines[0].split(" ", 2)
        fields = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":")
                                                                  for ln in lines[1:])}
        return Req(method, target, b"", fields)

    def read_body(self, req: Req) -> None:
        fields = req.fields
        body = b""
        if "content-length" in fields:
            n = int(fields["content-length"])
            while len(self.buf) < n:
                self._fill()
            body, self.buf = self.buf[:n], self.buf[n:]
        elif fields.get("transfer-encoding") == "chunked":
            while True:
                while b"\r\n" not in self.buf:
                    self._fill()
                line, self.buf = self.buf.split(b"\r\n", 1)
                size = int(line.split(b";")[0], 16)
                while len(self.buf) < size + 2:
                    self._fill()
                body += self.buf[:size]
                self.buf = self.buf[size + 2:]
                if size == 0:
                    break
        req.body = body

    def send(self, *records: bytes) -> None:
        """Each piece in its own TLS record, all of them in one TCP segment where they
        fit (corked): the edge reads them together."""
        self.tls.setsockopt(socket.IPPROTO_TCP, socket.TCP_CORK, 1)
        try:
            for record in records:
                self.tls.sendall(record)
        finally:
            self.tls.setsockopt(socket.IPPROTO_TCP, socket.TCP_CORK, 0)


#: What a scripted answer returns: keep serving the connection (True) or close it.
Script = Callable[["Conn", Req], bool]


class ScriptNode:
    """A pinned-mTLS HTTP/1.1 node whose answer to each request is `scripts[path]`
    (anything else: `answer(target)`). Thread per connection; records requests and
    counts connections open on its side."""

    def __init__(self, identity: Identity, client_ca: Identity,
                 scripts: dict[str, Script]) -> None:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(identity.cert_path, identity.key_path)
        ctx.set_alpn_protocols(["http/1.1"])
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(cafile=str(client_ca.cert_path))
        self._ctx = ctx
        self.scripts = scripts
        self._listener = socket.create_server((LOOPBACK, 0), backlog=256)
        self.port = int(self._listener.getsockname()[1])
        self._lock = threading.Lock()
        self.requests: list[Req] = []
        self.open = 0
        #: Connections the edge closed (or reset) after the node answered this path
        #: and waited for another request on it.
        self.closed_after: dict[str, int] = {}
        self._socks: set[socket.socket] = set()
        self._stopped = False
        threading.Thread(target=self._accept_loop, daemon=True).start()

    def _accept_loop(self) -> None:
        while not self._stopped:
            try:
                raw, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(raw,), daemon=True).start()

    def _serve(self, raw: socket.socket) -> None:
        raw.settimeout(30)
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._lock:
            self.open += 1
            self._socks.add(raw)
        try:
            conn = Conn(self._ctx.wrap_socket(raw, server_side=True))
            last = None
            while not self._stopped:
                try:
                    req = conn.read_head()
                except (OSError, EOFError):
                    if last is not None:
                        with self._lock:
                            self.closed_after[last] = self.closed_after.get(last, 0) + 1
                    raise
                script = self.scripts.get(req.path)
                if not getattr(script, "early", False):  # else: answers before the body
                    conn.read_body(req)
                with self._lock:
                    self.requests.append(req)
                if script is None:
                    conn.send(answer(req.target))
                elif not script(conn, req):
                    return
                last = req.path
        except (OSError, ssl.SSLError, EOFError, ValueError):
            return
        finally:
            with self._lock:
                self.open -= 1
                self._socks.discard(raw)
            with contextlib.suppress(OSError):
                raw.close()

    def open_connections(self) -> int:
        with self._lock:
            return self.open

    def wait_closed_after(self, path: str, count: int) -> bool:
        deadline = time.monotonic() + WAIT
        while time.monotonic() < deadline:
            with self._lock:
                if self.closed_after.get(path, 0) >= count:
                    return True
            time.sleep(0.02)
        return False

    def stop(self) -> None:
        self._stopped = True
        close_node(self._listener, self._lock, self._socks)


# --- scripts -------------------------------------------------------------------------------


def _second_response_same_read(conn: Conn, req: Req) -> bool:
    """The answer, then (own TLS record, same segment) a second response to nothing."""
    conn.send(answer(req.target), answer("/stolen"))
    return True


def _second_response_same_record(conn: Conn, req: Req) -> bool:
    """The answer and a second response to nothing, in one TLS record."""
    conn.send(answer(req.target) + answer("/stolen"))
    return True


def _second_response_later(conn: Conn, req: Req) -> bool:
    """The answer, then a moment later a second response to a request never sent."""
    conn.send(answer(req.target))
    time.sleep(0.1)
    conn.send(answer("/stolen"))
    return True


def _body_longer_than_length(conn: Conn, req: Req) -> bool:
    """Content-Length shorter than what follows: the rest written a moment later (a
    node counting characters, not bytes), shaped like a response."""
    body = json.dumps({"target": req.target}).encode()
    conn.send(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(body) + body)
    time.sleep(0.05)
    conn.send(answer("/stolen"))
    return True


def _head_with_body(conn: Conn, req: Req) -> bool:
    """A response to HEAD that carries a body anyway (a response-shaped one)."""
    body = answer("/stolen")
    conn.send(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(body) + body)
    return True


def _fixed(data: bytes, keep: bool = True) -> Script:
    def script(conn: Conn, req: Req) -> bool:
        conn.send(data)
        return keep
    return script


def _fixed_then_answer(data: bytes) -> Script:
    """`data`, then (same segment) a well-formed answer to this request."""
    def script(conn: Conn, req: Req) -> bool:
        conn.send(data, answer(req.target))
        return True
    return script


BROKEN: dict[str, bytes] = {
    "cl_and_te": b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\ntransfer-encoding: chunked\r\n\r\n"
                 b"0\r\n\r\n",
    "two_lengths": b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\ncontent-length: 6\r\n\r\nhello!",
    "obs_fold": b"HTTP/1.1 200 OK\r\nx-a: 1\r\n folded\r\ncontent-length: 2\r\n\r\nok",
    "bare_lf": b"HTTP/1.1 200 OK\nx-a: 1\ncontent-length: 2\n\nok",
    "bare_cr": b"HTTP/1.1 200 OK\r\nx-a: 1\rx-b: 2\r\ncontent-length: 2\r\n\r\nok",
    "nul_value": b"HTTP/1.1 200 OK\r\nx-a: a\x00b\r\ncontent-length: 2\r\n\r\nok",
    "nul_name": b"HTTP/1.1 200 OK\r\nx-\x00a: 1\r\ncontent-length: 2\r\n\r\nok",
    "space_name": b"HTTP/1.1 200 OK\r\nx a: 1\r\ncontent-length: 2\r\n\r\nok",
    "bad_chunk": b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\nhello\r\n0\r\n\r\n",
    "chunk_overflow": b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
                      b"10000000000000005\r\nhello\r\n0\r\n\r\n",
    "negative_length": b"HTTP/1.1 200 OK\r\ncontent-length: -1\r\n\r\nok",
    "length_overflow": b"HTTP/1.1 200 OK\r\ncontent-length: 99999999999999999999999\r\n\r\nok",
    "many_fields": b"HTTP/1.1 200 OK\r\n" + b"x-a: 1\r\n" * 200 + b"content-length: 2\r\n\r\nok",
    "upgrade_101": b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\n"
                   b"connection: upgrade\r\n\r\n" + answer("/stolen"),
    "interim_flood": b"HTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\n" * 50 + answer("/stolen"),
    # a 1xx has no content (RFC 9110 §15.2), but llhttp reads one for 104-199 by its
    # framing fields: those bytes must not become part of the final answer's body
    "interim_with_body": b"HTTP/1.1 150 X\r\ncontent-length: 2\r\n\r\nok"
                         b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nhi",
    "interim_chunked": b"HTTP/1.1 199 X\r\ntransfer-encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n"
                       b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nhi",
    "bad_status": b"HTTP/1.1 2000 OK\r\ncontent-length: 2\r\n\r\nok",
    "garbage": b"SSH-2.0-OpenSSH_9.6\r\n",
    "short_body_close": b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly some",
    # a transfer coding the edge does not undo: relayed, its bytes would pass for the
    # content itself (the coding is hop-by-hop, so no client would be told of it)
    "te_gzip": b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip, chunked\r\n\r\n"
               b"a\r\n\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\x03\r\n0\r\n\r\n",
    # not chunked last: delimited by the close (RFC 9112 §6.3), here at once
    "te_chunked_identity": b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked, identity\r\n\r\n"
                           b"2\r\nok\r\n0\r\n\r\n",
}
#: Answers after which the node closes the connection.
CLOSING = {"short_body_close", "te_chunked_identity"}


def scripts() -> dict[str, Script]:
    out: dict[str, Script] = {
        "/dup-same-read": _second_response_same_read,
        "/dup-same-record": _second_response_same_record,
        "/dup-later": _second_response_later,
        "/long-body": _body_longer_than_length,
        "/head-body": _head_with_body,
        # interim heads within the edge's bound, then the answer: relayed intact
        "/few-interim": _fixed_then_answer(b"HTTP/1.1 100 Continue\r\n\r\n"
                                           b"HTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\n"),
        # one field of 40 KB: more than an HTTP/2 frame, so HEADERS and CONTINUATION
        "/big-field": lambda c, r: c.send(answer(r.target, extra=b"x-big: %b\r\n"
                                                 % (b"b" * 40000))) or True,
        # a response to HTTP/1.0 framing: close-delimited, then closed
        "/http10": lambda c, r: (c.send(b"HTTP/1.0 200 OK\r\n\r\n" + json.dumps(
            {"target": r.target}).encode()), False)[1],
    }
    for name, data in BROKEN.items():
        out[f"/broken-{name}"] = _fixed(data, keep=name not in CLOSING)
    return out


# --- the rig -------------------------------------------------------------------------------


@dataclass
class Rig:
    serve: Serve
    node: ScriptNode
    tmp: Path


#: A route whose node never completes a TLS handshake (`tarpit_route`).
TARPIT_HOST = "tarpit.attack.test"
#: A route whose node's port refuses connections (nothing listens there).
REFUSED_HOST = "refused.attack.test"


def _rig(tmp: Path) -> Iterator[Rig]:
    ids = make_identities(tmp)
    node = ScriptNode(ids.node, ids.ingress, scripts())
    tarpit = socket.create_server((LOOPBACK, 0), backlog=64)
    try:
        serve = Serve(tmp, node, ids.node.fingerprint, workers=1,  # type: ignore[arg-type]
                      limits={"idle_timeout": 3, "calls_per_hour_per_ip": 1000000,
                              "max_requests_in_flight_per_ip": 100},
                      extra_routes=tarpit_route(TARPIT_HOST, tarpit.getsockname()[1])
                      + tarpit_route(REFUSED_HOST, free_port()))
    except BaseException:
        node.stop()
        tarpit.close()
        raise
    yield Rig(serve, node, tmp)
    serve.stop()
    node.stop()
    tarpit.close()


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    yield from _rig(tmp_path_factory.mktemp("node_attacks"))


@pytest.fixture(scope="module")
def trio_rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    """`rig` with the keep-alive lane switched off (`PACT_INGRESS_LANE=0`): every
    connection is the trio engine's from its start, and its socket joins no readiness
    hub while the process has few connections."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PACT_INGRESS_LANE", "0")
        rigs = _rig(tmp_path_factory.mktemp("node_attacks_trio"))
        started = next(rigs)
    yield started
    next(rigs, None)


#: Which engine serves a request: the keep-alive lane (a `GET`), the trio engine after
#: the lane handed the connection over (a 200 KB upload), the trio engine alone.
ENGINES = {"lane": ("rig", 0), "streamed": ("rig", 200_000), "trio": ("trio_rig", 0)}


def h1(port: int, method: str, target: str, *, sock: ssl.SSLSocket | None = None,
       body: bytes = b"") -> tuple[int, bytes]:
    """One request (on `sock` when given, else a fresh connection): (status, body); a
    connection the edge drops mid-answer gives (0, b"")."""
    own = sock is None
    sock = sock or tls_socket(port, OPT_HOST)
    try:
        sock.sendall(request_bytes(method, target, OPT_HOST, body=body,
                                   content_type="application/x-www-form-urlencoded"))
        resp = read_response(sock)
        return resp.status, resp.body
    except (ConnectionError, ssl.SSLError, ValueError):
        return 0, b""
    finally:
        if own:
            forget(sock)


def own_answer(target: str, status: int, body: bytes) -> bool:
    """A 200 that carries its own request's target (and nothing else)."""
    try:
        return status == 200 and bool(json.loads(body)["target"] == target)
    except (ValueError, KeyError, TypeError):
        return False


def settled(rig: Rig) -> None:
    """Every client connection of the test is given back; the edge still serves."""
    assert rig.serve.wait_open_connections(0) == 0
    assert rig.serve.alive()


# --- 1. no response ever answers another request ---------------------------------------------


@pytest.mark.parametrize("method", ["GET", "POST"])
@pytest.mark.parametrize("path", ["/dup-same-read", "/dup-same-record"])
def test_a_second_response_read_with_the_first_never_answers_the_next_request(
        rig: Rig, method: str, path: str) -> None:
    """Neither through the pool nor on the client's own connection: its bytes are not
    relayed as part of the first answer either."""
    closed = rig.node.closed_after.get(path, 0)
    sock = tls_socket(rig.serve.port, OPT_HOST)
    try:
        for i in range(4):
            target = f"{path}?i={i}&m={method}"
            status, body = h1(rig.serve.port, method, target, sock=sock)
            assert own_answer(target, status, body), (target, status, body[:200])
            target = f"/plain?i={i}&m={method}"
            status, body = h1(rig.serve.port, method, target, sock=sock)
            assert own_answer(target, status, body), (target, status, body[:200])
    finally:
        forget(sock)
    assert rig.node.wait_closed_after(path, closed + 4)  # each such connection closed
    settled(rig)


@pytest.mark.parametrize("path", ["/dup-later", "/long-body"])
def test_bytes_the_node_writes_after_an_answer_never_answer_the_next_request(
        rig: Rig, path: str) -> None:
    sock = tls_socket(rig.serve.port, OPT_HOST)
    try:
        for i in range(3):
            target = f"{path}?i={i}"
            status, body = h1(rig.serve.port, "GET", target, sock=sock)
            assert own_answer(target, status, body), (target, status, body[:200])
            time.sleep(0.3)  # the node's extra bytes reach the edge's idle connection
            for j in range(2):
                target = f"/plain?i={i}&j={j}"
                status, body = h1(rig.serve.port, "GET", target, sock=sock)
                assert own_answer(target, status, body), (target, status, body[:200])
    finally:
        forget(sock)
    settled(rig)


def _interim_body(conn: Conn, req: Req) -> bool:
    """An interim response with a body as long as the final one's, the final's body a
    whole response: were the interim's bytes relayed in front, the client would read
    them as the body its head announced, and the final body as its next answer."""
    smuggled = answer("/stolen")
    filler = b"f" * len(smuggled)
    conn.send(b"HTTP/1.1 150 X\r\ncontent-length: %d\r\n\r\n%b" % (len(filler), filler)
              + b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%b" % (len(smuggled),
                                                                      smuggled))
    return True


def test_an_interim_body_never_splits_the_client_connection(rig: Rig) -> None:
    rig.node.scripts["/interim-body"] = _interim_body
    sock = tls_socket(rig.serve.port, OPT_HOST)
    try:
        status, _ = h1(rig.serve.port, "GET", "/interim-body?v=1", sock=sock)
        if status == 200:  # relayed: the connection must still be in step
            target = "/plain?after=interim"
            status, body = h1(rig.serve.port, "GET", target, sock=sock)
            assert own_answer(target, status, body), (status, body[:200])
        else:
            assert status in (0, 502), status
    finally:
        forget(sock)
    settled(rig)


@pytest.mark.parametrize("status", [204, 304])
@pytest.mark.parametrize("split", [False, True])
def test_a_body_on_a_no_content_answer_never_answers_the_next_request(
        rig: Rig, status: int, split: bool) -> None:
    """A 204 or 304 followed by a response-shaped body, in the same TLS record or the
    next one: the client gets the 204/304, and the bytes after it answer nothing."""
    path = f"/nobody-{status}-{split}"
    head = b"HTTP/1.1 %d X\r\ncontent-length: 30\r\n\r\n" % status
    rig.node.scripts[path] = lambda c, r: (
        c.send(head, answer("/stolen")) if split else c.send(head + answer("/stolen"))) or True
    closed = rig.node.closed_after.get(path, 0)
    sock = tls_socket(rig.serve.port, OPT_HOST)
    try:
        for i in range(3):
            sock.sendall(request_bytes("GET", f"{path}?i={i}", OPT_HOST))
            assert read_response(sock).status == status
            target = f"/plain?i={i}"
            got, body = h1(rig.serve.port, "GET", target, sock=sock)
            assert own_answer(target, got, body), (target, got, body[:200])
    finally:
        forget(sock)
    assert rig.node.wait_closed_after(path, closed + 3)
    settled(rig)


def test_a_body_on_a_head_response_never_answers_the_next_request(rig: Rig) -> None:
    closed = rig.node.closed_after.get("/head-body", 0)
    sock = tls_socket(rig.serve.port, OPT_HOST)
    try:
        for i in range(3):
            sock.sendall(request_bytes("HEAD", f"/head-body?i={i}", OPT_HOST))
            assert read_response(sock, head_only=True).status == 200
            target = f"/plain?i={i}"
            status, body = h1(rig.serve.port, "GET", target, sock=sock)
            assert own_answer(target, status, body), (target, status, body[:200])
    finally:
        forget(sock)
    assert rig.node.wait_closed_after("/head-body", closed + 3)
    settled(rig)


# --- 2. broken answers: a defined answer, slots given back, nothing left behind ------------


def h2_client(port: int) -> H2Conn:
    """An HTTP/2 client that checks what it receives as a real client would."""
    client = H2Conn.__new__(H2Conn)
    client._start(tls_socket(port, OPT_HOST, alpn=("h2",)), OPT_HOST, validate=True)
    return client


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_a_broken_answer_is_a_502_on_both_legs_and_desyncs_nothing(rig: Rig, name: str) -> None:
    port = rig.serve.port
    target = f"/broken-{name}?v=1"
    status, body = h1(port, "GET", target)
    assert status in (0, 502), (name, status, body[:200])
    if name not in CLOSING:  # the edge closes the node's connection, never pools it
        assert rig.node.wait_closed_after(f"/broken-{name}", 1)
    client = h2_client(port)
    try:
        res = client.request("GET", target, content_type=None)
        # a 502, or an answer begun and then reset: never a body that looks complete
        assert res.status == 502 or res.reset is not None, (name, res)
        # the same connection, and the pool, still answer their own requests
        for i in range(3):
            res = client.request("GET", f"/plain?after={name}&i={i}", content_type=None)
            assert res.status == 200 and own_answer(f"/plain?after={name}&i={i}", 200,
                                                    res.body), (name, res)
    finally:
        client.close()
    for i in range(3):
        status, body = h1(port, "GET", f"/plain?h1={name}&i={i}")
        assert own_answer(f"/plain?h1={name}&i={i}", status, body) and status == 200
    settled(rig)


@pytest.mark.parametrize("path", ["/few-interim", "/big-field", "/http10"])
def test_odd_but_valid_answers_arrive_intact_on_both_legs(rig: Rig, path: str) -> None:
    port = rig.serve.port
    target = f"{path}?v=1"
    status, body = h1(port, "GET", target)
    assert status == 200 and own_answer(target, status, body)
    client = h2_client(port)
    try:
        res = client.request("GET", target, content_type=None)
        assert res.status == 200 and own_answer(target, 200, res.body), res
    finally:
        client.close()
    code, trace = nghttp(port, target)
    assert code == 0 and ":status: 200" in trace, trace[-2000:]
    settled(rig)


def test_a_node_head_over_the_edges_cap_is_a_502_on_both_legs(rig: Rig) -> None:
    """One field of 70 KB: over the 64 KiB the edge takes of a node's head, whichever
    leg the client came on (the cap is the node leg's own), and nothing of it is sent."""
    rig.node.scripts["/over-cap-head"] = lambda c, r: c.send(answer(
        r.target, extra=b"x-big: %b\r\n" % (b"b" * 70000))) or True
    status, body = h1(rig.serve.port, "GET", "/over-cap-head?v=1")
    assert status == 502, (status, body[:200])
    client = h2_client(rig.serve.port)
    try:
        res = client.request("GET", "/over-cap-head?v=2", content_type=None)
        assert res.status == 502 and "x-big" not in dict(res.headers), res.status
        res = client.request("GET", "/plain?after=over-cap", content_type=None)
        assert own_answer("/plain?after=over-cap", res.status or 0, res.body), res
    finally:
        client.close()
    settled(rig)


def test_a_node_head_over_what_the_h2_client_takes_is_a_502_on_its_stream(rig: Rig) -> None:
    """An HTTP/2 client that advertised SETTINGS_MAX_HEADER_LIST_SIZE of 8 KiB is not
    sent the node's 40 KB head (under the edge's own cap: an HTTP/1.1 client gets it
    whole): that stream is answered 502, and the connection's next stream is served."""
    port = rig.serve.port
    before = len(rig.serve.log_events())
    status, body = h1(port, "GET", "/big-field?leg=h1")
    assert own_answer("/big-field?leg=h1", status, body)
    client = h2_client(port)
    try:
        client.conn.update_settings({h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: 8192})
        client.sock.sendall(client.conn.data_to_send())
        res = client.request("GET", "/plain?before=big", content_type=None)
        assert own_answer("/plain?before=big", res.status or 0, res.body), res
        # the edge has acknowledged the setting (before that answer); the test's own
        # decoder takes any size from here on, so that what the edge sends is seen
        client.conn.decoder.max_header_list_size = 1 << 20
        res = client.request("GET", "/big-field?leg=h2", content_type=None)
        assert res.status == 502 and "x-big" not in dict(res.headers), (res.status, len(
            str(res.headers)))
        res = client.request("GET", "/plain?after=big", content_type=None)
        assert own_answer("/plain?after=big", res.status or 0, res.body), res
    finally:
        client.close()
    settled(rig)
    # the client's small setting is the cause: said so, and not blamed on the node
    events = {e.get("event") for e in rig.serve.log_events()[before:]}
    assert "response_head_over_client_limit" in events, events
    assert "upstream_bad_response" not in events, events


# --- 3. what the node may not say to a client -----------------------------------------------

HOP_HEAD = (b"HTTP/1.1 200 OK\r\n"
            b"Connection: X-Secret, X-Other\r\n"
            b"X-Secret: hop\r\nX-Other: hop\r\n"
            b"Keep-Alive: timeout=5\r\nProxy-Connection: keep-alive\r\nUpgrade: h2c\r\n"
            b"TE: trailers\r\nProxy-Authenticate: Basic\r\nTrailer: X-T\r\n"
            b"X-Kept: end-to-end\r\nTransfer-Encoding: chunked\r\n\r\n")
#: Fields no client may see from the edge (HTTP/2 forbids the first ones outright).
NEVER = {"connection", "keep-alive", "proxy-connection", "upgrade", "te",
         "transfer-encoding", "x-secret", "x-other", "proxy-authenticate"}


def _hop_fields(conn: Conn, req: Req) -> bool:
    body = json.dumps({"target": req.target}).encode()
    conn.send(HOP_HEAD + b"%x\r\n%b\r\n0\r\nX-T: trailer\r\n\r\n" % (len(body), body))
    return True


def _no_content_with_length(status: int, length: int) -> Script:
    def script(conn: Conn, req: Req) -> bool:
        conn.send(b"HTTP/1.1 %d X\r\ncontent-length: %d\r\nx-kept: 1\r\n\r\n"
                  % (status, length))
        return True
    return script


def nghttp(port: int, target: str, *extra: str) -> tuple[int, str]:
    """The nghttp2 client (a real HTTP/2 client's checks) for `target`: exit code, and
    its verbose trace of what it received."""
    proc = subprocess.run(
        ["nghttp", "-v", "-y", "-n", "-H", f":authority: {OPT_HOST}", *extra,
         f"https://{LOOPBACK}:{port}{target}"],
        check=False, capture_output=True, timeout=WAIT, text=True, errors="replace")
    return proc.returncode, proc.stdout + proc.stderr


@pytest.fixture
def hop_rig(rig: Rig) -> Rig:
    rig.node.scripts["/hop"] = _hop_fields
    rig.node.scripts["/204cl"] = _no_content_with_length(204, 5)
    rig.node.scripts["/204cl0"] = _no_content_with_length(204, 0)
    rig.node.scripts["/304cl"] = _no_content_with_length(304, 5)
    return rig


def test_hop_by_hop_fields_of_the_node_reach_no_client(hop_rig: Rig) -> None:
    port = hop_rig.serve.port
    sock = tls_socket(port, OPT_HOST)
    try:
        sock.sendall(request_bytes("GET", "/hop?v=1", OPT_HOST))
        resp = read_response(sock)
        assert own_answer("/hop?v=1", resp.status, resp.body)
        names = {k for k, _ in resp.headers}
        # the edge frames the client's leg itself: its own chunked, nothing of the node's
        assert resp.header("transfer-encoding") in (None, "chunked")
        assert not (names - {"transfer-encoding"}) & NEVER, resp.headers
        assert resp.header("x-kept") == "end-to-end"
    finally:
        forget(sock)
    client = h2_client(port)  # h2 refuses connection-specific fields as a client must
    try:
        res = client.request("GET", "/hop?v=2", content_type=None)
        assert res.status == 200 and own_answer("/hop?v=2", 200, res.body), res
        assert not {k for k, _ in res.headers} & NEVER, res.headers
    finally:
        client.close()
    code, trace = nghttp(port, "/hop?v=3")
    assert code == 0, trace[-2000:]
    settled(hop_rig)


@pytest.mark.parametrize("path", ["/204cl", "/204cl0", "/304cl"])
def test_a_no_content_answer_with_a_length_is_valid_http2(hop_rig: Rig, path: str) -> None:
    """RFC 9110 §8.6: no Content-Length in a 204; a 304's describes the selected
    representation. nghttp2 resets a 204 stream whose length is not 0 (a protocol error
    to a real client), so the edge must not pass such a length on."""
    port = hop_rig.serve.port
    status, _ = h1(port, "GET", f"{path}?v=1")
    assert status == int(path[1:4])
    code, trace = nghttp(port, f"{path}?v=2")
    assert code == 0 and f":status: {path[1:4]}" in trace, trace[-2000:]
    assert "RST_STREAM" not in trace and "PROTOCOL_ERROR" not in trace, trace[-2000:]
    # the pooled connection answers the next request with its own answer
    status, body = h1(port, "GET", "/plain?after=nocontent")
    assert own_answer("/plain?after=nocontent", status, body)
    settled(hop_rig)


# --- 4. the edge's memory, whatever the node sends -------------------------------------------

MIB = 1 << 20
PIECE = b"a" * 65536


def _stream_out(conn: Conn, total: int) -> None:
    while total > 0:
        conn.tls.sendall(PIECE[:min(total, len(PIECE))])
        total -= len(PIECE)


def _endless(conn: Conn, req: Req) -> bool:
    """A head, a chunk-size line or a trailer that never ends (`what`), after `body`
    bytes of chunked body: the node writes `size` bytes of it, then closes."""
    q = req.query
    what, body, size = q["what"], int(q.get("body", "0")), int(q["size"])
    if what == "head":
        conn.tls.sendall(b"HTTP/1.1 200 OK\r\nx-a: ")
        _stream_out(conn, size)
        return False
    conn.tls.sendall(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
    while body > 0:
        n = min(body, len(PIECE))
        conn.tls.sendall(b"%x\r\n%b\r\n" % (n, PIECE[:n]))
        body -= n
    conn.tls.sendall(b"5;ext=" if what == "chunk_line" else b"0\r\nx-t: ")
    _stream_out(conn, size)
    return False


def drain(sock: ssl.SSLSocket) -> bytes:
    """The last bytes that arrive before the edge closes the connection."""
    last = b""
    with contextlib.suppress(ConnectionError, ssl.SSLError):
        while data := sock.recv(1 << 20):
            last = (last + data)[-16:]
    return last


def peak_reset(serve: Serve) -> None:
    """Start the serve process's peak RSS (`VmHWM`) again from its current RSS."""
    Path(f"/proc/{serve.proc.pid}/clear_refs").write_text("5")


def peak_kib(serve: Serve) -> int:
    for line in Path(f"/proc/{serve.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise KeyError("VmHWM")


@pytest.mark.parametrize("what,body", [("head", 0), ("chunk_line", 0), ("chunk_line", 8),
                                       ("trailer", 0), ("trailer", 8)])
def test_what_never_ends_costs_the_edge_a_bounded_amount_of_memory(
        rig: Rig, what: str, body: int) -> None:
    """The node writes 16 MiB of one head field, one chunk-size line or one trailer,
    after `body` MiB of chunked body the client reads: the edge gives up on it within
    its bounds (a few times 64 KiB), never holding what the node sends."""
    rig.node.scripts["/endless"] = _endless
    port = rig.serve.port
    h1(port, "GET", "/plain?warm=1")  # the pool's connection and its TLS are made
    peak_reset(rig.serve)
    before = peak_kib(rig.serve)
    target = f"/endless?what={what}&body={body * MIB}&size={16 * MIB}"
    sock = tls_socket(port, OPT_HOST)
    try:
        sock.sendall(request_bytes("GET", target, OPT_HOST))
        head = read_response(sock, head_only=True)
        if head.status != 502:  # the answer had begun: it is cut, never ended
            assert head.status == 200 and not drain(sock).endswith(b"\r\n0\r\n\r\n")
    finally:
        forget(sock)
    grown = peak_kib(rig.serve) - before
    assert grown < 6 * 1024, (what, body, f"peak RSS grew {grown} KiB")
    status, resp = h1(port, "GET", "/plain?after=endless")
    assert own_answer("/plain?after=endless", status, resp)
    settled(rig)


class Huge:
    """`/huge?size=N`: a Content-Length answer of N bytes, written as fast as the edge
    takes it; `sent` counts what the node managed to hand to its kernel."""

    def __init__(self) -> None:
        self.sent = 0

    def __call__(self, conn: Conn, req: Req) -> bool:
        size = int(req.query["size"])
        conn.tls.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % size)
        self.sent = 0
        while self.sent < size:
            n = min(size - self.sent, len(PIECE))
            conn.tls.sendall(PIECE[:n])
            self.sent += n
        return True


@pytest.mark.parametrize("leg", ["h1", "h2"])
def test_a_huge_answer_to_a_client_that_does_not_read_is_not_buffered(rig: Rig, leg: str) -> None:
    """64 MiB for a client that stops reading after the head: the edge reads from the
    node only as fast as the client takes it (the node is held up, the edge's memory is
    not), and when the client leaves, the node connection is closed, not pooled."""
    huge = rig.node.scripts["/huge"] = Huge()
    port = rig.serve.port
    h1(port, "GET", "/plain?warm=1")
    peak_reset(rig.serve)
    before = peak_kib(rig.serve)
    size = 64 * MIB
    if leg == "h1":
        sock = tls_socket(port, OPT_HOST, rcvbuf=65536)
        sock.sendall(request_bytes("GET", f"/huge?size={size}", OPT_HOST))
        assert read_response(sock, head_only=True).status == 200
    else:
        client = H2Conn(port, OPT_HOST)
        sid = client.open_bare("GET", f"/huge?size={size}")
        client.conn.end_stream(sid)
        client.sock.sendall(client.conn.data_to_send())
    deadline = time.monotonic() + 1.0  # the node fills what buffers there are, then waits
    while time.monotonic() < deadline:
        time.sleep(0.1)
    grown = peak_kib(rig.serve) - before
    assert huge.sent < size // 2, huge.sent
    assert grown < 8 * 1024, (leg, f"peak RSS grew {grown} KiB")
    during = rig.node.open_connections()
    if leg == "h1":
        forget(sock)
    else:
        client.sock.close()
    # the abandoned answer's node connection is closed, never pooled for another request
    deadline = time.monotonic() + WAIT
    while rig.node.open_connections() >= during and time.monotonic() < deadline:
        time.sleep(0.05)
    assert rig.node.open_connections() == during - 1
    status, body = h1(port, "GET", "/plain?after=huge")
    assert own_answer("/plain?after=huge", status, body)
    settled(rig)


# --- 5. an answer before the request body was read -------------------------------------------


def answers_logged(serve: Serve, path: str, statuses: tuple[int, ...]) -> set[Any]:
    """The statuses the serve's access log shows for `path`, once there is one and all
    are among `statuses` (or when the wait is over)."""
    deadline = time.monotonic() + WAIT
    while True:
        seen = {e.get("status") for e in serve.log_events()
                if e.get("event") == "request" and e.get("path") == path}
        if (seen and seen <= set(statuses)) or time.monotonic() > deadline:
            return seen
        time.sleep(0.05)


def _early(then: str) -> Script:
    """Answers as soon as the head is in, then: "close" (the body unread), "drain" (reads
    the body and serves the connection on) or "stall" (neither reads nor closes)."""
    def script(conn: Conn, req: Req) -> bool:
        conn.send(answer(req.target, 413 if then == "close" else 200,
                         b"connection: close\r\n" if then == "close" else b""))
        if then == "drain":
            conn.read_body(req)
            return True
        if then == "stall":
            time.sleep(8)
        return False
    script.early = True  # type: ignore[attr-defined]
    return script


UPLOAD = 4 * MIB


def upload_h1(port: int, target: str) -> tuple[int, bytes]:
    sock = tls_socket(port, OPT_HOST)
    data = request_bytes("POST", target, OPT_HOST, body=b"u" * UPLOAD,
                         content_type="application/octet-stream")
    try:
        resp = read_response(Uploading(sock, data))  # type: ignore[arg-type]
        return resp.status, resp.body
    except (ConnectionError, ssl.SSLError):
        return 0, b""
    finally:
        forget(sock)


def upload(port: int, target: str, leg: str,
           on_h2: Callable[[H2Conn, Any], None] | None = None) -> tuple[int, bytes]:
    """An upload on the `leg` ("h1": whole, as `upload_h1`; "h2": a quarter of it, the
    test's HTTP/2 client taking its time per window); `on_h2` looks at the HTTP/2
    answer, and may use its connection, before that is closed. (status, body)."""
    if leg == "h1":
        return upload_h1(port, target)
    client = H2Conn(port, OPT_HOST)
    try:
        res = client.request("POST", target, body=b"u" * (UPLOAD // 4),
                             content_type="application/octet-stream")
        if on_h2 is not None:
            on_h2(client, res)
    finally:
        client.close()
    return res.status or 0, res.body


@pytest.mark.parametrize("then,leg", [("close", "h1"), ("close", "h2"), ("drain", "h1"),
                                      ("drain", "h2"), ("stall", "h1")])
def test_an_answer_before_the_body_was_read_is_defined_and_desyncs_nothing(
        rig: Rig, then: str, leg: str) -> None:
    path = f"/early-{then}"
    rig.node.scripts[path] = _early(then)
    port = rig.serve.port
    target = f"{path}?leg={leg}"
    status, body = upload(port, target, leg)
    if then == "drain":  # the node read the whole body: its answer, intact
        assert own_answer(target, status, body), (status, body[:200])
    else:
        # the node's early answer or the edge's for the link that broke (close); 504 when
        # the node stopped taking the body (stall), or its early answer when all of the
        # body fitted in the buffers between; a client still uploading past the edge's
        # linger bound may see the close instead (0): the access log says which answer
        # it was given
        wanted = (413, 502) if then == "close" else (200, 504)
        assert status in (0, *wanted), (status, body[:200])
        if status == 200:
            assert own_answer(target, status, body), body[:200]
        seen = answers_logged(rig.serve, path, wanted)
        assert seen and seen <= set(wanted), (seen, rig.serve.logs()[-3000:])
    for i in range(2):
        status, body = h1(port, "GET", f"/plain?after={then}&i={i}")
        assert own_answer(f"/plain?after={then}&i={i}", status, body)
    settled(rig)


@pytest.mark.parametrize("leg", ["h1", "h2"])
def test_an_early_answer_the_node_closes_after_is_relayed_whole(rig: Rig, leg: str) -> None:
    """The node answers 413 with `Connection: close` as soon as the head is in, then
    closes with the body unread (RFC 9112 §9.3 lets a server do so). Its answer is whole
    in the edge's receive buffer when the edge's next body write fails: that answer is
    the client's, not a 502 for the link the node closed. HTTP/1.1 says it closes, and
    HTTP/2 ends the stream (the rest of the upload is then refused with
    RST_STREAM(NO_ERROR)); the connection still serves what follows."""
    path = "/early-close-relayed"
    rig.node.scripts[path] = _early("close")
    port = rig.serve.port
    client = H2Conn(port, OPT_HOST) if leg == "h2" else None
    try:
        for i in range(3):
            target = f"{path}?leg={leg}&i={i}"
            if client is None:
                sock = tls_socket(port, OPT_HOST)
                data = request_bytes("POST", target, OPT_HOST, body=b"u" * UPLOAD,
                                     content_type="application/octet-stream")
                try:
                    resp = read_response(Uploading(sock, data))  # type: ignore[arg-type]
                finally:
                    forget(sock)
                assert resp.status == 413, (i, resp.status, resp.body[:200])
                assert resp.header("connection") == "close", resp.headers
                body = resp.body
            else:
                res = client.request("POST", target, body=b"u" * (UPLOAD // 4),
                                     content_type="application/octet-stream")
                assert res.status == 413 and res.reset in (None, 0), (i, res)
                body = res.body
            assert json.loads(body) == {"target": target}, body[:200]
        if client is not None:  # the stream ended, the connection did not
            res = client.request("GET", "/plain?after=early-h2", content_type=None)
            assert own_answer("/plain?after=early-h2", res.status or 0, res.body), res
    finally:
        if client is not None:
            client.close()
    assert answers_logged(rig.serve, path, (413,)) == {413}
    settled(rig)


def _reset(sock: socket.socket) -> None:
    """Leave as a client that gives up does: its connection reset (an abortive close,
    or a close with bytes of ours left unread). A bare FIN is not leaving: it is what a
    client that half-closed after its request and still waits for the answer sends."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_a_client_that_leaves_while_the_node_handshake_hangs_is_let_go(
        request: pytest.FixtureRequest, engine: str) -> None:
    """An HTTP/1.1 client sends a request to a route whose node never completes the TLS
    handshake, then leaves (its connection reset): the edge gives up on the node at
    once, not at its 10 s connect timeout, and the connection is no longer counted.
    Every engine (`ENGINES`): the lane cancels its task's connect when it sees the
    reset, the trio engine watches for one while the node is asked. (A bare FIN cannot
    be told from a client that half-closed after its request and still waits for the
    answer, which the edge serves: the next test.)"""
    fixture, body = ENGINES[engine]
    rig = request.getfixturevalue(fixture)
    assert rig.serve.wait_open_connections(0) == 0
    sock = tls_socket(rig.serve.port, TARPIT_HOST)
    try:
        data = request_bytes("POST" if body else "GET", f"/hangs?{engine}", TARPIT_HOST,
                             body=b"b" * body, content_type="application/octet-stream")
        sock.sendall(data[:len(data) - body // 2])  # (an upload still under way)
        assert rig.serve.wait_open_connections(1) == 1
        time.sleep(0.3)  # the edge is in its handshake with the node by now
        _reset(sock)
    finally:
        forget(sock)
    # well under the connect timeout, and past it it would reach 0 anyway
    assert rig.serve.wait_open_connections(0, timeout=5.0) == 0
    status, answer = h1(rig.serve.port, "GET", "/plain?after=tarpit")
    assert own_answer("/plain?after=tarpit", status, answer)
    settled(rig)


@pytest.mark.parametrize("engine", ["lane", "trio"])
def test_a_client_that_closes_before_reading_anything_is_let_go(
        request: pytest.FixtureRequest, engine: str) -> None:
    """A client whose TLS Finished and first request arrive in one write (the edge keeps
    its session tickets to leave with the answer, so the client has nothing of ours to
    read) closes with a bare FIN while the edge connects to a node whose handshake
    hangs. The FIN alone could be a half-close, so the edge sends what it held: this
    client's kernel answers with a reset, and the node's connect is given up at once,
    not at its 10 s timeout. Both engines (`ENGINES`)."""
    rig = request.getfixturevalue(ENGINES[engine][0])
    assert rig.serve.wait_open_connections(0) == 0
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.set_alpn_protocols(["http/1.1"])
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = ctx.wrap_bio(incoming, outgoing, server_hostname=TARPIT_HOST)
    sock = socket.create_connection((LOOPBACK, rig.serve.port), timeout=WAIT)
    try:
        assert bio_handshake(sock, tls, incoming, outgoing), "the edge closed in the handshake"
        tls.write(request_bytes("GET", "/hangs?finished-and-request", TARPIT_HOST))
        sock.sendall(outgoing.read())  # the Finished and the request in one write
        assert rig.serve.wait_open_connections(1) == 1
        time.sleep(0.3)  # the edge is in its handshake with the node by now
    finally:
        sock.close()  # nothing unread: a FIN
    assert rig.serve.wait_open_connections(0, timeout=5.0) == 0
    settled(rig)


@pytest.mark.parametrize("how", ["reset", "half-close"])
@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_a_client_that_resets_while_the_node_thinks_is_let_go(
        request: pytest.FixtureRequest, engine: str, how: str) -> None:
    """The node has the whole request and takes its time over the answer. A client that
    resets its connection meanwhile is let go at once (499 in the access log, the
    connection no longer counted), not when the node answers (10 s) or at the header
    timeout; one that only half-closes still gets the answer. The lane sees the reset
    on the client's socket; the trio engine watches for it while the node is asked
    (through the readiness hub when the socket is in it, else with a task)."""
    fixture, body = ENGINES[engine]
    rig = request.getfixturevalue(fixture)
    path = f"/thinks-{engine}-{how}"
    released = threading.Event()

    def thinks(conn: Conn, req: Req) -> bool:
        released.wait(10.0)
        conn.send(answer(req.target))
        return True

    rig.node.scripts[path] = thinks
    try:
        assert rig.serve.wait_open_connections(0) == 0
        sock = tls_socket(rig.serve.port, OPT_HOST)
        try:
            sock.sendall(request_bytes("POST" if body else "GET", path, OPT_HOST,
                                       body=b"b" * body,
                                       content_type="application/octet-stream"))
            deadline = time.monotonic() + WAIT
            while not any(r.target == path for r in rig.node.requests):
                assert time.monotonic() < deadline, "the node never got the request"
                time.sleep(0.02)
            if how == "reset":
                _reset(sock)
            else:
                # the FIN alone, below TLS (on a copy of the descriptor: the TLS
                # socket's own shutdown would drop its TLS state)
                with socket.fromfd(sock.fileno(), socket.AF_INET, socket.SOCK_STREAM) as dup:
                    dup.shutdown(socket.SHUT_WR)
                time.sleep(0.3)  # the edge has seen it by now
                released.set()
                resp = read_response(sock)
                assert resp.status == 200 and json.loads(resp.body) == {"target": path}
        finally:
            forget(sock)
        assert rig.serve.wait_open_connections(0, timeout=5.0) == 0
        wanted = (499,) if how == "reset" else (200,)
        assert answers_logged(rig.serve, path, wanted) == set(wanted)
    finally:
        released.set()
    settled(rig)


def test_a_node_that_refuses_connections_is_a_503_on_both_legs(rig: Rig) -> None:
    """A new node connection that fails (nothing listens on the node's port) is the
    defined `503` with `Retry-After`, on HTTP/1.1 as on HTTP/2."""
    for i in range(2):
        sock = tls_socket(rig.serve.port, REFUSED_HOST)
        try:
            sock.sendall(request_bytes("GET", f"/refused?i={i}", REFUSED_HOST))
            resp = read_response(sock)
        finally:
            forget(sock)
        assert resp.status == 503 and resp.header("retry-after"), (resp.status, resp.body)
    client = H2Conn(rig.serve.port, REFUSED_HOST)
    try:
        res = client.request("GET", "/refused?leg=h2", content_type=None)
        assert res.status == 503, res
    finally:
        client.close()
    settled(rig)


# --- 6. many clients on one pool, the node misbehaving between their answers -----------------


def test_clients_sharing_the_pool_each_get_their_own_answer(rig: Rig) -> None:
    """Four HTTP/1.1 clients and one HTTP/2 client with four streams at a time share the
    route's pool while the node slips second responses, broken answers and bodies on
    HEAD answers between the good ones: every 200 carries its own request's target."""
    port = rig.serve.port
    paths = ["/plain", "/dup-same-read", "/plain", "/broken-cl_and_te", "/dup-same-record",
             "/broken-interim_flood"]
    wrong: list[Any] = []
    answered = [0]
    lock = threading.Lock()

    def note(target: str, status: int, body: bytes) -> None:
        good = own_answer(target, status, body) if status == 200 else status in (0, 502)
        with lock:
            answered[0] += 1
            if not good or ("/broken" in target and status == 200):
                wrong.append((target, status, body[:100]))

    def h1_client(c: int) -> None:
        sock = tls_socket(port, OPT_HOST)
        try:
            for i in range(12):
                path = paths[(c + i) % len(paths)]
                method = "POST" if i % 3 == 2 else "GET"
                target = f"{path}?c={c}&i={i}"
                if path == "/dup-same-read" and i % 4 == 1:
                    sock.sendall(request_bytes("HEAD", f"/head-body?c={c}&i={i}", OPT_HOST))
                    with lock:
                        answered[0] += 1
                        if read_response(sock, head_only=True).status != 200:
                            wrong.append(("HEAD", c, i))
                    continue
                status, body = h1(port, method, target, sock=sock)
                note(target, status, body)
                if status in (0, 502) and "/broken" in target:
                    forget(sock)  # an answer cut short closes the connection
                    sock = tls_socket(port, OPT_HOST)
        finally:
            forget(sock)

    def h2_client() -> None:
        client = H2Conn(port, OPT_HOST)
        try:
            for r in range(3):
                sids = {}
                for s in range(4):
                    target = f"{paths[(r + s) % len(paths)]}?h2={r}.{s}"
                    sid = client.open_bare("GET", target)
                    client.conn.end_stream(sid)
                    sids[sid] = target
                client.sock.sendall(client.conn.data_to_send())
                for sid, target in sids.items():
                    res: H2Result = client.wait(sid)
                    note(target, 0 if res.reset is not None else res.status or 0, res.body)
        finally:
            client.close()

    threads = [threading.Thread(target=h1_client, args=(c,)) for c in range(4)]
    threads.append(threading.Thread(target=h2_client))
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT * 2)
    assert not any(t.is_alive() for t in threads)
    assert answered[0] == 4 * 12 + 3 * 4
    assert not wrong, wrong
    settled(rig)


# --- 7. a node that stops in the middle of an answer -----------------------------------------


def _stall_mid_body(conn: Conn, req: Req) -> bool:
    """The head and part of the body, then nothing (the connection left open)."""
    conn.send(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\npartial")
    time.sleep(10)
    return False


def test_a_node_that_stops_mid_body_is_cut_off_on_both_legs(rig: Rig) -> None:
    """After the route's idle timeout (3 s here) without a byte, the HTTP/1.1 client's
    connection is dropped and the HTTP/2 client's stream reset: neither is left waiting,
    nor given a short body that looks complete."""
    rig.node.scripts["/stall-body"] = _stall_mid_body
    port = rig.serve.port
    results: dict[str, Any] = {}

    def h1_leg() -> None:
        sock = tls_socket(port, OPT_HOST)
        try:
            sock.sendall(request_bytes("GET", "/stall-body?leg=h1", OPT_HOST))
            got = b""
            with contextlib.suppress(ConnectionError, ssl.SSLError):
                while data := sock.recv(65536):
                    got += data
            results["h1"] = got
        finally:
            forget(sock)

    def h2_leg() -> None:
        client = H2Conn(port, OPT_HOST)
        try:
            results["h2"] = client.request("GET", "/stall-body?leg=h2", content_type=None)
        finally:
            client.close()

    threads = [threading.Thread(target=h1_leg), threading.Thread(target=h2_leg)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT)
    got = results["h1"]  # the head and what came of the body, then the close
    assert got.startswith(b"HTTP/1.1 200 ") and got.endswith(b"\r\n\r\npartial"), got
    res = results["h2"]
    assert res.status == 200 and res.reset is not None and res.body == b"partial", res
    settled(rig)


def test_a_node_that_closes_after_its_head_gets_the_client_a_502(rig: Rig) -> None:
    """Nothing of the answer reached an HTTP/1.1 client yet (a head with a length waits
    for the first body bytes): the client is told 502, not left with a silent close it
    may take for a dead keep-alive connection and send its request again."""
    rig.node.scripts["/head-then-close"] = _fixed(
        b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n", keep=False)
    sock = tls_socket(rig.serve.port, OPT_HOST)
    try:
        status, _ = h1(rig.serve.port, "GET", "/head-then-close?v=1", sock=sock)
        assert status == 502
    finally:
        forget(sock)
    client = h2_client(rig.serve.port)
    try:  # HTTP/2 sends the head at once: then the stream is reset
        res = client.request("GET", "/head-then-close?v=2", content_type=None)
        assert res.status == 502 or (res.status == 200 and res.reset is not None), res
    finally:
        client.close()
    settled(rig)


#: What a node may write before it closes with the request body unread, and what the
#: edge may make of it: never anything that was not one whole final answer.
EARLY_ODD = {
    "interim": (b"HTTP/1.1 100 Continue\r\n\r\n", (502,)),
    "switch": (b"HTTP/1.1 101 Switching Protocols\r\nupgrade: x\r\nconnection: upgrade\r\n\r\n",
               (502,)),
    "partial-head": (b"HTTP/1.1 413 Too Large\r\ncontent-le", (502,)),
    "interim-then-partial": (b"HTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\nHTTP/1.1 41",
                             (502,)),
    "extra-response": ((b"HTTP/1.1 413 Too Large\r\nconnection: close\r\ncontent-length: 4"
                        b"\r\n\r\nbig!HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nEVIL!"),
                       (413, 502)),
}


@pytest.mark.parametrize("leg", ["h1", "h2"])
@pytest.mark.parametrize("name", sorted(EARLY_ODD))
def test_what_a_node_writes_before_it_closes_early_is_relayed_only_if_whole(
        rig: Rig, name: str, leg: str) -> None:
    """A node that writes something (an interim head, a 101, a head cut short, an answer
    and a second response after it) and closes without reading the upload: the client
    gets a 502, or the one whole final answer with its own body; never the interim or
    101 head, never the second response."""
    wire, wanted = EARLY_ODD[name]
    path = f"/early-odd-{name}"

    def script(conn: Conn, req: Req) -> bool:
        conn.send(wire)
        return False
    script.early = True  # type: ignore[attr-defined]
    rig.node.scripts[path] = script
    port = rig.serve.port
    target = f"{path}?leg={leg}"

    def served_after(client: H2Conn, res: Any) -> None:
        assert res.reset in (None, 0), res
        after = client.request("GET", f"/plain?after={name}", content_type=None)
        assert own_answer(f"/plain?after={name}", after.status or 0, after.body), after
    status, body = upload(port, target, leg, served_after)
    # 0: an HTTP/1.1 client still uploading past the edge's linger may see the close
    assert status in (0, *wanted), (status, body[:200])
    assert b"EVIL" not in body, body[:200]
    if status == 413:
        assert body == b"big!", body[:200]
    seen = answers_logged(rig.serve, path, wanted)
    assert seen and seen <= set(wanted), (seen, rig.serve.logs()[-3000:])
    for i in range(2):
        status, body = h1(port, "GET", f"/plain?after={name}&i={i}")
        assert own_answer(f"/plain?after={name}&i={i}", status, body)
    settled(rig)


def test_a_client_whose_header_list_size_fits_no_head_gets_resets_then_answers(
        rig: Rig) -> None:
    """An HTTP/2 client that advertises SETTINGS_MAX_HEADER_LIST_SIZE 0 (and then 20):
    no head fits, not even the edge's own 502, so its streams are reset and nothing of a
    head is sent; the connection lives on, and once the client raises the setting the
    next answer arrives and decodes (the edge's HPACK encoder encoded nothing for the
    heads it refused, so its table still agrees with the client's). The client's own
    setting is no fault to warn the operator of, request after request."""
    before = len(rig.serve.log_events())
    client = h2_client(rig.serve.port)
    try:
        for i, size in enumerate((0, 20)):
            client.conn.update_settings({h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: size})
            client.sock.sendall(client.conn.data_to_send())
            client.conn.decoder.max_header_list_size = 1 << 20  # so a head would be seen
            res = client.request("GET", f"/plain?tiny={i}", content_type=None)
            assert res.status is None and res.reset is not None, res
        client.conn.update_settings({h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: 100_000})
        client.sock.sendall(client.conn.data_to_send())
        for i in range(2):
            res = client.request("GET", f"/plain?raised={i}", content_type=None)
            assert own_answer(f"/plain?raised={i}", res.status or 0, res.body), res
    finally:
        client.close()
    settled(rig)
    warned = [e for e in rig.serve.log_events()[before:] if e.get("level") != "info"]
    assert not warned, warned


def test_an_early_answer_on_one_h2_stream_leaves_a_concurrent_upload_whole(rig: Rig) -> None:
    """Two uploads at once on one HTTP/2 connection: one to a node that answers early and
    closes with the body unread, one read whole. The first gets its 413 (the rest of its
    upload refused), the second its own answer with every byte taken."""
    early, plain = "/early-concurrent", "/plain-concurrent"
    rig.node.scripts[early] = _early("close")
    client = H2Conn(rig.serve.port, OPT_HOST)
    sizes = {"a": 3 * 65_536 + 123, "b": MIB}
    try:
        a = client.open_stream("POST", f"{plain}?c=1", length=sizes["a"])
        b = client.open_stream("POST", f"{early}?c=1", length=sizes["b"])
        left = {a: sizes["a"], b: sizes["b"]}
        deadline = time.monotonic() + WAIT
        while left:  # bounded by the deadline
            assert time.monotonic() < deadline, left
            for sid in list(left):
                if sid in client._done:
                    del left[sid]
                    continue
                room = min(client.conn.local_flow_control_window(sid),
                           client.conn.max_outbound_frame_size, left[sid])
                if room > 0:
                    left[sid] -= room
                    client.conn.send_data(sid, b"c" * room, end_stream=not left[sid])
                    if not left[sid]:
                        del left[sid]
            client.sock.sendall(client.conn.data_to_send())
            if left:
                client._pump(until=lambda: any(
                    s in client._done or client.conn.local_flow_control_window(s) > 0
                    for s in left), timeout=WAIT)
        res_b = client.wait(b)
        res_a = client.wait(a)
        assert own_answer(f"{plain}?c=1", res_a.status or 0, res_a.body), res_a
        assert res_b.status == 413 and json.loads(res_b.body) == {"target": f"{early}?c=1"}, \
            res_b
        res = client.request("GET", "/plain?after=concurrent", content_type=None)
        assert own_answer("/plain?after=concurrent", res.status or 0, res.body), res
    finally:
        client.close()
    got = [r for r in rig.node.requests if r.target == f"{plain}?c=1"]
    assert [len(r.body) for r in got] == [sizes["a"]], [len(r.body) for r in got]
    settled(rig)

