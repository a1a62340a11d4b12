"""Reverse tunnel, home side: `pact-ingress connect` dials out so the ingress can dial in.

Theory of operation (the protocol and its security argument are in
`net/tunnel/server.py`; this is the other end of it)
-----------------------------------------------------
`cfg.connections` slots each keep one **control connection** to the ingress: TCP to
`ingress.address`, TLS 1.3 with SNI `tunnel_hostname`, ALPN `pact-tunnel/1`, our PACT key
as client certificate, and the ingress accepted only if its key's fingerprint is one of
`ingress.pin` (stdlib ssl verifies nothing else; `identity.check_pin`). One Connector
talks to one ingress address; several instances get one each (`multi.py`). Over it we send
HELLO, answer and send heartbeats, and receive TOKENs and SPAREs.

Every TOKEN makes us dial one **data connection** at once; SPAREs we keep, and a data
connection that has carried a stream's first answer is replaced by one dialed with a
spare (`_replace`), so a stream costs the control connection nothing (why:
`server.py`, "Refilling"). A data connection is plain TCP to the ingress, then
`RAW_DATA_MAGIC` + DATA_HELLO(token) in one write, and the ingress answers DATA_OK (why a
token without TLS is enough: `server.py`, "Security argument"). The fallback,
`data_transport="tls"` or chosen by itself (below), is the older way: ALPN
`pact-tunnel-data/1` with the same pinned mutual TLS as the control connection, the token
inside, DATA_OK, then TLS unwrapped (close_notify both ways) — a full handshake on both
ends per stream, which costs far more CPU than the raw dial. The two ways are one
interface (`transport.RawTransport`, `transport.TlsTransport`); which one new data
connections use is the connector's policy (`_transport`, `_fallback`). Either way the
connection then waits, raw, in the ingress's pool. The first bytes the ingress sends mean "this is
a stream now": we connect `forward`, pass them on and splice both ways (kernel splice,
both ends plain TCP).

Each data connection lives on an OS thread of its own (`stream_job.StreamJob`):
a raw one is dialled there too, then the thread parks in poll(2) until the first bytes
and runs the stream to its end. trio only starts the job (`_run_job`), hears about the
stream's first answer (`_stream_opened`: count, replacement dial) and its end. A job
exists from the moment its dial starts, so what the connector counts (dialling, idle,
streaming) is read off the jobs' states, never kept apart. Why
threads in a trio program: both first-byte crossings of every stream run here, on the
home machine's core, next to the service; trio's per-wake-up cost there was most of
what the tunnel added to a stream's open (`stream_job.py`; the numbers are in the
README's "Performance" section). TLS data
connections are handshaken in trio first (ssl + trio), then handed over the same way.
Dials wait while a stream is opening (OPENING_YIELD), replacements REPLACE_DELAY more,
so that their connect, the ingress's accept and DATA_OK stay off the first-byte path. An
EOF before any byte means the ingress retired the idle connection. Data connections
belong to the connector, not to the control connection that granted them: a control
connection dying (or being replaced) never breaks a stream that is already flowing;
only idle data connections of a dead control connection are closed (`stop_if_idle`:
their path is presumably dead too).

Raw data connections are not TLS on :443, and some networks (DPI firewalls, "TLS only"
middleboxes) drop or reset such traffic. In `auto` mode (the default) the connector
therefore watches its raw data connections: RAW_FAILURES_BEFORE_FALLBACK of them in a
row failing before DATA_OK, while the control connection that issued their tokens is
alive, means "something in between does not let them through", and the process uses TLS
data connections from then on (logged once, counted `data_fallback_tls`). Each failed
raw attempt's token is retried once over TLS at once, so the ingress's pool does not
wait out TOKEN_TTL for tokens lost in between. An attacker
who can cause that only costs us CPU, never security.

Reconnects: a slot whose control connection fails waits `Backoff.next()` — exponential
from BACKOFF_BASE, capped at BACKOFF_CAP, with jitter so a fleet of connectors does not
reconnect in lockstep after an ingress restart — and resets the backoff once a
connection stayed up HEALTHY_PERIOD. A GOAWAY(SHUTDOWN) from the ingress sets a floor
(`retry_after`, at most GOAWAY_RETRY_CAP) under the next delay.

Graceful stop (`shutdown` event, set by the CLI on SIGTERM): GOAWAY(DRAINING) on every
control connection (the ingress stops using us for new streams and closes our idle data
connections), wait for those to go, close the control connections, then let running
streams finish until `grace` runs out; whatever is left is cancelled.
"""

from __future__ import annotations

import functools
import random
import secrets
import socket
import ssl
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import trio

from pact_ingress.errors import IdentityError, RemoteProtocolError
from pact_ingress.identity import (
    Identity,
    PinMismatch,
    check_pin,
    load_identity,
    pinned_client_context,
)
from pact_ingress.logs import log
from pact_ingress.model import ConnectorConfig, is_ip_address
from pact_ingress.net.mail_hook import MailHook
from pact_ingress.net.tunnel.common import (
    first_error,
    heartbeat,
    read_message,
    send_quietly,
)
from pact_ingress.net.tunnel.stream_job import Hooks, State, StreamJob
from pact_ingress.net.tunnel.transport import RawTransport, TlsTransport, Transport
from pact_ingress.proto.tunnel import frames as tf
from pact_ingress.proto.tunnel.constants import (
    ALPN_CONTROL,
    ALPN_DATA,
    CONTROL_READ,
    HANDSHAKE_TIMEOUT,
    HEARTBEAT_INTERVAL,
    HEARTBEAT_MISSES,
)
from pact_ingress.stats import Stats

#: Connecting (TCP) to the ingress or to `forward` gives up after this.
CONNECT_TIMEOUT = 10.0
#: Reconnect delays: 0.5 s, 1 s, 2 s, … capped at 30 s, each × a random factor in
#: [0.5, 1) ("equal jitter"): quick to come back after a blip, and a fleet of connectors
#: that lost the same ingress neither hammers it nor reconnects in lockstep.
BACKOFF_BASE = 0.5
BACKOFF_CAP = 30.0
#: The most a GOAWAY's retry_after can hold a slot back. Our own ingress asks for 2 s
#: while it restarts; the field is 32 bits of milliseconds, so a wrong or hostile value
#: could otherwise keep the home node off the net for weeks. Five minutes is well past
#: our longest backoff (an ingress may ask to be left alone longer than a blip), short
#: enough that a bad frame costs minutes at worst.
GOAWAY_RETRY_CAP = 300.0
#: A control connection that stayed up this long counts as healthy: backoff restarts.
HEALTHY_PERIOD = 60.0
#: Default time given to running streams after SIGTERM.
DRAIN_GRACE = 30.0
#: After GOAWAY(DRAINING), how long we wait for the ingress to retire our idle data
#: connections before closing the control connections anyway.
DRAIN_IDLE_WAIT = 5.0
#: Data connections being set up or idle per control connection. The ingress caps its
#: own grants (POOL_MAX + waiters); this guards against a misbehaving ingress.
MAX_PENDING_DATA = 256
#: Threads for data connections (`stream_job`: one per idle pooled connection and per
#: stream, parked in the kernel while idle). Past this a dialled connection waits for a
#: thread; the ingress's pool (POOL_MAX) and its per-tenant connection limit stay far
#: below it in any sane deployment.
MAX_STREAM_THREADS = 4096
#: SPARE tokens kept per control connection (the ingress keeps at most its SPARE_MAX out,
#: 128); beyond this the oldest are forgotten. Used within SPARE_USE_WITHIN of arrival,
#: well inside the ingress's SPARE_TTL.
MAX_SPARES = 256
SPARE_USE_WITHIN = tf.SPARE_TTL / 2
#: A stream with no byte either way for this long is closed. The ingress's route idle
#: timeout (default 300 s) normally ends streams first; TCP keepalive finds dead peers.
RELAY_IDLE_TIMEOUT = 3600.0
#: A dial (a new data connection for a TOKEN or a replacement) waits at most this long
#: while a stream is opening — its first bytes arrived, its first answer is not back yet
#: — so that the dial, the ingress's accept and DATA_OK do not land on that stream's
#: first-byte path on both ends (seen in strace and in a cross-process timeline). The
#: pool has slack (POOL_MIN), so a few ms cost nobody anything.
OPENING_YIELD = 0.005
#: A replacement dial (with a spare) also waits this long after the opening stream's first
#: answer: the answer still has to cross the ingress to the caller, and the replacement's
#: accept and DATA_OK would otherwise land on the ingress at that moment. The pool has
#: slack; a replacement a few ms later costs nothing.
REPLACE_DELAY = 0.002
#: How data connections are made: "raw" (token only, no TLS), "tls" (pinned mutual TLS,
#: then unwrapped), or "auto": raw, switching to tls for good if raw ones keep failing.
DATA_TRANSPORTS = ("auto", "raw", "tls")
#: Raw data connections failing in a row (before DATA_OK, control link alive) that make
#: `auto` switch to TLS. One failure can be a race with an ingress restart; three in a
#: row on a live control link is a pattern.
RAW_FAILURES_BEFORE_FALLBACK = 3

#: A job in one of these is a data connection still being made.
_MAKING = (State.NEW, State.DIALING)
_NET_ERRORS = (OSError, trio.BrokenResourceError, trio.ClosedResourceError, ssl.SSLError,
               trio.TooSlowError, RemoteProtocolError, IdentityError)


class Backoff:
    """Jittered exponential backoff. Pure: the caller sleeps; `rng` is injectable."""

    def __init__(self, base: float = BACKOFF_BASE, cap: float = BACKOFF_CAP,
                 rng: random.Random | None = None) -> None:
        self.base = base
        self.cap = cap
        self.rng = rng or random.Random()
        self.attempt = 0

    def next(self) -> float:
        ceiling = min(self.cap, self.base * (2 ** min(self.attempt, 32)))
        self.attempt += 1
        return ceiling * (0.5 + self.rng.random() / 2)

    def reset(self) -> None:
        self.attempt = 0


@dataclass
class _Attempt:
    """One control-connection attempt of a slot: when (if) it came up."""

    connected_at: float | None = None

    def up_for(self) -> float:
        if self.connected_at is None:
            return 0.0
        return trio.current_time() - self.connected_at


class _Goaway(Exception):
    def __init__(self, msg: tf.Goaway) -> None:
        super().__init__(f"{msg.code.name}: {msg.reason}")
        self.msg = msg


@dataclass(eq=False)
class _Link:
    """One live control connection."""

    slot: int
    tls: trio.SSLStream[trio.SocketStream]
    heartbeat: float
    last_rx: float
    send_lock: trio.Lock = field(default_factory=trio.Lock)
    idle_scopes: set[trio.CancelScope] = field(default_factory=set)  # dials in trio
    jobs: set[StreamJob] = field(default_factory=set)  # its data connections, from dial on
    spares: deque[tuple[bytes, float]] = field(default_factory=deque)  # (token, arrived)

    async def send(self, msg: tf.Message) -> None:
        async with self.send_lock:
            await self.tls.send_all(tf.encode(msg))

    async def ping(self, nonce: int, deadline: float) -> None:
        with trio.move_on_at(deadline):
            await self.send(tf.Ping(nonce))

    @property
    def dialing(self) -> int:
        """Its data connections still being made."""
        return sum(1 for job in self.jobs if job.state in _MAKING)


class Connector:
    """The home-side tunnel endpoint; `run()` until cancelled or `shutdown` is set."""

    def __init__(self, cfg: ConnectorConfig, *, stats: Stats | None = None,
                 identity: Identity | None = None,
                 heartbeat: float = HEARTBEAT_INTERVAL, data_transport: str = "auto"
                 ) -> None:
        if data_transport not in DATA_TRANSPORTS:
            raise ValueError(f"data_transport must be one of {DATA_TRANSPORTS}")
        self.cfg = cfg
        self.data_transport = data_transport  # as configured (the policy; never changes)
        self._raw_failures = 0  # raw data connections failed in a row (auto mode)
        self.stats = stats or Stats()
        self.identity = identity or load_identity(cfg.identity_key)
        self.heartbeat = heartbeat
        self.label = str(cfg.ingress)
        self.instance = secrets.token_bytes(tf.ID_BYTES)
        self._ctx_control = self._context(ALPN_CONTROL)
        self._ctx_data = self._context(ALPN_DATA)
        raw = RawTransport(cfg.ingress.host, cfg.ingress.port, CONNECT_TIMEOUT,
                           HANDSHAKE_TIMEOUT)
        tls = TlsTransport(functools.partial(self._dial, self._ctx_data), CONNECT_TIMEOUT,
                           HANDSHAKE_TIMEOUT)
        #: How new data connections are made: raw unless configured "tls", or until
        #: `auto` fell back (`_raw_failed`).
        self._transport: Transport = tls if data_transport == "tls" else raw
        #: Where a raw connection's token goes when the raw dial failed (auto only).
        self._fallback: Transport | None = tls if data_transport == "auto" else None
        self._links: set[_Link] = set()
        self._jobs: set[StreamJob] = set()  # data connections, from the dial on
        self._threads: trio.CapacityLimiter | None = None  # one per job (run())
        self._opened = trio.Event()  # set (and replaced) when a stream's answer went back
        self._changed = trio.Event()
        self._draining = False
        self._root: trio.Nursery | None = None
        # looked up once: prometheus `labels()` hashes and locks on every call, and these
        # are on every stream's first-byte path
        self._bytes_up = self.stats.bytes.labels("tunnel", "up")
        self._bytes_down = self.stats.bytes.labels("tunnel", "down")
        self._stream_opens = self.stats.tunnel_events.labels(self.label, "stream_open")
        #: The on_mail hook relay WAKEs run (None: not configured, and WAKE not offered).
        self.mail = MailHook(cfg.on_mail) if cfg.on_mail is not None else None

    def _context(self, alpn: str) -> ssl.SSLContext:
        ctx = pinned_client_context(self.identity, [alpn])
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3  # both ends are ours
        return ctx

    # --- introspection -------------------------------------------------------------------

    @property
    def live_links(self) -> int:
        return len(self._links)

    @property
    def active_streams(self) -> int:
        return sum(1 for job in self._jobs if job.streaming)

    @property
    def idle_data(self) -> int:
        """Data connections being dialled or waiting in the ingress's pool."""
        return sum(1 for job in self._jobs if job.waiting)

    @property
    def dialing(self) -> int:
        """Data connections still being made."""
        return sum(1 for job in self._jobs if job.state in _MAKING)

    @property
    def raw_data(self) -> bool:
        """Whether new data connections are raw (else TLS)."""
        return self._transport.name == "raw"

    def _event(self, event: str) -> None:
        self.stats.tunnel_events.labels(self.label, event).inc()

    def _touch(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    # --- lifecycle -------------------------------------------------------------------------

    async def run(self, *, shutdown: trio.Event | None = None, grace: float = DRAIN_GRACE,
                  task_status: trio.TaskStatus[Connector] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        """Keep the tunnel up. With `shutdown`: once it is set, drain and return."""
        self._threads = trio.CapacityLimiter(MAX_STREAM_THREADS)
        async with trio.open_nursery() as root:
            self._root = root
            slots = trio.CancelScope()
            root.start_soon(self._run_slots, slots)
            if self.mail is not None:
                root.start_soon(self.mail.run)
            task_status.started(self)
            if shutdown is None:
                await trio.sleep_forever()
            await shutdown.wait()
            await self._drain(slots, grace)
            root.cancel_scope.cancel()

    async def _run_slots(self, scope: trio.CancelScope) -> None:
        with scope:
            async with trio.open_nursery() as nursery:
                for slot in range(self.cfg.connections):
                    nursery.start_soon(self._slot, slot)

    async def _drain(self, slots: trio.CancelScope, grace: float) -> None:
        deadline = trio.current_time() + grace
        self._draining = True
        log.info("connector_draining", ingress=self.label, streams=self.active_streams,
                 grace_s=grace)
        for link in list(self._links):
            await send_quietly(link.send, tf.Goaway(tf.GoawayCode.DRAINING, 0, "draining"))
        with trio.move_on_at(min(deadline, trio.current_time() + DRAIN_IDLE_WAIT)):
            await self._wait_until(lambda: self.idle_data == 0)
        slots.cancel()  # control connections close; idle data connections with them
        with trio.move_on_at(deadline):
            await self._wait_until(lambda: self.active_streams == 0 and self.idle_data == 0)
        log.info("connector_drained", ingress=self.label,
                 abandoned_streams=self.active_streams)

    async def _wait_until(self, condition: object) -> None:
        while not condition():  # type: ignore[operator]
            await self._changed.wait()

    # --- control connections -----------------------------------------------------------

    async def _slot(self, slot: int) -> None:
        backoff = Backoff()
        while not self._draining:
            floor, attempt = 0.0, _Attempt()
            try:
                await self._control(slot, attempt)
            except _Goaway as exc:
                floor = min(exc.msg.retry_after_ms / 1000, GOAWAY_RETRY_CAP)
                self._log_goaway(slot, exc.msg)
            except PinMismatch as exc:
                self._event("refused_ingress_pin")
                log.error("ingress_pin_mismatch", ingress=self.label,
                          expected=list(self.cfg.ingress_pins),
                          seen=exc.seen, slot=slot)
            except _NET_ERRORS as exc:
                log.warning("tunnel_control_failed", ingress=self.label, slot=slot,
                            error=repr(exc))
            if self._draining:
                return
            if attempt.up_for() >= HEALTHY_PERIOD:
                backoff.reset()
            delay = max(floor, backoff.next())
            self._event("reconnect")
            log.info("tunnel_reconnect", ingress=self.label, slot=slot,
                     delay_s=round(delay, 3))
            await trio.sleep(delay)

    def _log_goaway(self, slot: int, msg: tf.Goaway) -> None:
        self._event("goaway_" + msg.code.name.lower())
        fields = {"ingress": self.label, "slot": slot, "code": msg.code.name,
                  "reason": msg.reason, "retry_after_ms": msg.retry_after_ms}
        if msg.code in (tf.GoawayCode.UNKNOWN_KEY, tf.GoawayCode.KEY_UNPINNED):
            log.error("tunnel_key_refused", fingerprint=self.identity.fingerprint, **fields)
        else:
            log.info("tunnel_goaway", **fields)

    async def _dial(self, ctx: ssl.SSLContext) -> trio.SSLStream[trio.SocketStream]:
        """TCP + TLS to the ingress, ingress pin checked. Caller bounds the time."""
        address = self.cfg.ingress
        tcp = await trio.open_tcp_stream(address.host, address.port)
        tls = trio.SSLStream(tcp, ctx, server_hostname=self.cfg.tunnel_hostname)
        try:
            await tls.do_handshake()
            check_pin(tls, self.cfg.ingress_pins)  # type: ignore[arg-type]
        except BaseException:
            await trio.aclose_forcefully(tls)
            raise
        return tls

    async def _control(self, slot: int, attempt: _Attempt) -> None:
        """One control connection, until it fails (raises why)."""
        decoder = tf.Decoder()
        with trio.fail_after(CONNECT_TIMEOUT + HANDSHAKE_TIMEOUT):
            tls = await self._dial(self._ctx_control)
        try:
            with trio.fail_after(HANDSHAKE_TIMEOUT):
                await tls.send_all(tf.encode(tf.Hello(tf.VERSION, slot, self.instance,
                                                      wake=self.mail is not None)))
                welcome = await read_message(tls, decoder)
            if isinstance(welcome, tf.Goaway):
                raise _Goaway(welcome)
            if not isinstance(welcome, tf.Welcome):
                raise RemoteProtocolError(f"expected WELCOME, got {welcome!r}")
            heartbeat = min(self.heartbeat, max(welcome.heartbeat_ms / 1000, 0.05))
            link = _Link(slot, tls, heartbeat, trio.current_time())
            attempt.connected_at = link.last_rx
            await self._serve_link(link, decoder, welcome.session.hex()[:16])
        finally:
            await trio.aclose_forcefully(tls)

    async def _serve_link(self, link: _Link, decoder: tf.Decoder, sid: str) -> None:
        """Serve until the link ends; raises why it ended (nothing ends it cleanly)."""
        self._links.add(link)
        self.stats.tunnels.labels(self.label).set(len(self._links))
        self._event("connect")
        log.info("tunnel_up", ingress=self.label, slot=link.slot, session=sid)
        ended: list[BaseException] = []
        try:
            async with trio.open_nursery() as nursery:
                def end(exc: BaseException) -> None:  # the first failure ends the link
                    ended.append(exc)
                    nursery.cancel_scope.cancel()

                for task in (functools.partial(self._read_link, link, decoder),
                             functools.partial(self._heartbeat, link)):
                    nursery.start_soon(first_error, task, (*_NET_ERRORS, _Goaway), end)
            raise ended[0]
        finally:
            self._links.discard(link)
            for scope in list(link.idle_scopes):
                scope.cancel()
            for job in list(link.jobs):
                job.stop_if_idle()
            self.stats.tunnels.labels(self.label).set(len(self._links))
            self._event("disconnect")
            log.info("tunnel_down", ingress=self.label, slot=link.slot, session=sid)

    async def _read_link(self, link: _Link, decoder: tf.Decoder) -> None:
        # frames that came in the read that held the WELCOME are served first: nothing
        # need follow them on the wire
        while (msg := decoder.next_message()) is not None:
            await self._on_message(link, msg)
        while True:
            data = await link.tls.receive_some(CONTROL_READ)
            if not data:
                raise trio.BrokenResourceError("ingress closed the control connection")
            link.last_rx = trio.current_time()
            decoder.feed(data)
            while (msg := decoder.next_message()) is not None:
                await self._on_message(link, msg)

    async def _on_message(self, link: _Link, msg: tf.Message) -> None:
        if isinstance(msg, tf.Ping):
            await link.send(tf.Pong(msg.nonce))
        elif isinstance(msg, tf.Pong):
            pass
        elif isinstance(msg, tf.Token):
            self._dial_data(link, msg.token)
        elif isinstance(msg, tf.Spare):
            if len(link.spares) >= MAX_SPARES:
                link.spares.popleft()
            link.spares.append((msg.token, trio.current_time()))
        elif isinstance(msg, tf.Goaway):
            raise _Goaway(msg)
        elif isinstance(msg, tf.Wake):
            if self.mail is not None:
                self.mail.notify()
        else:
            raise RemoteProtocolError(f"unexpected {type(msg).__name__} from the ingress")

    async def _heartbeat(self, link: _Link) -> None:
        await heartbeat(link.heartbeat, lambda: link.last_rx, link.ping)
        self._event("heartbeat_timeout")
        timeout = link.heartbeat * HEARTBEAT_MISSES
        raise trio.TooSlowError(f"no frame from the ingress for {timeout:g} s")

    # --- data connections --------------------------------------------------------------

    def _dial_data(self, link: _Link, token: bytes, delay: float = 0.0) -> None:
        """Start a data connection with `token` (in the root nursery: see module doc),
        once no stream is opening, and `delay` after that."""
        idle = sum(1 for job in link.jobs if job.waiting)
        if self._draining or idle >= MAX_PENDING_DATA:
            return  # the token expires unused at the ingress
        assert self._root is not None
        self._root.start_soon(self._data, link, self._new_job(link), token, delay,
                              self._transport)

    def _replace(self, link: _Link) -> None:
        """A data connection of `link` carried a stream's first answer (or its stream
        ended first): dial its replacement with a spare, so the pool stays full without
        a word on the control connection. No spare (or a dead link): the ingress
        notices and grants TOKENs."""
        if link not in self._links:
            return
        token = take_spare(link.spares, trio.current_time())
        if token is not None:
            self._dial_data(link, token, REPLACE_DELAY)

    def _new_job(self, link: _Link) -> StreamJob:
        """A job for a data connection about to be made, counted from now on (its state
        says whether it is being made, idle or streaming)."""
        forward = self.cfg.forward
        job = StreamJob(None, b"", (forward.host, forward.port),
                        _literal_family(forward.host), self._hooks(link),
                        connect_timeout=CONNECT_TIMEOUT, idle_timeout=RELAY_IDLE_TIMEOUT)
        link.jobs.add(job)
        self._jobs.add(job)
        return job

    async def _data(self, link: _Link, job: StreamJob, token: bytes, delay: float,
                    transport: Transport) -> None:
        """A data connection with `token`, served until it ends. Raw: dialled on the
        job's own thread too (no trio wake-ups on the way); TLS: handshaken here first.
        In auto mode a raw dial that connected but got no DATA_OK counts towards the TLS
        fallback (a refused connect is an ingress down, not a middlebox) and its token
        is tried once more over TLS: behind a middlebox the ingress never saw it;
        otherwise it is used up and refused again. Either way the ingress's pool does
        not wait TOKEN_TTL for a token that is lost."""
        try:
            outcome = await self._run_job(link, job, token, delay, transport)
        finally:
            link.jobs.discard(job)
            self._jobs.discard(job)
            self._touch()
        if outcome not in ("dial_refused", "dial_failed"):
            return
        self._event("data_failed")
        log.debug("tunnel_data_failed", ingress=self.label, error=repr(job.error))
        if outcome == "dial_refused":
            return
        if link in self._links:
            self._raw_failed()
        if self._fallback is not None:  # the same token once more, over TLS
            await self._data(link, self._new_job(link), token, 0.0, self._fallback)

    async def _run_job(self, link: _Link, job: StreamJob, token: bytes, delay: float,
                       transport: Transport) -> str:
        """The connection made by `transport` (in trio for TLS; a `Dial` for the job's
        thread when raw), then its life on a thread of its own (why: `stream_job.py`).
        Idle, it ends with its control connection (`stop_if_idle` in `_serve_link`); a
        stream that has begun is only ended by the connector stopping (cancellation:
        `stop`). Returns the job's outcome."""
        scope = trio.CancelScope()  # cancelled if the link dies while it is made
        link.idle_scopes.add(scope)
        source = None
        try:
            with scope:
                await self._yield_to_openings()
                source = await transport.connect(token, delay)
        except (*_NET_ERRORS, _Goaway) as exc:
            self._event("data_failed")
            log.debug("tunnel_data_failed", ingress=self.label, error=repr(exc))
        finally:
            link.idle_scopes.discard(scope)
        if source is None or not job.hand_over(*source):  # failed, or its link died
            if source is not None and isinstance(source[0], socket.socket):
                source[0].close()
            job.stop()
            return "retired"
        if link not in self._links:  # its control connection died meanwhile
            job.stop_if_idle()
        assert self._threads is not None
        try:
            return await trio.to_thread.run_sync(job.run, abandon_on_cancel=True,
                                                 limiter=self._threads)
        except BaseException:
            job.stop()  # cancelled: the connector is stopping
            raise

    def _hooks(self, link: _Link) -> Hooks:
        """A job's calls from its thread: counters directly (prometheus locks them), the
        rest handed to trio."""
        token = trio.lowlevel.current_trio_token()

        def soon(fn: Callable[..., object], *args: object) -> None:
            try:
                token.run_sync_soon(fn, *args)
            except trio.RunFinishedError:
                pass  # the connector has stopped: nothing left to account

        up, down = self._bytes_up, self._bytes_down

        def moved(direction: str, n: int) -> None:
            (up if direction == "up" else down).inc(n)

        return Hooks(opened=lambda: soon(self._stream_opened, link), moved=moved,
                     forward_failed=lambda exc: soon(self._forward_failed, exc),
                     dialled=self._raw_ok)

    def _raw_ok(self) -> None:
        """A raw data connection got its DATA_OK (called from its job's thread: a plain
        store; racing `_raw_failed` can at worst lose one count of a heuristic)."""
        self._raw_failures = 0

    def _stream_opened(self, link: _Link) -> None:
        """A stream's first answer went back (or it ended first): count it, dial its data
        connection's replacement, let waiting dials go."""
        self._stream_opens.inc()
        self._opened.set()
        self._opened = trio.Event()
        self._replace(link)
        self._touch()

    def _forward_failed(self, exc: OSError) -> None:
        self._event("forward_unreachable")
        log.warning("forward_unreachable", forward=str(self.cfg.forward), error=repr(exc))

    def _opening(self) -> bool:
        return any(job.state is State.OPENING for job in self._jobs)

    async def _yield_to_openings(self) -> None:
        """Wait (≤ OPENING_YIELD) until no stream is opening: see OPENING_YIELD."""
        if not self._opening():
            return
        with trio.move_on_after(OPENING_YIELD):
            while self._opening():  # bounded by the deadline
                await self._opened.wait()

    def _raw_failed(self) -> None:
        self._raw_failures += 1
        if self._fallback is not None and self._transport is not self._fallback and \
                self._raw_failures >= RAW_FAILURES_BEFORE_FALLBACK:
            self._transport = self._fallback
            self._event("data_fallback_tls")
            log.warning("tunnel_data_fallback_tls", ingress=self.label,
                        failures=self._raw_failures,
                        why="raw data connections fail while the control connection "
                            "works: something in between allows only TLS")


def take_spare(spares: deque[tuple[bytes, float]], now: float) -> bytes | None:
    """The oldest spare still usable at `now` (older ones are dropped), or None."""
    while spares:
        token, arrived = spares.popleft()
        if now - arrived <= SPARE_USE_WITHIN:
            return token
    return None


@functools.lru_cache(maxsize=64)
def _literal_family(host: str) -> int | None:
    """AF_INET / AF_INET6 for an IP literal, None for a name (looked up once per host:
    parsing an address is measurable on a first-byte path)."""
    if not is_ip_address(host):
        return None
    return socket.AF_INET6 if ":" in host else socket.AF_INET


async def run_connector(cfg: ConnectorConfig, *, stats: Stats | None = None,
                        shutdown: trio.Event | None = None, grace: float = DRAIN_GRACE,
                        heartbeat: float = HEARTBEAT_INTERVAL,
                        identity: Identity | None = None,
                        task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED
                        ) -> None:
    """Run the connector until cancelled, or until `shutdown` is set (then drain ≤ grace).

    The CLI sets `shutdown` on SIGTERM, and passes the `identity` it loaded before
    starting (so an unreadable key is its one-line error; otherwise it is loaded here).
    `task_status.started()` receives the `multi.ConnectorSet`: one Connector per ingress
    target (live counts for status output and tests).
    """
    # one Connector per ingress target, even for a single address: the set is where
    # names are resolved (every record an instance) and kept resolved
    from pact_ingress.net.tunnel.multi import ConnectorSet  # it builds on this module

    connectors = ConnectorSet(cfg, stats=stats, heartbeat=heartbeat, identity=identity)
    await connectors.run(shutdown=shutdown, grace=grace, task_status=task_status)
