"""The HTTP/2 client leg of the terminate engine: h2 driven by one reader task.

Theory of operation
-------------------
h2 is the state machine; this module moves bytes. One task reads the connection and
feeds h2; every event is dispatched *in order* before the next read, so a DATA frame
that arrived in the same read as its HEADERS finds its stream already created (the
stream exists from `RequestReceived` on). Each request runs as its own task (the engine's
`handle`) inside the connection's nursery; when the connection ends, they all end.

Request bodies are flow controlled end to end: DATA is queued on its stream and
acknowledged to h2 (so WINDOW_UPDATE goes out) only when the engine *takes* it, so a
stream buffers at most one window (`INITIAL_WINDOW_SIZE`) and the connection at most the
connection window, whatever the client sends. DATA for a stream that was answered early
or ended is acknowledged at once, so the connection window never leaks.

Writes are batched: h2 queues frames in its outbound buffer, and they leave in as few
socket writes as the connection allows. The reader flushes once per batch of events it
dispatched (one write answers every PING, SETTINGS and WINDOW_UPDATE of a read). A
stream's response head, its small DATA, its END_STREAM and its RST only *queue* frames and
wake the connection's writer task, which sends whatever has accumulated when it runs: a
1 KiB answer leaves as one TLS record in one `send`, and the answers of several streams
that finish together share one. Large DATA (over `FLUSH_BYTES` queued) is flushed by the
stream itself, so a stream that produces faster than the client takes waits (back-pressure
through the socket, on top of h2's flow control). One lock orders every write; each write
must be taken by the client within `write_timeout`, else the connection is dropped (a
client that stops reading must not hold a node's response, or our buffers, for ever;
and a TLS record cut off mid-write leaves nothing to resume). Response DATA waits for the
client's flow-control window with the same deadline.

A stream reset by the client cancels its task at once (and with it the upstream request).
Frames that cost a client nothing and us something (RST_STREAM, PING, SETTINGS,
PRIORITY, empty DATA) are metered per connection (`proto.h2_guard`): a flood ends the
connection with GOAWAY(ENHANCE_YOUR_CALM). Zero-window stalls end at the write deadline.
An answer given before the body was read ends the stream with `RST_STREAM(NO_ERROR)`
after the complete response (RFC 9113 §8.1). A drain sends GOAWAY; open streams finish.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Awaitable, Callable

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
import trio

from pact_ingress.logs import log
from pact_ingress.net.http_exchange import (
    BadResponse, ClientGone, Exchange, Headers, send_to_client,
)
from pact_ingress.proto.h2_guard import Flood, FloodGuard
from pact_ingress.proto.http_request import header

#: Streams one client connection may have open at once (RFC 9113 suggests ≥ 100).
MAX_CONCURRENT_STREAMS = 100
#: Largest header list accepted, as for HTTP/1.1 heads.
MAX_HEADER_LIST_SIZE = 16 * 1024
#: Bytes asked of the TLS stream per read.
READ_SIZE = 64 * 1024
#: Response DATA queued in h2 beyond which the sending stream writes it out itself and
#: waits for the socket: below it, the writer task batches (one TLS record can carry
#: 16 KiB; four of them is one large `send`).
FLUSH_BYTES = 64 * 1024

_Handle = Callable[[Exchange], Awaitable[None]]


class H2Connection:
    def __init__(self, stream: trio.abc.Stream, *, idle_timeout: float, write_timeout: float,
                 idle_scopes: set[trio.CancelScope], draining: trio.Event,
                 on_flood: Callable[[Flood], None] = lambda kind: None) -> None:
        self.stream = stream
        config = h2.config.H2Configuration(client_side=False, header_encoding=None)
        self.conn = h2.connection.H2Connection(config)
        self.idle_timeout = idle_timeout
        self.write_timeout = write_timeout
        self.streams: dict[int, H2Exchange] = {}
        self._idle_scopes = idle_scopes
        self._draining = draining
        self._send_lock = trio.Lock()
        self._window = trio.Event()  # set (and replaced) whenever send windows may grow
        self._goaway = False
        self._guard = FloodGuard()
        self._flooded: Flood | None = None
        self.on_flood: Callable[[Flood], None] = on_flood
        self._queued = 0  # DATA bytes handed to h2 since the last write took its buffer
        self._broken = False  # a write failed or timed out: nothing more can be sent
        self._dirty = False  # frames are queued that the writer has not been woken for
        self._writer: trio.lowlevel.Task | None = None  # the writer task, while parked
        self._scope = trio.CancelScope()  # the connection's: a failed write cancels it

    async def serve(self, handle: _Handle) -> None:
        self.conn.local_settings = h2.settings.Settings(client=False, initial_values={
            h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: MAX_CONCURRENT_STREAMS,
            h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: MAX_HEADER_LIST_SIZE,
            h2.settings.SettingCodes.ENABLE_PUSH: 0,
        })
        self.conn.initiate_connection()
        with self._scope:
            async with trio.open_nursery() as nursery:
                try:
                    await self.flush()
                    nursery.start_soon(self._on_drain)
                    nursery.start_soon(self._write_loop)
                    await self._read_loop(handle, nursery)
                except ClientGone:
                    pass
                finally:
                    nursery.cancel_scope.cancel()

    async def _on_drain(self) -> None:
        await self._draining.wait()
        self._goaway = True
        self.conn.close_connection()
        await self.flush()

    async def _read_loop(self, handle: _Handle, nursery: trio.Nursery) -> None:
        while not (self._goaway and not self.streams):
            data = await self._read()
            if not data:
                return
            try:
                events = self.conn.receive_data(data)
            except h2.exceptions.ProtocolError as exc:
                code = getattr(exc, "error_code", h2.errors.ErrorCodes.PROTOCOL_ERROR)
                self.conn.close_connection(error_code=code)
                await self.flush()
                return
            for event in events:
                self._dispatch(event, handle, nursery)
            await self.flush()
            if self._flooded is not None:
                return

    async def _read(self) -> bytes:
        """The next bytes; b"" at the client's close or after `idle_timeout` with no stream
        open (a drain ends such an idle wait too)."""
        if self.streams:
            deadline = math.inf
        else:
            deadline = trio.current_time() + self.idle_timeout
        with trio.CancelScope(deadline=deadline) as scope:
            if not self.streams:
                self._idle_scopes.add(scope)
            try:
                return await self.stream.receive_some(READ_SIZE)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return b""
            finally:
                self._idle_scopes.discard(scope)
        return b""

    def _dispatch(self, event: h2.events.Event, handle: _Handle, nursery: trio.Nursery) -> None:
        if isinstance(event, h2.events.RequestReceived):
            exchange = self._exchange(event)
            if exchange is not None:
                self.streams[event.stream_id] = exchange
                nursery.start_soon(self._run, handle, exchange)
        elif isinstance(event, h2.events.DataReceived):
            if not event.data and event.stream_ended is None:
                self._charge(Flood.EMPTY_DATA)
            exchange = self.streams.get(event.stream_id)
            if exchange is None or exchange.stopped:
                self.conn.acknowledge_received_data(event.flow_controlled_length,
                                                    event.stream_id)
            else:
                exchange.feed(event.data, event.flow_controlled_length)
        elif isinstance(event, h2.events.StreamEnded | h2.events.TrailersReceived):
            exchange = self.streams.get(event.stream_id)
            if exchange is not None:
                exchange.end_of_body()
        elif isinstance(event, h2.events.StreamReset):
            if event.remote_reset:
                self._charge(Flood.RESET)
            exchange = self.streams.get(event.stream_id)
            if exchange is not None:
                exchange.reset_by_client()
        elif isinstance(event, h2.events.WindowUpdated | h2.events.RemoteSettingsChanged):
            if isinstance(event, h2.events.RemoteSettingsChanged):
                self._charge(Flood.SETTINGS)
            self._window.set()
            self._window = trio.Event()
        elif isinstance(event, h2.events.PingReceived):
            self._charge(Flood.PING)
        elif isinstance(event, h2.events.PriorityUpdated):
            self._charge(Flood.PRIORITY)
        elif isinstance(event, h2.events.ConnectionTerminated):
            self._goaway = True

    def _charge(self, kind: Flood) -> None:
        if self._flooded is None and not self._guard.charge(kind, trio.current_time()):
            self._flooded = kind
            self.on_flood(kind)
            self.conn.close_connection(error_code=h2.errors.ErrorCodes.ENHANCE_YOUR_CALM)
            self._goaway = True

    def _exchange(self, event: h2.events.RequestReceived) -> H2Exchange | None:
        pseudo: dict[bytes, bytes] = {}
        headers: Headers = []
        for name, value in event.headers or ():
            if name.startswith(b":"):
                pseudo[bytes(name)] = bytes(value)
            else:
                headers.append((bytes(name), bytes(value)))
        declared = header(headers, b"content-length")
        try:
            length = int(declared) if declared is not None else None
        except ValueError:
            self.conn.reset_stream(event.stream_id, h2.errors.ErrorCodes.PROTOCOL_ERROR)
            return None
        authority = pseudo.get(b":authority")
        if authority is None:
            authority = header(headers, b"host")
        return H2Exchange(
            method=pseudo.get(b":method", b"").decode("ascii", "replace"),
            target=pseudo.get(b":path", b""), headers=headers, authority=authority,
            content_length=length, body_done=event.stream_ended is not None,
            connection=self, stream_id=event.stream_id,
        )

    async def _run(self, handle: _Handle, exchange: H2Exchange) -> None:
        try:
            with exchange.scope:
                await handle(exchange)
        except ClientGone:
            pass
        except Exception as exc:
            log.warning("h2_stream_error", error=repr(exc))
        finally:
            del self.streams[exchange.stream_id]
            exchange.release()
            self.kick()

    # -- writing ------------------------------------------------------------------------

    async def flush(self) -> None:
        """Send everything h2 has queued; return once it is written (`ClientGone` if it
        cannot be). Frames queued while a write is under way go out in the next one."""
        if self._broken:
            raise ClientGone("client connection broke")
        lock = self._send_lock
        if lock.locked():  # another task is writing; then take what it left
            async with lock:
                await self._write_queued()
            return
        data = self.conn.data_to_send()
        if not data:
            return
        lock.acquire_nowait()  # free and nothing awaited since: no checkpoint needed
        try:
            await self._write(data)
            await self._write_queued()
        finally:
            lock.release()

    async def _write_queued(self) -> None:
        while data := self.conn.data_to_send():
            await self._write(data)

    async def _write(self, data: bytes) -> None:
        self._queued = 0
        try:
            await send_to_client(self.stream, data, self.write_timeout)
        except ClientGone:
            self._broken = True
            self._scope.cancel()
            raise

    def kick(self) -> None:
        """Frames were queued: have the writer send them soon, without waiting here."""
        self._dirty = True
        task = self._writer
        if task is not None:
            self._writer = None
            trio.lowlevel.reschedule(task)

    async def _write_loop(self) -> None:
        def abort(_: object) -> trio.lowlevel.Abort:
            self._writer = None
            return trio.lowlevel.Abort.SUCCEEDED

        try:
            while True:
                if not self._dirty:
                    self._writer = trio.lowlevel.current_task()
                    await trio.lowlevel.wait_task_rescheduled(abort)
                self._dirty = False
                await self.flush()
        except ClientGone:
            pass

    async def wait_window(self, deadline: float) -> None:
        with trio.move_on_at(deadline):
            await self._window.wait()
            return
        raise ClientGone("client's flow-control window stayed closed")


class H2Exchange(Exchange):
    def __init__(self, *, connection: H2Connection, stream_id: int, **fields: object) -> None:
        super().__init__(**fields)  # type: ignore[arg-type]
        self.c = connection
        self.stream_id = stream_id
        self.scope = trio.CancelScope()
        self.stopped = False  # answered before the body was read: DATA is dropped
        self._chunks: collections.deque[tuple[bytes, int]] = collections.deque()
        self._arrived = trio.Event()
        self._ended = self.body_done
        self._gone = trio.Event()
        self._unacked = 0

    # -- fed by the connection's reader -----------------------------------------------

    def feed(self, data: bytes, flow_length: int) -> None:
        self._chunks.append((data, flow_length))
        self._unacked += flow_length
        self._arrived.set()

    def end_of_body(self) -> None:
        self._ended = True
        self._arrived.set()

    def reset_by_client(self) -> None:
        self._gone.set()
        self._arrived.set()
        self.scope.cancel()

    def release(self) -> None:
        """The exchange ended: hand back the window of DATA nobody took."""
        if self._unacked:
            self.c.conn.acknowledge_received_data(self._unacked, self.stream_id)
            self._unacked = 0
        self._chunks.clear()
        stream = self.c.conn.streams.get(self.stream_id)
        if stream is not None and not stream.closed:  # ended without a complete response
            self._reset(h2.errors.ErrorCodes.CANCEL)

    # -- the engine's side --------------------------------------------------------------

    async def receive(self, deadline: float) -> bytes:
        while True:
            if self._chunks:
                data, flow_length = self._chunks.popleft()
                self._unacked -= flow_length
                self.c.conn.acknowledge_received_data(flow_length, self.stream_id)
                self.c.kick()  # a WINDOW_UPDATE, when h2 decided one is due
                if data:
                    return data
                continue
            if self._gone.is_set():
                raise ClientGone("client reset the stream")
            if self._ended:
                self.body_done = True
                return b""
            self._arrived = trio.Event()
            with trio.move_on_at(deadline):
                await self._arrived.wait()
                continue
            raise ClientGone("request body not complete in time")

    async def respond(self, status: int, headers: Headers) -> None:
        self._live()
        try:
            self.c.conn.send_headers(self.stream_id,
                                     [(b":status", str(status).encode()), *headers])
        except h2.exceptions.ProtocolError as exc:
            stream = self.c.conn.streams.get(self.stream_id)
            if self.c.conn.state_machine.state is h2.connection.ConnectionState.CLOSED or (
                    stream is None or stream.closed):
                raise ClientGone("stream or connection closed") from exc
            raise BadResponse(str(exc)) from exc
        self.c.kick()

    async def send(self, chunk: bytes) -> None:
        view = memoryview(chunk)
        deadline = trio.current_time() + self.c.write_timeout
        while view:
            self._live()
            try:
                window = min(self.c.conn.local_flow_control_window(self.stream_id),
                             self.c.conn.max_outbound_frame_size)
            except h2.exceptions.ProtocolError as exc:
                raise ClientGone("stream closed") from exc
            if window <= 0:
                await self.c.wait_window(deadline)
                continue
            try:
                self.c.conn.send_data(self.stream_id, bytes(view[:window]))
            except h2.exceptions.ProtocolError as exc:
                raise ClientGone("stream closed") from exc
            view = view[window:]
            self.c._queued += window
            if self.c._queued >= FLUSH_BYTES:
                await self.c.flush()
        self.c.kick()

    async def end(self) -> None:
        self._live()
        try:
            self.c.conn.end_stream(self.stream_id)
        except h2.exceptions.ProtocolError as exc:
            raise ClientGone("stream closed") from exc
        if self.stopped and not self._ended:
            self._reset(h2.errors.ErrorCodes.NO_ERROR)
        self.c.kick()

    async def abort(self) -> None:
        self._reset(h2.errors.ErrorCodes.INTERNAL_ERROR)
        self.c.kick()

    async def wait_gone(self) -> None:
        await self._gone.wait()

    def needs_watch(self, response_headers: Headers) -> bool:
        return False  # a reset cancels the exchange's own scope (`reset_by_client`)

    def stop_body(self) -> None:
        if not self._ended:
            self.stopped = True
            if self._unacked:
                self.c.conn.acknowledge_received_data(self._unacked, self.stream_id)
                self._unacked = 0
            self._chunks.clear()

    def _live(self) -> None:
        if self._gone.is_set():
            raise ClientGone("client reset the stream")
        if self.c._broken:
            raise ClientGone("client connection broke")

    def _reset(self, code: int) -> None:
        try:
            self.c.conn.reset_stream(self.stream_id, error_code=code)
        except h2.exceptions.ProtocolError:
            pass  # already closed
