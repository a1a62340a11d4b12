"""Whole answers on the HTTP/2 client leg, attacked: a stream's own task may send its
finished answer (HEADERS + one DATA, or HEADERS alone) while the connection's writer is
idle, and what the kernel does not take is held and must leave before anything else.

Hostile clients on raw frames (`Raw` from tests/test_h2_attacks.py, whose `env` fixture
checks after each test that a bystander is served and no connection is left counted)
pile answers up behind small receive buffers, read in small bursts, reset streams and
connections while answers are held, change SETTINGS mid-flight and flood PINGs; a drain
comes while answers are held; real clients ask for many answers at once. The node
answers paths starting `/whole` with head and body in one write, so the edge has each
of those answers whole in one read.

Invariants, whatever the interleaving: TLS never breaks (a record out of order would
fail the client's decryption); every frame is well placed (HEADERS first, one END_STREAM,
nothing but RST_STREAM or WINDOW_UPDATE after it); every answer that ends is intact and
belongs to its own stream; DATA never exceeds what the client's windows and frame size
allowed; GOAWAY at a drain comes after the last answer; the connection is counted no
longer once it ends.
"""

from __future__ import annotations

import json
import shutil
import signal
import socket
import ssl
import struct
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import hpack
import httpx
import pytest

from tests import test_h2_attacks
from tests.terminate_env import BYSTANDER_IP, HOST, LOOPBACK, WAIT, wait_settled
from tests.terminate_env import ServeEnv as Env
from tests.test_h2_attacks import (
    ACK,
    DATA,
    END_HEADERS,
    END_STREAM,
    ENHANCE_YOUR_CALM,
    GOAWAY,
    HEADERS,
    LIMITS,
    NO_ERROR,
    PING,
    RST_STREAM,
    SETTINGS,
    STALL_HOST,
    WINDOW_UPDATE,
    Raw,
    frame,
    settings,
    u32,
)

#: SETTINGS identifiers
INITIAL_WINDOW_SIZE, MAX_FRAME_SIZE = 4, 5
MAX_WINDOW = 2**31 - 1
CANCEL = 8


# The h2 attack module's fixtures, each module getting its own serve: after every attack
# another client is served, and no connection is left counted.
shared = test_h2_attacks.shared
env = test_h2_attacks.env


class Wire(Raw):
    """`Raw` that tells a broken TLS connection (a record out of order, a bad MAC) from
    one the edge closed, reads in bursts of a chosen size, and checks every frame it
    parses against what this client allowed (frame size, windows)."""

    def __init__(self, env: Env | None, *, burst: int = 65536, frame_size: int = 16384,
                 **kw: object) -> None:
        self.tls_errors: list[str] = []
        self.send_errors: list[str] = []
        self.received = 0  # plaintext bytes read
        self.burst = burst
        self.frame_size = frame_size  # the largest frame this client has allowed so far
        self.oversized: list[tuple[int, int]] = []
        super().__init__(env, **kw)  # type: ignore[arg-type]

    def send(self, *data: bytes) -> None:
        try:
            self.sock.sendall(b"".join(data))
        except TimeoutError as exc:
            self.send_errors.append(repr(exc))
            self.eof = True  # the edge does not read
        except OSError as exc:
            self.send_errors.append(repr(exc))
            self.take_rest()

    def read(self, timeout: float = WAIT) -> bool:
        if self.eof:
            return False
        self.sock.settimeout(timeout)
        try:
            data = self.sock.recv(self.burst)
        except TimeoutError:
            return True
        except ssl.SSLError as exc:
            # the edge closing without close_notify is an EOF, not a broken record
            if "EOF" not in str(exc) and "UNEXPECTED_EOF" not in str(exc):
                self.tls_errors.append(repr(exc))
            data = b""
        except OSError:
            data = b""
        if not data:
            self.eof = True
            return False
        before = len(self.frames)
        self.received += len(data)
        self.buf += data
        self._parse()
        for kind, _flags, sid, payload in self.frames[before:]:
            if kind in (DATA, HEADERS) and len(payload) > self.frame_size:
                self.oversized.append((sid, len(payload)))
        return True

    def drain(self, done: Callable[[], object] | None = None, timeout: float = WAIT) -> None:
        """Read (in bursts) until `done()` or the connection ends, bounded by `timeout`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not (done is not None and done()):
            if not self.read(min(1.0, max(0.05, deadline - time.monotonic()))):
                break


def well_formed(c: Wire) -> None:
    """What must hold of everything the edge sent on this connection."""
    assert c.tls_errors == [], c.tls_errors
    assert c.oversized == [], c.oversized[:5]
    headed: set[int] = set()
    ended: set[int] = set()
    for kind, flags, sid, payload in c.frames:
        if not sid:
            continue
        if sid in ended:
            # after END_STREAM: a reset (NO_ERROR after an early answer) or a window
            assert kind in (RST_STREAM, WINDOW_UPDATE), (sid, kind, payload[:40])
            continue
        if kind == HEADERS:
            assert sid not in headed, f"a second HEADERS on stream {sid}"
            headed.add(sid)
        elif kind == DATA:
            assert sid in headed, f"DATA before HEADERS on stream {sid}"
        if kind in (HEADERS, DATA) and flags & END_STREAM:
            ended.add(sid)
        if kind == RST_STREAM:
            ended.add(sid)


def whole_ok(c: Wire, sid: int, target: str) -> None:
    status, body = c.answer(sid, timeout=0)
    assert status == 200 and c.ended(sid), (sid, status, c.resets(sid))
    assert json.loads(body)["target"] == target, (sid, body[:120])


def stream_ok(c: Wire, sid: int, n: int) -> None:
    status, body = c.answer(sid, timeout=0)
    assert status == 200 and c.ended(sid), (sid, status, c.resets(sid))
    assert body == b"".join(f"id: {i}\ndata: tick\n\n".encode() for i in range(n)), body[-80:]


def big_ok(c: Wire, sid: int, n: int) -> None:
    status, body = c.answer(sid, timeout=0)
    assert status == 200 and c.ended(sid), (sid, status, c.resets(sid))
    assert body == b"x" * n, (sid, len(body))


def _wait_node(env: Env, marker: str, count: int, timeout: float = WAIT) -> None:
    """Until the node has answered `count` requests whose target holds `marker`, or as
    many as it will while the client reads nothing: the edge stops taking answers once
    it holds what the connection can (behind a large answer, about ten)."""
    wait_settled(lambda: len([r for r in env.node.requests()
                              if marker in r.target and r.complete]), count, timeout)


def _wide_open(**kw: object) -> dict[str, object]:
    """A client whose windows are all wide open: what holds answers back is its small
    receive buffer, not flow control."""
    return {"first": settings((INITIAL_WINDOW_SIZE, MAX_WINDOW)), "rcvbuf": 4096, **kw}


def _open_connection_window(c: Wire) -> None:
    c.send(frame(WINDOW_UPDATE, 0, 0, u32(MAX_WINDOW - 65535)))


def _served_after(c: Wire, sid: int) -> None:
    c.send(c.headers(sid, f"/whole-after-{sid}"))
    c.drain(lambda: c.ended(sid) or bool(c.resets(sid)))
    whole_ok(c, sid, f"/whole-after-{sid}")


PAD = "p" * 2000


# === many small whole answers mixed with streamed and large ones, read in bursts ========


@pytest.mark.parametrize("burst", [97, 1024, 16384])
def test_whole_answers_interleaved_with_streams_and_big_ones(env: Env, burst: int) -> None:
    """On one connection: many whole answers, SSE streams and large bodies at once, the
    client reading in small bursts behind a small receive buffer. Each answer is intact
    and on its own stream; TLS never breaks."""
    c = Wire(env, burst=burst, **_wide_open())  # type: ignore[arg-type]
    _open_connection_window(c)
    try:
        kinds: dict[int, tuple[str, object]] = {}
        requests = []
        for i, sid in enumerate(range(1, 180, 2)):
            if i % 15 == 3:
                kinds[sid] = ("stream", 4)
                path = "/stream?n=4&interval=0.05"
            elif i % 15 == 8:
                kinds[sid] = ("big", 150_000 + sid)
                path = f"/big?bytes={150_000 + sid}"
            else:
                path = f"/whole-mix-{sid}-{PAD[:sid * 13]}"
                kinds[sid] = ("whole", path)
            requests.append(c.headers(sid, path))
        # in three writes, so the edge meets them while earlier answers are still held
        third = len(requests) // 3 + 1
        for part in range(3):
            c.send(*requests[part * third:(part + 1) * third])
            c.drain(timeout=0.2)
        c.drain(lambda: all(c.ended(s) or c.resets(s) for s in kinds), timeout=60)
        well_formed(c)
        for sid, (kind, arg) in kinds.items():
            if kind == "whole":
                whole_ok(c, sid, arg)  # type: ignore[arg-type]
            elif kind == "stream":
                stream_ok(c, sid, arg)  # type: ignore[arg-type]
            else:
                big_ok(c, sid, arg)  # type: ignore[arg-type]
        _served_after(c, 301)
        well_formed(c)
    finally:
        c.close()


def test_whole_answers_piled_up_over_rounds(env: Env) -> None:
    """Rounds of whole answers the client does not read until the node answered them all
    (the kernel takes part, the rest is held), each round with a large answer and a
    stream in flight: every answer arrives intact."""
    c = Wire(env, burst=2048, **_wide_open())  # type: ignore[arg-type]
    _open_connection_window(c)
    try:
        sid = 1
        for round_ in range(3):
            whole = {}
            c.send(c.headers(sid, "/stream?n=3&interval=0.1"))
            streamed, sid = sid, sid + 2
            c.send(c.headers(sid, "/big?bytes=200000"))
            big, sid = sid, sid + 2
            for _ in range(60):
                whole[sid] = f"/whole-round{round_}-{sid}-{PAD}"
                sid += 2
            c.send(*(c.headers(s, p) for s, p in whole.items()))
            _wait_node(env, f"/whole-round{round_}-", len(whole))
            time.sleep(0.3)  # answers pile up behind the closed receive window
            c.drain(lambda: all(c.ended(s) for s in [*whole, streamed, big]), timeout=30)
            well_formed(c)
            for s, p in whole.items():
                whole_ok(c, s, p)
            stream_ok(c, streamed, 3)
            big_ok(c, big, 200000)
        _served_after(c, sid)
    finally:
        c.close()


# === resets while answers are held =====================================================


@pytest.mark.parametrize("point", ["before", "after_node", "mid_read"])
def test_streams_reset_while_answers_are_held(env: Env, point: str) -> None:
    """Every third stream reset by the client: before the node answers, once answers are
    held, or part way through reading them. The others arrive intact, a reset stream
    gets nothing after its END_STREAM or its RST, and the connection serves on."""
    c = Wire(env, burst=1500, **_wide_open())  # type: ignore[arg-type]
    _open_connection_window(c)
    try:
        paths = {sid: f"/whole-rst-{point}-{sid}-{PAD}" for sid in range(1, 200, 2)}
        c.send(*(c.headers(sid, p) for sid, p in paths.items()))
        doomed = list(paths)[::3]
        if point != "before":
            _wait_node(env, f"/whole-rst-{point}-", len(paths) // 2)
        if point == "mid_read":
            for _ in range(5):
                c.read(0.5)
        c.send(*(frame(RST_STREAM, 0, sid, u32(CANCEL)) for sid in doomed))
        keep = [sid for sid in paths if sid not in doomed]
        c.drain(lambda: all(c.ended(s) or c.resets(s) for s in keep), timeout=30)
        well_formed(c)
        for sid in keep:
            whole_ok(c, sid, paths[sid])
        for sid in doomed:  # whatever came before the reset is a prefix of the answer
            status, body = c.answer(sid, timeout=0)
            if c.ended(sid):
                assert json.loads(body)["target"] == paths[sid]
        _served_after(c, 401)
    finally:
        c.close()


@pytest.mark.parametrize("reads", [0, 1, 3, 8])
def test_connection_reset_while_answers_are_held(env: Env, reads: int) -> None:
    """The client resets the connection (RST) after reading only a little of answers
    held for it, some mid-stream (SSE, large): the edge notices, holds nothing, the
    fixture finds no connection counted and a bystander served."""
    c = Wire(env, burst=700, **_wide_open())  # type: ignore[arg-type]
    _open_connection_window(c)
    c.send(c.headers(1, "/stream?n=50&interval=0.05"), c.headers(3, "/big?bytes=500000"))
    c.send(*(c.headers(sid, f"/whole-gone{reads}-{sid}-{PAD}") for sid in range(5, 200, 2)))
    _wait_node(env, f"/whole-gone{reads}-", 50)
    for _ in range(reads):
        c.read(0.5)
    assert c.tls_errors == []
    c.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    c.close()


def test_rst_after_early_answer_follows_the_whole_response(env: Env) -> None:
    """An answer given before the upload was read (a refusal: declared too large) ends
    the stream with RST_STREAM(NO_ERROR) only after the complete response; whole
    answers held for other streams on the connection meanwhile arrive intact."""
    c = Wire(env, burst=1024, **_wide_open())  # type: ignore[arg-type]
    _open_connection_window(c)
    try:
        whole = {sid: f"/whole-early-{sid}-{PAD}" for sid in range(1, 120, 4)}
        uploads = list(range(3, 120, 4))
        out = []
        for sid in range(1, 120, 2):
            if sid in whole:
                out.append(c.headers(sid, whole[sid]))
            else:  # an upload declared too large: refused before it is read
                out.append(frame(HEADERS, END_HEADERS, sid, c.block("/mcp", "POST", [
                    (b"content-type", b"application/json"),
                    (b"content-length", b"1000000000")])))
                out.append(frame(DATA, 0, sid, b"{" * 900))
        c.send(*out)
        c.drain(lambda: all(c.ended(s) for s in range(1, 120, 2)), timeout=30)
        well_formed(c)
        for sid, p in whole.items():
            whole_ok(c, sid, p)
        for sid in uploads:
            status, body = c.answer(sid, timeout=0)
            assert status is not None and status >= 400 and c.ended(sid), (sid, status)
            resets = c.resets(sid)
            if resets:
                assert resets == [NO_ERROR], (sid, resets)
                last = max(i for i, f in enumerate(c.frames)
                           if f[2] == sid and f[0] in (HEADERS, DATA))
                first_rst = min(i for i, f in enumerate(c.frames)
                                if f[2] == sid and f[0] == RST_STREAM)
                assert last < first_rst, sid
        _served_after(c, 201)
    finally:
        c.close()


# === SETTINGS mid-flight ===============================================================


def test_window_zero_then_open(env: Env) -> None:
    """SETTINGS_INITIAL_WINDOW_SIZE 0: no DATA may leave before the client opens the
    window; bodiless answers (HEAD) come at once; raising the setting lets every whole
    answer through intact."""
    c = Wire(env, burst=4096, first=settings((INITIAL_WINDOW_SIZE, 0)))
    try:
        paths = {sid: f"/whole-zero-{sid}" for sid in range(1, 80, 2)}
        heads = {sid: f"/whole-zero-head-{sid}" for sid in range(81, 100, 2)}
        c.send(*(c.headers(sid, p) for sid, p in paths.items()),
               *(c.headers(sid, p, method="HEAD") for sid, p in heads.items()))
        _wait_node(env, "/whole-zero-", len(paths) + len(heads))
        c.drain(lambda: all(c.ended(s) or c.resets(s) for s in heads), timeout=10)
        assert [f for f in c.frames if f[0] == DATA and f[3]] == [], "DATA beyond a zero window"
        for sid in heads:
            status, body = c.answer(sid, timeout=0)
            assert status == 200 and body == b"" and c.ended(sid), (sid, status, body)
        for sid in paths:  # the heads may have come; the answers wait for the window
            assert not c.ended(sid), sid
        c.send(settings((INITIAL_WINDOW_SIZE, 65535)))
        c.drain(lambda: all(c.ended(s) or c.resets(s) for s in paths), timeout=20)
        well_formed(c)
        for sid, p in paths.items():
            whole_ok(c, sid, p)
        _served_after(c, 201)
    finally:
        c.close()


def test_window_shrunk_below_the_answers_mid_flight(env: Env) -> None:
    """Wide windows, requests sent, then SETTINGS_INITIAL_WINDOW_SIZE cut to 100 before
    the answers come: the edge may send at most the window it still believes in, the
    answers larger than it go the long way (split, waiting for WINDOW_UPDATEs), and
    every answer ends intact once the client gives window back."""
    c = Wire(env, burst=4096, first=settings((INITIAL_WINDOW_SIZE, 65535)))
    try:
        paths = {sid: f"/whole-shrink-{sid}-{PAD[:sid * 7]}" for sid in range(1, 100, 2)}
        c.send(*(c.headers(sid, p) for sid, p in paths.items()),
               settings((INITIAL_WINDOW_SIZE, 100)))
        c.drain(lambda: any(f[0] == SETTINGS and f[1] & ACK for f in c.frames[1:]), timeout=5)
        _wait_node(env, "/whole-shrink-", len(paths))
        c.drain(timeout=1)
        # per stream: at most the larger of the windows it ever had, before any update
        for sid in paths:
            sent = sum(len(f[3]) for f in c.frames if f[0] == DATA and f[2] == sid)
            assert sent <= 65535, (sid, sent)
        # the client gives each stream window until every answer has ended
        for _ in range(40):
            pending = [s for s in paths if not c.ended(s) and not c.resets(s)]
            if not pending:
                break
            c.send(*(frame(WINDOW_UPDATE, 0, s, u32(4096)) for s in pending))
            c.drain(timeout=0.3)
        well_formed(c)
        for sid, p in paths.items():
            whole_ok(c, sid, p)
        c.send(settings((INITIAL_WINDOW_SIZE, 65535)))
        _served_after(c, 201)
    finally:
        c.close()


def test_frame_size_raised_then_lowered_mid_flight(env: Env) -> None:
    """SETTINGS_MAX_FRAME_SIZE raised to 1 MiB with wide windows, then lowered to the
    minimum while large and whole answers are in flight: after the edge acknowledges
    the lowering, no frame exceeds it, and every body is intact."""
    c = Wire(env, burst=8192, frame_size=1 << 20,
             **_wide_open(first=settings((INITIAL_WINDOW_SIZE, MAX_WINDOW),
                                         (MAX_FRAME_SIZE, 1 << 20))))  # type: ignore[arg-type]
    _open_connection_window(c)
    try:
        paths = {sid: f"/whole-fs-{sid}-{PAD}" for sid in range(1, 60, 2)}
        bigs = {sid: 60_000 + sid for sid in range(61, 70, 2)}
        c.send(*(c.headers(sid, p) for sid, p in paths.items()),
               *(c.headers(sid, f"/big?bytes={n}") for sid, n in bigs.items()))
        c.drain(timeout=0.3)
        acks = len([f for f in c.frames if f[0] == SETTINGS and f[1] & ACK])
        c.send(settings((MAX_FRAME_SIZE, 16384)))
        c.drain(lambda: len([f for f in c.frames if f[0] == SETTINGS and f[1] & ACK]) > acks,
                timeout=10)
        acked = max(i for i, f in enumerate(c.frames) if f[0] == SETTINGS and f[1] & ACK)
        c.drain(lambda: all(c.ended(s) or c.resets(s) for s in [*paths, *bigs]), timeout=30)
        late = [(f[2], len(f[3])) for f in c.frames[acked + 1:]
                if f[0] in (DATA, HEADERS) and len(f[3]) > 16384]
        assert late == [], late[:5]
        well_formed(c)
        for sid, p in paths.items():
            whole_ok(c, sid, p)
        for sid, n in bigs.items():
            big_ok(c, sid, n)
        _served_after(c, 201)
    finally:
        c.close()


# === PINGs while answers are held =====================================================


@pytest.mark.parametrize("count", [40, 300])
def test_pings_while_answers_are_held(env: Env, count: int) -> None:
    """PINGs sent while answers are held for a client that does not read: each PING ACK
    echoes a PING sent, in order, none twice, and what arrives is well formed. Within
    the allowance, every PING is answered and every answer arrives intact; beyond it
    the flood verdict ends the connection with GOAWAY(ENHANCE_YOUR_CALM), which the
    client gets (the fixture: nothing left counted)."""
    c = Wire(env, burst=2048, **_wide_open())  # type: ignore[arg-type]
    _open_connection_window(c)
    try:
        paths = {sid: f"/whole-ping{count}-{sid}-{PAD}" for sid in range(1, 200, 2)}
        c.send(*(c.headers(sid, p) for sid, p in paths.items()))
        _wait_node(env, f"/whole-ping{count}-", len(paths) // 2)
        pings = [struct.pack(">Q", i) for i in range(count)]
        for i in range(0, len(pings), 10):
            c.send(*(frame(PING, 0, 0, p) for p in pings[i:i + 10]))
            time.sleep(0.02)
        c.drain(lambda: (all(c.ended(s) or c.resets(s) for s in paths)
                         and len([f for f in c.frames if f[0] == PING]) == len(pings)),
                timeout=30)
        well_formed(c)
        echoed = [f[3] for f in c.frames if f[0] == PING]
        assert all(f[1] & ACK for f in c.frames if f[0] == PING)
        assert echoed == pings[:len(echoed)], "PING ACKs out of order, duplicated or forged"
        for sid, p in paths.items():
            if c.ended(sid):
                whole_ok(c, sid, p)
        if count <= 40:
            assert len(echoed) == len(pings)
            assert [f for f in c.frames if f[0] == GOAWAY] == []
            assert all(c.ended(s) for s in paths)
        else:
            assert c.until(lambda: c.eof, WAIT), "a PING flood did not end the connection"
            # the verdict reaches the client: the edge does not reset the connection
            # (which would throw away what it sent) while the client's PINGs are unread
            goaways = [f for f in c.frames if f[0] == GOAWAY]
            assert [struct.unpack(">II", f[3][:8])[1] for f in goaways] == [
                ENHANCE_YOUR_CALM]
    finally:
        c.close()


def test_answers_trickle_to_a_client_reading_in_small_bursts(env: Env) -> None:
    """The socket filled first by answers the client does not read; then one request at
    a time, the client reading about one answer's worth between them: the socket is
    nearly full whenever the next answer comes, so answers are sent part by the stream's
    task and part by the writer, over and over. All arrive intact."""
    c = Wire(env, burst=700, **_wide_open())  # type: ignore[arg-type]
    _open_connection_window(c)
    try:
        paths = {sid: f"/whole-trickle-{sid}-{PAD}" for sid in range(1, 260, 2)}
        first = list(paths)[:20]  # a pile-up the kernel's buffers hold (no stream waits)
        c.send(*(c.headers(sid, paths[sid]) for sid in first))
        _wait_node(env, "/whole-trickle-", len(first))
        for n, sid in enumerate(list(paths)[20:], start=21):
            c.send(c.headers(sid, paths[sid]))
            _wait_node(env, "/whole-trickle-", n, timeout=2)
            got = c.received
            c.drain(lambda: c.received >= got + 2100, timeout=0.5)
        c.drain(lambda: all(c.ended(s) or c.resets(s) for s in paths), timeout=60)
        well_formed(c)
        for sid, p in paths.items():
            whole_ok(c, sid, p)
    finally:
        c.close()


# === a client that stops reading =======================================================


def test_client_that_stops_reading_is_dropped_and_holds_nobody(env: Env) -> None:
    """Answers held for a client that never reads again: other clients are served while
    it stalls, and the edge drops it (the write deadline: the stall route's short one),
    leaving nothing counted."""
    c = Wire(env, **_wide_open(host=STALL_HOST))  # type: ignore[arg-type]
    _open_connection_window(c)
    try:
        c.send(*(c.headers(sid, f"/whole-stall-{sid}-{PAD}{PAD}") for sid in range(1, 200, 2)))
        _wait_node(env, "/whole-stall-", 100)
        for i in range(3):  # while it stalls, others are served on both legs
            other = Wire(env, source=BYSTANDER_IP)
            try:
                other.send(*(other.headers(sid, f"/whole-other-{i}-{sid}")
                             for sid in range(1, 40, 2)))
                other.drain(lambda o=other: all(o.ended(s) for s in range(1, 40, 2)))
                well_formed(other)
                for sid in range(1, 40, 2):
                    whole_ok(other, sid, f"/whole-other-{i}-{sid}")
            finally:
                other.close()
        # the stalled connection ends within the write deadline and some margin
        deadline = time.monotonic() + 90
        while env.serve.open_connections() > 0 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert env.serve.open_connections() == 0
    finally:
        c.close()


# === a drain while answers are held ====================================================


def test_drain_sends_goaway_after_the_held_answers(tmp_path: Path) -> None:
    """SIGTERM while whole answers are held for a client that does not read and an SSE
    stream is in flight: once the client reads, every answer is there intact, the
    stream ends whole, GOAWAY(NO_ERROR) comes after the last answer's frames, and the
    process exits cleanly."""
    env = Env.start(tmp_path, limits=LIMITS)
    try:
        c = Wire(env, burst=3000, **_wide_open())  # type: ignore[arg-type]
        _open_connection_window(c)
        try:
            c.send(c.headers(1, "/stream?n=10&interval=0.1"))
            paths = {sid: f"/whole-drain-{sid}-{PAD}" for sid in range(3, 200, 2)}
            c.send(*(c.headers(sid, p) for sid, p in paths.items()))
            _wait_node(env, "/whole-drain-", len(paths))
            time.sleep(0.3)
            env.serve.proc.send_signal(signal.SIGTERM)
            c.drain(lambda: any(f[0] == GOAWAY for f in c.frames), timeout=40)
            c.drain(timeout=2)
            well_formed(c)
            for sid, p in paths.items():
                whole_ok(c, sid, p)
            stream_ok(c, 1, 10)
            goaways = [i for i, f in enumerate(c.frames) if f[0] == GOAWAY]
            assert goaways, "no GOAWAY"
            code = struct.unpack(">II", c.frames[goaways[0]][3][:8])
            assert code == (199, NO_ERROR), code
            last_answer = max(i for i, f in enumerate(c.frames) if f[0] in (HEADERS, DATA))
            assert last_answer < goaways[0]
            assert env.serve.proc.wait(timeout=60) == 0, env.serve.logs()[-2000:]
        finally:
            c.close()
    finally:
        env.stop()


def test_drain_answer_reaches_a_slow_reader_that_keeps_talking(tmp_path: Path) -> None:
    """SIGTERM while a large answer is still on its way to a client that reads slowly
    and sends a PING after each read (frames the edge no longer reads once its last
    stream is answered): the connection must not be reset while the answer is still in
    the edge's kernel buffers, so the client gets every byte, then GOAWAY(NO_ERROR)."""
    size = 400_000
    env = Env.start(tmp_path, limits=LIMITS)
    try:
        c = Wire(env, burst=4096, **_wide_open())  # type: ignore[arg-type]
        _open_connection_window(c)
        try:
            c.send(c.headers(1, f"/big?bytes={size}"))
            _wait_node(env, "/big", 1)
            env.serve.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 60
            for _ in range(5000):  # bounded: until the GOAWAY or the end of the connection
                if any(f[0] == GOAWAY for f in c.frames) or time.monotonic() > deadline:
                    break
                if not c.read(2.0):
                    break
                c.send(frame(PING, 0, 0, bytes(8)))
                time.sleep(0.002)
            c.drain(timeout=2)
            well_formed(c)
            big_ok(c, 1, size)
            assert [struct.unpack(">II", f[3][:8]) for f in c.frames if f[0] == GOAWAY] == [
                (1, NO_ERROR)]
            assert env.serve.proc.wait(timeout=60) == 0, env.serve.logs()[-2000:]
        finally:
            c.close()
    finally:
        env.stop()


# === real clients, many concurrent streams =============================================

WHOLE_N = 300


def test_h2load_many_concurrent_whole_answers(env: Env) -> None:
    h2load = shutil.which("h2load")
    assert h2load, "h2load is not installed"
    proc = subprocess.run(
        [h2load, "-n", "3000", "-c", "3", "-m", "100", f"--connect-to={LOOPBACK}:{env.serve.port}",
         f"https://{HOST}/whole-h2load"],
        capture_output=True, text=True, timeout=120, check=False)
    assert "3000 succeeded, 0 failed, 0 errored" in proc.stdout, proc.stdout[-800:]
    assert "status codes: 3000 2xx" in proc.stdout, proc.stdout[-800:]


def test_nghttp_many_concurrent_whole_answers(env: Env) -> None:
    nghttp = shutil.which("nghttp")
    assert nghttp, "nghttp is not installed"
    targets = [f"/whole-nghttp-{i}-{PAD[:i * 17]}" for i in range(100)]
    proc = subprocess.run(
        # windows wide enough that no body is split: nghttp prints DATA as it comes,
        # and bodies split by a window may interleave (as HTTP/2 allows)
        [nghttp, "-w", "30", "-W", "30", "-H", f":authority: {HOST}",
         *(f"https://{LOOPBACK}:{env.serve.port}{t}" for t in targets)],
        capture_output=True, timeout=60, check=False)
    out = proc.stdout.decode()
    decoder = json.JSONDecoder()
    got = []
    pos = 0
    while pos < len(out):
        doc, pos = decoder.raw_decode(out, pos)
        got.append(doc["target"])
    assert sorted(got) == sorted(targets), (len(got), proc.stderr[-300:])


def test_curl_parallel_whole_answers(env: Env, tmp_path: Path) -> None:
    curl = shutil.which("curl")
    assert curl, "curl is not installed"
    targets = [f"/whole-curl-{i}-{PAD[:i * 29]}" for i in range(60)]
    args = [curl, "-sk", "--http2", "-Z", "--parallel-max", "60", "--parallel-immediate",
            "--resolve", f"{HOST}:{env.serve.port}:{LOOPBACK}"]
    for i, t in enumerate(targets):
        args += [f"https://{HOST}:{env.serve.port}{t}", "-o", str(tmp_path / f"{i}.json")]
    proc = subprocess.run(args, capture_output=True, timeout=60, check=False)
    for i, t in enumerate(targets):
        path = tmp_path / f"{i}.json"
        assert path.exists(), (i, proc.stderr[-300:])
        assert json.loads(path.read_bytes())["target"] == t, i


NODE_MIX = r"""
const http2 = require('http2'), tls = require('tls');
const [port, host, n] = process.argv.slice(1);
const client = http2.connect(`https://${host}:${port}`, {
  createConnection: () => tls.connect({host: '127.0.0.1', port: Number(port), servername: host,
                                       ALPNProtocols: ['h2'], rejectUnauthorized: false})});
const out = {};
const paths = [];
for (let i = 0; i < Number(n); i++) paths.push(`/whole-node-${i}-${'q'.repeat(i * 11)}`);
paths.push('/big?bytes=400000', '/stream?n=5&interval=0.05', '/big?bytes=123457');
let left = paths.length;
for (const p of paths) {
  const req = client.request({':method': 'GET', ':path': p});
  const parts = [];
  let status = null;
  req.on('response', h => { status = h[':status']; });
  req.on('data', c => parts.push(c));
  req.on('close', () => {
    const body = Buffer.concat(parts);
    out[p] = {status, len: body.length, text: p.startsWith('/big') ? '' : body.toString()};
    if (--left === 0) { console.log(JSON.stringify(out)); client.close(); }
  });
  req.end();
}
setTimeout(() => { console.log(JSON.stringify(out)); process.exit(3); }, 50000).unref();
"""


def test_node_many_whole_answers_mixed_with_big_and_streamed(env: Env) -> None:
    node = shutil.which("node")
    assert node, "node is not installed"
    proc = subprocess.run([node, "-e", NODE_MIX, str(env.serve.port), HOST, str(WHOLE_N)],
                          capture_output=True, text=True, timeout=60, check=False)
    lines = proc.stdout.strip().splitlines()
    out = json.loads(lines[-1]) if lines else {}
    assert proc.returncode == 0, proc.stderr[-300:]
    for i in range(WHOLE_N):
        p = f"/whole-node-{i}-{'q' * (i * 11)}"
        assert out[p]["status"] == 200 and json.loads(out[p]["text"])["target"] == p, i
    assert out["/big?bytes=400000"] == {"status": 200, "len": 400000, "text": ""}
    assert out["/big?bytes=123457"] == {"status": 200, "len": 123457, "text": ""}
    assert out["/stream?n=5&interval=0.05"]["text"] == "".join(
        f"id: {i}\ndata: tick\n\n" for i in range(5))


def test_httpx_many_whole_answers_and_heads(env: Env) -> None:
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE

    async def run() -> dict[str, httpx.Response]:
        import trio
        transport = httpx.AsyncHTTPTransport(http2=True, verify=ctx)
        limits = httpx.Limits(max_connections=1)
        async with httpx.AsyncClient(transport=transport, timeout=60, limits=limits,
                                     base_url=f"https://{LOOPBACK}:{env.serve.port}") as client:
            out: dict[str, httpx.Response] = {}

            async def one(method: str, path: str) -> None:
                out[f"{method} {path}"] = await client.request(
                    method, path, headers={"host": HOST}, extensions={"sni_hostname": HOST})
            async with trio.open_nursery() as nursery:
                for i in range(150):
                    nursery.start_soon(one, "GET", f"/whole-httpx-{i}-{PAD[:i * 5]}")
                    if i % 10 == 0:
                        nursery.start_soon(one, "HEAD", f"/whole-httpx-head-{i}")
            return out

    import trio
    answers = trio.run(run)
    for key, res in answers.items():
        method, path = key.split(" ", 1)
        assert res.http_version == "HTTP/2" and res.status_code == 200, (key, res.status_code)
        if method == "GET":
            assert res.json()["target"] == path, key
        else:
            assert res.content == b"" and int(res.headers["content-length"]) > 0, key


def test_hpack_state_survives_whole_answers(env: Env) -> None:
    """Header blocks sent by stream tasks and by the writer share one HPACK encoder: a
    decoder fed every HEADERS frame in wire order decodes them all (a block sent out of
    the order it was encoded would corrupt the dynamic table)."""
    c = Wire(env, burst=512, **_wide_open())  # type: ignore[arg-type]
    _open_connection_window(c)
    try:
        sids = list(range(1, 200, 2))
        c.send(*(c.headers(sid, f"/whole-hpack-{sid}" if sid % 3 else "/stream?n=2&interval=0.01")
                 for sid in sids))
        c.drain(lambda: all(c.ended(s) or c.resets(s) for s in sids), timeout=30)
        well_formed(c)
        dec = hpack.Decoder()
        for kind, _flags, sid, payload in c.frames:
            if kind == HEADERS:
                fields = dict(dec.decode(payload, raw=True))
                assert fields[b":status"] == b"200", sid
    finally:
        c.close()


# === in process: the held path made certain =============================================


async def test_held_whole_answers_leave_first_in_process() -> None:
    """`H2Connection` over `ServerTLS` on a socketpair with small buffers, a client that
    reads nothing until 60 whole answers were given: `write_nowait` must have held some
    ciphertext (checked, so the path is surely taken), and once the client reads, every
    record decrypts (h2's client state machine accepts the sequence) and every answer is
    whole, on its own stream; the connection then ends cleanly when the client leaves."""
    import h2.config
    import h2.connection
    import h2.events
    import trio
    import trio.testing

    from pact_ingress.net.http2 import H2Connection
    from tests.test_tls_server import _handshake_to_finished
    from tests.tls_helpers import WebPKI

    tls, peer, server_sock = await _handshake_to_finished(WebPKI(), with_request=b"")
    server_sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    peer.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    held = 0
    write_nowait = tls.write_nowait

    def counting(data: bytes | bytearray) -> bool | None:
        nonlocal held
        done = write_nowait(data)
        held += done is False
        return done

    tls.write_nowait = counting  # type: ignore[method-assign]
    client = h2.connection.H2Connection(h2.config.H2Configuration(
        client_side=True, header_encoding=None))
    client.initiate_connection()
    client.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: MAX_WINDOW})
    client.increment_flow_control_window(MAX_WINDOW - 65535)
    sids = []
    for i in range(60):  # under the stream limit, their answers under `FLUSH_BYTES`
        sid = client.get_next_available_stream_id()
        client.send_headers(sid, [(b":method", b"GET"), (b":scheme", b"https"),
                                  (b":authority", b"h2.test"), (b":path", f"/{i}".encode())],
                            end_stream=True)
        sids.append(sid)
    answered = trio.Event()
    go = trio.Event()  # set once every handler waits and the writer is parked, idle
    given = waiting = 0

    async def handle(ex: object) -> None:
        nonlocal given, waiting
        waiting += 1
        await go.wait()  # trio runs the woken handlers in one batch, in random order
        body = (ex.target * 300)[:1000]  # type: ignore[attr-defined]
        await ex.respond_whole(200, [(b"content-length", str(len(body)).encode())],  # type: ignore[attr-defined]
                               body)
        given += 1
        if given == len(sids):
            answered.set()

    conn = H2Connection(tls, idle_timeout=30, write_timeout=10, idle_scopes=set(),
                        draining=trio.Event())
    bodies: dict[int, bytes] = {}
    ended: set[int] = set()
    events: list[object] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(conn.serve, handle)

        def pump_out() -> None:
            peer.tls.write(client.data_to_send())
            peer.sock.sendall(peer.outgoing.read())

        pump_out()
        with trio.fail_after(20):
            while waiting < len(sids):
                await trio.sleep(0.01)
            # nothing else can run now: the writer is parked with nothing to send, so
            # the handlers, all woken at once, send their answers themselves until the
            # kernel refuses part of one (held), and the writer takes over from there
            await trio.testing.wait_all_tasks_blocked(0.05)
            go.set()
            await answered.wait()
        await trio.sleep(0.1)
        with trio.fail_after(20):  # now read it all: every record must decrypt
            while not ended.issuperset(sids):
                peer.incoming.write(await peer.receive())
                try:
                    plain = peer.tls.read(1 << 20)
                except ssl.SSLWantReadError:
                    continue
                while True:
                    try:
                        plain += peer.tls.read(1 << 20)
                    except ssl.SSLWantReadError:
                        break
                for ev in client.receive_data(plain):
                    events.append(ev)
                    if isinstance(ev, h2.events.DataReceived):
                        bodies[ev.stream_id] = bodies.get(ev.stream_id, b"") + ev.data
                        client.acknowledge_received_data(ev.flow_controlled_length,
                                                         ev.stream_id)
                    elif isinstance(ev, h2.events.StreamEnded):
                        ended.add(ev.stream_id)
                pump_out()
        client.close_connection()
        pump_out()
        with trio.fail_after(20):
            await conn.flush()
        nursery.cancel_scope.cancel()
    tls.close()
    peer.sock.close()
    assert held > 0, "the kernel took every answer: the held path was not exercised"
    for i, sid in enumerate(sids):
        assert bodies[sid] == (f"/{i}".encode() * 300)[:1000], sid
    assert not any(isinstance(e, h2.events.StreamReset) for e in events)
