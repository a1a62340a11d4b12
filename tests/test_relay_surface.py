"""What the relay host's HTTP surface refuses, on both HTTP versions, against a real `serve`.

The invariant behind every case: an answer is always given or the connection is dropped
(never a hang), and nothing is ever queued without a client certificate — whatever the
target spelling, method, framing or body. Each case checks the queue afterwards.
"""

from __future__ import annotations

import json
import socket
import ssl
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pact_ingress.identity import Identity, b64url_decode
from pact_ingress.proto.posture import MAX_JSON_VALUES, value_count
from tests.relay_env import (
    RELAY_HOST,
    RelayCaller,
    RelayH2,
    RelayIdentities,
    RelayServe,
    client_context,
    code_of,
    envelope,
    relay_identities,
    relay_ingress,
    relay_socket,
    rpc,
    tool_body,
)
from tests.terminate_env import (
    WAIT,
    forget,
    read_response,
    request_bytes,
)


@pytest.fixture(scope="module")
def ids(tmp_path_factory: pytest.TempPathFactory) -> RelayIdentities:
    return relay_identities(tmp_path_factory.mktemp("relay-ids"))


def _relay_serve(tmp: Path, ids: RelayIdentities) -> RelayServe:
    s = RelayServe(tmp, recipients=[ids.recipient])
    recipient = RelayCaller(s.port, ids.recipient)
    assert recipient.allowlist_set([ids.sender.fingerprint]).status == 200
    recipient.close()
    return s


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory,
           ids: RelayIdentities) -> Iterator[RelayServe]:
    """One `serve` for the module's cases that neither stop it nor change its limits:
    each refuses or queues on its own msg_ids, and finds the queue emptied first."""
    s = _relay_serve(tmp_path_factory.mktemp("relay-surface"), ids)
    yield s
    s.stop()


@pytest.fixture
def serve(shared: RelayServe, ids: RelayIdentities) -> RelayServe:
    """The module's `serve`, still up, its recipient's queue emptied: each case counts
    exactly what it queued itself."""
    assert shared.proc is not None and shared.proc.poll() is None, shared.logs()[-3000:]
    _empty_queue(shared, ids)
    return shared


@pytest.fixture
def own_serve(tmp_path: Path, ids: RelayIdentities) -> Iterator[RelayServe]:
    """A `serve` of the case's own (one it stops)."""
    s = _relay_serve(tmp_path, ids)
    yield s
    s.stop()


def _empty_queue(serve: RelayServe, ids: RelayIdentities) -> None:
    recipient = RelayCaller(serve.port, ids.recipient)
    try:
        for _ in range(100):  # bounded: a page holds up to 1000 items
            page = recipient.tool("fetch_queued", {"limit": 1000})[0]["structuredContent"]
            if page["items"]:
                ack, _ = recipient.tool("ack", {"ids": [i["id"] for i in page["items"]]})
                assert code_of(ack) is None, ack
            if not page["more"]:
                return
        raise AssertionError("the queue did not empty")
    finally:
        recipient.close()


def raw_h2(port: int, ident: Identity | None) -> RelayH2:
    """HTTP/2 to the relay host, any `:path` or header (client-side validation off)."""
    return RelayH2(port, ident, validate=False)


def queued(serve: RelayServe, ids: RelayIdentities) -> list[str]:
    """msg_ids waiting in the recipient's queue."""
    recipient = RelayCaller(serve.port, ids.recipient)
    try:
        page = recipient.tool("fetch_queued", {"limit": 1000})[0]["structuredContent"]
    finally:
        recipient.close()
    return [json.loads(b64url_decode(i["envelope"]["protected"]))["msg_id"]
            for i in page["items"]]


def call_body(ids: RelayIdentities, msg_id: str) -> bytes:
    return tool_body("relay_call", envelope(ids.sender, ids.recipient, msg_id=msg_id))


def h1(serve: RelayServe, ident: Identity | None, raw: bytes, *, answers: int = 1
       ) -> list[Any]:
    """`raw` on a fresh HTTP/1.1 connection; the answers read (None: closed instead)."""
    sock = relay_socket(serve.port, ident)
    out: list[Any] = []
    try:
        sock.sendall(raw)
        for _ in range(answers):
            try:
                out.append(read_response(sock))
            except (ConnectionError, ssl.SSLError, OSError):
                out.append(None)
                break
    finally:
        forget(sock)
    return out


def is_queued_answer(resp: Any) -> bool:
    if resp is None or resp.status != 200:
        return False
    result = json.loads(resp.body).get("result", {})
    return not result.get("isError") and result.get("structuredContent", {}).get(
        "status") == "queued"


# --- no client certificate -------------------------------------------------------------


def test_no_certificate_is_refused_on_both_versions(serve: RelayServe,
                                                    ids: RelayIdentities) -> None:
    anon = RelayCaller(serve.port, None)
    result, resp = anon.tool("relay_call", envelope(ids.sender, ids.recipient, msg_id="a1"))
    assert resp.status == 401 and code_of(result) == "identity_required"
    doc, resp = anon.rpc(rpc("tools/list"))
    assert resp.status == 401 and doc["error"]["data"]["code"] == "identity_required"
    for method in ("GET", "POST"):
        resp = anon.request(method, "/relay/allowlist",
                            json.dumps({"senders": []}).encode() if method == "POST" else b"")
        assert resp.status == 401 and json.loads(resp.body)["code"] == "identity_required"
    anon.close()
    conn = raw_h2(serve.port, None)
    try:
        res = conn.request("POST", "/relay/mcp", body=call_body(ids, "a2"))
        assert res.status == 401
        assert code_of(json.loads(res.body)["result"]) == "identity_required"
        res = conn.request("POST", "/relay/allowlist", body=b'{"senders": []}')
        assert res.status == 401
    finally:
        conn.close()
    assert queued(serve, ids) == []
    assert 'pact_ingress_relay_refusals_total{code="identity_required"}' in serve.metrics()


# --- bodies --------------------------------------------------------------------------------


def test_oversized_bodies_are_too_large_on_both_versions(serve: RelayServe,
                                                         ids: RelayIdentities) -> None:
    big = str(13 * 1024 * 1024)
    [resp] = h1(serve, ids.sender, request_bytes(
        "POST", "/relay/mcp", RELAY_HOST, length=False, headers=[("Content-Length", big)]))
    assert resp.status == 413 and code_of(json.loads(resp.body)["result"]) == "too_large"
    assert resp.header("connection") == "close"  # the unread body ends the connection
    [resp] = h1(serve, ids.recipient, request_bytes(
        "POST", "/relay/allowlist", RELAY_HOST, length=False,
        headers=[("Content-Length", str(2 * 1024 * 1024))]))
    assert resp.status == 413 and json.loads(resp.body)["code"] == "too_large"
    conn = raw_h2(serve.port, ids.sender)
    try:
        res = conn.wait(conn.open_stream("POST", "/relay/mcp", length=int(big)))
        assert res.status == 413 and code_of(json.loads(res.body)["result"]) == "too_large"
        # the same connection still serves
        assert conn.request("POST", "/relay/mcp", body=rpc("ping")).status == 200
    finally:
        conn.close()
    assert queued(serve, ids) == []


def test_garbage_json_on_both_versions(serve: RelayServe, ids: RelayIdentities) -> None:
    cases = [(b"{not json", -32700), (b"\xff\xfe\x00", -32700), (b"", -32700),
             (b"[1, 2]", -32600), (b'"text"', -32600), (b'{"jsonrpc": "1.0", "method": "x"}',
                                                        -32600),
             (b"[" * 100_000, -32700)]
    caller = RelayCaller(serve.port, ids.sender)
    conn = raw_h2(serve.port, ids.sender)
    try:
        for body, code in cases:
            resp = caller.request("POST", "/relay/mcp", body)
            assert resp.status == 400 and json.loads(resp.body)["error"]["code"] == code, body
            res = conn.request("POST", "/relay/mcp", body=body)
            assert res.status == 400 and json.loads(res.body)["error"]["code"] == code, body
    finally:
        caller.close()
        conn.close()
    assert queued(serve, ids) == []


def _padded(body: bytes, count: int) -> bytes:
    """`body` (one JSON-RPC object) with a last member `pad` ([0,0,…]) that brings its
    `value_count` to exactly `count`."""
    zeros = count - value_count(body[:-1] + b',"pad":[0]}') + 1
    padded = body[:-1] + b',"pad":[' + b",".join([b"0"] * zeros) + b"]}"
    assert value_count(padded) == count
    return padded


def test_nothing_over_the_json_value_cap_is_queued_on_both_versions(
        serve: RelayServe, ids: RelayIdentities) -> None:
    """The relay reads JSON as the terminate edge does: a relay_call padded to exactly
    `MAX_JSON_VALUES` counted values is queued; one value over, it is refused -32600
    (id null, not parsed) and nothing of it is queued, on either HTTP version."""
    caller = RelayCaller(serve.port, ids.sender)
    conn = raw_h2(serve.port, ids.sender)
    try:
        for version in ("h1", "h2"):
            for count, name in ((MAX_JSON_VALUES, "at"), (MAX_JSON_VALUES + 1, "over")):
                body = _padded(call_body(ids, f"{name}-{version}"), count)
                if version == "h1":
                    resp = caller.request("POST", "/relay/mcp", body)
                    status, answer = resp.status, json.loads(resp.body)
                else:
                    res = conn.request("POST", "/relay/mcp", body=body)
                    status, answer = res.status, json.loads(res.body)
                if name == "at":
                    assert status == 200, answer
                    assert answer["result"]["structuredContent"]["status"] == "queued"
                else:
                    assert status == 400, answer
                    assert answer["id"] is None and answer["error"]["code"] == -32600
                    assert str(MAX_JSON_VALUES) in answer["error"]["message"]
    finally:
        caller.close()
        conn.close()
    assert sorted(queued(serve, ids)) == ["at-h1", "at-h2"]


# --- pipelining ------------------------------------------------------------------------------


def test_pipelined_requests_are_answered_in_order(serve: RelayServe,
                                                  ids: RelayIdentities) -> None:
    raw = b"".join(request_bytes("POST", "/relay/mcp", RELAY_HOST, body=body) for body in (
        call_body(ids, "p1"), rpc("ping", rpc_id=7), call_body(ids, "p2")))
    answers = h1(serve, ids.sender, raw, answers=3)
    assert [r.status for r in answers] == [200, 200, 200]
    assert json.loads(answers[0].body)["result"]["structuredContent"]["msg_id"] == "p1"
    assert json.loads(answers[1].body) == {"jsonrpc": "2.0", "id": 7, "result": {}}
    assert json.loads(answers[2].body)["result"]["structuredContent"]["msg_id"] == "p2"
    # the same without a certificate: every one refused, none queued
    raw = b"".join(request_bytes("POST", "/relay/mcp", RELAY_HOST, body=call_body(ids, m))
                   for m in ("p3", "p4"))
    answers = h1(serve, None, raw, answers=2)
    assert [r.status for r in answers] == [401, 401]
    # a bad head behind good ones: the good ones are answered, then a 400 and the close
    raw = request_bytes("POST", "/relay/mcp", RELAY_HOST, body=call_body(ids, "p5")) + \
        b"POST /relay/mcp HTTP/1.1\r\nHost: relay.test\r\nContent-Length: 1\r\n" \
        b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
    answers = h1(serve, ids.sender, raw, answers=3)
    assert answers[0].status == 200 and answers[1].status == 400 and answers[2] is None
    assert sorted(queued(serve, ids)) == ["p1", "p2", "p5"]


# --- targets and methods ----------------------------------------------------------------------

#: target → does it name the MCP endpoint? (the edge's normaliser decides: dot segments
#: and empty segments fold, unreserved escapes decode; case and %2F do not)
SPELLINGS = [
    ("/relay/mcp", True),
    ("/relay/mcp?x=1", True),
    ("//relay/mcp", True),
    ("/relay/./mcp", True),
    ("/relay/../relay/mcp", True),
    ("/relay/%6Dcp", True),
    (f"https://{RELAY_HOST}/relay/mcp", True),
    ("/RELAY/mcp", False),
    ("/relay/MCP", False),
    ("/relay/mcp/", False),
    ("/relay/mcp%2F", False),
    ("/relay%2Fmcp", False),
    ("/relay/mcp/x", False),
    ("/relay", False),
    ("/", False),
    ("https://other.test/relay/mcp", False),
    ("*", False),
    ("relay/mcp", False),
    ("/relay/%zzmcp", False),
]


@pytest.mark.parametrize("http2", [False, True], ids=["h1", "h2"])
def test_target_spellings_have_one_defined_answer(serve: RelayServe, ids: RelayIdentities,
                                                  http2: bool) -> None:
    tag = "h2" if http2 else "h1"
    expected: list[str] = []
    conn = raw_h2(serve.port, ids.sender) if http2 else None
    anon = raw_h2(serve.port, None) if http2 else None
    try:
        for n, (target, endpoint) in enumerate(SPELLINGS):
            for ident, who in ((ids.sender, "s"), (None, "a")):
                msg_id = f"{tag}-{who}-{n}"
                body = call_body(ids, msg_id)
                if http2:
                    c = conn if ident is not None else anon
                    assert c is not None
                    res = c.request("POST", target, body=body)
                    status, text = res.status, res.body
                    resp: Any = None if status is None else res
                else:
                    [resp] = h1(serve, ident, request_bytes("POST", target, RELAY_HOST,
                                                            body=body))
                    status = None if resp is None else resp.status
                    text = b"" if resp is None else resp.body
                if ident is None:
                    assert status != 200, (target, status)
                    continue
                if endpoint:
                    assert status == 200, (target, status, text)
                    assert json.loads(text)["result"]["structuredContent"]["msg_id"] == msg_id
                    expected.append(msg_id)
                else:
                    # refused with an answer (a reset stream counts for h2's own rules)
                    assert status in (400, 404, 421) or (http2 and status is None), (
                        target, status)
    finally:
        for c in (conn, anon):
            if c is not None:
                c.close()
    assert sorted(queued(serve, ids)) == sorted(expected)


def test_exact_targets_read_as_the_normaliser_reads_them() -> None:
    """The endpoints' exact spellings skip `parse_target`: only if it reads them alike."""
    from pact_ingress.proto.http_request import parse_target
    from pact_ingress.relay.http import _EXACT

    assert set(_EXACT) == {b"/relay/mcp", b"/relay/allowlist"}
    for raw, target in _EXACT.items():
        assert parse_target(raw) == target


def test_unknown_paths_and_methods(serve: RelayServe, ids: RelayIdentities) -> None:
    caller = RelayCaller(serve.port, ids.sender)
    anon = RelayCaller(serve.port, None)
    try:
        for c in (caller, anon):
            assert c.request("GET", "/elsewhere").status == 404
            assert c.request("POST", "/relay/other", b"{}").status == 404
            for method in ("GET", "PUT", "DELETE", "PATCH", "OPTIONS"):
                resp = c.request(method, "/relay/mcp")
                assert resp.status == 405 and resp.header("allow") == "POST", method
            for method in ("PUT", "DELETE", "PATCH"):
                resp = c.request(method, "/relay/allowlist", b"{}")
                assert resp.status == 405 and resp.header("allow") == "GET, POST", method
        # HEAD: the same answer without a body
        sock = relay_socket(serve.port, ids.sender)
        try:
            sock.sendall(request_bytes("HEAD", "/relay/mcp", RELAY_HOST))
            resp = read_response(sock, head_only=True)
            assert resp.status == 405 and resp.header("allow") == "POST"
        finally:
            forget(sock)
        # a Host that is not the relay's
        [resp] = h1(serve, ids.sender, request_bytes("POST", "/relay/mcp", "other.test",
                                                     body=call_body(ids, "x2")))
        assert resp.status == 421
        [resp] = h1(serve, ids.sender, request_bytes("POST", "/relay/mcp", None,
                                                     body=call_body(ids, "x3")))
        assert resp.status == 400
    finally:
        caller.close()
        anon.close()
    assert queued(serve, ids) == []


# --- the body deadline (in process: the deadline is shortened) ----------------------------


async def test_slow_body_is_dropped_unanswered(tmp_path: Path, ids: RelayIdentities,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    import trio

    from pact_ingress.relay import http as relay_http

    monkeypatch.setattr(relay_http, "BODY_TIMEOUT", 0.5)
    ingress, port = relay_ingress(tmp_path, ids)

    def slow(http2: bool) -> Any:
        """Half a relay_call body, then nothing: what does the client see?"""
        body = call_body(ids, "slow-h2" if http2 else "slow-h1")
        if http2:
            conn = raw_h2(port, ids.sender)
            try:
                return conn.wait(conn.open_stream("POST", "/relay/mcp", length=len(body),
                                                  first=body[:10]))
            finally:
                conn.close()
        raw = socket.create_connection(("127.0.0.1", port), timeout=WAIT)
        sock = client_context(ids.sender).wrap_socket(raw, server_hostname=RELAY_HOST)
        try:
            sock.sendall(request_bytes("POST", "/relay/mcp", RELAY_HOST, length=False,
                                       headers=[("Content-Length", str(len(body)))])
                         + body[:10])
            started = time.monotonic()
            try:
                data = sock.recv(65536)
            except (ConnectionError, ssl.SSLError, OSError):
                data = b""
            return data, time.monotonic() - started
        finally:
            forget(sock)

    async with trio.open_nursery() as nursery:
        await nursery.start(lambda task_status: ingress.run(handle_signals=False,
                                                           task_status=task_status))
        recipient = RelayCaller(port, ids.recipient)
        assert (await trio.to_thread.run_sync(
            recipient.allowlist_set, [ids.sender.fingerprint])).status == 200
        data, _ = await trio.to_thread.run_sync(slow, False)
        assert data == b""  # closed, no answer
        res = await trio.to_thread.run_sync(slow, True)
        assert res.status is None and res.reset is not None  # the stream was reset
        page = await trio.to_thread.run_sync(recipient.tool, "fetch_queued", {})
        assert page[0]["structuredContent"]["items"] == []
        recipient.close()
        await ingress.stop(deadline=1)


def test_large_calls_are_checked_like_small_ones(serve: RelayServe,
                                                 ids: RelayIdentities) -> None:
    """A call over the inline size is parsed and checked in a worker thread: the same
    answers either way (queued; a bad signature refused; an unlisted sender denied)."""
    caller = RelayCaller(serve.port, ids.sender)
    other = RelayCaller(serve.port, ids.other)
    try:
        big = envelope(ids.sender, ids.recipient, msg_id="big", text="x" * 300_000)
        result, resp = caller.tool("relay_call", big)
        assert len(tool_body("relay_call", big)) > 256 * 1024
        assert resp.status == 200 and result["structuredContent"]["msg_id"] == "big"
        forged = dict(envelope(ids.sender, ids.recipient, msg_id="forged",
                               text="y" * 300_000))
        forged["sig"] = big["sig"]
        result, _ = caller.tool("relay_call", forged)
        assert code_of(result) == "envelope_invalid"
        result, _ = other.tool("relay_call", envelope(ids.other, ids.recipient,
                                                      msg_id="other", text="z" * 300_000))
        assert code_of(result) == "permission_denied"
    finally:
        caller.close()
        other.close()
    assert queued(serve, ids) == ["big"]


# --- shutdown ------------------------------------------------------------------------------


def test_drain_closes_idle_connections_and_finishes_busy_ones(own_serve: RelayServe,
                                                              ids: RelayIdentities) -> None:
    """SIGTERM: idle keep-alive connections (both versions) close at once; a request
    whose body is still arriving is answered and its item committed; then exit 0."""
    import signal

    serve = own_serve

    idle = relay_socket(serve.port, ids.sender)
    idle.sendall(request_bytes("POST", "/relay/mcp", RELAY_HOST, body=rpc("ping")))
    assert read_response(idle).status == 200
    h2conn = raw_h2(serve.port, ids.sender)
    assert h2conn.request("POST", "/relay/mcp", body=rpc("ping")).status == 200
    busy = relay_socket(serve.port, ids.sender)
    body = call_body(ids, "in-flight")
    busy.sendall(request_bytes("POST", "/relay/mcp", RELAY_HOST, length=False,
                               headers=[("Content-Length", str(len(body)))]) + body[:20])
    try:
        assert serve.proc is not None
        serve.proc.send_signal(signal.SIGTERM)
        idle.settimeout(WAIT)
        try:
            assert idle.recv(1) == b""  # the drain closed it
        except (ConnectionError, ssl.SSLError):
            pass
        h2conn._pump(until=lambda: h2conn.goaway, timeout=WAIT)  # GOAWAY or closed
        busy.sendall(body[20:])
        resp = read_response(busy)
        assert resp.status == 200
        assert json.loads(resp.body)["result"]["structuredContent"]["msg_id"] == "in-flight"
        assert serve.proc.wait(timeout=WAIT) == 0
    finally:
        for sock in (idle, busy):
            forget(sock)
        h2conn.close()
    serve.restart()
    assert queued(serve, ids) == ["in-flight"]


def _send_part(conn: Any, sid: int, n: int) -> None:
    """`n` bytes of stream `sid`'s body, in frames of the protocol's default size; the
    stream stays open."""
    for start in range(0, n, 16_384):
        conn.conn.send_data(sid, b"x" * min(16_384, n - start))
    conn.sock.sendall(conn.conn.data_to_send())


async def test_bodies_in_flight_are_bounded_per_address(tmp_path: Path,
                                                        ids: RelayIdentities) -> None:
    """Body bytes held at once count per client address (HTTP/2 multiplexes, so one
    connection could otherwise make the relay buffer 100 maximal bodies): past the
    share → rate_limited (429, Retry-After); the share comes back when a request ends."""
    import trio

    from pact_ingress.proto.shares import Shares

    ingress, port = relay_ingress(tmp_path, ids)
    ingress.relay.buffers = Shares(100_000, 10_000_000)  # small, so a test can cross it
    size, sent = 80_000, 60_000  # (within a stream's window: 65,535)

    def exercise() -> list[Any]:
        conn = raw_h2(port, ids.sender)
        try:
            # the shares count bytes as they come (not as declared): the first body's
            # bytes are most of a share before the second's come
            first = conn.open_stream("POST", "/relay/mcp", length=size)
            _send_part(conn, first, sent)
            second = conn.request("POST", "/relay/mcp", body=b"y" * size)
            # the rest of the first body, unless the first was the one refused
            conn.send_body(first, b"x" * (size - sent))
            conn.sock.sendall(conn.conn.data_to_send())
            first_res = conn.wait(first)
            third = conn.request("POST", "/relay/mcp", body=b"z" * size)
            return [first_res, second, third]
        finally:
            conn.close()

    async with trio.open_nursery() as nursery:
        await nursery.start(lambda task_status: ingress.run(handle_signals=False,
                                                           task_status=task_status))
        first, second, third = await trio.to_thread.run_sync(exercise)
        # the two bodies overlap: whichever stream's handler reserves its bytes second
        # (the engine promises no order between streams) is the one past the share
        assert sorted((first.status, second.status)) == [400, 429], (first, second)
        refused, read = (first, second) if first.status == 429 else (second, first)
        assert dict(refused.headers).get("retry-after") == "1"
        result = json.loads(refused.body)["result"]
        assert code_of(result) == "rate_limited" and result["structuredContent"][
            "retry_after"] == 1
        # the other was read whole (garbage: a parse error), and the share came back
        assert json.loads(read.body)["error"]["code"] == -32700
        assert third.status == 400 and json.loads(third.body)["error"]["code"] == -32700
        assert len(ingress.relay.buffers) == 0  # nothing held once every request ended
        await ingress.stop(deadline=1)


async def test_bodies_in_flight_over_the_process_share_are_unavailable(
        tmp_path: Path, ids: RelayIdentities) -> None:
    """Past the process's share of body bytes (another address holding most of it), a
    body within its own address's share is refused `unavailable` (503), not
    `rate_limited`: the shortage is the relay's, not this client's."""
    import trio

    from pact_ingress.proto.shares import Shares

    ingress, port = relay_ingress(tmp_path, ids)
    buffers = ingress.relay.buffers = Shares(100_000, 120_000)  # small, to cross it
    size, sent = 80_000, 60_000  # (within a stream's window: 65,535)

    def h2_from(source: str) -> RelayH2:
        conn = RelayH2.__new__(RelayH2)
        conn._start(relay_socket(port, ids.sender, alpn=("h2",), source=source), RELAY_HOST,
                    validate=False)
        return conn

    def exercise() -> Any:
        holder, other = h2_from("127.0.0.2"), h2_from("127.0.0.3")
        try:
            # bytes are counted as they come: the holder's, taken before the other's
            held = holder.open_stream("POST", "/relay/mcp", length=size)
            _send_part(holder, held, sent)
            deadline = time.monotonic() + WAIT
            while buffers.of("127.0.0.2") < sent and time.monotonic() < deadline:
                time.sleep(0.01)
            assert buffers.of("127.0.0.2") >= sent, "the first body was never held"
            refused = other.request("POST", "/relay/mcp", body=b"y" * size)
            holder.send_body(held, b"x" * (size - sent))
            holder.sock.sendall(holder.conn.data_to_send())
            holder.wait(held)
            return refused
        finally:
            holder.close()
            other.close()

    async with trio.open_nursery() as nursery:
        await nursery.start(lambda task_status: ingress.run(handle_signals=False,
                                                           task_status=task_status))
        refused = await trio.to_thread.run_sync(exercise)
        assert refused.status == 503, refused
        result = json.loads(refused.body)["result"]
        assert code_of(result) == "unavailable", result
        assert len(ingress.relay.buffers) == 0
        await ingress.stop(deadline=1)
