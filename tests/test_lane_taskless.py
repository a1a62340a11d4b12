"""Keep-alive lane connections the router starts without a task of their own
(`Terminator.start_lane`): the router's count of open connections returns to the truth
whichever way one ends, a drain waits for them as for any connection's task, and the
drain's deadline closes those still open. In process (a mock clock for the 30 s
deadline), with a real router, a real terminator and real TLS over loopback."""

from __future__ import annotations

import socket
import ssl
from pathlib import Path

import trio
import trio.testing

from pact_ingress.model import Limits
from pact_ingress.net.backends import Backends
from pact_ingress.net.router import Router
from pact_ingress.net.terminate import Terminator
from pact_ingress.stats import Stats
from tests.netutil import TEST_TIMEOUT, make_config, route
from tests.tls_helpers import LOOPBACK, StaticCerts, WebPKI, make_identity

HOST = "t.example.test"



async def _start(nursery: trio.Nursery, tmp: Path, pki: WebPKI, served: trio.Event
                 ) -> tuple[Router, Terminator, int]:
    # the lane's handshake deadline past the drain's: only the drain's can end it
    config = make_config(tmp, [route(HOST, "t", 9, mode="terminate")],
                         limits=Limits(clienthello_timeout=60.0))
    terminator = Terminator(identity=make_identity(tmp, "ingress"), backends=Backends(),
                            stats=Stats())
    terminator.update(config)
    router = Router(config, stats=Stats(), backends=Backends(), terminator=terminator,
                    certs=StaticCerts(pki.server_context(HOST, alpn=("http/1.1",))))
    listeners = await trio.open_tcp_listeners(0, host=LOOPBACK)
    port = listeners[0].socket.getsockname()[1]

    async def serve(task_status: trio.TaskStatus[None]) -> None:
        await router.serve(listeners, task_status=task_status)
        served.set()

    await nursery.start(serve)
    return router, terminator, port


async def _hello_only(pki: WebPKI, port: int) -> trio.socket.SocketType:
    """A client that sends its ClientHello and nothing more: the lane holds it, its
    handshake unfinished, with no task."""
    sock = trio.socket.socket()
    await sock.connect((LOOPBACK, port))
    inc, out = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = pki.client_context(alpn=("http/1.1",)).wrap_bio(inc, out, server_hostname=HOST)
    try:
        tls.do_handshake()
    except ssl.SSLWantReadError:
        pass
    await sock.send(out.read())
    return sock


async def _closed(sock: trio.socket.SocketType, within: float = TEST_TIMEOUT) -> bool:
    """Read until the peer closes (True) or `within` seconds pass (False)."""
    with trio.move_on_after(within):
        while True:
            try:
                if not await sock.recv(65536):
                    return True
            except ConnectionResetError:
                return True
    return False


async def test_a_drain_waits_for_taskless_connections_and_its_deadline_closes_them(
        nursery: trio.Nursery, tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    pki = WebPKI()
    served = trio.Event()
    router, terminator, port = await _start(nursery, tmp_path, pki, served)
    socks = [await _hello_only(pki, port) for _ in range(3)]
    with trio.fail_after(TEST_TIMEOUT):
        while router.open_connections < 3 or terminator._taskless < 3:
            await trio.sleep(0.01)
    start = trio.current_time()
    await router.drain(deadline=30)
    await terminator.drain()
    with trio.fail_after(100):
        await served.wait()  # the router's serve ends only once they are gone
    assert 30 <= trio.current_time() - start < 31
    for sock in socks:
        assert await _closed(sock)
        sock.close()
    assert router.open_connections == 0
    assert terminator._open == terminator._taskless == 0


async def test_a_drain_with_no_taskless_connection_left_ends_at_once(
        nursery: trio.Nursery, tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """A connection that ended before the drain leaves nothing for the drain to wait
    for (the task standing for such connections goes as the drain begins)."""
    pki = WebPKI()
    served = trio.Event()
    router, terminator, port = await _start(nursery, tmp_path, pki, served)
    sock = await _hello_only(pki, port)
    with trio.fail_after(TEST_TIMEOUT):
        while terminator._taskless < 1:
            await trio.sleep(0.01)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    sock.close()  # a reset: the lane ends it
    with trio.fail_after(TEST_TIMEOUT):
        while router.open_connections:
            await trio.sleep(0.01)
    assert terminator._open == terminator._taskless == 0
    start = trio.current_time()
    await router.drain(deadline=30)
    await terminator.drain()
    with trio.fail_after(100):
        await served.wait()
    assert trio.current_time() - start < 1


async def test_a_connection_started_as_the_drain_begins_is_waited_for_not_closed(
        nursery: trio.Nursery, tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """The drain signals the stand-in task that no task-less connection is left; the
    engine hands over one more hello before that task runs (it still serves hellos it
    had read). That connection is waited for like the others, until the drain's
    deadline, not closed by the stand-in task on its way out."""
    pki = WebPKI()
    served = trio.Event()
    router, terminator, port = await _start(nursery, tmp_path, pki, served)
    route = terminator.route(HOST)
    ctx = pki.server_context(HOST, alpn=("http/1.1",))
    ended: list[int] = []

    def start(server: socket.socket) -> None:
        """A connection whose ClientHello the engine read, started the router's way."""
        client_inc, client_out = ssl.MemoryBIO(), ssl.MemoryBIO()
        hello = pki.client_context(alpn=("http/1.1",)).wrap_bio(
            client_inc, client_out, server_hostname=HOST)
        try:
            hello.do_handshake()
        except ssl.SSLWantReadError:
            pass
        server.setblocking(False)
        assert route is not None
        assert terminator.start_lane(server, client_out.read(), ctx, route,
                                     (LOOPBACK, 1), HOST, router._runners.start,
                                     lambda: ended.append(1))

    first, first_peer = socket.socketpair()
    start(first)
    first_peer.close()  # it ends: the stand-in task runs on, with none left
    with trio.fail_after(TEST_TIMEOUT):
        while terminator._taskless or not terminator._keeping:
            await trio.sleep(0.01)
    assert ended == [1]
    second, second_peer = socket.socketpair()
    start_at = trio.current_time()
    await router.drain(deadline=30)
    await terminator.drain()  # (no checkpoint in either: the stand-in task has not run)
    start(second)
    peer = trio.socket.from_stdlib_socket(second_peer)
    assert await _closed(peer, within=100)
    assert 30 <= trio.current_time() - start_at < 31
    peer.close()
    with trio.fail_after(100):
        await served.wait()
    assert ended == [1, 1]
    assert terminator._open == terminator._taskless == 0
