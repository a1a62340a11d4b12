"""What both ends of an HTTP/2 connection do alike, as the base of their state machines.
Sans-I/O.

`proto.h2_server.H2Server` (the edge's front) and `proto.h2_client.H2Client` (its node
leg) read frames, gather header blocks, answer PING and SETTINGS, keep the peer's
windows and give ours back, and reset and end streams the same way; each adds what
only its end does (which stream ids the peer may use, HEADERS and DATA, GOAWAY). The
hooks a subclass sets: `_idle(sid)` (a stream id the peer may not name yet),
`_headers`, `_data`, `_goaway`, `_forget(sid)` (a stream is gone: anything of it held),
`_last_stream_id()` for our GOAWAY, `PUSH_MAX` (the highest SETTINGS_ENABLE_PUSH the
peer may send) and `PUSH_PROMISE_WHY`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pact_ingress.proto import h2_hpack
from pact_ingress.proto.h2_frames import (
    ACK,
    CONTINUATION,
    DATA,
    DEFAULT_MAX_FRAME,
    DEFAULT_WINDOW,
    END_HEADERS,
    END_STREAM,
    GOAWAY,
    GOAWAY_HEAD,
    HEAD,
    HEADERS,
    MAX_BLOCK_BYTES,
    MAX_CONTINUATIONS,
    MAX_STREAM_ID,
    MAX_WINDOW,
    PING,
    PRIORITY,
    PRIORITY_RECEIVED,
    PUSH_PROMISE,
    RESET_MEMORY,
    RST_STREAM,
    SETTING,
    SETTINGS,
    SETTINGS_ACKED,
    SETTINGS_CHANGED,
    U32,
    WINDOW_UPDATE,
    ConnectionError_,
    ErrorCode,
    Event,
    PingReceived,
    Setting,
    StreamReset,
    UnknownFrame,
    WindowUpdated,
    frame,
)


class Endpoint:
    """The state both ends keep, and the frames they handle alike. A subclass's
    `__init__` sets every attribute named here (see `H2Server` and `H2Client`)."""

    PUSH_MAX = 1
    PUSH_PROMISE_WHY = "PUSH_PROMISE"

    streams: dict[int, Any]
    closed: bool
    out: bytearray
    _buf: bytes
    _settings_seen: bool
    _conn_recv_target: int
    _recv_initial: int
    _conn_recv_window: int
    _conn_recv_processed: int
    _conn_ack_at: int  # connection bytes taken before a WINDOW_UPDATE gives them back
    _block: list[bytes] | None
    _block_stream: int
    _block_flags: int
    _block_bytes: int
    _continuations: int
    _reset_by_us: dict[int, None]
    _send_initial: int
    conn_send_window: int
    max_outbound_frame_size: int
    peer_max_concurrent_streams: int
    peer_max_header_list_size: int | None
    _table_reset: bool

    def _endpoint_init(self, initial_window: int, connection_window: int,
                       conn_ack_at: int) -> None:
        """The state both ends start with: `initial_window` for each stream we receive
        on, the connection's raised to `connection_window` by our first WINDOW_UPDATE
        (until then 65535: DATA up to the raised figure is taken from then on, the peer
        cannot send beyond 65535 before it sees it), given back `conn_ack_at` bytes at
        a time."""
        if not DEFAULT_WINDOW <= connection_window <= MAX_WINDOW:
            raise ValueError("the connection window starts at 65535 and can only grow")
        self.streams = {}  # open in at least one direction
        self.closed = False  # GOAWAY sent: nothing more is sent or taken
        #: frames queued for the peer; the I/O side takes them (`take_output`)
        self.out = bytearray()
        self._buf = b""
        self._settings_seen = False
        # receiving
        self._recv_initial = initial_window
        self._conn_recv_window = DEFAULT_WINDOW
        self._conn_recv_target = connection_window
        self._conn_recv_processed = 0
        self._conn_ack_at = conn_ack_at
        self._block = None  # header block fragments being gathered
        self._block_stream = 0
        self._block_flags = 0
        self._block_bytes = 0
        self._continuations = 0
        self._reset_by_us = {}  # oldest first, at most RESET_MEMORY
        # sending
        self._send_initial = DEFAULT_WINDOW
        self.conn_send_window = DEFAULT_WINDOW
        self.max_outbound_frame_size = DEFAULT_MAX_FRAME
        #: the peer's SETTINGS_MAX_CONCURRENT_STREAMS (unlimited until it names one) and
        #: SETTINGS_MAX_HEADER_LIST_SIZE (None until it names one: unlimited)
        self.peer_max_concurrent_streams = MAX_STREAM_ID
        self.peer_max_header_list_size = None
        self._table_reset = True  # start the next block with a table size update to 0

    def _raise_connection_window(self) -> None:
        """Our first WINDOW_UPDATE: the connection window to its target (no setting
        carries it)."""
        raise_by = self._conn_recv_target - self._conn_recv_window
        if raise_by > 0:
            self._conn_recv_window += raise_by
            self.out += frame(WINDOW_UPDATE, 0, 0, U32.pack(raise_by))

    # -- the subclass's ---------------------------------------------------------------

    def _idle(self, sid: int) -> bool:
        raise NotImplementedError

    def _headers(self, flags: int, sid: int, payload: bytes, events: list[Event]) -> None:
        raise NotImplementedError

    def _data(self, flags: int, sid: int, payload: bytes, events: list[Event]) -> None:
        raise NotImplementedError

    def _goaway(self, payload: bytes, events: list[Event]) -> None:
        raise NotImplementedError

    def _forget(self, sid: int) -> None:
        """A stream is gone (reset either way)."""

    def _last_stream_id(self) -> int:
        raise NotImplementedError

    # -- output -----------------------------------------------------------------------

    def take_output(self) -> bytearray:
        """The queued frames, handed over without a copy (`out` starts empty again)."""
        data = self.out
        self.out = bytearray()
        return data

    def _send_head(self, stream_id: int, headers: Iterable[tuple[bytes, bytes]],
                   end_stream: bool) -> None:
        """A header block on its stream: HEADERS, and CONTINUATION frames when it is
        longer than the peer's frame size. Encoded by `proto.h2_hpack`, which keeps no
        dynamic table (the first block, and the first after the peer changed its table
        size, says so with a size update to 0)."""
        block = h2_hpack.encode(headers)
        if self._table_reset:
            self._table_reset = False
            block = h2_hpack.TABLE_SIZE_ZERO + block
        flags = END_STREAM if end_stream else 0
        limit = self.max_outbound_frame_size
        if len(block) <= limit:
            self.out += HEAD.pack(len(block) << 8 | HEADERS, flags | END_HEADERS, stream_id)
            self.out += block
            return
        pieces = [block[i:i + limit] for i in range(0, len(block), limit)]
        self.out += frame(HEADERS, flags, stream_id, pieces[0])
        for piece in pieces[1:-1]:
            self.out += frame(CONTINUATION, 0, stream_id, piece)
        self.out += frame(CONTINUATION, END_HEADERS, stream_id, pieces[-1])

    # -- frames in ----------------------------------------------------------------------

    def _frames(self, buf: bytes, pos: int, events: list[Event]) -> int:
        """Every whole frame of `buf` from `pos` handled; where the rest starts."""
        end = len(buf)
        while end - pos >= 9:
            head, flags, stream_id = HEAD.unpack_from(buf, pos)
            length = head >> 8
            if length > DEFAULT_MAX_FRAME:
                self._fail(ErrorCode.FRAME_SIZE_ERROR, "frame larger than allowed")
            if end - pos - 9 < length:
                break
            payload = buf[pos + 9:pos + 9 + length]
            pos += 9 + length
            kind = head & 0xFF
            # the frames of every exchange go straight to their handler; the rest, and
            # anything while a header block is gathered, through `_frame`
            if kind == DATA and self._block is None and self._settings_seen:
                self._data(flags, stream_id & 0x7FFFFFFF, payload, events)
            elif kind == HEADERS and self._block is None and self._settings_seen:
                self._headers(flags, stream_id & 0x7FFFFFFF, payload, events)
            else:
                self._frame(kind, flags, stream_id & 0x7FFFFFFF, payload, events)
        return pos

    def _fail(self, code: ErrorCode, why: str) -> None:
        self.close_connection(code)
        raise ConnectionError_(code, why)

    def _frame(self, kind: int, flags: int, sid: int, payload: bytes,
               events: list[Event]) -> None:
        if self._block is not None:
            if kind != CONTINUATION or sid != self._block_stream:
                self._fail(ErrorCode.PROTOCOL_ERROR, "header block interrupted")
            self._continuation(flags, payload, events)
            return
        if not self._settings_seen:
            if kind != SETTINGS or flags & ACK:
                self._fail(ErrorCode.PROTOCOL_ERROR, "the preface must end with SETTINGS")
            self._settings_seen = True
        if kind == HEADERS:
            self._headers(flags, sid, payload, events)
        elif kind == DATA:
            self._data(flags, sid, payload, events)
        elif kind == WINDOW_UPDATE:
            self._window_update(sid, payload, events)
        elif kind == SETTINGS:
            self._settings(flags, sid, payload, events)
        elif kind == RST_STREAM:
            self._rst_stream(sid, payload, events)
        elif kind == PING:
            if sid:
                self._fail(ErrorCode.PROTOCOL_ERROR, "PING on a stream")
            if len(payload) != 8:
                self._fail(ErrorCode.FRAME_SIZE_ERROR, "PING not 8 bytes")
            if not flags & ACK:
                self.out += frame(PING, ACK, 0, payload)
            events.append(PingReceived(bool(flags & ACK)))
        elif kind == PRIORITY:
            if not sid:
                self._fail(ErrorCode.PROTOCOL_ERROR, "PRIORITY on stream 0")
            if len(payload) != 5:
                self._fail(ErrorCode.FRAME_SIZE_ERROR, "PRIORITY not 5 bytes")
            if U32.unpack_from(payload)[0] & 0x7FFFFFFF == sid:
                self._stream_error(sid, ErrorCode.PROTOCOL_ERROR, events)
            events.append(PRIORITY_RECEIVED)
        elif kind == GOAWAY:
            if sid:
                self._fail(ErrorCode.PROTOCOL_ERROR, "GOAWAY on a stream")
            if len(payload) < 8:
                self._fail(ErrorCode.FRAME_SIZE_ERROR, "GOAWAY shorter than 8 bytes")
            self._goaway(payload, events)
        elif kind == CONTINUATION:
            self._fail(ErrorCode.PROTOCOL_ERROR, "CONTINUATION without a header block")
        elif kind == PUSH_PROMISE:
            self._fail(ErrorCode.PROTOCOL_ERROR, self.PUSH_PROMISE_WHY)
        else:
            events.append(UnknownFrame(kind))  # ignored (RFC 9113 §4.1), but counted

    def _gather(self, sid: int, flags: int, block: bytes) -> None:
        """A header block that goes on in CONTINUATION frames: its first fragment."""
        self._block = [block]
        self._block_stream = sid
        self._block_flags = flags
        self._block_bytes = len(block)
        self._continuations = 0

    def _continuation(self, flags: int, payload: bytes, events: list[Event]) -> None:
        assert self._block is not None
        self._block.append(payload)
        self._block_bytes += len(payload)
        self._continuations += 1
        if self._block_bytes > MAX_BLOCK_BYTES or self._continuations > MAX_CONTINUATIONS:
            self._fail(ErrorCode.ENHANCE_YOUR_CALM, "header block too large")
        if flags & END_HEADERS:
            block, self._block = b"".join(self._block), None
            self._header_block(self._block_stream, self._block_flags, block, events)

    def _header_block(self, sid: int, flags: int, block: bytes, events: list[Event]) -> None:
        raise NotImplementedError

    def _window_update(self, sid: int, payload: bytes, events: list[Event]) -> None:
        if len(payload) != 4:
            self._fail(ErrorCode.FRAME_SIZE_ERROR, "WINDOW_UPDATE not 4 bytes")
        increment = U32.unpack(payload)[0] & 0x7FFFFFFF
        if not sid:
            if not increment:
                self._fail(ErrorCode.PROTOCOL_ERROR, "WINDOW_UPDATE of 0")
            self.conn_send_window += increment
            if self.conn_send_window > MAX_WINDOW:
                self._fail(ErrorCode.FLOW_CONTROL_ERROR, "connection window overflow")
            events.append(WindowUpdated(0))
            return
        stream = self.streams.get(sid)
        if stream is None:
            if self._idle(sid):
                self._fail(ErrorCode.PROTOCOL_ERROR, "WINDOW_UPDATE on an idle stream")
            events.append(WindowUpdated(sid))  # a closed stream: ignored, but counted
            return
        if not increment:
            self._stream_error(sid, ErrorCode.PROTOCOL_ERROR, events)
            return
        stream.send_window += increment
        if stream.send_window > MAX_WINDOW:
            self._stream_error(sid, ErrorCode.FLOW_CONTROL_ERROR, events)
            return
        events.append(WindowUpdated(sid))

    def _settings(self, flags: int, sid: int, payload: bytes, events: list[Event]) -> None:
        if sid:
            self._fail(ErrorCode.PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & ACK:
            if payload:
                self._fail(ErrorCode.FRAME_SIZE_ERROR, "SETTINGS ACK with a payload")
            events.append(SETTINGS_ACKED)
            return
        if len(payload) % 6:
            self._fail(ErrorCode.FRAME_SIZE_ERROR, "SETTINGS not a multiple of 6 bytes")
        for pos in range(0, len(payload), 6):
            code, value = SETTING.unpack_from(payload, pos)
            if code == Setting.HEADER_TABLE_SIZE:
                self._table_reset = True
            elif code == Setting.ENABLE_PUSH:
                if value > self.PUSH_MAX:  # (a server may only say 0: RFC 9113 §6.5.2)
                    self._fail(ErrorCode.PROTOCOL_ERROR, "SETTINGS_ENABLE_PUSH out of range")
            elif code == Setting.ENABLE_CONNECT_PROTOCOL:
                if value > 1:
                    self._fail(ErrorCode.PROTOCOL_ERROR, "a boolean setting not 0 or 1")
            elif code == Setting.MAX_CONCURRENT_STREAMS:
                self.peer_max_concurrent_streams = value
            elif code == Setting.INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    self._fail(ErrorCode.FLOW_CONTROL_ERROR, "initial window too large")
                delta = value - self._send_initial
                self._send_initial = value
                for stream in self.streams.values():
                    stream.send_window += delta
                    if stream.send_window > MAX_WINDOW:
                        self._fail(ErrorCode.FLOW_CONTROL_ERROR, "stream window overflow")
            elif code == Setting.MAX_FRAME_SIZE:
                if not DEFAULT_MAX_FRAME <= value <= 2**24 - 1:
                    self._fail(ErrorCode.PROTOCOL_ERROR, "max frame size out of range")
                self.max_outbound_frame_size = value
            elif code == Setting.MAX_HEADER_LIST_SIZE:
                self.peer_max_header_list_size = value
        self.out += frame(SETTINGS, ACK, 0)
        events.append(SETTINGS_CHANGED)

    def _rst_stream(self, sid: int, payload: bytes, events: list[Event]) -> None:
        if len(payload) != 4:
            self._fail(ErrorCode.FRAME_SIZE_ERROR, "RST_STREAM not 4 bytes")
        if not sid or self._idle(sid):
            self._fail(ErrorCode.PROTOCOL_ERROR, "RST_STREAM on an idle stream")
        self.streams.pop(sid, None)
        self._forget(sid)
        events.append(StreamReset(sid, U32.unpack(payload)[0], True))

    # -- streams ------------------------------------------------------------------------

    def _stream_error(self, sid: int, code: ErrorCode, events: list[Event]) -> None:
        self.reset_stream(sid, code)
        events.append(StreamReset(sid, code, False))

    def _remote_end(self, stream: Any) -> None:
        stream.remote_open = False
        if not stream.local_open:
            del self.streams[stream.id]

    def _local_end(self, stream: Any) -> None:
        stream.local_open = False
        if not stream.remote_open:
            del self.streams[stream.id]

    def is_open(self, stream_id: int) -> bool:
        return stream_id in self.streams

    # -- flow control of what we receive ----------------------------------------------

    def acknowledge(self, length: int, stream_id: int) -> None:
        """`length` flow-controlled bytes were taken: give the windows back when due
        (enough of the connection's, half a stream window, or a window drained)."""
        if not length:
            return
        self._conn_recv_processed += length
        processed = self._conn_recv_processed
        if processed >= self._conn_ack_at or (
                self._conn_recv_window == 0 and processed > 1024):
            self._conn_recv_processed = 0
            self._conn_recv_window += processed
            self.out += frame(WINDOW_UPDATE, 0, 0, U32.pack(processed))
        stream = self.streams.get(stream_id)
        if stream is None or not stream.remote_open:
            return
        stream.recv_processed += length
        processed = stream.recv_processed
        if processed >= self._recv_initial // 2 or (
                stream.recv_window == 0 and processed > min(1024, self._recv_initial // 4)):
            stream.recv_processed = 0
            stream.recv_window += processed
            self.out += frame(WINDOW_UPDATE, 0, stream_id, U32.pack(processed))

    # -- ending -------------------------------------------------------------------------

    def reset_stream(self, stream_id: int, code: int) -> None:
        """RST_STREAM, when the stream is open and the connection too; else nothing."""
        if self.closed or self.streams.pop(stream_id, None) is None:
            return
        self._forget(stream_id)
        self.out += frame(RST_STREAM, 0, stream_id, U32.pack(code))
        self._note_reset(stream_id)

    def _note_reset(self, stream_id: int) -> None:
        """Remember a stream we reset: the peer may still send on it what it had sent
        before it saw the reset, which is ignored rather than an error. The oldest are
        forgotten past a bound; late frames on those end the connection."""
        reset = self._reset_by_us
        reset[stream_id] = None
        if len(reset) > RESET_MEMORY:
            del reset[next(iter(reset))]

    def close_connection(self, code: int = ErrorCode.NO_ERROR,
                         last_stream_id: int | None = None) -> None:
        """GOAWAY naming the last stream we took (by default, `_last_stream_id()`)."""
        if self.closed:
            return
        last = self._last_stream_id() if last_stream_id is None else last_stream_id
        self.out += frame(GOAWAY, 0, 0, GOAWAY_HEAD.pack(last, code))
        self.closed = True
