"""Attacks on `serve --workers 2` from outside: handoff races, stuck handshakes in a worker,
killed workers, cheap h2 frame floods through a worker, hostile paths in the access log.

Real `serve`, real TLS on loopback; sources 127.0.0.2…9 reach both workers
(`proto.workers.worker_for`). Every loop is bounded in count and every wait in time;
the asserts are invariants (counts back to zero, fds back to the baseline, bystanders
served, every log line one JSON object), never timings.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import ssl
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import h2.config
import h2.connection
import h2.events
import hpack
import pytest

from tests.terminate_env import (
    HOST,
    LOOPBACK,
    OPT_HOST,
    WAIT,
    Identities,
    RecordingNode,
    Serve,
    client_context,
    make_identities,
    read_response,
    request_bytes,
    tls_socket,
    unsealed_call_body,
)
from tests.test_workers import by_worker, counter_total, poll, worker_pids

SOURCES = [f"127.0.0.{i}" for i in range(2, 10)]


@pytest.fixture
def ids(tmp_path: Path) -> Identities:
    return make_identities(tmp_path)


@pytest.fixture
def node(ids: Identities) -> Iterator[RecordingNode]:
    n = RecordingNode(ids.node, client_ca=ids.ingress)
    yield n
    n.stop()


def client_hello() -> bytes:
    """The bytes of a real ClientHello for HOST (a client that then goes away)."""
    inc, out = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = client_context().wrap_bio(inc, out, server_hostname=HOST)
    with pytest.raises(ssl.SSLWantReadError):
        obj.do_handshake()
    return out.read()


def raw_from(port: int, source: str) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.settimeout(WAIT)
    sock.bind((source, 0))
    sock.connect((LOOPBACK, port))
    return sock


def reset(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def get_status(serve: Serve, source: str) -> int:
    sock = tls_socket(serve.port, source=source)
    try:
        sock.sendall(request_bytes("GET", "/bystander"))
        return read_response(sock).status
    finally:
        sock.close()


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def fds_back(serve: Serve, before: dict[int, int]) -> dict[int, int]:
    """Poll (bounded) until no process holds more fds than at `before`; the last counts."""
    def now() -> dict[int, int]:
        return {pid: fds(pid) for pid in before}
    deadline = time.monotonic() + WAIT
    seen = now()
    while any(seen[p] > before[p] for p in before) and time.monotonic() < deadline:
        time.sleep(0.2)
        seen = now()
    return seen


def test_resets_right_after_the_clienthello_leave_every_process_as_it_was(
        tmp_path: Path, ids: Identities, node: RecordingNode) -> None:
    """The handoff to a worker races the client's RST: nothing leaks in main or workers."""
    serve = Serve(tmp_path, node, ids.node.fingerprint, workers=2)
    try:
        for ip in SOURCES:  # every bucket warmed once, so the baseline is the steady state
            assert get_status(serve, ip) == 200
        assert serve.wait_open_connections(0) == 0
        before = {pid: fds(pid) for pid in serve.pids()}
        hello = client_hello()
        for i in range(240):
            sock = raw_from(serve.port, SOURCES[i % len(SOURCES)])
            if i % 3:
                sock.sendall(hello if i % 3 == 1 else hello[: len(hello) // 2])
            reset(sock)
        assert serve.wait_open_connections(0) == 0
        after = fds_back(serve, before)
        assert after == {p: min(after[p], before[p]) for p in before}, (before, after)
        assert serve.alive() and sorted(serve.pids()) == sorted(before)
        for ip in SOURCES:
            assert get_status(serve, ip) == 200
    finally:
        serve.stop()


def test_handshakes_stuck_in_a_worker_still_count_against_the_ip_cap(
        tmp_path: Path, ids: Identities, node: RecordingNode) -> None:
    """Connections handed to a worker that never finish TLS are held against their IP by
    main (the cap is exact), and another IP of the same worker is served meanwhile."""
    cap = 5
    # the handshake deadline far beyond the test, so a slow machine cannot end the stuck
    # handshakes before the count is read
    serve = Serve(tmp_path, node, ids.node.fingerprint, workers=2,
                  limits={"max_connections_per_ip": cap, "clienthello_timeout": "120s"})
    groups = by_worker()
    attacker, = groups[0][:1]
    bystander = next(ip for ip in groups[0] if ip != attacker)
    held: list[socket.socket] = []
    try:
        hello = client_hello()
        for _ in range(cap * 3):
            sock = raw_from(serve.port, attacker)
            sock.sendall(hello)
            held.append(sock)
        poll(lambda: serve.open_connections() == cap, f"{cap} open connections")
        assert get_status(serve, bystander) == 200
        # still exactly the cap, not more: the refused ones were closed, the rest hold
        # (the bystander's own connection leaves main's count once its worker reports
        # it closed, a moment after the client has its answer)
        assert serve.wait_open_connections(cap) == cap
        for sock in held:
            reset(sock)
        held.clear()
        assert serve.wait_open_connections(0) == 0
        assert get_status(serve, attacker) == 200
    finally:
        for sock in held:
            sock.close()
        serve.stop()


def test_killed_workers_holding_connections_release_main(
        tmp_path: Path, ids: Identities, node: RecordingNode) -> None:
    """kill -9 of both workers while they hold connections: main's counts return to zero
    while the clients still hold their sockets,
    fresh workers serve every bucket, and main's fds do not grow from one kill to the next
    (the first respawn may open its own things once, so the baseline is taken after it)."""
    serve = Serve(tmp_path, node, ids.node.fingerprint, workers=2)
    held: list[socket.socket] = []
    try:
        groups = by_worker()
        baseline = 0
        for round_ in range(2):
            for ip in SOURCES:
                assert get_status(serve, ip) == 200
            assert serve.wait_open_connections(0) == 0
            old = worker_pids(serve)
            for i in range(24):
                source = groups[i % 2][i % len(groups[i % 2])]
                held.append(tls_socket(serve.port, source=source))
            # all 24 held by the workers (not by main while a worker was still starting)
            poll(lambda: serve.open_connections() == 24 and sum(
                w["open_connections"] for w in serve.status()["workers"]) == 24,
                "24 connections held by the workers")
            for pid in old.values():
                os.kill(pid, signal.SIGKILL)
            poll(lambda: set(worker_pids(serve).values()).isdisjoint(old.values())  # noqa: B023
                 and [w["state"] for w in serve.status()["workers"]] == ["ready", "ready"],
                 "both workers replaced and ready")
            assert serve.wait_open_connections(0) == 0
            for sock in held:
                sock.close()
            held.clear()
            for ip in SOURCES:
                assert get_status(serve, ip) == 200
            assert serve.wait_open_connections(0) == 0
            if round_ == 0:
                time.sleep(0.5)
                baseline = fds(serve.proc.pid)
            else:
                poll(lambda: fds(serve.proc.pid) <= baseline, "main's fds back to the baseline")
        assert serve.alive()
    finally:
        for sock in held:
            sock.close()
        serve.stop()


def _frame(kind: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + sid.to_bytes(4, "big") \
        + payload


def _goaway_codes(data: bytes) -> list[int]:
    codes, i = [], 0
    while i + 9 <= len(data):
        length = int.from_bytes(data[i:i + 3], "big")
        if data[i + 3] == 7 and i + 17 <= len(data):
            codes.append(int.from_bytes(data[i + 13:i + 17], "big"))
        i += 9 + length
    return codes


PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + _frame(4, 0, 0)


def _post_headers() -> bytes:
    return hpack.Encoder().encode([(":method", "POST"), (":scheme", "https"),
                                   (":authority", HOST), (":path", "/mcp"),
                                   ("content-type", "application/json")])


FLOODS = {
    "settings": PREFACE + b"".join(_frame(4, 0, 0, b"\x00\x03\x00\x00\x00\x64")
                                   for _ in range(5000)),
    "empty_data": PREFACE + _frame(1, 4, 1, _post_headers())
    + b"".join(_frame(0, 0, 1) for _ in range(5000)),
    "priority": PREFACE + b"".join(_frame(2, 0, 1 + 2 * i, b"\x00\x00\x00\x00\x10")
                                   for i in range(5000)),
}


@pytest.mark.parametrize("kind", sorted(FLOODS))
def test_h2_floods_through_a_worker_are_calmed_and_counted(
        tmp_path: Path, ids: Identities, node: RecordingNode, kind: str) -> None:
    serve = Serve(tmp_path, node, ids.node.fingerprint, workers=2)
    try:
        groups = by_worker()
        for w in (0, 1):
            sock = tls_socket(serve.port, source=groups[w][0], alpn=("h2",))
            with contextlib.suppress(OSError):
                sock.sendall(FLOODS[kind])
            got, deadline = b"", time.monotonic() + WAIT
            try:
                while time.monotonic() < deadline:
                    data = sock.recv(65536)
                    if not data:
                        break
                    got += data
            except OSError:
                pass
            finally:
                sock.close()
            assert 11 in _goaway_codes(got), (kind, w, _goaway_codes(got))  # ENHANCE_YOUR_CALM
        poll(lambda: counter_total(serve.metrics(), "pact_ingress_h2_floods") >= 2,
             "both workers' floods summed in /metrics")
        assert serve.wait_open_connections(0) == 0
        assert get_status(serve, groups[0][0]) == 200 and get_status(serve, groups[1][0]) == 200
    finally:
        serve.stop()


HOSTILE_PATHS = [b'/q"uote', b"/back\\slash", b"/%0a%0d%00%22", b"/\x01ctl", b"/\x7fdel",
                 b"/\xff\xfe\xc3(", b"/\xe2\x80\xa8sep", b"/a b"]


def test_hostile_paths_keep_the_log_one_json_object_per_line(
        tmp_path: Path, ids: Identities, node: RecordingNode) -> None:
    """Quotes, backslashes, control bytes, non-UTF-8 and line separators in the target,
    over HTTP/1.1 and h2, through both workers: every byte of the log parses as lines of
    one JSON object each, and the refused targets never reach the node."""
    serve = Serve(tmp_path, node, ids.node.fingerprint, workers=2)
    try:
        groups = by_worker()
        for path in HOSTILE_PATHS:
            for w in (0, 1):
                sock = tls_socket(serve.port, source=groups[w][0])
                try:
                    sock.sendall(b"GET " + path + b" HTTP/1.1\r\nHost: " + HOST.encode()
                                 + b"\r\n\r\n")
                    read_response(sock)
                finally:
                    sock.close()
                sock = tls_socket(serve.port, source=groups[w][0], alpn=("h2",))
                headers = hpack.Encoder().encode([(b":method", b"GET"), (b":scheme", b"https"),
                                                  (b":authority", HOST.encode()),
                                                  (b":path", path)])
                try:
                    sock.sendall(PREFACE + _frame(1, 5, 1, headers))
                    sock.settimeout(WAIT)
                    got = b""
                    while not got:  # an answer or a reset, then we go
                        got = sock.recv(65536)
                finally:
                    sock.close()
        assert serve.wait_open_connections(0) == 0
        serve.proc.send_signal(signal.SIGTERM)  # flushes the access buffers of all
        assert serve.proc.wait(WAIT) == 0
    finally:
        serve.stop()
    raw = serve.log_path.read_bytes()
    assert raw.endswith(b"\n")
    requests = 0
    for line in raw.split(b"\n")[:-1]:
        doc = json.loads(line.decode("utf-8"))  # strict UTF-8, one object per line
        assert isinstance(doc, dict) and "event" in doc, line
        requests += doc["event"] == "request"
    assert requests >= 2  # at least the %-encoded one was logged by each worker
    for request in node.requests():
        assert not any(c in request.path for c in '"\\\x01\x7f \n\r'), request.path


def test_sigterm_during_h2_uploads_in_both_workers_finishes_them(
        tmp_path: Path, ids: Identities, node: RecordingNode) -> None:
    """A drain that begins while h2 uploads are half sent (one per worker): each upload
    still completes and is answered, the node got each body whole, and all exit 0."""
    serve = Serve(tmp_path, node, ids.node.fingerprint, workers=2)
    body = unsealed_call_body("d" * 20000)
    conns: list[tuple[socket.socket, h2.connection.H2Connection]] = []
    try:
        groups = by_worker()
        for w in (0, 1):
            sock = tls_socket(serve.port, host=OPT_HOST, source=groups[w][0], alpn=("h2",))
            conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
            conn.initiate_connection()
            conn.send_headers(1, [(":method", "POST"), (":scheme", "https"),
                                  (":authority", OPT_HOST), (":path", "/mcp"),
                                  ("content-type", "application/json"),
                                  ("accept", "application/json, text/event-stream"),
                                  ("content-length", str(len(body)))])
            conn.send_data(1, body[:1000])
            sock.sendall(conn.data_to_send())
            conns.append((sock, conn))
        poll(lambda: sum(w["open_connections"] for w in serve.status()["workers"]) == 2,
             "both uploads held by the workers")
        serve.proc.send_signal(signal.SIGTERM)
        poll(lambda: any(e.get("event") == "worker_draining" for e in serve.log_events()),
             "the drain reached a worker")
        statuses = []
        for sock, conn in conns:
            rest = body[1000:]
            while rest:
                conn.send_data(1, rest[:16000], end_stream=len(rest) <= 16000)
                rest = rest[16000:]
            sock.sendall(conn.data_to_send())
            sock.settimeout(WAIT)
            status, ended = None, False
            for _ in range(1000):  # bounded: frames, not time
                data = sock.recv(65536)
                if not data:
                    break
                for event in conn.receive_data(data):
                    if isinstance(event, h2.events.ResponseReceived):
                        status = dict(event.headers).get(b":status")
                    ended = ended or isinstance(event, (h2.events.StreamEnded,
                                                        h2.events.StreamReset))
                sock.sendall(conn.data_to_send())
                if ended:
                    break
            statuses.append(status)
        assert statuses == [b"200", b"200"]
        assert serve.proc.wait(WAIT) == 0
        bodies = [r.body for r in node.requests() if r.path == "/mcp"]
        assert bodies == [body, body]
    finally:
        for sock, _ in conns:
            sock.close()
        serve.stop()


def test_a_worker_that_stops_reading_through_a_reload_costs_its_bucket_nothing(
        tmp_path: Path, ids: Identities, node: RecordingNode) -> None:
    """A worker that stops reading its channel (SIGSTOP) while handoffs fill it, then a
    reload: several tasks wait on the full channel at once (handoffs, the config's rest,
    the stats question). /status still answers, a fresh client of that worker's bucket is
    served (by main), and after SIGCONT everything returns to zero."""
    serve = Serve(tmp_path, node, ids.node.fingerprint, workers=2)
    groups = by_worker()
    stuffers, bystander = groups[0][:-1], groups[0][-1]
    held: list[socket.socket] = []
    pid0 = worker_pids(serve)[0]
    os.kill(pid0, signal.SIGSTOP)
    try:
        hello = client_hello()
        for i in range(240):
            sock = raw_from(serve.port, stuffers[i % len(stuffers)])
            sock.sendall(hello)
            held.append(sock)
        serve.extra_routes = "".join(f"""\
      - host: r{i}.attack.test
        mode: terminate
        backend: "{LOOPBACK}:{node.port}"
        seal: optional
        mcp_path: /mcp
        cert: {{cert: certs/r{i}.crt, key: certs/r{i}.key}}
""" for i in range(60))  # a config too big for the channel's free space
        assert serve.reload() == "reloaded"
        assert serve.status()["workers"]
        assert get_status(serve, bystander) == 200
        assert serve.alive()
    finally:
        os.kill(pid0, signal.SIGCONT)
        for sock in held:
            reset(sock)
        held.clear()
    try:
        assert serve.wait_open_connections(0) == 0
        for ip in SOURCES:
            assert get_status(serve, ip) == 200
        assert not any(e.get("event") == "admin_status_failed" for e in serve.log_events())
    finally:
        serve.stop()
