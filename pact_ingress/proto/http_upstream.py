"""HTTP/1.1 toward the home node, without I/O: the request head we write, the response we read.

`request_head` serialises a request the edge has already cleaned (`clean_request_headers`)
and framed. `ResponseParser` is fed the bytes the node sends and exposes the final
response's status and headers, its body in pieces, whether it has ended and whether the
connection may carry another request. The framing itself (Content-Length, chunked with
trailers, close-delimited, no body for 1xx/204/304) is llhttp's, through `httptools`:
llhttp is strict by default (CL together with TE, duplicate CL, obs-fold, bare LF and
bad chunk sizes are errors) and parses in C, where h11's pure-Python state machine cost
several times as much per response. What llhttp cannot be told — that a response to HEAD
has no body whatever its Content-Length says — and the bounds llhttp does not keep (head
size, header count, number of interim responses, the size of one chunk-size line or of
the trailers) are kept here.
"""

from __future__ import annotations

import httptools

from pact_ingress.proto import llhttp

#: Bytes of response head (interim 1xx heads included) we accept before the final head
#: is complete: generous for any real node, small enough that a node cannot make the
#: edge hold megabytes per connection before a single body byte.
MAX_HEAD_BYTES = 64 * 1024
#: Bytes the node may send after the head without any of them being body or a complete
#: chunk-size line: one chunk-size line (extensions included) or the trailer section
#: must fit. httptools gathers a trailer field's value in one growing bytes object, so
#: without this bound a node could make the edge hold (and copy over and over) a value
#: of any size.
MAX_FRAMING_BYTES = MAX_HEAD_BYTES
#: Header fields in one response, trailers included.
MAX_HEADERS = 128
#: Interim (1xx) responses skipped before the final one; a node looping on 103 Early
#: Hints would otherwise keep a request open without ever answering it.
MAX_INTERIM = 8


class ResponseError(Exception):
    """The node's response is not HTTP/1.1 we can relay (malformed, too large, upgrade)."""


class _HeadOnly(Exception):
    """Stops llhttp after the head of a response to HEAD (which has no body)."""


def request_head(method: str, target: bytes, headers: list[tuple[bytes, bytes]]) -> bytes:
    """The request line and header block; refuses anything that would split the head.

    The headers come from parsers that already reject CR and LF in names and values;
    counting line ends on the finished head is a cheap last guard against a request
    that would smuggle a second one onto a pooled connection.
    """
    parts = [method.encode("ascii"), b" ", target, b" HTTP/1.1\r\n"]
    for name, value in headers:
        parts += (name, b": ", value, b"\r\n")
    parts.append(b"\r\n")
    head = b"".join(parts)
    lines = len(headers) + 2
    # (`find`, not `in`: `bytes in bytes` first tries the needle as an integer and
    # builds and clears a TypeError, several times the cost of the search)
    if head.count(b"\n") != lines or head.count(b"\r") != lines or target.find(b" ") != -1:
        raise ValueError("request head would contain a bare line break or a split target")
    return head


class ResponseParser:
    """One response from the node, fed as it arrives (see module docstring).

    After `head_done`: `status`, `headers` (names lower-cased), `version` ("HTTP/1.1").
    `take_body()` returns the body bytes parsed so far; `done` once the response ended;
    `keep_alive` says whether the connection may be pooled afterwards.
    """

    def __init__(self, method: str, *, keep: bool = False) -> None:
        self._parser: httptools.HttpResponseParser | None = None
        #: the llhttp parser stays when the answer ends, for the next one (`restart`);
        #: whoever holds this parser then breaks the cycle itself (`discard`)
        self.keep = keep
        self.restart(method)

    def restart(self, method: str) -> None:
        """Ready for the next answer, to a request with `method`. After an answer that
        ended whole and left llhttp waiting at the start of a message (`keep` parsers,
        `keep_alive`, and llhttp's own keep-alive: it closes on fields this parser does
        not read, such as `Proxy-Connection: close`), llhttp's parser goes on: making it
        anew (its callbacks looked up, its C state allocated) is a good part of a small
        answer's whole parse. Otherwise a new one parses."""
        if self._parser is None or not (self._resumable and self.keep_alive):
            self._parser = httptools.HttpResponseParser(self)
        # (both set as this answer's head and end are parsed: llhttp's own keep-alive,
        # and whether llhttp then waits at the start of a message)
        self._llhttp_keeps = self._resumable = False
        self._head_only = method == "HEAD"
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.version = "HTTP/1.1"
        self.head_done = False
        self.done = False
        self.keep_alive = True
        self.received = 0  # bytes fed: a connection that never answered may be stale
        self._pieces: list[bytes] = []
        self._interim = 0
        self._in_interim = False
        self._close_delimited = False
        self._header_count = 0
        self._progress_at = 0  # `received` after the last feed that moved the body on
        self._progress = False  # a callback of this feed moved it on

    # -- feeding --------------------------------------------------------------------------

    def feed(self, data: bytes) -> None:
        """Parse bytes from the node; raises `ResponseError` when they are not HTTP."""
        self.received += len(data)
        if self.done:
            self.keep_alive = False  # bytes after the response: nothing may follow on it
            return
        if not self.head_done and self.received > MAX_HEAD_BYTES:
            raise ResponseError(f"response head over {MAX_HEAD_BYTES} bytes")
        if self.head_done and self.received - self._progress_at > MAX_FRAMING_BYTES:
            # a chunk-size line or trailers beyond any real node's (see MAX_FRAMING_BYTES)
            raise ResponseError("chunk framing or trailers of the response too large")
        try:
            self._parser.feed_data(data)
            if self._progress:
                self._progress = False
                self._progress_at = self.received
        except _HeadOnly:
            pass
        except httptools.HttpParserUpgrade as exc:
            raise ResponseError("the node switched protocols") from exc
        except httptools.HttpParserError as exc:
            if self.done:  # garbage after a complete response ends the connection only
                self.keep_alive = False
                return
            cause = exc.__context__
            if isinstance(cause, ResponseError):
                raise cause from None
            if isinstance(cause, _HeadOnly):
                return
            raise ResponseError(f"malformed response: {exc}") from exc

    def feed_eof(self) -> None:
        """The node closed the connection: the end of a close-delimited body, else an error."""
        self.keep_alive = False
        if self.done:
            return
        if self.head_done and self._close_delimited:
            self.done = True
            return
        raise ResponseError("the node closed the connection before the response ended"
                            if self.head_done else
                            "the node closed the connection before a response head")

    def take_body(self) -> bytes:
        pieces = self._pieces
        if not pieces:
            return b""
        self._pieces = []
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    # -- llhttp callbacks ---------------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self.done:
            # another message after the response: nothing of it is parsed (its body
            # would join this one's), and nothing may follow on this connection
            self.keep_alive = False
            self._resumable = False
            raise ResponseError("bytes after the response")

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        if self._header_count > MAX_HEADERS:
            raise ResponseError(f"more than {MAX_HEADERS} response header fields")
        if not self.head_done:  # trailers are dropped: nothing downstream relays them
            self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if status == 101:
            raise ResponseError("the node switched protocols")
        if status < 200:
            self._interim += 1
            if self._interim > MAX_INTERIM:
                raise ResponseError(f"more than {MAX_INTERIM} interim responses")
            self.headers = []
            self._header_count = 0
            self._in_interim = True
            return
        self.status = status
        self.head_done = True
        self._progress = True
        connection = b""
        codings = b""
        framed = status in (204, 304)
        proxy_connection = False
        for name, value in self.headers:
            if name == b"connection":
                connection += b"," + value.lower()
            elif name == b"proxy-connection":
                proxy_connection = True
            elif name == b"content-length":
                framed = True
            elif name == b"transfer-encoding":
                framed = True
                codings += b"," + value.lower()
        if codings and [c for c in (t.strip() for t in codings.split(b",")) if c] != [
                b"chunked"]:
            # the edge takes off chunked only; any other coding is hop-by-hop (the
            # client would not be told of it) and its bytes would pass for the content
            raise ResponseError("a transfer coding other than chunked")
        llhttp_keeps = self._parser.should_keep_alive()
        version = llhttp.version(self._parser, llhttp_keeps,
                                 bool(connection) or proxy_connection)
        self.version = f"HTTP/{version}"
        if version != "1.1" or (connection and b"close" in [
                t.strip() for t in connection.split(b",")]):
            self.keep_alive = False
        if self._head_only:
            # llhttp would wait for Content-Length bytes that never come. Where the head
            # ended in the fed bytes is not known here, so the connection is not reused.
            self.done = True
            self.keep_alive = False
            self._parser = None  # (see `on_message_complete`)
            raise _HeadOnly()
        if not framed:
            self._close_delimited = True
            self.keep_alive = False
        self._llhttp_keeps = llhttp_keeps

    def on_body(self, body: bytes) -> None:
        if self._in_interim:
            # a 1xx has no content; llhttp reads one by the framing fields of any but
            # 100-103, and those bytes must never join the final response's body
            raise ResponseError("an interim response with content")
        self._progress = True
        self._pieces.append(body)

    def on_chunk_header(self) -> None:
        self._progress = True

    def on_chunk_complete(self) -> None:
        self._progress = True

    def on_message_complete(self) -> None:
        if self._in_interim:
            self._in_interim = False
            return
        self.done = True
        self._resumable = self.keep_alive and self._llhttp_keeps
        # llhttp's parser holds this object's callbacks and this object holds the
        # parser: a cycle per response that only the cyclic collector would free. Once
        # the response is whole nothing more is parsed (`feed` stops at `done`), so the
        # cycle is broken here and both go by reference counting (unless it is kept for
        # the next answer: its holder breaks it). (The running `feed_data` keeps the
        # parser alive until it returns.)
        if not self.keep:
            self._parser = None

    def set_aside(self) -> None:
        """Kept between answers (`keep`): what the last one left (its fields, however
        large the node made them) goes now, not at the next `restart`."""
        self.headers = []
        self._pieces = []

    def discard(self) -> None:
        """Nothing more is parsed here: the cycle with llhttp's parser broken now."""
        self.keep = False
        self._parser = None
