"""The passthrough engine (`net/edge.py`) attacked through a real `serve` on loopback:
a head the backend's kernel takes only in part, a backend that never reads, the per-IP
cap counted exactly after clients aborted at every stage, and a route moved by a reload
while connections splice. After each, the process's own truth (open connections, its
fd table) is back where it was. Waits are bounded polls; nothing asserts timing."""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from collections.abc import Iterator

import pytest

from tests.test_attacks4 import ext, hello, sni_ext
from tests.test_edge import (
    Backend,
    dial,
    echo,
    eventually,
    hello_for,
    metric,
    open_fds,
    reset,
)
from tests.test_serve import HELLO, WAIT, Served, free_port, recv_exact

ECHO_SNI = "www.example.test"  # the captured hello's name
#: A route whose backend advertises a tiny receive window and reads late.
NARROW_SNI = "narrow.example.test"
#: The per-IP cap of the served config.
PER_IP = 6


def big_hello(sni: str, total: int) -> bytes:
    """One record holding a ClientHello of `total` bytes (header included), padded."""
    base = hello([sni_ext(sni.encode()), ext(21, b"")])
    return hello([sni_ext(sni.encode()), ext(21, bytes(total - (len(base) - 5)))])


def late_echo(conn: socket.socket) -> None:
    """Echo, but only after a pause: the engine writes its head while nothing reads."""
    time.sleep(0.3)
    echo(conn)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Served, int, int]]:
    tmp = tmp_path_factory.mktemp("edge-attacks")
    tls, admin = free_port(), free_port()
    plain, narrow = Backend(echo), Backend(late_echo)
    # inherited by the sockets it accepts: a window of a few hundred bytes at first
    narrow.server.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1)
    text = f"""\
state_dir: state
listen:
  tls: ["127.0.0.1:{tls}"]
  admin: "127.0.0.1:{admin}"
limits:
  max_connections_per_ip: {PER_IP}
  clienthello_timeout: 5s
tenants:
  - name: edge
    pins: ["sha256:{'A' * 43}"]
    routes:
      - {{host: {ECHO_SNI}, mode: passthrough, backend: "127.0.0.1:{plain.port}"}}
      - {{host: {NARROW_SNI}, mode: passthrough, backend: "127.0.0.1:{narrow.port}"}}
"""
    s = Served(tmp, text)
    try:
        s.wait_notify("READY=1")
        yield s, tls, admin
    finally:
        s.stop()
        plain.close()
        narrow.close()


def settled(admin: int) -> bool:
    return metric(admin, "pact_ingress_open_connections") == 0


def test_a_head_the_backend_takes_in_part_is_sent_whole(served: tuple[Served, int, int]):
    """A ClientHello near the 16 KiB cap with the client's next bytes behind it makes a
    head of ~20 KiB. The backend socket has TCP_NOTSENT_LOWAT 16 KiB, so toward a
    backend whose window is small the kernel takes only part of it, without saying
    EAGAIN; the rest must still go out when the backend reads."""
    s, tls, admin = served
    big = big_hello(NARROW_SNI, 16384)
    tail = os.urandom(8000)
    for source in ("127.0.0.1", "127.0.0.2"):
        with dial(tls, source) as c:
            c.sendall(big + tail)  # one write: the engine reads hello and tail together
            assert recv_exact(c, len(big) + len(tail)) == big + tail
    eventually(lambda: settled(admin), "open_connections back to 0")
    assert not [e for e in s.log_events() if e.get("event") == "backend_reset"]
