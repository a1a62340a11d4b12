"""Hostile clients against terminate connections started in the keep-alive lane with
no task of their own, and against the hub's repeated looks at its epoll set: real
`pact-ingress serve` processes (one worker, and two) over loopback. Each test asserts
the invariants, not one example: the count of open connections returns to 0, a fresh
client is served, no line of the log says a connection's handling failed, and SIGTERM
ends the process with 0."""

from __future__ import annotations

import contextlib
import json
import socket
import ssl
import struct
import threading
import time
from pathlib import Path

import pytest

from tests.terminate_env import (
    OPT_HOST,
    H2Conn,
    ServeEnv,
    client_context,
    closed_by_peer,
    forget,
    read_response,
    request_bytes,
    tarpit_route,
    tls_socket,
)
from tests.test_lane_attacks import EVIL_HOST, HostileNode

LIMITS = {"calls_per_hour_per_ip": 100_000_000, "calls_per_hour_per_ip_key": 100_000_000,
          "max_connections_per_ip": 5000, "max_requests_in_flight_per_ip": 1000}
HANG = 15.0
BAD = ("Traceback", "lane_error", "handler_error", "terminate_connection_error",
       "worker_error", "unhandled", "internal_error")


def bad_lines(env: ServeEnv) -> list[str]:
    return [ln for ln in env.serve.logs().splitlines() if any(b in ln for b in BAD)]


def reset(s: socket.socket) -> None:
    with contextlib.suppress(OSError):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    forget(s)


def echoed(body: bytes) -> dict[str, object]:
    return dict(json.loads(body))


def fresh_client_served(env: ServeEnv, host: str = OPT_HOST) -> None:
    s = tls_socket(env.serve.port, host, timeout=HANG)
    try:
        s.sendall(request_bytes("GET", "/fresh", host))
        resp = read_response(s)
        assert resp.status == 200, (resp.status, resp.body)
        assert echoed(resp.body)["target"] == "/fresh"
    finally:
        forget(s)


def settled_then_stopped(env: ServeEnv) -> None:
    """The invariants each test ends on: nothing left open, a fresh client served, no
    failure in the log, and SIGTERM ends the process with 0 (nothing failing then)."""
    assert env.serve.wait_open_connections(0) == 0
    fresh_client_served(env)
    assert env.serve.alive()
    assert bad_lines(env) == [], bad_lines(env)
    env.serve.proc.send_signal(15)
    assert env.serve.proc.wait(timeout=40) == 0
    assert bad_lines(env) == [], bad_lines(env)


def hello_only(port: int, host: str) -> socket.socket:
    raw = socket.create_connection(("127.0.0.1", port), timeout=HANG)
    inc, out = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = client_context().wrap_bio(inc, out, server_hostname=host)
    with contextlib.suppress(ssl.SSLWantReadError):
        obj.do_handshake()
    raw.sendall(out.read())
    return raw


def world(tmp: Path, workers: int = 1, extra: str = "") -> tuple[ServeEnv, HostileNode]:
    evil = socket.create_server(("127.0.0.1", 0), backlog=512)
    routes = tarpit_route(EVIL_HOST, evil.getsockname()[1]) + extra
    env = ServeEnv.start(tmp, workers=workers, limits=LIMITS, extra_routes=routes)
    return env, HostileNode(evil, str(env.ids.node.cert_path), str(env.ids.node.key_path))


def parallel(fns: list, timeout: float = 40.0) -> list[BaseException]:
    errs: list[BaseException] = []
    lock = threading.Lock()

    def run(fn):
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001
            with lock:
                errs.append(exc)

    ts = [threading.Thread(target=run, args=(f,), daemon=True) for f in fns]
    for t in ts:
        t.start()
    deadline = time.monotonic() + timeout
    for t in ts:
        t.join(max(0.1, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in ts), "threads hung"
    return errs


@pytest.mark.parametrize("workers", [1, 2])
def test_a_mass_reset_in_every_phase_leaves_nothing_open(
        tmp_path: Path, workers: int) -> None:
    env = ServeEnv.start(tmp_path, workers=workers, limits=LIMITS)
    try:
        port = env.serve.port
        socks: list[socket.socket] = []
        for i in range(150):
            s = tls_socket(port, OPT_HOST, timeout=HANG)
            kind = i % 5
            if kind == 1:  # between requests
                s.sendall(request_bytes("GET", f"/b/{i}", OPT_HOST))
                assert read_response(s).status == 200
            elif kind == 2:  # mid-request: head partial
                s.sendall(request_bytes("POST", f"/m/{i}", OPT_HOST, body=b"z" * 500,
                                        content_type="text/plain")[:40])
            elif kind == 3:  # mid-request: body partial
                s.sendall(request_bytes("POST", f"/m/{i}", OPT_HOST, body=b"z" * 5000,
                                        content_type="text/plain")[:-2000])
            elif kind == 4:  # request sent, answer unread
                s.sendall(request_bytes("GET", f"/big?bytes=300000&i={i}", OPT_HOST))
            socks.append(s)
        time.sleep(0.3)
        for s in socks:
            reset(s)
        settled_then_stopped(env)
    finally:
        env.stop()


@pytest.mark.parametrize("workers", [1, 2])
def test_sigterm_answers_requests_at_the_node_and_closes_the_rest(
        tmp_path: Path, workers: int) -> None:
    env, evil = world(tmp_path, workers)
    try:
        port = env.serve.port
        hellos = [hello_only(port, OPT_HOST) for _ in range(20)]
        idle = []
        for i in range(20):  # task-less idle keep-alive connections
            s = tls_socket(port, OPT_HOST, timeout=HANG)
            s.sendall(request_bytes("GET", f"/idle/{i}", OPT_HOST))
            assert read_response(s).status == 200
            idle.append(s)
        partial_heads = []
        for i in range(10):
            s = tls_socket(port, OPT_HOST, timeout=HANG)
            s.sendall(b"GET /part HTTP/1.1\r\nHost: " + OPT_HOST.encode())
            partial_heads.append(s)
        busy = []
        for i in range(10):
            s = tls_socket(port, EVIL_HOST, timeout=HANG)
            s.sendall(request_bytes("GET", f"/slow?s=1.5&k={i}", EVIL_HOST))
            busy.append(s)
        assert env.node.wait_for(lambda: len(evil.seen) >= 10)
        time.sleep(0.2)
        env.serve.proc.send_signal(15)
        for k, s in enumerate(busy):
            resp = read_response(s)
            assert resp.status == 200
            assert echoed(resp.body)["target"] == f"/slow?s=1.5&k={k}"
        for s in idle:
            assert closed_by_peer(s, timeout=HANG)
        rc = env.serve.proc.wait(timeout=45)
        logs = env.serve.logs()
        assert rc == 0, logs[-3000:]
        assert bad_lines(env) == [], bad_lines(env)
        for s in hellos + idle + partial_heads + busy:
            forget(s)
    finally:
        evil.stop()
        env.stop()


DEAD_HOST = "dead.attack.test"


@pytest.mark.parametrize("workers", [1, 2])
def test_clients_resetting_while_the_node_refuses_hangs_or_is_slow(
        tmp_path: Path, workers: int) -> None:
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    dead_port = dead.getsockname()[1]
    dead.close()  # nothing listens: connection refused
    env, evil = world(tmp_path, workers, extra=tarpit_route(DEAD_HOST, dead_port))
    try:
        port = env.serve.port
        # refused node: answered (502-ish), not hung
        for i in range(10):
            s = tls_socket(port, DEAD_HOST, timeout=HANG)
            s.sendall(request_bytes("GET", f"/dead/{i}", DEAD_HOST))
            resp = read_response(s)
            assert resp.status >= 500, resp.status
            forget(s)
        # refused node, client resets right after sending
        for i in range(40):
            s = tls_socket(port, DEAD_HOST, timeout=HANG)
            s.sendall(request_bytes("GET", f"/dead/r{i}", DEAD_HOST))
            if i % 2:
                time.sleep(0.005)
            reset(s)
        # slow node: first request needs a new node connection; resets at various points
        socks = []
        for i in range(60):
            s = tls_socket(port, EVIL_HOST, timeout=HANG)
            s.sendall(request_bytes("GET", f"/slow?s=0.5&r={i}", EVIL_HOST))
            socks.append(s)
        for i, s in enumerate(socks):
            if i % 3 == 0:
                reset(s)
        time.sleep(0.2)
        for i, s in enumerate(socks):
            if i % 3 == 1:
                reset(s)
        for i, s in enumerate(socks):
            if i % 3 == 2:
                resp = read_response(s)
                assert resp.status == 200 and echoed(resp.body)["target"] == f"/slow?s=0.5&r={i}"
                forget(s)
        # node hangs; clients reset while the lane waits for it
        hs = []
        for i in range(30):
            s = tls_socket(port, EVIL_HOST, timeout=HANG)
            s.sendall(request_bytes("GET", f"/hang?{i}", EVIL_HOST))
            hs.append(s)
        time.sleep(0.5)
        for s in hs:
            reset(s)
        assert env.serve.wait_open_connections(0) == 0
        fresh_client_served(env)
        s = tls_socket(port, EVIL_HOST, timeout=HANG)
        s.sendall(request_bytes("GET", "/after", EVIL_HOST))
        assert echoed(read_response(s).body)["target"] == "/after"
        forget(s)
        settled_then_stopped(env)
    finally:
        evil.stop()
        env.stop()


@pytest.mark.parametrize("workers", [1, 2])
def test_bursts_of_http2_and_pipelined_http1_on_one_route(
        tmp_path: Path, workers: int) -> None:
    env = ServeEnv.start(tmp_path, workers=workers, limits=LIMITS)
    try:
        port = env.serve.port

        def h1(c: int) -> None:
            s = tls_socket(port, OPT_HOST, timeout=HANG)
            try:
                s.sendall(b"".join(request_bytes("GET", f"/h1/{c}/{i}", OPT_HOST)
                                   for i in range(5)))
                for i in range(5):
                    r = read_response(s)
                    assert r.status == 200 and echoed(r.body)["target"] == f"/h1/{c}/{i}"
                if c % 3 == 0:
                    reset(s)
            finally:
                forget(s)

        def h2(c: int) -> None:
            conn = H2Conn(port, OPT_HOST)
            try:
                res = conn.burst(8, f"/h2/{c}")
                for r in res:
                    assert r.status == 200 and echoed(r.body)["target"] == f"/h2/{c}", r
                r = conn.request("POST", f"/h2p/{c}", body=b"p" * 1000,
                                 content_type="text/plain")
                assert r.status == 200
            finally:
                if c % 3 == 0:
                    reset(conn.sock)
                else:
                    conn.close()

        for _round in range(3):
            fns = [(lambda c=c: h1(c)) for c in range(30)] + [(lambda c=c: h2(c))
                                                             for c in range(15)]
            errs = parallel(fns)
            assert errs == [], errs[:3]
        settled_then_stopped(env)
    finally:
        env.stop()


@pytest.mark.parametrize("workers", [1, 2])
def test_aborted_pipelines_and_half_closes(
        tmp_path: Path, workers: int) -> None:
    env, evil = world(tmp_path, workers)
    try:
        port = env.serve.port
        # pipelines aborted at various points
        for n in (2, 10, 100, 600):
            for host in (OPT_HOST, EVIL_HOST):
                s = tls_socket(port, host, timeout=HANG)
                s.sendall(b"".join(request_bytes("GET", f"/p/{i}", host) for i in range(n)))
                read_response(s)
                reset(s)
        # a pipeline with a slow first answer, aborted
        for _ in range(5):
            s = tls_socket(port, EVIL_HOST, timeout=HANG)
            s.sendall(request_bytes("GET", "/slow?s=0.3", EVIL_HOST)
                      + b"".join(request_bytes("GET", f"/q/{i}", EVIL_HOST) for i in range(50)))
            time.sleep(0.05)
            reset(s)
        # half-close after a request: answered, then closed
        for host, target in ((OPT_HOST, "/hc"), (EVIL_HOST, "/slow?s=0.3"),
                             (OPT_HOST, "/big?bytes=200000"), (EVIL_HOST, "/hc2")):
            for pipe in (1, 3):
                s = tls_socket(port, host, timeout=HANG)
                s.sendall(b"".join(request_bytes("GET", target, host) for _ in range(pipe)))
                socket.socket.shutdown(s, socket.SHUT_WR)
                for _ in range(pipe):
                    r = read_response(s)
                    assert r.status == 200, (host, target, r.status)
                assert closed_by_peer(s, timeout=HANG), (host, target)
                forget(s)
        # half-close with no request at all, and after a partial head
        for data in (b"", b"GET /x HTTP/1.1\r\nHo"):
            s = tls_socket(port, OPT_HOST, timeout=HANG)
            if data:
                s.sendall(data)
            socket.socket.shutdown(s, socket.SHUT_WR)
            # (a 400 "closed mid-request" or a bare close: both seen, timing-dependent)
            with contextlib.suppress(ConnectionError, ssl.SSLError):
                r = read_response(s)
                assert r.status == 400 and data, (data, r.status)
            assert closed_by_peer(s, timeout=HANG)
            forget(s)
        settled_then_stopped(env)
    finally:
        evil.stop()
        env.stop()
