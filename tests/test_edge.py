"""The epoll passthrough engine (`net/edge.py`) through a real `pact-ingress serve`
process, for what the engine adds over a task per connection: clients that abort at
every stage leave the counts and the fd table as they were, a ClientHello arriving byte
by byte or in several segments is still routed, a flooding address does not starve
another one, half-close works both ways, bulk arrives intact both ways, and a backend
that refuses gets the alert and the log line. No timing asserts: waits are bounded
polls of the process's own state."""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import signal
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pact_ingress.admin.client import request
from pact_ingress.config import Address
from tests.test_serve import HELLO, WAIT, Served, free_port, recv_exact

ALERT_80 = b"\x15\x03\x03\x00\x02\x02\x50"
#: Per-IP cap in the served config: small, so one address can hit it quickly.
PER_IP = 24
#: Clients in the abort storm (each one aborts at some stage).
STORM = 240


def hello_for(sni: str) -> bytes:
    """The captured hello with its SNI (www.example.test) swapped for a same-length one."""
    old = b"www.example.test"
    assert len(sni) == len(old) and HELLO.count(old) == 1
    return HELLO.replace(old, sni.encode())


ECHO_SNI, HALF_SNI, DOWN_SNI = "www.example.test", "hlf.example.test", "dwn.example.test"
#: A backend whose accept queue is full: its SYNs are dropped, connects stay pending.
STUCK_SNI = "stk.example.test"


class Backend:
    """A threaded raw TCP server in the test process: `handler(conn)` per connection."""

    def __init__(self, handler: Callable[[socket.socket], None],
                 host: str = "127.0.0.1") -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.server = socket.create_server((host, 0), family=family, backlog=1024)
        self.port = self.server.getsockname()[1]
        self.handler = handler
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._run, args=(conn,), daemon=True).start()

    def _run(self, conn: socket.socket) -> None:
        try:
            self.handler(conn)
        except OSError:
            pass
        finally:
            conn.close()

    def close(self) -> None:
        self.server.close()


def echo(conn: socket.socket) -> None:
    while data := conn.recv(1 << 16):
        conn.sendall(data)


#: What the half-closing backend received after its own half-close: sha256 per connection.
HALF_SEEN: list[str] = []


def half_closer(conn: socket.socket) -> None:
    """Reads the hello, says "early", half-closes, then hashes whatever still comes."""
    recv_exact(conn, len(HELLO))
    conn.sendall(b"early")
    conn.shutdown(socket.SHUT_WR)
    digest = hashlib.sha256()
    while data := conn.recv(1 << 16):
        digest.update(data)
    HALF_SEEN.append(digest.hexdigest())


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Served, int, int]]:
    tmp = tmp_path_factory.mktemp("edge")
    tls, admin = free_port(), free_port()
    backends = [Backend(echo), Backend(half_closer)]
    refused = free_port()  # nothing listens there
    try:
        with edge_served(tmp, tls, admin, PER_IP, {
                ECHO_SNI: backends[0].port, HALF_SNI: backends[1].port,
                DOWN_SNI: refused}) as s:
            yield s, tls, admin
    finally:
        for b in backends:
            b.close()


@contextlib.contextmanager
def edge_served(tmp: Path, tls: int, admin: int, per_ip: int,
                routes: dict[str, int]) -> Iterator[Served]:
    """`serve` READY with these passthrough routes and `STUCK_SNI` to a `stuck_port`."""
    with stuck_port() as stuck:
        s = Served(tmp, passthrough_config(tls, admin, per_ip, {**routes, STUCK_SNI: stuck}))
        try:
            s.wait_notify("READY=1")
            yield s
        finally:
            s.stop()


@contextlib.contextmanager
def stuck_port() -> Iterator[int]:
    """A port a connect to stays in progress at: listening, never accepting, its queue
    filled by our own connects (the kernel drops SYNs to a full queue)."""
    stuck = socket.create_server(("127.0.0.1", 0), backlog=0)
    fillers = []
    try:
        for _ in range(4):
            f = socket.socket()
            fillers.append(f)
            f.setblocking(False)
            f.connect_ex(stuck.getsockname())
        yield stuck.getsockname()[1]
    finally:
        for f in fillers:
            f.close()
        stuck.close()


def passthrough_config(tls: int, admin: int, per_ip: int, routes: dict[str, int]) -> str:
    """One tenant's passthrough routes (SNI → loopback port), with a per-IP cap."""
    lines = "".join(f'      - {{host: {sni}, mode: passthrough, backend: "127.0.0.1:{port}"}}\n'
                    for sni, port in routes.items())
    return f"""\
state_dir: state
listen:
  tls: ["127.0.0.1:{tls}"]
  admin: "127.0.0.1:{admin}"
limits:
  max_connections_per_ip: {per_ip}
  clienthello_timeout: 5s
tenants:
  - name: edge
    pins: ["sha256:{'A' * 43}"]
    routes:
{lines}"""


def metrics(admin: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    status, body = request(Address("127.0.0.1", admin), "GET", "/metrics")
    assert status == 200
    out = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def metric(admin: int, name: str, **labels: str) -> float:
    return metrics(admin).get((name, tuple(sorted(labels.items()))), 0.0)


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def eventually(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.05)
    raise AssertionError(f"never: {what}")


def dial(port: int, source: str = "127.0.0.1") -> socket.socket:
    s = socket.socket()
    s.settimeout(WAIT)
    s.bind((source, 0))
    s.connect(("127.0.0.1", port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def reset(s: socket.socket) -> None:
    """Close with RST (SO_LINGER 0), as an aborting client does."""
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.close()


def echoed(port: int, payload: bytes = b"ping", source: str = "127.0.0.1") -> bool:
    with dial(port, source) as s:
        s.sendall(HELLO + payload)
        return recv_exact(s, len(HELLO) + len(payload)) == HELLO + payload


# --- tests ---------------------------------------------------------------------------------


def test_aborting_clients_leave_counts_and_fds_as_they_were(served: tuple[Served, int, int]):
    s, tls, admin = served
    pid = s.proc.pid

    def storm(seed: int) -> None:
        rng = random.Random(seed)

        def one(i: int) -> None:
            stage = i % 4
            try:
                c = dial(tls)
            except OSError:
                return
            try:
                if stage == 1:  # mid-ClientHello
                    c.sendall(HELLO[: rng.randrange(1, len(HELLO))])
                elif stage >= 2:  # mid-splice: bytes in flight one or both ways
                    c.sendall(HELLO + os.urandom(rng.randrange(1, 200_000)))
                    if stage == 3:
                        c.recv(rng.randrange(1, 4096))
            except OSError:
                pass
            reset(c)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(STORM)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT)

    def settled() -> bool:
        return metric(admin, "pact_ingress_open_connections") == 0

    assert echoed(tls)
    storm(1)  # the first storm grows the pipe pool to what such a storm needs
    eventually(settled, "open_connections back to 0 after the first storm")
    assert echoed(tls)
    before = open_fds(pid)
    storm(2)
    eventually(settled, "open_connections back to 0 after the second storm")
    # every fd of the storm's connections is closed; the pipe pool may keep a few more
    # drained pipes (it is bounded), never one pair per connection
    eventually(lambda: open_fds(pid) <= before + 8, f"fds back near {before}")
    assert echoed(tls)  # and the engine still serves


def test_clienthello_byte_by_byte_and_in_segments(served: tuple[Served, int, int]):
    _, tls, _ = served
    with dial(tls) as c:  # one byte per segment (TCP_NODELAY), the engine waits between
        for i in range(len(HELLO)):
            c.sendall(HELLO[i:i + 1])
            if i % 50 == 0:
                time.sleep(0.002)
        c.sendall(b"slow")
        assert recv_exact(c, len(HELLO) + 4) == HELLO + b"slow"
    rng = random.Random(7)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(HELLO)), 3))
        parts = [HELLO[a:b] for a, b in zip([0, *cuts], [*cuts, len(HELLO)], strict=True)]
        with dial(tls) as c:
            for part in parts:
                c.sendall(part)
                time.sleep(0.001)
            assert recv_exact(c, len(HELLO)) == HELLO


def test_flooding_address_does_not_starve_another(served: tuple[Served, int, int]):
    s, tls, admin = served
    refused_before = metric(admin, "pact_ingress_rejections_total",
                            reason="max_connections_per_ip")
    held: list[socket.socket] = []
    stop = threading.Event()

    def flood() -> None:  # 127.0.0.2 holds connections and keeps opening more
        while not stop.is_set() and len(held) < 4 * PER_IP:
            try:
                c = dial(tls, "127.0.0.2")
                c.sendall(hello_for(ECHO_SNI))
                held.append(c)
            except OSError:
                pass

    t = threading.Thread(target=flood)
    t.start()
    try:
        served_other = sum(echoed(tls, b"x" * 100, "127.0.0.3") for _ in range(30))
    finally:
        stop.set()
        t.join(WAIT)
    assert served_other == 30
    eventually(lambda: metric(admin, "pact_ingress_rejections_total",
                              reason="max_connections_per_ip") > refused_before,
               "the flooding address refused at its cap")
    for c in held:
        c.close()
    eventually(lambda: metric(admin, "pact_ingress_open_connections") == 0, "all closed")
    assert s.proc.poll() is None


def test_half_close_both_ways(served: tuple[Served, int, int]):
    _, tls, _ = served
    # the client half-closes first: the echo backend still answers everything
    with dial(tls) as c:
        payload = os.urandom(300_000)
        c.sendall(HELLO)
        c.sendall(payload)
        c.shutdown(socket.SHUT_WR)
        got = bytearray()
        while chunk := c.recv(1 << 16):
            got += chunk
        assert bytes(got) == HELLO + payload
    # the backend half-closes first: the client sees its EOF and can still send
    HALF_SEEN.clear()
    with dial(tls) as c:
        c.sendall(hello_for(HALF_SNI))
        assert recv_exact(c, 5) == b"early"
        assert c.recv(10) == b""  # its EOF, passed on
        late = os.urandom(500_000)
        c.sendall(late)
        c.shutdown(socket.SHUT_WR)
        eventually(lambda: len(HALF_SEEN) == 1, "the backend saw our EOF")
        assert HALF_SEEN == [hashlib.sha256(late).hexdigest()]


def bulk_writer(c: socket.socket, block: bytes, size: int, sent: Any,
                pause: threading.Event | None = None) -> threading.Thread:
    """A started thread that sends `size` bytes on `c` — 1 MiB `block` rotated by one
    byte more each time, so no two chunks are alike — into the `sent` hash, then
    half-closes; with `pause`, it waits for that event halfway."""
    def writer() -> None:
        for i in range(size >> 20):
            if pause is not None and i == size >> 21:
                pause.wait(WAIT)
            chunk = block[i:] + block[:i]
            sent.update(chunk)
            c.sendall(chunk)
        c.shutdown(socket.SHUT_WR)

    w = threading.Thread(target=writer)
    w.start()
    return w


def test_bulk_both_ways_intact(served: tuple[Served, int, int]):
    _, tls, _ = served
    size = 48 << 20

    def one(seed: int, results: list[bool]) -> None:
        rng = random.Random(seed)
        block = rng.randbytes(1 << 20)
        sent = hashlib.sha256()
        with dial(tls) as c:
            c.sendall(HELLO)

            w = bulk_writer(c, block, size, sent)
            got = hashlib.sha256()
            assert recv_exact(c, len(HELLO)) == HELLO
            n = 0
            while chunk := c.recv(1 << 20):
                got.update(chunk)
                n += len(chunk)
            w.join(WAIT)
        results.append(n == size and got.hexdigest() == sent.hexdigest())

    results: list[bool] = []
    threads = [threading.Thread(target=one, args=(i, results)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(4 * WAIT)
    assert results == [True, True, True]


def test_refusing_backend_gets_alert_log_and_counter(served: tuple[Served, int, int]):
    s, tls, admin = served
    with dial(tls) as c:
        c.sendall(hello_for(DOWN_SNI))
        assert recv_exact(c, 7) == ALERT_80
        assert c.recv(10) == b""
    eventually(lambda: any(e.get("event") == "backend_unreachable"
                           and e.get("route") == DOWN_SNI for e in s.log_events()),
               "a backend_unreachable log line")
    assert metric(admin, "pact_ingress_connections_total", route=DOWN_SNI,
                  mode="passthrough", outcome="backend_down") >= 1
    # and every served connection logged one conn_close line with its outcome
    closes = [e for e in s.log_events() if e.get("event") == "conn_close"]
    assert closes and all(e["mode"] == "passthrough" and e["outcome"] for e in closes)


def test_eof_right_behind_the_data_is_not_lost(served: tuple[Served, int, int]):
    """The peer's FIN often arrives with its last bytes: a read that returns them short
    does not mean the EOF was seen, and no later edge reports it. Both ways, with the
    hello whole or split (the engine then already waits on the client's fd)."""
    _, tls, _ = served
    rng = random.Random(3)
    for i in range(60):
        payload = os.urandom(rng.randrange(1, 3000))
        with dial(tls) as c:
            if i % 2:  # split: the engine registers the fd before the rest comes
                cut = rng.randrange(1, len(HELLO))
                c.sendall(HELLO[:cut])
                time.sleep(0.002)
                c.sendall(HELLO[cut:] + payload)
            else:
                c.sendall(HELLO + payload)
            c.shutdown(socket.SHUT_WR)
            got = bytearray()
            while chunk := c.recv(1 << 16):
                got += chunk
            assert bytes(got) == HELLO + payload, i


def test_messages_of_every_size_around_the_copy_probe(served: tuple[Served, int, int]):
    """Each readable edge copies a short message in one read and one write; a read that
    fills the probe (16 KiB) hands the direction to splice, which gives the pipe back
    once drained. Messages on both sides of that line, one at a time and pipelined, come
    back intact and in order on one connection."""
    _, tls, _ = served
    rng = random.Random(11)
    sizes = [1, 2, 100, 1400, 16383, 16384, 16385, 32768, 40000, 1, 7, 200_000, 3]
    with dial(tls) as c:
        c.sendall(HELLO)
        assert recv_exact(c, len(HELLO)) == HELLO
        for size in sizes:  # ping-pong
            payload = rng.randbytes(size)
            c.sendall(payload)
            assert recv_exact(c, size) == payload, size
        burst = b"".join(rng.randbytes(rng.choice(sizes)) for _ in range(40))
        done = threading.Event()

        def send() -> None:  # pipelined: the echo lags, both directions are busy
            c.sendall(burst)
            done.set()

        t = threading.Thread(target=send)
        t.start()
        assert recv_exact(c, len(burst)) == burst
        t.join(WAIT)
        assert done.is_set()


def test_hello_in_several_records_reaches_the_backend_as_sent(
        served: tuple[Served, int, int]):
    """A hello the quick check declines (several records, or split across segments)
    is parsed in full and routed the same; the backend gets the client's bytes as sent."""
    _, tls, _ = served
    message = b""
    pos = 0
    while pos < len(HELLO):  # the records' payloads: the handshake message
        length = int.from_bytes(HELLO[pos + 3:pos + 5], "big")
        message += HELLO[pos + 5:pos + 5 + length]
        pos += 5 + length
    for size in (len(message) // 2 + 1, 100, 7):
        chunks = [message[i:i + size] for i in range(0, len(message), size)]
        wire = b"".join(b"\x16\x03\x01" + len(ch).to_bytes(2, "big") + ch for ch in chunks)
        for split in (False, True):
            with dial(tls) as c:
                if split:  # the records arrive in two segments
                    c.sendall(wire[:len(wire) // 3])
                    time.sleep(0.002)
                    c.sendall(wire[len(wire) // 3:] + b"tail")
                else:
                    c.sendall(wire + b"tail")
                assert recv_exact(c, len(wire) + 4) == wire + b"tail"


def test_clients_aborting_while_the_backend_connect_is_pending(
        served: tuple[Served, int, int]):
    """A connect that never completes holds a backend socket in the engine; a client
    that resets (or half-closes) meanwhile ends the connection and releases both fds,
    while other addresses keep being served."""
    s, tls, admin = served
    pid = s.proc.pid
    assert echoed(tls)
    eventually(lambda: metric(admin, "pact_ingress_open_connections") == 0, "idle")
    before = open_fds(pid)
    pending = []
    for i in range(20):
        c = dial(tls, f"127.0.0.{10 + i % 5}")
        c.sendall(hello_for(STUCK_SNI))
        pending.append(c)
    eventually(lambda: metric(admin, "pact_ingress_open_connections") == 20,
               "the 20 connections held while their connects are pending")
    assert echoed(tls, b"served meanwhile", "127.0.0.3")
    for i, c in enumerate(pending):
        if i % 2:
            reset(c)
        else:
            c.shutdown(socket.SHUT_WR)  # its EOF waits behind the pending connect
    for c in pending[::2]:  # a half-closed client is ended by the connect timeout
        c.settimeout(WAIT)
        try:
            data = c.recv(100)
        except OSError:
            data = b""
        assert data in (b"", ALERT_80), data
        c.close()
    eventually(lambda: metric(admin, "pact_ingress_open_connections") == 0, "all ended")
    eventually(lambda: open_fds(pid) <= before + 8, f"fds back near {before}")
    assert echoed(tls)


def test_conn_close_names_the_route_a_connection_was_routed_by(
        tmp_path_factory: pytest.TempPathFactory):
    """A connection keeps the constants of the route it was routed by for its conn_close
    line: one opened before a reload that renames the route's tenant logs the old
    tenant, one opened after it the new; both lines carry every member."""
    tmp = tmp_path_factory.mktemp("edge-reload")
    tls = free_port()
    backend = Backend(echo)

    def config(tenant: str) -> str:
        return f"""\
state_dir: state
listen:
  tls: ["127.0.0.1:{tls}"]
tenants:
  - name: {tenant}
    pins: ["sha256:{'A' * 43}"]
    routes:
      - {{host: {ECHO_SNI}, mode: passthrough, backend: "127.0.0.1:{backend.port}"}}
"""

    s = Served(tmp, config("before"))
    try:
        s.wait_notify("READY=1")

        def closes() -> list[dict]:
            return [e for e in s.log_events() if e.get("event") == "conn_close"]

        old = dial(tls)
        old.sendall(HELLO + b"ping")
        assert recv_exact(old, len(HELLO) + 4) == HELLO + b"ping"  # routed, relaying
        s.config.write_text(config("after"))
        s.proc.send_signal(signal.SIGHUP)
        eventually(lambda: any(e.get("event") == "reloaded" for e in s.log_events()),
                   "the reload")
        with dial(tls) as new:
            new.sendall(HELLO)
            assert recv_exact(new, len(HELLO)) == HELLO
        eventually(lambda: len(closes()) == 1, "the new connection's conn_close")
        old.close()
        eventually(lambda: len(closes()) == 2, "the old connection's conn_close")
        first, second = closes()
        assert first["tenant"] == "after" and second["tenant"] == "before"
        for line, up in ((first, len(HELLO)), (second, len(HELLO) + 4)):
            assert set(line) == {"ts", "level", "event", "route", "tenant", "mode",
                                 "client_ip", "bytes_up", "bytes_down", "duration_s",
                                 "outcome"}, line
            assert line["route"] == ECHO_SNI and line["mode"] == "passthrough"
            assert line["bytes_up"] == up and line["bytes_down"] == up
            assert line["outcome"] == "ok" and line["client_ip"] == "127.0.0.1"
    finally:
        s.stop()
        backend.close()


def test_every_conn_close_line_comes_out_while_idle_and_at_the_drain(
        tmp_path_factory: pytest.TempPathFactory):
    """The engine writes a batch's log lines together: a burst of connections ends with
    every conn_close line in the log while the process then sits idle (a bounded wait,
    not a timing assert), and connections that end during the SIGTERM drain have theirs
    written before the process exits."""
    tmp = tmp_path_factory.mktemp("edge-lines")
    tls = free_port()
    backend = Backend(echo)
    s = Served(tmp, f"""\
state_dir: state
listen:
  tls: ["127.0.0.1:{tls}"]
tenants:
  - name: t
    pins: ["sha256:{'A' * 43}"]
    routes:
      - {{host: {ECHO_SNI}, mode: passthrough, backend: "127.0.0.1:{backend.port}"}}
""")

    def closes() -> int:
        return sum(e.get("event") == "conn_close" for e in s.log_events())

    try:
        s.wait_notify("READY=1")
        burst = [dial(tls) for _ in range(40)]
        for c in burst:
            c.sendall(HELLO)
        for c in burst:
            assert recv_exact(c, len(HELLO)) == HELLO
            c.close()
        eventually(lambda: closes() == 40, "a conn_close line per connection of the burst")
        late = [dial(tls) for _ in range(8)]
        for c in late:
            c.sendall(HELLO)
            assert recv_exact(c, len(HELLO)) == HELLO
        s.proc.send_signal(signal.SIGTERM)
        s.wait_notify("STOPPING=1")
        for c in late:  # they end during the drain
            c.close()
        assert s.proc.wait(timeout=WAIT) == 0
        assert closes() == 48
    finally:
        s.stop()
        backend.close()
