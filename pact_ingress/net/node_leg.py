"""The node's side of one exchange in the keep-alive lane, for either HTTP version of
the client: the request written to a pooled connection, the answer read and parsed
from the readiness hub's callbacks, the connection and the client's share given back.

An HTTP/1.1 lane connection (`net/h1_lane.py`) and an HTTP/2 stream served in the lane
(`net/h2_lane.py`) both send their request to the node this way; they differ only in
what they do with the outcome, which they say by implementing the hooks below:
`node_answered` (the whole answer is here), `retry_fresh` (a pooled connection the node
had closed: once more on a fresh one), `give_up` (an answer decided at the edge for a
node failure), `relayed` (the head is here, the body still coming: the trio engine
relays the rest) and `broke_off` (the answer broke off after its head).

Reads are bounded: the node's one read at a time, each decrypted and parsed (with the
response parser's caps) before the next, until the answer is whole, goes elsewhere, or
the socket has nothing more. The node's head is awaited until the pool's
`header_timeout` (`node_deadline`, fired by the lane's tick), the rest of a short body
for `BODY_GRACE` after it.
"""

from __future__ import annotations

import math
import select
import ssl
from typing import TYPE_CHECKING, Any

import trio

from pact_ingress.logs import log
from pact_ingress.net.h2_node import H2, UNTRIED, StreamRelay, request_fields
from pact_ingress.net.upstream import (
    IDEMPOTENT,
    UpstreamProtocolError,
    UpstreamTimeout,
)
from pact_ingress.proto.http_request import declared_length, header
from pact_ingress.proto.http_upstream import ResponseError, ResponseParser, request_head

if TYPE_CHECKING:
    from pact_ingress.net.h2_node import NodeSession
    from pact_ingress.net.terminate import Terminator, _Answer, _Connection
    from pact_ingress.net.upstream import _Conn, _Pool
    from pact_ingress.proto.shares import Shares

#: Ciphertext read per syscall.
READ_SIZE = 64 * 1024
#: The largest answer body (a declared length) awaited here once its head came; a
#: larger one is relayed as it comes by the trio engine.
MAX_WHOLE_BODY = 64 * 1024
#: How long the rest of a short answer (a declared length up to `MAX_WHOLE_BODY`) is
#: awaited here once its head came; then it is relayed as it comes (the trio engine),
#: so a body that trickles is not held back.
BODY_GRACE = 0.1

_IN, _OUT = select.EPOLLIN, select.EPOLLOUT
_HUP = select.EPOLLRDHUP | select.EPOLLHUP | select.EPOLLERR
_READABLE = _IN | _HUP
_BOTH = _IN | select.EPOLLRDHUP | select.EPOLLET | _OUT


class Broke(Exception):
    """A socket of the exchange failed (the client's or the node's)."""


class RouteNodes:
    """What one client connection's exchanges use of the route they go to: the clients'
    shares of its node and its pool of node connections, looked up again only when
    the route (or its pins) changed, by a reload."""

    __slots__ = ("pins", "pool", "route", "shares")

    def __init__(self) -> None:
        self.route: Any = None
        self.pins: tuple[str, ...] | None = None
        self.shares: Any = None
        self.pool: Any = None


class NodeLeg:
    """The node's side of the exchange in hand. A subclass sets, per exchange: `t`,
    `lane`, `conn`, `request` (anything with `method`), `go`, `entry` (counted in its
    `active`), `holding` (the client's share of the node, held), `node` and `reused`;
    and `phase`, which is `AT_NODE` while the request is at the node."""

    AT_NODE: Any  # the subclass's phase for "the request is at the node"
    #: Whether the exchanges may go as streams of a node's HTTP/2 session
    #: (`net/h2_node.py`); the subclass then implements `stream_answered` and
    #: `relayed_stream` too.
    MULTIPLEX = False

    t: Terminator
    lane: Any
    conn: _Connection
    request: Any
    go: Any
    phase: Any
    entry: _Pool | None
    holding: Shares | None
    node: _Conn | None
    reused: bool
    node_side: Any  # the node's `Watch.lane` meanwhile (a bound method, made once)
    node_deadline: float
    node_pending: bytes
    response: ResponseParser | None
    head_seen: bool
    sent_at: float
    session: NodeSession | None  # the exchange is a stream of this session
    sid: int
    parts: list[bytes]  # the stream's answer body so far
    h2_status: int
    h2_headers: list[tuple[bytes, bytes]]

    def leg_init(self) -> None:
        self.entry = None
        self.holding = None
        self.node = None
        self.reused = False
        self.node_side = self.node_event_guarded
        self.node_deadline = math.inf  # the node's head, or the rest of a short body
        self.node_pending = b""
        self.response = None
        self.head_seen = False  # the node's head came (its time noted)
        self.sent_at = 0.0
        self.session = None
        self.sid = 0
        self.parts = []
        self.h2_status = 0
        self.h2_headers = []

    # -- the hooks ----------------------------------------------------------------------

    def move(self, to: Any) -> None:
        raise NotImplementedError

    def failed(self, exc: Exception) -> None:
        raise NotImplementedError

    def node_answered(self, now: float) -> None:
        """The node's whole answer is here (`response`)."""
        raise NotImplementedError

    def retry_fresh(self) -> None:
        """Send the request again on a fresh connection (nothing of it was answered)."""
        raise NotImplementedError

    def give_up(self, answer: _Answer) -> None:
        """The node failed: `answer` goes to the client (the hold on the node ended)."""
        raise NotImplementedError

    def relayed(self, entry: _Pool, node: _Conn, response: ResponseParser) -> None:
        """The trio engine relays the rest of the answer, with the node connection, the
        pool's count and the client's share (it gives them back when the relay ends)."""
        raise NotImplementedError

    def broke_off(self) -> None:
        """The node's answer broke off after its head, nothing of it sent yet (the hold
        on the node ended)."""
        raise NotImplementedError

    def stream_answered(self, now: float) -> None:
        """The stream's whole answer is here (`h2_status`, `h2_headers`, `parts`)."""
        raise NotImplementedError

    def relayed_stream(self, relay: StreamRelay) -> None:
        """The trio engine relays the rest of the stream's answer from `relay` (which
        gives back the pool's count when it ends; the client's share is the lane's)."""
        raise NotImplementedError

    # -- the hold on the node, taken ----------------------------------------------------

    def take_node(self, nodes: RouteNodes, go: Any, now: float) -> bool | None:
        """The client's share of the node and the pool's count taken for `go`, and an
        idle connection to the node when one can be used: True (`node` is it), False
        (none: the subclass gets one), None (no share left: nothing taken)."""
        t = self.t
        route, pins = go.route, go.tenant.pins
        if route is not nodes.route or pins is not nodes.pins:
            nodes.route, nodes.pins = route, pins
            nodes.shares = t.shares_for(route)
            nodes.pool = t.upstream.pool(route, pins)
        shares = nodes.shares
        if shares.take(self.conn.client, 1) is not None:
            return None
        self.holding = shares
        entry = nodes.pool
        if entry.retired:
            entry = nodes.pool = t.upstream.pool(route, pins)
        self.entry = entry
        entry.active += 1
        if self.MULTIPLEX and not go.body:  # (a request with a body: see `net/h2_node.py`)
            protocol = entry.protocol
            if protocol is H2:
                session = entry.session
                if session is not None and not session.closed and session.h2.can_open():
                    self.session, self.reused = session, True
                    return True
            elif protocol is UNTRIED and not entry.retired:
                return False  # the node is tried for HTTP/2 first (`connect`)
        node = entry.take_idle(go.host, now)
        if node is None:
            return False
        self.node, self.reused = node, True
        return True

    # -- the request out ----------------------------------------------------------------

    def new_response(self, method: str) -> ResponseParser:
        """The parser for the node's answer to the request in hand (a subclass that
        serves one exchange after another may give the last one's again)."""
        return ResponseParser(method)

    def drop_response(self) -> None:
        """The answer in hand is parsed no further here."""
        parser, self.response = self.response, None
        if parser is not None:
            parser.discard()


    def send_request(self, now: float) -> None:
        if self.session is not None:
            self.send_stream(now)
            return
        request, go, node = self.request, self.go, self.node
        assert request is not None and go is not None and node is not None
        self.response = self.new_response(request.method)
        self.head_seen = False
        self.move(self.AT_NODE)
        watch = node._watch
        if watch is None:
            watch = node._watch = self.lane.hub.watch(node._raw)  # type: ignore[arg-type]
        watch.lane = self.node_side
        self.sent_at = now
        try:
            head = request_head(request.method, go.target.origin_form, go.headers)
            node._sslobj.write(head + go.body if go.body else head)
            self.node_send()
        except (ValueError, UnicodeEncodeError) as exc:  # (`_frame`'s refusal)
            self.node_failed(UpstreamProtocolError(f"request cannot be sent: {exc}"))
            return
        except (Broke, ssl.SSLError) as exc:
            self.node_failed(exc)
            return
        self.node_deadline = now + self.t.upstream.header_timeout

    def send_stream(self, now: float) -> None:
        """The request as a new stream of `session`."""
        request, go, session = self.request, self.go, self.session
        assert request is not None and go is not None and session is not None
        self.head_seen = False
        self.parts = []
        self.move(self.AT_NODE)
        self.sent_at = now
        self.sid = session.open(self, request_fields(request.method, go.target.origin_form,
                                                     go.headers), go.body)
        self.node_deadline = now + self.t.upstream.header_timeout

    # -- a stream's answer in (the session's calls) ----------------------------------------

    def h2_head(self, status: int, headers: list[tuple[bytes, bytes]], ended: bool,
                length: int | None) -> None:
        if self.phase is not self.AT_NODE or self.session is None:
            return
        now = self.conn.now()
        self.head_seen = True
        self.node_deadline = math.inf
        go = self.go
        assert go is not None
        self.t.note_header_time(go.route.host, now - self.sent_at)
        self.h2_status, self.h2_headers = status, headers
        if ended:
            self.stream_done(now)
            return
        if length is not None and length <= MAX_WHOLE_BODY:
            # a short answer whose body comes in frames of its own: awaited here for a
            # moment, then relayed as it comes
            self.node_deadline = now + BODY_GRACE
            return
        self.relay()

    def h2_data(self, data: bytes, flow: int, ended: bool) -> None:
        session = self.session
        if session is None:
            return
        session.acknowledge(flow, self.sid)  # held here (at most MAX_WHOLE_BODY), or not
        if self.phase is not self.AT_NODE:
            return
        if data:
            self.parts.append(data)
        if ended:
            self.node_deadline = math.inf
            self.stream_answered(self.conn.now())

    def h2_end(self) -> None:
        if self.phase is self.AT_NODE and self.session is not None:
            self.stream_done(self.conn.now())

    def h2_reset(self, code: int, retryable: bool) -> None:
        """The node reset the stream (`retryable`: it never processed it)."""
        if self.phase is not self.AT_NODE or self.session is None:
            return
        if retryable and not self.head_seen:
            self.let_node_go(False)
            self.retry_fresh()  # over HTTP/1.1, on a new connection
            return
        exc = UpstreamProtocolError(f"the node reset the stream ({code})")
        self.reused = False  # it saw the request: not sent again
        if self.head_seen:
            self.node_broke_off(exc)
        else:
            self.node_failed(exc)

    def h2_broken(self, exc: Exception) -> None:
        """The session ended with the stream open."""
        if self.phase is not self.AT_NODE or self.session is None:
            return
        if self.head_seen:
            self.node_broke_off(exc)
        else:
            self.node_failed(exc)

    def stream_done(self, now: float) -> None:
        self.node_deadline = math.inf
        self.stream_answered(now)

    def node_send(self) -> None:
        node = self.node
        assert node is not None
        data = self.node_pending + node._out.read()
        self.node_pending = b""
        while data:
            try:
                sent = node._raw.send(data)  # type: ignore[union-attr]
            except BlockingIOError:
                self.node_pending = data
                watch = node._watch
                assert watch is not None
                if not watch.out:
                    watch.hub.ep.modify(watch.fd, _BOTH)
                    watch.out = True
                return
            except OSError as exc:
                raise Broke(f"send to the node failed: {exc!r}") from exc
            data = data[sent:]

    # -- the answer in ------------------------------------------------------------------

    def node_event_guarded(self, mask: int) -> None:
        """The hub's call with the node connection's events (`guarded`, inline)."""
        try:
            self.node_event(mask)
        except Exception as exc:  # noqa: BLE001
            self.failed(exc)

    def node_event(self, mask: int) -> None:
        node = self.node
        if self.phase is not self.AT_NODE or node is None:
            return
        if mask & _OUT and self.node_pending:
            try:
                self.node_send()
            except Broke as exc:
                self.node_failed(exc)
                return
        if not mask & _READABLE:
            return
        # the node's answer, one read at a time, each decrypted and parsed before the
        # next (what a node sends is never held beyond one read and the parser's caps),
        # until it is whole, goes elsewhere, or the socket has nothing more
        parser = self.response
        assert parser is not None
        raw, inc, tls = node._raw, node._in, node._sslobj
        now = self.conn.now()
        while True:
            try:
                try:
                    data = raw.recv(READ_SIZE)  # type: ignore[union-attr]
                except BlockingIOError:
                    return
                except OSError as exc:
                    raise Broke(f"receive from the node failed: {exc!r}") from exc
                if data:
                    inc.write(data)
                else:
                    inc.write_eof()
                while not parser.done:
                    try:
                        plain = tls.read(READ_SIZE)
                    except ssl.SSLWantReadError:
                        break
                    except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                        plain = b""
                    if plain:
                        parser.feed(plain)
                    else:
                        parser.feed_eof()
                        break
            except (Broke, ResponseError, ssl.SSLError) as exc:
                if self.head_seen:
                    self.node_broke_off(exc)
                else:
                    self.node_failed(exc)
                return
            if parser.head_done and not self.head_seen and not self.node_head(now):
                return
            if parser.done:
                self.node_answered(now)
                return
            if not data or (len(data) < READ_SIZE and not mask & _HUP):
                return  # the socket has nothing more now (a close it held is read on)

    def node_expired(self, _: int) -> None:
        self.node_deadline = math.inf
        if self.phase is not self.AT_NODE:
            return
        session = self.session
        if session is not None:
            if self.head_seen:
                self.relay()
            else:
                # a node that let a head wait this long may be stuck as a whole: the
                # next exchange makes a new session rather than queue behind this one
                session.going_away()
                self.node_failed(UpstreamTimeout(
                    f"no response headers within {self.t.upstream.header_timeout:g} s"))
            return
        if self.head_seen:
            self.relay()  # the rest of a short body is slow: relayed as it comes
        else:
            self.node_failed(UpstreamTimeout(
                f"no response headers within {self.t.upstream.header_timeout:g} s"))

    # -- the hold on the node -----------------------------------------------------------

    def let_node_go(self, reusable: bool, now: float | None = None) -> None:
        """The node connection back to its pool (or closed); a stream given up."""
        session = self.session
        if session is not None:
            self.session = None
            self.node_deadline = math.inf
            session.cancel(self.sid)  # (nothing, when it ended)
            return
        node, entry = self.node, self.entry
        self.node_deadline = math.inf
        self.node = None
        self.node_pending = b""
        if node is None:
            return
        watch = node._watch
        if watch is not None:
            watch.lane = None
            watch.readable = True  # whoever waits next tries the socket first
        if entry is not None and not entry.keep(node, reusable, now):
            entry.drop(node)

    def release(self, reusable: bool, now: float | None = None) -> None:
        """The exchange's hold on the node ends: its connection back to the pool (or
        closed), its count in the pool's `active` and the client's share of the node
        given back."""
        self.let_node_go(reusable, now)
        entry, self.entry = self.entry, None
        if entry is not None:
            entry.active -= 1
            up = self.t.upstream
            if up._retired:
                trio.lowlevel.spawn_system_task(up._reap_quietly, name="upstream.reap")
        shares, self.holding = self.holding, None
        if shares is not None:
            shares.give(self.conn.client, 1)

    # -- the outcomes -------------------------------------------------------------------

    def node_failed(self, exc: Exception) -> None:
        """The node's connection failed before its head was whole."""
        request, go, parser = self.request, self.go, self.response
        assert request is not None and go is not None
        received = parser.received if parser is not None else 0
        self.let_node_go(False)
        self.drop_response()
        if (received == 0 and self.reused and request.method in IDEMPOTENT
                and not isinstance(exc, UpstreamTimeout)):
            # a pooled connection the node had closed: sent again, once, on a fresh one,
            # as the trio engine does for a request that may be sent twice
            self.retry_fresh()
            return
        self.release(False)
        if not isinstance(exc, UpstreamTimeout):
            exc = UpstreamProtocolError(f"node connection failed: {exc}")
        self.give_up(self.t.lane_failure(go.route, exc))  # type: ignore[arg-type]

    def node_head(self, now: float) -> bool:
        """The node's head is here (once per exchange): its time noted; True when the
        lane goes on with the exchange (the rest of a short body is awaited here), False
        when it went elsewhere (sent again fresh, or to the trio engine to relay)."""
        request, go, parser = self.request, self.go, self.response
        assert request is not None and go is not None and parser is not None
        self.head_seen = True
        self.node_deadline = math.inf
        self.t.note_header_time(go.route.host, now - self.sent_at)
        if parser.status == 408 and self.reused and request.method in IDEMPOTENT:
            # the node timing the idle connection out as our request crossed it: no
            # answer to this request (408 says the node took none); once more, fresh
            self.let_node_go(False)
            self.drop_response()
            self.retry_fresh()
            return False
        if parser.done:
            return True
        length = declared_length(header(parser.headers, b"content-length") or b"")
        if length is not None and length <= MAX_WHOLE_BODY:
            # a short answer whose body came in a write of its own, as many servers
            # send one: awaited here for a moment, then relayed as it comes
            self.node_deadline = now + BODY_GRACE
            return True
        self.relay()
        return False

    def relay(self) -> None:
        """The node's head is here, its body not all: the trio engine relays the rest."""
        session = self.session
        if session is not None:
            entry = self.entry
            assert entry is not None
            relay = StreamRelay(session, self.sid, entry, self.h2_status, self.h2_headers,
                                self.parts, False, self.go.route.limits.idle_timeout)
            self.session = self.entry = None
            self.holding = None
            self.node_deadline = math.inf
            self.parts = []
            self.relayed_stream(relay)
            return
        node, entry, parser = self.node, self.entry, self.response
        assert node is not None and entry is not None and parser is not None
        watch = node._watch
        if watch is not None:
            watch.lane = None
            watch.readable = True
        self.node_deadline = math.inf
        if self.node_pending:  # answered before our request was all sent: never reused
            parser.keep_alive = False
            self.node_pending = b""
        parser.keep = False  # its holder from now on is not this leg (see `discard`)
        self.node = self.entry = self.response = None
        self.holding = None
        self.relayed(entry, node, parser)

    def node_broke_off(self, exc: Exception) -> None:
        """The node's answer broke off after its head (nothing of it sent yet)."""
        go = self.go
        assert go is not None
        log.warning("upstream_body_failed", route=go.route.host, error=str(exc))
        self.release(False)
        self.drop_response()
        self.broke_off()
