"""The server side of an HTTP/2 connection (RFC 9113) as a state machine. Sans-I/O.

Bytes from the client go in (`receive_data`), events come out; calls that answer
(`send_headers`, `send_data`, `end_stream`, `reset_stream`, `close_connection`, ...)
queue frames that `data_to_send` hands over. Nothing here reads a clock or a socket.

What both ends of a connection do alike (reading frames, CONTINUATION, PING, SETTINGS,
WINDOW_UPDATE, RST_STREAM, our windows given back, resets) is `proto.h2_endpoint`, which
the node leg's client end (`proto.h2_client`) shares; this module is what only a
server does.

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

from pact_ingress.proto.h2_endpoint import Endpoint
from pact_ingress.proto.h2_frames import (
    DATA,
    DEFAULT_WINDOW,
    END_HEADERS,
    END_STREAM,
    GOAWAY_HEAD,
    HEAD,
    HEADERS,
    PREFACE,
    PRIORITY_FLAG,
    RST_STREAM,
    SETTING,
    SETTINGS,
    U32,
    ConnectionError_,
    DataReceived,
    ErrorCode,
    Event,
    Setting,
    StreamClosed,
    StreamEnded,
    StreamReset,
    UnknownFrame,
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


class H2Server(Endpoint):
    PUSH_MAX = 1
    PUSH_PROMISE_WHY = "PUSH_PROMISE from a client"

    def __init__(self, *, max_concurrent_streams: int = 100,
                 max_header_list_size: int = 16 * 1024,
                 initial_window: int = DEFAULT_WINDOW,
                 connection_window: int = DEFAULT_WINDOW) -> None:
        self._endpoint_init(initial_window, connection_window, DEFAULT_WINDOW // 2)
        self.max_concurrent_streams = max_concurrent_streams
        self.max_header_list_size = max_header_list_size
        self.highest_inbound_stream_id = 0
        self._preface = True  # the client preface is still expected
        # A list over `max_header_list_size` is still decoded whole, up to
        # `OVERSIZED_LISTS` times it, so the table stays the client's and only that
        # request is lost (431); past that the decoder stops mid-block and the
        # connection ends.
        self._decoder = hpack.Decoder(
            max_header_list_size=max_header_list_size * OVERSIZED_LISTS)
        # blocks decoded lately: the header list, its Content-Length, whether over the cap
        self._decoded: dict[bytes, tuple[list[tuple[bytes, bytes]], int | None, bool]] = {}

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
        self._raise_connection_window()

    def data_to_send(self) -> bytes:
        data = bytes(self.out)
        self.out.clear()
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
        try:
            pos = self._frames(buf, pos, events)
        except ConnectionError_:
            self._buf = b""
            raise
        self._buf = buf[pos:] if pos < len(buf) else b""
        return events

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
        self._gather(sid, flags, block)

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

    # -- the hooks of `Endpoint` --------------------------------------------------------

    def _idle(self, sid: int) -> bool:
        return sid > self.highest_inbound_stream_id

    def _goaway(self, payload: bytes, events: list[Event]) -> None:
        events.append(GoAwayReceived(GOAWAY_HEAD.unpack_from(payload)[1]))

    def _last_stream_id(self) -> int:
        return self.highest_inbound_stream_id

    # -- sending ----------------------------------------------------------------------

    def _sendable(self, stream_id: int) -> Stream:
        stream = self.streams.get(stream_id)
        if stream is None or not stream.local_open or self.closed:
            raise StreamClosed(f"stream {stream_id} is closed")
        return stream

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
        self._send_head(stream_id, headers, end_stream)
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
