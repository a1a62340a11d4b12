"""The README's answer tables, row by row, against one real `serve` over real sockets.

Each test pins the detail a row promises (the status and, where the row says so, the
`Retry-After` value, the close, the JSON-RPC code, the alert number) on both HTTP versions
where the row applies, for the rows no other test pins end to end. One serve and one
recording node are shared by the module; each test comes from a source address of its own
where a per-client budget could carry over.
"""

from __future__ import annotations

import contextlib
import json
import socket
import ssl
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import h2.events as h2_events
import pytest

from pact_ingress.identity import b64url_decode
from tests.netutil import free_port
from tests.relay_env import (
    RELAY_HOST,
    RelayCaller,
    RelayH2,
    RelayIdentities,
    RelayServe,
    envelope,
    relay_identities,
    relay_socket,
    tool_body,
)
from tests.terminate_env import (
    HOST,
    OPT_HOST,
    WAIT,
    H2Conn,
    H2Result,
    RecordingNode,
    Serve,
    ServeEnv,
    client_context,
    closed_by_peer,
    forget,
    hostport,
    make_identities,
    read_response,
    request_bytes,
    rpc,
    tls_socket,
    unsealed_call_body,
)

#: A terminate route whose certificate comes from ACME, from a CA that never answers: it
#: has no certificate for as long as the module runs.
ACME_HOST = "pending.answers.test"
#: Routes whose node is never there: an address nobody listens on, a tunnel never dialled.
DOWN_HOST = "down.answers.test"
TUNNEL_DOWN_HOST = "tunnel-down.answers.test"
PT_DOWN_HOST = "pt-down.answers.test"
PT_TUNNEL_HOST = "pt-tunnel.answers.test"
MAX_BODY = 64 * 1024
IN_FLIGHT = 2
#: Calls per hour per IP: a burst of 5 (the floor), so a sixth request in a row is refused;
#: every test here comes from a fresh address and asks far fewer.
IP_RATE = 10
#: Short, so a stalled body is given up within the test; every other test here is busy
#: for far less than this between bytes.
IDLE_S = 2
IP_BURST = 5
NO_ERROR = 0
ENHANCE_YOUR_CALM = 0xB
ALERT_INTERNAL_ERROR = 80


@dataclass
class AcmeServe(Serve):
    """The rig's serve plus an ACME-certificate route whose order cannot complete."""

    acme_port: int = 0
    dead_port: int = 0
    http_port: int = 0

    def render(self) -> str:
        dead = self.acme_port
        self.extra_routes = f"""\
      - host: {ACME_HOST}
        mode: terminate
        backend: "127.0.0.1:{self.node.port}"
        mcp_path: /mcp
        cert: acme
      - host: {DOWN_HOST}
        mode: terminate
        backend: "127.0.0.1:{self.dead_port}"
        cert: {{cert: certs/{DOWN_HOST}.crt, key: certs/{DOWN_HOST}.key}}
      - host: {TUNNEL_DOWN_HOST}
        mode: terminate
        backend: tunnel
        cert: {{cert: certs/{TUNNEL_DOWN_HOST}.crt, key: certs/{TUNNEL_DOWN_HOST}.key}}
      - {{host: {PT_DOWN_HOST}, mode: passthrough, backend: "127.0.0.1:{self.dead_port}"}}
      - {{host: {PT_TUNNEL_HOST}, mode: passthrough, backend: tunnel}}
tunnel: {{hostname: tunnel.answers.test}}
acme:
  directory: https://127.0.0.1:{dead}/dir
  email: ops@answers.test
  agree_tos: yes
  challenges: [tls-alpn-01]
"""
        text = super().render()
        tls_line = f'  tls: ["{hostport(self.listen_host, self.port)}"]\n'
        return text.replace(tls_line, tls_line + f'  http: ["127.0.0.1:{self.http_port}"]\n')


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeEnv]:
    tmp = tmp_path_factory.mktemp("answers")
    ids = make_identities(tmp)
    node = RecordingNode(ids.node, client_ca=ids.ingress)
    try:
        serve = AcmeServe(tmp, node, ids.node.fingerprint,
                          limits={"max_body_bytes": MAX_BODY,
                                  "max_requests_in_flight_per_ip": IN_FLIGHT,
                                  "calls_per_hour_per_ip": IP_RATE,
                                  "idle_timeout": f"{IDLE_S}s"},
                          acme_port=free_port(), dead_port=free_port(),
                          http_port=free_port())
    except BaseException:
        node.stop()
        raise
    e = ServeEnv(serve, node, ids, tmp)
    yield e
    e.stop()


@pytest.fixture
def fresh(env: ServeEnv) -> ServeEnv:
    return env.fresh()


_SOURCES = iter(f"127.0.{b}.{c}" for b in range(40, 60) for c in range(2, 250))


def source() -> str:
    """A loopback address no other test of this module has used: a clean per-IP budget."""
    return next(_SOURCES)


def h1(env: ServeEnv, raw: bytes, *, host: str = HOST, src: str | None = None,
       close: bool = False) -> tuple[Any, bool]:
    """One request on a fresh HTTP/1.1 connection: (the answer or None, and with `close`
    whether the edge closed the connection after it)."""
    sock = tls_socket(env.serve.port, host, source=src or source())
    try:
        sock.sendall(raw)
        try:
            resp = read_response(sock)
        except ConnectionError:
            return None, True
        return resp, close and closed_by_peer(sock)
    finally:
        forget(sock)


def h2(env: ServeEnv, method: str, path: str, *, host: str = HOST, src: str | None = None,
       **kw: Any) -> Any:
    conn = H2Conn(env.serve.port, host, source=src or source())
    try:
        return conn.request(method, path, **kw)
    finally:
        conn.close()


def header(headers: list[tuple[str, str]], name: str) -> str | None:
    for k, v in headers:
        if k.lower() == name:
            return v
    return None


# --- target and head: 400 / 414 / 431 ------------------------------------------------------


@pytest.mark.parametrize("http2", [False, True], ids=["h1", "h2"])
def test_a_target_over_8_kib_is_414(fresh: ServeEnv, http2: bool) -> None:
    target = "/x" + "a" * (8 * 1024 + 16)
    if http2:
        status = h2(fresh, "GET", target).status
    else:
        resp, _ = h1(fresh, request_bytes("GET", target))
        status = resp.status
    assert status == 414, status
    assert fresh.node.requests() == []


#: ~20 KiB of header fields
PADDING = [(f"x-pad-{i}", "p" * 1000) for i in range(20)]


@pytest.mark.parametrize("pipelined", [False, True], ids=["alone", "pipelined"])
def test_a_head_over_16_kib_is_431_and_close(fresh: ServeEnv, pipelined: bool) -> None:
    """The head arrives whole in one write (one read at the edge): the cap must hold
    for it as for a head that trickles in."""
    raw = request_bytes("GET", "/plain", headers=PADDING) + (SMUGGLED if pipelined else b"")
    resp, closed = h1(fresh, raw, close=True)
    assert resp is not None and resp.status == 431, resp and resp.status_line
    assert closed
    assert fresh.node.requests() == []


class _H2Goaway(H2Conn):
    """The rig's HTTP/2 client, keeping the GOAWAY's error code."""

    goaway_code: int | None = None

    def _event(self, ev: Any) -> None:
        if isinstance(ev, h2_events.ConnectionTerminated):
            self.goaway_code = int(ev.error_code)
        super()._event(ev)


def test_h2_header_list_over_16_kib_is_431_on_its_stream(fresh: ServeEnv) -> None:
    """Over the SETTINGS_MAX_HEADER_LIST_SIZE the edge advertised, as over the HTTP/1.1
    head cap: 431 (RFC 9113 §10.5.1). The block is decoded whole, so the connection's
    header-compression state holds and the connection serves the next request."""
    conn = _H2Goaway(fresh.serve.port, HOST, source=source())
    try:
        result = conn.request("GET", "/plain", headers=PADDING)
        assert result.status == 431 and not result.goaway, result
        assert conn.request("GET", "/plain").status == 200
        assert conn.goaway_code is None, conn.goaway_code
    finally:
        conn.close()
    assert [r.target for r in fresh.node.requests()] == ["/plain"]


def test_h2_header_list_far_over_the_cap_is_goaway_enhance_your_calm(fresh: ServeEnv) -> None:
    """Past four times the cap HPACK decoding stops mid-block, so the connection's
    header-compression state is lost: a connection error (RFC 9113 §4.3)."""
    conn = _H2Goaway(fresh.serve.port, HOST, source=source())
    try:
        result = conn.request("GET", "/plain", headers=PADDING * 4)
        assert result.status is None and result.goaway, result
        assert conn.goaway_code == ENHANCE_YOUR_CALM, conn.goaway_code
    finally:
        conn.close()
    assert fresh.node.requests() == []


TARGETS_400 = {
    "asterisk": "*",
    "fragment": "/plain#frag",
    "userinfo": f"https://user@{HOST}/plain",
    "not-ascii": "/pl\xe9in",
    "bad-path-char": "/pl{ain}",
}


@pytest.mark.parametrize("case", list(TARGETS_400))
@pytest.mark.parametrize("http2", [False, True], ids=["h1", "h2"])
def test_unreadable_targets_are_400(fresh: ServeEnv, http2: bool, case: str) -> None:
    target = TARGETS_400[case]
    if http2:
        result = h2(fresh, "OPTIONS" if case == "asterisk" else "GET", target)
        # a :path the RFC itself rules out may also end as a malformed request
        assert result.status == 400 or result.reset == 1, (result.status, result.reset)
    else:
        raw = request_bytes("OPTIONS" if case == "asterisk" else "GET", "@@", HOST)
        resp, _ = h1(fresh, raw.replace(b"@@", target.encode("latin-1")))
        assert resp is not None and resp.status == 400, resp and resp.status_line
    assert fresh.node.requests() == []


def test_authority_form_connect_is_501_and_close(fresh: ServeEnv) -> None:
    raw = f"CONNECT {HOST}:443 HTTP/1.1\r\nHost: {HOST}:443\r\n\r\n".encode()
    resp, closed = h1(fresh, raw + SMUGGLED, close=True)
    assert resp is not None and resp.status == 501, resp and resp.status_line
    assert closed
    assert fresh.node.requests() == []


# --- HTTP/1.1 framing: refused and closed ----------------------------------------------------

#: A request pipelined behind a refused head: it must never reach the node either.
SMUGGLED = f"GET /smuggled HTTP/1.1\r\nHost: {HOST}\r\n\r\n".encode()

FRAMING = {
    "te-gzip": ((b"POST /upload HTTP/1.1\r\nHost: %s\r\nContent-Type: text/plain\r\n"
                b"Transfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n"), 501),
    "upgrade": ((b"GET /plain HTTP/1.1\r\nHost: %s\r\nConnection: upgrade\r\n"
                b"Upgrade: websocket\r\n\r\n"), 501),
    "expect-other": (b"GET /plain HTTP/1.1\r\nHost: %s\r\nExpect: 200-ok\r\n\r\n", 417),
    "two-hosts": (b"GET /plain HTTP/1.1\r\nHost: %s\r\nHost: %s\r\n\r\n", 400),
    "bare-lf": (b"GET /plain HTTP/1.1\nHost: %s\n\n", 400),
    "space-before-colon": (b"GET /plain HTTP/1.1\r\nHost: %s\r\nX-A : b\r\n\r\n", 400),
    "folded-field": (b"GET /plain HTTP/1.1\r\nHost: %s\r\nX-A: b\r\n c\r\n\r\n", 400),
}


@pytest.mark.parametrize("case", list(FRAMING))
def test_h1_framing_refusals_close_the_connection(fresh: ServeEnv, case: str) -> None:
    raw, want = FRAMING[case]
    raw = raw.replace(b"%s", HOST.encode())
    resp, closed = h1(fresh, raw + SMUGGLED, close=True)
    assert resp is not None and resp.status == want, resp and resp.status_line
    assert closed, "connection kept open after a refused head"
    assert fresh.node.requests() == []


# --- scope: 405 / 415 / 403 / 400 -------------------------------------------------------------


@pytest.mark.parametrize("http2", [False, True], ids=["h1", "h2"])
def test_mcp_path_other_method_or_body_is_405(fresh: ServeEnv, http2: bool) -> None:
    cases = [("PUT", rpc("tools/list")), ("PATCH", rpc("tools/list")),
             ("DELETE", rpc("tools/list")), ("OPTIONS", rpc("tools/list"))]
    for method, body in cases:
        if http2:
            status = h2(fresh, method, "/mcp", body=body).status
        else:
            resp, _ = h1(fresh, request_bytes(method, "/mcp", body=body))
            status = resp.status
        assert status == 405, (method, status)
    assert fresh.node.requests() == []


@pytest.mark.parametrize("http2", [False, True], ids=["h1", "h2"])
def test_get_or_head_with_content_is_400(fresh: ServeEnv, http2: bool) -> None:
    for method in ("GET", "HEAD"):
        if http2:
            status = h2(fresh, method, "/plain", body=b"abc", content_type="text/plain").status
        else:
            resp, _ = h1(fresh, request_bytes(method, "/plain", body=b"abc",
                                              content_type="text/plain"))
            status = resp.status
        assert status == 400, (method, status)
    assert fresh.node.requests() == []


@pytest.mark.parametrize("http2", [False, True], ids=["h1", "h2"])
def test_content_encoding_twice_is_400(fresh: ServeEnv, http2: bool) -> None:
    headers = [("content-encoding", "identity"), ("content-encoding", "identity")]
    if http2:
        status = h2(fresh, "POST", "/mcp", body=rpc("tools/list"), headers=headers).status
    else:
        resp, _ = h1(fresh, request_bytes("POST", "/mcp", body=rpc("tools/list"),
                                          headers=headers))
        status = resp.status
    assert status == 400, status
    assert fresh.node.requests() == []


# --- Host: 421 / 400 --------------------------------------------------------------------------


@pytest.mark.parametrize("http2", [False, True], ids=["h1", "h2"])
def test_host_not_the_sni_is_421_and_disagreeing_names_400(fresh: ServeEnv,
                                                             http2: bool) -> None:
    if http2:
        other = h2(fresh, "GET", "/plain", authority=OPT_HOST).status
        both = h2(fresh, "GET", f"https://{OPT_HOST}/plain", headers=[("host", HOST)]).status
    else:
        other = h1(fresh, request_bytes("GET", "/plain", OPT_HOST))[0].status
        both = h1(fresh, request_bytes("GET", f"https://{OPT_HOST}/plain", HOST))[0].status
    assert other == 421, other
    # on HTTP/2 a Host unlike :authority is a malformed request (reset) or 400
    assert both in (400, 421) if http2 else both == 400, both
    assert fresh.node.requests() == []


# --- budgets: 413 early with its close, 429 with Retry-After: 1 --------------------------------


def test_h1_body_over_the_cap_is_413_with_connection_close(fresh: ServeEnv) -> None:
    body = b"x" * (MAX_BODY + 1)
    resp, closed = h1(fresh, request_bytes("POST", "/upload", body=body,
                                           content_type="application/octet-stream"), close=True)
    assert resp is not None and resp.status == 413, resp and resp.status_line
    assert (resp.header("connection") or "").lower() == "close", resp.headers
    assert closed
    assert fresh.node.requests() == []


def test_h2_body_over_the_cap_is_413_then_rst_stream_no_error(fresh: ServeEnv) -> None:
    conn = H2Conn(fresh.serve.port, HOST, source=source())
    try:
        sid = conn.open_stream("POST", "/upload", length=MAX_BODY + 1, first=b"x" * 1000)
        result = conn.wait(sid)
        assert result.status == 413, result
        assert result.reset == NO_ERROR, result.reset
        assert not result.goaway
        # the connection stays usable for the next request
        assert conn.request("GET", "/plain").status == 200
    finally:
        conn.close()


def _held_h1(env: ServeEnv, src: str) -> ssl.SSLSocket:
    """A request the node answers slowly (a chunk a second): in flight until read out."""
    sock = tls_socket(env.serve.port, HOST, source=src)
    sock.sendall(request_bytes("GET", "/stream?n=3&interval=1"))
    head = read_response(sock, head_only=True)
    assert head.status == 200, head.status_line
    return sock


@pytest.mark.parametrize("http2", [False, True], ids=["h1", "h2"])
def test_requests_in_flight_over_the_cap_are_429_retry_after_1(fresh: ServeEnv,
                                                               http2: bool) -> None:
    src = source()
    held = [_held_h1(fresh, src) for _ in range(IN_FLIGHT)]
    try:
        if http2:
            result = h2(fresh, "GET", "/plain", src=src)
            status, retry = result.status, header(result.headers, "retry-after")
        else:
            resp, _ = h1(fresh, request_bytes("GET", "/plain"), src=src)
            status, retry = resp.status, resp.header("retry-after")
        assert status == 429, status
        assert retry == "1", retry
    finally:
        for sock in held:
            forget(sock)


# --- MCP: the refusal shape and the JSON-RPC error codes ----------------------------------------


@pytest.mark.parametrize("http2", [False, True], ids=["h1", "h2"])
@pytest.mark.parametrize("rpc_id", [7, "7"], ids=["int-id", "str-id"])
def test_seal_required_refusal_shape(fresh: ServeEnv, http2: bool, rpc_id: Any) -> None:
    body = unsealed_call_body(rpc_id=rpc_id)
    if http2:
        result = h2(fresh, "POST", "/mcp", body=body)
        status, ctype, raw = result.status, header(result.headers, "content-type"), result.body
    else:
        resp, _ = h1(fresh, request_bytes("POST", "/mcp", body=body))
        status, ctype, raw = resp.status, resp.header("content-type"), resp.body
    assert status == 200, status
    assert (ctype or "").split(";")[0].strip() == "application/json", ctype
    reply = json.loads(raw)
    assert reply["jsonrpc"] == "2.0"
    assert reply["id"] == rpc_id and type(reply["id"]) is type(rpc_id), reply["id"]
    result_doc = reply["result"]
    assert result_doc["isError"] is True
    assert result_doc["structuredContent"] == {"code": "seal_required"}
    assert result_doc["content"][0]["type"] == "text"
    assert result_doc["content"][0]["text"].startswith("seal_required: ")
    assert fresh.node.requests() == []


RPC_ERRORS = {
    "not-json": (b"{not json", "application/json", -32700),
    "duplicate-member": (b'{"jsonrpc": "2.0", "id": 1, "method": "ping", "method": "x"}',
                         "application/json", -32700),
    "nan": (b'{"jsonrpc": "2.0", "id": 1, "method": "ping", "params": {"a": NaN}}',
            "application/json", -32700),
    "wrong-content-type": (rpc("ping"), "text/plain", -32600),
    "charset-utf7": (rpc("ping"), "application/json; charset=utf-7", -32600),
    "not-jsonrpc-2": (b'{"jsonrpc": "1.0", "id": 1, "method": "ping"}', "application/json",
                      -32600),
    "bad-id-type": (b'{"jsonrpc": "2.0", "id": [1], "method": "ping"}', "application/json",
                    -32600),
    "empty-batch": (b"[]", "application/json", -32600),
    "member-case": (b'{"jsonrpc": "2.0", "id": 1, "Method": "tools/call", "method": "ping"}',
                    "application/json", -32600),
}


@pytest.mark.parametrize("case", list(RPC_ERRORS))
@pytest.mark.parametrize("http2", [False, True], ids=["h1", "h2"])
def test_bad_json_rpc_is_400_with_the_specs_code(fresh: ServeEnv, http2: bool,
                                                  case: str) -> None:
    body, ctype, code = RPC_ERRORS[case]
    if http2:
        result = h2(fresh, "POST", "/mcp", body=body, content_type=ctype)
        status, raw = result.status, result.body
    else:
        resp, _ = h1(fresh, request_bytes("POST", "/mcp", body=body, content_type=ctype))
        status, raw = resp.status, resp.body
    assert status == 400, status
    reply = json.loads(raw)
    assert reply["error"]["code"] == code, reply
    # null, or the request's own id where it could be read as one
    assert reply["id"] is None or (case == "member-case" and reply["id"] == 1), reply
    assert fresh.node.requests() == []


# --- before routing: a terminate host with no certificate yet ----------------------------------


def _alert_for(port: int, sni: str) -> bytes:
    """The first bytes the edge answers a real ClientHello for `sni` with."""
    ctx = client_context(("h2", "http/1.1"))
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = ctx.wrap_bio(incoming, outgoing, server_hostname=sni)
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT) as sock:
        sock.sendall(outgoing.read())
        got = b""
        while len(got) < 7:
            chunk = sock.recv(64)
            if not chunk:
                break
            got += chunk
    return got


@pytest.mark.parametrize("host", [PT_DOWN_HOST, PT_TUNNEL_HOST], ids=["address", "tunnel"])
def test_passthrough_with_its_backend_down_gets_alert_80(fresh: ServeEnv, host: str) -> None:
    got = _alert_for(fresh.serve.port, host)
    assert got[:1] == b"\x15" and got[5:7] == bytes([2, ALERT_INTERNAL_ERROR]), got.hex()


@pytest.mark.parametrize("host", [DOWN_HOST, TUNNEL_DOWN_HOST], ids=["address", "tunnel"])
@pytest.mark.parametrize("http2", [False, True], ids=["h1", "h2"])
def test_terminate_with_its_node_offline_is_503_with_retry_after(fresh: ServeEnv,
                                                                 http2: bool, host: str) -> None:
    if http2:
        r = h2(fresh, "GET", "/plain", host=host)
        status, retry = r.status, header(r.headers, "retry-after")
    else:
        resp, _ = h1(fresh, request_bytes("GET", "/plain", host), host=host)
        status, retry = resp.status, resp.header("retry-after")
    assert status == 503, status
    assert retry is not None and int(retry) >= 1, retry


def test_terminate_host_without_a_certificate_yet_gets_alert_80(fresh: ServeEnv) -> None:
    got = _alert_for(fresh.serve.port, ACME_HOST)
    # a fatal alert record: level 2, description 80 (internal_error)
    assert got[:1] == b"\x15" and got[5:7] == bytes([2, ALERT_INTERNAL_ERROR]), got.hex()
    # the neighbouring host with its certificate is served meanwhile
    resp, _ = h1(fresh, request_bytes("GET", "/plain"))
    assert resp.status == 200


def test_h2_connect_authority_form_is_400(fresh: ServeEnv) -> None:
    """HTTP/2 has no parser-level CONNECT refusal: the authority-form target is what the
    edge refuses (HTTP/1.1's parser answers it 501 first, above)."""
    conn = H2Conn(fresh.serve.port, HOST, source=source())
    try:
        sid = conn.conn.get_next_available_stream_id()
        conn._results[sid] = H2Result(None, [], b"")
        conn.conn.send_headers(sid, [(b":method", b"CONNECT"),
                                     (b":authority", f"{HOST}:443".encode())], end_stream=True)
        conn.sock.sendall(conn.conn.data_to_send())
        result = conn.wait(sid)
        assert result.status == 400, (result.status, result.reset)
    finally:
        conn.close()
    assert fresh.node.requests() == []


# --- MCP: batches, notifications, rate_limited ---------------------------------------------


def _post(env: ServeEnv, http2: bool, body: bytes, *, path: str = "/mcp",
          src: str | None = None, content_type: str = "application/json"
          ) -> tuple[int | None, list[tuple[str, str]], bytes]:
    if http2:
        r = h2(env, "POST", path, body=body, src=src, content_type=content_type)
        return r.status, r.headers, r.body
    resp, _ = h1(env, request_bytes("POST", path, body=body, content_type=content_type),
                 src=src)
    return resp.status, resp.headers, resp.body


def _tool_error_code(reply: dict[str, Any]) -> str:
    assert reply["result"]["isError"] is True, reply
    return str(reply["result"]["structuredContent"]["code"])


@pytest.mark.parametrize("http2", [False, True], ids=["h1", "h2"])
def test_a_batch_with_a_refused_call_is_answered_per_element_and_not_forwarded(
        fresh: ServeEnv, http2: bool) -> None:
    batch = json.dumps([json.loads(rpc("tools/list", rpc_id="a")),
                        json.loads(unsealed_call_body(rpc_id=2)),
                        json.loads(rpc("notifications/initialized", rpc_id=None))]).encode()
    status, _, raw = _post(fresh, http2, batch)
    assert status == 200, status
    replies = json.loads(raw)
    assert isinstance(replies, list) and [r["id"] for r in replies] == ["a", 2], replies
    assert _tool_error_code(replies[0]) == "bad_request"
    assert "another call in the same batch was refused" in (
        replies[0]["result"]["content"][0]["text"])
    assert _tool_error_code(replies[1]) == "seal_required"
    assert fresh.node.requests() == []


@pytest.mark.parametrize("http2", [False, True], ids=["h1", "h2"])
def test_a_refused_notification_is_answered_with_a_null_id(fresh: ServeEnv,
                                                           http2: bool) -> None:
    call = json.loads(unsealed_call_body())
    del call["id"]
    status, _, raw = _post(fresh, http2, json.dumps(call).encode())
    assert status == 200, status
    reply = json.loads(raw)
    assert reply["id"] is None and _tool_error_code(reply) == "seal_required", reply
    assert fresh.node.requests() == []


@pytest.mark.parametrize("http2", [False, True], ids=["h1", "h2"])
def test_over_the_ip_budget_mcp_gets_rate_limited_and_other_paths_a_plain_429(
        fresh: ServeEnv, http2: bool) -> None:
    src = source()
    for n in range(IP_BURST):
        status, _, raw = _post(fresh, http2, rpc("tools/list", rpc_id=n), src=src)
        assert status == 200 and "error" not in json.loads(raw), (n, status, raw[:200])
    status, headers, raw = _post(fresh, http2, rpc("tools/list", rpc_id=9), src=src)
    assert status == 200, status
    reply = json.loads(raw)
    # judged at the head, before the body was read: no id known
    assert reply["id"] is None and _tool_error_code(reply) == "rate_limited", reply
    retry = reply["result"]["structuredContent"]["retry_after"]
    assert isinstance(retry, int) and retry >= 1, retry
    assert header(headers, "retry-after") == str(retry), headers
    status, headers, _ = _post(fresh, http2, b"x", path="/upload", src=src,
                               content_type="application/octet-stream")
    assert status == 429, status
    assert int(header(headers, "retry-after") or "0") >= 1, headers
    assert len(fresh.node.requests()) == IP_BURST


# --- the relay host: its JSON-RPC 400s, and refused heads queue nothing ---------------------


@dataclass
class RelayEnv:
    serve: RelayServe
    ids: RelayIdentities

    def queued(self) -> list[str]:
        recipient = RelayCaller(self.serve.port, self.ids.recipient)
        try:
            page = recipient.tool("fetch_queued", {"limit": 1000})[0]["structuredContent"]
        finally:
            recipient.close()
        return [json.loads(b64url_decode(i["envelope"]["protected"]))["msg_id"]
                for i in page["items"]]

    def call_body(self, msg_id: str) -> bytes:
        return tool_body("relay_call", envelope(self.ids.sender, self.ids.recipient,
                                                msg_id=msg_id))


@pytest.fixture(scope="module")
def relay(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RelayEnv]:
    tmp = tmp_path_factory.mktemp("relay-answers")
    ids = relay_identities(tmp)
    serve = RelayServe(tmp, recipients=[ids.recipient])
    try:
        recipient = RelayCaller(serve.port, ids.recipient)
        assert recipient.allowlist_set([ids.sender.fingerprint]).status == 200
        recipient.close()
        yield RelayEnv(serve, ids)
    finally:
        serve.stop()


RELAY_RPC_ERRORS = {
    "bom": (b"\xef\xbb\xbf" + rpc("ping"), -32700),
    "nan": (b'{"jsonrpc": "2.0", "id": 1, "method": "ping", "params": {"a": NaN}}', -32700),
    "infinity": (b'{"jsonrpc": "2.0", "id": 1, "method": "ping", "params": {"a": Infinity}}',
                 -32700),
    "member-twice": (b'{"jsonrpc": "2.0", "id": 1, "method": "ping", "method": "ping"}',
                     -32700),
    "not-utf8": (b'{"jsonrpc": "2.0", "id": 1, "method": "p\xffng"}', -32700),
    "batch": (b"[" + rpc("ping") + b"]", -32600),
    "id-list": (b'{"jsonrpc": "2.0", "id": [1], "method": "ping"}', -32600),
    "id-float": (b'{"jsonrpc": "2.0", "id": 1.5, "method": "ping"}', -32600),
    "id-object": (b'{"jsonrpc": "2.0", "id": {}, "method": "ping"}', -32600),
}


@pytest.mark.parametrize("case", list(RELAY_RPC_ERRORS))
@pytest.mark.parametrize("http2", [False, True], ids=["h1", "h2"])
def test_relay_bad_json_rpc_is_400_with_the_specs_code_and_a_null_id(
        relay: RelayEnv, http2: bool, case: str) -> None:
    body, code = RELAY_RPC_ERRORS[case]
    if http2:
        conn = RelayH2(relay.serve.port, relay.ids.sender, validate=False)
        try:
            res = conn.request("POST", "/relay/mcp", body=body)
            status, raw = res.status, res.body
        finally:
            conn.close()
    else:
        caller = RelayCaller(relay.serve.port, relay.ids.sender)
        try:
            resp = caller.request("POST", "/relay/mcp", body)
            status, raw = resp.status, resp.body
        finally:
            caller.close()
    assert status == 400, status
    reply = json.loads(raw)
    assert reply["error"]["code"] == code and reply["id"] is None, reply


RELAY_REFUSED_HEADS = {
    "two-hosts": (b"Host: %s\r\nHost: %s\r\nContent-Type: application/json\r\n", 400),
    "te-gzip": (b"Host: %s\r\nTransfer-Encoding: gzip\r\n", 501),
    "expect-other": (b"Host: %s\r\nExpect: 200-ok\r\n", 417),
}


@pytest.mark.parametrize("case", list(RELAY_REFUSED_HEADS))
def test_relay_refused_heads_queue_nothing(relay: RelayEnv, case: str) -> None:
    """The relay host runs the terminate engine's HTTP/1.1 parser: a head it refuses is
    answered and the connection closed; neither that call nor one behind it is queued."""
    fields, want = RELAY_REFUSED_HEADS[case]
    body = relay.call_body(f"refused-{case}")
    head = (b"POST /relay/mcp HTTP/1.1\r\n" + fields.replace(b"%s", RELAY_HOST.encode())
            + b"Content-Length: %d\r\n\r\n" % len(body))
    if b"Transfer-Encoding" in head:
        head = head.replace(b"Content-Length: %d\r\n" % len(body), b"")
        body = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    behind = request_bytes("POST", "/relay/mcp", RELAY_HOST,
                           body=relay.call_body(f"behind-{case}"))
    sock = relay_socket(relay.serve.port, relay.ids.sender)
    try:
        sock.sendall(head + body + behind)
        resp = read_response(sock)
        assert resp.status == want, resp.status_line
        assert closed_by_peer(sock)
    finally:
        forget(sock)
    assert not [m for m in relay.queued() if m.endswith(case)], relay.queued()


# --- the admin endpoint of the same serve --------------------------------------------------


def _admin(env: ServeEnv, method: str, path: str, headers: dict[str, str] | None = None
           ) -> tuple[int, dict[str, str]]:
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", env.serve.admin_port, timeout=WAIT)
    try:
        conn.request(method, path, body=b"" if method == "POST" else None,
                     headers=headers or {})
        resp = conn.getresponse()
        resp.read()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}
    finally:
        conn.close()


@pytest.mark.parametrize("path", ["/reload", "/certs/renew"])
@pytest.mark.parametrize("headers", [{"Origin": "https://evil.example"},
                                     {"Origin": "null"},
                                     {"Sec-Fetch-Site": "cross-site"},
                                     {"Sec-Fetch-Site": "same-origin"}],
                         ids=["origin", "origin-null", "cross-site", "same-origin"])
def test_admin_refuses_browser_posts_with_403(fresh: ServeEnv, path: str,
                                              headers: dict[str, str]) -> None:
    before = len([e for e in fresh.serve.log_events() if e.get("event") == "reloaded"])
    status, _ = _admin(fresh, "POST", path, headers)
    assert status == 403, status
    assert len([e for e in fresh.serve.log_events() if e.get("event") == "reloaded"]) == before


def test_admin_refuses_a_rebound_host_with_421(fresh: ServeEnv) -> None:
    for host in ("evil.example", f"evil.example:{fresh.serve.admin_port}", "192.0.2.2"):
        assert _admin(fresh, "GET", "/status", {"Host": host})[0] == 421, host
    assert _admin(fresh, "GET", "/status")[0] == 200


def test_admin_status_page_headers(fresh: ServeEnv) -> None:
    status, headers = _admin(fresh, "GET", "/")
    assert status == 200
    assert headers["content-security-policy"].startswith("default-src 'none'"), headers
    assert headers["x-frame-options"] == "DENY", headers
    assert headers["referrer-policy"] == "no-referrer", headers


# --- port 80 ---------------------------------------------------------------------------------

PORT80_PER_CLIENT = 32


def _port80(env: ServeEnv, raw: bytes, src: str) -> bytes:
    with socket.create_connection(("127.0.0.1", env.serve.http_port), timeout=WAIT,
                                  source_address=(src, 0)) as sock:
        sock.sendall(raw)
        got = b""
        try:
            while chunk := sock.recv(65536):
                got += chunk
        except ConnectionResetError:
            pass
        return got


def test_port80_redirects_with_308_to_https_on_the_same_name(fresh: ServeEnv) -> None:
    got = _port80(fresh, f"GET /a/b?c=1 HTTP/1.1\r\nHost: {HOST}\r\n\r\n".encode(), source())
    head = got.split(b"\r\n\r\n", 1)[0].decode("latin-1").lower()
    assert head.startswith("http/1.1 308 "), head
    assert f"\r\nlocation: https://{HOST}/a/b?c=1" in head, head


def test_port80_connections_over_the_per_client_cap_are_closed_at_accept(
        fresh: ServeEnv) -> None:
    src = source()
    held = []
    try:
        for _ in range(PORT80_PER_CLIENT):
            held.append(socket.create_connection(("127.0.0.1", fresh.serve.http_port),
                                                 timeout=WAIT, source_address=(src, 0)))
        # one more from the same address: closed before its request is read
        request = f"GET / HTTP/1.1\r\nHost: {HOST}\r\n\r\n".encode()
        got = b""
        with connect_from(src, fresh.serve.http_port) as extra:
            with contextlib.suppress(OSError):
                extra.sendall(request)
            try:
                got = extra.recv(65536)
            except ConnectionResetError:
                got = b""
        assert got == b"", got[:100]
        # another address is served meanwhile, and so is one of the held ones
        assert _port80(fresh, request, source()).startswith(b"HTTP/1.1 308 ")
        held[0].sendall(request)
        assert held[0].recv(65536).startswith(b"HTTP/1.1 308 ")
    finally:
        for sock in held:
            sock.close()


@contextlib.contextmanager
def connect_from(src: str, port: int) -> Iterator[socket.socket]:
    sock = socket.create_connection(("127.0.0.1", port), timeout=WAIT, source_address=(src, 0))
    try:
        yield sock
    finally:
        sock.close()


# --- a body that stops coming ------------------------------------------------------------------


def _requests_499(env: ServeEnv) -> float:
    total = 0.0
    for line in env.serve.metrics().splitlines():
        if line.startswith("pact_ingress_http_requests_total{") and 'status="499"' in line \
                and f'route="{HOST}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.mark.parametrize("path", ["/upload", "/mcp"], ids=["streamed", "buffered"])
@pytest.mark.parametrize("http2", [False, True], ids=["h1", "h2"])
def test_a_body_idle_for_idle_timeout_is_dropped_and_counted_499(fresh: ServeEnv,
                                                                 http2: bool, path: str) -> None:
    """A body that stops coming is given up after idle_timeout (not only at the 60 s
    whole-body deadline): no answer, the connection (HTTP/1.1) or the stream (HTTP/2)
    dropped, the request counted as 499. A streamed body and a buffered MCP body alike."""
    ctype = "application/json" if path == "/mcp" else "application/octet-stream"
    before = _requests_499(fresh)
    bound = IDLE_S * 3 + 3  # idle_timeout, checked about once a second, with room
    if http2:
        conn = H2Conn(fresh.serve.port, HOST, source=source())
        try:
            sid = conn.conn.get_next_available_stream_id()
            conn._results[sid] = H2Result(None, [], b"")
            conn.conn.send_headers(sid, [
                (b":method", b"POST"), (b":scheme", b"https"),
                (b":authority", HOST.encode()), (b":path", path.encode()),
                (b"content-type", ctype.encode()), (b"content-length", b"1000")])
            conn.conn.send_data(sid, b"{" + b" " * 9)
            conn.sock.sendall(conn.conn.data_to_send())
            result = conn.wait(sid, timeout=bound)
        finally:
            conn.close()
        assert result.status is None and (result.reset is not None or result.goaway), result
    else:
        sock = tls_socket(fresh.serve.port, HOST, source=source())
        try:
            sock.sendall(request_bytes("POST", path, body=b"{" + b" " * 999,
                                       content_type=ctype)[:-990])
            sock.settimeout(bound)
            got = b""
            try:
                while chunk := sock.recv(65536):
                    got += chunk
            except (ConnectionError, ssl.SSLError):
                pass
        finally:
            forget(sock)
        assert got == b"", got[:200]
    deadline = time.monotonic() + WAIT
    while _requests_499(fresh) < before + 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _requests_499(fresh) == before + 1
    assert not [r for r in fresh.node.requests() if r.path == "/mcp"]
