"""Terminate mode attacked from outside, second round: regressions found against the
rewritten HTTP engine (llhttp client leg, h2, own upstream client).

Run:   python -m pytest tests/test_terminate_attacks2.py -v -s

Same rules as tests/test_terminate_attacks.py: a real `serve` subprocess and a recording
home node (tests/terminate_env.py), loopback only, every loop bounded in count and time,
assertions on invariants only (what the client got, what the node received, /status and
/proc facts) — nothing imports the terminate engine.
"""

from __future__ import annotations

import ssl

import pytest

from tests.terminate_env import (
    ATTACKER_IP,
    HOST,
    H2Conn,
    RawResponse,
    exchange,
    forget,
    module_fixtures,
    read_response,
    rpc,
    tls_socket,
    unsealed_call_body,
)
from tests.terminate_env import (
    ServeEnv as Env,
)

shared, env = module_fixtures("attacks2")


# === chunked trailers are not bounded ========================================

#: Far over the 16 KiB head limit, small enough to stay quick on the current engine.
TRAILER_BYTES = 1 << 20


def _send_with_trailer(env: Env, path: str, content_type: str, body: bytes,
                       trailer_bytes: int) -> tuple[RawResponse | None, bool]:
    """A chunked request whose trailer section is one field of `trailer_bytes`:
    (the answer if any, whether the edge stopped taking bytes before the end)."""
    sock = tls_socket(env.serve.port, HOST, source=ATTACKER_IP)
    try:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {HOST}\r\nContent-Type: {content_type}"
                     f"\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
                     + b"%x\r\n%s\r\n0\r\nX-Trailer: " % (len(body), body))
        cut = False
        piece = b"a" * 65536
        try:
            for _ in range(trailer_bytes // len(piece)):
                sock.sendall(piece)
            sock.sendall(b"\r\n\r\n")
        except (OSError, ssl.SSLError):
            cut = True
        try:
            return read_response(sock), cut
        except (ConnectionError, OSError, ssl.SSLError, ValueError):
            return None, True
    finally:
        forget(sock)


@pytest.mark.parametrize("path,content_type,body", [
    ("/upload", "text/plain", b"hello"),
    ("/mcp", "application/json", rpc("tools/list", {})),
], ids=["plain", "mcp"])
def test_trailer_section_is_bounded(env: Env, path: str, content_type: str,
                                    body: bytes) -> None:
    """A chunked request's trailer section is part of its head budget (16 KiB): a 1 MiB
    trailer field must be refused (4xx, or the connection closed), not accumulated.

    On the current engine the trailer is neither counted in the head limit (the parser
    only counts bytes fed outside the BODY phase) nor in `max_body_bytes`, and httptools
    concatenates the field value with `bytes +=` on every read: one client can make the
    edge hold any amount of memory and spend quadratic CPU on the shared event loop (a
    32 MiB trailer took ~22 s to send and stalled a bystander's GET for ~6.6 s)."""
    resp, cut = _send_with_trailer(env, path, content_type, body, TRAILER_BYTES)
    complete = [r.target for r in env.node.requests() if r.complete]
    assert complete == [], f"request with a {TRAILER_BYTES}-byte trailer completed: {complete}"
    assert cut or resp is None or 400 <= resp.status < 500, (
        f"{TRAILER_BYTES}-byte trailer section accepted: {resp.status_line if resp else None}")


# === duplicate Content-Type: the first is judged, the node may read another ===


def test_duplicate_content_type_cannot_smuggle_json_off_mcp_path(env: Env) -> None:
    """README: outside mcp_path any request carrying a JSON body is 403. The edge reads
    only the first Content-Type (`proto.http_request.header`), so `text/plain` then
    `application/json` passes as plain and the node gets a JSON tools/call labelled
    application/json (frameworks that take the last value, or join the values, dispatch
    it as JSON). Either refuse duplicate Content-Type (400) or judge every value."""
    body = unsealed_call_body()
    raw = (f"POST /other HTTP/1.1\r\nHost: {HOST}\r\nContent-Type: text/plain\r\n"
           f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
           ).encode() + body
    resp = exchange(env.serve.port, raw)
    got = [(r.target, r.header_values("content-type")) for r in env.node.requests()]
    assert got == [], f"JSON body with a second application/json reached the node: {got}"
    assert 400 <= resp.status < 500, resp.status_line


def test_duplicate_content_type_cannot_smuggle_json_off_mcp_path_h2(env: Env) -> None:
    """The same over HTTP/2: two `content-type` fields, the first `text/plain`."""
    conn = H2Conn(env.serve.port, HOST)
    try:
        res = conn.request("POST", "/other", body=unsealed_call_body(), content_type="text/plain",
                           headers=[("content-type", "application/json")], coalesce=False)
    finally:
        conn.close()
    got = [(r.target, r.header_values("content-type")) for r in env.node.requests()]
    assert got == [], f"JSON body with a second application/json reached the node: {got}"
    assert res.status is None or 400 <= res.status < 500, (res.status, res.body[:200])
