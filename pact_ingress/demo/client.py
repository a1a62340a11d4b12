"""A tiny PACT caller for trying the demo: `python -m pact_ingress.demo.client ...`.

`pact-ingress demo` prints commands that use it. It speaks MCP JSON-RPC over HTTPS to the
ingress on loopback (SNI and Host set to the route's name), either

* `plain`  — an unsealed `tools/call send_message` (a terminate route with
  `seal: required` refuses it at the edge with `seal_required`), or
* `sealed` — the same call sealed to the node's key with the caller's key (spec §13): the
  edge checks the envelope header, the node opens it, attributes the call to the
  caller's fingerprint and seals the result back, which this client opens and prints;
* `relay-send` — what a sender does when the node may be away (spec §9): the sealed call
  goes direct first; when that fails (the node is offline: 503), the *same* envelope is
  handed to the node's relay gateway with `relay_call` (the caller's key as client
  certificate), which answers `queued`;
* `relay-fetch` — the node's side, run with the node's key: `fetch_queued` until `more` is
  false, open each envelope with the node key, print the plaintext call, `ack`.

`--cert` presents the caller key as a TLS client certificate (passthrough routes: it
reaches the node untouched). Certificates are not verified by chain here: the demo's
edge certificate is self-signed; the pin check that matters happens edge → node.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import trio
from cryptography import x509

from pact_ingress.demo.wire import fetch_open_ack, post, relay_tool, rpc_call, shown
from pact_ingress.envelope import RESULT_CTY, open_envelope, seal
from pact_ingress.identity import b64url, fingerprint, load_identity, load_private_key, spki_der

#: A relayed call may wait for its node for a while; a day is plenty for the demo (the
#: relay keeps an item until `exp`, at most 30 days).
RELAY_LIFETIME = 24 * 3600


def _inner(text: str) -> dict[str, Any]:
    return {"method": "tools/call",
            "params": {"name": "send_message",
                       "arguments": {"msg_id": str(uuid.uuid4()), "text": text,
                                     "sender": "agent"}}}


def _public_key(path: Path) -> Any:
    """The public key in a PEM certificate (what a caller holds of the node)."""
    return x509.load_pem_x509_certificate(path.read_bytes()).public_key()


async def relay_send(args: argparse.Namespace) -> int:
    """Direct first; on failure, the same envelope to the relay."""
    caller = load_identity(Path(args.key))
    node_pub = _public_key(Path(args.node_cert))
    now = int(time.time())
    payload = {**_inner(args.text), "spk": b64url(spki_der(caller.key.public_key()))}
    envelope = seal(payload, sender_key=caller.key,
                    recipient_public_key=node_pub,  # type: ignore[arg-type]
                    msg_id=str(uuid.uuid4()), ts=now, exp=now + RELAY_LIFETIME)
    print(f"call: {json.dumps(shown(payload))}")
    status, body = await post(args.host, args.port, args.path,
                              rpc_call({"name": "sealed_call", "arguments": envelope}), None)
    if status == 200:
        result = json.loads(body).get("result", {})
        if {"protected", "enc", "ct", "sig"} <= set(result.get("structuredContent") or {}):
            print(f"direct ({args.host}): HTTP 200, delivered; the relay is not needed")
            return 0
    print(f"direct ({args.host}): HTTP {status} {body.decode(errors='replace').strip()}")
    print(f"the node is unreachable: handing the same envelope to its relay ({args.relay})")
    status, result = await relay_tool(args.port, args.relay, caller, "relay_call", envelope)
    answer = json.dumps(result.get("structuredContent", result))
    print(f"relay ({args.relay}): HTTP {status} {answer}")
    return 0 if status == 200 and not result.get("isError") else 1


async def relay_fetch(args: argparse.Namespace) -> int:
    node = load_identity(Path(args.key))
    items = await fetch_open_ack(args.port, args.relay, node)
    if not items:
        print(f"the relay queue of {node.fingerprint} is empty")
        return 0
    for item in items:
        print(json.dumps(item))
    print(f"fetched, opened and acked {len(items)} item(s) for {node.fingerprint}")
    return 0


async def run(args: argparse.Namespace) -> int:
    if args.mode == "relay-fetch":
        if not args.relay:
            raise SystemExit("relay-fetch needs --relay: the gateway to fetch from")
        return await relay_fetch(args)
    if not args.host:
        raise SystemExit(f"{args.mode} needs --host: the route to call")
    if args.mode == "relay-send":
        if not (args.relay and args.node_cert):
            raise SystemExit("relay-send needs --relay (the gateway) and --node-cert")
        return await relay_send(args)
    cert = None
    if args.cert:
        caller = load_identity(Path(args.key))
        cert = (caller.cert_path, caller.key_path)
    if args.mode == "sealed" and not args.node_cert:
        raise SystemExit("sealed needs --node-cert: the node's public key to seal to")
    if args.mode == "plain":
        body = rpc_call(_inner(args.text)["params"])
        status, payload = await post(args.host, args.port, args.path, body, cert)
        print(f"HTTP {status}")
        print(payload.decode(errors="replace"))
        return 0
    key = load_private_key(Path(args.key))
    node_pub = _public_key(Path(args.node_cert))
    now = int(time.time())
    payload = {**_inner(args.text), "spk": b64url(spki_der(key.public_key()))}
    envelope = seal(payload, sender_key=key, recipient_public_key=node_pub,  # type: ignore[arg-type]
                    msg_id=str(uuid.uuid4()), ts=now, exp=now + 300)
    status, body = await post(args.host, args.port, args.path,
                               rpc_call({"name": "sealed_call", "arguments": envelope}), cert)
    print(f"HTTP {status}")
    answer = json.loads(body)
    result = answer.get("result", {})
    sealed = result.get("structuredContent", result)
    if not {"protected", "enc", "ct", "sig"} <= set(sealed):
        print(json.dumps(answer, indent=2))
        return 1
    opened = open_envelope(sealed, recipient_key=key, sender_public_key=node_pub,
                           now=int(time.time()), expected_cty=RESULT_CTY)
    print(f"sealed result from {opened.sender_fingerprint}, opened by "
          f"{fingerprint(key.public_key())}:")
    print(json.dumps(opened.payload, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pact_ingress.demo.client",
                                description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=("plain", "sealed", "relay-send", "relay-fetch"))
    p.add_argument("--host", help="route name (SNI and Host)")
    p.add_argument("--relay", help="the relay gateway's host name (relay-send, relay-fetch)")
    p.add_argument("--port", type=int, required=True, help="ingress TLS port on 127.0.0.1")
    p.add_argument("--path", default="/mcp")
    p.add_argument("--key", required=True,
                   help="the caller's key file (relay-fetch: the node's)")
    p.add_argument("--node-cert", help="the node's certificate (its public key is sealed to)")
    p.add_argument("--cert", action="store_true", help="present the caller key as client cert")
    p.add_argument("--text", default="hello from the demo client")
    args = p.parse_args(argv)
    return trio.run(run, args)


if __name__ == "__main__":
    sys.exit(main())
