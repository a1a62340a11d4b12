"""The :443 SNI router: accept, peek the ClientHello, dispatch by SNI and ALPN.

Theory of operation
-------------------
Every TLS connection arrives on one listener. The router reads just enough bytes to
parse the ClientHello (sans-I/O, `proto.clienthello`), without answering anything, then
hands the connection — with the peeked bytes replayed first — to exactly one owner.

One kind of connection is not TLS: a reverse-tunnel *raw data connection*, which starts
with the fixed magic `proto.tunnel.frames.RAW_DATA_MAGIC` (first byte "P"; a TLS record's is
0x16, so the first bytes decide). It is checked before ClientHello parsing and goes to
the tunnel server (`tunnels.handle`), which authenticates it by its single-use token
(why no TLS is needed there: `net/tunnel/server.py`). Every TLS connection goes to:

- ALPN `acme-tls/1` alone for a host this edge terminates → the ACME TLS-ALPN-01
  responder (a CA offers nothing else, RFC 8737; a client that lists it among other
  protocols is an ordinary client; a passthrough host's challenge goes through to the
  home node like any connection);
- SNI = `tunnel.hostname` → the tunnel server (connectors dial in here), or with ALPN
  `pact-forward/1` a peer instance's forward link (`net/forward.py`);
- a passthrough route → a backend stream, [PROXY v2 header], the peeked bytes, then a
  splice both ways until both sides are done;
- a terminate route → the route's certificate context and the `Terminator`;
- SNI = the relay host (`relay.host`) → the relay server (`relay/server.py`), which ends
  TLS itself (ACME TLS-ALPN-01 for that host is answered here, as for terminate hosts).

Anything else gets a defined answer: unknown/missing SNI → alert unrecognized_name
(112); backend down or no certificate yet → alert internal_error (80); a ClientHello that
is malformed, too large or not complete within `clienthello_timeout` → close. Each is
counted by reason in `Stats.rejections`.

Limits are checked at accept, before any byte is read: a global connection cap and a
per-client cap, where a client is an IPv4 address or an IPv6 /64 (one subscriber usually
holds a whole /64, as the call budgets assume too). Tunnel connections from a home
node's connector are counted apart from that client's other connections, each kind
against its own `max_connections_per_ip`: a household behind one NAT address, whose
members call its own node through this edge, must not be able to lock its connector
out (or the reverse). A connection that claims to be a connector's takes a tunnel slot
only once the tunnel server has authenticated it (`_Admission`): until then it counts as
pending, so stalled impostors on that address cannot fill the connector's slots. What a
connection is shows only in its first bytes, so at accept a
client at its cap still gets `PEEK_HEADROOM` connections to show them; one that turns
out to be an ordinary client connection over the cap is then closed unanswered. Accept
errors such as EMFILE are survived (logged, short back-off).

Per-connection cost is the router's weak spot (measured: the interpreter, not the
kernel, dominated a short connection served by a task of its own), so socket listeners
are served by the epoll engine (`net/edge.py`): one task accepts, peeks, routes and
splices every passthrough connection to a configured address, and hands everything else
to this module with the bytes it read (`adopt`), which runs it in a handler task exactly
as if it had read them itself. Limits, counts, refusals, counters and log lines are this
module's in both paths. The task path below still serves any other listener (tests wrap
listeners to inject faults) and every connection the engine hands over; it works on
bare trio sockets, trying every syscall before waiting: the ClientHello is read before
any epoll wait, the backend connect is probed instead of waited on, and the relay
splices fds. Only the modes that need a `Stream` (tunnel, ACME, a non-socket backend)
wrap the socket in one; a terminate connection the engine hands over goes to the
terminator as its bare stdlib socket and the peeked bytes (`_terminate_socket`), which
it feeds straight into its TLS engine. `tests/bench/profile_router.py` measures and
profiles the passthrough path.

Reload swaps the route table and limits atomically (`update`); connections already
routed keep the `Route` object they were given. Shutdown (`drain`) closes the
listeners first, then gives open connections a deadline before cancelling them.
"""

from __future__ import annotations

import _socket
import errno
import os
import socket
import ssl
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

import trio

from pact_ingress.errors import BackendError, ListenError
from pact_ingress.logs import log
from pact_ingress.model import Config, Route, normalize_hostname
from pact_ingress.net.backends import Backends
from pact_ingress.net.replay import ReplayStream
from pact_ingress.net.runners import Runners
from pact_ingress.net.shortage import ACCEPT_BACKOFF, CAPACITY_ERRNOS, ShortageEpisode
from pact_ingress.net.splice import POOL as splice_pipes
from pact_ingress.net.splice import relay, relay_sockets
from pact_ingress.proto import tls_alert
from pact_ingress.proto.clienthello import (
    ClientHello,
    ClientHelloError,
    is_acme_validation,
    parse_client_hello,
)
from pact_ingress.proto.proxy_protocol import encode_v2
from pact_ingress.proto.ratelimit import client_bucket
from pact_ingress.proto.routing import RouteTable
from pact_ingress.proto.tunnel.constants import ALPN_FORWARD, TUNNEL_ALPNS
from pact_ingress.proto.tunnel.frames import raw_data_prefix
from pact_ingress.stats import Stats

#: Bytes asked of the socket per read while peeking. A typical ClientHello is 250–600
#: bytes, a post-quantum one ~1.9 KB; 4 KiB reads need one or two calls in practice.
PEEK_READ = 4096


#: How long a backend may take to take the whole head (PROXY header + ClientHello, at
#: most ~16 KiB: any live TCP peer's receive window takes that at once) once it took
#: its first bytes; progress does not extend it.
HEAD_TIMEOUT = 10.0
#: How long a handshake with the ACME TLS-ALPN-01 challenge cert may take.
CHALLENGE_TIMEOUT = 10.0
#: Connections a client at its cap may still open to show what they are (a connector's
#: data connections show it in the first read, within milliseconds). Bounded: they are
#: closed unanswered after `clienthello_timeout` at the latest.
PEEK_HEADROOM = 16


class TerminatorLike(Protocol):
    async def serve(self, stream: ReplayStream, server_ctx: ssl.SSLContext, route: Route,
                    client: tuple[str, int], *, sni: str | None = None) -> None: ...

    # Optional: `serve` for a bare socket and the bytes peeked from it (the router
    # prefers it when the terminator has it; see `Router._terminate_socket`).
    # async def serve_socket(self, sock: socket.socket, data: bytes,
    #                        server_ctx: ssl.SSLContext, route: Route,
    #                        client: tuple[str, int], *, sni: str | None = None) -> None


class CertsLike(Protocol):
    def server_context(self, route: Route) -> ssl.SSLContext | None: ...
    async def challenge_context(self, host: str) -> ssl.SSLContext | None: ...


class TunnelsLike(Protocol):
    async def handle(self, stream: ReplayStream, client: tuple[str, int],
                     admit: Callable[[], bool] | None = None) -> None: ...


class ForwardLike(Protocol):
    async def handle(self, stream: ReplayStream, client: tuple[str, int],
                     admit: Callable[[], bool] | None = None) -> None: ...


class HandoffLike(Protocol):
    async def serve(self, sock: trio.socket.SocketType, data: bytes, route: Route,
                    client: tuple[str, int], sni: str | None,
                    ctx: ssl.SSLContext) -> bool: ...
    async def serve_relay(self, sock: trio.socket.SocketType, data: bytes, host: str,
                          client: tuple[str, int], sni: str | None) -> bool: ...


class RelayLike(Protocol):
    host: str

    async def serve(self, stream: ReplayStream, client: tuple[str, int]) -> None: ...


class Tally(dict[str, int]):
    """Open connections by client: a dict whose missing clients count 0. Not a `Counter`:
    its `__delitem__` override makes every item assignment a call through Python, and
    these are written three times per connection."""

    def __missing__(self, key: str) -> int:
        return 0


@dataclass
class _Counts:
    """Open connections: in total, and per client (IPv4 address or IPv6 /64) by kind."""

    total: int = 0
    pending: Tally = field(default_factory=Tally)  # first bytes not seen yet
    clients: Tally = field(default_factory=Tally)  # anything but the tunnel
    tunnels: Tally = field(default_factory=Tally)  # connector control/data

    def drop(self, kind: Tally, client: str) -> None:
        left = kind[client] - 1
        if left:
            kind[client] = left
        else:
            del kind[client]


class _Admission:
    """A connection that claims to be a connector's, counted as pending (like any
    connection still showing its first bytes) until the tunnel server calls this once it
    has proved it (a token redeemed, a pinned key's handshake): only then does it take one
    of its address's tunnel slots. So anyone behind the connector's address who sends
    the first bytes of a tunnel connection and stalls holds no slot the connector needs.
    False: that address is at its tunnel cap (refused, counted and logged here)."""

    __slots__ = ("ip", "kind", "router", "who")

    def __init__(self, router: Router, who: str, ip: str) -> None:
        self.router = router
        self.who = who
        self.ip = ip
        self.kind = router._counts.pending

    def __call__(self) -> bool:
        router = self.router
        counts = router._counts
        if self.kind is not counts.pending:
            return True
        tunnels = counts.tunnels
        if tunnels[self.who] >= router.limits.max_connections_per_ip:
            router._reject(self.ip, "max_tunnel_connections_per_ip")
            return False
        counts.drop(counts.pending, self.who)
        tunnels[self.who] += 1
        self.kind = tunnels
        return True


def client_of(ip: str) -> str:
    """Who a connection from `ip` counts against: IPv4 as is, IPv6 by its /64 (IPv4-mapped
    ones as their IPv4). The IPv4 case, the common one, costs no parsing."""
    if ":" not in ip:
        return ip
    return client_bucket(ip) or ip


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
        relay: RelayLike | None = None,
    ) -> None:
        self.stats = stats
        self.backends = backends
        self.terminator = terminator
        self.certs = certs
        self.tunnels = tunnels
        #: The relay gateway, served on its own host (the app sets it on reload too).
        self.relay = relay
        #: Forward links from peer instances (`net/forward.py`), when configured.
        self.forward: ForwardLike | None = None
        #: Worker processes that take terminate connections (`net/workers.py`), when
        #: `serve --workers` runs more than one; it answers False to leave one here.
        self.handoff: HandoffLike | None = None
        self._counts = _Counts()
        self._bytes_by_route: dict[str, tuple[Any, Any]] = {}
        self._conn_counters: dict[tuple[str, str], Any] = {}
        self._accepting = trio.CancelScope()
        self._handlers: trio.Nursery | None = None
        self._runners: Runners = Runners(None)  # handler tasks for handed-over connections
        self._edge: Any = None  # the epoll engine (net/edge.py) while serving
        #: One for the process's every listener, engine's or task's: fds run out for all.
        self.accept_episode = ShortageEpisode()
        # The gauge reads the count when scraped: no lock taken twice per connection.
        stats.open_connections.set_function(lambda: self._counts.total)
        stats.splice_pipes_free.set_function(splice_pipes.free)
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
        listeners: Sequence[trio.abc.Listener[Any]],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Accept on all listeners until `drain` is called, then wait for handlers.

        Socket listeners are served by the epoll engine (`net/edge.py`), any other
        listener by an accept loop task (tests wrap listeners to inject faults)."""
        from pact_ingress.net.edge import Edge  # it imports this module

        sockets = [lst for lst in listeners if type(lst) is trio.SocketListener]
        others = [lst for lst in listeners if type(lst) is not trio.SocketListener]
        async with trio.open_nursery() as handlers:
            self._handlers = handlers
            self._runners = Runners(handlers)
            if sockets:
                self._edge = Edge(self, sockets)
                handlers.start_soon(self._edge.run)
            with self._accepting:
                async with trio.open_nursery() as acceptors:
                    for listener in others:
                        acceptors.start_soon(self._accept_loop, listener, handlers)
                    task_status.started()
                    await trio.sleep_forever()
            if self._edge is not None:
                self._edge.stop_accepting()
            self._runners.close()  # idle handler tasks end: the nursery waits for none
            for listener in listeners:
                await listener.aclose()

    async def drain(self, deadline: float) -> None:
        """Stop accepting now; cancel connections still open after `deadline` seconds."""
        self._accepting.cancel()  # `serve` then stops the engine's accepts too
        if self._handlers is not None:
            handlers = self._handlers
            handlers.cancel_scope.deadline = min(
                handlers.cancel_scope.deadline, trio.current_time() + deadline)

    @property
    def open_connections(self) -> int:
        return self._counts.total

    def adopt(self, sock: socket.socket, hello: ClientHello | None, data: bytes,
              client: tuple[str, int], who: str, kind: Tally) -> None:
        """Take over a connection the engine peeked and counted (as `kind`) but does not
        serve: it runs here as if this router had read `data` itself."""
        self._runners.start(self._handle_adopted, sock, hello, data, client, who, kind)

    def adopt_terminate(self, sock: _socket.socket, route: Route, sni: str | None,
                        data: bytes, client: tuple[str, int], who: str,
                        kind: Tally) -> None:
        """`adopt` for a connection the engine found to be a plain terminate one (what
        `_plain_terminate` would pick): its route comes with it, so nothing is parsed or
        looked up again, and its socket comes as the engine accepted it. The terminator's
        keep-alive lane takes it without a task of its own when it can (`start_lane`)."""
        start_lane = getattr(self.terminator, "start_lane", None)
        if self.handoff is None and start_lane is not None:
            ctx = self._served_context(sock, route, client)
            if ctx is None:
                sock.close()
                self._terminate_done(kind, who)
                return
            try:
                if start_lane(sock, data, ctx, route, client, sni, self._runners.start,
                              partial(self._terminate_done, kind, who)):
                    return
            except Exception as exc:  # a bug in one connection's start must not stop the rest
                self._handler_error(client[0], exc)
                if sock.fileno() != -1:
                    sock.close()
                self._terminate_done(kind, who)
                return
        self._runners.start(self._handle_terminate, sock, route, sni, data, client, who, kind)

    def _terminate_done(self, kind: Tally, who: str) -> None:
        self._counts.total -= 1
        self._counts.drop(kind, who)

    async def _handle_terminate(self, sock: _socket.socket, route: Route, sni: str | None,
                                data: bytes, client: tuple[str, int], who: str,
                                kind: Tally) -> None:
        try:
            serve_socket = getattr(self.terminator, "serve_socket", None)
            if self.handoff is None and serve_socket is not None:
                # `_terminate_socket`'s usual case inline (one coroutine less)
                ctx = self._served_context(sock, route, client)
                if ctx is not None:
                    await serve_socket(sock, data, ctx, route, client, sni=sni)
            else:
                await self._terminate_socket(sock, data, route, client, sni)
        except Exception as exc:  # a bug in one connection's handler must not stop the rest
            self._handler_error(client[0], exc)
        finally:
            if sock.fileno() != -1:  # the terminator closes what it served
                sock.close()
            self._terminate_done(kind, who)

    async def _handle_adopted(self, sock: socket.socket, hello: ClientHello | None,
                              data: bytes, client: tuple[str, int], who: str,
                              kind: Tally) -> None:
        wrapped = None
        # the engine hands a connection over still pending only when it is `_unproven`
        admission = _Admission(self, who, client[0]) if kind is self._counts.pending \
            else None
        try:
            route = self._plain_terminate(hello)
            if route is not None:  # the usual case: see `_terminate_socket`
                assert hello is not None
                await self._terminate_socket(sock, data, route, client, hello.sni)
            else:
                wrapped = trio.socket.from_stdlib_socket(sock)
                await self._serve_peeked(wrapped, hello, data, client, admission)
        except Exception as exc:  # a bug in one connection's handler must not stop the rest
            self._handler_error(client[0], exc)
        finally:
            if wrapped is not None:
                wrapped.close()  # wakes anything still waiting on it
            elif sock.fileno() != -1:  # the terminator closes what it served
                sock.close()
            self._counts.total -= 1
            self._counts.drop(kind if admission is None else admission.kind, who)

    def _handler_error(self, ip: str, exc: Exception) -> None:
        self.stats.rejections.labels("handler_error").inc()
        log.error("handler_error", client_ip=ip, error=f"{type(exc).__name__}: {exc}")

    async def _accept_loop(self, listener: trio.abc.Listener[Any],
                           handlers: trio.Nursery) -> None:
        """Any listener but a plain socket one (those are the engine's): tests wrap
        listeners to inject faults; a task per connection from the start."""
        while True:
            try:
                stream = await listener.accept()
            except OSError as exc:
                await self._accept_failed(exc)
                continue
            if self.accept_episode.failures:
                self.accept_episode.accepted(trio.current_time())
            self._admit(stream.socket, _peer(stream.socket), handlers)

    async def _accept_failed(self, exc: OSError) -> None:
        if exc.errno not in CAPACITY_ERRNOS:
            raise exc
        self.stats.rejections.labels("accept_" + errno.errorcode[exc.errno]).inc()
        self.accept_episode.failed(errno.errorcode[exc.errno], trio.current_time())
        await trio.sleep(ACCEPT_BACKOFF)

    def _admit(self, sock: trio.socket.SocketType, client: tuple[str, int],
               handlers: trio.Nursery) -> None:
        """Limits at accept: an over-limit connection is closed before any byte is read."""
        ip = client[0]
        who = client_of(ip)
        reason = self._over_limit(who)
        if reason is not None:
            self.stats.rejections.labels(reason).inc()
            self.stats.refused("-", ip, reason)
            sock.close()  # at accept: no handshake, no task
            return
        self._counts.total += 1
        self._counts.pending[who] += 1
        handlers.start_soon(self._handle_counted, sock, client, who)

    def _over_limit(self, who: str) -> str | None:
        counts = self._counts
        if counts.total >= self.limits.max_connections:
            return "max_connections"
        if counts.pending.get(who, 0) + counts.clients.get(who, 0) >= (
                self.limits.max_connections_per_ip + PEEK_HEADROOM):
            return "max_connections_per_ip"
        return None

    def _classify(self, who: str, ip: str, tunnel: bool) -> Tally | None:
        """Move a connection from pending to its kind's count; None (and uncounted) when
        that kind is at its cap for this client."""
        counts = self._counts
        kind = counts.tunnels if tunnel else counts.clients
        pending = counts.pending  # `counts.drop`, inline: once per connection
        left = pending[who] - 1
        if left:
            pending[who] = left
        else:
            del pending[who]
        had = kind.get(who, 0)
        if had >= self.limits.max_connections_per_ip:
            self._reject(ip, "max_tunnel_connections_per_ip" if tunnel
                         else "max_connections_per_ip")
            return None
        kind[who] = had + 1
        return kind

    async def _handle_counted(self, sock: trio.socket.SocketType, client: tuple[str, int],
                              who: str) -> None:
        counts = self._counts
        kind: Tally | None = counts.pending
        admission = None
        try:
            peeked = await self._peek(sock, client[0])
            if peeked is not None:
                hello, data = peeked
                if self._unproven(hello):
                    admission = _Admission(self, who, client[0])
                    await self._serve_peeked(sock, hello, data, client, admission)
                else:
                    kind = self._classify(who, client[0], False)
                    if kind is not None:
                        await self._serve_peeked(sock, hello, data, client)
        except Exception as exc:  # a bug in one connection's handler must not stop the rest
            self._handler_error(client[0], exc)
        finally:
            sock.close()
            counts.total -= 1
            if admission is not None:
                kind = admission.kind
            if kind is not None:
                counts.drop(kind, who)

    # --- one connection ----------------------------------------------------------------

    async def _serve_peeked(self, sock: trio.socket.SocketType, hello: ClientHello | None,
                            data: bytes, client: tuple[str, int],
                            admission: _Admission | None = None) -> None:
        if hello is None:  # a tunnel raw data connection (see module docstring)
            stream = ReplayStream(data, trio.SocketStream(sock))
            await self.tunnels.handle(stream, client, admission)  # type: ignore[union-attr]
        else:
            await self._dispatch(sock, hello, data, client, admission)

    def _unproven(self, hello: ClientHello | None) -> bool:
        """A connection that says it is a connector's (the raw data preamble, control or
        data TLS for the tunnel hostname) or a peer instance's forward link, but has not
        proved it yet: it stays counted as pending until the tunnel server (or the
        forwarder) admits it (`_Admission`)."""
        if hello is None:
            return self.tunnels is not None
        return self._is_tunnel(hello)

    def _is_tunnel(self, hello: ClientHello) -> bool:
        """A connector's TLS connection (control, or data over TLS): what `_dispatch`
        hands to the tunnel server."""
        return (hello.sni is not None and hello.sni == self.tunnel_hostname
                and self.tunnels is not None
                and any(p in TUNNEL_ALPNS or p == ALPN_FORWARD for p in hello.alpn))

    async def _peek(self, sock: trio.socket.SocketType, ip: str
                    ) -> tuple[ClientHello | None, bytes] | None:
        """Read until the ClientHello parses. Reads are tried before waiting: a new
        connection's hello is usually queued already, and then this costs one read(2)
        and no trip through the scheduler. The timeout runs from the first wait.
        (None, bytes) is a tunnel raw data connection (only with a tunnel server)."""
        fd = sock.fileno()
        buf = b""
        deadline = None
        try:
            while True:
                try:
                    chunk = os.read(fd, PEEK_READ)
                except BlockingIOError:
                    if deadline is None:
                        deadline = trio.current_time() + self.limits.clienthello_timeout
                    with trio.move_on_at(deadline) as waiting:
                        await trio.lowlevel.wait_readable(sock)
                    if waiting.cancelled_caught:
                        self._reject(ip, "clienthello_timeout")
                        return None
                    continue
                if not chunk:
                    self._reject(ip, "clienthello_eof")
                    return None
                buf += chunk
                if self.tunnels is not None and (raw := raw_data_prefix(buf)) is not False:
                    if raw:
                        return None, buf
                    continue  # part of the magic so far
                hello = parse_client_hello(buf)
                if hello is not None:
                    return hello, buf
        except ClientHelloError as exc:
            self._reject(ip, "clienthello_" + exc.reason)
        except OSError:
            self._reject(ip, "clienthello_reset")
        return None

    def _reject(self, ip: str, reason: str, route: str = "-") -> None:
        self.stats.rejections.labels(reason).inc()
        self.stats.refused(route, ip, reason)
        log.info("conn_rejected", client_ip=ip, reason=reason, route=route)

    async def _dispatch(self, sock: trio.socket.SocketType, hello: ClientHello, data: bytes,
                        client: tuple[str, int], admission: _Admission | None = None
                        ) -> None:
        sni = hello.sni
        if self._is_tunnel(hello) and ALPN_FORWARD in hello.alpn:
            if self.forward is not None:  # a peer instance's forward link
                await self.forward.handle(ReplayStream(data, trio.SocketStream(sock)), client,
                                          admission)
            else:
                self._reject(client[0], "forward_not_configured")
                _send_alert(sock, tls_alert.NO_APPLICATION_PROTOCOL)
            return
        if self._is_tunnel(hello):
            await self.tunnels.handle(  # type: ignore[union-attr]
                ReplayStream(data, trio.SocketStream(sock)), client, admission)
            return
        if self.relay is not None and sni is not None and normalize_hostname(
                sni, validate=False) == self.relay.host:
            await self._relay(sock, hello, data, client)
            return
        route = self.table.lookup(sni)
        if route is None:
            self._reject(client[0], "unknown_sni" if sni else "no_sni")
            _send_alert(sock, tls_alert.UNRECOGNIZED_NAME)
            return
        if route.mode == "terminate":
            if is_acme_validation(hello.alpn):
                await self._answer_challenge(sock, data, route, sni or "", client)
            else:
                await self._terminate(sock, data, route, client, sni)
            return
        await self._passthrough(sock, data, route, client)

    def _plain_terminate(self, hello: ClientHello | None) -> Route | None:
        """The terminate route `_dispatch` would serve this hello on without the ACME
        responder; None for anything else (`_dispatch` then decides again)."""
        if hello is None or self._is_tunnel(hello):
            return None
        sni = hello.sni
        if self.relay is not None and sni is not None and normalize_hostname(
                sni, validate=False) == self.relay.host:
            return None
        route = self.table.lookup(sni)
        if route is None or route.mode != "terminate" or is_acme_validation(hello.alpn):
            return None
        return route

    async def _relay(self, sock: trio.socket.SocketType, hello: ClientHello, data: bytes,
                     client: tuple[str, int]) -> None:
        """The relay host: its TLS ends in the relay server (any client key, pinned
        there), except an ACME TLS-ALPN-01 validation of its certificate."""
        assert self.relay is not None
        if not is_acme_validation(hello.alpn):
            # with workers, the client's worker serves it (main keeps the store)
            if self.handoff is not None and await self.handoff.serve_relay(
                    sock, data, self.relay.host, client, hello.sni):
                return
            await self.relay.serve(ReplayStream(data, trio.SocketStream(sock)), client)
            return
        stream = ReplayStream(data, trio.SocketStream(sock))
        ctx = None
        if self.certs is not None:
            ctx = await self.certs.challenge_context(self.relay.host)
        if ctx is None:
            self._reject(client[0], "acme_no_challenge", self.relay.host)
            _send_alert(sock, tls_alert.NO_APPLICATION_PROTOCOL)
            return
        tls = trio.SSLStream(stream, ctx, server_side=True)
        with trio.move_on_after(CHALLENGE_TIMEOUT):
            try:
                await tls.do_handshake()
                log.info("acme_tls_alpn_answered", host=self.relay.host, client_ip=client[0])
            except (trio.BrokenResourceError, ssl.SSLError, OSError):
                pass

    async def _answer_challenge(self, sock: trio.socket.SocketType, data: bytes, route: Route,
                                host: str, client: tuple[str, int]) -> None:
        ctx = await self.certs.challenge_context(host) if self.certs is not None else None
        if ctx is None:
            self._reject(client[0], "acme_no_challenge", route.host)
            _send_alert(sock, tls_alert.NO_APPLICATION_PROTOCOL)
            return
        tls = trio.SSLStream(ReplayStream(data, trio.SocketStream(sock)), ctx, server_side=True)
        with trio.move_on_after(CHALLENGE_TIMEOUT):
            try:
                await tls.do_handshake()
                log.info("acme_tls_alpn_answered", host=host, client_ip=client[0])
            except (trio.BrokenResourceError, ssl.SSLError, OSError):
                pass

    def _served_context(self, sock: trio.socket.SocketType | socket.socket | _socket.socket,
                        route: Route,
                        client: tuple[str, int]) -> ssl.SSLContext | None:
        """The route's certificate context; None (alert sent, refusal counted) while
        there is none or nothing terminates here."""
        ctx = self.certs.server_context(route) if self.certs is not None else None
        if ctx is None or self.terminator is None:
            self._reject(client[0], "no_certificate_yet", route.host)
            log.warning("terminate_no_cert", route=route.host,
                        detail="certificate issuance in progress or no cert source")
            _send_alert(sock, tls_alert.INTERNAL_ERROR)
            return None
        return ctx

    async def _terminate(self, sock: trio.socket.SocketType, data: bytes, route: Route,
                         client: tuple[str, int], sni: str | None) -> None:
        ctx = self._served_context(sock, route, client)
        if ctx is None:
            return
        if self.handoff is not None and await self.handoff.serve(sock, data, route, client,
                                                                 sni, ctx):
            return
        await self.terminator.serve(  # type: ignore[union-attr]
            ReplayStream(data, trio.SocketStream(sock)), ctx, route, client, sni=sni)

    async def _terminate_socket(self, sock: socket.socket | _socket.socket, data: bytes,
                                route: Route, client: tuple[str, int],
                                sni: str | None) -> None:
        """`_terminate` for a connection the engine handed over as a bare socket: TLS runs
        on it directly (`Terminator.serve_socket`), without a trio socket, stream and
        replay wrapper built around it first. The terminator closes it. `sock` may be
        the engine's own `_socket.socket`: it becomes a `socket.socket` (the same fd)
        only where trio must wrap it; whoever holds it afterwards sees it detached."""
        ctx = self._served_context(sock, route, client)
        if ctx is None:
            return
        if self.handoff is not None:
            stdlib = _stdlib(sock)
            try:
                handed = await self.handoff.serve(trio.socket.from_stdlib_socket(stdlib),
                                                  data, route, client, sni, ctx)
            except BaseException:
                stdlib.close()
                raise
            if handed:
                stdlib.close()  # the worker has its own copy of the fd
                return
            sock = stdlib
        serve_socket = getattr(self.terminator, "serve_socket", None)
        if serve_socket is not None:
            await serve_socket(sock, data, ctx, route, client, sni=sni)
            return
        wrapped = trio.socket.from_stdlib_socket(_stdlib(sock))  # a `serve`-only terminator
        try:
            await self.terminator.serve(  # type: ignore[union-attr]
                ReplayStream(data, trio.SocketStream(wrapped)), ctx, route, client, sni=sni)
        finally:
            wrapped.close()

    async def _passthrough(self, sock: trio.socket.SocketType, data: bytes, route: Route,
                           client: tuple[str, int]) -> None:
        start = trio.current_time()
        try:
            backend = await self._open_backend(route)
        except BackendError as exc:
            self._reject(client[0], "backend_unreachable", route.host)
            log.warning("backend_unreachable", route=route.host, tenant=route.tenant,
                        error=str(exc))
            self._connections(route.host, "backend_down").inc()
            _send_alert(sock, tls_alert.INTERNAL_ERROR)
            return
        up, down = self._byte_counters(route.host)

        def on_bytes(direction: str, n: int) -> None:
            (up if direction == "up" else down).inc(n)

        outcome = "error"
        try:
            head = data
            if route.proxy_protocol == "v2":
                head = encode_v2(client, _local(sock)) + data
            try:
                await _send_head(backend, head)
            except (trio.BrokenResourceError, OSError) as exc:
                outcome = "backend_reset"
                log.warning("backend_reset", route=route.host, error=str(exc))
                return
            up.inc(len(data))
            if isinstance(backend, trio.abc.Stream):  # not a plain socket: copy
                result = await relay(trio.SocketStream(sock), backend,
                                     idle_timeout=route.limits.idle_timeout, on_bytes=on_bytes)
            else:
                result = await relay_sockets(sock, backend,
                                             idle_timeout=route.limits.idle_timeout,
                                             on_bytes=on_bytes)
            outcome = result.outcome
            log.info("conn_close", route=route.host, tenant=route.tenant, mode="passthrough",
                     client_ip=client[0], bytes_up=result.up + len(data),
                     bytes_down=result.down, duration_s=round(trio.current_time() - start, 3),
                     outcome=outcome)
        finally:
            if isinstance(backend, trio.abc.Stream):
                await close_stream(backend)
            else:
                backend.close()
            self._connections(route.host, outcome).inc()

    async def _open_backend(self, route: Route) -> trio.socket.SocketType | trio.abc.Stream:
        """The route's backend: a bare socket for a configured address or a tunnel data
        connection (both are plain TCP and get spliced), any other stream as is."""
        if route.backend.address is not None:
            return await self.backends.connect_socket(route.backend.address)
        stream = await self.backends.connect(route)
        if type(stream) is trio.SocketStream:
            return stream.socket
        return stream

    def _connections(self, host: str, outcome: str) -> Any:
        """The connections counter of (route, outcome), looked up once (see below)."""
        key = (host, outcome)
        child = self._conn_counters.get(key)
        if child is None:
            child = self._conn_counters[key] = self.stats.connections.labels(
                host, "passthrough", outcome)
        return child

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


async def _send_head(backend: trio.socket.SocketType | trio.abc.Stream, head: bytes) -> None:
    """The first bytes to the backend; on a bare socket a send(2) is tried before any
    wait (a fresh connection's buffer takes a ClientHello whole). A backend that does not
    take them within HEAD_TIMEOUT counts as reset (the deadline is only set up on the
    slow path, so the usual connection pays nothing for it)."""
    if isinstance(backend, trio.abc.Stream):
        with trio.move_on_after(HEAD_TIMEOUT) as scope:
            await backend.send_all(head)
        if scope.cancelled_caught:
            raise trio.BrokenResourceError("backend did not take the ClientHello")
        return
    fd = backend.fileno()
    view = memoryview(head)
    deadline = None
    while view:
        try:
            view = view[os.write(fd, view):]
        except BlockingIOError:
            if deadline is None:
                deadline = trio.current_time() + HEAD_TIMEOUT
            with trio.move_on_at(deadline):
                await trio.lowlevel.wait_writable(backend)
            if trio.current_time() >= deadline:
                raise trio.BrokenResourceError("backend did not take the ClientHello")


def _stdlib(sock: socket.socket | _socket.socket) -> socket.socket:
    """`sock` as the `socket.socket` trio wraps: the engine's own `_socket.socket` is
    detached into one (naming family, type and protocol spares the two getsockopt(2) the
    socket module would make to learn them)."""
    if isinstance(sock, socket.socket):
        return sock
    return socket.socket(sock.family, socket.SOCK_STREAM, socket.IPPROTO_TCP, sock.detach())


def _send_alert(sock: trio.socket.SocketType | socket.socket | _socket.socket,
                description: int) -> None:
    """Best effort: a fatal alert, then the caller closes. Seven bytes on a connection
    that has sent us nothing fit its empty send buffer; a peer that is gone is no error."""
    try:
        os.write(sock.fileno(), tls_alert.alert_record(description))
    except OSError:
        pass


def _peer(sock: trio.socket.SocketType) -> tuple[str, int]:
    try:
        name = sock.getpeername()
    except OSError:
        return ("?", 0)
    return (str(name[0]), int(name[1]))


def _local(sock: trio.socket.SocketType) -> tuple[str, int]:
    name = sock.getsockname()
    return (str(name[0]), int(name[1]))


async def open_listeners(addresses: Sequence[tuple[str, int]]) -> list[trio.SocketListener]:
    """Bind every configured address (IPv6 listeners are v6-only, so "[::]" and
    "0.0.0.0" can both be listed)."""
    out: list[trio.SocketListener] = []
    try:
        for host, port in addresses:
            try:
                out.extend(await trio.open_tcp_listeners(port, host=host, backlog=4096))
            except OSError as exc:
                shown = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
                raise ListenError.binding(shown, exc) from exc
    except BaseException:
        for listener in out:  # the ones bound before the failure
            listener.socket.close()
        raise
    return out
