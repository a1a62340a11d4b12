"""Every close after an answer, against a client that reads slowly and keeps talking.

When the edge closes a connection whose client sent bytes it never read (a pipelined
request, the rest of an upload, HTTP/2 PINGs and WINDOW_UPDATEs), Linux answers the
close with a TCP reset, and the reset throws away whatever the edge's kernel has not
delivered yet: a client with a small receive buffer that reads slowly loses the tail of
its last answer. The same happens to bytes the client sends after the close: they meet
a closed socket, which resets the connection with the answer still queued.

Each test provokes one such close with an answer much larger than the kernel buffers
(the node's `/big`; on port 80, a redirect of several KiB), a client whose receive buffer
is small (4 KiB; on port 80 the smallest there is) and reads it a few KiB at a time, and
asserts the invariant: the client gets the whole answer.

Passthrough has no such close: it relays, and ends a connection only once both ends
said EOF (nothing left unread) or one end failed (a reset passed on as one).
"""

from __future__ import annotations

import contextlib
import signal
import socket
import ssl
import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.netutil import free_port
from tests.terminate_env import (
    ATTACKER_IP,
    HOST,
    LOOPBACK,
    WAIT,
    RecordingNode,
    Serve,
    make_identities,
    request_bytes,
    tls_socket,
)
from tests.terminate_env import ServeEnv as Env
from tests.test_h2_attacks import GOAWAY, LIMITS, NO_ERROR, WINDOW_UPDATE, frame, u32
from tests.test_h2_whole_attacks import Wire, _wide_open, big_ok

#: An answer much larger than what the kernels on both sides hold for a 4 KiB reader.
SIZE = 400_000
#: Small enough that the tests can provoke an early answer (413) cheaply.
MAX_BODY = 65_536


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    env = Env.start(tmp_path_factory.mktemp("close"),
                    limits={**LIMITS, "max_body_bytes": MAX_BODY})
    yield env
    env.stop()


@pytest.fixture
def env(shared: Env) -> Iterator[Env]:
    env = shared.fresh()
    yield env
    assert env.serve.wait_open_connections(0) == 0


def _wait_node(env: Env, marker: str) -> None:
    assert env.node.wait_for(lambda: any(marker in r.target and r.complete
                                         for r in env.node.requests())), env.node.requests()


def slow_read(sock: socket.socket, *, talk: Callable[[int], None] = lambda i: None,
              burst: int = 4096, pause: float = 0.002, limit: int | None = None
              ) -> tuple[bytes, str | None]:
    """Everything the edge sends until it closes, read `burst` bytes at a time with a
    `pause` after each read, calling `talk(i)` after the i-th read (its send errors are
    ignored: the edge may have closed its side). Also stops once `limit` bytes came.
    Returns the bytes and the error that ended the reading (None: a clean close)."""
    data = bytearray()
    sock.settimeout(5.0)
    deadline = time.monotonic() + 2 * WAIT
    for i in range(100_000):  # bounded in count and time
        if time.monotonic() > deadline:
            return bytes(data), "timed out"
        try:
            chunk = sock.recv(burst)
        except TimeoutError:
            return bytes(data), "nothing for 5 s"
        except (OSError, ssl.SSLError) as exc:
            return bytes(data), repr(exc)
        if not chunk:
            return bytes(data), None
        data += chunk
        if limit is not None and len(data) >= limit:
            return bytes(data), None
        with contextlib.suppress(OSError, ssl.SSLError):
            talk(i)
        time.sleep(pause)
    return bytes(data), "too many reads"


def responses(data: bytes) -> list[tuple[int, dict[str, str], bytes]]:
    """The HTTP/1.1 responses (Content-Length framed) in `data`; a cut-off last one is
    returned with the body it got."""
    out = []
    while data:
        head, sep, rest = data.partition(b"\r\n\r\n")
        if not sep:
            out.append((0, {}, data))
            break
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip()
                   for k, _, v in (line.partition(":") for line in lines[1:])}
        length = int(headers.get("content-length", "0"))
        out.append((int(lines[0].split(" ")[1]), headers, rest[:length]))
        data = rest[length:]
    return out


def _big_whole(got: list[tuple[int, dict[str, str], bytes]], error: str | None) -> None:
    assert got and got[0][0] == 200, (error, [(s, h) for s, h, _ in got])
    assert len(got[0][2]) == SIZE and got[0][2] == b"x" * SIZE, (len(got[0][2]), error)


# === HTTP/1.1 ===========================================================================


def test_h1_connection_close_answer_reaches_a_talking_slow_reader(env: Env) -> None:
    """An answer with `Connection: close` (the client asked for it) while the client
    still sends bytes the edge will not read: the edge must not reset the answer away."""
    sock = tls_socket(env.serve.port, source=ATTACKER_IP, rcvbuf=4096)
    try:
        sock.sendall(request_bytes("GET", f"/big?bytes={SIZE}",
                                   headers=[("Connection", "close")]))
        _wait_node(env, "/big")
        data, error = slow_read(sock, talk=lambda i: sock.sendall(b"\r\n"))
        got = responses(data)
        _big_whole(got, error)
        assert got[0][1].get("connection") == "close"
    finally:
        sock.close()


def test_h1_bad_request_after_a_large_answer_does_not_reset_it(env: Env) -> None:
    """A large answer, then a malformed pipelined request (400, close), and the client
    keeps sending: both answers arrive whole."""
    sock = tls_socket(env.serve.port, source=ATTACKER_IP, rcvbuf=4096)
    try:
        sock.sendall(request_bytes("GET", f"/big?bytes={SIZE}"))
        _wait_node(env, "/big")
        sock.sendall(b"NOT A REQUEST\r\n\r\n")
        data, error = slow_read(sock, talk=lambda i: sock.sendall(b"more junk\r\n"))
        got = responses(data)
        _big_whole(got, error)
        assert len(got) == 2 and got[1][0] == 400, (error, [(s, h) for s, h, _ in got])
        assert got[1][1].get("connection") == "close"
    finally:
        sock.close()


def test_h1_early_answer_after_a_large_answer_reaches_an_uploading_slow_reader(
        env: Env) -> None:
    """A large answer, then a pipelined upload over max_body_bytes, answered 413 before
    its body is read while the tail of the first answer is still in the edge's kernel;
    the client keeps uploading a little and reads nothing for longer than a second, then
    reads on: both answers arrive whole."""
    sock = tls_socket(env.serve.port, source=ATTACKER_IP, rcvbuf=4096)
    try:
        sock.sendall(request_bytes("GET", f"/big?bytes={SIZE}"))
        _wait_node(env, "/big")
        # all but the last 12 KB: the edge has handed the whole answer to its kernel by
        # then (its socket holds more), and the client's holds less than that
        first, error = slow_read(sock, limit=SIZE - 12_000)
        assert error is None, error
        sock.sendall(f"POST /upload HTTP/1.1\r\nHost: {HOST}\r\nContent-Type: text/plain\r\n"
                     f"Content-Length: 10000000\r\n\r\n".encode())
        for _ in range(15):  # 1.5 s of uploading without reading
            with contextlib.suppress(OSError, ssl.SSLError):
                sock.sendall(b"u" * 1024)
            time.sleep(0.1)
        rest, error = slow_read(sock, talk=lambda i: sock.sendall(b"u" * 1024))
        got = responses(first + rest)
        _big_whole(got, error)
        assert len(got) == 2 and got[1][0] == 413, (error, [(s, h) for s, h, _ in got])
    finally:
        sock.close()


def test_h1_drain_answer_reaches_a_slow_reader_that_pipelines(tmp_path: Path) -> None:
    """SIGTERM while a large answer is still on its way, and the client pipelines its
    next request (which the edge, draining, will not take): the answer arrives whole,
    then the connection closes, and the process exits cleanly."""
    env = Env.start(tmp_path, limits=LIMITS)
    try:
        sock = tls_socket(env.serve.port, source=ATTACKER_IP, rcvbuf=4096)
        try:
            sock.sendall(request_bytes("GET", f"/big?bytes={SIZE}"))
            _wait_node(env, "/big")
            env.serve.proc.send_signal(signal.SIGTERM)
            data, error = slow_read(
                sock, talk=lambda i: i == 0 and sock.sendall(request_bytes("GET", "/next")))
            got = responses(data)
            _big_whole(got, error)
            assert len(got) == 1, [(s, h) for s, h, _ in got]
        finally:
            sock.close()
        assert env.serve.proc.wait(timeout=60) == 0, env.serve.logs()[-2000:]
    finally:
        env.stop()


# === HTTP/2 =============================================================================


def test_h2_idle_close_does_not_reset_an_answer_still_on_its_way(tmp_path: Path) -> None:
    """The idle timeout closes a connection whose last answer is still in the edge's
    kernel buffers (its stream ended when the edge handed it over), while the client,
    reading slowly, gives its window back: the client still gets every byte."""
    env = Env.start(tmp_path, limits={**LIMITS, "idle_timeout": "250ms"})
    try:
        c = Wire(env, burst=4096, **_wide_open())  # type: ignore[arg-type]
        c.send(frame(WINDOW_UPDATE, 0, 0, u32(2**30)))  # room left for the updates below
        try:
            c.send(c.headers(1, f"/big?bytes={SIZE}"))
            _wait_node(env, "/big")
            deadline = time.monotonic() + 60
            for _ in range(5000):  # bounded: until the end of the connection
                before = c.received
                if time.monotonic() > deadline or not c.read(2.0):
                    break
                if c.received > before:  # what a client gives back for what it read
                    c.send(frame(WINDOW_UPDATE, 0, 0, u32(c.received - before)))
                time.sleep(0.02)  # slower than the idle timeout lets the kernel's share go
            c.drain(timeout=2)
            assert [struct.unpack(">II", f[3][:8]) for f in c.frames if f[0] == GOAWAY] \
                in ([], [(1, NO_ERROR)])
            big_ok(c, 1, SIZE)
        finally:
            c.close()
    finally:
        env.stop()


# === port 80 ============================================================================


class _WithPort80(Serve):
    """`Serve` with the plain-HTTP listener on loopback too."""

    def render(self) -> str:
        self.http_port = free_port()
        return super().render().replace(
            "listen:\n", f'listen:\n  http: ["{LOOPBACK}:{self.http_port}"]\n', 1)


def test_port80_redirect_reaches_a_slow_reader_that_sends_a_body(tmp_path: Path) -> None:
    """A 308 whose Location is long (the target is echoed: several KiB), to a client with
    the smallest receive buffer that is still sending a request body the listener never
    reads: the redirect arrives whole."""
    ids = make_identities(tmp_path)
    node = RecordingNode(ids.node, client_ca=ids.ingress)
    try:
        serve = _WithPort80(tmp_path, node, ids.node.fingerprint)
    except BaseException:
        node.stop()
        raise
    try:
        path = "/" + "a" * 7000
        sock = socket.socket()
        try:
            # before connecting: the window it advertises is sized from it
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1)
            sock.settimeout(WAIT)
            sock.connect((LOOPBACK, serve.http_port))
            sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {HOST}\r\n"
                         f"Content-Length: 1000000\r\n\r\n".encode() + b"b" * 1024)
            data, error = slow_read(sock, talk=lambda i: sock.sendall(b"b" * 256),
                                    burst=512, pause=0.005)
        finally:
            sock.close()
        got = responses(data)
        assert got and got[0][0] == 308, (error, data[:200])
        assert got[0][1].get("location") == f"https://{HOST}{path}", (error, len(data))
        assert got[0][2] == b"redirecting to https\n", (error, got[0][2])
    finally:
        serve.stop()
        node.stop()
