"""The keep-alive lane (`net/h1_lane.py`) against a real `pact-ingress serve`: what it
serves itself, and every point where it hands a connection to the trio engine.

Each test reads `pact_ingress_terminate_lane_total` before and after, so it knows which
path answered: a test of a hand-off that the lane happened to serve itself (or the other
way round) fails instead of passing by the wrong road. The node echoes each request's
target and the SHA-256 of its body, so every answer is checked to be its own request's.

Every socket is loopback, every wait bounded; nothing asserts on timing.
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.terminate_env import (
    BYSTANDER_IP,
    HOST,
    OPT_HOST,
    H2Conn,
    ServeEnv,
    closed_by_peer,
    forget,
    read_response,
    refusal_code,
    request_bytes,
    tls_socket,
    unsealed_call_body,
)

LIMITS = {"calls_per_hour_per_ip": 100_000_000, "calls_per_hour_per_ip_key": 100_000_000,
          "max_connections_per_ip": 5000, "max_requests_in_flight_per_ip": 4}
HANG = 10.0
_LANE = re.compile(r'^pact_ingress_terminate_lane_total\{outcome="(\w+)"\} ([0-9.e+]+)$', re.M)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeEnv]:
    env = ServeEnv.start(tmp_path_factory.mktemp("lane"), workers=1, limits=LIMITS)
    try:
        yield env
    finally:
        env.stop()


def lane_counts(env: ServeEnv) -> dict[str, float]:
    return {k: float(v) for k, v in _LANE.findall(env.serve.metrics())}


def moved(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The outcomes that changed, by how much (not `connect`: whether the pool had a
    node connection idle is the pool's business)."""
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after
            if after.get(k, 0.0) != before.get(k, 0.0) and k != "connect"}


def echoed(resp_body: bytes) -> dict[str, object]:
    return dict(json.loads(resp_body))


def test_lane_serves_sequential_and_pipelined_requests_each_its_own(
        served: ServeEnv) -> None:
    env = served.fresh()
    before = lane_counts(env)
    s = tls_socket(env.serve.port, OPT_HOST, timeout=HANG)
    try:
        for i in range(20):
            s.sendall(request_bytes("GET", f"/seq/{i}?q={i}", OPT_HOST))
            resp = read_response(s)
            assert resp.status == 200 and echoed(resp.body)["target"] == f"/seq/{i}?q={i}"
        # five requests in one write, and POSTs with bodies among them
        batch = b"".join(
            request_bytes("POST", f"/pipe/{i}", OPT_HOST, body=b"b" * i,
                          content_type="text/plain") if i % 2 else
            request_bytes("GET", f"/pipe/{i}", OPT_HOST) for i in range(5))
        s.sendall(batch)
        for i in range(5):
            resp = read_response(s)
            got = echoed(resp.body)
            assert resp.status == 200 and got["target"] == f"/pipe/{i}"
            assert got["sha256"] == hashlib.sha256(b"b" * i if i % 2 else b"").hexdigest()
    finally:
        forget(s)
    assert env.serve.wait_open_connections(0) == 0
    # every one of them served by the lane: none handed over
    assert moved(before, lane_counts(env)) == {"served": 25.0}


def test_a_head_still_arriving_goes_to_the_trio_engine_whole(served: ServeEnv) -> None:
    """START: a POST whose body comes in a later write. The trio engine serves it from
    the beginning, the body whole, then every later request of the connection."""
    env = served.fresh()
    before = lane_counts(env)
    s = tls_socket(env.serve.port, OPT_HOST, timeout=HANG)
    try:
        body = b"x" * 3000
        raw = request_bytes("POST", "/later", OPT_HOST, body=body, content_type="text/plain")
        s.sendall(raw[:-len(body)])
        time.sleep(0.2)  # the head is read alone; the lane hands over at once
        s.sendall(body)
        resp = read_response(s)
        assert resp.status == 200
        assert echoed(resp.body)["sha256"] == hashlib.sha256(body).hexdigest()
        s.sendall(request_bytes("GET", "/after", OPT_HOST))
        assert echoed(read_response(s).body)["target"] == "/after"
    finally:
        forget(s)
    assert env.serve.wait_open_connections(0) == 0
    assert moved(before, lane_counts(env)) == {"start": 1.0}


def test_expect_continue_goes_to_the_trio_engine(served: ServeEnv) -> None:
    env = served.fresh()
    before = lane_counts(env)
    s = tls_socket(env.serve.port, OPT_HOST, timeout=HANG)
    try:
        body = b"y" * 100
        s.sendall(request_bytes("POST", "/continue", OPT_HOST, body=b"",
                                content_type="text/plain", length=False,
                                headers=[("Content-Length", "100"),
                                         ("Expect", "100-continue")]))
        head = s.recv(4096)
        assert head.startswith(b"HTTP/1.1 100 Continue\r\n"), head
        s.sendall(body)
        resp = read_response(s)
        assert resp.status == 200
        assert echoed(resp.body)["sha256"] == hashlib.sha256(body).hexdigest()
    finally:
        forget(s)
    assert moved(before, lane_counts(env)) == {"start": 1.0}


def test_an_unsealed_call_is_refused_by_the_answer_handoff(served: ServeEnv) -> None:
    """ANSWER: the lane judged the seal posture and refused; nothing reached the node,
    and the connection keeps serving (in the trio engine)."""
    env = served.fresh()
    before = lane_counts(env)
    s = tls_socket(env.serve.port, HOST, timeout=HANG)
    try:
        s.sendall(request_bytes("POST", "/mcp", HOST, body=unsealed_call_body("lane")))
        resp = read_response(s)
        assert resp.status == 200 and refusal_code(resp.body) == "seal_required", resp.body
        s.sendall(request_bytes("GET", "/fine", HOST))
        assert echoed(read_response(s).body)["target"] == "/fine"
    finally:
        forget(s)
    assert env.node.unsealed_calls() == []
    assert [r.target for r in env.node.requests()] == ["/fine"]
    assert moved(before, lane_counts(env)) == {"answer": 1.0}


@pytest.mark.parametrize("target", ["/mcp/../mcp", "https://mcp.attack.test/mcp",
                                    "/MCP/../mcp/", "/%6dcp", "//mcp", "/mcp;x"])
def test_odd_spellings_of_the_mcp_target_never_pass_unsealed(served: ServeEnv,
                                                             target: str) -> None:
    """However the target is spelled, an unsealed call gets no further than the edge,
    whichever path answers it."""
    env = served.fresh()
    s = tls_socket(env.serve.port, HOST, timeout=HANG)
    try:
        s.sendall(request_bytes("POST", target, HOST, body=unsealed_call_body("odd")))
        resp = read_response(s)
        assert resp.status != 200 or refusal_code(resp.body) is not None, resp.body
    except ConnectionError:
        pass  # refused by closing is an answer too
    finally:
        forget(s)
    assert env.node.unsealed_calls() == []


@pytest.mark.parametrize("target", ["/stream?n=3&interval=0.05", "/big?bytes=300000"])
def test_a_streamed_or_large_answer_is_relayed_by_the_trio_engine(
        served: ServeEnv, target: str) -> None:
    """RELAY: the node's head came without its whole body (an event stream, or a body
    over what the lane waits for): relayed whole, and the connection serves on."""
    env = served.fresh()
    before = lane_counts(env)
    s = tls_socket(env.serve.port, OPT_HOST, timeout=HANG)
    try:
        s.sendall(request_bytes("GET", target, OPT_HOST))
        resp = read_response(s)
        assert resp.status == 200
        if target.startswith("/stream"):
            assert resp.body.count(b"data: tick") == 3
        else:
            assert resp.body == b"x" * 300000
        s.sendall(request_bytes("GET", "/next", OPT_HOST))
        assert echoed(read_response(s).body)["target"] == "/next"
    finally:
        forget(s)
    assert moved(before, lane_counts(env)) == {"relay": 1.0}
    assert env.node.wait_for(lambda: env.node.active_streams == 0)


def test_a_short_answer_whose_body_comes_apart_is_served_by_the_lane(
        served: ServeEnv) -> None:
    """The node writes head and body apart (the test node always does, except for
    /whole...): a short declared body is awaited in the lane, not relayed."""
    env = served.fresh()
    before = lane_counts(env)
    s = tls_socket(env.serve.port, OPT_HOST, timeout=HANG)
    try:
        for i in range(10):
            s.sendall(request_bytes("GET", f"/apart/{i}", OPT_HOST))
            assert echoed(read_response(s).body)["target"] == f"/apart/{i}"
    finally:
        forget(s)
    assert moved(before, lane_counts(env)) == {"served": 10.0}


def test_http2_is_handed_over_after_the_handshake(served: ServeEnv) -> None:
    env = served.fresh()
    before = lane_counts(env)
    conn = H2Conn(env.serve.port, OPT_HOST)
    try:
        body = b"z" * 5000
        got = conn.request("POST", "/h2", body=body, content_type="text/plain")
        assert got.status == 200
        assert echoed(got.body)["sha256"] == hashlib.sha256(body).hexdigest()
    finally:
        conn.close()
    assert moved(before, lane_counts(env)) == {"h2": 1.0}


def test_a_close_with_bytes_still_coming_lingers_and_the_answer_arrives(
        served: ServeEnv) -> None:
    """LINGER: the client's last request said `Connection: close` and it goes on
    sending (here 100 KB nobody will read). The answer is delivered whole (the close
    does not reset it away) and the connection ends."""
    env = served.fresh()
    before = lane_counts(env)
    s = tls_socket(env.serve.port, OPT_HOST, timeout=HANG)
    try:
        # more than the lane reads ahead (64 KiB) and less than the kernel buffers take,
        # so the write cannot block: some of it is still unread at the close
        s.sendall(request_bytes("GET", "/last", OPT_HOST, headers=[("Connection", "close")])
                  + b"A" * 100_000)
        resp = read_response(s)
        assert resp.status == 200 and echoed(resp.body)["target"] == "/last"
        assert resp.header("connection") == "close"
    finally:
        forget(s)
    assert [r.target for r in env.node.requests()] == ["/last"]
    assert env.serve.wait_open_connections(0) == 0
    assert moved(before, lane_counts(env)) == {"served": 1.0, "linger": 1.0}


def _reset(s: socket.socket) -> None:
    """Close with a TCP reset (SO_LINGER 0), as an aborting client does."""
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    forget(s)


def test_clients_that_pipeline_then_reset_leave_nothing_held(served: ServeEnv) -> None:
    """Pipelined requests, then a reset while the first is at the node, many times over
    from one address: the share of the node (4 in flight per address here) is given
    back every time, so the same address is served afterwards, and another address
    was served throughout."""
    env = served.fresh()
    port = env.serve.port
    for i in range(40):
        s = tls_socket(port, OPT_HOST, timeout=HANG)
        s.sendall(b"".join(request_bytes("GET", f"/abort/{i}/{k}", OPT_HOST)
                           for k in range(3)))
        _reset(s)
        if i % 10 == 0:
            other = tls_socket(port, OPT_HOST, source=BYSTANDER_IP, timeout=HANG)
            try:
                other.sendall(request_bytes("GET", f"/bystander/{i}", OPT_HOST))
                assert echoed(read_response(other).body)["target"] == f"/bystander/{i}"
            finally:
                forget(other)
    assert env.serve.wait_open_connections(0) == 0
    # the aborted address gets its full share again: 4 at once, all answered
    socks = [tls_socket(port, OPT_HOST, timeout=HANG) for _ in range(4)]
    try:
        for k, s in enumerate(socks):
            s.sendall(request_bytes("GET", f"/again/{k}", OPT_HOST))
        for k, s in enumerate(socks):
            resp = read_response(s)
            assert resp.status == 200 and echoed(resp.body)["target"] == f"/again/{k}"
    finally:
        for s in socks:
            forget(s)


def test_the_lane_can_be_switched_off(tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """`PACT_INGRESS_LANE=0`: every connection is the trio engine's from the start."""
    monkeypatch.setenv("PACT_INGRESS_LANE", "0")
    env = ServeEnv.start(tmp_path, workers=1, limits=LIMITS)
    try:
        s = tls_socket(env.serve.port, OPT_HOST, timeout=HANG)
        try:
            for i in range(3):
                s.sendall(request_bytes("GET", f"/off/{i}", OPT_HOST))
                assert echoed(read_response(s).body)["target"] == f"/off/{i}"
        finally:
            forget(s)
        assert lane_counts(env) == {}
    finally:
        env.stop()


def test_drain_closes_connections_waiting_in_the_lane(tmp_path: Path) -> None:
    """SIGTERM: keep-alive connections waiting for their next request in the lane are
    closed at once (one answered already, one never asked anything), and the process
    ends cleanly."""
    env = ServeEnv.start(tmp_path, workers=1, limits=LIMITS)
    try:
        port = env.serve.port
        answered = tls_socket(port, OPT_HOST, timeout=HANG)
        answered.sendall(request_bytes("GET", "/idle", OPT_HOST))
        assert echoed(read_response(answered).body)["target"] == "/idle"
        silent = tls_socket(port, OPT_HOST, timeout=HANG)
        silent.do_handshake()
        assert env.serve.wait_open_connections(2) == 2
        env.serve.proc.send_signal(15)
        assert closed_by_peer(answered, timeout=HANG)
        assert closed_by_peer(silent, timeout=HANG)
        forget(answered)
        forget(silent)
        assert env.serve.proc.wait(timeout=60) == 0
    finally:
        env.stop()


def test_open_connections_and_node_pool_settle_after_many_lane_clients(
        served: ServeEnv) -> None:
    """Forty connections each doing a few requests, some leaving mid-way by reset: the
    count of open connections returns to 0 and the node holds no request unanswered."""
    env = served.fresh()
    port = env.serve.port
    for i in range(40):
        s = tls_socket(port, OPT_HOST, timeout=HANG)
        try:
            for k in range(3):
                s.sendall(request_bytes("GET", f"/many/{i}/{k}", OPT_HOST))
                if i % 4 == 0 and k == 1:
                    break
                assert echoed(read_response(s).body)["target"] == f"/many/{i}/{k}"
        finally:
            if i % 4 == 0:
                _reset(s)
            else:
                forget(s)
    assert env.serve.wait_open_connections(0) == 0
    assert all(r.complete for r in env.node.requests())
