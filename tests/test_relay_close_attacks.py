"""Every close after a relay answer, against a caller that reads slowly and keeps talking.

The relay host runs the edge's HTTP legs over its own TLS (`relay.tls.RelayTLS`), so it
meets the close `tests/test_close_attacks.py` attacks on the terminate routes: closed
with bytes the caller sent still unread (a pipelined request, junk behind a refused head,
HTTP/2 WINDOW_UPDATEs), or meeting the ones it sends next, the socket is reset, and the
reset throws away whatever our kernel has not delivered yet: the tail of a large
`fetch_queued` page, for a caller whose receive buffer is small and who reads slowly.

The large answer here is one page holding one envelope of ~400 kB (a relay_call of a
long text), fetched by the recipient over a socket with a 4 KiB receive buffer that is
read a few KiB at a time; the invariant is that the recipient gets the whole page.
"""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import ssl
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pact_ingress.identity import Identity
from tests.relay_env import (
    LOOPBACK,
    RELAY_HOST,
    RelayCaller,
    RelayIdentities,
    RelayServe,
    client_context,
    envelope,
    relay_identities,
    tool_body,
)
from tests.terminate_env import WAIT, forget, request_bytes
from tests.test_close_attacks import responses, slow_read
from tests.test_h2_attacks import (
    DATA,
    GOAWAY,
    NO_ERROR,
    WINDOW_UPDATE,
    frame,
    settings,
    u32,
)
from tests.test_h2_whole_attacks import INITIAL_WINDOW_SIZE, MAX_WINDOW, Wire

#: The text sealed into the one queued envelope: its page is far larger than what the
#: kernels on both sides hold for a 4 KiB reader.
TEXT = 150_000
FETCH = tool_body("fetch_queued", {"limit": 1})


def _slow_socket(port: int, ident: Identity, alpn: tuple[str, ...] = ("http/1.1",)
                 ) -> ssl.SSLSocket:
    """A TLS connection to the relay host as `ident`, with a 4 KiB receive buffer (set
    before connecting: the window it advertises is sized from it)."""
    raw = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    raw.settimeout(WAIT)
    try:
        raw.connect((LOOPBACK, port))
        return client_context(ident, alpn).wrap_socket(raw, server_hostname=RELAY_HOST)
    except BaseException:
        raw.close()
        raise


def _queue_one_large(serve: RelayServe, ids: RelayIdentities) -> dict[str, str]:
    recipient, sender = RelayCaller(serve.port, ids.recipient), RelayCaller(serve.port,
                                                                            ids.sender)
    try:
        assert recipient.allowlist_set([ids.sender.fingerprint]).status == 200
        sealed = envelope(ids.sender, ids.recipient, msg_id="big", text="t" * TEXT)
        result, resp = sender.tool("relay_call", sealed)
        assert resp.status == 200 and not result.get("isError"), result
        return sealed
    finally:
        recipient.close()
        sender.close()


def _page_whole(answer: tuple[int, dict[str, str], bytes], sealed: dict[str, str],
                error: str | None) -> None:
    status, headers, body = answer
    assert status == 200, (error, status, headers)
    assert len(body) == int(headers["content-length"]) > TEXT, (error, len(body))
    items = json.loads(body)["result"]["structuredContent"]["items"]
    assert [item["envelope"] for item in items] == [sealed], error


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory
        ) -> Iterator[tuple[RelayServe, RelayIdentities, dict[str, str]]]:
    tmp = tmp_path_factory.mktemp("relay-close")
    ids = relay_identities(tmp)
    serve = RelayServe(tmp, recipients=[ids.recipient], workers=1)
    try:
        yield serve, ids, _queue_one_large(serve, ids)
    finally:
        serve.stop()


# === HTTP/1.1 ===========================================================================


def test_relay_h1_connection_close_page_reaches_a_talking_slow_reader(
        rig: tuple[RelayServe, RelayIdentities, dict[str, str]]) -> None:
    """A fetch asked with `Connection: close` while the caller keeps sending bytes the
    relay will not read: the page arrives whole."""
    serve, ids, sealed = rig
    sock = _slow_socket(serve.port, ids.recipient)
    try:
        sock.sendall(request_bytes("POST", "/relay/mcp", RELAY_HOST, body=FETCH,
                                   headers=[("Connection", "close")]))
        data, error = slow_read(sock, talk=lambda i: sock.sendall(b"\r\n"))
        got = responses(data)
        assert got, (error, data[:200])
        _page_whole(got[0], sealed, error)
        assert got[0][1].get("connection") == "close"
    finally:
        forget(sock)


def test_relay_h1_bad_request_behind_a_large_page_does_not_reset_it(
        rig: tuple[RelayServe, RelayIdentities, dict[str, str]]) -> None:
    """A fetch, then (with the tail of its page still in the relay's kernel) a malformed
    request (400, close), and the caller keeps sending junk without reading for longer
    than a second, then reads on: both answers arrive whole."""
    serve, ids, sealed = rig
    sock = _slow_socket(serve.port, ids.recipient)
    try:
        sock.sendall(request_bytes("POST", "/relay/mcp", RELAY_HOST, body=FETCH))
        # all but the last 12 KB: the relay has handed the whole page to its kernel by
        # then (its socket holds more), and the caller's holds less than that
        first, error = slow_read(sock, limit=2 * TEXT + 90_000)
        assert error is None, error
        sock.sendall(b"NOT A REQUEST\r\n\r\n")
        for _ in range(15):  # 1.5 s of talking without reading
            with contextlib.suppress(OSError, ssl.SSLError):
                sock.sendall(b"more junk\r\n")
            time.sleep(0.1)
        rest, error = slow_read(sock, talk=lambda i: sock.sendall(b"more junk\r\n"))
        got = responses(first + rest)
        assert got, (error, first[:200])
        _page_whole(got[0], sealed, error)
        assert len(got) == 2 and got[1][0] == 400, (error, [(s, h) for s, h, _ in got])
        assert got[1][1].get("connection") == "close"
    finally:
        forget(sock)


# === the drain ==========================================================================


def test_relay_drain_page_reaches_slow_readers_h1_and_h2(tmp_path: Path) -> None:
    """SIGTERM while two large pages are on their way to slow readers: one over
    HTTP/1.1 that pipelines its next request (which the draining relay will not take),
    one over HTTP/2 that keeps giving its window back. Both pages arrive whole, then the
    connections close and the process exits cleanly."""
    ids = relay_identities(tmp_path)
    serve = RelayServe(tmp_path, recipients=[ids.recipient], workers=1)
    try:
        sealed = _queue_one_large(serve, ids)
        h1 = _slow_socket(serve.port, ids.recipient)
        h2 = _RelayWire(serve.port, ids.recipient)
        try:
            h1.sendall(request_bytes("POST", "/relay/mcp", RELAY_HOST, body=FETCH))
            h2.send(frame(WINDOW_UPDATE, 0, 0, u32(2**30)))  # room for the updates
            h2.send(h2.post(1, FETCH, path="/relay/mcp"))
            # both answers are under way (the first bytes of each came) before the drain
            first, error = slow_read(h1, limit=4096)
            assert error is None, error
            assert h2.until(lambda: any(f[0] == DATA and f[2] == 1 for f in h2.frames))
            assert serve.proc is not None
            serve.proc.send_signal(signal.SIGTERM)
            h1.sendall(request_bytes("POST", "/relay/mcp", RELAY_HOST, body=FETCH))
            _h2_read_slowly(h2)
            rest, error = slow_read(h1, talk=lambda i: h1.sendall(b"\r\n"))
            got = responses(first + rest)
            assert got, (error, (first + rest)[:200])
            _page_whole(got[0], sealed, error)
            assert len(got) == 1, [(s, h) for s, h, _ in got]
            status, body = h2.answer(1, timeout=0)
            assert status == 200 and h2.ended(1), (status, len(body), h2.tls_errors)
            _page_whole((200, {"content-length": str(len(body))}, body), sealed, "h2")
            assert [struct.unpack(">II", f[3][:8]) for f in h2.frames if f[0] == GOAWAY] \
                in ([], [(1, NO_ERROR)])
        finally:
            forget(h1)
            h2.close()
        assert serve.proc.wait(timeout=WAIT) == 0, serve.logs()[-2000:]
    finally:
        serve.stop()


class _RelayWire(Wire):
    """`Wire` (raw HTTP/2 frames, read in bursts) to the relay host with a client
    certificate, windows wide open and a 4 KiB receive buffer: what holds the answer back
    is the slow reading, not flow control."""

    def __init__(self, port: int, ident: Identity) -> None:
        super().__init__(None, burst=4096, host=RELAY_HOST,
                         sock=_slow_socket(port, ident, ("h2",)),
                         first=settings((INITIAL_WINDOW_SIZE, MAX_WINDOW)))


def _h2_read_slowly(c: _RelayWire) -> None:
    """Read to the end of the connection a burst at a time, giving back what was read."""
    deadline = time.monotonic() + 2 * WAIT
    for _ in range(20_000):  # bounded in count and time: until the connection ends
        before = c.received
        if time.monotonic() > deadline or not c.read(5.0):
            break
        if c.received > before:
            c.send(frame(WINDOW_UPDATE, 0, 0, u32(c.received - before)))
        time.sleep(0.002)

