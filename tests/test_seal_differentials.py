"""Seal posture against reader differentials: what the edge judged versus what a node
could read from the same bytes.

Run:   python -m pytest tests/test_seal_differentials.py -q

The edge judges a JSON-RPC body once; the node parses it again with its own stack. Any
byte sequence the two read differently is a way around the posture. The readings a
real node may apply, each modelled below by `_readings`:

* strict UTF-8 JSON, exact member names (Python, pydantic, Jackson);
* the body decoded with the `charset` of its Content-Type first (the MCP TypeScript
  SDK hands the charset to raw-body, which decodes anything iconv-lite knows, UTF-7
  included);
* member names matched without regard to case, the last one winning (Go's
  `encoding/json` into a struct, which also folds U+017F to `s` and U+212A to `k`).

The invariant, over each spelling in each table: no reading of any request that reached
the node holds an unsealed `tools/call` (the route is `seal: required`), and the client
got a defined answer (a 4xx, a JSON-RPC refusal, or an HTTP/2 reset).

Same harness as tests/test_terminate_attacks.py: a real `serve` and a recording node
(tests/terminate_env.py), loopback only, nothing imports the terminate engine.
"""

from __future__ import annotations

import codecs
import json
from typing import Any

import pytest

from pact_ingress.proto.posture import MAX_JSON_VALUES, value_count
from tests.terminate_env import (
    HOST,
    OPT_HOST,
    H2Conn,
    H2Result,
    NodeRequest,
    exchange,
    forget,
    gzip_bytes,
    module_fixtures,
    read_response,
    request_bytes,
    rpc,
    sealed_call_body,
    tls_socket,
    unsealed_call_body,
)
from tests.terminate_env import (
    ServeEnv as Env,
)

shared, env = module_fixtures("differentials")


# --- how a node may read what it got -----------------------------------------------------


def _charset(content_type: str | None) -> str | None:
    """The charset a lenient media-type parser takes: the last `charset` parameter."""
    found = None
    for param in (content_type or "").split(";")[1:]:
        name, _, value = param.partition("=")
        if name.strip().lower().startswith("charset"):
            found = value.strip().strip('"').strip("'")
    return found


def _fold_keys(value: Any) -> Any:
    """Go's reading: member names compared case-insensitively, the last one wins."""
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, item in value.items():
            out[key.casefold()] = _fold_keys(item)
        return out
    if isinstance(value, list):
        return [_fold_keys(v) for v in value]
    return value


def _c_keys(value: Any) -> Any:
    """A C parser's reading: member names end at a NUL, the last one wins."""
    if isinstance(value, dict):
        return {key.partition("\0")[0]: _c_keys(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_c_keys(v) for v in value]
    return value


def _texts(req: NodeRequest) -> list[str]:
    texts = []
    try:
        texts.append(req.body.decode("utf-8"))
    except UnicodeDecodeError:
        pass
    charset = _charset(next(iter(req.header_values("content-type")), None))
    if charset:
        try:
            texts.append(codecs.decode(req.body, charset))
        except (LookupError, ValueError):
            pass
    return texts


def _readings(req: NodeRequest) -> list[Any]:
    readings = []
    for text in _texts(req):
        try:
            doc = json.loads(text.lstrip("\ufeff"))  # a repeated member: the last wins
        except ValueError:
            continue
        readings += [doc, _fold_keys(doc), _c_keys(doc)]
    return readings


def _unsealed_in(doc: Any) -> list[Any]:
    out = []
    for message in doc if isinstance(doc, list) else [doc]:
        if isinstance(message, dict) and message.get("method") == "tools/call":
            params = message.get("params")
            name = params.get("name") if isinstance(params, dict) else None
            if name != "sealed_call":
                out.append(name)
    return out


def _assert_nothing_unsealed_reached(env: Env, case: str) -> None:
    for req in env.node.requests():
        for doc in _readings(req):
            assert not _unsealed_in(doc), (
                f"{case}: the node got {req.method} {req.target} "
                f"({req.header_values('content-type')}) whose body a node reads as an "
                f"unsealed tools/call of {_unsealed_in(doc)}")


def _codes(body: bytes) -> set[str]:
    """Every PACT refusal code in an edge answer (one per element of a batch)."""
    try:
        doc = json.loads(body)
    except ValueError:
        return set()
    codes = set()
    for item in doc if isinstance(doc, list) else [doc]:
        result = item.get("result") if isinstance(item, dict) else None
        if isinstance(result, dict) and result.get("isError"):
            codes.add(str((result.get("structuredContent") or {}).get("code")))
    return codes


def _defined(status: int | None, body: bytes, reset: int | None = None) -> bool:
    """A 4xx, an HTTP/2 reset, or a JSON-RPC refusal naming a seal code."""
    return (reset is not None or (status is not None and 400 <= status < 500)
            or (status == 200 and bool(_codes(body) & {"seal_required", "envelope_invalid"})))


def _post(env: Env, body: bytes, *, http2: bool, content_type: str | None = "application/json",
          headers: list[tuple[str, str]] | None = None, target: str = "/mcp",
          method: str = "POST") -> tuple[int | None, bytes, int | None]:
    if http2:
        conn = H2Conn(env.serve.port, HOST)
        try:
            res = conn.request(method, target, body=body, content_type=content_type,
                               headers=headers or [], coalesce=False)
        finally:
            conn.close()
        return res.status, res.body, res.reset
    resp = exchange(env.serve.port, request_bytes(method, target, HOST, body=body,
                                                  content_type=content_type,
                                                  headers=headers or []))
    return resp.status, resp.body, None


BOTH = pytest.mark.parametrize("http2", [False, True], ids=["h1", "h2"])


def _call_with(**members: Any) -> dict[str, Any]:
    message: dict[str, Any] = {"jsonrpc": "2.0", "id": 1}
    message.update(members)
    return message


SEND = {"name": "send_message", "arguments": {"msg_id": "m-1", "text": "unsealed"}}


# === charset: the node may decode the body as something else than UTF-8 =============

#: `tools/call` spelt so that only a UTF-7 reader sees it: `+AHQ-` is `t`.
UTF7_CALL = json.dumps(_call_with(method="+AHQ-ools/call", params=SEND)).encode()

CHARSETS = [
    "application/json; charset=utf-7",
    "application/json;charset=UTF-7",
    'application/json; charset="utf-7"',
    "application/json; charset=utf-8; charset=utf-7",
    "application/json; charset=utf7",
    "application/json; Charset=utf-7",
]


@BOTH
@pytest.mark.parametrize("content_type", CHARSETS)
def test_a_charset_other_than_utf8_cannot_carry_a_call(env: Env, http2: bool,
                                                       content_type: str) -> None:
    """MCP bodies are UTF-8. A node that honours the declared charset reads `+AHQ-ools/call`
    under UTF-7 as `tools/call`, while the edge read a method it forwards; so a charset
    other than UTF-8 is refused, whatever the spelling of its parameter."""
    status, body, reset = _post(env, UTF7_CALL, http2=http2, content_type=content_type)
    _assert_nothing_unsealed_reached(env, content_type)
    assert _defined(status, body, reset), (content_type, status, body[:200])


@BOTH
@pytest.mark.parametrize("content_type", ["application/json; charset=utf-8",
                                          "application/json; charset=UTF-8",
                                          'application/json; charset="utf-8"',
                                          "application/json"])
def test_utf8_bodies_are_still_served(env: Env, http2: bool, content_type: str) -> None:
    status, body, _ = _post(env, rpc("tools/list", {}), http2=http2, content_type=content_type)
    assert status == 200 and not _codes(body), (status, body[:200])
    assert [r.path for r in env.node.requests()] == ["/mcp"]


# === member names a case-insensitive parser reads as another =========================


def _fabricated_envelope(env: Env) -> dict[str, Any]:
    """A sealed_call whose header passes the edge (anyone can write one: the edge cannot
    check the signature) — the cover under which a second reading hides."""
    doc = json.loads(sealed_call_body(env.ids, msg_id="cover"))
    return dict(doc["params"])


def _fold_bodies(env: Env) -> dict[str, bytes]:
    cover = _fabricated_envelope(env)
    raw = {
        # the edge sees tools/list; a case-insensitive reader takes the last "method"
        "Method-after-method": (
            '{"jsonrpc":"2.0","id":1,"method":"tools/list","Method":"tools/call",'
            '"params":' + json.dumps(SEND) + "}"),
        # the edge sees a response (no "method"); such a reader sees a request
        "METHOD-in-a-response": (
            '{"jsonrpc":"2.0","id":1,"result":{},"METHOD":"tools/call","params":'
            + json.dumps(SEND) + "}"),
        # U+017F folds to "s" in Go: "paramſ" is "params" there
        "long-s-params": (
            '{"jsonrpc":"2.0","id":1,"method":"tools/call","params":' + json.dumps(cover)
            + ',"param\u017f":' + json.dumps(SEND) + "}"),
        # the edge sees sealed_call and its envelope; the reader the later Name/Arguments
        "Name-and-Arguments": (
            '{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"sealed_call",'
            '"arguments":' + json.dumps(cover["arguments"]) + ',"Name":"send_message",'
            '"Arguments":{"msg_id":"m-1","text":"unsealed"}}}'),
        # a reader that keeps names as C strings: "method\0x" is "method" there
        "NUL-cut-method": (
            '{"jsonrpc":"2.0","id":1,"method":"tools/list","method\\u0000x":"tools/call",'
            '"params":' + json.dumps(SEND) + "}"),
        "batch-with-a-folded-element": (
            '[{"jsonrpc":"2.0","id":1,"method":"tools/list"},'
            '{"jsonrpc":"2.0","id":2,"method":"ping","MetHod":"tools/call","params":'
            + json.dumps(SEND) + "}]"),
    }
    return {k: v.encode() for k, v in raw.items()}


FOLD_CASES = ["Method-after-method", "METHOD-in-a-response", "long-s-params",
              "Name-and-Arguments", "NUL-cut-method", "batch-with-a-folded-element"]


@BOTH
@pytest.mark.parametrize("case", FOLD_CASES)
def test_member_names_differing_only_in_case_cannot_carry_a_call(env: Env, http2: bool,
                                                                 case: str) -> None:
    """A JSON-RPC or tools/call member spelt in another case (or with a character Go
    folds onto an ASCII letter) is the member to a case-insensitive parser: the edge
    must not judge one member while the node acts on its look-alike."""
    status, body, reset = _post(env, _fold_bodies(env)[case], http2=http2)
    _assert_nothing_unsealed_reached(env, case)
    assert _defined(status, body, reset), (case, status, body[:200])


# === spellings the posture must refuse, swept ========================================

UNSEALED = unsealed_call_body()


def _spellings() -> dict[str, tuple[bytes, str | None, list[tuple[str, str]]]]:
    """name -> (body, content type, extra headers); every body is an unsealed call to
    somebody's reading."""
    j = "application/json"
    text = UNSEALED.decode()
    out: dict[str, tuple[bytes, str | None, list[tuple[str, str]]]] = {
        "bom": (b"\xef\xbb\xbf" + UNSEALED, j, []),
        "utf-16": (text.encode("utf-16"), j + "; charset=utf-16", []),
        "utf-16le-no-bom": (text.encode("utf-16-le"), j, []),
        "utf-32": (text.encode("utf-32"), j, []),
        "escaped-method": (UNSEALED.replace(b'"tools/call"', b'"\\u0074ools\\/call"'), j, []),
        "escaped-tool": (UNSEALED.replace(b'"send_message"', b'"\\u0073end_message"'), j, []),
        "duplicate-method": (UNSEALED.replace(b'"method":', b'"method":"tools/list","method":'),
                             j, []),
        "duplicate-name": (UNSEALED.replace(b'"name":', b'"name":"sealed_call","name":'), j, []),
        "batch-mixed": (b"[" + rpc("tools/list", {}) + b"," + UNSEALED + b"]", j, []),
        "nested-batch": (b"[[" + UNSEALED + b"]]", j, []),
        "no-jsonrpc": (UNSEALED.replace(b'"jsonrpc": "2.0", ', b""), j, []),
        "two-documents": (rpc("tools/list", {}) + b"\n" + UNSEALED, j, []),
        "trailing-comma": (UNSEALED[:-1] + b",}", j, []),
        "nul-after": (UNSEALED + b"\x00", j, []),
        "huge-id": (UNSEALED.replace(b'"id": 1', b'"id": 1' + b"0" * 400), j, []),
        "deep-arguments": (UNSEALED.replace(b'"text": "unsealed"',
                                            b'"text": ' + b"[" * 3000 + b"]" * 3000), j, []),
        "no-content-type": (UNSEALED, None, []),
        "text-json": (UNSEALED, "text/json", []),
        "plus-json": (UNSEALED, "application/vnd.pact+json", []),
        "json-list": (UNSEALED, "application/json, text/plain", []),
        "two-content-types": (UNSEALED, "text/plain", [("content-type", j)]),
        "two-content-types-json-first": (UNSEALED, j, [("content-type", "text/plain")]),
        "gzip": (gzip_bytes(UNSEALED), j, [("content-encoding", "gzip")]),
        "GZIP-raw": (UNSEALED, j, [("content-encoding", "GZIP")]),
        "x-gzip": (gzip_bytes(UNSEALED), j, [("content-encoding", "x-gzip")]),
        "deflate-raw": (UNSEALED, j, [("content-encoding", "deflate")]),
        "br-raw": (UNSEALED, j, [("content-encoding", "br")]),
        "identity-then-gzip": (gzip_bytes(UNSEALED), j, [("content-encoding", "identity, gzip")]),
        "gzip-then-identity": (gzip_bytes(UNSEALED), j, [("content-encoding", "gzip, identity")]),
        "two-encodings": (UNSEALED, j, [("content-encoding", "identity"),
                                        ("content-encoding", "gzip")]),
        "Identity": (UNSEALED, j, [("content-encoding", "Identity")]),
        "empty-encoding": (UNSEALED, j, [("content-encoding", "")]),
    }
    return out


SPELLINGS = sorted(_spellings())


@BOTH
@pytest.mark.parametrize("case", SPELLINGS)
def test_spellings_of_an_unsealed_call_are_refused(env: Env, http2: bool, case: str) -> None:
    body, content_type, headers = _spellings()[case]
    status, answer, reset = _post(env, body, http2=http2, content_type=content_type,
                                  headers=headers)
    _assert_nothing_unsealed_reached(env, case)
    assert not [r for r in env.node.requests() if r.looks_like_tool_call()], case
    assert _defined(status, answer, reset), (case, status, answer[:200])


# === methods, targets and authorities =================================================

OTHER_METHODS = ["PUT", "PATCH", "GET", "OPTIONS", "DELETE", "PROPFIND"]
#: (method, http2): a lower-case `post` exists only in HTTP/2 (llhttp refuses the line).
METHOD_CASES = [(m, h2) for m in OTHER_METHODS for h2 in (False, True)] + [("post", True)]


@pytest.mark.parametrize(("method", "http2"), METHOD_CASES)
@pytest.mark.parametrize("target", ["/mcp", "/mcp/", "/MCP;x?y=1"])
def test_other_methods_with_a_body_at_the_mcp_path(env: Env, http2: bool, method: str,
                                                   target: str) -> None:
    status, body, reset = _post(env, UNSEALED, http2=http2, method=method, target=target)
    assert not [r for r in env.node.requests() if r.looks_like_tool_call()], (method, target)
    assert _defined(status, body, reset), (method, target, status, body[:200])


@pytest.mark.parametrize("sni, host", [
    (HOST, OPT_HOST), (OPT_HOST, HOST), (HOST, "other.example"), (HOST, HOST + ":444"),
])
@BOTH
def test_the_optional_route_never_carries_the_required_routes_calls(
        env: Env, http2: bool, sni: str, host: str) -> None:
    """Both routes lead to one node: a request must be judged by the route its Host /
    :authority names, and a name other than the connection's SNI is refused."""
    if http2:
        conn = H2Conn(env.serve.port, sni)
        try:
            res = conn.request("POST", "/mcp", body=UNSEALED, authority=host, coalesce=False)
        finally:
            conn.close()
        status, body, reset = res.status, res.body, res.reset
    else:
        resp = exchange(env.serve.port, request_bytes("POST", "/mcp", host, body=UNSEALED),
                        host=sni)
        status, body, reset = resp.status, resp.body, None
    if host.split(":")[0] == sni == OPT_HOST:
        return  # the optional route: an unsealed call is its business
    unsealed = [r for r in env.node.requests() if r.looks_like_tool_call()]
    assert unsealed == [], (sni, host, [(r.target, r.header_values("host")) for r in unsealed])
    assert _defined(status, body, reset), (sni, host, status, body[:200])


# === one connection, several requests ================================================


def test_pipelined_requests_are_each_judged(env: Env) -> None:
    """A permitted call, an unsealed one, a sealed one, back to back in one write: the
    node gets the first and the third, the second is refused in its place."""
    sealed = sealed_call_body(env.ids, msg_id="pipe", rpc_id=3)
    raw = (request_bytes("POST", "/mcp", HOST, body=rpc("tools/list", {}, 1))
           + request_bytes("POST", "/mcp", HOST, body=unsealed_call_body(rpc_id=2))
           + request_bytes("POST", "/mcp", HOST, body=sealed))
    sock = tls_socket(env.serve.port, HOST)
    try:
        sock.sendall(raw)
        answers = [read_response(sock) for _ in range(3)]
    finally:
        forget(sock)
    assert [a.status for a in answers] == [200, 200, 200], [a.status_line for a in answers]
    assert answers[1].code == "seal_required", answers[1].body[:200]
    _assert_nothing_unsealed_reached(env, "pipelined")
    assert [r.body for r in env.node.requests()] == [rpc("tools/list", {}, 1), sealed]


@pytest.mark.parametrize("case", ["short-length", "expect-then-other", "chunked-ext-trailer",
                                  "get-with-length", "upgrade-h2c", "upgrade-websocket"])
def test_framing_tricks_on_one_connection(env: Env, case: str) -> None:
    """A declared length shorter than the JSON (the rest parsed as the next request),
    `Expect: 100-continue`, chunk extensions with a trailer naming a header the node
    reads, a GET at the MCP path with a body, upgrades: whatever the node receives
    holds no unsealed call, and the client always gets an answer."""
    tl = rpc("tools/list", {})
    head = f"POST /mcp HTTP/1.1\r\nHost: {HOST}\r\nContent-Type: application/json\r\n"
    if case == "short-length":
        smuggled = request_bytes("POST", "/mcp", HOST, body=UNSEALED)
        raw = (head + f"Content-Length: {len(tl)}\r\n\r\n").encode() + tl + smuggled
    elif case == "expect-then-other":
        raw = (head + f"Expect: 100-continue\r\nContent-Length: {len(UNSEALED)}\r\n\r\n"
               ).encode() + UNSEALED
    elif case == "chunked-ext-trailer":
        raw = (head + "Transfer-Encoding: chunked\r\nTrailer: Content-Type\r\n\r\n").encode()
        raw += b"%x;ext=1;q=\"a\"\r\n%s\r\n0;last\r\nContent-Type: text/plain\r\n" \
               b"Content-Encoding: gzip\r\n\r\n" % (len(UNSEALED), UNSEALED)
    elif case == "get-with-length":
        raw = (f"GET /mcp HTTP/1.1\r\nHost: {HOST}\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(UNSEALED)}\r\n\r\n").encode() + UNSEALED
    else:
        proto = "h2c" if case == "upgrade-h2c" else "websocket"
        extra = "HTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n" if proto == "h2c" else (
            "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n")
        raw = (head + f"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: {proto}\r\n{extra}"
               f"Content-Length: {len(UNSEALED)}\r\n\r\n").encode() + UNSEALED
    sock = tls_socket(env.serve.port, HOST)
    try:
        sock.sendall(raw)
        answer = read_response(sock)
        if case == "short-length":  # the permitted call is answered; then the smuggled one
            assert answer.status == 200 and answer.code is None, answer.status_line
            answer = read_response(sock)
    finally:
        forget(sock)
    _assert_nothing_unsealed_reached(env, case)
    assert not [r for r in env.node.requests() if r.looks_like_tool_call()], case
    if case.startswith("upgrade-"):  # refused by the parser before any posture: 501
        assert answer.status == 501, (case, answer.status_line, answer.body[:200])
        return
    assert _defined(answer.status, answer.body), (case, answer.status_line, answer.body[:200])


def test_h2_trailers_carry_nothing(env: Env) -> None:
    """HTTP/2 trailers naming Content-Type and Content-Encoding after a judged body."""
    conn = H2Conn(env.serve.port, HOST)
    try:
        sid = conn.conn.get_next_available_stream_id()
        conn._results[sid] = H2Result(None, [], b"")
        conn.conn.send_headers(sid, [(b":method", b"POST"), (b":scheme", b"https"),
                                     (b":authority", HOST.encode()), (b":path", b"/mcp"),
                                     (b"content-type", b"application/json")])
        conn.conn.send_data(sid, UNSEALED)
        conn.conn.send_headers(sid, [(b"content-type", b"text/plain"),
                                     (b"content-encoding", b"gzip")], end_stream=True)
        conn.sock.sendall(conn.conn.data_to_send())
        trailed = conn.wait(sid)
    finally:
        conn.close()
    _assert_nothing_unsealed_reached(env, "h2 trailers")
    assert not [r for r in env.node.requests() if r.looks_like_tool_call()]
    assert _defined(trailed.status, trailed.body, trailed.reset), trailed


@pytest.mark.parametrize("path", ["/mcp", "/other"])
def test_h2_extended_connect_is_not_offered(env: Env, path: str) -> None:
    """The edge never sends SETTINGS_ENABLE_CONNECT_PROTOCOL, so a `:protocol` request is
    malformed (RFC 8441 §4) — as HTTP/1.1's CONNECT and upgrades are refused. Forwarded,
    it became `CONNECT /other` to the node with a body nobody judged, and the stream
    hung."""
    conn = H2Conn(env.serve.port, HOST)
    try:
        sid = conn.conn.get_next_available_stream_id()
        conn._results[sid] = H2Result(None, [], b"")
        conn.conn.send_headers(sid, [(b":method", b"CONNECT"), (b":protocol", b"websocket"),
                                     (b":scheme", b"https"), (b":authority", HOST.encode()),
                                     (b":path", path.encode())])
        conn.conn.send_data(sid, UNSEALED)
        conn.sock.sendall(conn.conn.data_to_send())
        try:
            res: H2Result | None = conn.wait(sid, timeout=5)
        except TimeoutError:
            res = None
    finally:
        conn.close()
    got = [(r.method, r.target) for r in env.node.requests()]
    assert got == [], f"extended CONNECT reached the node: {got}"
    assert res is not None and (_defined(res.status, res.body, res.reset) or res.goaway), res


# === content on GET and HEAD ========================================================


SMUGGLED = request_bytes("POST", "/mcp", HOST, body=UNSEALED)


@pytest.mark.parametrize("method", ["GET", "HEAD"])
@pytest.mark.parametrize("framing", ["length", "chunked", "h2-data", "h2-length"])
def test_content_on_get_and_head_is_refused(env: Env, method: str, framing: str) -> None:
    """Off the MCP path, a GET or HEAD whose content is a whole unsealed request: a node
    that ignores content there would read it as its next request on the pooled
    connection, one the posture never judged. Refused (400, or the stream reset), and
    the node gets nothing — whatever the framing."""
    if framing.startswith("h2"):
        conn = H2Conn(env.serve.port, HOST)
        try:
            if framing == "h2-length":
                sid = conn.open_stream(method, "/other", length=len(SMUGGLED), first=SMUGGLED)
            else:
                sid = conn.open_bare(method, "/other")
                conn.conn.send_data(sid, SMUGGLED, end_stream=True)
                conn.sock.sendall(conn.conn.data_to_send())
            res = conn.wait(sid)
        finally:
            conn.close()
        assert res.status == 400 or res.reset is not None, res
    else:
        frame = (f"Content-Length: {len(SMUGGLED)}\r\n\r\n".encode() + SMUGGLED
                 if framing == "length" else
                 b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n"
                 % (len(SMUGGLED), SMUGGLED))
        answer = exchange(env.serve.port, f"{method} /other HTTP/1.1\r\nHost: {HOST}\r\n"
                          .encode() + frame)
        assert answer.status == 400, answer.status_line
    assert env.node.requests() == []


@pytest.mark.parametrize("method", ["GET", "HEAD"])
def test_an_h2_get_ended_by_an_empty_data_frame_is_served(env: Env, method: str) -> None:
    """Some HTTP/2 clients end a GET's stream with an empty DATA frame, not on its
    HEADERS: no content came, so it is served."""
    conn = H2Conn(env.serve.port, HOST)
    try:
        sid = conn.open_bare(method, "/other")
        conn.sock.sendall(conn.conn.data_to_send())
        conn.conn.send_data(sid, b"", end_stream=True)
        conn.sock.sendall(conn.conn.data_to_send())
        res = conn.wait(sid)
    finally:
        conn.close()
    assert res.status == 200, res
    assert [(r.method, r.path, r.body) for r in env.node.requests()] == [(method, "/other", b"")]


def test_an_h2_get_declaring_no_content_is_answered_before_its_stream_ends(env: Env) -> None:
    """`content-length: 0` on a GET whose HEADERS leave the stream open: nothing may
    follow, so it is answered at once rather than after the body deadline (a minute)."""
    conn = H2Conn(env.serve.port, HOST)
    try:
        sid = conn.open_stream("GET", "/other", length=0)
        res = conn.wait(sid, timeout=10)
    finally:
        conn.close()
    assert res.status == 200, res
    assert [(r.method, r.path, r.body) for r in env.node.requests()] == [("GET", "/other", b"")]


# === the JSON value cap: judged before parsing, on both HTTP versions ====================


def _padded(body: bytes, count: int) -> bytes:
    """`body` (one JSON-RPC object) with a last member `pad` ([0,0,…]) that brings its
    `value_count` to exactly `count`: its `,` `:` `[`, then one comma per zero after
    the first."""
    base = body[:-1] + b',"pad":[0]}'
    zeros = count - value_count(base) + 1
    padded = body[:-1] + b',"pad":[' + b",".join([b"0"] * zeros) + b"]}"
    assert value_count(padded) == count
    return padded


@BOTH
def test_nothing_over_the_json_value_cap_reaches_the_node(env: Env, http2: bool) -> None:
    """A sealed call padded to exactly `MAX_JSON_VALUES` counted values is judged and
    forwarded; the same call one value over is refused -32600 (id null: it was not
    parsed) and the node sees nothing of it."""
    at = _padded(sealed_call_body(env.ids, msg_id=f"cap-{http2}"), MAX_JSON_VALUES)
    status, body, reset = _post(env, at, http2=http2)
    assert (status, reset) == (200, None), (status, body[:300])
    assert [r.body for r in env.node.requests()] == [at]
    env.node.clear()
    over = _padded(sealed_call_body(env.ids, msg_id=f"over-{http2}"), MAX_JSON_VALUES + 1)
    status, body, reset = _post(env, over, http2=http2)
    assert (status, reset) == (400, None), (status, body[:300])
    answer = json.loads(body)
    assert answer["id"] is None and answer["error"]["code"] == -32600, answer
    assert str(MAX_JSON_VALUES) in answer["error"]["message"]
    assert env.node.requests() == []
