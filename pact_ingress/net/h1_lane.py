"""The keep-alive lane: the terminate engine's usual HTTP/1.1 exchange served from the
readiness hub's epoll loop, without a trio task switch per request.

Theory of operation
-------------------
A keep-alive request through the trio engine (`net/http1.py` and `net/terminate.py`)
parks its connection's task twice (the client's next request, the node's answer) and
runs the request story through coroutines, an `Exchange` and the pool's context
manager. Most requests need none of that: the request arrives whole in one read, the
checks pass, an idle pooled connection to the node is there, and the answer comes whole
in one read. This module serves exactly those, as callbacks of the readiness hub
(`net/readiness.py`), which already owns an edge-triggered epoll set per trio run: a
connection here is a small state machine whose socket's `Watch` points at it
(`Watch.lane`, the connection's bound method), so the hub calls it with each event,
and one wake-up of the hub serves every connection that became ready. The router
starts a connection here without a task of its own (`Lane.start`, through
`Terminator.start_lane`): a connection that is served whole here and closes never
costs a task switch, at its start or its end. Its first result (`wake`) decides: its
end is counted on the spot, anything else gets it a task for good. When no idle
connection to the node is there, that task gets one from the pool (`NeedNode`:
`_Pool.acquire` connects and checks the pins as for the trio engine) and hands it
back (`Lane.connected`); a pooled connection the node had closed is replaced the same
way, once, for a request that may be sent twice (the pool's rule). (`Lane.serve` is
the same with a task from the start, for a caller that has one.)

Everything else is the trio engine's, and a connection goes there for good, in one
step, the moment it needs anything this lane does not do (`Handoff`): its TLS engine
with what its BIOs hold, its socket's place in the hub, its HTTP/1.1 parser with what
is queued, and the request in hand, if any, with how far its story got:

* `Resume.START` — nothing was charged or answered yet: the trio engine serves the
  request from the beginning (a head or body still arriving, a body over
  `MAX_WHOLE_BODY`, `Expect: 100-continue`, a check that would refuse it, a head that
  did not parse, a limiter that is not local).
* `Resume.ANSWER` — the story decided an answer at the edge (rate limited, a seal
  posture refusal, a share refused, a node failure); the trio engine writes it.
* `Resume.FORWARD` — the checks passed and were charged, but the pool gave a node
  connection this lane cannot drive (over a stream, not a socket of ours): the trio
  engine forwards it (`Terminator._forward`).
* `Resume.RELAY` — the node's head came but not its whole answer (a stream, SSE, a
  large body, or a short one whose rest is later than `BODY_GRACE`): the trio engine
  relays the rest (`Upstream.adopt`).
* `Resume.H2` — the client chose HTTP/2 (the handshake is done here).
* `Resume.LINGER` — the connection closes while the client may still be sending: the
  trio engine's linger (`net/linger.py`) keeps the close from resetting our last
  answer away.

(`Resume.WRITE` is an HTTP/2 stream's: `net/h2_lane.py`, which serves the usual HTTP/2
stream the same way and sends to the node through the same `NodeLeg`.)

A node that selects `h2` gets this lane's requests without a body as streams of one
session instead of pooled connections (`net/h2_node.py`): `NeedNode.offer_h2` is the
exchange that tries the node for it, `Lane.connected` installs the session, and an
answer that is not whole goes to the trio engine as `Resume.RELAY` with a
`StreamRelay` in place of the node connection.

The request story itself is `Terminator.lane_story` (beside `Terminator._story`, in the
same order: route, target and host, scope, the IP unit, the body's share and the seal
posture, the caller keys, the share of the node), so the checks cannot differ by path.
Counting and the access log line are `Terminator.count`, as for the trio engine's
exchanges.

Phases (`Phase`, their moves in `_MOVES`): HANDSHAKE → IDLE (between requests) →
[CONNECTING (the task gets a node connection) →] UPSTREAM (the request at the node) →
[WRITING (the answer not all taken by the kernel yet) →] IDLE again; ENDED from any of
them (closed, or handed over). Deadlines, a number per connection fired by one tick of
the sweeper every `TICK` (`Lane.fire`): the handshake by the route's
`clienthello_timeout`, the wait for the next request by its `idle_timeout`, the node's
head by the pool's `header_timeout` (504), each write by `client_write_timeout`.

Reads are bounded: a client's per event by `FILL_BUDGET` (a connection that sends more
at once goes to the trio engine), the node's one read at a time, each decrypted and
parsed (with the parser's caps) before the next.

While a request is at the node the client is still read (a request pipelined behind it
is parsed and queued, at most `MAX_PIPELINED_BYTES`, then reading stops until the
exchange ends); the client's half-close is noted and served as the trio engine does (the
answer is still written), a reset or error ends the exchange (the node's connection is
closed, not reused; status 499).
"""

from __future__ import annotations

import enum
import math
import select
import socket
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import outcome
import trio
from trio.lowlevel import Abort, current_task, reschedule, wait_task_rescheduled

from pact_ingress.logs import log
from pact_ingress.net import readiness
from pact_ingress.net.h2_node import H2, HTTP1, TRYING, UNTRIED, NodeSession, StreamRelay
from pact_ingress.net.h2_node import move as move_protocol
from pact_ingress.net.http1 import BROKE_OFF, MAX_PIPELINED_BYTES, MIN_READ_AHEAD_CHARGE
from pact_ingress.net.linger import unread
from pact_ingress.net.node_leg import READ_SIZE, Broke, NodeLeg, RouteNodes
from pact_ingress.net.tls_server import ServerTLS
from pact_ingress.net.upstream import (
    UpstreamError,
)
from pact_ingress.proto.http1_server import (
    FRAMING_CLOSE,
    FRAMING_LENGTH,
    INCOMPLETE,
    H1ServerParser,
    ParseError,
    Request,
    response_head,
    whole_response,
)
from pact_ingress.proto.http_headers import clean_response_headers
from pact_ingress.proto.http_request import header
from pact_ingress.proto.http_upstream import ResponseParser

if TYPE_CHECKING:
    from pact_ingress.model import Route, Tenant
    from pact_ingress.net.terminate import Terminator, _Answer, _Connection
    from pact_ingress.net.upstream import _Conn, _Pool
    from pact_ingress.proto.http_request import Target

#: The largest request body served here (read whole with its head, judged inline);
#: larger ones, which the trio engine streams or judges in a thread, go there.
MAX_WHOLE_BODY = 64 * 1024

_IN, _OUT = select.EPOLLIN, select.EPOLLOUT
_HUP = select.EPOLLRDHUP | select.EPOLLHUP | select.EPOLLERR
_FAILED_HARD = select.EPOLLHUP | select.EPOLLERR  # both ways gone, or an error
_READABLE = _IN | _HUP
_BOTH = _IN | select.EPOLLRDHUP | select.EPOLLET | _OUT


class Phase(enum.Enum):
    HANDSHAKE = "handshake"
    IDLE = "idle"  # waiting for the next request
    CONNECTING = "connecting"  # the connection's task gets a connection to the node
    UPSTREAM = "upstream"  # a request at the node
    WRITING = "writing"  # an answer the kernel has not taken all of yet
    ENDED = "ended"  # closed, or handed to the trio engine


#: The members as plain globals, for the per-request steps below: on Python 3.11 an Enum
#: class attribute (`Phase.IDLE`) goes through the metaclass's `__getattr__` hook, about
#: ten times the cost of a global load.
HANDSHAKE, IDLE, CONNECTING, UPSTREAM, WRITING, ENDED = (
    Phase.HANDSHAKE, Phase.IDLE, Phase.CONNECTING, Phase.UPSTREAM, Phase.WRITING, Phase.ENDED)


#: Bytes one fill reads at most: a whole request of the largest body served here, with
#: its head, fits; a client that sends more at once is handed to the trio engine.
FILL_BUDGET = 2 * READ_SIZE
#: How often the lane fires the deadlines that passed: the most one fires late, nothing
#: next to the seconds-long limits it enforces.
TICK = 0.25
#: The status an answer the node broke off is counted with (as the trio engine does).
NODE_BROKE_OFF = 502
#: The status an exchange that ended by a fault of ours (a bug) is counted with.
INTERNAL_FAULT = 500
_TEXT = (b"content-type", b"text/plain; charset=utf-8")

_PARKED = object()  # no result for the connection's task yet

_MOVES: dict[Phase, tuple[Phase, ...]] = {
    Phase.HANDSHAKE: (Phase.IDLE, Phase.ENDED),
    Phase.IDLE: (Phase.CONNECTING, Phase.UPSTREAM, Phase.ENDED),
    Phase.CONNECTING: (Phase.UPSTREAM, Phase.IDLE, Phase.ENDED),
    # (UPSTREAM -> IDLE: the answer went out whole at once, or the exchange was handed)
    Phase.UPSTREAM: (Phase.CONNECTING, Phase.WRITING, Phase.IDLE, Phase.ENDED),
    Phase.WRITING: (Phase.IDLE, Phase.ENDED),
    Phase.ENDED: (),
}
for _phase, _to in _MOVES.items():
    # on the member itself: a move is checked by identity in a tuple, without hashing
    # an enum (a Python-level `__hash__`) three times per request
    _phase.moves = _to  # type: ignore[attr-defined]


class Resume(enum.Enum):
    """Where the trio engine takes a connection up (see the module docstring)."""

    START = "start"
    ANSWER = "answer"
    FORWARD = "forward"
    RELAY = "relay"
    H2 = "h2"
    LINGER = "linger"
    WRITE = "write"  # an HTTP/2 stream's whole answer, to wait for the client's window


@dataclass(slots=True)
class Handoff:
    """A connection the lane gives to the trio engine, and what it carries."""

    point: Resume
    tls: ServerTLS
    parser: H1ServerParser
    deferred: ParseError | None  # a head that did not parse, behind what is queued
    answered: bool  # a request was answered on this connection already
    request: Request | None = None  # ANSWER, FORWARD, RELAY: the request in hand
    started: float = 0.0  # when its story began
    held: int = 0  # request-body bytes it holds in the terminator's `buffers`
    answer: _Answer | None = None  # ANSWER
    go: LaneGo | None = None  # FORWARD, RELAY: the story so far (the body with it)
    entry: _Pool | None = None  # RELAY: the pool, counted in its `active`
    node: _Conn | None = None  # RELAY: the node connection, the head read
    response: ResponseParser | None = None  # RELAY
    stream: StreamRelay | None = None  # RELAY of an HTTP/2 stream's answer (no `node`)


@dataclass(slots=True)
class LaneGo:
    """A request whose checks passed and were charged (`Terminator.lane_story`), as it
    goes to the node."""

    route: Route
    tenant: Tenant
    host: str
    target: Target
    headers: list[tuple[bytes, bytes]]  # cleaned, `Forwarded` added, framing said
    body: bytes
    held: int  # body bytes held in the terminator's `buffers`


@dataclass(slots=True)
class NeedNode:
    """The lane asks the connection's task for a connection to the node (`Lane.serve`
    returns it; the task answers with `Lane.connected`)."""

    client: _Client
    entry: _Pool
    host: str
    deadline: float
    fresh: bool
    offer_h2: bool = False  # a new connection offering h2: the node's session, if it takes it


class Lane:
    """The lane of one trio run's terminator (made on first use)."""

    def __init__(self, terminator: Terminator) -> None:
        self.t = terminator
        self.hub = readiness.hub()
        self.sweeper = self.hub.sweeper
        self.now = self.sweeper.now
        self.open: set[_Client] = set()
        self.draining = False
        self.ticking = False  # `fire` is armed in the sweeper
        #: exchanges served whole here, and connections handed over by where
        self.too_many = terminator.too_many_in_flight  # the answer when a share is out
        self.served = 0
        self.connects = 0  # exchanges that had the task get a node connection first
        self.handed = dict.fromkeys(Resume, 0)
        #: HTTP/2 streams served here (`net/h2_lane.py`): those at the node now, those
        #: served whole here, and those a stream worker took up, by where
        self.streams: set[Any] = set()
        self.h2_served = 0
        self.h2_aborted = 0  # reset by the client, or their connection ended
        self.h2_handed = dict.fromkeys(Resume, 0)

    async def serve(self, sock: socket.socket, data: bytes, ctx: ssl.SSLContext,
                    route: Route, conn: _Connection) -> Handoff | NeedNode | None:
        """Run one client connection here until it ends (None: closed), goes to the
        trio engine (its `Handoff`), or needs a connection to the node (`NeedNode`:
        answer with `connected`)."""
        client = _Client(self, sock, data, ctx, route, conn)
        client.start()
        return await self._park(client)

    def start(self, sock: socket.socket, data: bytes, ctx: ssl.SSLContext, route: Route,
              conn: _Connection, first: Callable[[Handoff | NeedNode | None], None]
              ) -> None:
        """`serve` without a task: the connection runs here, and its first result goes
        to `first` (called at once, from whichever callback produced it) instead of a
        parked task; whoever takes it gives the connection a task if it needs one."""
        client = _Client(self, sock, data, ctx, route, conn)
        client.first = first
        client.start()

    def close_taskless(self) -> None:
        """Close the connections that have no task (the process is stopping)."""
        for client in list(self.open):
            if client.first is not None:
                client.close(499 if client.request is not None else 0)

    async def connected(self, need: NeedNode, node: _Conn | None, reused: bool,
                        error: UpstreamError | None) -> Handoff | NeedNode | None:
        """`serve` again, with the node connection `need` asked for (`reused`: it was
        idle in the pool) or why there is none."""
        client = need.client
        session = None
        if need.offer_h2:
            entry = need.entry
            if node is None:
                move_protocol(entry, UNTRIED)  # tried again by a later exchange
            elif node.ssl_object.selected_alpn_protocol() != "h2":
                move_protocol(entry, HTTP1)  # an HTTP/1.1 connection like any other
            elif node._raw is None or entry.retired:
                # (over a stream the hub cannot drive: this node stays on HTTP/1.1)
                move_protocol(entry, HTTP1 if node._raw is None else UNTRIED)
                await entry.discard(node)
                if client.phase is not ENDED:  # (still CONNECTING) over HTTP/1.1, fresh
                    return NeedNode(client, entry, need.host, need.deadline, True)
                return await self._park(client)
            else:
                session = NodeSession(entry, node, self.hub)
                node = None
                if session.usable():
                    entry.session = session
                    move_protocol(entry, H2)
                else:  # it ended as it began (a GOAWAY or a close in its first flight)
                    session.close()
                    session = None
                    move_protocol(entry, UNTRIED)
                    if client.phase is not ENDED:  # (still CONNECTING) over HTTP/1.1
                        return NeedNode(client, entry, need.host, need.deadline, True)
                    return await self._park(client)
        if client.phase is ENDED:
            # the client left while the task connected: the connection stays pooled
            if node is not None and not need.entry.keep(node, True):
                need.entry.drop(node)
        else:
            client.guarded(lambda _: client.node_ready(node, reused, error, session), 0)
        return await self._park(client)

    async def _park(self, client: _Client) -> Handoff | NeedNode | None:
        result, client.result = client.result, _PARKED
        if result is not _PARKED:  # it came while the task ran: nothing to wait for
            return result  # type: ignore[return-value]
        client.task = current_task()
        return await wait_task_rescheduled(client.abort)  # type: ignore[no-any-return]

    def join(self, client: _Client) -> None:
        self.open.add(client)
        if not self.ticking:
            self.ticking = True
            self.sweeper.arm(self.now() + TICK, watch=self)

    def join_stream(self, stream: Any) -> None:
        """An HTTP/2 stream at the node: its deadline fired by the tick too."""
        self.streams.add(stream)
        if not self.ticking:
            self.ticking = True
            self.sweeper.arm(self.now() + TICK, watch=self)

    def fire(self, side: int) -> None:
        """The sweeper's call, every `TICK` while connections are open: every deadline
        that passed, fired (a number per connection, moved with each request, instead
        of an entry armed and disarmed in the sweeper's table per wait)."""
        now = self.now()
        for client in list(self.open):
            if client.deadline <= now:
                client.guarded(client.expired, 0)
            if client.node_deadline <= now:
                client.guarded(client.node_expired, 0)
        for stream in list(self.streams):
            if stream.node_deadline <= now:
                stream.guarded(stream.node_expired, 0)
        if self.open or self.streams:
            self.sweeper.arm(now + TICK, watch=self)
        else:
            self.ticking = False

    def drain(self) -> None:
        """Shutdown has begun: connections waiting for a request close now; the others
        answer with `Connection: close` and close after it."""
        self.draining = True
        for client in list(self.open):
            if client.phase is IDLE and client.parser.whole_message() is None:
                client.end()


class _Client(NodeLeg):
    MULTIPLEX = True

    """One client connection in the lane: its TLS, its parser, the exchange in hand
    (its node side: `NodeLeg`)."""

    AT_NODE = UPSTREAM

    def __init__(self, lane: Lane, sock: socket.socket, data: bytes, ctx: ssl.SSLContext,
                 route: Route, conn: _Connection) -> None:
        self.lane = lane
        self.t = lane.t
        self.sock = sock
        self.conn = conn
        self.limits = route.limits
        self.inc, self.out = ssl.MemoryBIO(), ssl.MemoryBIO()
        self.ssl = ctx.wrap_bio(self.inc, self.out, server_side=True)
        self.tls = getattr(self.ssl, "_sslobj", self.ssl)  # the C object: no wrapper frame
        if data:
            self.inc.write(data)
        self.watch = lane.hub.watch(sock)
        self.watch.lane = self.event
        self.phase = HANDSHAKE
        self.pending = b""  # ciphertext the kernel did not take yet
        self.parser = H1ServerParser()
        self.deferred: ParseError | None = None
        self.answered = False
        self.eof = False  # the client closed its side (or the connection broke)
        self.paused = False  # reading stopped: read ahead enough while a request runs
        self.more = False  # the last fill stopped at its budget: the socket holds more
        self.ahead = 0  # bytes read ahead while the request in hand runs
        self.deadline = math.inf  # the client side's: handshake, next request, a write
        self.task: trio.lowlevel.Task | None = None
        self.result: Any = _PARKED  # for the task, when it came while the task ran
        #: a connection with no task yet (`Lane.start`): where its first result goes
        self.first: Callable[[Handoff | NeedNode | None], None] | None = None
        #: while the task gets a node connection (`NeedNode`): its scope, cancelled when
        #: the connection closes meanwhile (the client reset or broke it), so that the
        #: node's connect or handshake is given up at once, not at its timeout
        self.connecting: trio.CancelScope | None = None
        # the exchange in hand
        self.request: Request | None = None
        self.started = 0.0
        self.held = 0
        self.go: LaneGo | None = None
        self.nodes = RouteNodes()  # the shares and the pool of the route last used
        #: the last answer's parser, kept for the next one (`new_response`)
        self.spare: ResponseParser | None = None
        self.leg_init()  # the node's side: `entry`, `holding`, `node`, `response`, ...
        self.status = 0
        self.close_after = False
        lane.join(self)

    # -- the state machine -------------------------------------------------------------

    def move(self, to: Phase) -> None:
        if to not in self.phase.moves:
            raise AssertionError(f"lane: {self.phase.value} -> {to.value}")
        self.phase = to

    def guarded(self, step: Callable[[int], None], arg: int) -> None:
        """Run one step; a failure this code did not expect ends the connection, never
        the hub that called it."""
        try:
            step(arg)
        except Exception as exc:  # noqa: BLE001
            self.failed(exc)

    def failed(self, exc: Exception) -> None:
        if isinstance(exc, Broke):  # a leg failed where no step expected it
            if self.phase is not ENDED:
                self.gone() if self.request is not None else self.close(0)
            return
        log.error("lane_error", route=self.conn.route_host, client=self.conn.client_ip,
                  error=f"{type(exc).__name__}: {exc}")
        if self.phase is not ENDED:
            # a fault of ours: what was sent of an answer cannot be trusted, so the
            # connection closes; the exchange counts as 500, not as the client's loss
            self.close(INTERNAL_FAULT if self.request is not None else 0)

    def event(self, mask: int) -> None:
        """The hub's call with the socket's events (`guarded`, inline)."""
        try:
            self._event(mask)
        except Exception as exc:  # noqa: BLE001
            self.failed(exc)

    def _event(self, mask: int) -> None:
        if self.phase is ENDED:
            return
        if mask & _OUT and self.pending and self.flush() and self.phase is WRITING:
            self.written()
            if self.phase is ENDED:
                return
        # what this event says is there to read is read now, whether or not the answer
        # is all out, in the phase the answer left: the ACK that lets an answer out
        # often comes in the segment of the client's next request, and (edge-triggered)
        # no later event tells of it
        if mask & _READABLE:
            ended = mask & _HUP
            if self.phase is HANDSHAKE:
                self.fill(ended)
                self.handshake()
            elif self.phase is IDLE:
                self.fill(ended)
                self.take()
                self.next()
            elif mask & _FAILED_HARD:
                self.gone()
            elif not self.paused:
                self.read_ahead(ended)
                if self.eof and self.out.pending:
                    # the client's FIN while the exchange runs: what the TLS engine holds
                    # for it (the session tickets kept to leave with the first answer)
                    # goes now. A client that half-closed and waits for its answer takes
                    # it as it would have then; one that closed for good has its kernel
                    # answer with a reset, which the next event brings (`_FAILED_HARD`):
                    # the exchange ends then, its node's request given up
                    self.send_out()

    def expired(self, _: int) -> None:
        self.deadline = math.inf
        if self.phase is WRITING:
            self.gone()  # the client did not take the answer in time
        elif self.phase is HANDSHAKE:
            self.close(0)
        elif self.phase is IDLE:
            self.end()

    def start(self) -> None:
        self.guarded(lambda _: self.handshake(), 0)

    def abort(self, _: object) -> Abort:
        """The parked task was cancelled (the process is stopping): close here."""
        self.task = None
        if self.phase is not ENDED:
            self.close(499 if self.request is not None else 0)
        return Abort.SUCCEEDED

    # -- the client's bytes ------------------------------------------------------------

    def fill(self, ended: int = 0, budget: int = FILL_BUDGET) -> None:
        """What the socket holds into the TLS engine, up to about `budget` bytes (`more`
        says when it stopped there); notes the client's close (`ended`: the event said
        it came, so the read that stops short reached it).
        The close is not given to the TLS engine: a TLS read that met it would leave the
        engine failed (OpenSSL takes a close without close_notify for an error), and
        the answer to a request that came just before it must still be written."""
        sock, inc = self.sock, self.inc
        self.more = False
        while True:
            try:
                data = sock.recv(READ_SIZE)
            except BlockingIOError:
                return
            except OSError:
                self.eof = True
                return
            if not data:
                self.eof = True
                return
            inc.write(data)
            if len(data) < READ_SIZE:
                if ended:  # edge-triggered: no later event will tell of this close
                    self.eof = True
                return
            budget -= READ_SIZE
            if budget <= 0:
                self.more = True  # (edge-triggered: no event will say so again)
                return

    def take(self) -> None:
        """Decrypt what the TLS engine holds and parse it."""
        tls, inc, parser = self.tls, self.inc, self.parser
        while self.deferred is None and not parser.closed:
            if not inc.pending and not tls.pending():
                if self.eof:
                    self.feed(b"")
                return
            try:
                data = tls.read(READ_SIZE)
            except ssl.SSLWantReadError:
                if self.eof:  # a record cut short by the close
                    self.feed(b"")
                return
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                self.feed(b"")
                return
            except ssl.SSLError:
                self.eof = True
                self.feed(b"")
                return
            if not data:
                self.feed(b"")
                return
            try:
                parser.feed(data)  # (`feed`, inline: every request comes this way)
            except ParseError as exc:
                self.deferred = exc

    def feed(self, data: bytes) -> None:
        if self.parser.closed:
            return
        try:
            self.parser.feed(data)
        except ParseError as exc:
            self.deferred = exc  # what was queued before it is served first

    def read_ahead(self, ended: int) -> None:
        """While a request runs: what the client sends next is read and queued, up to
        `MAX_PIPELINED_BYTES`; then reading stops until the exchange ends."""
        before = self.inc.pending
        self.fill(ended, MAX_PIPELINED_BYTES - self.ahead)
        self.ahead += max(self.inc.pending - before, MIN_READ_AHEAD_CHARGE)
        self.take()
        if self.more or self.ahead >= MAX_PIPELINED_BYTES:
            self.paused = True

    # -- TLS handshake -----------------------------------------------------------------

    def handshake(self) -> None:
        try:
            self.ssl.do_handshake()
        except ssl.SSLWantReadError:
            if self.eof:
                self.close(0)
                return
            self.send_out()
            if self.deadline == math.inf:
                self.deadline = self.conn.now() + self.limits.clienthello_timeout
            return
        except (ssl.SSLError, OSError) as exc:
            log.debug("terminate_connection_ended", route=self.conn.route_host,
                      error=repr(exc))
            try:
                self.send_out()  # the alert, if any
            except Broke:
                pass
            self.close(0)
            return
        self.deadline = math.inf
        self.move(IDLE)
        if self.ssl.selected_alpn_protocol() == "h2":
            self.hand(Resume.H2)
            return
        # the client's first request often came with its Finished: the session
        # tickets wait in the BIO and leave with the answer, in one send
        if not self.inc.pending:
            self.send_out()
        self.take()
        self.next()

    # -- requests ----------------------------------------------------------------------

    def next(self) -> None:
        """In IDLE: serve the next request if it is here whole; hand the connection
        over if what is here needs the trio engine; else wait for more."""
        if self.phase is not IDLE:
            return
        parser = self.parser
        whole = parser.whole_message()
        if whole is None:
            if self.deferred is not None or self.more:
                self.hand(Resume.START)  # a head to refuse, or more than one fill took
                return
        elif whole is INCOMPLETE:
            self.hand(Resume.START)  # a request still arriving
            return
        else:
            request, body, count = whole  # type: ignore[misc]
            if len(body) > MAX_WHOLE_BODY or request.expects_continue:
                self.hand(Resume.START)
                return
            self.serve(request, body, count)
            return
        if parser.closed or self.eof:
            self.close(0)  # the client left between requests
            return
        if self.answered and self.lane.draining:
            self.end()
            return
        if self.out.pending or self.pending:  # what the handshake left, if it is here
            self.flush()
        if self.deadline == math.inf:
            self.deadline = self.conn.now() + self.limits.idle_timeout

    def serve(self, request: Request, body: bytes, count: int) -> None:
        t, conn = self.t, self.conn
        now = conn.now()
        step = t.lane_story(conn, request, body, now)
        if step is None:
            self.hand(Resume.START)
            return
        self.parser.drop(count)
        self.deadline = math.inf
        self.request, self.started, self.ahead = request, now, 0
        if type(step) is not LaneGo:
            self.hand(Resume.ANSWER, answer=step)  # type: ignore[arg-type]
            return
        go = self.go = step
        self.held = go.held
        taken = self.take_node(self.nodes, go, now)
        if taken is None:
            self.hand(Resume.ANSWER, answer=self.lane.too_many)
        elif taken:
            self.send_request(now)
        else:
            self.connect(fresh=False)

    # -- the node's side ---------------------------------------------------------------

    def connect(self, *, fresh: bool) -> None:
        """No idle connection to use: the connection's own task gets one from the pool
        (`NeedNode`), connecting as the trio engine does, and comes back with it."""
        go, entry = self.go, self.entry
        assert go is not None and entry is not None
        self.move(CONNECTING)
        self.lane.connects += 1
        self.reused = False
        offer_h2 = (not fresh and not go.body and entry.protocol is UNTRIED
                    and not entry.retired)
        if offer_h2:
            move_protocol(entry, TRYING)  # one exchange tries; the others go on as they did
        self.wake(NeedNode(self, entry, go.host,
                           self.conn.now() + self.t.upstream.header_timeout, fresh, offer_h2))

    def node_ready(self, node: _Conn | None, reused: bool,
                   error: UpstreamError | None, session: NodeSession | None = None) -> None:
        """What the task's `_Pool.acquire` gave (`Lane.connected`): a connection, or
        the node's new HTTP/2 session."""
        entry, go = self.entry, self.go
        assert self.phase is CONNECTING and entry is not None and go is not None
        if session is not None:
            self.session, self.reused = session, False
            self.send_request(self.conn.now())
            return
        if error is not None:
            self.release(False)
            self.move(IDLE)
            self.hand(Resume.ANSWER, answer=self.t.lane_failure(go.route, error))
            return
        assert node is not None
        if node._raw is None:  # over a stream this lane cannot drive: the trio engine's
            if not entry.keep(node, True):
                entry.drop(node)
            self.release(False)
            self.move(IDLE)
            self.hand(Resume.FORWARD)
            return
        self.node, self.reused = node, reused
        self.send_request(self.conn.now())

    # -- the node leg's outcomes (`NodeLeg`) ---------------------------------------------

    def retry_fresh(self) -> None:
        self.connect(fresh=True)

    def give_up(self, answer: _Answer) -> None:
        self.move(IDLE)
        self.hand(Resume.ANSWER, answer=answer)

    def relayed(self, entry: _Pool, node: _Conn, response: ResponseParser) -> None:
        self.move(IDLE)
        self.hand(Resume.RELAY, entry=entry, node=node, response=response)

    def relayed_stream(self, relay: StreamRelay) -> None:
        self.move(IDLE)
        self.hand(Resume.RELAY, entry=relay.entry, stream=relay)

    def stream_answered(self, now: float) -> None:
        """The stream's whole answer is here: to the client in one write."""
        request = self.request
        assert request is not None
        headers = clean_response_headers(self.h2_headers)
        parts, self.parts = self.parts, []
        body = parts[0] if len(parts) == 1 else b"".join(parts)
        status = self.h2_status
        if body and header(headers, b"content-length") is None:
            headers.append((b"content-length", b"%d" % len(body)))
        close = not request.keep_alive or self.lane.draining
        data, framing = whole_response(request.method, request.http_version, status,
                                       headers, body, close=close)
        self.release(True, now)
        self.answer_with(status, data, close=close or framing is FRAMING_CLOSE, now=now)

    def broke_off(self) -> None:
        """The client is told so and the connection closes, as the trio engine does."""
        self.answer_with(NODE_BROKE_OFF, response_head(
            NODE_BROKE_OFF, [_TEXT, (b"content-length", b"%d" % len(BROKE_OFF))],
            FRAMING_LENGTH, close=True) + BROKE_OFF, close=True, now=self.conn.now())

    def new_response(self, method: str) -> ResponseParser:
        """The last answer's parser when it ended whole and clean (llhttp waits at the
        start of a message: `ResponseParser.restart`), else a new one; kept parsers keep
        their cycle with llhttp's, broken when the connection ends (`close`, `hand`)."""
        spare, self.spare = self.spare, None
        if spare is None:
            return ResponseParser(method, keep=True)
        spare.restart(method)
        return spare

    def node_answered(self, now: float) -> None:
        """The node's whole answer is here: to the client in one write."""
        request, parser = self.request, self.response
        assert request is not None and parser is not None
        headers = clean_response_headers(parser.headers)
        body = parser.take_body()
        status = parser.status
        close = not request.keep_alive or self.lane.draining
        data, framing = whole_response(request.method, request.http_version, status,
                                       headers, body, close=close)
        # (a node that answered before it took our whole request: not reused)
        self.release(parser.keep_alive and not self.node_pending, now)
        self.response = None
        if parser.keep_alive:
            parser.set_aside()
            self.spare = parser
        else:
            parser.discard()
        self.answer_with(status, data, close=close or framing is FRAMING_CLOSE, now=now)

    def answer_with(self, status: int, data: bytes, *, close: bool, now: float) -> None:
        """The answer to the client: done when the kernel takes it at once (the usual
        case: no WRITING phase at all), else written as the client reads."""
        self.status = status
        self.close_after = close
        try:
            self.tls.write(data)
            if not self.flush():
                self.move(WRITING)
                self.deadline = now + self.limits.client_write_timeout
                return
        except (Broke, ssl.SSLError):
            self.gone()
            return
        self.written(now)

    # -- the answer --------------------------------------------------------------------

    def written(self, now: float | None = None) -> None:
        """The kernel took the whole answer: the exchange is done."""
        self.lane.served += 1
        now = self.finish(self.status, now)
        if self.close_after:
            self.deadline = math.inf
            self.end()
            return
        self.deadline = now + self.limits.idle_timeout
        self.move(IDLE)
        if self.paused:  # what the client sent since was left in the kernel: read it now
            self.paused = False
            self.fill()
            self.take()
        # (otherwise every byte that came while the request ran was read as it came)
        self.next()

    def finish(self, status: int, now: float | None = None) -> float:
        """The exchange in hand ends with `status`: counted and logged. Returns now."""
        if now is None:
            now = self.conn.now()
        request = self.request
        if request is None:
            return now
        self.request = self.go = None
        held, self.held = self.held, 0
        self.answered = True
        self.t.count(self.conn, request.method, request.target, status, self.started, held,
                     now)
        return now

    def gone(self) -> None:
        """The client left (or broke) while an exchange ran."""
        self.eof = True
        self.close(499)

    # -- ciphertext out ----------------------------------------------------------------

    def send_out(self) -> None:
        """What the TLS engine has to send, to the kernel (the rest waits for room)."""
        if self.out.pending or self.pending:
            self.flush()

    def flush(self) -> bool:
        """Everything pending to the kernel; False when it has no room for all of it
        (EPOLLOUT is asked for, and the rest waits in `pending`). `Broke` on failure."""
        data = self.pending + self.out.read() if self.pending else self.out.read()
        self.pending = b""
        sock = self.sock
        while data:
            try:
                sent = sock.send(data)
            except BlockingIOError:
                self.pending = data
                watch = self.watch
                if not watch.out:
                    watch.hub.ep.modify(watch.fd, _BOTH)
                    watch.out = True
                return False
            except OSError as exc:
                raise Broke(f"send failed: {exc!r}") from exc
            data = data[sent:]
        return True

    # -- deadlines ---------------------------------------------------------------------

    # -- the end -----------------------------------------------------------------------

    def end(self) -> None:
        """Close between requests: lingering (in the trio engine) when the client may
        still be sending, so the close does not reset our last answer away."""
        if self.phase is ENDED:
            return
        if not (self.eof or self.parser.closed) and (
                self.parser.queued or self.inc.pending or unread(self.sock.fileno())):
            if self.phase is not IDLE:
                self.move(IDLE)
            self.hand(Resume.LINGER)
            return
        self.close(0)

    def close(self, status: int) -> None:
        """Close the connection here; an exchange in hand ends with `status`."""
        self.release(False)
        self.drop_response()
        self.drop_spare()
        if self.request is not None:
            self.finish(status or 499)
        self.deadline = math.inf
        self.phase = ENDED
        if self.connecting is not None:
            self.connecting.cancel()
        self.lane.open.discard(self)
        self.watch.lane = None
        self.watch.close()
        self.sock.close()
        # the parser's and this object's own reference cycles, broken: what the
        # connection held goes now, not at the cyclic collector's next pass
        self.parser.discard()
        self.node_side = None  # type: ignore[assignment]
        self.wake(None)

    def hand(self, point: Resume, *, answer: _Answer | None = None,
             entry: _Pool | None = None, node: _Conn | None = None,
             response: ResponseParser | None = None,
             stream: StreamRelay | None = None) -> None:
        """Give the connection to the trio engine at `point`."""
        self.lane.handed[point] += 1
        self.drop_spare()
        self.deadline = self.node_deadline = math.inf
        self.node_side = None  # type: ignore[assignment]  # (a cycle: see `close`)
        self.move(ENDED)
        self.lane.open.discard(self)
        watch = self.watch
        watch.lane = None
        watch.readable = True  # the trio engine tries the socket before it waits
        if self.eof:
            watch.ended = True
        tls = ServerTLS.adopt(self.sock, self.ssl, self.inc, self.out, watch)
        tls._held = self.pending  # ciphertext the kernel did not take yet: sent first
        self.pending = b""
        request = self.request if point is not Resume.START else None
        self.request = None
        held, self.held = self.held, 0
        self.wake(Handoff(point, tls, self.parser, self.deferred, self.answered,
                          request=request, started=self.started, held=held,
                          answer=answer, go=self.go, entry=entry, node=node,
                          response=response, stream=stream))
        self.go = None

    def drop_spare(self) -> None:
        spare, self.spare = self.spare, None
        if spare is not None:
            spare.discard()

    def wake(self, result: Handoff | NeedNode | None) -> None:
        task, self.task = self.task, None
        if task is not None:
            reschedule(task, outcome.Value(result))
            return
        first = self.first
        if first is not None:  # no task yet: the result decides whether one is needed
            self.first = None
            first(result)
        else:
            self.result = result  # the task is running: `Lane._park` returns it
