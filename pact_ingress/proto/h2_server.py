"""The server side of an HTTP/2 connection (RFC 9113) as a state machine. Sans-I/O.

Bytes from the client go in (`receive_data`), events come out; calls that answer
(`send_headers`, `send_data`, `end_stream`, `reset_stream`, `close_connection`, ...)
queue frames that `data_to_send` hands over. Nothing here reads a clock or a socket.

Written here rather than driving the `h2` library because, at an edge that handles every
request of a connection, h2's generality (a frame object per frame, a generic event
machinery, Huffman-coding every response header, per-frame debug formatting) was most of
an HTTP/2 exchange's cost. Only what a server that never pushes needs is here, so the
common exchange (one HEADERS in, HEADERS + DATA + END_STREAM out) is a handful of
dictionary operations and struct packs. Header blocks are decoded by `hpack.Decoder`
(its dynamic table must follow the client's) and encoded by `proto.h2_hpack` (no
dynamic table). Request header blocks are not validated here:
`proto.h2_request.split_request` does that in one pass.

What is enforced, and how it fails:

- the connection preface, then SETTINGS as the first frame; frame sizes against
  SETTINGS_MAX_FRAME_SIZE and the fixed sizes of PRIORITY, RST_STREAM, PING,
  WINDOW_UPDATE and SETTINGS (FRAME_SIZE_ERROR); padding longer than its frame;
- stream ids: client-initiated (odd) and increasing; a frame on an idle stream,
  PUSH_PROMISE, CONTINUATION out of place or interleaved with another frame are
  connection errors (PROTOCOL_ERROR);
- header blocks: the decoder's header list size cap (SETTINGS_MAX_HEADER_LIST_SIZE) and
  a cap on the compressed block and on its CONTINUATION frames (a block that keeps
  growing, or an endless chain of empty CONTINUATIONs, ends the connection with
  ENHANCE_YOUR_CALM); a block that cannot be decoded is a COMPRESSION_ERROR. Every block
  is decoded, even one for a stream that is refused, so the decoder's table stays right;
- flow control both ways: DATA beyond the connection or stream window we advertised is a
  FLOW_CONTROL_ERROR; the connection window may start larger than the protocol's 65535
  (`connection_window`: one WINDOW_UPDATE after our SETTINGS), so that streams whose
  data waits cannot hold all of it; our windows are given back (WINDOW_UPDATE) only as
  the application acknowledges data, once half a (default-sized) window is consumed; the
  client's windows (initial size from its SETTINGS, changes applied to every open
  stream, overflow checks) bound what `send_data` may send;
- streams: at most `max_concurrent_streams` open, more are refused (REFUSED_STREAM);
  `Content-Length` against the DATA received (PROTOCOL_ERROR on the stream); trailers
  must end the stream and carry no pseudo-header; frames on a closed stream are ignored
  (the client may have sent them before it saw our reset), their flow-controlled bytes
  given back at once, and each still reported (DATA with nothing owed, HEADERS as an
  unknown frame) so the caller's flood meters see them; so is a refused stream.

A connection error queues GOAWAY and raises `ConnectionError_` (no frame is read after
it). A stream error queues RST_STREAM and reports `StreamReset(remote=False)`.
"""

from __future__ import annotations

from collections.abc import Iterable

import hpack

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
    MAX_WINDOW,
    PING,
    PREFACE,
    PRIORITY,
    PRIORITY_FLAG,
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
    DataReceived,
    ErrorCode,
    Event,
    PingReceived,
    Setting,
    StreamClosed,
    StreamEnded,
    StreamReset,
    UnknownFrame,
    WindowUpdated,
    frame,
    unpad,
)
from pact_ingress.proto.http_request import declared_length

#: Not a wire flag: set on a header block whose HEADERS frame made the stream depend on
#: itself (outside the 8 bits a frame's flags take).
SELF_DEPENDENT = 0x100

#: A header list up to this many times `max_header_list_size` is refused on its stream
#: (431); beyond, the connection ends (ENHANCE_YOUR_CALM).
OVERSIZED_LISTS = 4
#: Decoded header blocks remembered per connection (see `_decode`).
DECODED_CACHE = 32

#: No response header list the edge sends is this large (a node's head is capped at
#: 64 KiB and 128 fields on its own leg, `proto.http_upstream`): a client advertising at
#: least this much needs no counting.
_ANY_LIST = 64 * 1024 + 32 * 130


# -- events of this end ---------------------------------------------------------------

class RequestReceived(Event):
    __slots__ = ("stream_id", "headers", "ended")

    def __init__(self, stream_id: int, headers: list[tuple[bytes, bytes]], ended: bool):
        self.stream_id, self.headers, self.ended = stream_id, headers, ended


class GoAwayReceived(Event):
    __slots__ = ("code",)

    def __init__(self, code: int):
        self.code = code


# -- streams --------------------------------------------------------------------------

class Stream:
    __slots__ = ("id", "remote_open", "local_open", "headers_sent", "send_window",
                 "recv_window", "recv_processed", "content_length", "received")

    def __init__(self, stream_id: int, send_window: int, recv_window: int) -> None:
        self.id = stream_id
        self.remote_open = True  # the client may still send DATA
        self.local_open = True  # we may still send
        self.headers_sent = False
        self.send_window = send_window
        self.recv_window = recv_window  # what we still let the client send
        self.recv_processed = 0  # acknowledged since the last WINDOW_UPDATE
        self.content_length: int | None = None
        self.received = 0


def _all_indexed(block: bytes) -> bool:
    """Is every representation in `block` an indexed field (RFC 7541 §6.1)?"""
    i, n = 0, len(block)
    while i < n:
        b = block[i]
        if not b & 0x80:
            return False
        i += 1
        if b & 0x7F == 0x7F:  # the index goes on in continuation bytes
            while i < n and block[i] & 0x80:
                i += 1
            i += 1
    return True


def _content_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    for name, value in headers:
        if name == b"content-length":
            # anything but digits: `split_request`'s caller refuses the request
            return declared_length(value)
    return None


class H2Server:
    def __init__(self, *, max_concurrent_streams: int = 100,
                 max_header_list_size: int = 16 * 1024,
                 initial_window: int = DEFAULT_WINDOW,
                 connection_window: int = DEFAULT_WINDOW) -> None:
        if not DEFAULT_WINDOW <= connection_window <= MAX_WINDOW:
            raise ValueError("the connection window starts at 65535 and can only grow")
        self.max_concurrent_streams = max_concurrent_streams
        self.max_header_list_size = max_header_list_size
        self.streams: dict[int, Stream] = {}  # open in at least one direction
        self.highest_inbound_stream_id = 0
        self.closed = False  # GOAWAY sent: nothing more is sent or taken
        #: frames queued for the client; the I/O side takes it whole (`take_output`)
        self.out = bytearray()
        self._buf = b""
        self._preface = True  # the client preface is still expected
        self._settings_seen = False
        # receiving
        # A list over `max_header_list_size` is still decoded whole, up to
        # `OVERSIZED_LISTS` times it, so the table stays the client's and only that
        # request is lost (431); past that the decoder stops mid-block and the
        # connection ends.
        self._decoder = hpack.Decoder(
            max_header_list_size=max_header_list_size * OVERSIZED_LISTS)
        # blocks decoded lately: the header list, its Content-Length, whether over the cap
        self._decoded: dict[bytes, tuple[list[tuple[bytes, bytes]], int | None, bool]] = {}
        self._recv_initial = initial_window
        # the connection window is 65535 until our first WINDOW_UPDATE raises it to
        # `connection_window` (`initiate_connection`); DATA up to the raised figure is
        # taken from then on (a client cannot send beyond 65535 before it sees it)
        self._conn_recv_window = DEFAULT_WINDOW
        self._conn_recv_target = connection_window
        self._conn_recv_processed = 0
        self._block: list[bytes] | None = None  # header block fragments being gathered
        self._block_stream = 0
        self._block_flags = 0
        self._block_bytes = 0
        self._continuations = 0
        self._reset_by_us: dict[int, None] = {}  # oldest first, at most RESET_MEMORY
        # sending
        self._send_initial = DEFAULT_WINDOW
        self.conn_send_window = DEFAULT_WINDOW
        self.max_outbound_frame_size = DEFAULT_MAX_FRAME
        #: the client's SETTINGS_MAX_HEADER_LIST_SIZE: None until it names one (unlimited)
        self.peer_max_header_list_size: int | None = None
        self._table_reset = True  # start the next block with a table size update to 0

    # -- set-up and output ------------------------------------------------------------

    def initiate_connection(self) -> None:
        """Queue our SETTINGS (the server preface)."""
        payload = b"".join(SETTING.pack(code, value) for code, value in (
            (Setting.ENABLE_PUSH, 0),
            (Setting.MAX_CONCURRENT_STREAMS, self.max_concurrent_streams),
            (Setting.INITIAL_WINDOW_SIZE, self._recv_initial),
            (Setting.MAX_HEADER_LIST_SIZE, self.max_header_list_size),
        ))
        self._write(frame(SETTINGS, 0, 0, payload))
        raise_by = self._conn_recv_target - self._conn_recv_window
        if raise_by > 0:
            # no setting carries the connection window: only a WINDOW_UPDATE raises it
            self._conn_recv_window += raise_by
            self._write(frame(WINDOW_UPDATE, 0, 0, U32.pack(raise_by)))

    def data_to_send(self) -> bytes:
        data = bytes(self.out)
        self.out.clear()
        return data

    def take_output(self) -> bytearray:
        """The queued frames, handed over without a copy (`out` starts empty again)."""
        data = self.out
        self.out = bytearray()
        return data

    def _write(self, frame: bytes) -> None:
        self.out += frame

    # -- receiving --------------------------------------------------------------------

    def receive_data(self, data: bytes) -> list[Event]:
        """Events for the frames completed by `data`; `ConnectionError_` (GOAWAY queued)
        when the client broke the protocol."""
        if self.closed:
            return []
        buf = self._buf + data if self._buf else data
        pos = 0
        if self._preface:
            if len(buf) < len(PREFACE):
                if not PREFACE.startswith(buf):
                    self._fail(ErrorCode.PROTOCOL_ERROR, "not an HTTP/2 preface")
                self._buf = buf
                return []
            if buf[:len(PREFACE)] != PREFACE:
                self._fail(ErrorCode.PROTOCOL_ERROR, "not an HTTP/2 preface")
            self._preface = False
            pos = len(PREFACE)
        events: list[Event] = []
        end = len(buf)
        try:
            while end - pos >= 9:
                head, flags, stream_id = HEAD.unpack_from(buf, pos)
                length = head >> 8
                if length > DEFAULT_MAX_FRAME:
                    self._fail(ErrorCode.FRAME_SIZE_ERROR, "frame larger than allowed")
                if end - pos - 9 < length:
                    break
                payload = buf[pos + 9:pos + 9 + length]
                pos += 9 + length
                self._frame(head & 0xFF, flags, stream_id & 0x7FFFFFFF, payload, events)
        except ConnectionError_:
            self._buf = b""
            raise
        self._buf = buf[pos:] if pos < end else b""
        return events

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
                self._write(frame(PING, ACK, 0, payload))
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
            events.append(GoAwayReceived(GOAWAY_HEAD.unpack_from(payload)[1]))
        elif kind == CONTINUATION:
            self._fail(ErrorCode.PROTOCOL_ERROR, "CONTINUATION without a header block")
        elif kind == PUSH_PROMISE:
            self._fail(ErrorCode.PROTOCOL_ERROR, "PUSH_PROMISE from a client")
        else:
            events.append(UnknownFrame(kind))  # ignored (RFC 9113 §4.1), but counted

    def _headers(self, flags: int, sid: int, payload: bytes, events: list[Event]) -> None:
        if not sid or not sid & 1:
            self._fail(ErrorCode.PROTOCOL_ERROR, "HEADERS on an even stream id")
        block = unpad(flags, payload)
        if block is None:
            self._fail(ErrorCode.PROTOCOL_ERROR, "padding longer than the frame")
        if flags & PRIORITY_FLAG:
            if len(block) < 5:
                self._fail(ErrorCode.FRAME_SIZE_ERROR, "HEADERS too short for its priority")
            if U32.unpack_from(block)[0] & 0x7FFFFFFF == sid:
                # a stream cannot depend on itself (RFC 9113 §5.3.1): the block is still
                # decoded below, so that the table stays the client's, then reset
                flags |= SELF_DEPENDENT
            block = block[5:]
        if flags & END_HEADERS:
            self._header_block(sid, flags, block, events)
            return
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

    def _decode(self, block: bytes) -> tuple[list[tuple[bytes, bytes]], int | None, bool]:
        """The header list of `block`. A block made only of indexed fields leaves the
        dynamic table as it was, so while the table does not change the same bytes mean
        the same list: a client repeating a request sends the same few bytes each time,
        and they are decoded once. Any other block may change the table and forgets
        what was remembered. Also the block's Content-Length, if any, and whether the
        list is over `max_header_list_size` (counted as SETTINGS_MAX_HEADER_LIST_SIZE
        is: each field's name and value plus 32)."""
        known = self._decoded.get(block)
        if known is not None:
            return known
        try:
            headers = self._decoder.decode(block, raw=True)
        except hpack.OversizedHeaderListError:
            self._fail(ErrorCode.ENHANCE_YOUR_CALM, "header list too large")
        except (hpack.HPACKError, IndexError, ValueError, TypeError):
            self._fail(ErrorCode.COMPRESSION_ERROR, "header block cannot be decoded")
        size = sum(len(name) + len(value) + 32 for name, value in headers)
        known = headers, _content_length(headers), size > self.max_header_list_size
        if _all_indexed(block):
            if len(self._decoded) >= DECODED_CACHE:
                self._decoded.clear()
            self._decoded[block] = known
        elif self._decoded:
            self._decoded.clear()
        return known

    def _header_block(self, sid: int, flags: int, block: bytes, events: list[Event]) -> None:
        headers, content_length, oversized = self._decode(block)
        ended = bool(flags & END_STREAM)
        stream = self.streams.get(sid)
        if stream is not None:  # trailers
            if oversized:
                self._stream_error(sid, ErrorCode.PROTOCOL_ERROR, events)
                return
            if flags & SELF_DEPENDENT:
                self._stream_error(sid, ErrorCode.PROTOCOL_ERROR, events)
                return
            if not stream.remote_open:
                self._stream_error(sid, ErrorCode.STREAM_CLOSED, events)
                return
            if not ended or any(name[:1] == b":" for name, _ in headers):
                # trailers must end the stream and carry no pseudo-header (§8.1)
                self._stream_error(sid, ErrorCode.PROTOCOL_ERROR, events)
                return
            if stream.content_length is not None and stream.content_length != stream.received:
                self._stream_error(sid, ErrorCode.PROTOCOL_ERROR, events)
                return
            self._remote_end(stream)
            events.append(StreamEnded(sid))
            return
        if sid <= self.highest_inbound_stream_id:
            if sid in self._reset_by_us:
                # trailers sent before the client saw our reset: ignored (RFC 9113 §5.1;
                # the block was decoded, so the table is right), but not free
                events.append(UnknownFrame(HEADERS))
                return
            # a stream that ended, or an id the client skipped: a new stream's id must
            # be above every one used before (§5.1.1)
            self._fail(ErrorCode.PROTOCOL_ERROR, "HEADERS on a stream id already passed")
        self.highest_inbound_stream_id = sid
        if flags & SELF_DEPENDENT or len(self.streams) >= self.max_concurrent_streams:
            code = (ErrorCode.PROTOCOL_ERROR if flags & SELF_DEPENDENT
                    else ErrorCode.REFUSED_STREAM)
            self._write(frame(RST_STREAM, 0, sid, U32.pack(code)))
            self._note_reset(sid)
            # reported, so the caller's flood meters see refusals a client keeps provoking
            events.append(StreamReset(sid, code, False))
            return
        stream = Stream(sid, self._send_initial, self._recv_initial)
        stream.content_length = content_length
        self.streams[sid] = stream
        if oversized:
            # answered here, as HTTP/1.1 answers a head over its cap: the request is
            # refused and the connection's other streams go on; the body that may follow
            # is dropped (RST_STREAM(NO_ERROR) after the complete answer, §8.1)
            stream.remote_open = not ended
            self.send_headers(sid, [(b":status", b"431"), (b"content-length", b"0")],
                              end_stream=True)
            if not ended:
                self.reset_stream(sid, ErrorCode.NO_ERROR)
            # reported, so the caller's flood meters see the refusals a client provokes
            events.append(StreamReset(sid, ErrorCode.NO_ERROR, False))
            return
        if ended:
            stream.remote_open = False
            if stream.content_length:
                self._stream_error(sid, ErrorCode.PROTOCOL_ERROR, events)
                return
        events.append(RequestReceived(sid, headers, ended))

    def _data(self, flags: int, sid: int, payload: bytes, events: list[Event]) -> None:
        if not sid:
            self._fail(ErrorCode.PROTOCOL_ERROR, "DATA on stream 0")
        length = len(payload)
        if length > self._conn_recv_window:
            self._fail(ErrorCode.FLOW_CONTROL_ERROR, "DATA beyond the connection window")
        self._conn_recv_window -= length
        data = unpad(flags, payload)
        if data is None:
            self._fail(ErrorCode.PROTOCOL_ERROR, "padding longer than the frame")
        stream = self.streams.get(sid)
        if stream is None or not stream.remote_open:
            if sid > self.highest_inbound_stream_id:
                self._fail(ErrorCode.PROTOCOL_ERROR, "DATA on an idle stream")
            # closed, or reset by us: the client may not have seen it yet
            self.acknowledge(length, sid)
            if stream is not None:  # half closed (remote): the client broke the rules
                self._stream_error(sid, ErrorCode.STREAM_CLOSED, events)
            else:  # reported with nothing owed, so an empty one is still counted
                events.append(DataReceived(sid, data, 0, bool(flags & END_STREAM)))
            return
        if length > stream.recv_window:
            self._fail(ErrorCode.FLOW_CONTROL_ERROR, "DATA beyond the stream window")
        stream.recv_window -= length
        stream.received += len(data)
        ended = bool(flags & END_STREAM)
        if stream.content_length is not None and (
                stream.received > stream.content_length
                or (ended and stream.received != stream.content_length)):
            self._stream_error(sid, ErrorCode.PROTOCOL_ERROR, events)
            self.acknowledge(length, sid)
            return
        if ended:
            self._remote_end(stream)
        events.append(DataReceived(sid, data, length, ended))

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
            if sid > self.highest_inbound_stream_id:
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
            elif code in (Setting.ENABLE_PUSH, Setting.ENABLE_CONNECT_PROTOCOL):
                if value > 1:
                    self._fail(ErrorCode.PROTOCOL_ERROR, "a boolean setting not 0 or 1")
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
        self._write(frame(SETTINGS, ACK, 0))
        events.append(SETTINGS_CHANGED)

    def _rst_stream(self, sid: int, payload: bytes, events: list[Event]) -> None:
        if len(payload) != 4:
            self._fail(ErrorCode.FRAME_SIZE_ERROR, "RST_STREAM not 4 bytes")
        if not sid or sid > self.highest_inbound_stream_id:
            self._fail(ErrorCode.PROTOCOL_ERROR, "RST_STREAM on an idle stream")
        self.streams.pop(sid, None)
        events.append(StreamReset(sid, U32.unpack(payload)[0], True))

    def _stream_error(self, sid: int, code: ErrorCode, events: list[Event]) -> None:
        self.reset_stream(sid, code)
        events.append(StreamReset(sid, code, False))

    def _remote_end(self, stream: Stream) -> None:
        stream.remote_open = False
        if not stream.local_open:
            del self.streams[stream.id]

    # -- flow control of what we receive ----------------------------------------------

    def acknowledge(self, length: int, stream_id: int) -> None:
        """`length` flow-controlled bytes were taken: give the windows back when due."""
        if not length:
            return
        self._conn_recv_processed += length
        processed = self._conn_recv_processed
        if processed >= DEFAULT_WINDOW // 2 or (
                self._conn_recv_window == 0 and processed > 1024):
            self._conn_recv_processed = 0
            self._conn_recv_window += processed
            self._write(frame(WINDOW_UPDATE, 0, 0, U32.pack(processed)))
        stream = self.streams.get(stream_id)
        if stream is None or not stream.remote_open:
            return
        stream.recv_processed += length
        processed = stream.recv_processed
        if processed >= self._recv_initial // 2 or (
                stream.recv_window == 0 and processed > min(1024, self._recv_initial // 4)):
            stream.recv_processed = 0
            stream.recv_window += processed
            self._write(frame(WINDOW_UPDATE, 0, stream_id, U32.pack(processed)))

    # -- sending ----------------------------------------------------------------------

    def _sendable(self, stream_id: int) -> Stream:
        stream = self.streams.get(stream_id)
        if stream is None or not stream.local_open or self.closed:
            raise StreamClosed(f"stream {stream_id} is closed")
        return stream

    def is_open(self, stream_id: int) -> bool:
        return stream_id in self.streams

    def fits_peer(self, headers: list[tuple[bytes, bytes]]) -> bool:
        """Is a header list within what the client said it takes (RFC 9113 §6.5.2:
        names and values, 32 octets more per field)?"""
        limit = self.peer_max_header_list_size
        if limit is None or limit >= _ANY_LIST:
            return True
        return sum(len(n) + len(v) + 32 for n, v in headers) <= limit

    def send_headers(self, stream_id: int, headers: Iterable[tuple[bytes, bytes]],
                     end_stream: bool = False) -> None:
        stream = self._sendable(stream_id)
        block = h2_hpack.encode(headers)
        if self._table_reset:
            self._table_reset = False
            block = h2_hpack.TABLE_SIZE_ZERO + block
        flags = END_STREAM if end_stream else 0
        limit = self.max_outbound_frame_size
        if len(block) <= limit:
            self._write(HEAD.pack(len(block) << 8 | HEADERS, flags | END_HEADERS,
                                        stream_id) + block)
        else:
            pieces = [block[i:i + limit] for i in range(0, len(block), limit)]
            self._write(frame(HEADERS, flags, stream_id, pieces[0]))
            for piece in pieces[1:-1]:
                self._write(frame(CONTINUATION, 0, stream_id, piece))
            self._write(frame(CONTINUATION, END_HEADERS, stream_id, pieces[-1]))
        stream.headers_sent = True
        if end_stream:
            self._local_end(stream)

    def local_flow_control_window(self, stream_id: int) -> int:
        """Bytes of DATA `send_data` may send on the stream now."""
        stream = self._sendable(stream_id)
        return min(stream.send_window, self.conn_send_window)

    def send_data(self, stream_id: int, data: bytes, end_stream: bool = False) -> None:
        """One DATA frame; `data` must fit the window and the peer's frame size."""
        stream = self._sendable(stream_id)
        n = len(data)
        if n > stream.send_window or n > self.conn_send_window or (
                n > self.max_outbound_frame_size):
            raise ValueError("DATA beyond the client's window or frame size")
        if not stream.headers_sent:
            raise StreamClosed("DATA before the response head")
        stream.send_window -= n
        self.conn_send_window -= n
        self._write(HEAD.pack(n << 8 | DATA, END_STREAM if end_stream else 0,
                                    stream_id))
        if n:
            self._write(data)
        if end_stream:
            self._local_end(stream)

    def end_stream(self, stream_id: int) -> None:
        self.send_data(stream_id, b"", end_stream=True)

    def _local_end(self, stream: Stream) -> None:
        stream.local_open = False
        if not stream.remote_open:
            del self.streams[stream.id]

    def reset_stream(self, stream_id: int, code: int) -> None:
        """RST_STREAM, when the stream is open and the connection too; else nothing."""
        if self.closed or self.streams.pop(stream_id, None) is None:
            return
        self._write(frame(RST_STREAM, 0, stream_id, U32.pack(code)))
        self._note_reset(stream_id)

    def _note_reset(self, stream_id: int) -> None:
        """Remember a stream we reset: the client may still send on it what it had sent
        before it saw the reset, which is ignored rather than an error. The oldest are
        forgotten past a bound; late frames on those end the connection."""
        reset = self._reset_by_us
        reset[stream_id] = None
        if len(reset) > RESET_MEMORY:
            del reset[next(iter(reset))]

    def close_connection(self, code: int = ErrorCode.NO_ERROR,
                         last_stream_id: int | None = None) -> None:
        """GOAWAY naming the last stream we took (by default the highest opened)."""
        if self.closed:
            return
        last = self.highest_inbound_stream_id if last_stream_id is None else last_stream_id
        self._write(frame(GOAWAY, 0, 0, GOAWAY_HEAD.pack(last, code)))
        self.closed = True
