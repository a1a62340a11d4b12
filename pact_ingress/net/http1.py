"""The HTTP/1.1 client leg of the terminate engine: `proto.http1_server` driven by one task
per connection.

Theory of operation
-------------------
`H1ServerParser` (llhttp) is the state machine: strict parsing and framing, events out;
this module only moves bytes and runs deadlines. One task owns the connection and serves
its requests one after another as `Exchange` objects handed to the engine's `handle`.

Deadlines, all absolute: waiting for the next request (keep-alive) is bounded by the
route's `idle_timeout`; once the first byte of a head arrived the whole head must follow
within `head_timeout` (else 408); body reads take the deadline the engine gives; every
write must be taken by the client within `write_timeout`.

Pipelining: while a response streams, the connection keeps reading (up to
`MAX_PIPELINED_BYTES` not yet served, for the connection, however many answers stream
before the request loop reaches them, each read counting at least
`MIN_READ_AHEAD_CHARGE`; parsed and queued as events for later) so that a
client that pipelined its next request and then went away is noticed at once, and its
exchange ends instead of waiting for a read nobody will ever satisfy.

Closing: when the client may still be sending (the rest of an upload an early answer
refused, what follows a head we refused, bytes waiting unread: a request pipelined
behind the last answer), the connection lingers (`net.linger`) before it closes: our
side is shut and what the client sends is read and dropped until the client has
acknowledged everything sent, for at most `LINGER_SECONDS` / `LINGER_BYTES`. A client
that sent nothing more is closed at once: it sends nothing before it has all of ours.
Closed with the client's bytes unread, the socket would be reset, and the reset throws
away what our kernel has not delivered yet: the tail of the last answer, for a client
that reads slowly. An answer given before the
request body was read (`stop_body`) carries `Connection: close`.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable

import trio

from pact_ingress.net import deadlines, readiness
from pact_ingress.net.http_exchange import ClientGone, Exchange, Headers, send_to_client
from pact_ingress.net.linger import linger, unread
from pact_ingress.net.memory_tls import ServerStream
from pact_ingress.proto.http1_server import (
    CONTINUE,
    END_OF_MESSAGE,
    LAST_CHUNK,
    NEED_DATA,
    Data,
    Framing,
    H1ServerParser,
    ParseError,
    Request,
    chunk,
    response_framing,
    response_head,
    whole_response,
)
from pact_ingress.proto.http_request import header

#: Bytes asked of the TLS stream per read.
READ_SIZE = 64 * 1024
#: Read ahead while a response streams: enough to see the close behind a pipelined
#: request, little enough that a pipelining client cannot make us buffer much.
MAX_PIPELINED_BYTES = 64 * 1024
#: Each read ahead counts as at least this many bytes against `MAX_PIPELINED_BYTES`: a
#: read is a parser event and its objects (~100 bytes), however few bytes it brought, so
#: a client sending a byte or two per TLS record would otherwise have the budget hold
#: some fifty times its bytes.
MIN_READ_AHEAD_CHARGE = 1024
#: Before a close, at most how long and how much of what the client still sends is read
#: and dropped while it has not acknowledged all we sent (`net.linger`): long enough for
#: a slow reader to take a large last answer, little enough that refusing a flood of
#: large bodies does not cost us reading them anyway (they are not decrypted).
LINGER_SECONDS = 5.0
LINGER_BYTES = 256 * 1024
#: Without a socket of ours to shut and ask (another transport), the rest of an upload
#: refused early is read, and decrypted, for this long at most instead: enough for a
#: polite client's in-flight window to land before the close.
DRAIN_SECONDS = 1.0
#: The answer to a client whose answer the node broke off before any of it was sent.
BROKE_OFF = b"the home node broke off its answer\n"
_TEXT = (b"content-type", b"text/plain; charset=utf-8")
#: Requests served back to back without the connection ever waiting (a client that
#: pipelines, answered at the edge) before it yields to the other connections once.
FAIR_SHARE = 16


class _MustWait(Exception):
    """The connection has to wait for its next request: `serve` enters its scope."""


class H1Connection:
    def __init__(self, stream: trio.abc.Stream, *, idle_timeout: float, head_timeout: float,
                 write_timeout: float, idle_scopes: set[trio.CancelScope],
                 draining: trio.Event | None = None, parser: H1ServerParser | None = None,
                 deferred: ParseError | None = None) -> None:
        self.stream = stream
        # (a connection the keep-alive lane served so far comes with its parser)
        self.parser = H1ServerParser() if parser is None else parser
        self.idle_timeout = idle_timeout
        self.head_timeout = head_timeout
        self.write_timeout = write_timeout
        self.deferred = deferred  # a bad pipelined head, read ahead
        # bytes read ahead while answers streamed, not yet reached by the request loop:
        # one budget for the connection, not one per answer, or a client pipelining
        # behind streamed answers has every answer read another share into the queue
        self.read_ahead = 0
        self._idle_scopes = idle_scopes  # cancelled by a drain: idle connections close
        # set by a drain: a keep-alive connection that becomes idle after it began
        # closes too (the drain cancelled only the scopes of those idle at that moment);
        # a new one still gets its first request, which its client sends unasked
        self._draining = draining
        # our own TLS takes deadlines per call; any other stream gets a scope per read
        self._tls = stream if isinstance(stream, ServerStream) else None
        self._idle: trio.CancelScope | None = None  # entered by `serve` once needed
        self._answered = False  # a request was answered on this connection
        self._broken = False  # an exchange broke the connection: it closes at once
        #: The client may still be sending what we will not read: the rest of an upload
        #: answered early, or whatever follows a head we refused.
        self._talking = False
        self._now = deadlines.clock()
        self._sweeper: deadlines.Sweeper | None = None  # this run's, at the first wait
        self._first: tuple[Request, Callable[[Exchange], Awaitable[None]]] | None = None

    async def serve(self, handle: Callable[[Exchange], Awaitable[None]],
                    first: tuple[Request, Callable[[Exchange], Awaitable[None]]] | None = None
                    ) -> None:
        """Serve the connection's requests with `handle` until it ends. `first`: a
        request the keep-alive lane read whole (its body taken from the parser) and
        began to serve, with what finishes it; it is served before the rest."""
        self._first = first
        # One scope for the connection's life, armed (idle deadline with the sweeper,
        # drain) only while it waits between requests: cheaper than a new scope per
        # wait. When it fires, the connection ends: what an idle timeout or a drain means.
        # It is entered only when the connection first has to wait for a request: one
        # whose requests were all there already (a new connection's single request,
        # which came with the handshake) never pays for a scope.
        if self._tls is not None:
            try:
                await self._serve(handle)
            except _MustWait:
                pass  # nothing half-read: serving starts again inside the scope
            else:
                await self._linger()
                return
        with trio.CancelScope() as self._idle:
            await self._serve(handle)
        await self._linger()  # outside the idle scope, which may be cancelled

    async def _serve(self, handle: Callable[[Exchange], Awaitable[None]]) -> None:
        served = 0
        while True:
            first, self._first = self._first, None
            if first is not None:
                exchange = H1Exchange(self, first[0], True)
                await first[1](exchange)
            else:
                exchange = await self._next_exchange()
                if exchange is None:
                    return
                await handle(exchange)
            if exchange.broken:
                self._broken = True  # nothing more is sent: there is no answer to protect
                return
            if exchange.stopped_early:
                self._talking = True  # the rest of the upload is still coming
                return
            if not exchange.reusable():
                return
            self._answered = True
            served += 1
            if served % FAIR_SHARE == 0:
                # reads and writes that need no wait do not yield: a client whose
                # pipelined requests are all answered at the edge must still let the
                # other connections run
                await trio.lowlevel.checkpoint()

    # -- reading ----------------------------------------------------------------------

    async def read(self, deadline: float) -> bytes | None:
        """Bytes from the client, b"" at its close, None when `deadline` passed."""
        tls = self._tls
        if tls is not None:
            try:
                return await tls.receive_by(READ_SIZE, deadline)
            except trio.TooSlowError:
                return None
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return b""
        with trio.move_on_at(deadline):
            try:
                return await self.stream.receive_some(READ_SIZE)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return b""
        return None

    async def _next_exchange(self) -> H1Exchange | None:
        idle_deadline = self._now() + self.idle_timeout
        head_deadline: float | None = None
        parser = self.parser
        while True:
            event = parser.next_event()
            if isinstance(event, Request):
                return self._exchange(event)
            if event is not NEED_DATA:
                return None  # leftovers of a body nobody read: the connection is done
            self.read_ahead = 0  # all that was read ahead is served
            if self.deferred is not None:
                await self._refuse_head(self.deferred)
                return None
            if parser.closed:
                return None
            if parser.in_head and head_deadline is None:
                head_deadline = trio.current_time() + self.head_timeout
            if head_deadline is None:
                data = await self._idle_read(idle_deadline)
            else:
                data = await self.read(head_deadline)
            if data is None:
                if head_deadline is not None:
                    await self._refuse_head(ParseError(408, "request head not complete in time"))
                return None
            try:
                parser.feed(data)
            except ParseError as exc:
                self.deferred = exc  # events parsed before the error are served first

    def draining(self) -> bool:
        """The process is draining: a response says `Connection: close` (the client
        then knows not to send another request on a connection about to close)."""
        return self._draining is not None and self._draining.is_set()

    async def _idle_read(self, deadline: float) -> bytes | None:
        """A read between requests: a drain closes the connection here (None). What is
        already decrypted or buffered is taken at once; otherwise the connection waits
        (a client that waits for each response cannot have sent more yet) under its
        idle scope, armed for the idle deadline and the drain."""
        tls = self._tls
        if tls is not None:
            try:
                data = tls.read_buffered(READ_SIZE)
            except trio.BrokenResourceError:
                return b""
            if data is not None:
                return data
            if self._answered and self._draining is not None and self._draining.is_set():
                return None
            idle = self._idle
            if idle is None:
                raise _MustWait()
            sweeper = self._sweeper
            if sweeper is None:
                sweeper = self._sweeper = deadlines.sweeper()
            arm = sweeper.arm(deadline, scope=idle)
            self._idle_scopes.add(idle)
            try:
                # the first request often follows the handshake at once; later ones are
                # sent only after the client read our last answer
                if tls._closed:
                    raise trio.ClosedResourceError()
                data = await tls.read(READ_SIZE, math.inf, self._answered)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                data = b""
            finally:
                self._idle_scopes.discard(idle)
                sweeper.disarm(arm)
            # the deadline or a drain may have fired as the bytes arrived: it stands
            return None if idle.cancel_called else data
        if self._answered and self._draining is not None and self._draining.is_set():
            return None
        with trio.CancelScope(deadline=deadline) as scope:
            self._idle_scopes.add(scope)
            try:
                return await self.read(math.inf)
            finally:
                self._idle_scopes.discard(scope)
        return None

    def _exchange(self, request: Request) -> H1Exchange:
        body_done = not request.chunked and not request.content_length
        if body_done and self.parser.next_event() is not END_OF_MESSAGE:
            raise AssertionError("llhttp completes a body-less message with its head")
        return H1Exchange(self, request, body_done)

    async def _refuse_head(self, error: ParseError) -> None:
        """Answer a head we will not serve, then close."""
        body = f"{error.why}\n".encode()
        head = response_head(error.status, [(b"content-type", b"text/plain; charset=utf-8"),
                                            (b"content-length", str(len(body)).encode())],
                             Framing.LENGTH, close=True)
        self._talking = True  # what follows a refused head is never read
        try:
            await self.write(head + body)
        except ClientGone:
            self._broken = True

    async def _linger(self) -> None:
        """Before the close (see the module docstring): nothing when the client closed
        first or the connection broke, nor when it sent nothing we have not read and is
        not expected to (a polite client waiting for its answer, then our close: no
        byte of its can meet the closed socket before it has all of ours)."""
        if self._broken or self.parser.closed:
            return
        sock = getattr(self._tls, "socket", None)
        if sock is not None:
            if self._talking or unread(sock.fileno()):
                await linger(sock, LINGER_SECONDS, LINGER_BYTES)
        elif self._talking:
            # no socket of ours to shut or ask: the rest of the upload is read (and
            # decrypted) for a moment, so that the close does not reset the answer away
            left = LINGER_BYTES
            deadline = trio.current_time() + DRAIN_SECONDS
            while left > 0:
                data = await self.read(deadline)
                if not data:
                    return
                left -= len(data)

    # -- writing ----------------------------------------------------------------------

    async def write(self, data: bytes) -> None:
        tls = self._tls
        if tls is None:
            await send_to_client(self.stream, data, self.write_timeout)
            return
        # `send_to_client` on our own TLS, inline: every response is written here
        try:
            if tls._closed:
                raise trio.ClosedResourceError()
            await tls.write(data, self._now() + self.write_timeout)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise ClientGone("client connection broke") from exc
        except trio.TooSlowError:
            raise ClientGone("client did not read in time") from None


class H1Exchange(Exchange):
    def __init__(self, connection: H1Connection, request: Request, body_done: bool) -> None:
        # the fields of `Exchange`, set here directly: one exchange per request
        self.method = request.method
        self.target = request.target
        self.headers = request.headers
        self.authority = request.host
        self.content_length = request.content_length
        self.body_done = body_done
        self.c = connection
        self.request = request
        self.stopped_early = False
        self.broken = False
        self._continued = False
        self._framing: Framing | None = None
        self._complete = False
        self._pending = b""  # a response head not written yet
        self._close = False  # the response said `Connection: close`

    def reusable(self) -> bool:
        return (self._complete and self.body_done and not self._close
                and self._framing is not Framing.CLOSE)

    async def receive(self, deadline: float) -> bytes:
        parser = self.c.parser
        while not self.body_done:
            event = parser.next_event()
            if isinstance(event, Data):
                if event.data:
                    return event.data
            elif event is END_OF_MESSAGE:
                self.body_done = True
            elif event is NEED_DATA:
                if self.request.expects_continue and not self._continued:
                    self._continued = True
                    await self.c.write(CONTINUE)
                data = await self.c.read(deadline)
                if data is None:
                    self.broken = True
                    raise ClientGone("request body not complete in time")
                try:
                    parser.feed(data)
                except ParseError as exc:
                    self.broken = True
                    raise ClientGone(f"request body broke HTTP/1.1 framing: {exc.why}") from exc
            else:
                self.broken = True
                raise ClientGone("request body framing lost")
        return b""

    async def respond(self, status: int, headers: Headers) -> None:
        """A response of declared length (or none) waits for its first body bytes, so
        head and body leave in one write; a stream's head goes out at once (an SSE
        client waits for it before the first event)."""
        self._framing = response_framing(self.method, self.request.http_version, status,
                                         headers)
        close = self._close = (self.stopped_early or not self.request.keep_alive
                               or self.c.draining())
        self._pending = response_head(status, headers, self._framing, close=close)
        if self._framing in (Framing.CHUNKED, Framing.CLOSE):
            await self._write_pending(b"")

    async def respond_whole(self, status: int, headers: Headers, body: bytes) -> None:
        """The whole response in one write."""
        request = self.request
        close = self._close = (self.stopped_early or not request.keep_alive
                               or self.c.draining())
        data, self._framing = whole_response(self.method, request.http_version, status,
                                             headers, body, close=close)
        await self._write(data)
        self._complete = True

    async def send(self, data: bytes) -> None:
        if self._framing is Framing.CHUNKED:
            await self._write_pending(chunk(data))
        elif self._framing is not Framing.NONE:
            await self._write_pending(data)

    async def end(self) -> None:
        await self._write_pending(LAST_CHUNK if self._framing is Framing.CHUNKED else b"")
        self._complete = True

    async def _write_pending(self, data: bytes) -> None:
        if self._pending:
            data, self._pending = self._pending + data, b""
        if data:
            await self._write(data)

    async def abort(self) -> None:
        if self._pending:
            # nothing of the answer went out yet (a head with a length waits for the
            # first body bytes): the client can still be told, rather than see a silent
            # close it may take for a dead keep-alive connection and send again on
            self._pending = b""
            self._close = True
            self._complete = True
            self._framing = Framing.LENGTH
            head = response_head(502, [_TEXT, (b"content-length", b"%d" % len(BROKE_OFF))],
                                 Framing.LENGTH, close=True)
            try:
                await self._write(head + BROKE_OFF)
            except ClientGone:
                pass  # (`_write` marked the connection broken)
            return
        self.broken = True  # the connection is dropped: the client sees a truncated body

    async def _write(self, data: bytes) -> None:
        try:
            await self.c.write(data)
        except ClientGone:
            self.broken = True
            raise

    def reset_watch(self) -> readiness.Watch | None:
        # (while the node is asked, nothing reads this connection: the body reader only
        # as the node takes the body, the read-ahead only while an answer streams)
        tls = self.c._tls
        watch = tls.joined() if tls is not None else None
        if watch is not None:
            watch.on_fin = tls.send_held_nowait  # type: ignore[union-attr]
        return watch

    def connection_scope(self) -> trio.CancelScope | None:
        return self.c._idle

    def needs_watch(self, response_headers: Headers) -> bool:
        """A response of declared length is relayed as fast as the node sends it, and a
        gone client fails the next write; a stream (SSE, chunked) may sit idle for a
        long time, so only then is the connection read for the client's close."""
        return header(response_headers, b"content-length") is None

    async def wait_gone(self) -> None:
        if not self.body_done:
            await trio.sleep_forever()  # the body reader notices a close itself
        c = self.c
        while c.read_ahead < MAX_PIPELINED_BYTES and c.deferred is None:
            try:
                data = await self.c.stream.receive_some(READ_SIZE)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                data = b""
            if not data:
                self.broken = True
                return
            c.read_ahead += max(len(data), MIN_READ_AHEAD_CHARGE)
            try:
                self.c.parser.feed(data)
            except ParseError as exc:
                self.c.deferred = exc
        await trio.sleep_forever()  # enough read ahead; the write deadline still applies

    def stop_body(self) -> None:
        if not self.body_done:
            self.stopped_early = True
