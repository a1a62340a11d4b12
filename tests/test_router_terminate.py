"""How the router hands a terminate connection to the terminator: the engine's bare
socket and the bytes it peeked go straight to `serve_socket` (TLS runs on the socket
itself, no stream wrappers built first); a terminator with `serve` only still gets a
stream; and the shortcut picks exactly the connections `_dispatch` would terminate.
Real sockets and real TLS over loopback; the terminators are small stand-ins."""

from __future__ import annotations

import _socket
import contextlib
import socket
import ssl
import threading
from pathlib import Path

import pytest
import trio

from pact_ingress.model import Route
from pact_ingress.net.backends import Backends
from pact_ingress.net.replay import ReplayStream
from pact_ingress.net.router import Router
from pact_ingress.net.tls_server import ServerTLS
from pact_ingress.proto.clienthello import ClientHello
from pact_ingress.stats import Stats
from tests.netutil import TEST_TIMEOUT, make_config, route
from tests.tls_helpers import LOOPBACK, StaticCerts, WebPKI

HOST = "t.example.test"
PASS_HOST = "p.example.test"
TUNNEL_HOST = "tunnel.example.test"
RELAY_HOST = "relay.example.test"



class _StreamOnly:
    """A terminator with `serve` only: TLS over the stream it is given, then echo."""

    def __init__(self) -> None:
        self.seen: list[object] = []

    async def serve(self, stream: ReplayStream, server_ctx: ssl.SSLContext, route: Route,
                    client: tuple[str, int], *, sni: str | None = None) -> None:
        self.seen.append(("stream", type(stream), sni))
        tls = trio.SSLStream(stream, server_ctx, server_side=True)
        try:
            with trio.fail_after(TEST_TIMEOUT):
                while data := await tls.receive_some(4096):
                    await tls.send_all(data)
        except (trio.BrokenResourceError, ssl.SSLError, OSError):
            pass


class _Both(_StreamOnly):
    """A terminator with `serve_socket` too: it records what it was handed."""

    async def serve_socket(self, sock: socket.socket, data: bytes,
                           server_ctx: ssl.SSLContext, route: Route,
                           client: tuple[str, int], *, sni: str | None = None) -> None:
        self.seen.append(("socket", type(sock), data[:1], sni, route.host))
        tls = ServerTLS(sock, server_ctx, data)
        try:
            with trio.fail_after(TEST_TIMEOUT):
                await tls.do_handshake()
                while data := await tls.receive_some():
                    await tls.send_all(data)
        except trio.BrokenResourceError:
            pass
        finally:
            tls.close()


def _echo_once(port: int, ctx: ssl.SSLContext, payload: bytes) -> bytes:
    with socket.create_connection((LOOPBACK, port), timeout=TEST_TIMEOUT) as raw:
        with ctx.wrap_socket(raw, server_hostname=HOST) as tls:
            tls.sendall(payload)
            got = b""
            while len(got) < len(payload):
                chunk = tls.recv(65536)
                if not chunk:
                    break
                got += chunk
            return got


async def _served(nursery: trio.Nursery, tmp: Path, terminator: object,
                  pki: WebPKI) -> tuple[Router, int]:
    config = make_config(tmp, [route(HOST, "t", 9, mode="terminate")])
    router = Router(config, stats=Stats(), backends=Backends(),
                    terminator=terminator,  # type: ignore[arg-type]
                    certs=StaticCerts(pki.server_context(HOST, alpn=("http/1.1",))))
    listeners = await trio.open_tcp_listeners(0, host=LOOPBACK)
    port = listeners[0].socket.getsockname()[1]
    await nursery.start(router.serve, listeners)
    return router, port


async def _settled(router: Router) -> None:
    with trio.fail_after(TEST_TIMEOUT):
        while router.open_connections:
            await trio.sleep(0.01)


async def test_terminate_connections_reach_the_terminator_as_bare_sockets(
        nursery: trio.Nursery, tmp_path: Path) -> None:
    pki = WebPKI()
    terminator = _Both()
    router, port = await _served(nursery, tmp_path, terminator, pki)
    client = pki.client_context(alpn=("http/1.1",))
    for n in range(3):
        payload = f"ping {n}".encode() * 100
        assert await trio.to_thread.run_sync(_echo_once, port, client, payload) == payload
    await _settled(router)
    # the peeked ClientHello (a handshake record) came first; nothing went to `serve`;
    # the socket is the very object the engine accepted (no new one made for its fd)
    assert terminator.seen == [("socket", _socket.socket, b"\x16", HOST, HOST)] * 3


def _quiet_client(port: int, ctx: ssl.SSLContext, handshake: bool,
                  done: threading.Event) -> None:
    """A real ClientHello (and, with `handshake`, the rest of the handshake), then
    nothing until `done` (or the test's timeout)."""
    with socket.create_connection((LOOPBACK, port), timeout=TEST_TIMEOUT) as raw:
        if handshake:
            with ctx.wrap_socket(raw, server_hostname=HOST):
                done.wait(TEST_TIMEOUT + 5)
            return
        hello = ctx.wrap_bio(ssl.MemoryBIO(), outgoing := ssl.MemoryBIO(),
                             server_hostname=HOST)
        with contextlib.suppress(ssl.SSLWantReadError):
            hello.do_handshake()
        raw.sendall(outgoing.read())
        done.wait(TEST_TIMEOUT + 5)


@pytest.mark.parametrize("handshake", [False, True], ids=["in_handshake", "after_it"])
async def test_a_quiet_client_never_holds_up_another_connection(
        nursery: trio.Nursery, tmp_path: Path, handshake: bool) -> None:
    """The handed-over socket must be non-blocking: a read that waits for a client who
    went quiet parks its task, and the other connections are served meanwhile."""
    pki = WebPKI()
    terminator = _Both()
    router, port = await _served(nursery, tmp_path, terminator, pki)
    client = pki.client_context(alpn=("http/1.1",))
    done = threading.Event()
    async with trio.open_nursery() as inner:
        inner.start_soon(trio.to_thread.run_sync, _quiet_client, port, client, handshake, done)
        with trio.fail_after(TEST_TIMEOUT):
            while not terminator.seen:  # the quiet one is being served
                await trio.sleep(0.01)
        await trio.sleep(0.2)  # (and has come to its read)
        try:
            got = await trio.to_thread.run_sync(_echo_once, port, client, b"other" * 50)
        finally:
            done.set()
    assert got == b"other" * 50
    await _settled(router)


async def test_every_alpn_reaches_the_terminator_but_an_acme_validation(
        nursery: trio.Nursery, tmp_path: Path) -> None:
    """The engine's shortcut decides on the hello's bytes without parsing it: one that
    names `acme-tls/1` anywhere (here inside another ALPN name) takes the router's
    parsing path and is still terminated; only a real `acme-tls/1` offer is kept from
    the terminator (answered by the challenge responder: none here, so an alert)."""
    pki = WebPKI()
    terminator = _Both()
    router, port = await _served(nursery, tmp_path, terminator, pki)
    for alpn in (("http/1.1",), ("x-acme-tls/1", "http/1.1"), ("h2", "http/1.1")):
        client = pki.client_context(alpn=alpn)
        assert await trio.to_thread.run_sync(_echo_once, port, client, b"hi") == b"hi"
    await _settled(router)
    assert [(kind, first, sni, host) for kind, _, first, sni, host in terminator.seen] == [
        ("socket", b"\x16", HOST, HOST)] * 3
    client = pki.client_context(alpn=("acme-tls/1",))
    try:
        await trio.to_thread.run_sync(_echo_once, port, client, b"hi")
    except (ssl.SSLError, OSError):
        pass  # refused: no challenge certificate here
    else:
        raise AssertionError("an ACME validation was served")
    await _settled(router)
    assert len(terminator.seen) == 3
    assert router.stats.value("pact_ingress_rejections_total",
                              {"reason": "acme_no_challenge"}) == 1


async def test_a_terminator_with_serve_only_still_gets_a_stream(
        nursery: trio.Nursery, tmp_path: Path) -> None:
    pki = WebPKI()
    terminator = _StreamOnly()
    router, port = await _served(nursery, tmp_path, terminator, pki)
    client = pki.client_context(alpn=("http/1.1",))
    assert await trio.to_thread.run_sync(_echo_once, port, client, b"hello") == b"hello"
    await _settled(router)
    assert terminator.seen == [("stream", ReplayStream, HOST)]


class _Relay:
    host = RELAY_HOST

    async def serve(self, stream: ReplayStream, client: tuple[str, int]) -> None:
        raise AssertionError("not called here")


def _hello(sni: str | None, *alpn: str) -> ClientHello:
    return ClientHello(sni=sni, alpn=alpn, legacy_version=0x0303, record_version=0x0301,
                       raw_len=0)


def test_the_shortcut_takes_exactly_what_dispatch_would_terminate(tmp_path: Path) -> None:
    """`_plain_terminate` returns a route only for a hello `_dispatch` sends to
    `_terminate`: not a tunnel or forward link, not the relay host, not an ACME
    validation, not a passthrough route, not an unknown or missing name."""
    config = make_config(tmp_path, [route(HOST, "t", 9, mode="terminate"),
                                    route(PASS_HOST, "t", 9)],
                         tunnel_hostname=TUNNEL_HOST)
    router = Router(config, stats=Stats(), backends=Backends(), terminator=_StreamOnly(),
                    tunnels=object(), relay=_Relay())  # type: ignore[arg-type]
    terminated = router._plain_terminate(_hello(HOST, "h2", "http/1.1"))
    assert terminated is not None and terminated.host == HOST
    assert router._plain_terminate(_hello(HOST.upper() + ".")) is terminated
    for hello in (None, _hello(None), _hello("unknown.example.test"), _hello(PASS_HOST),
                  _hello(HOST, "acme-tls/1"), _hello(RELAY_HOST),
                  _hello(TUNNEL_HOST, "pact-tunnel/1"), _hello(TUNNEL_HOST, "pact-forward/1")):
        assert router._plain_terminate(hello) is None, hello


class _LaneDeclines(_Both):
    """A terminator whose `start_lane` declines (no lane here) or fails: the router
    serves the connection with a task as before, or counts it closed."""

    def __init__(self, fail: bool) -> None:
        super().__init__()
        self.fail = fail
        self.asked = 0

    def start_lane(self, sock: socket.socket, data: bytes, ctx: ssl.SSLContext,
                   route: Route, client: tuple[str, int], sni: str | None,
                   spawn: object, ended: object) -> bool:
        self.asked += 1
        if self.fail:
            raise RuntimeError("a bug in the lane's start")
        return False


@pytest.mark.parametrize("fail", [False, True], ids=["declines", "fails"])
async def test_a_lane_that_declines_or_fails_leaves_the_counts_true(
        nursery: trio.Nursery, tmp_path: Path, fail: bool) -> None:
    pki = WebPKI()
    terminator = _LaneDeclines(fail)
    router, port = await _served(nursery, tmp_path, terminator, pki)
    client = pki.client_context(alpn=("http/1.1",))
    for _ in range(3):
        try:
            got = await trio.to_thread.run_sync(_echo_once, port, client, b"hi")
        except (ssl.SSLError, OSError):
            got = b""
        assert got == (b"" if fail else b"hi")
    await _settled(router)
    assert terminator.asked == 3
    assert len(terminator.seen) == (0 if fail else 3)
    if fail:
        assert router.stats.value("pact_ingress_rejections_total",
                                  {"reason": "handler_error"}) == 3
