"""The HTTP/2 leg's connection lifecycle, in process (tests/test_terminate.py's rig): a
connection that ends with a stream in flight leaves nothing registered with the
terminator, and a drain refuses new streams, lets the open one finish (its upload too),
then closes the connection with GOAWAY instead of waiting for the client to leave."""

from __future__ import annotations

import json
from pathlib import Path

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.settings
import h2.stream
import trio

from tests.test_terminate import HOST, Env, rpc, start_env

WAIT = 10.0


class RawH2:
    """A bare h2 client on a trio TLS stream: frames exactly as the test sends them."""

    def __init__(self, stream: trio.SSLStream[trio.SocketStream]) -> None:
        self.stream = stream
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(
            client_side=True, header_encoding=None))
        self.events: list[h2.events.Event] = []
        self.eof = False

    @classmethod
    async def open(cls, env: Env) -> RawH2:
        tcp = await trio.open_tcp_stream("127.0.0.1", env.port)
        tls = trio.SSLStream(tcp, env.pki.client_context(["h2"]), server_hostname=HOST)
        await tls.do_handshake()
        client = cls(tls)
        client.conn.initiate_connection()
        await client.flush()
        return client

    async def flush(self) -> None:
        if data := self.conn.data_to_send():
            await self.stream.send_all(data)

    async def read(self) -> None:
        try:
            data = await self.stream.receive_some(65536)
        except trio.BrokenResourceError:
            data = b""
        if not data:
            self.eof = True
            return
        self.events += self.conn.receive_data(data)
        for ev in self.events:
            if isinstance(ev, h2.events.DataReceived):
                self.conn.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
        await self.flush()

    async def read_until(self, done: type[h2.events.Event]) -> None:
        with trio.fail_after(WAIT):
            while not self.eof and not any(isinstance(e, done) for e in self.events):
                await self.read()

    def post_head(self, length: int) -> int:
        sid = self.conn.get_next_available_stream_id()
        self.conn.send_headers(sid, [
            (b":method", b"POST"), (b":scheme", b"https"), (b":authority", HOST.encode()),
            (b":path", b"/mcp"), (b"content-type", b"application/json"),
            (b"accept", b"application/json, text/event-stream"),
            (b"content-length", str(length).encode())])
        return sid


async def test_h2_connection_gone_mid_request_leaves_no_idle_scope(
        nursery: trio.Nursery, tmp_path: Path) -> None:
    env = await start_env(nursery, tmp_path)
    for _ in range(3):
        client = await RawH2.open(env)
        body = rpc("tools/list", {})
        sid = client.post_head(len(body))
        client.conn.send_data(sid, body[:5])  # the rest never comes
        await client.flush()
        await trio.sleep(0.2)  # the exchange is waiting for its body
        await client.stream.aclose()
    with trio.fail_after(WAIT):
        while env.terminator._idle_scopes:  # each connection's own, while it lived
            await trio.sleep(0.05)
    await env.terminator.aclose()


async def test_h2_drain_finishes_open_stream_then_closes(nursery: trio.Nursery,
                                                         tmp_path: Path) -> None:
    env = await start_env(nursery, tmp_path)
    client = await RawH2.open(env)
    body = rpc("tools/list", {})
    sid = client.post_head(len(body))
    client.conn.send_data(sid, body[:5])
    await client.flush()
    await trio.sleep(0.2)
    await env.terminator.drain()
    await trio.sleep(0.1)
    late = client.post_head(len(body))  # opened after the drain began
    client.conn.send_data(late, body, end_stream=True)
    client.conn.send_data(sid, body[5:], end_stream=True)
    await client.flush()
    await client.read_until(h2.events.StreamEnded)
    answer = b"".join(e.data for e in client.events
                      if isinstance(e, h2.events.DataReceived) and e.stream_id == sid)
    status = next(dict(e.headers)[b":status"] for e in client.events
                  if isinstance(e, h2.events.ResponseReceived))
    assert status == b"200", (status, answer)
    assert "tools" in json.loads(answer)["result"], answer
    with trio.fail_after(WAIT):  # closed by the edge, not by this client leaving
        while not client.eof:
            await client.read()
    refused = [e.error_code for e in client.events
               if isinstance(e, h2.events.StreamReset) and e.stream_id == late]
    assert refused == [h2.errors.ErrorCodes.REFUSED_STREAM], client.events
    goaways = [e for e in client.events if isinstance(e, h2.events.ConnectionTerminated)]
    assert [(g.error_code, g.last_stream_id) for g in goaways] == [(0, sid)], goaways
    await client.stream.aclose()
    await env.terminator.aclose()


def _answer(client: RawH2, sid: int) -> tuple[bytes | None, bytes, bool]:
    """The :status, the body and whether the stream ended, for stream `sid`."""
    status = next((dict(e.headers)[b":status"] for e in client.events
                   if isinstance(e, h2.events.ResponseReceived) and e.stream_id == sid), None)
    body = b"".join(e.data for e in client.events
                    if isinstance(e, h2.events.DataReceived) and e.stream_id == sid)
    ended = any(isinstance(e, h2.events.StreamEnded) and e.stream_id == sid
                for e in client.events)
    return status, body, ended


async def _read_until_ended(client: RawH2, sid: int) -> None:
    with trio.fail_after(WAIT):
        while not client.eof and not _answer(client, sid)[2]:
            await client.read()


async def test_h2_request_head_in_continuation_frames(nursery: trio.Nursery,
                                                      tmp_path: Path) -> None:
    """A request header block split over HEADERS and two CONTINUATIONs, the body in the
    same write: answered as if it came in one frame, on a connection that goes on."""
    env = await start_env(nursery, tmp_path)
    client = await RawH2.open(env)
    body = rpc("tools/list", {})
    for sid in (1, 3):
        block = client.conn.encoder.encode([
            (b":method", b"POST"), (b":scheme", b"https"), (b":authority", HOST.encode()),
            (b":path", b"/mcp"), (b"content-type", b"application/json"),
            (b"accept", b"application/json, text/event-stream"),
            (b"x-padding", b"p" * 3000), (b"content-length", str(len(body)).encode())])
        cut = [0, len(block) // 3, 2 * len(block) // 3, len(block)]
        frames = [(1, 0), (9, 0), (9, 4)]  # HEADERS, CONTINUATION, CONTINUATION+END_HEADERS
        wire = b"".join(
            (cut[i + 1] - cut[i]).to_bytes(3, "big") + bytes([kind, flags])
            + sid.to_bytes(4, "big") + block[cut[i]:cut[i + 1]]
            for i, (kind, flags) in enumerate(frames))
        wire += len(body).to_bytes(3, "big") + bytes([0, 1]) + sid.to_bytes(4, "big") + body
        await client.stream.send_all(wire)
        # the client library has to know the stream it did not open through its API
        client.conn.state_machine.process_input(h2.connection.ConnectionInputs.SEND_HEADERS)
        stream = client.conn._begin_new_stream(sid, h2.connection.AllowedStreamIDs.ODD)
        stream.state_machine.process_input(h2.stream.StreamInputs.SEND_HEADERS)
        stream.state_machine.process_input(h2.stream.StreamInputs.SEND_END_STREAM)
        await _read_until_ended(client, sid)
        status, answer, _ = _answer(client, sid)
        assert status == b"200" and "tools" in json.loads(answer)["result"], (status, answer)
    await client.stream.aclose()
    await env.terminator.aclose()


async def test_h2_response_through_a_tiny_window(nursery: trio.Nursery,
                                                 tmp_path: Path) -> None:
    """A client window of 7 bytes: the answer comes in pieces no larger, each after a
    WINDOW_UPDATE, and arrives whole."""
    env = await start_env(nursery, tmp_path)
    client = await RawH2.open(env)
    client.conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 7})
    body = rpc("tools/list", {})
    sid = client.post_head(len(body))
    client.conn.send_data(sid, body, end_stream=True)
    await client.flush()
    await _read_until_ended(client, sid)
    status, answer, ended = _answer(client, sid)
    assert status == b"200" and ended and "tools" in json.loads(answer)["result"], answer
    sizes = [len(e.data) for e in client.events
             if isinstance(e, h2.events.DataReceived) and e.stream_id == sid]
    assert max(sizes) <= 7 and len(sizes) >= len(answer) // 7, sizes
    await client.stream.aclose()
    await env.terminator.aclose()


async def test_h2_reset_mid_response_leaves_the_connection_serving(
        nursery: trio.Nursery, tmp_path: Path) -> None:
    """The client resets a stream whose answer is stuck on a closed window: the edge
    sends nothing more on it, forgets the exchange, and answers the next stream."""
    env = await start_env(nursery, tmp_path)
    client = await RawH2.open(env)
    client.conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 16})
    body = rpc("tools/list", {})
    stuck = client.post_head(len(body))
    client.conn.send_data(stuck, body, end_stream=True)
    await client.flush()
    with trio.fail_after(WAIT):  # read without acknowledging: the window stays shut
        while sum(len(e.data) for e in client.events if isinstance(e, h2.events.DataReceived)
                  and e.stream_id == stuck) < 16:
            client.events += client.conn.receive_data(await client.stream.receive_some(65536))
            await client.flush()
    client.conn.reset_stream(stuck, h2.errors.ErrorCodes.CANCEL)
    after = len(client.events)
    fresh = client.post_head(len(body))
    client.conn.send_data(fresh, body, end_stream=True)
    client.conn.increment_flow_control_window(1 << 20, stream_id=fresh)
    await client.flush()
    await _read_until_ended(client, fresh)
    status, answer, _ = _answer(client, fresh)
    assert status == b"200" and "tools" in json.loads(answer)["result"], answer
    assert not [e for e in client.events[after:]
                if getattr(e, "stream_id", None) == stuck], client.events[after:]
    with trio.fail_after(WAIT):  # the reset exchange is gone from the edge too
        while any(c.streams for c in _h2_connections(env)):
            await trio.sleep(0.05)
    await client.stream.aclose()
    await env.terminator.aclose()


def _h2_connections(env: Env) -> list[object]:
    import gc

    from pact_ingress.net.http2 import H2Connection
    return [o for o in gc.get_objects() if isinstance(o, H2Connection)]
