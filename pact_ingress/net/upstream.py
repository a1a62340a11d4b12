"""Re-origination to the home node: pinned mTLS, pooled HTTP/1.1 keep-alive connections.

Theory of operation
-------------------
A terminate route ends the caller's TLS at the edge; the request then travels to the
tenant's home node over a TLS connection on which

* the edge presents its own PACT identity as client certificate (the node sees the
  ingress's fingerprint on the link, never the caller's — callers prove themselves in
  sealed envelopes, spec §13), and
* the node is accepted only if its SPKI fingerprint is one of the tenant's pins (two
  while a rotation runs, spec §2). No chain or hostname is checked: the pin is the whole
  of server authentication. A mismatch raises `UpstreamTLSError` carrying the expected
  and seen fingerprints.

The client is our own, small on purpose: every PACT node speaks HTTP/1.1, so we offer
ALPN `http/1.1` only, and a request costs one head write, one or two TLS reads and a
C parse. httpcore with HTTP/2 toward the node cost about 40% of the edge's CPU per
proxied request; HTTP/2 buys nothing on a loopback or LAN link to one node, where a
connection per in-flight request is cheap.

* **Parsing**: `proto.http_upstream` — llhttp via `httptools` (strict, C speed; h11 costs
  several times more per response in pure Python). Bodies are framed by Content-Length,
  chunked (trailers dropped) or the close of the connection; 1xx heads are skipped;
  HEAD/204/304 responses have no body.
* **TLS**: an `ssl.SSLObject` on memory BIOs. Over a configured address it drives the
  non-blocking socket directly (`wait_readable`/`wait_writable` only when the kernel has
  nothing), which skips `trio.SSLStream`'s locking and retry layers; over a tunnel
  stream it moves ciphertext with the stream's own `receive_some`/`send_all`. Each
  pool keeps the node's TLS session per SNI name so new connections resume instead of
  running a full handshake (the pin is still checked: a resumed session carries the
  node's certificate).
* **Pool**: one per (route host, backend, pins). Idle connections are reused last in,
  first out, expire after `KEEPALIVE_EXPIRY`, and are checked before every reuse (a
  `poll(2)`, and a read when it says something came): a connection the node closed, or
  wrote to with no request outstanding, is closed instead. Not even a connection used a
  moment ago skips it: bytes the node wrote after its answer (a second response, the
  tail of a body longer than its Content-Length) would otherwise be read as the answer
  to the next request, and that request's own answer as the answer to the one after, a
  desync that lasts as long as requests keep the connection busy. At most
  `MAX_CONNECTIONS_PER_ROUTE` are open; a request waits for a free one at most
  `header_timeout` (→ `UpstreamTimeout`). A reload that changes a route's backend or pins
  gets a fresh pool; the old one is retired: its idle connections close at once, and a
  running request's connection closes when that request ends, so a reload never cuts a
  running SSE stream.
* **Stale connections**: a pooled connection the node closed just as it was reused (after
  the check) fails on first use, before any response byte, or answers a `408` it wrote
  while idle. A replayable
  request — an idempotent method (GET, HEAD, OPTIONS, TRACE, PUT, DELETE) with a bytes
  body — is then sent once more on a fresh connection; any other (a POST such as every
  MCP call, a streamed body) is never sent twice: 502.
* **Early answers**: a node may answer before it has read the whole request body and
  close (RFC 9112 §9.3: a `413` with `Connection: close`). Its close fails our next
  write; the answer is then read from what the kernel holds, and when a final head came
  it is the response (`UpstreamResponse.early`: the caller stops the client's upload),
  not a 502 for the failed write. The connection is never reused.
* **Connection reuse**: only after a response read to its end with keep-alive. A
  response abandoned before its end (the client left, a 502 mid-body) closes its
  connection; what the node still sends for it can never be read as the next response.

Request body framing is the caller's: `net.terminate` appends `content-length` or
`transfer-encoding: chunked`, and we frame the body the way those headers say. A body
with neither header gets one here (Content-Length for bytes, chunked for a stream).

Failures are typed for the front to answer: `NodeUnreachable` → 503,
`UpstreamTLSError`/`UpstreamProtocolError` → 502, `UpstreamTimeout` → 504.

Time: connecting and the handshake are bounded by `connect_timeout` each; each write of
the request by the route's `idle_timeout`; the wait for response headers by
`header_timeout`, counted from the moment the request body has been fully handed over (a
slow upload is bounded by the per-read idle timeout instead, not by the header budget).
After the headers, each read of the body is bounded by `idle_timeout`, so SSE streams
can stay open for as long as bytes keep flowing.
"""

from __future__ import annotations

import math
import os
import select
import socket
import ssl
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field

import trio

from pact_ingress.errors import BackendError, EdgeShortage
from pact_ingress.identity import Identity, PinMismatch, check_pin, pinned_client_context
from pact_ingress.logs import log
from pact_ingress.model import Route
from pact_ingress.net.backends import Backends
from pact_ingress.net.deadlines import clock
from pact_ingress.net.h2_node import HTTP1, UNTRIED, NodeProtocol, NodeSession
from pact_ingress.net.memory_tls import READ_SIZE, WRITE_SLICE, MemoryTLS
from pact_ingress.net.shortage import ShortageEpisode
from pact_ingress.proto.http_upstream import ResponseError, ResponseParser, request_head

#: Time to response headers once the request body has been sent (→ 504 to the caller).
DEFAULT_HEADER_TIMEOUT = 30.0
#: Connecting to a backend (address or tunnel) and the pinned TLS handshake, each.
CONNECT_TIMEOUT = 10.0
#: Connections per pool (per route). HTTP/1.1 needs one per concurrent request (an SSE
#: stream holds one for its life); the per-client share in terminate keeps one address
#: from holding them all.
MAX_CONNECTIONS_PER_ROUTE = 100
#: Idle pooled connections are closed after this; home nodes drop idle peers too.
KEEPALIVE_EXPIRY = 60.0
#: Methods whose request may be sent to the node a second time (RFC 9110 §9.2.2).
IDEMPOTENT = frozenset({"GET", "HEAD", "OPTIONS", "TRACE", "PUT", "DELETE"})
#: Pool keys remembered per route object (a route's key is the same on every request).
MAX_KNOWN_ROUTES = 4096
#: TLS sessions a pool keeps for resumption, one per SNI name (a wildcard route sees
#: many names; beyond this the oldest is forgotten).
MAX_SESSIONS_PER_POOL = 64

ALPN = ("http/1.1",)
#: What the keep-alive lane offers when it tries a node for HTTP/2 (`net/h2_node.py`).
ALPN_H2 = ("h2", "http/1.1")
#: Whether the lane tries nodes for HTTP/2 at all; `PACT_INGRESS_NODE_H2=0` keeps every
#: node leg on HTTP/1.1.
NODE_H2 = os.environ.get("PACT_INGRESS_NODE_H2", "1") != "0"


class UpstreamError(BackendError):
    """Re-origination failed; `status` is the HTTP status the front answers with."""

    status = 502


class NodeUnreachable(UpstreamError):
    """The backend could not be reached (address down, tunnel not connected)."""

    status = 503


class UpstreamBusy(UpstreamError):
    """The edge had no fd (or kernel memory) for a connection to the node: its own
    shortage, which a client should retry shortly; the node may well be up."""

    status = 503


class UpstreamTLSError(UpstreamError):
    """The pinned TLS handshake failed or the node's key is not pinned."""

    status = 502

    def __init__(self, message: str, *, expected: Iterable[str] = (), seen: str | None = None):
        super().__init__(message)
        self.expected = tuple(expected)
        self.seen = seen


class UpstreamProtocolError(UpstreamError):
    """The node broke HTTP (closed early, sent garbage, refused our certificate)."""

    status = 502


class _StaleConnection(Exception):
    """The node connection failed before response headers (maybe a dead pooled one)."""


class UpstreamTimeout(UpstreamError):
    """No response headers within the header timeout."""

    status = 504


class _Broken(Exception):
    """The link to the node failed (reset, closed, TLS error) in the middle of an exchange."""


# --- one TLS connection ---------------------------------------------------------------------


class _Conn(MemoryTLS):
    """A pinned TLS connection to a node (`MemoryTLS`, client side).

    Over a `trio.SocketStream` the ciphertext goes straight through the stdlib socket
    underneath it; over any other stream (a tunnel) through `receive_some`/`send_all`.
    Only one task uses a connection at a time: the pool hands it to one request.
    """

    def __init__(self, stream: trio.abc.Stream, context: ssl.SSLContext, sni: str,
                 session: ssl.SSLSession | None) -> None:
        self.stream = stream
        self.sni = sni
        self.idle_since = 0.0
        self.session_saved = False
        self.dead = False  # `alive` said no: it says so again without a syscall
        #: the node answered before it took the whole request (`_answered_early`)
        self.answered_early = False
        self._sock: trio.socket.SocketType | None = None
        raw: socket.socket | None = None
        if isinstance(stream, trio.SocketStream):
            self._sock = stream.socket
            # trio keeps the stdlib socket it wraps here; without it we fall back to the
            # stream's own methods, which work on any stream, only slower.
            inner = getattr(stream.socket, "_sock", None)
            raw = inner if isinstance(inner, socket.socket) else None
        incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        super().__init__(
            context.wrap_bio(incoming, outgoing, server_hostname=sni or None, session=session),
            incoming, outgoing, raw=raw, stream=None if raw is not None else stream)
        self._hubbed = raw is not None  # `aclose` closes the Watch before the socket
        if raw is not None:  # `alive`'s look at the socket (poll(2): no fd of its own)
            self._poll = select.poll()
            self._poll.register(raw, select.POLLIN)

    def _broken(self, why: str) -> Exception:
        return _Broken(f"the link to the node failed: {why}")

    async def send(self, data: bytes | bytearray | memoryview,
                   deadline: float = math.inf) -> None:
        """All of `data` to the node; `trio.TooSlowError` at `deadline`."""
        await self.write(data, deadline)

    async def recv(self, deadline: float = math.inf, wait_first: bool = False) -> bytes:
        """Plaintext from the node (at most `READ_SIZE`), b"" when it closed the link;
        `trio.TooSlowError` when nothing came by `deadline`."""
        return await self.read(READ_SIZE, deadline, wait_first)

    def alive(self) -> bool:
        """Cheap check before reuse: has the node closed (or written to) an idle connection?

        Reads whatever the socket holds without blocking. Nothing: alive. TLS records
        that carry no application data (TLS 1.3 session tickets arriving late): alive.
        End of stream, an alert or unsolicited application data: dead. Over a tunnel
        stream nothing can be checked without blocking; the stale retry covers it.
        """
        raw = self._raw
        if raw is None or self.dead:
            return not self.dead
        if not self._poll.poll(0):  # the usual answer, without a failed read's exception
            return True
        self.dead = True
        try:
            data = raw.recv(READ_SIZE)
        except BlockingIOError:
            self.dead = False
            return True
        except OSError:
            return False
        if not data:
            return False
        if len(data) == READ_SIZE and self._watch is not None:
            self._watch.readable = True  # more may be left (`MemoryTLS.read`)
        self._in.write(data)
        try:
            self._ssl.read(1)
        except ssl.SSLWantReadError:
            self.dead = False
            return True
        except ssl.SSLError:
            return False
        return False

    def quiet(self) -> bool:
        """Nothing from the node waits unread in the TLS engine. A read returns one TLS
        record's plaintext, so bytes the node wrote after the response just read (a
        second response, the rest of a body longer than its Content-Length) may sit here
        in a record of their own, where `alive` (which looks at the socket) cannot see
        them, and would be read as the answer to the next request. Records that carry
        no application data (a session ticket, a key update) are taken here."""
        if not (self._in.pending or self._sslobj.pending()):
            return True
        try:
            self._sslobj.read(1)
        except ssl.SSLWantReadError:
            return True
        except ssl.SSLError:
            return False
        return False

    def close_now(self) -> None:
        """`aclose` for a connection over a socket of ours (`_raw`), which has nothing
        to await."""
        assert self._sock is not None
        self._close_watch()
        self._sock.close()

    async def aclose(self) -> None:
        if self._sock is not None:
            self._close_watch()
            self._sock.close()  # no close_notify: the node treats EOF as the end
        else:
            await trio.aclose_forcefully(self.stream)


# --- pools ------------------------------------------------------------------------------------

PoolKey = tuple[str, str, tuple[str, ...]]


class _Pool:
    """Connections to one route's node for one set of pins (see module docstring)."""

    def __init__(self, upstream: Upstream, route: Route, pins: tuple[str, ...]) -> None:
        self.upstream = upstream
        self.route = route
        self.pins = pins
        self.idle: list[_Conn] = []  # oldest first; reuse takes from the end
        self.open = 0  # connections open, idle or carrying a request
        self.active = 0  # requests in flight
        self.retired = False
        #: what the node speaks to the lane (`net/h2_node.py`), and its HTTP/2 session
        self.protocol: NodeProtocol = UNTRIED if NODE_H2 else HTTP1
        self.session: NodeSession | None = None
        self.sessions: dict[str, ssl.SSLSession] = {}
        self._freed = trio.lowlevel.ParkingLot()
        self.waiting = 0  # tasks parked in `_freed` (a number: no call to ask the lot)
        self.now = clock()  # trio.current_time, cheaper

    @property
    def connections(self) -> list[_Conn]:
        """The idle connections (for tests and status)."""
        return list(self.idle)

    async def acquire(self, sni: str, deadline: float, *, fresh: bool,
                      offer_h2: bool = False) -> tuple[_Conn, bool]:
        """A connection for `sni` and whether it was reused; waits for a slot until
        `deadline` (→ UpstreamTimeout). `offer_h2`: a new connection, offering `h2` as
        well (the lane's try for a session; the caller looks at what the node chose)."""
        if offer_h2:
            fresh = True
        while True:
            idle = self.idle
            if idle:
                now = trio.current_time()
                if idle[0].idle_since + KEEPALIVE_EXPIRY < now:
                    await self._expire()
            if not fresh and (conn := self._idle_for(sni)) is not None:
                if conn.alive():
                    return conn, True
                await self.discard(conn)
                continue  # closed by the node while idle: try the next one
            if self.open < MAX_CONNECTIONS_PER_ROUTE:
                self.open += 1
                try:
                    return await self._connect(sni, offer_h2), False
                except BaseException:
                    self.open -= 1
                    self._freed.unpark()
                    raise
            if self.idle:  # full, but an idle connection (to another name) can make room
                await self.discard(self.idle.pop(0))
                continue
            with trio.move_on_at(deadline):
                self.waiting += 1
                try:
                    await self._freed.park()
                finally:
                    self.waiting -= 1
                continue
            raise UpstreamTimeout(
                f"all {MAX_CONNECTIONS_PER_ROUTE} connections to the node are busy")

    def take_recent(self, sni: str, now: float) -> _Conn | None:
        """`acquire`'s usual case for a replayable request, without awaiting: the most
        recently used idle connection, when it is for `sni`, not expired and alive; None
        sends the caller to `acquire` (which closes it if it is dead)."""
        idle = self.idle
        if not idle:
            return None
        conn = idle[-1]
        if (conn.sni != sni or idle[0].idle_since + KEEPALIVE_EXPIRY < now
                or not conn.alive()):
            return None
        return idle.pop()

    def take_idle(self, sni: str, now: float) -> _Conn | None:
        """`acquire`'s usual case without awaiting, for a caller that drives the socket
        itself (the keep-alive lane): the most recently used idle connection, when it is
        for `sni`, over a socket of ours, not expired and alive; None sends the caller to
        `acquire` (which closes what is dead or expired)."""
        idle = self.idle
        if not idle or self.retired:
            return None
        conn = idle[-1]
        if (conn.sni != sni or conn._raw is None or conn._held
                or idle[0].idle_since + KEEPALIVE_EXPIRY < now or not conn.alive()):
            return None
        return idle.pop()

    def drop(self, conn: _Conn) -> None:
        """`discard` for a connection `take_idle` gave out."""
        self.open -= 1
        self._freed.unpark()
        conn.close_now()

    def _idle_for(self, sni: str) -> _Conn | None:
        """The most recently used idle connection for `sni`, taken off the idle list."""
        idle = self.idle
        for i in range(len(idle) - 1, -1, -1):
            if idle[i].sni == sni:
                return idle.pop(i)
        return None

    async def _connect(self, sni: str, offer_h2: bool = False) -> _Conn:
        up = self.upstream
        try:
            with trio.fail_after(up.connect_timeout):
                stream = await up.backends.connect(self.route)
        except trio.TooSlowError as exc:
            raise NodeUnreachable(f"backend {self.route.backend} did not answer") from exc
        except EdgeShortage as exc:
            up.shortage.failed(str(exc), trio.current_time())
            raise UpstreamBusy(str(exc)) from exc
        except BackendError as exc:
            raise NodeUnreachable(str(exc)) from exc
        if up.shortage.failures:
            up.shortage.accepted(trio.current_time())
        if offer_h2:
            conn = _Conn(stream, up.context_h2, sni, None)
            # (a TLS session resumes only under the context that made it: this one's is
            # not kept for the pool's HTTP/1.1 connections)
            conn.session_saved = True
        else:
            conn = _Conn(stream, up.context, sni, self.sessions.get(sni))
        try:
            with trio.fail_after(up.connect_timeout):
                await conn.handshake()
            check_pin(conn.ssl_object, self.pins)
        except PinMismatch as exc:
            await conn.aclose()
            raise UpstreamTLSError(str(exc), expected=exc.expected, seen=exc.seen) from exc
        except (_Broken, ssl.SSLError, trio.TooSlowError) as exc:
            await conn.aclose()
            raise UpstreamTLSError(f"TLS handshake with the node failed: {exc.__cause__ or exc}",
                                   expected=self.pins) from exc
        except BaseException:
            await conn.aclose()
            raise
        return conn

    async def release(self, conn: _Conn, reusable: bool) -> None:
        """A request is done with `conn`: back to the idle list, or closed."""
        if not self.keep(conn, reusable):
            await self.discard(conn)

    def keep(self, conn: _Conn, reusable: bool, now: float | None = None) -> bool:
        """Put `conn` back on the idle list if it may be reused (True); else the caller
        must `discard` it. `now`: the caller's clock reading, if it has one."""
        if reusable and not self.retired and conn.quiet():
            if not conn.session_saved:
                # By the end of a response the node's TLS 1.3 tickets have arrived, so
                # this session can be resumed by the next connection.
                conn.session_saved = True
                session = conn.ssl_object.session
                if session is not None:
                    if len(self.sessions) >= MAX_SESSIONS_PER_POOL:
                        self.sessions.pop(next(iter(self.sessions)))
                    self.sessions[conn.sni] = session
            conn.idle_since = self.now() if now is None else now
            self.idle.append(conn)
            if self.waiting:
                self._freed.unpark()
            return True
        return False

    async def discard(self, conn: _Conn) -> None:
        self.open -= 1
        self._freed.unpark()
        await conn.aclose()

    async def _expire(self) -> None:
        idle = self.idle
        cutoff = trio.current_time() - KEEPALIVE_EXPIRY
        while idle and idle[0].idle_since < cutoff:
            await self.discard(idle.pop(0))

    async def close_idle(self) -> None:
        session = self.session
        if session is not None and not session.holders:
            session.close()
        while self.idle:
            await self.discard(self.idle.pop())


@dataclass
class UpstreamResponse:
    """Response headers from the node, and its body as an async iterator of chunks."""

    status: int
    headers: list[tuple[bytes, bytes]]
    http_version: str
    body: AsyncIterator[bytes] = field(repr=False)  # a _Body
    #: the node answered before it had taken the whole request body, and closed: the
    #: rest of the client's upload goes nowhere and must be stopped
    early: bool = False

    def take_whole(self) -> bytes | None:
        """The whole body when all of it has arrived already (a small answer comes in
        one read with its head), and `body` then yields nothing; else None."""
        body = self.body
        return body.take_whole() if isinstance(body, _Body) else None


class Upstream:
    """Pinned, pooled HTTP/1.1 client toward home nodes (see module docstring)."""

    def __init__(
        self,
        identity: Identity,
        backends: Backends,
        *,
        header_timeout: float = DEFAULT_HEADER_TIMEOUT,
        connect_timeout: float = CONNECT_TIMEOUT,
    ) -> None:
        self.identity = identity
        self.backends = backends
        self.header_timeout = header_timeout
        self.connect_timeout = connect_timeout
        self.context = pinned_client_context(identity, alpn=ALPN)
        self.context_h2 = pinned_client_context(identity, alpn=ALPN_H2)
        #: node connections that found no fd: one line when that starts, one when it ends
        self.shortage = ShortageEpisode("upstream_no_fds", backoff=False,
                                        resumed="upstream_fds_back")
        self._pools: dict[PoolKey, _Pool] = {}
        self._retired: list[_Pool] = []
        self._keys: dict[int, tuple[Route, tuple[str, ...], PoolKey]] = {}

    @staticmethod
    def _key(route: Route, pins: tuple[str, ...]) -> PoolKey:
        return (route.host, str(route.backend), tuple(sorted(pins)))

    def retain(self, live: Iterable[tuple[Route, tuple[str, ...]]]) -> None:
        """Keep pools for these (route, pins); retire the rest (closed when idle)."""
        self._keys.clear()
        keep = {self._key(r, p) for r, p in live}
        idle = False
        for key in [k for k in self._pools if k not in keep]:
            entry = self._pools.pop(key)
            entry.retired = True
            self._retired.append(entry)
            idle = idle or bool(entry.idle) or entry.session is not None
        if idle:
            # Now, not when a later request happens to end in this process: a pin
            # removed is a key revoked, and its node keeps no connection from us.
            trio.lowlevel.spawn_system_task(self._reap_quietly, name="upstream.reap")

    async def _reap_quietly(self) -> None:
        try:
            await self._reap()
        except Exception as exc:  # noqa: BLE001 - a failing system task ends the run
            log.warning("upstream_reap_failed", error=repr(exc))

    def _pool_for(self, route: Route, pins: tuple[str, ...]) -> _Pool:
        known = self._keys.get(id(route))
        if known is not None and known[0] is route and known[1] is pins:
            key = known[2]  # the same config objects as last time: their key
        else:
            key = self._key(route, pins)
            if len(self._keys) >= MAX_KNOWN_ROUTES:
                self._keys.clear()
            self._keys[id(route)] = (route, pins, key)  # holding route keeps its id unique
        entry = self._pools.get(key)
        if entry is None:
            entry = self._pools[key] = _Pool(self, route, tuple(pins))
        return entry

    async def _reap(self) -> None:
        """Close what retired pools hold idle; forget those with nothing in flight."""
        with trio.CancelScope(shield=True):
            for entry in self._retired:
                await entry.close_idle()
        self._retired = [e for e in self._retired if e.active > 0]

    def request(
        self,
        route: Route,
        pins: tuple[str, ...],
        *,
        method: str,
        host: str,
        target: bytes,
        headers: list[tuple[bytes, bytes]],
        body: bytes | AsyncIterable[bytes],
        idle_timeout: float,
    ) -> AbstractAsyncContextManager[UpstreamResponse]:
        """Send one request to `route`'s node; `async with` it: entered once response
        headers arrived.

        `host` is the authority the caller asked for (also our SNI toward the node).
        Raises an `UpstreamError` subclass on entering; after that, a broken body ends
        the body iterator with `UpstreamProtocolError`, an idle one with
        `UpstreamTimeout`. Leaving gives the connection back to the pool (or closes it).
        """
        return _Request(self, self._pool_for(route, pins), method, host, target, headers,
                        body, idle_timeout)

    async def _exchange(
        self,
        entry: _Pool,
        method: str,
        host: str,
        target: bytes,
        headers: list[tuple[bytes, bytes]],
        body: bytes | AsyncIterable[bytes],
        idle_timeout: float,
    ) -> tuple[_Conn, ResponseParser]:
        """Send the request and read the response head, retrying once when the pooled
        connection it went out on turns out to have been closed by the node."""
        head, chunked = _frame(method, target, headers, body)
        # sent again after a stale connection only when sending it twice is harmless: a
        # proxy must not retry what the node may have acted on (a POST: every MCP call)
        replayable = method in IDEMPOTENT and isinstance(body, bytes | bytearray)
        now = entry.now()
        pool_deadline = now + self.header_timeout
        fresh = False
        while True:
            conn = None if fresh or not replayable else entry.take_recent(host, now)
            if conn is not None:
                reused = True
            else:
                conn, reused = await entry.acquire(host, pool_deadline, fresh=fresh)
            try:
                parser = await self._send(conn, method, head, body, chunked, idle_timeout,
                                          entry.now)
                if parser.status != 408 or not (reused and replayable):
                    return conn, parser
                # A 408 on a reused connection is the node timing out the idle connection:
                # it may write that before closing, and when it crossed our check before
                # reuse nothing read it before our request went out, so it is no answer
                # to this request (408 says the node took none). Like a silent close:
                # resend once, fresh.
                with trio.CancelScope(shield=True):
                    await entry.release(conn, False)
                fresh = True
            except _StaleConnection as exc:
                with trio.CancelScope(shield=True):
                    await entry.release(conn, False)
                if not (reused and replayable):
                    raise UpstreamProtocolError(str(exc)) from exc
                fresh = True  # once: the retry never takes a pooled connection
            except BaseException:
                with trio.CancelScope(shield=True):
                    await entry.release(conn, False)
                raise

    async def _send(
        self,
        conn: _Conn,
        method: str,
        head: bytes,
        body: bytes | AsyncIterable[bytes],
        chunked: bool,
        idle_timeout: float,
        now: Callable[[], float],
    ) -> ResponseParser:
        parser = ResponseParser(method)
        try:
            buffered = isinstance(body, bytes | bytearray)
            try:
                try:
                    deadline = now() + idle_timeout
                    if buffered and body and len(head) + len(body) <= WRITE_SLICE:
                        await conn.write(head + body, deadline)  # one TLS record for it all
                    else:
                        await conn.write(head, deadline)
                        if buffered and body:
                            await conn.write(body, deadline)
                except trio.TooSlowError:
                    raise UpstreamTimeout("the node did not take the request in time") from None
                if not buffered:
                    await _send_stream(conn, body, chunked,  # type: ignore[arg-type]
                                       idle_timeout)
            except _Broken:
                if await _answered_early(conn, parser, now() + self.header_timeout):
                    return parser
                raise
            deadline = now() + self.header_timeout
            wait_first = True  # the node cannot have answered a request just sent
            try:
                while not parser.head_done:
                    data = await conn.read(READ_SIZE, deadline, wait_first)
                    wait_first = False
                    if data:
                        parser.feed(data)
                    else:
                        parser.feed_eof()
            except trio.TooSlowError:
                raise UpstreamTimeout(
                    f"no response headers within {self.header_timeout:g} s") from None
        except ResponseError as exc:
            if parser.received == 0:  # closed before answering at all: maybe stale
                raise _StaleConnection(f"node connection closed: {exc}") from exc
            raise UpstreamProtocolError(f"node broke HTTP: {exc}") from exc
        except _Broken as exc:
            if parser.received == 0:
                raise _StaleConnection(str(exc)) from exc
            raise UpstreamProtocolError(str(exc)) from exc
        return parser

    def pool(self, route: Route, pins: tuple[str, ...]) -> _Pool:
        """The pool `request` would use for `route` (the keep-alive lane takes its idle
        connections from it)."""
        return self._pool_for(route, pins)

    def adopt(self, entry: _Pool, conn: _Conn, parser: ResponseParser,
              idle_timeout: float) -> AbstractAsyncContextManager[UpstreamResponse]:
        """`request`'s context for an exchange that went out elsewhere (the keep-alive
        lane: it took `conn` with `take_idle`, counted it in `entry.active`, and has the
        response head in `parser`): the rest of the body is read from here, and leaving
        gives the connection back as `request` does."""
        return _Adopted(self, entry, conn, parser, idle_timeout)

    async def aclose(self) -> None:
        """Close every pooled connection (shutdown); requests still running close theirs."""
        pools = [*self._pools.values(), *self._retired]
        self._pools.clear()
        self._retired.clear()
        with trio.CancelScope(shield=True):
            for entry in pools:
                entry.retired = True
                await entry.close_idle()


class _Request:
    """`Upstream.request`'s context: a pool slot and connection held from entering (the
    response head is in) to leaving (the connection pooled again or closed)."""

    __slots__ = ("_up", "_entry", "_args", "_conn", "_parser", "_body")

    def __init__(self, up: Upstream, entry: _Pool, *args: object) -> None:
        self._up = up
        self._entry = entry
        self._args = args

    async def __aenter__(self) -> UpstreamResponse:
        up, entry = self._up, self._entry
        entry.active += 1
        try:
            conn, parser = await up._exchange(entry, *self._args)  # type: ignore[arg-type]
        except BaseException:
            entry.active -= 1
            if up._retired:
                await up._reap()
            raise
        self._conn, self._parser = conn, parser
        self._body = _Body(conn, parser, self._args[-1])  # type: ignore[arg-type]
        return UpstreamResponse(parser.status, parser.headers, parser.version, self._body,
                                conn.answered_early)

    async def __aexit__(self, *exc_info: object) -> None:
        up, entry = self._up, self._entry
        try:
            if not entry.keep(self._conn, self._body.complete and self._parser.keep_alive):
                with trio.CancelScope(shield=True):
                    await entry.discard(self._conn)
        finally:
            entry.active -= 1
            if up._retired:
                await up._reap()


class _Adopted(_Request):
    """`_Request` entered already: the request went out and the head came elsewhere."""

    __slots__ = ()

    def __init__(self, up: Upstream, entry: _Pool, conn: _Conn, parser: ResponseParser,
                 idle_timeout: float) -> None:
        self._up, self._entry, self._args = up, entry, (idle_timeout,)
        self._conn, self._parser = conn, parser
        self._body = _Body(conn, parser, idle_timeout)

    async def __aenter__(self) -> UpstreamResponse:
        parser = self._parser
        return UpstreamResponse(parser.status, parser.headers, parser.version, self._body)


def _frame(method: str, target: bytes, headers: list[tuple[bytes, bytes]],
           body: bytes | AsyncIterable[bytes]) -> tuple[bytes, bool]:
    """The request head, and whether a streamed body goes out chunked.

    The caller's framing headers decide; a body without any gets Content-Length (bytes)
    or chunked (a stream) here.
    """
    chunked = length = False
    for name, value in headers:
        if name == b"transfer-encoding":
            chunked = value.lower() == b"chunked"
        elif name == b"content-length":
            length = True
    if isinstance(body, bytes | bytearray):
        if chunked:
            raise UpstreamProtocolError("a buffered body is sent with a Content-Length")
        if not length and body:
            headers = [*headers, (b"content-length", str(len(body)).encode())]
    elif not chunked and not length:
        headers = [*headers, (b"transfer-encoding", b"chunked")]
        chunked = True
    try:
        return request_head(method, target, headers), chunked
    except (ValueError, UnicodeEncodeError) as exc:
        raise UpstreamProtocolError(f"request cannot be sent: {exc}") from exc


async def _answered_early(conn: _Conn, parser: ResponseParser, deadline: float) -> bool:
    """After a write of the request failed: did the node answer before it closed?

    A node may answer before it has read the whole body and then close (RFC 9112 §9.3:
    a `413` with `Connection: close`); the close fails our next write, and its answer
    waits whole in our receive buffer. That answer is the client's, not a 502 for the
    link. What the kernel still has for us is read (the link is closed, so that ends at
    once); True when a final response head came, and the body follows from the same
    buffer. The connection is never reused, and the response says the request body
    was cut short (`answered_early`), so the client's upload is stopped as for the
    edge's own early answers."""
    conn.discard_unsent()  # never sent before a read: the link is closed
    try:
        while not parser.head_done:
            data = await conn.read(READ_SIZE, deadline)
            if data:
                parser.feed(data)
            else:
                parser.feed_eof()
    except (_Broken, ResponseError, trio.TooSlowError):
        return False
    parser.keep_alive = False
    conn.answered_early = True
    return True


async def _send_stream(conn: _Conn, body: AsyncIterable[bytes], chunked: bool,
                       idle_timeout: float) -> None:
    """A streamed request body, each write bounded by the idle timeout."""
    try:
        async for chunk in body:
            if not chunk:
                continue
            deadline = trio.current_time() + idle_timeout
            if chunked:
                await conn.send(b"%x\r\n%b\r\n" % (len(chunk), chunk), deadline)
            else:
                await conn.send(chunk, deadline)
        if chunked:
            await conn.send(b"0\r\n\r\n", trio.current_time() + idle_timeout)
    except trio.TooSlowError:
        raise UpstreamTimeout("the node did not take the request body in time") from None


class _Body:
    """The node's response body as an async iterator; `complete` once it ended normally."""

    __slots__ = ("_conn", "_parser", "_idle", "complete")

    def __init__(self, conn: _Conn, parser: ResponseParser, idle_timeout: float) -> None:
        self._conn = conn
        self._parser = parser
        self._idle = idle_timeout
        self.complete = parser.done and not parser._pieces

    def take_whole(self) -> bytes | None:
        parser = self._parser
        if not parser.done:
            return None
        self.complete = True
        return parser.take_body()

    def __aiter__(self) -> _Body:
        return self

    async def __anext__(self) -> bytes:
        parser = self._parser
        while True:
            piece = parser.take_body()
            if parser.done:
                self.complete = True
            if piece:
                return piece
            if parser.done:
                raise StopAsyncIteration
            try:
                data = await self._conn.recv(trio.current_time() + self._idle)
            except _Broken as exc:
                raise UpstreamProtocolError(f"node body broke: {exc}") from exc
            except trio.TooSlowError:
                raise UpstreamTimeout("node body idle too long") from None
            try:
                if data:
                    parser.feed(data)
                else:
                    parser.feed_eof()
            except ResponseError as exc:
                raise UpstreamProtocolError(f"node body broke: {exc}") from exc
