"""The passthrough engine (`net/edge.py`) attacked through a real `serve` on loopback
(main and its default workers; passthrough is main's): a head the backend's kernel
takes only in part, a backend that never reads, a client's reset that arrives with its
hello or while the backend connect hangs, the per-IP cap counted exactly after clients
aborted at every stage while another address is served, and a route moved by a reload
while a connection splices. After each, the process's own truth (open connections, its
fd table) is back where it was.

Where several arrivals must reach the engine as one edge, the process is held with
SIGSTOP while the client sends, and let go with SIGCONT. Waits are bounded polls;
nothing asserts timing."""

from __future__ import annotations

import hashlib
import os
import re
import select
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.test_attacks4 import ext, hello, sni_ext
from tests.test_edge import (
    STUCK_SNI,
    Backend,
    bulk_writer,
    dial,
    echo,
    edge_served,
    eventually,
    hello_for,
    metric,
    open_fds,
    reset,
)
from tests.test_serve import HELLO, WAIT, Served, free_port, recv_exact

ECHO_SNI = "www.example.test"  # the captured hello's name
#: A route whose backend advertises a tiny receive window and reads late.
NARROW_SNI = "narrow.example.test"
#: A route whose backend takes the connection and never reads from it.
HOLD_SNI = "hld.example.test"
#: The per-IP cap of the served config.
PER_IP = 6


def big_hello(sni: str, total: int) -> bytes:
    """One record holding a ClientHello of `total` bytes (header included), padded."""
    base = hello([sni_ext(sni.encode()), ext(21, b"")])
    return hello([sni_ext(sni.encode()), ext(21, bytes(total - (len(base) - 5)))])


class Holder:
    """A backend handler that takes the connection and reads nothing until `release`."""

    def __init__(self) -> None:
        self.go = threading.Event()
        self.lock = threading.Lock()
        self.holding = 0

    def __call__(self, conn: socket.socket) -> None:
        with self.lock:
            self.holding += 1
        try:
            self.go.wait(4 * WAIT)
        finally:
            with self.lock:
                self.holding -= 1

    def release(self) -> None:
        """Every held connection closed (by the backend's thread), then hold again."""
        self.go.set()
        eventually(lambda: self.holding == 0, "the held connections released")
        self.go.clear()


HOLD = Holder()


def late_echo(conn: socket.socket) -> None:
    """Echo, but only after a pause: the engine writes its head while nothing reads."""
    time.sleep(0.3)
    echo(conn)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Served, int, int]]:
    tmp = tmp_path_factory.mktemp("edge-attacks")
    tls, admin = free_port(), free_port()
    plain, narrow, hold = Backend(echo), Backend(late_echo), Backend(HOLD)
    # inherited by the sockets they accept: a window of a few hundred bytes at first
    narrow.server.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1)
    hold.server.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1)
    try:
        with edge_served(tmp, tls, admin, PER_IP, {
                ECHO_SNI: plain.port, NARROW_SNI: narrow.port, HOLD_SNI: hold.port}) as s:
            yield s, tls, admin
    finally:
        HOLD.go.set()
        for b in (plain, narrow, hold):
            b.close()


def settled(admin: int) -> bool:
    return metric(admin, "pact_ingress_open_connections") == 0


def test_a_head_the_backend_takes_in_part_is_sent_whole(served: tuple[Served, int, int]):
    """A ClientHello near the 16 KiB cap with the client's next bytes behind it makes a
    head of ~20 KiB. The backend socket has TCP_NOTSENT_LOWAT 16 KiB, so toward a
    backend whose window is small the kernel takes only part of it, without saying
    EAGAIN; the rest must still go out when the backend reads."""
    s, tls, admin = served
    big = big_hello(NARROW_SNI, 16384)
    tail = os.urandom(8000)
    for source in ("127.0.0.1", "127.0.0.2"):
        with dial(tls, source) as c:
            c.sendall(big + tail)  # one write: the engine reads hello and tail together
            assert recv_exact(c, len(big) + len(tail)) == big + tail
    eventually(lambda: settled(admin), "open_connections back to 0")
    assert not [e for e in s.log_events() if e.get("event") == "backend_reset"]


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def refusals(admin: int) -> float:
    return metric(admin, "pact_ingress_rejections_total", reason="max_connections_per_ip")


def cap_is_exact(tls: int, admin: int, source: str) -> None:
    """`source` gets exactly PER_IP connections, each served; one more is closed
    unanswered and counted; meanwhile another address is served."""
    before = refusals(admin)
    held = []
    try:
        for _ in range(PER_IP):
            c = dial(tls, source)
            held.append(c)
            c.sendall(HELLO + b"in")
            assert recv_exact(c, len(HELLO) + 2) == HELLO + b"in"
        with dial(tls, source) as over:
            over.sendall(HELLO + b"over")
            assert over.recv(100) == b""  # refused once it showed it is a client's
        with dial(tls, "127.0.0.9") as other:
            other.sendall(HELLO + b"other")
            assert recv_exact(other, len(HELLO) + 5) == HELLO + b"other"
        assert refusals(admin) == before + 1
    finally:
        for c in held:
            c.close()


def test_the_per_ip_cap_stays_exact_after_aborts_at_every_stage(
        served: tuple[Served, int, int]):
    """Clients of one address abort at every stage of a connection (mid-hello, while
    the backend connect hangs, at the alert, mid-splice, half-closed, toward a backend
    that never reads): afterwards that address again gets exactly PER_IP connections."""
    s, tls, admin = served
    pid = s.proc.pid
    source = "127.0.0.8"
    cap_is_exact(tls, admin, source)
    eventually(lambda: settled(admin), "open_connections back to 0")
    before = open_fds(pid)

    def aborts(stage: int) -> None:
        c = dial(tls, source)
        try:
            if stage == 1:
                c.sendall(HELLO[:5])  # the record header alone
            elif stage == 2:
                c.sendall(HELLO[:9])  # and the handshake header
                c.shutdown(socket.SHUT_WR)
            elif stage == 3:  # routed, its backend connect pending
                c.sendall(hello_for(STUCK_SNI))
            elif stage == 4:  # unknown name: the alert
                c.sendall(hello_for("nne.example.test"))
            elif stage == 5:  # splicing, bytes in flight both ways
                c.sendall(HELLO + os.urandom(300_000))
                c.recv(1000)
            elif stage == 6:  # half-closed after the hello, then gone
                c.sendall(HELLO)
                c.shutdown(socket.SHUT_WR)
                c.recv(1000)
            elif stage == 7:  # its backend never reads
                c.sendall(hello_for(HOLD_SNI) + os.urandom(200_000))
        except OSError:
            pass
        reset(c)

    threads = [threading.Thread(target=aborts, args=(i % 8,)) for i in range(48)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT)
    eventually(lambda: settled(admin), "open_connections back to 0 after the aborts")
    cap_is_exact(tls, admin, source)
    eventually(lambda: settled(admin), "open_connections back to 0")
    HOLD.release()  # its side of the connections whose clients aborted
    eventually(lambda: open_fds(pid) <= before + 8, f"fds back near {before}")
    assert s.proc.poll() is None


def test_a_backend_that_never_reads_holds_the_client_back(served: tuple[Served, int, int]):
    """The engine buffers at most a copy probe per direction: a client writing to a
    backend that reads nothing is held back by TCP, and the process does not grow."""
    s, tls, admin = served
    pid = s.proc.pid
    eventually(lambda: settled(admin), "idle")
    fds, rss = open_fds(pid), rss_kib(pid)
    c = dial(tls, "127.0.0.7")
    c.sendall(hello_for(HOLD_SNI))
    c.setblocking(False)
    block = os.urandom(1 << 16)
    pushed = 0
    deadline = time.monotonic() + WAIT
    while pushed < 256 << 20 and time.monotonic() < deadline:  # bounded both ways
        try:
            pushed += c.send(block)
        except BlockingIOError:
            if not select.select([], [c], [], 0.5)[1]:
                break  # held back: nothing taken for half a second
    assert pushed < 256 << 20, "the engine took everything the client sent"
    assert rss_kib(pid) - rss < 16 << 10, "the process grew with what it could not pass on"
    assert open_fds(pid) <= fds + 4  # two sockets, at most one pipe
    reset(c)
    eventually(lambda: settled(admin), "open_connections back to 0")
    HOLD.release()
    eventually(lambda: open_fds(pid) <= fds + 2, f"fds back near {fds}")


def test_a_reset_that_came_with_the_hello_ends_the_connection(
        served: tuple[Served, int, int]):
    """A client's hello, its next bytes and its RST can reach the engine in one edge
    while it waits for the hello. That edge's error is not seen by the read that takes
    the hello; with a backend that takes little, the engine reads the client no more,
    and nothing else reports the reset: the connection must still end now, not at the
    idle timeout (300 s)."""
    s, tls, admin = served
    pid = s.proc.pid
    eventually(lambda: settled(admin), "idle")
    fds = open_fds(pid)
    c = dial(tls, "127.0.0.6")
    # accepted, its first read found nothing: the engine waits for the hello's edge
    eventually(lambda: metric(admin, "pact_ingress_open_connections") == 1, "accepted")
    os.kill(pid, signal.SIGSTOP)  # so that the hello, the bytes and the RST make one edge
    try:
        c.sendall(hello_for(HOLD_SNI) + os.urandom(60_000))
        reset(c)
    finally:
        os.kill(pid, signal.SIGCONT)
    eventually(lambda: settled(admin), "the reset connection ended")
    HOLD.release()
    eventually(lambda: open_fds(pid) <= fds + 2, f"fds back near {fds}")


def tagged(conn: socket.socket) -> None:
    """Says who it is, then echoes."""
    conn.sendall(b"new:")
    echo(conn)


def test_a_reload_moving_a_route_leaves_connections_mid_splice_where_they_were(
        served: tuple[Served, int, int]):
    """A SIGHUP that points a route at another backend while a bulk transfer splices
    through it (pipes in use both ways): the open connection stays with its backend
    and loses nothing; a new one reaches the new backend; then the counts and fds are
    back where they were."""
    s, tls, admin = served
    pid = s.proc.pid
    eventually(lambda: settled(admin), "idle")
    fds = open_fds(pid)
    old_text = s.config.read_text()
    route = re.search(rf'host: {re.escape(ECHO_SNI)}, .*?backend: "127\.0\.0\.1:(\d+)"',
                      old_text)
    assert route is not None
    new = Backend(tagged)
    size, block = 24 << 20, os.urandom(1 << 20)
    sent, got = hashlib.sha256(), hashlib.sha256()
    halfway = threading.Event()
    reloads = sum(e.get("event") == "reloaded" for e in s.log_events())
    try:
        c = dial(tls, "127.0.0.5")
        c.sendall(HELLO)
        assert recv_exact(c, len(HELLO)) == HELLO

        w = bulk_writer(c, block, size, sent, pause=halfway)
        n = 0
        while chunk := c.recv(1 << 20):
            got.update(chunk)
            n += len(chunk)
            if not halfway.is_set() and n >= size >> 2:  # mid-splice: move the route
                s.config.write_text(old_text.replace(
                    route.group(0), route.group(0).replace(route.group(1), str(new.port))))
                s.proc.send_signal(signal.SIGHUP)
                eventually(lambda: sum(e.get("event") == "reloaded"
                                       for e in s.log_events()) > reloads, "the reload")
                with dial(tls, "127.0.0.5") as fresh:
                    fresh.sendall(HELLO)
                    assert recv_exact(fresh, 4 + len(HELLO)) == b"new:" + HELLO
                halfway.set()
        w.join(WAIT)
        c.close()
        assert n == size and got.hexdigest() == sent.hexdigest()
    finally:
        halfway.set()
        s.config.write_text(old_text)
        s.proc.send_signal(signal.SIGHUP)
        new.close()
    eventually(lambda: sum(e.get("event") == "reloaded" for e in s.log_events()) > reloads + 1
               and echoed_plain(tls), "the route back where it was")
    eventually(lambda: settled(admin), "open_connections back to 0")
    eventually(lambda: open_fds(pid) <= fds + 4, f"fds back near {fds}")


def echoed_plain(tls: int) -> bool:
    with dial(tls, "127.0.0.5") as c:
        c.sendall(HELLO)
        return recv_exact(c, len(HELLO)) == HELLO


def test_a_client_reset_while_its_backend_connect_is_pending_ends_it_as_reset(
        served: tuple[Served, int, int]):
    """A hello taken in the read right after accept is routed at once; when the
    backend's connect then hangs, a client that resets must end the connection now, as
    a reset: not held for the connect timeout and then counted as a backend that is
    down (and answered with an alert nobody reads)."""
    s, tls, admin = served
    pid = s.proc.pid
    eventually(lambda: settled(admin), "idle")

    def outcome(name: str) -> float:
        return metric(admin, "pact_ingress_connections_total", route=STUCK_SNI,
                      mode="passthrough", outcome=name)

    resets, downs = outcome("reset"), outcome("backend_down")
    os.kill(pid, signal.SIGSTOP)  # the hello is queued before the engine accepts
    try:
        c = dial(tls, "127.0.0.4")
        c.sendall(hello_for(STUCK_SNI))
    finally:
        os.kill(pid, signal.SIGCONT)
    eventually(lambda: metric(admin, "pact_ingress_open_connections") == 1, "routed")
    reset(c)
    eventually(lambda: outcome("reset") == resets + 1, "the connection ended as a reset")
    assert settled(admin) and outcome("backend_down") == downs
