"""A tiny PACT caller for trying the demo: `python -m pact_ingress.demo.client ...`.

`pact-ingress demo` prints commands that use it. It speaks MCP JSON-RPC over HTTPS to the
ingress on loopback (SNI and Host set to the route's name), either

* `plain`  — an unsealed `tools/call send_message` (a terminate route with
  `seal: required` refuses it at the edge with `seal_required`), or
* `sealed` — the same call sealed to the node's key with the caller's key (spec §13): the
  edge checks the envelope header, the node opens it, attributes the call to the
  caller's fingerprint and seals the result back, which this client opens and prints.

`--cert` presents the caller key as a TLS client certificate (passthrough routes: it
reaches the node untouched). Certificates are not verified by chain here: the demo's
edge certificate is self-signed; the pin check that matters happens edge → node.
"""

from __future__ import annotations

import argparse
import json
import ssl
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import trio
from cryptography import x509

from pact_ingress.envelope import RESULT_CTY, open_envelope, seal
from pact_ingress.identity import b64url, fingerprint, load_identity, load_private_key, spki_der

TIMEOUT = 15.0


def _inner(text: str) -> dict[str, Any]:
    return {"method": "tools/call",
            "params": {"name": "send_message",
                       "arguments": {"msg_id": str(uuid.uuid4()), "text": text,
                                     "sender": "agent"}}}


async def _post(host: str, port: int, path: str, body: bytes, cert: tuple[Path, Path] | None
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


def _public_key(path: Path) -> Any:
    """The public key in a PEM certificate (what a caller holds of the node)."""
    return x509.load_pem_x509_certificate(path.read_bytes()).public_key()


def _rpc(params: dict[str, Any]) -> bytes:
    return json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                       "params": params}).encode()


async def run(args: argparse.Namespace) -> int:
    cert = None
    if args.cert:
        caller = load_identity(Path(args.key))
        cert = (caller.cert_path, caller.key_path)
    if args.mode == "sealed" and not args.node_cert:
        raise SystemExit("sealed needs --node-cert: the node's public key to seal to")
    if args.mode == "plain":
        body = _rpc(_inner(args.text)["params"])
        status, payload = await _post(args.host, args.port, args.path, body, cert)
        print(f"HTTP {status}")
        print(payload.decode(errors="replace"))
        return 0
    key = load_private_key(Path(args.key))
    node_pub = _public_key(Path(args.node_cert))
    now = int(time.time())
    payload = {**_inner(args.text), "spk": b64url(spki_der(key.public_key()))}
    envelope = seal(payload, sender_key=key, recipient_public_key=node_pub,  # type: ignore[arg-type]
                    msg_id=str(uuid.uuid4()), ts=now, exp=now + 300)
    status, body = await _post(args.host, args.port, args.path,
                               _rpc({"name": "sealed_call", "arguments": envelope}), cert)
    print(f"HTTP {status}")
    answer = json.loads(body)
    result = answer.get("result", {})
    sealed = result.get("structuredContent", result)
    if not {"protected", "enc", "ct", "sig"} <= set(sealed):
        print(json.dumps(answer, indent=2))
        return 1
    opened = open_envelope(sealed, recipient_key=key, sender_public_key=node_pub, now=int(time.time()),
                           expected_cty=RESULT_CTY)
    print(f"sealed result from {opened.sender_fingerprint}, opened by "
          f"{fingerprint(key.public_key())}:")
    print(json.dumps(opened.payload, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pact_ingress.demo.client",
                                description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=("plain", "sealed"))
    p.add_argument("--host", required=True, help="route name (SNI and Host)")
    p.add_argument("--port", type=int, required=True, help="ingress TLS port on 127.0.0.1")
    p.add_argument("--path", default="/mcp")
    p.add_argument("--key", required=True, help="the caller's key file")
    p.add_argument("--node-cert", help="the node's certificate (its public key is sealed to)")
    p.add_argument("--cert", action="store_true", help="present the caller key as client cert")
    p.add_argument("--text", default="hello from the demo client")
    args = p.parse_args(argv)
    return trio.run(run, args)


if __name__ == "__main__":
    sys.exit(main())
