"""Terminate mode end to end: real TLS on loopback, the demo node behind pinned mTLS.

Every test runs: client (httpcore / curl) → TLS → Terminator (behind a minimal listener
that peeks nothing) → pinned mTLS → demo node. Assertions are about what the client got
and what the node recorded (`node.calls`, `node.requests`) — never about timing.
"""

from __future__ import annotations

import json
import logging
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
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import generate_latest

from pact_ingress.config import Address, Backend, Config, Limits, Listen, Route, Tenant
from pact_ingress.demo.node import DemoNode, serve_demo_node
from pact_ingress.envelope import RESULT_CTY, canonical_json, open_envelope, seal
from pact_ingress.identity import Identity, b64url, spki_der
from pact_ingress.net.backends import Backends
from pact_ingress.net.replay import ReplayStream
from pact_ingress.net.terminate import Terminator
from pact_ingress.proto.http_headers import (
    clean_request_headers,
    clean_response_headers,
    forwarded_value,
)
from pact_ingress.proto.http_request import host_matches
from pact_ingress.proto.routing import RouteTable
from pact_ingress.stats import Stats
from tests.tls_helpers import LOOPBACK, WebPKI, http_client, make_identity, serve_loopback
from tests.tools import require

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
    limits: Limits | None = None,
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
                  limits=limits or Limits())
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


def sealed_call_args(env: Env, inner: dict[str, Any], *, msg_id: str = "m-1",
                     now: float | None = None,
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


@pytest.mark.parametrize("zone", ["eth0", "7", "wlan\u00e9"])
def test_forwarded_names_a_link_local_client_without_its_zone(zone: str) -> None:
    """A zone names an interface of the edge host: meaningless to the node, outside RFC
    7239's grammar for a node (`"[" IPv6address "]"`), and an interface name need not be
    ASCII (the header was then not built at all)."""
    assert forwarded_value(f"fe80::1%{zone}", HOST) == (
        b'for="[fe80::1]";proto=https;host=mcp.alina.test')


def test_response_header_hygiene() -> None:
    dirty = [(b"Connection", b"close, X-Node-Hop"), (b"x-node-hop", b"1"), (b"keep-alive", b"5"),
             (b"transfer-encoding", b"chunked"), (b"upgrade", b"h2c"),
             (b"proxy-authenticate", b"x"),
             (b"content-type", b"text/event-stream"), (b"Mcp-Session-Id", b"s1")]
    assert clean_response_headers(dirty) == [(b"content-type", b"text/event-stream"),
                                             (b"mcp-session-id", b"s1")]


@pytest.mark.parametrize("order", range(6))
def test_response_header_hygiene_in_any_order(order: int) -> None:
    """What `Connection` names goes wherever it stands (before or after the field, in a
    second `Connection`, in any case), and so do pseudo-headers and `proxy-` names."""
    import itertools
    fields = [(b"X-Late", b"1"), (b"CONNECTION", b" x-late ,, Keep-Me-Not"),
              (b"keep-me-not", b"2"), (b":status", b"200"), (b"Proxy-Foo", b"3"),
              (b"connection", b"x-third"), (b"x-third", b"4"), (b"Vary", b"accept")]
    shuffled = list(itertools.permutations(fields))[order * 997 % 40320]
    assert clean_response_headers(shuffled) == [(b"vary", b"accept")]


_NAME_PARTS = [b"x-forwarded-", b"proxy-", b":", b"x-pact-", b"_", b"-", b"te", b"host",
               b"connection", b"keep-alive", b"forwarded", b"accept", b"Content-Length",
               b"X-Real-IP", b"via", b"upgrade", b"expect", b"a", b"Z"]


def _old_request_hygiene(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The request rule as it reads, judged field by field (what the remembered
    verdicts must always agree with)."""
    from pact_ingress.proto.http_headers import HOP_BY_HOP, is_spoofable
    out, named = [], set()
    for name, value in headers:
        lname = name.lower()
        if lname == b"connection":
            named |= {t.strip().lower() for t in value.split(b",") if t.strip()}
        elif not (lname in (b"host", b"content-length", b"te") or lname.startswith(b":")
                  or lname in HOP_BY_HOP or is_spoofable(lname)):
            out.append((lname, value))
    return [f for f in out if f[0] not in named]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.lists(st.sampled_from(_NAME_PARTS), min_size=1, max_size=4)
                          .map(b"".join), st.sampled_from([b"1", b"x-pact-caller, accept"])),
                max_size=12))
def test_header_hygiene_by_remembered_verdicts_is_the_rule(
        fields: list[tuple[bytes, bytes]]) -> None:
    """Each direction's fields are judged by a verdict remembered per name; whatever
    names came before (the table warm, cold or full), what reaches the node and the
    client is what the rule says, field by field."""
    from pact_ingress.proto import http_headers
    for warm in (False, True):
        out = clean_request_headers(fields, client_ip="192.0.2.7", host=HOST)
        assert out[0] == (b"host", HOST.encode()) and out[-1][0] == b"forwarded"
        assert out[1:-1] == _old_request_hygiene(fields), warm
        spoofed = [name for name, _ in out[1:-1] if http_headers.is_spoofable(name)]
        assert not spoofed
        answer = clean_response_headers(fields)
        assert all(not (n in http_headers.HOP_BY_HOP or n.startswith((b":", b"proxy-")))
                   for n, _ in answer)
    assert len(http_headers._request_verdicts) <= http_headers.MAX_VERDICTS
    assert len(http_headers._response_verdicts) <= http_headers.MAX_VERDICTS


def test_verdicts_kept_are_bounded_and_the_rest_judged_each_time() -> None:
    """A client inventing names cannot grow the table past its cap, and names past the
    cap are still judged right (spoofable ones dropped)."""
    from pact_ingress.proto import http_headers
    for i in range(http_headers.MAX_VERDICTS + 50):
        clean_request_headers([(b"x-made-up-%d" % i, b"1")], client_ip="192.0.2.7",
                              host=HOST)
        clean_response_headers([(b"x-made-up-%d" % i, b"1")])
    assert len(http_headers._request_verdicts) <= http_headers.MAX_VERDICTS
    assert len(http_headers._response_verdicts) <= http_headers.MAX_VERDICTS
    late = [(b"x_forwarded_for", b"6.6.6.6"), (b"x-forwarded-host", b"evil"),
            (b"proxy-connection", b"keep-alive"), (b"x-late-but-fine", b"ok")]
    out = clean_request_headers(late, client_ip="192.0.2.7", host=HOST)
    assert [name for name, _ in out] == [b"host", b"x-late-but-fine", b"forwarded"]


def test_host_matching() -> None:
    exact = Route(host=HOST, tenant="t", mode="terminate", backend=Backend(None))
    wild = replace(exact, host="*.alina.test")
    assert host_matches(HOST, HOST, exact.host)
    assert not host_matches(OTHER, HOST, exact.host)
    assert host_matches("a.alina.test", None, wild.host)
    assert not host_matches("alina.test", None, wild.host)
    # with the SNI known, a wildcard route still requires Host == SNI exactly
    assert not host_matches("b.alina.test", "a.alina.test", wild.host)


@pytest.mark.parametrize("name", ["a.alina.test", "a.b.alina.test", "x.y.z.alina.test",
                                  "alina.test", "A.Alina.Test.", "balina.test", "a.other.test"])
def test_wildcard_rule_is_the_routers(name: str) -> None:
    """The terminate host check and the SNI router apply one wildcard rule (any depth)."""
    wild = Route(host="*.alina.test", tenant="t", mode="terminate", backend=Backend(None))
    routed = RouteTable.build([wild]).lookup(name) is not None
    assert host_matches(name.lower().rstrip("."), None, wild.host) == routed


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


@pytest.mark.parametrize("http2", [True, False])
async def test_request_metrics_are_exact_whenever_read(env: Env, http2: bool) -> None:
    """Answered requests and node header times are counted as plain numbers on the hot
    path and moved into their metric families when the registry is collected: every
    read in between sees every request so far, and none twice."""
    def requests(status: str) -> float:
        return env.stats.value("pact_ingress_http_requests_total",
                               {"route": HOST, "status": status})

    def header_times() -> float:
        return env.stats.value("pact_ingress_upstream_response_seconds_count",
                               {"route": HOST})

    async with env.client(http2=http2, http1=not http2) as client:
        for made in range(1, 6):
            r = await post_mcp(client, rpc("tools/list", {}, made))
            assert r.status == 200
            assert requests("200") == made and header_times() == made
            assert requests("200") == made  # a second read counts nothing again
        r = await client.request("POST", f"https://{HOST}/", content=b"{}",
                                 headers=[(b"content-type", b"application/json")])
        # JSON outside the MCP path: refused at the edge
        assert r.status == 403
    assert (requests("200"), requests("403"), header_times()) == (5, 1, 5)
    text = generate_latest(env.stats.registry).decode()
    assert f'pact_ingress_http_requests_total{{route="{HOST}",status="200"}} 5.0' in text


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
            r = await post_mcp(client, rpc("tools/call",
                                           {"name": "sealed_call", "arguments": args}))
            result = json.loads(r.content)["result"]
            assert result["structuredContent"] == {"code": "envelope_invalid"}, name
    assert env.node.requests == []


async def test_not_json_is_400(env: Env) -> None:
    async with env.client() as client:
        r = await post_mcp(client, b"{not json")
    assert r.status == 400
    assert env.node.requests == []


# --- streaming ------------------------------------------------------------------------------


def _sse_events(buffer: bytes) -> tuple[list[dict[str, Any]], bytes]:
    """Complete SSE events in `buffer` (their data as JSON) and the unparsed rest."""
    events = []
    while b"\n\n" in buffer:
        raw, buffer = buffer.split(b"\n\n", 1)
        data = [line[6:] for line in raw.split(b"\n") if line.startswith(b"data: ")]
        events.append(json.loads(b"".join(data)))
    return events, buffer


@pytest.mark.parametrize("http2", [True, False])
async def test_sse_streams_without_buffering(env: Env, http2: bool) -> None:
    """Event 2 is only emitted after the client holds event 1 — so nothing buffered it.

    Were any hop to buffer until more data (or the end), the client would never see
    event 1 and the test would hang at its deadline instead of passing.
    """
    gates = {1: trio.Event(), 2: trio.Event()}
    env.node.sse_gates.update(gates)
    received: list[tuple[int, int]] = []  # (event index, how many events the node had emitted)
    async with env.client(http2=http2, http1=not http2) as client:
        with trio.fail_after(10):
            async with client.stream("GET", f"https://{HOST}/mcp?count=3",
                                     headers=[(b"accept", b"text/event-stream")]) as r:
                assert r.status == 200
                headers = dict(r.headers)
                assert headers[b"content-type"] == b"text/event-stream"
                assert headers[b"mcp-session-id"] == b"demo-sse"
                buffer = b""
                async for chunk in r.aiter_stream():
                    events, buffer = _sse_events(buffer + chunk)
                    for event in events:
                        received.append((event["i"], len(env.node.sse_emitted)))
                        if event["i"] + 1 in gates:
                            gates[event["i"] + 1].set()
    assert [i for i, _ in received] == [0, 1, 2]
    # each event arrived while the node had emitted exactly that many: no batching
    assert received == [(0, 1), (1, 2), (2, 3)]


async def test_client_leaving_ends_node_stream(env: Env) -> None:
    """count=0 streams forever; the client leaving must end the node's stream too.

    The upstream speaks HTTP/1.1: the edge must close the connection the abandoned
    response was on (never pool it), which is what ends the node's stream.
    """
    async with env.client() as client:
        with trio.fail_after(10):
            async with client.stream("GET", f"https://{HOST}/mcp?count=0&interval=0.01") as r:
                async for _ in r.aiter_stream():
                    if len(env.node.sse_emitted) >= 3:
                        break
            assert env.node.sse_open == 1
    # the client's connection is gone now
    with trio.fail_after(10):
        while env.node.sse_open:  # bounded by fail_after
            await trio.sleep(0.01)
    pooled = env.terminator.upstream._pools
    assert len(pooled) == 1 and next(iter(pooled.values())).open == 0
    async with env.client() as client:
        assert (await post_mcp(client, rpc("tools/list", {}))).status == 200
    assert {peer for _, _, peer in env.node.requests} == {env.ingress_id.fingerprint}


# --- Host / SNI -----------------------------------------------------------------------------


async def test_421_on_h2_connection_reuse_for_other_host(env: Env) -> None:
    async with env.client(http1=False) as client:
        r1 = await post_mcp(client, rpc("tools/list", {}))
        r2 = await post_mcp(client, rpc("tools/list", {}), extra=[])
        r3 = await client.request("POST", f"https://{HOST}/mcp",
                                  headers=[(b"host", OTHER.encode())] + JSON,
                                  content=rpc("tools/list", {}))
        assert len(client.connections) == 1  # all three rode one HTTP/2 connection
    assert (r1.status, r2.status, r3.status) == (200, 200, 421)
    assert r3.extensions["http_version"] == b"HTTP/2"
    assert len(env.node.requests) == 2


async def test_421_http11_host_mismatch(env: Env) -> None:
    async with env.client(http2=False) as client:
        r = await client.request("GET", f"https://{HOST}/_demo/headers",
                                 headers=[(b"host", b"evil.example")])
    assert r.status == 421 and env.node.requests == []


async def test_forwarded_headers_reach_node_clean(env: Env) -> None:
    spoof = [(b"x-forwarded-for", b"6.6.6.6"), (b"forwarded", b"for=6.6.6.6"),
             (b"x-real-ip", b"6.6.6.6"), (b"x-pact-caller", b"sha256:forged"),
             (b"x-custom", b"kept")]
    async with env.client(http2=False) as client:
        r = await client.request("GET", f"https://{HOST}/_demo/headers", headers=spoof)
    seen = json.loads(r.content)
    names = [k for k, _ in seen["headers"]]
    assert not {"x-forwarded-for", "x-real-ip", "x-pact-caller"} & set(names)
    assert ["forwarded", "for=127.0.0.1;proto=https;host=mcp.alina.test"] in seen["headers"]
    assert names.count("forwarded") == 1
    assert ["x-custom", "kept"] in seen["headers"]
    assert seen["transport_peer"] == env.ingress_id.fingerprint
    assert seen["http_version"] == "1.1"  # the node offers h2 too; the edge asks http/1.1 only


# --- body cap -------------------------------------------------------------------------------


@pytest.mark.parametrize("http2", [True, False])
async def test_413_declared_and_streamed(nursery: trio.Nursery, tmp_path: Path,
                                         http2: bool) -> None:
    env = await start_env(nursery, tmp_path, limits=Limits(max_body_bytes=1000))
    async with env.client(http2=http2, http1=not http2) as client:
        r = await client.request("POST", f"https://{HOST}/_demo/upload", content=b"x" * 1001)
        assert r.status == 413

        async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: counted as it streams
            for _ in range(5):
                yield b"y" * 300

        r = await client.request("POST", f"https://{HOST}/_demo/upload", content=chunks())
        assert r.status == 413
        r = await client.request("POST", f"https://{HOST}/_demo/upload", content=b"z" * 1000)
        assert r.status == 200 and json.loads(r.content)["bytes"] == 1000
    await env.terminator.aclose()


async def test_streamed_upload_within_cap_arrives_whole(env: Env) -> None:
    async def chunks() -> AsyncIterator[bytes]:
        for i in range(8):
            yield bytes([i]) * 10_000

    async with env.client(http2=False) as client:
        r = await client.request("POST", f"https://{HOST}/_demo/upload", content=chunks())
    import hashlib

    expected = hashlib.sha256(b"".join(bytes([i]) * 10_000 for i in range(8))).hexdigest()
    assert json.loads(r.content) == {"bytes": 80_000, "sha256": expected}


# --- upstream failures ----------------------------------------------------------------------


async def test_502_on_wrong_pin_names_both_fingerprints(
    nursery: trio.Nursery, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    stranger = make_identity(tmp_path, "stranger")
    env = await start_env(nursery, tmp_path, pins=(stranger.fingerprint,))
    logging.getLogger("pact_ingress").setLevel(logging.INFO)
    with caplog.at_level(logging.INFO, logger="pact_ingress"):
        async with env.client() as client:
            r = await post_mcp(client, rpc("tools/list", {}))
    assert r.status == 502
    assert env.node.requests == []
    lines = [rec for rec in caplog.records if rec.getMessage() == "upstream_tls_failed"]
    assert lines, caplog.records
    fields = lines[0].fields  # type: ignore[attr-defined]
    assert fields["expected"] == [stranger.fingerprint]
    assert fields["seen"] == env.node_id.fingerprint
    await env.terminator.aclose()


async def test_two_pins_during_rotation(nursery: trio.Nursery, tmp_path: Path) -> None:
    old = make_identity(tmp_path, "old")
    env = await start_env(nursery, tmp_path, pins=(old.fingerprint, "sha256:" + "A" * 43))
    # neither pin is the node's key → 502; then the rotation's new pin joins → 200
    async with env.client() as client:
        assert (await post_mcp(client, rpc("tools/list", {}))).status == 502
        env.terminator.update(make_config(tmp_path, env.route,
                                          (old.fingerprint, env.node_id.fingerprint)))
        assert (await post_mcp(client, rpc("tools/list", {}))).status == 200
    await env.terminator.aclose()


async def test_503_when_node_down(nursery: trio.Nursery, tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:  # a loopback port with nobody listening
        s.bind((LOOPBACK, 0))
        dead = s.getsockname()[1]
    env = await start_env(nursery, tmp_path, backend_port=dead)
    async with env.client() as client:
        r = await post_mcp(client, rpc("tools/list", {}))
    assert r.status == 503
    assert dict(r.headers)[b"retry-after"] == b"5"
    await env.terminator.aclose()


async def test_504_on_stalled_node(nursery: trio.Nursery, tmp_path: Path) -> None:
    env = await start_env(nursery, tmp_path, header_timeout=0.5)
    async with env.client() as client:
        with trio.fail_after(20):
            r = await client.request("GET", f"https://{HOST}/_demo/stall")
        assert r.status == 504
        # the connection and the pool stay usable afterwards
        assert (await post_mcp(client, rpc("tools/list", {}))).status == 200
    await env.terminator.aclose()


# --- rate limits ----------------------------------------------------------------------------


async def test_rate_limit_per_ip_key_with_mock_clock(
    nursery: trio.Nursery, tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    # 5/hour per (IP, key): burst 5, then one call every 720 s
    env = await start_env(nursery, tmp_path, limits=Limits(calls_per_hour_per_ip_key=5))
    statuses = []
    async with env.client() as client:
        for n in range(6):
            args = sealed_call_args(env, send_message_inner(msg_id=f"i{n}"), msg_id=f"m{n}")
            r = await post_mcp(client, rpc("tools/call",
                                           {"name": "sealed_call", "arguments": args}, n))
            result = json.loads(r.content)["result"]
            statuses.append(result.get("structuredContent", {}).get("code", "ok")
                            if result.get("isError") else "ok")
            if n == 5:
                limited = (r, result)
    assert statuses == ["ok"] * 5 + ["rate_limited"]
    r, result = limited
    assert result["structuredContent"]["retry_after"] == 720
    assert dict(r.headers)[b"retry-after"] == b"720"
    assert len(env.node.calls) == 5
    await env.terminator.aclose()


async def test_plain_http_metered_per_ip_429(
    nursery: trio.Nursery, tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    env = await start_env(nursery, tmp_path, limits=Limits(calls_per_hour_per_ip=10))
    async with env.client() as client:
        codes = [(await client.request("GET", f"https://{HOST}/_demo/headers")).status
                 for _ in range(6)]
        assert codes == [200] * 5 + [429]
        r = await client.request("GET", f"https://{HOST}/_demo/headers")
        assert dict(r.headers)[b"retry-after"] == b"360"
    await trio.sleep(360)  # MockClock: the bucket refills one call (and idle conns close)
    async with env.client() as client:
        assert (await client.request("GET", f"https://{HOST}/_demo/headers")).status == 200
        assert (await client.request("GET", f"https://{HOST}/_demo/headers")).status == 429
    await env.terminator.aclose()


# --- real clients ---------------------------------------------------------------------------


def _curl(env: Env, *args: str) -> tuple[str, str]:
    """Run curl against the edge (blocking; call via trio.to_thread)."""
    proc = subprocess.run(
        ["curl", "-sS", "-k", "--max-time", "20", "--resolve", f"{HOST}:{env.port}:{LOOPBACK}",
         "-w", "\\n%{http_code} %{http_version}", *args],
        capture_output=True, text=True, timeout=30, check=False)
    body, _, status = proc.stdout.rpartition("\n")
    return body, status


@pytest.mark.parametrize(("flag", "version"), [("--http2", "2"), ("--http1.1", "1.1")])
async def test_curl_mcp_and_sse(env: Env, flag: str, version: str) -> None:
    require("curl")
    url = f"https://{HOST}:{env.port}"
    body, status = await trio.to_thread.run_sync(
        _curl, env, flag, "-H", "content-type: application/json", "--data-binary",
        rpc("tools/list", {}).decode(), f"{url}/mcp")
    assert status == f"200 {version}"
    assert json.loads(body)["result"]["tools"][0]["name"] == "echo"
    body, status = await trio.to_thread.run_sync(
        _curl, env, flag, "-N", f"{url}/mcp?count=3&interval=0.01")
    assert status == f"200 {version}"
    assert body.count("event: tick") == 3
    body, status = await trio.to_thread.run_sync(
        _curl, env, flag, "-H", f"host: {OTHER}", f"{url}/mcp")
    assert status == f"421 {version}"
    assert [peer for _, _, peer in env.node.requests] == [env.ingress_id.fingerprint] * 2


async def test_wildcard_route_host_must_equal_sni(nursery: trio.Nursery, tmp_path: Path) -> None:
    env = await start_env(nursery, tmp_path, route_host="*.alina.test")
    async with env.client() as client:
        # no SNI passed by our test listener: Host must match the wildcard
        r = await post_mcp(client, rpc("tools/list", {}), host="a.alina.test")
        assert r.status == 200
        # any depth below the wildcard, as the SNI router routes it...
        r = await post_mcp(client, rpc("tools/list", {}), host="a.alina.test",
                           extra=[(b"host", b"a.b.alina.test")])
        assert r.status == 200
        # ...but never a name outside it
        r = await post_mcp(client, rpc("tools/list", {}), host="a.alina.test",
                           extra=[(b"host", b"a.other.test")])
        assert r.status == 421
    await env.terminator.aclose()


def test_batched_histogram_observation_equals_one_by_one() -> None:
    """The header times moved into the histogram in one go per bucket give the same
    samples as observing them one by one (bucket edges included)."""
    from prometheus_client import CollectorRegistry, Histogram

    from pact_ingress.net.terminate import _observe_all

    values = [0.0, 0.005, 0.0051, 0.1, 0.25, 7.5, 10.0, 10.1, 1e9, 0.3, 0.005]
    registry = CollectorRegistry()
    family = Histogram("t", "t", ["route"], registry=registry)
    for value in values:
        family.labels("one").observe(value)
    _observe_all(family.labels("all"), values)
    samples = {(s.name, s.labels.get("le")): s.value
               for m in registry.collect() for s in m.samples if s.labels.get("route") == "one"}
    batched = {(s.name, s.labels.get("le")): s.value
               for m in registry.collect() for s in m.samples if s.labels.get("route") == "all"}
    samples.pop(("t_created", None))
    batched.pop(("t_created", None))
    assert samples == batched
