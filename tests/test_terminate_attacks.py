"""Terminate mode attacked from outside, black-box: the regressions it must never repeat.

Run:   python -m pytest tests/test_terminate_attacks.py -v -s
       (-s shows the numbers: memory before/after, bystander latencies)
CI:    PACT_REQUIRE_TOOLS=1 makes a missing nghttp/h2load/node/curl a failure.
Needs: nghttp2-client (nghttp, h2load), nodejs, curl; Linux (127.0.0.2/.3 source
       addresses on lo, /proc/PID/status).

Every test drives a real `python -m pact_ingress serve` subprocess over real loopback TLS
(tests/terminate_env.py) and asserts only on (a) what the client got on the wire, (b) what
the recording home node received, (c) the admin endpoint (/status) and the process's
/proc facts. Nothing imports the terminate engine: these tests must pass unchanged against
any HTTP engine under terminate mode.

The assertions are invariants (nothing unsealed reaches the node; the node sees the path
the edge checked; counters return to the truth; another client is served), not one
engine's answers.
Every load loop is bounded in count and time; every address is in 127.0.0.0/8; nothing
asserts on timing — a bystander "is served" means it got its 200 within a generous
bounded wait (BYSTANDER_WAIT).
"""

from __future__ import annotations

import hashlib
import json
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import pytest

from pact_ingress.envelope import canonical_json
from pact_ingress.identity import b64url, b64url_decode
from tests.terminate_env import (
    ATTACKER_IP,
    BYSTANDER_IP,
    HOST,
    LOOPBACK,
    OPT_HOST,
    WAIT,
    H2Conn,
    RawResponse,
    Serve,
    closed_by_peer,
    exchange,
    forget,
    gzip_bytes,
    module_fixtures,
    read_response,
    refusal_code,
    request_bytes,
    rpc,
    sealed_call_body,
    tls_socket,
    unsealed_call_body,
    wait_settled,
)
from tests.terminate_env import (
    ServeEnv as Env,
)
from tests.tools import require

#: How long a bystander may wait for its answer while an attack runs (a bound, not a
#: latency target: the broken engine never answers, or answers 504 after ~30 s).
BYSTANDER_WAIT = 12.0


#: One serve + node for the cheap request-level tests (default limits).
shared, env = module_fixtures("attacks")


@pytest.fixture
def fresh(tmp_path: Path) -> Iterator[list[Env]]:
    """For tests that need their own limits or kill/reload the process: `Env.start` into it."""
    envs: list[Env] = []
    yield envs
    for e in envs:
        e.stop()


def _bystander_get(serve: Serve, path: str = "/ok") -> tuple[int, float]:
    """One GET from BYSTANDER_IP on a fresh connection: (status, seconds)."""
    started = time.monotonic()
    sock = tls_socket(serve.port, HOST, source=BYSTANDER_IP, timeout=BYSTANDER_WAIT)
    try:
        sock.sendall(request_bytes("GET", path, HOST))
        return read_response(sock).status, time.monotonic() - started
    finally:
        forget(sock)


def _rst_close(sock: socket.socket) -> None:
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    forget(sock)


def _acceptable_refusal(status: int | None, body: bytes) -> bool:
    """400, 421, or the seal_required refusal (HTTP 200 + JSON-RPC isError)."""
    return status in (400, 421) or (status == 200 and refusal_code(body) == "seal_required")


# === seal bypass by request target ==========================================

#: Request targets that name the MCP endpoint (or something under it) in another
#: spelling; each must be refused (400/421) or checked (seal_required).
BYPASS_TARGETS = [
    f"https://{HOST}/mcp",
    f"http://{HOST}/mcp",
    f"https://{HOST}:443/mcp",
    "/mcp?x=1",
    f"https://{OPT_HOST}/mcp",  # another route's authority (seal: optional)
    "https://other.example/mcp",
    "/mcp/x",
    "/mcp/",
    "/mcp;x",
    "/MCP",
    "/Mcp/x",
    "/%6Dcp",
    "/%6dcp",
    "//mcp",
    "/x/../mcp",
    "/./mcp",
    "*",
]


@pytest.mark.parametrize("target", BYPASS_TARGETS)
def test_seal_bypass_http1_target(env: Env, target: str) -> None:
    resp = exchange(env.serve.port, request_bytes("POST", target, HOST,
                                                  body=unsealed_call_body()))
    assert env.node.requests() == [], (
        f"unsealed tools/call reached the node via {target!r}: "
        f"{[(r.method, r.target) for r in env.node.requests()]}; client got {resp.status_line}")
    assert _acceptable_refusal(resp.status, resp.body), (resp.status_line, resp.body[:200])


@pytest.mark.parametrize("target", BYPASS_TARGETS)
def test_seal_bypass_h2_path(env: Env, target: str) -> None:
    """Same spellings in HTTP/2 `:path` (absolute form and `*` are malformed there: a
    400 or a stream reset is fine, forwarding is not)."""
    conn = H2Conn(env.serve.port, HOST)
    try:
        res = conn.request("POST", target, body=unsealed_call_body(), coalesce=False)
    finally:
        conn.close()
    assert env.node.requests() == [], (
        f"unsealed tools/call reached the node via :path {target!r}: "
        f"{[(r.method, r.target) for r in env.node.requests()]}; client got {res.status}")
    assert (_acceptable_refusal(res.status, res.body) or res.reset is not None
            or res.goaway), (res.status, res.body[:200])


#: Spellings whose checked (normalised) path is exactly /mcp.
SAME_AS_MCP = ["/mcp", f"https://{HOST}/mcp", "/mcp?x=1", "/%6Dcp", "//mcp", "/x/../mcp",
               "/./mcp", "/mcp;x"]


@pytest.mark.parametrize("target", SAME_AS_MCP)
def test_node_receives_the_checked_path(env: Env, target: str) -> None:
    """A permitted call (tools/list) sent to a spelling of /mcp is either refused (4xx) or
    reaches the node at exactly `/mcp` — never the raw target the check did not see."""
    resp = exchange(env.serve.port, request_bytes("POST", target, HOST,
                                                  body=rpc("tools/list", {})))
    seen = [r.target for r in env.node.requests()]
    if 400 <= resp.status < 500:
        assert seen == [], seen
        return
    assert resp.status == 200, resp.status_line
    assert len(seen) == 1 and seen[0].split("?", 1)[0] == "/mcp", (target, seen)
    assert not seen[0].startswith(("http:", "https:")), seen


@pytest.mark.parametrize("content_type", ["application/json", "Application/JSON; charset=utf-8"])
@pytest.mark.parametrize("http2", [False, True], ids=["h1", "h2"])
def test_json_post_off_mcp_path_not_forwarded(env: Env, content_type: str, http2: bool) -> None:
    """On a `seal: required` route a JSON POST to a non-MCP path is refused, not
    forwarded unchecked (a node router may serve it as MCP)."""
    body = unsealed_call_body()
    if http2:
        conn = H2Conn(env.serve.port, HOST)
        try:
            res = conn.request("POST", "/other/endpoint", body=body, content_type=content_type,
                               coalesce=False)
        finally:
            conn.close()
        status, answer = res.status, res.body
    else:
        resp = exchange(env.serve.port, request_bytes("POST", "/other/endpoint", HOST, body=body,
                                                      content_type=content_type))
        status, answer = resp.status, resp.body
    assert env.node.requests() == [], [(r.method, r.target) for r in env.node.requests()]
    assert status is None or status >= 400 or refusal_code(answer) is not None, (status, answer)


@pytest.mark.parametrize("http2", [False, True], ids=["h1", "h2"])
@pytest.mark.parametrize("gzipped", [True, False], ids=["gzip-body", "json-labelled-gzip"])
def test_content_encoding_on_mcp_path_refused(env: Env, http2: bool, gzipped: bool) -> None:
    """Non-identity Content-Encoding on mcp_path → 4xx, not forwarded (a node may inflate
    what the edge checked raw). `gzipped=False`: a raw JSON body labelled gzip."""
    body = rpc("tools/list", {})
    body = gzip_bytes(body) if gzipped else body
    headers = [("content-encoding", "gzip")]
    if http2:
        conn = H2Conn(env.serve.port, HOST)
        try:
            res = conn.request("POST", "/mcp", body=body, headers=headers, coalesce=False)
        finally:
            conn.close()
        status = res.status
    else:
        status = exchange(env.serve.port, request_bytes("POST", "/mcp", HOST, body=body,
                                                        headers=headers)).status
    assert env.node.requests() == [], [(r.target, r.headers) for r in env.node.requests()]
    assert status is not None and 400 <= status < 500, status


def test_huge_ts_is_envelope_invalid(env: Env) -> None:
    """`ts = 10**309` in a sealed header → envelope_invalid, not a 500."""
    # seal() itself refuses such times, so the header is rewritten after sealing: the
    # edge judges the header before any signature, and must refuse it as invalid.
    call = json.loads(sealed_call_body(env.ids, msg_id="huge-ts"))
    args = call["params"]["arguments"]
    header = json.loads(b64url_decode(args["protected"]))
    header.update(ts=10**309, exp=10**309 + 600)
    args["protected"] = b64url(canonical_json(header))
    body = json.dumps(call).encode()
    resp = exchange(env.serve.port, request_bytes("POST", "/mcp", HOST, body=body))
    assert (resp.status, resp.code) == (200, "envelope_invalid"), (resp.status_line, resp.body)
    assert env.node.requests() == []


# === HTTP/2 bodies in the same read as their HEADERS ========================


def _padded_list(size: int) -> bytes:
    """A permitted MCP request (tools/list with a cursor) of about `size` bytes."""
    head = rpc("tools/list", {"cursor": ""})
    return rpc("tools/list", {"cursor": "c" * max(0, size - len(head))})


def _bodies(env: Env) -> dict[str, bytes]:
    return {"small": rpc("tools/list", {}, 7), "padded": _padded_list(40_000),
            "sealed": sealed_call_body(env.ids, msg_id=f"h2-{time.monotonic_ns()}")}


def _node_bodies(env: Env) -> list[tuple[int, str]]:
    return [(len(r.body), hashlib.sha256(r.body).hexdigest()) for r in env.node.requests()
            if r.complete]


def _digest(body: bytes) -> tuple[int, str]:
    return len(body), hashlib.sha256(body).hexdigest()


def test_h2_raw_coalesced_headers_and_data(env: Env) -> None:
    """HEADERS + DATA(END_STREAM) in one sendall (and so one read at the edge)."""
    conn = H2Conn(env.serve.port, HOST)
    try:
        for name, body in _bodies(env).items():
            env.node.clear()
            res = conn.request("POST", "/mcp", body=body)
            assert res.status == 200 and refusal_code(res.body) is None, (name, res)
            assert _node_bodies(env) == [_digest(body)], name
    finally:
        conn.close()


def test_nghttp_body_arrives_whole(env: Env, tmp_path: Path) -> None:
    nghttp = require("nghttp")
    for name, body in _bodies(env).items():
        env.node.clear()
        path = tmp_path / f"{name}.json"
        path.write_bytes(body)
        proc = subprocess.run(
            [nghttp, "-d", str(path), "-H", f":authority: {HOST}",
             "-H", "content-type: application/json",
             f"https://{LOOPBACK}:{env.serve.port}/mcp"],
            capture_output=True, timeout=30, check=False)
        assert env.node.wait_for(lambda: bool(_node_bodies(env)), 5), (
            f"{name}: nothing reached the node; nghttp got {proc.stdout[:200]!r}")
        assert _node_bodies(env) == [_digest(body)], (name, proc.stdout[:300])
        assert refusal_code(proc.stdout) is None and b'"result"' in proc.stdout, proc.stdout[:300]


def test_h2load_bodies_arrive_whole(env: Env, tmp_path: Path) -> None:
    h2load = require("h2load")
    body = _padded_list(20_000)
    path = tmp_path / "body.json"
    path.write_bytes(body)
    proc = subprocess.run(
        [h2load, "-n", "20", "-c", "2", "-d", str(path), "-H", "content-type: application/json",
         f"--connect-to={LOOPBACK}:{env.serve.port}", f"https://{HOST}/mcp"],
        capture_output=True, text=True, timeout=60, check=False)
    assert "20 succeeded" in proc.stdout, proc.stdout[-800:]
    env.node.wait_for(lambda: len(_node_bodies(env)) >= 20, 5)
    got = _node_bodies(env)
    assert got == [_digest(body)] * 20, (len(got), {g[0] for g in got})
    assert "status codes: 20 2xx" in proc.stdout, proc.stdout[-800:]


NODE_H2_CLIENT = r"""
const http2 = require('http2'), tls = require('tls'), fs = require('fs');
const [port, host, ...files] = process.argv.slice(1);
const client = http2.connect(`https://${host}:${port}`, {
  createConnection: () => tls.connect({host: '127.0.0.1', port: Number(port), servername: host,
                                       ALPNProtocols: ['h2'], rejectUnauthorized: false})});
const out = [];
let left = files.length;
for (const f of files) {
  const req = client.request({':method': 'POST', ':path': '/mcp',
                              'content-type': 'application/json'});
  let status = null, data = '';
  req.on('response', h => { status = h[':status']; });
  req.on('data', c => { data += c; });
  req.on('close', () => {
    out.push({file: f, status, data});
    if (--left === 0) { console.log(JSON.stringify(out)); client.close(); }
  });
  req.end(fs.readFileSync(f));
}
setTimeout(() => { console.log(JSON.stringify(out)); process.exit(3); }, 20000).unref();
"""


def test_node_http2_client_body_arrives_whole(env: Env, tmp_path: Path) -> None:
    node_bin = require("node")
    bodies = _bodies(env)
    files = []
    for name, body in bodies.items():
        (tmp_path / f"{name}.json").write_bytes(body)
        files.append(str(tmp_path / f"{name}.json"))
    proc = subprocess.run([node_bin, "-e", NODE_H2_CLIENT, str(env.serve.port), HOST, *files],
                          capture_output=True, text=True, timeout=60, check=False)
    answers = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.stdout.strip() else []
    assert [a["status"] for a in answers] == [200] * 3, (answers, proc.stderr[-500:])
    assert all(refusal_code(a["data"].encode()) is None for a in answers), answers
    assert sorted(_node_bodies(env)) == sorted(_digest(b) for b in bodies.values())


# === pipelined request + disconnect leaks the connection slot ================


@pytest.mark.parametrize("how", ["fin", "rst"])
def test_pipelined_abort_frees_slots(fresh: list[Env], tmp_path: Path, how: str) -> None:
    clients = 20
    env = Env.start(tmp_path, limits={"max_connections_per_ip": clients, "idle_timeout": "30s"})
    fresh.append(env)
    socks = []
    # Two attacker addresses: one address may only hold a tenth of the route's upstream
    # share at once (its further requests get 429), and each of these streams holds one.
    sources = (ATTACKER_IP, "127.0.0.4")
    for i in range(clients):
        s = tls_socket(env.serve.port, HOST, source=sources[i % 2])
        s.sendall(request_bytes("GET", "/stream?n=600&interval=0.05", HOST)
                  + request_bytes("GET", f"/second-{i}", HOST))
        head = read_response(s, head_only=True)  # the first response is streaming now
        assert head.status == 200, head.status_line
        socks.append(s)
    assert env.node.wait_for(lambda: env.node.active_streams == clients, 10)
    for s in socks:
        if how == "rst":
            _rst_close(s)
        else:
            s.shutdown(socket.SHUT_RDWR)  # FIN, no close_notify
            forget(s)
    left = env.serve.wait_open_connections(0, timeout=10)
    print(f"\n[pipelined-{how}] open_connections after {clients} aborts: {left}; "
          f"node streams still open: {env.node.active_streams}")
    assert left == 0, f"{left} connection slots leaked"
    assert env.node.wait_for(lambda: env.node.active_streams == 0, 10), (
        f"{env.node.active_streams} upstream streams left running")
    # the attacker's own per-IP slots are back: a new connection from it is served
    status, _ = _bystander_get(env.serve)
    assert status == 200
    resp = exchange(env.serve.port, request_bytes("GET", "/after", HOST), source=ATTACKER_IP)
    assert resp.status == 200
    assert "/second-" not in " ".join(r.target for r in env.node.requests())


# === one IP takes a route down (slow bodies, slow readers) ===================


def _hold_open(serve: Serve, count: int, make: str) -> list[socket.socket]:
    socks = []
    for i in range(count):
        try:
            s = tls_socket(serve.port, HOST, source=ATTACKER_IP,
                           rcvbuf=4096 if make == "slow-read" else None)
        except OSError:
            break  # refused at accept (a per-IP cap): fine, that is a defence
        if make == "slow-body":
            path, ctype = ("/mcp", "application/json") if i % 5 == 4 else (
                "/upload", "application/octet-stream")
            s.sendall(request_bytes("POST", path, HOST, content_type=ctype, length=False,
                                    headers=[("Content-Length", "5000000")]) + b"{")
        else:
            s.sendall(request_bytes("GET", "/big?bytes=268435456", HOST))
        socks.append(s)
    return socks


@pytest.mark.parametrize("attack", ["slow-body", "slow-read"])
def test_one_ip_cannot_take_the_route_down(fresh: list[Env], tmp_path: Path,
                                           attack: str) -> None:
    """Slow connections from 127.0.0.2, more than a route's upstream pool holds (slow
    body: 160, four in five to a non-MCP path, the rest trickling a body to mcp_path;
    slow read: 120 big downloads never read); while they hang, a client from 127.0.0.3
    is served; after they close, the counters return to zero."""
    env = Env.start(tmp_path)
    fresh.append(env)
    count = 160 if attack == "slow-body" else 120
    socks = _hold_open(env.serve, count, attack)
    stop = threading.Event()

    def trickle() -> None:  # slow body: one byte per socket per second, bounded
        for _ in range(60):
            if stop.wait(1.0):
                return
            for s in socks:
                try:
                    s.send(b" ")
                except OSError:
                    pass

    trickler = threading.Thread(target=trickle, daemon=True)
    if attack == "slow-body":
        trickler.start()
    try:
        # let the attack settle: the node sees what the edge let through (bounded wait)
        wait_settled(lambda: len(env.node.requests()), 100, 10)
        held = len(env.node.requests())
        try:
            status, took = _bystander_get(env.serve)
        except (OSError, ConnectionError) as exc:
            status, took = None, float("nan")
            print(f"bystander failed: {exc!r}")
        print(f"\n[{attack}] attacker connections {len(socks)}, node saw {held} of them; "
              f"bystander from {BYSTANDER_IP}: status {status} after {took:.2f} s")
        assert status == 200, f"bystander not served while {attack} from one IP: {status}"
    finally:
        stop.set()
        for s in socks:
            _rst_close(s)
    left = env.serve.wait_open_connections(0)
    assert left == 0, f"{left} connection slots left after the {attack} run"
    assert env.node.wait_for(lambda: env.node.active_streams == 0, 10)
    assert _bystander_get(env.serve)[0] == 200


# === big bodies in parallel, refusal floods ==================================


def _big_mcp_body(size: int) -> bytes:
    """An unsealed tools/call whose arguments are ~`size` bytes of small JSON objects
    (the expensive kind to parse)."""
    item = {"k": 1, "v": "x"}
    one = len(json.dumps(item)) + 2
    items = [item] * (size // one)
    return unsealed_call_body().replace(b'"text": "unsealed"', b'"text": "unsealed", "items": '
                                        + json.dumps(items).encode())


def test_big_bodies_in_parallel(fresh: list[Env], tmp_path: Path) -> None:
    """60 connections from one IP each POST ~5 MiB to mcp_path (under max_body_bytes):
    a client from another IP is served throughout, nothing reaches the node, and the
    process's memory stays bounded (peak and after)."""
    env = Env.start(tmp_path)
    fresh.append(env)
    assert _bystander_get(env.serve)[0] == 200  # warm up
    body = _big_mcp_body(5 * 1024 * 1024)
    base_rss, base_hwm = env.serve.rss_kib(), env.serve.proc_status("VmHWM")
    results: list[object] = []

    def attacker() -> None:
        try:
            s = tls_socket(env.serve.port, HOST, source=ATTACKER_IP, timeout=60)
        except OSError as exc:
            results.append(f"refused at connect: {exc!r}")
            return
        try:
            s.sendall(request_bytes("POST", "/mcp", HOST, body=body))
            resp = read_response(s)
            results.append((resp.status, resp.code))
        except (OSError, ConnectionError) as exc:
            results.append(f"dropped: {exc!r}")
        finally:
            forget(s)

    threads = [threading.Thread(target=attacker, daemon=True) for _ in range(60)]
    for t in threads:
        t.start()
    latencies, statuses = [], []
    deadline = time.monotonic() + 90
    while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
        try:
            status, took = _bystander_get(env.serve)
        except (OSError, ConnectionError):
            status, took = None, BYSTANDER_WAIT
        statuses.append(status)
        latencies.append(took)
        time.sleep(0.2)
    for t in threads:
        t.join(timeout=max(0.0, deadline - time.monotonic()))
    rss, hwm = env.serve.rss_kib(), env.serve.proc_status("VmHWM")
    print(f"\n[big-bodies] 60 x {len(body) / 2**20:.1f} MiB from {ATTACKER_IP}: "
          f"RSS {base_rss / 1024:.0f} -> {rss / 1024:.0f} MiB, peak {base_hwm / 1024:.0f} -> "
          f"{hwm / 1024:.0f} MiB; bystander {len(statuses)} requests, statuses "
          f"{sorted(set(map(str, statuses)))}, latency max {max(latencies, default=0):.2f} s")
    print(f"[big-bodies] attacker answers: "
          f"{sorted({str(r) for r in results})[:8]}")
    assert env.node.unsealed_calls() == []
    assert statuses and all(s == 200 for s in statuses), statuses
    # generous bounds: ~300 MiB of bodies were offered; buffering them all (or keeping
    # them) is the bug. A per-IP/per-process buffer budget keeps both far below.
    assert (hwm - base_rss) < 200 * 1024, f"peak grew by {(hwm - base_rss) // 1024} MiB"
    assert (rss - base_rss) < 100 * 1024, f"RSS stayed {(rss - base_rss) // 1024} MiB up"
    assert env.serve.wait_open_connections(0) == 0


def test_refusal_flood_is_charged_to_the_limiter(fresh: list[Env], tmp_path: Path) -> None:
    """400 refused requests from one IP (unsealed calls, bad envelopes, non-JSON): with
    calls_per_hour_per_ip 30 the flood must hit rate_limited / 429 — refusals are charged."""
    budget = 30
    env = Env.start(tmp_path, limits={"calls_per_hour_per_ip": budget})
    fresh.append(env)
    bad_envelope = rpc("tools/call", {"name": "sealed_call", "arguments": {
        "protected": "x", "enc": "x", "ct": "x", "sig": "x"}})
    kinds = [unsealed_call_body(), bad_envelope, b"{not json"]
    answers: list[str] = []
    sock = None
    deadline = time.monotonic() + 60
    for i in range(400):
        if time.monotonic() > deadline:
            break
        if sock is None:
            sock = tls_socket(env.serve.port, HOST, source=ATTACKER_IP)
        try:
            sock.sendall(request_bytes("POST", "/mcp", HOST, body=kinds[i % 3]))
            resp = read_response(sock)
        except (OSError, ConnectionError):
            forget(sock)
            sock = None
            answers.append("dropped")
            continue
        limited = resp.status == 429 or resp.code == "rate_limited"
        answers.append("limited" if limited else f"{resp.status}:{resp.code}")
        if (resp.header("connection") or "").lower() == "close":
            forget(sock)
            sock = None
    if sock is not None:
        forget(sock)
    tally = {a: answers.count(a) for a in sorted(set(answers))}
    print(f"\n[refusal-flood] {len(answers)} requests: {tally}")
    assert env.node.requests() == []
    not_limited = len(answers) - answers.count("limited") - answers.count("dropped")
    assert answers.count("limited") > 0, f"400 refusals never charged: {tally}"
    assert not_limited <= 2 * budget, f"{not_limited} refusals answered beyond the budget"
    assert _bystander_get(env.serve)[0] == 200


# === HTTP/1.1 framing ========================================================

SMUGGLED = request_bytes("GET", "/smuggled", HOST)


def _framing(env: Env, head: bytes, body: bytes) -> tuple[RawResponse | None, bool]:
    sock = tls_socket(env.serve.port, HOST)
    try:
        sock.sendall(head + body)
        try:
            resp = read_response(sock)
        except ConnectionError:
            return None, True
        return resp, closed_by_peer(sock)
    finally:
        forget(sock)


FRAMING_CASES = {
    "cl-and-te": ((b"POST /upload HTTP/1.1\r\nHost: %s\r\nContent-Type: application/octet-stream"
                  b"\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n"), b"0\r\n\r\n"),
    "te-and-cl": ((b"POST /upload HTTP/1.1\r\nHost: %s\r\nTransfer-Encoding: chunked\r\n"
                  b"Content-Length: 5\r\n\r\n"), b"0\r\n\r\n"),
    "cl-and-te-mcp": ((b"POST /mcp HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n"), b"0\r\n\r\n"),
    "folded-te": ((b"POST /upload HTTP/1.1\r\nHost: %s\r\nContent-Type: text/plain\r\n"
                  b"Transfer-Encoding:\r\n chunked\r\n\r\n"), b"0\r\n\r\n"),
    "folded-te-and-cl": ((b"POST /upload HTTP/1.1\r\nHost: %s\r\nContent-Length: 5\r\n"
                         b"Transfer-Encoding:\r\n chunked\r\n\r\n"), b"0\r\n\r\n"),
    "duplicate-cl": ((b"POST /upload HTTP/1.1\r\nHost: %s\r\nContent-Length: 5\r\n"
                     b"Content-Length: 46\r\n\r\n"), b"hello"),
    "cl-list": (b"POST /upload HTTP/1.1\r\nHost: %s\r\nContent-Length: 5, 46\r\n\r\n", b"hello"),
}


@pytest.mark.parametrize("case", list(FRAMING_CASES))
def test_ambiguous_framing_is_400_and_close(env: Env, case: str) -> None:
    """RFC 9112 §6.1/§6.3: ambiguous framing → 400 and the connection closed; nothing
    (and above all no smuggled second request) reaches the node."""
    head, body = FRAMING_CASES[case]
    resp, closed = _framing(env, head % HOST.encode(), body + SMUGGLED)
    time.sleep(0.3)  # let a smuggled request (if any) arrive before we look
    targets = [r.target for r in env.node.requests()]
    assert "/smuggled" not in targets, f"smuggled request reached the node: {targets}"
    assert targets == [], targets
    assert resp is None or resp.status == 400, resp.status_line
    assert closed, "connection kept open after ambiguous framing"


# === header hygiene, reason phrase ===========================================

SPOOFED = [("X-Forwarded-For", "6.6.6.6"), ("x_forwarded_for", "6.6.6.6"),
           ("X-Forwarded-Host", "evil.example"), ("x-pact_caller", "sha256:forged"),
           ("X-Pact-Caller", "sha256:forged"), ("X-Pact-Anything", "y"),
           ("X-Client-IP", "6.6.6.6"), ("x_client_ip", "6.6.6.6"),
           ("True-Client-IP", "6.6.6.6"), ("X-Real-IP", "6.6.6.6"), ("x_real_ip", "6.6.6.6"),
           ("Forwarded", "for=6.6.6.6;proto=http"), ("X-Original-URL", "/admin"),
           ("X-Rewrite-URL", "/admin"), ("X-Custom", "kept")]


def _names_seen(headers: list[tuple[str, str]]) -> set[str]:
    return {k.lower().replace("_", "-") for k, _ in headers}


@pytest.mark.parametrize("http2", [False, True], ids=["h1", "h2"])
def test_spoofable_headers_never_reach_node(env: Env, http2: bool) -> None:
    if http2:
        conn = H2Conn(env.serve.port, HOST, source=ATTACKER_IP)
        try:
            res = conn.request("GET", "/headers", headers=[(k.lower(), v) for k, v in SPOOFED])
        finally:
            conn.close()
        assert res.status == 200, res
    else:
        resp = exchange(env.serve.port, request_bytes("GET", "/headers", HOST, headers=SPOOFED),
                        source=ATTACKER_IP)
        assert resp.status == 200, resp.status_line
    [seen] = env.node.requests()
    names = _names_seen(seen.headers)
    leaked = names & {"x-forwarded-for", "x-forwarded-host", "x-pact-caller", "x-pact-anything",
                      "x-client-ip", "true-client-ip", "x-real-ip", "x-original-url",
                      "x-rewrite-url"}
    assert not leaked, f"spoofable headers reached the node: {sorted(leaked)}"
    assert not any("_" in k for k, _ in seen.headers), seen.headers
    assert seen.header_values("forwarded") == [f"for={ATTACKER_IP};proto=https;host={HOST}"]
    assert seen.header_values("x-custom") == ["kept"]
    assert seen.peer == env.ids.ingress.fingerprint


def test_status_line_has_reason_phrase(env: Env) -> None:
    resp = exchange(env.serve.port, request_bytes("GET", "/ok", HOST))
    assert resp.status == 200
    assert resp.status_line == "HTTP/1.1 200 OK", repr(resp.status_line)
    refused = exchange(env.serve.port, request_bytes("POST", "/mcp", HOST, body=b"{bad"))
    assert refused.status == 400 and refused.reason.strip(), repr(refused.status_line)


# === reload applies to open connections, and never kills the process ==========


@pytest.mark.parametrize("http2", [True, False], ids=["h2", "h1"])
def test_reload_applies_to_open_connection(fresh: list[Env], tmp_path: Path,
                                           http2: bool) -> None:
    """An open connection on a `seal: optional` route; the route becomes `required` and
    SIGHUP; the next unsealed call on the SAME connection is refused (seal_required) — or
    the stream/connection is refused outright — and the node sees nothing."""
    env = Env.start(tmp_path)
    fresh.append(env)
    h2c = H2Conn(env.serve.port, OPT_HOST) if http2 else None
    sock = None if http2 else tls_socket(env.serve.port, OPT_HOST)

    def call(n: int) -> tuple[int | None, bytes, bool]:
        body = unsealed_call_body(rpc_id=n)
        if h2c is not None:
            res = h2c.request("POST", "/mcp", body=body, coalesce=False)
            return res.status, res.body, res.reset is not None or res.goaway
        assert sock is not None
        sock.sendall(request_bytes("POST", "/mcp", OPT_HOST, body=body))
        try:
            resp = read_response(sock)
        except (OSError, ConnectionError):
            return None, b"", True
        return resp.status, resp.body, False

    try:
        status, body, _ = call(1)
        assert status == 200 and refusal_code(body) is None, body  # optional: forwarded
        assert len(env.node.unsealed_calls()) == 1
        env.node.clear()
        assert env.serve.reload(opt_seal="required") == "reloaded"
        status, body, refused_outright = call(2)
        assert env.node.unsealed_calls() == [], "old route judged a request after reload"
        assert refused_outright or (status, refusal_code(body)) == (200, "seal_required"), (
            status, body)
    finally:
        if h2c is not None:
            h2c.close()
        if sock is not None:
            forget(sock)


def test_reload_with_unusable_cert_path_keeps_serving(fresh: list[Env], tmp_path: Path) -> None:
    """A config check-config accepts but whose cert directory is a file: the reload is
    refused or applied, and the process keeps serving."""
    env = Env.start(tmp_path)
    fresh.append(env)
    (tmp_path / "blocker").write_text("not a directory\n")
    text = env.serve.render() + """\
      - host: crash.attack.test
        mode: terminate
        backend: "127.0.0.1:9"
        seal: required
        cert: {cert: blocker/crash.crt, key: blocker/crash.key}
"""
    env.serve.config.write_text(text)
    check = subprocess.run([sys.executable, "-m", "pact_ingress", "check-config", "-c",
                            str(env.serve.config)], capture_output=True, text=True,
                           timeout=60, check=False)
    outcome = env.serve.reload(text)
    print(f"\n[reload-bad-cert-dir] check-config rc={check.returncode}; reload: {outcome}")
    assert env.serve.alive(), f"reload killed the process: {env.serve.logs()[-2000:]}"
    assert outcome in ("reloaded", "reload_refused"), outcome
    assert exchange(env.serve.port, request_bytes("GET", "/ok", HOST)).status == 200


# === HTTP/2 frames that cost the client nothing: floods end the connection ===========


def _h2_flood(port: int, frames: Callable[[h2.connection.H2Connection], None]) -> int | None:
    """Open an h2 connection, let `frames` queue a flood, send it, and read until the
    edge ends the connection; the GOAWAY error code it sent, or None."""
    sock = tls_socket(port, HOST, source=ATTACKER_IP, alpn=("h2",))
    conn = h2.connection.H2Connection(h2.config.H2Configuration(
        client_side=True, header_encoding=None, validate_inbound_headers=False))
    conn.initiate_connection()
    frames(conn)
    try:
        sock.sendall(conn.data_to_send())
    except OSError:
        pass  # the edge may close before taking it all
    sock.settimeout(WAIT)
    deadline = time.monotonic() + WAIT
    try:
        while time.monotonic() < deadline:
            data = sock.recv(65536)
            if not data:
                return None
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.ConnectionTerminated):
                    return int(event.error_code)
    except (OSError, h2.exceptions.ProtocolError):
        return None
    finally:
        sock.close()
    return None


def _rapid_reset(conn: h2.connection.H2Connection) -> None:
    for _ in range(1000):  # bounded: far over the per-connection reset allowance
        sid = conn.get_next_available_stream_id()
        conn.send_headers(sid, [(b":method", b"GET"), (b":scheme", b"https"),
                                (b":authority", HOST.encode()), (b":path", b"/rapid")])
        conn.reset_stream(sid)


def _ping_flood(conn: h2.connection.H2Connection) -> None:
    for i in range(1000):
        conn.ping(i.to_bytes(8, "big"))


def _window_update_flood(conn: h2.connection.H2Connection) -> None:
    for _ in range(3000):  # no data was sent to explain any of them
        conn.increment_flow_control_window(1)


def _unknown_frame_flood(conn: h2.connection.H2Connection) -> None:
    # type 0x21 is unassigned: a receiver must ignore it (RFC 9113 §4.1), not for free
    frame = (0).to_bytes(3, "big") + bytes([0x21, 0]) + (0).to_bytes(4, "big")
    conn._data_to_send += frame * 3000  # h2 has no API to send an unknown frame type


@pytest.mark.parametrize(("kind", "frames"), [
    ("reset", _rapid_reset), ("ping", _ping_flood), ("window_update", _window_update_flood),
    ("unknown", _unknown_frame_flood)])
def test_h2_floods_end_the_connection(env: Env, kind: str,
                                      frames: Callable[[h2.connection.H2Connection], None]) -> None:
    assert _h2_flood(env.serve.port, frames) == h2.errors.ErrorCodes.ENHANCE_YOUR_CALM
    assert f'kind="{kind}"' in env.serve.metrics()
    # the flood cost the node (almost) nothing and a bystander is served
    assert len([r for r in env.node.requests() if r.path == "/rapid"]) <= 200
    status, _ = _bystander_get(env.serve)
    assert status == 200


def _request_lines(serve: Serve, marker: str, want: int) -> list[dict[str, object]]:
    """The `request` log lines whose path carries `marker`, once `want` of them arrived
    (workers write their own lines; a bounded wait, not a timing assert)."""
    deadline = time.monotonic() + BYSTANDER_WAIT
    while True:
        lines = [json.loads(line) for line in serve.logs().splitlines()
                 if line.startswith("{") and '"event":"request"' in line]
        found = [line for line in lines if marker in str(line.get("path", ""))]
        if len(found) >= want or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def test_access_log_line_per_request(env: Env) -> None:
    """Every request, forwarded or refused at the edge, on either HTTP version, leaves one
    `request` line with its status — and nothing of the query or the body."""
    secret_query, secret_body = "token=QSECRET7", "BSECRET7"
    ok = exchange(env.serve.port, request_bytes("GET", f"/logged-ok?{secret_query}", HOST))
    refused = exchange(env.serve.port, request_bytes(
        "POST", "/mcp/logged-refused?x=1", HOST, body=unsealed_call_body(secret_body)))
    conn = H2Conn(env.serve.port, HOST)
    try:
        h2_ok = conn.request("GET", "/logged-h2")
    finally:
        conn.close()
    assert (ok.status, h2_ok.status) == (200, 200)
    assert refusal_code(refused.body) == "seal_required", refused.body[:200]
    got = {}
    for marker, status in (("/logged-ok", ok.status), ("/mcp/logged-refused", refused.status),
                           ("/logged-h2", h2_ok.status)):
        lines = _request_lines(env.serve, marker, 1)
        assert lines, f"no request line for {marker}"
        got[marker] = lines[-1]
        assert lines[-1]["status"] == status and lines[-1]["route"] == HOST, lines[-1]
        assert lines[-1]["client_ip"] == LOOPBACK, lines[-1]
    assert got["/logged-ok"]["path"] == "/logged-ok" and got["/logged-ok"]["method"] == "GET"
    assert got["/mcp/logged-refused"]["method"] == "POST"
    logs = env.serve.logs()
    assert "QSECRET7" not in logs and secret_body not in logs


def test_raising_a_budget_by_reload_frees_a_throttled_client(fresh: list[Env],
                                                             tmp_path: Path) -> None:
    """An operator raises a small call budget to let a throttled client back in: the
    next call after the reload is served. (What the client spent was carried over as
    time measured in the old rate's intervals: at 2 calls an hour that kept it refused
    for most of an hour whatever the new budget.)"""
    small = {"calls_per_hour_per_ip": 2, "calls_per_hour_per_ip_key": 2}
    env = Env.start(tmp_path, limits=small)
    fresh.append(env)

    def call(n: int) -> str | None:
        resp = exchange(env.serve.port, request_bytes("POST", "/mcp", OPT_HOST,
                                                      body=unsealed_call_body(rpc_id=n)),
                        host=OPT_HOST)
        assert resp.status in (200, 429), resp.status_line
        return refusal_code(resp.body)

    assert [call(n) for n in range(3)] == [None, None, "rate_limited"]
    assert len(env.node.unsealed_calls()) == 2
    big = {"calls_per_hour_per_ip": 1000, "calls_per_hour_per_ip_key": 1000}
    assert env.serve.reload(limits=big) == "reloaded"
    assert [call(n) for n in range(3, 6)] == [None, None, None]
    assert len(env.node.unsealed_calls()) == 5
