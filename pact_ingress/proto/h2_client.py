"""The client side of an HTTP/2 connection (RFC 9113) to a node, as a state machine.
Sans-I/O.

Requests go in (`send_request`, `send_data`), frames come out (`take_output`); bytes
from the node go in (`receive_data`), events come out. Nothing here reads a clock or a
socket. It is the node leg's end of the protocol whose front end is `proto.h2_server`;
both take the wire's vocabulary from `proto.h2_frames` and what they do alike from
`proto.h2_endpoint`; this module is what only a client does.

Written here rather than driving the `h2` library for the reason the server side is:
h2 makes some 900 Python calls per request for its two ends together, more than a whole
HTTP/1.1 exchange costs at the edge. Only what a client that never accepts a push needs
is here. Request blocks are encoded by `proto.h2_hpack` (no dynamic table, no Huffman);
response blocks are decoded by `hpack.Decoder`, and we ask the node for a dynamic table
of 0 bytes (SETTINGS_HEADER_TABLE_SIZE), so that after its first block every block
stands alone: the same bytes mean the same header list, and a node's repeated answers
are decoded and checked once (`_decode`, a small cache per connection).

What is enforced, and how it fails:

- the node's preface is a SETTINGS frame; frame sizes against the 16,384 bytes we take
  and the fixed sizes of PRIORITY, RST_STREAM, PING, WINDOW_UPDATE and SETTINGS
  (FRAME_SIZE_ERROR); padding longer than its frame; SETTINGS values in range, and
  ENABLE_PUSH never 1 from a server;
- stream ids: the node may only answer streams we opened. HEADERS or DATA on an even
  id or an id we never used, PUSH_PROMISE (push is off), CONTINUATION out of place or
  interleaved are connection errors (PROTOCOL_ERROR); a frame on a stream that ended
  both ways is STREAM_CLOSED. Frames on a stream we reset are ignored for a while
  (`RESET_MEMORY`): the node may have sent them before it saw the reset;
- header blocks: a cap on the compressed block and on its CONTINUATION frames
  (ENHANCE_YOUR_CALM), on the decoded list (`max_header_list_size`, as the HTTP/1.1 node
  leg caps a head: over it the stream is reset, far over it the connection ends), a
  block that cannot be decoded is a COMPRESSION_ERROR. Every block is decoded, even on
  a stream we reset, so the decoder stays in step with the node;
- the response itself (`split_response`): one `:status`, three digits, first; names
  lower-case tokens; no control character but HTAB in a value, none starting or ending
  with whitespace (the head may go on to an HTTP/1.1 client, where a CR or LF would
  split it); no connection-specific field; Content-Length fields that agree. Then: no
  DATA before the final head, none on a HEAD request or a 204/304, the DATA received
  against Content-Length, trailers that end the stream and carry no pseudo-header,
  informational (1xx) heads at most `MAX_INTERIM` and never 101. A malformed response
  is a stream error (RST_STREAM(PROTOCOL_ERROR), reported as `StreamReset(remote=False)`),
  so the node's other streams go on;
- flow control both ways: DATA beyond the windows we advertised is a FLOW_CONTROL_ERROR;
  our windows go back to the node (WINDOW_UPDATE) only as the caller acknowledges what
  it passed on (`acknowledge`), so a caller that stops taking a stream's answer stops
  the node sending it; what we send keeps to the node's windows: request bodies wait in
  the stream (`pending`) until a WINDOW_UPDATE or a larger initial window lets them go;
- concurrency: a stream is opened only while the node's SETTINGS_MAX_CONCURRENT_STREAMS
  (and our own `max_concurrent_streams`) allow it (`can_open`); after GOAWAY none is,
  and the streams the node says it never processed are handed back
  (`GoAwayReceived.unprocessed`), as is a stream it refused (RST_STREAM with
  REFUSED_STREAM): both may be sent again on another connection.

A connection error queues GOAWAY and raises `ConnectionError_` (no frame is read after
it).
"""

from __future__ import annotations

from collections.abc import Iterable

import hpack

from pact_ingress.proto.h2_endpoint import Endpoint
from pact_ingress.proto.h2_frames import (
    DATA,
    END_HEADERS,
    END_STREAM,
    GOAWAY_HEAD,
    HEAD,
    HEADERS,
    MAX_STREAM_ID,
    MAX_WINDOW,
    PADDED,
    PREFACE,
    PRIORITY_FLAG,
    ConnectionError_,
    DataReceived,
    ErrorCode,
    Event,
    Setting,
    StreamClosed,
    StreamEnded,
    UnknownFrame,
    settings_frame,
    unpad,
)
from pact_ingress.proto.h2_request import (
    CONNECTION_SPECIFIC,
    CONTROL,
    FIELD_NAMES,
    WHITESPACE,
)
from pact_ingress.proto.http_request import declared_length
from pact_ingress.proto.http_upstream import MAX_HEAD_BYTES, MAX_HEADERS, MAX_INTERIM

Header = tuple[bytes, bytes]

#: The header list we take, counted as SETTINGS_MAX_HEADER_LIST_SIZE is (each field's
#: name and value plus 32): what the HTTP/1.1 node leg takes as a head.
MAX_HEADER_LIST = MAX_HEAD_BYTES + 32 * MAX_HEADERS
#: A list up to this many times the cap is decoded whole (the decoder stays in step) and
#: only its stream reset; beyond, the decoder stops mid-block and the connection ends.
OVERSIZED_LISTS = 4
#: Decoded and checked response blocks remembered per connection (see `_decode`).
DECODED_CACHE = 64
#: Responses without a body (RFC 9110 §6.4.1), whatever their Content-Length says.
_NO_CONTENT = frozenset({204, 304})


class MalformedResponse(ValueError):
    """The response header block breaks a rule of RFC 9113 §8.2/§8.3."""


def split_response(headers: Iterable[Header]) -> tuple[int, list[Header], int | None]:
    """The status, the ordinary fields (in order) and the Content-Length (None when
    there is none) of a well-formed response header block; `MalformedResponse`
    otherwise."""
    status: bytes | None = None
    fields: list[Header] = []
    length: bytes | None = None
    for name, value in headers:
        if value[:1] in WHITESPACE or value[-1:] in WHITESPACE:
            raise MalformedResponse(f"whitespace around the value of {name!r}")
        if name[:1] == b":":
            if fields:
                raise MalformedResponse(f"pseudo-header {name!r} after a regular field")
            if name != b":status":
                raise MalformedResponse(f"pseudo-header {name!r} not allowed in a response")
            if status is not None:
                raise MalformedResponse(":status repeated")
            status = value
            continue
        if name in CONNECTION_SPECIFIC:
            raise MalformedResponse(f"connection-specific field {name!r}")
        if name == b"content-length":
            if length is not None and value != length:
                raise MalformedResponse("Content-Length fields differ")
            length = value
        fields.append((name, value))
    if status is None or len(status) != 3 or not status.isdigit():
        raise MalformedResponse("no :status of three digits")
    if fields and not FIELD_NAMES.fullmatch(b",".join([n for n, _ in fields])):
        raise MalformedResponse("a field name is not a lower-case token")
    if CONTROL.search(b"\t".join([status, *(v for _, v in fields)])):
        raise MalformedResponse("a control character in a field value")
    declared = None
    if length is not None:
        declared = declared_length(length)
        if declared is None:
            raise MalformedResponse("Content-Length is not a number")
    return int(status), fields, declared


# -- events of this end ---------------------------------------------------------------

class ResponseReceived(Event):
    """The final response head of a stream (informational ones are not reported);
    `length`: its Content-Length, checked against the DATA (None: none, or an answer
    that carries no body)."""
    __slots__ = ("stream_id", "status", "headers", "ended", "length")

    def __init__(self, stream_id: int, status: int, headers: list[Header], ended: bool,
                 length: int | None = None):
        self.stream_id, self.status, self.headers, self.ended, self.length = (
            stream_id, status, headers, ended, length)


class GoAwayReceived(Event):
    """The node takes no new stream. `unprocessed`: our streams above its last stream
    id, which it never acted on; they are closed here and may be sent again elsewhere."""
    __slots__ = ("code", "last_stream_id", "unprocessed")

    def __init__(self, code: int, last_stream_id: int, unprocessed: list[int]):
        self.code, self.last_stream_id, self.unprocessed = code, last_stream_id, unprocessed


# -- streams --------------------------------------------------------------------------

class Stream:
    __slots__ = ("id", "bodiless", "local_open", "remote_open", "send_window",
                 "recv_window", "recv_processed", "pending", "pending_end", "status",
                 "interim", "content_length", "received")

    def __init__(self, stream_id: int, bodiless: bool, send_window: int,
                 recv_window: int) -> None:
        self.id = stream_id
        self.bodiless = bodiless  # a HEAD request: its answer carries no DATA
        self.local_open = True  # we may still send
        self.remote_open = True  # the node may still send
        self.send_window = send_window
        self.recv_window = recv_window  # what we still let the node send
        self.recv_processed = 0  # acknowledged since the last WINDOW_UPDATE
        self.pending = bytearray()  # request body waiting for the node's windows
        self.pending_end = False  # and END_STREAM after it
        self.status = 0  # the final status, once its head came
        self.interim = 0  # informational heads so far
        self.content_length: int | None = None
        self.received = 0


class _Block:
    """A decoded header block: its list, whether over the cap, and once asked for, its
    reading as a response head (`split_response`'s result, or None: malformed)."""
    __slots__ = ("headers", "oversized", "response")

    def __init__(self, headers: list[Header], oversized: bool) -> None:
        self.headers = headers
        self.oversized = oversized
        self.response: tuple[int, list[Header], int | None] | None | bool = False


class H2Client(Endpoint):
    PUSH_MAX = 0  # a server may only say 0 (RFC 9113 §6.5.2)
    PUSH_PROMISE_WHY = "PUSH_PROMISE, but push is off"

    def __init__(self, *, max_concurrent_streams: int = 100,
                 max_header_list_size: int = MAX_HEADER_LIST,
                 initial_window: int = 256 * 1024,
                 connection_window: int = 16 * 1024 * 1024) -> None:
        if not 0 <= initial_window <= MAX_WINDOW:
            raise ValueError("a stream window is at most 2**31 - 1")
        self._endpoint_init(initial_window, connection_window, connection_window // 2)
        self.max_concurrent_streams = max_concurrent_streams
        self.max_header_list_size = max_header_list_size
        self.next_stream_id = 1
        self.going_away = False  # GOAWAY received: no new stream
        self._decoder = hpack.Decoder(
            max_header_list_size=max_header_list_size * OVERSIZED_LISTS)
        self._decoder.max_allowed_table_size = 0  # what our SETTINGS ask for
        self._decoded: dict[bytes, _Block] = {}
        self._blocked: dict[int, None] = {}  # streams whose body waits for a window

    # -- set-up and output ------------------------------------------------------------

    def initiate_connection(self) -> None:
        """Queue the client preface: the magic, our SETTINGS, the connection window."""
        self.out += PREFACE
        self.out += settings_frame((
            (Setting.HEADER_TABLE_SIZE, 0),
            (Setting.ENABLE_PUSH, 0),
            (Setting.INITIAL_WINDOW_SIZE, self._recv_initial),
            (Setting.MAX_HEADER_LIST_SIZE, self.max_header_list_size),
        ))
        self._raise_connection_window()

    # -- opening streams ----------------------------------------------------------------

    def can_open(self) -> bool:
        """May a new stream be opened on this connection now?"""
        return (not self.closed and not self.going_away
                and self.next_stream_id <= MAX_STREAM_ID
                and len(self.streams) < min(self.peer_max_concurrent_streams,
                                            self.max_concurrent_streams))

    def send_request(self, headers: list[Header], end_stream: bool = True) -> int:
        """Open a stream with the request head `headers` (pseudo-header fields first,
        names lower case, as the caller built them); its id. `StreamClosed` when no
        stream can be opened (see `can_open`)."""
        sid = self.next_stream_id
        if (self.closed or self.going_away or sid > MAX_STREAM_ID  # `can_open`, inline
                or len(self.streams) >= self.peer_max_concurrent_streams
                or len(self.streams) >= self.max_concurrent_streams):
            raise StreamClosed("no new stream on this connection")
        self.next_stream_id += 2
        method = headers[0]  # the pseudo-header fields come first, `:method` usually so
        bodiless = (method == (b":method", b"HEAD") if method[0] == b":method"
                    else (b":method", b"HEAD") in headers)
        stream = Stream(sid, bodiless, self._send_initial, self._recv_initial)
        self.streams[sid] = stream
        self._send_head(sid, headers, end_stream)
        if end_stream:
            self._local_end(stream)
        return sid

    # -- sending a request body -------------------------------------------------------

    def send_data(self, stream_id: int, data: bytes, end_stream: bool = False) -> None:
        """Queue `data` (and END_STREAM) on the stream: what the node's windows allow
        goes out now, the rest when they open (`pending`)."""
        stream = self.streams.get(stream_id)
        if stream is None or not stream.local_open or stream.pending_end or self.closed:
            raise StreamClosed(f"stream {stream_id} takes no more data")
        stream.pending += data
        stream.pending_end = end_stream
        self._flush(stream)

    def pending(self, stream_id: int) -> int:
        """Bytes of the stream's body still waiting for the node's windows."""
        stream = self.streams.get(stream_id)
        return len(stream.pending) if stream is not None else 0

    def _flush(self, stream: Stream) -> None:
        pending = stream.pending
        while pending:
            n = min(len(pending), stream.send_window, self.conn_send_window,
                    self.max_outbound_frame_size)
            if n <= 0:
                self._blocked[stream.id] = None
                return
            last = n == len(pending) and stream.pending_end
            self.out += HEAD.pack(n << 8 | DATA, END_STREAM if last else 0, stream.id)
            self.out += pending[:n]
            del pending[:n]
            stream.send_window -= n
            self.conn_send_window -= n
            if last:
                self._blocked.pop(stream.id, None)
                self._local_end(stream)
                return
        self._blocked.pop(stream.id, None)
        if stream.pending_end and stream.local_open:
            self.out += HEAD.pack(0 << 8 | DATA, END_STREAM, stream.id)
            self._local_end(stream)

    def _flush_blocked(self) -> None:
        for sid in list(self._blocked):
            stream = self.streams.get(sid)
            if stream is None:
                self._blocked.pop(sid, None)
                continue
            if self.conn_send_window <= 0:
                return
            self._flush(stream)

    # -- receiving --------------------------------------------------------------------

    def receive_data(self, data: bytes) -> list[Event]:
        """Events for the frames completed by `data`; `ConnectionError_` (GOAWAY queued)
        when the node broke the protocol."""
        if self.closed:
            return []
        buf = self._buf + data if self._buf else data
        events: list[Event] = []
        try:
            pos = self._frames(buf, 0, events)
        except ConnectionError_:
            self._buf = b""
            raise
        self._buf = buf[pos:] if pos < len(buf) else b""
        if self._blocked and not self.closed:
            self._flush_blocked()
        return events

    def _ours(self, sid: int, what: str) -> None:
        """A frame on stream `sid` names a stream we opened, or the node broke the
        protocol."""
        if not sid & 1 or sid >= self.next_stream_id:
            self._fail(ErrorCode.PROTOCOL_ERROR, f"{what} on a stream we never opened")

    def _headers(self, flags: int, sid: int, payload: bytes, events: list[Event]) -> None:
        self._ours(sid, "HEADERS")
        block = unpad(flags, payload) if flags & PADDED else payload
        if block is None:
            self._fail(ErrorCode.PROTOCOL_ERROR, "padding longer than the frame")
        if flags & PRIORITY_FLAG:
            if len(block) < 5:
                self._fail(ErrorCode.FRAME_SIZE_ERROR, "HEADERS too short for its priority")
            block = block[5:]
        if flags & END_HEADERS:
            self._header_block(sid, flags, block, events)
            return
        self._gather(sid, flags, block)

    def _decode(self, block: bytes) -> _Block:
        """The header list of `block`, and whether it is over `max_header_list_size`
        (or `MAX_HEADERS` fields). While the decoder's dynamic table is empty before and
        after a block, the same bytes mean the same list, so it is remembered, with its
        reading as a response head once made; with the table of 0 bytes we ask for,
        that is every block after the node's first."""
        known = self._decoded.get(block)
        if known is not None:
            return known
        table = self._decoder.header_table
        empty = not table.dynamic_entries
        try:
            headers = self._decoder.decode(block, raw=True)
        except hpack.OversizedHeaderListError:
            self._fail(ErrorCode.ENHANCE_YOUR_CALM, "header list too large")
        except (hpack.HPACKError, IndexError, ValueError, TypeError):
            self._fail(ErrorCode.COMPRESSION_ERROR, "header block cannot be decoded")
        size = sum(len(name) + len(value) + 32 for name, value in headers)
        known = _Block(headers, size > self.max_header_list_size
                       or len(headers) > MAX_HEADERS + 1)
        if empty and not table.dynamic_entries:
            if len(self._decoded) >= DECODED_CACHE:
                self._decoded.clear()
            self._decoded[block] = known
        return known

    def _header_block(self, sid: int, flags: int, block: bytes, events: list[Event]) -> None:
        decoded = self._decode(block)
        ended = bool(flags & END_STREAM)
        stream = self.streams.get(sid)
        if stream is None or not stream.remote_open:
            if sid in self._reset_by_us:
                events.append(UnknownFrame(HEADERS))  # sent before the node saw our reset
                return
            self._fail(ErrorCode.STREAM_CLOSED, "HEADERS on a stream that ended")
        if decoded.oversized:
            self._stream_error(sid, ErrorCode.PROTOCOL_ERROR, events)
            return
        if stream.status:  # trailers
            if not ended or any(name[:1] == b":" for name, _ in decoded.headers):
                self._stream_error(sid, ErrorCode.PROTOCOL_ERROR, events)
                return
            if not self._length_kept(stream, ended=True):
                self._stream_error(sid, ErrorCode.PROTOCOL_ERROR, events)
                return
            self._remote_end(stream)
            events.append(StreamEnded(sid))
            return
        response = decoded.response
        if response is False:
            try:
                response = split_response(decoded.headers)
            except MalformedResponse:
                response = None
            decoded.response = response
        if response is None:
            self._stream_error(sid, ErrorCode.PROTOCOL_ERROR, events)
            return
        status, fields, length = response  # type: ignore[misc]
        if status < 200:
            stream.interim += 1
            if ended or status == 101 or status < 100 or stream.interim > MAX_INTERIM:
                self._stream_error(sid, ErrorCode.PROTOCOL_ERROR, events)
            return  # informational: the final head is still to come
        stream.status = status
        if stream.bodiless or status in _NO_CONTENT:
            stream.bodiless = True
        else:
            stream.content_length = length
        if ended:
            if not self._length_kept(stream, ended=True):
                self._stream_error(sid, ErrorCode.PROTOCOL_ERROR, events)
                return
            self._remote_end(stream)
        events.append(ResponseReceived(sid, status, list(fields), ended,
                                       stream.content_length))

    @staticmethod
    def _length_kept(stream: Stream, ended: bool) -> bool:
        """Does the DATA received so far agree with the answer's Content-Length?"""
        expected = stream.content_length
        if expected is None:
            return True
        return stream.received == expected if ended else stream.received <= expected

    def _data(self, flags: int, sid: int, payload: bytes, events: list[Event]) -> None:
        if not sid & 1 or sid >= self.next_stream_id:  # `_ours`, inline: every answer's
            self._fail(ErrorCode.PROTOCOL_ERROR, "DATA on a stream we never opened")
        length = len(payload)
        if length > self._conn_recv_window:
            self._fail(ErrorCode.FLOW_CONTROL_ERROR, "DATA beyond the connection window")
        self._conn_recv_window -= length
        data = unpad(flags, payload) if flags & PADDED else payload
        if data is None:
            self._fail(ErrorCode.PROTOCOL_ERROR, "padding longer than the frame")
        stream = self.streams.get(sid)
        if stream is None or not stream.remote_open:
            if sid not in self._reset_by_us:
                self._fail(ErrorCode.STREAM_CLOSED, "DATA on a stream that ended")
            # reset by us, and the node had not seen it yet: its window given back at
            # once; reported with nothing owed, so the caller's meters still see it
            self.acknowledge(length, sid)
            events.append(DataReceived(sid, data, 0, bool(flags & END_STREAM)))
            return
        if length > stream.recv_window:
            self._fail(ErrorCode.FLOW_CONTROL_ERROR, "DATA beyond the stream window")
        stream.recv_window -= length
        stream.received += len(data)
        ended = bool(flags & END_STREAM)
        expected = stream.content_length
        if (not stream.status or (stream.bodiless and stream.received)
                or (expected is not None and (stream.received > expected
                                              or (ended and stream.received != expected)))):
            self.acknowledge(length, sid)
            self._stream_error(sid, ErrorCode.PROTOCOL_ERROR, events)
            return
        if ended:
            self._remote_end(stream)
        events.append(DataReceived(sid, data, length, ended))

    def _settings(self, flags: int, sid: int, payload: bytes, events: list[Event]) -> None:
        super()._settings(flags, sid, payload, events)
        for stream in self.streams.values():
            if stream.pending:  # (a larger initial window may let it go)
                self._blocked[stream.id] = None

    def _goaway(self, payload: bytes, events: list[Event]) -> None:
        last, code = GOAWAY_HEAD.unpack_from(payload)
        last &= 0x7FFFFFFF
        self.going_away = True
        unprocessed = [s for s in self.streams if s > last]
        for s in unprocessed:
            del self.streams[s]
            self._blocked.pop(s, None)
        events.append(GoAwayReceived(code, last, unprocessed))

    # -- the hooks of `Endpoint` --------------------------------------------------------

    def _idle(self, sid: int) -> bool:
        return not sid & 1 or sid >= self.next_stream_id

    def _forget(self, sid: int) -> None:
        self._blocked.pop(sid, None)

    def _last_stream_id(self) -> int:
        return 0  # the node opens no streams
