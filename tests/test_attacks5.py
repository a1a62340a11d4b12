"""The terminate hand-over (engine → router → parked handler tasks) attacked from outside.

Run:   python -m pytest tests/test_attacks5.py -v

A plain terminate connection is handed from the passthrough engine to the router with its
socket and served in a handler task that parks afterwards and serves the next connection
(`net/runners.py`; a worker process does the same with the connections main hands it).
What one connection did in such a task — abort mid-handshake, time out, send its FIN
with its hello, offer `acme-tls/1` — must leave nothing that the next connection in the
same task sees. These tests drive a real `serve` (one process, or main and two workers)
over loopback TLS and assert only on the wire, /status and the log's event names.

Every loop is bounded in count and time; nothing asserts on timing.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import signal
import socket
import ssl
import struct
import subprocess
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.terminate_env import (
    LOOPBACK,
    OPT_HOST,
    H2Conn,
    H2Result,
    Serve,
    ServeEnv,
    forget,
    read_chunked_body,
    read_response,
    request_bytes,
    tls_socket,
)

#: A bound on any single wait of a client here (a hung connection fails, it never stalls
#: the run for long).
HANG = 10.0
LIMITS = {"calls_per_hour_per_ip": 100_000_000, "calls_per_hour_per_ip_key": 100_000_000,
          "max_connections_per_ip": 2000, "max_requests_in_flight_per_ip": 2000,
          "clienthello_timeout": 1}
#: Events that say a handler task let an error escape or a connection broke in a bug.
BUG_EVENTS = {"handler_error", "terminate_connection_error"}


@pytest.fixture(scope="module", params=[1, 2], ids=["one-process", "two-workers"])
def env(request: pytest.FixtureRequest,
        tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeEnv]:
    e = ServeEnv.start(tmp_path_factory.mktemp("attacks5"), workers=request.param,
                       limits=LIMITS)
    try:
        yield e
    finally:
        e.stop()


def _check(resp: Any, target: str) -> None:
    assert resp.status == 200, (resp.status, resp.body[:200])
    doc = json.loads(resp.body)
    assert doc["target"] == target
    assert doc["sha256"] == hashlib.sha256(b"").hexdigest()


def _good(port: int, tag: str) -> None:
    """One request on a fresh connection: it must be answered exactly."""
    target = f"/a5/{tag}"
    sock = tls_socket(port, OPT_HOST, timeout=HANG)
    try:
        sock.sendall(request_bytes("GET", target, OPT_HOST))
        _check(read_response(sock), target)
    finally:
        forget(sock)


def _bug_events(env: ServeEnv) -> list[dict[str, Any]]:
    return [e for e in env.serve.log_events() if e.get("event") in BUG_EVENTS]


# --- raw clients: a ClientHello made by the ssl module, sent however the test likes -------


class _MemoryClient:
    """A TLS client whose bytes go through memory: the test decides how they travel."""

    def __init__(self, host: str = OPT_HOST, alpn: tuple[str, ...] = ("http/1.1",)) -> None:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        ctx.set_alpn_protocols(list(alpn))
        self.inc, self.out = ssl.MemoryBIO(), ssl.MemoryBIO()
        self.tls = ctx.wrap_bio(self.inc, self.out, server_hostname=host)

    def hello(self) -> bytes:
        with contextlib.suppress(ssl.SSLWantReadError):
            self.tls.do_handshake()
        return self.out.read()

    def finish(self, sock: socket.socket) -> None:
        """The rest of the handshake over `sock` (bounded by its timeout)."""
        while True:
            try:
                self.tls.do_handshake()
                sock.sendall(self.out.read())
                return
            except ssl.SSLWantReadError:
                sock.sendall(self.out.read())
                data = sock.recv(65536)
                if not data:
                    raise ConnectionError("closed in the handshake") from None
                self.inc.write(data)

    def request(self, sock: socket.socket, raw: bytes) -> bytes:
        """Send `raw`, return everything read until the close-delimited answer's end or a
        whole HTTP response with Content-Length."""
        self.tls.write(raw)
        sock.sendall(self.out.read())
        got = b""
        while True:
            try:
                got += self.tls.read(65536)
            except ssl.SSLWantReadError:
                data = sock.recv(65536)
                if not data:
                    return got
                self.inc.write(data)
                continue
            except ssl.SSLZeroReturnError:
                return got
            head, sep, body = got.partition(b"\r\n\r\n")
            if sep:
                for line in head.split(b"\r\n"):
                    if (line.lower().startswith(b"content-length:")
                            and len(body) >= int(line.split(b":")[1])):
                        return got


def _raw(port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.settimeout(HANG)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.connect((LOOPBACK, port))
    return sock


def _reset(sock: socket.socket) -> None:
    """Close with an RST (SO_LINGER 0): an abort, not a goodbye."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def _drained(sock: socket.socket) -> bytes:
    """What the edge sends until it closes (bounded)."""
    got = b""
    with contextlib.suppress(OSError):
        while chunk := sock.recv(65536):
            got += chunk
    return got


def _hostile(port: int, kind: str) -> None:
    """One connection that misbehaves in the way `kind` names."""
    client = _MemoryClient(alpn=("acme-tls/1",) if kind == "acme" else ("http/1.1",))
    hello = client.hello()
    sock = _raw(port)
    try:
        if kind == "rst_mid_hello":
            sock.sendall(hello[: len(hello) // 2])
            time.sleep(0.02)
            _reset(sock)
        elif kind == "hello_then_fin":
            sock.sendall(hello)
            sock.shutdown(socket.SHUT_WR)
            _drained(sock)
        elif kind == "hello_fin_one_segment":
            # the FIN rides on the hello's last segment (MSG_MORE holds the bytes back
            # until the shutdown pushes both)
            sock.send(hello, socket.MSG_MORE)
            sock.shutdown(socket.SHUT_WR)
            _drained(sock)
        elif kind == "rst_after_server_hello":
            sock.sendall(hello)
            sock.recv(1)  # the edge has answered: the handshake is under way
            _reset(sock)
        elif kind == "stalled_handshake":
            sock.sendall(hello)  # and never the Finished: the handshake deadline ends it
            _drained(sock)
        elif kind == "garbage_after_hello":
            sock.sendall(hello + b"\x17\x03\x03\x00\x05hello")
            _drained(sock)
        elif kind == "acme":
            sock.sendall(hello)
            answer = _drained(sock)
            # no challenge certificate here: refused (an alert), never a handshake
            assert answer[:1] in (b"", b"\x15"), answer[:16]
        elif kind == "split_hello":
            for i in range(0, len(hello), 7):  # a hello in many small TCP segments
                sock.sendall(hello[i:i + 7])
                time.sleep(0.001)
            client.inc.write(b"")
            client.finish(sock)
            target = "/a5/split"
            answer = client.request(sock, request_bytes("GET", target, OPT_HOST))
            assert answer.startswith(b"HTTP/1.1 200"), answer[:100]
            assert target.encode() in answer
        else:
            raise AssertionError(kind)
    finally:
        with contextlib.suppress(OSError):
            sock.close()


HOSTILE = ["rst_mid_hello", "hello_then_fin", "hello_fin_one_segment",
           "rst_after_server_hello", "stalled_handshake", "garbage_after_hello", "acme",
           "split_hello"]


def test_misbehaving_connections_leave_nothing_for_the_next_one_in_the_task(
        env: ServeEnv) -> None:
    """Each kind of misbehaviour, then a plain request, over and over: the parked task
    that served the misbehaving connection serves the next one. Every plain request is
    answered, the counters return to zero, no handler error is logged."""
    serve = env.fresh().serve
    before = len(_bug_events(env))
    for round_ in range(3):
        for kind in HOSTILE:
            _hostile(serve.port, kind)
            _good(serve.port, f"{kind}-{round_}")
    assert serve.wait_open_connections(0) == 0
    # the tasks that saw deadlines fire and aborts now serve plain connections again
    for i in range(30):
        _good(serve.port, f"after-{i}")
    assert serve.wait_open_connections(0) == 0
    assert _bug_events(env)[before:] == []
    assert serve.alive()


def test_hostile_connections_at_once_with_plain_ones(env: ServeEnv) -> None:
    """The same misbehaviour from several threads at once, with plain requests among
    them: the stalled handshakes' deadlines fire while other tasks park and unpark."""
    serve = env.fresh().serve
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            for j, kind in enumerate(HOSTILE):
                _hostile(serve.port, kind)
                _good(serve.port, f"t{i}-{j}")
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    assert serve.wait_open_connections(0) == 0
    assert serve.alive()


def _many_open(port: int, n: int) -> list[ssl.SSLSocket]:
    socks: list[ssl.SSLSocket] = []
    try:
        for _ in range(n):
            socks.append(tls_socket(port, OPT_HOST, timeout=HANG))
    except BaseException:
        for s in socks:
            forget(s)
        raise
    return socks


def _served_at_once(serve: Serve, count: int, tag: str) -> None:
    """`count` connections open at once, each with a request in flight, each answered;
    then all closed and none left counted."""
    socks = _many_open(serve.port, count)
    try:
        for i, s in enumerate(socks):
            s.sendall(request_bytes("GET", f"/a5/{tag}/{i}", OPT_HOST))
        for i, s in enumerate(socks):
            _check(read_response(s), f"/a5/{tag}/{i}")
    finally:
        for s in socks:
            forget(s)
    assert serve.wait_open_connections(0) == 0


def test_more_connections_at_once_than_tasks_are_kept_parked(env: ServeEnv) -> None:
    """300 connections open at once (more than the 256 parked tasks kept), each with a
    request in flight, twice: the second wave is served by parked tasks and new ones."""
    serve = env.fresh().serve
    for wave in range(2):
        _served_at_once(serve, 300, f"w{wave}")
    _good(serve.port, "after-waves")


def test_the_crowd_shrinks_below_the_hub_and_grows_again(env: ServeEnv) -> None:
    """Sockets join the readiness hub while ≥ 4 terminate connections are open and leave
    when it is nearly idle: connections (HTTP/1.1 and HTTP/2) that lived through a
    crowd, its end and a new crowd keep being answered (no wait parked on a hub nobody
    serves), and h2 streams in flight while the crowd leaves are answered too."""
    serve = env.fresh().serve
    keep = _many_open(serve.port, 1)
    h2s = [H2Conn(serve.port, OPT_HOST) for _ in range(2)]
    try:
        for rnd in range(4):
            crowd = _many_open(serve.port, 8)
            try:
                for i, s in enumerate(crowd + keep):
                    target = f"/a5/crowd/{rnd}/{i}"
                    s.sendall(request_bytes("GET", target, OPT_HOST))
                    _check(read_response(s), target)
                for i, h in enumerate(h2s):
                    target = f"/a5/h2crowd/{rnd}/{i}"
                    _check(h.request("GET", target), target)
                # streams opened in the crowd, answered after it is gone
                sids = [h.open_stream("POST", f"/a5/h2gone/{rnd}", length=2)
                        for h in h2s]
            finally:
                for s in crowd:
                    forget(s)
            time.sleep(0.2)  # the crowd's ends are seen: three connections are left
            for h, sid in zip(h2s, sids, strict=True):
                h.send_body(sid, b"{}")
                h.sock.sendall(h.conn.data_to_send())
                result = h.wait(sid)
                assert result.status == 200, result
                assert json.loads(result.body)["target"] == f"/a5/h2gone/{rnd}"
            for i, s in enumerate(keep):
                target = f"/a5/alone/{rnd}/{i}"
                s.sendall(request_bytes("GET", target, OPT_HOST))
                _check(read_response(s), target)
    finally:
        for s in keep:
            forget(s)
        for h in h2s:
            h.close()
    assert serve.wait_open_connections(0) == 0


def test_a_client_that_stops_reading_a_big_answer_holds_up_nobody(env: ServeEnv) -> None:
    """A big response to a client that stops reading (its windows fill, the writer parks
    on the socket) while a crowd comes and goes: the others are answered, and once the
    client reads again it gets every byte."""
    serve = env.fresh().serve
    size = 8 << 20
    slow = tls_socket(serve.port, OPT_HOST, timeout=HANG, rcvbuf=4096)
    try:
        slow.sendall(request_bytes("GET", f"/big?bytes={size}", OPT_HOST))
        head = read_response(slow, head_only=True)
        assert head.status == 200
        for rnd in range(3):
            crowd = _many_open(serve.port, 6)
            try:
                for i, s in enumerate(crowd):
                    target = f"/a5/bystander/{rnd}/{i}"
                    s.sendall(request_bytes("GET", target, OPT_HOST))
                    _check(read_response(s), target)
            finally:
                for s in crowd:
                    forget(s)
        length = head.header("content-length")
        body = (read_chunked_body(slow) if length is None
                else _read_exact(slow, int(length)))
        assert len(body) == size
    finally:
        forget(slow)
    assert serve.wait_open_connections(0) == 0


def _read_exact(sock: ssl.SSLSocket, n: int) -> bytes:
    from tests.terminate_env import _READERS

    reader = _READERS[id(sock)]
    return reader.exact(n)


@pytest.mark.parametrize("workers", [1, 2], ids=["one-process", "two-workers"])
def test_sigterm_while_tasks_are_parked_busy_and_mid_handshake(
        tmp_path_factory: pytest.TempPathFactory, workers: int) -> None:
    """Drain with parked tasks (300 served at once before), an idle keep-alive connection, one
    stalled mid-handshake, one streaming answer and one h2 request in flight: both finish,
    a connection accepted before the drain and shaking hands after it gets its answer,
    and the process exits once nothing is in flight (the stalled handshake's 3 s at
    most), not at the 30 s drain deadline: a keep-alive connection whose answer ended
    during the drain is idle, and a drain closes idle connections."""
    env = ServeEnv.start(tmp_path_factory.mktemp(f"drain{workers}"), workers=workers,
                         limits=dict(LIMITS, clienthello_timeout=3))
    socks: list[socket.socket] = []
    try:
        serve = env.serve
        _served_at_once(serve, 300, "park")  # more tasks than are kept parked, then parked
        idle = tls_socket(serve.port, OPT_HOST, timeout=HANG)
        socks.append(idle)
        idle.sendall(request_bytes("GET", "/a5/idle", OPT_HOST))
        _check(read_response(idle), "/a5/idle")
        stalled = _raw(serve.port)
        socks.append(stalled)
        stalled.sendall(_MemoryClient().hello())
        streaming = tls_socket(serve.port, OPT_HOST, timeout=HANG)
        socks.append(streaming)
        streaming.sendall(request_bytes("GET", "/stream?n=6&interval=0.2", OPT_HOST))
        assert read_response(streaming, head_only=True).status == 200
        h2 = H2Conn(serve.port, OPT_HOST)
        socks.append(h2.sock)
        _check(h2.request("GET", "/a5/h2-first"), "/a5/h2-first")
        sid = h2.conn.get_next_available_stream_id()  # a streaming answer, begun
        h2._results[sid] = H2Result(None, [], b"")
        h2.conn.send_headers(sid, [
            (b":method", b"GET"), (b":scheme", b"https"), (b":authority", OPT_HOST.encode()),
            (b":path", b"/stream?n=6&interval=0.2")], end_stream=True)
        h2.sock.sendall(h2.conn.data_to_send())
        h2._pump(until=lambda: h2._results[sid].status is not None, timeout=HANG)
        early = _raw(serve.port)  # accepted before the drain; its hello comes after
        socks.append(early)
        serve.proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        client = _MemoryClient()
        early.sendall(client.hello())
        client.finish(early)
        answer = client.request(early, request_bytes("GET", "/a5/early", OPT_HOST))
        assert answer.startswith(b"HTTP/1.1 200") and b"/a5/early" in answer, answer[:200]
        # answered during the drain: the client is told the connection ends here
        assert b"\r\nconnection: close\r\n" in answer.split(b"\r\n\r\n")[0].lower() + b"\r\n"
        body = read_chunked_body(streaming)
        assert body == b"".join(f"id: {i}\ndata: tick\n\n".encode() for i in range(6))
        result = h2.wait(sid)  # the h2 answer begun before the drain ends whole too
        assert result.status == 200, result
        assert result.body == body
        try:
            rc = serve.proc.wait(timeout=12)
        except subprocess.TimeoutExpired:
            pytest.fail("serve still running 12 s into its drain with nothing in flight")
        assert rc == 0, serve.logs()[-2000:]
        assert _bug_events(env) == []
    finally:
        for s in socks:
            forget(s)
        env.stop()


@pytest.mark.parametrize("workers", [1, 2], ids=["one-process", "two-workers"])
def test_misbehaving_connections_leave_no_count_against_their_client(
        tmp_path_factory: pytest.TempPathFactory, workers: int) -> None:
    """With a per-client cap of 4, one client misbehaves in every way; then it
    opens 4 connections at once: all 4 are served (none of its earlier connections is
    still counted against it), and a 5th at once is refused."""
    env = ServeEnv.start(tmp_path_factory.mktemp(f"cap{workers}"), workers=workers,
                         limits=dict(LIMITS, max_connections_per_ip=4))
    try:
        serve = env.serve
        for kind in HOSTILE:
            _hostile(serve.port, kind)
        assert serve.wait_open_connections(0) == 0
        socks = _many_open(serve.port, 4)
        try:
            for i, s in enumerate(socks):
                s.sendall(request_bytes("GET", f"/a5/cap/{i}", OPT_HOST))
                _check(read_response(s), f"/a5/cap/{i}")
            with pytest.raises((OSError, ssl.SSLError)):
                extra = tls_socket(serve.port, OPT_HOST, timeout=HANG)
                try:
                    extra.sendall(request_bytes("GET", "/a5/cap/over", OPT_HOST))
                    read_response(extra)
                finally:
                    forget(extra)
        finally:
            for s in socks:
                forget(s)
        assert serve.wait_open_connections(0) == 0
        assert _bug_events(env) == []
    finally:
        env.stop()


def test_sni_spellings_of_a_terminate_host_are_served_alike(env: ServeEnv) -> None:
    """The engine's remembered host names (`quick_sni`) and the route lookup: the same
    host in other cases and with its trailing dot is terminated like the canonical
    spelling, over and over (remembered), and a near-miss is refused (alert 112)."""
    serve = env.fresh().serve
    for _ in range(3):
        for host in (OPT_HOST, OPT_HOST.upper(), OPT_HOST + ".", OPT_HOST.title() + "."):
            sock = tls_socket(serve.port, host, timeout=HANG)
            try:
                target = "/a5/spelling"
                sock.sendall(request_bytes("GET", target, OPT_HOST))
                _check(read_response(sock), target)
            finally:
                forget(sock)
        for host in ("x" + OPT_HOST, OPT_HOST[:-1], "www." + OPT_HOST):
            with pytest.raises(ssl.SSLError) as info:
                forget(tls_socket(serve.port, host, timeout=HANG))
            assert "UNRECOGNIZED_NAME" in str(info.value).upper(), info.value
    assert serve.wait_open_connections(0) == 0
