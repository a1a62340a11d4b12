"""The :443 SNI router: accept, peek the ClientHello, dispatch by SNI and ALPN.

Theory of operation
-------------------
Every TLS connection arrives on one listener. The router reads just enough bytes to
parse the ClientHello (sans-I/O, `proto.clienthello`), without answering anything, then
hands the connection — with the peeked bytes replayed first — to exactly one owner:

- ALPN `acme-tls/1` for a host this edge terminates → the ACME TLS-ALPN-01 responder
  (a passthrough host's challenge goes through to the home node like any connection);
- SNI = `tunnel.hostname` → the tunnel server (connectors dial in here);
- a passthrough route → a backend stream, [PROXY v2 header], the peeked bytes, then a
  splice both ways until both sides are done;
- a terminate route → the route's certificate context and the `Terminator`.

Anything else gets a defined answer: unknown/missing SNI → alert unrecognized_name
(112); backend down or no certificate yet → alert internal_error (80); a ClientHello that
is malformed, too large or not complete within `clienthello_timeout` → close. Each is
counted by reason in `Stats.rejections`.

Limits are checked at accept, before any byte is read: a global connection cap and a
per-IP cap. Accept errors such as EMFILE are survived (logged, short back-off).

Reload swaps the route table and limits atomically (`update`); connections already
routed keep the `Route` object they were given. Shutdown (`drain`) closes the
listeners first, then gives open connections a deadline before cancelling them.
"""

from __future__ import annotations

import errno
import ssl
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import trio

from pact_ingress.config import Config, Route
from pact_ingress.errors import BackendError
from pact_ingress.logs import log
from pact_ingress.net.backends import Backends
from pact_ingress.net.replay import ReplayStream
from pact_ingress.net.splice import relay
from pact_ingress.proto import tls_alert
from pact_ingress.proto.clienthello import ClientHello, ClientHelloError, parse_client_hello
from pact_ingress.proto.proxy_protocol import encode_v2
from pact_ingress.proto.routing import RouteTable
from pact_ingress.stats import Stats

#: Bytes asked of the socket per read while peeking. A typical ClientHello is 250–600
#: bytes, a post-quantum one ~1.9 KB; 4 KiB reads need one or two calls in practice.
PEEK_READ = 4096
#: Errors from accept() that mean "out of resources for now", not "listener broken".
ACCEPT_CAPACITY_ERRNOS = {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS}
#: Back-off after such an error: long enough to let connections close, short enough
#: that service resumes quickly (trio's serve_listeners uses the same 100 ms).
ACCEPT_BACKOFF = 0.1
#: How long a handshake with the ACME TLS-ALPN-01 challenge cert may take.
CHALLENGE_TIMEOUT = 10.0
ACME_ALPN = "acme-tls/1"
TUNNEL_ALPNS = ("pact-tunnel/1", "pact-tunnel-data/1")


class TerminatorLike(Protocol):
    async def serve(self, stream: ReplayStream, server_ctx: ssl.SSLContext, route: Route,
                    client: tuple[str, int], *, sni: str | None = None) -> None: ...


class CertsLike(Protocol):
    def server_context(self, route: Route) -> ssl.SSLContext | None: ...
    def challenge_context(self, host: str) -> ssl.SSLContext | None: ...


class TunnelsLike(Protocol):
    async def handle(self, stream: ReplayStream, client: tuple[str, int]) -> None: ...


@dataclass
class _Counts:
    total: int = 0
    per_ip: Counter[str] = field(default_factory=Counter)


class Router:
    """Owns the TLS listeners and every connection accepted on them."""

    def __init__(
        self,
        config: Config,
        *,
        stats: Stats,
        backends: Backends,
        terminator: TerminatorLike | None = None,
        certs: CertsLike | None = None,
        tunnels: TunnelsLike | None = None,
    ) -> None:
        self.stats = stats
        self.backends = backends
        self.terminator = terminator
        self.certs = certs
        self.tunnels = tunnels
        self._counts = _Counts()
        self._bytes_by_route: dict[str, tuple[Any, Any]] = {}
        self._accepting = trio.CancelScope()
        self._handlers: trio.Nursery | None = None
        self.update(config)

    def update(self, config: Config) -> None:
        """Swap in a new config for new connections; open ones keep their route."""
        self.config = config
        self.table = RouteTable.build(config.routes())
        self.limits = config.limits
        self.tunnel_hostname = config.tunnel_hostname

    # --- accepting -------------------------------------------------------------------

    async def serve(
        self,
        listeners: Sequence[trio.SocketListener],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Accept on all listeners until `drain` is called, then wait for handlers."""
        async with trio.open_nursery() as handlers:
            self._handlers = handlers
            with self._accepting:
                async with trio.open_nursery() as acceptors:
                    for listener in listeners:
                        acceptors.start_soon(self._accept_loop, listener, handlers)
                    task_status.started()
            for listener in listeners:
                await listener.aclose()

    async def drain(self, deadline: float) -> None:
        """Stop accepting now; cancel connections still open after `deadline` seconds."""
        self._accepting.cancel()
        if self._handlers is not None:
            handlers = self._handlers
            handlers.cancel_scope.deadline = min(
                handlers.cancel_scope.deadline, trio.current_time() + deadline)

    @property
    def open_connections(self) -> int:
        return self._counts.total

    async def _accept_loop(self, listener: trio.SocketListener, handlers: trio.Nursery) -> None:
        while True:
            try:
                stream = await listener.accept()
            except OSError as exc:
                if exc.errno not in ACCEPT_CAPACITY_ERRNOS:
                    raise
                self.stats.rejections.labels("accept_" + errno.errorcode[exc.errno]).inc()
                log.error("accept_failed", error=errno.errorcode[exc.errno],
                          backoff_s=ACCEPT_BACKOFF)
                await trio.sleep(ACCEPT_BACKOFF)
                continue
            ip = _peer_ip(stream)
            reason = self._over_limit(ip)
            if reason is not None:
                self.stats.rejections.labels(reason).inc()
                self.stats.refused("-", ip, reason)
                stream.socket.close()  # at accept: no handshake, no task
                continue
            self._counts.total += 1
            self._counts.per_ip[ip] += 1
            handlers.start_soon(self._handle_counted, stream, ip)

    def _over_limit(self, ip: str) -> str | None:
        if self._counts.total >= self.limits.max_connections:
            return "max_connections"
        if self._counts.per_ip[ip] >= self.limits.max_connections_per_ip:
            return "max_connections_per_ip"
        return None

    async def _handle_counted(self, stream: trio.SocketStream, ip: str) -> None:
        self.stats.open_connections.inc()
        try:
            await self.handle(stream)
        except Exception as exc:  # a bug in one connection's handler must not stop the rest
            self.stats.rejections.labels("handler_error").inc()
            log.error("handler_error", client_ip=ip, error=f"{type(exc).__name__}: {exc}")
        finally:
            self.stats.open_connections.dec()
            self._counts.total -= 1
            self._counts.per_ip[ip] -= 1
            if not self._counts.per_ip[ip]:
                del self._counts.per_ip[ip]

    # --- one connection ----------------------------------------------------------------

    async def handle(self, tcp: trio.SocketStream) -> None:
        """Route one accepted connection; always closes it."""
        client = _peer(tcp)
        try:
            peeked = await self._peek(tcp, client[0])
            if peeked is not None:
                hello, data = peeked
                await self._dispatch(tcp, hello, data, client)
        finally:
            await close_stream(tcp)

    async def _peek(self, tcp: trio.SocketStream, ip: str) -> tuple[ClientHello, bytes] | None:
        buf = bytearray()
        with trio.move_on_after(self.limits.clienthello_timeout):
            try:
                while True:
                    chunk = await tcp.receive_some(PEEK_READ)
                    if not chunk:
                        self._reject(ip, "clienthello_eof")
                        return None
                    buf += chunk
                    hello = parse_client_hello(bytes(buf))
                    if hello is not None:
                        return hello, bytes(buf)
            except ClientHelloError as exc:
                self._reject(ip, "clienthello_" + exc.reason)
                return None
            except (trio.BrokenResourceError, OSError):
                self._reject(ip, "clienthello_reset")
                return None
        self._reject(ip, "clienthello_timeout")
        return None

    def _reject(self, ip: str, reason: str, route: str = "-") -> None:
        self.stats.rejections.labels(reason).inc()
        self.stats.refused(route, ip, reason)
        log.info("conn_rejected", client_ip=ip, reason=reason, route=route)

    async def _dispatch(self, tcp: trio.SocketStream, hello: ClientHello, data: bytes,
                        client: tuple[str, int]) -> None:
        sni = hello.sni
        if (sni is not None and sni == self.tunnel_hostname and self.tunnels is not None
                and any(p in TUNNEL_ALPNS for p in hello.alpn)):
            await self.tunnels.handle(ReplayStream(data, tcp), client)
            return
        route = self.table.lookup(sni)
        if route is None:
            self._reject(client[0], "unknown_sni" if sni else "no_sni")
            await _send_alert(tcp, tls_alert.UNRECOGNIZED_NAME)
            return
        if route.mode == "terminate":
            if ACME_ALPN in hello.alpn:
                await self._answer_challenge(tcp, data, route, sni or "", client)
            else:
                await self._terminate(tcp, data, route, client, sni)
            return
        await self._passthrough(tcp, data, route, client)

    async def _answer_challenge(self, tcp: trio.SocketStream, data: bytes, route: Route,
                                host: str, client: tuple[str, int]) -> None:
        ctx = self.certs.challenge_context(host) if self.certs is not None else None
        if ctx is None:
            self._reject(client[0], "acme_no_challenge", route.host)
            await _send_alert(tcp, tls_alert.NO_APPLICATION_PROTOCOL)
            return
        tls = trio.SSLStream(ReplayStream(data, tcp), ctx, server_side=True)
        with trio.move_on_after(CHALLENGE_TIMEOUT):
            try:
                await tls.do_handshake()
                log.info("acme_tls_alpn_answered", host=host, client_ip=client[0])
            except (trio.BrokenResourceError, ssl.SSLError, OSError):
                pass

    async def _terminate(self, tcp: trio.SocketStream, data: bytes, route: Route,
                         client: tuple[str, int], sni: str | None) -> None:
        ctx = self.certs.server_context(route) if self.certs is not None else None
        if ctx is None or self.terminator is None:
            self._reject(client[0], "no_certificate_yet", route.host)
            log.warning("terminate_no_cert", route=route.host,
                        detail="certificate issuance in progress or no cert source")
            await _send_alert(tcp, tls_alert.INTERNAL_ERROR)
            return
        await self.terminator.serve(ReplayStream(data, tcp), ctx, route, client, sni=sni)

    async def _passthrough(self, tcp: trio.SocketStream, data: bytes, route: Route,
                           client: tuple[str, int]) -> None:
        start = trio.current_time()
        try:
            backend = await self.backends.connect(route)
        except BackendError as exc:
            self._reject(client[0], "backend_unreachable", route.host)
            log.warning("backend_unreachable", route=route.host, tenant=route.tenant,
                        error=str(exc))
            self.stats.connections.labels(route.host, "passthrough", "backend_down").inc()
            await _send_alert(tcp, tls_alert.INTERNAL_ERROR)
            return
        up, down = self._byte_counters(route.host)

        def on_bytes(direction: str, n: int) -> None:
            (up if direction == "up" else down).inc(n)

        outcome = "error"
        try:
            head = data
            if route.proxy_protocol == "v2":
                head = encode_v2(client, _local(tcp)) + data
            try:
                await backend.send_all(head)
            except (trio.BrokenResourceError, OSError) as exc:
                outcome = "backend_reset"
                log.warning("backend_reset", route=route.host, error=str(exc))
                return
            up.inc(len(data))
            result = await relay(tcp, backend, idle_timeout=route.limits.idle_timeout,
                                 on_bytes=on_bytes)
            outcome = result.outcome
            log.info("conn_close", route=route.host, tenant=route.tenant, mode="passthrough",
                     client_ip=client[0], bytes_up=result.up + len(data),
                     bytes_down=result.down, duration_s=round(trio.current_time() - start, 3),
                     outcome=outcome)
        finally:
            await close_stream(backend)
            self.stats.connections.labels(route.host, "passthrough", outcome).inc()

    def _byte_counters(self, host: str) -> tuple[Any, Any]:
        """The (up, down) byte counters of a route, looked up once per route, not per
        connection (prometheus `labels()` hashes and locks on every call)."""
        pair = self._bytes_by_route.get(host)
        if pair is None:
            pair = self._bytes_by_route[host] = (
                self.stats.bytes.labels(host, "up"), self.stats.bytes.labels(host, "down"))
        return pair


async def close_stream(stream: trio.abc.Stream) -> None:
    """Close at once. For a plain socket that is `close()`: `aclose_forcefully` would
    raise and catch a `Cancelled` per call, measurable per connection."""
    if type(stream) is trio.SocketStream:
        stream.socket.close()
    else:
        await trio.aclose_forcefully(stream)


async def _send_alert(tcp: trio.SocketStream, description: int) -> None:
    """Best effort: a fatal alert, then close. A peer that is gone is no error."""
    with trio.move_on_after(1.0):
        try:
            await tcp.send_all(tls_alert.alert_record(description))
        except (trio.BrokenResourceError, OSError):
            pass


def _peer(stream: trio.SocketStream) -> tuple[str, int]:
    try:
        name = stream.socket.getpeername()
    except OSError:
        return ("?", 0)
    return (str(name[0]), int(name[1]))


def _peer_ip(stream: trio.SocketStream) -> str:
    return _peer(stream)[0]


def _local(stream: trio.SocketStream) -> tuple[str, int]:
    name = stream.socket.getsockname()
    return (str(name[0]), int(name[1]))


async def open_listeners(addresses: Sequence[tuple[str, int]]) -> list[trio.SocketListener]:
    """Bind every configured address (IPv6 listeners are v6-only, so "[::]" and
    "0.0.0.0" can both be listed)."""
    out: list[trio.SocketListener] = []
    for host, port in addresses:
        out.extend(await trio.open_tcp_listeners(port, host=host, backlog=4096))
    return out
