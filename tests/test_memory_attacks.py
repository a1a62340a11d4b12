"""Memory and buffers of a real `serve` process under hostile clients.

Every attack here runs against one `pact-ingress serve --workers 1` (one process, so its
VmRSS is the whole instance) over real sockets on loopback, bounded in count and time.
Each test reads the process's resident set before the attack and after it (once it has
settled: sampled until two readings a moment apart agree), and asserts that the growth
stays under a bound worked out from the caps the edge advertises or enforces, written
next to each test. Python keeps freed memory in its own arenas, so "after" is close to
the high-water mark of the attack: the bounds are about what an attack can make the
process hold, not about what it gives back. Afterwards a measuring client from another
address is still served and the counters come back to the truth (no connection left
counted, no tunnel stream, no relay item beyond the caps).
"""

from __future__ import annotations

import contextlib
import json
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.terminate_env import (
    ATTACKER_IP,
    BYSTANDER_IP,
    HOST,
    LOOPBACK,
    OPT_HOST,
    WAIT,
    ServeEnv,
    closed_by_peer,
    exchange,
    forget,
    request_bytes,
    rpc,
    tarpit_route,
    tls_socket,
)
from tests.test_h2_attacks import (
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    FLOW_CONTROL_ERROR,
    GOAWAY,
    HEADERS,
    PING,
    RST_STREAM,
    WINDOW_UPDATE,
    Raw,
    frame,
    settings,
    u32,
)

KIB = 1024
MIB = 1024 * KIB
#: What the process may grow by on top of each test's own budget: allocator slack,
#: import-on-first-use of code paths the warm-up did not take, prometheus label sets.
SLACK_KIB = 16 * KIB

#: The caps these bounds are derived from, as the README states them (written here so a
#: change to the code's values does not silently loosen a test).
H2_MAX_STREAMS = 100  # SETTINGS_MAX_CONCURRENT_STREAMS
H2_MAX_HEADER_LIST = 16 * KIB  # SETTINGS_MAX_HEADER_LIST_SIZE
H2_CONN_WINDOW = 65535  # the connection receive window every client starts with
H2_STREAM_WINDOW = 65535  # SETTINGS_INITIAL_WINDOW_SIZE: a stream's receive window
#: The connection receive window the edge raises it to at once (one WINDOW_UPDATE):
#: every stream's window, so streams that wait cannot hold all of it.
H2_CONN_WINDOW_RAISED = H2_MAX_STREAMS * H2_STREAM_WINDOW
#: Queue entries an HTTP/2 stream's unread body may take (payloads under 1 KiB gather in
#: runs of up to 16 KiB: 63 payloads of 1 KiB or more, 64 runs around them, 3 full
#: runs), and a generous figure for each entry's objects.
H2_STREAM_ENTRIES = 130
H2_ENTRY = 256
H2_OUTBOX = 64 * KIB  # FLUSH_BYTES: queued frames before whoever queues more waits
READ_BUF = 64 * KIB  # a TLS read (client side and upstream side)
PER_CLIENT_BUFFER = 18 * MIB  # MCP bodies buffered for one client address
MAX_JSON_VALUES = 256 * KIB  # counted values an MCP body may hold (terminate and relay)
#: A terminate TLS connection's own cost (socket, OpenSSL SSL object and its BIOs, the
#: HTTP leg's task and state): a generous figure, well above the idle bench's measure.
PER_CONNECTION = 128 * KIB

LIMITS = {"calls_per_hour_per_ip_key": 10**6, "calls_per_hour_per_ip": 10**6}


#: A terminate route whose node accepts no connection (the edge's connect waits in the
#: listener's backlog): a request there never has its body taken by the node.
TARPIT_HOST = "tarpit.memory.test"
#: The same node, on a route whose in-flight share holds a whole connection's streams:
#: every upload there waits for the node instead of being refused (429).
WIDE_TARPIT_HOST = "wide.tarpit.memory.test"


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeEnv]:
    with socket.create_server((LOOPBACK, 0), backlog=64) as tarpit:
        route = tarpit_route(TARPIT_HOST, tarpit.getsockname()[1], "{max_body_bytes: 1GiB}")
        route += tarpit_route(WIDE_TARPIT_HOST, tarpit.getsockname()[1],
                              "{max_body_bytes: 1GiB, max_requests_in_flight_per_ip: 400}")
        env = ServeEnv.start(tmp_path_factory.mktemp("memory"), workers=1, limits=LIMITS,
                             extra_routes=route)
        try:
            for _ in range(20):  # warm up the code paths every test takes
                assert _measure(env) == 200
            yield env
        finally:
            env.stop()


@pytest.fixture
def env(shared: ServeEnv) -> Iterator[ServeEnv]:
    env = shared.fresh()
    yield env
    # after every attack: the measuring client is served, no connection is left counted
    assert _measure(env) == 200
    assert env.serve.wait_open_connections(0) == 0
    _attacker_share_is_whole(env)
    assert "Traceback" not in env.serve.logs()


def _attacker_share_is_whole(env: ServeEnv) -> None:
    """The attacker's address holds nothing any more: all of its in-flight share
    (`max_requests_in_flight_per_ip`, 16) is there for 16 overlapping requests, and
    nothing is left at the node."""
    assert env.node.wait_for(lambda: env.node.active_streams == 0), env.node.active_streams
    c = _h2(env)
    try:
        sids = range(1, 33, 2)
        c.send(*(c.headers(sid, "/stream?n=2&interval=0.3") for sid in sids))
        statuses = [c.answer(sid)[0] for sid in sids]
    finally:
        c.close()
    assert statuses == [200] * 16, statuses


def _measure(env: ServeEnv) -> int:
    """The measuring client: one HTTP/1.1 request and one HTTP/2 request from the
    bystander's address; the HTTP/1.1 status if both got 200."""
    r = exchange(env.serve.port, request_bytes("GET", "/measure", HOST), source=BYSTANDER_IP)
    c = Raw(env, source=BYSTANDER_IP)
    try:
        c.send(c.headers(1, "/measure2"))
        status2 = c.answer(1)[0]
    finally:
        c.close()
    assert status2 == 200, status2
    return r.status


def settled_rss(env: ServeEnv, timeout: float = 5.0) -> int:
    """VmRSS (KiB) once two readings 0.3 s apart differ by less than 256 KiB."""
    deadline = time.monotonic() + timeout
    last = env.serve.rss_kib()
    while time.monotonic() < deadline:
        time.sleep(0.3)
        now = env.serve.rss_kib()
        if abs(now - last) < 256:
            return now
        last = now
    return last


def _report(name: str, before: int, during: int | None, after: int, bound: int) -> None:
    print(f"\n[mem] {name}: RSS before {before / 1024:.1f} MiB, "
          + (f"during {during / 1024:.1f} MiB, " if during is not None else "")
          + f"after {after / 1024:.1f} MiB, bound +{bound / 1024:.1f} MiB")


def _check(name: str, before: int, during: int | None, after: int, bound_kib: int) -> None:
    _report(name, before, during, after, bound_kib)
    peak = max(after, during or 0)
    assert peak - before < bound_kib, (
        f"{name}: grew by {(peak - before) / 1024:.1f} MiB, bound {bound_kib / 1024:.1f} MiB")


def _drain(c: Raw, rounds: int = 64) -> None:
    """Read what the edge has sent so far: reads until one finds nothing (bounded)."""
    for _ in range(rounds):
        before = (len(c.frames), len(c.buf))
        if not c.read(0.005) or (len(c.frames), len(c.buf)) == before:
            return


def _h2(env: ServeEnv, source: str = ATTACKER_IP, first: bytes | None = None,
        host: str = HOST) -> Raw:
    return Raw(env, source=source, first=first, host=host)


# === HTTP/2 =============================================================================


def _fat_fields(tag: int, budget: int = H2_MAX_HEADER_LIST - 1024) -> list[tuple[bytes, bytes]]:
    """Regular fields filling `budget` of the header list (each field counts its name,
    its value and 32), distinct per `tag` so nothing is shared between streams."""
    out = []
    used = 0
    i = 0
    while True:
        name = f"x-fat-{i}".encode()
        value = (f"{tag:08d}-{i:04d}-".encode() * 100)[:960]
        size = len(name) + len(value) + 32
        if used + size > budget:
            return out
        out.append((name, value))
        used += size
        i += 1


def test_h2_full_header_lists_on_streams_never_finished(env: ServeEnv) -> None:
    """Four connections, each opening the 100 streams it may with a header list just
    under SETTINGS_MAX_HEADER_LIST_SIZE, none ever ending (no END_STREAM, no DATA).

    Bound: what such a stream can make the edge hold is its decoded header list (≤ 16 KiB
    of names and values) and the request built from it; take three copies of that to cover
    the decoded list, the checked request and the upstream head (some streams reach the
    node: 16 in flight per address), plus a connection's own cost:
    4 × (100 × 3 × 16 KiB + 128 KiB) ≈ 19.3 MiB, plus slack."""
    conns = 4
    bound = conns * (H2_MAX_STREAMS * 3 * H2_MAX_HEADER_LIST + PER_CONNECTION) // KIB + SLACK_KIB
    before = settled_rss(env)
    clients = []
    try:
        for n in range(conns):
            c = _h2(env)
            clients.append(c)
            # literal fields without indexing: every block is decoded in full
            c.enc.header_table_size = 0
            batch = []
            for sid in range(1, 2 * H2_MAX_STREAMS, 2):
                extra = _fat_fields(n * 1000 + sid)
                block = c.enc.encode([(b":method", b"GET"), (b":scheme", b"https"),
                                      (b":authority", HOST.encode()),
                                      (b":path", f"/held/{n}/{sid}".encode())] + extra,
                                     huffman=False)
                batch.append(frame(HEADERS, END_HEADERS, sid, block))
            c.send(*batch)
        for c in clients:  # the edge took every stream (no GOAWAY, no reset for a limit)
            c.read(0.5)
        during = settled_rss(env)
        for c in clients:
            assert not c.eof and not any(f[0] == 7 for f in c.frames), c.frames[-3:]
    finally:
        for c in clients:
            c.close()
    assert env.serve.wait_open_connections(0) == 0
    after = settled_rss(env)
    _check("h2 full header lists x 400 open streams", before, during, after, bound)


def test_h2_hpack_table_churn_and_continuation_chains(env: ServeEnv) -> None:
    """One connection sends 1000 requests whose every field is new and indexed (the
    dynamic table is rewritten by each block), each block cut into a CONTINUATION chain
    of 60 frames (under the 64-frame cap), and answered.

    Bound: the decoder's table is SETTINGS_HEADER_TABLE_SIZE (4 KiB, the default, never
    raised); a header block in assembly is at most 64 KiB; the blocks remembered for
    all-indexed repeats are at most 32; nothing of this grows with the request count:
    2 MiB for all of it, plus slack."""
    bound = 2 * 1024 + SLACK_KIB
    before = settled_rss(env)
    c = _h2(env)
    try:
        answered = 0
        sid = 1
        for rnd in range(10):  # bounded: 10 rounds of 100 streams
            out = []
            for _ in range(100):
                block = c.enc.encode([
                    (b":method", b"GET"), (b":scheme", b"https"),
                    (b":authority", HOST.encode()), (b":path", f"/churn/{sid}".encode()),
                    (f"x-churn-{sid}".encode(), f"{rnd}-{sid}-".encode() * 40)])
                size = -(-len(block) // 60)
                pieces = [block[i * size:(i + 1) * size] for i in range(60)]
                out.append(frame(HEADERS, 0, sid, pieces[0]))
                for k, piece in enumerate(pieces[1:], 1):
                    flags = END_HEADERS if k == 59 else 0
                    out.append(frame(CONTINUATION, flags, sid, piece))
                sid += 2
            first_sid = sid - 200
            c.send(*out)
            # HEADERS without END_STREAM: end each stream with an empty DATA
            c.send(*(frame(DATA, END_STREAM, s, b"") for s in range(first_sid, sid, 2)))
            opened = range(first_sid, sid, 2)
            assert c.until(lambda opened=opened: all(c.ended(s) or c.resets(s)
                                                     for s in opened), WAIT), rnd
            answered += sum(1 for s in range(first_sid, sid, 2) if c.ended(s))
            c.frames.clear()
        assert answered == 1000, answered
    finally:
        c.close()
    after = settled_rss(env)
    _check("h2 hpack churn + continuation chains x 1000", before, None, after, bound)


def test_h2_request_bodies_are_held_to_the_windows(env: ServeEnv) -> None:
    """Eight connections from one address each open 100 uploads of 5 MiB (to the MCP
    path, whose bodies the edge reads whole before forwarding, and to a plain path) and
    push DATA as fast as the windows allow for 2 s, never finishing.

    Bound: the edge acknowledges DATA only as it takes it, so a stream holds at most its
    window unread (64 KiB). A stream refused (beyond the in-flight share of 16, or the
    buffer share) has what it was sent acknowledged and dropped with the refusal, at
    once; the streams left waiting with their DATA unread are the 16 of the in-flight
    share. What the edge has taken of MCP bodies is held to the client's buffer share
    (18 MiB); what it takes of plain bodies goes to the node. 8 × 128 KiB + 18 MiB +
    16 × (64 KiB + the node link's buffers, 2 × 64 KiB) ≈ 22 MiB, plus slack."""
    conns = 8
    bound = (conns * PER_CONNECTION + PER_CLIENT_BUFFER
             + 16 * (H2_STREAM_WINDOW + 2 * READ_BUF)) // KIB + SLACK_KIB
    before = settled_rss(env)
    clients = []
    length = 5 * MIB
    sent = 0
    try:
        for n in range(conns):
            c = _h2(env, host=OPT_HOST)
            clients.append(c)
            batch = []
            for sid in range(1, 2 * H2_MAX_STREAMS, 2):
                path = "/mcp" if sid % 4 == 1 else f"/upload/{n}/{sid}"
                ctype = b"application/json" if path == "/mcp" else b"application/octet-stream"
                batch.append(frame(HEADERS, END_HEADERS, sid, c.block(path, "POST", [
                    (b"content-type", ctype), (b"content-length", str(length).encode())])))
            c.send(*batch)
        deadline = time.monotonic() + 2
        chunk = b"[" + b" " * 16382 + b"]"
        # the client's own idea of the windows: the edge's WINDOW_UPDATEs raise them
        windows = [{0: H2_CONN_WINDOW} for _ in clients]
        while time.monotonic() < deadline:
            for c, win in zip(clients, windows, strict=True):
                _drain(c)
                for kind, _f, fsid, payload in c.frames:
                    if kind == WINDOW_UPDATE:
                        win[fsid] = win.get(fsid, H2_CONN_WINDOW) + int.from_bytes(payload, "big")
                c.frames = [f for f in c.frames if f[0] != WINDOW_UPDATE]
                for sid in range(1, 2 * H2_MAX_STREAMS, 2):
                    room = min(win[0], win.get(sid, H2_CONN_WINDOW), len(chunk))
                    if room <= 0 or c.resets(sid) or c.ended(sid):
                        continue
                    c.send(frame(DATA, 0, sid, chunk[:room]))
                    win[0] -= room
                    win[sid] = win.get(sid, H2_CONN_WINDOW) - room
                    sent += room
        during = settled_rss(env)
    finally:
        for c in clients:
            c.close()
    assert env.serve.wait_open_connections(0) == 0
    after = settled_rss(env)
    print(f"\n[mem] h2 uploads: {sent / MIB:.1f} MiB of DATA sent in 2 s")
    _check("h2 uploads pushed to the windows", before, during, after, bound)


def test_h2_client_that_never_reads_a_big_answer(env: ServeEnv) -> None:
    """Two kinds of client that do not take a 64 MiB answer, 16 streams each (the
    in-flight share of one address): one keeps the flow-control windows shut (never a
    WINDOW_UPDATE), the other opens them to the maximum and then does not read its
    socket at all. The edge must stop reading from the node, not buffer the answers.

    Bound: per stream, what is read from the node and not yet sent (a 64 KiB read) plus
    the upstream TLS buffers (64 KiB), per connection the writer's outbox (64 KiB), a
    TLS record or two, and the connection's own cost: 2 × (16 × 2 × 64 KiB + 64 KiB +
    128 KiB) ≈ 4.4 MiB, against 2 GiB offered; plus slack."""
    bound = 2 * (16 * 2 * READ_BUF + H2_OUTBOX + PER_CONNECTION) // KIB + SLACK_KIB
    before = settled_rss(env)
    size = 64 * MIB
    shut = _h2(env)
    wide = Raw(env, source="127.0.0.4", first=settings((4, 2**31 - 1)), rcvbuf=4096)
    try:
        wide.send(frame(WINDOW_UPDATE, 0, 0, u32(2**31 - 1 - H2_CONN_WINDOW)))
        for c in (shut, wide):
            c.send(*(c.headers(sid, f"/big?bytes={size}") for sid in range(1, 33, 2)))
        # `shut` reads (frames, not DATA credit: Raw would send WINDOW_UPDATEs, so it is
        # only read here enough to see the heads); `wide` is never read
        shut.unacked.clear()
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:
            shut.sock.settimeout(0.2)
            with contextlib.suppress(TimeoutError, OSError):
                shut.sock.recv(65536)  # dropped: no window given back
        during = settled_rss(env)
        assert env.node.active_streams > 0  # the node is still held, writing
    finally:
        shut.close()
        wide.close()
    assert env.serve.wait_open_connections(0) == 0
    assert env.node.wait_for(lambda: env.node.active_streams == 0), env.node.active_streams
    after = settled_rss(env)
    _check("h2 client not reading 32 x 64 MiB answers", before, during, after, bound)


# === HTTP/1.1 ===========================================================================

#: Bytes of pipelined requests the HTTP/1.1 leg reads ahead while a response streams.
H1_READ_AHEAD = 64 * KIB
#: What one parsed request costs in memory, at most, per byte of its head on the wire: a
#: head of ~70 bytes becomes a request object, its target and header list (~1.5 KiB).
H1_PARSED_PER_WIRE_BYTE = 24


def _pump_send(sock: ssl.SSLSocket, data: bytes, seconds: float) -> list[int]:
    """Send `data` from a thread for at most `seconds` (a socket timeout bounds each
    wait); returns a list that will hold the byte count sent."""
    sent = [0]

    def run() -> None:
        view = memoryview(data)
        deadline = time.monotonic() + seconds
        sock.settimeout(0.5)
        while view and time.monotonic() < deadline:
            try:
                n = sock.send(view[:16384])
            except TimeoutError:
                continue
            except (OSError, ValueError):
                return
            sent[0] += n
            view = view[n:]

    threading.Thread(target=run, daemon=True).start()
    return sent


def test_h1_pipelined_requests_behind_streaming_answers(env: ServeEnv) -> None:
    """One connection pipelines 16 MiB of small requests for streamed (chunked) answers
    while reading the answers as they come. While an answer streams the edge reads
    ahead to notice the client leaving; what it has read ahead and not served yet must
    stay within the read-ahead bound however many answers it streams.

    Bound: 64 KiB of pipelined heads parsed into requests (24 bytes of memory per wire
    byte: ~1.5 MiB), a read buffer and the connection: ~1.7 MiB, plus slack. Against:
    the whole 16 MiB offered, parsed, would be hundreds of MiB."""
    bound = (H1_READ_AHEAD * H1_PARSED_PER_WIRE_BYTE + READ_BUF + PER_CONNECTION) // KIB \
        + SLACK_KIB
    before = settled_rss(env)
    one = request_bytes("GET", "/stream?n=1&interval=0", HOST)
    data = one * (16 * MIB // len(one))
    s = tls_socket(env.serve.port, HOST, source=ATTACKER_IP)
    view = memoryview(data)
    got = 0
    try:
        # one thread takes turns sending and reading (a TLS socket is not for two)
        s.settimeout(0.02)
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            with contextlib.suppress(TimeoutError, ssl.SSLWantWriteError):
                if view:
                    view = view[s.send(view[:16384]):]
            with contextlib.suppress(TimeoutError, ssl.SSLWantReadError):
                chunk = s.recv(65536)
                if not chunk:
                    break
                got += len(chunk)
        during = settled_rss(env)
    finally:
        forget(s)
    assert got > 0, "no answer came back: the connection stopped serving"
    assert env.serve.wait_open_connections(0) == 0
    after = settled_rss(env)
    print(f"\n[mem] h1 pipelining: {(len(data) - len(view)) / MIB:.1f} MiB of requests "
          f"sent, {got / MIB:.2f} MiB of answers read")
    _check("h1 pipelined requests behind streamed answers", before, during, after, bound)


def test_h1_pipelined_big_answers_never_read(env: ServeEnv) -> None:
    """Eight connections each pipeline 200 requests for a 64 MiB answer and read none.

    Bound: per connection the answer being relayed holds a read from the node (64 KiB),
    the upstream TLS buffers (64 KiB) and what the client's TLS stream has not sent (a
    64 KiB write); the pipelined heads read ahead (64 KiB, parsed: ~1.5 MiB); and the
    connection: 8 × (3 × 64 KiB + 1.5 MiB + 128 KiB) ≈ 14.5 MiB, against 100 GiB asked."""
    conns = 8
    bound = conns * (3 * READ_BUF + H1_READ_AHEAD * H1_PARSED_PER_WIRE_BYTE
                     + PER_CONNECTION) // KIB + SLACK_KIB
    before = settled_rss(env)
    socks = []
    try:
        for _ in range(conns):
            s = tls_socket(env.serve.port, HOST, source=ATTACKER_IP, rcvbuf=4096)
            socks.append(s)
            _pump_send(s, request_bytes("GET", f"/big?bytes={64 * MIB}", HOST) * 200, 2.0)
        time.sleep(2)
        during = settled_rss(env)
        assert env.node.active_streams > 0
    finally:
        for s in socks:
            forget(s)
    assert env.serve.wait_open_connections(0) == 0
    assert env.node.wait_for(lambda: env.node.active_streams == 0), env.node.active_streams
    after = settled_rss(env)
    _check("h1 8 x pipelined 64 MiB answers never read", before, during, after, bound)


def test_h1_slow_reader_of_big_answers(env: ServeEnv) -> None:
    """Eight connections each ask for a 64 MiB answer and read it at 16 KiB per 50 ms
    through a 4 KiB receive buffer for 2 s: the edge must pace its reads from the node
    by what the client takes.

    Bound: per connection a node read, the upstream TLS buffers and a client write
    (3 × 64 KiB) and the connection: 8 × 320 KiB = 2.5 MiB, plus slack."""
    conns = 8
    bound = conns * (3 * READ_BUF + PER_CONNECTION) // KIB + SLACK_KIB
    before = settled_rss(env)
    socks = []
    got = 0
    try:
        for _ in range(conns):
            s = tls_socket(env.serve.port, HOST, source=ATTACKER_IP, rcvbuf=4096)
            s.sendall(request_bytes("GET", f"/big?bytes={64 * MIB}", HOST))
            s.settimeout(0.05)
            socks.append(s)
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:
            for s in socks:
                with contextlib.suppress(TimeoutError):
                    got += len(s.recv(16384))
            time.sleep(0.05)
        during = settled_rss(env)
        assert env.node.active_streams > 0
    finally:
        for s in socks:
            forget(s)
    assert env.serve.wait_open_connections(0) == 0
    assert env.node.wait_for(lambda: env.node.active_streams == 0), env.node.active_streams
    after = settled_rss(env)
    print(f"\n[mem] h1 slow readers took {got / MIB:.1f} MiB")
    _check("h1 8 slow readers of 64 MiB answers", before, during, after, bound)


def test_bodies_streamed_toward_a_node_that_does_not_take_them(env: ServeEnv) -> None:
    """Eight HTTP/1.1 connections and one HTTP/2 connection upload 256 MiB each (the
    route allows 1 GiB) to a node whose listener never accepts, for 2 s.

    Bound: a body streams to the node only as the node takes it, so per connection the
    edge holds a read (64 KiB) and, on HTTP/2, at most the stream's window (one stream
    here); plus the connection: 9 × (64 KiB + 64 KiB + 128 KiB) ≈ 2.3 MiB, plus slack."""
    conns = 8
    bound = (conns + 1) * (READ_BUF + H2_STREAM_WINDOW + PER_CONNECTION) // KIB + SLACK_KIB
    before = settled_rss(env)
    size = 256 * MIB
    body = b"\0" * (4 * MIB)
    socks = []
    sent = []
    c = _h2(env, host=TARPIT_HOST)
    try:
        for _ in range(conns):
            s = tls_socket(env.serve.port, TARPIT_HOST, source=ATTACKER_IP)
            s.sendall(request_bytes("POST", "/upload", TARPIT_HOST,
                                    content_type="application/octet-stream")
                      .replace(b"Content-Length: 0", f"Content-Length: {size}".encode()))
            socks.append(s)
            sent.append(_pump_send(s, body * (size // len(body)), 2.0))
        c.send(frame(HEADERS, END_HEADERS, 1, c.block("/upload", "POST", [
            (b"content-type", b"application/octet-stream"),
            (b"content-length", str(size).encode())])))
        # the whole window, and then some more the edge must refuse to take unasked
        c.send(*(frame(DATA, 0, 1, b"\0" * 16384) for _ in range(3)),
               frame(DATA, 0, 1, b"\0" * 16383))
        time.sleep(2)
        _drain(c)
        during = settled_rss(env)
        # nothing was given back, the node took nothing: the one WINDOW_UPDATE is the
        # connection's, raised at the start
        assert _window_updates(c) == [(0, H2_CONN_WINDOW_RAISED - H2_CONN_WINDOW)], c.frames
    finally:
        c.close()
        for s in socks:
            forget(s)
    assert env.serve.wait_open_connections(0) == 0
    after = settled_rss(env)
    print(f"\n[mem] uploads toward a tarpit: {sum(x[0] for x in sent) / MIB:.1f} MiB "
          f"taken by the kernel from {conns} HTTP/1.1 clients")
    _check("uploads toward a node that takes nothing", before, during, after, bound)


def _window_updates(c: Raw) -> list[tuple[int, int]]:
    """(stream, increment) of every WINDOW_UPDATE the edge sent, in order."""
    return [(sid, int.from_bytes(payload, "big")) for kind, _f, sid, payload in c.frames
            if kind == WINDOW_UPDATE]


def _wide_uploads(c: Raw) -> range:
    """Open the connection's 100 streams, each an upload of 1 MiB (declared) to the wide
    tarpit, once the edge's raised connection window has arrived; their ids."""
    assert c.until(lambda: (0, H2_CONN_WINDOW_RAISED - H2_CONN_WINDOW)
                   in _window_updates(c)), c.frames
    sids = range(1, 2 * H2_MAX_STREAMS, 2)
    c.send(*(frame(HEADERS, END_HEADERS, sid, c.block(f"/wide/{sid}", "POST", [
        (b"content-type", b"application/octet-stream"),
        (b"content-length", str(MIB).encode())])) for sid in sids))
    return sids


def _fill_windows(c: Raw, sids: range, sent: dict[int, int]) -> None:
    """The rest of each stream's window in 16 KiB DATA frames, then a PING; returns once
    its answer came (frames are handled in order: every DATA was handled before it)."""
    for sid in sids:
        while (room := min(H2_STREAM_WINDOW - sent[sid], 16 * KIB)) > 0:
            c.send(frame(DATA, 0, sid, bytes(room)))
            sent[sid] += room
    c.send(frame(PING, 0, 0, b"measured"))
    assert c.until(lambda: any(f[0] == PING and f[3] == b"measured" for f in c.frames),
                   4 * WAIT), c.frames[-3:]


def test_h2_uploads_to_a_node_that_takes_nothing_stop_at_the_windows(env: ServeEnv) -> None:
    """One connection opens its 100 streams, each an upload to a route whose node takes
    nothing and whose in-flight share lets every stream wait for the node (none is
    refused, so nothing is acknowledged for a refusal), and sends DATA as the windows
    allow.

    The windows: 65,535 bytes per stream, and for the connection 100 of them, raised at
    once. Nothing is taken, so nothing is given back: every stream's window fills (a
    stream that waits stops its own upload, and no stream is short of connection
    window), the client's sends stop at exactly 100 × 65,535 bytes, and one byte more
    is a FLOW_CONTROL_ERROR.

    Bound: what the edge holds unread is at most the raised connection window; each
    stream's request waits for a connection toward the node; plus the connection itself:
    6.25 MiB + 100 × 64 KiB + 128 KiB ≈ 12.6 MiB, plus slack."""
    bound = (H2_CONN_WINDOW_RAISED + H2_MAX_STREAMS * READ_BUF + PER_CONNECTION) // KIB \
        + SLACK_KIB
    before = settled_rss(env)
    c = _h2(env, host=WIDE_TARPIT_HOST)
    try:
        sids = _wide_uploads(c)
        sent = dict.fromkeys(sids, 0)
        _fill_windows(c, sids, sent)
        during = settled_rss(env)
        assert sum(sent.values()) == H2_CONN_WINDOW_RAISED
        answered = [f[:3] for f in c.frames if f[0] in (HEADERS, RST_STREAM, GOAWAY)]
        assert not answered, answered[:3]
        # nothing given back: the windows stay spent, so the client can send no more
        assert _window_updates(c) == [(0, H2_CONN_WINDOW_RAISED - H2_CONN_WINDOW)], (
            [f[:3] for f in c.frames])
        c.send(frame(DATA, 0, 1, b"x"))
        assert c.goaway() == FLOW_CONTROL_ERROR, c.frames[-3:]
    finally:
        c.close()
    assert env.serve.wait_open_connections(0) == 0
    after = settled_rss(env)
    _check("h2 100 uploads filling the windows toward a tarpit", before, during, after, bound)


def test_h2_one_byte_data_frames_filling_the_windows(env: ServeEnv) -> None:
    """As above, but the first 6,000 bytes of each stream's window come as one-byte DATA
    frames (the most frames a window takes): 600,000 frames.

    Bound: the same window, now in at most 130 queue entries per stream (short payloads
    are gathered, not held an object each: 600,000 of them took ~45 MiB more):
    6.25 MiB + 100 × (130 × 256 B + 64 KiB) + 128 KiB ≈ 16 MiB, plus slack.

    The node's connect and handshake time out after 10 s each (503 / 502 on those
    streams, their data acknowledged and dropped): on a host too busy to take the
    frames in that time, those answers are all the stream may get."""
    bound = (H2_CONN_WINDOW_RAISED + H2_MAX_STREAMS * (H2_STREAM_ENTRIES * H2_ENTRY + READ_BUF)
             + PER_CONNECTION) // KIB + SLACK_KIB
    tiny = 6000
    before = settled_rss(env)
    c = _h2(env, host=WIDE_TARPIT_HOST)
    try:
        sids = _wide_uploads(c)
        sent = dict.fromkeys(sids, 0)
        for sid in sids:
            c.send(frame(DATA, 0, sid, b"x") * tiny)
            sent[sid] += tiny
        _fill_windows(c, sids, sent)
        during = settled_rss(env)
        assert sum(sent.values()) == H2_CONN_WINDOW_RAISED
        assert not any(f[0] == GOAWAY for f in c.frames), c.frames[-3:]
        answered = {f[2] for f in c.frames if f[0] == HEADERS}
        for sid in answered:
            assert c.answer(sid)[0] in (502, 503), (sid, c.answer(sid))
        # a stream still waiting was given nothing back
        assert not [(sid, n) for sid, n in _window_updates(c) if sid and sid not in answered]
    finally:
        c.close()
    assert env.serve.wait_open_connections(0) == 0
    after = settled_rss(env)
    _check("h2 600,000 one-byte DATA frames toward a tarpit", before, during, after, bound)


# === TLS ================================================================================


def _client_hello(host: str = HOST, alpn: tuple[str, ...] = ("http/1.1",)) -> bytes:
    """The bytes of a real ClientHello (stdlib TLS client, memory BIOs)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.set_alpn_protocols(list(alpn))
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(incoming, outgoing, server_hostname=host)
    with contextlib.suppress(ssl.SSLWantReadError):
        obj.do_handshake()
    return outgoing.read()


def _raw(source: str, port: int) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(WAIT)
    s.bind((source, 0))
    s.connect((LOOPBACK, port))
    return s


#: Connections one address may hold, and the extra ones it gets to show a ClientHello
#: when at that cap (README: `max_connections_per_ip`).
PER_IP_CAP = 200
PER_IP_GRACE = 16


def test_tls_half_handshakes_at_the_per_ip_cap_from_four_addresses(env: ServeEnv) -> None:
    """From four loopback addresses, each opens 230 connections (beyond its cap of 200
    plus 16): half send a whole ClientHello and then nothing (the edge answers with its
    flight and waits for the client's Finished), half send 3 bytes of a record header.

    Bound: the edge holds at most 216 connections per address; a handshake in progress
    costs its socket, an OpenSSL object with its buffers and a parked task, well under
    the 128 KiB counted per connection: 4 × 216 × 128 KiB = 108 MiB. The measured figure
    is far below; the bound is what the caps allow, not what this run used."""
    addrs = [f"127.0.9.{i}" for i in range(1, 5)]
    per = 230
    bound = len(addrs) * (PER_IP_CAP + PER_IP_GRACE) * PER_CONNECTION // KIB + SLACK_KIB
    hello = _client_hello()
    before = settled_rss(env)
    socks: list[socket.socket] = []
    try:
        for addr in addrs:
            for i in range(per):
                try:
                    s = _raw(addr, env.serve.port)
                except OSError:
                    continue
                socks.append(s)
                with contextlib.suppress(OSError):
                    s.sendall(hello if i % 2 == 0 else hello[:3])
        time.sleep(1)
        open_now = env.serve.open_connections()
        during = settled_rss(env)
        assert open_now <= len(addrs) * (PER_IP_CAP + PER_IP_GRACE), open_now
        # a measuring client still gets in meanwhile (its own address, its own share)
        assert _measure(env) == 200
    finally:
        for s in socks:
            s.close()
    assert env.serve.wait_open_connections(0) == 0
    after = settled_rss(env)
    print(f"\n[mem] half handshakes: {len(socks)} connections made, {open_now} held open")
    _check("TLS half handshakes at the per-IP cap x 4 addresses", before, during, after, bound)


def test_tls_oversized_client_hello_records(env: ServeEnv) -> None:
    """Fifty connections each send a handshake record header announcing a 16 MiB
    ClientHello, then 1 MiB of it in maximal records (and one in records over the
    maximal size): each is refused at the ClientHello cap and closed.

    Bound: the ClientHello parser holds at most 16 KiB (`MAX_CLIENT_HELLO`) per
    connection: 50 × (16 KiB + 128 KiB) ≈ 7 MiB, plus slack."""
    conns = 50
    bound = conns * (16 * KIB + PER_CONNECTION) // KIB + SLACK_KIB
    # handshake type 1, length 0xFFFFFF, then filler, cut into 16 KiB records
    payload = b"\x01\xff\xff\xff" + b"\x03\x03" + b"A" * (MIB - 6)
    records = b"".join(b"\x16\x03\x01" + (16384).to_bytes(2, "big") + payload[i:i + 16384]
                       for i in range(0, len(payload), 16384))
    oversized = b"\x16\x03\x01\xff\xff" + b"B" * 65535
    before = settled_rss(env)
    closed = 0
    socks = []
    try:
        for i in range(conns):
            s = _raw(ATTACKER_IP, env.serve.port)
            socks.append(s)
            _pump_send(s, oversized if i == 0 else records, 2.0)
        for s in socks:
            if closed_by_peer(s, 5.0):
                closed += 1
        during = settled_rss(env)
    finally:
        for s in socks:
            s.close()
    assert closed == conns, closed
    assert env.serve.wait_open_connections(0) == 0
    after = settled_rss(env)
    _check("TLS oversized ClientHello x 50", before, during, after, bound)


# === the relay and the tunnel ==========================================================


def test_relay_flood_to_an_offline_node_whose_tunnel_never_reads(tmp_path: Path) -> None:
    """A relay recipient whose connector holds a control link open and never reads it
    (4 KiB receive buffer), while two senders flood its queue with ~1 MiB sealed calls
    past its byte cap (24 MiB) and 100 callers knock on its tunnel route.

    What must hold: the queue stops at the sender's share of its cap (half: the two
    flooding threads are one sender), every call beyond it is answered `rate_limited`
    with retry_after 60 (the defined error), the counters say what the store holds, and
    memory is bounded.

    Bound: the queue is durable on disk (SQLite), so RAM holds per call in progress its
    body and the parsed and canonical envelope (4 × 1.1 MiB, two senders at once), the
    store's page caches (2 MiB per connection, a writer and a reader), a control link's
    TLS buffers for the silent connector and the waiting passthrough callers
    (100 × 128 KiB): ≈ 9 + 4 + 12.5 MiB, plus slack. Against: 24 MiB queued in RAM, on
    top of what the flood itself costs, would cross it."""
    from tests.relay_env import RelayCaller, RelayServe, envelope, relay_identities
    from tests.test_relay_workers import HIGH_LIMITS, queued

    envelope_size = MIB
    cap = 24 * MIB
    bound = (2 * 4 * (envelope_size + 64 * KIB) + 2 * 2 * MIB
             + 100 * PER_CONNECTION) // KIB + SLACK_KIB
    ids = relay_identities(tmp_path)
    serve = RelayServe(tmp_path, recipients=[ids.recipient], workers=1, tunnel=True,
                       max_bytes=str(cap), extra=HIGH_LIMITS)
    try:
        env = _Proc(serve.proc)
        socks: list[socket.socket] = []
        try:
            owner = RelayCaller(serve.port, ids.recipient)
            assert owner.allowlist_set([ids.sender.fingerprint]).status == 200
            now = int(time.time())
            first = envelope(ids.sender, ids.recipient, msg_id="warm", ts=now, text="w")
            warm = RelayCaller(serve.port, ids.sender)
            assert queued(warm.tool("relay_call", first)[0], "warm")
            warm.close()
            owner.close()
            before = settled_rss(env)  # type: ignore[arg-type]
            # the silent connector: HELLO, then never a read
            from tests.test_tunnel_attacks import hello

            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
            ctx.set_alpn_protocols(["pact-tunnel/1"])
            ctx.load_cert_chain(ids.recipient.cert_path, ids.recipient.key_path)
            raw = socket.socket()
            raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            raw.settimeout(WAIT)
            raw.connect((LOOPBACK, serve.port))
            silent = ctx.wrap_socket(raw, server_hostname="tunnel.test")
            socks.append(silent)
            silent.sendall(hello())
            # callers knocking on the tunnel route (passthrough): they wait for a stream
            knock = _client_hello("home.test")
            for i in range(100):
                with contextlib.suppress(OSError):
                    k = _raw(f"127.0.8.{1 + i % 50}", serve.port)
                    socks.append(k)
                    k.sendall(knock)
            text = "x" * envelope_size
            answers: dict[str, str] = {}
            lock = threading.Lock()

            def sender(k: int) -> None:
                caller = RelayCaller(serve.port, ids.sender, source=f"127.0.7.{k + 1}")
                try:
                    for i in range(20):  # 40 calls of ~1 MiB at a 24 MiB queue
                        m = f"flood-{k}-{i}"
                        e = envelope(ids.sender, ids.recipient, msg_id=m, ts=now, text=text)
                        result, resp = caller.tool("relay_call", e)
                        sc = result.get("structuredContent") or {}
                        code = "queued" if queued(result, m) else (
                            f"{sc.get('code')}:{sc.get('retry_after')}:{resp.status}")
                        with lock:
                            answers[m] = code
                finally:
                    caller.close()

            threads = [threading.Thread(target=sender, args=(k,)) for k in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            during = settled_rss(env)  # type: ignore[arg-type]
            ok = [m for m, a in answers.items() if a == "queued"]
            refused = {a for a in answers.values() if a != "queued"}
            assert len(answers) == 40, len(answers)
            assert refused == {"rate_limited:60:429"} or refused == {"rate_limited:60:200"}, refused
            queues = serve.status()["relay"]["queues"]
            items, size = sum(q["items"] for q in queues), sum(q["bytes"] for q in queues)
            # one sender floods: its share of the byte bound (half of it) is what fills
            share = cap // 2
            assert items == len(ok) + 1 and size <= share, (items, size, len(ok))
            # that share, not something else, stopped the flood: one more would not fit
            assert ok and share - size < size / len(ok), (size, len(ok))
        finally:
            for s in socks:
                with contextlib.suppress(OSError):
                    s.close()
        # every connection let go: the silent connector's link, the knocking callers
        deadline = time.monotonic() + WAIT
        while time.monotonic() < deadline:
            counters = serve.status()["counters"]
            if counters.get("open_connections") == 0 and counters.get("tunnels") == 0:
                break
            time.sleep(0.2)
        assert counters.get("open_connections") == 0 and counters.get("tunnels") == 0, counters
        after = settled_rss(env)  # type: ignore[arg-type]
        _check("relay flood + silent tunnel peer", before, during, after, bound)
        # a measuring client: the owner fetches a page and the queue still answers
        owner = RelayCaller(serve.port, ids.recipient)
        page = owner.tool("fetch_queued", {"limit": 2})[0]
        owner.close()
        assert page["structuredContent"]["items"], page
        assert "Traceback" not in serve.logs()
    finally:
        serve.stop()


class _Proc:
    """`settled_rss` for a process that is not a `Serve` (one process, no workers)."""

    def __init__(self, proc: object) -> None:
        self.serve = self
        self.proc = proc

    def pids(self) -> list[int]:
        return [self.proc.pid]  # type: ignore[attr-defined]

    def proc_status(self, field_name: str) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():  # type: ignore[attr-defined]
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
        raise KeyError(field_name)

    def rss_kib(self) -> int:
        return self.proc_status("VmRSS")


# === the admin endpoint =================================================================


def test_admin_large_and_slow_bodies(env: ServeEnv) -> None:
    """The admin endpoint (loopback) gets eight 32 MiB bodies and thirty bodies that
    trickle a byte every 100 ms for 2 s: no admin endpoint takes a body, so each is read and
    dropped, answered 413 over 64 KiB.

    Bound: hypercorn holds one read (64 KiB) per connection and the head (16 KiB):
    38 × (80 KiB + 128 KiB) ≈ 7.7 MiB, plus slack."""
    conns_big, conns_slow = 8, 30
    bound = (conns_big + conns_slow) * (80 * KIB + PER_CONNECTION) // KIB + SLACK_KIB
    port = env.serve.admin_port
    before = settled_rss(env)
    socks = []
    statuses = []
    try:
        for _ in range(conns_slow):
            s = socket.create_connection((LOOPBACK, port), timeout=WAIT)
            s.sendall(b"POST /reload HTTP/1.1\r\nHost: admin\r\nContent-Length: 1000000\r\n\r\n")
            socks.append(s)
        big = []
        for _ in range(conns_big):
            s = socket.create_connection((LOOPBACK, port), timeout=WAIT)
            s.sendall(b"POST /reload HTTP/1.1\r\nHost: admin\r\n"
                      + f"Content-Length: {32 * MIB}\r\n\r\n".encode())
            big.append((s, _pump_send(s, b"z" * (32 * MIB), 2.0)))
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:
            for s in socks:
                with contextlib.suppress(OSError):
                    s.send(b"a")
            time.sleep(0.1)
        during = settled_rss(env)
        for s, _sent in big:
            s.settimeout(5)
            with contextlib.suppress(OSError):
                statuses.append(s.recv(100).split(b" ")[1:2])
            s.close()
    finally:
        for s in socks:
            s.close()
    after = settled_rss(env)
    print(f"\n[mem] admin: big bodies answered {statuses}")
    _check("admin large and slow bodies", before, during, after, bound)
    assert env.serve.status()["counters"]  # the admin endpoint still answers


# === MCP bodies: what parsing one costs ===============================================


def _reset_peak(env: ServeEnv) -> None:
    """Start VmHWM afresh (Linux: `5` to clear_refs resets the peak to the current RSS)."""
    for pid in env.serve.pids():
        with contextlib.suppress(OSError):
            Path(f"/proc/{pid}/clear_refs").write_text("5")


def _over_the_cap_body(size: int) -> bytes:
    """A tools/list of `size` bytes whose params are an array of empty objects: ~2
    counted values per 3 bytes, far over `MAX_JSON_VALUES` (a parse would have built two
    million objects of a 6 MiB body, four million of a 12 MiB one)."""
    head = b'{"jsonrpc":"2.0","id":1,"method":"tools/list","params":{"x":['
    inner = b"{},"
    return head + inner * ((size - len(head) - 4) // len(inner)) + b"0]}}"


def _at_the_cap_body(size: int) -> bytes:
    """A tools/list of `size` bytes holding exactly `MAX_JSON_VALUES` counted values in
    the dearest shape measured (one object of distinct keys with 2-character string
    values, ~143 bytes each once parsed), the rest one long string."""
    head = b'{"jsonrpc":"2.0","id":1,"method":"tools/list","params":{"x":['
    frame = head.count(b",") + head.count(b":") + head.count(b"{") + head.count(b"[") + 1
    members = (MAX_JSON_VALUES - frame) // 2
    core = b"{" + b",".join(b'"%x":"ab"' % i for i in range(members)) + b"},"
    body = head + core + b'"' + b"a" * (size - len(head) - len(core) - 5) + b'"]}}'
    counted = sum(body.count(c) for c in (b",", b":", b"{", b"["))
    assert len(body) == size and MAX_JSON_VALUES - 1 <= counted <= MAX_JSON_VALUES, counted
    return body


def test_mcp_body_parse_amplification(env: ServeEnv) -> None:
    """One client posts an MCP body just under `max_body_bytes` (6 MiB): an array of two
    million empty objects. The edge reads it whole (counted against the client's 18 MiB
    share) and, before parsing, counts what it may hold: over `MAX_JSON_VALUES`, it is
    refused -32600 unparsed (parsing it peaked at ~155 MiB) and never reaches the node.

    Bound: the body (6 MiB) in the forms reading it makes (the parts, the joined bytes)
    and one more for slack in the answer path: 6 MiB × 3 above the RSS before, at the
    peak (VmHWM, reset before the attack), plus slack."""
    bound = 6 * 3 * 1024 + SLACK_KIB
    body = _over_the_cap_body(6 * MIB - 100)
    before = settled_rss(env)
    _reset_peak(env)
    r = exchange(env.serve.port, request_bytes("POST", "/mcp", OPT_HOST, body=body),
                 host=OPT_HOST, source=ATTACKER_IP)
    peak = env.serve.proc_status("VmHWM")
    after = settled_rss(env)
    assert r.status == 400, r.status
    answer = json.loads(r.body)
    assert answer["id"] is None and answer["error"]["code"] == -32600, answer
    assert not env.node.requests()
    _check("MCP body of 2M empty objects, refused unparsed (peak)", before, peak, after, bound)


def test_mcp_body_at_the_value_cap(env: ServeEnv) -> None:
    """The dearest body the cap lets through: `MAX_JSON_VALUES` counted values of the
    shape that costs most once parsed, filled up to 6 MiB by one string. It is parsed,
    judged and forwarded (the node answers the tools/list).

    Bound: one parse at a time per process stays under 64 MiB (the cap's derivation,
    proto/posture.py: ~36 MiB measured for this body), plus the body in three forms (the
    parts, the joined bytes, the copy on its way to the node): 64 + 3 × 6 MiB, plus
    slack."""
    bound = (64 + 6 * 3) * 1024 + SLACK_KIB
    body = _at_the_cap_body(6 * MIB - 100)
    before = settled_rss(env)
    _reset_peak(env)
    r = exchange(env.serve.port, request_bytes("POST", "/mcp", OPT_HOST, body=body),
                 host=OPT_HOST, source=ATTACKER_IP)
    peak = env.serve.proc_status("VmHWM")
    after = settled_rss(env)
    assert r.status == 200, (r.status, r.body[:300])
    [seen] = env.node.requests()
    assert len(seen.body) == len(body)
    _check("MCP body at the JSON value cap, forwarded (peak)", before, peak, after, bound)


def test_relay_body_parse_amplification(tmp_path: Path) -> None:
    """The relay host reads JSON with the same reader: a 12 MiB /relay/mcp body of four
    million empty objects (parsing it peaked at ~314 MiB) is refused -32600 unparsed.

    Bound: the body (12 MiB) as the parts, the joined bytes and slack: 12 MiB × 3 above
    the RSS before, at the peak, plus slack."""
    from tests.relay_env import RelayCaller, RelayServe, relay_identities
    from tests.test_relay_workers import HIGH_LIMITS

    bound = 12 * 3 * 1024 + SLACK_KIB
    ids = relay_identities(tmp_path)
    serve = RelayServe(tmp_path, recipients=[ids.recipient], workers=1, extra=HIGH_LIMITS)
    proc = _Proc(serve.proc)
    try:
        caller = RelayCaller(serve.port, ids.sender, source=ATTACKER_IP)
        assert caller.request("POST", "/relay/mcp", rpc("ping")).status == 200
        before = settled_rss(proc)  # type: ignore[arg-type]
        _reset_peak(proc)  # type: ignore[arg-type]
        resp = caller.request("POST", "/relay/mcp", _over_the_cap_body(12 * MIB))
        peak = proc.proc_status("VmHWM")
        after = settled_rss(proc)  # type: ignore[arg-type]
        assert resp.status == 400, resp.status
        answer = json.loads(resp.body)
        assert answer["id"] is None and answer["error"]["code"] == -32600, answer
        assert caller.request("POST", "/relay/mcp", rpc("ping")).status == 200
        caller.close()
        _check("relay body of 4M empty objects, refused unparsed (peak)", before, peak,
               after, bound)
        assert "Traceback" not in serve.logs()
    finally:
        serve.stop()


def test_relay_bodies_refused_after_a_thread_check_leave_nothing_behind(
        tmp_path: Path) -> None:
    """Large relay calls are parsed and checked in a worker thread. A caller sends, four
    rounds over, a call whose arguments are the dearest tree the JSON value cap lets
    through (one object of ~130 000 distinct members: refused envelope_invalid once
    parsed) and a 12 MiB body that is not JSON (an unclosed string, refused -32700 by the
    parser): once each is answered, nothing of it may stay in memory.

    Bounds: the first two rounds may leave what the allocator keeps of their largest
    buffers (the 12 MiB body, its decoded text, the joined parts: 36 MiB) and of the
    tree (under the cap's 64 MiB), plus slack: glibc raises its mmap threshold when the
    first round frees its large blocks, so the second round's come from the heap and
    stay there (with MALLOC_MMAP_THRESHOLD_ fixed, the first round's end is the
    plateau). Each later round must add nothing beyond slack: 16 MiB from the end of the
    second round to the end of the fourth. Against: a refused call's parsed tree
    (~36 MiB) and its body and text (~36 MiB for 12 MiB) kept per call until a full
    collection, which two rounds would double."""
    from tests.relay_env import RelayCaller, RelayServe, relay_identities
    from tests.test_relay_workers import HIGH_LIMITS

    bound = SLACK_KIB
    ids = relay_identities(tmp_path)
    serve = RelayServe(tmp_path, recipients=[ids.recipient], workers=1, extra=HIGH_LIMITS)
    env = _Proc(serve.proc)
    try:
        caller = RelayCaller(serve.port, ids.sender, source=ATTACKER_IP)
        assert caller.request("POST", "/relay/mcp", rpc("ping")).status == 200
        before = settled_rss(env)  # type: ignore[arg-type]
        head = b'{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"relay_call",'
        opening = head + b'"arguments":{'
        members = (MAX_JSON_VALUES - sum(opening.count(c) for c in b",:{[") + 1) // 2
        tree = opening + b",".join(b'"%x":"ab"' % i for i in range(members)) + b"}}}"
        assert MAX_JSON_VALUES - 1 <= sum(tree.count(c) for c in b",:{[") <= MAX_JSON_VALUES
        broken = head + b'"arguments":{"x":"' + b"a" * (12 * MIB)  # never closed
        ends = []
        for _ in range(4):
            codes = []
            for body in (tree, broken):
                resp = caller.request("POST", "/relay/mcp", body)
                codes.append((resp.status, resp.body[:300]))
            assert [c[0] for c in codes] == [200, 400], codes
            assert b"envelope_invalid" in codes[0][1] and b"-32700" in codes[1][1], codes
            ends.append(settled_rss(env))  # type: ignore[arg-type]
        caller.close()
        print(f"\n[mem] relay refused bodies: RSS at the end of each round "
              f"{[round(e / 1024, 1) for e in ends]} MiB")
        _check("relay bodies refused after a thread check (rounds 1-2)", before, None,
               ends[1], (3 * 12 + 64) * 1024 + SLACK_KIB)
        _check("relay bodies refused after a thread check (rounds 3-4)", ends[1], None,
               ends[3], bound)
        assert "Traceback" not in serve.logs()
    finally:
        serve.stop()
