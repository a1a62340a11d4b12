"""Reverse tunnel end to end over loopback: real TLS, real sockets, real connector.

The harness stands in for the router (not needed to test the tunnel): one listener hands
every connection to `TunnelServer.handle` (as the router does for SNI = tunnel host),
and one "caller" listener per tenant does what a passthrough route with `backend:
tunnel` does: `open_stream(tenant)` and `splice.relay`. Heartbeats are shortened so
dead-path tests run in about a second.
"""

from __future__ import annotations

import hashlib
import os
import socket
import ssl
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import trio

from pact_ingress.config import Address, ConnectorConfig, Limits
from pact_ingress.errors import BackendError
from pact_ingress.identity import Identity, check_pin, pinned_client_context
from pact_ingress.net.backends import Backends
from pact_ingress.net.replay import ReplayStream
from pact_ingress.net.router import Router
from pact_ingress.net.splice import relay
from pact_ingress.net.tunnel import connector as connector_mod
from pact_ingress.net.tunnel import server as ts
from pact_ingress.net.tunnel.connector import Connector
from pact_ingress.net.tunnel.server import TunnelServer
from pact_ingress.proto import tls_alert
from pact_ingress.proto.tunnel import constants as tc
from pact_ingress.proto.tunnel import frames as tf
from pact_ingress.proto.tunnel import session as tsess
from pact_ingress.stats import Stats
from tests.netutil import (
    TEST_TIMEOUT,
    TlsWhoAmI,
    https_get,
    make_config,
    route,
    server_context,
)
from tests.tls_helpers import make_identity

TUNNEL_HOST = "tunnel.test"
#: A captured curl ClientHello (SNI www.example.test).
HELLO = (Path(__file__).parent / "vectors" / "clienthello" / "curl.bin").read_bytes()
#: Short heartbeat for tests: a dead path is noticed after 3 × 0.2 s.
HB = 0.2


@dataclass
class Keys:
    ingress: Identity
    alina: Identity
    bob: Identity
    stranger: Identity
    caller: Identity
    home: Identity


@pytest.fixture
def keys(tmp_path: Path) -> Keys:
    return Keys(*(make_identity(tmp_path, n) for n in
                  ("ingress", "alina", "bob", "stranger", "caller", "home")))


def config(tmp_path: Path, keys: Keys, *, alina_pinned: bool = True,  # type: ignore[no-untyped-def]
           alina_pins: tuple[str, ...] | None = None):
    pins = {"bob": (keys.bob.fingerprint,)}
    if alina_pins is not None:
        pins["alina"] = alina_pins
    elif alina_pinned:
        pins["alina"] = (keys.alina.fingerprint,)
    routes = [route("alina.test", "alina", None), route("bob.test", "bob", None)]
    return make_config(tmp_path, routes, pins=pins, tunnel_hostname=TUNNEL_HOST)


@dataclass
class Ingress:
    server: TunnelServer
    stats: Stats
    tunnel_port: int
    caller_ports: dict[str, int] = field(default_factory=dict)
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)


async def _tunnel_handler(server: TunnelServer, tcp: trio.SocketStream) -> None:
    """What the router does for the tunnel: peek the first bytes (TLS ClientHello or raw
    data magic), hand over with them replayed, close afterwards."""
    try:
        peer = tcp.socket.getpeername()
        head = b""
        while tf.raw_data_prefix(head) is None:  # ≤ len(magic) reads
            chunk = await tcp.receive_some(4096)
            if not chunk:
                return
            head += chunk
        await server.handle(ReplayStream(head, tcp), (peer[0], peer[1]))
    finally:
        await trio.aclose_forcefully(tcp)  # as the router does


async def _caller_handler(server: TunnelServer, tenant: str, tcp: trio.SocketStream) -> None:
    try:
        try:
            backend = await server.open_stream(tenant)
        except BackendError:
            await tcp.send_all(tls_alert.alert_record(tls_alert.INTERNAL_ERROR))
            return
        try:
            await relay(tcp, backend, idle_timeout=TEST_TIMEOUT)
        finally:
            await trio.aclose_forcefully(backend)
    finally:
        await trio.aclose_forcefully(tcp)


async def _listen(port: int = 0) -> list[trio.SocketListener]:
    return await trio.open_tcp_listeners(port, host="127.0.0.1")


@asynccontextmanager
async def ingress(nursery: trio.Nursery, keys: Keys, cfg: object, *, port: int = 0,
                  heartbeat: float = HB) -> AsyncIterator[Ingress]:
    stats = Stats()
    server = TunnelServer(identity=keys.ingress, stats=stats, heartbeat=heartbeat)
    server.update(cfg)  # type: ignore[arg-type]
    tunnel = await _listen(port)
    ing = Ingress(server, stats, tunnel[0].socket.getsockname()[1])

    async def run(task_status: trio.TaskStatus[None]) -> None:
        with ing.scope:
            async with trio.open_nursery() as n:
                n.start_soon(trio.serve_listeners,
                             lambda s: _tunnel_handler(server, s), tunnel)
                for tenant in ("alina", "bob"):
                    listeners = await _listen()
                    ing.caller_ports[tenant] = listeners[0].socket.getsockname()[1]
                    n.start_soon(trio.serve_listeners,
                                 lambda s, t=tenant: _caller_handler(server, t, s), listeners)
                task_status.started()

    await nursery.start(run)
    yield ing


def connector_config(tmp_path: Path, ident: Identity, ingress_fp: str, port: int,
                     forward: int, connections: int = 2) -> ConnectorConfig:
    return ConnectorConfig(path=tmp_path / "connector.yaml", identity_key=ident.key_path,
                           ingress=Address("127.0.0.1", port), tunnel_hostname=TUNNEL_HOST,
                           pin=ingress_fp, forward=Address("127.0.0.1", forward),
                           connections=connections)


async def start_connector(nursery: trio.Nursery, cfg: ConnectorConfig, *,
                          shutdown: trio.Event | None = None, grace: float = 5.0,
                          data_transport: str = "auto"
                          ) -> tuple[Connector, trio.CancelScope]:
    connector = Connector(cfg, heartbeat=HB, data_transport=data_transport)
    scope = trio.CancelScope()

    async def run() -> None:
        with scope:
            await connector.run(shutdown=shutdown, grace=grace)

    nursery.start_soon(run)
    return connector, scope


async def eventually(check: Callable[[], bool], timeout: float = TEST_TIMEOUT) -> None:
    with trio.fail_after(timeout):
        while not check():
            await trio.sleep(0.01)


async def whoami(nursery: trio.Nursery, keys: Keys, name: str) -> TlsWhoAmI:
    backend = TlsWhoAmI(keys.home, server_context(keys.home, client_ca=[keys.caller]), name)
    await nursery.start(backend.serve)
    return backend


async def echo_server(nursery: trio.Nursery) -> int:
    async def echo(s: trio.SocketStream) -> None:
        try:
            while data := await s.receive_some(1 << 16):
                await s.send_all(data)
            await s.send_eof()
        except (trio.BrokenResourceError, OSError):
            pass

    listeners = await nursery.start(trio.serve_tcp, echo, 0)
    return listeners[0].socket.getsockname()[1]


def events(stats: Stats, tenant: str, event: str) -> float:
    return stats.value("pact_ingress_tunnel_events_total", {"tenant": tenant, "event": event})


# --- both ends up: the passthrough path ---------------------------------------------------


@pytest.mark.parametrize("transport", ["auto", "tls"])
async def test_passthrough_through_tunnel_sees_caller_cert(tmp_path: Path, keys: Keys,
                                                           nursery: trio.Nursery,
                                                           transport: str) -> None:
    backend = await whoami(nursery, keys, "alina-home")
    async with ingress(nursery, keys, config(tmp_path, keys)) as ing:
        cfg = connector_config(tmp_path, keys.alina, keys.ingress.fingerprint,
                               ing.tunnel_port, backend.port)
        connector, _ = await start_connector(nursery, cfg, data_transport=transport)
        await eventually(lambda: ing.server.live_tunnels("alina") == 2)
        await eventually(lambda: ing.server.idle_connections("alina") >= tsess.POOL_MIN)
        for _ in range(5):
            body, server_fp = await https_get(ing.caller_ports["alina"], "alina.test",
                                              keys.caller)
            assert body == f"alina-home {keys.caller.fingerprint}"
            assert server_fp == keys.home.fingerprint  # end-to-end TLS with the home node
        assert backend.seen == [keys.caller.fingerprint] * 5
        assert ing.stats.value("pact_ingress_tunnels", {"tenant": "alina"}) == 2
        assert events(ing.stats, "alina", "stream_open") == 5
        await eventually(lambda: ing.server.open_streams("alina") == 0)
        assert connector.raw_data == (transport == "auto")  # auto stayed raw: no fallback
        assert events(ing.stats, "-", "refused_handshake_failed") == 0
    ing.scope.cancel()


@pytest.mark.parametrize("transport", ["raw", "tls"])
async def test_bulk_bytes_arrive_intact_both_ways(tmp_path: Path, keys: Keys,
                                                  nursery: trio.Nursery,
                                                  transport: str) -> None:
    port = await echo_server(nursery)
    async with ingress(nursery, keys, config(tmp_path, keys)) as ing:
        cfg = connector_config(tmp_path, keys.alina, keys.ingress.fingerprint,
                               ing.tunnel_port, port)
        connector, _ = await start_connector(nursery, cfg, data_transport=transport)
        await eventually(lambda: ing.server.idle_connections("alina") > 0)
        payload = os.urandom(1 << 20) * 8  # 8 MiB
        with trio.fail_after(TEST_TIMEOUT):
            s = await trio.open_tcp_stream("127.0.0.1", ing.caller_ports["alina"])
            got = hashlib.sha256()
            received = 0

            async def send() -> None:
                await s.send_all(payload)
                await s.send_eof()

            async with trio.open_nursery() as n:
                n.start_soon(send)
                while data := await s.receive_some(1 << 16):
                    got.update(data)
                    received += len(data)
            await s.aclose()
        assert received == len(payload)
        assert got.digest() == hashlib.sha256(payload).digest()
        up = connector.stats.value("pact_ingress_bytes_total",
                                   {"route": "tunnel", "direction": "up"})
        assert up == len(payload)
    ing.scope.cancel()


async def test_used_data_connections_are_replaced_with_spares(
        tmp_path: Path, keys: Keys, nursery: trio.Nursery) -> None:
    """Steady state: opening a stream sends nothing on the control connection — the
    connector replaces each used data connection with a SPARE it holds; TOKENs are for
    the pool's growth only, so 20 streams must not cost 20 of them."""
    port = await echo_server(nursery)
    async with ingress(nursery, keys, config(tmp_path, keys)) as ing:
        cfg = connector_config(tmp_path, keys.alina, keys.ingress.fingerprint,
                               ing.tunnel_port, port, connections=1)
        connector, _ = await start_connector(nursery, cfg, data_transport="raw")
        await eventually(lambda: ing.server.idle_connections("alina") == tsess.POOL_MIN)
        [session] = ing.server._sessions["alina"]
        assert len(session.grants.spares) == tsess.SPARE_MIN  # granted with the first TOKENs
        tokens_before = events(ing.stats, "alina", "tokens_granted")
        spares_before = events(ing.stats, "alina", "spares_granted")
        for i in range(20):
            level = ing.server.idle_connections("alina")
            with trio.fail_after(TEST_TIMEOUT):
                s = await trio.open_tcp_stream("127.0.0.1", ing.caller_ports["alina"])
                await s.send_all(b"ping %d" % i)
                assert await s.receive_some(64) == b"ping %d" % i
                await s.aclose()
            # the replacement arrives by itself (a few ms after the answer)
            await eventually(lambda n=level: ing.server.idle_connections("alina") >= n)
        tokens = events(ing.stats, "alina", "tokens_granted") - tokens_before
        assert tokens <= 2  # the pool may grow by one or two as the open rate rises
        assert events(ing.stats, "alina", "spares_granted") > spares_before  # topped up
        assert events(ing.stats, "alina", "stream_open") == 20
        # every take was replaced with a spare (none expire here: SPARE_TTL is 300 s)
        await eventually(lambda: events(ing.stats, "alina", "spares_granted")
                         - len(session.grants.spares) == 20)
        assert not session.replacing
        assert connector.idle_data >= tsess.POOL_MIN
    ing.scope.cancel()


async def test_forward_down_answers_like_a_dead_backend(tmp_path: Path, keys: Keys,
                                                       nursery: trio.Nursery) -> None:
    """`forward` refusing connections: the caller gets a fatal TLS alert, the connector
    counts it, and the next stream (once forward is up) goes through."""
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()  # nothing listens there now: connects are refused
    async with ingress(nursery, keys, config(tmp_path, keys)) as ing:
        cfg = connector_config(tmp_path, keys.alina, keys.ingress.fingerprint,
                               ing.tunnel_port, port)
        connector, _ = await start_connector(nursery, cfg, data_transport="raw")
        await eventually(lambda: ing.server.idle_connections("alina") > 0)
        with trio.fail_after(TEST_TIMEOUT):
            s = await trio.open_tcp_stream("127.0.0.1", ing.caller_ports["alina"])
            await s.send_all(b"\x16\x03\x01hello")
            answer = await read_all(s)
            await s.aclose()
        assert answer == tls_alert.alert_record(tls_alert.INTERNAL_ERROR)
        assert connector.stats.value("pact_ingress_tunnel_events_total",
                                     {"tenant": connector.label,
                                      "event": "forward_unreachable"}) == 1
        assert connector.active_streams == 0
    ing.scope.cancel()


async def test_tenant_isolation(tmp_path: Path, keys: Keys, nursery: trio.Nursery) -> None:
    alina_home = await whoami(nursery, keys, "alina-home")
    bob_home = await whoami(nursery, keys, "bob-home")
    async with ingress(nursery, keys, config(tmp_path, keys)) as ing:
        fp = keys.ingress.fingerprint
        await start_connector(nursery, connector_config(
            tmp_path, keys.alina, fp, ing.tunnel_port, alina_home.port))
        await start_connector(nursery, connector_config(
            tmp_path, keys.bob, fp, ing.tunnel_port, bob_home.port))
        await eventually(lambda: ing.server.idle_connections("alina") > 0
                         and ing.server.idle_connections("bob") > 0)
        for _ in range(4):
            for tenant, home in (("alina", "alina-home"), ("bob", "bob-home")):
                body, _ = await https_get(ing.caller_ports[tenant], f"{tenant}.test",
                                          keys.caller)
                assert body.startswith(home + " ")
        assert len(alina_home.seen) == 4 and len(bob_home.seen) == 4

        # alina's key presenting one of bob's tokens: refused, counted, bob's pool intact
        # (the test plays an attacker that learned a token granted to bob's connector)
        bob_session = ing.server._sessions["bob"][0]
        bob_token = os.urandom(32)
        ing.server._tokens.issue(bob_session, tsess.Kind.TOKEN, trio.current_time(),
                                 token=bob_token)
        with pytest.raises((trio.BrokenResourceError, ssl.SSLError)):
            await raw_data_connection(ing.tunnel_port, keys.alina, keys.ingress, bob_token)
        await eventually(lambda: events(ing.stats, "alina", "refused_token_mismatch") == 1)
        assert bob_token not in ing.server._tokens  # single use, even when refused
    ing.scope.cancel()


# --- refusals ------------------------------------------------------------------------------


async def pinned_tls(port: int, ident: Identity | None, ingress_key: Identity,
                     alpn: str) -> trio.SSLStream[trio.SocketStream]:
    ctx = pinned_client_context(ident, [alpn])
    tcp = await trio.open_tcp_stream("127.0.0.1", port)
    tls = trio.SSLStream(tcp, ctx, server_hostname=TUNNEL_HOST)
    await tls.do_handshake()
    check_pin(tls, [ingress_key.fingerprint])  # type: ignore[arg-type]
    return tls


async def read_all(stream: trio.abc.Stream) -> bytes:
    out = b""
    with trio.fail_after(TEST_TIMEOUT):
        try:
            while data := await stream.receive_some(4096):
                out += data
        except trio.BrokenResourceError:
            pass
    return out


async def raw_data_connection(port: int, ident: Identity, ingress_key: Identity,
                              token: bytes) -> bytes:
    tls = await pinned_tls(port, ident, ingress_key, tc.ALPN_DATA)
    await tls.send_all(tf.encode(tf.DataHello(token)))
    data = await read_all(tls)
    await trio.aclose_forcefully(tls)
    if not data:
        raise trio.BrokenResourceError("closed without DATA_OK")
    return data


async def test_unknown_connector_refused(tmp_path: Path, keys: Keys,
                                         nursery: trio.Nursery) -> None:
    port = await echo_server(nursery)
    async with ingress(nursery, keys, config(tmp_path, keys)) as ing:
        cfg = connector_config(tmp_path, keys.stranger, keys.ingress.fingerprint,
                               ing.tunnel_port, port)
        connector, scope = await start_connector(nursery, cfg)
        await eventually(lambda: events(ing.stats, "-", "refused_unknown_key") >= 1)
        await eventually(lambda: connector.stats.value(
            "pact_ingress_tunnel_events_total",
            {"tenant": connector.label, "event": "goaway_unknown_key"}) >= 1)
        assert not ing.server._all_sessions() and connector.live_links == 0
        scope.cancel()
        with pytest.raises(BackendError):
            await ing.server.open_stream("alina")
    ing.scope.cancel()


async def test_connector_refuses_wrong_ingress_pin(tmp_path: Path, keys: Keys,
                                                   nursery: trio.Nursery) -> None:
    async with ingress(nursery, keys, config(tmp_path, keys)) as ing:
        cfg = connector_config(tmp_path, keys.alina, keys.stranger.fingerprint,
                               ing.tunnel_port, 9)
        connector, scope = await start_connector(nursery, cfg)
        await eventually(lambda: connector.stats.value(
            "pact_ingress_tunnel_events_total",
            {"tenant": connector.label, "event": "refused_ingress_pin"}) >= 1)
        assert ing.server.live_tunnels("alina") == 0
        scope.cancel()
    ing.scope.cancel()


async def test_wrong_alpn_and_no_cert_refused(tmp_path: Path, keys: Keys,
                                              nursery: trio.Nursery) -> None:
    async with ingress(nursery, keys, config(tmp_path, keys)) as ing:
        with pytest.raises((trio.BrokenResourceError, ssl.SSLError)):
            tls = await pinned_tls(ing.tunnel_port, keys.alina, keys.ingress, "h2")
            assert await read_all(tls) == b""  # TLS 1.3: refusal shows on first read
            raise trio.BrokenResourceError
        with pytest.raises((trio.BrokenResourceError, ssl.SSLError)):
            tls = await pinned_tls(ing.tunnel_port, None, keys.ingress, tc.ALPN_CONTROL)
            await tls.send_all(b"x")
            assert await read_all(tls) == b""
            raise trio.BrokenResourceError
        await eventually(lambda: events(ing.stats, "-", "refused_bad_alpn")
                         + events(ing.stats, "-", "refused_handshake_failed") >= 2)
        assert not ing.server._all_sessions()
    ing.scope.cancel()


async def test_garbage_and_floods_on_control_refused(tmp_path: Path, keys: Keys,
                                                     nursery: trio.Nursery) -> None:
    async with ingress(nursery, keys, config(tmp_path, keys)) as ing:
        fds_before = len(os.listdir("/proc/self/fd"))
        # garbage right after the handshake
        tls = await pinned_tls(ing.tunnel_port, keys.alina, keys.ingress, tc.ALPN_CONTROL)
        await tls.send_all(b"\xff" * 64)
        answer = tf.Decoder()
        answer.feed(await read_all(tls))
        msg = answer.next_message()
        assert isinstance(msg, tf.Goaway) and msg.code == tf.GoawayCode.PROTOCOL_ERROR
        await trio.aclose_forcefully(tls)
        await eventually(lambda: events(ing.stats, "alina", "refused_protocol_error") == 1)

        # a valid session that floods pings
        tls = await pinned_tls(ing.tunnel_port, keys.alina, keys.ingress, tc.ALPN_CONTROL)
        await tls.send_all(tf.encode(tf.Hello(tf.VERSION, 0, b"f" * 16)))
        await tls.send_all(tf.encode(tf.Ping(1)) * (ts.CONTROL_FRAME_BURST + 50))
        data = await read_all(tls)
        await trio.aclose_forcefully(tls)
        frames = tf.Decoder()
        frames.feed(data)
        got = []
        while (m := frames.next_message()) is not None:
            got.append(m)
        assert isinstance(got[0], tf.Welcome)
        assert got[-1] == tf.Goaway(tf.GoawayCode.PROTOCOL_ERROR, 0, "control frame flood")
        await eventually(lambda: events(ing.stats, "alina", "refused_flood") == 1)

        # a flood of data connections with made-up tokens: each refused, nothing kept
        for i in range(20):
            with pytest.raises(trio.BrokenResourceError):
                await raw_data_connection(ing.tunnel_port, keys.alina, keys.ingress,
                                          os.urandom(32))
        assert events(ing.stats, "alina", "refused_bad_token") == 20
        await eventually(lambda: not ing.server._all_sessions())
        assert len(ing.server._tokens) == 0
        await eventually(lambda: len(os.listdir("/proc/self/fd")) <= fds_before)  # no leak
    ing.scope.cancel()


async def raw_dial(port: int, payload: bytes) -> trio.SocketStream:
    s = await trio.open_tcp_stream("127.0.0.1", port)
    await s.send_all(payload)
    return s


async def control_session(port: int, keys: Keys, kind: type = tf.Token,
                          count: int = tsess.POOL_MIN
                          ) -> tuple[trio.SSLStream[trio.SocketStream], list[bytes]]:
    """A hand-made control session of alina's key; returns it and the first `count`
    tokens granted of `kind` (TOKEN or SPARE)."""
    tls = await pinned_tls(port, keys.alina, keys.ingress, tc.ALPN_CONTROL)
    await tls.send_all(tf.encode(tf.Hello(tf.VERSION, 0, b"h" * 16)))
    decoder, tokens = tf.Decoder(), []
    with trio.fail_after(TEST_TIMEOUT):
        while len(tokens) < count:
            decoder.feed(await tls.receive_some(4096))
            while (msg := decoder.next_message()) is not None:
                if isinstance(msg, kind):
                    tokens.append(msg.token)  # type: ignore[attr-defined]
    return tls, tokens


async def test_raw_data_tokens_single_use_and_bound_to_their_session(
        tmp_path: Path, keys: Keys, nursery: trio.Nursery) -> None:
    """A raw data connection's only credential is its token: issued inside the pinned
    control TLS, good once, for the session (so the tenant) that issued it."""
    async with ingress(nursery, keys, config(tmp_path, keys)) as ing:
        tls, tokens = await control_session(ing.tunnel_port, keys)
        first = await raw_dial(ing.tunnel_port, tf.raw_data_preamble(tokens[0]))
        with trio.fail_after(TEST_TIMEOUT):
            assert await first.receive_some(3) == tf.encode(tf.DataOk())
        await eventually(lambda: ing.server.idle_connections("alina") == 1)
        # the same token again (an eavesdropper replaying it): refused, nothing pooled
        replay = await raw_dial(ing.tunnel_port, tf.raw_data_preamble(tokens[0]))
        assert await read_all(replay) == b""
        assert events(ing.stats, "alina", "refused_bad_token") + \
            events(ing.stats, "-", "refused_bad_token") == 1
        # made-up tokens and malformed preambles: refused and counted, nothing pooled
        for payload, why in ((tf.raw_data_preamble(os.urandom(32)), "refused_bad_token"),
                             (tf.RAW_DATA_MAGIC + b"\xff" * 40, "refused_protocol_error"),
                             (tf.raw_data_preamble(tokens[1]) + b"x",
                              "refused_protocol_error")):
            before = events(ing.stats, "-", why)
            s = await raw_dial(ing.tunnel_port, payload)
            assert await read_all(s) == b""
            await eventually(lambda w=why, n=before: events(ing.stats, "-", w) == n + 1)
        assert ing.server.idle_connections("alina") == 1
        # the pooled one carries a stream (the harness's caller → open_stream → it)
        caller = await trio.open_tcp_stream("127.0.0.1", ing.caller_ports["alina"])
        await caller.send_all(b"hi")
        with trio.fail_after(TEST_TIMEOUT):
            assert await first.receive_some(2) == b"hi"
        # the control session ends: its tokens die with it
        await trio.aclose_forcefully(tls)
        await eventually(lambda: ing.server.live_tunnels("alina") == 0)
        late = await raw_dial(ing.tunnel_port, tf.raw_data_preamble(tokens[2]))
        assert await read_all(late) == b""
        assert len(ing.server._tokens) == 0
        await trio.aclose_forcefully(first)
        await trio.aclose_forcefully(caller)
    ing.scope.cancel()


async def test_spare_tokens_single_use_bound_and_expiring(
        tmp_path: Path, keys: Keys, nursery: trio.Nursery,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A SPARE is a token like a TOKEN (single use, its session's only), valid for
    SPARE_TTL."""
    monkeypatch.setattr(tf, "SPARE_TTL", 1.0)
    async with ingress(nursery, keys, config(tmp_path, keys)) as ing:
        tls, spares = await control_session(ing.tunnel_port, keys, tf.Spare, tsess.SPARE_MIN)
        used = await raw_dial(ing.tunnel_port, tf.raw_data_preamble(spares[0]))
        with trio.fail_after(TEST_TIMEOUT):
            assert await used.receive_some(3) == tf.encode(tf.DataOk())
        replay = await raw_dial(ing.tunnel_port, tf.raw_data_preamble(spares[0]))
        assert await read_all(replay) == b""
        await trio.sleep(1.2)  # past the (shortened) SPARE_TTL
        late = await raw_dial(ing.tunnel_port, tf.raw_data_preamble(spares[1]))
        assert await read_all(late) == b""
        assert events(ing.stats, "-", "refused_bad_token") == 2
        await trio.aclose_forcefully(used)
        await trio.aclose_forcefully(tls)
    ing.scope.cancel()


async def test_older_protocol_version_refused_with_a_reason(
        tmp_path: Path, keys: Keys, nursery: trio.Nursery) -> None:
    """A connector speaking another version (e.g. 1, before SPARE frames) gets a
    GOAWAY naming the version expected, and the refusal is counted."""
    async with ingress(nursery, keys, config(tmp_path, keys)) as ing:
        tls = await pinned_tls(ing.tunnel_port, keys.alina, keys.ingress, tc.ALPN_CONTROL)
        await tls.send_all(tf.encode(tf.Hello(tf.VERSION - 1, 0, b"h" * 16)))
        decoder = tf.Decoder()
        decoder.feed(await read_all(tls))
        goaway = decoder.next_message()
        assert isinstance(goaway, tf.Goaway)
        assert goaway.code == tf.GoawayCode.PROTOCOL_ERROR
        assert f"HELLO v{tf.VERSION}" in goaway.reason
        assert events(ing.stats, "alina", "refused_protocol_error") == 1
        assert ing.server.live_tunnels("alina") == 0
    ing.scope.cancel()


def test_take_spare_skips_stale_ones() -> None:
    spares = deque([(b"old", 0.0), (b"ok", 100.0), (b"new", 200.0)])
    now = 100.0 + connector_mod.SPARE_USE_WITHIN
    assert connector_mod.take_spare(spares, now) == b"ok"  # "old" dropped on the way
    assert list(spares) == [(b"new", 200.0)]
    assert connector_mod.take_spare(spares, 200.0 + connector_mod.SPARE_USE_WITHIN + 1) \
        is None
    assert not spares


async def test_raw_data_silence_times_out(tmp_path: Path, keys: Keys, nursery: trio.Nursery,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ts, "HANDSHAKE_TIMEOUT", 0.2)
    async with ingress(nursery, keys, config(tmp_path, keys)) as ing:
        s = await raw_dial(ing.tunnel_port, tf.RAW_DATA_MAGIC + b"\x07")  # then nothing
        assert await read_all(s) == b""
        assert events(ing.stats, "-", "refused_timeout") == 1
    ing.scope.cancel()


class TlsOnlyProxy:
    """A "TLS only on 443" middlebox: forwards connections whose first byte starts a TLS
    record (0x16) and resets the rest."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.dropped = 0

    async def serve(self, task_status: trio.TaskStatus[int]) -> None:
        listeners = await _listen()
        task_status.started(listeners[0].socket.getsockname()[1])
        await trio.serve_listeners(self._handle, listeners)

    async def _handle(self, client: trio.SocketStream) -> None:
        try:
            first = await client.receive_some(65536)
        except (trio.BrokenResourceError, OSError):
            return
        if not first.startswith(b"\x16"):
            self.dropped += 1
            await trio.aclose_forcefully(client)
            return
        upstream = await trio.open_tcp_stream("127.0.0.1", self.target)
        await upstream.send_all(first)

        async def pump(src: trio.SocketStream, dst: trio.SocketStream) -> None:
            try:
                while data := await src.receive_some(65536):
                    await dst.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                pass
            await trio.aclose_forcefully(dst)

        async with client, upstream, trio.open_nursery() as n:
            n.start_soon(pump, client, upstream)
            n.start_soon(pump, upstream, client)


async def test_auto_falls_back_to_tls_data_behind_a_tls_only_middlebox(
        tmp_path: Path, keys: Keys, nursery: trio.Nursery) -> None:
    port = await echo_server(nursery)
    async with ingress(nursery, keys, config(tmp_path, keys)) as ing:
        proxy = TlsOnlyProxy(ing.tunnel_port)
        proxy_port = await nursery.start(proxy.serve)
        cfg = connector_config(tmp_path, keys.alina, keys.ingress.fingerprint,
                               proxy_port, port)
        connector, _ = await start_connector(nursery, cfg)
        await eventually(lambda: not connector.raw_data)
        assert proxy.dropped >= connector_mod.RAW_FAILURES_BEFORE_FALLBACK
        assert connector.stats.value("pact_ingress_tunnel_events_total", {
            "tenant": connector.label, "event": "data_fallback_tls"}) == 1
        await eventually(lambda: ing.server.idle_connections("alina") >= tsess.POOL_MIN)
        for _ in range(3):
            s = await trio.open_tcp_stream("127.0.0.1", ing.caller_ports["alina"])
            await s.send_all(b"through")
            with trio.fail_after(TEST_TIMEOUT):
                assert await s.receive_some(7) == b"through"
            await s.aclose()
        # the failed raw dials and their TLS retries were each counted once: the
        # connector's idle count settles on the ingress's pool
        await eventually(lambda: connector.dialing == 0
                         and connector.idle_data == ing.server.idle_connections("alina"))
        assert all(link.dialing == 0 for link in connector._links)
    ing.scope.cancel()


async def test_raw_data_connections_through_the_real_router(tmp_path: Path, keys: Keys,
                                                            nursery: trio.Nursery) -> None:
    """The router recognises the raw magic before ClientHello parsing (no TLS fallback
    allowed here), and serves the passthrough route through the tunnel."""
    backend = await whoami(nursery, keys, "alina-home")
    cfg_ing = config(tmp_path, keys)
    stats = Stats()
    server = TunnelServer(identity=keys.ingress, stats=stats, heartbeat=HB)
    server.update(cfg_ing)
    router = Router(cfg_ing, stats=stats, backends=Backends(tunnels=server), tunnels=server)
    listeners = await _listen()
    await nursery.start(router.serve, listeners)
    port = listeners[0].socket.getsockname()[1]
    cfg = connector_config(tmp_path, keys.alina, keys.ingress.fingerprint, port,
                           backend.port)
    connector, scope = await start_connector(nursery, cfg, data_transport="raw")
    await eventually(lambda: server.idle_connections("alina") >= tsess.POOL_MIN)
    for _ in range(3):
        body, server_fp = await https_get(port, "alina.test", keys.caller)
        assert body == f"alina-home {keys.caller.fingerprint}"
        assert server_fp == keys.home.fingerprint
    assert connector.stats.value("pact_ingress_tunnel_events_total", {
        "tenant": connector.label, "event": "data_failed"}) == 0
    scope.cancel()
    await router.drain(0)



async def test_household_behind_one_address_cannot_lock_out_its_connector(
        tmp_path: Path, keys: Keys, nursery: trio.Nursery) -> None:
    """The household's own clients fill the per-IP cap of their shared NAT address; its
    connector, dialling from the same address, still gets its control and data
    connections in (they are counted apart), so callers elsewhere are served."""
    backend = await whoami(nursery, keys, "alina-home")
    held_by = await echo_server(nursery)
    cap = 8
    limits = Limits(max_connections_per_ip=cap)
    cfg_ing = make_config(tmp_path, [route("alina.test", "alina", None),
                                     route("www.example.test", "house", held_by)],
                          limits=limits, pins={"alina": (keys.alina.fingerprint,)},
                          tunnel_hostname=TUNNEL_HOST)
    stats = Stats()
    server = TunnelServer(identity=keys.ingress, stats=stats, heartbeat=HB)
    server.update(cfg_ing)
    router = Router(cfg_ing, stats=stats, backends=Backends(tunnels=server), tunnels=server)
    listeners = await _listen()
    await nursery.start(router.serve, listeners)
    port = listeners[0].socket.getsockname()[1]
    household = []
    for _ in range(cap):  # e.g. the family's phones, all behind 127.0.0.1
        s = await trio.open_tcp_stream("127.0.0.1", port)
        await s.send_all(HELLO)
        echoed = b""
        with trio.fail_after(TEST_TIMEOUT):  # routed: counted as an ordinary client
            while len(echoed) < len(HELLO):
                echoed += await s.receive_some(len(HELLO))
        household.append(s)
    await eventually(lambda: router.open_connections == cap)
    cfg = connector_config(tmp_path, keys.alina, keys.ingress.fingerprint, port,
                           backend.port, connections=1)
    connector, scope = await start_connector(nursery, cfg, data_transport="raw")
    await eventually(lambda: server.live_tunnels("alina") == 1
                     and server.idle_connections("alina") >= tsess.POOL_MIN)
    body, _ = await https_get(port, "alina.test", keys.caller, local_address="127.0.0.2")
    assert body == f"alina-home {keys.caller.fingerprint}"
    # the household's own cap still holds for its ordinary connections
    extra = await trio.open_tcp_stream("127.0.0.1", port)
    await extra.send_all(HELLO)
    with trio.fail_after(TEST_TIMEOUT):
        assert await read_all(extra) == b""
    assert stats.value("pact_ingress_rejections_total",
                       {"reason": "max_connections_per_ip"}) == 1
    assert connector.stats.value("pact_ingress_tunnel_events_total", {
        "tenant": connector.label, "event": "data_failed"}) == 0
    scope.cancel()
    for s in household:
        await s.aclose()
    await router.drain(0)

# --- liveness -------------------------------------------------------------------------------


async def test_no_tunnel_is_a_dead_backend_until_one_connects(tmp_path: Path, keys: Keys,
                                                              nursery: trio.Nursery) -> None:
    backend = await whoami(nursery, keys, "alina-home")
    async with ingress(nursery, keys, config(tmp_path, keys)) as ing:
        with pytest.raises(BackendError):
            await ing.server.open_stream("alina")
        # what a caller sees: alert 80 (the harness plays the router)
        s = await trio.open_tcp_stream("127.0.0.1", ing.caller_ports["alina"])
        assert await read_all(s) == tls_alert.alert_record(tls_alert.INTERNAL_ERROR)
        cfg = connector_config(tmp_path, keys.alina, keys.ingress.fingerprint,
                               ing.tunnel_port, backend.port, connections=1)
        await start_connector(nursery, cfg)
        await eventually(lambda: ing.server.live_tunnels("alina") == 1)
        # the moment a session exists, open_stream waits for its first data connection
        stream = await ing.server.open_stream("alina")
        await stream.aclose()
        body, _ = await https_get(ing.caller_ports["alina"], "alina.test", keys.caller)
        assert body.startswith("alina-home")
    ing.scope.cancel()


async def test_kill_and_restart_connector(tmp_path: Path, keys: Keys,
                                          nursery: trio.Nursery) -> None:
    port = await echo_server(nursery)
    async with ingress(nursery, keys, config(tmp_path, keys)) as ing:
        cfg = connector_config(tmp_path, keys.alina, keys.ingress.fingerprint,
                               ing.tunnel_port, port)
        _, scope = await start_connector(nursery, cfg)
        await eventually(lambda: ing.server.idle_connections("alina") > 0)
        caller = await trio.open_tcp_stream("127.0.0.1", ing.caller_ports["alina"])
        await caller.send_all(b"ping")
        assert await caller.receive_some(4) == b"ping"
        scope.cancel()  # the connector dies with a stream open
        assert await read_all(caller) == b""  # ...which ends cleanly, no hang
        await eventually(lambda: ing.server.live_tunnels("alina") == 0)
        await start_connector(nursery, cfg)
        await eventually(lambda: ing.server.idle_connections("alina") > 0)
        caller = await trio.open_tcp_stream("127.0.0.1", ing.caller_ports["alina"])
        await caller.send_all(b"again")
        assert await caller.receive_some(5) == b"again"
        await caller.aclose()
    ing.scope.cancel()


@pytest.mark.parametrize("graceful", [False, True])
async def test_kill_and_restart_ingress(tmp_path: Path, keys: Keys, nursery: trio.Nursery,
                                        graceful: bool) -> None:
    port = await echo_server(nursery)
    cfg_ing = config(tmp_path, keys)
    async with ingress(nursery, keys, cfg_ing) as ing:
        cfg = connector_config(tmp_path, keys.alina, keys.ingress.fingerprint,
                               ing.tunnel_port, port)
        connector, _ = await start_connector(nursery, cfg)
        await eventually(lambda: ing.server.idle_connections("alina") > 0)
        caller = await trio.open_tcp_stream("127.0.0.1", ing.caller_ports["alina"])
        await caller.send_all(b"one")
        assert await caller.receive_some(3) == b"one"
        if graceful:
            await ing.server.aclose()  # GOAWAY(SHUTDOWN): connectors come back later
            await eventually(lambda: connector.live_links == 0)
            # a stream already flowing is an independent TCP connection: unaffected
            await caller.send_all(b"two")
            assert await caller.receive_some(3) == b"two"
        ing.scope.cancel()  # listeners and relays gone (a crash, if not graceful)
        assert await read_all(caller) == b""  # the open stream ends cleanly
        await caller.aclose()
        await eventually(lambda: connector.live_links == 0)
        await eventually(lambda: connector.active_streams == 0)
    async with ingress(nursery, keys, cfg_ing, port=ing.tunnel_port) as ing2:
        await eventually(lambda: ing2.server.live_tunnels("alina") == 2)
        await eventually(lambda: ing2.server.idle_connections("alina") > 0)
        caller = await trio.open_tcp_stream("127.0.0.1", ing2.caller_ports["alina"])
        await caller.send_all(b"three")
        assert await caller.receive_some(5) == b"three"
        await caller.aclose()
        reason = "goaway_shutdown" if graceful else "reconnect"
        assert connector.stats.value("pact_ingress_tunnel_events_total",
                                     {"tenant": connector.label, "event": reason}) >= 1
    ing2.scope.cancel()


class BlackholeProxy:
    """TCP forwarder; `blackhole()` makes every existing connection silently drop bytes
    (both ways, without closing anything), like a dead path. New connections pass."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.generation = 0

    def blackhole(self) -> None:
        self.generation += 1

    async def serve(self, task_status: trio.TaskStatus[int]) -> None:
        listeners = await _listen()
        task_status.started(listeners[0].socket.getsockname()[1])
        await trio.serve_listeners(self._handle, listeners)

    async def _handle(self, client: trio.SocketStream) -> None:
        gen = self.generation
        try:
            upstream = await trio.open_tcp_stream("127.0.0.1", self.target)
        except OSError:
            return

        async def pump(src: trio.SocketStream, dst: trio.SocketStream) -> None:
            try:
                while data := await src.receive_some(65536):
                    if gen == self.generation:
                        await dst.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                pass
            if gen == self.generation:
                await trio.aclose_forcefully(dst)

        async with client, upstream, trio.open_nursery() as n:
            n.start_soon(pump, client, upstream)
            n.start_soon(pump, upstream, client)


async def test_silent_dead_path_detected_and_replaced(tmp_path: Path, keys: Keys,
                                                      nursery: trio.Nursery) -> None:
    port = await echo_server(nursery)
    async with ingress(nursery, keys, config(tmp_path, keys)) as ing:
        proxy = BlackholeProxy(ing.tunnel_port)
        proxy_port = await nursery.start(proxy.serve)
        cfg = connector_config(tmp_path, keys.alina, keys.ingress.fingerprint,
                               proxy_port, port)
        connector, _ = await start_connector(nursery, cfg)
        await eventually(lambda: ing.server.live_tunnels("alina") == 2)
        old = {s.sid for s in ing.server._sessions["alina"]}
        proxy.blackhole()
        # both ends notice within the heartbeat bound (3 × HB, plus scheduling slack);
        # ≥: on a loaded machine a new connection can time out too (HB is tiny here)
        bound = HB * tc.HEARTBEAT_MISSES * 3 + 1
        await eventually(lambda: events(ing.stats, "alina", "heartbeat_timeout") >= 2, bound)
        await eventually(lambda: connector.stats.value(
            "pact_ingress_tunnel_events_total",
            {"tenant": connector.label, "event": "heartbeat_timeout"}) >= 2, bound)
        await eventually(lambda: ing.server.live_tunnels("alina") == 2
                         and not old & {s.sid for s in ing.server._sessions["alina"]})
        await eventually(lambda: ing.server.idle_connections("alina") > 0)
        caller = await trio.open_tcp_stream("127.0.0.1", ing.caller_ports["alina"])
        await caller.send_all(b"alive")
        assert await caller.receive_some(5) == b"alive"
        await caller.aclose()
    ing.scope.cancel()


async def test_newer_connection_does_not_break_older(tmp_path: Path, keys: Keys,
                                                     nursery: trio.Nursery) -> None:
    port = await echo_server(nursery)
    async with ingress(nursery, keys, config(tmp_path, keys)) as ing:
        cfg = connector_config(tmp_path, keys.alina, keys.ingress.fingerprint,
                               ing.tunnel_port, port, connections=1)
        first, _ = await start_connector(nursery, cfg)
        await eventually(lambda: ing.server.idle_connections("alina") > 0)
        caller = await trio.open_tcp_stream("127.0.0.1", ing.caller_ports["alina"])
        await caller.send_all(b"a")
        assert await caller.receive_some(1) == b"a"
        second, _ = await start_connector(nursery, cfg)  # same key, e.g. a restart
        await eventually(lambda: ing.server.live_tunnels("alina") == 2)
        await eventually(lambda: second.idle_data > 0)
        assert first.live_links == 1
        await caller.send_all(b"b")
        assert await caller.receive_some(1) == b"b"
        await caller.aclose()
        # streams spread over both live connections
        for _ in range(8):
            s = await trio.open_tcp_stream("127.0.0.1", ing.caller_ports["alina"])
            await s.send_all(b"x")
            assert await s.receive_some(1) == b"x"
            await s.aclose()
        opened = [c.stats.value("pact_ingress_tunnel_events_total",
                                {"tenant": c.label, "event": "stream_open"})
                  for c in (first, second)]
        assert all(n >= 2 for n in opened), opened
    ing.scope.cancel()


async def test_connector_drain_finishes_streams_and_stops_new_ones(
        tmp_path: Path, keys: Keys, nursery: trio.Nursery) -> None:
    port = await echo_server(nursery)
    async with ingress(nursery, keys, config(tmp_path, keys)) as ing:
        cfg = connector_config(tmp_path, keys.alina, keys.ingress.fingerprint,
                               ing.tunnel_port, port)
        shutdown = trio.Event()
        done = trio.Event()
        connector = Connector(cfg, heartbeat=HB)

        async def run() -> None:
            await connector.run(shutdown=shutdown, grace=TEST_TIMEOUT)
            done.set()

        nursery.start_soon(run)
        await eventually(lambda: ing.server.idle_connections("alina") > 0)
        caller = await trio.open_tcp_stream("127.0.0.1", ing.caller_ports["alina"])
        await caller.send_all(b"1")
        assert await caller.receive_some(1) == b"1"
        shutdown.set()  # SIGTERM
        await eventually(lambda: ing.server.live_tunnels("alina") == 0)
        with pytest.raises(BackendError):
            await ing.server.open_stream("alina")
        assert not done.is_set()  # still serving the open stream
        await caller.send_all(b"2")
        assert await caller.receive_some(1) == b"2"
        await caller.send_eof()
        assert await read_all(caller) == b""
        with trio.fail_after(TEST_TIMEOUT):
            await done.wait()
        assert connector.active_streams == 0 and connector.idle_data == 0
    ing.scope.cancel()


async def tag_server(nursery: trio.Nursery, tag: bytes) -> int:
    """Answers every read with `tag` + the bytes read: which node a stream reached."""
    async def answer(s: trio.SocketStream) -> None:
        try:
            while data := await s.receive_some(1 << 16):
                await s.send_all(tag + data)
        except (trio.BrokenResourceError, OSError):
            pass

    listeners = await nursery.start(trio.serve_tcp, answer, 0)
    return listeners[0].socket.getsockname()[1]


async def test_a_revoked_key_s_streams_are_cut_and_the_other_key_s_run_on(
        tmp_path: Path, keys: Keys, nursery: trio.Nursery) -> None:
    """alina has two pinned keys, each with a connector, and streams open through both.
    The reload that leaves only one pinned cuts every stream of the other (its callers
    read an end of stream) and none of the kept key's, which go on answering."""
    both = (keys.alina.fingerprint, keys.stranger.fingerprint)
    async with ingress(nursery, keys, config(tmp_path, keys, alina_pins=both)) as ing:
        for ident, tag in ((keys.alina, b"old:"), (keys.stranger, b"new:")):
            (tmp_path / tag.decode()[:-1]).mkdir()
            cfg = connector_config(tmp_path / tag.decode()[:-1], ident,
                                   keys.ingress.fingerprint, ing.tunnel_port,
                                   await tag_server(nursery, tag))
            await start_connector(nursery, cfg)
        await eventually(lambda: ing.server.live_tunnels("alina") == 4)
        streams: dict[bytes, list[trio.SocketStream]] = {b"old:": [], b"new:": []}
        with trio.fail_after(TEST_TIMEOUT):
            while min(len(v) for v in streams.values()) < 3:
                caller = await trio.open_tcp_stream("127.0.0.1", ing.caller_ports["alina"])
                await caller.send_all(b"hi")
                reply = await caller.receive_some(64)
                streams[reply[:4]].append(caller)
        ing.server.update(config(tmp_path, keys, alina_pins=both[1:]))
        # streams opened right after the reload, before the revoked sessions' tasks ran
        # again (taken from idle pools, `open_stream` does not yield), come from the kept
        # key only
        opened = [await ing.server.open_stream("alina") for _ in range(4)]
        for stream in opened:
            with trio.fail_after(TEST_TIMEOUT):
                await stream.send_all(b"now")
                assert await stream.receive_some(64) == b"new:now"
            await stream.aclose()
        with trio.fail_after(TEST_TIMEOUT):
            for caller in streams[b"old:"]:
                try:
                    assert await caller.receive_some(64) == b""
                except trio.BrokenResourceError:
                    pass  # reset: cut as well
        for caller in streams[b"new:"]:
            await caller.send_all(b"again")
            with trio.fail_after(TEST_TIMEOUT):
                assert await caller.receive_some(64) == b"new:again"
        assert events(ing.stats, "alina", "stream_cut") == len(streams[b"old:"])
        for caller in streams[b"old:"] + streams[b"new:"]:
            await caller.aclose()
        await eventually(lambda: ing.server.open_streams("alina") == 0)
    ing.scope.cancel()


async def test_reload_drops_unpinned_connector(tmp_path: Path, keys: Keys,
                                               nursery: trio.Nursery) -> None:
    port = await echo_server(nursery)
    async with ingress(nursery, keys, config(tmp_path, keys)) as ing:
        cfg = connector_config(tmp_path, keys.alina, keys.ingress.fingerprint,
                               ing.tunnel_port, port)
        connector, scope = await start_connector(nursery, cfg)
        await eventually(lambda: ing.server.live_tunnels("alina") == 2)
        ing.server.update(config(tmp_path, keys, alina_pinned=False))
        await eventually(lambda: connector.stats.value(
            "pact_ingress_tunnel_events_total",
            {"tenant": connector.label, "event": "goaway_key_unpinned"}) >= 2)
        await eventually(lambda: events(ing.stats, "-", "refused_unknown_key") >= 1)
        assert ing.server.live_tunnels("alina") == 0
        ing.server.update(config(tmp_path, keys))  # pinned again: it comes back by itself
        await eventually(lambda: ing.server.live_tunnels("alina") == 2, TEST_TIMEOUT * 2)
        scope.cancel()
    ing.scope.cancel()
