"""The server side of HTTP/1.1 as a sans-I/O state machine over llhttp (`httptools`).

Why llhttp and not h11: the terminating edge parses every request, and h11's pure-Python
validation was most of the per-request cost of the client leg; llhttp (Node's parser, in
C) is strict by default — it refuses `Content-Length` with `Transfer-Encoding`, duplicate
`Content-Length`, folded lines, bare LF, whitespace before a colon, control bytes — and
costs a few microseconds. `httptools` exposes it as a callback parser; this module turns
the callbacks into events, adds what llhttp leaves to its caller, and serialises
responses:

* `feed(bytes)` parses; `next_event()` returns `Request`, `Data`, `EndOfMessage` or
  `NEED_DATA`. Pipelined requests queue up as events; the caller bounds how much it
  reads ahead.
* Caps llhttp lacks: a head (request line + fields) over `MAX_HEAD_BYTES` is a 431,
  more than `MAX_FIELDS` fields a 431 (llhttp itself would accumulate a value of any
  size before calling back); the same for trailer fields, and chunk framing plus
  trailers may not exceed `MAX_HEAD_BYTES` beyond the body bytes they carry.
* Refusals on top of llhttp's: more than one `Host`; a transfer coding other than a
  single `chunked`, counted over every `Transfer-Encoding` field (a node might decode
  `gzip, chunked` differently); an upgrade or `CONNECT` (not offered here); `Expect`
  other than `100-continue` (417).
* Trailer fields of a chunked request are dropped: nothing downstream reads them.

Errors raise `ParseError` with the HTTP status to answer; after one, the connection is
closed (no event follows). A refused head yields no event at all, and parsing stops at it:
the caller serves the events queued before an error first, so neither the refused request
nor one pipelined behind it may be among them.
"""

from __future__ import annotations

import collections
import enum
import http
from dataclasses import dataclass

import httptools

from pact_ingress.proto import llhttp
from pact_ingress.proto.http_request import declared_length

#: A request head larger than this is refused with 431; MCP and browser heads are a few
#: KiB, and every connection may hold one incomplete head in memory.
MAX_HEAD_BYTES = 16 * 1024
#: Header fields per request; real clients send a dozen or two.
MAX_FIELDS = 100

Headers = list[tuple[bytes, bytes]]


class ParseError(Exception):
    def __init__(self, status: int, why: str) -> None:
        super().__init__(why)
        self.status = status
        self.why = why


@dataclass(slots=True)
class Request:
    method: str
    target: bytes
    headers: Headers  # lower-case names, in order
    http_version: str  # "1.1" or "1.0"
    content_length: int | None
    chunked: bool
    expects_continue: bool
    keep_alive: bool  # the client allows another request on this connection
    host: bytes | None = None  # the Host field's value (there is at most one)


@dataclass(frozen=True)
class Data:
    data: bytes


class EndOfMessage:
    pass


class _Need:
    def __repr__(self) -> str:
        return "NEED_DATA"


NEED_DATA = _Need()


class _Incomplete:
    def __repr__(self) -> str:
        return "INCOMPLETE"


INCOMPLETE = _Incomplete()
END_OF_MESSAGE = EndOfMessage()
Event = Request | Data | EndOfMessage | _Need


#: Method names as str, without decoding the common ones per request.
_METHODS = {m: m.decode("ascii") for m in (
    b"GET", b"HEAD", b"POST", b"PUT", b"DELETE", b"OPTIONS", b"PATCH")}


class _Phase(enum.Enum):
    IDLE = "idle"  # between messages
    HEAD = "head"  # request line and fields arriving
    BODY = "body"  # body arriving


#: The members as plain globals, for the callbacks below that run for every request: on
#: Python 3.11 an Enum class attribute (`_Phase.HEAD`) goes through the metaclass's
#: `__getattr__` hook, about ten times the cost of a global load.
_IDLE, _HEAD, _BODY = _Phase.IDLE, _Phase.HEAD, _Phase.BODY


class H1ServerParser:
    def __init__(self) -> None:
        self._parser = httptools.HttpRequestParser(self)
        self._events: collections.deque[Request | Data | EndOfMessage] = collections.deque()
        self._phase = _IDLE
        self._head_bytes = 0
        self._head_size = 0  # of the current head as parsed, whatever the reads were
        self._target = bytearray()
        self._fields: Headers = []
        self._broken: ParseError | None = None
        self.closed = False  # the client ended its side
        self._trailer_fields = 0
        self._body_bytes = 0  # of the current message
        self._body_phase_bytes = 0  # fed while its body (framing, trailers) was arriving

    # -- feeding --------------------------------------------------------------------------

    def feed(self, data: bytes) -> None:
        """Parse `data` (b"" = the client closed); raises `ParseError`."""
        if self._broken is not None:
            raise self._broken
        if not data:
            self.closed = True
            if self._phase is not _IDLE:
                self._fail(400, "connection closed mid-request")
                raise self._broken  # type: ignore[misc]
            return
        if self._phase is not _BODY:
            self._head_bytes += len(data)
        else:
            self._body_phase_bytes += len(data)
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(501, "protocol upgrades and CONNECT are not offered here")
        except httptools.HttpParserError as exc:
            self._fail(400, f"malformed request: {exc}")
        if self._broken is not None:
            raise self._broken
        if self._phase is not _BODY and self._head_bytes > MAX_HEAD_BYTES:
            self._fail(431, "request head too large")
            raise self._broken  # type: ignore[misc]
        if self._phase is _BODY and (self._body_phase_bytes - self._body_bytes
                                     > MAX_HEAD_BYTES + self._body_bytes):
            # chunk framing and trailers beyond any real client's: llhttp would go on
            # accumulating a trailer value of any size, quadratically
            self._fail(431, "chunk framing or trailer section too large")
            raise self._broken  # type: ignore[misc]

    def _fail(self, status: int, why: str) -> None:
        if self._broken is None:
            self._broken = ParseError(status, why)

    def discard(self) -> None:
        """The connection is gone: nothing more is parsed (a feed raises `ParseError`).
        llhttp's parser holds this object's callbacks and this object holds the parser,
        a cycle that only the cyclic collector would free; dropping the parser here lets
        both go by reference counting, as the connection closes."""
        self._fail(400, "connection discarded")
        self.closed = True
        self._events.clear()
        self._parser = None  # type: ignore[assignment]

    def next_event(self) -> Event:
        return self._events.popleft() if self._events else NEED_DATA

    def whole_message(self) -> tuple[Request, bytes, int] | _Incomplete | None:
        """The next message when all of it is parsed already, without taking it: its
        request, its body and the number of events it spans (for `drop`); `INCOMPLETE`
        when something is here but not a whole message (a head or a body still
        arriving, what is left of one); None when nothing is."""
        events = self._events
        if len(events) < 2:
            return INCOMPLETE if events or self._phase is _HEAD else None
        request = events[0]
        if not isinstance(request, Request):
            return INCOMPLETE
        if events[1] is END_OF_MESSAGE:  # the usual message: no body
            return request, b"", 2
        parts = []
        for count, event in enumerate(events):
            if event is END_OF_MESSAGE:
                return request, b"".join(parts), count + 1
            if isinstance(event, Data):
                parts.append(event.data)
            elif count:
                return INCOMPLETE
        return INCOMPLETE

    def drop(self, count: int) -> None:
        """Take the first `count` events (a message `whole_message` returned)."""
        events = self._events
        for _ in range(count):
            events.popleft()

    @property
    def queued(self) -> bool:
        """Events wait to be taken."""
        return bool(self._events)

    @property
    def in_head(self) -> bool:
        """A request head has begun and is not complete yet."""
        return self._phase is _HEAD

    # -- llhttp callbacks -----------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._phase = _HEAD
        self._head_size = 0
        self._target.clear()
        self._fields = []
        self._trailer_fields = 0
        self._body_bytes = 0
        self._body_phase_bytes = 0

    # A head that arrives whole in one read completes inside one feed, so the cap after
    # each feed never sees it: the head is counted as it is parsed too (inline, as the
    # callbacks run for every field of every request).

    def on_url(self, url: bytes) -> None:
        self._target += url
        self._head_size += len(url)
        if self._head_size > MAX_HEAD_BYTES:
            self._head_too_large()

    def _head_too_large(self) -> None:
        self._fail(431, "request head too large")
        raise self._broken  # type: ignore[misc]  # stops llhttp at this message

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._phase is not _HEAD:  # a trailer field: counted, then dropped
            self._trailer_fields += 1
            if self._trailer_fields > MAX_FIELDS:
                self._fail(431, "too many trailer fields")
            return
        if len(self._fields) >= MAX_FIELDS:
            self._fail(431, "too many header fields")
            return
        self._head_size += len(name) + len(value) + 4  # ": " and CRLF
        if self._head_size > MAX_HEAD_BYTES:
            self._head_too_large()
        self._fields.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self._phase = _BODY
        self._head_bytes = 0
        fields = self._fields
        hosts = 0
        length = transfer = expect = host = None
        connection = False
        for name, value in fields:
            if name == b"host":
                hosts += 1
                host = value
            elif name == b"content-length":
                # llhttp accepted it: digits, one field (with any number of leading
                # zeros, which int() refuses past 4300 digits)
                length = declared_length(value)
            elif name == b"transfer-encoding":  # every field counts: gzip + chunked is two
                transfer = value if transfer is None else transfer + b"," + value
            elif name == b"expect":
                expect = value
            elif name == b"connection" or name == b"proxy-connection":
                connection = True
        parser = self._parser
        keep_alive = parser.should_keep_alive()
        version = llhttp.version(parser, keep_alive, connection)
        if hosts > 1:
            self._fail(400, "more than one Host field")
        elif transfer is not None and [t.strip() for t in transfer.lower().split(b",")] != [
                b"chunked"]:
            self._fail(501, "transfer codings other than chunked are not accepted")
        elif expect is not None and expect.strip().lower() != b"100-continue":
            self._fail(417, "only 100-continue is understood")
        elif not hosts and version != "1.0":
            self._fail(400, "no Host field")
        elif parser.should_upgrade():
            self._fail(501, "protocol upgrades and CONNECT are not offered here")
        if self._broken is not None:
            # a refused head yields no event, and llhttp stops here: nothing of it, and
            # nothing pipelined behind it, may be served before the refusal
            raise self._broken
        method = parser.get_method()
        name = _METHODS.get(method)
        if name is None:
            name = method.decode("ascii")
        self._events.append(Request(
            name, bytes(self._target), fields, version, length, transfer is not None,
            expect is not None and version == "1.1", keep_alive, host))

    def on_body(self, body: bytes) -> None:
        self._body_bytes += len(body)
        self._events.append(Data(bytes(body)))

    def on_message_complete(self) -> None:
        self._phase = _IDLE
        self._events.append(END_OF_MESSAGE)


# --- responses -------------------------------------------------------------------------------

CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
LAST_CHUNK = b"0\r\n\r\n"


class Framing(enum.Enum):
    NONE = "none"  # HEAD, 1xx, 204, 304: no body whatever the fields say
    LENGTH = "length"  # Content-Length from the fields
    CHUNKED = "chunked"
    CLOSE = "close"  # HTTP/1.0 client, no length: the body ends with the connection


#: The members as plain globals, for the same reason as `_Phase`'s: every answer is
#: framed here.
FRAMING_NONE, FRAMING_LENGTH, FRAMING_CHUNKED, FRAMING_CLOSE = (
    Framing.NONE, Framing.LENGTH, Framing.CHUNKED, Framing.CLOSE)


_REASONS = {int(s): s.phrase.encode("ascii") for s in http.HTTPStatus}


def reason(status: int) -> bytes:
    return _REASONS.get(status, b"Unknown")


def response_framing(request_method: str, http_version: str, status: int,
                     headers: Headers) -> Framing:
    if request_method == "HEAD" or status < 200 or status in (204, 304):
        return FRAMING_NONE
    for name, _ in headers:
        if name == b"content-length":
            return FRAMING_LENGTH
    return FRAMING_CHUNKED if http_version == "1.1" else FRAMING_CLOSE


#: Status lines by status, made on first use.
_STATUS_LINES: dict[int, bytes] = {}


def response_head(status: int, headers: Headers, framing: Framing, *, close: bool) -> bytes:
    """The status line and fields; `headers` must carry no framing but Content-Length."""
    line = _STATUS_LINES.get(status)
    if line is None:
        line = b"HTTP/1.1 %d %s\r\n" % (status, reason(status))
        if 100 <= status <= 999:
            _STATUS_LINES[status] = line
    parts = [line]
    if framing is FRAMING_LENGTH:
        for name, value in headers:
            parts += (name, b": ", value, b"\r\n")
    else:
        for name, value in headers:
            if name != b"content-length":
                parts += (name, b": ", value, b"\r\n")
        if framing is FRAMING_CHUNKED:
            parts.append(b"transfer-encoding: chunked\r\n")
    if close or framing is FRAMING_CLOSE:
        parts.append(b"connection: close\r\n")
    parts.append(b"\r\n")
    return b"".join(parts)


def whole_response(request_method: str, http_version: str, status: int, headers: Headers,
                   body: bytes, *, close: bool) -> tuple[bytes, Framing]:
    """A whole answer's bytes for one write, and the framing it got."""
    framing = response_framing(request_method, http_version, status, headers)
    head = response_head(status, headers, framing, close=close)
    if framing is FRAMING_LENGTH or framing is FRAMING_CLOSE:
        return (head + body if body else head), framing
    if framing is FRAMING_CHUNKED:
        return (head + chunk(body) + LAST_CHUNK if body else head + LAST_CHUNK), framing
    return head, framing


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)
