"""The passthrough engine: accept, peek, route and splice without a task per connection.

Theory of operation
-------------------
A passthrough connection is the common case at the edge and the cheapest one to serve:
the kernel moves its bytes (`os.splice`), so what it costs is the work around them —
accept, one read, one connect, a few splices, two closes. A trio task per connection
adds its own waiting machinery to each of those steps, and for a short connection
that machinery costs more than the steps. So :443 connections are served by one
long-lived trio task that owns an epoll set (`Edge.run`):

* every fd is registered once, edge-triggered, for reading, and asks for writability
  (one `epoll_ctl` MOD, kept from then on) only the first time a write to it would block
  (a connect in progress, a full buffer): a fd registered writable reports an edge at
  once, and most connections never fill a buffer (an `epoll_ctl` per wait is what a
  task per connection pays);
* a direction that waits to write stops its source's readability (`_mute`: one MOD
  when the wait begins, one when it ends): edge-triggered, every segment its peer
  sends raises an edge, which can do nothing while the destination is full — in a bulk
  transfer into a slower reader those edges were most of the engine's wake-ups;
* every step is tried before anything waits: a new connection's ClientHello is read
  right after accept(2), the backend's connect is probed by writing the head to it, and
  a read or write that would block is the only thing that leaves a connection waiting;
* each wake-up of a direction starts with one copied read of at most `COPY_PROBE`
  bytes (a request, a response or an EOF costs read + write and no pipe); a read that
  fills it hands the direction to splice through a pooled pipe for the rest. The usual
  edge (readable, on a splicing connection) is served by `_relay_short` straight from
  `_event`, without the state machine's step dispatch: most edges are that one;
* the usual ClientHello (whole in one record, naming a host) is checked by
  `proto/hello_fast.quick_sni`, which returns only the SNI routing needs; everything
  it declines goes to the full parser, whose verdict and alert are the answer;
* accepts are batched until EAGAIN (bounded per round, the rest are owed and taken on
  the next round without waiting);
* timers are not per connection: each connection has one deadline (its state machine,
  `proto/passthrough.py`, keeps it) and the engine sweeps them every `SWEEP_INTERVAL`;
* the engine waits for its epoll fd in trio (`wait_readable`), then takes ready events
  with `poll(0)` in batches until none are left, yielding to trio every
  `BATCHES_PER_YIELD` batches so the rest of the process (terminate, tunnels, admin,
  reload) keeps running.

What a connection does is decided by its sans-I/O state machine (`Passthrough`): an
edge goes in, the steps to take come out; the engine performs them and reports what
they did. The engine serves only passthrough routes to a configured address whose name
is resolved already; everything else it peeks — a tunnel raw data connection, a
connector's or peer's TLS, the relay host, a terminate route (ACME included), a tunnel
backend, a cold DNS cache — is handed to the router's trio code with the bytes already
read (`Router.adopt`), which replays them to whoever takes it next. A handed-off fd is
first removed from the engine's epoll set. Limits, counts, refusal reasons, counters and
the `conn_close` log line are the router's, shared with its task path.

Ownership: the engine owns every connection it has not handed off — its client and
backend sockets, and the pipes its directions hold while bytes are in flight (from the
process's `PipePool`, as the task relay does). It closes them when the connection
ends — the sockets once the batch of events it ended in is handled, so that no accept or
connect later in that batch takes their fd numbers and inherits the batch's remaining
events for them — and all of them when its task is cancelled (the drain deadline).

Drain: `stop_accepting` removes the listeners from the epoll set (the router closes
them); open connections run on, and the engine's task returns when the last one ends,
or is cancelled at the drain deadline with the router's handler nursery.
"""

from __future__ import annotations

import _socket
import errno
import fcntl
import ipaddress
import logging
import math
import os
import select
import socket
import sys
import termios
from collections.abc import Sequence
from json.encoder import encode_basestring_ascii as _json_str
from typing import Any

import trio

from pact_ingress.logs import log, members, ms_repr
from pact_ingress.model import Route, normalize_hostname
from pact_ingress.net.backends import CONNECT_TIMEOUT, STREAM_OPTIONS
from pact_ingress.net.router import (
    HEAD_TIMEOUT,
    PEEK_HEADROOM,
    PEEK_READ,
    Router,
    Tally,
    client_of,
)
from pact_ingress.net.shortage import ACCEPT_BACKOFF, CAPACITY_ERRNOS
from pact_ingress.net.splice import YIELD_EVERY, Direction, Pipe, Wait, give_pipe, pump, take_pipe
from pact_ingress.proto import tls_alert
from pact_ingress.proto.clienthello import (
    ACME_ALPN,
    ClientHello,
    ClientHelloError,
    is_acme_validation,
    parse_client_hello,
)
from pact_ingress.proto.hello_fast import quick_sni
from pact_ingress.proto.passthrough import (
    BACKEND,
    CLIENT,
    DOWN,
    F_DONE,
    F_READ,
    F_WRITE,
    PUMP_DOWN,
    PUMP_UP,
    S_CLOSED,
    S_HELLO,
    S_SPLICING,
    UP,
    Passthrough,
    Step,
    alert_for,
)
from pact_ingress.proto.proxy_protocol import encode_v2
from pact_ingress.proto.tunnel.frames import raw_data_prefix

#: Events taken per `poll(0)`: enough to amortise the call, few enough that one batch
#: does not hold the trio thread for long (a few ms at most).
MAX_EVENTS = 256
#: Batches handled back to back before the engine yields to the other trio tasks.
BATCHES_PER_YIELD = 4
#: Connections accepted per listener per round; the rest of the backlog is taken on
#: the next round (edge-triggered: nothing would report it again).
ACCEPT_BATCH = 64
#: How often deadlines are checked: timeouts fire up to this late. Timeouts here are
#: seconds to minutes, so a second of slack is noise, and a sweep of 10,000 connections
#: costs a few milliseconds.
SWEEP_INTERVAL = 1.0
#: Bytes read by the copy that starts every wake-up of a direction (see `Edge._copy`): a
#: request or a response usually fits; a read that fills it hands the direction to splice.
COPY_PROBE = 16384
#: The accepted socket's type and protocol, as plain ints (`_accept`).
_STREAM, _TCP = int(socket.SOCK_STREAM), int(socket.IPPROTO_TCP)
#: A backend socket's families and type, as plain ints (`_dial`), and what a
#: non-blocking connect that has not failed returns.
_INET, _INET6 = int(socket.AF_INET), int(socket.AF_INET6)
_NEW_STREAM = int(socket.SOCK_STREAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
_CONNECTING = (0, errno.EINPROGRESS)
#: Per-call non-blocking reads and writes of a client socket whose fd blocks (`_accept`).
_DONTWAIT = socket.MSG_DONTWAIT
_ONE = (1).to_bytes(4, sys.byteorder)  # FIONBIO's int argument
#: Every fd's registration: readable, peer half-close, edge-triggered (errors and hang-ups
#: are reported whatever is asked for).
REGISTER = select.EPOLLIN | select.EPOLLRDHUP | select.EPOLLET
#: The registration once a write to the fd has blocked: writable too.
REGISTER_OUT = REGISTER | select.EPOLLOUT
_READABLE = select.EPOLLIN | select.EPOLLRDHUP | select.EPOLLHUP
_WRITABLE = select.EPOLLOUT | select.EPOLLHUP
_ERROR = select.EPOLLERR
#: The peer shut its sending side: its EOF waits to be read, and no later edge reports it.
_HUP = select.EPOLLRDHUP | select.EPOLLHUP
#: What an edge in SPLICING may carry that only `Passthrough.ready` judges.
_OUT_OR_ERROR = select.EPOLLOUT | select.EPOLLERR
#: `Wait`'s members as globals (an Enum class attribute costs a metaclass hook on 3.11).
_W_READ, _W_WRITE, _W_EOF, _W_BUSY = Wait.READ, Wait.WRITE, Wait.EOF, Wait.BUSY
_READ_HELLO, _SEND_HEAD = Step.READ_HELLO, Step.SEND_HEAD
#: A head this long may leave in more than one segment (the smallest MSS a path may
#: have): its backend socket gets `STREAM_OPTIONS` before the connect, else Nagle could
#: hold the head's tail. A shorter head leaves in one segment whatever the options are,
#: and the options are set when the client's first bytes after it are relayed
#: (`_tune`): a connection that relays nothing more costs no setsockopt(2).
TUNE_AT_CONNECT = 536


#: A route's (route, (up, down) byte counters, "ok" connections counter, `conn_close`
#: line head): see `Edge._prepared`.
_Prepared = tuple[Route, tuple[Any, Any], Any, str]
#: The fields of the `conn_close` line (`Edge._finish`).
_CLOSE_FIELDS = frozenset(("route", "tenant", "mode", "client_ip", "bytes_up", "bytes_down",
                           "duration_s", "outcome"))


class _Conn(Passthrough):
    """A connection the engine owns: its state machine plus sockets, pipes, counts."""

    __slots__ = ("csock", "cfd", "bsock", "bfd", "client", "who", "kind", "buf",
                 "route", "head", "hello_len", "addrs", "addr_i", "start", "upd", "downd",
                 "up_pipe", "down_pipe", "up_bytes", "down_bytes", "creg", "last_error",
                 "up_left", "down_left", "hup", "tuned", "outs", "muted", "counters",
                 "nonblocking", "prepared", "local")

    def __init__(self, now: float, hello_timeout: float, csock: _socket.socket,
                 client: tuple[str, int], who: str, local: tuple[str, int] | None) -> None:
        # `Passthrough.__init__`, inline (a call per connection; `super()` would build an
        # object too): the same fields and values, which a test holds it to
        self.state = S_HELLO
        self.deadline = now + hello_timeout
        self.outcome = None
        self.up = self.down = F_READ
        self.connected = False
        self.seen = 0
        self.idle_timeout = self.head_timeout = 0.0
        self.csock = csock
        self.cfd = csock.fileno()
        #: The address the client connected to, when its listener's says it (bound to
        #: one address); None: ask the socket (a wildcard listener), if ever needed.
        self.local = local
        self.bsock: _socket.socket | None = None
        self.bfd = -1
        self.client = client
        self.who = who
        self.kind: Tally | None = None  # the _Counts bucket it is counted in
        self.buf = b""
        self.route: Route | None = None
        self.head: bytes | memoryview | None = None  # a view once partly written
        self.hello_len = 0
        self.addrs: tuple[str, ...] = ()
        self.addr_i = 0
        self.start = now
        self.upd: Direction | None = None
        self.downd: Direction | None = None
        self.up_pipe: Pipe | None = None
        self.down_pipe: Pipe | None = None
        self.up_bytes = 0
        self.down_bytes = 0
        self.creg = False  # the client fd is in the epoll set
        self.up_left = b""  # copied bytes the backend has not taken yet
        self.down_left = b""  # and the client
        self.hup = 0  # sides whose peer shut down its sending side (bit per side)
        self.tuned = False  # the backend socket has STREAM_OPTIONS
        self.outs = 0  # sides whose fd is registered for writability (bit per side)
        self.muted = 0  # sides whose fd is not registered for readability (bit per side)
        self.last_error: str = ""
        self.counters: tuple[Any, Any] = (None, None)  # the route's (up, down) byte counters
        self.nonblocking = False  # the client fd has O_NONBLOCK (see `_accept`)
        self.prepared: _Prepared | None = None  # its route's constants, once routed

    def add_up(self, n: int) -> None:
        self.up_bytes += n

    def add_down(self, n: int) -> None:
        self.down_bytes += n


class Edge:
    """The epoll engine serving the router's socket listeners (see the module doc)."""

    def __init__(self, router: Router, listeners: Sequence[trio.SocketListener]) -> None:
        self.router = router
        self.stats = router.stats
        self.ep = select.epoll()
        self.fds: dict[int, tuple[_Conn, int]] = {}
        self.conns: set[_Conn] = set()
        self.listeners: dict[int, socket.socket] = {}
        self.owed: list[socket.socket] = []  # listeners whose backlog was not emptied
        self.again: list[tuple[_Conn, int]] = []  # directions that stopped busy
        #: Sockets of connections that ended, closed once the batch of events being
        #: handled is done (`_close_ended`): until then their fd numbers cannot be taken
        #: again by an accept or a connect in the same batch, which would have the rest
        #: of the batch's events (read before the reuse) applied to the new connection.
        self.ended: list[_socket.socket] = []
        self.draining = False
        self.accept_paused_until = -math.inf
        self.next_sweep = -math.inf
        self.now = 0.0
        self._waiting: trio.CancelScope | None = None
        #: Counter increments owed, added up over the batches of events handled back to
        #: back and applied before the engine yields or waits (`_flush`): one `inc` per
        #: counter per busy spell, not one per connection and step.
        self.tally: dict[Any, int] = {}
        #: What every connection of a route needs, made once per route (`_prepared`).
        self.routes: dict[str, _Prepared] = {}
        #: Each listener's own address where every connection it accepts has that local
        #: address (bound to one IP), else None: a PROXY v2 header's destination without
        #: a getsockname(2) per connection.
        self.locals: dict[int, tuple[str, int] | None] = {}
        for listener in listeners:
            fd = listener.socket.fileno()
            raw = socket.socket(fileno=fd)  # the same fd: detached in stop_accepting
            self.locals[fd] = _bound_address(raw)
            for option, value in STREAM_OPTIONS:  # inherited by every accepted socket
                raw.setsockopt(socket.IPPROTO_TCP, option, value)
            self.listeners[fd] = raw
            self.ep.register(fd, select.EPOLLIN | select.EPOLLET)
            self.owed.append(raw)  # a backlog that filled before registration

    def stop_accepting(self) -> None:
        """Drain: no more accepts; the task ends when the last connection has."""
        for fd, raw in self.listeners.items():
            try:
                self.ep.unregister(fd)
            except OSError:
                pass
            raw.detach()
        self.listeners.clear()
        self.owed.clear()
        self.draining = True
        if self._waiting is not None:
            self._waiting.cancel()

    # --- the loop ----------------------------------------------------------------------

    async def run(self) -> None:
        ep = self.ep
        batches = 0
        clock = trio.lowlevel.current_clock()  # what trio.current_time() asks, in one call
        try:
            while True:
                self.now = now = clock.current_time()
                if now >= self.next_sweep:
                    self._sweep(now)
                if self.owed and now >= self.accept_paused_until:
                    owed, self.owed = self.owed, []
                    for raw in owed:
                        self._accept(raw)
                events = ep.poll(0, MAX_EVENTS)
                log.hold()  # a batch's log lines go out in one write
                try:
                    for fd, mask in events:
                        self._event(fd, mask)
                    if self.again:
                        again, self.again = self.again, []
                        for conn, direction in again:
                            if conn.state is S_SPLICING:
                                self._guarded(conn, self._pump, direction)
                finally:
                    log.release()
                    if self.ended:
                        self._close_ended()
                batches += 1
                if events or self.again or (self.owed and now >= self.accept_paused_until):
                    if batches >= BATCHES_PER_YIELD:
                        batches = 0
                        if self.tally:
                            self._flush()
                        await trio.lowlevel.checkpoint()
                    continue
                if self.tally:  # before anything else may read them: once per busy spell
                    self._flush()
                if self.draining and not self.conns:
                    return
                batches = 0
                await self._wait()
        finally:
            self._close_all()

    async def _wait(self) -> None:
        wake = self.next_sweep if self.conns else math.inf
        if self.owed:
            wake = min(wake, self.accept_paused_until)
        with trio.CancelScope(deadline=wake) as scope:
            self._waiting = scope
            await trio.lowlevel.wait_readable(self.ep.fileno())
        self._waiting = None

    def _event(self, fd: int, mask: int) -> None:
        entry = self.fds.get(fd)
        if entry is None:
            raw = self.listeners.get(fd)
            if raw is not None:
                if self.now >= self.accept_paused_until:
                    self._accept(raw)
                elif raw not in self.owed:
                    self.owed.append(raw)
            return  # or a stale event of a connection closed earlier in this batch
        conn, side = entry
        if mask & _HUP:
            conn.hup |= 1 << side
        try:
            if conn.state is S_SPLICING and not mask & _OUT_OR_ERROR:
                # The common edge: data (or the peer's EOF) to read on one side, which is
                # the source of one direction (UP == CLIENT): `ready` would name that pump
                # alone. A hang-up is a writable edge too: when the other direction waits
                # to write to this side, `ready` judges it.
                if side == CLIENT:
                    mine, other = conn.up, conn.down
                else:
                    mine, other = conn.down, conn.up
                if (mine is F_READ
                        and (other is not F_WRITE or not mask & select.EPOLLHUP)):
                    self._relay_short(conn, side)
                    return
            steps = conn.ready(side, mask & _READABLE, mask & _WRITABLE, mask & _ERROR)
            for step in steps:
                if conn.state is S_CLOSED:
                    break
                self._step(conn, step)
            if mask & _ERROR and side == CLIENT and conn.state is not S_CLOSED \
                    and conn.state is not S_HELLO:
                # The client's reset came in the edge that completed its hello: the read
                # took the hello, queued ahead of the reset, and routed it; no later edge
                # reports the reset, and a direction that stops before reading the client
                # to its end would never see it. Past HELLO a reset ends the connection.
                self._finish(conn, "reset")
        except Exception as exc:  # one connection's bug must not stop the engine
            self._crashed(conn, exc)

    def _count(self, counter: Any, n: int = 1) -> None:
        tally = self.tally
        tally[counter] = tally.get(counter, 0) + n

    def _flush(self) -> None:
        tally, self.tally = self.tally, {}
        for counter, n in tally.items():
            counter.inc(n)

    def _guarded(self, conn: _Conn, action: Any, arg: Any) -> None:
        try:
            action(conn, arg)
        except Exception as exc:
            self._crashed(conn, exc)

    def _step(self, conn: _Conn, step: Step) -> None:
        if step is PUMP_UP:
            self._pump(conn, UP)
        elif step is PUMP_DOWN:
            self._pump(conn, DOWN)
        elif step is _READ_HELLO:
            self._read_hello(conn)
        elif step is _SEND_HEAD:
            self._send_head(conn)
        else:  # Step.FAIL
            self._finish(conn, "reset")

    def _sweep(self, now: float) -> None:
        self.next_sweep = now + SWEEP_INTERVAL
        for conn in [c for c in self.conns if c.deadline <= now]:
            try:
                outcome = conn.expired(now)
                if outcome is not None:
                    self._expired(conn, outcome)
            except Exception as exc:
                self._crashed(conn, exc)

    def _expired(self, conn: _Conn, outcome: str) -> None:
        if outcome == "clienthello_timeout":
            self.router._reject(conn.client[0], "clienthello_timeout")
            self._drop(conn)
        elif outcome == "backend_down":
            self._unreachable(conn, "timed out")
        elif outcome == "backend_reset":
            self._backend_reset(conn, "backend did not take the ClientHello")
        else:
            self._finish(conn, outcome)

    # --- accept and peek -----------------------------------------------------------------

    def _accept(self, raw: socket.socket) -> None:
        router = self.router
        counts = router._counts
        limits = router.limits
        family = raw.family
        local = self.locals.get(raw.fileno())
        # `router._over_limit`'s bounds, for its usual answer (none) without the call; a
        # connection at a bound gets its reason from it (limits change between rounds,
        # never within one)
        most = limits.max_connections
        most_per_client = limits.max_connections_per_ip + PEEK_HEADROOM
        pending = counts.pending
        clients = counts.clients
        hello_timeout = limits.clienthello_timeout
        episode = router.accept_episode
        for _ in range(ACCEPT_BATCH):
            try:
                fd, addr = raw._accept()  # the fd alone: `accept()` wraps it in Python
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno not in CAPACITY_ERRNOS:
                    raise
                name = errno.errorcode[exc.errno]
                self.stats.rejections.labels("accept_" + name).inc()
                episode.failed(name, self.now)
                self.accept_paused_until = self.now + ACCEPT_BACKOFF
                self.owed.append(raw)
                return
            if episode.failures:
                episode.accepted(self.now)
            ip = addr[0]
            who = client_of(ip) if ":" in ip else ip
            if (counts.total >= most
                    or pending.get(who, 0) + clients.get(who, 0) >= most_per_client):
                reason = router._over_limit(who)
                if reason is not None:
                    self.stats.rejections.labels(reason).inc()
                    self.stats.refused("-", ip, reason)
                    os.close(fd)  # at accept: nothing read, nothing answered
                    continue
            # The fd stays blocking: every read and write of it here says MSG_DONTWAIT, and
            # O_NONBLOCK (one more syscall) is set only when it is first spliced
            # (`_nonblocking`), which most connections never are.
            sock = _socket.socket(family, _STREAM, _TCP, fd)
            counts.total += 1
            pending[who] = pending.get(who, 0) + 1
            conn = _Conn(self.now, hello_timeout, sock,
                         addr if len(addr) == 2 else (ip, addr[1]), who, local)
            self.conns.add(conn)
            try:
                self._read_hello(conn)
            except Exception as exc:
                self._crashed(conn, exc)
        self.owed.append(raw)  # more may be queued: taken next round, without a wait

    def _read_hello(self, conn: _Conn) -> None:
        router = self.router
        while True:
            try:
                chunk = conn.csock.recv(PEEK_READ, _DONTWAIT)
            except BlockingIOError:
                if not conn.creg:
                    self._register(conn.cfd, conn, CLIENT)
                    conn.creg = True
                return
            except OSError:
                router._reject(conn.client[0], "clienthello_reset")
                self._drop(conn)
                return
            if not chunk:
                router._reject(conn.client[0], "clienthello_eof")
                self._drop(conn)
                return
            buf = conn.buf = conn.buf + chunk
            if router.tunnels is not None and (raw := raw_data_prefix(buf)) is not False:
                if raw:
                    self._classified(conn, None)
                    return
                continue  # part of the magic so far
            sni = quick_sni(buf)
            if sni is not None:  # whole, valid, and naming a host: the usual hello
                self._classified(conn, sni, more=len(chunk) == PEEK_READ)
                return
            try:
                hello = parse_client_hello(buf)
            except ClientHelloError as exc:
                router._reject(conn.client[0], "clienthello_" + exc.reason)
                self._drop(conn)
                return
            if hello is not None:
                self._classified(conn, hello, more=len(chunk) == PEEK_READ)
                return

    def _classified(self, conn: _Conn, hello: ClientHello | str | None,
                    more: bool = False) -> None:
        """The first bytes say what the connection is: serve it here or hand it off.
        `hello`: the parsed ClientHello, or only its SNI (`quick_sni` vouched for the
        rest: `_hello` parses it when a ClientHello is needed), or None for a tunnel's
        raw data connection."""
        router = self.router
        ip = conn.client[0]
        if hello is None:
            sni = None
            tunnel = True
        else:
            sni = hello if type(hello) is str else hello.sni  # type: ignore[union-attr]
            tunnel = (sni is not None and sni == router.tunnel_hostname
                      and router._is_tunnel(self._hello(conn, hello)))
        if tunnel:  # pending until the tunnel server admits it (`Router._unproven`)
            conn.kind = router._counts.pending
            self._hand_off(conn, hello)
            return
        kind = router._classify(conn.who, ip, False)
        if kind is None:  # over its kind's cap: refused (and uncounted) by _classify
            self._drop(conn, counted=False)
            return
        conn.kind = kind
        relay = router.relay
        if relay is not None and sni is not None and normalize_hostname(
                sni, validate=False) == relay.host:
            self._hand_off(conn, hello)
            return
        table = router.table
        route = table.exact.get(sni)  # type: ignore[arg-type]
        if route is None:  # the parser's SNI is spelled canonically: no normalising
            route = table.lookup(sni)
        if route is None:
            router._reject(ip, "unknown_sni" if sni else "no_sni")
            _send_alert(conn.csock, tls_alert.UNRECOGNIZED_NAME)
            self._drop(conn)
            return
        address = route.backend.address
        addrs = None
        if route.mode == "passthrough" and address is not None:
            addrs = router.backends.resolver.cached(address.host)
        if addrs is None:  # terminate, tunnel backend, or a name not resolved yet
            if route.mode == "terminate" and _no_acme(conn.buf, hello):
                self._hand_off_terminate(conn, route, sni)
            else:
                self._hand_off(conn, hello)
            return
        # The backend connect (here rather than in a method of its own: every routed
        # connection comes this way, and a call costs more than these few lines).
        conn.route = route
        prepared = self.routes.get(route.host)
        if prepared is None or prepared[0] is not route:
            prepared = self._prepared(route)
        conn.prepared = prepared
        conn.counters = prepared[1]
        conn.addrs = addrs
        head = conn.buf
        conn.hello_len = len(head)
        if route.proxy_protocol == "v2":
            local = conn.local
            if local is None:  # a wildcard listener: the address it was reached at
                name = conn.csock.getsockname()
                local = (str(name[0]), int(name[1]))
            head = encode_v2(conn.client, local) + head
        conn.head = head
        conn.routed(self.now, CONNECT_TIMEOUT, HEAD_TIMEOUT, route.limits.idle_timeout, more)
        if not conn.creg:  # (a hello whole in the read after accept)
            # Watched from now on, not only once the head is sent: a client that resets
            # while the connect hangs ends the connection at once. Registering reports
            # what is ready already, so no edge is lost either way.
            self.fds[conn.cfd] = (conn, CLIENT)
            self.ep.register(conn.cfd, REGISTER)
            conn.creg = True
        self._dial(conn)

    def _hand_off(self, conn: _Conn, hello: ClientHello | str | None) -> None:
        """To the router's task path, with the bytes read so far."""
        parsed = None if hello is None else self._hello(conn, hello)
        self._forget(conn, handing_off=True)
        conn.close("handed_off")
        assert conn.kind is not None
        _nonblocking(conn)  # what the task path expects of an fd
        # what trio wraps; naming family, type and protocol spares the two getsockopt(2)
        # the socket module would otherwise make to learn them
        csock = conn.csock
        sock = socket.socket(csock.family, socket.SOCK_STREAM, socket.IPPROTO_TCP,
                             csock.detach())
        self.router.adopt(sock, parsed, conn.buf, conn.client, conn.who, conn.kind)

    def _hand_off_terminate(self, conn: _Conn, route: Route, sni: str | None) -> None:
        """`_hand_off` for a terminate connection the router would serve as such
        (`Router._plain_terminate`): the route goes with it, the ClientHello is not
        parsed again, and the socket goes as it is (no new socket object for the fd)."""
        self._forget(conn, handing_off=True)
        conn.close("handed_off")
        assert conn.kind is not None
        _nonblocking(conn)  # the engine tries each recv/send before it waits
        self.router.adopt_terminate(conn.csock, route, sni, conn.buf, conn.client, conn.who,
                                    conn.kind)

    @staticmethod
    def _hello(conn: _Conn, hello: ClientHello | str) -> ClientHello:
        """The ClientHello itself where only its SNI was taken (`quick_sni`)."""
        if type(hello) is not str:
            return hello  # type: ignore[return-value]
        parsed = parse_client_hello(conn.buf)
        assert parsed is not None and parsed.sni == hello  # quick_sni's promise
        return parsed

    # --- backend ---------------------------------------------------------------------------

    def _dial(self, conn: _Conn) -> None:
        """Connect to the next address; a refusal moves on to the one after."""
        route = conn.route
        assert route is not None and route.backend.address is not None
        port = route.backend.address.port
        while conn.addr_i < len(conn.addrs):
            ip = conn.addrs[conn.addr_i]
            try:  # out of fds (EMFILE) fails this address like a refusal would
                sock = _socket.socket(_INET6 if ":" in ip else _INET, _NEW_STREAM)
            except OSError as exc:
                conn.last_error = str(exc)
                conn.addr_i += 1
                continue
            conn.tuned = len(conn.head) > TUNE_AT_CONNECT  # type: ignore[arg-type]
            if conn.tuned:
                for option, value in STREAM_OPTIONS:
                    sock.setsockopt(socket.IPPROTO_TCP, option, value)
            err = sock.connect_ex((ip, port))
            if err in _CONNECTING:
                conn.bsock = sock
                conn.bfd = fd = sock.fileno()
                self.fds[fd] = (conn, BACKEND)
                self.ep.register(fd, REGISTER)
                self._send_head(conn)
                return
            sock.close()
            conn.last_error = f"[Errno {err}] {os.strerror(err)}"
            conn.addr_i += 1
        self._unreachable(conn, conn.last_error)

    def _send_head(self, conn: _Conn) -> None:
        head = conn.head
        assert head is not None
        try:
            n = os.write(conn.bfd, head)
        except BlockingIOError:  # connecting, or (connected) a full buffer:
            self._want_out(conn, BACKEND)  # the backend's writable edge says
            return
        except OSError as exc:
            conn.addr_i += 1
            outcome = conn.backend_failed(self.now, conn.addr_i < len(conn.addrs),
                                          CONNECT_TIMEOUT)
            if outcome == "backend_reset":
                self._backend_reset(conn, str(exc))
                return
            self._close_backend(conn)
            conn.last_error = str(exc)
            if outcome is None:  # the next address
                self._dial(conn)
            else:
                self._unreachable(conn, conn.last_error)
            return
        if n < len(head):  # the rest when the backend takes more (no copy of it)
            conn.head = (head if type(head) is memoryview else memoryview(head))[n:]
            conn.head_progress(self.now, False)
            # a short write is a write that blocked: the kernel (TCP_NOTSENT_LOWAT, a
            # small window) says so without an EAGAIN, and the backend may send nothing
            # until it has the whole hello, so only its writable edge can move the rest
            self._want_out(conn, BACKEND)
            return
        steps = conn.head_progress(self.now, True)
        conn.head = None
        conn.buf = b""  # sent: an idle connection keeps no copy of its hello
        assert conn.route is not None
        tally = self.tally
        counter = conn.counters[0]
        tally[counter] = tally.get(counter, 0) + conn.hello_len
        if conn.hup & (1 << CLIENT) and PUMP_UP not in steps:
            steps += (PUMP_UP,)  # its EOF arrived with the hello: no edge will come
        for step in steps:
            if conn.state is S_CLOSED:
                return
            self._step(conn, step)

    # --- splice ------------------------------------------------------------------------------

    def _pump(self, conn: _Conn, direction: int) -> None:
        if direction == UP:
            d, pipe, moved, before = conn.upd, conn.up_pipe, conn.add_up, conn.up_bytes
            src, dst = conn.cfd, conn.bfd
        else:
            d, pipe, moved, before = conn.downd, conn.down_pipe, conn.add_down, conn.down_bytes
            src, dst = conn.bfd, conn.cfd
        try:
            wait = self._copy(conn, direction, moved) if pipe is None else _W_BUSY
            if wait is _W_BUSY:  # a full probe, or mid-splice: the rest by splice
                if not conn.tuned and direction == UP:
                    _tune(conn)
                if d is None:  # splice's state, made the first time a direction needs it
                    if not conn.nonblocking:  # splice(2) has no MSG_DONTWAIT
                        _nonblocking(conn)
                    d = Direction("", src, dst)
                    if direction == UP:
                        conn.upd = d
                    else:
                        conn.downd = d
                if pipe is None:
                    pipe = take_pipe()
                wait = pump(d, pipe, moved, YIELD_EVERY)
        except OSError:
            self._keep_pipe(conn, direction, pipe)
            self._finish(conn, "reset")
            return
        if pipe is not None and (wait is _W_READ or wait is _W_EOF):
            give_pipe(pipe, drained=True)
            pipe = None
        if wait is _W_EOF:
            other = conn.down if direction == UP else conn.up
            if other is not F_DONE:  # passed on as a half-close
                dst = conn.bsock if direction == UP else conn.csock
                try:  # (the last EOF needs none: both sockets close right after)
                    dst.shutdown(socket.SHUT_WR)  # type: ignore[union-attr]
                except OSError:
                    pass  # the peer is gone: the other direction will see that
        elif wait is _W_BUSY:
            self.again.append((conn, direction))
        elif wait is _W_WRITE:
            self._want_out(conn, BACKEND if direction == UP else CLIENT)
        if direction == UP:
            conn.up_pipe = pipe
            after = conn.up_bytes
        else:
            conn.down_pipe = pipe
            after = conn.down_bytes
        if after != before:
            self._count(conn.counters[direction], after - before)
        flow = F_DONE if wait is _W_EOF else F_WRITE if wait is _W_WRITE else F_READ
        muted = conn.muted & (1 << direction)  # (the source of UP is the CLIENT side)
        if flow is F_WRITE:
            if not muted:
                self._mute(conn, direction, True)
        elif muted and flow is F_READ:  # a source read to its EOF stays muted: no edge
            self._mute(conn, direction, False)  # of it could be of use any more
        if conn.pumped(direction, flow, after != before, self.now):
            self._finish(conn, "ok")

    def _relay_short(self, conn: _Conn, direction: int) -> None:
        """A readable edge on the source of `direction` (client side = UP): short
        messages are read and written here, and an EOF is passed on, and that is the
        edge's whole work; anything else (a full probe, a destination that does not take
        it all, a direction with a pipe in use or bytes left over) goes on to `_pump` with
        nothing lost. The same steps as `_pump` → `_copy` in the usual cases, without
        their generality."""
        if direction == UP:
            if conn.up_pipe is not None or conn.up_left:
                self._pump(conn, UP)
                return
            src, dst = conn.csock, conn.bsock
        else:
            if conn.down_pipe is not None or conn.down_left:
                self._pump(conn, DOWN)
                return
            src, dst = conn.bsock, conn.csock
        while True:
            try:
                data = src.recv(COPY_PROBE, _DONTWAIT)  # type: ignore[union-attr]
            except BlockingIOError:
                return  # drained (or a spurious edge): the direction waits to read
            except OSError:
                self._finish(conn, "reset")
                return
            size = len(data)
            if not size:  # EOF: passed on as a half-close, unless it is the last one
                if (conn.down if direction == UP else conn.up) is not F_DONE:
                    try:
                        dst.shutdown(socket.SHUT_WR)  # type: ignore[union-attr]
                    except OSError:
                        pass  # the peer is gone: the other direction will see that
                if conn.pumped(direction, F_DONE, False, self.now):
                    self._finish(conn, "ok")
                return
            if not conn.tuned and direction == UP:
                _tune(conn)
            try:
                n = dst.send(data, _DONTWAIT)  # type: ignore[union-attr]
            except BlockingIOError:
                n = 0
            except OSError:
                self._finish(conn, "reset")
                return
            if n:
                if direction == UP:
                    conn.up_bytes += n
                else:
                    conn.down_bytes += n
                counter = conn.counters[direction]
                tally = self.tally
                tally[counter] = tally.get(counter, 0) + n
                conn.deadline = self.now + conn.idle_timeout
            if n < size:
                if direction == UP:
                    conn.up_left = data[n:]
                else:
                    conn.down_left = data[n:]
                break
            if size == COPY_PROBE:
                break  # a bulk transfer: the rest by splice
            if not conn.hup & (1 << direction):
                return  # a short read: drained, and passed on whole
            # its peer has shut down: the EOF behind the data raises no new edge
        self._pump(conn, direction)  # bytes left to write, or more to read by splice

    @staticmethod
    def _copy(conn: _Conn, direction: int, moved: Any) -> Wait:
        """The first step of a wake-up: one read of at most COPY_PROBE bytes, copied.

        Most wake-ups of a connection carry a request, a response or an EOF, far less
        than a pipeful: read + write is two syscalls where a splice costs three (in,
        out, and the EAGAIN that proves the source drained) plus a pipe from the pool.
        A short read proves the source drained as well (a TCP read returns less than
        asked only when nothing else is queued; anything arriving later raises a new
        edge). A full probe means a bulk transfer: BUSY, and the rest goes by splice.
        Bytes the destination does not take wait in `conn.up_left/down_left` (at most
        COPY_PROBE per direction)."""
        if direction == UP:
            src, dst, left = conn.csock, conn.bsock, conn.up_left
        else:
            src, dst, left = conn.bsock, conn.csock, conn.down_left
        if left:
            try:
                n = dst.send(left, _DONTWAIT)  # type: ignore[union-attr]
            except BlockingIOError:
                n = 0
            moved(n)
            left = left[n:]
            if direction == UP:
                conn.up_left = left
            else:
                conn.down_left = left
            if left:
                return _W_WRITE
        src_side = CLIENT if direction == UP else BACKEND
        while True:
            try:
                data = src.recv(COPY_PROBE, _DONTWAIT)  # type: ignore[union-attr]
            except BlockingIOError:
                return _W_READ
            if not data:
                return _W_EOF
            if not conn.tuned and direction == UP:
                _tune(conn)
            try:
                n = dst.send(data, _DONTWAIT)  # type: ignore[union-attr]
            except BlockingIOError:
                n = 0
            if n:
                moved(n)
            if n < len(data):
                if direction == UP:
                    conn.up_left = data[n:]
                else:
                    conn.down_left = data[n:]
                return _W_WRITE
            if len(data) == COPY_PROBE:
                return _W_BUSY
            if not conn.hup & (1 << src_side):
                return _W_READ
            # a short read does not prove a drained source when its peer has shut down:
            # the EOF behind the data raises no new edge, so read on until it shows

    @staticmethod
    def _keep_pipe(conn: _Conn, direction: int, pipe: Pipe | None) -> None:
        if direction == UP:
            conn.up_pipe = pipe
        else:
            conn.down_pipe = pipe

    # --- endings ---------------------------------------------------------------------------

    def _unreachable(self, conn: _Conn, error: str) -> None:
        route = conn.route
        assert route is not None
        router = self.router
        router._reject(conn.client[0], "backend_unreachable", route.host)
        log.warning("backend_unreachable", route=route.host, tenant=route.tenant,
                    error=f"backend {route.backend.address} unreachable: {error}")
        router._connections(route.host, "backend_down").inc()
        alert = alert_for("backend_down")
        if alert is not None:
            _send_alert(conn.csock, alert)
        self._end(conn, "backend_down")

    def _backend_reset(self, conn: _Conn, error: str) -> None:
        route = conn.route
        assert route is not None
        log.warning("backend_reset", route=route.host, error=error)
        self.router._connections(route.host, "backend_reset").inc()
        self._end(conn, "backend_reset")

    def _finish(self, conn: _Conn, outcome: str) -> None:
        """A routed connection is over: its log line and counter, then close."""
        route = conn.route
        prepared = conn.prepared  # made for `route` when it was routed
        assert route is not None and prepared is not None
        _, _, ok, head = prepared
        bytes_up = conn.up_bytes + conn.hello_len
        if not log.emit_members(logging.INFO, "conn_close", (
                f'{head}{_json_str(conn.client[0])},"bytes_up":{bytes_up},'
                f'"bytes_down":{conn.down_bytes},"duration_s":{ms_repr(self.now - conn.start)},'
                f'"outcome":{_json_str(outcome)}'), _CLOSE_FIELDS):
            log.info("conn_close", route=route.host, tenant=route.tenant, mode="passthrough",
                     client_ip=conn.client[0], bytes_up=bytes_up, bytes_down=conn.down_bytes,
                     duration_s=round(self.now - conn.start, 3), outcome=outcome)
        counter = ok if outcome == "ok" else self.router._connections(route.host, outcome)
        tally = self.tally
        tally[counter] = tally.get(counter, 0) + 1
        self._end(conn, outcome)

    def _prepared(self, route: Route) -> _Prepared:
        """The per-route constants of a connection: its byte counters, its "ok"
        connections counter and the constant head of its `conn_close` line. Made again
        for the new `Route` a reload gives."""
        if len(self.routes) > 4096:  # routes come and go with reloads
            self.routes.clear()
        router = self.router
        host = route.host
        prepared = self.routes[host] = (
            route, router._byte_counters(host), router._connections(host, "ok"),
            members(route=host, tenant=route.tenant, mode="passthrough") + ',"client_ip":')
        return prepared

    def _crashed(self, conn: _Conn, exc: Exception) -> None:
        self.stats.rejections.labels("handler_error").inc()
        log.error("handler_error", client_ip=conn.client[0],
                  error=f"{type(exc).__name__}: {exc}")
        if conn.route is not None and conn.state is not S_HELLO:
            self.router._connections(conn.route.host, "error").inc()
        self._end(conn, "error")

    def _drop(self, conn: _Conn, counted: bool = True) -> None:
        """A connection that never got past its first bytes: close it, uncount it
        (`counted` False: `_classify` refused it and took it out of the counts)."""
        self._end(conn, "refused", pending=counted)

    def _end(self, conn: _Conn, outcome: str, pending: bool = True) -> None:
        if conn not in self.conns:
            return  # ended already
        if conn.state is not S_CLOSED:
            conn.close(outcome)
        self.conns.discard(conn)  # `_forget` and `_close_backend`, inline: every end
        fds = self.fds
        fds.pop(conn.cfd, None)
        conn.creg = False
        if conn.up_pipe is not None or conn.down_pipe is not None:
            for pipe, d in ((conn.up_pipe, conn.upd), (conn.down_pipe, conn.downd)):
                if pipe is not None:
                    give_pipe(pipe, drained=d is not None and d.pending == 0)
            conn.up_pipe = conn.down_pipe = None
        if conn.bsock is not None:
            fds.pop(conn.bfd, None)
            self.ended.append(conn.bsock)  # out of the epoll set when closed: its only fd
            conn.bsock = None
            conn.bfd = -1
        self.ended.append(conn.csock)  # (closed with the batch: `ended`)
        counts = self.router._counts
        counts.total -= 1
        kind = conn.kind
        if kind is None:
            if not pending:
                return
            kind = counts.pending
        who = conn.who
        left = kind[who] - 1
        if left:
            kind[who] = left
        else:
            del kind[who]

    def _forget(self, conn: _Conn, handing_off: bool = False) -> None:
        """Out of the engine's tables; a client socket that lives on (handed off) out of
        the epoll set too (closing an fd removes it: no epoll_ctl for the usual end)."""
        self.conns.discard(conn)
        if self.fds.pop(conn.cfd, None) is not None and handing_off:
            self.ep.unregister(conn.cfd)
        conn.creg = False
        if conn.bfd >= 0:
            self.fds.pop(conn.bfd, None)

    def _close_backend(self, conn: _Conn) -> None:
        if conn.bsock is not None:
            self.fds.pop(conn.bfd, None)
            self.ended.append(conn.bsock)  # (closed with the batch: `ended`)
            conn.bsock = None
            conn.bfd = -1
            conn.outs &= ~(1 << BACKEND)

    def _register(self, fd: int, conn: _Conn, side: int) -> None:
        self.fds[fd] = (conn, side)
        self.ep.register(fd, REGISTER)

    def _want_out(self, conn: _Conn, side: int) -> None:
        """A write to `side` would block: its fd reports writability from now on (a
        MOD reports what is ready already, so an edge between the write and it is not
        lost)."""
        bit = 1 << side
        if conn.outs & bit:
            return
        fd = conn.cfd if side == CLIENT else conn.bfd
        if fd < 0 or fd not in self.fds:
            return
        conn.outs |= bit
        self.ep.modify(fd, _interest(conn, bit))

    def _mute(self, conn: _Conn, side: int, mute: bool) -> None:
        """Stop (or resume) reporting readability of `side`, the source of a direction
        that waits to write: each segment the source's peer sends would raise an edge,
        and a wake-up, that can do nothing while the destination is full. Resuming
        reports what is ready already (a MOD does), and the pump reads its source to
        EAGAIN anyway, so nothing that arrived meanwhile is missed. Hang-ups and errors
        are reported either way."""
        fd = conn.cfd if side == CLIENT else conn.bfd
        if fd < 0 or fd not in self.fds:
            return
        bit = 1 << side
        conn.muted = conn.muted | bit if mute else conn.muted & ~bit
        self.ep.modify(fd, _interest(conn, bit))

    def _close_ended(self) -> None:
        ended, self.ended = self.ended, []
        for sock in ended:
            sock.close()

    def _close_all(self) -> None:
        """The task ends (drain deadline, shutdown): every connection closes now."""
        for conn in list(self.conns):
            if conn.route is not None and conn.state is not S_HELLO:
                self.router._connections(conn.route.host, "error").inc()
            self._end(conn, "error")
        self._close_ended()
        self._flush()
        for raw in self.listeners.values():
            raw.detach()
        self.listeners.clear()
        self.ep.close()


_ACME_ALPN = ACME_ALPN.encode()


def _no_acme(buf: bytes, hello: ClientHello | str) -> bool:
    """The ClientHello is not a TLS-ALPN-01 validation (`is_acme_validation`). Where
    only its SNI was taken (`quick_sni`), bytes that do not contain `acme-tls/1`
    anywhere cannot be one; bytes that do are left to the router, which parses them."""
    if type(hello) is str:
        return _ACME_ALPN not in buf
    return not is_acme_validation(hello.alpn)  # type: ignore[union-attr]


def _bound_address(raw: socket.socket) -> tuple[str, int] | None:
    """The (ip, port) every connection `raw` accepts is addressed to, when it is bound to
    one IP; None for a wildcard, a transparent listener (it accepts connections to other
    addresses) or one whose address cannot be read."""
    try:
        name = raw.getsockname()
        if ipaddress.ip_address(str(name[0]).partition("%")[0]).is_unspecified:
            return None
        if raw.family == socket.AF_INET6:
            transparent = raw.getsockopt(socket.IPPROTO_IPV6, _IPV6_TRANSPARENT)
        else:
            transparent = raw.getsockopt(socket.IPPROTO_IP, _IP_TRANSPARENT)
        if transparent:
            return None
    except (OSError, ValueError, IndexError):
        return None
    return (str(name[0]), int(name[1]))


#: Linux's socket options for a listener that accepts connections to any address.
_IP_TRANSPARENT = getattr(socket, "IP_TRANSPARENT", 19)
_IPV6_TRANSPARENT = getattr(socket, "IPV6_TRANSPARENT", 75)


def _interest(conn: _Conn, bit: int) -> int:
    """The epoll registration of the side `bit` names, from what it asks for now:
    readability unless muted, writability once a write to it has blocked."""
    mask = REGISTER_OUT if conn.outs & bit else REGISTER
    return mask & ~select.EPOLLIN if conn.muted & bit else mask


def _tune(conn: _Conn) -> None:
    """The backend socket's options, before the first client bytes after the head."""
    conn.tuned = True
    sock = conn.bsock
    if sock is not None:
        for option, value in STREAM_OPTIONS:
            sock.setsockopt(socket.IPPROTO_TCP, option, value)


def _send_alert(sock: _socket.socket, description: int) -> None:
    """Best effort: a fatal alert before the close (see `router._send_alert`)."""
    try:
        sock.send(tls_alert.alert_record(description), _DONTWAIT)
    except OSError:
        pass


def _nonblocking(conn: _Conn) -> None:
    """O_NONBLOCK on the client fd, for what cannot say MSG_DONTWAIT per call: splice(2),
    and the task path a handed-off connection goes to. One ioctl, as `setblocking`
    makes, without changing the socket object's own (blocking) mode."""
    conn.nonblocking = True
    fcntl.ioctl(conn.cfd, termios.FIONBIO, _ONE)

