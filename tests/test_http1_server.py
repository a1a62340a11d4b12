"""The HTTP/1.1 server parser (llhttp via httptools): events, strictness, caps, responses."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pact_ingress.proto.http1_server import (
    END_OF_MESSAGE,
    INCOMPLETE,
    MAX_HEAD_BYTES,
    NEED_DATA,
    Data,
    Framing,
    H1ServerParser,
    ParseError,
    Request,
    chunk,
    response_framing,
    response_head,
)

PIPELINE = (
    b"POST /mcp HTTP/1.1\r\nHost: h.test\r\nContent-Length: 5\r\n\r\nhello"
    b"POST /up HTTP/1.1\r\nHost: h.test\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"3;ext=1\r\nabc\r\n2\r\nde\r\n0\r\nTrailer: x\r\n\r\n"
    b"GET /sse HTTP/1.1\r\nHost: h.test\r\nConnection: close\r\n\r\n"
)


def _events(parser: H1ServerParser) -> list[object]:
    out: list[object] = []
    while (event := parser.next_event()) is not NEED_DATA:
        out.append(event)
    return out


def _summary(events: list[object]) -> list[object]:
    """Requests by (method, target, keep_alive), bodies joined, ends marked."""
    out: list[object] = []
    body = b""
    for event in events:
        if isinstance(event, Request):
            out.append((event.method, event.target, event.keep_alive))
        elif isinstance(event, Data):
            body += event.data
        elif event is END_OF_MESSAGE:
            out.append(body)
            body = b""
    return out


EXPECTED = [("POST", b"/mcp", True), b"hello", ("POST", b"/up", True), b"abcde",
            ("GET", b"/sse", False), b""]


def test_pipelined_requests_in_one_read() -> None:
    parser = H1ServerParser()
    parser.feed(PIPELINE)
    assert _summary(_events(parser)) == EXPECTED


@pytest.mark.parametrize("cut", range(1, len(PIPELINE)))
def test_every_split_gives_the_same_events(cut: int) -> None:
    parser = H1ServerParser()
    events: list[object] = []
    for piece in (PIPELINE[:cut], PIPELINE[cut:]):
        parser.feed(piece)
        events += _events(parser)
    assert _summary(events) == EXPECTED


@pytest.mark.parametrize("cut", range(0, len(PIPELINE) + 1))
def test_whole_message_is_each_message_once_it_is_all_here(cut: int) -> None:
    """The keep-alive lane's view: `whole_message` gives a message (and nothing is taken
    until `drop`) only once all of it is parsed, whatever the split; INCOMPLETE while a
    part of one is here; None when nothing is."""
    parser = H1ServerParser()
    if cut:  # (b"" would say the client closed)
        parser.feed(PIPELINE[:cut])
    whole = []
    while isinstance(got := parser.whole_message(), tuple):
        request, body, count = got
        assert parser.whole_message() == got  # looking takes nothing
        parser.drop(count)
        whole.append((request.method, request.target, body))
    if cut < len(PIPELINE):
        # nothing here only where a message ended (or before the first began)
        boundaries = {0, PIPELINE.index(b"POST /up"), PIPELINE.index(b"GET /sse")}
        assert got is (None if cut in boundaries else INCOMPLETE)
        parser.feed(PIPELINE[cut:])
        while isinstance(got := parser.whole_message(), tuple):
            request, body, count = got
            parser.drop(count)
            whole.append((request.method, request.target, body))
    assert got is None
    assert whole == [("POST", b"/mcp", b"hello"), ("POST", b"/up", b"abcde"),
                     ("GET", b"/sse", b"")]


@pytest.mark.parametrize(("raw", "status"), [
    (b"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n", 400),
    (b"POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\n", 400),
    (b"POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding:\r\n chunked\r\n\r\n", 400),
    (b"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n", 400),
    (b"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 5, 5\r\n\r\n", 400),
    (b"POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: gzip, chunked\r\n\r\n", 501),
    (b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400),
    (b"GET / HTTP/1.1\r\n\r\n", 400),
    (b"GET / HTTP/1.1\nHost: h\n\n", 400),
    (b"GET / HTTP/1.1\r\nHost : h\r\n\r\n", 400),
    (b"GET / HTTP/1.1\r\nHost: h\r\nX: a\x00b\r\n\r\n", 400),
    (b"GET / HTTP/1.1\r\nHost: h\r\nExpect: 200-ok\r\n\r\n", 417),
    (b"GET / HTTP/1.1\r\nHost: h\r\nConnection: upgrade\r\nUpgrade: websocket\r\n\r\n", 501),
    (b"CONNECT h:443 HTTP/1.1\r\nHost: h:443\r\n\r\n", 501),
    (b"GET / HTTP/1.1\r\nHost: h\r\nX: " + b"a" * MAX_HEAD_BYTES, 431),
    (b"GET / HTTP/1.1\r\nHost: h\r\n" + b"X: a\r\n" * 101 + b"\r\n", 431),
])
def test_ambiguous_or_oversized_heads_are_refused(raw: bytes, status: int) -> None:
    with pytest.raises(ParseError) as info:
        H1ServerParser().feed(raw)
    assert info.value.status == status


REFUSED_HEADS = [
    b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",
    b"POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: h\r\nExpect: 200-ok\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: h\r\nConnection: upgrade\r\nUpgrade: websocket\r\n\r\n",
    b"CONNECT h:443 HTTP/1.1\r\nHost: h:443\r\n\r\n",
    b"GET / HTTP/1.1\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: h\r\n" + b"X: a\r\n" * 101 + b"\r\n",
    # whole in one read: the head completes inside one feed
    b"GET / HTTP/1.1\r\nHost: h\r\nX: " + b"a" * MAX_HEAD_BYTES + b"\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: h\r\n"
    + b"".join(b"X%d: %s\r\n" % (i, b"a" * 1000) for i in range(20)) + b"\r\n",
]


@pytest.mark.parametrize("refused", REFUSED_HEADS,
                         ids=["two-hosts", "te-gzip", "expect", "upgrade", "connect", "no-host",
                              "fields", "big-field", "big-head"])
def test_a_refused_head_yields_no_event_and_nothing_behind_it(refused: bytes) -> None:
    """The caller serves the events parsed before an error first: a refused head must
    not be among them, nor a request pipelined behind it; one before it still is."""
    parser = H1ServerParser()
    with pytest.raises(ParseError):
        parser.feed(b"GET /first HTTP/1.1\r\nHost: h\r\n\r\n" + refused
                    + b"GET /smuggled HTTP/1.1\r\nHost: h\r\n\r\n")
    assert _summary(_events(parser)) == [("GET", b"/first", True), b""]


def test_close_mid_request_is_an_error_and_between_requests_is_not() -> None:
    parser = H1ServerParser()
    parser.feed(b"GET / HTTP/1.1\r\nHost: h\r\n\r\n")
    parser.feed(b"")
    assert parser.closed
    parser = H1ServerParser()
    parser.feed(b"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 9\r\n\r\nabc")
    with pytest.raises(ParseError):
        parser.feed(b"")


def test_a_discarded_parser_refuses_more_and_is_freed_without_the_cycle_collector(
        ) -> None:
    import gc
    import weakref

    gc.disable()
    try:
        for feed_again in (False, True):
            parser = H1ServerParser()
            parser.feed(b"GET / HTTP/1.1\r\nHost: h\r\n\r\nGET /next HTTP/1.1\r\n")
            parser.discard()
            assert parser.closed and not parser.queued
            if feed_again:  # (the raised error's traceback holds the parser: a cycle)
                with pytest.raises(ParseError):
                    parser.feed(b"Host: h\r\n\r\n")
                return
            gone = weakref.ref(parser)
            del parser
            assert gone() is None
    finally:
        gc.enable()


def test_http10_has_no_keep_alive_and_needs_no_host() -> None:
    parser = H1ServerParser()
    parser.feed(b"GET / HTTP/1.0\r\n\r\n")
    request = parser.next_event()
    assert isinstance(request, Request) and not request.keep_alive
    assert request.http_version == "1.0"


@given(st.binary(max_size=200))
def test_garbage_only_ever_raises_parse_error(raw: bytes) -> None:
    parser = H1ServerParser()
    try:
        parser.feed(raw)
        _events(parser)
    except ParseError:
        pass


def test_response_framing_and_head() -> None:
    assert response_framing("HEAD", "1.1", 200, [(b"content-length", b"5")]) is Framing.NONE
    assert response_framing("GET", "1.1", 304, []) is Framing.NONE
    assert response_framing("GET", "1.1", 200, [(b"content-length", b"5")]) is Framing.LENGTH
    assert response_framing("GET", "1.1", 200, []) is Framing.CHUNKED
    assert response_framing("GET", "1.0", 200, []) is Framing.CLOSE
    head = response_head(200, [(b"content-type", b"text/plain"), (b"content-length", b"9")],
                         Framing.CHUNKED, close=True)
    assert head == (b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n"
                    b"transfer-encoding: chunked\r\nconnection: close\r\n\r\n")
    assert chunk(b"abc") == b"3\r\nabc\r\n"


def test_trailers_are_bounded() -> None:
    head = b"POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n"
    parser = H1ServerParser()
    parser.feed(head)
    with pytest.raises(ParseError) as info:
        for _ in range(40):  # a trailer value growing 1 KiB per read, bounded
            parser.feed(b"X-T: " if _ == 0 else b"a" * 1024)
    assert info.value.status == 431
    parser = H1ServerParser()
    parser.feed(head)
    with pytest.raises(ParseError) as info:
        parser.feed(b"".join(b"T%d: x\r\n" % i for i in range(101)) + b"\r\n")
    assert info.value.status == 431


def test_every_transfer_encoding_field_counts() -> None:
    with pytest.raises(ParseError) as info:
        H1ServerParser().feed(b"POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: gzip\r\n"
                              b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n")
    assert info.value.status == 501


def test_small_chunks_of_a_real_body_pass() -> None:
    parser = H1ServerParser()
    body = b"".join(b"1\r\n%c\r\n" % c for c in b"x" * 3000) + b"0\r\n\r\n"
    parser.feed(b"POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n")
    for i in range(0, len(body), 4096):
        parser.feed(body[i:i + 4096])
    assert _summary(_events(parser)) == [("POST", b"/", True), b"x" * 3000]


@pytest.mark.parametrize("request_line", [b"GET / HTTP/1.1", b"HEAD / HTTP/1.1",
                                          b"GET / HTTP/1.0"])
@pytest.mark.parametrize("status", [200, 204, 304, 404])
@pytest.mark.parametrize("length", [True, False])
@pytest.mark.parametrize("body", [b"", b"hello"])
def test_whole_response_writes_what_the_streamed_one_writes(
        request_line: bytes, status: int, length: bool, body: bytes) -> None:
    """`respond_whole` (one write: the usual small answer) puts on the wire exactly the
    bytes `respond` + `send` + `end` do, for every framing, and leaves the connection
    as reusable (or not) as they do."""
    import trio
    import trio.testing

    from pact_ingress.net.http1 import H1Connection

    headers = [(b"content-type", b"text/plain")]
    if length:
        headers.append((b"content-length", str(len(body)).encode()))
    raw = request_line + b"\r\nHost: h.test\r\n\r\n"

    async def serve(whole: bool) -> tuple[bytes, bool]:
        ours, theirs = trio.testing.memory_stream_pair()
        conn = H1Connection(ours, idle_timeout=5, head_timeout=5, write_timeout=5,
                            idle_scopes=set())
        conn.parser.feed(raw)
        ex = await conn._next_exchange()
        assert ex is not None
        if whole:
            await ex.respond_whole(status, headers, body)
        else:
            await ex.respond(status, headers)
            if body:
                await ex.send(body)
            await ex.end()
        await ours.aclose()
        out = b""
        while data := await theirs.receive_some(65536):
            out += data
        return out, ex.reusable()

    async def main() -> None:
        assert await serve(True) == await serve(False)

    trio.run(main)


def test_a_drain_ends_a_keep_alive_connection_once_its_answer_is_done() -> None:
    """A drain that begins while a request is being answered: once the answer is out,
    the connection ends instead of waiting for another request (its idle scope was not
    in the set the drain cancelled). A new connection, with the drain already on, still
    gets its first request answered, however late that comes."""
    import trio
    import trio.testing

    from pact_ingress.net.http1 import H1Connection

    raw = b"GET / HTTP/1.1\r\nHost: h.test\r\n\r\n"

    async def main() -> None:
        draining = trio.Event()
        answered = 0

        async def handle(ex) -> None:  # type: ignore[no-untyped-def]
            nonlocal answered
            draining.set()  # the drain begins mid-answer
            await ex.respond_whole(200, [(b"content-length", b"2")], b"ok")
            answered += 1

        for late in (False, True):
            ours, theirs = trio.testing.memory_stream_pair()
            conn = H1Connection(ours, idle_timeout=1000, head_timeout=1000,
                                write_timeout=1000, idle_scopes=set(), draining=draining)
            with trio.fail_after(10):  # a bound: a connection left waiting fails here
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(conn.serve, handle)
                    if late:  # the drain is on before this connection's request comes
                        await trio.testing.wait_all_tasks_blocked()
                    await theirs.send_all(raw)
            assert answered == (2 if late else 1)
            out = await theirs.receive_some(65536)
            assert out.startswith(b"HTTP/1.1 200") and out.endswith(b"ok")

    trio.run(main)


@pytest.mark.parametrize("zeros", [0, 1, 4300, 8000])
def test_a_content_length_with_any_number_of_leading_zeros_is_its_number(zeros: int) -> None:
    """llhttp takes `Content-Length: 000…05` (8000 zeros fit under the head cap); the
    parser reads it as 5, where int() refused more than 4300 digits and the client got a
    400 naming a callback error."""
    parser = H1ServerParser()
    parser.feed(b"POST /mcp HTTP/1.1\r\nHost: h.test\r\nContent-Length: "
                + b"0" * zeros + b"5\r\n\r\nhello")
    events = _events(parser)
    assert isinstance(events[0], Request) and events[0].content_length == 5, events[:1]
    assert _summary(events) == [("POST", b"/mcp", True), b"hello"]


def test_a_content_length_past_any_body_is_refused_as_llhttp_reads_it() -> None:
    """Twenty significant digits and more: llhttp's own overflow check refuses the head
    (400), before any of it is read as a number."""
    parser = H1ServerParser()
    with pytest.raises(ParseError) as refused:
        parser.feed(b"POST / HTTP/1.1\r\nHost: h.test\r\nContent-Length: "
                    + b"9" * 5000 + b"\r\n\r\n")
    assert refused.value.status == 400 and "callback" not in refused.value.why, refused.value


_CONNECTION_FIELDS = [b"", b"Connection: keep-alive\r\n", b"Connection: close\r\n",
                      b"Connection: x, keep-alive\r\n", b"Proxy-Connection: keep-alive\r\n",
                      b"Proxy-Connection: close\r\n",
                      b"Connection: close\r\nProxy-Connection: keep-alive\r\n"]


@pytest.mark.parametrize("version", [b"0.9", b"1.0", b"1.1", b"2.0"])
@pytest.mark.parametrize("fields", _CONNECTION_FIELDS)
def test_version_is_what_llhttp_parsed_whatever_the_connection_fields(
        version: bytes, fields: bytes) -> None:
    """The request's version (told without asking llhttp for its text where keep-alive
    already says it) is llhttp's own, for every version llhttp takes and every spelling
    of the fields that change keep-alive; keep-alive is llhttp's too."""
    import httptools

    raw = b"GET / HTTP/" + version + b"\r\nHost: h.test\r\n" + fields + b"\r\n"
    seen: list[tuple[str, bool]] = []

    class Probe:
        def on_headers_complete(self) -> None:
            seen.append((probe.get_http_version(), probe.should_keep_alive()))

    probe = httptools.HttpRequestParser(Probe())
    probe.feed_data(raw)
    parser = H1ServerParser()
    parser.feed(raw)
    request = parser.next_event()
    assert isinstance(request, Request)
    assert (request.http_version, request.keep_alive) == seen[0]
    assert request.http_version == version.decode()
