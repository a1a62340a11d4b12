"""`ServerTLS`, the terminate engine's server-side TLS: real TLS over loopback sockets."""

from __future__ import annotations

import hashlib
import os
import socket
import ssl

import pytest
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


class _Peer:
    """The client end as a bare `ssl.SSLObject` over its half of a socketpair: the test
    decides which records leave together and sees what the server sent, record by byte."""

    def __init__(self, pki: WebPKI, sock: socket.socket) -> None:
        self.sock = sock
        self.incoming, self.outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        self.tls = pki.client_context(alpn=("http/1.1",)).wrap_bio(
            self.incoming, self.outgoing, server_hostname=HOST)

    def hello(self) -> bytes:
        try:
            self.tls.do_handshake()
        except ssl.SSLWantReadError:
            pass
        return self.outgoing.read()

    async def receive(self) -> bytes:
        """What the server sent, once it sent something (bounded wait)."""
        with trio.fail_after(10):
            await trio.lowlevel.wait_readable(self.sock)
        return self.sock.recv(1 << 16)

    def waiting(self) -> bool:
        """Whether the server sent anything not read yet."""
        try:
            self.sock.recv(1 << 16, socket.MSG_PEEK)
        except BlockingIOError:
            return False
        return True


def _records(data: bytes) -> list[int]:
    """Content types of the TLS records in `data` (whole records only)."""
    types = []
    while len(data) >= 5:
        types.append(data[0])
        data = data[5 + int.from_bytes(data[3:5], "big"):]
    return types


async def _handshake_to_finished(pki: WebPKI, *, with_request: bytes
                                 ) -> tuple[ServerTLS, _Peer, socket.socket]:
    """Run a handshake over a socketpair up to the client's Finished, sent together with
    `with_request` (TLS application data) when given; returns after the server's
    `do_handshake` returned."""
    server_sock, client_sock = socket.socketpair()
    server_sock.setblocking(False)
    client_sock.setblocking(False)
    peer = _Peer(pki, client_sock)
    tls = ServerTLS(server_sock, pki.server_context(HOST, alpn=("http/1.1",)), peer.hello())
    async with trio.open_nursery() as nursery:
        nursery.start_soon(tls.do_handshake)
        peer.incoming.write(await peer.receive())  # the server's whole flight
        peer.tls.do_handshake()
        if with_request:
            peer.tls.write(with_request)
        client_sock.sendall(peer.outgoing.read())  # Finished [+ request], one segment
    return tls, peer, server_sock


async def test_tickets_leave_with_the_answer_when_the_request_came_with_the_finished() -> None:
    """A client whose request came with its Finished gets the session tickets in the same
    send as the answer (one send fewer per new connection), and they still precede it."""
    pki = WebPKI()
    request = b"GET / HTTP/1.1\r\nhost: tls.test\r\n\r\n"
    tls, peer, _ = await _handshake_to_finished(pki, with_request=request)
    try:
        assert not peer.waiting()  # nothing sent since the flight: the tickets are held
        assert tls.read_buffered() == request  # the request, without a syscall
        await tls.send_all(b"HTTP/1.1 204 No Content\r\n\r\n")
        data = await peer.receive()
        assert _records(data) == [23, 23, 23]  # two tickets, then the answer: one send
        peer.incoming.write(data)
        assert peer.tls.read(1024) == b"HTTP/1.1 204 No Content\r\n\r\n"
        assert peer.tls.session is not None and peer.tls.session.has_ticket
    finally:
        tls.close()
        peer.sock.close()


async def test_tickets_leave_at_once_when_the_finished_came_alone() -> None:
    """Without a request behind the Finished, the server is about to wait for the client:
    what the handshake left to send is not held back."""
    pki = WebPKI()
    tls, peer, _ = await _handshake_to_finished(pki, with_request=b"")
    try:
        data = await peer.receive()
        assert _records(data) == [23, 23]  # the two tickets, before any request
        peer.incoming.write(data)
        with pytest.raises(ssl.SSLWantReadError):
            peer.tls.read(1024)
        assert peer.tls.session is not None and peer.tls.session.has_ticket
        assert tls.read_buffered() is None
    finally:
        tls.close()
        peer.sock.close()


async def test_close_unwatched_leaves_trio_able_to_wait_on_the_next_socket() -> None:
    """After a handshake that waited on its socket (so trio's epoll knew it), closing it
    without telling trio must not confuse the next socket that gets the same number."""
    pki = WebPKI()
    tls, peer, server_sock = await _handshake_to_finished(pki, with_request=b"")
    fd = server_sock.fileno()
    tls.close_unwatched()
    assert server_sock.fileno() == -1
    peer.sock.close()
    # New sockets take the lowest free numbers, and numbers below `fd` that earlier tests
    # of this process freed come first: pairs are made until one of them gets `fd`.
    pairs: list[tuple[socket.socket, socket.socket]] = []
    try:
        for _ in range(512):  # bounded: a process has far fewer holes below `fd`
            a, b = socket.socketpair()
            pairs.append((a, b))
            if fd in (a.fileno(), b.fileno()):
                break
        assert fd in (a.fileno(), b.fileno()), f"no new socket got number {fd}"
        mine, other = (a, b) if a.fileno() == fd else (b, a)
        mine.setblocking(False)
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(trio.lowlevel.wait_readable, mine)
                await trio.testing.wait_all_tasks_blocked()
                other.send(b"x")  # wakes the wait: the new socket is watched for real
        assert mine.recv(1) == b"x"
    finally:
        for a, b in pairs:
            a.close()
            b.close()


async def test_write_nowait_holds_what_the_kernel_refused_and_sends_it_first() -> None:
    """`write_nowait` into a socket the peer does not read: what the kernel refuses is
    held, a later `write` (and `flush_by`) sends it before its own records, and the peer
    decrypts every byte in order; it never waits and says when it cannot go at all."""
    pki = WebPKI()
    tls, peer, server_sock = await _handshake_to_finished(pki, with_request=b"")
    server_sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    peer.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sent = bytearray()
    try:
        outcomes = []
        for i in range(200):  # the peer reads nothing: the socket fills
            piece = bytes([i]) * 1000
            done = tls.write_nowait(piece)
            if done is None:
                break
            sent += piece
            outcomes.append(done)
            if not done:
                break
        assert outcomes[-1] is False and all(outcomes[:-1]) and tls.holding
        assert tls.write_nowait(b"x") is None  # held ciphertext: only `write` may go on
        later = b"after the held records" * 100
        received = bytearray()

        async def drain() -> None:
            while len(received) < len(sent) + len(later):
                peer.incoming.write(await peer.receive())
                while True:
                    try:
                        received.extend(peer.tls.read(1 << 16))
                    except ssl.SSLWantReadError:
                        break

        async with trio.open_nursery() as nursery:
            nursery.start_soon(drain)
            await tls.write(later, trio.current_time() + 10)
            await tls.flush_by(trio.current_time() + 10)
        assert not tls.holding
        assert bytes(received) == bytes(sent) + later
    finally:
        tls.close()
        peer.sock.close()
