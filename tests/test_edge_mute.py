"""A direction that waits to write stops hearing its source (the engine registers the
source fd without EPOLLIN until the direction moves again). Attacked through a real
`serve` with both ends of each connection held by the test: both directions muted at
once and resumed in either order, both EOFs arriving while both are muted, a backend
that half-closes or resets while the client's direction is muted, a connection muted
for good that must still end by its idle timeout, a reload and a drain while muted,
many connections muted and resumed over and over, and fd numbers taken again after a
muted connection ends (in a later batch of events, and in the same one). Every byte
must arrive in order and every EOF pass; connections end, and serve's count and its
sockets return to the truth. Waits are bounded polls of the process's own state;
nothing asserts on timing."""

from __future__ import annotations

import contextlib
import hashlib
import os
import queue
import random
import signal
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.test_edge import (
    PER_IP,
    edge_served,
    eventually,
    hello_for,
    metric,
    passthrough_config,
    stuck_port,
)
from tests.test_edge_stall import EPOLLIN, EPOLLOUT, interest, is_muted, socket_fd
from tests.test_serve import WAIT, Served, free_port, recv_exact

SNI = "mut.example.test"
HELLO_M = hello_for(SNI)
#: Small receive buffers at both ends: the chain fills after a few hundred KiB.
SMALL = 1 << 14


class Accepting:
    """A backend that takes connections and hands each socket to the test, which then
    plays the backend's part itself (reads, writes, half-closes, resets)."""

    def __init__(self) -> None:
        self.server = socket.create_server(("127.0.0.1", 0), backlog=256)
        self.server.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SMALL)  # inherited
        self.port = self.server.getsockname()[1]
        self.accepted: queue.Queue[socket.socket] = queue.Queue()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            conn.settimeout(WAIT)
            self.accepted.put(conn)

    def take(self) -> socket.socket:
        return self.accepted.get(timeout=WAIT)

    def close(self) -> None:
        self.server.close()


Instance = tuple[Served, int, int, Accepting]


@pytest.fixture(scope="module")
def muted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Instance]:
    backend = Accepting()
    tls, admin = free_port(), free_port()
    try:
        with edge_served(tmp_path_factory.mktemp("mute"), tls, admin, 4 * PER_IP,
                         {SNI: backend.port}) as s:
            yield s, tls, admin, backend
    finally:
        backend.close()


def pair(tls: int, backend: Accepting) -> tuple[socket.socket, socket.socket]:
    """A client through the engine and the backend's end of it, the hello taken."""
    c = socket.socket()
    c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SMALL)
    c.settimeout(WAIT)
    c.connect(("127.0.0.1", tls))
    c.sendall(HELLO_M)
    b = backend.take()
    assert recv_exact(b, len(HELLO_M)) == HELLO_M
    return c, b


def serve_fds(pid: int, c: socket.socket, b: socket.socket) -> tuple[int, int]:
    """serve's fds for the client's and the backend's side of this connection."""
    cfd = socket_fd(pid, c.getpeername()[1], c.getsockname()[1])
    bfd = socket_fd(pid, b.getpeername()[1], b.getsockname()[1])
    assert cfd is not None and bfd is not None, "serve holds no socket for this connection"
    return cfd, bfd


def blocks(size: int, seed: int) -> Iterator[bytes]:
    """`size` bytes of a seeded stream, in 256 KiB pieces."""
    rng = random.Random(seed)
    left = size
    while left:
        n = min(left, 1 << 18)
        yield rng.randbytes(n)
        left -= n


def digest_of(size: int, seed: int) -> str:
    h = hashlib.sha256()
    for block in blocks(size, seed):
        h.update(block)
    return h.hexdigest()


def fill(c: socket.socket, rng: random.Random | None = None,
         digest: Any = None) -> int:
    """Sends until a send would block (bounded: the chain holds far less than 256 MiB)
    random bytes from `rng`, hashed into `digest`: how many were sent."""
    c.setblocking(False)
    rng = rng or random.Random(7)
    sent = 0
    for _ in range(4096):
        block = rng.randbytes(1 << 16)
        try:
            n = c.send(block)
        except BlockingIOError:
            break
        if digest is not None:
            digest.update(block[:n])
        sent += n
    c.settimeout(WAIT)
    return sent


class Writer(threading.Thread):
    """Sends `size` seeded bytes (blocking), then half-closes; `error` if it failed."""

    def __init__(self, sock: socket.socket, size: int, seed: int,
                 shut: bool = True) -> None:
        super().__init__(daemon=True)
        self.sock, self.size, self.seed, self.shut = sock, size, seed, shut
        self.error: BaseException | None = None
        self.done = threading.Event()

    def run(self) -> None:
        try:
            for block in blocks(self.size, self.seed):
                self.sock.sendall(block)
            if self.shut:
                self.sock.shutdown(socket.SHUT_WR)
        except BaseException as exc:  # reported by the test
            self.error = exc
        finally:
            self.done.set()


def upload_until_muted(pid: int, c: socket.socket, b: socket.socket,
                       seed: int) -> tuple[int, Writer]:
    """The client starts an upload of `SIZE` seeded bytes (then its EOF) that the
    backend does not read: returns serve's fd for the client, once it is muted, and the
    writer."""
    cfd, _ = serve_fds(pid, c, b)
    w = Writer(c, SIZE, seed)
    w.start()
    eventually(lambda: is_muted(pid, cfd), f"client fd muted: {interest(pid, cfd)}")
    return cfd, w


class Reader(threading.Thread):
    """Waits for `gate`, then reads to EOF: (bytes, sha256, how it ended)."""

    def __init__(self, sock: socket.socket, gate: threading.Event | None = None) -> None:
        super().__init__(daemon=True)
        self.sock, self.gate = sock, gate or threading.Event()
        self.n, self.how = 0, ""
        self.digest = hashlib.sha256()
        self.done = threading.Event()

    def run(self) -> None:
        try:
            self.gate.wait(WAIT * 3)
            while data := self.sock.recv(1 << 20):
                self.digest.update(data)
                self.n += len(data)
            self.how = "eof"
        except OSError as exc:
            self.how = type(exc).__name__
        finally:
            self.done.set()

    def result(self) -> tuple[str, int, str]:
        assert self.done.wait(WAIT), "the reader never saw the end"
        return self.how, self.n, self.digest.hexdigest()


def relay_sockets(pid: int, tls: int, backend: int) -> int:
    """serve's sockets of passthrough connections: accepted on `tls`, or to `backend`
    (the listener itself left out). Counted from its fd table and /proc/net/tcp."""
    inodes = set()
    for line in open("/proc/net/tcp").read().splitlines()[1:]:
        f = line.split()
        local, remote = int(f[1].split(":")[1], 16), int(f[2].split(":")[1], 16)
        if (local == tls and f[3] != "0A") or remote == backend:
            inodes.add(f"socket:[{f[9]}]")
    n = 0
    for name in os.listdir(f"/proc/{pid}/fd"):
        try:
            n += os.readlink(f"/proc/{pid}/fd/{name}") in inodes
        except OSError:
            continue
    return n


def settled(s: Served, admin: int, tls: int, backend: Accepting) -> None:
    """No connection open, and serve holds no socket of one (pipes are not counted:
    drained ones are pooled for reuse, up to the pool's bound)."""
    pid = s.proc.pid
    eventually(lambda: metric(admin, "pact_ingress_open_connections") == 0,
               "open_connections back to 0")
    eventually(lambda: relay_sockets(pid, tls, backend.port) == 0,
               "serve still holds sockets of ended connections")


SIZE = 16 << 20  # per direction: far more than the buffers on the way hold


@pytest.mark.parametrize("first", ["client", "backend"])
def test_both_directions_muted_then_resumed_in_either_order(muted: Instance, first: str):
    """Client and backend both stop reading while both keep writing: each direction
    ends up waiting to write, so both fds are muted at once (each is one direction's
    source and the other's destination). The side that resumes first gets every byte
    and the EOF of its direction while the other direction stays muted; then the other
    side resumes and gets all of its own. Nothing is lost either way, and the
    connection ends with both EOFs."""
    s, tls, admin, backend = muted
    pid = s.proc.pid
    c, b = pair(tls, backend)
    with c, b:
        cfd, bfd = serve_fds(pid, c, b)
        writers = [Writer(c, SIZE, 1), Writer(b, SIZE, 2)]
        readers = {"client": Reader(c), "backend": Reader(b)}
        for t in [*writers, *readers.values()]:
            t.start()
        eventually(lambda: is_muted(pid, cfd) and is_muted(pid, bfd),
                   f"both fds muted: {interest(pid, cfd)}, {interest(pid, bfd)}")
        # what each side receives: the other side's stream (client seed 1, backend 2)
        want = {"client": digest_of(SIZE, 2), "backend": digest_of(SIZE, 1)}
        second = "backend" if first == "client" else "client"
        readers[first].gate.set()
        # the direction into the first side completes, EOF included, while the other
        # direction still waits: its source stays muted all along
        assert readers[first].result() == ("eof", SIZE, want[first])
        still = cfd if first == "client" else bfd
        assert is_muted(pid, still), f"unmuted while still waiting: {interest(pid, still)}"
        readers[second].gate.set()
        assert readers[second].result() == ("eof", SIZE, want[second])
        for w in writers:
            assert w.done.wait(WAIT) and w.error is None, w.error
    settled(s, admin, tls, backend)


def test_backend_half_close_while_up_is_muted(muted: Instance):
    """The client's direction waits on the backend (the backend's fd is its
    destination and the source of the other direction). The backend half-closes then:
    its EOF (and the bytes before it) reach the client at once, although the client's
    own direction is still muted; once the backend reads, the whole upload arrives with
    its EOF and the connection ends."""
    s, tls, admin, backend = muted
    pid = s.proc.pid
    c, b = pair(tls, backend)
    with c, b:
        cfd, w = upload_until_muted(pid, c, b, 3)
        b.sendall(b"bye")
        b.shutdown(socket.SHUT_WR)
        assert recv_exact(c, 3) == b"bye"
        assert c.recv(1) == b"", "the backend's EOF did not pass while UP was muted"
        assert is_muted(pid, cfd), "the client's direction moved without its backend"
        r = Reader(b)
        r.gate.set()
        r.start()
        assert r.result() == ("eof", SIZE, digest_of(SIZE, 3))
        assert w.done.wait(WAIT) and w.error is None, w.error
    settled(s, admin, tls, backend)


def test_both_eofs_arrive_while_both_directions_are_muted(muted: Instance):
    """Both ends send until their writes block, so both directions wait to write and
    both fds are muted (each still registered for writability); then both ends
    half-close. The EOFs come while nothing is read from either fd: once both ends
    read, each gets every byte the other sent and then its EOF, and the connection
    ends."""
    s, tls, admin, backend = muted
    pid = s.proc.pid
    c, b = pair(tls, backend)
    with c, b:
        cfd, bfd = serve_fds(pid, c, b)
        rng_up, rng_down = random.Random(10), random.Random(20)
        up, down = hashlib.sha256(), hashlib.sha256()
        n_up = n_down = 0
        for _ in range(200):  # each fill lets the engine move more: until both block
            n_up += fill(c, rng_up, up)
            n_down += fill(b, rng_down, down)
            if is_muted(pid, cfd) and is_muted(pid, bfd):
                break
            threading.Event().wait(0.02)
        assert is_muted(pid, cfd) and is_muted(pid, bfd), (
            interest(pid, cfd), interest(pid, bfd))
        for fd in (cfd, bfd):
            assert (interest(pid, fd) or 0) & EPOLLOUT, "writability not asked for"
        c.shutdown(socket.SHUT_WR)
        b.shutdown(socket.SHUT_WR)
        readers = [Reader(c), Reader(b)]
        for r in readers:
            r.gate.set()
            r.start()
        assert [r.result() for r in readers] == [("eof", n_down, down.hexdigest()),
                                                  ("eof", n_up, up.hexdigest())]
    settled(s, admin, tls, backend)


def test_backend_reset_while_up_is_muted(muted: Instance):
    """A backend that resets while the client's direction is muted ends the
    connection: serve lets go of the client (which sees the end) and of both fds."""
    s, tls, admin, backend = muted
    pid = s.proc.pid
    c, b = pair(tls, backend)
    with c:
        port = c.getsockname()[1]
        cfd, w = upload_until_muted(pid, c, b, 4)
        b.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\0\0\0\0\0\0\0")
        b.close()  # a reset (unread bytes in its buffer make it one anyway)
        eventually(lambda: socket_fd(pid, tls, port) is None,
                   "serve still holds the client of a reset backend")
        try:
            while c.recv(1 << 16):
                pass
        except OSError:
            pass  # a reset is an end as good as an EOF here
        assert w.done.wait(WAIT), "the client's writer still blocks"
    settled(s, admin, tls, backend)


def test_reload_while_muted_leaves_the_connection_whole(muted: Instance):
    """A SIGHUP while the client's direction is muted (the config rewritten with one
    more route): the connection goes on untouched, and once the backend reads, every
    byte arrives with the EOF; a new connection after the reload is served."""
    s, tls, admin, backend = muted
    pid = s.proc.pid
    old = s.config.read_text()
    reloads = sum(e.get("event") == "reloaded" for e in s.log_events())
    c, b = pair(tls, backend)
    try:
        with c, b:
            cfd, w = upload_until_muted(pid, c, b, 5)
            extra = '      - {host: xtr.example.test, mode: passthrough, ' \
                    'backend: "127.0.0.1:9"}\n'
            s.config.write_text(old + extra)
            s.proc.send_signal(signal.SIGHUP)
            eventually(lambda: sum(e.get("event") == "reloaded"
                                   for e in s.log_events()) > reloads, "the reload")
            assert is_muted(pid, cfd), f"the reload touched it: {interest(pid, cfd)}"
            b.sendall(b"still here")
            assert recv_exact(c, 10) == b"still here"
            r = Reader(b)
            r.gate.set()
            r.start()
            assert r.result() == ("eof", SIZE, digest_of(SIZE, 5))
            assert w.done.wait(WAIT) and w.error is None, w.error
            b.shutdown(socket.SHUT_WR)
            assert c.recv(1) == b""
        c2, b2 = pair(tls, backend)
        with c2, b2:
            c2.sendall(b"after")
            assert recv_exact(b2, 5) == b"after"
    finally:
        s.config.write_text(old)
        s.proc.send_signal(signal.SIGHUP)
    eventually(lambda: sum(e.get("event") == "reloaded" for e in s.log_events())
               > reloads + 1, "the config put back")
    settled(s, admin, tls, backend)


MANY = 50
PER_CONN = 2 << 20


def test_many_connections_muted_and_resumed_over_and_over(muted: Instance):
    """50 connections at once, each side reading in small pieces with random pauses
    between them (its receive buffer small): each direction fills its destination,
    is muted, resumes, many times over. Every byte arrives both ways, in order, with
    both EOFs, no connection is left stuck, and serve's count returns to 0."""
    s, tls, admin, backend = muted
    failures: list[str] = []
    one_at_a_time = threading.Lock()  # the backend's next accept is this client's

    class Paused(Reader):
        def __init__(self, sock: socket.socket, seed: int) -> None:
            super().__init__(sock)
            self.rng = random.Random(seed)
            self.gate.set()

        def run(self) -> None:
            try:
                while data := self.sock.recv(self.rng.choice((4096, 16384, 65536))):
                    self.digest.update(data)
                    self.n += len(data)
                    if self.rng.random() < 0.3:
                        threading.Event().wait(self.rng.uniform(0, 0.01))
                self.how = "eof"
            except OSError as exc:
                self.how = type(exc).__name__
            finally:
                self.done.set()

    def one(i: int) -> None:
        try:
            with one_at_a_time:
                c, b = pair(tls, backend)
        except Exception as exc:
            failures.append(f"{i}: connect: {exc!r}")
            return
        with c, b:
            ws = [Writer(c, PER_CONN, 100 + i), Writer(b, PER_CONN, 200 + i)]
            rs = [Paused(c, 300 + i), Paused(b, 400 + i)]
            for t in [*ws, *rs]:
                t.start()
            got = [r.result() for r in rs]
            want = [("eof", PER_CONN, digest_of(PER_CONN, 200 + i)),
                    ("eof", PER_CONN, digest_of(PER_CONN, 100 + i))]
            if got != want:
                failures.append(f"{i}: {got} != {want}")
            for w in ws:
                if not w.done.wait(WAIT) or w.error is not None:
                    failures.append(f"{i}: writer {w.error!r}")

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(MANY)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT * 3)
    assert not [t for t in threads if t.is_alive()], "connections stuck"
    assert not failures, failures[:5]
    settled(s, admin, tls, backend)


def test_a_reused_fd_number_starts_unmuted(muted: Instance):
    """A muted connection ends (its client resets); the next connection's sockets may
    get the same fd numbers. Nothing of the old connection's mute may carry over: the
    new client's fd is registered for reading and its bytes pass both ways."""
    s, tls, admin, backend = muted
    pid = s.proc.pid
    for round_ in range(5):
        c, b = pair(tls, backend)
        cfd, _ = serve_fds(pid, c, b)
        port = c.getsockname()[1]
        fill(c)
        eventually(lambda: is_muted(pid, cfd), f"client fd muted: {interest(pid, cfd)}")
        c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\0\0\0\0\0\0\0")
        c.close()
        b.close()
        eventually(lambda: socket_fd(pid, tls, port) is None, "the reset connection ends")
        c2, b2 = pair(tls, backend)
        with c2, b2:
            cfd2, bfd2 = serve_fds(pid, c2, b2)
            for fd in (cfd2, bfd2):
                mask = interest(pid, fd)
                assert mask is not None and mask & EPOLLIN, (round_, fd, cfd, mask)
            c2.sendall(b"up")
            assert recv_exact(b2, 2) == b"up"
            b2.sendall(b"down")
            assert recv_exact(c2, 4) == b"down"
    settled(s, admin, tls, backend)


def test_a_connection_on_the_fds_of_one_that_ended_in_the_same_batch_is_left_alone(
        muted: Instance):
    """A muted connection's client resets, a new connection arrives with its hello, and
    the old connection's backend resets, all before the engine next looks (serve is
    stopped meanwhile, so the three are reported in one batch, in that order). Ending
    the old connection on the first event frees its two fd numbers; the accept and
    connect on the second take them again; the third event, the old backend's error,
    was read before those fds were reused and is not the new connection's: it must not
    end it. The new connection then carries bytes both ways."""
    s, tls, admin, backend = muted
    pid = s.proc.pid
    linger = b"\x01\0\0\0\0\0\0\0"
    for round_ in range(5):
        ca, ba = pair(tls, backend)
        cfd, _ = serve_fds(pid, ca, ba)
        fill(ca)
        eventually(lambda: is_muted(pid, cfd), f"client fd muted: {interest(pid, cfd)}")
        ca.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger)
        ba.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger)
        cb = socket.socket()
        cb.settimeout(WAIT)
        s.proc.send_signal(signal.SIGSTOP)
        try:
            ca.close()  # a reset
            cb.connect(("127.0.0.1", tls))  # the kernel completes it; the hello waits
            cb.sendall(HELLO_M)
            ba.close()  # a reset
        finally:
            s.proc.send_signal(signal.SIGCONT)
        with cb, backend.take() as bb:
            assert recv_exact(bb, len(HELLO_M)) == HELLO_M
            cb.sendall(b"up")
            assert recv_exact(bb, 2) == b"up", f"round {round_}: the new connection ended"
            bb.sendall(b"down")
            assert recv_exact(cb, 4) == b"down", f"round {round_}: the new connection ended"
    settled(s, admin, tls, backend)


# --- a connection muted for good still ends -------------------------------------------------

IDLE_S = 2


@contextlib.contextmanager
def own_instance(tmp: Path, idle_s: int | None = None) -> Iterator[Instance]:
    """A `serve` of the test's own (it is stopped or drained), with `SNI` to a fresh
    `Accepting` backend; `idle_s`: its idle timeout."""
    backend = Accepting()
    tls, admin = free_port(), free_port()
    try:
        with stuck_port() as stuck:
            text = passthrough_config(tls, admin, PER_IP, {SNI: backend.port,
                                                           "stk.example.test": stuck})
            if idle_s is not None:
                text = text.replace("  clienthello_timeout: 5s\n",
                                    f"  clienthello_timeout: 5s\n  idle_timeout: {idle_s}s\n")
            s = Served(tmp, text)
            try:
                s.wait_notify("READY=1")
                yield s, tls, admin, backend
            finally:
                s.stop()
    finally:
        backend.close()


@pytest.fixture()
def idle(tmp_path: Path) -> Iterator[Instance]:
    with own_instance(tmp_path, IDLE_S) as instance:
        yield instance


def test_client_half_close_then_a_backend_that_never_reads_ends_by_idle_timeout(
        idle: Instance):
    """The client sends until its writes block, then half-closes; the backend never
    reads again. The client's direction waits muted with its EOF behind the bytes, and
    nothing moves: the connection must still end by its idle timeout (logged as such),
    and serve's count and fds return to what they were."""
    s, tls, admin, backend = idle
    pid = s.proc.pid
    eventually(lambda: metric(admin, "pact_ingress_open_connections") == 0, "idle")
    c, b = pair(tls, backend)
    with c, b:
        cfd, _ = serve_fds(pid, c, b)
        port = c.getsockname()[1]
        fill(c)
        eventually(lambda: is_muted(pid, cfd), f"client fd muted: {interest(pid, cfd)}")
        c.shutdown(socket.SHUT_WR)
        eventually(lambda: socket_fd(pid, tls, port) is None,
                   "the stalled connection outlived its idle timeout")
        try:
            assert c.recv(1) == b""
        except ConnectionResetError:
            pass
    eventually(lambda: any(e.get("event") == "conn_close" and e.get("outcome")
                           == "idle_timeout" for e in s.log_events()), "idle_timeout logged")
    settled(s, admin, tls, backend)



def test_a_drain_lets_a_muted_connection_finish(tmp_path: Path):
    """SIGTERM while the client's direction is muted: serve stops accepting, but the
    open connection goes on; once its backend reads, the whole upload arrives with its
    EOF, the backend's answer and EOF reach the client, and serve exits 0 as soon as
    that last connection has ended (well before its drain deadline)."""
    with own_instance(tmp_path) as (s, tls, admin, backend):
        pid = s.proc.pid
        c, b = pair(tls, backend)
        with c, b:
            cfd, w = upload_until_muted(pid, c, b, 8)
            s.proc.send_signal(signal.SIGTERM)
            s.wait_notify("STOPPING=1")
            eventually(lambda: socket_fd(pid, tls, 0) is None, "the listener closed")
            assert is_muted(pid, cfd), f"the drain touched it: {interest(pid, cfd)}"
            r = Reader(b)
            r.gate.set()
            r.start()
            assert r.result() == ("eof", SIZE, digest_of(SIZE, 8))
            assert w.done.wait(WAIT) and w.error is None, w.error
            b.sendall(b"done")
            b.shutdown(socket.SHUT_WR)
            assert recv_exact(c, 4) == b"done"
            assert c.recv(1) == b""
        assert s.proc.wait(timeout=WAIT) == 0
