"""The HTTP/1.1 client leg of the terminate engine: h11 driven by one task per connection.

Theory of operation
-------------------
h11 is the state machine (strict parsing, framing, keep-alive rules); this module only
moves bytes and runs deadlines. One task owns the connection and serves its requests
one after another as `Exchange` objects handed to the engine's `handle`.

Deadlines, all absolute: waiting for the next request (keep-alive) is bounded by the
route's `idle_timeout`; once the first byte of a head arrived the whole head must follow
within `head_timeout` (else 408); body reads take the deadline the engine gives; every
write must be taken by the client within `write_timeout`. The head is at most
`MAX_HEAD_BYTES` (431 beyond).

Pipelining: while a response streams, the connection keeps reading (up to
`MAX_PIPELINED_BYTES`, handed to h11 to parse later) so that a client that pipelined
its next request and then went away is noticed at once, and its exchange ends instead
of waiting for a read nobody will ever satisfy.

Before h11 frames a head, the raw head is checked (`proto.http_request.framing_problem`)
for the ambiguities h11 tolerates but a node behind us might read differently
(`Content-Length` with `Transfer-Encoding`, folded lines): those get 400 and a close.

An answer given before the request body was read (`stop_body`) carries
`Connection: close`; the rest of the upload is then read and dropped for at most
`DRAIN_SECONDS` / `DRAIN_MAX_BYTES` so that closing does not reset the connection under
the answer before the client has read it.
"""

from __future__ import annotations

import http
from collections.abc import Awaitable, Callable

import h11
import trio

from pact_ingress.net.http_exchange import BadResponse, ClientGone, Exchange, Headers
from pact_ingress.proto.http_request import framing_problem, header

#: A request head larger than this is refused with 431; MCP and browser heads are a few
#: KiB, and every connection may hold one incomplete head in memory.
MAX_HEAD_BYTES = 16 * 1024
#: Bytes asked of the TLS stream per read.
READ_SIZE = 64 * 1024
#: Read ahead while a response streams: enough to see the close behind a pipelined
#: request, little enough that a pipelining client cannot make us buffer much.
MAX_PIPELINED_BYTES = 64 * 1024
#: After an early answer, how long and how much of the rest of the upload is discarded:
#: enough for a polite client's in-flight window to land before we close (so the close
#: does not reset the answer away), little enough that refusing a flood of large bodies
#: does not cost us reading (and decrypting) them anyway.
DRAIN_SECONDS = 1.0
DRAIN_MAX_BYTES = 256 * 1024


def reason(status: int) -> bytes:
    try:
        return http.HTTPStatus(status).phrase.encode("ascii")
    except ValueError:
        return b"Unknown"


class H1Connection:
    def __init__(self, stream: trio.abc.Stream, *, idle_timeout: float, head_timeout: float,
                 write_timeout: float, idle_scopes: set[trio.CancelScope]) -> None:
        self.stream = stream
        self.conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
        self.idle_timeout = idle_timeout
        self.head_timeout = head_timeout
        self.write_timeout = write_timeout
        self._idle_scopes = idle_scopes  # cancelled by a drain: idle connections close

    async def serve(self, handle: Callable[[Exchange], Awaitable[None]]) -> None:
        while True:
            exchange = await self._next_exchange()
            if exchange is None:
                return
            await handle(exchange)
            if exchange.stopped_early and not exchange.broken:
                await self._drain()
                return
            if exchange.broken or not self._finish_cycle():
                return

    def _finish_cycle(self) -> bool:
        """Start the next request/response cycle if both sides completed this one."""
        try:
            if self.conn.their_state is h11.SEND_BODY:
                self.conn.next_event()  # the EndOfMessage of a body-less request
            if self.conn.our_state is h11.DONE and self.conn.their_state is h11.DONE:
                self.conn.start_next_cycle()
                return True
        except h11.ProtocolError:
            pass
        return False

    # -- reading ----------------------------------------------------------------------

    async def read(self, deadline: float) -> bytes | None:
        """Bytes from the client, b"" at its close, None when `deadline` passed."""
        with trio.move_on_at(deadline):
            try:
                return await self.stream.receive_some(READ_SIZE)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return b""
        return None

    async def _next_exchange(self) -> H1Exchange | None:
        idle_deadline = trio.current_time() + self.idle_timeout
        head_deadline: float | None = None
        while True:
            pending = self.conn.trailing_data[0]
            end = pending.find(b"\r\n\r\n")
            problem = framing_problem(pending[:end]) if end >= 0 else None
            if problem is not None:
                await self._refuse_head(400, problem)
                return None
            try:
                event = self.conn.next_event()
            except h11.RemoteProtocolError as exc:
                await self._refuse_head(exc.error_status_hint, str(exc))
                return None
            if isinstance(event, h11.Request):
                return self._exchange(event)
            if event is not h11.NEED_DATA:  # ConnectionClosed, or PAUSED after a close
                return None
            if pending.strip(b"\r\n") and head_deadline is None:
                head_deadline = trio.current_time() + self.head_timeout
            if head_deadline is None:
                data = await self._idle_read(idle_deadline)
            else:
                data = await self.read(head_deadline)
            if data is None:
                if head_deadline is not None:
                    await self._refuse_head(408, "request head not complete in time")
                return None
            self.conn.receive_data(data)

    async def _idle_read(self, deadline: float) -> bytes | None:
        """A read between requests: a drain closes the connection here (None)."""
        with trio.CancelScope() as scope:
            self._idle_scopes.add(scope)
            try:
                return await self.read(deadline)
            finally:
                self._idle_scopes.discard(scope)
        return None

    def _exchange(self, request: h11.Request) -> H1Exchange:
        headers: Headers = [(bytes(k), bytes(v)) for k, v in request.headers]
        declared = header(headers, b"content-length")
        length = int(declared) if declared is not None else None
        chunked = header(headers, b"transfer-encoding") is not None
        return H1Exchange(
            method=request.method.decode("ascii"), target=bytes(request.target),
            headers=headers, authority=header(headers, b"host"), content_length=length,
            body_done=not chunked and not length, connection=self,
        )

    async def _refuse_head(self, status: int, why: str) -> None:
        """Answer a head we will not serve, then close."""
        if self.conn.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            return
        body = f"{why}\n".encode()
        try:
            data = self.conn.send(h11.Response(
                status_code=status, reason=reason(status),
                headers=[(b"content-type", b"text/plain; charset=utf-8"),
                         (b"content-length", str(len(body)).encode()),
                         (b"connection", b"close")]))
            data += self.conn.send(h11.Data(data=body)) + self.conn.send(h11.EndOfMessage())
        except h11.LocalProtocolError:
            return
        await self.write(data)

    async def _drain(self) -> None:
        left = DRAIN_MAX_BYTES
        deadline = trio.current_time() + DRAIN_SECONDS
        while left > 0:
            data = await self.read(deadline)
            if not data:
                return
            left -= len(data)

    # -- writing ----------------------------------------------------------------------

    async def write(self, data: bytes) -> None:
        with trio.move_on_after(self.write_timeout):
            try:
                await self.stream.send_all(data)
                return
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                raise ClientGone("client connection broke") from exc
        raise ClientGone("client did not read the response in time")


class H1Exchange(Exchange):
    def __init__(self, *, connection: H1Connection, **fields: object) -> None:
        super().__init__(**fields)  # type: ignore[arg-type]
        self.c = connection
        self.stopped_early = False
        self.broken = False

    async def receive(self, deadline: float) -> bytes:
        conn = self.c.conn
        while not self.body_done:
            if conn.they_are_waiting_for_100_continue:
                await self.c.write(conn.send(h11.InformationalResponse(
                    status_code=100, headers=[], reason=b"Continue")))
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError as exc:
                self.broken = True
                raise ClientGone(f"request body broke HTTP/1.1 framing: {exc}") from exc
            if isinstance(event, h11.Data):
                if event.data:
                    return bytes(event.data)
            elif isinstance(event, h11.EndOfMessage):
                self.body_done = True
            elif event is h11.NEED_DATA:
                data = await self.c.read(deadline)
                if data is None:
                    self.broken = True
                    raise ClientGone("request body not complete in time")
                conn.receive_data(data)
            else:
                self.broken = True
                raise ClientGone("client closed the connection mid-body")
        return b""

    async def respond(self, status: int, headers: Headers) -> None:
        if self.stopped_early:
            headers = [*headers, (b"connection", b"close")]
        try:
            data = self.c.conn.send(h11.Response(status_code=status, headers=headers,
                                                 reason=reason(status)))
        except h11.LocalProtocolError as exc:
            raise BadResponse(str(exc)) from exc
        await self._write(data)

    async def send(self, chunk: bytes) -> None:
        await self._write(self.c.conn.send(h11.Data(data=chunk)))

    async def end(self) -> None:
        await self._write(self.c.conn.send(h11.EndOfMessage()))

    async def abort(self) -> None:
        self.broken = True  # the connection is dropped: the client sees a truncated body

    async def _write(self, data: bytes | None) -> None:
        try:
            await self.c.write(data or b"")
        except ClientGone:
            self.broken = True
            raise

    async def wait_gone(self) -> None:
        if not self.body_done:
            await trio.sleep_forever()  # the body reader notices a close itself
        conn = self.c.conn
        while len(conn.trailing_data[0]) < MAX_PIPELINED_BYTES:
            try:
                data = await self.c.stream.receive_some(READ_SIZE)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                data = b""
            if not data:
                self.broken = True
                return
            conn.receive_data(data)
        await trio.sleep_forever()  # enough read ahead; the write deadline still applies

    def needs_watch(self, response_headers: Headers) -> bool:
        """A response of declared length is relayed as fast as the node sends it, and a
        gone client fails the next write; a stream (SSE, chunked) may sit idle for a
        long time, so only then is the connection read for the client's close."""
        return header(response_headers, b"content-length") is None

    def stop_body(self) -> None:
        if not self.body_done:
            self.stopped_early = True
