"""HTTP/2 streams in the keep-alive lane (`net/h2_lane.py`) against a real
`pact-ingress serve`, a well-behaved node and a hostile one, over loopback sockets.

Each test reads `pact_ingress_terminate_lane_total` before and after, so it knows which
path answered (`h2_served`: the lane; `h2_<point>`: a stream worker took the stream up
there): a test of a hand-off that the lane happened to serve itself (or the other way
round) fails instead of passing by the wrong road. Invariants after each attack: every
answer is its own request's (the node echoes target and body hash); open connections
return to 0; the per-IP in-flight share is given back (the same address is served its
full share afterwards); the node holds nothing (`hanging` back to 0);
`pact_ingress_http_requests_total` grows by the requests actually made.

Every loop is bounded in count and time; nothing asserts on timing.
"""

from __future__ import annotations

import re
import socket
import subprocess
import time
from pathlib import Path

import h2.settings
import pytest

from tests import test_lane_attacks as lane_attacks
from tests.terminate_env import (
    ATTACKER_IP,
    BYSTANDER_IP,
    HOST,
    LOOPBACK,
    OPT_HOST,
    H2Conn,
    H2Result,
    ServeEnv,
    closed_by_peer,
    tls_socket,
)
from tests.test_h2_attacks import (
    CANCEL,
    CONTINUATION,
    END_HEADERS,
    END_STREAM,
    HEADERS,
    PROTOCOL_ERROR,
    RST_STREAM,
    Raw,
    frame,
    u32,
)
from tests.test_lane_attacks import (
    EVIL_HOST,
    HANG,
    IN_FLIGHT,
    LIMITS,
    HostileNode,
    echoed,
    forget,
    full_share_served,
    make_world,
    requests_total,
    reset,
    settled,
)

# the hostile world's fixtures, shared: a serve with `EVIL_HOST` routed to the hostile node
world, env, evil = lane_attacks.world, lane_attacks.env, lane_attacks.evil

_LANE = re.compile(r'^pact_ingress_terminate_lane_total\{outcome="(\w+)"\} ([0-9.e+]+)$', re.MULTILINE)


def lane_counts(env: ServeEnv) -> dict[str, float]:
    return {k: float(v) for k, v in _LANE.findall(env.serve.metrics())}


def moved(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The outcomes that changed, by how much (not `connect`, the HTTP/1.1 lane's wait
    for a node connection, and not `h2`, the hand-off of every HTTP/2 connection after
    its handshake)."""
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after
            if after.get(k, 0.0) != before.get(k, 0.0) and k not in ("connect", "h2")}


def open_ended(c: H2Conn, path: str) -> int:
    """A GET stream whose HEADERS end it (as browsers and curl send one), not waited
    for: the caller sends `c.conn.data_to_send()` and reads the answer with `c.wait`."""
    sid = c.conn.get_next_available_stream_id()
    c._results[sid] = H2Result(None, [], b"")
    c.conn.send_headers(sid, [(b":method", b"GET"), (b":scheme", b"https"),
                              (b":authority", c.host.encode()), (b":path", path.encode())],
                        end_stream=True)
    return sid


def warm_pool(port: int, n: int) -> None:
    """`n` connections to the hostile node left idle in the pool: `n` streams at once
    that each hold one for a moment (whoever serves them), so the next `n` streams
    each find one idle and are the lane's."""
    c = H2Conn(port, EVIL_HOST)
    try:
        sids = [open_ended(c, f"/slow?s=0.3&w={k}") for k in range(n)]
        c.sock.sendall(c.conn.data_to_send())
        for sid in sids:
            assert c.wait(sid, timeout=HANG).status == 200
    finally:
        c.close()


def nothing_held(env: ServeEnv, evil: HostileNode) -> None:
    """Open connections back to 0, the node holds nothing, the full share is served."""
    settled(env)
    assert env.node.wait_for(lambda: evil.hanging == 0), evil.hanging
    full_share_served(env, EVIL_HOST)
    full_share_served(env, OPT_HOST)


def test_streams_one_after_another_and_at_once_each_get_their_own_answer(
        env: ServeEnv) -> None:
    before, total = lane_counts(env), requests_total(env)
    c = H2Conn(env.serve.port, OPT_HOST)
    try:
        for i in range(10):
            got = c.request("GET", f"/seq/{i}?q={i}")
            assert got.status == 200 and echoed(got.body)["target"] == f"/seq/{i}?q={i}"
        # the share's worth of streams opened in one write, the node's answers in any
        # order: each stream's answer is its own request's
        for k, got in enumerate(c.burst(IN_FLIGHT, "/whole/burst")):
            assert got.status == 200 and echoed(got.body)["target"] == "/whole/burst", k
        got = c.request("HEAD", "/head")
        assert got.status == 200 and got.body == b""
    finally:
        c.close()
    settled(env)
    got = moved(before, lane_counts(env))
    # (a stream that finds no idle connection to the node goes to a worker, which
    # connects: the burst's first time)
    assert set(got) <= {"h2_served", "h2_forward"}, got
    assert got.get("h2_served", 0) + got.get("h2_forward", 0) == 10 + IN_FLIGHT + 1, got
    assert got.get("h2_served", 0) >= 11, got
    assert requests_total(env) - total == 10 + IN_FLIGHT + 1


def test_a_burst_beyond_the_share_is_answered_in_full_without_the_node_seeing_more(
        env: ServeEnv) -> None:
    """Forty streams in one write against a share of `IN_FLIGHT`: the lane takes what
    the share allows, the rest are refused at the edge (429) by a stream worker, and
    the node sees exactly the streams answered 200."""
    before = lane_counts(env)
    c = H2Conn(env.serve.port, OPT_HOST)
    try:
        answers = c.burst(40, "/many")
    finally:
        c.close()
    statuses = [a.status for a in answers]
    ok = statuses.count(200)
    assert ok + statuses.count(429) == 40 and ok >= IN_FLIGHT, statuses
    assert env.node.wait_for(lambda: len(env.node.requests()) >= ok)
    assert len(env.node.requests()) == ok
    got = moved(before, lane_counts(env))
    assert set(got) <= {"h2_served", "h2_forward", "h2_answer"}, got
    assert sum(got.values()) == 40, got
    settled(env)
    full_share_served(env, OPT_HOST)


def test_a_request_with_a_body_is_a_workers_from_the_start(env: ServeEnv) -> None:
    before = lane_counts(env)
    c = H2Conn(env.serve.port, OPT_HOST)
    try:
        got = c.request("POST", "/up", body=b"u" * 3000, content_type="text/plain")
        assert got.status == 200 and echoed(got.body)["target"] == "/up"
        got = c.request("GET", "/after")
        assert got.status == 200 and echoed(got.body)["target"] == "/after"
    finally:
        c.close()
    assert moved(before, lane_counts(env)) == {"h2_served": 1.0}


@pytest.mark.parametrize("target", ["/stream?n=3&interval=0.05", "/big?bytes=300000"])
def test_a_streamed_or_large_answer_is_relayed_by_a_worker(env: ServeEnv,
                                                           target: str) -> None:
    before = lane_counts(env)
    c = H2Conn(env.serve.port, OPT_HOST)
    try:
        got = c.request("GET", target)
        assert got.status == 200
        if target.startswith("/stream"):
            assert got.body.count(b"data: tick") == 3
        else:
            assert got.body == b"x" * 300000
        got = c.request("GET", "/next")
        assert echoed(got.body)["target"] == "/next"
    finally:
        c.close()
    assert moved(before, lane_counts(env)) == {"h2_relay": 1.0, "h2_served": 1.0}
    assert env.node.wait_for(lambda: env.node.active_streams == 0)


def test_a_client_window_too_small_for_the_answer_is_written_by_a_worker(
        env: ServeEnv) -> None:
    """The client allows 16 bytes per stream: the node's whole answer cannot go out at
    once, so a worker writes it as the client opens its window; every byte arrives."""
    before = lane_counts(env)
    c = H2Conn(env.serve.port, OPT_HOST)
    try:
        c.conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 16})
        c.sock.sendall(c.conn.data_to_send())
        for i in range(3):
            got = c.request("GET", f"/narrow/{i}")
            assert got.status == 200 and echoed(got.body)["target"] == f"/narrow/{i}"
    finally:
        c.close()
    assert moved(before, lane_counts(env)) == {"h2_write": 3.0}


def test_a_reset_while_the_node_works_closes_its_connection_and_gives_back_the_share(
        env: ServeEnv, evil: HostileNode) -> None:
    """RST_STREAM while the request hangs at the node: the node's connection is closed
    (not reused, so the node's `hanging` drops), the reset is counted (499), and the
    same connection goes on serving new streams in the lane."""
    before, total = lane_counts(env), requests_total(env)
    c = H2Conn(env.serve.port, EVIL_HOST)
    try:
        assert c.request("GET", "/warm").status == 200  # a node connection left idle
        for i in range(IN_FLIGHT + 2):
            sid = open_ended(c, f"/hang?k={i}")
            c.sock.sendall(c.conn.data_to_send())
            assert env.node.wait_for(lambda i=i: evil.hanging == 1 and len(evil.seen) > i)
            c.conn.reset_stream(sid)
            c.sock.sendall(c.conn.data_to_send())
            assert env.node.wait_for(lambda: evil.hanging == 0)
            got = c.request("GET", f"/then/{i}")
            assert got.status == 200 and echoed(got.body)["target"] == f"/then/{i}"
    finally:
        c.close()
    got = moved(before, lane_counts(env))
    # every hanging stream was the lane's (the connection before it was idle in the
    # pool), and the reset ended it there; each next one found no idle connection
    assert got.pop("h2_abort") == IN_FLIGHT + 2, got
    assert set(got) <= {"h2_served", "h2_forward"} and sum(got.values()) == IN_FLIGHT + 3
    assert requests_total(env) - total == 2 * (IN_FLIGHT + 2) + 1
    nothing_held(env, evil)


@pytest.mark.parametrize("how", ["reset", "close"])
def test_the_connection_ending_with_streams_at_the_node_leaves_nothing_held(
        env: ServeEnv, evil: HostileNode, how: str) -> None:
    """The share's worth of streams hang at the node, each in the lane; the client's
    connection ends (a TCP reset, or GOAWAY and a close): every node connection is
    closed, every share given back."""
    warm_pool(env.serve.port, IN_FLIGHT)
    before = lane_counts(env)
    c = H2Conn(env.serve.port, EVIL_HOST)
    sids = []
    for i in range(IN_FLIGHT):
        sid = open_ended(c, f"/hang?c={i}")
        sids.append(sid)
    c.sock.sendall(c.conn.data_to_send())
    assert env.node.wait_for(lambda: evil.hanging == IN_FLIGHT), evil.hanging
    if how == "reset":
        reset(c.sock)
    else:
        c.close()
    settled(env)
    assert moved(before, lane_counts(env)) == {"h2_abort": IN_FLIGHT}
    nothing_held(env, evil)


def test_a_node_that_drops_a_reused_connection_gets_the_request_again_fresh(
        env: ServeEnv, evil: HostileNode) -> None:
    """The pooled connection dies as the next request crosses it: the GET is sent once
    more on a fresh connection (by a worker) and answered with its own answer."""
    before = lane_counts(env)
    c = H2Conn(env.serve.port, EVIL_HOST)
    try:
        for i in range(3):
            got = c.request("GET", "/dropnext")
            assert echoed(got.body)["target"] == "/dropnext"
            got = c.request("GET", f"/again/{i}")
            assert got.status == 200 and echoed(got.body)["target"] == f"/again/{i}"
            got = c.request("GET", "/408next")
            assert echoed(got.body)["target"] == "/408next"
            got = c.request("GET", f"/after408/{i}")
            assert got.status == 200 and echoed(got.body)["target"] == f"/after408/{i}"
    finally:
        c.close()
    got = moved(before, lane_counts(env))
    assert got.get("h2_forward", 0) >= 6, got
    nothing_held(env, evil)


def test_a_node_answering_twice_never_answers_the_next_stream(
        env: ServeEnv, evil: HostileNode) -> None:
    c = H2Conn(env.serve.port, EVIL_HOST)
    try:
        for i in range(3):
            assert echoed(c.request("GET", "/double").body)["target"] == "/double"
            got = c.request("GET", f"/mine/{i}")
            assert got.status == 200 and echoed(got.body)["target"] == f"/mine/{i}"
    finally:
        c.close()
    nothing_held(env, evil)


def test_interim_answers_a_broken_off_body_and_a_trickled_body_from_the_node(
        env: ServeEnv, evil: HostileNode) -> None:
    before = lane_counts(env)
    c = H2Conn(env.serve.port, EVIL_HOST)
    try:
        got = c.request("GET", "/interim")
        assert got.status == 200 and echoed(got.body)["target"] == "/interim"
        got = c.request("GET", "/brokeoff")  # its close read with its 10 body bytes
        assert got.status == 502 and b"broke off" in got.body, got
        got = c.request("GET", "/lagbody?s=0.01")
        assert got.status == 200 and echoed(got.body)["target"] == "/lagbody?s=0.01"
        got = c.request("GET", "/lagbody?s=0.4")  # past the grace: relayed as it comes
        assert got.status == 200 and echoed(got.body)["target"] == "/lagbody?s=0.4"
        got = c.request("GET", "/last")
        assert got.status == 200 and echoed(got.body)["target"] == "/last"
    finally:
        c.close()
    got = moved(before, lane_counts(env))
    assert got.get("h2_answer") == 1.0 and got.get("h2_relay") == 1.0, got
    assert got.get("h2_served", 0) + got.get("h2_forward", 0) == 3.0, got
    nothing_held(env, evil)


def test_a_flood_of_hanging_streams_from_one_address_leaves_another_served(
        env: ServeEnv, evil: HostileNode) -> None:
    """An attacker opens far more hanging streams than its share on several
    connections: it gets its share at the node and 429 for the rest; a bystander at
    another address is served all the while; once the attacker leaves, nothing is
    held."""
    conns = [H2Conn(env.serve.port, EVIL_HOST, source=ATTACKER_IP) for _ in range(3)]
    try:
        for c in conns:
            for i in range(20):
                open_ended(c, f"/hang?f={i}")
            c.sock.sendall(c.conn.data_to_send())
        assert env.node.wait_for(lambda: evil.hanging == IN_FLIGHT), evil.hanging
        by = H2Conn(env.serve.port, OPT_HOST, source=BYSTANDER_IP)
        try:
            for i in range(5):
                got = by.request("GET", f"/by/{i}")
                assert got.status == 200 and echoed(got.body)["target"] == f"/by/{i}"
        finally:
            by.close()
        assert evil.hanging == IN_FLIGHT  # (the flood never got past its share)
    finally:
        for c in conns:
            reset(c.sock)
    nothing_held(env, evil)


def test_the_checks_answer_the_same_with_the_lane_on_and_off(
        env: ServeEnv, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Requests without a body to odd spellings of the MCP path, on the seal-required
    and the optional host: the lane's answer (status and refusal) is the trio engine's,
    for each."""
    cases = [(m, t, h) for h in (HOST, OPT_HOST) for m in ("GET", "POST", "DELETE")
             for t in ("/mcp", "/mcp/", "/MCP", "/mcp/../mcp", "//mcp", "/%6dcp", "/x")]

    def answers(port: int) -> list[tuple[int | None, str | None, int | None]]:
        out = []
        conns = {h: H2Conn(port, h) for h in (HOST, OPT_HOST)}
        try:
            for method, target, host in cases:
                got = conns[host].request(method, target)
                out.append((got.status, got.code, got.reset))
        finally:
            for c in conns.values():
                c.close()
        return out

    lane_on = answers(env.serve.port)
    monkeypatch.setenv("PACT_INGRESS_LANE", "0")
    off = ServeEnv.start(tmp_path, workers=1, limits=LIMITS)
    try:
        lane_off = answers(off.serve.port)
        assert lane_counts(off) == {}
    finally:
        off.stop()
    assert lane_on == lane_off, [(c, a, b) for c, a, b in zip(cases, lane_on, lane_off,
                                                              strict=True) if a != b]


def test_drain_with_streams_at_the_node_answers_them_then_goaway(tmp_path: Path) -> None:
    env, evil = make_world(tmp_path)
    try:
        warm_pool(env.serve.port, 3)
        before = lane_counts(env)
        c = H2Conn(env.serve.port, EVIL_HOST)
        sids = []
        for k in range(3):
            sid = open_ended(c, f"/slow?s=1&k={k}")
            sids.append(sid)
        c.sock.sendall(c.conn.data_to_send())
        seen: list[object] = []
        receive = c.conn.receive_data

        def noted(data: bytes) -> list[object]:
            events = receive(data)
            seen.extend(events)
            return events

        c.conn.receive_data = noted  # type: ignore[method-assign]
        assert env.node.wait_for(lambda: len(evil.seen) >= 6)
        assert moved(before, lane_counts(env)) == {}  # at the node, from the lane
        env.serve.proc.send_signal(15)
        for k, sid in enumerate(sids):
            got = c.wait(sid, timeout=HANG)
            assert got.status == 200 and echoed(got.body)["target"] == f"/slow?s=1&k={k}"
        c._pump(until=lambda: c.goaway, timeout=HANG)  # (set when the edge closes)
        assert any(type(e).__name__ == "ConnectionTerminated" for e in seen), seen
        assert c.goaway
        forget(c.sock)
        assert env.serve.proc.wait(timeout=60) == 0
    finally:
        evil.stop()
        env.stop()


def test_h2load_many_streams_per_connection_all_answered_and_counted(
        env: ServeEnv) -> None:
    """A real client multiplexing: h2load, 4 connections of 2 streams at a time (within
    the share), 800 requests: every one 200, the node saw each once, the lane served
    them, and everything settles."""
    before, total = lane_counts(env), requests_total(env)
    n = 800
    proc = subprocess.run(
        ["h2load", "-n", str(n), "-c", "2", "-m", "2",
         f"--connect-to={LOOPBACK}:{env.serve.port}", f"https://{OPT_HOST}/whole/h2load"],
        capture_output=True, text=True, timeout=120, check=False)
    out = proc.stdout
    assert f"{n} succeeded" in out and f"status codes: {n} 2xx" in out, out[-800:]
    assert env.node.wait_for(lambda: len(env.node.requests()) >= n)
    assert len(env.node.requests()) == n
    assert requests_total(env) - total == n
    got = moved(before, lane_counts(env))
    assert got.get("h2_served", 0) >= n * 0.9, got  # (a few may find no idle node link)
    settled(env)



# -- frame by frame ----------------------------------------------------------------------


def test_a_header_block_split_across_continuation_frames_is_served_whole(
        env: ServeEnv) -> None:
    r = Raw(None, sock=tls_socket(env.serve.port, OPT_HOST, alpn=("h2",)), host=OPT_HOST)
    try:
        r.send(r.headers(1, "/warm"))  # (a node connection left idle for the next)
        assert r.answer(1)[0] == 200
        before = lane_counts(env)
        block = r.block("/split/continuation", extra=[(b"x-pad", b"p" * 300)])
        r.send(frame(HEADERS, END_STREAM, 3, block[:7]),
               frame(CONTINUATION, 0, 3, block[7:40]),
               frame(CONTINUATION, END_HEADERS, 3, block[40:]))
        status, body = r.answer(3)
        assert status == 200 and echoed(body)["target"] == "/split/continuation"
    finally:
        r.close()
    settled(env)
    assert moved(before, lane_counts(env)) == {"h2_served": 1.0}


def test_headers_that_end_the_stream_yet_declare_a_body_are_refused_before_the_node(
        env: ServeEnv) -> None:
    """HEADERS with END_STREAM and `content-length: 10`: malformed (RFC 9113 §8.1.1),
    reset by the state machine; neither lane nor node ever sees it."""
    r = Raw(None, sock=tls_socket(env.serve.port, OPT_HOST, alpn=("h2",)), host=OPT_HOST)
    try:
        r.send(r.headers(1, "/warm"))
        assert r.answer(1)[0] == 200
        before = lane_counts(env)
        r.send(r.headers(3, "/liar", extra=[(b"content-length", b"10")]))
        assert r.reset(3) == PROTOCOL_ERROR
        r.send(r.headers(5, "/honest"))
        status, body = r.answer(5)
        assert status == 200 and echoed(body)["target"] == "/honest"
    finally:
        r.close()
    assert [q.target for q in env.node.requests()] == ["/warm", "/honest"]
    assert moved(before, lane_counts(env)) == {"h2_served": 1.0}


def test_streams_opened_and_reset_in_one_write_leave_nothing_held(
        env: ServeEnv, evil: HostileNode) -> None:
    """The HTTP/2 form of pipelining then aborting: on several connections at once,
    each write opens streams that hang at the node and resets them in the same write
    (and some at once, some after the node has them). Every reset stream ends in the
    lane or its worker, every node connection it held is closed, and afterwards the
    address has its whole share, the node holds nothing and every request was counted
    exactly once."""
    warm_pool(env.serve.port, IN_FLIGHT)
    total, before = requests_total(env), lane_counts(env)
    raws = [Raw(None, sock=tls_socket(env.serve.port, EVIL_HOST, alpn=("h2",)),
                host=EVIL_HOST) for _ in range(3)]
    opened = 0
    try:
        for rnd in range(5):
            for r in raws:
                sids = [1 + 2 * (rnd * 4 + k) for k in range(4)]
                r.send(*[r.headers(sid, f"/hang?r={rnd}&s={sid}") for sid in sids[:2]],
                       *[frame(RST_STREAM, 0, sid, u32(CANCEL)) for sid in sids[:1]],
                       *[r.headers(sid, f"/hang?r={rnd}&s={sid}") for sid in sids[2:]],
                       *[frame(RST_STREAM, 0, sid, u32(CANCEL)) for sid in sids[2:3]])
                opened += 4
            time.sleep(0.05)
            for r in raws:  # the rest, once the node may have them
                r.send(*[frame(RST_STREAM, 0, 1 + 2 * (rnd * 4 + k), u32(CANCEL))
                         for k in (1, 3)])
        for r in raws:
            r.send(r.headers(1 + 2 * 20, "/after/resets"))
            status, _ = r.answer(1 + 2 * 20)
            # the share may still be held for a moment by streams whose reset is on its way
            assert status in (200, 429), status
    finally:
        for r in raws:
            r.close()
    got = moved(before, lane_counts(env))
    assert got.get("h2_abort", 0) >= 1, got  # (some, at least, were the lane's to end)
    nothing_held(env, evil)
    assert env.node.wait_for(lambda: requests_total(env) - total >= opened + 3)
    assert requests_total(env) - total == opened + 3 + 2 * IN_FLIGHT


def test_bytes_that_are_not_tls_after_the_handshake_end_the_connection_at_once(
        env: ServeEnv) -> None:
    """Once the reader waits with the hub reading for it, what the client sends next is
    read there: plaintext garbage instead of a TLS record ends the connection at once
    (not at its idle deadline), and the next client is served."""
    for garbage in (b"GET / HTTP/1.1\r\n\r\n", b"\x17\x03\x03\x00\x05hello", b"\x00" * 64):
        r = Raw(None, sock=tls_socket(env.serve.port, OPT_HOST, alpn=("h2",)), host=OPT_HOST)
        try:
            r.send(r.headers(1, "/before"))
            status, body = r.answer(1)
            assert status == 200 and echoed(body)["target"] == "/before"
            socket.socket.sendall(r.sock, garbage)  # under the TLS layer: not a record
            assert closed_by_peer(r.sock, timeout=HANG)
        finally:
            r.close()
        c = H2Conn(env.serve.port, OPT_HOST)
        try:
            assert echoed(c.request("GET", "/next").body)["target"] == "/next"
        finally:
            c.close()
    settled(env)
