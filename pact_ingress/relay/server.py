"""The relay gateway: TLS with any client key, an MCP app on hypercorn, the queue behind it.

Theory of operation
-------------------
The router hands us every connection whose SNI is `relay.host` (peeked bytes replayed).
TLS ends here, with pyOpenSSL (`net.ossl_stream`): the stdlib cannot accept an unknown
self-signed client certificate, and on a relay every caller is one — its key *is* its
identity (spec §2), read as the SPKI fingerprint after the handshake. The certificate is
requested, not required at the TLS layer, so a caller without one gets a readable
``identity_required`` answer instead of a failed handshake. The certificate we present is
the relay host's (files or ACME, held by `CertManager`, reloaded when its files change).

HTTP/1.1 and HTTP/2 are hypercorn's, driven on the accepted stream exactly as the demo
node does (`TCPServer` per connection: its public `serve` wants listeners, and we need
each connection's peer key in the app). The app serves two paths:

* ``POST /relay/mcp`` — JSON-RPC: ``initialize``, ``ping``, ``tools/list``,
  ``tools/call`` of ``relay_call`` / ``fetch_queued`` / ``ack``. The rules are
  `proto.relay`'s; the queue is a `RelayStore`, chosen by the state backend (SQLite, or
  Redis: `state/relay_store.py`). A success answer to relay_call is sent only after the
  store's COMMIT returned, or Redis answered the write (see `relay/store.py`).
* ``GET|POST /relay/allowlist`` — the recipient's own allow-list.

Only configured recipients (pins of ``relay: true`` tenants) have queues and lists. One
JSON log line per tool call names caller, recipient, msg_id, size and outcome, never a
body. When an item is newly queued for a tenant with a live tunnel, `wake(tenant)` asks
the tunnel server to push a content-free WAKE (it rate-limits per tenant).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

import trio
from cryptography import x509
from hypercorn.app_wrappers import ASGIWrapper
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import ConnectionState
from OpenSSL import SSL

from pact_ingress import __version__
from pact_ingress.identity import PublicKey, fingerprint_of_cert_der
from pact_ingress.logs import log
from pact_ingress.model import Config
from pact_ingress.net.hypercorn_guard import install_h2_guard
from pact_ingress.net.ossl_stream import OpenSSLStream, files_server_context
from pact_ingress.net.replay import ReplayStream
from pact_ingress.proto import relay as rules
from pact_ingress.proto import tls_alert
from pact_ingress.proto.ratelimit import Budget, Limited
from pact_ingress.proto.relay import Refusal
from pact_ingress.relay.store import QueueFull, RelayStore, SqliteStore, StoreUnavailable
from pact_ingress.state import LocalState, StateBackend
from pact_ingress.stats import Stats

MCP_PATH = "/relay/mcp"
ALLOWLIST_PATH = "/relay/allowlist"
#: Body of an allow-list POST: MAX_ALLOWLIST fingerprints of ~55 bytes, quoted.
MAX_ALLOWLIST_BODY = 1024 * 1024
#: One deadline for reading a whole request body (slow-loris bound on the largest one).
BODY_TIMEOUT = 60.0
#: Expired items are purged this often (they are already invisible to fetch meanwhile).
PURGE_INTERVAL = 60.0
#: MCP protocol version answered when the client names none we can echo.
MCP_VERSION = "2025-06-18"

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


def _hypercorn_config() -> HypercornConfig:
    config = HypercornConfig()
    config.keep_alive_timeout = 75.0
    config.ssl_handshake_timeout = 10.0
    config.include_server_header = False
    config.accesslog = None
    config.errorlog = None
    return config


class RelayServer:
    """The relay host: `serve` takes connections from the router; `run` keeps the store."""

    def __init__(self, config: Config, *, stats: Stats, certs: Any,
                 wake: Callable[[str], bool] | None = None,
                 store: RelayStore | None = None, state: StateBackend | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        assert config.relay is not None
        install_h2_guard()  # hypercorn crash on DATA for a finished stream
        self.stats = stats
        self.certs = certs
        self.wake = wake
        self.clock = clock
        # the queue lives where the state backend keeps shared state (SQLite or Redis)
        backend = state or LocalState()
        self.store: RelayStore = store or backend.relay_store(
            config.relay, stats, lambda: self.clock())
        # relay_call is charged like a terminate call: the caller's (IP, key) budget and
        # the IP ceiling, cluster-wide when the state backend is shared
        self.limiter = backend.limiter
        self._hconfig = _hypercorn_config()
        self._ctx: tuple[tuple[Any, ...], SSL.Context] | None = None
        self._conns: set[_Conn] = set()
        self._draining = False
        self.update(config)

    def update(self, config: Config) -> None:
        """Host, bounds and served recipients of a (re)loaded config. The store file is
        opened once: a changed `relay.store` path takes effect on restart."""
        assert config.relay is not None
        self.relay = config.relay
        self.host = config.relay.host
        self.budget = Budget.from_limits(config.limits)
        self.recipients = config.relay_recipients()
        self.store.set_bounds(config.relay.max_items, config.relay.max_bytes)
        if isinstance(self.store, SqliteStore):
            if self.store.path != config.relay.store:
                log.warning("relay_store_path_unchanged", running=str(self.store.path),
                            configured=str(config.relay.store),
                            detail="the relay store moves only on restart")

    # --- lifecycle -----------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        """Open the store, then purge expired items every PURGE_INTERVAL until cancelled."""
        await self.store.open()
        task_status.started()
        try:
            while True:
                await trio.sleep(PURGE_INTERVAL)
                await self.purge()
        finally:
            with trio.CancelScope(shield=True):
                await self.store.aclose()

    async def purge(self) -> int:
        try:
            expired = await self.store.purge()
        except StoreUnavailable:
            return 0
        if expired:
            self.stats.relay_expiries.inc(expired)
            log.info("relay_expired", items=expired)
        return expired

    def status(self) -> dict[str, Any]:
        depths = self.store.depths()
        queues = [{"recipient": r, "tenant": self.recipients.get(r), "items": n, "bytes": b}
                  for r, (n, b) in sorted(depths.items()) if n]
        store = str(self.relay.store) if isinstance(self.store, SqliteStore) else str(self.store)
        out: dict[str, Any] = {"host": self.host, "store": store,
                               "healthy": self.store.healthy, "queues": queues}
        error = self.store.last_error
        if error:
            out["last_error"] = error
        warning = getattr(self.store, "persistence_warning", None)
        if warning:
            out["persistence_warning"] = warning
        return out

    # --- connections ---------------------------------------------------------------------

    def _context(self) -> SSL.Context | None:
        files = self.certs.cert_files(self.host) if self.certs is not None else None
        if files is None:
            return None
        try:
            key = (*files, *(os.stat(f).st_mtime_ns for f in files))
            if self._ctx is None or self._ctx[0] != key:
                self._ctx = (key, files_server_context(*files))
        except (OSError, SSL.Error) as exc:
            log.error("relay_cert_unusable", host=self.host, error=str(exc))
            return None
        return self._ctx[1]

    async def serve(self, stream: ReplayStream, client: tuple[str, int]) -> None:
        """Serve one connection the router gave us; closes it."""
        ctx = self._context()
        if ctx is None:
            self.stats.rejections.labels("no_certificate_yet").inc()
            log.warning("relay_no_cert", host=self.host)
            try:
                await stream.send_all(tls_alert.alert_record(tls_alert.INTERNAL_ERROR))
            except (trio.BrokenResourceError, OSError):
                pass
            await trio.aclose_forcefully(stream)
            return
        tls = OpenSSLStream(stream, ctx, server_side=True, https_compatible=True)
        conn = _Conn()
        server = TCPServer(ASGIWrapper(self._app(tls, client, conn)), self._hconfig,
                           WorkerContext(None), ConnectionState({}), tls)  # type: ignore[arg-type]
        self._conns.add(conn)
        try:
            with conn.scope:
                await server.run()
        finally:
            self._conns.discard(conn)
            await trio.aclose_forcefully(tls)

    def drain(self) -> None:
        """Shutdown: close idle keep-alive connections now, busy ones after their
        requests (the router's drain deadline bounds those)."""
        self._draining = True
        for conn in list(self._conns):
            if not conn.busy:
                conn.scope.cancel()

    def _app(self, tls: OpenSSLStream, client: tuple[str, int], conn: _Conn
             ) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
        peer: list[tuple[str, PublicKey] | None] = []

        def caller() -> tuple[str, PublicKey] | None:
            if not peer:  # once per connection: the key cannot change after the handshake
                der = tls.getpeercert(binary_form=True)
                peer.append(None if der is None else (
                    fingerprint_of_cert_der(der),
                    x509.load_der_x509_certificate(der).public_key()))  # type: ignore[arg-type]
            return peer[0]

        async def app(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != "http":
                return
            conn.busy += 1
            try:
                await _Exchange(self, caller(), client, scope, receive, send).run()
            finally:
                conn.busy -= 1
                if self._draining and not conn.busy:
                    conn.scope.cancel()

        return app

    # --- the tools -----------------------------------------------------------------------

    def _allowlists(self) -> dict[str, frozenset[str]]:
        lists = self.store.allowlists()
        empty: frozenset[str] = frozenset()
        return {pin: lists.get(pin, empty) for pin in self.recipients}

    async def _ensure_store(self) -> None:
        """A broken store says unavailable (before any permission answer, which would
        otherwise be computed from allow-lists we could not read)."""
        if not self.store.healthy:
            await self.store.probe()
            if not self.store.healthy:
                raise StoreUnavailable("relay store unavailable")
        await self.store.refresh()  # a shared store: what other instances changed

    async def relay_call(self, fp: str, key: PublicKey, arguments: object,
                         seen: dict[str, Any] | None = None) -> dict[str, Any]:
        accepted = rules.check_relay_call(arguments, caller=fp, caller_key=key,
                                          now=self.clock(), allowlists=self._allowlists(),
                                          seen=seen)
        header = accepted.header
        try:
            done = await self.store.enqueue(header.to, header.sender, header.msg_id,
                                            accepted.envelope, accepted.expires_at)
        except QueueFull as exc:
            raise Refusal(rules.RATE_LIMITED, "the recipient's queue is full",
                          exc.retry_after) from None
        self.stats.relay_enqueues.labels("duplicate" if done.duplicate else "queued").inc()
        if not done.duplicate and self.wake is not None:
            tenant = self.recipients.get(header.to)
            if tenant is not None and self.wake(tenant):
                self.stats.relay_wakes.inc()
        return rules.queued(header.msg_id)

    def has_mail(self, tenant: str) -> bool:
        """Does any of `tenant`'s served recipients have items waiting? (Asked when one
        of its tunnel links comes up, so mail queued while it was away wakes it.)"""
        depths = self.store.depths()
        return any(depths.get(fp, (0, 0))[0] > 0
                   for fp, owner in self.recipients.items() if owner == tenant)

    async def fetch_queued(self, fp: str, arguments: object) -> dict[str, Any]:
        limit = rules.fetch_limit(arguments)
        if fp not in self.recipients:
            raise rules.denied()
        items, more = await self.store.fetch(fp, limit)
        self.stats.relay_fetched.inc(len(items))
        return {"items": [{"id": i.id, "queued_at": i.queued_at,
                           "envelope": json.loads(i.envelope)} for i in items],
                "more": more}

    async def ack(self, fp: str, arguments: object) -> dict[str, Any]:
        ids = rules.ack_ids(arguments)
        if fp not in self.recipients:
            raise rules.denied()
        n = await self.store.ack(fp, ids)
        self.stats.relay_acks.inc(n)
        return {"acked": n}


class _Conn:
    """One relay connection: requests in flight, and how to end it."""

    def __init__(self) -> None:
        self.busy = 0
        self.scope = trio.CancelScope()


class _Exchange:
    """One HTTP request to the relay host."""

    def __init__(self, server: RelayServer, caller: tuple[str, PublicKey] | None,
                 client: tuple[str, int], scope: Scope, receive: Receive, send: Send) -> None:
        self.server, self.caller, self.client = server, caller, client
        self.scope, self.receive, self.send = scope, receive, send

    async def run(self) -> None:
        method, path = self.scope["method"], self.scope["path"]
        if path == MCP_PATH:
            if method != "POST":
                await self._json(405, {"code": "bad_request", "message": "POST only"},
                                 [(b"allow", b"POST")])
            else:
                await self._mcp()
        elif path == ALLOWLIST_PATH:
            if method not in ("GET", "POST"):
                await self._json(405, {"code": "bad_request", "message": "GET or POST"},
                                 [(b"allow", b"GET, POST")])
            else:
                await self._allowlist(method)
        else:
            await self._json(404, {"code": "bad_request", "message": "not found"})

    # --- plumbing ------------------------------------------------------------------------

    async def _body(self, cap: int) -> bytes | None:
        """The whole body, or None when it is over `cap` (declared or sent)."""
        for name, value in self.scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > cap:
                return None
        parts: list[bytes] = []
        size = 0
        with trio.move_on_after(BODY_TIMEOUT) as scope:
            while True:
                message = await self.receive()
                if message["type"] == "http.disconnect":
                    break
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > cap:
                    return None
                parts.append(chunk)
                if not message.get("more_body", False):
                    break
        if scope.cancelled_caught:
            raise trio.TooSlowError("request body too slow")
        return b"".join(parts)

    async def _json(self, status: int, obj: Any,
                    headers: list[tuple[bytes, bytes]] | None = None) -> None:
        body = json.dumps(obj).encode()
        await self.send({"type": "http.response.start", "status": status, "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"cache-control", b"no-store"), *(headers or [])]})
        await self.send({"type": "http.response.body", "body": body, "more_body": False})

    def _refused(self, code: str) -> None:
        self.server.stats.relay_refusals.labels(code).inc()

    # --- /relay/allowlist ----------------------------------------------------------------

    async def _allowlist(self, method: str) -> None:
        if self.caller is None:
            self._refused(rules.IDENTITY_REQUIRED)
            await self._json(401, {"code": rules.IDENTITY_REQUIRED,
                                   "message": "present your PACT key as a client certificate"})
            return
        fp = self.caller[0]
        body = b""
        if method == "POST":
            try:
                got = await self._body(MAX_ALLOWLIST_BODY)
            except trio.TooSlowError:
                return
            if got is None:
                self._refused(rules.TOO_LARGE)
                await self._json(413, {"code": rules.TOO_LARGE, "message": "body too large"})
                return
            body = got
        try:
            if fp not in self.server.recipients:
                raise rules.denied()
            if method == "GET":
                senders = sorted(self.server.store.allowlists().get(fp, ()))
                await self._json(200, {"senders": senders})
                return
            parsed = rules.parse_allowlist(body)
            await self.server._ensure_store()
            await self.server.store.set_allowlist(fp, parsed)
        except Refusal as exc:
            self._refused(exc.code)
            status = {rules.PERMISSION_DENIED: 403, rules.TOO_LARGE: 413}.get(exc.code, 400)
            await self._json(status, {"code": exc.code, "message": exc.reason})
            return
        except StoreUnavailable:
            self._refused(rules.UNAVAILABLE)
            await self._json(503, {"code": rules.UNAVAILABLE,
                                   "message": "relay store unavailable"})
            return
        log.info("relay_allowlist", recipient=fp, senders=len(parsed), client_ip=self.client[0])
        await self._json(200, {"senders": len(parsed)})

    # --- /relay/mcp ----------------------------------------------------------------------

    async def _mcp(self) -> None:
        try:
            body = await self._body(rules.MAX_REQUEST_BYTES)
        except trio.TooSlowError:
            return
        if body is None:
            self._refused(rules.TOO_LARGE)
            await self._json(413, _rpc(None, result=rules.tool_error(
                Refusal(rules.TOO_LARGE, f"request over {rules.MAX_REQUEST_BYTES} bytes"))))
            return
        try:
            message = json.loads(body)
        except (ValueError, RecursionError):
            await self._json(400, _rpc(None, error=(-32700, "Parse error")))
            return
        if not isinstance(message, dict) or not isinstance(message.get("method"), str) or (
                message.get("jsonrpc") != "2.0"):
            what = "batches are not supported" if isinstance(message, list) else \
                "not a JSON-RPC 2.0 request"
            await self._json(400, _rpc(None, error=(-32600, f"Invalid Request: {what}")))
            return
        if "id" not in message:  # a notification: nothing to answer
            await self.send({"type": "http.response.start", "status": 202, "headers": [
                (b"content-length", b"0")]})
            await self.send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        rpc_id = message["id"]
        params = message.get("params")
        params = params if isinstance(params, dict) else {}
        if self.caller is None:
            self._refused(rules.IDENTITY_REQUIRED)
            refusal = Refusal(rules.IDENTITY_REQUIRED,
                              "the relay needs your PACT key as a TLS client certificate")
            if message["method"] == "tools/call":
                await self._json(401, _rpc(rpc_id, result=rules.tool_error(refusal)))
            else:
                await self._json(401, _rpc(rpc_id, error=(
                    -32001, str(refusal), {"code": rules.IDENTITY_REQUIRED})))
            return
        await self._json(200, await self._dispatch(rpc_id, message["method"], params))

    async def _dispatch(self, rpc_id: Any, method: str, params: dict[str, Any]
                        ) -> dict[str, Any]:
        if method == "initialize":
            version = params.get("protocolVersion")
            return _rpc(rpc_id, result={
                "protocolVersion": version if isinstance(version, str) else MCP_VERSION,
                "capabilities": {"tools": {"listChanged": False}},
                "serverInfo": {"name": "pact-ingress-relay", "version": __version__}})
        if method == "ping":
            return _rpc(rpc_id, result={})
        if method == "tools/list":
            return _rpc(rpc_id, result={"tools": rules.TOOLS})
        if method != "tools/call":
            return _rpc(rpc_id, error=(-32601, f"Method not found: {method[:64]}"))
        name = params.get("name")
        arguments = params.get("arguments", {})
        if name not in ("relay_call", "fetch_queued", "ack"):
            return _rpc(rpc_id, error=(-32602, f"Unknown tool: {str(name)[:64]}"))
        return _rpc(rpc_id, result=await self._tool(name, arguments))

    async def _tool(self, name: str, arguments: object) -> dict[str, Any]:
        assert self.caller is not None
        fp, key = self.caller
        started = trio.current_time()
        fields: dict[str, Any] = {}
        if name == "relay_call" and isinstance(arguments, dict):
            fields["bytes"] = sum(len(v) for v in arguments.values() if isinstance(v, str))
        try:
            await self.server._ensure_store()
            if name == "relay_call":
                await self._charge(fp)
                data = await self.server.relay_call(fp, key, arguments, fields)
            elif name == "fetch_queued":
                data = await self.server.fetch_queued(fp, arguments)
                fields = {"items": len(data["items"]), "more": data["more"]}
            else:
                data = await self.server.ack(fp, arguments)
                fields = {"acked": data["acked"]}
            outcome, result = "ok", rules.tool_result(data)
        except Refusal as exc:
            outcome, result = exc.code, rules.tool_error(exc)
            if exc.code != rules.PERMISSION_DENIED:
                fields["reason"] = exc.reason
        except StoreUnavailable as exc:
            outcome = rules.UNAVAILABLE
            result = rules.tool_error(Refusal(rules.UNAVAILABLE, "relay store unavailable"))
            fields["reason"] = str(exc)
        if outcome != "ok":
            self._refused(outcome)
        log.info("relay_" + name, caller=fp, client_ip=self.client[0], outcome=outcome,
                 duration_ms=round((trio.current_time() - started) * 1000, 2), **fields)
        return result


    async def _charge(self, fp: str) -> None:
        """One call of the caller's budget, or `rate_limited` with when to come back."""
        server = self.server
        decision = await server.limiter.check_calls(
            self.client[0], (fp,), trio.current_time(), budget=server.budget,
            scope=server.host)
        if isinstance(decision, Limited):
            raise Refusal(rules.RATE_LIMITED, "over the call budget", decision.retry_after)


def _rpc(rpc_id: Any, *, result: Any = None, error: tuple[Any, ...] | None = None
         ) -> dict[str, Any]:
    if error is not None:
        err: dict[str, Any] = {"code": error[0], "message": error[1]}
        if len(error) > 2:
            err["data"] = error[2]
        return {"jsonrpc": "2.0", "id": rpc_id, "error": err}
    return {"jsonrpc": "2.0", "id": rpc_id, "result": result}
