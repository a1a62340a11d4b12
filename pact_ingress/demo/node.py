"""A small demo PACT home node: MCP Streamable HTTP over mTLS, with sealed calls.

Why it exists: `pact-ingress demo` and the end-to-end tests need something real behind
the ingress — a node with its own PACT identity that

* serves TLS itself, **requesting** a client certificate and accepting any self-signed
  one (pyOpenSSL via `net.ossl_stream`: stdlib ssl has no verify callback, so it can only
  accept client certificates that chain to a CA it was given), so it can
  report which key was on the transport link (the ingress's, in terminate mode; the
  caller's, in passthrough mode);
* answers MCP `initialize`, `tools/list` (the guest view: `echo`, `send_message`,
  `sealed_call`) and `tools/call`: a plain call is attributed to the client-certificate
  fingerprint (or "anonymous"); `sealed_call` opens the envelope with the node's key,
  verifies it (spec §13.3), dispatches the inner call as the envelope's sender, and seals
  the result back to the caller (`cty` result, same `msg_id`);
* streams Server-Sent Events on GET of the MCP path (`?count=N&interval=S`, `count=0`
  runs until the client leaves), with test hooks (`sse_gates`) that hold an event until
  the test releases it — which is how tests prove no proxy buffers the stream;
* keeps `calls` (who each call was attributed to, and the transport peer), also served
  as JSON at `GET /_demo/calls`; `GET /_demo/headers` echoes request headers;
  `POST /_demo/upload` counts a body; `/_demo/stall` never answers (504 tests).

It is a demo, not a PACT implementation: no contacts, tiers or permissions.
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import parse_qs

import trio
from cryptography.hazmat.primitives import serialization
from hypercorn.app_wrappers import ASGIWrapper
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import ConnectionState

from pact_ingress.envelope import RESULT_CTY, EnvelopeInvalid, open_envelope, seal
from pact_ingress.identity import Identity, b64url_decode
from pact_ingress.logs import log
from pact_ingress.net.hypercorn_guard import install_h2_guard
from pact_ingress.net.ossl_stream import OpenSSLStream, server_context

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

MCP_PATH = "/mcp"
PROTOCOL_VERSION = "2025-06-18"
#: Lifetime of sealed results (they are delivered directly, so short is fine).
RESULT_LIFETIME = 600
#: Cap on SSE events per stream when a count is given (count=0 means "until closed").
MAX_SSE_EVENTS = 10_000
#: Body cap for the demo's own endpoints.
MAX_BODY = 8 * 1024 * 1024
#: Envelope results remembered for idempotency (spec §13.3), oldest dropped first.
MAX_REMEMBERED = 1024

GUEST_TOOLS = [
    {
        "name": "echo",
        "description": "Echo `text` back, saying who the node thinks called.",
        "inputSchema": {"type": "object", "properties": {"text": {"type": "string"}}},
    },
    {
        "name": "send_message",
        "description": "Deliver a message (recorded by the demo node).",
        "inputSchema": {
            "type": "object",
            "properties": {
                "msg_id": {"type": "string"},
                "thread_id": {"type": "string"},
                "text": {"type": "string"},
                "sender": {"type": "string", "enum": ["human", "agent"]},
            },
            "required": ["msg_id", "text"],
        },
    },
    {
        "name": "sealed_call",
        "description": "A PACT sealed envelope (spec §13.2): protected, enc, ct, sig.",
        "inputSchema": {
            "type": "object",
            "properties": {k: {"type": "string"} for k in ("protected", "enc", "ct", "sig")},
            "required": ["protected", "enc", "ct", "sig"],
        },
    },
]


@dataclass(frozen=True)
class CallRecord:
    """One tool call as the node saw it."""

    tool: str
    caller: str  # the fingerprint the call is attributed to, or "anonymous"
    transport_peer: str | None  # the key presented on the TLS link (None: no cert)
    sealed: bool
    msg_id: str | None
    at: float  # wall clock
    via: str = "direct"  # "relay": fetched from the node's relay queue, not called directly


@dataclass
class DemoNode:
    identity: Identity
    port: int
    calls: list[CallRecord] = field(default_factory=list)
    #: Test hook: before emitting SSE event i, wait for sse_gates[i] if present.
    sse_gates: dict[int, trio.Event] = field(default_factory=dict)
    #: (event index, trio.current_time()) of every SSE event written.
    sse_emitted: list[tuple[int, float]] = field(default_factory=list)
    #: SSE streams currently open (tests check that abandoned streams end).
    sse_open: int = 0
    #: Requests that reached the node: (method, path, transport peer).
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)
    _sealed_results: dict[str, dict[str, Any]] = field(default_factory=dict)

    def app(self, tls: OpenSSLStream) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
        """The ASGI app for one connection (it knows that connection's peer key)."""

        async def app(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] == "http":
                await _Exchange(self, tls.peer_fingerprint, scope, receive, send).run()

        return app

    async def serve_stream(self, stream: trio.abc.Stream, ctx: Any,
                           config: HypercornConfig) -> None:
        """Serve one accepted connection (its transport must expose `.socket`)."""
        tls = OpenSSLStream(stream, ctx, server_side=True, https_compatible=True)
        server = TCPServer(ASGIWrapper(self.app(tls)), config, WorkerContext(None),
                           ConnectionState({}), tls)  # type: ignore[arg-type]
        try:
            await server.run()
        finally:
            await trio.aclose_forcefully(tls)

    # -- calls (shared by the MCP endpoint and relayed delivery) --------------------------

    def dispatch(self, name: Any, arguments: dict[str, Any], *, caller: str,
                 peer: str | None, sealed: bool, via: str = "direct") -> dict[str, Any]:
        msg_id = arguments.get("msg_id") if isinstance(arguments.get("msg_id"), str) else None
        if name not in ("echo", "send_message"):
            return _tool_error("bad_request", f"unknown tool {str(name)[:64]!r}")
        self.calls.append(CallRecord(str(name), caller, peer, sealed, msg_id, time.time(), via))
        log.info("demo_call", tool=name, caller=caller, transport_peer=peer, sealed=sealed,
                 via=via)
        if name == "echo":
            text = str(arguments.get("text", ""))
            return {"content": [{"type": "text", "text": text}],
                    "structuredContent": {"text": text, "caller": caller}}
        thread_id = str(arguments.get("thread_id") or uuid.uuid4())
        return {"content": [{"type": "text", "text": "delivered"}],
                "structuredContent": {"thread_id": thread_id, "status": "delivered",
                                      "caller": caller}}

    def sealed_call(self, envelope: Any, *, peer: str | None, relayed: bool = False
                    ) -> tuple[dict[str, Any] | None, dict[str, Any]]:
        """Open, verify, dispatch as the envelope's sender, seal the result back.

        Returns (the opened payload or None, the sealed result or a tool error). A relayed
        envelope was queued at a gateway, so its `ts` may be old: only `exp` bounds it.
        """
        now = time.time()
        try:
            opened = open_envelope(envelope, recipient_key=self.identity.key, now=now,
                                   direct=not relayed)
        except EnvelopeInvalid as exc:
            return None, _tool_error("envelope_invalid", exc.reason)
        header = opened.header
        payload = opened.payload
        remembered = self._sealed_results.get(f"env:{header.sender}:{header.msg_id}")
        if remembered is not None:  # spec §13.3: a replay gets the original result
            return payload, remembered
        caller_key = serialization.load_der_public_key(b64url_decode(payload["spk"]))
        inner = payload.get("params") or {}
        if payload.get("method") == "tools/list":
            result: dict[str, Any] = {"tools": GUEST_TOOLS}
        elif payload.get("method") == "tools/call" and isinstance(inner, dict):
            result = self.dispatch(inner.get("name"), inner.get("arguments") or {},
                                   caller=opened.sender_fingerprint, peer=peer, sealed=True,
                                   via="relay" if relayed else "direct")
        else:
            result = _tool_error("bad_request", "sealed method must be tools/call or tools/list")
        sealed = seal(result, sender_key=self.identity.key,
                      recipient_public_key=caller_key,  # type: ignore[arg-type]
                      msg_id=header.msg_id, ts=int(now), exp=int(now) + RESULT_LIFETIME,
                      cty=RESULT_CTY, kid=header.sender)
        if len(self._sealed_results) >= MAX_REMEMBERED:
            self._sealed_results.pop(next(iter(self._sealed_results)))
        self._sealed_results[f"env:{header.sender}:{header.msg_id}"] = sealed
        return payload, sealed


class _Exchange:
    """One HTTP request to the demo node."""

    def __init__(self, node: DemoNode, peer: str | None, scope: Scope, receive: Receive,
                 send: Send) -> None:
        self.node, self.peer = node, peer
        self.scope, self.receive, self.send = scope, receive, send

    async def run(self) -> None:
        method, path = self.scope["method"], self.scope["path"]
        self.node.requests.append((method, path, self.peer))
        if path == MCP_PATH and method == "POST":
            await self._mcp_post()
        elif path == MCP_PATH and method == "GET":
            await self._sse()
        elif path == MCP_PATH and method == "DELETE":
            await self._respond(200, b"")
        elif path == "/_demo/calls":
            await self._json(200, [asdict(c) for c in self.node.calls])
        elif path == "/_demo/headers":
            await self._json(200, {"headers": [[k.decode("latin-1"), v.decode("latin-1")]
                                               for k, v in self.scope["headers"]],
                                   "transport_peer": self.peer,
                                   "http_version": self.scope["http_version"]})
        elif path == "/_demo/upload":
            body = await self._body()
            await self._json(200, {"bytes": len(body), "sha256": hashlib.sha256(body).hexdigest()})
        elif path == "/_demo/stall":
            await self._wait_disconnect()
        else:
            await self._respond(404, b"not found\n", content_type="text/plain")

    # -- plumbing -----------------------------------------------------------------------

    async def _body(self) -> bytes:
        parts, size = [], 0
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                break
            parts.append(message.get("body", b""))
            size += len(parts[-1])
            if size > MAX_BODY or not message.get("more_body", False):
                break
        return b"".join(parts)

    async def _wait_disconnect(self) -> None:
        while (await self.receive())["type"] != "http.disconnect":
            pass

    async def _respond(self, status: int, body: bytes, *, content_type: str = "application/json",
                       headers: list[tuple[bytes, bytes]] | None = None) -> None:
        all_headers = [(b"content-type", content_type.encode()),
                       (b"content-length", str(len(body)).encode())] + (headers or [])
        await self.send({"type": "http.response.start", "status": status, "headers": all_headers})
        await self.send({"type": "http.response.body", "body": body, "more_body": False})

    async def _json(self, status: int, obj: Any,
                    headers: list[tuple[bytes, bytes]] | None = None) -> None:
        await self._respond(status, json.dumps(obj).encode(), headers=headers)

    # -- SSE ----------------------------------------------------------------------------

    async def _sse(self) -> None:
        query = parse_qs(self.scope["query_string"].decode("latin-1"))
        count = min(int(query.get("count", ["3"])[0]), MAX_SSE_EVENTS)
        interval = float(query.get("interval", ["0.05"])[0])
        await self.send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"),
            (b"mcp-session-id", b"demo-sse")]})
        self.node.sse_open += 1
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._cancel_on_disconnect, nursery.cancel_scope)
                await self._emit(count, interval)
                await self.send({"type": "http.response.body", "body": b"", "more_body": False})
                nursery.cancel_scope.cancel()
        finally:
            self.node.sse_open -= 1

    async def _emit(self, count: int, interval: float) -> None:
        i = 0
        while count == 0 or i < count:
            gate = self.node.sse_gates.get(i)
            if gate is not None:
                await gate.wait()
            elif i:
                await trio.sleep(interval)
            data = json.dumps({"i": i, "t": time.time()})
            event = f"id: {i}\nevent: tick\ndata: {data}\n\n".encode()
            self.node.sse_emitted.append((i, trio.current_time()))
            await self.send({"type": "http.response.body", "body": event, "more_body": True})
            i += 1

    async def _cancel_on_disconnect(self, scope: trio.CancelScope) -> None:
        await self._wait_disconnect()
        scope.cancel()

    # -- MCP ----------------------------------------------------------------------------

    async def _mcp_post(self) -> None:
        try:
            message = json.loads(await self._body())
        except ValueError:
            await self._json(400, _rpc_error(None, -32700, "Parse error"))
            return
        if not isinstance(message, dict) or message.get("jsonrpc") != "2.0":
            await self._json(400, _rpc_error(None, -32600, "Invalid Request"))
            return
        if "id" not in message:  # notification or response: accepted, nothing to say
            await self._respond(202, b"")
            return
        rpc_id, method = message["id"], message.get("method")
        params = message.get("params") or {}
        headers: list[tuple[bytes, bytes]] = []
        if method == "initialize":
            headers.append((b"mcp-session-id", uuid.uuid4().hex.encode()))
            result: Any = {
                "protocolVersion": params.get("protocolVersion", PROTOCOL_VERSION),
                "capabilities": {"tools": {}},
                "serverInfo": {"name": "pact-ingress-demo-node", "version": "0.1"},
            }
        elif method == "ping":
            result = {}
        elif method == "tools/list":
            result = {"tools": GUEST_TOOLS}
        elif method == "tools/call":
            result = self._tools_call(params)
        else:
            await self._json(200, _rpc_error(rpc_id, -32601, "Method not found"))
            return
        await self._json(200, {"jsonrpc": "2.0", "id": rpc_id, "result": result}, headers)

    def _tools_call(self, params: dict[str, Any]) -> dict[str, Any]:
        name, arguments = params.get("name"), params.get("arguments") or {}
        if name == "sealed_call":
            return _sealed_tool_result_or_error(self.node.sealed_call(arguments, peer=self.peer)[1])
        return self.node.dispatch(name, arguments, caller=self.peer or "anonymous",
                                  peer=self.peer, sealed=False)


def _sealed_tool_result_or_error(answer: dict[str, Any]) -> dict[str, Any]:
    """A sealed result travels as the tool result's structured content; an error as is."""
    if answer.get("isError"):
        return answer
    return {"content": [{"type": "text", "text": json.dumps(answer)}],
            "structuredContent": answer}


def _tool_error(code: str, why: str) -> dict[str, Any]:
    return {"isError": True, "content": [{"type": "text", "text": f"{code}: {why}"}],
            "structuredContent": {"code": code}}


def _rpc_error(rpc_id: Any, code: int, message: str) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": rpc_id, "error": {"code": code, "message": message}}


def demo_hypercorn_config() -> HypercornConfig:
    config = HypercornConfig()
    config.keep_alive_timeout = 75.0
    config.ssl_handshake_timeout = 10.0
    config.accesslog = None
    config.errorlog = None
    return config


async def serve_demo_node(
    identity: Identity,
    host: str,
    port: int,
    *,
    alpn: tuple[str, ...] = ("h2", "http/1.1"),
    task_status: trio.TaskStatus[DemoNode] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run a demo node on host:port (0 = any free port) until cancelled.

    `task_status.started(node)` hands back the `DemoNode` (with the bound port).
    """
    install_h2_guard()
    ctx = server_context(identity, alpn=alpn)
    config = demo_hypercorn_config()
    listeners = await trio.open_tcp_listeners(port, host=host)
    node = DemoNode(identity, listeners[0].socket.getsockname()[1])

    async def handler(stream: trio.SocketStream) -> None:
        await node.serve_stream(stream, ctx, config)

    async with trio.open_nursery() as nursery:
        task_status.started(node)
        await trio.serve_listeners(handler, listeners, handler_nursery=nursery)
