"""Hostile clients and a hostile node against the keep-alive lane (`net/h1_lane.py`) of
a real `pact-ingress serve`, over loopback sockets.

Invariants checked after each attack: every answer is its own request's (the node
echoes target and body hash); nothing unsealed reaches the node at the seal-required
HOST; open connections return to 0; the per-IP in-flight share is given back (the same
address is served to its full share afterwards); another address is served during a
flood; `pact_ingress_http_requests_total` grows by the requests actually made.

Every loop is bounded in count and time; nothing asserts on timing.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import socket
import ssl
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import h11
import pytest

from tests.terminate_env import (
    _READERS,
    ATTACKER_IP,
    BYSTANDER_IP,
    HOST,
    OPT_HOST,
    ServeEnv,
    _Reader,
    client_context,
    closed_by_peer,
    forget,
    read_response,
    refusal_code,
    request_bytes,
    rpc,
    tarpit_route,
    tls_socket,
    unsealed_call_body,
)

IN_FLIGHT = 4
LIMITS = {"calls_per_hour_per_ip": 100_000_000, "calls_per_hour_per_ip_key": 100_000_000,
          "max_connections_per_ip": 5000, "max_requests_in_flight_per_ip": IN_FLIGHT}
HANG = 15.0
EVIL_HOST = "evil.attack.test"  # a route to the hostile node below
_REQS = re.compile(r'^pact_ingress_http_requests_total\{[^}]*\} ([0-9.e+]+)$', re.M)


class HostileNode:
    """An HTTP/1.1 node over TLS (the pinned node identity) that misbehaves by path:
    `/hang` (or a query of `hang`) never answers (until the edge closes), `/slow?s=S`
    answers after S seconds,
    `/lagbody?s=S` sends its body S seconds after its head, `/double` answers twice in
    one write, `/interim` sends 100 and 103 first, `/brokeoff`
    closes 10 bytes into a 100-byte body, `/dropnext` and `/408next` answer, then close
    the connection on the next request (unanswered, or with a 408); anything else
    echoes target and body hash."""

    def __init__(self, listener: socket.socket, cert: str, key: str) -> None:
        self.ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.ctx.load_cert_chain(cert, key)
        self.ctx.set_alpn_protocols(["http/1.1"])
        self.listener = listener
        self.lock = threading.Lock()
        self.seen: list[str] = []
        self.hanging = 0
        self.socks: set[socket.socket] = set()
        self.stopped = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.stopped:
            try:
                raw, _ = self.listener.accept()
            except OSError:
                return
            with self.lock:
                self.socks.add(raw)
            threading.Thread(target=self._serve, args=(raw,), daemon=True).start()

    def _serve(self, raw: socket.socket) -> None:
        """One connection of the edge's: its exchanges (`_exchanges`) until either end
        stops, then the socket closed and forgotten."""
        raw.settimeout(60)
        try:
            self._exchanges(self.ctx.wrap_socket(raw, server_side=True))
        except (OSError, ssl.SSLError, h11.ProtocolError, ValueError):
            return
        finally:
            with self.lock:
                self.socks.discard(raw)
            with contextlib.suppress(OSError):
                raw.close()

    def _exchanges(self, tls: ssl.SSLSocket) -> None:
        conn = h11.Connection(h11.SERVER)
        then = ""  # what the next request on this connection gets
        while not self.stopped:
            got = self._request(tls, conn)
            if got is None:
                return
            req, body = got
            target = req.target.decode()
            with self.lock:
                self.seen.append(target)
            url = urlsplit(target)
            if then == "drop":  # read, then the connection closed unanswered
                return
            if then == "408":
                tls.sendall(b"HTTP/1.1 408 Request Timeout\r\nconnection: close\r\n"
                            b"content-length: 0\r\n\r\n")
                return
            then = {"/dropnext": "drop", "/408next": "408"}.get(url.path, "")
            if url.path == "/brokeoff":
                tls.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n0123456789")
                return
            if url.path == "/hang" or url.query == "hang":
                self._hang(tls)
                return
            if url.path == "/slow":
                time.sleep(float(parse_qs(url.query)["s"][0]))
            payload = json.dumps({"target": target,
                                  "sha256": hashlib.sha256(body).hexdigest()}).encode()
            one = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                   b"content-length: %d\r\n\r\n%s" % (len(payload), payload))
            if url.path == "/lagbody":  # the head, then the body a moment later
                tls.sendall(one[:one.index(b"\r\n\r\n") + 4])
                time.sleep(float(parse_qs(url.query)["s"][0]))
                one = one[one.index(b"\r\n\r\n") + 4:]
            if url.path == "/interim":
                one = (b"HTTP/1.1 100 Continue\r\n\r\n"
                       b"HTTP/1.1 103 Early Hints\r\nlink: </x>\r\n\r\n") + one
            if url.path == "/double":
                other = json.dumps({"target": "/smuggled", "sha256": ""}).encode()
                one += (b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s"
                        % (len(other), other))
            tls.sendall(one)
            conn = h11.Connection(h11.SERVER)  # (no state carried: a new cycle)

    @staticmethod
    def _request(tls: ssl.SSLSocket, conn: h11.Connection
                 ) -> tuple[h11.Request, bytes] | None:
        """The next request and its body; None when the connection ended or broke."""
        req, body = None, b""
        while True:
            ev = conn.next_event()
            if ev is h11.NEED_DATA:
                data = tls.recv(65536)
                if not data:
                    return None
                conn.receive_data(data)
            elif isinstance(ev, h11.Request):
                req = ev
            elif isinstance(ev, h11.Data):
                body += ev.data
            elif isinstance(ev, h11.EndOfMessage):
                return (req, body) if req is not None else None
            else:
                return None

    def _hang(self, tls: ssl.SSLSocket) -> None:
        """Hold the request unanswered until the edge closes (`hanging` counts it)."""
        with self.lock:
            self.hanging += 1
        try:
            while tls.recv(65536):
                pass
        finally:
            with self.lock:
                self.hanging -= 1

    def stop(self) -> None:
        self.stopped = True
        with contextlib.suppress(OSError):
            self.listener.close()
        with self.lock:
            held = list(self.socks)
        for s in held:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)


def make_world(tmp: Path, node: type[HostileNode] = HostileNode
               ) -> tuple[ServeEnv, HostileNode]:
    """A serve with `EVIL_HOST` routed to a hostile node (`node`: its class)."""
    evil = socket.create_server(("127.0.0.1", 0), backlog=256)
    routes = tarpit_route(EVIL_HOST, evil.getsockname()[1])
    try:
        env = ServeEnv.start(tmp, workers=1, limits=LIMITS, extra_routes=routes)
    except BaseException:
        evil.close()
        raise
    return env, node(evil, str(env.ids.node.cert_path), str(env.ids.node.key_path))


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[tuple[ServeEnv, HostileNode]]:
    env, node = make_world(tmp_path_factory.mktemp("lane_attacks"))
    try:
        yield env, node
    finally:
        node.stop()
        env.stop()


@pytest.fixture
def env(world: tuple[ServeEnv, HostileNode]) -> ServeEnv:
    return world[0].fresh()


@pytest.fixture
def evil(world: tuple[ServeEnv, HostileNode]) -> HostileNode:
    with world[1].lock:
        world[1].seen.clear()
    return world[1]


def requests_total(env: ServeEnv) -> float:
    return sum(float(v) for v in _REQS.findall(env.serve.metrics()))


def echoed(body: bytes) -> dict[str, object]:
    return dict(json.loads(body))


def sha(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


def chunked(body: bytes, pieces: int = 3) -> bytes:
    step = max(1, len(body) // pieces)
    out = b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + step]), body[i:i + step])
                   for i in range(0, len(body), step))
    return out + b"0\r\n\r\n"


def chunked_request(target: str, host: str, body: bytes) -> bytes:
    return (f"POST {target} HTTP/1.1\r\nHost: {host}\r\nContent-Type: text/plain\r\n"
            "Transfer-Encoding: chunked\r\n\r\n").encode() + chunked(body)


def reset(s: socket.socket) -> None:
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    forget(s)


def full_share_served(env: ServeEnv, host: str, source: str = "127.0.0.1",
                      path: str = "/share") -> None:
    """The address's whole in-flight share at once, every request answered by the node."""
    socks = [tls_socket(env.serve.port, host, source=source, timeout=HANG)
             for _ in range(IN_FLIGHT)]
    try:
        for k, s in enumerate(socks):
            s.sendall(request_bytes("GET", f"{path}/{k}", host))
        for k, s in enumerate(socks):
            resp = read_response(s)
            assert resp.status == 200, (resp.status, resp.body)
            assert echoed(resp.body)["target"] == f"{path}/{k}"
    finally:
        for s in socks:
            forget(s)


def settled(env: ServeEnv) -> None:
    assert env.serve.wait_open_connections(0) == 0


# -- hostile clients -------------------------------------------------------------------


def test_a_pipelined_mix_of_bodies_and_methods_gets_each_its_own_answer(
        env: ServeEnv) -> None:
    """One write: GET, small POST, chunked POST, HEAD, POSTs of 65536 and 65537 bytes
    (the lane's whole-body limit, and one over), GET; each answer is its own."""
    before = requests_total(env)
    big, bigger = b"A" * 65536, b"B" * 65537
    plan = [("GET", "/m/0", b"", None), ("POST", "/m/1", b"small", None),
            ("POST", "/m/2", b"chunky" * 50, "chunked"), ("HEAD", "/m/3", b"", None),
            ("POST", "/m/4", big, None), ("POST", "/m/5", bigger, None),
            ("GET", "/m/6", b"", None)]
    raw = b"".join(chunked_request(t, OPT_HOST, b) if how == "chunked" else
                   request_bytes(m, t, OPT_HOST, body=b, content_type="text/plain")
                   for m, t, b, how in plan)
    s = tls_socket(env.serve.port, OPT_HOST, timeout=HANG)
    try:
        s.sendall(raw)
        for method, target, body, _ in plan:
            resp = read_response(s, head_only=method == "HEAD")
            assert resp.status == 200, (target, resp.status, resp.body)
            if method != "HEAD":
                got = echoed(resp.body)
                assert (got["target"], got["sha256"]) == (target, sha(body))
    finally:
        forget(s)
    settled(env)
    assert [r.target for r in env.node.requests()] == [t for _, t, _, _ in plan]
    assert requests_total(env) - before == len(plan)


def test_a_request_split_across_tls_records_at_every_offset(env: ServeEnv) -> None:
    """The same small POST split in two TLS records at every byte offset, one
    connection each: wherever the split falls, the request is served whole, once."""
    before = requests_total(env)
    body = b'{"k": "v"}'
    raw = request_bytes("POST", "/split", OPT_HOST, body=body, content_type="text/plain")
    for k in range(1, len(raw)):
        s = tls_socket(env.serve.port, OPT_HOST, timeout=HANG)
        try:
            s.sendall(raw[:k])
            s.sendall(raw[k:])
            resp = read_response(s)
            got = echoed(resp.body)
            assert resp.status == 200 and got["sha256"] == sha(body), (k, resp.body)
        finally:
            forget(s)
    settled(env)
    assert len(env.node.requests()) == len(raw) - 1
    assert requests_total(env) - before == len(raw) - 1


def test_expect_continue_in_the_middle_of_a_pipeline(env: ServeEnv) -> None:
    before = requests_total(env)
    body = b"e" * 300
    raw = (request_bytes("GET", "/x/0", OPT_HOST)
           + request_bytes("POST", "/x/1", OPT_HOST, body=body, content_type="text/plain",
                           headers=[("Expect", "100-continue")])
           + request_bytes("GET", "/x/2", OPT_HOST))
    s = tls_socket(env.serve.port, OPT_HOST, timeout=HANG)
    try:
        s.sendall(raw)
        for target, b in (("/x/0", b""), ("/x/1", body), ("/x/2", b"")):
            resp = read_response(s)
            got = echoed(resp.body)
            assert resp.status == 200 and (got["target"], got["sha256"]) == (target, sha(b))
    finally:
        forget(s)
    settled(env)
    assert requests_total(env) - before == 3


def test_a_bad_head_behind_good_ones_is_refused_after_them(env: ServeEnv) -> None:
    before = requests_total(env)
    raw = (request_bytes("GET", "/g/0", OPT_HOST)
           + request_bytes("POST", "/g/1", OPT_HOST, body=b"one", content_type="text/plain")
           + f"GET /bad HTTP/1.1\r\nHost: {OPT_HOST}\r\nHost: other\r\n\r\n".encode()
           + request_bytes("GET", "/never", OPT_HOST))
    s = tls_socket(env.serve.port, OPT_HOST, timeout=HANG)
    try:
        s.sendall(raw)
        assert echoed(read_response(s).body)["target"] == "/g/0"
        assert echoed(read_response(s).body)["target"] == "/g/1"
        assert read_response(s).status == 400
        with pytest.raises((ConnectionError, ssl.SSLError)):
            read_response(s)
    finally:
        forget(s)
    settled(env)
    assert [r.target for r in env.node.requests()] == ["/g/0", "/g/1"]
    # (a refused head is no exchange: neither engine counts it)
    assert requests_total(env) - before == 2


def test_a_request_sent_with_the_tls_finished_is_served(env: ServeEnv) -> None:
    """The client's Finished and its first request (and a second, pipelined) in one
    TCP segment."""
    before = requests_total(env)
    deadline = time.monotonic() + HANG
    raw, obj, inc, out = _bio_client(env.serve.port, OPT_HOST, deadline)
    try:
        obj.write(request_bytes("GET", "/fin/0", OPT_HOST)
                  + request_bytes("POST", "/fin/1", OPT_HOST, body=b"f",
                                  content_type="text/plain"))
        raw.sendall(out.read())  # Finished + the requests, one send
        plain = b""
        while plain.count(b"/fin/") < 2 and time.monotonic() < deadline:
            try:
                plain += obj.read(65536)
                continue
            except ssl.SSLWantReadError:
                pass
            data = raw.recv(65536)
            assert data, plain
            inc.write(data)
        assert plain.count(b"HTTP/1.1 200 ") == 2, plain
        assert plain.index(b"/fin/0") < plain.index(b"/fin/1")
    finally:
        raw.close()
    settled(env)
    assert requests_total(env) - before == 2


def test_half_close_after_a_request_still_gets_the_answer(env: ServeEnv) -> None:
    before = requests_total(env)
    for i in range(5):
        s = tls_socket(env.serve.port, OPT_HOST, timeout=HANG)
        try:
            s.sendall(request_bytes("POST", f"/half/{i}", OPT_HOST, body=b"h" * i,
                                    content_type="text/plain"))
            socket.socket.shutdown(s, socket.SHUT_WR)
            resp = read_response(s)
            assert resp.status == 200 and echoed(resp.body)["target"] == f"/half/{i}"
        finally:
            forget(s)
    settled(env)
    assert requests_total(env) - before == 5


def test_http10_with_and_without_host(env: ServeEnv) -> None:
    """HTTP/1.0 with Host is served and closed (no keep-alive asked); without Host the
    edge refuses it (400, as the trio engine does): nothing reaches the node."""
    before = requests_total(env)
    s = tls_socket(env.serve.port, OPT_HOST, timeout=HANG)
    try:
        s.sendall(f"GET /ten HTTP/1.0\r\nHost: {OPT_HOST}\r\n\r\n".encode()
                  + request_bytes("GET", "/never", OPT_HOST))
        resp = read_response(s)
        assert resp.status == 200 and echoed(resp.body)["target"] == "/ten"
        assert s.recv(100) == b""
    finally:
        forget(s)
    s = tls_socket(env.serve.port, OPT_HOST, timeout=HANG)
    try:
        s.sendall(b"GET /nohost HTTP/1.0\r\n\r\n")
        assert read_response(s).status == 400
    finally:
        forget(s)
    settled(env)
    assert [r.target for r in env.node.requests()] == ["/ten"]
    assert requests_total(env) - before == 2


def test_connection_close_mid_pipeline_serves_nothing_behind_it(env: ServeEnv) -> None:
    before = requests_total(env)
    s = tls_socket(env.serve.port, OPT_HOST, timeout=HANG)
    try:
        s.sendall(request_bytes("GET", "/c/0", OPT_HOST)
                  + request_bytes("GET", "/c/1", OPT_HOST, headers=[("Connection", "close")])
                  + request_bytes("POST", "/c/2", OPT_HOST, body=b"no",
                                  content_type="text/plain"))
        assert echoed(read_response(s).body)["target"] == "/c/0"
        resp = read_response(s)
        assert echoed(resp.body)["target"] == "/c/1" and resp.header("connection") == "close"
        with pytest.raises((ConnectionError, ssl.SSLError)):
            read_response(s)
    finally:
        forget(s)
    settled(env)
    assert [r.target for r in env.node.requests()] == ["/c/0", "/c/1"]
    assert requests_total(env) - before == 2


def test_half_close_while_the_node_works_answers_the_pipeline(
        env: ServeEnv, evil: HostileNode) -> None:
    """Two requests, the first slow at the node, then the client's half-close: both
    answered, in order, then the connection ends."""
    before = requests_total(env)
    s = tls_socket(env.serve.port, EVIL_HOST, timeout=HANG)
    try:
        s.sendall(request_bytes("GET", "/slow?s=0.3", EVIL_HOST))
        assert env.node.wait_for(lambda: len(evil.seen) >= 1)
        s.sendall(request_bytes("POST", "/then", EVIL_HOST, body=b"t",
                                content_type="text/plain"))
        socket.socket.shutdown(s, socket.SHUT_WR)
        assert echoed(read_response(s).body)["target"] == "/slow?s=0.3"
        got = echoed(read_response(s).body)
        assert (got["target"], got["sha256"]) == ("/then", sha(b"t"))
    finally:
        forget(s)
    settled(env)
    assert evil.seen == ["/slow?s=0.3", "/then"]
    assert requests_total(env) - before == 2


def test_unsealed_calls_in_odd_spellings_pipelined_behind_good_ones(env: ServeEnv) -> None:
    targets = ["https://mcp.attack.test/mcp", "/mcp/../mcp", "/mcp?x=1", "/mcp/",
               "HTTPS://MCP.ATTACK.TEST:443/mcp", "/./mcp", "/%6Dcp"]
    for t in targets:
        s = tls_socket(env.serve.port, HOST, timeout=HANG)
        try:
            s.sendall(request_bytes("GET", "/ok", HOST)
                      + request_bytes("POST", t, HOST, body=unsealed_call_body("odd"))
                      + request_bytes("GET", "/after", HOST))
            assert echoed(read_response(s).body)["target"] == "/ok"
            resp = read_response(s)
            assert resp.status != 200 or refusal_code(resp.body) is not None, (t, resp.body)
        except (ConnectionError, ssl.SSLError):
            pass  # refused by closing is an answer too
        finally:
            forget(s)
    settled(env)
    assert env.node.unsealed_calls() == []


# -- the client leaves at each phase ------------------------------------------------------


def test_reset_while_the_node_has_not_answered_gives_the_share_back(
        env: ServeEnv, evil: HostileNode) -> None:
    before = requests_total(env)
    for i in range(IN_FLIGHT + 2):
        s = tls_socket(env.serve.port, EVIL_HOST, timeout=HANG)
        s.sendall(request_bytes("GET", "/hang", EVIL_HOST))
        assert env.node.wait_for(lambda i=i: evil.seen.count("/hang") > i)
        reset(s)
    settled(env)
    full_share_served(env, EVIL_HOST)
    assert requests_total(env) - before == IN_FLIGHT + 2 + IN_FLIGHT


def test_reset_while_the_answer_is_being_written(env: ServeEnv) -> None:
    """A client that takes nothing of a ~60 KB answer and resets."""
    before = requests_total(env)
    for i in range(IN_FLIGHT + 2):
        s = tls_socket(env.serve.port, OPT_HOST, rcvbuf=4096, timeout=HANG)
        s.sendall(request_bytes("POST", f"/w/{i}", OPT_HOST, body=b"w" * 100,
                                content_type="text/plain"))
        s.sendall(request_bytes("GET", "/big?bytes=60000", OPT_HOST))
        time.sleep(0.1)
        reset(s)
    settled(env)
    full_share_served(env, OPT_HOST)
    assert requests_total(env) - before >= IN_FLIGHT  # (the resets count as they came)


def test_a_node_answering_twice_does_not_answer_the_next_request(
        env: ServeEnv, evil: HostileNode) -> None:
    s = tls_socket(env.serve.port, EVIL_HOST, timeout=HANG)
    try:
        for i in range(5):
            s.sendall(request_bytes("GET", "/double", EVIL_HOST))
            assert echoed(read_response(s).body)["target"] == "/double"
            s.sendall(request_bytes("GET", f"/next/{i}", EVIL_HOST))
            assert echoed(read_response(s).body)["target"] == f"/next/{i}"
    finally:
        forget(s)
    settled(env)


# -- floods and reloads -----------------------------------------------------------------


def test_a_flood_from_one_address_leaves_another_served_and_gives_everything_back(
        env: ServeEnv, evil: HostileNode) -> None:
    before = requests_total(env)
    port = env.serve.port
    flood: list[ssl.SSLSocket] = []
    try:
        for i in range(40):
            s = tls_socket(port, EVIL_HOST, source=ATTACKER_IP, timeout=HANG)
            s.sendall(request_bytes("GET", "/hang", EVIL_HOST)
                      + request_bytes("GET", f"/behind/{i}", EVIL_HOST))
            flood.append(s)
        assert env.node.wait_for(lambda: evil.hanging >= IN_FLIGHT)
        for i in range(5):
            other = tls_socket(port, EVIL_HOST, source=BYSTANDER_IP, timeout=HANG)
            try:
                other.sendall(request_bytes("GET", f"/by/{i}", EVIL_HOST))
                assert echoed(read_response(other).body)["target"] == f"/by/{i}"
            finally:
                forget(other)
        refused = 0
        for s in flood[IN_FLIGHT:]:
            resp = read_response(s)
            assert resp.status != 200, resp.body
            refused += 1
    finally:
        for s in flood:
            reset(s)
    settled(env)
    assert evil.seen.count("/hang") == IN_FLIGHT
    full_share_served(env, EVIL_HOST, source=ATTACKER_IP)
    made = 5 + IN_FLIGHT + refused  # the /hang ones reset count too, as 499
    assert requests_total(env) - before >= made


def test_reload_while_lane_requests_are_at_the_node(env: ServeEnv, evil: HostileNode) -> None:
    before = requests_total(env)
    socks = [tls_socket(env.serve.port, EVIL_HOST, timeout=HANG) for _ in range(3)]
    try:
        for k, s in enumerate(socks):
            s.sendall(request_bytes("POST", f"/slow?s=1&k={k}", EVIL_HOST, body=b"r" * k,
                                    content_type="text/plain"))
        assert env.node.wait_for(lambda: len(evil.seen) >= 3)
        outcome = env.serve.reload(limits={**LIMITS, "max_requests_in_flight_per_ip": 3})
        assert outcome == "reloaded"
        for k, s in enumerate(socks):
            resp = read_response(s)
            got = echoed(resp.body)
            assert resp.status == 200 and got["target"] == f"/slow?s=1&k={k}"
            assert got["sha256"] == sha(b"r" * k)
            s.sendall(request_bytes("GET", f"/post-reload/{k}", EVIL_HOST))
            assert echoed(read_response(s).body)["target"] == f"/post-reload/{k}"
    finally:
        for s in socks:
            forget(s)
        assert env.serve.reload(limits=LIMITS) == "reloaded"
    settled(env)
    full_share_served(env, EVIL_HOST)
    assert requests_total(env) - before == 6 + IN_FLIGHT


def test_a_node_that_drops_a_reused_connection_on_the_next_request(
        env: ServeEnv, evil: HostileNode) -> None:
    """The pooled connection dies as the next request crosses it: a GET is sent once
    more on a fresh connection and answered with its own answer; a POST is not sent
    again (502)."""
    before = requests_total(env)
    s = tls_socket(env.serve.port, EVIL_HOST, timeout=HANG)
    try:
        for i in range(3):
            s.sendall(request_bytes("GET", "/dropnext", EVIL_HOST))
            assert echoed(read_response(s).body)["target"] == "/dropnext"
            s.sendall(request_bytes("GET", f"/again/{i}", EVIL_HOST))
            assert echoed(read_response(s).body)["target"] == f"/again/{i}"
        s.sendall(request_bytes("GET", "/dropnext", EVIL_HOST))
        assert echoed(read_response(s).body)["target"] == "/dropnext"
        s.sendall(request_bytes("POST", "/once", EVIL_HOST, body=b"p",
                                content_type="text/plain"))
        assert read_response(s).status == 502
    finally:
        forget(s)
    settled(env)
    assert evil.seen.count("/once") == 1
    assert requests_total(env) - before == 8
    full_share_served(env, EVIL_HOST)


def test_a_node_timing_out_a_reused_connection_with_408(
        env: ServeEnv, evil: HostileNode) -> None:
    before = requests_total(env)
    s = tls_socket(env.serve.port, EVIL_HOST, timeout=HANG)
    try:
        for i in range(3):
            s.sendall(request_bytes("GET", "/408next", EVIL_HOST))
            assert echoed(read_response(s).body)["target"] == "/408next"
            s.sendall(request_bytes("GET", f"/after408/{i}", EVIL_HOST))
            resp = read_response(s)
            assert resp.status == 200 and echoed(resp.body)["target"] == f"/after408/{i}"
    finally:
        forget(s)
    settled(env)
    assert requests_total(env) - before == 6


def test_interim_answers_and_a_broken_off_body_from_the_node(
        env: ServeEnv, evil: HostileNode) -> None:
    before = requests_total(env)
    s = tls_socket(env.serve.port, EVIL_HOST, timeout=HANG)
    try:
        s.sendall(request_bytes("GET", "/interim", EVIL_HOST))
        resp = read_response(s)
        assert resp.status == 200 and echoed(resp.body)["target"] == "/interim"
        s.sendall(request_bytes("GET", "/brokeoff", EVIL_HOST)
                  + request_bytes("GET", "/never", EVIL_HOST))
        resp = read_response(s, head_only=True)
        assert resp.status == 502 or resp.header("content-length") == "100"
        with pytest.raises((ConnectionError, ssl.SSLError)):
            read_response(s)
    finally:
        forget(s)
    settled(env)
    assert "/never" not in evil.seen
    assert requests_total(env) - before == 2
    full_share_served(env, EVIL_HOST)


def test_a_long_pipeline_behind_a_slow_request_is_answered_in_order(
        env: ServeEnv, evil: HostileNode) -> None:
    """More than the lane reads ahead (64 KiB) pipelined behind a request the node is
    slow to answer: reading stops, then resumes; every answer in order, each its own."""
    before = requests_total(env)
    n = 700
    s = tls_socket(env.serve.port, EVIL_HOST, timeout=HANG)
    try:
        s.sendall(request_bytes("GET", "/slow?s=0.3", EVIL_HOST)
                  + b"".join(request_bytes("GET", f"/p/{i:04d}", EVIL_HOST)
                             for i in range(n)))
        assert echoed(read_response(s).body)["target"] == "/slow?s=0.3"
        for i in range(n):
            resp = read_response(s)
            assert resp.status == 200 and echoed(resp.body)["target"] == f"/p/{i:04d}"
    finally:
        forget(s)
    settled(env)
    assert len(evil.seen) == n + 1
    assert requests_total(env) - before == n + 1


def test_a_request_trickled_byte_by_byte_while_the_node_works(
        env: ServeEnv, evil: HostileNode) -> None:
    """The next request in one-byte TLS records while the first is at the node: each
    read is charged at least 1 KiB, so reading stops part-way; the rest is read when
    the first answer is out, and the second answered whole."""
    before = requests_total(env)
    s = tls_socket(env.serve.port, EVIL_HOST, timeout=HANG)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    body = b"q" * 50
    nxt = request_bytes("POST", "/trickled", EVIL_HOST, body=body, content_type="text/plain")
    try:
        s.sendall(request_bytes("GET", "/slow?s=0.5", EVIL_HOST))
        assert env.node.wait_for(lambda: len(evil.seen) >= 1)
        for b in nxt[:150]:
            s.sendall(bytes([b]))
        s.sendall(nxt[150:])
        assert echoed(read_response(s).body)["target"] == "/slow?s=0.5"
        got = echoed(read_response(s).body)
        assert (got["target"], got["sha256"]) == ("/trickled", sha(body))
    finally:
        forget(s)
    settled(env)
    assert requests_total(env) - before == 2


@pytest.mark.parametrize("target", ["/big?bytes=200000"])
def test_half_close_then_a_relayed_answer_arrives_whole(env: ServeEnv, target: str) -> None:
    """The client half-closes right after a request whose answer the trio engine relays
    (RELAY hand-off with the close already seen): the answer still arrives whole. (An
    event stream is cut at a half-close instead: the trio engine's watch takes it for
    the client gone, with the lane off too.)"""
    before = requests_total(env)
    s = tls_socket(env.serve.port, OPT_HOST, timeout=HANG)
    try:
        s.sendall(request_bytes("GET", target, OPT_HOST))
        socket.socket.shutdown(s, socket.SHUT_WR)
        resp = read_response(s)
        assert resp.status == 200
        if target.startswith("/stream"):
            assert resp.body.count(b"data: tick") == 3
        else:
            assert resp.body == b"x" * 200000
    finally:
        forget(s)
    settled(env)
    assert requests_total(env) - before == 1


def test_drain_while_lane_requests_are_at_the_node(tmp_path: Path) -> None:
    """SIGTERM with requests at the node: each is answered with its own answer and
    `Connection: close`, a connection waiting idle is closed, and the process exits 0."""
    env, evil = make_world(tmp_path)
    try:
        port = env.serve.port
        idle = tls_socket(port, EVIL_HOST, timeout=HANG)
        idle.sendall(request_bytes("GET", "/first", EVIL_HOST))
        assert echoed(read_response(idle).body)["target"] == "/first"
        busy = [tls_socket(port, EVIL_HOST, timeout=HANG) for _ in range(3)]
        for k, s in enumerate(busy):
            s.sendall(request_bytes("POST", f"/slow?s=1&k={k}", EVIL_HOST, body=b"d" * k,
                                    content_type="text/plain"))
        assert env.node.wait_for(lambda: len(evil.seen) >= 4)
        env.serve.proc.send_signal(15)
        for k, s in enumerate(busy):
            resp = read_response(s)
            got = echoed(resp.body)
            assert (got["target"], got["sha256"]) == (f"/slow?s=1&k={k}", sha(b"d" * k))
            assert resp.header("connection") == "close"
        assert closed_by_peer(idle, timeout=HANG)
        for s in [idle, *busy]:
            forget(s)
        assert env.serve.proc.wait(timeout=60) == 0
    finally:
        evil.stop()
        env.stop()


def test_half_close_behind_a_pipeline_the_lane_stopped_reading_closes_the_connection(
        env: ServeEnv, evil: HostileNode) -> None:
    """More than the lane reads ahead pipelined behind a slow request, then the client's
    half-close: every request is answered, then the edge closes the connection (it does
    not wait out the idle timeout, 300 s, for a client that said it sends no more)."""
    before = requests_total(env)
    n = 700
    s = tls_socket(env.serve.port, EVIL_HOST, timeout=HANG)
    try:
        s.sendall(request_bytes("GET", "/slow?s=0.3", EVIL_HOST)
                  + b"".join(request_bytes("GET", f"/h/{i:04d}", EVIL_HOST)
                             for i in range(n)))
        socket.socket.shutdown(s, socket.SHUT_WR)
        assert echoed(read_response(s).body)["target"] == "/slow?s=0.3"
        for i in range(n):
            assert echoed(read_response(s).body)["target"] == f"/h/{i:04d}"
        assert closed_by_peer(s, timeout=HANG)
    finally:
        forget(s)
    settled(env)
    assert requests_total(env) - before == n + 1


def _bio_client(port: int, host: str, deadline: float
                ) -> tuple[socket.socket, ssl.SSLObject, ssl.MemoryBIO, ssl.MemoryBIO]:
    """A TLS client on memory BIOs over a plain socket, handshake done: its Finished
    waits in `out`, so the caller's first records leave in the same send."""
    raw = socket.create_connection(("127.0.0.1", port), timeout=HANG)
    try:
        inc, out = ssl.MemoryBIO(), ssl.MemoryBIO()
        obj = client_context().wrap_bio(inc, out, server_hostname=host)
        while time.monotonic() < deadline:
            try:
                obj.do_handshake()
                return raw, obj, inc, out
            except ssl.SSLWantReadError:
                if out.pending:
                    raw.sendall(out.read())
                data = raw.recv(65536)
                assert data, "closed during the handshake"
                inc.write(data)
        raise TimeoutError("handshake")
    except BaseException:
        raw.close()
        raise


def test_close_notify_right_behind_the_requests_still_gets_the_answers(
        env: ServeEnv) -> None:
    """The client's requests and its TLS close_notify in one segment (with its
    Finished): both answers arrive, then the connection ends."""
    before = requests_total(env)
    deadline = time.monotonic() + HANG
    raw, obj, inc, out = _bio_client(env.serve.port, OPT_HOST, deadline)
    try:
        obj.write(request_bytes("GET", "/cn/0", OPT_HOST)
                  + request_bytes("POST", "/cn/1", OPT_HOST, body=b"c",
                                  content_type="text/plain"))
        with contextlib.suppress(ssl.SSLWantReadError):
            obj.unwrap()  # close_notify into `out`
        raw.sendall(out.read())
        got = b""
        while time.monotonic() < deadline:
            data = raw.recv(65536)
            if not data:
                break
            got += data
        inc.write(got)
        plain = b""
        with contextlib.suppress(ssl.SSLError):
            while chunk := obj.read(65536):
                plain += chunk
        assert plain.count(b"HTTP/1.1 200 ") == 2, plain
        assert plain.index(b"/cn/0") < plain.index(b"/cn/1")
    finally:
        raw.close()
    settled(env)
    assert requests_total(env) - before == 2


def test_a_chunked_unsealed_call_never_reaches_the_node(env: ServeEnv) -> None:
    """An unsealed call in a chunked body (chunks cutting the JSON anywhere), pipelined
    between good requests, at the seal-required host."""
    body = unsealed_call_body("chunked")
    for pieces in (1, 2, 5, len(body)):
        s = tls_socket(env.serve.port, HOST, timeout=HANG)
        try:
            s.sendall(request_bytes("GET", "/pre", HOST)
                      + (f"POST /mcp HTTP/1.1\r\nHost: {HOST}\r\n"
                         "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n"
                         "\r\n").encode() + chunked(body, pieces)
                      + request_bytes("GET", "/post", HOST))
            assert echoed(read_response(s).body)["target"] == "/pre"
            resp = read_response(s)
            assert resp.status != 200 or refusal_code(resp.body) is not None, resp.body
            assert echoed(read_response(s).body)["target"] == "/post"
        finally:
            forget(s)
    settled(env)
    assert env.node.unsealed_calls() == []
    assert [r.target for r in env.node.requests()] == ["/pre", "/post"] * 4


def test_mcp_bodies_held_by_reset_exchanges_are_given_back(
        env: ServeEnv, evil: HostileNode) -> None:
    """MCP calls with 12 KB bodies (one TLS record each: judged and held in the lane), the
    client resetting while each is at the node: the body shares and the in-flight share
    are given back each time (the address is served in full afterwards)."""
    before = requests_total(env)
    body = rpc("tools/list", {"pad": "p" * 12_000})
    raw = request_bytes("POST", "/mcp?hang", EVIL_HOST, body=body)
    port = env.serve.port
    rounds = 3 * IN_FLIGHT
    for i in range(rounds):
        s = tls_socket(port, EVIL_HOST, source=ATTACKER_IP, timeout=HANG)
        s.sendall(raw)
        assert env.node.wait_for(lambda i=i: evil.seen.count("/mcp?hang") > i)
        reset(s)
    settled(env)
    s = tls_socket(port, EVIL_HOST, source=ATTACKER_IP, timeout=HANG)
    try:
        s.sendall(request_bytes("POST", "/mcp", EVIL_HOST, body=body))
        resp = read_response(s)
        assert resp.status == 200 and echoed(resp.body)["sha256"] == sha(body), resp.body
    finally:
        forget(s)
    full_share_served(env, EVIL_HOST, source=ATTACKER_IP)
    assert requests_total(env) - before == rounds + 1 + IN_FLIGHT


def test_reload_moving_the_route_to_another_node_mid_request(
        env: ServeEnv, evil: HostileNode) -> None:
    """SIGHUP moves EVIL_HOST's backend to the recording node while lane requests are at
    the hostile one (its pool retired under them): each gets its own answer, the next
    requests go to the new node, and nothing stays held."""
    before = requests_total(env)
    old_routes = env.serve.extra_routes
    socks = [tls_socket(env.serve.port, EVIL_HOST, timeout=HANG) for _ in range(3)]
    try:
        for k, s in enumerate(socks):
            s.sendall(request_bytes("GET", f"/slow?s=1&m={k}", EVIL_HOST))
        assert env.node.wait_for(lambda: len(evil.seen) >= 3)
        moved_routes = tarpit_route(EVIL_HOST, env.node.port)
        assert env.serve.reload(extra_routes=moved_routes) == "reloaded"
        for k, s in enumerate(socks):
            resp = read_response(s)
            assert resp.status == 200 and echoed(resp.body)["target"] == f"/slow?s=1&m={k}"
            s.sendall(request_bytes("GET", f"/moved/{k}", EVIL_HOST))
            resp = read_response(s)
            assert resp.status == 200 and echoed(resp.body)["target"] == f"/moved/{k}"
    finally:
        for s in socks:
            forget(s)
        assert env.serve.reload(extra_routes=old_routes) == "reloaded"
    settled(env)
    assert sorted(r.target for r in env.node.requests()) == [f"/moved/{k}" for k in range(3)]
    full_share_served(env, EVIL_HOST)
    assert requests_total(env) - before == 6 + IN_FLIGHT


def test_an_unsealed_call_cannot_borrow_the_optional_routes_connection(
        env: ServeEnv) -> None:
    """On a connection to the seal-optional host, requests naming the seal-required
    host (by Host, by absolute form, both, in case and port variants), pipelined behind
    a good one: none reaches the node as a request for the required host."""
    spellings = [("/mcp", HOST), (f"https://{HOST}/mcp", OPT_HOST),
                 (f"https://{HOST}/mcp", HOST), ("/mcp", HOST.upper()),
                 ("/mcp", f"{HOST}:443"), (f"https://{HOST}:443/mcp", None)]
    for target, host in spellings:
        s = tls_socket(env.serve.port, OPT_HOST, timeout=HANG)
        try:
            s.sendall(request_bytes("GET", "/ok", OPT_HOST)
                      + request_bytes("POST", target, host, body=unsealed_call_body("b")))
            assert echoed(read_response(s).body)["target"] == "/ok"
            with contextlib.suppress(ConnectionError, ssl.SSLError):
                resp = read_response(s)
                assert resp.status != 200, (target, host, resp.body)
        finally:
            forget(s)
    settled(env)
    for r in env.node.requests():
        named = [*r.header_values("host"), r.target]
        assert not any(HOST in v.lower() for v in named), (r.target, r.headers)
    assert [r.target for r in env.node.requests()] == ["/ok"] * len(spellings)


@pytest.mark.parametrize("lag", ["0.01", "0.4"])
def test_a_short_body_that_lags_behind_its_head(env: ServeEnv, evil: HostileNode,
                                                lag: str) -> None:
    """The node's short answer comes head first, body later (within the lane's grace,
    or after it: relayed by the trio engine); pipelined requests behind it are each
    answered with their own, in order."""
    before = requests_total(env)
    s = tls_socket(env.serve.port, EVIL_HOST, timeout=HANG)
    try:
        for i in range(3):
            s.sendall(request_bytes("GET", f"/lagbody?s={lag}&i={i}", EVIL_HOST)
                      + request_bytes("POST", f"/behind/{i}", EVIL_HOST, body=b"%d" % i,
                                      content_type="text/plain"))
            resp = read_response(s)
            assert resp.status == 200
            assert echoed(resp.body)["target"] == f"/lagbody?s={lag}&i={i}"
            got = echoed(read_response(s).body)
            assert (got["target"], got["sha256"]) == (f"/behind/{i}", sha(b"%d" % i))
    finally:
        forget(s)
    settled(env)
    assert requests_total(env) - before == 6
    full_share_served(env, EVIL_HOST)


def test_a_request_pipelined_as_the_last_of_a_slow_answer_leaves_is_answered(
        env: ServeEnv) -> None:
    """A client with a small receive buffer (the lane's answer waits in WRITING) sends
    its next request at every point while reading the answer: the segment that carries
    the request also carries the ACK that lets the rest of the answer out, so readiness
    to write and to read come in one event. The request must still be read and answered
    (it used to wait for an event that never came: the connection hung)."""
    before = requests_total(env)
    made = 0
    for c in range(3):
        s = tls_socket(env.serve.port, OPT_HOST, rcvbuf=2048, timeout=5)
        try:
            s.sendall(request_bytes("GET", f"/big?bytes=60000&c={c}", OPT_HOST))
            made += 1
            for i in range(60):
                reader = _READERS.setdefault(id(s), _Reader(s))
                while len(reader.buf) < 1000 * i:  # part of the answer read, then ...
                    assert reader.fill()
                s.sendall(request_bytes("GET", f"/big?bytes=60000&c={c}&i={i}", OPT_HOST))
                made += 1
                assert len(read_response(s).body) == 60000
            assert len(read_response(s).body) == 60000
        finally:
            forget(s)
    settled(env)
    assert requests_total(env) - before == made
