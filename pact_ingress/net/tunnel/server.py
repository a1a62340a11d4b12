"""Reverse tunnel, ingress side: connectors dial in, routes with `backend: tunnel` dial out.

Theory of operation
-------------------
A home node behind NAT runs `pact-ingress connect`, which dials this ingress on :443.
The router hands us two kinds of connection (`handle`):

* **control** (TLS, SNI = `tunnel.hostname`, ALPN `pact-tunnel/1`), one per connector
  `connections` slot: pinned mutual TLS carrying small frames (`proto.tunnel.frames`):
  HELLO/WELCOME, PING/PONG heartbeats, TOKEN grants, GOAWAY. It never carries payload.
* **data**, one per stream: a plain TCP connection that starts with `RAW_DATA_MAGIC`
  and a DATA_HELLO frame carrying one single-use TOKEN (the router checks the magic
  before it parses a ClientHello); we answer DATA_OK and the connection waits in its
  control session's idle pool until `open_stream` hands it (as a plain
  `trio.SocketStream`) to a route; the connector, on the first byte, connects its
  `forward` address and relays. Fallback (connector `data_transport="tls"`, or chosen
  by the connector itself when raw ones keep failing, e.g. behind a "TLS only on 443"
  middlebox): the same DATA_HELLO/DATA_OK inside pinned mutual TLS (ALPN
  `pact-tunnel-data/1`), then both ends exchange close_notify and the TCP connection
  carries raw bytes. We accept both, always.

Why raw data connections (the design choice): the bench (tests/bench, "Tunnel") showed
the per-stream TLS handshake of the data connection to be the tunnel's cost: ~3 ms of
edge CPU and ~5 ms of connector CPU per stream, do_handshake ~25% of each side's busy
time, new connections/s through the tunnel capped near 100-150/s, and +2-4 ms p99 on
stream open. TLS 1.3 resumption would save the signature and certificate checks but
keep an ECDHE, both handshake round trips through pyOpenSSL/trio, and the close_notify
exchange; the token was the real credential already. A raw data connection costs one
TCP connect and one small write at the connector, one read and one 3-byte write here.

Why pooled raw data connections and not streams multiplexed over one TLS pipe: h2
multiplexing over one TLS connection measured ~10× below a direct splice here (Python
decrypts and re-encrypts every byte, twice). Here payload bytes never enter Python: the
router splices caller ↔ data connection and the connector splices data connection ↔
forward, so the tunnel costs one extra kernel hop. The pool keeps stream opening off the
network: `open_stream` pops an idle connection (one non-blocking MSG_PEEK to check it is
still alive). The pool size adapts to the open rate × the path's refill latency
(`proto.tunnel.session.PoolSizer`: a windowed minimum, so refills queued behind each
other cannot inflate the pool), within [POOL_MIN, POOL_MAX].

Refilling without a word per stream: two kinds of token. A TOKEN means "dial one data
connection now"; we send them when the pool is short of its target (at start, growth,
waiters). A SPARE means "keep this; when one of this session's data connections starts
carrying a stream, dial its replacement with it". The connector holds a stock of spares
(SPARE_MIN..SPARE_MAX, topped up in one TLS record once below half), so the steady
state is: a stream is taken, the connector replaces its connection by itself a few ms
after the stream's first answer (REPLACE_DELAY there), and the control connection
carries nothing. The earlier design sent one TOKEN per take; the bench showed that
control write, its decryption at the connector and the dial landing on the opening
stream's first-byte path on both ends (+0.3–0.6 ms at p50). We count a take as
"being replaced" while the session has more spares out than replacements pending
(`replacing`, forgotten after REPLACE_WAIT); TOKENs make up for whatever does not come.

Security argument
-----------------
*Who can open a control connection.* Only a peer that completes TLS 1.3 presenting a
key whose fingerprint is a pin of exactly one tenant; the session belongs to that tenant.

*Who can add a data connection to a pool.* Whoever presents a token we issued: 256
random bits, sent only inside a pinned control TLS session, single-use (removed from the
table on first presentation, whatever the outcome), void with their session and after
TOKEN_TTL (30 s; a SPARE after `SPARE_TTL`, 300 s — it waits at the connector, but like
a TOKEN it crosses the network in the clear only once, when it is used up), capped per
session (MAX_OUTSTANDING_TOKENS, SPARE_MAX). A data connection joins only
the pool of the session that issued its token, and sessions belong to one tenant, so a
connector serves only its own tenant's routes; `open_stream(B)` only ever draws from B's
sessions. Off the path, a token cannot be guessed; made-up ones are refused and counted
(`bad_token`) at the cost of one read and one dict lookup (cheaper than the handshake a
TLS data connection made us burn), bounded by the router's per-IP limits. On a TLS data
connection the key must also be the session's (`token_mismatch`).

*What a raw data connection gives away.* The token crosses the network in the clear
once. What an on-path attacker between ingress and home can do with it: replay it —
refused, it is used; race the connector with it — only an attacker that can delay or
drop the connector's packet wins (an eavesdropper sees the token only as it travels
to us, and needs a TCP handshake before it can present it). The winner gets one pooled
connection and, later, one stream. Every payload byte on a stream is already end-to-end
TLS: the caller's own TLS in passthrough (the ingress never had its keys), our pinned
mutual TLS to the home node in terminate. The attacker can neither complete that inner
handshake as the home node (no key) nor read anything: the stream fails, a denial of
service — what that attacker can do to any TCP connection anyway (drop, reset). The
same attacker could already hijack the unwrapped TCP connection of the TLS design; TLS
around the token bought nothing against it. The one thing such an attacker can also do
is what any on-path attacker in front of an origin can: answer an ACME TLS-ALPN-01
validation of a *passthrough* host (the challenge goes through to the home node) — the
same exposure as a home node reachable by port forwarding; terminate hosts' challenges
are answered by the ingress itself. Injected bytes into an idle pooled connection are
caught by the MSG_PEEK check (bytes before we sent any are a protocol violation) or, on
the connector side, make it relay garbage to the home node's TLS, which refuses it. The
ingress never reads plaintext from a data connection. The one unprotected field is the
optional PROXY v2 header (client address) in passthrough — the same exposure as a
direct backend address reached over the internet. Nothing the ingress says on a raw
connection is trusted by the connector beyond "DATA_OK"; a forged refusal or a
middlebox costs only the switch to TLS data connections (CPU, not security).

Liveness: each side pings every `heartbeat` seconds and declares the control connection
dead after HEARTBEAT_MISSES intervals without any frame; a dead session's idle pool is
closed (its path is dead too). Streams already handed out are independent TCP
connections and end on their own: a dead control connection says nothing about them.
Several sessions per tenant coexist (the connector's
`connections`, plus a restarted connector while the old session times out); a newer one
never displaces an older one. No live session → `open_stream` raises BackendError, which
the router answers like a dead backend; the next session to connect is used at once.

Revocation: a reload that leaves a key no tenant's pin (or moves it, or drops its
tenant) ends that key's sessions with GOAWAY(KEY_UNPINNED) and also cuts every stream
handed out through them, in flight or idle in an upstream pool (`update`). Each stream
remembers the key of the session that gave it, and a cut resets its socket in place
(`net/abort.py`): what either side had queued is thrown away, the connector's side gets
a RST, and whoever holds the socket here (a splice, a pooled node connection, the splice
onto a worker's socketpair) fails its next read or write. A polite `shutdown` would
leave the receive queue readable, so a holder would relay megabytes the revoked node had
already sent. Letting streams finish would let the holder of a revoked key keep serving
(and reading) a long-lived passthrough session or stream for as long as its callers
stay.

Shutdown (`aclose`) sends GOAWAY(SHUTDOWN, retry_after) so connectors reconnect later
instead of hammering a restarting ingress.
"""

from __future__ import annotations

import functools
import math
import os
import secrets
import socket
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import trio
from OpenSSL import SSL

from pact_ingress.errors import BackendError, RemoteProtocolError
from pact_ingress.identity import Identity
from pact_ingress.logs import log
from pact_ingress.model import Config
from pact_ingress.net.abort import abort
from pact_ingress.net.ossl_stream import OpenSSLStream, server_context
from pact_ingress.net.replay import ReplayStream
from pact_ingress.net.tunnel.common import (
    PEER_GONE,
    first_error,
    heartbeat,
    read_message,
    send_quietly,
    set_keepalive,
)
from pact_ingress.proto.tunnel import frames as tf
from pact_ingress.proto.tunnel.constants import (
    ALPN_CONTROL,
    CONTROL_READ,
    DATA_OK,
    GOAWAY_TIMEOUT,
    HANDSHAKE_TIMEOUT,
    HEARTBEAT_INTERVAL,
    HEARTBEAT_MISSES,
    TUNNEL_ALPNS,
)
from pact_ingress.proto.tunnel.session import (
    POOL_MAX,
    POOL_MIN,
    BadToken,
    Grants,
    Kind,
    PoolSizer,
    TokenTable,
    spare_target,
)
from pact_ingress.stats import Stats

#: An idle data connection older than this is closed and replaced, so NAT state and
#: silently dead paths never linger in the pool (keepalive covers the time before).
POOL_MAX_AGE = 300.0
#: How long `open_stream` waits for a data connection when the pool is empty.
OPEN_TIMEOUT = 5.0
#: Tunnel connections one tenant may hold at once (connections: N plus restarts).
MAX_SESSIONS_PER_TENANT = 16
#: `open_stream` callers waiting for an empty pool, per tenant; more fail at once.
MAX_WAITERS_PER_TENANT = 256
#: Tokens outstanding per session (pool target already bounded; this caps bursts).
MAX_OUTSTANDING_TOKENS = 128
#: A taken data connection whose replacement (dialed with a spare) has not arrived after
#: this long is given up on: TOKENs make up for it. Replacements normally take ms.
REPLACE_WAIT = 1.0
#: A TOKEN not redeemed this long after it was sent is presumed lost on its way (a dial
#: refused at the door or failed on the path; the connector does not say): it stays valid
#: until TOKEN_TTL, but the pool no longer counts it as coming and grants another.
#: Refills normally take ms; counting lost ones for their whole TTL left a pool empty for
#: TOKEN_TTL after the refusals had stopped.
TOKEN_WAIT = 2.0
#: Control frames a connector may send: a few per heartbeat is normal; this is a flood.
CONTROL_FRAME_RATE = 20.0
CONTROL_FRAME_BURST = 100
#: What we tell connectors when shutting down: come back after this many seconds.
RECONNECT_AFTER_SHUTDOWN = 2.0
#: WAKE frames (relay mail queued) per tenant: at most one per this many seconds. The
#: connector fetches everything queued on one wake, so more would only repeat it.
WAKE_INTERVAL = 1.0
#: Pool maintenance wakes at least this often (token expiry, ageing, stream gauge).
MAINTENANCE_TICK = 1.0


class _SendTimeout(trio.BrokenResourceError):
    """A control frame could not be sent in time: the peer stopped reading."""


class _Refused(Exception):
    """A tunnel connection we refuse: `event` is the counter label, `goaway` the answer."""

    def __init__(self, event: str, detail: str, goaway: tf.GoawayCode | None = None):
        super().__init__(detail)
        self.event = event
        self.goaway = goaway


@dataclass(eq=False, slots=True)
class _HandedOut:
    """A stream `open_stream` gave away: its socket, the key of the session it came
    from, and whether a revocation cut it already."""

    sock: trio.socket.SocketType
    fingerprint: str
    cut: bool = False


@dataclass(eq=False)
class _Session:
    """One live control connection of one tenant's connector."""

    tenant: str
    fingerprint: str
    client: tuple[str, int]
    tls: OpenSSLStream
    sid: str
    started: float
    last_rx: float
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    send_lock: trio.Lock = field(default_factory=trio.Lock)
    idle: deque[tuple[socket.socket, float]] = field(default_factory=deque)
    grants: Grants = field(default_factory=Grants)  # its TOKENs and SPAREs out
    replacing: deque[float] = field(default_factory=deque)  # takes awaiting a spare's dial
    sizer: PoolSizer = field(default_factory=PoolSizer)
    wakeup: trio.Event = field(default_factory=trio.Event)
    draining: bool = False
    closed: bool = False
    goaway: tf.Goaway | None = None
    send_timeout: float = HEARTBEAT_INTERVAL * HEARTBEAT_MISSES
    wake_ok: bool = False  # the connector's HELLO said it understands WAKE
    wake_pending: bool = False  # a WAKE is owed (sent by the pool task, rate-limited)

    def poke(self) -> None:
        self.wakeup.set()

    def kill(self, goaway: tf.Goaway | None) -> None:
        if self.goaway is None:
            self.goaway = goaway
        self.scope.cancel()

    async def send(self, *msgs: tf.Message, deadline: float | None = None) -> None:
        """Send frames whole (one TLS write), even if the session is being killed meanwhile.

        A cancel that lands inside `send_all` (e.g. once it holds the TLS stream's send
        lock, which it takes with a yielding checkpoint) leaves the TLS stream broken for
        good, so the GOAWAY that `kill` wants delivered could no longer be sent and the
        connector would see a bare EOF instead of KEY_UNPINNED / SHUTDOWN. So waiting
        for our turn is cancellable, but the send itself is shielded and bounded by its
        own deadline (default: a heartbeat timeout; a peer that stops reading for that
        long is dead). `_SendTimeout` if the deadline hits: the stream is broken then.
        """
        async with self.send_lock:
            if deadline is None:
                deadline = trio.current_time() + self.send_timeout
            with trio.CancelScope(shield=True, deadline=deadline) as scope:
                await self.tls.send_all(b"".join(tf.encode(m) for m in msgs))
            if scope.cancelled_caught:
                raise _SendTimeout(f"control frame not sent within {self.send_timeout} s")

    async def ping(self, nonce: int, deadline: float) -> None:
        try:
            await self.send(tf.Ping(nonce), deadline=deadline)
        except _SendTimeout:
            pass  # silent for a whole timeout: the heartbeat's next turn declares it dead

    def close_idle(self) -> None:
        while self.idle:
            self.idle.popleft()[0].close()


class TunnelServer:
    """Accepts connectors (`handle`) and opens streams through them (`open_stream`)."""

    def __init__(self, *, identity: Identity, stats: Stats,
                 heartbeat: float = HEARTBEAT_INTERVAL) -> None:
        self.identity = identity
        self.stats = stats
        self.heartbeat = heartbeat
        self._ctx = self._make_context(identity)
        self._tenant_of: dict[str, str | None] = {}  # fingerprint → tenant (None: ambiguous)
        self._sessions: dict[str, list[_Session]] = {}
        self._tokens: TokenTable[_Session] = TokenTable()
        self._arrival: dict[str, trio.Event] = {}
        self._waiters: dict[str, int] = {}
        self._rr: dict[str, int] = {}
        #: tenant → streams handed out and not yet closed (a revoked key's are cut)
        self._streams: dict[str, list[_HandedOut]] = {}
        # per tenant: (streams gauge, stream_open counter), looked up once — prometheus
        # `labels()` hashes and locks on every call, and these are on every open
        self._stream_metrics: dict[str, tuple[Any, Any]] = {}
        self._woken: dict[str, float] = {}  # tenant → when its last WAKE went out
        self._closing = False
        self._all_gone = trio.Event()
        #: Asked as a WAKE-capable link comes up: has relay mail waited for this tenant?
        #: (Set by the app when a relay is configured.)
        self.has_mail: Callable[[str], bool] | None = None
        self._all_gone.set()

    @staticmethod
    def _make_context(identity: Identity) -> SSL.Context:
        ctx = server_context(identity, alpn=TUNNEL_ALPNS,
                             require_client_cert=True)
        ctx.set_min_proto_version(SSL.TLS1_3_VERSION)  # both ends are ours
        return ctx

    # --- configuration -----------------------------------------------------------------

    def update(self, config: Config) -> None:
        """New pin → tenant map; sessions whose key is no longer that tenant's are dropped."""
        tenant_of: dict[str, str | None] = {}
        for tenant in config.tenants:
            for pin in tenant.pins:
                known = tenant_of.get(pin, tenant.name)
                tenant_of[pin] = tenant.name if known == tenant.name else None
        self._tenant_of = tenant_of
        for session in self._all_sessions():
            if session.closed:
                continue  # cut by an earlier reload, its task not yet through
            if tenant_of.get(session.fingerprint) != session.tenant:
                log.warning("tunnel_key_unpinned", tenant=session.tenant,
                            fingerprint=session.fingerprint, session=session.sid)
                self._event(session.tenant, "unpinned")
                session.kill(tf.Goaway(tf.GoawayCode.KEY_UNPINNED, 0,
                                       "key no longer pinned for this tenant"))
                # out of service now, not once its task runs: an `open_stream` or a data
                # connection scheduled before that task would still find it live
                session.closed = True
                session.close_idle()
        self._cut_unpinned(tenant_of)

    def _cut_unpinned(self, tenant_of: dict[str, str | None]) -> None:
        """Cut (reset) the handed-out streams whose session's key `tenant_of` no
        longer gives their tenant; whoever holds one (a splice, a pooled node
        connection, a worker's socketpair behind a splice) fails on it and ends. A cut
        stream is counted until its holder closes it, as any other."""
        for tenant, streams in self._streams.items():
            cut: dict[str, int] = {}
            for out in streams:
                if out.cut or out.sock.fileno() == -1 or tenant_of.get(
                        out.fingerprint) == tenant:
                    continue
                out.cut = True
                try:
                    abort(out.sock.fileno())
                except OSError:
                    pass  # closed meanwhile: it is ending anyway
                cut[out.fingerprint] = cut.get(out.fingerprint, 0) + 1
            for fingerprint, n in cut.items():
                self.stats.tunnel_events.labels(tenant, "stream_cut").inc(n)
                log.warning("tunnel_streams_cut", tenant=tenant, fingerprint=fingerprint,
                            streams=n)

    def _all_sessions(self) -> list[_Session]:
        return [s for group in self._sessions.values() for s in group]

    # --- introspection (status page, tests) --------------------------------------------

    def live_tunnels(self, tenant: str) -> int:
        return len(self._live(tenant))

    def idle_connections(self, tenant: str) -> int:
        return sum(len(s.idle) for s in self._live(tenant))

    def open_streams(self, tenant: str) -> int:
        self._sweep(tenant)
        return len(self._streams.get(tenant, ()))

    def _live(self, tenant: str) -> list[_Session]:
        return [s for s in self._sessions.get(tenant, ()) if not (s.draining or s.closed)]

    def _event(self, tenant: str, event: str) -> None:
        self.stats.tunnel_events.labels(tenant, event).inc()

    # --- accepting connections ---------------------------------------------------------

    async def handle(self, stream: ReplayStream, client: tuple[str, int],
                     admit: Callable[[], bool] | None = None) -> None:
        """Serve one connection the router gave us; closes it (or pools a duplicate).

        The router hands over TLS connections for the tunnel hostname and raw data
        connections (its peeked bytes start with `RAW_DATA_MAGIC`). `admit` is called
        once the connection proved it is a connector's (its token, or its pinned key):
        the router counts it as one from then on; False means its address is at its cap
        of those, and it is refused.
        """
        if tf.raw_data_prefix(stream.pending):
            await self._handle_raw(stream, client, admit)
            return
        tls = OpenSSLStream(stream, self._ctx, server_side=True)
        fingerprint: str | None = None
        tenant = "-"
        try:
            with trio.fail_after(HANDSHAKE_TIMEOUT):
                await tls.do_handshake()
            fingerprint = tls.peer_fingerprint
            tenant, alpn = self._admit(tls, fingerprint)
            if admit is not None and not admit():
                raise _Refused("over_capacity", "over the tunnel connections of its address",
                               tf.GoawayCode.OVER_CAPACITY)
            if alpn == ALPN_CONTROL:
                await self._serve_control(tls, tenant, fingerprint or "", client)
            else:
                await self._accept_data(tls, stream, tenant, fingerprint or "", client)
        except _Refused as exc:
            await self._refuse(tls, tenant, fingerprint, client, exc)
        except RemoteProtocolError as exc:  # a frame that does not parse
            await self._refuse(tls, tenant, fingerprint, client, _Refused(
                "protocol_error", str(exc), tf.GoawayCode.PROTOCOL_ERROR))
        except trio.TooSlowError:
            await self._refuse(tls, tenant, fingerprint, client,
                               _Refused("timeout", "handshake or first frame too slow"))
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            if fingerprint is None:  # failed in the handshake: wrong ALPN, no cert, junk
                await self._refuse(tls, tenant, fingerprint, client,
                                   _Refused("handshake_failed", str(exc)))
        except Exception as exc:
            self._event(tenant, "internal_error")
            log.error("tunnel_internal_error", tenant=tenant, fingerprint=fingerprint,
                      error=repr(exc))
        finally:
            await trio.aclose_forcefully(tls)

    def _admit(self, tls: OpenSSLStream, fingerprint: str | None) -> tuple[str, str]:
        alpn = tls.selected_alpn_protocol()
        if alpn not in TUNNEL_ALPNS:
            raise _Refused("bad_alpn", f"ALPN {alpn!r} is not a tunnel protocol")
        if self._closing:
            raise _Refused("shutting_down", "ingress shutting down", tf.GoawayCode.SHUTDOWN)
        if fingerprint is None or fingerprint not in self._tenant_of:
            raise _Refused("unknown_key", "key is not a pin of any tenant",
                           tf.GoawayCode.UNKNOWN_KEY)
        tenant = self._tenant_of[fingerprint]
        if tenant is None:
            raise _Refused("ambiguous_key", "key is pinned by several tenants",
                           tf.GoawayCode.UNKNOWN_KEY)
        return tenant, alpn

    async def _refuse(self, tls: OpenSSLStream | None, tenant: str,
                      fingerprint: str | None, client: tuple[str, int], exc: _Refused
                      ) -> None:
        """Count and log a refusal; on TLS, tell the peer why (GOAWAY) if there is a code.

        (A raw data connection gets no answer: nothing said in the clear is trusted.)
        """
        self._event(tenant, "refused_" + exc.event)
        self.stats.refused("tunnel", client[0], exc.event)
        log.warning("tunnel_refused", reason=exc.event, detail=str(exc), tenant=tenant,
                    fingerprint=fingerprint, client_ip=client[0],
                    transport="tls" if tls is not None else "raw")
        if exc.goaway is not None and tls is not None:
            retry = int(RECONNECT_AFTER_SHUTDOWN * 1000) if exc.event == "shutting_down" else 0
            await _send_goaway(tls, tf.Goaway(exc.goaway, retry, str(exc)))

    # --- control sessions --------------------------------------------------------------

    async def _serve_control(self, tls: OpenSSLStream, tenant: str, fingerprint: str,
                             client: tuple[str, int]) -> None:
        decoder = tf.Decoder()
        with trio.fail_after(HANDSHAKE_TIMEOUT):
            hello = await read_message(tls, decoder)
        if not isinstance(hello, tf.Hello) or hello.version != tf.VERSION:
            raise _Refused("protocol_error", f"expected HELLO v{tf.VERSION}, got {hello!r}",
                           tf.GoawayCode.PROTOCOL_ERROR)
        if len(self._sessions.get(tenant, ())) >= MAX_SESSIONS_PER_TENANT:
            raise _Refused("over_capacity", f"over {MAX_SESSIONS_PER_TENANT} tunnels",
                           tf.GoawayCode.OVER_CAPACITY)
        now = trio.current_time()
        sid = secrets.token_bytes(tf.ID_BYTES)
        session = _Session(tenant, fingerprint, client, tls, sid.hex()[:16], now, now,
                           send_timeout=self.heartbeat * HEARTBEAT_MISSES, wake_ok=hello.wake)
        await session.send(tf.Welcome(sid, int(self.heartbeat * 1000)))
        self._register(session, hello)
        def broken(_exc: BaseException) -> None:
            session.kill(None)  # the session ends, not the router

        try:
            with session.scope:
                async with trio.open_nursery() as nursery:
                    for task in (functools.partial(self._read_control, session, decoder),
                                 functools.partial(self._heartbeat, session),
                                 functools.partial(self._maintain_pool, session)):
                        nursery.start_soon(first_error, task, PEER_GONE, broken)
        finally:
            self._unregister(session)
        if session.goaway is not None:
            await _send_goaway(tls, session.goaway)

    def _register(self, session: _Session, hello: tf.Hello) -> None:
        self._sessions.setdefault(session.tenant, []).append(session)
        self._all_gone = trio.Event() if self._all_gone.is_set() else self._all_gone
        self.stats.tunnels.labels(session.tenant).set(len(self._live(session.tenant)))
        self._event(session.tenant, "connect")
        log.info("tunnel_up", tenant=session.tenant, fingerprint=session.fingerprint,
                 session=session.sid, slot=hello.slot, instance=hello.instance.hex()[:16],
                 client_ip=session.client[0])
        self._wake_waiters(session.tenant)
        if session.wake_ok and self.has_mail is not None and self.has_mail(session.tenant):
            self.wake(session.tenant)

    def _unregister(self, session: _Session) -> None:
        session.closed = True
        group = self._sessions.get(session.tenant, [])
        if session in group:
            group.remove(session)
        if not group:
            self._sessions.pop(session.tenant, None)
        self._tokens.forget(session)
        session.close_idle()
        self.stats.tunnels.labels(session.tenant).set(len(self._live(session.tenant)))
        self._event(session.tenant, "disconnect")
        log.info("tunnel_down", tenant=session.tenant, fingerprint=session.fingerprint,
                 session=session.sid, reason=session.goaway.code.name if session.goaway
                 else "closed", up_s=round(trio.current_time() - session.started, 3))
        self._wake_waiters(session.tenant)
        if not self._sessions:
            self._all_gone.set()

    async def _read_control(self, session: _Session, decoder: tf.Decoder) -> None:
        budget = tf.FrameBudget(CONTROL_FRAME_RATE, CONTROL_FRAME_BURST, trio.current_time())
        now = trio.current_time()
        try:
            while True:
                # served before the next read: frames that came with the HELLO (in the
                # read that held it) need nothing behind them on the wire
                while (msg := decoder.next_message()) is not None:
                    if not budget.take(now):
                        raise _Refused("flood", "control frame flood",
                                       tf.GoawayCode.PROTOCOL_ERROR)
                    await self._on_control(session, msg)
                data = await session.tls.receive_some(CONTROL_READ)
                if not data:
                    session.kill(None)
                    return
                now = session.last_rx = trio.current_time()
                decoder.feed(data)
        except (_Refused, RemoteProtocolError) as exc:
            refused = exc if isinstance(exc, _Refused) else _Refused(
                "protocol_error", str(exc), tf.GoawayCode.PROTOCOL_ERROR)
            self._event(session.tenant, "refused_" + refused.event)
            log.warning("tunnel_refused", reason=refused.event, detail=str(exc),
                        tenant=session.tenant, fingerprint=session.fingerprint,
                        session=session.sid, client_ip=session.client[0])
            session.kill(tf.Goaway(refused.goaway or tf.GoawayCode.PROTOCOL_ERROR, 0,
                                   str(exc)))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            session.kill(None)

    async def _on_control(self, session: _Session, msg: tf.Message) -> None:
        if isinstance(msg, tf.Ping):
            await session.send(tf.Pong(msg.nonce))
        elif isinstance(msg, tf.Pong):
            pass  # receiving it already refreshed last_rx
        elif isinstance(msg, tf.Goaway) and msg.code == tf.GoawayCode.DRAINING:
            log.info("tunnel_draining", tenant=session.tenant, session=session.sid)
            session.draining = True
            session.close_idle()
            self.stats.tunnels.labels(session.tenant).set(len(self._live(session.tenant)))
            self._event(session.tenant, "draining")
        elif isinstance(msg, tf.Goaway):
            session.kill(None)
        else:
            raise _Refused("protocol_error", f"unexpected {type(msg).__name__} on control",
                           tf.GoawayCode.PROTOCOL_ERROR)

    async def _heartbeat(self, session: _Session) -> None:
        silent = await heartbeat(self.heartbeat, lambda: session.last_rx, session.ping)
        self._event(session.tenant, "heartbeat_timeout")
        log.warning("tunnel_dead", tenant=session.tenant, session=session.sid,
                    fingerprint=session.fingerprint, silent_s=round(silent, 3))
        session.kill(None)

    # --- the data-connection pool ------------------------------------------------------

    async def _maintain_pool(self, session: _Session) -> None:
        while True:
            session.wakeup = trio.Event()  # before granting: a take meanwhile wakes us again
            now = trio.current_time()
            self._expire(session, now)
            self._sweep(session.tenant)
            if not session.draining:
                await self._grant_tokens(session, now)
            if session.wake_pending and now >= self._woken.get(session.tenant, -WAKE_INTERVAL) \
                    + WAKE_INTERVAL:
                session.wake_pending = False
                self._woken[session.tenant] = now
                await session.send(tf.Wake())
            with trio.move_on_after(MAINTENANCE_TICK):
                await session.wakeup.wait()

    def _expire(self, session: _Session, now: float) -> None:
        self._tokens.expire(session, now)
        while session.replacing and now - session.replacing[0] > REPLACE_WAIT:
            session.replacing.popleft()
        while session.idle and now - session.idle[0][1] > POOL_MAX_AGE:
            session.idle.popleft()[0].close()

    def _target(self, session: _Session, now: float) -> int:
        live = max(1, len(self._live(session.tenant)))
        waiting = math.ceil(self._waiters.get(session.tenant, 0) / live)
        return min(POOL_MAX, session.sizer.target(now) + waiting)

    async def _grant_tokens(self, session: _Session, now: float) -> None:
        """TOKENs for what the pool lacks beyond replacements on their way; SPAREs when
        the connector's stock runs low. All in one TLS record and one write."""
        target = self._target(session, now)
        out = session.grants
        coming = sum(1 for issued in out.tokens.values() if now - issued <= TOKEN_WAIT)
        want = target - len(session.idle) - coming - len(session.replacing)
        want = min(want, MAX_OUTSTANDING_TOKENS - len(out.tokens))
        grants: list[tf.Message] = [tf.Token(self._tokens.issue(session, Kind.TOKEN, now))
                                    for _ in range(max(0, want))]
        tokens = len(grants)
        spares = spare_target(target)
        if len(out.spares) < spares // 2:
            grants += [tf.Spare(self._tokens.issue(session, Kind.SPARE, now))
                       for _ in range(spares - len(out.spares))]
        if grants:
            events = self.stats.tunnel_events
            if tokens:
                events.labels(session.tenant, "tokens_granted").inc(tokens)
            if len(grants) > tokens:
                events.labels(session.tenant, "spares_granted").inc(len(grants) - tokens)
            await session.send(*grants)

    async def _accept_data(self, tls: OpenSSLStream, stream: ReplayStream, tenant: str,
                           fingerprint: str, client: tuple[str, int]) -> None:
        """The TLS fallback: DATA_HELLO inside pinned mutual TLS, DATA_OK, unwrap."""
        decoder = tf.Decoder()
        with trio.fail_after(HANDSHAKE_TIMEOUT):
            hello = await read_message(tls, decoder)
            if not isinstance(hello, tf.DataHello) or decoder.buffered:
                raise _Refused("protocol_error", f"expected DATA_HELLO, got {hello!r}")
            session = self._redeem(hello.token, fingerprint)
            await tls.send_all(tf.encode(tf.DataOk()))
            await _unwrap(tls)
        if stream.pending:
            raise _Refused("protocol_error", "bytes left over in the TLS phase")
        self._pool(session, hello.token, stream.inner.socket)

    async def _handle_raw(self, stream: ReplayStream, client: tuple[str, int],
                          admit: Callable[[], bool] | None = None) -> None:
        """A raw data connection: magic, DATA_HELLO in the clear; we answer DATA_OK.

        The token alone authenticates it (security argument in the module docstring).
        Nothing is answered on refusal; the router closes the connection.

        The connector sends magic and DATA_HELLO in one write, so the router's first
        read usually holds both: then no deadline is set up and DATA_OK (3 bytes into
        an empty send buffer) is one write(2) — every stream's replacement passes here.
        """
        tenant = "-"
        try:
            decoder = tf.Decoder()
            decoder.feed(stream.take_pending()[len(tf.RAW_DATA_MAGIC):])
            hello = decoder.next_message()
            if hello is None:  # the rest of the frame is still on its way
                with trio.fail_after(HANDSHAKE_TIMEOUT):
                    hello = await read_message(stream, decoder)
            if not isinstance(hello, tf.DataHello) or decoder.buffered:
                raise _Refused("protocol_error", "expected DATA_HELLO, alone")
            if self._closing:
                raise _Refused("shutting_down", "ingress shutting down")
            session = self._redeem(hello.token, None)
            tenant = session.tenant
            if admit is not None and not admit():
                return  # its address is at its tunnel cap: refused and logged by the router
            sock = stream.inner.socket
            if os.write(sock.fileno(), DATA_OK) != len(DATA_OK):
                raise trio.BrokenResourceError("DATA_OK not taken whole")
            self._pool(session, hello.token, sock)
        except _Refused as exc:
            await self._refuse(None, tenant, None, client, exc)
        except RemoteProtocolError as exc:
            await self._refuse(None, tenant, None, client,
                               _Refused("protocol_error", str(exc)))
        except trio.TooSlowError:
            await self._refuse(None, tenant, None, client,
                               _Refused("timeout", "no DATA_HELLO in time"))
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass  # the peer went away: nothing to keep

    def _pool(self, session: _Session, token: bytes, sock: trio.socket.SocketType) -> None:
        """Put (a duplicate of) an accepted data connection into its session's pool.

        Returning to the router closes its descriptor; the pool owns the duplicate.
        """
        now = trio.current_time()
        if session.closed or session.draining:
            return  # the session ended while this connection was being set up
        raw = socket.socket(fileno=os.dup(sock.fileno()))
        raw.setblocking(False)
        set_keepalive(raw)
        latency = session.grants.settle(token, now)
        if latency is None:  # a replacement, dialled with a spare
            if session.replacing:
                session.replacing.popleft()
            if len(session.grants.spares) < spare_target(self._target(session, now)) // 2:
                session.poke()  # the connector's stock runs low
        else:
            session.sizer.refilled(now, latency)
        session.idle.append((raw, now))
        self._wake_waiters(session.tenant)

    def _redeem(self, token: bytes, fingerprint: str | None) -> _Session:
        """The session a token was issued to; it is used up whatever the outcome.

        `fingerprint` (TLS data connections) must be the session's key; a raw data
        connection has none: the token, issued only inside that session's pinned TLS,
        is its credential.
        """
        try:
            return self._tokens.redeem(token, fingerprint, trio.current_time())
        except BadToken as exc:
            raise _Refused(exc.event, str(exc)) from None

    def wake(self, tenant: str) -> bool:
        """Tell one of `tenant`'s connectors that relay mail is queued (a content-free
        WAKE on a control link whose HELLO offered CAP_WAKE). At most one per
        WAKE_INTERVAL per tenant; one asked for meanwhile goes out when the interval
        ends, so the last item queued always causes a wake. False: no such link."""
        live = [s for s in self._live(tenant) if s.wake_ok]
        if not live:
            return False
        if not any(s.wake_pending for s in live):
            session = live[0]
            session.wake_pending = True
            session.poke()
        return True

    def _wake_waiters(self, tenant: str) -> None:
        event = self._arrival.pop(tenant, None)
        if event is not None:
            event.set()

    # --- opening streams ---------------------------------------------------------------

    async def open_stream(self, tenant: str) -> trio.abc.Stream:
        """A raw stream to the tenant's connector `forward` address, or BackendError.

        With an idle data connection in the pool this does not wait (a cancelled caller
        still sees Cancelled): it is on every tunnel stream's first-byte path."""
        await trio.lowlevel.checkpoint_if_cancelled()
        self._sweep(tenant)
        stream = self._take(tenant)
        if stream is not None:
            return stream
        if not self._live(tenant):
            self._event(tenant, "open_no_tunnel")
            raise BackendError(f"no live tunnel for tenant {tenant}")
        if self._waiters.get(tenant, 0) >= MAX_WAITERS_PER_TENANT:
            self._event(tenant, "open_overloaded")
            raise BackendError(f"tunnel of tenant {tenant} overloaded")
        return await self._wait_for_stream(tenant)

    async def _wait_for_stream(self, tenant: str) -> trio.abc.Stream:
        self._waiters[tenant] = self._waiters.get(tenant, 0) + 1
        try:
            with trio.move_on_after(OPEN_TIMEOUT):
                while self._live(tenant):
                    event = self._arrival.setdefault(tenant, trio.Event())
                    for session in self._live(tenant):
                        session.poke()
                    await event.wait()
                    stream = self._take(tenant)
                    if stream is not None:
                        return stream
        finally:
            self._waiters[tenant] -= 1
        self._event(tenant, "open_timeout")
        raise BackendError(f"no tunnel data connection for tenant {tenant} in time")

    def _take(self, tenant: str) -> trio.SocketStream | None:
        live = self._live(tenant)
        start = self._rr.get(tenant, 0)
        for i in range(len(live)):
            session = live[(start + i) % len(live)]
            raw = _pop_usable(session)
            if raw is None:
                continue
            self._rr[tenant] = start + i + 1
            now = trio.current_time()
            session.sizer.took(now)
            # the connector replaces it with a spare if it holds one for it; else (or
            # if the pool runs low) the maintenance task grants TOKENs now
            replaced = len(session.replacing) < len(session.grants.spares)
            if replaced:
                session.replacing.append(now)
            if not replaced or len(session.idle) < POOL_MIN:
                session.poke()
            return self._hand_out(tenant, raw, session.fingerprint)
        return None

    def _hand_out(self, tenant: str, raw: socket.socket, fingerprint: str
                  ) -> trio.SocketStream:
        sock = trio.socket.from_stdlib_socket(raw)
        streams = self._streams.setdefault(tenant, [])
        streams.append(_HandedOut(sock, fingerprint))
        gauge, opens = self._metrics(tenant)
        gauge.set(len(streams))
        opens.inc()
        return trio.SocketStream(sock)

    def _sweep(self, tenant: str) -> None:
        """Forget handed-out streams whose user closed them (the gauge follows)."""
        streams = self._streams.get(tenant)
        if streams is None:
            return
        streams[:] = [out for out in streams if out.sock.fileno() != -1]
        self._metrics(tenant)[0].set(len(streams))

    def _metrics(self, tenant: str) -> tuple[Any, Any]:
        pair = self._stream_metrics.get(tenant)
        if pair is None:
            pair = self._stream_metrics[tenant] = (
                self.stats.tunnel_streams.labels(tenant),
                self.stats.tunnel_events.labels(tenant, "stream_open"))
        return pair

    # --- shutdown ----------------------------------------------------------------------

    async def aclose(self) -> None:
        """Tell every connector to reconnect later, close sessions and idle pools."""
        self._closing = True
        goaway = tf.Goaway(tf.GoawayCode.SHUTDOWN, int(RECONNECT_AFTER_SHUTDOWN * 1000),
                           "ingress shutting down")
        for session in self._all_sessions():
            session.kill(goaway)
        with trio.move_on_after(GOAWAY_TIMEOUT * 2):
            await self._all_gone.wait()


def _pop_usable(session: _Session) -> socket.socket | None:
    """The next idle connection that is still open and silent, closing dead ones."""
    while session.idle:
        raw, _since = session.idle.popleft()
        try:
            peeked = raw.recv(1, socket.MSG_PEEK)
        except BlockingIOError:
            return raw  # nothing to read: alive and quiet, as it should be
        except OSError:
            peeked = b""
        if peeked:
            log.warning("tunnel_data_unexpected_bytes", tenant=session.tenant,
                        session=session.sid)
        raw.close()
    return None


async def _unwrap(tls: OpenSSLStream) -> None:
    """Exchange close_notify both ways; afterwards the transport carries raw bytes.

    OpenSSLStream has no public unwrap; SSL_shutdown through its retry loop is exactly
    that: the first call sends our close_notify, later ones read until the peer's.
    """
    for _ in range(8):  # bounded: two calls suffice; the caller's deadline bounds time
        if await tls._retry(tls._conn.shutdown):
            return
    raise RemoteProtocolError("TLS shutdown did not complete")


async def _send_goaway(tls: OpenSSLStream, goaway: tf.Goaway) -> None:
    """Tell the peer why we end (shielded: the handler may be being torn down)."""
    async def send(msg: tf.Message) -> None:
        await tls.send_all(tf.encode(msg))

    await send_quietly(send, goaway, shield=True)
