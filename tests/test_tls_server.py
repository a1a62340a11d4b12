"""`ServerTLS`, the terminate engine's server-side TLS: real TLS over loopback sockets."""

from __future__ import annotations

import hashlib
import os
import socket

import trio
import trio.testing

from pact_ingress.net.tls_server import ServerTLS
from tests.tls_helpers import LOOPBACK, WebPKI, serve_loopback

HOST = "tls.test"


async def _serve(nursery: trio.Nursery, pki: WebPKI, peek: int,
                 results: list[object]) -> int:
    """A server that peeks `peek` bytes the way the router does, then runs `ServerTLS`:
    it echoes what it receives until the client closes, counting bytes and a hash."""
    ctx = pki.server_context(HOST, alpn=("h2", "http/1.1"))

    async def handler(tcp: trio.SocketStream) -> None:
        peeked = b""
        while len(peeked) < peek:
            peeked += await tcp.receive_some(peek - len(peeked))
        tls = ServerTLS(tcp.socket._sock, ctx, peeked)
        try:
            await tls.do_handshake()
            results.append(tls.selected_alpn_protocol())
            digest, size = hashlib.sha256(), 0
            while data := await tls.receive_some():
                digest.update(data)
                size += len(data)
                await tls.send_all(data)
            results.append((size, digest.hexdigest()))
        finally:
            await tls.aclose()

    return await nursery.start(serve_loopback, handler)


async def _client(port: int, pki: WebPKI, payload: bytes) -> bytes:
    """Send `payload` while reading the echo (two tasks, trio's own TLS); close; the echo."""
    tcp = await trio.open_tcp_stream(LOOPBACK, port)
    tls = trio.SSLStream(tcp, pki.client_context(alpn=("http/1.1",)), server_hostname=HOST)
    echoed = bytearray()

    async def read() -> None:
        while len(echoed) < len(payload):
            chunk = await tls.receive_some(65536)
            if not chunk:
                return
            echoed.extend(chunk)

    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read)
            await tls.send_all(payload)
    await tls.aclose()
    return bytes(echoed)


async def test_full_duplex_echo_byte_exact_with_the_hello_peeked(nursery: trio.Nursery) -> None:
    pki = WebPKI()
    results: list[object] = []
    port = await _serve(nursery, pki, peek=5, results=results)  # the record header only
    payload = os.urandom(4 * 1024 * 1024)
    echoed = await _client(port, pki, payload)
    assert echoed == payload
    with trio.fail_after(10):
        while len(results) < 2:
            await trio.sleep(0.01)
    assert results == ["http/1.1", (len(payload), hashlib.sha256(payload).hexdigest())]


async def test_a_bad_handshake_is_a_broken_stream(nursery: trio.Nursery) -> None:
    pki = WebPKI()
    ctx = pki.server_context(HOST)
    outcome: list[str] = []

    async def handler(tcp: trio.SocketStream) -> None:
        tls = ServerTLS(tcp.socket._sock, ctx, b"")
        try:
            await tls.do_handshake()
            outcome.append("handshook")
        except trio.BrokenResourceError:
            outcome.append("broken")
        finally:
            await tls.aclose()

    port = await nursery.start(serve_loopback, handler)

    def garbage() -> None:
        with socket.create_connection((LOOPBACK, port), timeout=10) as s:
            s.sendall(b"\x16\x03\x01\x00\x05hello" + b"\x00" * 64)
            try:
                s.recv(100)
            except OSError:
                pass

    await trio.to_thread.run_sync(garbage)
    with trio.fail_after(10):
        while not outcome:
            await trio.sleep(0.01)
    assert outcome == ["broken"]


async def test_close_wakes_a_waiting_reader(nursery: trio.Nursery) -> None:
    pki = WebPKI()
    ctx = pki.server_context(HOST)
    done: list[str] = []

    async def handler(tcp: trio.SocketStream) -> None:
        tls = ServerTLS(tcp.socket._sock, ctx, b"")
        await tls.do_handshake()
        async with trio.open_nursery() as inner:
            async def reader() -> None:
                try:
                    await tls.receive_some()
                except (trio.ClosedResourceError, trio.BrokenResourceError):
                    done.append("woken")
            inner.start_soon(reader)
            await trio.testing.wait_all_tasks_blocked()
            await tls.aclose()

    port = await nursery.start(serve_loopback, handler)
    client = pki.client_context()
    raw = await trio.to_thread.run_sync(
        lambda: client.wrap_socket(socket.create_connection((LOOPBACK, port), timeout=10),
                                   server_hostname=HOST))
    try:
        with trio.fail_after(10):
            while not done:
                await trio.sleep(0.01)
    finally:
        raw.close()
    assert done == ["woken"]
