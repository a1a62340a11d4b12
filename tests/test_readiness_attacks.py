"""The readiness hub (`net/readiness.py`) attacked: lost wake-ups, fd reuse, close and
cancel while parked, both directions at once, deadlines on parked waits, floods.

Two levels:

* the hub and `ServerTLS` in trio over real socketpairs (what the engine's callers do,
  nothing faked but the order in which bytes arrive);
* a real `pact-ingress serve` (tests/terminate_env.py) driven by raw TLS sockets: every
  request gets exactly its answer (the node echoes the target and the body's SHA-256),
  no connection hangs (every wait bounded), the open-connection count returns to 0.

Every loop is bounded in count and time; every address is loopback; nothing asserts on
timing.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
import trio.testing

from pact_ingress.net import deadlines, readiness
from pact_ingress.net.memory_tls import READ_SIZE
from pact_ingress.net.tls_server import ServerTLS
from tests.terminate_env import (
    _READERS,
    BYSTANDER_IP,
    LOOPBACK,
    OPT_HOST,
    H2Conn,
    H2Result,
    ServeEnv,
    closed_by_peer,
    forget,
    read_response,
    request_bytes,
    rpc,
    tls_socket,
)
from tests.test_readiness import _pair, _parked_reads, _recv
from tests.test_tls_server import _handshake_to_finished
from tests.tls_helpers import WebPKI

#: Limits for the serve tests: no call budget in the way of a few thousand requests.
OPEN_LIMITS = {"calls_per_hour_per_ip": 100_000_000, "calls_per_hour_per_ip_key": 100_000_000,
               "max_connections_per_ip": 5000, "max_requests_in_flight_per_ip": 1000}
#: How long a client waits for any one answer before the test calls the connection hung.
HANG = 10.0


async def _read_into(tls: ServerTLS, got: bytearray, size: int) -> None:
    """Read `tls` the engine's way (buffered plaintext first, then wait, then recv)
    into `got` until it holds `size` bytes."""
    while len(got) < size:
        data = tls.read_buffered()
        if data is None:
            data = await tls.read(READ_SIZE, wait_first=True)
        assert data, "the peer closed early"
        got.extend(data)


def _fill_send_buffer(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    while True:
        try:
            sock.send(b"\0" * 65536)
        except BlockingIOError:
            return


def _drain(sock: socket.socket) -> int:
    n = 0
    while True:
        try:
            chunk = sock.recv(1 << 20)
        except BlockingIOError:
            return n
        if not chunk:
            return n
        n += len(chunk)


# --- ServerTLS on the hub: what one recv leaves behind ----------------------------------


async def test_server_tls_reads_a_burst_bigger_than_one_recv_whole() -> None:
    """DEFECT (lost wake-up): a client sends many small TLS records at once, more than
    one recv takes (READ_SIZE). The engine's rule between requests is "read what is
    buffered, else wait first" (`read_buffered`, then `read(wait_first=True)`). The
    kernel still holds the rest of the burst, but its one edge was taken when the first
    recv was made: the wait must not park until the peer sends something new."""
    pki = WebPKI()
    tls, peer, _ = await _handshake_to_finished(pki, with_request=b"")
    try:
        peer.incoming.write(await peer.receive())  # the session tickets
        assert tls.read_buffered() is None
        payload = b"".join(b"%05d" % i + b"x" * 195 for i in range(600))
        for start in range(0, len(payload), 200):  # one record per "request"
            peer.tls.write(payload[start:start + 200])
        burst = peer.outgoing.read()
        assert len(burst) > 2 * READ_SIZE
        got = bytearray()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_read_into, tls, got, len(payload))
            await trio.testing.wait_all_tasks_blocked()  # parked between "requests"
            peer.sock.setblocking(True)
            peer.sock.sendall(burst)  # all of it in the kernel before the hub looks
            with trio.move_on_after(HANG) as waited:
                while len(got) < len(payload):
                    await trio.sleep(0.02)
            nursery.cancel_scope.cancel()
        assert not waited.cancelled_caught, (
            f"hung with {len(payload) - len(got)} of {len(payload)} bytes unread")
        assert bytes(got) == payload
    finally:
        tls.close()
        peer.sock.close()


async def test_server_tls_sees_the_close_that_came_with_the_last_data() -> None:
    """DEFECT (lost wake-up): the peer's last bytes and its FIN arrive behind one edge.
    The recv that takes the bytes is short (the FIN stops it) yet the socket is not
    drained: the next wait (the engine waits first after a short read) must see EOF
    instead of parking forever."""
    pki = WebPKI()
    tls, peer, _ = await _handshake_to_finished(pki, with_request=b"")
    try:
        peer.incoming.write(await peer.receive())  # the session tickets
        got: list[bytes] = []

        async def reader() -> None:
            while True:
                data = tls.read_buffered()
                if data is None:
                    data = await tls.read(READ_SIZE, wait_first=True)
                got.append(data)
                if not data:
                    return

        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader)
            await trio.testing.wait_all_tasks_blocked()  # parked
            peer.tls.write(b"last request")
            peer.sock.setblocking(True)
            peer.sock.sendall(peer.outgoing.read())
            peer.sock.shutdown(socket.SHUT_WR)  # FIN right behind it
            with trio.move_on_after(HANG) as waited:
                while not got or got[-1] != b"":
                    await trio.sleep(0.02)
            nursery.cancel_scope.cancel()
        assert not waited.cancelled_caught, f"the close was never seen (got {got})"
        assert b"".join(got) == b"last request"
    finally:
        tls.close()
        peer.sock.close()


async def test_server_tls_reader_and_writer_at_once_on_one_socket() -> None:
    """Full duplex over one ServerTLS: a writer blocked on a full send buffer and a reader
    parked for data, both on the same Watch; each is woken by its own event and the
    bytes arrive exactly (SHA-256 both ways)."""
    pki = WebPKI()
    tls, peer, server_sock = await _handshake_to_finished(pki, with_request=b"")
    try:
        peer.incoming.write(await peer.receive())  # the session tickets
        server_sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        down = os.urandom(3 << 20)  # server → client: many waits for room
        up = os.urandom(1 << 20)  # client → server
        got_up = bytearray()
        got_down = bytearray()

        async def server_writer() -> None:
            for start in range(0, len(down), 100_000):
                await tls.write(down[start:start + 100_000])

        def client() -> None:  # a thread: blocking stdlib TLS over the other end
            sock = peer.sock
            sock.setblocking(True)
            sent = 0
            chunk = 1 << 15
            sock.settimeout(HANG)
            while sent < len(up) or len(got_down) < len(down):
                if sent < len(up):
                    peer.tls.write(up[sent:sent + chunk])
                    sent += chunk
                    sock.sendall(peer.outgoing.read())
                sock.settimeout(0.01 if sent < len(up) else HANG)
                try:
                    data = sock.recv(1 << 16)
                except TimeoutError:
                    continue
                if not data:
                    return
                peer.incoming.write(data)
                while True:
                    try:
                        got_down.extend(peer.tls.read(1 << 16))
                    except ssl.SSLWantReadError:
                        break

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_read_into, tls, got_up, len(up))
                nursery.start_soon(server_writer)
                await trio.to_thread.run_sync(client)
        assert hashlib.sha256(got_up).digest() == hashlib.sha256(up).digest()
        assert hashlib.sha256(got_down).digest() == hashlib.sha256(down).digest()
    finally:
        tls.close()
        peer.sock.close()


# --- the hub itself, on socketpairs -------------------------------------------------------


async def test_reader_and_writer_parked_on_one_watch_each_get_their_own_event() -> None:
    a, b = _pair()
    with a, b:
        watch = readiness.hub().watch(a)
        _fill_send_buffer(a)
        woke: list[str] = []

        async def read() -> None:
            woke.append("read:" + (await _recv(watch, a, wait_first=True)).decode())

        async def write() -> None:
            while True:
                try:
                    a.send(b"late")
                    break
                except BlockingIOError:
                    await watch.wait_writable()
            woke.append("write")

        with trio.fail_after(HANG):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(read)
                nursery.start_soon(write)
                await trio.testing.wait_all_tasks_blocked()
                assert watch.reader is not None and watch.writer is not None
                b.send(b"in")  # only the reader's event
                await trio.testing.wait_all_tasks_blocked()
                assert woke == ["read:in"]
                assert watch.writer is not None  # the writer still parked
                _drain(b)  # now room: the writer's event
        assert woke == ["read:in", "write"]


async def test_a_deadline_firing_on_the_reader_leaves_the_parked_writer_alone(
        autojump_clock: trio.testing.MockClock) -> None:
    a, b = _pair()
    with a, b:
        watch = readiness.hub().watch(a)
        _fill_send_buffer(a)
        outcome: dict[str, str] = {}

        async def read() -> None:
            try:
                await _recv(watch, a, trio.current_time() + 5, wait_first=True)
            except trio.TooSlowError:
                outcome["read"] = "timeout"

        async def write() -> None:
            await watch.wait_writable(trio.current_time() + 1000)
            outcome["write"] = "woken"

        async with trio.open_nursery() as nursery:
            nursery.start_soon(read)
            nursery.start_soon(write)
            await trio.sleep(10)  # the reader's deadline passes
            assert outcome == {"read": "timeout"}
            assert watch.writer is not None
            _drain(b)
            await trio.sleep(1)
        assert outcome == {"read": "timeout", "write": "woken"}
        assert not deadlines.sweeper()._armed


async def test_cancel_while_parked_with_a_deadline_disarms_and_the_next_wait_works(
        autojump_clock: trio.testing.MockClock) -> None:
    a, b = _pair()
    with a, b:
        watch = readiness.hub().watch(a)
        for _ in range(3):
            with trio.move_on_after(1) as scope:
                await watch.wait_readable(trio.current_time() + 100)
            assert scope.cancelled_caught
            assert watch.reader is None
        assert not deadlines.sweeper()._armed  # no deadline left behind to fire later
        _fill_send_buffer(a)
        with trio.move_on_after(1) as scope:
            await watch.wait_writable(trio.current_time() + 100)
        assert scope.cancelled_caught and watch.writer is None
        await trio.sleep(200)  # the cancelled waits' deadlines pass: nothing fires
        b.send(b"ok")
        assert await _recv(watch, a, trio.current_time() + 5, wait_first=True) == b"ok"


async def test_a_task_parked_on_a_socket_closed_under_it_is_woken_when_its_number_is_reused(
        ) -> None:
    """An owner that closed its socket without `Watch.close` while a task waited (a
    bug elsewhere, or a close from another path): the number's next socket joins the hub,
    and the stale waiter must end (not hang, not get the new socket's events)."""
    hub = readiness.hub()
    a, b = _pair()
    fd = a.fileno()
    stale = hub.watch(a)
    result: list[object] = []

    async def stale_reader() -> None:
        try:
            await stale.wait_readable()
            result.append("woken")
        except trio.ClosedResourceError:
            result.append("closed")

    with trio.fail_after(HANG):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stale_reader)
            await trio.testing.wait_all_tasks_blocked()
            a.close()
            b.close()
            c, d = _pair()
            if d.fileno() == fd:
                c, d = d, c
            assert c.fileno() == fd, "the freed number was not reused"
            with c, d:
                new = hub.watch(c)
                d.send(b"for the new socket")
                assert await _recv(new, c, wait_first=True) == b"for the new socket"
    assert result == ["closed"]


async def test_a_file_still_open_elsewhere_under_a_reused_number_gives_only_spurious_wakes(
        ) -> None:
    """The old socket's file stays open through a duplicate (a descriptor handed to a
    worker process keeps it open the same way) after its number was closed: the epoll
    set keeps reporting it under the old number. The new socket with that number must
    still get exactly its own bytes, and waits on it must still end."""
    hub = readiness.hub()
    a, b = _pair()
    fd = a.fileno()
    hub.watch(a)
    dup = os.dup(fd)  # the old file, open elsewhere
    os.close(fd)
    a.detach()
    c, d = _pair()
    if d.fileno() == fd:
        c, d = d, c
    try:
        assert c.fileno() == fd, "the freed number was not reused"
        new = hub.watch(c)
        with trio.fail_after(HANG):
            for i in range(20):
                b.send(b"old %d" % i)  # events of the old file, under the same number
                d.send(b"new %d" % i)
                assert await _recv(new, c, wait_first=True) == b"new %d" % i
                await trio.testing.wait_all_tasks_blocked()
            # the new socket still waits properly when only the old file is busy
            async with trio.open_nursery() as nursery:
                got: list[bytes] = []

                async def reader() -> None:
                    got.append(await _recv(new, c, wait_first=True))

                nursery.start_soon(reader)
                await trio.testing.wait_all_tasks_blocked()
                b.send(b"old again")
                await trio.testing.wait_all_tasks_blocked()
                b.shutdown(socket.SHUT_RDWR)  # the old file's end, under the same number
                await trio.testing.wait_all_tasks_blocked()  # parked again, not spinning
                d.send(b"finally")
            assert got == [b"finally"]
    finally:
        os.close(dup)
        for s in (b, c, d):
            s.close()


async def test_rdhup_hup_and_rst_wake_both_sides() -> None:
    """Peer half-close wakes the reader (EOF); a reset wakes reader and writer (errors),
    rather than leaving either parked."""
    # half close: the reader sees EOF
    a, b = _pair()
    with a, b:
        watch = readiness.hub().watch(a)
        assert await _parked_reads(watch, a, lambda: b.shutdown(socket.SHUT_WR)) == [b""]
    # TCP reset: reader and writer both woken
    listener = socket.create_server((LOOPBACK, 0))
    with listener:
        client = socket.create_connection(listener.getsockname())
        server, _ = listener.accept()
        server.setblocking(False)
        with server:
            watch = readiness.hub().watch(server)
            _fill_send_buffer(server)
            errors: list[str] = []

            async def read() -> None:
                try:
                    errors.append("eof" if not await _recv(watch, server, wait_first=True)
                                  else "data")
                except OSError as exc:
                    errors.append(type(exc).__name__)

            async def write() -> None:
                try:
                    while True:
                        try:
                            server.send(b"x" * 65536)
                        except BlockingIOError:
                            await watch.wait_writable()
                except OSError as exc:
                    errors.append(type(exc).__name__)

            with trio.fail_after(HANG):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(read)
                    nursery.start_soon(write)
                    await trio.testing.wait_all_tasks_blocked()
                    client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                      b"\x01\x00\x00\x00\x00\x00\x00\x00")
                    client.close()  # RST
            assert len(errors) == 2


# --- a real serve ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeEnv]:
    env = ServeEnv.start(tmp_path_factory.mktemp("hub"), workers=1, limits=OPEN_LIMITS)
    try:
        yield env
    finally:
        env.stop()


def _target(i: int, tag: str) -> str:
    return f"/hub/{tag}/{i}?pad=" + "x" * 200


def _check_answer(resp, target: str, body: bytes = b"") -> None:  # type: ignore[no-untyped-def]
    assert resp.status == 200, (resp.status, resp.body[:200])
    doc = json.loads(resp.body)
    assert doc["target"] == target
    assert doc["sha256"] == hashlib.sha256(body).hexdigest()


def _stop_all(pids: list[int]) -> None:
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)


def _cont_all(pids: list[int]) -> None:
    for pid in pids:
        os.kill(pid, signal.SIGCONT)


@pytest.mark.parametrize("frozen", [True, False], ids=["arrives-while-frozen", "live"])
def test_pipelined_requests_beyond_one_recv_are_all_answered(served: ServeEnv,
                                                             frozen: bool) -> None:
    """DEFECT (lost wake-up), end to end: HTTP/1.1 pipelining, each request in its own TLS
    record, more than one recv (64 KiB) of them at once. `frozen`: serve is stopped
    (SIGSTOP) while they arrive, so the kernel holds them all behind one edge. Every
    request must get exactly its answer, in order, none left behind."""
    serve = served.fresh().serve
    n = 600
    sock = tls_socket(serve.port, OPT_HOST, timeout=HANG)
    try:
        # a first exchange: the connection then waits "for the next request" on the hub
        sock.sendall(request_bytes("GET", _target(-1, "warm"), OPT_HOST))
        _check_answer(read_response(sock), _target(-1, "warm"))
        pids = serve.pids()
        if frozen:
            _stop_all(pids)
        try:
            for i in range(n):  # one TLS record each
                sock.sendall(request_bytes("GET", _target(i, "pipe"), OPT_HOST))
        finally:
            if frozen:
                _cont_all(pids)
        answered = 0
        try:
            for i in range(n):
                _check_answer(read_response(sock), _target(i, "pipe"))
                answered += 1
        except TimeoutError:
            pytest.fail(f"connection hung: {answered} of {n} pipelined requests answered")
    finally:
        forget(sock)
    assert serve.wait_open_connections(0) == 0


def _h2_upload_all(conn: H2Conn, bodies: list[bytes]) -> dict[int, bytes]:
    """POST /mcp of every body on its own stream of `conn`, interleaved: each round sends
    what the windows allow on every stream in one burst. Returns stream id → body."""
    c = conn.conn
    left: dict[int, memoryview] = {}
    streams: dict[int, bytes] = {}
    for body in bodies:
        sid = c.get_next_available_stream_id()
        conn._results[sid] = H2Result(None, [], b"")
        c.send_headers(sid, [
            (b":method", b"POST"), (b":scheme", b"https"), (b":authority", OPT_HOST.encode()),
            (b":path", b"/mcp"), (b"content-type", b"application/json"),
            (b"accept", b"application/json, text/event-stream"),
            (b"content-length", str(len(body)).encode())])
        left[sid] = memoryview(body)
        streams[sid] = body
    while any(left.values()):
        sent = False
        for sid, view in left.items():
            room = min(c.local_flow_control_window(sid), c.max_outbound_frame_size, len(view))
            if view and room > 0:
                c.send_data(sid, bytes(view[:room]), end_stream=room == len(view))
                left[sid] = view[room:]
                sent = True
        conn.sock.sendall(c.data_to_send())
        if not sent:
            conn._pump(until=lambda: any(c.local_flow_control_window(s) > 0
                                         for s, v in left.items() if v), timeout=HANG)
    return streams


def test_a_client_that_closes_right_after_its_last_request_is_let_go(
        served: ServeEnv) -> None:
    """DEFECT (lost wake-up), end to end: the last request and the client's FIN arrive
    together. The answer is sent; then the connection must end (EOF seen), not sit
    counted until the idle timeout (300 s here)."""
    serve = served.fresh().serve
    socks = []
    try:
        for i in range(20):
            s = tls_socket(serve.port, OPT_HOST, timeout=HANG)
            s.sendall(request_bytes("GET", _target(i, "first"), OPT_HOST))
            _check_answer(read_response(s), _target(i, "first"))
            s.sendall(request_bytes("GET", _target(i, "last"), OPT_HOST))
            socket.socket.shutdown(s, socket.SHUT_WR)  # TCP FIN behind it (no TLS close)
            socks.append(s)
        for i, s in enumerate(socks):
            _check_answer(read_response(s), _target(i, "last"))
        assert serve.wait_open_connections(0) == 0
    finally:
        for s in socks:
            forget(s)


def test_h2_uploads_in_parallel_are_answered_byte_exact(served: ServeEnv) -> None:
    """Several HTTP/2 streams upload bodies of different sizes at once on one connection,
    interleaved in bursts (the read loop waits first after short reads): every stream is
    answered, and the node got every body byte-exact."""
    env = served.fresh()
    conn = H2Conn(env.serve.port, OPT_HOST)
    try:
        for round_ in range(3):
            bodies = [rpc("tools/list", {"pad": os.urandom(15_000 * (i + 1)).hex()}, i)
                      for i in range(8)]
            streams = _h2_upload_all(conn, bodies)
            for sid in streams:
                res = conn.wait(sid, timeout=HANG * 3)
                assert res.status == 200, (round_, res.status, res.body[:200])
                assert json.loads(res.body)["result"]["tools"]
        got = {hashlib.sha256(r.body).hexdigest() for r in env.node.requests()}
        assert {hashlib.sha256(b).hexdigest() for b in bodies} <= got
    finally:
        conn.close()
    assert env.serve.wait_open_connections(0) == 0


@pytest.mark.parametrize("frozen", [True, False], ids=["arrives-while-frozen", "live"])
def test_h2_streams_opened_in_a_burst_of_small_records_are_all_answered(
        served: ServeEnv, frozen: bool) -> None:
    """DEFECT (lost wake-up) on HTTP/2: a client opens many streams at once, each HEADERS
    in its own small TLS record, more than one recv of them. After a short read the h2
    read loop waits first: every stream must still be answered, with its own path."""
    env = served.fresh()
    conn = H2Conn(env.serve.port, OPT_HOST)
    try:
        conn.sock.settimeout(HANG)
        assert conn.request("GET", _target(-1, "h2warm")).status == 200
        c = conn.conn
        n = min(100, c.remote_settings.max_concurrent_streams)
        pad = 3 * READ_SIZE // n  # random hex: HPACK cannot shrink it much
        pids = env.serve.pids()
        if frozen:
            _stop_all(pids)
        sids = {}
        try:
            for i in range(n):
                sid = c.get_next_available_stream_id()
                conn._results[sid] = H2Result(None, [], b"")
                target = _target(i, "h2burst")
                c.send_headers(sid, [
                    (b":method", b"GET"), (b":scheme", b"https"),
                    (b":authority", OPT_HOST.encode()), (b":path", target.encode()),
                    (b"x-pad", os.urandom(pad // 2).hex().encode())], end_stream=True)
                conn.sock.sendall(c.data_to_send())  # a record each
                sids[sid] = target
        finally:
            if frozen:
                _cont_all(pids)
        answered = 0
        for sid, target in sids.items():
            try:
                res = conn.wait(sid, timeout=HANG)
            except TimeoutError:
                pytest.fail(f"connection hung: {answered} of {n} streams answered")
            assert res.status == 200, (res.status, res.body[:200])
            assert json.loads(res.body)["target"] == target
            answered += 1
    finally:
        conn.close()
    assert env.serve.wait_open_connections(0) == 0


def test_many_keepalive_connections_and_a_bystander(served: ServeEnv) -> None:
    """Hundreds of connections parked on the hub between requests, all woken in a
    burst, while a bystander from another address is served; everyone gets exactly their
    answer; the count returns to 0."""
    serve = served.fresh().serve
    n = 300
    socks = []
    try:
        for i in range(n):
            s = tls_socket(serve.port, OPT_HOST, timeout=HANG)
            s.sendall(request_bytes("GET", _target(i, "first"), OPT_HOST))
            socks.append(s)
        for i, s in enumerate(socks):
            _check_answer(read_response(s), _target(i, "first"))
        for i, s in enumerate(socks):  # all of them parked: wake every one at once
            s.sendall(request_bytes("GET", _target(i, "second"), OPT_HOST))
        by = tls_socket(serve.port, OPT_HOST, source=BYSTANDER_IP, timeout=HANG)
        try:
            by.sendall(request_bytes("GET", _target(0, "bystander"), OPT_HOST))
            _check_answer(read_response(by), _target(0, "bystander"))
        finally:
            forget(by)
        for i, s in enumerate(socks):
            _check_answer(read_response(s), _target(i, "second"))
    finally:
        for s in socks:
            forget(s)
    assert serve.wait_open_connections(0) == 0


def test_client_gone_while_its_request_waits_on_the_node(served: ServeEnv) -> None:
    """Clients disconnect while the engine is parked on the node's answer (a slow
    stream): the upstream waits are cancelled; the pool keeps serving; the count returns
    to 0; a later request on every kind of path is answered."""
    env = served.fresh()
    serve = env.serve
    for round_ in range(3):
        socks = []
        for _ in range(6):
            s = tls_socket(serve.port, OPT_HOST, timeout=HANG)
            s.sendall(request_bytes("GET", "/stream?n=50&interval=0.2", OPT_HOST))
            read_response(s, head_only=True)
            socks.append(s)
        for s in socks:
            forget(s)  # gone mid-stream
        sock = tls_socket(serve.port, OPT_HOST, timeout=HANG)
        try:
            for i in range(5):
                body = os.urandom(3000 * (i + 1))
                target = _target(i, f"after-gone-{round_}")
                sock.sendall(request_bytes("PUT", target, OPT_HOST, body=body,
                                           content_type="application/octet-stream"))
                resp = read_response(sock)
                if resp.status != 200:  # PUT outside the MCP path may be refused: fine
                    assert resp.status in (403, 405), resp.status
                    break
                _check_answer(resp, target, body)
            sock.sendall(request_bytes("GET", _target(0, "get"), OPT_HOST))
            _check_answer(read_response(sock), _target(0, "get"))
        finally:
            forget(sock)
    assert serve.wait_open_connections(0) == 0


def test_slow_head_gets_408_and_an_idle_connection_is_closed(tmp_path: Path) -> None:
    """Deadlines on parked waits, end to end: a head that never completes is answered
    408 and closed; a connection idle past idle_timeout is closed; the count returns to
    0; a new connection is served."""
    env = ServeEnv.start(tmp_path, workers=1, limits={**OPEN_LIMITS, "idle_timeout": "2s",
                                                      "clienthello_timeout": "2s"})
    try:
        serve = env.serve
        idle = tls_socket(serve.port, OPT_HOST, timeout=HANG)
        idle.sendall(request_bytes("GET", _target(0, "idle"), OPT_HOST))
        _check_answer(read_response(idle), _target(0, "idle"))
        slow = tls_socket(serve.port, OPT_HOST, timeout=HANG * 3)
        slow.sendall(b"GET /slow HTTP/1.1\r\nHost: " + OPT_HOST.encode() + b"\r\n")
        resp = read_response(slow)
        assert resp.status == 408, resp.status
        assert closed_by_peer(slow, HANG)
        assert closed_by_peer(idle, HANG * 3)
        forget(slow)
        forget(idle)
        assert serve.wait_open_connections(0) == 0
        sock = tls_socket(serve.port, OPT_HOST, timeout=HANG)
        try:
            sock.sendall(request_bytes("GET", _target(1, "after"), OPT_HOST))
            _check_answer(read_response(sock), _target(1, "after"))
        finally:
            forget(sock)
    finally:
        env.stop()


def test_two_workers_survive_kill_9_of_one(tmp_path: Path) -> None:
    """`serve --workers 2`: sockets are handed to worker processes and join their hubs;
    a worker killed with SIGKILL mid-traffic is replaced, and new connections (and the
    surviving worker's) keep getting exactly their answers."""
    env = ServeEnv.start(tmp_path, workers=2, limits=OPEN_LIMITS)
    try:
        serve = env.serve
        deadline = time.monotonic() + 20
        while len(serve.pids()) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        workers = serve.pids()[1:]
        assert len(workers) == 2, workers
        errors: list[BaseException] = []
        stop = threading.Event()

        def client(tag: str) -> None:
            i = 0
            try:
                while not stop.is_set() and i < 400:
                    try:
                        s = tls_socket(serve.port, OPT_HOST, timeout=HANG)
                    except (ConnectionError, ssl.SSLError):
                        continue  # the connection the dead worker held: reconnect
                    try:
                        for _ in range(5):
                            target = _target(i, tag)
                            s.sendall(request_bytes("GET", target, OPT_HOST))
                            _check_answer(read_response(s), target)
                            i += 1
                    except (ConnectionError, ssl.SSLError, BrokenPipeError):
                        pass  # on the killed worker
                    finally:
                        forget(s)
            except BaseException as exc:  # noqa: BLE001 - reported by the test
                errors.append(exc)

        threads = [threading.Thread(target=client, args=(f"w{k}",)) for k in range(4)]
        for t in threads:
            t.start()
        time.sleep(1.0)
        os.kill(workers[0], signal.SIGKILL)
        time.sleep(1.0)
        stop.set()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads), "a client hung"
        assert not errors, errors
        assert serve.alive()
        # a fresh round after the restart: every connection answered
        for i in range(20):
            s = tls_socket(serve.port, OPT_HOST, timeout=HANG)
            try:
                s.sendall(request_bytes("GET", _target(i, "after-kill"), OPT_HOST))
                _check_answer(read_response(s), _target(i, "after-kill"))
            finally:
                forget(s)
    finally:
        env.stop()


# --- the upstream legs: deadlines on parked waits, in process -----------------------------


async def test_a_504_on_one_pooled_connection_leaves_the_others_and_the_pool_working(
        nursery: trio.Nursery, tmp_path: Path) -> None:
    """A node that never answers some requests (their upstream reads are parked on the
    hub until the header deadline fires: 504) while other requests run on other pooled
    connections at the same time: each of those gets exactly its answer, and afterwards
    the pool serves again (no connection left with a deadline armed, nothing hung)."""
    from tests.test_terminate import post_mcp, start_env
    from tests.test_terminate import rpc as demo_rpc

    env = await start_env(nursery, tmp_path, header_timeout=1.0, node_alpn=("http/1.1",),
                          seal="optional")
    results: dict[str, list[int]] = {"stall": [], "ok": []}

    async def stall(client) -> None:  # type: ignore[no-untyped-def]
        r = await client.request("GET", "https://mcp.alina.test/_demo/stall")
        results["stall"].append(r.status)

    async def ok(client, i: int) -> None:  # type: ignore[no-untyped-def]
        r = await post_mcp(client, demo_rpc("tools/list", {}, i))
        assert r.status == 200, r.status
        assert json.loads(r.content)["id"] == i
        results["ok"].append(i)

    with trio.fail_after(60):
        for round_ in range(2):
            async with env.client(http2=False) as client, trio.open_nursery() as inner:
                for _ in range(3):
                    inner.start_soon(stall, client)
                for i in range(12):
                    inner.start_soon(ok, client, 100 * round_ + i)
            async with env.client(http2=False) as client:  # after: the pool serves
                for i in range(5):
                    await ok(client, 1000 + 100 * round_ + i)
    assert results["stall"] == [504] * 6
    assert sorted(results["ok"]) == sorted(
        [100 * r + i for r in range(2) for i in range(12)]
        + [1000 + 100 * r + i for r in range(2) for i in range(5)])
    assert not deadlines.sweeper()._armed or all(
        a.deadline > trio.current_time() for a in deadlines.sweeper()._armed)
    await env.terminator.aclose()


# --- reload, drain, writers parked on a slow reader -----------------------------------------


def test_parked_connections_survive_a_reload_and_a_drain_closes_them(tmp_path: Path) -> None:
    """Connections parked on the hub between requests: a reload (SIGHUP) leaves each one
    serving its next request; a drain (SIGTERM) closes every one of them at once (the
    idle timeout is far away) and serve exits cleanly."""
    env = ServeEnv.start(tmp_path, workers=1, limits={**OPEN_LIMITS, "idle_timeout": "300s"})
    socks = []
    try:
        serve = env.serve
        for i in range(50):
            s = tls_socket(serve.port, OPT_HOST, timeout=HANG)
            s.sendall(request_bytes("GET", _target(i, "pre"), OPT_HOST))
            _check_answer(read_response(s), _target(i, "pre"))
            socks.append(s)
        assert serve.reload() == "reloaded"
        for i, s in enumerate(socks):
            s.sendall(request_bytes("GET", _target(i, "post"), OPT_HOST))
            _check_answer(read_response(s), _target(i, "post"))
        serve.proc.send_signal(signal.SIGTERM)
        for s in socks:
            assert closed_by_peer(s, HANG)
        assert serve.proc.wait(timeout=HANG * 2) == 0
    finally:
        for s in socks:
            forget(s)
        env.stop()


def test_writers_parked_on_slow_readers_get_every_byte_and_gone_readers_free_all(
        served: ServeEnv) -> None:
    """Large answers to clients with small receive buffers: the engine's writes wait on
    the hub for room (EPOLLOUT joins the socket's set) while its reads of the node go on.
    Readers that keep reading get every byte (length and content); readers that stop
    and vanish mid-answer free their connection; the count returns to 0."""
    serve = served.fresh().serve
    size = 4 << 20
    errors: list[BaseException] = []

    def reader(slow: bool) -> None:
        try:
            s = tls_socket(serve.port, OPT_HOST, rcvbuf=4096, timeout=HANG)
            try:
                s.sendall(request_bytes("GET", f"/big?bytes={size}", OPT_HOST))
                resp = read_response(s, head_only=True)
                assert resp.status == 200
                got = 0
                digest = hashlib.sha256()
                # what `read_response` read past the head is the body's start
                reader_buf, _READERS[id(s)].buf = _READERS[id(s)].buf, b""
                digest.update(reader_buf)
                got += len(reader_buf)
                while got < size:
                    chunk = s.recv(1 << 14)
                    if not chunk:
                        break
                    digest.update(chunk)
                    got += len(chunk)
                    if slow:
                        time.sleep(0.001)
                assert got == size
                assert digest.digest() == hashlib.sha256(b"x" * size).digest()
            finally:
                forget(s)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    def quitter() -> None:
        s = tls_socket(serve.port, OPT_HOST, rcvbuf=4096, timeout=HANG)
        s.sendall(request_bytes("GET", f"/big?bytes={size}", OPT_HOST))
        read_response(s, head_only=True)
        s.recv(1000)
        forget(s)  # gone with the engine's writer parked on a full buffer

    threads = [threading.Thread(target=reader, args=(k % 2 == 0,)) for k in range(4)]
    threads += [threading.Thread(target=quitter) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a reader hung"
    assert not errors, errors
    assert serve.wait_open_connections(0) == 0
    # the pool is still good
    s = tls_socket(serve.port, OPT_HOST, timeout=HANG)
    try:
        s.sendall(request_bytes("GET", _target(0, "after-big"), OPT_HOST))
        _check_answer(read_response(s), _target(0, "after-big"))
    finally:
        forget(s)
