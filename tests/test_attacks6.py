"""A hostile client against the terminate edge: paths a node's router may read as the
MCP endpoint, and what one client's aborts leave behind.

Run:   python -m pytest tests/test_attacks6.py -v

Real `serve` processes and real TLS on loopback (tests/terminate_env.py); every wait is
bounded, nothing asserts on timing.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from pact_ingress.proto.http_request import in_mcp_scope, parse_target
from pact_ingress.proto.relay import MAX_REQUEST_BYTES as RELAY_MAX_REQUEST
from tests.relay_env import RELAY_HOST, RelayCaller, RelayServe, relay_identities, relay_socket
from tests.relay_env import client_context as relay_client_context
from tests.terminate_env import (
    HOST,
    LOOPBACK,
    OPT_HOST,
    H2Conn,
    ServeEnv,
    client_context,
    exchange,
    forget,
    module_fixtures,
    read_response,
    request_bytes,
    rpc,
    tls_socket,
    unsealed_call_body,
)

shared, env = module_fixtures("attacks6")

#: A bound on any single wait of a client here.
HANG = 10.0

#: Targets whose path, once a router reads `%2F` / `%5C` as a slash (as the scope rule
#: itself does) and then merges slashes or resolves dot segments (nginx's location
#: matching does both, Go's ServeMux cleans the path), is the MCP endpoint.
ENCODED_SLASH_SPELLINGS = [
    "/%2Fmcp", "/%2fmcp", "/%5Cmcp", "/x%2F..%2Fmcp", "/x%2F%2e%2e%2Fmcp",
    "/%2F%2Fmcp%2F", "/.%2Fmcp", "/a%5C..%5Cmcp",
]


@pytest.mark.parametrize("raw", ENCODED_SLASH_SPELLINGS)
def test_encoded_slashes_merged_or_resolved_are_still_in_scope(raw: str) -> None:
    assert in_mcp_scope(parse_target(raw.encode()).path, "/mcp")


@pytest.mark.parametrize("raw", ["/mcp%2F..%2Fx", "/mcp%2Fx", "/mcp/..%2Fx"])
def test_what_was_in_scope_stays_in_scope(raw: str) -> None:
    # a router that leaves the escapes alone serves these below /mcp
    assert in_mcp_scope(parse_target(raw.encode()).path, "/mcp")


@pytest.mark.parametrize("raw", ["/%2Fmcpx", "/x%2Fmcp", "/%2F..%2Fx"])
def test_other_encoded_paths_are_not(raw: str) -> None:
    assert not in_mcp_scope(parse_target(raw.encode()).path, "/mcp")


@pytest.mark.parametrize("target", ["/%2Fmcp", "/x%2F..%2Fmcp", "/%5Cmcp"])
@pytest.mark.parametrize("content_type", ["text/plain", None])
def test_an_unsealed_call_at_an_encoded_slash_spelling_never_reaches_the_node(
        env: ServeEnv, target: str, content_type: str | None) -> None:
    # the MCP endpoint refuses a body that is not application/json; the same body at a
    # spelling of the endpoint must be refused the same way, not forwarded as a plain POST
    body = unsealed_call_body()
    resp = exchange(env.serve.port, request_bytes(
        "POST", target, HOST, body=body, content_type=content_type), host=HOST)
    assert resp.status == 400, (resp.status, resp.body[:200])
    assert env.node.requests() == []


# --- an HTTP/2 Content-Length of more digits than int() converts -------------------------

#: CPython refuses to convert a decimal string of more than 4300 digits (a guard against
#: quadratic conversion); a header list of 16 KiB holds one easily.
MANY_DIGITS = 5000


@pytest.mark.parametrize(("value", "status"), [
    ("9" * MANY_DIGITS, None),  # a length no body could have: reset, or 413
    ("0" * (MANY_DIGITS - 1) + "2", 200),  # RFC 9110's 1*DIGIT: 2, spelt long
], ids=["nines", "leading-zeros"])
def test_an_h2_content_length_of_many_digits_ends_only_its_stream(
        env: ServeEnv, value: str, status: int | None) -> None:
    h = H2Conn(env.serve.port, OPT_HOST)
    try:
        r = h.request("POST", "/upload", body=b"{}", content_type="text/plain",
                      headers=[("content-length", value)], timeout=HANG)
        assert not r.goaway, "one stream's header ended the whole connection"
        if status is None:
            assert r.reset is not None or r.status == 413, r
        else:
            assert r.status == status, r
        # the connection goes on serving
        after = h.request("GET", "/after", timeout=HANG)
        assert after.status == 200, after
    finally:
        h.close()
    assert [e for e in env.serve.log_events()
            if e.get("event") == "terminate_connection_error"] == []


# --- an MCP body in tiny TLS records ------------------------------------------------------

#: The body sent two bytes per TLS record: each record is one read, one body chunk.
TINY_BODY = 600_000
TINY_RECORD = 2


class _Records:
    """A TLS connection whose records the test makes itself: one `write` is one record,
    sent when `flush` is called."""

    def __init__(self, port: int, host: str, context: ssl.SSLContext | None = None) -> None:
        self.raw = socket.create_connection((LOOPBACK, port), timeout=HANG)
        self.incoming, self.outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        self.obj = (context or client_context()).wrap_bio(self.incoming, self.outgoing,
                                                          server_hostname=host)
        deadline = time.monotonic() + HANG
        while True:
            try:
                self.obj.do_handshake()
                break
            except ssl.SSLWantReadError:
                self.flush()
                assert time.monotonic() < deadline, "handshake did not finish"
                self.incoming.write(self.raw.recv(65536))
        self.flush()

    def flush(self) -> None:
        if data := self.outgoing.read():
            self.raw.sendall(data)

    def response_head(self) -> bytes:
        data = b""
        deadline = time.monotonic() + HANG
        while b"\r\n\r\n" not in data and time.monotonic() < deadline:
            try:
                data += self.obj.read(65536)
                continue
            except ssl.SSLWantReadError:
                pass
            got = self.raw.recv(65536)
            if not got:
                break
            self.incoming.write(got)
        return data


def _unread_on_server(port: int, client_port: int) -> int:
    """Bytes the kernel holds for the edge's end of this connection, not read yet."""
    unread = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, remote = fields[1], fields[2]
        if (int(local.split(":")[1], 16) == port
                and int(remote.split(":")[1], 16) == client_port):
            unread += int(fields[4].split(":")[1], 16)
    return unread


def _held_in_tiny_records(port: int, host: str, target: str, body: bytes,
                          rss_kib: Callable[[], int],
                          context: ssl.SSLContext | None = None) -> tuple[float, bytes]:
    """Send `body` to `target` two bytes per TLS record, all but its last records; once
    the edge has read them, how much it grew (MiB). Then the rest: the answer's head."""
    head = request_bytes("POST", target, host, body=body)[:-len(body)]
    conn = _Records(port, host, context)
    try:
        before = rss_kib()
        conn.obj.write(head)
        end = len(body) - 2 * TINY_RECORD  # the rest is sent once the edge was measured
        for i in range(0, end, TINY_RECORD):
            conn.obj.write(body[i:i + TINY_RECORD])
        conn.flush()
        client_port = conn.raw.getsockname()[1]
        deadline = time.monotonic() + 60
        while _unread_on_server(port, client_port) and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.0)  # the records of the last read decrypted and taken
        grown_mib = (rss_kib() - before) / 1024
        conn.obj.write(body[end:])
        conn.flush()
        return grown_mib, conn.response_head()
    finally:
        conn.raw.close()


def test_a_body_in_tiny_records_costs_about_its_bytes(env: ServeEnv) -> None:
    """The buffer share counts body bytes; what the edge holds for them must be about as
    much, however the client cuts the body into records (a list of two-byte objects
    costs some twenty times the bytes, which no share accounts for)."""
    port = env.serve.port
    assert exchange(port, request_bytes("GET", "/warm", OPT_HOST),
                    host=OPT_HOST).status == 200
    body = rpc("tools/list", {"pad": "p" * (TINY_BODY - 60)})
    grown_mib, answer = _held_in_tiny_records(port, OPT_HOST, "/mcp", body,
                                              env.serve.rss_kib)
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]
    assert grown_mib < 8 * TINY_BODY / 2**20, (
        f"{grown_mib:.1f} MiB held for a {TINY_BODY / 2**20:.1f} MiB body")


def test_a_relay_body_in_tiny_records_costs_about_its_bytes(tmp_path: Path) -> None:
    """The same for the relay host's reader, which counts its bodies in a share too."""
    ids = relay_identities(tmp_path)
    serve = RelayServe(tmp_path, recipients=[ids.recipient], workers=1)
    try:
        def rss_kib() -> int:
            total = 0
            for pid in _process_tree(serve.proc.pid):  # type: ignore[union-attr]
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1])
            return total

        warm = RelayCaller(serve.port, ids.sender)
        try:
            assert warm.request("POST", "/relay/mcp", rpc("tools/list")).status == 200
        finally:
            warm.close()
        body = rpc("tools/list", {"pad": "p" * (TINY_BODY - 60)})
        grown_mib, answer = _held_in_tiny_records(
            serve.port, RELAY_HOST, "/relay/mcp", body, rss_kib,
            relay_client_context(ids.sender))
    finally:
        serve.stop()
    assert answer.startswith(b"HTTP/1.1 "), answer[:200]
    assert grown_mib < 8 * TINY_BODY / 2**20, (
        f"{grown_mib:.1f} MiB held for a {TINY_BODY / 2**20:.1f} MiB body")


def _process_tree(pid: int) -> list[int]:
    pids = [pid]
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            pids += [int(p) for p in (task / "children").read_text().split()]
    return pids


# --- read ahead behind a streamed answer, in tiny TLS records -----------------------------

#: Connections that each stream an answer while the client pipelines behind it.
STREAMERS = 4
#: What each pipelines: a request whose body is far more than the edge reads ahead.
PIPELINED_BODY = 64 * 1024


def _settled_unread(port: int, client_ports: list[int]) -> None:
    """Until the edge reads no more of these connections: all read, or nothing more read
    for a while (it stopped reading ahead); bounded."""
    deadline = time.monotonic() + 20
    last, since = None, time.monotonic()
    while time.monotonic() < deadline:
        unread = [_unread_on_server(port, p) for p in client_ports]
        if not any(unread):
            return
        if unread != last:
            last, since = unread, time.monotonic()
        elif time.monotonic() - since > 1.0:
            return
        time.sleep(0.1)


def test_reading_ahead_behind_a_streamed_answer_costs_about_its_bytes(env: ServeEnv) -> None:
    """While an answer streams, the HTTP/1.1 leg reads ahead a bounded number of bytes
    (to see the client's close behind a pipelined request). A client sending those bytes
    two per TLS record makes one parser event per record: bounded in bytes, the read
    ahead must be bounded in what it holds too."""
    serve = env.serve
    port = serve.port
    assert exchange(port, request_bytes("GET", "/warm", OPT_HOST),
                    host=OPT_HOST).status == 200
    body = b"x" * PIPELINED_BODY
    pipelined = request_bytes("POST", "/up", OPT_HOST, body=body,
                              content_type="application/octet-stream")[:-len(body)]
    conns: list[_Records] = []
    try:
        before = serve.rss_kib()
        for _ in range(STREAMERS):
            conn = _Records(port, OPT_HOST)
            conns.append(conn)
            conn.obj.write(request_bytes("GET", "/stream?n=100&interval=0.1", OPT_HOST))
            conn.flush()
        for conn in conns:  # each answer's head first: the answers stream
            assert conn.response_head().startswith(b"HTTP/1.1 200 ")
        for conn in conns:
            conn.obj.write(pipelined)
            for i in range(0, len(body), TINY_RECORD):
                conn.obj.write(body[i:i + TINY_RECORD])
            conn.flush()
        _settled_unread(port, [c.raw.getsockname()[1] for c in conns])
        time.sleep(1.0)  # the records of the last read decrypted and parsed
        grown_mib = (serve.rss_kib() - before) / 1024
    finally:
        for conn in conns:
            conn.raw.close()
    assert grown_mib < STREAMERS * 1.0, (
        f"{grown_mib:.1f} MiB held for {STREAMERS} connections' read ahead")


# --- the process's body-buffer cap, held by declarations alone ----------------------------

#: The process's cap on buffered MCP body bytes and one client's share of it
#: (`net.terminate.MAX_BUFFERED_TOTAL`, `MAX_BUFFERED_PER_CLIENT`), and the route's
#: body cap (the default `max_body_bytes`).
BUFFERED_TOTAL = 256 * 1024 * 1024
BUFFERED_PER_CLIENT = 18 * 1024 * 1024
MAX_BODY = 6 * 1024 * 1024


def test_declared_lengths_alone_do_not_take_the_processs_body_buffers(tmp_path: Path) -> None:
    """Clients that send the head of an MCP POST declaring the largest body, and not a
    byte of it, hold nothing: the buffer shares bound bytes buffered. Counted at the
    head, a few heads from a handful of addresses (a handful of IPv6 /64s is nothing)
    held the whole process's cap, and every other client's MCP call got 503."""
    env = ServeEnv.start(tmp_path, workers=1)
    held: list[ssl.SSLSocket] = []
    try:
        port = env.serve.port
        sizes = [MAX_BODY] * (BUFFERED_TOTAL // MAX_BODY)
        sizes.append(BUFFERED_TOTAL - sum(sizes) - 100)  # all but 100 bytes of the cap
        per_client = BUFFERED_PER_CLIENT // MAX_BODY
        for n, size in enumerate(sizes):
            source = f"127.0.1.{10 + n // per_client}"
            sock = tls_socket(port, OPT_HOST, source=source)
            held.append(sock)
            sock.sendall(f"POST /mcp HTTP/1.1\r\nHost: {OPT_HOST}\r\n"
                         f"Content-Type: application/json\r\n"
                         f"Content-Length: {size}\r\n\r\n".encode())
        # the heads are read and their bodies awaited: nothing outside shows it, so a
        # moment is given (on a slow machine the bystander may come first and pass
        # anyway; it never fails for it)
        time.sleep(0.5)
        bystander = exchange(port, request_bytes("POST", "/mcp", OPT_HOST,
                                                 body=rpc("tools/list", {"pad": "p" * 200})),
                             host=OPT_HOST, source="127.0.2.1")
        assert bystander.status == 200, (bystander.status, bystander.body[:200])
    finally:
        for sock in held:
            forget(sock)
        env.stop()


def test_declared_lengths_alone_do_not_take_the_relays_body_buffers(tmp_path: Path) -> None:
    """The relay host's reader the same: its shares count bytes buffered, not lengths
    declared by heads that send nothing after them."""
    ids = relay_identities(tmp_path)
    serve = RelayServe(tmp_path, recipients=[ids.recipient], workers=1)
    held: list[ssl.SSLSocket] = []
    try:
        largest = RELAY_MAX_REQUEST
        sizes = [largest] * (BUFFERED_TOTAL // largest)
        sizes.append(BUFFERED_TOTAL - sum(sizes) - 100)  # all but 100 bytes of the cap
        per_client = (3 * largest) // largest
        for n, size in enumerate(sizes):
            sock = relay_socket(serve.port, ids.sender, source=f"127.0.3.{10 + n // per_client}")
            held.append(sock)
            sock.sendall(f"POST /relay/mcp HTTP/1.1\r\nHost: {RELAY_HOST}\r\n"
                         f"Content-Type: application/json\r\n"
                         f"Content-Length: {size}\r\n\r\n".encode())
        time.sleep(0.5)  # as above: the heads read, their bodies awaited
        bystander = RelayCaller(serve.port, ids.sender, source="127.0.4.1")
        try:
            resp = bystander.request("POST", "/relay/mcp", rpc("tools/list", {"pad": "p" * 200}))
        finally:
            bystander.close()
        assert resp.status == 200, (resp.status, resp.body[:200])
    finally:
        for sock in held:
            forget(sock)
        serve.stop()


def test_a_declared_body_no_share_could_hold_is_refused_at_its_head(tmp_path: Path) -> None:
    """Counting bytes as they come must not make a client upload what can never fit:
    with a body cap above a client's buffer share, an MCP body declared larger than
    the share is refused at its head (429), as before, without a byte of it read."""
    env = ServeEnv.start(tmp_path, workers=1, limits={"max_body_bytes": "64MiB"})
    try:
        sock = tls_socket(env.serve.port, OPT_HOST)
        try:
            sock.sendall(f"POST /mcp HTTP/1.1\r\nHost: {OPT_HOST}\r\n"
                         f"Content-Type: application/json\r\n"
                         f"Content-Length: {BUFFERED_PER_CLIENT + 1}\r\n\r\n".encode())
            resp = read_response(sock)
        finally:
            forget(sock)
        assert resp.status == 429, (resp.status, resp.body[:200])
        assert resp.header("retry-after") == "1"
    finally:
        env.stop()
