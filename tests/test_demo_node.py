"""The demo home node on its own: mTLS attribution, sealed calls, idempotency, endpoints."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpcore
import pytest
import trio

from pact_ingress.demo.node import DemoNode, serve_demo_node
from pact_ingress.envelope import RESULT_CTY, open_envelope, seal
from pact_ingress.identity import Identity, b64url, check_pin, pinned_client_context, spki_der
from tests.tls_helpers import LOOPBACK, http_client, make_identity

HOST = "node.alina.test"


@pytest.fixture
async def node(nursery: trio.Nursery, tmp_path: Path) -> DemoNode:
    return await nursery.start(serve_demo_node, make_identity(tmp_path, "node"), LOOPBACK, 0)  # type: ignore[no-any-return]


def client_for(node: DemoNode, identity: Identity | None, *, http2: bool = True) -> httpcore.AsyncConnectionPool:
    alpn = ["h2", "http/1.1"] if http2 else ["http/1.1"]
    return http_client(node.port, pinned_client_context(identity, alpn=alpn), http2=http2)


async def call(client: httpcore.AsyncConnectionPool, method: str, params: dict[str, Any],
               rpc_id: int = 1) -> tuple[httpcore.Response, dict[str, Any]]:
    body = json.dumps({"jsonrpc": "2.0", "id": rpc_id, "method": method, "params": params})
    r = await client.request("POST", f"https://{HOST}/mcp", content=body.encode(),
                             headers=[(b"content-type", b"application/json")])
    return r, json.loads(r.content)


@pytest.mark.parametrize("http2", [True, False])
async def test_plain_call_attributed_to_client_cert(node: DemoNode, tmp_path: Path,
                                                    http2: bool) -> None:
    caller = make_identity(tmp_path, "caller", ed25519=True)
    async with client_for(node, caller, http2=http2) as client:
        r, reply = await call(client, "tools/call", {"name": "echo", "arguments": {"text": "hi"}})
        ssl_object = r.extensions["network_stream"].get_extra_info("ssl_object")
        assert check_pin(ssl_object, [node.identity.fingerprint])  # the node's own key
        assert ssl_object.selected_alpn_protocol() == ("h2" if http2 else "http/1.1")
    assert reply["result"]["structuredContent"] == {"text": "hi", "caller": caller.fingerprint}
    assert [(c.caller, c.transport_peer, c.sealed) for c in node.calls] == [
        (caller.fingerprint, caller.fingerprint, False)]


async def test_anonymous_without_client_cert(node: DemoNode) -> None:
    async with client_for(node, None) as client:
        _, reply = await call(client, "tools/call", {"name": "send_message",
                                                     "arguments": {"msg_id": "1", "text": "x"}})
        _, listing = await call(client, "tools/list", {}, 2)
    assert reply["result"]["structuredContent"]["caller"] == "anonymous"
    assert [t["name"] for t in listing["result"]["tools"]] == ["echo", "send_message", "sealed_call"]
    assert node.calls[0].transport_peer is None


async def test_sealed_call_opens_dispatches_seals_back_idempotently(
    node: DemoNode, tmp_path: Path
) -> None:
    caller = make_identity(tmp_path, "caller")
    edge = make_identity(tmp_path, "edge")  # the transport peer differs from the sender
    now = int(time.time())
    envelope = seal({"method": "tools/call", "spk": b64url(spki_der(caller.key.public_key())),
                     "params": {"name": "echo", "arguments": {"text": "sealed hi"}}},
                    sender_key=caller.key, recipient_public_key=node.identity.key.public_key(),  # type: ignore[arg-type]
                    msg_id="env-1", ts=now, exp=now + 600)
    async with client_for(node, edge) as client:
        _, first = await call(client, "tools/call", {"name": "sealed_call", "arguments": envelope})
        _, again = await call(client, "tools/call", {"name": "sealed_call", "arguments": envelope}, 2)
        r = await client.request("GET", f"https://{HOST}/_demo/calls")
    result_env = first["result"]["structuredContent"]
    assert again["result"]["structuredContent"] == result_env  # replay: the original result
    opened = open_envelope(result_env, recipient_key=caller.key, now=time.time(),
                           sender_public_key=node.identity.key.public_key(),  # type: ignore[arg-type]
                           expected_cty=RESULT_CTY)
    assert opened.header.msg_id == "env-1"
    assert opened.payload["structuredContent"] == {"text": "sealed hi", "caller": caller.fingerprint}
    assert [(c.caller, c.transport_peer, c.sealed) for c in node.calls] == [
        (caller.fingerprint, edge.fingerprint, True)]  # executed once
    assert json.loads(r.content)[0]["caller"] == caller.fingerprint


async def test_garbage_envelope_is_envelope_invalid(node: DemoNode) -> None:
    async with client_for(node, None) as client:
        _, reply = await call(client, "tools/call", {"name": "sealed_call",
                                                     "arguments": {"protected": "x"}})
    assert reply["result"]["structuredContent"] == {"code": "envelope_invalid"}
    assert node.calls == []


async def test_sse_and_stall(node: DemoNode) -> None:
    async with client_for(node, None) as client:
        r = await client.request("GET", f"https://{HOST}/mcp?count=2&interval=0")
        assert r.content.count(b"event: tick") == 2
        with trio.move_on_after(0.3) as scope:
            await client.request("GET", f"https://{HOST}/_demo/stall")
        assert scope.cancelled_caught
