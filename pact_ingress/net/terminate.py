"""Terminate mode: the public TLS ends here; the request story runs; the node gets it
over pinned mTLS.

Theory of operation
-------------------
The router has peeked the ClientHello and picked a certificate context for the SNI; it
hands us the connection as a `ReplayStream`. `Terminator.serve` runs the TLS handshake
(bounded by `clienthello_timeout`) and, by ALPN, drives HTTP/2 (`net.http2`) or HTTP/1.1
(`net.http1`) on it. A bare socket (`serve_socket`, the usual hand-over) starts in the
keep-alive lane instead (`net.h1_lane`), which serves the usual HTTP/1.1 exchange from
the readiness hub's loop and hands the connection to the engine here, where its story
stands, when it needs more (`_resume`); the lane's story is `lane_story`, the steps
below in the same order. Those modules turn the connection into `Exchange`s; this module runs
the same story on each, whichever the version:

1. **Route, looked up per request.** The connection remembers only its route's *host*;
   each request takes the route as the running config has it now, so a reload applies
   to open connections too. A route that is gone (or no longer terminates) → 421.
2. **One IP unit charged**, before anything else is judged: every request costs the
   client's IP ceiling one call, refusals included, so a flood of bad requests is
   metered like good ones. Over budget → `rate_limited` (JSON-RPC at the MCP endpoint,
   else 429), without reading the body.
3. **Target and host** (`proto.http_request`): the target is parsed and normalised (400
   when ambiguous); Host / `:authority` / an absolute-form authority must name the SNI
   (421). The node receives the normalised path, never the raw target.
4. **Scope** (`proto.http_request.judge_scope`): a POST at or below `mcp_path` is judged
   by the seal posture; a JSON body elsewhere is refused (403), a body-carrying non-POST
   at the MCP endpoint 405, a compressed MCP body 415.
5. **Body budget.** A declared length over `max_body_bytes` → 413 before reading.
   Every body has a deadline for its whole (`BODY_TIMEOUT`, plus the per-read idle
   timeout). An MCP body is buffered against `buffers`, a `Shares` table with a per-IP
   and a per-process cap (429 / 503 beyond), gathered in one buffer (`BodyBuffer`: it
   costs about its bytes however small the chunks it came in), then judged by
   `proto.posture` — in a worker thread when large, so the event loop (passthrough,
   tunnels) keeps running.
6. **Keys charged**: a forwarded MCP call charges its caller keys (the IP unit already
   paid) and may still be `rate_limited`.
7. **A share of the node.** Each client IP holds at most the route's
   `max_requests_in_flight_per_ip` requests toward the node at once (429 beyond), so one
   IP cannot take a route's upstream pool from everyone else.
8. **Upstream** (`net.upstream`): pinned mTLS, pooled; typed failures → 503 +
   Retry-After (node offline, or the edge out of fds to reach it), 502 (pin or TLS
   failure, broken HTTP), 504 (no response headers in time).
9. **Response** streams back chunk by chunk (SSE works), each chunk bounded by the
   client write deadline; a client that goes away cancels the upstream request; a node
   that answered before it took the whole body has the client's upload stopped as for
   the edge's own early answers; a node
   that breaks mid-body makes the client see a failure (HTTP/1.1 connection dropped,
   HTTP/2 stream reset; an HTTP/1.1 client sent nothing of the answer yet gets a 502),
   never a short body that looks complete.
"""

from __future__ import annotations

import _socket
import bisect
import contextlib
import enum
import os
import socket
import ssl
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from functools import partial
from typing import Any

import trio

from pact_ingress.identity import Identity
from pact_ingress.logs import log, request_prefix
from pact_ingress.model import Config, Route, Tenant
from pact_ingress.net import deadlines, readiness
from pact_ingress.net.backends import Backends
from pact_ingress.net.h1_lane import ENDED as LANE_ENDED
from pact_ingress.net.h1_lane import INTERNAL_FAULT, Handoff, Lane, LaneGo, NeedNode, Resume
from pact_ingress.net.h2_lane import H2Lane, Rest
from pact_ingress.net.http1 import BROKE_OFF, LINGER_BYTES, LINGER_SECONDS, H1Connection
from pact_ingress.net.http2 import H2Connection, H2Exchange
from pact_ingress.net.http_exchange import (
    BadResponse,
    BodyBuffer,
    ClientGone,
    Exchange,
    HeadTooLarge,
)
from pact_ingress.net.linger import linger
from pact_ingress.net.replay import ReplayStream
from pact_ingress.net.tls_server import ServerTLS
from pact_ingress.net.upstream import (
    DEFAULT_HEADER_TIMEOUT,
    NodeUnreachable,
    Upstream,
    UpstreamBusy,
    UpstreamError,
    UpstreamResponse,
    UpstreamTimeout,
    UpstreamTLSError,
)
from pact_ingress.proto import posture
from pact_ingress.proto.h2_guard import Flood
from pact_ingress.proto.http1_server import H1ServerParser, ParseError, Request
from pact_ingress.proto.http_headers import clean_request_headers, clean_response_headers
from pact_ingress.proto.http_request import (
    MCP_POST,
    NO_CONTENT_METHODS,
    BadRequest,
    Target,
    check_host,
    check_single_valued,
    header,
    in_mcp_scope,
    judge_scope,
    parse_target,
)
from pact_ingress.proto.ratelimit import Budget, Limited, client_bucket
from pact_ingress.proto.shares import Refused, Shares
from pact_ingress.state import Limiter, LocalLimiter
from pact_ingress.stats import Stats

#: Retry-After for 503 (node offline): a tunnel reconnects within seconds; asking
#: clients to come back much later would turn a blip into an outage.
RETRY_AFTER_OFFLINE = 5
#: HTTP status recorded when the client went away before we could answer (nginx's 499).
CLIENT_CLOSED = 499
#: HTTP status recorded when the node broke off an answer the client was being sent.
NODE_BROKE_OFF = 502
#: The whole request body must arrive within this (a 6 MiB MCP body at 128 KiB/s).
BODY_TIMEOUT = 60.0
#: Request-body bytes the edge buffers (MCP bodies are read whole to be judged): per
#: client, three maximal bodies at once; per process, what a small VPS can spare. Bytes
#: not taken yet are not counted here: they are bounded by flow control instead (HTTP/2:
#: a stream's window, 64 KiB, and the connection's, 100 of them, `net.http2`; HTTP/1.1:
#: one read), and a refused request's are dropped with the refusal.
MAX_BUFFERED_PER_CLIENT = 18 * 1024 * 1024
MAX_BUFFERED_TOTAL = 256 * 1024 * 1024
#: Bodies larger than this are parsed in a worker thread (one at a time), so a large
#: JSON document does not stall the event loop every other connection runs on.
INLINE_PARSE_BYTES = 64 * 1024

#: Labelled metric children kept at hand (routes × statuses seen); past this the cache
#: starts again, so a config with many routes costs lookups, never memory.
MAX_CACHED_COUNTERS = 1024
#: Upstream header times kept before they are moved into the histogram unasked (the
#: metrics may never be collected; memory stays bounded).
MAX_PENDING_TIMES = 1024
#: The keep-alive lane (`net/h1_lane.py`) serves the usual HTTP/1.1 exchange of a
#: process whose rate limits are its own; `PACT_INGRESS_LANE=0` leaves every connection
#: to the trio engine (a side-by-side measure of the two).
LANE = os.environ.get("PACT_INGRESS_LANE", "1") != "0"
#: The in-flight total per route is bounded by the upstream pool itself; only the
#: per-client share is enforced here.
UNBOUNDED = 1 << 30

_TEXT = (b"content-type", b"text/plain; charset=utf-8")


class _BodyTooLarge(Exception):
    """A streamed request body crossed max_body_bytes."""


class _BrokenOff(enum.Enum):
    """Who cut a response short while it was relayed."""

    NODE = "node"
    CLIENT = "client"


class _NodeBrokeOff(ClientGone):
    """The node's answer broke off after its head went to the client: the client's leg is
    already failed (`Exchange.abort`), so the exchange ends as for a gone client, but the
    failure is the node's and is counted so."""


@dataclass(frozen=True)
class _Answer:
    status: int
    body: bytes
    headers: tuple[tuple[bytes, bytes], ...] = (_TEXT,)
    code: str | None = None  # refusal code for metrics and the log line

    @classmethod
    def text(cls, status: int, why: str, *extra: tuple[bytes, bytes]) -> _Answer:
        return cls(status, f"{why}\n".encode(), (_TEXT, *extra))

    @classmethod
    def refusal(cls, refusal: posture.Refuse) -> _Answer:
        headers = tuple((k.encode(), v.encode()) for k, v in refusal.headers)
        return cls(refusal.http_status, refusal.body, headers, refusal.code)


class _Connection:
    """What the exchanges of one connection share (made once per connection: a plain
    slotted class, not a frozen dataclass, whose `__init__` sets each field through
    `object.__setattr__`). Nothing changes it after it is made."""

    __slots__ = ("client", "client_ip", "log_prefix", "now", "route_host", "sni")

    def __init__(self, route_host: str, sni: str | None, client_ip: str, client: str,
                 log_prefix: str, now: Callable[[], float]) -> None:
        self.route_host = route_host  # the route the router chose; looked up per request
        self.sni = sni
        self.client_ip = client_ip
        self.client = client  # the rate limiter's bucket for client_ip (IPv6: its /64)
        self.log_prefix = log_prefix  # route and client_ip as its access lines write them
        self.now = now  # trio.current_time, cheaper (`deadlines.clock`)


#: `pact_ingress_terminate_lane_total` outcomes the lane counts in attributes of its own.
_LANE_OUTCOMES = (("served", "served"), ("connect", "connects"), ("h2_served", "h2_served"),
                  ("h2_abort", "h2_aborted"))

#: Exceptions that mean the client (or the link to it) went: anything else that ends an
#: exchange or a connection is a fault of ours.
_CLIENT_WENT = (trio.BrokenResourceError, trio.ClosedResourceError, ClientGone)


def _connection_ended(route_host: str, exc: Exception) -> None:
    """A connection's end by an exception: a debug line when the client or the link
    went, a warning when anything else ended it."""
    if isinstance(exc, _CLIENT_WENT):
        log.debug("terminate_connection_ended", route=route_host, error=repr(exc))
    else:
        log.warning("terminate_connection_error", route=route_host, error=repr(exc))


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
        limiter: Limiter | None = None,
    ) -> None:
        self.identity = identity
        self.stats = stats
        self.wall_clock = wall_clock
        self.upstream = Upstream(identity, backends, header_timeout=header_timeout)
        # per-route budgets are passed per call; the state backend decides where buckets live
        self.limiter: Limiter = limiter or LocalLimiter()
        self.buffers = Shares(MAX_BUFFERED_PER_CLIENT, MAX_BUFFERED_TOTAL)
        self._inflight: dict[str, Shares] = {}
        self._routes: dict[str, Route] = {}
        self._budgets: dict[str, Budget] = {}  # per route host, made with the routes
        self._tenants: dict[str, Tenant] = {}
        self._parse_slot = trio.CapacityLimiter(1)
        self._idle_scopes: set[trio.CancelScope] = set()
        self._draining = trio.Event()
        self._children: dict[tuple[Any, ...], Any] = {}
        # answered requests and upstream header times, kept as plain numbers per request
        # and moved into their metric families before each collection (`_sync_metrics`)
        self._answered: dict[tuple[str, int], int] = {}
        self._header_times: list[tuple[str, float]] = []
        stats.before_collect(self._sync_metrics)
        self._open = 0
        self._lane: Lane | None = None  # made on first use, in the trio run
        #: lane connections with no task of their own yet (`start_lane`), and whether
        #: the task that stands for them in the router's nursery runs (`_keep_taskless`)
        self._taskless = 0
        self._keeping = False
        self._taskless_gone = trio.Event()  # draining, and none of them is left

    def update(self, config: Config) -> None:
        """Take a (re)loaded config: routes and tenants, for open connections too."""
        self._tenants = {t.name: t for t in config.tenants}
        self._routes = {r.host: r for r in config.routes() if r.mode == "terminate"}
        self._budgets = {r.host: Budget.from_limits(r.limits) for r in self._routes.values()}
        self.upstream.retain((r, self._tenants[r.tenant].pins) for r in self._routes.values())

    def tenant(self, name: str) -> Tenant | None:
        return self._tenants.get(name)

    def route(self, host: str) -> Route | None:
        """The terminate route of `host` in the running config (a worker process looks
        up the route main chose for a connection it hands over)."""
        return self._routes.get(host)

    @property
    def open_connections(self) -> int:
        """Connections inside `serve` now."""
        return self._open

    # -- connections ------------------------------------------------------------------

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
        await self._serve(_server_tls(stream, server_ctx), route, client, sni)

    def serve_socket(
        self,
        sock: socket.socket | _socket.socket,
        data: bytes,
        server_ctx: ssl.SSLContext,
        route: Route,
        client: tuple[str, int],
        *,
        sni: str | None = None,
    ) -> Coroutine[Any, Any, None]:
        """`serve` for a bare non-blocking socket and the bytes already read from it (the
        router's hand-over): TLS runs on the socket itself, with `data` fed to it first.
        Always closes the socket. To be awaited like `serve`: it returns the connection's
        coroutine itself (one coroutine per connection fewer than an `async def` that
        awaits it)."""
        try:
            # our writes are whole answers: nothing gains from being held back for an ACK
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass  # a connection already reset fails where it is used, like any other
        if LANE and type(self.limiter) is LocalLimiter:
            return self._serve_lane(sock, data, server_ctx, route, client,  # type: ignore[arg-type]
                                    sni)
        try:
            tls = ServerTLS(sock, server_ctx, data)  # type: ignore[arg-type]
        except BaseException:
            sock.close()
            raise
        return self._serve(tls, route, client, sni)

    def _lane_connection(self, route: Route, client: tuple[str, int], sni: str | None
                         ) -> tuple[Lane, _Connection]:
        if sni is None and not route.host.startswith("*."):
            sni = route.host
        ip = client[0]
        conn = _Connection(route.host, sni, ip, client_bucket(ip) or ip,
                           request_prefix(route.host, ip), deadlines.clock())
        lane = self._lane
        if lane is None:
            lane = self._lane = Lane(self)
            if self._draining.is_set():
                lane.drain()
        return lane, conn

    async def _serve_lane(self, sock: socket.socket, data: bytes, ctx: ssl.SSLContext,
                          route: Route, client: tuple[str, int], sni: str | None) -> None:
        """`_serve` with the keep-alive lane (`net/h1_lane.py`) serving the connection
        for as long as its requests are the usual ones; the trio engine takes it up
        where the lane hands it over."""
        lane, conn = self._lane_connection(route, client, sni)
        self._open += 1
        readiness.open_connections += 1
        try:
            step = await lane.serve(sock, data, ctx, route, conn)
        except BaseException:
            self._lane_over(sock, None, None)
            raise
        await self._lane_on(sock, route, conn, lane, step, None)

    def start_lane(self, sock: socket.socket, data: bytes, ctx: ssl.SSLContext,
                   route: Route, client: tuple[str, int], sni: str | None,
                   spawn: Callable[..., None], ended: Callable[[], None]) -> bool:
        """`serve_socket` without a task: the lane serves the connection from the
        readiness hub's callbacks, and a task (`spawn(fn, *args)`, the router's handler
        tasks) is started only when the connection needs one: to connect to the node,
        or once it goes to the trio engine. `ended()` is called once when the
        connection is over. False: no lane here (the caller serves it as before).
        A connection costs no task switch of its own at its start or its end."""
        if not (LANE and type(self.limiter) is LocalLimiter):
            return False
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass  # a connection already reset fails where it is used, like any other
        lane, conn = self._lane_connection(route, client, sni)
        if not self._keeping:
            spawn(self._keep_taskless)
            self._keeping = True
        self._open += 1
        readiness.open_connections += 1
        self._taskless += 1
        try:
            lane.start(sock, data, ctx, route, conn,
                       partial(self._lane_first, sock, route, conn, lane, spawn, ended))
        except Exception as exc:  # (the lane catches its own; this is one before it ran)
            _connection_ended(route.host, exc)
            self._untasked()
            self._lane_over(sock, None, ended)
        return True

    def _lane_first(self, sock: socket.socket, route: Route, conn: _Connection, lane: Lane,
                    spawn: Callable[..., None], ended: Callable[[], None],
                    step: Handoff | NeedNode | None) -> None:
        """A task-less lane connection's first result: its end (closed), or what needs a
        task from here on, which it gets."""
        self._untasked()
        if step is None:
            self._lane_over(sock, None, ended)
            return
        try:
            spawn(self._lane_on, sock, route, conn, lane, step, ended)
        except Exception as exc:  # no task to be had (the process is stopping)
            _connection_ended(route.host, exc)
            if type(step) is NeedNode:
                step.client.close(CLIENT_CLOSED)
            self._lane_over(sock, step if type(step) is Handoff else None, ended)

    def _untasked(self) -> None:
        self._taskless -= 1
        if not self._taskless and self._draining.is_set():
            self._taskless_gone.set()

    async def _keep_taskless(self) -> None:
        """Stands for the task-less lane connections in the router's handler nursery:
        while it runs, a drain waits for them as for any connection's task; cancelled
        (the drain's deadline, a stop), it closes those still open."""
        try:
            while True:
                await self._taskless_gone.wait()
                # a connection may have come between the drain's signal and this wake-up
                # (the engine still hands over hellos it had read): it is waited for too
                if not self._taskless:
                    return
                self._taskless_gone = trio.Event()
        except BaseException:
            if self._lane is not None:
                self._lane.close_taskless()
            raise
        finally:
            self._keeping = False

    async def _lane_on(self, sock: socket.socket, route: Route, conn: _Connection,
                       lane: Lane, step: Handoff | NeedNode | None,
                       ended: Callable[[], None] | None) -> None:
        """A lane connection from its first result on: a connection to the node got for
        it (as often as it asks), then the trio engine from where the lane handed it."""
        handed: Handoff | None = None
        try:
            while type(step) is NeedNode:
                step = await self._connect_for_lane(lane, step)
            handed = step  # type: ignore[assignment]
            if handed is not None:
                await self._resume(conn, route, handed)
        except Exception as exc:
            _connection_ended(route.host, exc)
        finally:
            self._lane_over(sock, handed, ended)

    def _lane_over(self, sock: socket.socket, handed: Handoff | None,
                   ended: Callable[[], None] | None) -> None:
        """A lane connection's end (`_connection_life`'s, written out: a generator-based
        context manager per connection cost more than the rest of its bookkeeping)."""
        self._open -= 1
        readiness.open_connections -= 1
        if handed is not None:
            handed.tls.close_unwatched()
        elif sock.fileno() != -1:
            sock.close()  # (the lane closes what it ends; this is a failure's)
        if ended is not None:
            ended()

    @contextlib.contextmanager
    def _connection_life(self, route_host: str) -> Iterator[None]:
        """One connection served: counted open while it is, its end logged as a debug
        line when the client or the link went, a warning when anything else ended it."""
        self._open += 1
        readiness.open_connections += 1
        try:
            yield
        except Exception as exc:
            _connection_ended(route_host, exc)
        finally:
            self._open -= 1
            readiness.open_connections -= 1

    async def _connect_for_lane(self, lane: Lane, need: NeedNode
                                ) -> Handoff | NeedNode | None:
        """A connection to the node for the lane's exchange, as `Upstream.request` gets
        one (`_Pool.acquire`: waits for a slot, connects, checks the pins)."""
        node = error = None
        reused = False
        client = need.client
        # (the client's connection closing meanwhile cancels this scope: `connected`
        # then finds it ended, with no node connection)
        with trio.CancelScope() as client.connecting:
            try:
                node, reused = await need.entry.acquire(need.host, need.deadline,
                                                        fresh=need.fresh,
                                                        offer_h2=need.offer_h2)
            except UpstreamError as exc:
                error = exc
            except BaseException:
                if client.phase is not LANE_ENDED:
                    client.close(CLIENT_CLOSED)  # cancelled: the process is stopping
                raise
            finally:
                client.connecting = None
        return await lane.connected(need, node, reused, error)

    async def _resume(self, conn: _Connection, route: Route, h: Handoff) -> None:
        """A connection the lane handed over, served on from where it stopped."""
        limits = route.limits
        if h.point is Resume.H2:
            await self._h2(h.tls, conn, limits).serve(partial(self._exchange, conn))
            return
        if h.point is Resume.LINGER:
            await linger(h.tls.socket, LINGER_SECONDS, LINGER_BYTES)
            return
        h1 = self._h1(h.tls, limits, h.parser, h.deferred)
        h1._answered = h.answered
        first = None
        if h.request is not None:
            first = (h.request, partial(self._exchange, conn, then=partial(self._then, conn, h),
                                        held=h.held, started=h.started))
        await h1.serve(partial(self._exchange, conn), first)

    async def _then(self, conn: _Connection, h: Handoff | Rest, ex: Exchange) -> int:
        """The rest of the story of the request the lane handed over with `h`."""
        if h.point is Resume.ANSWER:
            assert h.answer is not None
            return await self._answer(ex, conn, h.answer)
        if h.point is Resume.WRITE:  # the node's whole answer, the lane's hold given back
            assert h.answer is not None
            try:
                await ex.respond_whole(h.answer.status, list(h.answer.headers),
                                       h.answer.body)
            except HeadTooLarge:  # (as `_from_node` answers it)
                return await self._head_too_large(ex, conn)
            return h.answer.status
        go = h.go
        assert go is not None
        if h.point is Resume.FORWARD:
            return await self._forward(ex, conn, go.route, go.tenant, conn.client, go.host,
                                       go.target, go.body)
        if h.stream is not None:  # RELAY of an HTTP/2 stream's answer
            answer: AbstractAsyncContextManager[UpstreamResponse] = h.stream
        else:
            assert h.entry is not None and h.node is not None and h.response is not None
            answer = self.upstream.adopt(h.entry, h.node, h.response,
                                         go.route.limits.idle_timeout)
        try:  # RELAY: the lane holds the client's share of the node for it
            return await self._from_node(ex, conn, go.route, answer, None)
        finally:
            self.lane_give(conn, go.route)

    async def _serve(self, tls: ServerTLS | trio.SSLStream, route: Route,
                     client: tuple[str, int], sni: str | None) -> None:
        if sni is None and not route.host.startswith("*."):
            sni = route.host
        limits = route.limits
        ip = client[0]
        conn = _Connection(route.host, sni, ip, client_bucket(ip) or ip,
                           request_prefix(route.host, ip), deadlines.clock())
        handle = partial(self._exchange, conn)
        ours = type(tls) is ServerTLS  # (not isinstance: an ABC check costs a call)
        try:
            with self._connection_life(route.host):
                await self._serve_tls(tls, ours, conn, handle, limits)
        finally:
            if ours:
                # the HTTP leg and its tasks are done: nothing waits on the socket now
                tls.close_unwatched()  # type: ignore[union-attr]
            else:
                await trio.aclose_forcefully(tls)

    async def _serve_tls(self, tls: ServerTLS | trio.SSLStream, ours: bool,
                         conn: _Connection, handle: Callable[[Exchange], Any],
                         limits: Any) -> None:
        """`_serve`'s handshake, then the HTTP version the client chose."""
        if ours:
            try:
                # `ServerTLS.do_handshake`'s body, without its coroutine
                await tls.handshake(  # type: ignore[union-attr]
                    conn.now() + limits.clienthello_timeout, hold_tail=True)
            except trio.TooSlowError:
                return
        else:
            with trio.move_on_after(limits.clienthello_timeout) as handshake:
                await tls.do_handshake()
            if handshake.cancelled_caught:
                return
        if tls.selected_alpn_protocol() == "h2":
            await self._h2(tls, conn, limits).serve(handle)
        else:
            await self._h1(tls, limits).serve(handle)

    def _h2(self, tls: trio.abc.Stream, conn: _Connection, limits: Any) -> H2Connection:
        c = H2Connection(tls, idle_timeout=limits.idle_timeout,
                         write_timeout=limits.client_write_timeout,
                         idle_scopes=self._idle_scopes, draining=self._draining,
                         on_flood=partial(self._flooded, conn))
        if LANE and type(self.limiter) is LocalLimiter and type(tls) is ServerTLS:
            # the usual stream served without a worker (`net/h2_lane.py`)
            lane = self._lane
            if lane is None:
                lane = self._lane = Lane(self)
            h2 = H2Lane(lane, conn, c)
            c.fast, c.fast_close = h2.start, h2.close
        return c

    def resumed(self, conn: _Connection, rest: Rest, held: int, started: float
                ) -> Callable[[Exchange], Coroutine[Any, Any, None]]:
        """The handle a stream worker serves an HTTP/2 stream the lane began with."""
        return partial(self._exchange, conn, then=partial(self._then, conn, rest),
                       held=held, started=started)

    def _h1(self, tls: trio.abc.Stream, limits: Any, parser: H1ServerParser | None = None,
            deferred: ParseError | None = None) -> H1Connection:
        return H1Connection(tls, idle_timeout=limits.idle_timeout,
                            head_timeout=limits.clienthello_timeout,
                            write_timeout=limits.client_write_timeout,
                            idle_scopes=self._idle_scopes, draining=self._draining,
                            parser=parser, deferred=deferred)

    def _flooded(self, conn: _Connection, kind: Flood) -> None:
        self.stats.h2_floods.labels(route=conn.route_host, kind=kind.value).inc()
        log.warning("h2_flood", route=conn.route_host, client=conn.client_ip, kind=kind.value)

    async def drain(self) -> None:
        """Shutdown has begun: close idle connections now, let open requests finish."""
        self._draining.set()
        if self._lane is not None:
            self._lane.drain()
        if not self._taskless:
            self._taskless_gone.set()
        for scope in list(self._idle_scopes):
            scope.cancel()

    async def aclose(self) -> None:
        await self.upstream.aclose()

    # -- one exchange -----------------------------------------------------------------

    def _sync_metrics(self) -> None:
        """The requests counted and the header times noted since the last sync, into
        `stats.requests` and `stats.upstream_seconds`."""
        lane = self._lane
        if lane is not None:
            # (plain attributes on the lane: an increment per request costs least so)
            for outcome, attribute in _LANE_OUTCOMES:
                count = getattr(lane, attribute)
                if count:
                    self.stats.lane.labels(outcome).inc(count)
                    setattr(lane, attribute, 0)
            for prefix, table in (("", lane.handed), ("h2_", lane.h2_handed)):
                for point, handed in table.items():
                    if handed:
                        self.stats.lane.labels(prefix + point.value).inc(handed)
                        table[point] = 0
        answered, self._answered = self._answered, {}
        for (route_host, status), count in answered.items():
            self._labelled(self.stats.requests, route_host, str(status)).inc(count)
        times, self._header_times = self._header_times, []
        by_route: dict[str, list[float]] = {}
        for route_host, seconds in times:
            by_route.setdefault(route_host, []).append(seconds)
        for route_host, values in by_route.items():
            _observe_all(self._labelled(self.stats.upstream_seconds, route_host), values)

    def _labelled(self, family: Any, *labels: str) -> Any:
        """`family.labels(*labels)`, looked up once per label set: prometheus_client's
        `labels()` costs more than the increment it leads to."""
        key = (id(family), *labels)
        child = self._children.get(key)
        if child is None:
            if len(self._children) >= MAX_CACHED_COUNTERS:
                self._children.clear()
            child = self._children[key] = family.labels(*labels)
        return child

    async def _exchange(self, conn: _Connection, ex: Exchange,
                        then: Callable[[Exchange], Coroutine[Any, Any, int]] | None = None,
                        held: int = 0, started: float | None = None) -> None:
        """One exchange, counted and logged however it ends. `then`: the rest of a
        story the lane began at `started`, holding `held` body bytes."""
        shares = [held]  # body bytes this exchange holds in `buffers`
        client = conn.client
        if started is None:
            started = conn.now()
        # counted however the exchange ends: an HTTP/2 stream the client resets, or whose
        # connection breaks, is cancelled rather than told, and a request the node may
        # have executed by then must still show in the counts and the log
        status = CLIENT_CLOSED
        try:
            if then is None:
                status = await self._story(conn, ex, client, shares, started)
            else:
                status = await then(ex)
        except _NodeBrokeOff:
            status = NODE_BROKE_OFF
        except ClientGone:
            status = CLIENT_CLOSED
        except Exception as exc:
            # a fault of ours (a bug), not the client's loss; a socket's error or a
            # deadline that escaped unnamed is still taken for the client's
            if not isinstance(exc, (*_CLIENT_WENT, OSError, trio.TooSlowError)):
                status = INTERNAL_FAULT
            raise
        finally:
            self.count(conn, ex.method, ex.target, status, started, shares[0])

    def count(self, conn: _Connection, method: str, target: bytes, status: int,
              started: float, held: int, now: float | None = None) -> None:
        """An exchange ended with `status`: its body's share given back, the answer
        counted (in the metric at the next collection), the access log line written."""
        if held:
            self.buffers.give(conn.client, held)
        answered = self._answered
        key = (conn.route_host, status)
        answered[key] = answered.get(key, 0) + 1
        # the target as the access log shows it: no query (queries carry tokens), at
        # most `LOG_PATH_MAX` characters; bytes that are not ASCII are escaped by the line
        path = target.split(b"?", 1)[0]
        if len(path) > LOG_PATH_MAX:
            path = path[:LOG_PATH_MAX]
        log.request(conn.log_prefix, method, path.decode("latin-1"), status,
                    ((conn.now() if now is None else now) - started) * 1000)

    def note_header_time(self, route_host: str, seconds: float) -> None:
        """How long the node took to its response head (into the histogram at the next
        collection, or now when many are waiting)."""
        times = self._header_times
        times.append((route_host, seconds))
        if len(times) >= MAX_PENDING_TIMES:
            self._sync_metrics()

    # -- the lane's story -------------------------------------------------------------

    def lane_story(self, conn: _Connection, req: Request | H2Exchange, body: bytes,
                   now: float) -> LaneGo | _Answer | None:
        """`_story` for a request the lane has whole (an HTTP/1.1 `Request`, or an
        `H2Exchange`, which has the same fields), as far as the node, in the same
        order: the checks that need no charge first (their failures go to the trio
        engine uncharged: None), then the charges (a refusal: the `_Answer`, the
        charges made), else what the lane forwards."""
        route = self._routes.get(conn.route_host)
        if route is None:
            return None
        tenant = self._tenants.get(route.tenant)
        limiter = self.limiter
        if tenant is None or type(limiter) is not LocalLimiter:
            return None
        method = req.method
        has_body = req.chunked if req.content_length is None else req.content_length > 0
        try:
            target = parse_target(req.target)
            host = check_host(req.host, target, conn.sni, route.host)
            check_single_valued(req.headers)
            scope = judge_scope(
                method, target, route.mcp_path, has_body=has_body,
                content_type=header(req.headers, b"content-type") if has_body else None,
                content_encoding=(header(req.headers, b"content-encoding")
                                  if method == "POST" else None))
        except BadRequest:
            return None
        mcp = scope is MCP_POST
        if len(body) > min(route.limits.max_body_bytes, INLINE_PARSE_BYTES) or (
                body and not mcp and method in NO_CONTENT_METHODS):
            return None
        budget = self._budgets.get(route.host) or Budget.from_limits(route.limits)
        ip_unit = limiter.pure.check_ip_unit(conn.client, now, budget, route.host)
        if isinstance(ip_unit, Limited):
            mcp_call = method == "POST" and in_mcp_scope(target.path, route.mcp_path)
            return _Answer.refusal(posture.refuse_rate_limited(
                posture.Forward(caller_keys=(None,), jsonrpc=mcp_call), ip_unit.retry_after))
        held = 0
        if mcp:
            if body:
                refused = self.buffers.take(conn.client, len(body))
                if refused is not None:
                    return _busy(refused)
                held = len(body)
            content_type = header(req.headers, b"content-type")
            decision = posture.check_request(posture.McpRequest(
                method, target.path,
                content_type.decode("latin-1") if content_type is not None else None, body),
                posture.Policy.for_route(route, tenant), self.wall_clock())
            keyed: Any = None
            if not isinstance(decision, posture.Refuse):
                keyed = limiter.pure.check_calls(conn.client_ip, decision.caller_keys, now,
                                                 budget=budget, scope=route.host, prepaid=1)
            if isinstance(decision, posture.Refuse) or isinstance(keyed, Limited):
                if held:
                    self.buffers.give(conn.client, held)
                return _Answer.refusal(decision if isinstance(decision, posture.Refuse)
                                       else posture.refuse_rate_limited(
                                           decision, keyed.retry_after))
        out = _node_headers(req.headers, conn.client_ip, host, method, req.content_length,
                            body)
        return LaneGo(route, tenant, host, target, out, body, held)

    #: the answer when a client has no share of the node left (the lane's too)
    too_many_in_flight: _Answer
    #: the lane's answers to an HTTP/2 stream: the node's answer broke off after its
    #: head; its head is larger than the client takes (as `_from_node` answers them)
    broke_off_answer: _Answer
    head_too_large_answer: _Answer

    @staticmethod
    def node_answer(status: int, headers: list[tuple[bytes, bytes]], body: bytes
                    ) -> _Answer:
        """The node's whole answer, for a stream worker to write (`Resume.WRITE`)."""
        return _Answer(status, body, tuple(headers))

    def shares_for(self, route: Route) -> Shares:
        """The clients' shares of `route`'s node (`_forward`'s first step takes one)."""
        return self._inflight_for(route)

    def lane_give(self, conn: _Connection, route: Route) -> None:
        self._inflight_for(route).give(conn.client, 1)

    @staticmethod
    def lane_failure(route: Route, exc: UpstreamError) -> _Answer:
        return _upstream_answer(route, exc)

    async def _story(self, conn: _Connection, ex: Exchange, client: str, held: list[int],
                     now: float) -> int:
        route = self._routes.get(conn.route_host)
        if route is None:
            return await self._answer(ex, conn, _Answer.text(
                421, "misdirected request: this host is no longer terminated here"))
        limits = route.limits
        budget = self._budgets.get(route.host) or Budget.from_limits(limits)
        limiter = self.limiter
        if type(limiter) is LocalLimiter:  # its own answer at once: no coroutine per request
            ip_unit = limiter.pure.check_ip_unit(client, now, budget, route.host)
        else:
            ip_unit = await limiter.check_calls(conn.client_ip, (None,), now, budget=budget,
                                                scope=route.host)
        try:
            target = parse_target(ex.target)
            host = check_host(ex.authority, target, conn.sni, route.host)
            check_single_valued(ex.headers)
        except BadRequest as exc:
            return await self._answer(ex, conn, _Answer.text(exc.status, exc.why))
        if isinstance(ip_unit, Limited):
            mcp = ex.method == "POST" and in_mcp_scope(target.path, route.mcp_path)
            forward = posture.Forward(caller_keys=(None,), jsonrpc=mcp)
            return await self._refuse(ex, conn, posture.refuse_rate_limited(
                forward, ip_unit.retry_after))
        tenant = self._tenants.get(route.tenant)
        if tenant is None:
            return await self._answer(ex, conn, _Answer.text(
                503, "route no longer configured", (b"retry-after", b"60")))
        # the fields `judge_scope` reads only for a body / a POST: not looked up otherwise
        has_body = ex.has_body
        method = ex.method
        try:
            scope = judge_scope(
                method, target, route.mcp_path, has_body=has_body,
                content_type=header(ex.headers, b"content-type") if has_body else None,
                content_encoding=(header(ex.headers, b"content-encoding")
                                  if method == "POST" else None))
        except BadRequest as exc:
            return await self._answer(ex, conn, _Answer.text(exc.status, exc.why))
        if ex.content_length is not None and ex.content_length > limits.max_body_bytes:
            return await self._answer(ex, conn, self._too_large(route))
        body_deadline = now + BODY_TIMEOUT
        body: bytes | AsyncIterator[bytes]
        if scope is MCP_POST:
            read = await self._read_mcp_body(ex, route, client, held, body_deadline)
            if isinstance(read, _Answer):
                return await self._answer(ex, conn, read)
            decision = await self._judge(ex, route, tenant, target, read)
            if isinstance(decision, posture.Refuse):
                return await self._refuse(ex, conn, decision)
            keyed = await self.limiter.check_calls(
                conn.client_ip, decision.caller_keys, trio.current_time(), budget=budget,
                scope=route.host, prepaid=1)
            if isinstance(keyed, Limited):
                return await self._refuse(
                    ex, conn, posture.refuse_rate_limited(decision, keyed.retry_after))
            body = read
        elif ex.body_done:
            body = b""
        elif method in NO_CONTENT_METHODS:
            # (see proto.http_request) what looked like a body may be none, an HTTP/2
            # stream ended by an empty DATA frame: only content that is there is refused
            if not await _nothing_more(ex, body_deadline):
                return await self._answer(ex, conn, _Answer.text(
                    400, f"a {method} request carries no content here"))
            body = b""
        else:
            body = _stream_body(ex, limits.max_body_bytes, body_deadline, limits.idle_timeout)
        return await self._forward(ex, conn, route, tenant, client, host, target, body)

    async def _read_mcp_body(self, ex: Exchange, route: Route, client: str, held: list[int],
                             deadline: float) -> bytes | _Answer:
        """The whole body, every byte counted in `buffers` before it is kept; or the
        answer to give. Bytes are counted as they come, not as declared: a head that
        declares the largest body and sends none of it would otherwise hold that much of
        the shares for the body's whole deadline, and a few such heads the whole
        process's."""
        cap = route.limits.max_body_bytes
        if ex.content_length is not None and ex.content_length > self.buffers.per_client:
            return _busy(Refused.CLIENT)  # no share could ever hold it: not read at all
        body = BodyBuffer()
        idle = route.limits.idle_timeout
        # a body that stops coming holds its buffer share: given up when idle too, as a
        # streamed body is, not only at the whole-body deadline
        while chunk := await ex.receive(min(deadline, trio.current_time() + idle)):
            size = body.size + len(chunk)
            if size > cap:
                return self._too_large(route)
            if size > held[0]:
                refused = self.buffers.take(client, size - held[0])
                if refused is not None:
                    return _busy(refused)
                held[0] = size
            body.add(chunk)
        return body.whole()

    async def _judge(self, ex: Exchange, route: Route, tenant: Tenant, target: Target,
                     payload: bytes) -> posture.Decision:
        content_type = header(ex.headers, b"content-type")
        request = posture.McpRequest(
            ex.method, target.path,
            content_type.decode("latin-1") if content_type is not None else None, payload)
        policy = posture.Policy.for_route(route, tenant)
        check = partial(posture.check_request, request, policy, self.wall_clock())
        if len(payload) <= INLINE_PARSE_BYTES:
            return check()
        return await trio.to_thread.run_sync(check, limiter=self._parse_slot)

    @staticmethod
    def _too_large(route: Route) -> _Answer:
        return _Answer.text(413, f"request body over {route.limits.max_body_bytes} bytes")

    # -- answering at the edge --------------------------------------------------------

    async def _refuse(self, ex: Exchange, conn: _Connection, refusal: posture.Refuse) -> int:
        return await self._answer(ex, conn, _Answer.refusal(refusal))

    async def _answer(self, ex: Exchange, conn: _Connection, answer: _Answer) -> int:
        """Answer without the node; stop the client's upload if it is still sending."""
        if answer.code is not None:
            self.stats.refusals.labels(route=conn.route_host, code=answer.code).inc()
            self.stats.refused(conn.route_host, conn.client_ip, answer.code)
            log.info("refused", route=conn.route_host, client=conn.client_ip, code=answer.code)
        ex.stop_body()
        headers = [*answer.headers, (b"content-length", str(len(answer.body)).encode())]
        try:
            await ex.respond_whole(answer.status, headers,
                                   answer.body if ex.method != "HEAD" else b"")
        except HeadTooLarge as exc:
            # The client takes no head of this size, so it can be told nothing: its
            # stream is reset, as for a client that left. Its own setting is the cause,
            # so the operator is not warned (it could have us warn on every request).
            raise ClientGone(str(exc)) from None
        return answer.status

    async def _head_too_large(self, ex: Exchange, conn: _Connection) -> int:
        self.note_head_too_large(conn)
        return await self._answer(ex, conn, self.head_too_large_answer)

    @staticmethod
    def note_head_too_large(conn: _Connection) -> None:
        """The node's head is fine, the client's advertised limit is small: its doing,
        so the line is info (the answer is `head_too_large_answer`)."""
        log.info("response_head_over_client_limit", route=conn.route_host,
                 client=conn.client_ip)

    # -- forwarding -------------------------------------------------------------------

    def _inflight_for(self, route: Route) -> Shares:
        per_client = route.limits.max_requests_in_flight_per_ip
        shares = self._inflight.get(route.host)
        if shares is None:
            shares = self._inflight[route.host] = Shares(per_client, UNBOUNDED)
        shares.per_client = per_client  # a reload may have changed it; counts stay
        return shares

    async def _forward(self, ex: Exchange, conn: _Connection, route: Route, tenant: Tenant,
                       client: str, host: str, target: Target,
                       body: bytes | AsyncIterator[bytes]) -> int:
        inflight = self._inflight_for(route)
        if inflight.take(client, 1) is not None:
            return await self._answer(ex, conn, _TOO_MANY_IN_FLIGHT)
        try:
            return await self._upstream(ex, conn, route, tenant, host, target, body)
        except _BodyTooLarge:
            return await self._answer(ex, conn, self._too_large(route))
        finally:
            inflight.give(client, 1)

    async def _upstream(self, ex: Exchange, conn: _Connection, route: Route, tenant: Tenant,
                        host: str, target: Target, body: bytes | AsyncIterator[bytes]) -> int:
        """The request to the node and its answer relayed (a node failure answered)."""
        out = _node_headers(ex.headers, conn.client_ip, host, ex.method, ex.content_length,
                            body)
        watch = ex.reset_watch()
        if watch is not None and watch.failed:
            watch.on_fin = None
            raise ClientGone("the client's connection failed before the node was asked")
        asked = self._from_node(ex, conn, route, self.upstream.request(
            route, tenant.pins, method=ex.method, host=host, target=target.origin_form,
            headers=out, body=body, idle_timeout=route.limits.idle_timeout), conn.now())
        if watch is None:
            return await asked
        if watch.ended and watch.on_fin is not None:  # its FIN came already
            hook, watch.on_fin = watch.on_fin, None
            hook()
        # a client that resets its connection meanwhile gives the node's request up at
        # once (its connect, handshake, upload or head), not at the node's timeouts: the
        # hub sees the reset and cancels the connection's scope (the exchange counts as
        # the client's loss), or a scope of the request's own on a connection that has
        # none yet (its first request, served before it ever waited)
        scope = ex.connection_scope()
        if scope is not None:
            watch.on_fail = scope.cancel
            try:
                return await asked
            finally:
                watch.on_fail = watch.on_fin = None
        with trio.CancelScope() as own:
            watch.on_fail = own.cancel
            try:
                return await asked
            finally:
                watch.on_fail = watch.on_fin = None
        raise ClientGone("the client's connection failed while the node was asked")

    async def _from_node(self, ex: Exchange, conn: _Connection, route: Route,
                         request: AbstractAsyncContextManager[UpstreamResponse],
                         started: float | None) -> int:
        """The node's answer relayed, or a node failure answered. `started`: when the
        request went out (None: its header time was noted already)."""
        try:
            async with request as response:
                if started is not None:
                    self.note_header_time(route.host, conn.now() - started)
                await self._relay(ex, route, response)
                return response.status
        except UpstreamError as exc:
            return await self._answer(ex, conn, _upstream_answer(route, exc))
        except HeadTooLarge:
            return await self._head_too_large(ex, conn)
        except BadResponse as exc:
            log.warning("upstream_bad_response", route=route.host, error=str(exc))
            return await self._answer(ex, conn, _Answer.text(
                502, "the home node sent a response that cannot be relayed"))

    async def _relay(self, ex: Exchange, route: Route, response: UpstreamResponse) -> None:
        headers = clean_response_headers(response.headers)
        if response.early:  # the node answered before it took the body, and closed
            ex.stop_body()
        whole = response.take_whole()
        if whole is not None:  # the whole answer is here: one write, no pump
            await ex.respond_whole(response.status, headers, whole)
            return
        await ex.respond(response.status, headers)
        broken: _BrokenOff | None = _BrokenOff.CLIENT  # stays so if the watch saw it go
        if ex.needs_watch(headers):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_cancel_when_gone, ex, nursery.cancel_scope)
                broken = await _pump(ex, route, response)
                nursery.cancel_scope.cancel()
        else:
            broken = await _pump(ex, route, response)
        if broken is _BrokenOff.NODE:
            raise _NodeBrokeOff("the node broke off its answer")
        if broken is not None:
            raise ClientGone("the response did not complete")


async def _pump(ex: Exchange, route: Route, response: UpstreamResponse
                ) -> _BrokenOff | None:
    """The response body to the client; None when it was delivered whole, else who
    broke it off."""
    try:
        async for chunk in response.body:
            await ex.send(chunk)
        await ex.end()
    except UpstreamError as exc:
        log.warning("upstream_body_failed", route=route.host, error=str(exc))
        await ex.abort()
        return _BrokenOff.NODE
    except ClientGone:
        return _BrokenOff.CLIENT
    return None


def _observe_all(histogram: Any, values: list[float]) -> None:
    """`histogram.observe(v)` for each of `values`, bucketed here and added with one
    increment per bucket (prometheus_client takes a lock per increment); observed one by
    one should the histogram not have the parts this relies on."""
    bounds = getattr(histogram, "_upper_bounds", None)
    buckets = getattr(histogram, "_buckets", None)
    total = getattr(histogram, "_sum", None)
    if bounds is None or buckets is None or total is None or len(bounds) != len(buckets):
        for value in values:
            histogram.observe(value)
        return
    counts: dict[int, int] = {}  # a Counter built from an iterable asks an ABC first
    for value in values:
        index = bisect.bisect_left(bounds, value)
        counts[index] = counts.get(index, 0) + 1
    total.inc(sum(values))
    for index, count in counts.items():
        buckets[index].inc(count)


def _server_tls(stream: trio.abc.Stream, ctx: ssl.SSLContext) -> ServerTLS | trio.SSLStream:
    """TLS over the socket itself when the router handed us one (the peeked ClientHello
    goes into the TLS engine first); any other stream gets trio's general SSLStream."""
    if isinstance(stream, ReplayStream):
        raw = getattr(stream.socket, "_sock", None)  # the stdlib socket trio wraps
        if isinstance(raw, socket.socket):
            return ServerTLS(raw, ctx, stream.take_pending())
    return trio.SSLStream(stream, ctx, server_side=True, https_compatible=True)


async def _cancel_when_gone(ex: Exchange, scope: trio.CancelScope) -> None:
    await ex.wait_gone()
    scope.cancel()


async def _nothing_more(ex: Exchange, deadline: float) -> bool:
    """The request carries no content: a declared length of zero (any byte beyond it
    breaks the stream's framing, which the HTTP/2 layer refuses), or no declared length
    and a stream that ended without a byte (a deadline passed, or the client left:
    ClientGone)."""
    if ex.content_length is not None:
        return ex.content_length == 0
    return not await ex.receive(deadline)


async def _stream_body(ex: Exchange, cap: int, deadline: float,
                       idle: float) -> AsyncIterator[bytes]:
    """A request body passed through as it arrives: capped, whole-body and idle bounded."""
    size = 0
    while True:
        chunk = await ex.receive(min(deadline, trio.current_time() + idle))
        if not chunk:
            return
        size += len(chunk)
        if size > cap:
            raise _BodyTooLarge()
        yield chunk


def _node_headers(headers: list[tuple[bytes, bytes]], client_ip: str, host: str,
                  method: str, content_length: int | None,
                  body: bytes | AsyncIterator[bytes]) -> list[tuple[bytes, bytes]]:
    """The request's headers as they go to the node: cleaned, `Forwarded` added, the
    body's framing said."""
    out = clean_request_headers(headers, client_ip=client_ip, host=host)
    if isinstance(body, bytes):
        if body or content_length is not None or method not in (
                "GET", "HEAD", "DELETE", "OPTIONS"):
            out.append((b"content-length", str(len(body)).encode()))
    elif content_length is not None:
        out.append((b"content-length", str(content_length).encode()))
    else:
        out.append((b"transfer-encoding", b"chunked"))
    return out


_TOO_MANY_IN_FLIGHT = _Answer.text(429, "too many requests in flight from your address",
                                   (b"retry-after", b"1"))
Terminator.too_many_in_flight = _TOO_MANY_IN_FLIGHT
Terminator.broke_off_answer = _Answer.text(NODE_BROKE_OFF, BROKE_OFF.decode().strip())
Terminator.head_too_large_answer = _Answer.text(
    502, "the home node's response head is larger than your client accepts")


def _busy(refused: Refused) -> _Answer:
    if refused is Refused.CLIENT:
        return _Answer.text(429, "too much request data in flight from your address",
                            (b"retry-after", b"1"))
    return _Answer.text(503, "the edge is busy", (b"retry-after", b"1"))


def _upstream_answer(route: Route, exc: UpstreamError) -> _Answer:
    if isinstance(exc, UpstreamBusy):  # logged once per shortage by the pool
        return _busy(Refused.TOTAL)
    if isinstance(exc, NodeUnreachable):
        log.warning("node_unreachable", route=route.host, error=str(exc))
        return _Answer.text(503, "the home node is offline",
                            (b"retry-after", str(RETRY_AFTER_OFFLINE).encode()))
    if isinstance(exc, UpstreamTLSError):
        log.error("upstream_tls_failed", route=route.host, expected=list(exc.expected),
                  seen=exc.seen, error=str(exc))
        return _Answer.text(502, "the home node failed authentication")
    if isinstance(exc, UpstreamTimeout):
        log.warning("upstream_timeout", route=route.host, error=str(exc))
        return _Answer.text(504, "the home node did not answer in time")
    log.warning("upstream_failed", route=route.host, error=str(exc))
    return _Answer.text(502, "the home node connection failed")


#: Longest request path an access log line carries; the rest is cut (a log line is for
#: an operator, and a client must not be able to make lines of any size).
LOG_PATH_MAX = 200
