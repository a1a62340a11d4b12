"""The sans-I/O HTTP/2 server state machine, raw frames in and out.

The peer is the h2 library as a client (an independent implementation), or frames built
by hand where h2 would refuse to send them. Every response is checked by h2 decoding it.
"""

from __future__ import annotations

import random
import struct

import h2.config
import h2.connection
import h2.events
import hpack
import pytest

from pact_ingress.proto import h2_frames as hf
from pact_ingress.proto import h2_server as hs
from pact_ingress.proto.h2_server import ErrorCode, H2Server

REQUEST = [(b":method", b"POST"), (b":scheme", b"https"), (b":authority", b"a.example"),
           (b":path", b"/mcp"), (b"content-type", b"application/json")]


def _client(settings: dict[int, int] | None = None) -> h2.connection.H2Connection:
    conn = h2.connection.H2Connection(h2.config.H2Configuration(
        client_side=True, header_encoding=None))
    conn.initiate_connection()
    if settings:
        conn.update_settings(settings)
    return conn


def _frame(kind: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I B I", len(payload) << 8 | kind, flags, sid) + payload


def _pair(settings: dict[int, int] | None = None,
          ) -> tuple[h2.connection.H2Connection, H2Server]:
    client, server = _client(settings), H2Server()
    server.initiate_connection()
    server.receive_data(client.data_to_send())
    client.receive_data(server.data_to_send())
    server.receive_data(client.data_to_send())  # the SETTINGS ACK
    return client, server


def _to_client(client: h2.connection.H2Connection, server: H2Server) -> list[object]:
    events = client.receive_data(server.data_to_send())
    return [e for e in events if not isinstance(e, (h2.events.SettingsAcknowledged,
                                                     h2.events.RemoteSettingsChanged))]


def _respond(server: H2Server, sid: int, body: bytes,
             headers: list[tuple[bytes, bytes]] | None = None) -> None:
    server.send_headers(sid, [(b":status", b"200"), (b"content-length", str(len(body)).encode())]
                        + (headers or []))
    if body:
        server.send_data(sid, body)
    server.end_stream(sid)


def test_request_and_response_round_trip() -> None:
    client, server = _pair()
    client.send_headers(1, REQUEST + [(b"content-length", b"5")])
    client.send_data(1, b"hello", end_stream=True)
    events = server.receive_data(client.data_to_send())  # HEADERS + DATA in one read
    assert [type(e) for e in events] == [hs.RequestReceived, hf.DataReceived]
    assert list(events[0].headers[:4]) == REQUEST[:4] and not events[0].ended
    assert (events[1].data, events[1].flow_length, events[1].ended) == (b"hello", 5, True)
    extra = [(b"x-id", b"abc"), (b"set-cookie", b"s=1"), (b"date", b"Mon, 30 Nov 2026")]
    _respond(server, 1, b"world", extra)
    got = _to_client(client, server)
    assert isinstance(got[0], h2.events.ResponseReceived)
    assert got[0].headers == [(b":status", b"200"), (b"content-length", b"5")] + extra
    assert b"".join(e.data for e in got if isinstance(e, h2.events.DataReceived)) == b"world"
    assert isinstance(got[-1], h2.events.StreamEnded)
    assert not server.streams  # closed both ways


def test_any_split_of_the_input_gives_the_same_events() -> None:
    client = _client()
    for sid in (1, 3, 5):
        client.send_headers(sid, REQUEST + [(b"content-length", b"3")])
        client.send_data(sid, b"abc", end_stream=True)
    client.ping(b"12345678")
    wire = client.data_to_send()

    def run(cuts: list[int]) -> list[tuple[object, ...]]:
        server = H2Server()
        out = []
        for a, b in zip([0] + cuts, cuts + [len(wire)], strict=True):
            for e in server.receive_data(wire[a:b]):
                out.append((type(e).__name__,) + tuple(
                    getattr(e, s) for s in type(e).__slots__))
        return out

    whole = run([])
    assert len(whole) == 3 * 2 + 2  # settings, 3 × (request, data), ping
    rng = random.Random(7)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(wire)), rng.randint(1, 12)))
        assert run(cuts) == whole


def test_continuation_in_and_out() -> None:
    client, server = _pair()
    block = hpack.Encoder().encode(REQUEST + [(b"x-long", b"v" * 300)])
    parts = [block[:10], block[10:200], block[200:]]
    wire = (_frame(hf.HEADERS, hf.END_STREAM, 1, parts[0])
            + _frame(hf.CONTINUATION, 0, 1, parts[1])
            + _frame(hf.CONTINUATION, hf.END_HEADERS, 1, parts[2]))
    events = server.receive_data(wire)
    assert [type(e) for e in events] == [hs.RequestReceived]
    assert events[0].headers[-1] == (b"x-long", b"v" * 300) and events[0].ended
    # a response head larger than a frame leaves as HEADERS + CONTINUATION
    client.send_headers(3, REQUEST, end_stream=True)
    server.receive_data(client.data_to_send())
    big = [(b"x-big-%d" % i, b"w" * 1000) for i in range(40)]
    _respond(server, 3, b"", big)
    wire = server.data_to_send()
    kinds = [kind for kind, _ in _frames(wire)]
    assert kinds[0] == hf.HEADERS and kinds[1:-1] == [hf.CONTINUATION] * (len(kinds) - 2)
    assert len(kinds) > 2
    got = [e for e in client.receive_data(wire) if isinstance(e, h2.events.ResponseReceived)]
    assert isinstance(got[0], h2.events.ResponseReceived) and got[0].headers[2:] == big


def test_continuation_flood_and_interleaving_end_the_connection() -> None:
    _, server = _pair()
    wire = _frame(hf.HEADERS, 0, 1, b"\x82")
    wire += b"".join(_frame(hf.CONTINUATION, 0, 1) for _ in range(hf.MAX_CONTINUATIONS + 1))
    with pytest.raises(hf.ConnectionError_) as caught:
        server.receive_data(wire)
    assert caught.value.code == ErrorCode.ENHANCE_YOUR_CALM
    assert _goaway(server.data_to_send()) == ErrorCode.ENHANCE_YOUR_CALM
    for other in (_frame(hf.PING, 0, 0, b"x" * 8), _frame(hf.CONTINUATION, hf.END_HEADERS, 3)):
        _, server = _pair()
        with pytest.raises(hf.ConnectionError_) as caught:
            server.receive_data(_frame(hf.HEADERS, 0, 1, b"\x82") + other)
        assert caught.value.code == ErrorCode.PROTOCOL_ERROR


def _goaway(data: bytes) -> int | None:
    """The error code of the last GOAWAY frame in `data`."""
    code, pos = None, 0
    while pos + 9 <= len(data):
        head, _, _ = struct.unpack_from(">I B I", data, pos)
        if head & 0xFF == hf.GOAWAY:
            code = struct.unpack_from(">I", data, pos + 13)[0]
        pos += 9 + (head >> 8)
    return code


def test_send_window_exhaustion_and_growth() -> None:
    client, server = _pair({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 10})
    client.send_headers(1, REQUEST, end_stream=True)
    client.send_headers(3, REQUEST, end_stream=True)
    server.receive_data(client.data_to_send())
    server.send_headers(1, [(b":status", b"200")])
    assert server.local_flow_control_window(1) == 10
    server.send_data(1, b"x" * 10)
    assert server.local_flow_control_window(1) == 0
    with pytest.raises(ValueError):
        server.send_data(1, b"y")
    # the client opens the stream's window; a SETTINGS change moves every open stream
    client.receive_data(server.data_to_send())
    client.increment_flow_control_window(5, stream_id=1)
    client.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 20})
    events = server.receive_data(client.data_to_send())
    assert {type(e) for e in events} == {hf.WindowUpdated, hf.SettingsChanged}
    assert server.local_flow_control_window(1) == 15 and server.local_flow_control_window(3) == 20
    # the connection window bounds every stream
    server.send_headers(3, [(b":status", b"200")])
    sent = 0
    while server.conn_send_window:
        for sid in (1, 3):
            n = min(server.local_flow_control_window(sid), 7)
            if n:
                server.send_data(sid, b"z" * n)
                sent += n
        client.receive_data(server.data_to_send())
        for sid in (1, 3):  # the client keeps the streams open but not the connection
            client.increment_flow_control_window(100, stream_id=sid)
        server.receive_data(client.data_to_send())
    assert sent == hf.DEFAULT_WINDOW - 10
    assert server.local_flow_control_window(1) == server.local_flow_control_window(3) == 0


def test_receive_window_is_enforced_and_given_back_as_acknowledged() -> None:
    client, server = _pair()
    client.send_headers(1, REQUEST)
    server.receive_data(client.data_to_send())
    taken = 0
    while window := client.local_flow_control_window(1):  # fill the stream's window
        client.send_data(1, b"d" * min(window, 16384))
        taken += sum(e.flow_length for e in server.receive_data(client.data_to_send())
                     if isinstance(e, hf.DataReceived))
    assert server.data_to_send() == b""  # nothing acknowledged: no WINDOW_UPDATE
    over = _frame(hf.DATA, 0, 1, b"d" * (hf.DEFAULT_WINDOW - taken + 1))
    with pytest.raises(hf.ConnectionError_) as caught:
        H2Server.receive_data(_copy(server), over)
    assert caught.value.code == ErrorCode.FLOW_CONTROL_ERROR
    server.acknowledge(taken, 1)
    updates = [e for e in client.receive_data(server.data_to_send())
               if isinstance(e, h2.events.WindowUpdated)]
    assert sorted(e.stream_id for e in updates) == [0, 1]
    assert all(e.delta == taken for e in updates)


def test_connection_window_raised_at_the_start_holds_every_stream_window() -> None:
    """A connection window of three streams' windows, raised by one WINDOW_UPDATE after
    SETTINGS (h2, the independent client, must see it): three streams each fill their own
    window with nothing acknowledged, and none is short of connection window; a byte
    past a stream's window is still a FLOW_CONTROL_ERROR, and so is one past the
    connection's. Acknowledging gives back both windows as before."""
    client = _client()
    server = H2Server(connection_window=3 * hf.DEFAULT_WINDOW)
    server.initiate_connection()
    server.receive_data(client.data_to_send())
    events = client.receive_data(server.data_to_send())
    raised = [e for e in events if isinstance(e, h2.events.WindowUpdated)]
    assert [(e.stream_id, e.delta) for e in raised] == [(0, 2 * hf.DEFAULT_WINDOW)]
    server.receive_data(client.data_to_send())  # the SETTINGS ACK
    assert client.outbound_flow_control_window == 3 * hf.DEFAULT_WINDOW
    for sid in (1, 3, 5):
        client.send_headers(sid, REQUEST)
    server.receive_data(client.data_to_send())
    taken = dict.fromkeys((1, 3, 5), 0)
    for sid in (1, 3, 5):
        while window := client.local_flow_control_window(sid):
            client.send_data(sid, b"d" * min(window, 16384))
            taken[sid] += sum(e.flow_length for e in server.receive_data(client.data_to_send())
                              if isinstance(e, hf.DataReceived))
    assert taken == dict.fromkeys((1, 3, 5), hf.DEFAULT_WINDOW)
    assert server.data_to_send() == b""  # nothing taken, nothing given back
    past_stream = _copy(server)  # stream 1's window is spent
    with pytest.raises(hf.ConnectionError_) as caught:
        past_stream.receive_data(_frame(hf.DATA, 0, 1, b"x"))
    assert caught.value.code == ErrorCode.FLOW_CONTROL_ERROR
    past_connection = _copy(server)  # a fourth stream has its window, the connection not
    client.send_headers(7, REQUEST)
    past_connection.receive_data(client.data_to_send())
    with pytest.raises(hf.ConnectionError_) as caught:
        past_connection.receive_data(_frame(hf.DATA, 0, 7, b"x"))
    assert caught.value.code == ErrorCode.FLOW_CONTROL_ERROR
    server.acknowledge(hf.DEFAULT_WINDOW, 3)
    updates = [(e.stream_id, e.delta) for e in client.receive_data(server.data_to_send())
               if isinstance(e, h2.events.WindowUpdated)]
    assert sorted(updates) == [(0, hf.DEFAULT_WINDOW), (3, hf.DEFAULT_WINDOW)]
    with pytest.raises(ValueError):
        H2Server(connection_window=hf.DEFAULT_WINDOW - 1)


def _copy(server: H2Server) -> H2Server:
    import copy
    return copy.deepcopy(server)


def test_reset_mid_response() -> None:
    client, server = _pair()
    client.send_headers(1, REQUEST)
    server.receive_data(client.data_to_send())
    server.send_headers(1, [(b":status", b"200")])
    server.send_data(1, b"part")
    client.receive_data(server.data_to_send())
    client.reset_stream(1)
    events = server.receive_data(client.data_to_send())
    assert [(type(e), e.remote) for e in events] == [(hf.StreamReset, True)]
    with pytest.raises(hf.StreamClosed):
        server.send_data(1, b"more")
    with pytest.raises(hf.StreamClosed):
        server.end_stream(1)
    server.reset_stream(1, ErrorCode.CANCEL)  # already closed: nothing queued
    assert server.data_to_send() == b""
    # DATA the client sent before it saw a reset of ours is dropped, its window given back
    client.send_headers(3, REQUEST)
    server.receive_data(client.data_to_send())
    server.reset_stream(3, ErrorCode.NO_ERROR)
    server.data_to_send()
    late = b"".join(_frame(hf.DATA, 0, 3, b"q" * 16000) for _ in range(5))
    events = server.receive_data(late)
    assert [(type(e), e.flow_length) for e in events] == [(hf.DataReceived, 0)] * 5  # nothing owed
    updates = [f for f in _frames(server.data_to_send()) if f[0] == hf.WINDOW_UPDATE]
    assert updates and all(sid == 0 for _, sid in updates)


def _frames(data: bytes) -> list[tuple[int, int]]:
    out, pos = [], 0
    while pos + 9 <= len(data):
        head, _, sid = struct.unpack_from(">I B I", data, pos)
        out.append((head & 0xFF, sid))
        pos += 9 + (head >> 8)
    return out


def test_stream_errors_reset_only_their_stream() -> None:
    client, server = _pair()
    client.send_headers(1, REQUEST + [(b"content-length", b"3")])
    client.send_headers(3, REQUEST, end_stream=True)
    server.receive_data(client.data_to_send())
    events = server.receive_data(_frame(hf.DATA, hf.END_STREAM, 1, b"abcd"))  # over the length
    assert [(type(e), e.code, e.remote) for e in events] == [
        (hf.StreamReset, ErrorCode.PROTOCOL_ERROR, False)]
    assert _frames(server.data_to_send())[0] == (hf.RST_STREAM, 1)
    assert server.is_open(3) and not server.is_open(1)
    # trailers without END_STREAM
    client.send_headers(5, REQUEST)
    server.receive_data(client.data_to_send())
    block = hpack.Encoder().encode([(b"x-trailer", b"1")])
    events = server.receive_data(_frame(hf.HEADERS, hf.END_HEADERS, 5, block))
    assert [type(e) for e in events] == [hf.StreamReset]
    # trailers with a pseudo-header (RFC 9113 §8.1)
    client.send_headers(7, REQUEST)
    server.receive_data(client.data_to_send())
    block = client.encoder.encode([(b":path", b"/other")])
    events = server.receive_data(_frame(hf.HEADERS, hf.END_HEADERS | hf.END_STREAM, 7, block))
    assert [(type(e), e.stream_id, e.code) for e in events] == [
        (hf.StreamReset, 7, ErrorCode.PROTOCOL_ERROR)]


def test_concurrent_stream_limit_refuses_the_extra_stream() -> None:
    client, server = _pair()
    server.max_concurrent_streams = 2
    for sid in (1, 3, 5):
        client.send_headers(sid, REQUEST)
    events = server.receive_data(client.data_to_send())
    assert [e.stream_id for e in events if isinstance(e, hs.RequestReceived)] == [1, 3]
    # the refusal is reported too, so the caller can meter a client that keeps provoking it
    refused = [e for e in events if isinstance(e, hf.StreamReset)]
    assert [(e.stream_id, e.code, e.remote) for e in refused] == [
        (5, ErrorCode.REFUSED_STREAM, False)]
    got = client.receive_data(server.data_to_send())
    resets = [e for e in got if isinstance(e, h2.events.StreamReset)]
    assert [(e.stream_id, e.error_code) for e in resets] == [(5, ErrorCode.REFUSED_STREAM)]


def test_late_frames_on_reset_streams_are_ignored_within_a_bound() -> None:
    """Trailers on a stream this end reset are ignored (the client may have sent them
    before it saw the reset); once that stream is older than the last RESET_MEMORY
    resets, they end the connection like HEADERS on any passed stream id."""
    client, server = _pair()
    server.max_concurrent_streams = 1
    client.send_headers(1, REQUEST)  # held open: every later stream is refused
    server.receive_data(client.data_to_send())
    refused = list(range(3, 3 + 2 * (hf.RESET_MEMORY + 1), 2))
    events = server.receive_data(b"".join(
        _frame(hf.HEADERS, hf.END_HEADERS | hf.END_STREAM, sid, client.encoder.encode(REQUEST))
        for sid in refused))
    assert len([e for e in events if isinstance(e, hf.StreamReset)]) == len(refused)
    trailer = hpack.Encoder().encode([(b"x-t", b"1")])
    events = server.receive_data(_frame(hf.HEADERS, hf.END_HEADERS | hf.END_STREAM,
                                        refused[-1], trailer))
    assert [type(e) for e in events] == [hf.UnknownFrame]  # remembered: ignored, metered
    with pytest.raises(hf.ConnectionError_) as caught:  # forgotten: a passed stream id
        server.receive_data(_frame(hf.HEADERS, hf.END_HEADERS | hf.END_STREAM,
                                   refused[0], trailer))
    assert caught.value.code == ErrorCode.PROTOCOL_ERROR


def test_headers_depending_on_their_own_stream_reset_it() -> None:
    client, server = _pair()
    block = client.encoder.encode(REQUEST)
    events = server.receive_data(_frame(
        hf.HEADERS, hf.END_HEADERS | hf.END_STREAM | hf.PRIORITY_FLAG, 1,
        struct.pack(">I", 1) + b"\x10" + block))
    assert [(type(e), e.stream_id, e.code) for e in events] == [
        (hf.StreamReset, 1, ErrorCode.PROTOCOL_ERROR)]
    assert _frames(server.data_to_send()) == [(hf.RST_STREAM, 1)]
    assert server.highest_inbound_stream_id == 1 and not server.is_open(1)
    # a dependency on another stream is fine
    events = server.receive_data(_frame(
        hf.HEADERS, hf.END_HEADERS | hf.END_STREAM | hf.PRIORITY_FLAG, 3,
        struct.pack(">I", 1) + b"\x10" + client.encoder.encode(REQUEST)))
    assert [type(e) for e in events] == [hs.RequestReceived]


def _block_frames(sid: int, block: bytes, flags: int = 0) -> bytes:
    """`block` as HEADERS and as many CONTINUATIONs as the default frame size needs."""
    pieces = [block[i:i + 16384] for i in range(0, len(block), 16384)] or [b""]
    wire = _frame(hf.HEADERS, flags | (hf.END_HEADERS if len(pieces) == 1 else 0), sid,
                  pieces[0])
    for i, piece in enumerate(pieces[1:], 2):
        wire += _frame(hf.CONTINUATION, hf.END_HEADERS if i == len(pieces) else 0, sid, piece)
    return wire


def test_header_list_over_the_cap_is_431_on_its_stream() -> None:
    """Over SETTINGS_MAX_HEADER_LIST_SIZE (a big cookie): that request is answered 431 and
    its body dropped; the block was decoded whole, so the table is still the client's and
    the next request on the connection (indexing the same fields) is read right."""
    _, server = _pair()
    fat = [(b"x-%d" % i, b"v%d" % i * 500) for i in range(20)]
    encoder = hpack.Encoder()
    wire = _block_frames(1, encoder.encode(REQUEST + fat))
    events = server.receive_data(wire)
    assert [(type(e), e.stream_id) for e in events] == [(hf.StreamReset, 1)]
    kinds = _frames(server.data_to_send())
    assert kinds == [(hf.HEADERS, 1), (hf.RST_STREAM, 1)], kinds
    # DATA the client had already sent for it is dropped
    events = server.receive_data(_frame(hf.DATA, hf.END_STREAM, 1, b"late"))
    assert not [e for e in events if isinstance(e, hs.RequestReceived)]
    small = REQUEST + [(b"x-19", b"v19" * 500)]  # in the table since the oversized block
    block = encoder.encode(small)
    assert len(block) < 100, len(block)  # sent as an index into the table
    events = server.receive_data(_block_frames(3, block, hf.END_STREAM))
    got = [e for e in events if isinstance(e, hs.RequestReceived)]
    assert len(got) == 1 and got[0].headers == small, events
    assert not server.closed


def test_header_list_far_over_the_cap_ends_the_connection() -> None:
    _, server = _pair()
    big = REQUEST + [(b"x-%d" % i, random.randbytes(1500).hex().encode()) for i in range(24)]
    with pytest.raises(hf.ConnectionError_) as caught:
        server.receive_data(_block_frames(1, hpack.Encoder().encode(big)))
    assert caught.value.code == ErrorCode.ENHANCE_YOUR_CALM


@pytest.mark.parametrize(("wire", "code"), [
    (_frame(hf.PING, 0, 0, b"short"), ErrorCode.FRAME_SIZE_ERROR),
    (_frame(hf.PING, 0, 1, b"x" * 8), ErrorCode.PROTOCOL_ERROR),
    (_frame(hf.WINDOW_UPDATE, 0, 0, b"\0\0\0\0"), ErrorCode.PROTOCOL_ERROR),
    (_frame(hf.WINDOW_UPDATE, 0, 0, struct.pack(">I", 2**31 - 1)),
     ErrorCode.FLOW_CONTROL_ERROR),
    (_frame(hf.DATA, 0, 9, b"x"), ErrorCode.PROTOCOL_ERROR),  # idle stream
    (_frame(hf.HEADERS, hf.END_HEADERS, 2, b"\x82"), ErrorCode.PROTOCOL_ERROR),
    (_frame(hf.RST_STREAM, 0, 7, b"\0\0\0\0"), ErrorCode.PROTOCOL_ERROR),
    (_frame(hf.PUSH_PROMISE, hf.END_HEADERS, 1, b"\0\0\0\2"), ErrorCode.PROTOCOL_ERROR),
    (_frame(hf.SETTINGS, 0, 0, b"\0\5\0\0\0\1"), ErrorCode.PROTOCOL_ERROR),  # frame size
    (_frame(hf.SETTINGS, 0, 0, b"\0\4\x80\0\0\0"), ErrorCode.FLOW_CONTROL_ERROR),
    (_frame(hf.SETTINGS, 0, 0, b"\0\4"), ErrorCode.FRAME_SIZE_ERROR),
    (_frame(hf.DATA, 0, 1, b"x" * 16385), ErrorCode.FRAME_SIZE_ERROR),
    (_frame(hf.HEADERS, hf.END_HEADERS, 1, b"\xff\xff\xff\xff"), ErrorCode.COMPRESSION_ERROR),
])
def test_connection_errors(wire: bytes, code: ErrorCode) -> None:
    _, server = _pair()
    with pytest.raises(hf.ConnectionError_) as caught:
        server.receive_data(wire)
    assert caught.value.code == code
    assert _goaway(server.data_to_send()) == code
    assert server.receive_data(_frame(hf.PING, 0, 0, b"x" * 8)) == []  # nothing after it


def test_preface_and_first_frame() -> None:
    with pytest.raises(hf.ConnectionError_):
        H2Server().receive_data(b"GET / HTTP/1.1\r\n\r\n")
    with pytest.raises(hf.ConnectionError_):
        H2Server().receive_data(hf.PREFACE + _frame(hf.PING, 0, 0, b"x" * 8))
    server = H2Server()
    assert server.receive_data(hf.PREFACE[:5]) == []
    assert [type(e) for e in server.receive_data(hf.PREFACE[5:] + _frame(hf.SETTINGS, 0, 0))] \
        == [hf.SettingsChanged]


def test_table_size_update_starts_the_first_block_and_follows_a_settings_change() -> None:
    client, server = _pair({h2.settings.SettingCodes.HEADER_TABLE_SIZE: 0})
    for sid in (1, 3, 5):
        client.send_headers(sid, REQUEST, end_stream=True)
    server.receive_data(client.data_to_send())
    _respond(server, 1, b"a")
    first = server.data_to_send()
    assert first[9] == 0x20  # the block opens with "table size 0"
    client.receive_data(first)
    _respond(server, 3, b"b")
    second = server.data_to_send()
    assert second[9] != 0x20
    client.receive_data(second)
    client.update_settings({h2.settings.SettingCodes.HEADER_TABLE_SIZE: 100})
    server.receive_data(client.data_to_send())
    _respond(server, 5, b"c")
    third = server.data_to_send()
    frames = _frames(third)
    assert (hf.HEADERS, 5) in frames
    got = client.receive_data(third)
    assert any(isinstance(e, h2.events.ResponseReceived) for e in got)


def test_hpack_encoder_round_trips_every_kind_of_field() -> None:
    from pact_ingress.proto import h2_hpack
    fields = [(b":status", b"200"), (b":status", b"418"), (b"content-type", b"text/plain"),
              (b"x-new-name", b""), (b"set-cookie", b"a=b"), (b"x-long", b"L" * 5000),
              (b"y" * 200, b"v"), (b"accept-encoding", b"gzip, deflate")]
    block = h2_hpack.TABLE_SIZE_ZERO + h2_hpack.encode(fields)
    assert hpack.Decoder().decode(block, raw=True) == fields
    decoded = hpack.Decoder().decode(h2_hpack.encode(fields), raw=True)
    assert isinstance(decoded[4], hpack.NeverIndexedHeaderTuple)


def test_remembered_header_blocks_decode_as_the_table_says() -> None:
    """Repeated blocks are decoded once; whatever the client's encoder does to its dynamic
    table in between (insertions, evictions), every request reads as it was sent."""
    rng = random.Random(11)
    client, server = _pair()
    paths = [b"/mcp", b"/a", b"/b" * 300, b"/c" * 700]
    extras = [[], [(b"x-big", b"v" * 1500)], [(b"x-big", b"w" * 1500), (b"x-n", b"1")]]
    sid, repeats = 1, 0
    for _ in range(300):
        sent = [(b":method", b"GET"), (b":scheme", b"https"), (b":authority", b"a.example"),
                (b":path", rng.choice(paths))] + rng.choice(extras)
        client.send_headers(sid, sent, end_stream=True)
        wire = client.data_to_send()
        repeats += wire[9:] in server._decoded  # one HEADERS frame: its block follows
        (event,) = server.receive_data(wire)
        assert isinstance(event, hs.RequestReceived) and list(event.headers) == sent
        _respond(server, sid, b"")
        client.receive_data(server.data_to_send())
        sid += 2
    assert repeats > 20  # remembered blocks were used, not just stored


def test_hpack_encoder_remembers_fields_without_changing_them() -> None:
    from pact_ingress.proto import h2_hpack
    rng = random.Random(3)
    names = [b"content-type", b"content-length", b"x-a", b"set-cookie", b"date"]
    for _ in range(500):
        fields = [(rng.choice(names), b"%d" % rng.randrange(40) * rng.choice((1, 100)))
                  for _ in range(rng.randint(1, 6))]
        fields.append((b"x-ba", bytearray(b"mutable")))
        decoded = hpack.Decoder().decode(h2_hpack.encode(fields), raw=True)
        assert decoded == [(n, bytes(v)) for n, v in fields]
    assert len(h2_hpack._FIELDS) <= h2_hpack._FIELDS_MAX
    assert not any(n == b"set-cookie" for n, _ in h2_hpack._FIELDS)


def test_mangled_input_fails_only_as_a_protocol_error() -> None:
    """Valid client traffic with random bytes flipped, cut or repeated: whatever comes
    in, `receive_data` returns events or raises `ConnectionError_` (GOAWAY queued), and
    the state stays within its bounds. Bounded: a fixed number of seeded cases."""
    client = _client({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 100})
    for sid in (1, 3, 5, 7):
        client.send_headers(sid, REQUEST + [(b"content-length", b"20"), (b"x-%d" % sid, b"v")])
        client.send_data(sid, b"a" * 10)
        client.send_data(sid, b"b" * 10, end_stream=sid != 5, pad_length=3 if sid == 3 else None)
    client.increment_flow_control_window(1000)
    client.ping(b"pingpong")
    client.reset_stream(5)
    client.update_settings({h2.settings.SettingCodes.HEADER_TABLE_SIZE: 100})
    wire = client.data_to_send()
    rng = random.Random(5)
    outcomes = {"events": 0, "error": 0}
    for _ in range(1500):
        data = bytearray(wire)
        for _ in range(rng.randint(1, 4)):
            pos = rng.randrange(0 if rng.random() < 0.05 else len(hf.PREFACE), len(data))
            action = rng.random()
            if action < 0.6:
                data[pos] = rng.randrange(256)
            elif action < 0.8:
                del data[pos:pos + rng.randint(1, 20)]
            else:
                data[pos:pos] = data[pos:pos + rng.randint(1, 30)]
        server = H2Server(max_concurrent_streams=3)
        server.initiate_connection()
        try:
            for start in range(0, len(data), 97):
                server.receive_data(bytes(data[start:start + 97]))
            outcomes["events"] += 1
        except hf.ConnectionError_ as exc:
            assert _goaway(server.data_to_send()) == exc.code
            outcomes["error"] += 1
        assert len(server.streams) <= 3
        assert server.conn_send_window <= hf.MAX_WINDOW
        for stream in server.streams.values():
            assert stream.recv_window >= 0 and stream.send_window <= hf.MAX_WINDOW
        for sid, stream in list(server.streams.items()):  # answering never breaks
            if stream.local_open and not server.closed:
                _respond(server, sid, b"")
    assert outcomes["events"] > 100 and outcomes["error"] > 100, outcomes  # both exercised
