"""The keep-alive lane's multiplexed node leg: the lane's exchanges to a node that speaks
HTTP/2 go as streams of one connection, written once per wake-up of the readiness hub.

Theory of operation
-------------------
Over HTTP/1.1 every exchange in flight needs a node connection of its own, so each
request costs a TLS record and a send(2) toward the node and a receive back, whatever
else is in flight. Over HTTP/2 the requests of every client connection served in one
wake-up of the hub go out in one TLS write and one send(2), and the node's answers to
them come back in a few reads: fewer segments, records and syscalls per request, which
is where a multiplexing proxy's lead at many keep-alive connections comes from.

A `NodeSession` is one pinned TLS connection to a node that selected `h2`, driven from
the hub's callbacks (its socket's `Watch.lane`), the protocol in `proto/h2_client.py`.
Each stream has a holder: the lane exchange that sent it (`NodeLeg`), or the trio
engine's relay of an answer that is not whole (`StreamRelay`). The session feeds each
holder its stream's events (`h2_head`, `h2_data`, `h2_end`, `h2_reset`, `h2_broken`);
a holder that gives its stream up (`cancel`) has it reset (CANCEL), so a client that
leaves stops the node's work on its request and nothing of it is read on.

Frames queued while the hub serves a batch of events go out once, when the batch is
done (`Hub.after`); anything queued outside the hub's callbacks (a deadline, a relay's
task) goes out at once. Our windows go back to the node as the answers are taken: an
answer the lane holds whole (at most `MAX_WHOLE_BODY`) is taken as it comes; a relayed
one as the trio engine writes it to the client, so a client that stops reading stops the
node's stream, not the session.

Only requests without a body go as streams; one with a body goes over HTTP/1.1, as
before. A node may answer a request before it read the body (a refusal, a size limit),
and some HTTP/2 servers then close the whole connection (hypercorn does, without a
GOAWAY; measured in `tests/test_node_h2.py`): every other stream in flight on it would
fail with it, and a request that may not be sent twice would get a 502 for another
client's refusal. Over HTTP/1.1 such an answer costs only its own connection.

Which protocol a pool's node speaks is the pool's `protocol` (`NodeProtocol`, its moves
in `_MOVES`): UNTRIED → TRYING (a lane exchange needs a node connection: its task
connects offering `h2` and `http/1.1`) → H2 (the node selected `h2`: the session serves
every lane exchange it has room for) or HTTP1 (it selected HTTP/1.1, or the connection
cannot be driven from the hub: pooled HTTP/1.1 as before, for the pool's life); a
session that ends (the node's GOAWAY, a failure, a reload, or its
`MAX_STREAMS_PER_SESSION` streams served) takes the pool back to UNTRIED, a failed try
too. Exchanges that find no room on a session (the node's stream
limit), and everything the trio engine sends, go over pooled HTTP/1.1 connections.

What goes wrong, and what the client gets: a stream the node refused (REFUSED_STREAM) or
never processed (GOAWAY) is sent again on a fresh HTTP/1.1 connection; a session that
fails before an answer's head gives a retry to a request that may be sent twice, a 502
to others; a stream reset after its head ends the client's answer as a broken body
would; the node's head late is 504, as over HTTP/1.1, and the session takes no new
stream (a node stuck as a whole would hold every later request the same way).
"""

from __future__ import annotations

import enum
import select
import ssl
from collections import deque
from typing import TYPE_CHECKING, Any

import trio

from pact_ingress.logs import log
from pact_ingress.proto.h2_client import GoAwayReceived, H2Client, ResponseReceived
from pact_ingress.proto.h2_frames import (
    ConnectionError_,
    DataReceived,
    ErrorCode,
    StreamEnded,
    StreamReset,
)

if TYPE_CHECKING:
    from pact_ingress.net.readiness import Hub
    from pact_ingress.net.upstream import _Conn, _Pool

Header = tuple[bytes, bytes]

#: Ciphertext read per syscall.
READ_SIZE = 64 * 1024
#: Our window per stream: an answer may run this far ahead of the client taking it.
STREAM_WINDOW = 256 * 1024
#: Our window for the whole session: every stream's window, for as many streams as the
#: lane sends at once to one node (beyond, exchanges go over HTTP/1.1).
MAX_STREAMS = 100
SESSION_WINDOW = STREAM_WINDOW * MAX_STREAMS
#: Streams one session carries before the next exchange makes a new one. Some HTTP/2
#: servers stop answering on a connection after a number of requests: hypercorn, at
#: its `keep_alive_max_requests` (1,000 by default), takes the next request and then
#: sends GOAWAY with it counted as processed, so its answer never comes (a 504 after
#: the header timeout). So a session stops short of that, and its successor is made
#: (`renew`) while it still serves, from `RENEW_AT` streams on: no exchange waits for
#: it, and a new TLS connection every 900 requests costs about 1.5 µs of CPU each.
MAX_STREAMS_PER_SESSION = 900
RENEW_AT = 600

_IN, _OUT = select.EPOLLIN, select.EPOLLOUT
_HUP = select.EPOLLRDHUP | select.EPOLLHUP | select.EPOLLERR
_READABLE = _IN | _HUP
_BOTH = _IN | select.EPOLLRDHUP | select.EPOLLET | _OUT


class NodeProtocol(enum.Enum):
    UNTRIED = "untried"  # no connection offered h2 yet, or the last session ended
    TRYING = "trying"  # a lane exchange's task connects, offering h2 and http/1.1
    H2 = "h2"  # a session carries the lane's exchanges
    HTTP1 = "http/1.1"  # the node chose HTTP/1.1 (or cannot be driven from the hub)

    __hash__ = object.__hash__


UNTRIED, TRYING, H2, HTTP1 = (NodeProtocol.UNTRIED, NodeProtocol.TRYING, NodeProtocol.H2,
                              NodeProtocol.HTTP1)
_MOVES: dict[NodeProtocol, frozenset[NodeProtocol]] = {
    UNTRIED: frozenset({TRYING}),
    TRYING: frozenset({H2, HTTP1, UNTRIED}),
    H2: frozenset({UNTRIED}),
    HTTP1: frozenset(),
}


def move(pool: _Pool, to: NodeProtocol) -> None:
    if to not in _MOVES[pool.protocol]:
        raise AssertionError(f"node protocol {pool.protocol.value} -> {to.value}")
    pool.protocol = to


#: Request fields that have no place in an HTTP/2 request (RFC 9113 §8.2.2); the lane's
#: cleaned headers carry none but `host`, which becomes `:authority`.
_NOT_SENT = frozenset({b"host", b"connection", b"keep-alive", b"proxy-connection",
                       b"transfer-encoding", b"upgrade"})
_METHODS: dict[str, bytes] = {}


def request_fields(method: str, target: bytes, headers: list[Header]) -> list[Header]:
    """The request's head as an HTTP/2 header list: the pseudo-header fields first, the
    `Host` the lane set as `:authority`, the rest as cleaned (names already lower case)."""
    m = _METHODS.get(method)
    if m is None:
        m = method.encode("ascii")
        if len(_METHODS) < 64:
            _METHODS[method] = m
    authority = b""
    rest = []
    for field in headers:
        name = field[0]
        if name in _NOT_SENT:
            if name == b"host":
                authority = field[1]
            continue
        rest.append(field)
    return [(b":method", m), (b":scheme", b"https"), (b":path", target),
            (b":authority", authority), *rest]


class NodeSession:
    """One HTTP/2 connection to a node, its streams' holders fed from the hub."""

    def __init__(self, pool: _Pool, conn: _Conn, hub: Hub) -> None:
        self.pool = pool
        self.conn = conn
        self.hub = hub
        self.h2 = H2Client(max_concurrent_streams=MAX_STREAMS, initial_window=STREAM_WINDOW,
                           connection_window=SESSION_WINDOW)
        self.holders: dict[int, Any] = {}  # stream id -> its holder
        self.closed = False
        #: it takes no new stream (its last was opened, a successor took over, or the
        #: node said GOAWAY): it closes once its streams ended (`retire_if_done`)
        self.retiring = False
        self.queued = False  # a flush is due when the hub's batch is done
        self.pending = b""  # ciphertext the kernel did not take yet
        self.served = 0  # streams opened
        watch = conn._watch
        if watch is None:
            watch = conn._watch = hub.watch(conn._raw)  # type: ignore[arg-type]
        watch.lane = self.event
        self.watch = watch
        self.h2.initiate_connection()
        self.queue()
        if conn._in.pending or conn._sslobj.pending() or watch.readable:
            # what came with the handshake (the node's SETTINGS, even a GOAWAY) is read
            # now: no new edge of the socket will announce it
            watch.readable = False
            self.event(_IN)

    # -- for the lane -------------------------------------------------------------------

    def usable(self) -> bool:
        """May a new exchange go as a stream now?"""
        return not self.closed and not self.retiring and self.h2.can_open()

    def open(self, holder: Any, fields: list[Header], body: bytes) -> int:
        """Send a request as a new stream held by `holder`; its id. The caller checked
        `usable` (so `StreamClosed` means a bug)."""
        h2 = self.h2
        sid = h2.send_request(fields, end_stream=not body)
        if body:
            h2.send_data(sid, body, end_stream=True)
        self.holders[sid] = holder
        self.served += 1
        if self.served == RENEW_AT:
            trio.lowlevel.spawn_system_task(self.renew, name="node_session.renew")
        elif self.served >= MAX_STREAMS_PER_SESSION:
            self.going_away()  # its last stream: closed once its streams ended
        self.queue()
        return sid

    async def renew(self) -> None:
        """Make this session's successor while it still serves; the successor takes
        over when it is up, and this one closes once its streams ended. A failure
        changes nothing: at its last stream this one goes away, and the pool's next
        exchange tries the node as the first one did."""
        from pact_ingress.net.upstream import UpstreamError

        pool = self.pool
        try:
            conn, _ = await pool.acquire(self.conn.sni,
                                         trio.current_time() + pool.upstream.connect_timeout,
                                         fresh=True, offer_h2=True)
        except UpstreamError as exc:
            log.warning("node_session_renew_failed", route=pool.route.host, error=str(exc))
            return
        if (pool.session is self and not pool.retired and conn._raw is not None
                and conn.ssl_object.selected_alpn_protocol() == "h2"):
            successor = NodeSession(pool, conn, self.hub)
            if successor.usable() and pool.session is self:
                pool.session = successor
                self.retiring = True
                self.retire_if_done()
            else:  # (it ended as it began: a GOAWAY or a close in its first flight)
                successor.close()
            return
        await pool.discard(conn)

    def hand(self, sid: int, holder: Any) -> None:
        """The stream's events go to `holder` from now on."""
        if sid in self.holders:
            self.holders[sid] = holder

    def acknowledge(self, length: int, sid: int) -> None:
        """`length` bytes of the stream's answer were passed on: our windows back."""
        if length and not self.closed:
            self.h2.acknowledge(length, sid)
            if self.h2.out:
                self.queue()

    def cancel(self, sid: int) -> None:
        """The holder gives the stream up: reset (CANCEL) if it is still open either
        way (an answer that ended before our request body did: NO_ERROR, as RFC 9113
        §8.1 has a server do); what the node sends on it is dropped from now on."""
        held = self.holders.pop(sid, None) is not None
        if self.closed:
            return
        stream = self.h2.streams.get(sid)
        if stream is not None:
            if stream.remote_open:
                self.h2.reset_stream(sid, ErrorCode.CANCEL)
            else:
                # the node answered before it took our whole request: some nodes close
                # the connection after that (hypercorn does), so, as an HTTP/1.1
                # connection in that state is not reused, no new stream goes here
                self.h2.reset_stream(sid, ErrorCode.NO_ERROR)
                self.going_away()
            self.queue()
        if held or stream is not None:
            self.retire_if_done()

    # -- out ------------------------------------------------------------------------------

    def queue(self) -> None:
        """Frames are queued: out when the hub's batch is done, or now outside it."""
        if self.queued or self.closed:
            return
        if self.hub.serving:
            self.queued = True
            self.hub.after.append(self.flush)
        else:
            self.flush()

    def flush(self) -> None:
        self.queued = False
        if self.closed:
            return
        conn = self.conn
        out = self.h2.take_output()
        try:
            if out:
                conn._sslobj.write(out)
            self.send()
        except (OSError, ssl.SSLError) as exc:
            self.fail(f"send to the node failed: {exc!r}")

    def send(self) -> None:
        conn = self.conn
        data = self.pending + conn._out.read() if self.pending else conn._out.read()
        self.pending = b""
        raw = conn._raw
        assert raw is not None
        while data:
            try:
                sent = raw.send(data)
            except BlockingIOError:
                self.pending = data
                watch = self.watch
                if not watch.out:
                    watch.hub.ep.modify(watch.fd, _BOTH)
                    watch.out = True
                return
            data = data[sent:]

    # -- in -------------------------------------------------------------------------------

    def event(self, mask: int) -> None:
        """The hub's call with the node socket's events."""
        try:
            self._event(mask)
        except Exception as exc:  # noqa: BLE001 - a bug here ends the session, not the hub
            log.error("node_session_failed", route=self.pool.route.host, error=repr(exc))
            self.fail(f"the session failed: {exc!r}")

    def _event(self, mask: int) -> None:
        if self.closed:
            return
        if mask & _OUT and self.pending:
            try:
                self.send()
            except OSError as exc:
                self.fail(f"send to the node failed: {exc!r}")
                return
        if not mask & _READABLE:
            return
        conn = self.conn
        raw, inc, tls = conn._raw, conn._in, conn._sslobj
        assert raw is not None
        # what the TLS engine holds already (it came with the handshake's last flight,
        # or behind a record read before) first: no edge of the socket announces it
        if (inc.pending or tls.pending()) and not self.plaintext():
            return
        while not self.closed:
            try:
                data = raw.recv(READ_SIZE)
            except BlockingIOError:
                break
            except OSError as exc:
                self.fail(f"receive from the node failed: {exc!r}")
                return
            if data:
                inc.write(data)
            else:
                inc.write_eof()
            if not self.plaintext():
                return
            if not data:
                self.fail("the node closed the connection")
                return
            if len(data) < READ_SIZE and not mask & _HUP:
                break  # the socket had nothing more: a new edge announces what comes
        if self.h2.out:
            self.queue()

    def plaintext(self) -> bool:
        """Everything the TLS engine can decrypt now, to the protocol and its events to
        their holders; False when the session ended."""
        conn = self.conn
        inc, tls, h2 = conn._in, conn._sslobj, self.h2
        while not self.closed:
            try:
                plain = tls.read(READ_SIZE)
            except ssl.SSLWantReadError:
                return True
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                plain = b""
            except ssl.SSLError as exc:
                self.fail(f"TLS from the node failed: {exc!r}")
                return False
            if not plain:
                self.fail("the node closed the connection")
                return False
            try:
                events = h2.receive_data(plain)
            except ConnectionError_ as exc:
                self.queue()  # the GOAWAY, if the socket still takes it
                self.fail(f"the node broke HTTP/2: {exc} ({exc.code.name})")
                return False
            self.dispatch(events)
            if not inc.pending and not tls.pending():
                return True  # (what a further read would say without its exception)
        return False

    def dispatch(self, events: list[Any]) -> None:
        holders = self.holders
        for e in events:
            kind = type(e)
            if kind is DataReceived:
                holder = holders.get(e.stream_id)
                if holder is None:
                    self.h2.acknowledge(e.flow_length, e.stream_id)
                    continue
                if e.ended:
                    del holders[e.stream_id]
                holder.h2_data(e.data, e.flow_length, e.ended)
            elif kind is ResponseReceived:
                holder = holders.get(e.stream_id)
                if holder is not None:
                    if e.ended:
                        del holders[e.stream_id]
                    holder.h2_head(e.status, e.headers, e.ended, e.length)
            elif kind is StreamEnded:
                holder = holders.pop(e.stream_id, None)
                if holder is not None:
                    holder.h2_end()
            elif kind is StreamReset:
                holder = holders.pop(e.stream_id, None)
                if holder is not None:
                    holder.h2_reset(e.code, e.code == ErrorCode.REFUSED_STREAM)
            elif kind is GoAwayReceived:
                self.going_away()
                for sid in e.unprocessed:
                    holder = holders.pop(sid, None)
                    if holder is not None:
                        holder.h2_reset(ErrorCode.REFUSED_STREAM, True)
        self.retire_if_done()

    # -- the end ------------------------------------------------------------------------

    def going_away(self) -> None:
        """No new stream here: the pool's next exchange makes a new session."""
        self.retiring = True
        pool = self.pool
        if pool.session is self:
            pool.session = None
            move(pool, UNTRIED)

    def retire_if_done(self) -> None:
        """A session that takes no new stream closes once its last stream ended."""
        if not self.holders and not self.closed and (self.retiring or self.pool.retired):
            self.close()

    def close(self) -> None:
        """Closed by us: GOAWAY if the socket takes it, then the connection."""
        if self.closed:
            return
        self.h2.close_connection()
        try:
            self.flush()
        except Exception:  # noqa: BLE001 - closing anyway
            pass
        self.fail(None)

    def fail(self, why: str | None) -> None:
        """The connection ends; every stream still held is told (`why`: a failure)."""
        if self.closed:
            return
        self.closed = True
        self.going_away()
        if why is not None:
            # with streams in flight a failure; with none, most often a node closing a
            # connection it found idle (hypercorn does after 5 s): not worth a warning
            (log.warning if self.holders else log.debug)(
                "node_session_ended", route=self.pool.route.host, error=why,
                streams=len(self.holders))
        holders, self.holders = self.holders, {}
        watch = self.watch
        watch.lane = None
        self.pool.open -= 1
        self.pool._freed.unpark()
        self.conn.close_now()
        exc = ConnectionResetError(why or "the session closed")
        for holder in holders.values():
            holder.h2_broken(exc)


class StreamRelay:
    """The rest of a stream's answer, for the trio engine's relay: `Upstream.adopt`'s
    counterpart (an async context giving an `UpstreamResponse` whose body is read from
    here). The session feeds it; the relay task takes each piece, and only then does
    our window for it go back to the node."""

    def __init__(self, session: NodeSession, sid: int, entry: _Pool, status: int,
                 headers: list[Header], parts: list[bytes], ended: bool,
                 idle_timeout: float) -> None:
        self.session = session
        self.sid = sid
        self.entry = entry
        self.status = status
        self.headers = headers
        self.idle_timeout = idle_timeout
        self.pieces: deque[tuple[bytes, int]] = deque((p, 0) for p in parts if p)
        self.ended = ended
        self.error: Exception | None = None
        self.complete = False
        self.waiter: trio.Event | None = None
        if not ended:
            session.hand(sid, self)

    # -- the session's side -----------------------------------------------------------

    def _wake(self) -> None:
        if self.waiter is not None:
            self.waiter.set()

    def h2_head(self, status: int, headers: list[Header], ended: bool,
                length: int | None) -> None:
        self.ended = self.ended or ended
        self._wake()

    def h2_data(self, data: bytes, flow: int, ended: bool) -> None:
        if data or flow:
            self.pieces.append((data, flow))
        self.ended = self.ended or ended
        self._wake()

    def h2_end(self) -> None:
        self.ended = True
        self._wake()

    def h2_reset(self, code: int, retryable: bool) -> None:
        self.error = ConnectionResetError(f"the node reset the stream ({code})")
        self._wake()

    def h2_broken(self, exc: Exception) -> None:
        self.error = exc
        self._wake()

    # -- the relay task's side ---------------------------------------------------------

    async def __aenter__(self) -> Any:
        from pact_ingress.net.upstream import UpstreamResponse
        return UpstreamResponse(self.status, self.headers, "2", self)

    async def __aexit__(self, *exc_info: object) -> None:
        if not self.complete:
            # what came and was not taken is given back first: held here, it would be
            # lost to the session's window for good (a stream's worth per client that
            # leaves mid-answer)
            owed = sum(flow for _, flow in self.pieces)
            self.pieces.clear()
            self.session.acknowledge(owed, self.sid)
            self.session.cancel(self.sid)
        entry = self.entry
        entry.active -= 1
        up = entry.upstream
        if up._retired:
            await up._reap()

    def take_whole(self) -> bytes | None:
        return None

    def __aiter__(self) -> StreamRelay:
        return self

    async def __anext__(self) -> bytes:
        from pact_ingress.net.upstream import UpstreamProtocolError, UpstreamTimeout
        while True:
            if self.pieces:
                data, flow = self.pieces.popleft()
                self.session.acknowledge(flow, self.sid)
                if data:
                    return data
                continue
            if self.error is not None:
                raise UpstreamProtocolError(f"node body broke: {self.error}")
            if self.ended:
                self.complete = True
                raise StopAsyncIteration
            self.waiter = trio.Event()
            with trio.move_on_after(self.idle_timeout) as waited:
                await self.waiter.wait()
            self.waiter = None
            if waited.cancelled_caught:
                raise UpstreamTimeout("node body idle too long")

