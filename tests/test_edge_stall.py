"""The epoll engine's interests: writability asked for only once a write has blocked, so
a connection whose every buffer fills must still resume; readability of a source not
asked for while its direction waits to write, and nothing lost by that (through a real
`serve`)."""

from __future__ import annotations

import hashlib
import os
import random
import socket
import struct
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.test_edge import (
    PER_IP,
    edge_served,
    eventually,
    hello_for,
    served,  # noqa: F401,F811  (a served instance of its own)
)
from tests.test_serve import HELLO, WAIT, Served, free_port


def test_stalled_reader_resumes_both_ways(served: tuple[Served, int, int]):  # noqa: F811
    """A client that stops reading fills every buffer on the way: the engine's writes
    to it, then the echo backend's, then the engine's writes to the backend block. Each
    blocked fd must report writability later (it is asked for only once a write has
    blocked), so once the client reads again every byte arrives, in order."""
    _, tls, _ = served
    size = 48 << 20  # more than the buffers of the chain hold
    block = random.Random(11).randbytes(1 << 20)
    with socket.socket() as c:
        c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)  # stalls sooner
        c.settimeout(WAIT)
        c.connect(("127.0.0.1", tls))
        c.sendall(HELLO)
        sent = threading.Event()

        def writer() -> None:
            for i in range(size >> 20):
                c.sendall(block[i:] + block[:i])
            sent.set()

        w = threading.Thread(target=writer, daemon=True)
        w.start()
        sent.wait(1.0)  # not reading meanwhile: the writer stalls once buffers are full
        want = hashlib.sha256(HELLO)
        for i in range(size >> 20):
            want.update(block[i:] + block[:i])
        got = hashlib.sha256()
        n = 0
        while n < len(HELLO) + size:
            chunk = c.recv(1 << 20)
            assert chunk, "EOF before every byte came back"
            got.update(chunk)
            n += len(chunk)
        w.join(WAIT)
        assert sent.is_set()
    assert n == len(HELLO) + size and got.hexdigest() == want.hexdigest()


# --- a source whose direction waits to write is not read (nor woken for) -----------------

GATE_SNI = "gat.example.test"
EPOLLIN, EPOLLOUT, EPOLLRDHUP = 0x1, 0x4, 0x2000


class _GatedBackend:
    """Accepts, takes nothing until `gate` is set (its small receive buffer fills at
    once), then reads to EOF and reports what it got: (bytes, sha256, how it ended)."""

    def __init__(self) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.server.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 14)  # inherited
        self.port = self.server.getsockname()[1]
        self.gate = threading.Event()
        self.result: list[tuple[int, str, str]] = []
        self.done = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        conn, _ = self.server.accept()
        with conn:
            self.gate.wait(WAIT * 2)
            digest, n, how = hashlib.sha256(), 0, "eof"
            conn.settimeout(WAIT)
            try:
                while data := conn.recv(1 << 20):
                    digest.update(data)
                    n += len(data)
            except OSError as exc:
                how = type(exc).__name__
            self.result.append((n, digest.hexdigest(), how))
            self.done.set()

    def close(self) -> None:
        self.server.close()


def socket_fd(pid: int, local_port: int, remote_port: int) -> int | None:
    """The fd of `pid` for the TCP socket local_port <-> remote_port (IPv4 loopback)."""
    inode = None
    for line in open("/proc/net/tcp").read().splitlines()[1:]:
        f = line.split()
        if (int(f[1].split(":")[1], 16) == local_port
                and int(f[2].split(":")[1], 16) == remote_port):
            inode = f[9]
    if inode is None:
        return None
    for name in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{name}") == f"socket:[{inode}]":
                return int(name)
        except OSError:
            continue
    return None


def interest(pid: int, fd: int) -> int | None:
    """The events `fd` is registered for in `pid`'s epoll sets (None: in none), from
    /proc/PID/fdinfo: the registration itself, not a guess from behaviour."""
    for name in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{name}") != "anon_inode:[eventpoll]":
                continue
            text = open(f"/proc/{pid}/fdinfo/{name}").read()
        except OSError:
            continue
        for line in text.splitlines():
            f = line.split()
            if f[:1] == ["tfd:"] and int(f[1]) == fd:
                return int(f[3], 16)
    return None


def is_muted(pid: int, fd: int) -> bool:
    """Registered, and not for readability (its hang-up still asked for)."""
    mask = interest(pid, fd)
    return mask is not None and not mask & EPOLLIN and bool(mask & EPOLLRDHUP)


@pytest.fixture()
def gated(tmp_path: Path) -> Iterator[tuple[Served, int, _GatedBackend]]:
    backend = _GatedBackend()
    tls, admin = free_port(), free_port()
    try:
        with edge_served(tmp_path, tls, admin, PER_IP, {GATE_SNI: backend.port}) as s:
            yield s, tls, backend
    finally:
        backend.gate.set()
        backend.close()


def _fill(c: socket.socket, block: bytes, limit: int) -> tuple[int, Any]:
    """Sends rotations of `block` until a send would block (or `limit`): (sent, sha256
    of what was sent, the hello included)."""
    digest = hashlib.sha256(hello_for(GATE_SNI))
    c.sendall(hello_for(GATE_SNI))
    c.setblocking(False)
    sent, i = 0, 0
    while sent < limit:
        chunk = block[i % len(block):] + block[:i % len(block)]
        try:
            n = c.send(chunk)
        except BlockingIOError:
            break
        digest.update(chunk[:n])
        sent += n
        i += 7
    c.setblocking(True)
    return sent, digest


def test_source_is_muted_while_its_direction_waits_and_its_eof_still_arrives(
        gated: tuple[Served, int, _GatedBackend]):
    """A backend that takes nothing: the client's direction ends up waiting to write.
    Meanwhile the engine does not ask to hear of the client's bytes (its fd is
    registered without EPOLLIN: every segment would be a wake-up for nothing), but still
    of its hang-up. The client then half-closes while muted, and once the backend reads,
    every byte and the EOF arrive: nothing that came while muted is lost."""
    instance, tls, backend = gated
    block = random.Random(5).randbytes(1 << 20)
    with socket.create_connection(("127.0.0.1", tls), timeout=WAIT) as c:
        sent, digest = _fill(c, block, 256 << 20)
        assert sent < 256 << 20, "the client's writes never blocked"
        pid = instance.proc.pid
        fd = socket_fd(pid, tls, c.getsockname()[1])
        assert fd is not None, "serve holds no socket for this client"
        eventually(lambda: is_muted(pid, fd),
                  f"the client fd stays registered for reading: {interest(pid, fd)}")
        mask = interest(pid, fd)
        assert mask is not None and mask & EPOLLRDHUP, f"hang-up not asked for: {mask}"
        c.shutdown(socket.SHUT_WR)  # the EOF arrives while the fd is muted
        backend.gate.set()
        assert backend.done.wait(WAIT), "the backend never saw the end of the upload"
        n, sha, how = backend.result[0]
        assert (how, n, sha) == ("eof", len(hello_for(GATE_SNI)) + sent, digest.hexdigest())
        c.settimeout(WAIT)
        assert c.recv(1) == b"", "the backend's close did not reach the client"


def test_a_client_reset_while_muted_ends_the_connection(
        gated: tuple[Served, int, _GatedBackend]):
    """Muted for reading, the client's fd still reports errors: a reset then ends the
    connection (the backend's side closes; the fd leaves the epoll set)."""
    instance, tls, backend = gated
    block = random.Random(6).randbytes(1 << 20)
    c = socket.create_connection(("127.0.0.1", tls), timeout=WAIT)
    _fill(c, block, 256 << 20)
    pid, port = instance.proc.pid, c.getsockname()[1]
    fd = socket_fd(pid, tls, port)
    assert fd is not None
    eventually(lambda: is_muted(pid, fd),
              "the client fd was never muted")
    c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    c.close()  # a reset
    eventually(lambda: socket_fd(pid, tls, port) is None,
              "serve still holds the reset connection")
    backend.gate.set()
    assert backend.done.wait(WAIT), "the backend's connection was not ended"
