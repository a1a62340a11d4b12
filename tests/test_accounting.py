"""Accounting after a hostile workload: clients that abort at every stage of a terminate
connection (mid-ClientHello, mid-handshake, mid-head, mid-body on HTTP/1.1 and HTTP/2,
while the node answers, mid-response, pipelined, RST_STREAM storms, TCP resets,
100-continue then gone), passthrough clients gone mid-splice, and a node that breaks
mid-response, with one process and with two workers. Afterwards every gauge, count, cap
and fd must be back to the truth, and the same numbers must show in /status, /metrics
and the log lines.

Real `serve` processes and real sockets on loopback (tests/terminate_env.py). Every
wait is a bounded poll of the process's own state; nothing asserts timing.
"""

from __future__ import annotations

import collections
import gc
import socket
import ssl
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.terminate_env import (
    LOOPBACK,
    OPT_HOST,
    WAIT,
    H2Conn,
    H2Result,
    ServeEnv,
    client_context,
    exchange,
    forget,
    read_response,
    request_bytes,
    rpc,
    tls_socket,
)
from tests.test_serve import EchoBackend
from tests.test_workers import poll as eventually

#: Caps small enough to probe exactly: N allowed, N+1 refused.
PER_IP = 4
IN_FLIGHT = 4
SOURCES = ("127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5")
UPLOAD = b"u" * 50_000
#: A passthrough route of the same instance, to an echo backend.
PT_HOST = "pt.attack.test"


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def summed(text: str, name: str, **labels: str) -> float:
    return sum(v for (n, ls), v in samples(text).items()
               if n == name and all(dict(ls).get(k) == w for k, w in labels.items()))


def reset(sock: socket.socket) -> None:
    """Close with an RST (SO_LINGER 0), the abrupt way a client dies."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    forget(sock)


def dial(port: int, source: str) -> socket.socket:
    s = socket.socket()
    s.settimeout(WAIT)
    s.bind((source, 0))
    s.connect((LOOPBACK, port))
    return s


def client_hello(sni: str = OPT_HOST) -> bytes:
    inc, out = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = client_context().wrap_bio(inc, out, server_hostname=sni)
    try:
        obj.do_handshake()
    except ssl.SSLWantReadError:
        pass
    return out.read()


def h2_headers(method: str, path: str) -> list[tuple[bytes, bytes]]:
    return [(b":method", method.encode()), (b":scheme", b"https"),
            (b":authority", OPT_HOST.encode()), (b":path", path.encode())]


def hostile(port: int, source: str) -> None:
    """One round of clients that go away at every stage; each ends abruptly or plainly."""
    hello, pt_hello = client_hello(), client_hello(PT_HOST)
    for end in (forget, reset):
        s = dial(port, source)  # passthrough: gone mid-splice, bytes in flight both ways
        s.sendall(pt_hello + b"p" * 100_000)
        s.recv(1000)
        end(s)  # type: ignore[operator]
        for cut in (5, len(hello) // 2, len(hello) - 1):  # mid-ClientHello
            s = dial(port, source)
            s.sendall(hello[:cut])
            end(s)  # type: ignore[operator]
        s = dial(port, source)  # the whole hello, gone during the handshake
        s.sendall(hello)
        time.sleep(0.02)
        end(s)  # type: ignore[operator]
        s = tls_socket(port, OPT_HOST, source=source)  # mid-head
        s.sendall(b"POST /up HTTP/1.1\r\nHost: " + OPT_HOST.encode())
        time.sleep(0.02)
        end(s)
        s = tls_socket(port, OPT_HOST, source=source)  # mid-body, Content-Length
        s.sendall(request_bytes("POST", "/up-cl", OPT_HOST, body=UPLOAD,
                                content_type="application/octet-stream")[:-20_000])
        time.sleep(0.05)
        end(s)
        s = tls_socket(port, OPT_HOST, source=source)  # mid-body, chunked
        s.sendall(request_bytes("POST", "/up-chunked", OPT_HOST, length=False,
                                content_type="application/octet-stream",
                                headers=[("Transfer-Encoding", "chunked")])
                  + b"1000\r\n" + b"c" * 4096 + b"\r\n100\r\n" + b"c" * 10)
        time.sleep(0.05)
        end(s)
        s = tls_socket(port, OPT_HOST, source=source)  # 100-continue, part of the body
        head = request_bytes("POST", "/up-continue", OPT_HOST, body=UPLOAD,
                             content_type="application/octet-stream",
                             headers=[("Expect", "100-continue")])[:-len(UPLOAD)]
        s.sendall(head)
        time.sleep(0.02)
        s.sendall(UPLOAD[:1000])
        time.sleep(0.02)
        end(s)
        mcp = rpc("tools/list", {"pad": "p" * 40_000})  # a buffered MCP body, cut
        s = tls_socket(port, OPT_HOST, source=source)
        s.sendall(request_bytes("POST", "/mcp", OPT_HOST, body=mcp)[:-5000])
        time.sleep(0.05)
        end(s)
        s = tls_socket(port, OPT_HOST, source=source)  # gone before the answer
        s.sendall(request_bytes("GET", "/stream?n=3&interval=0.5", OPT_HOST))
        end(s)
        s = tls_socket(port, OPT_HOST, source=source)  # mid-response: SSE
        s.sendall(request_bytes("GET", "/stream?n=20&interval=0.05", OPT_HOST))
        read_response(s, head_only=True)
        end(s)
        s = tls_socket(port, OPT_HOST, source=source, rcvbuf=4096)  # mid-response: large
        s.sendall(request_bytes("GET", "/big?bytes=4000000", OPT_HOST))
        read_response(s, head_only=True)
        s.recv(1000)
        end(s)
        s = tls_socket(port, OPT_HOST, source=source)  # pipelined, the last one cut
        s.sendall(b"".join(request_bytes("GET", f"/pipe{i}", OPT_HOST) for i in range(4))
                  + request_bytes("POST", "/pipe-cut", OPT_HOST, body=UPLOAD,
                                  content_type="application/octet-stream")[:-100])
        time.sleep(0.1)
        end(s)
    for how in ("goaway", "rst"):  # HTTP/2: a cut upload, a reset storm, a large answer
        h = H2Conn(port, OPT_HOST, source=source)
        h.open_stream("POST", "/h2-cut", length=100_000, first=b"d" * 16_000)
        nocl = h.conn.get_next_available_stream_id()
        h.conn.send_headers(nocl, h2_headers("POST", "/h2-cut-chunked"))
        h.conn.send_data(nocl, b"e" * 16_000)
        for _ in range(20):
            sid = h.conn.get_next_available_stream_id()
            h.conn.send_headers(sid, h2_headers("GET", "/stream?n=20&interval=0.05"),
                                end_stream=True)
            h.conn.reset_stream(sid)
        big = h.conn.get_next_available_stream_id()
        h.conn.send_headers(big, h2_headers("GET", "/big?bytes=3000000"), end_stream=True)
        h.sock.sendall(h.conn.data_to_send())
        time.sleep(0.1)
        h.conn.reset_stream(nocl)  # one upload ends by RST_STREAM, one with the connection
        h.sock.sendall(h.conn.data_to_send())
        time.sleep(0.05)
        if how == "rst":
            reset(h.sock)
        else:
            h.close()


def node_breaks_mid_response(env: ServeEnv, source: str) -> None:
    """The node dies while it writes an answer: HTTP/1.1 and HTTP/2 clients must see a
    break (a dropped connection, RST_STREAM), never a short body that ends cleanly."""
    port = env.serve.port

    def break_node() -> None:
        # the node's TLS sockets live in this process: shutting them down is the node's
        # kernel cutting its connections under the writer
        for obj in gc.get_objects():
            if isinstance(obj, ssl.SSLSocket) and obj.server_side and obj.fileno() != -1:
                try:
                    obj.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    s = tls_socket(port, OPT_HOST, source=source)
    s.sendall(request_bytes("GET", "/stream?n=200&interval=0.05", OPT_HOST))
    assert read_response(s, head_only=True).status == 200
    break_node()
    s.settimeout(WAIT)
    tail = b""
    try:
        while data := s.recv(65536):
            tail = (tail + data)[-16:]
    except (OSError, ssl.SSLError):
        pass
    assert not tail.endswith(b"0\r\n\r\n"), "a broken answer ended like a whole one"
    forget(s)
    h = H2Conn(port, OPT_HOST, source=source)
    try:
        sid = h.conn.get_next_available_stream_id()
        h._results[sid] = H2Result(None, [], b"")
        h.conn.send_headers(sid, h2_headers("GET", "/stream?n=200&interval=0.05"),
                            end_stream=True)
        h.sock.sendall(h.conn.data_to_send())
        h._pump(until=lambda: bool(h._results[sid].body), timeout=WAIT)
        break_node()
        result = h.wait(sid)
        assert result.status == 200 and (result.reset or result.goaway), result
    finally:
        h.close()


@pytest.fixture(params=[1, 2], ids=["one-process", "two-workers"])
def env(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ServeEnv]:
    echo = EchoBackend()
    try:
        e = ServeEnv.start(tmp_path, workers=request.param, limits={
            "max_connections_per_ip": PER_IP, "max_requests_in_flight_per_ip": IN_FLIGHT},
            extra_routes=f"      - {{host: {PT_HOST}, mode: passthrough, "
                         f"backend: \"{LOOPBACK}:{echo.port}\"}}\n")
        yield e
        e.stop()
    finally:
        echo.stop()


def test_hostile_workload_leaves_every_count_as_the_truth(env: ServeEnv) -> None:
    serve, node = env.serve, env.node
    port = serve.port
    for ip in SOURCES:  # warm: each worker has its pool, its children, its counters
        assert exchange(port, request_bytes("GET", "/warm", OPT_HOST), host=OPT_HOST,
                        source=ip).status == 200
    eventually(lambda: serve.open_connections() == 0, "idle before")
    fds_before = serve.open_fds()

    for ip in SOURCES:
        hostile(port, ip)
    node_breaks_mid_response(env, SOURCES[0])
    assert exchange(port, request_bytes("GET", "/after", OPT_HOST), host=OPT_HOST,
                    source=SOURCES[1]).status == 200

    # settled: nothing open anywhere, by every account
    def settled() -> bool:
        status, text = serve.status(), serve.metrics()
        return (status["counters"]["open_connections"] == 0
                and all(w["open_connections"] == 0 for w in status.get("workers", []))
                and summed(text, "pact_ingress_open_connections") == 0
                and summed(text, "pact_ingress_worker_open_connections") == 0
                and node.active_streams == 0)
    eventually(settled, "open connections back to 0 in /status and /metrics")
    # the node's pooled connections are what the edge keeps, not one per aborted request
    eventually(lambda: serve.open_fds() <= fds_before + 8,
               f"fds back near {fds_before} (now {serve.open_fds()})")
    with node._lock:
        assert len(node._socks) <= 2 * len(SOURCES), len(node._socks)

    # the node never took an aborted upload as whole, nor a buffered MCP body at all
    for r in node.requests():
        if "cut" in r.target or r.target.startswith("/up"):
            assert not r.complete, (r.target, len(r.body))
        assert r.path != "/mcp", "a cut MCP body reached the node"

    # per-IP caps exact: N connections allowed, the N+1th refused; N requests in flight
    for ip in SOURCES:
        held = [tls_socket(port, OPT_HOST, source=ip) for _ in range(PER_IP)]
        try:
            for s in held:
                s.sendall(request_bytes("GET", "/stream?n=2&interval=0.2", OPT_HOST))
            assert [read_response(s, head_only=True).status for s in held] == [200] * PER_IP
            with pytest.raises((OSError, ssl.SSLError)):
                extra = tls_socket(port, OPT_HOST, source=ip, timeout=5)
                try:
                    extra.sendall(request_bytes("GET", "/x", OPT_HOST))
                    read_response(extra)
                finally:
                    forget(extra)
        finally:
            for s in held:
                forget(s)
        eventually(lambda: serve.open_connections() == 0, "caps probe closed")
        h = H2Conn(port, OPT_HOST, source=ip)
        try:
            sids = []
            for _ in range(IN_FLIGHT + 1):
                sid = h.conn.get_next_available_stream_id()
                h._results[sid] = H2Result(None, [], b"")
                h.conn.send_headers(sid, h2_headers("GET", "/stream?n=2&interval=0.2"),
                                    end_stream=True)
                h.sock.sendall(h.conn.data_to_send())
                if len(sids) < IN_FLIGHT:  # each in flight before the next is asked
                    h._pump(until=lambda s=sid, c=h: c._results[s].status is not None,
                            timeout=WAIT)
                sids.append(sid)
            statuses = sorted(h.wait(sid).status or 0 for sid in sids)
            assert statuses == [200] * IN_FLIGHT + [429], (ip, statuses)
        finally:
            h.close()
    eventually(settled, "open connections back to 0 after the probes")

    # the same numbers in /status, /metrics and the log lines (access lines are written
    # in batches: waited for, boundedly)
    total = summed(serve.metrics(), "pact_ingress_http_requests_total")
    eventually(lambda: sum(e.get("event") == "request" for e in serve.log_events()) >= total,
               f"{total} access lines")
    status, text = serve.status(), serve.metrics()
    events = serve.log_events()
    logged = collections.Counter(str(e["status"]) for e in events if e.get("event") == "request")
    counted = {dict(ls)["status"]: v for (n, ls), v in samples(text).items()
               if n == "pact_ingress_http_requests_total"}
    assert {k: float(v) for k, v in logged.items()} == {k: v for k, v in counted.items() if v}
    assert status["counters"]["http_requests_total"] == sum(logged.values())
    if "workers" in status:
        assert sum(w["requests"] for w in status["workers"]) == sum(logged.values())
    rejected = collections.Counter(e["reason"] for e in events
                                   if e.get("event") == "conn_rejected")
    by_reason = {dict(ls)["reason"]: v for (n, ls), v in samples(text).items()
                 if n == "pact_ingress_rejections_total"}
    assert {k: float(v) for k, v in rejected.items()} == {k: v for k, v in by_reason.items() if v}
    assert status["counters"]["rejections_total"] == sum(rejected.values())
    closed = collections.Counter((e["route"], e["outcome"]) for e in events
                                 if e.get("event") == "conn_close")
    conns = {(dict(ls)["route"], dict(ls)["outcome"]): v for (n, ls), v in samples(text).items()
             if n == "pact_ingress_connections_total"}
    assert {k: float(v) for k, v in closed.items()} == {k: v for k, v in conns.items() if v}
    assert sum(n for (route, _), n in closed.items() if route == PT_HOST) == 2 * len(SOURCES)
    assert rejected["max_connections_per_ip"] == len(SOURCES)  # one refusal per probe
    # no exchange ended in an internal error (its request would go uncounted)
    assert [e for e in events if e.get("event") in (
        "terminate_connection_error", "h2_stream_error")] == []
    # every request that reached the node is counted, whoever left first
    reached = collections.Counter(r.path for r in node.requests())
    paths = collections.Counter(e["path"] for e in events if e.get("event") == "request")
    assert {p: n for p, n in reached.items() if paths[p] < n} == {}, paths


def test_a_node_breaking_mid_answer_is_counted_as_the_nodes_failure(tmp_path: Path) -> None:
    """The client stayed; the node broke. The count and the log line say 502 (the node's
    failure), not 499 (a client that left), on HTTP/1.1 and HTTP/2 alike."""
    env = ServeEnv.start(tmp_path, workers=1)
    try:
        node_breaks_mid_response(env, SOURCES[0])
        eventually(lambda: env.serve.open_connections() == 0, "closed")

        def logged() -> list[int]:
            return [e["status"] for e in env.serve.log_events()
                    if e.get("event") == "request" and e.get("path") == "/stream"]
        eventually(lambda: len(logged()) >= 2, "both requests logged")
        assert logged() == [502, 502], logged()
        text = env.serve.metrics()
        assert summed(text, "pact_ingress_http_requests_total", status="502") == 2
        assert summed(text, "pact_ingress_http_requests_total", status="499") == 0
    finally:
        env.stop()
