"""The keep-alive lane's multiplexed node leg (`net/h2_node.py`), end to end: a real
`serve` in front of a real HTTP/2 node (hypercorn, pinned TLS on loopback), driven by
real HTTP/1.1 clients (curl, httpx, raw sockets).

The invariants: the lane's exchanges reach the node as streams of one HTTP/2 connection
(the node sees HTTP/2 and one client port), every answer arrives whole and in order on
each client connection, what is not whole at once is relayed as it comes, a client that
leaves has its stream reset at the node, a late head is 504, the seal posture holds on
the new leg (nothing unsealed reaches the node), and with `PACT_INGRESS_NODE_H2=0` the
same node is spoken to over HTTP/1.1.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import httpx
import pytest

from tests.netutil import bio_handshake, free_port
from tests.terminate_env import (
    HOST,
    LOOPBACK,
    OPT_HOST,
    Serve,
    make_identities,
    rpc,
    unsealed_call_body,
)
from tests.tools import require

APP = '''
import asyncio, json

SEEN = []  # (http_version, client port, path, authority/host, forwarded)
GONE = []  # paths whose client went away before the answer ended


async def app(scope, receive, send):
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    path = scope["path"]
    headers = dict(scope["headers"])
    if path == "/seen":
        out = json.dumps({"seen": SEEN, "gone": GONE}).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(len(out)).encode())]})
        await send({"type": "http.response.body", "body": out})
        return
    SEEN.append([scope["http_version"], scope["client"][1], path,
                 headers.get(b"host", b"").decode(), headers.get(b"forwarded", b"").decode()])
    if path.startswith("/early"):  # answered before the body is read
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-length", b"0")]})
        await send({"type": "http.response.body", "body": b""})
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    if path.startswith("/hang"):
        while (await receive())["type"] != "http.disconnect":
            pass
        GONE.append(path)
        return
    if path.startswith("/slow/"):
        await asyncio.sleep(float(path.rsplit("/", 1)[1]))
    if path.startswith("/stream/"):
        n = int(path.rsplit("/", 1)[1])
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        for i in range(n):
            await send({"type": "http.response.body", "body": b"data: %d\\n\\n" % i,
                        "more_body": True})
            await asyncio.sleep(0.05)
        await send({"type": "http.response.body", "body": b""})
        return
    if path == "/echo" or path == "/mcp":
        out = body
    elif path.startswith("/big/"):
        n = int(path.rsplit("/", 1)[1])
        out = (b"0123456789abcdef" * (n // 16 + 1))[:n]
    else:
        out = json.dumps({"path": path, "version": scope["http_version"]}).encode()
    fields = [(b"x-got", str(len(body)).encode())]
    if path != "/nolength":
        fields.append((b"content-length", str(len(out)).encode()))
    await send({"type": "http.response.start", "status": 200, "headers": fields})
    await send({"type": "http.response.body", "body": out})
'''


@dataclass
class H2Node:
    """hypercorn serving `APP` over TLS with the node's identity (ALPN h2, http/1.1)."""

    tmp: Path
    cert: Path
    key: Path

    def __post_init__(self) -> None:
        (self.tmp / "h2app.py").write_text(APP)
        self.port = free_port()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "hypercorn", "--certfile", str(self.cert), "--keyfile",
             str(self.key), "--bind", f"{LOOPBACK}:{self.port}", "--keep-alive", "30",
             "h2app:app"], cwd=self.tmp, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while True:
            assert self.proc.poll() is None, "the node exited"
            try:
                socket.create_connection((LOOPBACK, self.port), timeout=1).close()
                return
            except OSError:
                assert time.monotonic() < deadline, "the node never listened"
                time.sleep(0.1)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


@dataclass
class Rig:
    serve: Serve
    node: H2Node

    def get(self, path: str, host: str = OPT_HOST) -> httpx.Response:
        with client() as c:
            return get(c, self.serve, path, host)

    def seen(self) -> dict:
        """What the node saw (asked over HTTP/1.1 directly, not through the edge)."""
        ctx = ssl.create_default_context()
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
        with httpx.Client(verify=ctx, http1=True, http2=False, timeout=10) as c:
            return c.get(f"https://{LOOPBACK}:{self.node.port}/seen").json()


def client() -> httpx.Client:
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    return httpx.Client(verify=ctx, http1=True, http2=False, timeout=20)


def url(serve: Serve, path: str, host: str = OPT_HOST) -> str:
    return f"https://{host}:{serve.port}{path}"


def send(c: httpx.Client, serve: Serve, method: str, path: str, host: str = OPT_HOST,
         **kw: object) -> httpx.Request:
    """A request to `host` on the edge's loopback port (SNI and Host: `host`)."""
    headers = {"host": host, **kw.pop("headers", {})}  # type: ignore[dict-item]
    return c.build_request(method, f"https://{LOOPBACK}:{serve.port}{path}", headers=headers,
                           extensions={"sni_hostname": host}, **kw)  # type: ignore[arg-type]


def get(c: httpx.Client, serve: Serve, path: str, host: str = OPT_HOST) -> httpx.Response:
    return c.send(send(c, serve, "GET", path, host))


def _rig(tmp: Path, env: dict[str, str]) -> Iterator[Rig]:
    ids = make_identities(tmp)
    node = H2Node(tmp, ids.node.cert_path, ids.node.key_path)
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        serve = Serve(tmp, node, ids.node.fingerprint, workers=1,  # type: ignore[arg-type]
                      limits={"idle_timeout": 5, "calls_per_hour_per_ip": 1000000,
                              "max_requests_in_flight_per_ip": 200})
    except BaseException:
        node.stop()
        raise
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    yield Rig(serve, node)
    serve.stop()
    node.stop()


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    yield from _rig(tmp_path_factory.mktemp("node_h2"), {})


@pytest.fixture(scope="module")
def h1_rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    yield from _rig(tmp_path_factory.mktemp("node_h2_off"), {"PACT_INGRESS_NODE_H2": "0"})


def _resolve(serve: Serve, host: str = OPT_HOST) -> list[str]:
    return ["--resolve", f"{host}:{serve.port}:{LOOPBACK}"]


def test_keep_alive_exchanges_go_as_streams_of_one_connection(rig: Rig) -> None:
    curl = require("curl")
    before = len(rig.seen()["seen"])
    paths = [f"/n/{i}" for i in range(40)]
    out = subprocess.run(
        [curl, "-sk", "--http1.1", *_resolve(rig.serve), *(
            x for p in paths for x in ("-o", "-", url(rig.serve, p)))],
        capture_output=True, timeout=60).stdout
    bodies = [json.loads(line) for line in out.replace(b"}{", b"}\n{").splitlines()]
    assert [b["path"] for b in bodies] == paths
    assert {b["version"] for b in bodies} == {"2"}  # the node was spoken to over HTTP/2
    seen = [s for s in rig.seen()["seen"][before:] if s[2].startswith("/n/")]
    assert [s[2] for s in seen] == paths
    assert len({s[1] for s in seen}) == 1  # one node connection for all of them
    assert {s[3] for s in seen} == {OPT_HOST}  # :authority is the route's host
    assert all(s[4].startswith("for=") for s in seen)  # Forwarded, as over HTTP/1.1


def test_many_clients_at_once_share_the_session_and_get_their_own_answers(rig: Rig) -> None:
    """24 keep-alive connections, 10 requests each, all in flight together: each answer
    is its own request's (the path echoed), whole, and the node saw HTTP/2 only."""
    import concurrent.futures

    def one(i: int) -> list[str]:
        with client() as c:
            return [get(c, rig.serve, f"/c/{i}/{j}").json()["path"] for j in range(10)]

    with concurrent.futures.ThreadPoolExecutor(24) as pool:
        got = list(pool.map(one, range(24)))
    assert got == [[f"/c/{i}/{j}" for j in range(10)] for i in range(24)]
    seen = [s for s in rig.seen()["seen"] if s[2].startswith("/c/")]
    assert len(seen) == 240 and {s[0] for s in seen} == {"2"}


@pytest.mark.parametrize("size", [0, 1, 70_000, 3_000_000])
def test_answers_of_every_size_arrive_whole(rig: Rig, size: int) -> None:
    """Whole in the lane up to 64 KiB, relayed beyond: the bytes are the node's."""
    r = rig.get(f"/big/{size}")
    assert r.status_code == 200
    want = (b"0123456789abcdef" * (size // 16 + 1))[:size]
    assert hashlib.sha256(r.content).digest() == hashlib.sha256(want).digest()
    assert r.headers["content-length"] == str(size)


def test_more_requests_than_the_node_takes_per_connection_are_all_answered(
        rig: Rig) -> None:
    """hypercorn stops answering on a connection after 1,000 requests; the edge makes a
    new session every 900 streams, so 2,100 requests in a row (16,000 bytes each, whole
    in the lane) are all answered over HTTP/2, on at least three node connections."""
    want = (b"0123456789abcdef" * 1000)[:16000]
    before = len(rig.seen()["seen"])
    with client() as c:
        for i in range(2100):
            r = get(c, rig.serve, "/big/16000")
            assert r.status_code == 200 and r.content == want, i
    seen = rig.seen()["seen"][before:]
    assert len(seen) == 2100 and {s[0] for s in seen} == {"2"}
    assert len({s[1] for s in seen}) >= 3  # (the first may have served some already)


def test_a_relayed_answer_larger_than_the_session_window_arrives_whole(rig: Rig) -> None:
    """30 MB through the relay: more than the session's whole window (25.6 MB), so it
    stalls unless our window is given back as the client takes the answer."""
    from pact_ingress.net.h2_node import SESSION_WINDOW

    size = 30_000_000
    assert size > SESSION_WINDOW
    r = rig.get(f"/big/{size}")
    want = (b"0123456789abcdef" * (size // 16 + 1))[:size]
    assert r.status_code == 200 and len(r.content) == size
    assert hashlib.sha256(r.content).digest() == hashlib.sha256(want).digest()


def test_clients_that_leave_mid_relay_do_not_starve_the_session(rig: Rig) -> None:
    """110 clients ask for a 3 MB answer, read its head, stop reading and reset: each
    relay had up to a stream window (256 KiB) of the answer waiting, 28 MB in all, more
    than the session's whole window. What they left must go back to the node's window:
    a request after them is answered at once, over the same session."""
    import concurrent.futures
    import struct

    def leave_mid_answer(i: int) -> None:
        ctx = ssl.create_default_context()
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
        raw = socket.create_connection((LOOPBACK, rig.serve.port), timeout=20)
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        tls = ctx.wrap_socket(raw, server_hostname=OPT_HOST)
        tls.sendall(f"GET /big/3000000?leave={i} HTTP/1.1\r\nHost: {OPT_HOST}\r\n\r\n"
                    .encode())
        assert tls.recv(4096).startswith(b"HTTP/1.1 200")
        time.sleep(0.3)  # the relay's stream window fills while nothing is read
        tls.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        tls.close()  # a reset

    assert rig.get("/before-leavers").json()["version"] == "2"
    with concurrent.futures.ThreadPoolExecutor(10) as pool:
        list(pool.map(leave_mid_answer, range(110)))
    start = time.monotonic()
    r = rig.get("/after-leavers")
    assert r.status_code == 200 and r.json()["version"] == "2"
    assert time.monotonic() - start < 5  # (a starved session: the 30 s header timeout)


def test_an_answer_without_length_is_framed_for_the_client(rig: Rig) -> None:
    r = rig.get("/nolength")
    assert r.status_code == 200 and json.loads(r.content)["path"] == "/nolength"


def test_a_request_body_reaches_the_node_whole(rig: Rig) -> None:
    body = os.urandom(60_000)
    before = len(rig.seen()["seen"])
    with client() as c:
        for _ in range(3):
            r = c.send(send(c, rig.serve, "POST", "/echo", content=body))
            assert r.status_code == 200 and r.content == body
            assert r.headers["x-got"] == str(len(body))
    # (a request with a body goes over HTTP/1.1: see the early-answer tests below)
    assert {s[0] for s in rig.seen()["seen"][before:]} == {"1.1"}


def test_answers_before_the_body_was_taken_are_relayed_and_the_next_go_on(
        rig: Rig) -> None:
    """hypercorn closes its HTTP/2 connection when it answers a request (413) before
    reading its body, so requests with a body go over HTTP/1.1: every one of 30 such
    requests (each on a connection of its own, head and body in one write, as the lane
    serves them) gets its own 413, the node saw each once (over HTTP/1.1), and the next
    request without a body is served over HTTP/2."""
    body = b"e" * 65536
    before = len(rig.seen()["seen"])
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    for i in range(30):
        raw = socket.create_connection((LOOPBACK, rig.serve.port), timeout=20)
        with ctx.wrap_socket(raw, server_hostname=OPT_HOST) as tls:
            tls.sendall(f"POST /early/{i} HTTP/1.1\r\nHost: {OPT_HOST}\r\n"
                        f"content-length: {len(body)}\r\n\r\n".encode() + body)
            answer = tls.recv(65536)
        assert answer.startswith(b"HTTP/1.1 413"), (i, answer[:200])
    assert rig.get("/after-early").json()["version"] == "2"
    reached = [(s[0], s[2]) for s in rig.seen()["seen"][before:]]
    assert reached == [("1.1", f"/early/{i}") for i in range(30)] + [("2", "/after-early")]


def test_hypercorn_closes_its_http2_connection_after_an_early_answer(rig: Rig) -> None:
    """Why requests with a body stay on HTTP/1.1: the node's own HTTP/2 connection
    (our client end, straight to hypercorn) ends right after a 413 to a POST whose
    1,000-byte body it did not read, and stays up after one to a GET."""
    from pact_ingress.proto.h2_client import H2Client, ResponseReceived

    def closed_after(body: bytes | None) -> bool:
        ctx = ssl.create_default_context()
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
        ctx.set_alpn_protocols(["h2"])
        raw = socket.create_connection((LOOPBACK, rig.node.port), timeout=5)
        with ctx.wrap_socket(raw, server_hostname="node") as tls:
            c = H2Client()
            c.initiate_connection()
            method = b"GET" if body is None else b"POST"
            sid = c.send_request([(b":method", method), (b":scheme", b"https"),
                                  (b":path", b"/early/probe"), (b":authority", b"node")],
                                 end_stream=body is None)
            if body is not None:
                c.send_data(sid, body, end_stream=True)
            tls.sendall(c.take_output())
            answered, deadline = False, time.monotonic() + 5
            tls.settimeout(1)
            while time.monotonic() < deadline:
                try:
                    data = tls.recv(65536)
                except TimeoutError:
                    if answered:
                        return False  # a second with nothing more: still up
                    continue
                if not data:
                    return True
                answered |= any(isinstance(e, ResponseReceived) and e.status == 413
                                for e in c.receive_data(data))
                tls.sendall(c.take_output())
            raise AssertionError("no answer from the node")

    assert closed_after(b"x" * 1000)
    assert not closed_after(None)


def test_a_stream_is_relayed_as_it_comes(rig: Rig) -> None:
    """An answer with no length, sent in ten pieces 50 ms apart: the first piece reaches
    the client long before the last is sent."""
    with client() as c:
        r = c.send(send(c, rig.serve, "GET", "/stream/10"), stream=True)
        start = time.monotonic()
        pieces = []
        for chunk in r.iter_raw():
            pieces.append((time.monotonic() - start, chunk))
        r.close()
        text = b"".join(piece for _, piece in pieces)
    assert text == b"".join(b"data: %d\n\n" % i for i in range(10))
    assert pieces[0][0] < pieces[-1][0]  # not held back until the end
    assert len(pieces) > 1


def test_a_client_that_leaves_has_its_stream_reset_at_the_node(rig: Rig) -> None:
    """The node's handler is told the request is gone (RST_STREAM reached it), and the
    session goes on serving."""
    raw = socket.create_connection((LOOPBACK, rig.serve.port))
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    tls = ctx.wrap_socket(raw, server_hostname=OPT_HOST)
    tls.sendall(f"GET /hang/1 HTTP/1.1\r\nHost: {OPT_HOST}\r\n\r\n".encode())
    deadline = time.monotonic() + 10
    while not any(s[2] == "/hang/1" for s in rig.seen()["seen"]):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    tls.close()
    while "/hang/1" not in rig.seen()["gone"]:
        assert time.monotonic() < deadline, "the node never heard the client left"
        time.sleep(0.05)
    assert rig.get("/after-leave").json()["version"] == "2"


async def test_a_late_head_is_504_and_a_new_session_serves_on(nursery, tmp_path: Path) -> None:
    """In process, with the lane serving and a node header timeout of 1 s: the demo node
    (hypercorn, which offers h2) stalls one request; that client gets 504, the stream is
    given up and its session retires (closed once it has no stream), and the next
    requests are served over a new session."""
    import trio

    from tests.test_terminate import HOST as DEMO_HOST
    from tests.test_terminate import start_env

    env = await start_env(nursery, tmp_path, header_timeout=1.0, seal="optional")
    server_ctx = env.pki.server_context(DEMO_HOST)

    async def handler(tcp: trio.SocketStream) -> None:
        sock = tcp.socket._sock  # type: ignore[attr-defined]
        await env.terminator.serve_socket(sock, b"", server_ctx, env.route,
                                          sock.getpeername()[:2])

    listeners = await nursery.start(partial(trio.serve_tcp, handler, 0, host=LOOPBACK))
    port = listeners[0].socket.getsockname()[1]
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE

    async def exchange(request: bytes) -> bytes:
        stream = trio.SSLStream(await trio.open_tcp_stream(LOOPBACK, port), ctx,
                                server_hostname=DEMO_HOST)
        await stream.send_all(request)
        data = b""
        while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < int(
                dict(line.split(b": ", 1) for line in data.split(b"\r\n\r\n")[0]
                     .split(b"\r\n")[1:] if b": " in line).get(b"content-length", b"0")):
            chunk = await stream.receive_some(65536)
            if not chunk:
                break
            data += chunk
        await stream.aclose()
        return data

    headers_get = f"GET /_demo/headers HTTP/1.1\r\nHost: {DEMO_HOST}\r\n\r\n".encode()
    with trio.fail_after(30):
        assert (await exchange(headers_get)).startswith(b"HTTP/1.1 200")
        pool = next(iter(env.terminator.upstream._pools.values()))
        assert pool.session is not None  # the node took h2
        session = pool.session
        stalled = await exchange(f"GET /_demo/stall HTTP/1.1\r\nHost: {DEMO_HOST}\r\n\r\n"
                                 .encode())
        assert stalled.startswith(b"HTTP/1.1 504")
        # the session that let a head wait retires; the next exchange makes a new one
        for _ in range(3):
            assert (await exchange(headers_get)).startswith(b"HTTP/1.1 200")
        assert pool.session is not None and pool.session is not session
        assert session.closed and not pool.session.holders
    await env.terminator.aclose()


def test_the_seal_posture_holds_on_the_multiplexed_leg(rig: Rig) -> None:
    """Unsealed tool calls to the sealed route, in every spelling of the target, never
    reach the node; the same session serves the allowed ones."""
    body = unsealed_call_body()
    targets = ["/mcp", "/mcp/", "//mcp", "/./mcp", "/%6dcp", "/mcp?x=1",
               f"https://{HOST}/mcp"]
    before = len(rig.seen()["seen"])
    for target in targets:
        raw = socket.create_connection((LOOPBACK, rig.serve.port))
        ctx = ssl.create_default_context()
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
        with ctx.wrap_socket(raw, server_hostname=HOST) as tls:
            tls.sendall(f"POST {target} HTTP/1.1\r\nHost: {HOST}\r\ncontent-type: "
                        f"application/json\r\ncontent-length: {len(body)}\r\n"
                        f"connection: close\r\n\r\n".encode() + body)
            answer = b""
            while chunk := tls.recv(65536):
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 "), (target, answer[:200])
    listed = rpc("tools/list")
    with client() as c:
        r = c.send(send(c, rig.serve, "POST", "/mcp", HOST, content=listed,
                        headers={"content-type": "application/json"}))
    assert r.status_code == 200
    reached = [s[2] for s in rig.seen()["seen"][before:]]
    assert reached == ["/mcp"]  # the tools/list only


def test_with_the_switch_off_the_node_is_spoken_to_over_http1(h1_rig: Rig) -> None:
    with client() as c:
        versions = {get(c, h1_rig.serve, f"/off/{i}").json()["version"] for i in range(5)}
    assert versions == {"1.1"}


class FirstFlightNode:
    """A node limited to TLS 1.2 whose HTTP/2 preface (SETTINGS) leaves in the same
    segment as its handshake's Finished, so it is in our TLS engine before the session
    exists; `mode` "close_once" / "goaway_once": its first HTTP/2 connection then closes
    / says GOAWAY(0) in that same flight, and later ones serve. It answers over HTTP/2
    with `h2`'s server end (`{"path": ..., "version": "2"}`) and over HTTP/1.1 too."""

    def __init__(self, cert: Path, key: Path, mode: str) -> None:
        import threading

        self.mode = mode
        self.ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.ctx.load_cert_chain(str(cert), str(key))
        self.ctx.maximum_version = ssl.TLSVersion.TLSv1_2
        self.ctx.set_alpn_protocols(["h2", "http/1.1"])
        self.sock = socket.create_server((LOOPBACK, 0), backlog=64)
        self.port = self.sock.getsockname()[1]
        self.h2_connections = 0
        self.seen: list[tuple[str, str]] = []  # (version, path)
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import threading

        while True:
            try:
                s, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(s,), daemon=True).start()

    def _serve(self, s: socket.socket) -> None:
        import h2.config
        import h2.connection
        import h2.events

        inc, out = ssl.MemoryBIO(), ssl.MemoryBIO()
        tls = self.ctx.wrap_bio(inc, out, server_side=True)
        s.settimeout(20)
        try:
            if not bio_handshake(s, tls, inc, out):
                return
            h2_mode = tls.selected_alpn_protocol() == "h2"
            conn = h2.connection.H2Connection(h2.config.H2Configuration(
                client_side=False, header_encoding=None))
            if h2_mode:
                self.h2_connections += 1
                first = self.h2_connections == 1
                conn.initiate_connection()
                if first and self.mode == "goaway_once":
                    conn.close_connection(last_stream_id=0)
                tls.write(conn.data_to_send())
                s.sendall(out.read())  # the Finished and the preface: one segment
                if first and self.mode in ("close_once", "goaway_once"):
                    return
            else:
                s.sendall(out.read())  # the handshake's last flight
            buf = b""
            while True:
                data = s.recv(65536)
                if not data:
                    return
                inc.write(data)
                plain = b""
                try:
                    while True:
                        plain += tls.read(65536)
                except ssl.SSLWantReadError:
                    pass
                if h2_mode:
                    for e in conn.receive_data(plain):
                        if isinstance(e, h2.events.RequestReceived):
                            path = dict(e.headers)[b":path"].decode()
                            self.seen.append(("2", path))
                            body = json.dumps({"path": path, "version": "2"}).encode()
                            conn.send_headers(e.stream_id, [
                                (b":status", b"200"),
                                (b"content-length", str(len(body)).encode())])
                            conn.send_data(e.stream_id, body, end_stream=True)
                    tls.write(conn.data_to_send())
                else:
                    buf += plain
                    while b"\r\n\r\n" in buf:
                        head, buf = buf.split(b"\r\n\r\n", 1)
                        path = head.split(b" ")[1].decode()
                        self.seen.append(("1.1", path))
                        body = json.dumps({"path": path, "version": "1.1"}).encode()
                        tls.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n"
                                  % len(body) + body)
                if out.pending:
                    s.sendall(out.read())
        except (OSError, ssl.SSLError):
            pass
        finally:
            s.close()

    def stop(self) -> None:
        self.sock.close()


@pytest.mark.parametrize("mode", ["serve", "close_once", "goaway_once"])
def test_a_node_whose_preface_comes_with_its_finished_gets_a_session(
        tmp_path: Path, mode: str) -> None:
    """The node's SETTINGS are in our TLS engine when the session is made (TLS 1.2 sends
    them with the Finished): the session reads them at once and serves. A first
    connection that closes or says GOAWAY in that flight is not installed: that request
    goes over HTTP/1.1 (or, when a close comes after the session took it, gets the 502
    of a node that failed a new connection; never an edge error), and the next ones over
    a new session."""
    ids = make_identities(tmp_path)
    node = FirstFlightNode(ids.node.cert_path, ids.node.key_path, mode)
    serve = Serve(tmp_path, node, ids.node.fingerprint, workers=1,  # type: ignore[arg-type]
                  limits={"calls_per_hour_per_ip": 1000000})
    try:
        with client() as c:
            answers = [get(c, serve, f"/ff/{i}") for i in range(5)]
        if mode == "close_once" and answers[0].status_code == 502:
            # the close came after the session took the request: a node that fails a
            # new connection, a 502 as over HTTP/1.1 (nothing says it did not act)
            answers = answers[1:]
        assert {a.status_code for a in answers} == {200}
        assert [a.json()["path"] for a in answers] == [f"/ff/{i}" for i in range(5)][-len(
            answers):]
        versions = [a.json()["version"] for a in answers]
        assert versions[-4:] == ["2"] * 4
        if mode == "serve":
            assert versions == ["2"] * 5
        assert "lane_error" not in serve.logs()
    finally:
        serve.stop()
        node.stop()
