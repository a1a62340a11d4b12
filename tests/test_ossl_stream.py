"""OpenSSLStream: trio's generic stream conformance suite, pins, ALPN, real sockets."""

from __future__ import annotations

import ssl
from pathlib import Path

import pytest
import trio
import trio.testing
from OpenSSL import SSL

from pact_ingress.identity import Identity, check_pin, pinned_client_context
from pact_ingress.net.ossl_stream import OpenSSLStream, client_context, server_context
from tests.tls_helpers import LOOPBACK, make_identity


@pytest.fixture(scope="module")
def ids(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Identity]:
    d = tmp_path_factory.mktemp("ids")
    return {"server": make_identity(d, "server"), "client": make_identity(d, "client", ed25519=True)}


async def _pair(
    ids: dict[str, Identity],
    transport_pair: tuple[trio.abc.Stream, trio.abc.Stream],
    *,
    tls12: bool = False,
) -> tuple[OpenSSLStream, OpenSSLStream]:
    ct, st = transport_pair
    cctx = client_context(ids["client"], alpn=["h2"])
    if tls12:
        cctx.set_max_proto_version(SSL.TLS1_2_VERSION)
    client = OpenSSLStream(ct, cctx, server_side=False, server_hostname="node.test")
    server = OpenSSLStream(st, server_context(ids["server"]), server_side=True)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(client.do_handshake)
        nursery.start_soon(server.do_handshake)
    return client, server


async def test_check_two_way_stream(ids: dict[str, Identity]) -> None:
    async def maker() -> tuple[OpenSSLStream, OpenSSLStream]:
        return await _pair(ids, trio.testing.memory_stream_pair())

    async def clogged() -> tuple[OpenSSLStream, OpenSSLStream]:
        # TLS 1.2: a TLS 1.3 server sends session tickets after the client's handshake
        # has returned, which a lockstep transport (no buffering) cannot carry.
        return await _pair(ids, trio.testing.lockstep_stream_pair(), tls12=True)

    await trio.testing.check_two_way_stream(maker, clogged)


async def test_handshake_facts(ids: dict[str, Identity]) -> None:
    client, server = await _pair(ids, trio.testing.memory_stream_pair())
    assert server.peer_fingerprint == ids["client"].fingerprint
    assert client.peer_fingerprint == ids["server"].fingerprint
    assert server.selected_alpn_protocol() == client.selected_alpn_protocol() == "h2"
    assert server.server_name == "node.test"
    # identity.check_pin accepts the stream like an ssl.SSLObject
    assert check_pin(server, [ids["client"].fingerprint]) == ids["client"].fingerprint
    await client.aclose()
    await server.aclose()


async def test_large_transfer_both_ways(ids: dict[str, Identity]) -> None:
    client, server = await _pair(ids, trio.testing.memory_stream_pair())
    blob = bytes(range(256)) * 4096  # 1 MiB

    async def pump(s: OpenSSLStream) -> None:
        await s.send_all(blob)

    async def drain(s: OpenSSLStream, out: list[bytes]) -> None:
        got = 0
        while got < len(blob):
            chunk = await s.receive_some()
            assert chunk
            out.append(chunk)
            got += len(chunk)

    a: list[bytes] = []
    b: list[bytes] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(pump, client)
        nursery.start_soon(pump, server)
        nursery.start_soon(drain, client, a)
        nursery.start_soon(drain, server, b)
    assert b"".join(a) == blob and b"".join(b) == blob


async def test_stdlib_client_over_real_socket(ids: dict[str, Identity], tmp_path: Path) -> None:
    """The server end accepts an unknown self-signed client cert from stdlib ssl."""
    seen: list[str | None] = []

    async def handler(tcp: trio.SocketStream) -> None:
        tls = OpenSSLStream(tcp, server_context(ids["server"]), server_side=True)
        await tls.do_handshake()
        seen.append(tls.peer_fingerprint)
        await tls.send_all(await tls.receive_some())
        await tls.aclose()

    listeners = await trio.open_tcp_listeners(0, host=LOOPBACK)
    port = listeners[0].socket.getsockname()[1]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.serve_listeners, handler, listeners)
        tcp = await trio.open_tcp_stream(LOOPBACK, port)
        ctx = pinned_client_context(ids["client"], alpn=["http/1.1"])
        tls = trio.SSLStream(tcp, ctx, server_hostname="node.test")
        await tls.do_handshake()
        assert check_pin(tls._ssl_object, [ids["server"].fingerprint])  # type: ignore[attr-defined]
        await tls.send_all(b"ping")
        assert await tls.receive_some() == b"ping"
        await tls.aclose()
        nursery.cancel_scope.cancel()
    assert seen == [ids["client"].fingerprint]


async def test_required_client_cert_refuses_anonymous(ids: dict[str, Identity]) -> None:
    ct, st = trio.testing.memory_stream_pair()
    server = OpenSSLStream(st, server_context(ids["server"], require_client_cert=True),
                           server_side=True)
    ctx = pinned_client_context(None)
    ctx.maximum_version = ssl.TLSVersion.TLSv1_2  # the refusal shows in the handshake
    client = trio.SSLStream(ct, ctx, server_hostname="node.test")
    results: list[str] = []

    async def run(s: trio.abc.Stream, name: str) -> None:
        try:
            await s.do_handshake()  # type: ignore[attr-defined]
            results.append(f"{name}:ok")
        except trio.BrokenResourceError:
            results.append(f"{name}:broken")
        await trio.aclose_forcefully(s)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run, server, "server")
        nursery.start_soon(run, client, "client")
    assert "server:broken" in results and "client:broken" in results
