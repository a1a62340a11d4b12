"""The pinned HTTP/1.1 upstream client against real loopback TLS servers.

Most tests run a scripted node: a stdlib TLS server (the node's PACT identity as its
certificate, so the pin is its fingerprint) that reads each request with h11 and writes
whatever raw response bytes the test scripts, so framing edge cases reach the client
exactly as written. One test runs the demo node end to end.
"""

from __future__ import annotations

import json
import shutil
import ssl
import subprocess
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import h11
import pytest
import trio

from pact_ingress.config import Address, Backend, Limits, Route
from pact_ingress.demo.node import serve_demo_node
from pact_ingress.identity import Identity
from pact_ingress.net import upstream as upstream_mod
from pact_ingress.net.backends import Backends
from pact_ingress.net.upstream import (
    NodeUnreachable,
    Upstream,
    UpstreamProtocolError,
    UpstreamTimeout,
    UpstreamTLSError,
)
from pact_ingress.proto.http_upstream import (
    MAX_INTERIM,
    ResponseError,
    ResponseParser,
    request_head,
)
from tests.tls_helpers import LOOPBACK, make_identity, serve_loopback

HOST = "node.upstream.test"
WAIT = 10.0


@dataclass
class Seen:
    method: str
    target: str
    body: bytes
    conn: int  # which accepted connection it came on (0, 1, ...)


Script = Callable[["NodeConn", Seen], Awaitable[bool]]  # → keep the connection open?


@dataclass
class NodeConn:
    stream: trio.SSLStream
    index: int

    async def write(self, data: bytes) -> None:
        await self.stream.send_all(data)


@dataclass
class ScriptedNode:
    identity: Identity
    script: Script
    port: int = 0
    seen: list[Seen] = field(default_factory=list)
    accepted: int = 0
    closed_by_client: int = 0  # connections that ended with EOF from the edge
    resumed: int = 0  # TLS handshakes that resumed a session

    def context(self) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(self.identity.cert_path, self.identity.key_path)
        ctx.set_alpn_protocols(["h2", "http/1.1"])
        return ctx

    async def handle(self, tcp: trio.SocketStream) -> None:
        index = self.accepted
        self.accepted += 1
        # https_compatible: the edge closes without close_notify, which then reads as EOF
        tls = trio.SSLStream(tcp, self._ctx, server_side=True, https_compatible=True)
        conn = NodeConn(tls, index)
        parser = h11.Connection(h11.SERVER)
        try:
            await tls.do_handshake()
            self.resumed += tls._ssl_object.session_reused  # type: ignore[attr-defined]
            while True:
                method = target = ""
                body = b""
                while True:
                    event = parser.next_event()
                    if event is h11.NEED_DATA:
                        data = await tls.receive_some(65536)
                        if not data:
                            self.closed_by_client += 1
                            return
                        parser.receive_data(data)
                    elif isinstance(event, h11.Request):
                        method, target = event.method.decode(), event.target.decode()
                    elif isinstance(event, h11.Data):
                        body += event.data
                    elif isinstance(event, h11.EndOfMessage):
                        break
                seen = Seen(method, target, body, index)
                self.seen.append(seen)
                if not await self.script(conn, seen):
                    return
                parser = h11.Connection(h11.SERVER)  # the script wrote raw bytes itself
        except (trio.BrokenResourceError, trio.ClosedResourceError, h11.RemoteProtocolError):
            return
        finally:
            await trio.aclose_forcefully(tls)

    async def start(self, nursery: trio.Nursery) -> None:
        self._ctx = self.context()
        self.port = await nursery.start(serve_loopback, self.handle)


@dataclass
class Env:
    node: ScriptedNode
    upstream: Upstream
    route: Route
    pins: tuple[str, ...]

    def request(self, target: str = "/", *, method: str = "GET", body: object = b"",
                headers: list[tuple[bytes, bytes]] | None = None, idle_timeout: float = 5.0):
        out = [(b"host", HOST.encode()), *(headers or [])]
        return self.upstream.request(self.route, self.pins, method=method, host=HOST,
                                     target=target.encode(), headers=out, body=body,  # type: ignore[arg-type]
                                     idle_timeout=idle_timeout)

    async def get(self, target: str = "/", **kw: object) -> tuple[int, bytes]:
        async with self.request(target, **kw) as r:  # type: ignore[arg-type]
            return r.status, b"".join([c async for c in r.body])

    def pool(self) -> upstream_mod._Pool:
        (pool,) = self.upstream._pools.values()
        return pool


async def make_env(nursery: trio.Nursery, tmp: Path, script: Script, *,
                   pins: tuple[str, ...] | None = None, header_timeout: float = 5.0,
                   port: int | None = None) -> Env:
    node_id = make_identity(tmp, "node")
    node = ScriptedNode(node_id, script)
    await node.start(nursery)
    route = Route(host=HOST, tenant="t", mode="terminate",
                  backend=Backend(Address(LOOPBACK, port or node.port)),  # type: ignore[arg-type]
                  limits=Limits())
    ingress = make_identity(tmp, "ingress")
    up = Upstream(ingress, Backends(), header_timeout=header_timeout, connect_timeout=2.0)
    return Env(node, up, route, pins or (node_id.fingerprint,))


def reply(body: bytes = b"ok", *extra: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\n" + b"".join(e + b"\r\n" for e in extra) + \
        b"Content-Length: %d\r\n\r\n" % len(body) + body


async def answer_ok(conn: NodeConn, seen: Seen) -> bool:
    await conn.write(reply(b"echo:" + seen.body))
    return True


# --- framing ---------------------------------------------------------------------------------


async def test_content_length_reused_connection_and_session_resumption(
        nursery: trio.Nursery, tmp_path: Path) -> None:
    env = await make_env(nursery, tmp_path, answer_ok)
    with trio.fail_after(WAIT):
        assert await env.get("/a", method="POST", body=b"hi",
                             headers=[(b"content-length", b"2")]) == (200, b"echo:hi")
        assert await env.get("/b") == (200, b"echo:")
        assert env.node.accepted == 1  # the second request rode the pooled connection
        # hold the pooled connection; a concurrent request opens a second one, resumed
        async with env.request("/c") as first:
            async with env.request("/d") as second:
                assert [c async for c in second.body] == [b"echo:"]
                assert second.body._conn.ssl_object.session_reused  # type: ignore[attr-defined]
            assert [c async for c in first.body] == [b"echo:"]
    assert env.node.accepted == 2 and env.node.resumed == 1
    assert [s.target for s in env.node.seen] == ["/a", "/b", "/c", "/d"]
    assert len(env.pool().idle) == 2
    await env.upstream.aclose()


async def test_chunked_with_trailers(nursery: trio.Nursery, tmp_path: Path) -> None:
    async def chunked(conn: NodeConn, seen: Seen) -> bool:
        await conn.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n"
                         b"Trailer: x-sum\r\n\r\n5\r\nhello\r\n")
        await trio.sleep(0.05)
        await conn.write(b"6;ext=1\r\n world\r\n0\r\nX-Sum: 42\r\n\r\n")
        return True

    env = await make_env(nursery, tmp_path, chunked)
    with trio.fail_after(WAIT):
        async with env.request() as r:
            assert r.status == 200 and r.http_version == "HTTP/1.1"
            assert (b"transfer-encoding", b"chunked") in r.headers
            chunks = [c async for c in r.body]
        assert b"".join(chunks) == b"hello world" and len(chunks) == 2  # streamed, not buffered
        assert await env.get() == (200, b"hello world")
    assert env.node.accepted == 1  # trailers consumed: the connection stayed usable
    await env.upstream.aclose()


async def test_close_delimited_body_not_reused(nursery: trio.Nursery, tmp_path: Path) -> None:
    async def until_close(conn: NodeConn, seen: Seen) -> bool:
        await conn.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nall of ")
        await conn.write(b"it until close")
        return False

    env = await make_env(nursery, tmp_path, until_close)
    with trio.fail_after(WAIT):
        assert await env.get() == (200, b"all of it until close")
        assert await env.get() == (200, b"all of it until close")
    assert env.node.accepted == 2 and env.pool().open == 0
    await env.upstream.aclose()


async def test_interim_responses_skipped(nursery: trio.Nursery, tmp_path: Path) -> None:
    async def interim(conn: NodeConn, seen: Seen) -> bool:
        await conn.write(b"HTTP/1.1 100 Continue\r\n\r\n"
                         b"HTTP/1.1 103 Early Hints\r\nLink: </a.css>; rel=preload\r\n\r\n")
        await trio.sleep(0.02)
        await conn.write(reply(b"final", b"X-Final: 1"))
        return True

    env = await make_env(nursery, tmp_path, interim)
    with trio.fail_after(WAIT):
        async with env.request() as r:
            assert r.status == 200
            assert [n for n, _ in r.headers] == [b"x-final", b"content-length"]
            assert b"".join([c async for c in r.body]) == b"final"
        assert await env.get() == (200, b"final")
    assert env.node.accepted == 1
    await env.upstream.aclose()


@pytest.mark.parametrize(("method", "status"), [("HEAD", 200), ("GET", 204), ("GET", 304)])
async def test_bodiless_responses(nursery: trio.Nursery, tmp_path: Path, method: str,
                                  status: int) -> None:
    async def bodiless(conn: NodeConn, seen: Seen) -> bool:
        await conn.write(b"HTTP/1.1 %d X\r\nContent-Length: 10\r\n\r\n" % status)
        return True

    env = await make_env(nursery, tmp_path, bodiless)
    with trio.fail_after(WAIT):
        assert await env.get(method=method) == (status, b"")
        assert await env.get(method=method) == (status, b"")
    # 204/304 keep the connection; after HEAD the head's end is not known: a new one
    assert env.node.accepted == (2 if method == "HEAD" else 1)
    await env.upstream.aclose()


async def test_streamed_request_body_goes_out_chunked(nursery: trio.Nursery,
                                                      tmp_path: Path) -> None:
    env = await make_env(nursery, tmp_path, answer_ok)

    async def upload():
        for part in (b"one,", b"two,", b"three"):
            await trio.sleep(0.01)
            yield part

    with trio.fail_after(WAIT):
        status, body = await env.get("/up", method="POST", body=upload(),
                                     headers=[(b"transfer-encoding", b"chunked")])
    assert (status, body) == (200, b"echo:one,two,three")
    await env.upstream.aclose()


async def test_garbage_response_is_protocol_error(nursery: trio.Nursery, tmp_path: Path) -> None:
    async def garbage(conn: NodeConn, seen: Seen) -> bool:
        await conn.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nTransfer-Encoding: chunked"
                         b"\r\n\r\n")
        return True

    env = await make_env(nursery, tmp_path, garbage)
    with trio.fail_after(WAIT), pytest.raises(UpstreamProtocolError):
        await env.get()
    assert env.pool().open == 0
    await env.upstream.aclose()


# --- TLS and reachability ----------------------------------------------------------------------


async def test_pin_mismatch_names_expected_and_seen(nursery: trio.Nursery,
                                                    tmp_path: Path) -> None:
    stranger = make_identity(tmp_path, "stranger")
    env = await make_env(nursery, tmp_path, answer_ok, pins=(stranger.fingerprint,))
    with trio.fail_after(WAIT), pytest.raises(UpstreamTLSError) as caught:
        await env.get()
    assert caught.value.expected == (stranger.fingerprint,)
    assert caught.value.seen == env.node.identity.fingerprint
    assert caught.value.status == 502 and env.node.seen == []
    assert env.pool().open == 0
    await env.upstream.aclose()


async def test_node_unreachable(nursery: trio.Nursery, tmp_path: Path) -> None:
    with trio.socket.socket() as probe:
        await probe.bind((LOOPBACK, 0))
        closed_port = probe.getsockname()[1]
    env = await make_env(nursery, tmp_path, answer_ok, port=closed_port)
    with trio.fail_after(WAIT), pytest.raises(NodeUnreachable):
        await env.get()
    await env.upstream.aclose()


# --- time -------------------------------------------------------------------------------------


async def test_slow_headers_time_out(nursery: trio.Nursery, tmp_path: Path) -> None:
    async def slow(conn: NodeConn, seen: Seen) -> bool:
        await trio.sleep(5)
        return False

    env = await make_env(nursery, tmp_path, slow, header_timeout=0.3)
    started = trio.current_time()
    with trio.fail_after(WAIT), pytest.raises(UpstreamTimeout):
        await env.get()
    assert 0.25 < trio.current_time() - started < 2.0
    assert env.pool().open == 0
    await env.upstream.aclose()


async def test_header_clock_starts_after_the_body(nursery: trio.Nursery, tmp_path: Path) -> None:
    env = await make_env(nursery, tmp_path, answer_ok, header_timeout=0.3)

    async def slow_upload():
        for _ in range(5):
            await trio.sleep(0.1)  # 0.5 s of upload, longer than the header budget
            yield b"x"

    with trio.fail_after(WAIT):
        assert await env.get(method="POST", body=slow_upload(),
                             headers=[(b"transfer-encoding", b"chunked")]) == (200, b"echo:xxxxx")
    await env.upstream.aclose()


async def test_sse_stays_open_while_bytes_flow_then_idles_out(nursery: trio.Nursery,
                                                              tmp_path: Path) -> None:
    async def sse(conn: NodeConn, seen: Seen) -> bool:
        await conn.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                         b"Transfer-Encoding: chunked\r\n\r\n")
        for i in range(8):  # 0.8 s in all, each gap well inside the 0.3 s idle timeout
            await trio.sleep(0.1)
            event = b"data: %d\n\n" % i
            await conn.write(b"%x\r\n%b\r\n" % (len(event), event))
        await trio.sleep(5)  # then silence
        return False

    env = await make_env(nursery, tmp_path, sse)
    events = []
    with trio.fail_after(WAIT):
        async with env.request(idle_timeout=0.3) as r:
            with pytest.raises(UpstreamTimeout):
                async for chunk in r.body:
                    events.append(chunk)
    assert events == [b"data: %d\n\n" % i for i in range(8)]
    assert env.pool().open == 0  # an unfinished response never goes back to the pool
    await env.upstream.aclose()


# --- the pool -------------------------------------------------------------------------------------


async def test_abandoned_response_closes_its_connection(nursery: trio.Nursery,
                                                        tmp_path: Path) -> None:
    async def endless(conn: NodeConn, seen: Seen) -> bool:
        if seen.target == "/small":
            await conn.write(reply(b"small"))
            return True
        await conn.write(b"HTTP/1.1 200 OK\r\nContent-Length: 1000000\r\n\r\n" + b"x" * 1000)
        await trio.sleep(5)
        return False

    env = await make_env(nursery, tmp_path, endless)
    with trio.fail_after(WAIT):
        async with env.request("/big") as r:
            assert len(await r.body.__anext__()) == 1000
        # abandoned: its connection closed, the node sees the edge go
        assert env.pool().open == 0 and env.pool().idle == []
        assert await env.get("/small") == (200, b"small")
    assert env.node.accepted == 2
    await env.upstream.aclose()


async def test_node_closing_idle_connection(nursery: trio.Nursery, tmp_path: Path) -> None:
    """Closed while idle: a new connection serves the next request (within the liveness
    beat the request finds the close itself and is resent; see the Node.js test below)."""
    async def once(conn: NodeConn, seen: Seen) -> bool:
        await conn.write(reply(b"one"))
        await trio.sleep(0.05)
        return False  # close after each response, without saying so in the headers

    env = await make_env(nursery, tmp_path, once)
    with trio.fail_after(WAIT):
        assert await env.get() == (200, b"one")
        await trio.sleep(0.2)
        assert await env.get("/again") == (200, b"one")
    assert env.node.accepted == 2 and len(env.node.seen) == 2
    await env.upstream.aclose()


@pytest.mark.parametrize(("method", "streamed"), [
    ("PUT", False), ("GET", False), ("POST", False), ("PATCH", False), ("PUT", True)])
async def test_stale_connection_retried_once_only_for_an_idempotent_bytes_request(
        nursery: trio.Nursery, tmp_path: Path, method: str, streamed: bool) -> None:
    """The node drops the pooled connection just as the next request reaches it (its
    keep-alive ran out then, or it crashed after reading the request): an idempotent
    request with a bytes body is sent again on a fresh connection; a POST or PATCH is
    never sent twice (the node may have acted on it: 502), nor a streamed body, which
    cannot be replayed."""
    async def flaky(conn: NodeConn, seen: Seen) -> bool:
        if conn.index == 0 and seen.target == "/second":
            return False  # close without answering
        await conn.write(reply(b"served on %d" % conn.index))
        return True

    env = await make_env(nursery, tmp_path, flaky)

    async def stream():
        yield b"abc"

    replayed = method in ("PUT", "GET") and not streamed
    body = stream() if streamed else b"abc"
    headers = [(b"content-length", b"3")]
    with trio.fail_after(WAIT):
        assert await env.get("/first") == (200, b"served on 0")
        if replayed:
            assert await env.get("/second", method=method, body=body,
                                 headers=headers) == (200, b"served on 1")
        else:
            with pytest.raises(UpstreamProtocolError):
                await env.get("/second", method=method, body=body, headers=headers)
    assert [s.target for s in env.node.seen] == (
        ["/first", "/second", "/second"] if replayed else ["/first", "/second"])
    await env.upstream.aclose()


async def test_pool_limit_waits_then_times_out(nursery: trio.Nursery, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(upstream_mod, "MAX_CONNECTIONS_PER_ROUTE", 2)
    release = trio.Event()

    async def hold(conn: NodeConn, seen: Seen) -> bool:
        await conn.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1\r\nx\r\n")
        await release.wait()
        await conn.write(b"0\r\n\r\n")
        return True

    env = await make_env(nursery, tmp_path, hold, header_timeout=0.5)
    results: list[tuple[int, bytes]] = []
    with trio.fail_after(WAIT):
        async with env.request() as a, env.request() as b:
            with pytest.raises(UpstreamTimeout):  # both slots taken: bounded wait, then 504
                await env.get()

            async def waiter() -> None:
                results.append(await env.get())

            nursery.start_soon(waiter)
            await trio.sleep(0.05)
            release.set()  # `a` ends: its connection goes back and the waiter takes it
            assert b"".join([c async for c in a.body]) == b"x"
            assert b"".join([c async for c in b.body]) == b"x"
        while not results:
            await trio.sleep(0.01)
    assert results == [(200, b"x")] and env.node.accepted == 2
    await env.upstream.aclose()


async def test_retired_pool_lets_running_stream_finish(nursery: trio.Nursery,
                                                       tmp_path: Path) -> None:
    async def stream(conn: NodeConn, seen: Seen) -> bool:
        await conn.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(3):
            await trio.sleep(0.05)
            await conn.write(b"1\r\ne\r\n")
        await conn.write(b"0\r\n\r\n")
        return True

    env = await make_env(nursery, tmp_path, stream)
    with trio.fail_after(WAIT):
        assert await env.get() == (200, b"eee")  # one idle pooled connection
        async with env.request() as r:  # rides it
            pool = env.pool()
            env.upstream.retain([])  # a reload dropped the route
            assert b"".join([c async for c in r.body]) == b"eee"  # not cut
        assert pool.open == 0 and env.upstream._pools == {} and env.upstream._retired == []
        while env.node.closed_by_client < 1:
            await trio.sleep(0.01)
    await env.upstream.aclose()


async def test_demo_node_end_to_end(nursery: trio.Nursery, tmp_path: Path) -> None:
    node_id = make_identity(tmp_path, "demo")
    node = await nursery.start(serve_demo_node, node_id, LOOPBACK, 0)
    route = Route(host=HOST, tenant="t", mode="terminate",
                  backend=Backend(Address(LOOPBACK, node.port)), limits=Limits())  # type: ignore[arg-type]
    ingress = make_identity(tmp_path, "ingress")
    up = Upstream(ingress, Backends())
    with trio.fail_after(WAIT):
        for _ in range(3):
            async with up.request(route, (node_id.fingerprint,), method="GET", host=HOST,
                                  target=b"/_demo/headers", headers=[(b"host", HOST.encode())],
                                  body=b"", idle_timeout=5.0) as r:
                assert r.status == 200 and r.http_version == "HTTP/1.1"
                assert b"".join([c async for c in r.body]).startswith(b"{")
    (pool,) = up._pools.values()
    assert pool.open == 1  # three requests, one connection
    await up.aclose()


# --- the parser alone ---------------------------------------------------------------------------


def test_parser_refuses_ambiguous_framing() -> None:
    for head in (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n",
                 b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n",
                 b"HTTP/1.1 200 OK\r\nX: a\r\n folded\r\n\r\n",
                 b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\nConnection: upgrade\r\n\r\n"):
        with pytest.raises(ResponseError):
            ResponseParser("GET").feed(head)


@pytest.mark.parametrize("version", [b"0.9", b"1.0", b"1.1", b"2.0"])
@pytest.mark.parametrize("fields", [
    b"", b"Connection: keep-alive\r\n", b"Connection: close\r\n",
    b"Connection: x, Close\r\n", b"Proxy-Connection: keep-alive\r\n",
    b"Proxy-Connection: close\r\n", b"Connection: close\r\nProxy-Connection: keep-alive\r\n"])
@pytest.mark.parametrize("framing", [b"Content-Length: 2\r\n", b""])
def test_parser_version_and_reuse_whatever_the_connection_fields(
        version: bytes, fields: bytes, framing: bytes) -> None:
    """The response's version is the one it was sent with (told without asking llhttp
    for its text where keep-alive already says it), and the connection is reused only
    after an HTTP/1.1 response, framed, that did not say close."""
    p = ResponseParser("GET")
    p.feed(b"HTTP/" + version + b" 200 OK\r\n" + fields + framing + b"\r\nhi")
    if not framing:  # close-delimited: the end is the node's close
        p.feed_eof()
    assert p.done and p.version == "HTTP/" + version.decode()
    says_close = b"close" in fields.split(b"Proxy-Connection")[0].lower()
    assert p.keep_alive == (version == b"1.1" and bool(framing) and not says_close)


_ANSWERS = [
    b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nhi",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nab\r\n0\r\nT: x\r\n\r\n",
    b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\nHTTP/1.1 204 No Content\r\n\r\n",
    b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nX-A: 1\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nProxy-Connection: close\r\nContent-Length: 1\r\n\r\nz",
    b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 1\r\n\r\ny",
    b"HTTP/1.0 200 OK\r\nContent-Length: 1\r\n\r\nw",
    b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\nvHTTP/1.1 200 OK\r\n\r\n",  # bytes after
    b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nuvw",
]


def _outcome(p: ResponseParser, data: bytes, method: str) -> tuple[object, ...]:
    try:
        for i in range(0, len(data), 7):  # in pieces, as reads come
            p.feed(data[i:i + 7])
    except ResponseError as exc:
        return ("error", str(exc))
    return (p.status, p.headers, p.version, p.take_body(), p.done, p.keep_alive, method)


@pytest.mark.parametrize("start", range(len(_ANSWERS)))
def test_parser_restarted_after_each_answer_parses_as_a_new_one(start: int) -> None:
    """One `keep` parser restarted for answer after answer (what the keep-alive lane
    does with a client's exchanges) reads each exactly as a new parser would, whatever
    came before: answers that leave llhttp closed (Connection or Proxy-Connection
    close, HTTP/1.0, bytes after the answer), interim answers, chunked trailers, HEAD."""
    kept = ResponseParser("GET", keep=True)
    order = _ANSWERS[start:] + _ANSWERS[:start]
    for n, data in enumerate(order * 2):
        method = "HEAD" if n % 5 == 4 else "GET"
        if n:
            kept.restart(method)
        assert _outcome(kept, data, method) == _outcome(ResponseParser(method), data, method)
    kept.discard()
    assert kept._parser is None and not kept.keep


def test_parser_bytes_after_response_end_the_connection() -> None:
    p = ResponseParser("GET")
    p.feed(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nhiHTTP/1.1 200 OK\r\n")
    assert p.done and p.take_body() == b"hi" and not p.keep_alive


@pytest.mark.parametrize(("method", "response"), [
    ("GET", b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nhi"),
    ("GET", (b"HTTP/1.1 103 Hints\r\n\r\nHTTP/1.1 200 OK\r\nTransfer-Encoding: chunked"
             b"\r\n\r\n2\r\nhi\r\n0\r\n\r\nHTTP/1.1 200 OK\r\n")),
    ("HEAD", b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n"),
])
def test_a_whole_response_frees_its_parser_without_the_cycle_collector(
        method: str, response: bytes) -> None:
    """llhttp's parser and ours refer to each other; once the response is whole the
    cycle is broken, so neither waits for the collector (one per response otherwise)."""
    import gc
    import weakref

    gc.disable()
    try:
        p = ResponseParser(method)
        p.feed(response)
        assert p.done
        p.feed(b"more")  # nothing is parsed after the end
        assert not p.keep_alive or method == "GET" and response.endswith(b"hi")
        gone = weakref.ref(p)
        del p
        assert gone() is None
    finally:
        gc.enable()


def test_parser_caps() -> None:
    with pytest.raises(ResponseError):
        ResponseParser("GET").feed(b"HTTP/1.1 103 Hints\r\n\r\n" * (MAX_INTERIM + 1))
    with pytest.raises(ResponseError):
        ResponseParser("GET").feed(b"HTTP/1.1 200 OK\r\n" + b"X: y\r\n" * 200 + b"\r\n")
    with pytest.raises(ResponseError):
        ResponseParser("GET").feed(b"HTTP/1.1 200 OK\r\nX: " + b"y" * 70000)


def test_parser_truncated_body_is_an_error() -> None:
    p = ResponseParser("GET")
    p.feed(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhi")
    with pytest.raises(ResponseError):
        p.feed_eof()


def test_parser_connection_close_and_http10() -> None:
    p = ResponseParser("GET")
    p.feed(b"HTTP/1.1 200 OK\r\nConnection: keep-alive, close\r\nContent-Length: 0\r\n\r\n")
    assert p.done and not p.keep_alive
    p = ResponseParser("GET")
    p.feed(b"HTTP/1.0 200 OK\r\nContent-Length: 0\r\n\r\n")
    assert p.done and not p.keep_alive and p.version == "HTTP/1.0"


def test_request_head_refuses_line_breaks() -> None:
    assert request_head("GET", b"/x", [(b"host", b"a")]) == b"GET /x HTTP/1.1\r\nhost: a\r\n\r\n"
    for bad in ([(b"x", b"a\r\nevil: 1")], [(b"x", b"a\nb")]):
        with pytest.raises(ValueError):
            request_head("GET", b"/x", bad)
    with pytest.raises(ValueError):
        request_head("GET", b"/x HTTP/1.1\r\n", [])


# --- the liveness check before reuse, against a real server ----------------------------------

NODE_KEEPALIVE_SERVER = r"""
const https = require("https");
const fs = require("fs");
let conns = 0;
const seen = {};
const server = https.createServer(
  {key: fs.readFileSync(process.argv[2]), cert: fs.readFileSync(process.argv[3])},
  (req, res) => {
    const sock = req.socket;
    if (sock.connIndex === undefined) sock.connIndex = conns++;
    clearTimeout(sock.idleTimer);
    seen[req.url] = (seen[req.url] || 0) + 1;
    req.resume();
    req.on("end", () => {
      const body = JSON.stringify({url: req.url, seen: seen[req.url], conn: sock.connIndex});
      res.writeHead(200, {"content-type": "application/json",
                          "content-length": Buffer.byteLength(body)});
      res.end(body);
      // an idle connection is closed quietly after 100 ms (Node's own keepAliveTimeout
      // cannot go below a second)
      res.on("finish", () => { sock.idleTimer = setTimeout(() => sock.destroy(), 100); });
    });
  });
server.listen(0, "127.0.0.1", () => console.log(server.address().port));
"""


async def test_liveness_check_rule_with_a_node_that_closes_idle_connections(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Node.js server closes an idle keep-alive connection 100 ms after its last
    answer, without a word. Every reuse is preceded by the check, however recently the
    connection was used and whether or not the request could be resent: it finds the
    close, and the request goes out on a fresh connection. Every request is answered and
    reaches the node exactly once."""
    node_bin = shutil.which("node")
    assert node_bin, "node (nodejs) is needed for this test"
    node_id = make_identity(tmp_path, "node")
    script = tmp_path / "keepalive.js"
    script.write_text(NODE_KEEPALIVE_SERVER)
    checks: list[bool] = []
    alive = upstream_mod._Conn.alive

    def counted(self: upstream_mod._Conn) -> bool:
        checks.append(result := alive(self))
        return result

    monkeypatch.setattr(upstream_mod._Conn, "alive", counted)
    proc = await trio.lowlevel.open_process(
        [node_bin, str(script), str(node_id.key_path), str(node_id.cert_path)],
        stdout=subprocess.PIPE)
    try:
        with trio.fail_after(WAIT):
            assert proc.stdout is not None
            port = int((await proc.stdout.receive_some(100)).decode().strip())
        route = Route(host=HOST, tenant="t", mode="terminate",
                      backend=Backend(Address(LOOPBACK, port)),  # type: ignore[arg-type]
                      limits=Limits())
        up = Upstream(make_identity(tmp_path, "ingress"), Backends(), header_timeout=5.0,
                      connect_timeout=2.0)
        env = Env(None, up, route, (node_id.fingerprint,))  # type: ignore[arg-type]

        async def ask(target: str, **kw: object) -> dict[str, object]:
            status, body = await env.get(target, **kw)
            assert status == 200
            return json.loads(body)

        async def streamed():
            yield b"abc"

        with trio.fail_after(WAIT):
            first = await ask("/a")
            await trio.sleep(0.4)  # the node closed it; the pool cannot know yet
            second = await ask("/b")
            assert checks[-1] is False  # checked, a moment after its last use: closed
            assert second["conn"] != first["conn"]  # so a fresh connection was used
            await trio.sleep(0.4)
            third = await ask("/c", method="POST", body=streamed())
            assert checks[-1] is False  # the same for a request that cannot be resent
            assert third["conn"] not in (first["conn"], second["conn"])
            fourth = await ask("/d")  # right after: the pooled connection is alive
            assert checks[-1] is True
            assert fourth["conn"] == third["conn"]
        assert [r["seen"] for r in (first, second, third, fourth)] == [1, 1, 1, 1]
        await up.aclose()
    finally:
        proc.kill()
        await proc.wait()
