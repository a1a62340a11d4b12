"""Attacks on the HTTP/2 keep-alive lane (`net/h2_lane.py`) of a real `pact-ingress
serve`, over loopback sockets: odd node answers (compared with the trio engine's own
answer to the same request, the lane off), a client's tiny header list limit, windows
exactly as large as the answer, a connection window held by another stream, frames
interleaved with lane streams, the client's GOAWAY, reloads, and a drain whose deadline
passes with lane streams hanging at the node.

Invariants after each attack: every answer is its own request's (the node names the
target in a header and in its body); `pact_ingress_terminate_lane_total` shows which
path served it; open connections return to 0; the node holds nothing; the per-IP share
is fully served afterwards; `pact_ingress_http_requests_total` grows by exactly the
requests made.

Every loop is bounded in count and time; nothing asserts on timing.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import ssl
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import h2.settings
import h11
import pytest

from tests import test_lane_attacks as lane_attacks
from tests.inject import inject
from tests.terminate_env import (
    ATTACKER_IP,
    BYSTANDER_IP,
    OPT_HOST,
    H2Conn,
    H2Result,
    ServeEnv,
    read_response,
    request_bytes,
    tarpit_route,
    tls_socket,
)
from tests.test_h2_attacks import (
    GOAWAY,
    PING,
    PRIORITY,
    RST_STREAM,
    WINDOW_UPDATE,
    Raw,
    frame,
    u32,
)
from tests.test_h2_lane import lane_counts, moved, open_ended
from tests.test_lane_attacks import (
    EVIL_HOST,
    HANG,
    IN_FLIGHT,
    LIMITS,
    HostileNode,
    echoed,
    forget,
    full_share_served,
    requests_total,
    settled,
)
from tests.test_lane_attacks import make_world as lane_world

NO_ERROR, CANCEL = 0, 8

# the fixtures of one test on this module's `world` (its own node)
env, evil = lane_attacks.env, lane_attacks.evil


# -- a node with more ways to answer ----------------------------------------------------


def _echo(target: str) -> bytes:
    return json.dumps({"target": target, "sha256": hashlib.sha256(b"").hexdigest()}).encode()


def _answer(method: str, target: str) -> tuple[bytes, str]:
    """The raw answer to one request, and what happens after it ("", "close", "hang")."""
    url = urlsplit(target)
    q = {k: v[0] for k, v in parse_qs(url.query).items()}
    tag = b"x-target: %s\r\n" % target.encode()
    path = url.path
    if path == "/hang":
        return b"", "hang"
    if path == "/slow":
        time.sleep(float(q.get("s", "0.5")))
    if path == "/size":  # a body of exactly n bytes (the target at its start)
        n = int(q["n"])
        body = (target.encode() + b"|" + b"z" * n)[:n]
        return (b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n%scontent-length: %d\r\n\r\n"
                % (tag, n) + (b"" if method == "HEAD" else body)), ""
    if path == "/bighead":
        big = b"x-big: " + b"h" * int(q.get("n", "2000")) + b"\r\n"
        body = _echo(target)
        return (b"HTTP/1.1 200 OK\r\n%s%scontent-length: %d\r\n\r\n%s"
                % (tag, big, len(body), body)), ""
    if path == "/status":  # 204 / 304 with a content-length the node should not send
        code = int(q["code"])
        reason = {204: b"No Content", 304: b"Not Modified"}.get(code, b"X")
        return (b"HTTP/1.1 %d %s\r\n%scontent-length: %s\r\netag: \"e\"\r\n\r\n"
                % (code, reason, tag, q.get("cl", "0").encode())), ""
    body = _echo(target)
    if path == "/chunked":
        mid = len(body) // 2
        return (b"HTTP/1.1 200 OK\r\n%stransfer-encoding: chunked\r\n\r\n"
                b"%x\r\n%s\r\n%x\r\n%s\r\n0\r\n\r\n"
                % (tag, mid, body[:mid], len(body) - mid, body[mid:])), ""
    if path == "/trailers":
        return (b"HTTP/1.1 200 OK\r\n%stransfer-encoding: chunked\r\ntrailer: x-sum\r\n\r\n"
                b"%x\r\n%s\r\n0\r\nx-sum: 42\r\nx-more: yes\r\n\r\n"
                % (tag, len(body), body)), ""
    if path == "/interim":
        return (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: </s>\r\n\r\n"
                b"HTTP/1.1 200 OK\r\n%scontent-length: %d\r\n\r\n%s"
                % (tag, len(body), body)), ""
    if path == "/close":  # `Connection: close`, then the close
        return (b"HTTP/1.1 200 OK\r\n%sconnection: close\r\ncontent-length: %d\r\n\r\n%s"
                % (tag, len(body), body)), "close"
    if path == "/eofbody":  # no length: the body ends with the connection
        return b"HTTP/1.1 200 OK\r\n%s\r\n%s" % (tag, body), "close"
    head_len = b"" if method != "HEAD" else b"content-length: 1234\r\n"
    if method == "HEAD":
        return b"HTTP/1.1 200 OK\r\n%s%s\r\n" % (tag, head_len), ""
    return (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n%scontent-length: %d"
            b"\r\n\r\n%s" % (tag, len(body), body)), ""


class Node(HostileNode):
    """An HTTP/1.1 node over TLS (the pinned node identity) answering by path (see
    `_answer`); `hanging` counts requests it holds unanswered (until the edge closes)."""

    def _exchanges(self, tls: ssl.SSLSocket) -> None:
        while not self.stopped:
            got = self._request(tls, h11.Connection(h11.SERVER))
            if got is None:
                return
            target = got[0].target.decode()
            with self.lock:
                self.seen.append(target)
            out, then = _answer(got[0].method.decode(), target)
            if then == "hang":
                self._hang(tls)
                return
            tls.sendall(out)
            if then == "close":
                return


def make_world(tmp: Path) -> tuple[ServeEnv, Node]:
    return lane_world(tmp, Node)  # type: ignore[return-value]


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServeEnv, Node]]:
    env, node = make_world(tmp_path_factory.mktemp("h2_lane_attacks"))
    try:
        yield env, node
    finally:
        node.stop()
        env.stop()


@pytest.fixture(scope="module")
def world_off(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServeEnv, Node]]:
    """The same, with the lane off: the trio engine's answers, to compare with."""
    old = os.environ.get("PACT_INGRESS_LANE")
    os.environ["PACT_INGRESS_LANE"] = "0"
    try:
        env, node = make_world(tmp_path_factory.mktemp("h2_lane_off"))
    finally:
        if old is None:
            os.environ.pop("PACT_INGRESS_LANE", None)
        else:
            os.environ["PACT_INGRESS_LANE"] = old
    try:
        yield env, node
    finally:
        node.stop()
        env.stop()


def nothing_held(env: ServeEnv, evil: Node) -> None:
    settled(env)
    assert env.node.wait_for(lambda: evil.hanging == 0), evil.hanging
    full_share_served(env, EVIL_HOST)
    full_share_served(env, OPT_HOST)


def header(got: H2Result, name: str) -> str | None:
    for k, v in got.headers:
        if k == name:
            return v
    return None


def warm(env: ServeEnv, n: int) -> None:
    """`n` node connections left idle in the pool (the next `n` streams are the
    lane's)."""
    c = H2Conn(env.serve.port, EVIL_HOST)
    try:
        sids = [open_ended(c, f"/slow?s=0.3&w={k}") for k in range(n)]
        c.sock.sendall(c.conn.data_to_send())
        for sid in sids:
            assert c.wait(sid, timeout=HANG).status == 200
    finally:
        c.close()


def big_window(c: H2Conn) -> None:
    """The connection's receive window raised far beyond anything sent here."""
    c.conn.increment_flow_control_window(2**30)
    c.sock.sendall(c.conn.data_to_send())


# -- the node's odd answers: the lane answers as the trio engine does ----------------------

ODD = [
    ("GET", "/plain/a"),
    ("HEAD", "/head/a"),  # HEAD, a content-length and no body
    ("HEAD", "/size?n=500"),
    ("GET", "/status?code=204&cl=0"),
    ("GET", "/status?code=204&cl=7"),
    ("GET", "/status?code=304&cl=50"),
    ("GET", "/chunked?c=1"),
    ("GET", "/trailers?t=1"),
    ("GET", "/interim?i=1"),
    ("GET", "/close?c=1"),
    ("GET", "/after-close"),
    ("GET", "/eofbody?e=1"),
    ("GET", "/size?n=1"),
    ("GET", "/size?n=16384"),
    ("GET", "/size?n=16385"),
    ("GET", "/size?n=65535"),
    ("GET", "/size?n=65536"),
    ("GET", "/size?n=65537"),
    ("GET", "/last"),
]

_HOP = {"date", "server", "x-request-id"}


def _answers(port: int) -> list[tuple[object, ...]]:
    out: list[tuple[object, ...]] = []
    c = H2Conn(port, EVIL_HOST)
    try:
        big_window(c)
        for method, target in ODD:
            got = c.request(method, target, timeout=HANG)
            hdrs = sorted((k, v) for k, v in got.headers if k not in _HOP)
            out.append((method, target, got.status, got.reset, hdrs,
                        hashlib.sha256(got.body).hexdigest(), len(got.body)))
    finally:
        c.close()
    return out


def test_odd_node_answers_are_relayed_by_the_lane_as_by_the_trio_engine(
        world: tuple[ServeEnv, Node], world_off: tuple[ServeEnv, Node]) -> None:
    """HEAD with a content-length, 204/304 with one, chunked, trailers, 1xx first,
    `Connection: close` (and the request after it), a body ended by the close, bodies
    around the frame size and the lane's whole-body limit: each answer (status, headers,
    body) is the one the trio engine gives with the lane off, and each its own."""
    env, evil = world[0].fresh(), world[1]
    before, total = lane_counts(env), requests_total(env)
    lane_on = _answers(env.serve.port)
    lane_off = _answers(world_off[0].serve.port)
    for method, target, status, reset, hdrs, _, _ in lane_on:
        assert reset is None and status is not None, (method, target, status, reset)
        if status not in (204, 304) and target not in ("/eofbody?e=1",):
            assert ("x-target", target) in hdrs, (target, hdrs)
    diff = [(a, b) for a, b in zip(lane_on, lane_off, strict=True) if a != b]
    assert not diff, diff
    settled(env)
    got = moved(before, lane_counts(env))
    assert sum(got.values()) == len(ODD), got
    assert got.get("h2_served", 0) >= 8, got
    assert requests_total(env) - total == len(ODD)
    nothing_held(env, evil)


# -- the client's header list limit -----------------------------------------------------


def test_a_tiny_max_header_list_size_gets_a_502_from_the_lane_and_the_link_is_kept(
        env: ServeEnv, evil: Node) -> None:
    """SETTINGS_MAX_HEADER_LIST_SIZE of 400 and a node head far larger: a 502 text
    answer (counted `h2_answer`: the lane handed the refusal to a worker), and the
    connection goes on (the next stream, with a small head, served in the lane)."""
    before, total = lane_counts(env), requests_total(env)
    c = H2Conn(env.serve.port, EVIL_HOST)
    try:
        c.conn.update_settings({h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: 400})
        c.sock.sendall(c.conn.data_to_send())
        got = c.request("GET", "/warm")  # (the pool: one idle node connection)
        assert got.status == 200 and echoed(got.body)["target"] == "/warm"
        for i in range(3):
            got = c.request("GET", f"/bighead?n=2000&i={i}")
            assert got.status == 502 and b"larger than your client accepts" in got.body, got
            got = c.request("GET", f"/small/{i}")
            assert got.status == 200 and echoed(got.body)["target"] == f"/small/{i}"
    finally:
        c.close()
    settled(env)
    got = moved(before, lane_counts(env))
    assert got.get("h2_answer") == 3.0, got
    assert got.get("h2_served", 0) + got.get("h2_forward", 0) == 4.0, got
    assert requests_total(env) - total == 7
    nothing_held(env, evil)


# -- windows ------------------------------------------------------------------------------


@pytest.mark.parametrize(("size", "window", "frame_size"), [
    (100, 100, 16384), (100, 99, 16384), (0, 0, 16384),
    (16384, 16384, 16384), (16385, 65535, 16384),
    (65535, 65535, 1 << 20), (65535, 65534, 1 << 20)])
def test_an_answer_exactly_the_clients_window_and_one_more(
        env: ServeEnv, evil: Node, size: int, window: int, frame_size: int) -> None:
    """The client's stream window exactly the answer's size (served whole in the lane
    when the frame size allows), or one byte short (written by a worker as the window
    opens): every byte arrives, and the path that served it is the one expected."""
    before = lane_counts(env)
    c = H2Conn(env.serve.port, EVIL_HOST)
    try:
        big_window(c)
        assert c.request("GET", "/warm").status == 200  # (a node connection left idle)
        c.conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: window,
                                h2.settings.SettingCodes.MAX_FRAME_SIZE: frame_size})
        c.sock.sendall(c.conn.data_to_send())
        before = lane_counts(env)
        for i in range(2):
            target = f"/size?n={size}&i={i}"
            got = c.request("GET", target, timeout=HANG)
            assert got.status == 200 and len(got.body) == size, (got.status, len(got.body))
            assert got.body == (target.encode() + b"|" + b"z" * size)[:size]
    finally:
        c.close()
    settled(env)
    got = moved(before, lane_counts(env))
    fits = size <= window and size <= frame_size
    if fits:
        assert got == {"h2_served": 2.0}, got
    else:
        assert got == {"h2_write": 2.0}, got
    nothing_held(env, evil)


class Stingy(Raw):
    """Never gives back window of its own accord."""

    def _consumed(self, sid: int, length: int) -> None:
        pass


def test_a_connection_window_held_by_another_streams_answer(
        env: ServeEnv, evil: Node) -> None:
    """A large answer on one stream takes the whole connection window (the client does
    not open it); a lane stream's short answer is then ready but cannot go: a worker
    writes it once the client opens the window, and both answers arrive whole."""
    warm(env, 2)
    r = Stingy(None, sock=tls_socket(env.serve.port, EVIL_HOST, alpn=("h2",)),
               host=EVIL_HOST)
    try:
        before, total = lane_counts(env), requests_total(env)
        r.send(r.headers(1, "/size?n=100000"))
        # the big answer stalls with the connection window (65,535) used up
        assert r.until(lambda: sum(len(f[3]) for f in r.frames
                                   if f[0] == 0 and f[2] == 1) >= 65535, timeout=HANG)
        r.send(r.headers(3, "/small/after-big"))
        assert env.node.wait_for(lambda: "/small/after-big" in evil.seen)
        r.until(lambda: r.ended(3), timeout=1.0)
        assert not r.ended(3)  # (no window: nothing of it could be sent)
        r.send(frame(WINDOW_UPDATE, 0, 0, u32(1 << 24)),
               frame(WINDOW_UPDATE, 0, 1, u32(1 << 24)))
        status, body = r.answer(3, timeout=HANG)
        assert status == 200 and echoed(body)["target"] == "/small/after-big"
        status, body = r.answer(1, timeout=HANG)
        assert status == 200 and len(body) == 100000
    finally:
        r.close()
    settled(env)
    got = moved(before, lane_counts(env))
    assert got == {"h2_relay": 1.0, "h2_write": 1.0}, got
    assert requests_total(env) - total == 2
    nothing_held(env, evil)


# -- frames around lane streams -------------------------------------------------------------


def test_ping_priority_window_update_interleaved_and_resets_of_answered_streams(
        env: ServeEnv, evil: Node) -> None:
    """Lane streams with PING, PRIORITY, WINDOW_UPDATE between and after them, and an
    RST_STREAM for each stream once it was answered: every stream gets its own answer,
    the late resets change nothing (no abort counted, the connection goes on), and
    nothing is held."""
    warm(env, IN_FLIGHT)
    r = Raw(None, sock=tls_socket(env.serve.port, EVIL_HOST, alpn=("h2",)), host=EVIL_HOST)
    made = 0
    try:
        before, total = lane_counts(env), requests_total(env)
        sid = 1
        for rnd in range(5):
            sids = [sid + 2 * k for k in range(3)]
            sid += 6
            parts = []
            for s in sids:
                parts += [frame(PING, 0, 0, b"p%07d" % s),
                          frame(PRIORITY, 0, s, u32(0) + b"\x10"),
                          r.headers(s, f"/i/{rnd}/{s}"),
                          frame(PRIORITY, 0, s, u32(0) + b"\x20"),
                          frame(WINDOW_UPDATE, 0, s, u32(1000)),
                          frame(WINDOW_UPDATE, 0, 0, u32(1000))]
            r.send(*parts)
            made += 3
            for s in sids:
                status, body = r.answer(s, timeout=HANG)
                assert status == 200 and echoed(body)["target"] == f"/i/{rnd}/{s}"
            r.send(*[frame(RST_STREAM, 0, s, u32(CANCEL)) for s in sids],
                   frame(PING, 0, 0, b"after---"))
        r.send(r.headers(sid, "/i/last"))
        made += 1
        status, body = r.answer(sid, timeout=HANG)
        assert status == 200 and echoed(body)["target"] == "/i/last"
        assert all(not r.resets(s) for s in range(1, sid + 1, 2))
    finally:
        r.close()
    settled(env)
    got = moved(before, lane_counts(env))
    assert "h2_abort" not in got, got
    assert set(got) <= {"h2_served", "h2_forward"} and sum(got.values()) == made, got
    assert requests_total(env) - total == made
    nothing_held(env, evil)


def test_resets_racing_the_lanes_answer(env: ServeEnv, evil: Node) -> None:
    """RST_STREAM sent while the node's answer is on its way (after a short, varied
    pause): each stream ends either answered (its own answer) or reset, never with
    another's; the counts add up and nothing is held."""
    warm(env, 2)
    r = Raw(None, sock=tls_socket(env.serve.port, EVIL_HOST, alpn=("h2",)), host=EVIL_HOST)
    made = 0
    try:
        before, total = lane_counts(env), requests_total(env)
        for k in range(12):
            s = 1 + 2 * k
            r.send(r.headers(s, f"/slow?s=0.05&r={k}"))
            time.sleep(0.01 * (k % 8))
            r.send(frame(RST_STREAM, 0, s, u32(CANCEL)))
            made += 1
            r.until(lambda s=s: r.ended(s), timeout=0.3)
            status, body = r.answer(s, timeout=0.01)
            if r.ended(s):
                assert status == 200 and echoed(body)["target"] == f"/slow?s=0.05&r={k}"
        s = 1 + 2 * 12
        r.send(r.headers(s, "/race/last"))
        made += 1
        status, body = r.answer(s, timeout=HANG)
        assert status == 200 and echoed(body)["target"] == "/race/last"
    finally:
        r.close()
    settled(env)
    got = moved(before, lane_counts(env))
    assert sum(got.values()) == made, got
    assert env.node.wait_for(lambda: requests_total(env) - total >= made)
    assert requests_total(env) - total == made
    nothing_held(env, evil)


def test_the_clients_goaway_with_lane_streams_at_the_node(env: ServeEnv, evil: Node) -> None:
    """GOAWAY(NO_ERROR) from the client while its streams are at the node, each in the
    lane: a client's GOAWAY ends nothing it opened, so each is answered (its own answer),
    then the edge closes the connection; nothing is held."""
    warm(env, 3)
    r = Raw(None, sock=tls_socket(env.serve.port, EVIL_HOST, alpn=("h2",)), host=EVIL_HOST)
    try:
        before, total = lane_counts(env), requests_total(env)
        r.send(*[r.headers(s, f"/slow?s=0.5&g={s}") for s in (1, 3, 5)])
        assert env.node.wait_for(lambda: len(evil.seen) >= 6)
        assert moved(before, lane_counts(env)) == {}  # at the node, from the lane
        r.send(frame(GOAWAY, 0, 0, struct.pack(">II", 0, NO_ERROR)))
        for s in (1, 3, 5):
            status, body = r.answer(s, timeout=HANG)
            assert status == 200 and echoed(body)["target"] == f"/slow?s=0.5&g={s}", (s,
                                                                                        status)
        r.until(lambda: r.eof, timeout=HANG)
        assert r.eof
    finally:
        r.close()
    settled(env)
    assert moved(before, lane_counts(env)) == {"h2_served": 3.0}
    assert requests_total(env) - total == 3
    nothing_held(env, evil)


# -- floods --------------------------------------------------------------------------------


def test_many_connections_of_many_streams_from_one_address_leave_another_served(
        env: ServeEnv, evil: Node) -> None:
    """Eight connections from one address, each opening 40 streams (short answers and
    some that hang) in one write, three rounds: the attacker gets its share at the node
    and 429 for the rest, every 200 its own; a bystander is served all the while; once
    the attacker leaves, nothing is held, and every stream was counted once."""
    total = requests_total(env)
    made = 0
    ok = 0
    conns: list[H2Conn] = []
    try:
        for rnd in range(3):
            batch = [H2Conn(env.serve.port, EVIL_HOST, source=ATTACKER_IP) for _ in range(8)]
            conns += batch
            plan: list[tuple[H2Conn, int, str]] = []
            for n, c in enumerate(batch):
                for i in range(40):
                    path = f"/hang?r={rnd}" if i == 0 and n == 0 else f"/f/{rnd}/{n}/{i}"
                    plan.append((c, open_ended(c, path), path))
                c.sock.sendall(c.conn.data_to_send())
            made += len(plan)
            by = H2Conn(env.serve.port, OPT_HOST, source=BYSTANDER_IP)
            try:
                for i in range(3):
                    got = by.request("GET", f"/by/{rnd}/{i}")
                    assert got.status == 200 and echoed(got.body)["target"] == f"/by/{rnd}/{i}"
                    made += 1
            finally:
                by.close()
            for c, sid, path in plan:
                if path.startswith("/hang"):
                    continue
                got = c.wait(sid, timeout=HANG)
                assert got.status in (200, 429), (path, got.status, got.reset)
                if got.status == 200:
                    ok += 1
                    assert echoed(got.body)["target"] == path
    finally:
        for c in conns:
            c.close()
    settled(env)
    assert env.node.wait_for(lambda: evil.hanging == 0)
    assert ok >= 1
    assert env.node.wait_for(lambda: requests_total(env) - total >= made)
    assert requests_total(env) - total == made
    full_share_served(env, EVIL_HOST, source=ATTACKER_IP)
    nothing_held(env, evil)


# -- reloads --------------------------------------------------------------------------------


def reload_with_three_at_the_node(env: ServeEnv, evil: Node, c: H2Conn, tag: str,
                                  **changes: Any) -> None:
    """Three lane streams on `c` held at the node (one second each) while serve reloads
    with `changes`: the reload goes through, and each stream gets its own answer."""
    before = lane_counts(env)
    sids = [open_ended(c, f"/slow?s=1&{tag}={k}") for k in range(3)]
    c.sock.sendall(c.conn.data_to_send())
    assert env.node.wait_for(lambda: len(evil.seen) >= 6)
    assert moved(before, lane_counts(env)) == {}  # at the node: nothing counted yet
    assert env.serve.reload(**changes) == "reloaded"
    for k, sid in enumerate(sids):
        got = c.wait(sid, timeout=HANG)
        assert got.status == 200 and echoed(got.body)["target"] == f"/slow?s=1&{tag}={k}"


def test_reload_while_lane_streams_are_at_the_node(env: ServeEnv, evil: Node) -> None:
    """SIGHUP (a smaller in-flight share) while three lane streams are at the node: each
    gets its own answer, the connection goes on with new streams, nothing held."""
    warm(env, 3)
    total = requests_total(env)
    c = H2Conn(env.serve.port, EVIL_HOST)
    try:
        before = lane_counts(env)
        reload_with_three_at_the_node(env, evil, c, "h", limits={
            **LIMITS, "max_requests_in_flight_per_ip": 3})
        for k in range(4):
            got = c.request("GET", f"/post-reload/{k}")
            assert got.status == 200 and echoed(got.body)["target"] == f"/post-reload/{k}"
        # the new share: 3 at once, the 4th refused
        answers = c.burst(4, "/slow?s=0.5&after=1")
        assert sorted(a.status for a in answers) == [200, 200, 200, 429], answers
    finally:
        c.close()
        assert env.serve.reload(limits=LIMITS) == "reloaded"
    settled(env)
    got = moved(before, lane_counts(env))
    assert got.get("h2_served", 0) >= 3, got
    assert requests_total(env) - total == 3 + 4 + 4
    nothing_held(env, evil)


def test_reload_moving_the_route_while_lane_streams_are_at_the_node(
        env: ServeEnv, evil: Node) -> None:
    """SIGHUP moves EVIL_HOST to the recording node while lane streams are at the
    hostile one (its pool retired under them): each gets its own answer, the next
    streams on the same connection go to the new node, nothing stays held."""
    warm(env, 3)
    total = requests_total(env)
    old = env.serve.extra_routes
    c = H2Conn(env.serve.port, EVIL_HOST)
    try:
        reload_with_three_at_the_node(env, evil, c, "m",
                                      extra_routes=tarpit_route(EVIL_HOST, env.node.port))
        for k in range(3):
            got = c.request("GET", f"/moved/{k}")
            assert got.status == 200 and echoed(got.body)["target"] == f"/moved/{k}"
    finally:
        c.close()
        assert env.serve.reload(extra_routes=old) == "reloaded"
    settled(env)
    assert sorted(r.target for r in env.node.requests()) == [f"/moved/{k}" for k in range(3)]
    assert requests_total(env) - total == 6
    nothing_held(env, evil)


# -- a drain whose deadline passes ----------------------------------------------------------

def _short_drain(deadline: float) -> dict[str, str]:
    """The drain's deadline made `deadline` seconds, in main and in the workers."""
    worker = f"def patch(module):\n    module.DRAIN_DEADLINE = {deadline}\n"
    app = worker + f"    module.Ingress.stop.__defaults__ = ({deadline},)\n"
    return {"pact_ingress.app": app, "pact_ingress.worker": worker}


def test_drain_deadline_passing_with_lane_streams_hanging_at_the_node(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGTERM while lane streams hang at the node, and the drain's deadline (made 2 s
    here) passes: the process exits 0, every node connection is closed, and the serve
    log holds no traceback and no lane error."""
    inject(tmp_path, monkeypatch, _short_drain(2.0))
    env, evil = make_world(tmp_path / "w")
    try:
        warm(env, IN_FLIGHT)
        before = lane_counts(env)
        c = H2Conn(env.serve.port, EVIL_HOST)
        sids = [open_ended(c, f"/hang?d={k}") for k in range(IN_FLIGHT)]
        c.sock.sendall(c.conn.data_to_send())
        assert env.node.wait_for(lambda: evil.hanging == IN_FLIGHT), evil.hanging
        assert moved(before, lane_counts(env)) == {}
        env.serve.proc.send_signal(15)
        code = env.serve.proc.wait(timeout=25)
        with contextlib.suppress(TimeoutError, OSError):
            for sid in sids:
                got = c.wait(sid, timeout=2)
                assert got.status != 200, got  # (reset, or the connection closed)
        forget(c.sock)
        assert code == 0, env.serve.logs()[-3000:]
        assert env.node.wait_for(lambda: evil.hanging == 0, timeout=10), evil.hanging
        logs = env.serve.logs()
        hung = [e.get("status") for e in env.serve.log_events() if e.get("path") == "/hang"]
        assert hung == [499] * IN_FLIGHT, hung  # each counted once, as the client's loss
        assert "Traceback" not in logs, logs[-4000:]
        assert '"lane_error"' not in logs and "h2_stream_error" not in logs, logs[-4000:]
    finally:
        evil.stop()
        env.stop()


@pytest.mark.parametrize("window", [65535, 16])
def test_a_head_over_the_clients_limit_is_a_502_whichever_path_writes_it(
        world: tuple[ServeEnv, Node], world_off: tuple[ServeEnv, Node], window: int) -> None:
    """SETTINGS_MAX_HEADER_LIST_SIZE of 400 and a node head far larger, the client's
    stream window either wide (the lane finds the head too large: `h2_answer`) or
    16 bytes (the answer cannot go at once, so the lane hands the node's whole answer
    to a worker to write: `h2_write`): either way the client gets the 502 text answer
    the trio engine gives (the lane off), never a reset, and it is counted 502."""
    env, evil = world[0].fresh(), world[1]

    def ask(port: int) -> list[tuple[int | None, int | None, bytes]]:
        out = []
        c = H2Conn(port, EVIL_HOST)
        try:
            assert c.request("GET", "/warm").status == 200
            c.conn.update_settings({h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: 400,
                                    h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: window})
            c.sock.sendall(c.conn.data_to_send())
            for i in range(2):
                got = c.request("GET", f"/bighead?n=2000&w={window}&i={i}", timeout=HANG)
                out.append((got.status, got.reset, got.body))
            got = c.request("GET", f"/small/{window}")
            assert got.status == 200 and echoed(got.body)["target"] == f"/small/{window}"
        finally:
            c.close()
        return out

    before, total = lane_counts(env), requests_total(env)
    logged = len(env.serve.log_events())
    lane_on = ask(env.serve.port)
    lane_off = ask(world_off[0].serve.port)
    assert lane_off == [(502, None, lane_off[0][2])] * 2, lane_off
    assert lane_on == lane_off, (lane_on, lane_off)
    settled(env)
    got = moved(before, lane_counts(env))
    # (with the 16-byte window the small answer after them is a worker's to write too)
    assert (got.get("h2_answer"), got.get("h2_write")) == (
        (2.0, None) if window == 65535 else (None, 3.0)), got
    assert requests_total(env) - total == 4

    def bighead() -> list[object]:
        return [e.get("status") for e in env.serve.log_events()[logged:]
                if e.get("path") == "/bighead"]

    env.node.wait_for(lambda: len(bighead()) >= 2)  # (the log is written as it goes)
    events = env.serve.log_events()[logged:]
    assert bighead() == [502, 502], events
    assert not [e for e in events if e.get("event") == "h2_stream_error"], events
    nothing_held(env, evil)


# -- a fault of ours inside the lane ------------------------------------------------------

# The fault cannot be provoked from outside (it stands for a bug): the lane's write of the
# request to the node raises for targets under /fault, after the client's share and an
# idle node connection were taken; the trio engine's request to the node raises for
# targets under /wfault (a request with a body: a worker's from the start).
_FAULT = {
    "pact_ingress.net.node_leg": """\
def patch(module):
    send = module.NodeLeg.send_request
    def send_request(self, now, send=send):
        if self.go.target.path.startswith("/fault"):
            raise RuntimeError("injected fault")
        return send(self, now)
    module.NodeLeg.send_request = send_request
""",
    "pact_ingress.net.terminate": """\
def patch(module):
    upstream = module.Terminator._upstream
    async def _upstream(self, ex, conn, route, tenant, host, target, body, up=upstream):
        if target.path.startswith("/wfault"):
            raise RuntimeError("injected fault")
        return await up(self, ex, conn, route, tenant, host, target, body)
    module.Terminator._upstream = _upstream
""",
}


def closed_unanswered(env: ServeEnv, raw: bytes) -> None:
    """`raw` on a new HTTP/1.1 connection: the edge closes it with no answer (also while
    a large body is still going out: the close may then fail our send)."""
    s = tls_socket(env.serve.port, EVIL_HOST, timeout=HANG)
    try:
        try:
            s.sendall(raw)
        except OSError:  # (ssl.SSLError and ConnectionError are OSErrors)
            pass
        with pytest.raises((ConnectionError, OSError)):
            read_response(s)
    finally:
        forget(s)


def counted_500(env: ServeEnv, prefix: str, n: int) -> None:
    """`n` access lines for paths under `prefix`, each with status 500."""
    def statuses() -> list[int]:  # (access lines are written in batches)
        return sorted(e.get("status") for e in env.serve.log_events()
                      if str(e.get("path", "")).startswith(prefix))

    assert env.node.wait_for(lambda: len(statuses()) == n), statuses()
    assert statuses() == [500] * n


def test_a_fault_of_ours_in_the_lane_is_a_500_that_holds_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug in the lane between taking the node and writing to it: the HTTP/2 stream is
    reset with INTERNAL_ERROR while its connection's other stream is answered, the
    HTTP/1.1 connection is closed; each is logged as one `lane_error` line (no
    traceback) and counted 500, not as the client's loss; the share and the node
    connection come back (the whole share is served afterwards)."""
    inject(tmp_path, monkeypatch, _FAULT)
    env, evil = make_world(tmp_path / "w")
    try:
        warm(env, 2)
        before = lane_counts(env)
        c = H2Conn(env.serve.port, EVIL_HOST)
        try:
            bad, good = open_ended(c, "/fault/h2"), open_ended(c, "/plain/ok")
            c.sock.sendall(c.conn.data_to_send())
            got_bad, got_good = c.wait(bad, timeout=HANG), c.wait(good, timeout=HANG)
        finally:
            c.close()
        assert (got_bad.status, got_bad.reset) == (None, 2), got_bad  # INTERNAL_ERROR
        assert got_good.status == 200 and header(got_good, "x-target") == "/plain/ok"
        closed_unanswered(env, request_bytes("GET", "/fault/h1", EVIL_HOST))
        assert moved(before, lane_counts(env)).get("h2_served") == 1
        nothing_held(env, evil)
        counted_500(env, "/fault/", 2)
        faults = [e for e in env.serve.log_events() if e.get("event") == "lane_error"]
        assert len(faults) == 2 and all("injected fault" in e["error"] for e in faults)
        assert "Traceback" not in env.serve.logs()
    finally:
        evil.stop()
        env.stop()


def test_a_fault_of_ours_in_a_worker_is_a_500_too(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same fault in the trio engine (requests with a body go there from the start):
    the HTTP/2 stream is reset with INTERNAL_ERROR beside an answered one, the HTTP/1.1
    connection closed; each counted 500 and warned of in one line, nothing held."""
    inject(tmp_path, monkeypatch, _FAULT)
    env, evil = make_world(tmp_path / "w")
    try:
        c = H2Conn(env.serve.port, EVIL_HOST)
        try:
            bad = c.request("POST", "/wfault/h2", body=b"x" * 10, content_type="text/plain",
                            timeout=HANG)
            good = c.request("POST", "/plain/ok", body=b"y" * 10, content_type="text/plain",
                             timeout=HANG)
        finally:
            c.close()
        assert (bad.status, bad.reset) == (None, 2), bad  # INTERNAL_ERROR
        assert good.status == 200 and header(good, "x-target") == "/plain/ok"
        # (over the lane's whole-body limit: a worker's from the start)
        closed_unanswered(env, request_bytes("POST", "/wfault/h1", EVIL_HOST,
                                             body=b"z" * 70_000, content_type="text/plain"))
        nothing_held(env, evil)
        counted_500(env, "/wfault/", 2)
        events = {e.get("event") for e in env.serve.log_events()
                  if "injected fault" in str(e.get("error", ""))}
        assert events == {"h2_stream_error", "terminate_connection_error"}, events
        assert "Traceback" not in env.serve.logs()
    finally:
        evil.stop()
        env.stop()
