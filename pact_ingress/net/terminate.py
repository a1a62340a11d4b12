"""Terminate mode: the public TLS ends here; HTTP/1.1 or HTTP/2 is re-originated to the node.

Theory of operation
-------------------
The router has peeked the ClientHello and picked a certificate context for the SNI; it
hands us the connection as a `ReplayStream` (the ClientHello is replayed to the TLS
engine). `Terminator.serve` wraps it in `trio.SSLStream` and lets hypercorn's trio
`TCPServer` run HTTP on it (DESIGN §5: an internal hypercorn API, hence hypercorn is
pinned to 0.18.0 in pyproject). Each connection gets its own small ASGI app
(`_ConnectionApp`) that knows the route, the SNI and the client address, so no request
ever has to be re-routed: a request belongs to the connection's route or is refused.

Per request, in this order (DESIGN §4):

1. Host / `:authority` must name the SNI of the connection, else **421** — this is what
   stops domain fronting and answers HTTP/2 connection reuse across hosts correctly (the
   client retries on a new connection). Port suffixes are ignored (the listener's port is
   not ours to judge). When the router does not pass the SNI (an exact route), the
   route's host is the SNI; for a wildcard route without SNI the host must match the
   wildcard.
2. `Content-Length` over the route's `max_body_bytes` → **413** (and a streamed body is
   counted; crossing the cap mid-stream is a 413 too).
3. POST to the route's `mcp_path`: the body is read (bounded by the cap) and checked by
   `proto.posture.check_request` (seal posture; refusals are JSON-RPC tool errors answered
   here — the refused call never reaches the node; malformed JSON-RPC → 400).
4. Rate limits (`proto.ratelimit`): every request is charged — an MCP call per
   (client IP, caller key `from` of its sealed header) under the per-IP ceiling; any
   other request (SSE GET, DELETE of a session, plain HTTP) is metered **per IP only**
   (it carries no key) and answered 429 + Retry-After when over budget. The limiter's
   clock is `trio.current_time()` (MockClock in tests); the posture's clock is the wall
   clock (envelope `ts`/`exp` are unix seconds).
5. Header hygiene: client-sent `Forwarded`, `X-Forwarded-*`, `X-Real-IP`, `X-Pact-*`
   are dropped and one `Forwarded: for=…;proto=https;host=…` is added; hop-by-hop
   headers (RFC 9110 §7.6.1: `Connection` and every header it names, `Keep-Alive`,
   `Proxy-*`, `TE` except `trailers`, `Transfer-Encoding`, `Upgrade`) are removed in
   both directions.
6. `net.upstream.Upstream` sends it over pinned mTLS to the node; its typed failures map
   to 503 + Retry-After (node offline), 502 (pin mismatch, TLS failure, broken HTTP) and
   504 (no response headers in time).
7. The response streams chunk by chunk as the node writes it (SSE works over both HTTP
   versions); a task watching for the client's disconnect cancels the upstream request
   as soon as the client goes away, and the upstream idle timeout ends a silent node.

Aborting a response that already started (the node broke mid-body) must not look like a
complete response: on HTTP/1.1 the connection is dropped; on HTTP/2 the stream is reset
(`INTERNAL_ERROR`). Answering before the request body was read (413, 421, refusals) on
HTTP/2 ends with `RST_STREAM(NO_ERROR)` (RFC 9113 §8.1) so the client stops sending;
on HTTP/1.1 with `Connection: close`. Both reach into hypercorn's protocol object
(pinned version) — see `_reset_h2_stream`.
"""

from __future__ import annotations

import logging
import ssl
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import h2.errors
import h2.events
import h2.exceptions
import hypercorn.protocol
import trio
from hypercorn.app_wrappers import ASGIWrapper
from hypercorn.config import Config as HypercornConfig
from hypercorn.logging import Logger as HypercornLogger
from hypercorn.protocol.h2 import H2Protocol
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import ConnectionState

from pact_ingress.config import Config, Limits, Route, Tenant
from pact_ingress.identity import Identity
from pact_ingress.logs import log
from pact_ingress.net.backends import Backends
from pact_ingress.net.upstream import (
    DEFAULT_HEADER_TIMEOUT,
    NodeUnreachable,
    Upstream,
    UpstreamError,
    UpstreamTimeout,
    UpstreamTLSError,
)
from pact_ingress.proto import posture
from pact_ingress.proto.ratelimit import Budget, Limited, RateLimiter
from pact_ingress.stats import Stats

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
Headers = list[tuple[bytes, bytes]]

#: Retry-After for 503 (node offline): a tunnel reconnects within seconds; asking
#: clients to come back much later would turn a blip into an outage.
RETRY_AFTER_OFFLINE = 5
#: After answering before the body was read (413/421/refusal over HTTP/1.1), at most this
#: long is spent discarding what the client still sends before the connection closes.
REFUSAL_DRAIN_SECONDS = 5.0
#: HTTP status recorded when the client went away before we could answer (nginx's 499).
CLIENT_CLOSED = 499

#: RFC 9110 §7.6.1 connection-specific fields (plus the obsolete Proxy-Connection).
HOP_BY_HOP = frozenset(
    {b"connection", b"keep-alive", b"proxy-connection", b"te", b"transfer-encoding", b"upgrade"}
)
#: Request fields only the edge may set: a client could otherwise claim another origin
#: address or smuggle PACT metadata the node would trust.
SPOOFABLE = frozenset({b"forwarded", b"x-real-ip"})
SPOOFABLE_PREFIXES = (b"x-forwarded-", b"x-pact-", b"proxy-")


# --- pure header logic ---------------------------------------------------------------------


def _connection_tokens(headers: Iterable[tuple[bytes, bytes]]) -> set[bytes]:
    named: set[bytes] = set()
    for name, value in headers:
        if name.lower() == b"connection":
            named.update(t.strip().lower() for t in value.split(b",") if t.strip())
    return named


def _is_hop_by_hop(name: bytes, named: set[bytes]) -> bool:
    return name in HOP_BY_HOP or name in named or name.startswith(b"proxy-")


def clean_response_headers(headers: Iterable[tuple[bytes, bytes]]) -> Headers:
    """The node's response headers minus hop-by-hop ones (and any pseudo-headers)."""
    headers = list(headers)
    named = _connection_tokens(headers)
    out: Headers = []
    for name, value in headers:
        lname = name.lower()
        if lname.startswith(b":") or _is_hop_by_hop(lname, named):
            continue
        out.append((lname, value))
    return out


def forwarded_value(client_ip: str, host: str) -> bytes:
    """RFC 7239 `Forwarded` element for this hop (IPv6 quoted and bracketed)."""
    node = f'"[{client_ip}]"' if ":" in client_ip else client_ip
    return f"for={node};proto=https;host={host}".encode("ascii")


def clean_request_headers(
    headers: Iterable[tuple[bytes, bytes]], *, client_ip: str, host: str
) -> Headers:
    """Request headers for the node: no hop-by-hop, no spoofable, one `Forwarded`.

    `Host` is set to `host`; `TE: trailers` survives when the client asked for it. Body
    framing (`Content-Length`/`Transfer-Encoding`) is the caller's to set afterwards.
    """
    headers = list(headers)
    named = _connection_tokens(headers)
    out: Headers = [(b"host", host.encode("idna"))]
    wants_trailers = False
    for name, value in headers:
        lname = name.lower()
        if lname == b"te":
            wants_trailers |= b"trailers" in [t.strip().lower() for t in value.split(b",")]
            continue
        if lname in (b"host", b"content-length") or lname.startswith(b":"):
            continue
        if _is_hop_by_hop(lname, named) or lname in SPOOFABLE:
            continue
        if lname.startswith(SPOOFABLE_PREFIXES):
            continue
        out.append((lname, value))
    if wants_trailers:
        out.append((b"te", b"trailers"))
    out.append((b"forwarded", forwarded_value(client_ip, host)))
    return out


def header(headers: Iterable[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    for key, value in headers:
        if key.lower() == name:
            return value
    return None


def authority_host(value: bytes | None) -> str | None:
    """The host part of a Host / :authority value, lower-case, without port; None if bad."""
    if not value:
        return None
    try:
        text = value.decode("ascii").strip().lower()
    except UnicodeDecodeError:
        return None
    if text.startswith("["):
        end = text.find("]")
        return None if end < 0 else text[: end + 1]
    host, _, port = text.partition(":")
    if port and not port.isdigit():
        return None
    return host.rstrip(".") or None


def host_matches(host: str | None, sni: str | None, route: Route) -> bool:
    """Does the requested host belong on this connection? (see module docstring, step 1)"""
    if host is None:
        return False
    if sni is not None:
        return host == sni.lower().rstrip(".")
    if route.host.startswith("*."):
        suffix = route.host[1:]
        label = host[: -len(suffix)] if host.endswith(suffix) else ""
        return bool(label) and "." not in label
    return host == route.host


def content_length(headers: Iterable[tuple[bytes, bytes]]) -> int | None:
    """Declared body length; -1 when present but not a non-negative integer."""
    value = header(headers, b"content-length")
    if value is None:
        return None
    text = value.strip()
    return int(text) if text.isdigit() else -1


# --- request bodies ------------------------------------------------------------------------


class BodyTooLarge(Exception):
    """The request body crossed max_body_bytes."""


class ClientGone(Exception):
    """The client disconnected (or stalled past the idle timeout) mid-request."""


class _Body:
    """The ASGI request body as an async iterator of chunks, capped and idle-bounded."""

    def __init__(self, receive: Receive, cap: int, idle_timeout: float) -> None:
        self._receive = receive
        self._cap = cap
        self._idle = idle_timeout
        self.received = 0
        self.done = False

    async def next_chunk(self) -> bytes:
        """The next non-empty chunk, or b"" once the body is complete."""
        while not self.done:
            with trio.move_on_after(self._idle) as idle:
                message = await self._receive()
            if idle.cancelled_caught or message["type"] == "http.disconnect":
                raise ClientGone()
            chunk = message.get("body", b"")
            self.done = not message.get("more_body", False)
            self.received += len(chunk)
            if self.received > self._cap:
                raise BodyTooLarge()
            if chunk:
                return chunk
        return b""

    async def read_all(self) -> bytes:
        parts = []
        while chunk := await self.next_chunk():
            parts.append(chunk)
        return b"".join(parts)

    def __aiter__(self) -> _Body:
        return self

    async def __anext__(self) -> bytes:
        chunk = await self.next_chunk()
        if not chunk:
            raise StopAsyncIteration
        return chunk


class _Prepend:
    """An async iterator yielding `first` and then the rest of `body`."""

    def __init__(self, first: bytes, body: _Body) -> None:
        self._first: bytes | None = first
        self._body = body

    def __aiter__(self) -> _Prepend:
        return self

    async def __anext__(self) -> bytes:
        if self._first is not None:
            first, self._first = self._first, None
            return first
        return await self._body.__anext__()


# --- hypercorn plumbing --------------------------------------------------------------------


class _QuietHypercornLogger(HypercornLogger):
    """Hypercorn's own log calls, folded into our structured log at debug level.

    Its access log is off (we count requests ourselves) and "Error in ASGI Framework"
    tracebacks are expected when we deliberately abort an HTTP/1.1 response.
    """

    def __init__(self, config: HypercornConfig) -> None:
        super().__init__(config)
        self.access_logger = None
        self.error_logger = None

    async def access(self, request: Any, response: Any, request_time: float) -> None:
        return None

    async def log(self, level: int, message: str, *args: Any, **kwargs: Any) -> None:
        if level >= logging.ERROR:
            log.debug("hypercorn", message=message % args if args else message)


def hypercorn_config(limits: Limits) -> HypercornConfig:
    config = HypercornConfig()
    config.include_server_header = False  # the node's own headers pass through
    config.include_date_header = False
    config.keep_alive_timeout = limits.idle_timeout  # idle connection (no request open)
    config.ssl_handshake_timeout = limits.clienthello_timeout
    config.alpn_protocols = ["h2", "http/1.1"]
    config._log = _QuietHypercornLogger(config)
    return config


class _Abort(Exception):
    """Raised out of the ASGI app to make hypercorn drop an HTTP/1.1 connection."""


def _h2_protocol(server: TCPServer | None) -> H2Protocol | None:
    """hypercorn internals (pinned 0.18.0): TCPServer.protocol (ProtocolWrapper) →
    .protocol, an H2Protocol on HTTP/2 connections; None otherwise."""
    proto = getattr(getattr(server, "protocol", None), "protocol", None)
    return proto if isinstance(proto, H2Protocol) else None


def _h2_stream_id(server: TCPServer | None, scope: Scope) -> int | None:
    """The HTTP/2 stream serving `scope` (H2Protocol.streams maps id → HTTPStream)."""
    proto = _h2_protocol(server)
    if proto is None:
        return None
    for stream_id, stream in list(proto.streams.items()):
        if getattr(stream, "scope", None) is scope:
            return stream_id
    return None


async def _reset_h2_stream(server: TCPServer | None, stream_id: int, error_code: int) -> None:
    """RST_STREAM one HTTP/2 stream (no-op when it already ended)."""
    proto = _h2_protocol(server)
    if proto is None:
        return
    try:
        proto.connection.reset_stream(stream_id, error_code=error_code)
    except h2.exceptions.ProtocolError:  # the stream already ended: nothing to reset
        return
    await proto._flush()


class _GuardedH2Protocol(H2Protocol):
    """hypercorn's H2Protocol, minus a crash: DATA for a stream whose response is done.

    hypercorn 0.18.0 forgets a stream once its response ends and then raises KeyError
    (killing the whole connection, every stream on it) when the client's DATA for that
    stream still arrives — which is exactly what happens when we answer 413/421/refusals
    before reading the body. Such DATA is acknowledged (so the connection's flow-control
    window is not leaked) and dropped.
    """

    async def _handle_events(self, events: list[h2.events.Event]) -> None:
        kept = []
        for event in events:
            if isinstance(event, h2.events.DataReceived) and event.stream_id not in self.streams:
                self.connection.acknowledge_received_data(
                    event.flow_controlled_length, event.stream_id)
                continue
            kept.append(event)
        await super()._handle_events(kept)


def install_h2_guard() -> None:
    """Make hypercorn build `_GuardedH2Protocol` for HTTP/2 connections (idempotent).

    ProtocolWrapper looks the class up in `hypercorn.protocol` at connection time; this
    process-wide swap is the only hook it offers. Safe for any other hypercorn user in
    the process (the demo node): it only removes a crash.
    """
    hypercorn.protocol.H2Protocol = _GuardedH2Protocol  # type: ignore[misc]


# --- the per-connection ASGI app -----------------------------------------------------------


@dataclass
class _Answer:
    status: int
    body: bytes
    headers: tuple[tuple[str, str], ...] = (("content-type", "text/plain; charset=utf-8"),)


class _ConnectionApp:
    """ASGI app for one client connection on one terminate route."""

    def __init__(self, terminator: Terminator, route: Route, sni: str | None,
                 client: tuple[str, int]) -> None:
        self.t = terminator
        self.route = route
        self.sni = sni
        self.client_ip = client[0]
        self.server: TCPServer | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":  # not offered: refuse the upgrade (hypercorn → 403)
            await send({"type": "websocket.close", "code": 1008})
            return
        if scope["type"] != "http":
            return
        status = await self._http(scope, receive, send)
        self.t.stats.requests.labels(route=self.route.host, status=str(status)).inc()

    # -- the request pipeline ---------------------------------------------------------

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> int:
        route, limits = self.route, self.route.limits
        headers: Headers = scope["headers"]
        host = authority_host(header(headers, b"host"))
        if not host_matches(host, self.sni, route):
            return await self._early(scope, receive, send, _Answer(
                421, b"misdirected request: this connection serves another host\n"))
        declared = content_length(headers)
        if declared == -1:
            return await self._early(scope, receive, send, _Answer(400, b"bad content-length\n"))
        if declared is not None and declared > limits.max_body_bytes:
            return await self._early(scope, receive, send, self._too_large())
        tenant = self.t.tenant(route.tenant)
        if tenant is None:  # removed by a reload while this connection was open
            return await self._early(scope, receive, send, _Answer(
                503, b"route no longer configured\n", (("retry-after", "60"),)))
        assert host is not None
        body = _Body(receive, limits.max_body_bytes, limits.idle_timeout)
        target = scope["raw_path"] + (b"?" + scope["query_string"] if scope["query_string"] else b"")
        method: str = scope["method"]
        try:
            decision, payload = await self._posture(scope, method, target, headers, body, tenant)
            if isinstance(decision, posture.Refuse):
                return await self._refuse(scope, receive, send, decision, body)
            limited = self.t.limiter.check_calls(
                self.client_ip, decision.caller_keys, trio.current_time(),
                budget=Budget.from_limits(limits), scope=route.host)
            if isinstance(limited, Limited):
                refusal = posture.refuse_rate_limited(decision, limited.retry_after)
                return await self._refuse(scope, receive, send, refusal, body)
            if payload is None:
                payload = await self._stream_or_bytes(body)
        except BodyTooLarge:
            return await self._early(scope, receive, send, self._too_large())
        except ClientGone:
            return CLIENT_CLOSED
        out = clean_request_headers(headers, client_ip=self.client_ip, host=host)
        if isinstance(payload, bytes):
            if payload or declared is not None or method not in ("GET", "HEAD", "DELETE", "OPTIONS"):
                out.append((b"content-length", str(len(payload)).encode()))
        elif declared is not None:
            out.append((b"content-length", str(declared).encode()))
        else:
            out.append((b"transfer-encoding", b"chunked"))
        return await self._forward(scope, receive, send, tenant, method, host, target, out,
                                   payload, body)

    async def _posture(
        self, scope: Scope, method: str, target: bytes, headers: Headers, body: _Body,
        tenant: Tenant,
    ) -> tuple[posture.Decision, bytes | None]:
        path = target.decode("latin-1")
        if method != "POST" or posture._norm_path(path) != posture._norm_path(self.route.mcp_path):
            return posture.Forward(caller_keys=(None,)), None
        payload = await body.read_all()
        content_type = header(headers, b"content-type")
        request = posture.McpRequest(method, path, content_type.decode("latin-1")
                                     if content_type is not None else None, payload)
        policy = posture.Policy.for_route(self.route, tenant)
        return posture.check_request(request, policy, self.t.wall_clock()), payload

    @staticmethod
    async def _stream_or_bytes(body: _Body) -> bytes | _Prepend:
        """Bytes when the whole body is already here (the common case), else a stream."""
        first = await body.next_chunk()
        if body.done:
            return first
        return _Prepend(first, body)

    def _too_large(self) -> _Answer:
        return _Answer(413, f"request body over {self.route.limits.max_body_bytes} bytes\n".encode())

    # -- answering at the edge --------------------------------------------------------

    async def _early(self, scope: Scope, receive: Receive, send: Send, answer: _Answer,
                     body_done: bool = False) -> int:
        """Answer without the node; stop the client's upload if it is still sending."""
        is_h2 = scope["http_version"] == "2"
        headers = [(k.encode(), v.encode()) for k, v in answer.headers]
        headers.append((b"content-length", str(len(answer.body)).encode()))
        if not body_done and not is_h2:
            headers.append((b"connection", b"close"))
        stream_id = _h2_stream_id(self.server, scope) if is_h2 else None
        await send({"type": "http.response.start", "status": answer.status, "headers": headers})
        await send({"type": "http.response.body", "body": answer.body, "more_body": False})
        if not body_done:
            if stream_id is not None:  # RFC 9113 §8.1: complete answer, then stop the upload
                await _reset_h2_stream(self.server, stream_id, h2.errors.ErrorCodes.NO_ERROR)
            else:
                await self._drain(receive)
        return answer.status

    @staticmethod
    async def _drain(receive: Receive) -> None:
        with trio.move_on_after(REFUSAL_DRAIN_SECONDS):
            while True:
                message = await receive()
                if message["type"] == "http.disconnect" or not message.get("more_body", False):
                    return

    async def _refuse(self, scope: Scope, receive: Receive, send: Send,
                      refusal: posture.Refuse, body: _Body) -> int:
        route = self.route.host
        self.t.stats.refusals.labels(route=route, code=refusal.code).inc()
        self.t.stats.refused(route, self.client_ip, refusal.code)
        log.info("refused", route=route, client=self.client_ip, code=refusal.code,
                 detail=refusal.detail)
        answer = _Answer(refusal.http_status, refusal.body, refusal.headers)
        return await self._early(scope, receive, send, answer, body_done=body.done)

    # -- forwarding -------------------------------------------------------------------

    async def _forward(
        self, scope: Scope, receive: Receive, send: Send, tenant: Tenant, method: str,
        host: str, target: bytes, headers: Headers, payload: bytes | _Prepend, body: _Body,
    ) -> int:
        route = self.route
        started = trio.current_time()
        try:
            async with self.t.upstream.request(
                route, tenant.pins, method=method, host=host, target=target, headers=headers,
                body=payload, idle_timeout=route.limits.idle_timeout,
            ) as response:
                self.t.stats.upstream_seconds.labels(route=route.host).observe(
                    trio.current_time() - started)
                await self._relay(scope, receive, send, response)
                return response.status
        except BodyTooLarge:
            return await self._early(scope, receive, send, self._too_large())
        except ClientGone:
            return CLIENT_CLOSED
        except UpstreamError as exc:
            return await self._upstream_failed(scope, receive, send, exc, body)

    async def _relay(self, scope: Scope, receive: Receive, send: Send, response: Any) -> None:
        await send({"type": "http.response.start", "status": response.status,
                    "headers": clean_response_headers(response.headers)})
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._watch_disconnect, receive, nursery.cancel_scope)
            try:
                async for chunk in response.body:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except UpstreamError as exc:
                log.warning("upstream_body_failed", route=self.route.host, error=str(exc))
                stream_id = _h2_stream_id(self.server, scope)
                if stream_id is None:  # HTTP/1.1: only a dropped connection says "truncated"
                    raise _Abort("node broke mid-body") from exc
                await _reset_h2_stream(self.server, stream_id, h2.errors.ErrorCodes.INTERNAL_ERROR)
                nursery.cancel_scope.cancel()
                return
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            nursery.cancel_scope.cancel()

    @staticmethod
    async def _watch_disconnect(receive: Receive, scope: trio.CancelScope) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        scope.cancel()

    async def _upstream_failed(self, scope: Scope, receive: Receive, send: Send,
                               exc: UpstreamError, body: _Body) -> int:
        route = self.route.host
        if isinstance(exc, NodeUnreachable):
            log.warning("node_unreachable", route=route, error=str(exc))
            answer = _Answer(503, b"the home node is offline\n",
                             (("content-type", "text/plain; charset=utf-8"),
                              ("retry-after", str(RETRY_AFTER_OFFLINE))))
        elif isinstance(exc, UpstreamTLSError):
            log.error("upstream_tls_failed", route=route, expected=list(exc.expected),
                      seen=exc.seen, error=str(exc))
            answer = _Answer(502, b"the home node failed authentication\n")
        elif isinstance(exc, UpstreamTimeout):
            log.warning("upstream_timeout", route=route, error=str(exc))
            answer = _Answer(504, b"the home node did not answer in time\n")
        else:
            log.warning("upstream_failed", route=route, error=str(exc))
            answer = _Answer(502, b"the home node connection failed\n")
        return await self._early(scope, receive, send, answer, body_done=body.done)


# --- the public face -----------------------------------------------------------------------


class Terminator:
    """Serves terminate-route connections: TLS + HTTP at the edge, pinned mTLS onward."""

    def __init__(
        self,
        *,
        identity: Identity,
        backends: Backends,
        stats: Stats,
        wall_clock: Callable[[], float] = time.time,
        header_timeout: float = DEFAULT_HEADER_TIMEOUT,
    ) -> None:
        self.identity = identity
        self.stats = stats
        self.wall_clock = wall_clock
        self.upstream = Upstream(identity, backends, header_timeout=header_timeout)
        self.limiter = RateLimiter()  # per-route budgets are passed per call
        self._tenants: dict[str, Tenant] = {}
        self._hypercorn: dict[Limits, HypercornConfig] = {}
        # One hypercorn worker context for every connection: setting its `terminated`
        # event on drain makes idle keep-alive connections close at once, HTTP/2 refuse
        # new streams and HTTP/1.1 not recycle, while in-flight requests finish.
        self._context = WorkerContext(None)
        install_h2_guard()

    def update(self, config: Config) -> None:
        """Take a (re)loaded config: tenants and pins; rate-limit state is kept."""
        self._tenants = {t.name: t for t in config.tenants}
        self.upstream.retain(
            (r, self._tenants[r.tenant].pins) for r in config.routes() if r.mode == "terminate"
        )

    def tenant(self, name: str) -> Tenant | None:
        return self._tenants.get(name)

    def _config_for(self, limits: Limits) -> HypercornConfig:
        config = self._hypercorn.get(limits)
        if config is None:
            config = self._hypercorn[limits] = hypercorn_config(limits)
        return config

    async def serve(
        self,
        stream: trio.abc.Stream,
        server_ctx: ssl.SSLContext,
        route: Route,
        client: tuple[str, int],
        *,
        sni: str | None = None,
    ) -> None:
        """Own one client connection on `route` until it ends; always closes it.

        `sni` is the server name the client sent (pass it for wildcard routes; for an
        exact route it defaults to the route's host).
        """
        if sni is None and not route.host.startswith("*."):
            sni = route.host
        tls = trio.SSLStream(stream, server_ctx, server_side=True)
        app = _ConnectionApp(self, route, sni, client)
        server = TCPServer(ASGIWrapper(app), self._config_for(route.limits), self._context,
                           ConnectionState({}), tls)  # type: ignore[arg-type]
        app.server = server
        try:
            await server.run()
        except Exception as exc:  # noqa: BLE001 - hypercorn internals must not escape the router
            log.debug("terminate_connection_error", route=route.host, error=repr(exc))
        finally:
            await trio.aclose_forcefully(tls)

    async def drain(self) -> None:
        """Shutdown has begun: close idle connections now, let open requests finish."""
        await self._context.terminated.set()

    async def aclose(self) -> None:
        await self.upstream.aclose()

