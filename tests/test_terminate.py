"""Terminate mode end to end: real TLS on loopback, the demo node behind pinned mTLS.

Every test runs: client (httpcore / curl) → TLS → Terminator (behind a minimal listener
that peeks nothing) → pinned mTLS → demo node. Assertions are about what the client got
and what the node recorded (`node.calls`, `node.requests`) — never about timing.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpcore
import pytest
import trio
import trio.testing

from pact_ingress.config import Address, Backend, Config, Limits, Listen, Route, Tenant
from pact_ingress.demo_node import DemoNode, serve_demo_node
from pact_ingress.envelope import RESULT_CTY, canonical_json, open_envelope, seal
from pact_ingress.identity import Identity, b64url, spki_der
from pact_ingress.net.backends import Backends
from pact_ingress.net.replay import ReplayStream
from pact_ingress.net.terminate import (
    Terminator,
    clean_request_headers,
    clean_response_headers,
    forwarded_value,
    host_matches,
)
from pact_ingress.stats import Stats
from tests.tls_helpers import LOOPBACK, WebPKI, http_client, make_identity, serve_loopback

HOST = "mcp.alina.test"
OTHER = "other.alina.test"


@dataclass
class Env:
    port: int
    node: DemoNode
    node_id: Identity
    ingress_id: Identity
    caller_id: Identity
    route: Route
    terminator: Terminator
    stats: Stats
    pki: WebPKI
    tmp: Path

    def client(self, *, http2: bool = True, http1: bool = True) -> httpcore.AsyncConnectionPool:
        alpn = (["h2"] if http2 else []) + (["http/1.1"] if http1 else [])
        return http_client(self.port, self.pki.client_context(alpn), http2=http2, http1=http1)


def make_config(tmp: Path, route: Route, pins: tuple[str, ...]) -> Config:
    return Config(path=tmp / "ingress.yaml", identity_key=tmp / "ingress.key", state_dir=tmp,
                  listen=Listen(tls=()), tunnel_hostname=None, acme=None, limits=Limits(),
                  tenants=(Tenant("alina", pins, (route,)),))


async def start_env(
    nursery: trio.Nursery,
    tmp: Path,
    *,
    limits: Limits = Limits(),
    seal: str = "required",
    pins: tuple[str, ...] | None = None,
    header_timeout: float = 30.0,
    node_alpn: tuple[str, ...] = ("h2", "http/1.1"),
    backend_port: int | None = None,
    route_host: str = HOST,
) -> Env:
    node_id = make_identity(tmp, "node")
    ingress_id = make_identity(tmp, "ingress")
    caller_id = make_identity(tmp, "caller", ed25519=True)
    node: DemoNode = await nursery.start(serve_demo_node, node_id, LOOPBACK, 0)  # type: ignore[arg-type]
    if node_alpn != ("h2", "http/1.1"):
        node = await nursery.start(lambda task_status: serve_demo_node(  # type: ignore[misc]
            node_id, LOOPBACK, 0, alpn=node_alpn, task_status=task_status))
    port = node.port if backend_port is None else backend_port
    route = Route(host=route_host, tenant="alina", mode="terminate",
                  backend=Backend(Address(LOOPBACK, port)), seal=seal,  # type: ignore[arg-type]
                  limits=limits)
    stats = Stats()
    terminator = Terminator(identity=ingress_id, backends=Backends(), stats=stats,
                            header_timeout=header_timeout)
    terminator.update(make_config(tmp, route, pins or (node_id.fingerprint,)))
    pki = WebPKI()
    ctx = pki.server_context(HOST, OTHER, "*.alina.test")

    async def handler(tcp: trio.SocketStream) -> None:
        await terminator.serve(ReplayStream(b"", tcp), ctx, route, tcp.socket.getpeername()[:2])

    listen_port = await nursery.start(serve_loopback, handler)
    return Env(listen_port, node, node_id, ingress_id, caller_id, route, terminator, stats,
               pki, tmp)


@pytest.fixture
async def env(nursery: trio.Nursery, tmp_path: Path) -> AsyncIterator[Env]:
    e = await start_env(nursery, tmp_path)
    yield e
    await e.terminator.aclose()


def rpc(method: str, params: dict[str, Any] | None = None, rpc_id: int | None = 1) -> bytes:
    message: dict[str, Any] = {"jsonrpc": "2.0", "method": method}
    if params is not None:
        message["params"] = params
    if rpc_id is not None:
        message["id"] = rpc_id
    return json.dumps(message).encode()


JSON = [(b"content-type", b"application/json"), (b"accept", b"application/json, text/event-stream")]


async def post_mcp(client: httpcore.AsyncConnectionPool, body: bytes, host: str = HOST,
                   extra: list[tuple[bytes, bytes]] | None = None) -> httpcore.Response:
    return await client.request("POST", f"https://{host}/mcp", headers=JSON + (extra or []),
                                content=body)


def sealed_call_args(env: Env, inner: dict[str, Any], *, msg_id: str = "m-1", now: float | None = None,
                     ts: int | None = None, exp: int | None = None) -> dict[str, str]:
    now = time.time() if now is None else now
    payload = {**inner, "spk": b64url(spki_der(env.caller_id.key.public_key()))}
    ts = int(now) if ts is None else ts
    return seal(payload, sender_key=env.caller_id.key,
                recipient_public_key=env.node_id.key.public_key(),  # type: ignore[arg-type]
                msg_id=msg_id, ts=ts, exp=ts + 600 if exp is None else exp)


def send_message_inner(text: str = "hello", msg_id: str = "inner-1") -> dict[str, Any]:
    return {"method": "tools/call",
            "params": {"name": "send_message",
                       "arguments": {"msg_id": msg_id, "text": text, "sender": "agent"}}}


# --- pure helpers ----------------------------------------------------------------------------


def test_request_header_hygiene() -> None:
    dirty = [(b"host", b"x"), (b"forwarded", b"for=1.2.3.4"), (b"x-forwarded-for", b"1.2.3.4"),
             (b"X-Real-IP", b"1.2.3.4"), (b"x-pact-caller", b"sha256:forged"),
             (b"connection", b"keep-alive, x-secret"), (b"x-secret", b"hop"),
             (b"keep-alive", b"300"), (b"te", b"trailers, deflate"), (b"upgrade", b"h2c"),
             (b"proxy-authorization", b"basic x"), (b"transfer-encoding", b"chunked"),
             (b"content-length", b"5"), (b"mcp-session-id", b"abc"), (b"accept", b"*/*")]
    out = clean_request_headers(dirty, client_ip="2001:db8::1", host=HOST)
    assert out == [(b"host", HOST.encode()), (b"mcp-session-id", b"abc"), (b"accept", b"*/*"),
                   (b"te", b"trailers"),
                   (b"forwarded", b'for="[2001:db8::1]";proto=https;host=mcp.alina.test')]
    assert forwarded_value("192.0.2.7", HOST) == b"for=192.0.2.7;proto=https;host=mcp.alina.test"


def test_response_header_hygiene() -> None:
    dirty = [(b"Connection", b"close, X-Node-Hop"), (b"x-node-hop", b"1"), (b"keep-alive", b"5"),
             (b"transfer-encoding", b"chunked"), (b"upgrade", b"h2c"), (b"proxy-authenticate", b"x"),
             (b"content-type", b"text/event-stream"), (b"Mcp-Session-Id", b"s1")]
    assert clean_response_headers(dirty) == [(b"content-type", b"text/event-stream"),
                                             (b"mcp-session-id", b"s1")]


def test_host_matching() -> None:
    exact = Route(host=HOST, tenant="t", mode="terminate", backend=Backend(None))
    wild = replace(exact, host="*.alina.test")
    assert host_matches(HOST, HOST, exact)
    assert not host_matches(OTHER, HOST, exact)
    assert not host_matches(None, HOST, exact)
    assert host_matches("a.alina.test", None, wild)
    assert not host_matches("a.b.alina.test", None, wild)
    assert not host_matches("alina.test", None, wild)
    # with the SNI known, a wildcard route still requires Host == SNI exactly
    assert not host_matches("b.alina.test", "a.alina.test", wild)


# --- MCP through the edge -------------------------------------------------------------------


@pytest.mark.parametrize("http2", [True, False])
async def test_initialize_and_tools_list(env: Env, http2: bool) -> None:
    async with env.client(http2=http2, http1=not http2) as client:
        r = await post_mcp(client, rpc("initialize", {"protocolVersion": "2025-06-18"}))
        assert r.status == 200
        assert r.extensions["http_version"] == (b"HTTP/2" if http2 else b"HTTP/1.1")
        assert dict(r.headers).get(b"mcp-session-id")
        r = await post_mcp(client, rpc("tools/list", {}, 2))
        tools = [t["name"] for t in json.loads(r.content)["result"]["tools"]]
        assert tools == ["echo", "send_message", "sealed_call"]
    # the node saw the ingress's key on the link, on a pooled HTTP/2 upstream
    assert {peer for _, _, peer in env.node.requests} == {env.ingress_id.fingerprint}


async def test_sealed_send_message_attributed_to_caller(env: Env) -> None:
    args = sealed_call_args(env, send_message_inner("hi bharat"))
    async with env.client() as client:
        r = await post_mcp(client, rpc("tools/call", {"name": "sealed_call", "arguments": args}, 7))
    assert r.status == 200
    reply = json.loads(r.content)
    assert reply["id"] == 7
    envelope = reply["result"]["structuredContent"]
    opened = open_envelope(envelope, recipient_key=env.caller_id.key, now=time.time(),
                           sender_public_key=env.node_id.key.public_key(),  # type: ignore[arg-type]
                           expected_cty=RESULT_CTY)
    assert opened.header.msg_id == "m-1"
    assert opened.payload["structuredContent"]["status"] == "delivered"
    assert [(c.tool, c.caller, c.transport_peer, c.sealed) for c in env.node.calls] == [
        ("send_message", env.caller_id.fingerprint, env.ingress_id.fingerprint, True)]


async def test_unsealed_call_refused_at_edge(env: Env) -> None:
    body = rpc("tools/call", {"name": "send_message", "arguments": {"msg_id": "x", "text": "t"}}, 3)
    async with env.client() as client:
        r = await post_mcp(client, body)
    reply = json.loads(r.content)
    assert r.status == 200 and reply["id"] == 3
    assert reply["result"]["isError"] is True
    assert reply["result"]["structuredContent"] == {"code": "seal_required"}
    assert env.node.calls == [] and env.node.requests == []
    assert env.stats.value("pact_ingress_refusals_total",
                           {"route": HOST, "code": "seal_required"}) == 1


def _tamper_protected(args: dict[str, str], **changes: Any) -> dict[str, str]:
    from pact_ingress.identity import b64url_decode

    header = json.loads(b64url_decode(args["protected"]))
    header.update(changes)
    for key in [k for k, v in changes.items() if v is _DROP]:
        del header[key]
    return {**args, "protected": b64url(canonical_json(header))}


_DROP = object()


def _bad_envelopes(env: Env) -> dict[str, dict[str, str]]:
    now = time.time()
    good = sealed_call_args(env, send_message_inner())
    from pact_ingress.identity import b64url_decode

    header = json.loads(b64url_decode(good["protected"]))
    noncanonical = b64url(json.dumps(header, indent=1).encode())
    return {
        "misdirected": _tamper_protected(good, to=env.caller_id.fingerprint),
        "expired": sealed_call_args(env, send_message_inner(), ts=int(now) - 700, exp=int(now) - 1),
        "skewed": sealed_call_args(env, send_message_inner(), ts=int(now) + 400),
        "extra_member": _tamper_protected(good, extra="x"),
        "non_canonical": {**good, "protected": noncanonical},
        "empty_msg_id": _tamper_protected(good, msg_id=""),
    }


async def test_invalid_envelopes_refused_at_edge(env: Env) -> None:
    async with env.client() as client:
        for name, args in _bad_envelopes(env).items():
            r = await post_mcp(client, rpc("tools/call", {"name": "sealed_call", "arguments": args}))
            result = json.loads(r.content)["result"]
            assert result["structuredContent"] == {"code": "envelope_invalid"}, name
    assert env.node.requests == []


async def test_not_json_is_400(env: Env) -> None:
    async with env.client() as client:
        r = await post_mcp(client, b"{not json")
    assert r.status == 400
    assert env.node.requests == []
