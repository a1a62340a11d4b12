"""The demo's HTTPS plumbing, shared by the caller (`demo.client`) and the demo's own mail
run (`demo.control`): one-shot JSON POSTs over TLS to the loopback ingress (SNI and Host
set to a route or the relay host), relay tool calls with a key as client certificate,
and the node's fetch → open → deliver → ack loop.

A module of its own so that `python -m pact_ingress.demo.client` is never imported by the
package first (runpy warns when the module it runs is already loaded).
"""

from __future__ import annotations

import json
import ssl
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from pact_ingress.envelope import EnvelopeInvalid, open_envelope
from pact_ingress.identity import Identity

TIMEOUT = 15.0
RELAY_MCP = "/relay/mcp"
#: Items per fetch_queued page.
FETCH_PAGE = 100


async def post(host: str, port: int, path: str, body: bytes, cert: tuple[Path, Path] | None
                ) -> tuple[int, bytes]:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.set_alpn_protocols(["http/1.1"])
    if cert is not None:
        ctx.load_cert_chain(*cert)
    with trio.fail_after(TIMEOUT):
        tcp = await trio.open_tcp_stream("127.0.0.1", port)
        tls = trio.SSLStream(tcp, ctx, server_hostname=host)
        head = (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                f"Accept: application/json, text/event-stream\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
        await tls.send_all(head + body)
        data = b""
        while True:
            try:
                chunk = await tls.receive_some(65536)
            except trio.BrokenResourceError:
                break
            if not chunk:
                break
            data += chunk
    head_bytes, _, payload = data.partition(b"\r\n\r\n")
    status = int(head_bytes.split(b" ", 2)[1])
    if b"transfer-encoding: chunked" in head_bytes.lower():
        payload = _dechunk(payload)
    return status, payload


def _dechunk(data: bytes) -> bytes:
    out = b""
    while data:
        size_line, _, rest = data.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            break
        out += rest[:size]
        data = rest[size + 2:]
    return out


def rpc_call(params: dict[str, Any]) -> bytes:
    return json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                       "params": params}).encode()


def shown(payload: dict[str, Any]) -> dict[str, Any]:
    """A call's plaintext as printed: without `spk` (the sender's key, base64)."""
    return {k: v for k, v in payload.items() if k != "spk"}


async def relay_tool(port: int, relay_host: str, ident: Identity, name: str,
                     arguments: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """One relay tool call as `ident` (its key is the client certificate): (HTTP status,
    the tool result, or the whole JSON-RPC answer when it has none)."""
    status, body = await post(relay_host, port, RELAY_MCP,
                              rpc_call({"name": name, "arguments": arguments}),
                              (ident.cert_path, ident.key_path))
    answer = json.loads(body)
    return status, answer.get("result", answer)


async def fetch_open_ack(port: int, relay_host: str, node: Identity,
                         deliver: Callable[[dict[str, Any]], Any] | None = None
                         ) -> list[dict[str, Any]]:
    """The node's mail run: fetch its relay queue page by page, open each envelope with
    the node key, hand it to `deliver` (when given), and ack the page once handled.

    Acking only after delivery keeps the relay's at-least-once promise: a run that dies
    midway leaves the items queued for the next one. Returns one summary per item
    (relay id, sender, msg_id, the plaintext call or why it could not be opened).
    """
    done: list[dict[str, Any]] = []
    while True:
        status, result = await relay_tool(port, relay_host, node, "fetch_queued",
                                          {"limit": FETCH_PAGE})
        page = result.get("structuredContent") if isinstance(result, dict) else None
        if status != 200 or result.get("isError") or not isinstance(page, dict):
            raise RuntimeError(f"fetch_queued failed: HTTP {status} {json.dumps(result)}")
        items = page.get("items") or []
        for item in items:
            envelope = item["envelope"]
            summary: dict[str, Any] = {"id": item["id"], "queued_at": item["queued_at"]}
            try:
                opened = open_envelope(envelope, recipient_key=node.key, now=time.time(),
                                       direct=False)
                summary.update({"from": opened.sender_fingerprint,
                                "msg_id": opened.header.msg_id, "call": shown(opened.payload)})
            except EnvelopeInvalid as exc:  # acked anyway: it will never open
                summary["error"] = f"envelope_invalid: {exc.reason}"
            if deliver is not None and "error" not in summary:
                deliver(envelope)
            done.append(summary)
        if items:
            _, acked = await relay_tool(port, relay_host, node, "ack",
                                        {"ids": [item["id"] for item in items]})
            if acked.get("isError"):
                raise RuntimeError(f"ack failed: {json.dumps(acked)}")
        if not page.get("more"):
            return done
