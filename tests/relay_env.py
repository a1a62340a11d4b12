"""Black-box harness for the relay: a real `pact-ingress serve` with a relay host, and
callers that present real (self-signed) client certificates over real TLS.

    ids = relay_identities(tmp)                  # recipient (a relay tenant), sender, other
    serve = RelayServe(tmp, recipients=[ids.recipient])  # starts, waits READY
    caller = RelayCaller(serve.port, ids.sender) # keep-alive HTTP/1.1 with a client cert
    caller.tool("relay_call", envelope_for(ids))  # -> (result dict, RawResponse)
    caller.allowlist_set([ids.sender.fingerprint])
    serve.kill9(); serve.restart()

Everything binds 127.0.0.1; every wait is bounded (`WAIT`).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pact_ingress.envelope import seal
from pact_ingress.identity import Identity, b64url, keygen, spki_der
from tests.netutil import START_WAIT, wait_told
from tests.terminate_env import (
    WAIT,
    H2Conn,
    RawResponse,
    forget,
    free_port,
    hostport,
    json_events,
    read_response,
    request_bytes,
)

LOOPBACK = "127.0.0.1"
RELAY_HOST = "relay.test"
TUNNEL_HOST = "tunnel.test"


@dataclass
class RelayIdentities:
    recipient: Identity  # a node served by the relay (tenant "home", relay: true)
    sender: Identity
    other: Identity  # a second sender, never on any list
    ingress: Identity


def relay_identities(tmp: Path) -> RelayIdentities:
    return RelayIdentities(
        recipient=keygen(tmp / "recipient.key", common_name="recipient"),
        sender=keygen(tmp / "sender.key", ed25519_key=True, common_name="sender"),
        other=keygen(tmp / "other.key", common_name="other"),
        ingress=keygen(tmp / "ingress.key", common_name="ingress"),
    )


def envelope(sender: Identity, recipient: Identity, *, msg_id: str = "m-1",
             ts: int | None = None, exp: int | None = None, text: str = "hello",
             cty: str = "application/pact-call+json") -> dict[str, str]:
    """A sealed send_message call from `sender` to `recipient` (PACT §13)."""
    ts = int(time.time()) if ts is None else ts
    inner = {"method": "tools/call", "params": {"name": "send_message", "arguments": {
        "msg_id": f"inner-{msg_id}", "text": text, "sender": "agent"}},
        "spk": b64url(spki_der(sender.key.public_key()))}  # type: ignore[arg-type]
    return seal(inner, sender_key=sender.key,
                recipient_public_key=recipient.key.public_key(),  # type: ignore[arg-type]
                msg_id=msg_id, ts=ts, exp=ts + 3600 if exp is None else exp, cty=cty)


def rpc(method: str, params: dict[str, Any] | None = None, rpc_id: Any = 1) -> bytes:
    message: dict[str, Any] = {"jsonrpc": "2.0", "method": method, "id": rpc_id}
    if params is not None:
        message["params"] = params
    return json.dumps(message).encode()


def tool_body(name: str, arguments: Any, rpc_id: Any = 1) -> bytes:
    return rpc("tools/call", {"name": name, "arguments": arguments}, rpc_id)


def client_context(ident: Identity | None, alpn: Iterable[str] = ("http/1.1",)
                   ) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.set_alpn_protocols(list(alpn))
    if ident is not None:
        ctx.load_cert_chain(ident.cert_path, ident.key_path)
    return ctx


def relay_socket(port: int, ident: Identity | None, *, alpn: Iterable[str] = ("http/1.1",),
                 timeout: float = WAIT, host: str = LOOPBACK,
                 source: str | None = None) -> ssl.SSLSocket:
    raw = socket.create_connection((host, port), timeout=timeout,
                                   source_address=(source, 0) if source else None)
    try:
        return client_context(ident, alpn).wrap_socket(raw, server_hostname=RELAY_HOST)
    except BaseException:
        raw.close()
        raise


class RelayCaller:
    """One keep-alive HTTP/1.1 connection to the relay host, as `ident` (None: no cert)."""

    def __init__(self, port: int, ident: Identity | None, host: str = LOOPBACK,
                 source: str | None = None) -> None:
        self.port, self.ident, self.host, self.source = port, ident, host, source
        self.sock: ssl.SSLSocket | None = None

    def request(self, method: str, path: str, body: bytes = b"", **kw: Any) -> RawResponse:
        for attempt in (0, 1):  # a keep-alive connection the server closed: once more
            if self.sock is None:
                self.sock = relay_socket(self.port, self.ident, host=self.host,
                                         source=self.source)
            try:
                self.sock.sendall(request_bytes(method, path, RELAY_HOST, body=body, **kw))
                return read_response(self.sock)
            except (ConnectionError, ssl.SSLError, OSError):
                self.close()
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def rpc(self, body: bytes) -> tuple[dict[str, Any], RawResponse]:
        resp = self.request("POST", "/relay/mcp", body)
        return json.loads(resp.body), resp

    def tool(self, name: str, arguments: Any) -> tuple[dict[str, Any], RawResponse]:
        doc, resp = self.rpc(tool_body(name, arguments))
        return doc.get("result", doc), resp

    def allowlist_set(self, senders: list[str]) -> RawResponse:
        return self.request("POST", "/relay/allowlist", json.dumps({"senders": senders}).encode())

    def allowlist_get(self) -> RawResponse:
        return self.request("GET", "/relay/allowlist")

    def close(self) -> None:
        if self.sock is not None:
            forget(self.sock)
            self.sock = None


class RelayH2(H2Conn):
    """HTTP/2 to the relay host with a client certificate (H2Conn's machinery);
    `validate=False`: any `:path` or header goes out, as in H2Conn."""

    def __init__(self, port: int, ident: Identity | None, *, validate: bool = True) -> None:
        self._start(relay_socket(port, ident, alpn=("h2",)), RELAY_HOST, validate=validate)


def code_of(result: dict[str, Any]) -> str | None:
    if isinstance(result, dict) and result.get("isError"):
        sc = result.get("structuredContent") or {}
        return sc.get("code")
    return None


@dataclass
class RelayServe:
    """`python -m pact_ingress serve` with a relay host and one relay tenant ("home")."""

    tmp: Path
    recipients: list[Identity]
    max_items: int | None = None
    max_bytes: str | None = None
    tunnel: bool = False
    extra: str = ""
    env: dict[str, str] = field(default_factory=dict)
    address: str = LOOPBACK  # the TLS listener's (the admin one stays on LOOPBACK)
    workers: int | None = None  # `--workers`; None: serve's default (one per core)

    def __post_init__(self) -> None:
        self.port, self.admin_port = free_port(), free_port()
        self.config = self.tmp / "ingress.yaml"
        self.config.write_text(self.render())
        self.log_path = self.tmp / "serve.log"
        self._log = open(self.log_path, "ab")
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def render(self) -> str:
        bounds = ""
        if self.max_items is not None:
            bounds += f"  max_items: {self.max_items}\n"
        if self.max_bytes is not None:
            bounds += f"  max_bytes: {self.max_bytes}\n"
        pins = ", ".join(f'"{r.fingerprint}"' for r in self.recipients)
        tunnel = f"tunnel: {{hostname: {TUNNEL_HOST}}}\n" if self.tunnel else ""
        routes = ""
        if self.tunnel:
            routes = ("    routes:\n      - host: home.test\n        mode: passthrough\n"
                      "        backend: tunnel\n")
        return f"""\
identity: {{key: ingress.key}}
state_dir: state
listen:
  tls: ["{hostport(self.address, self.port)}"]
  admin: "{LOOPBACK}:{self.admin_port}"
{tunnel}relay:
  host: {RELAY_HOST}
  cert: {{cert: certs/relay.crt, key: certs/relay.key}}
{bounds}tenants:
  - name: home
    pins: [{pins}]
    relay: true
{routes}{self.extra}"""

    def start(self) -> None:
        notify_path = self.tmp / "notify.sock"
        with contextlib.suppress(FileNotFoundError):
            notify_path.unlink()
        self.notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.notify.bind(str(notify_path))
        env = dict(os.environ, NOTIFY_SOCKET=str(notify_path), **self.env)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pact_ingress", "serve", "-c", str(self.config),
             *(["--workers", str(self.workers)] if self.workers is not None else [])],
            stdout=self._log, stderr=subprocess.STDOUT, env=env)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self) -> None:
        if wait_told(self.notify, "READY=1", self.proc, START_WAIT)[0]:
            return
        raise AssertionError(f"serve not READY; log tail:\n{self.logs()[-3000:]}")

    def logs(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def log_events(self) -> list[dict[str, Any]]:
        return json_events(self.logs())

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=WAIT)
        self.notify.close()

    def restart(self) -> None:
        self.start()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        with contextlib.suppress(OSError):
            self.notify.close()
        if not self._log.closed:
            self._log.close()

    def status(self) -> dict[str, Any]:
        import urllib.request

        with urllib.request.urlopen(f"http://{LOOPBACK}:{self.admin_port}/status",
                                    timeout=10) as r:
            return dict(json.loads(r.read()))

    def metrics(self) -> str:
        import urllib.request

        with urllib.request.urlopen(f"http://{LOOPBACK}:{self.admin_port}/metrics",
                                    timeout=10) as r:
            return str(r.read().decode())


def relay_ingress(tmp_path: Path, ids: Any) -> tuple[Any, int]:
    """An `Ingress` in this process (not started) serving the relay host for
    `ids.recipient`, and its port: for tests that move its clock, shorten a deadline or
    shrink a budget first."""
    from pact_ingress.app import Ingress
    from pact_ingress.config import load_config

    port = free_port()
    config_path = tmp_path / "ingress.yaml"
    config_path.write_text(f"""\
identity: {{key: ingress.key}}
state_dir: state
listen: {{tls: ["127.0.0.1:{port}"]}}
relay: {{host: {RELAY_HOST}, cert: {{cert: relay.crt, key: relay.key}}}}
tenants:
  - {{name: home, pins: ["{ids.recipient.fingerprint}"], relay: true}}
""")
    return Ingress(load_config(config_path)), port


async def in_process(tmp_path: Path, ids: Any, clock: list[float], body: Any) -> None:
    """Run `body(port, ingress)` in a thread against an in-process ingress whose relay
    clock is `clock[0]`, so retention and expiry can be crossed without waiting (the
    body reaches the ingress's coroutines with `trio.from_thread.run`)."""
    import trio

    ingress, port = relay_ingress(tmp_path, ids)
    ingress.relay.clock = lambda: clock[0]
    async with trio.open_nursery() as nursery:
        await nursery.start(lambda task_status: ingress.run(handle_signals=False,
                                                           task_status=task_status))
        try:
            await trio.to_thread.run_sync(body, port, ingress)
        finally:
            await ingress.stop(deadline=1)
