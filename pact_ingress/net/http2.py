"""The HTTP/2 client leg of the terminate engine: `proto.h2_server` driven by one reader
and one writer.

Theory of operation
-------------------
`proto.h2_server.H2Server` is the state machine (frames, HPACK, stream states, flow
control, the protocol's limits); this module moves bytes. One task reads the connection
and feeds it; every event is dispatched *in order* before the next read, so a DATA frame
that arrived in the same read as its HEADERS finds its stream already created (the
stream exists from `RequestReceived` on). When the socket is in the readiness hub and
the reader has nothing to do but wait, it parks and the hub's call with the socket's
events reads, feeds and dispatches for it (`_read_inline`), the same steps in the same
order: a client that sends a request and waits for its answer costs no wake-up of the
reader; the reader wakes for what it must do itself (the client's end, a failure, a
flood, back-pressure, more than `INLINE_READS` reads at once). The usual request (its
HEADERS end the stream) is offered to the keep-alive lane first (`fast`,
`net/h2_lane.py`), which serves it without a stream worker. Every other request runs
the engine's `handle` in a stream worker: a task of the connection's nursery that, when
its exchange is done, parks and takes the connection's next request instead of ending,
so a keep-alive connection does not spawn (and tear down) a task per request. When the
connection ends, they all end. A worker keeps one cancel scope for all the exchanges it
serves: a reset cancels it, and the worker ends with that exchange.

Request bodies are flow controlled end to end: DATA is queued on its stream and
acknowledged to the state machine (so WINDOW_UPDATE goes out when one is due: once half
a window has been taken) only when the engine *takes* it, so a stream buffers at most
its window (`STREAM_WINDOW`, 65,535 bytes) whatever the client sends: a stream whose node
is slow, or that waits for a node connection, stops its own upload and no other. The
connection window is raised at the start to every stream's window at once
(`CONNECTION_WINDOW`), so streams that wait can never hold the whole of it and starve
the streams that could go on (with the protocol's 65,535, one waiting stream's full
window did), and it bounds what the connection buffers: 6,553,500 bytes of request
data not yet taken. Short DATA payloads are gathered into runs, so what is buffered
costs its bytes and not an object per frame. DATA for a stream that was answered early
or ended is acknowledged at once, so the connection window never leaks.

Writes: only the writer task ever waits on the socket. Everyone else (the reader
answering PINGs and SETTINGS, a stream queueing its head, DATA, END_STREAM or RST) lets
the state machine queue frames in its outbox (`H2Server.out`) and calls `kick`, which
wakes the writer; the writer takes the whole outbox and sends it in one write when it
runs. So a 1 KiB answer leaves as one TLS record in one `send`, the answers of streams
that finish together share one, and nothing cancels a write half-way (a TLS record cut
off mid-write would leave nothing to resume). One exception saves the writer's wake-up
on the usual answer: a stream whose whole answer is queued while the writer is idle
sends the outbox itself without waiting (`_send_now`); what the kernel does not take is
held by the TLS stream and the writer is woken to send it before anything else.
Back-pressure: a stream or the reader that finds more than `FLUSH_BYTES` in the outbox
waits for the writer to take it. Each write must be taken by the client within
`write_timeout`, else the connection is dropped (a client that stops reading must not
hold a node's response, or our buffers, for ever). Response DATA waits for the client's
flow-control window with the same deadline.

Idle connections: a connection with no stream open is closed after `idle_timeout`
without a new request (one watchdog task per connection, re-armed by the time of the
last request or the end of the last stream, instead of a deadline on every read), and at
once when the edge drains. Frames that open no stream (PING, SETTINGS, WINDOW_UPDATE,
PRIORITY, unknown types, frames on closed streams) do not keep a connection: a client
pinging within its allowance would otherwise hold it for ever.

A stream reset by the client cancels its exchange at once (and with it the upstream
request). Frames that cost a client nothing and us something (RST_STREAM, and the resets
a client provokes from us: malformed requests, stream errors, streams beyond the
concurrency limit; PING, SETTINGS, PRIORITY, empty DATA, unknown types, and
WINDOW_UPDATEs beyond what the data we send explains) are metered per connection
(`proto.h2_guard`): a flood ends the connection with GOAWAY(ENHANCE_YOUR_CALM), after
which the connection lingers a moment, reading and dropping what the client still sends,
so the GOAWAY is not lost to a reset. Zero-window stalls end at the write deadline. An
answer given before the body was read ends the stream with `RST_STREAM(NO_ERROR)` after
the complete response (RFC 9113 §8.1). A drain takes no new stream (REFUSED_STREAM: safe
to retry elsewhere), lets the open ones finish, uploads included, then sends
GOAWAY(NO_ERROR) and closes; an idle connection closes at once.

Header blocks are checked here, in one pass each way: a request header block by
`proto.h2_request.split_request` (names, characters, pseudo-headers, connection-specific
fields, Host against `:authority`: nothing malformed reaches the engine; a malformed
request is reset with PROTOCOL_ERROR; the same decoded block as the previous request is
not split again), and the response block is built by `response_block` from headers the
engine has already cleaned (`proto.http_headers`: lower-case names, no pseudo-headers,
no hop-by-hop fields), with the one normalisation left, surrounding whitespace, done in
the same pass. The state machine enforces the header list size and checks
`Content-Length` against the DATA.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Awaitable, Callable
from typing import Any

import outcome
import trio

from pact_ingress.logs import log
from pact_ingress.net import readiness
from pact_ingress.net.http_exchange import (
    ClientGone,
    Exchange,
    Headers,
    HeadTooLarge,
    send_to_client,
)
from pact_ingress.net.linger import linger
from pact_ingress.net.tls_server import ServerTLS
from pact_ingress.proto import h2_frames
from pact_ingress.proto import h2_server as h2
from pact_ingress.proto.h2_frames import ErrorCode
from pact_ingress.proto.h2_guard import WINDOW_CREDIT_BYTES, WINDOW_UPDATE, Flood, FloodGuard
from pact_ingress.proto.h2_request import MalformedRequest, split_request
from pact_ingress.proto.http_request import declared_length, header

#: Streams one client connection may have open at once (RFC 9113 suggests ≥ 100).
MAX_CONCURRENT_STREAMS = 100
#: Largest header list accepted, as for HTTP/1.1 heads.
MAX_HEADER_LIST_SIZE = 16 * 1024
#: A stream's receive window (SETTINGS_INITIAL_WINDOW_SIZE, the protocol's default): the
#: most of its request body a stream can have waiting here before the engine takes it.
STREAM_WINDOW = h2_frames.DEFAULT_WINDOW
#: The connection's receive window, raised from 65535 at the start: every stream's whole
#: window at once. DATA is acknowledged only when the engine takes it, so a stream whose
#: body waits (for a node connection, for a node that reads slowly) holds its own window;
#: with a connection window no larger than a stream's, a few waiting streams would hold
#: all of it and the streams whose nodes are ready could get none of their bodies. This
#: is also the connection's bound on request data received and not yet taken:
#: 100 × 65,535 = 6,553,500 bytes.
CONNECTION_WINDOW = MAX_CONCURRENT_STREAMS * STREAM_WINDOW
#: DATA payloads shorter than this are appended to the stream's last short run (up to
#: `RUN_BYTES`) rather than queued as objects of their own: a frame's payload can be one
#: byte, and a queue entry per byte would cost a hundred times the window in objects.
#: So a stream's queue has at most 130 entries: up to 63 payloads of 1 KiB or more, a
#: run before each of them and one after, and 3 runs that filled up.
SHORT_DATA = 1024
RUN_BYTES = 16 * 1024
#: Bytes asked of the TLS stream per read.
READ_SIZE = 64 * 1024
#: Plaintext of a full TLS record: a read returns at most this much.
TLS_RECORD = 16 * 1024
#: Bytes queued for the writer beyond which whoever queues more waits for the writer to
#: take them: enough for four full TLS records in one `send`, and a bound on what a client
#: that does not read can make us hold per connection.
FLUSH_BYTES = 64 * 1024
#: A read returns without yielding to other connections when TLS already holds bytes;
#: the reader yields at least every this many reads, so a client that keeps its socket
#: full (of frames the state machine handles without us, such as WINDOW_UPDATE) cannot
#: hold the loop.
YIELD_EVERY = 8
#: Reads the hub makes for a parked reader per event (`_take_inline`); a client that
#: sends more at once has the reader read the rest.
INLINE_READS = 4
#: Stream workers kept parked per connection for the next request; more than this many
#: concurrent streams spawn workers that end with their exchange.
MAX_IDLE_WORKERS = 8
#: After a GOAWAY for an error, how long and how much of what the client still sends is
#: read and dropped before closing (`H2Connection._linger`): long enough for a client
#: to read what was sent to it, little enough that a flooder gains nothing by it. The
#: bytes cover what the windows we granted let a client have in flight (an upload on
#: every stream does not know of the error yet) and room for its other frames: closing
#: with any of it unread would reset the connection and could take the GOAWAY with it.
LINGER_SECONDS = 1.0
LINGER_BYTES = CONNECTION_WINDOW + 256 * 1024
#: After the drain's GOAWAY(NO_ERROR) or an idle close, the same, for longer: a client
#: still reading the last answers keeps sending WINDOW_UPDATEs, and a reset would throw
#: away what it has not read yet. It ends as soon as the client has acknowledged it all,
#: or closes its side, as clients do on GOAWAY.
DRAIN_LINGER_SECONDS = 5.0

_Handle = Callable[[Exchange], Awaitable[None]]

#: Response header fields that must not appear in HTTP/2 (RFC 9113 §8.2.2); the engine
#: strips them already, this is the last line.
_CONNECTION_SPECIFIC = frozenset({
    b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"upgrade",
    b"te",
})
_STATUS = {code: str(code).encode() for code in range(100, 600)}
_OWS = b" \t"


def response_block(status: int, headers: Headers) -> Headers:
    """The HEADERS block of a response: `:status` first, then the fields as HTTP/2 wants
    them (lower-case names, no surrounding whitespace, no connection-specific field)."""
    block = [(b":status", _STATUS.get(status) or str(status).encode())]
    for name, value in headers:
        name = name.lower()
        if name in _CONNECTION_SPECIFIC or name[:1] == b":":
            continue
        if status == 204 and name == b"content-length":
            # a node may send one (RFC 9110 §8.6 says it must not); nghttp2 resets a 204
            # stream whose length is not 0, and there is no content to measure anyway
            continue
        block.append((name, value.strip(_OWS)))
    return block


def _sendable_block(conn: h2.H2Server, status: int, headers: Headers) -> Headers:
    """`response_block`, or `HeadTooLarge` when it is larger than the client's advertised
    SETTINGS_MAX_HEADER_LIST_SIZE. The engine then answers 502 on the stream, as proxies
    do with an upstream head they cannot pass on (nginx's "upstream sent too big
    header"): a status the client can act on, where a reset would say nothing, and
    sending it anyway would have the client discard the answer or, as the h2 library
    does, fail the whole connection and every other stream on it. Nothing of the answer
    has gone out at this point: the head is its first frame."""
    block = response_block(status, headers)
    if not conn.fits_peer(block):
        raise HeadTooLarge("response head larger than the client's SETTINGS_MAX_HEADER_LIST_SIZE")
    return block


class H2Connection:
    def __init__(self, stream: trio.abc.Stream, *, idle_timeout: float, write_timeout: float,
                 idle_scopes: set[trio.CancelScope], draining: trio.Event,
                 on_flood: Callable[[Flood], None] = lambda kind: None) -> None:
        self.stream = stream
        # our own TLS: a stream worker may send a finished answer itself (`_send_now`)
        self._tls = stream if isinstance(stream, ServerTLS) else None
        self.conn = h2.H2Server(max_concurrent_streams=MAX_CONCURRENT_STREAMS,
                                max_header_list_size=MAX_HEADER_LIST_SIZE,
                                initial_window=STREAM_WINDOW,
                                connection_window=CONNECTION_WINDOW)
        self.idle_timeout = idle_timeout
        self.write_timeout = write_timeout
        self.streams: dict[int, H2Exchange] = {}
        self._idle_scopes = idle_scopes
        self._draining = draining
        self._window: trio.Event | None = None  # set when send windows may have grown
        self._goaway = False
        self._last_stream: int | None = None  # the last stream taken before a drain
        self._guard = FloodGuard()
        self._flooded: Flood | None = None
        self._refused = False  # the read loop ended on our GOAWAY for an error
        self._gone = False  # the read loop ended on the client's close (or reset)
        self.on_flood: Callable[[Flood], None] = on_flood
        # writing
        self._writing = False  # the writer holds a batch it is sending
        self._writer: trio.lowlevel.Task | None = None  # the writer, while parked
        self._room: trio.Event | None = None  # set when the writer takes the outbox
        self._written: trio.Event | None = None  # set when the writer runs out of work
        self._broken = False  # a write failed or timed out: nothing more can be sent
        self._scope = trio.CancelScope()  # the whole connection: a failed write ends it
        # reading
        self._read_scope = trio.CancelScope()  # cancelled: idle too long, or drained idle
        self._last_read = 0.0
        self._closing = False  # the read loop is over; the nursery is being torn down
        # stream workers
        self._handle: _Handle | None = None
        self._nursery: trio.Nursery | None = None
        self._idle_workers: list[trio.lowlevel.Task] = []
        # the last request header block checked, and the request it makes
        self._split: tuple[object, _Request] | None = None
        # the reader parked while the hub reads for it (`_read_inline`)
        self._inline_task: trio.lowlevel.Task | None = None
        self._inline_watch: readiness.Watch | None = None
        #: the keep-alive lane's start of a stream (`net/h2_lane.py`): True when it
        #: serves the stream without a worker
        self.fast: Callable[[H2Exchange], bool] | None = None
        #: the lane's end of the connection: the streams it still serves end
        self.fast_close: Callable[[], None] | None = None

    async def serve(self, handle: _Handle) -> None:
        self.conn.initiate_connection()
        self._handle = handle
        self._last_read = trio.current_time()
        with self._scope:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                try:
                    self.kick()
                    nursery.start_soon(self._write_loop)
                    nursery.start_soon(self._on_drain)
                    nursery.start_soon(self._idle_watch)
                    self._idle_scopes.add(self._read_scope)
                    with self._read_scope:
                        await self._read_loop()
                    if self._draining.is_set() and not self.conn.closed:
                        # GOAWAY(NO_ERROR) naming the last stream taken before the drain
                        self.conn.close_connection(last_stream_id=self._last_stream)
                    await self.flush()  # a GOAWAY, the last answers
                except ClientGone:
                    pass
                finally:
                    self._closing = True  # streams ending from here on leave no trace
                    self._idle_scopes.discard(self._read_scope)
                    if self.fast_close is not None:
                        self.fast_close()
                    nursery.cancel_scope.cancel()
            if not (self._broken or self._gone):
                # with every task of the connection ended: none writes
                await self._linger(LINGER_SECONDS if self._refused else DRAIN_LINGER_SECONDS)

    async def _linger(self, seconds: float) -> None:
        """After our GOAWAY (for an error: a flood, a protocol error; or the drain's) or
        an idle close, `net.linger`: the write side is shut and what the client still
        sends is read and dropped until the client has acknowledged everything we sent,
        or it closes, for at most `seconds` and `LINGER_BYTES`. Closed with the client's
        bytes unread (or meeting the ones it sends next), the socket would be reset, and
        the reset throws away what our kernel has not delivered yet: the GOAWAY and the
        answers still on their way (the client would never learn why, or lose the tail
        of its last answers: a slow reader still sends WINDOW_UPDATEs)."""
        # our TLS, or the relay's (its own TLS object, the same socket underneath)
        sock = getattr(self.stream, "socket", None)
        if sock is not None:
            await linger(sock, seconds, LINGER_BYTES)

    async def _on_drain(self) -> None:
        """Take no new stream; say GOAWAY once the open ones have been answered. Not at
        once: the h2 library (and so httpx) treats any GOAWAY as the end of the connection
        and would fail the answers still to come, and its uploads still open with them."""
        await self._draining.wait()
        self._goaway = True
        self._last_stream = self.conn.highest_inbound_stream_id
        if not self.streams:
            self._read_scope.cancel()

    async def _idle_watch(self) -> None:
        """End the read loop once no stream has been open and no request came for
        `idle_timeout` (`_last_read` moves with each request and when the last stream
        ends)."""
        while True:
            now = trio.current_time()
            if self.streams:
                await trio.sleep_until(now + self.idle_timeout)
                continue
            due = self._last_read + self.idle_timeout
            if now >= due:
                self._read_scope.cancel()
                return
            await trio.sleep_until(due)

    async def _read_loop(self) -> None:
        reads = 0
        tls = self._tls
        data = b""
        inline = False  # the last wait was `_read_inline`'s: the next read is the reader's
        while not (self._goaway and not self.streams):
            reads += 1
            if reads % YIELD_EVERY == 0:
                await trio.lowlevel.checkpoint()
            if tls is not None and not inline and len(data) < TLS_RECORD:
                watch = tls._watch
                if (watch is not None and watch.lane is None and not watch.readable
                        and not watch.ended and not watch.closed and not tls.buffered()):
                    inline = True
                    await self._read_inline(watch)
                    if self._gone or self._refused:
                        return
                    if len(self.conn.out) >= FLUSH_BYTES:
                        await self._wait_room()
                    continue
            inline = False
            try:
                if tls is not None:
                    # less than a full TLS record last time: the socket was most likely
                    # drained (a client waiting for its answer), so wait for it to be
                    # readable instead of asking it first (what TLS holds is read first)
                    data = await tls.receive_by(READ_SIZE, math.inf,
                                                wait_first=len(data) < TLS_RECORD)
                else:
                    data = await self.stream.receive_some(READ_SIZE)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self._gone = True
                return
            if not data:
                self._gone = True
                return
            if not self._feed(data):
                return
            if len(self.conn.out) >= FLUSH_BYTES:
                await self._wait_room()

    async def _read_inline(self, watch: readiness.Watch) -> None:
        """Wait for the client's next bytes with the reader parked while the hub reads,
        feeds and dispatches them as they come (`_inline`, called with the socket's
        events): a client that waits for each answer then costs no wake-up of the reader
        per request. Returns when the reader has something to do itself: the client's
        end or a failure, a protocol error or a flood, an outbox to wait on, the last
        stream answered after a GOAWAY, more than `INLINE_READS` reads at once, or a TLS
        message of ours to send."""
        self._inline_watch = watch
        self._inline_task = trio.lowlevel.current_task()
        watch.lane = self._inline
        await trio.lowlevel.wait_task_rescheduled(self._abort_inline)

    def _abort_inline(self, _: object) -> trio.lowlevel.Abort:
        watch, self._inline_watch = self._inline_watch, None
        if watch is not None:
            watch.lane = None
        self._inline_task = None
        return trio.lowlevel.Abort.SUCCEEDED

    def _wake_reader(self) -> None:
        watch, self._inline_watch = self._inline_watch, None
        if watch is not None:
            watch.lane = None
        task, self._inline_task = self._inline_task, None
        if task is not None:
            trio.lowlevel.reschedule(task)

    def _inline(self, mask: int) -> None:
        """The hub's call with the socket's events while the reader is parked inline."""
        watch = self._inline_watch
        if watch is None:
            return
        if mask & readiness.WAKES_WRITER:
            writer = watch.writer
            if writer is not None:
                watch.writer = None
                trio.lowlevel.reschedule(writer)
        if not mask & readiness.WAKES_READER:
            return
        if mask & readiness.ENDS:  # the client's end (or a failure): the reader's to read
            watch.ended = True
            self._wake_reader()
            return
        try:
            done = self._take_inline()
        except trio.BrokenResourceError:
            self._gone = True  # (as the reader's own read ends it)
            done = False
        except Exception as exc:  # noqa: BLE001 - never the hub's end
            log.error("h2_reader_error", error=repr(exc))
            self._gone = True
            done = False
        if not done:
            watch.readable = True  # (edge-triggered: what is left has no event of its own)
            self._wake_reader()

    def _take_inline(self) -> bool:
        """What the socket holds, read, fed and dispatched, as `_read_loop` does; True
        when all of it was and the reader may stay parked."""
        tls = self._tls
        assert tls is not None
        for _ in range(INLINE_READS):
            if self._inline_task is None:  # (a dispatch ended the wait: a drain's cancel)
                return False
            data = tls.read_now(READ_SIZE)
            if data is None:  # the socket has nothing more
                return not tls._out.pending
            if not data:
                self._gone = True
                return False
            if not self._feed(data):
                return False
            if len(self.conn.out) >= FLUSH_BYTES or (self._goaway and not self.streams):
                return False
        return False

    def _feed(self, data: bytes) -> bool:
        """The client's bytes into the state machine, every event dispatched in order;
        False when the connection is refused (a protocol error or a flood: the GOAWAY
        is queued)."""
        try:
            events = self.conn.receive_data(data)
        except h2_frames.ConnectionError_:
            self._refused = True
            return False
        for event in events:
            self._dispatch(event)
            if self._flooded is not None:
                break  # the verdict is in: the rest of this read starts nothing
        self.kick()
        if self._flooded is not None:
            self._refused = True
            return False
        return True

    def _dispatch(self, event: h2_frames.Event) -> None:
        kind = type(event)
        if kind is h2.RequestReceived:
            if self._last_stream is not None and event.stream_id > self._last_stream:
                # opened after the drain began: the client may retry it elsewhere
                self.conn.reset_stream(event.stream_id, ErrorCode.REFUSED_STREAM)
                return
            exchange = self._exchange(event)
            if exchange is not None:
                self._last_read = trio.current_time()
                if not self.streams:
                    self._idle_scopes.discard(self._read_scope)
                self.streams[event.stream_id] = exchange
                fast = self.fast
                if fast is None or not fast(exchange):
                    self._start(exchange)
        elif kind is h2_frames.DataReceived:
            if not event.data and not event.ended:
                self._charge(Flood.EMPTY_DATA)
            exchange = self.streams.get(event.stream_id)
            if exchange is None or exchange.stopped:
                self.conn.acknowledge(event.flow_length, event.stream_id)
            else:
                exchange.feed(event.data, event.flow_length)
            if event.ended and exchange is not None:
                exchange.end_of_body()
        elif kind is h2_frames.StreamEnded:
            exchange = self.streams.get(event.stream_id)
            if exchange is not None:
                exchange.end_of_body()
        elif kind is h2_frames.StreamReset:
            # ours too: a reset the client provokes (a malformed frame, a stream beyond
            # the limit) frees its stream as cheaply as one it sends itself
            self._charge(Flood.RESET)
            exchange = self.streams.get(event.stream_id)
            if exchange is not None:
                exchange.reset_by_client()
        elif kind is h2_frames.WindowUpdated or kind is h2_frames.SettingsChanged:
            self._charge(Flood.SETTINGS if kind is h2_frames.SettingsChanged
                         else Flood.WINDOW_UPDATE)
            if self._window is not None:
                self._window.set()
                self._window = None
        elif kind is h2_frames.SettingsAcked:
            self._charge(Flood.SETTINGS)
        elif kind is h2_frames.PingReceived:
            self._charge(Flood.PING)
        elif kind is h2_frames.PriorityReceived:
            self._charge(Flood.PRIORITY)
        elif kind is h2_frames.UnknownFrame:
            self._charge(Flood.UNKNOWN)
        elif kind is h2.GoAwayReceived:
            self._goaway = True

    def _charge(self, kind: Flood) -> None:
        if self._flooded is None and not self._guard.charge(kind, trio.current_time()):
            self._flooded = kind
            self.on_flood(kind)
            self.conn.close_connection(ErrorCode.ENHANCE_YOUR_CALM)
            self._goaway = True

    def _exchange(self, event: h2.RequestReceived) -> H2Exchange | None:
        memo = self._split
        if memo is not None and memo[0] is event.headers:
            # the same decoded block as the last request (see `H2Server._decode`)
            request = memo[1]
        else:
            request = _request(event.headers)
            if request is None:
                self.conn.reset_stream(event.stream_id, ErrorCode.PROTOCOL_ERROR)
                self._charge(Flood.RESET)
                return None
            self._split = (event.headers, request)
        method, target, authority, length, fields = request
        return H2Exchange(self, event.stream_id, method, target, list(fields), authority,
                          length, event.ended)

    # -- stream workers -----------------------------------------------------------------

    def start_with(self, exchange: H2Exchange, handle: _Handle) -> None:
        """A worker serves `exchange` with `handle` (the rest of a story the lane began)."""
        exchange.then = handle
        self._start(exchange)

    def _start(self, exchange: H2Exchange) -> None:
        if self._idle_workers:
            trio.lowlevel.reschedule(self._idle_workers.pop(), outcome.Value(exchange))
        else:
            assert self._nursery is not None
            self._nursery.start_soon(self._worker, exchange)

    async def _worker(self, exchange: H2Exchange) -> None:
        # One cancel scope for every exchange the worker serves (entering and leaving a
        # scope per request costs more than the rest of the hand-off): a reset cancels
        # it, and the worker ends with that exchange.
        with trio.CancelScope() as scope:
            while True:
                exchange.scope = scope
                if exchange._reset:  # reset before the worker took it
                    scope.cancel()
                await self._run(exchange)
                exchange.scope = None
                if scope.cancel_called or len(self._idle_workers) >= MAX_IDLE_WORKERS:
                    return
                exchange = await self._park()

    async def _park(self) -> H2Exchange:
        """Wait for the connection's next request (`_start`)."""
        task = trio.lowlevel.current_task()
        self._idle_workers.append(task)

        def abort(_: object) -> trio.lowlevel.Abort:
            self._idle_workers.remove(task)
            return trio.lowlevel.Abort.SUCCEEDED

        exchange: H2Exchange = await trio.lowlevel.wait_task_rescheduled(abort)
        return exchange

    async def _run(self, exchange: H2Exchange) -> None:
        handle = exchange.then or self._handle
        assert handle is not None
        try:
            await handle(exchange)
        except ClientGone:
            pass
        except Exception as exc:
            log.warning("h2_stream_error", error=repr(exc))
            exchange.reset(ErrorCode.INTERNAL_ERROR)  # nothing if the answer was whole
        finally:
            self.stream_done(exchange)

    def stream_done(self, exchange: H2Exchange) -> None:
        """The stream's exchange is over (a worker's, or the lane's)."""
        self.streams.pop(exchange.stream_id, None)
        exchange.release()
        self.kick()
        if not self.streams and not self._closing:
            self._last_read = trio.current_time()  # idle from now
            if self._draining.is_set() or self._goaway:
                # drained, or the client said GOAWAY: the last answer is queued
                self._read_scope.cancel()
            else:
                self._idle_scopes.add(self._read_scope)

    # -- writing ------------------------------------------------------------------------

    def kick(self) -> None:
        """Wake the writer if frames are queued (`self.conn.out`); never waits."""
        if self.conn.out:
            task = self._writer
            if task is not None:
                self._writer = None
                trio.lowlevel.reschedule(task)

    def _send_now(self) -> None:
        """What is queued, sent by the calling task when the writer is idle (parked,
        nothing of its own in flight), so a finished answer costs no wake-up of the
        writer; never waits: what the kernel does not take at once is held by the TLS
        stream and the writer is woken to send it, ahead of anything queued later."""
        tls = self._tls
        if tls is None or self._writer is None or self._broken or not self.conn.out:
            self.kick()
            return
        data = self.conn.take_output()
        try:
            done = tls.write_nowait(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            self._broken = True
            self._scope.cancel()  # as when the writer fails: the connection is over
            raise ClientGone("client connection broke") from exc
        if done is None:  # not possible now: the frames go back to the writer
            self.conn.out[:0] = data
            self.kick()
            return
        if self._room is not None:
            self._room.set()
            self._room = None
        if not done:
            task, self._writer = self._writer, None
            trio.lowlevel.reschedule(task)

    async def _write_loop(self) -> None:
        def abort(_: object) -> trio.lowlevel.Abort:
            self._writer = None
            return trio.lowlevel.Abort.SUCCEEDED

        tls = self._tls
        while True:
            if tls is not None and tls.holding:  # left by `_send_now`: it goes first
                self._writing = True
                try:
                    await tls.flush_by(trio.current_time() + self.write_timeout)
                except (trio.BrokenResourceError, trio.ClosedResourceError,
                        trio.TooSlowError):
                    self._broken = True
                    self._scope.cancel()
                    return
                finally:
                    self._writing = False
                continue
            if not self.conn.out:
                if self._written is not None:
                    self._written.set()
                    self._written = None
                self._writer = trio.lowlevel.current_task()
                await trio.lowlevel.wait_task_rescheduled(abort)
                continue
            data = self.conn.take_output()
            if self._room is not None:
                self._room.set()
                self._room = None
            self._writing = True
            try:
                await send_to_client(self.stream, data, self.write_timeout)
            except ClientGone:
                self._broken = True
                self._scope.cancel()  # every waiter on the writer ends with it
                return
            finally:
                self._writing = False

    async def _wait_room(self) -> None:
        """Wait until the writer has taken the outbox (it writes it within its deadline,
        or the connection ends)."""
        if self._broken:
            raise ClientGone("client connection broke")
        if self._room is None:
            self._room = trio.Event()
        await self._room.wait()

    async def flush(self) -> None:
        """Wait until everything queued so far has been written."""
        self.kick()
        if self._broken:
            raise ClientGone("client connection broke")
        if self.conn.out or self._writing or (self._tls is not None and self._tls.holding):
            if self._written is None:
                self._written = trio.Event()
            await self._written.wait()

    async def wait_window(self, deadline: float) -> None:
        if self._window is None:
            self._window = trio.Event()
        with trio.move_on_at(deadline):
            await self._window.wait()
            return
        raise ClientGone("client's flow-control window stayed closed")


_Request = tuple[str, bytes, bytes | None, int | None, tuple[tuple[bytes, bytes], ...]]


def _request(block: list[tuple[bytes, bytes]]) -> _Request | None:
    """Method, target, authority, declared length and fields of a request header block;
    None when it is malformed."""
    try:
        pseudo, headers = split_request(block)
    except MalformedRequest:
        return None
    declared = header(headers, b"content-length")
    length = None
    if declared is not None:
        length = declared_length(declared)
        if length is None:
            return None
    authority = pseudo.get(b":authority")
    if authority is None:
        authority = header(headers, b"host")
    return (pseudo.get(b":method", b"").decode("ascii", "replace"), pseudo.get(b":path", b""),
            authority, length, tuple(headers))


class H2Exchange(Exchange):
    chunked = False  # (HTTP/2 frames its bodies itself: `Terminator.lane_story` asks)

    def __init__(self, connection: H2Connection, stream_id: int, method: str, target: bytes,
                 headers: Headers, authority: bytes | None, content_length: int | None,
                 body_done: bool) -> None:
        # the dataclass fields, set directly (its generated __init__ takes keywords)
        self.method = method
        self.target = target
        self.headers = headers
        self.authority = authority
        self.host = authority  # (what `Terminator.lane_story` reads of a request)
        self.content_length = content_length
        self.body_done = body_done
        self.c = connection
        self.stream_id = stream_id
        self.scope: trio.CancelScope | None = None  # the worker's, while it runs this
        self.stopped = False  # answered before the body was read: DATA is dropped
        # body bytes not taken yet, each with the flow-controlled bytes it owes back
        self._chunks: collections.deque[tuple[bytes | bytearray, int]] = collections.deque()
        self._arrived: trio.Event | None = None  # while the engine waits for body bytes
        self._ended = self.body_done
        self._reset = False  # the client reset the stream
        self._gone: trio.Event | None = None  # for `wait_gone`, made when first asked
        self._unacked = 0
        self.then: _Handle | None = None  # a worker's handle other than the connection's
        self.lane: Any = None  # the lane's stream, while the lane serves it

    # -- fed by the connection's reader -----------------------------------------------

    def _wake(self) -> None:
        if self._arrived is not None:
            self._arrived.set()
            self._arrived = None

    def feed(self, data: bytes, flow_length: int) -> None:
        chunks = self._chunks
        if len(data) >= SHORT_DATA:
            chunks.append((data, flow_length))
        else:  # short payloads gather in one bytearray (see `SHORT_DATA`)
            run, owed = chunks[-1] if chunks else (b"", 0)
            if isinstance(run, bytearray) and len(run) < RUN_BYTES:
                run += data
                chunks[-1] = (run, owed + flow_length)
            else:
                chunks.append((bytearray(data), flow_length))
        self._unacked += flow_length
        self._wake()

    def end_of_body(self) -> None:
        self._ended = True
        self._wake()

    def reset_by_client(self) -> None:
        self._reset = True
        if self._gone is not None:
            self._gone.set()
        self._wake()
        if self.scope is not None:
            self.scope.cancel()
        if self.lane is not None:
            self.lane.abort()

    def release(self) -> None:
        """The exchange ended: hand back the window of DATA nobody took."""
        if self._unacked:
            self.c.conn.acknowledge(self._unacked, self.stream_id)
            self._unacked = 0
        self._chunks.clear()
        if self.c.conn.is_open(self.stream_id):  # ended without a complete response
            self._rst(ErrorCode.CANCEL)

    # -- the engine's side --------------------------------------------------------------

    async def receive(self, deadline: float) -> bytes:
        while True:
            if self._chunks:
                data, flow_length = self._chunks.popleft()
                self._unacked -= flow_length
                self.c.conn.acknowledge(flow_length, self.stream_id)
                self.c.kick()  # a WINDOW_UPDATE, when one is due
                if data:
                    return data if type(data) is bytes else bytes(data)
                continue
            if self._reset:
                raise ClientGone("client reset the stream")
            if self._ended:
                self.body_done = True
                return b""
            arrived = self._arrived = trio.Event()
            with trio.move_on_at(deadline):
                await arrived.wait()
                continue
            raise ClientGone("request body not complete in time")

    async def respond(self, status: int, headers: Headers) -> None:
        self._live()
        block = _sendable_block(self.c.conn, status, headers)
        try:
            self.c.conn.send_headers(self.stream_id, block)
        except h2_frames.StreamClosed as exc:
            raise ClientGone("stream or connection closed") from exc
        self.c.kick()

    async def send(self, chunk: bytes) -> None:
        conn = self.c.conn
        n = len(chunk)
        if not self._reset and not self.c._broken:
            try:
                window = conn.local_flow_control_window(self.stream_id)
            except h2_frames.StreamClosed as exc:
                raise ClientGone("stream closed") from exc
            if 0 < n <= window and n <= conn.max_outbound_frame_size and (
                    len(conn.out) + n < FLUSH_BYTES):
                # the usual case: the whole chunk in one DATA frame, nothing to wait for
                conn.send_data(self.stream_id, chunk)
                self.c._guard.credit(WINDOW_UPDATE, n / WINDOW_CREDIT_BYTES)
                self.c.kick()
                return
        view = memoryview(chunk)
        deadline = trio.current_time() + self.c.write_timeout
        while view:
            self._live()
            try:
                window = min(self.c.conn.local_flow_control_window(self.stream_id),
                             self.c.conn.max_outbound_frame_size)
            except h2_frames.StreamClosed as exc:
                raise ClientGone("stream closed") from exc
            if window <= 0:
                await self.c.wait_window(deadline)
                continue
            piece = chunk if window >= len(view) == len(chunk) else bytes(view[:window])
            try:
                self.c.conn.send_data(self.stream_id, piece)
            except h2_frames.StreamClosed as exc:
                raise ClientGone("stream closed") from exc
            self.c._guard.credit(WINDOW_UPDATE, len(piece) / WINDOW_CREDIT_BYTES)
            view = view[window:]
            self.c.kick()
            if len(self.c.conn.out) >= FLUSH_BYTES:
                with trio.move_on_at(deadline):
                    await self.c._wait_room()
                    continue
                raise ClientGone("client did not read in time")

    async def respond_whole(self, status: int, headers: Headers, body: bytes) -> None:
        """The whole answer queued at once and, when the writer is idle, sent by this
        task (`_send_now`): no wake-up of the writer per answer. An answer that has to
        wait (for the window, or for the writer to take the outbox) goes the long way."""
        if not self.respond_whole_now(status, headers, body):
            await super().respond_whole(status, headers, body)

    def respond_whole_now(self, status: int, headers: Headers, body: bytes) -> bool:
        """`respond_whole` when nothing has to wait: False (nothing queued) when the
        client's window or the outbox cannot take the answer now."""
        c = self.c
        conn = c.conn
        n = len(body)
        self._live()
        try:
            if n and (n > conn.local_flow_control_window(self.stream_id)
                      or n > conn.max_outbound_frame_size or len(conn.out) + n >= FLUSH_BYTES):
                return False
            conn.send_headers(self.stream_id, _sendable_block(conn, status, headers),
                              end_stream=not n)
            if n:
                conn.send_data(self.stream_id, body, end_stream=True)
        except h2_frames.StreamClosed as exc:
            raise ClientGone("stream or connection closed") from exc
        if n:
            c._guard.credit(WINDOW_UPDATE, n / WINDOW_CREDIT_BYTES)
        if self.stopped and not self._ended:
            self._rst(ErrorCode.NO_ERROR)
        c._send_now()
        return True

    async def end(self) -> None:
        self._live()
        try:
            self.c.conn.end_stream(self.stream_id)
        except h2_frames.StreamClosed as exc:
            raise ClientGone("stream closed") from exc
        if self.stopped and not self._ended:
            self._rst(ErrorCode.NO_ERROR)
        self.c.kick()

    async def abort(self) -> None:
        self.reset(ErrorCode.INTERNAL_ERROR)

    def reset(self, code: int) -> None:
        """End the stream with RST_STREAM(`code`) now (nothing if it is closed already)."""
        self._rst(code)
        self.c.kick()

    async def wait_gone(self) -> None:
        if self._reset:
            return
        if self._gone is None:
            self._gone = trio.Event()
        await self._gone.wait()

    def needs_watch(self, response_headers: Headers) -> bool:
        return False  # a reset cancels the exchange's own scope (`reset_by_client`)

    def stop_body(self) -> None:
        if not self._ended:
            self.stopped = True
            if self._unacked:
                self.c.conn.acknowledge(self._unacked, self.stream_id)
                self._unacked = 0
            self._chunks.clear()

    def _live(self) -> None:
        if self._reset:
            raise ClientGone("client reset the stream")
        if self.c._broken:
            raise ClientGone("client connection broke")

    def _rst(self, code: int) -> None:
        self.c.conn.reset_stream(self.stream_id, code)  # nothing when already closed
