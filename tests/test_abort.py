"""`net/abort.py` on real loopback TCP: a reset in place, the descriptor kept."""

from __future__ import annotations

import errno
import select
import socket
import time
from collections.abc import Iterator

import pytest

from pact_ingress.net.abort import abort

QUEUED = 1 << 20


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        ours = socket.create_connection(listener.getsockname(), timeout=5)
        theirs, _ = listener.accept()
    theirs.settimeout(5)
    try:
        yield ours, theirs
    finally:
        ours.close()
        theirs.close()


def _queue_both_ways(ours: socket.socket, theirs: socket.socket) -> None:
    """Bytes waiting in our receive queue and in our send queue (nobody reads)."""
    for sender in (theirs, ours):
        sender.setblocking(False)
        sent, deadline = 0, time.monotonic() + 5
        while sent < QUEUED and time.monotonic() < deadline:
            try:
                sent += sender.send(b"x" * 65536)
            except BlockingIOError:
                break
        sender.setblocking(True)
        sender.settimeout(5)
    deadline = time.monotonic() + 5
    while not ours.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT):
        assert time.monotonic() < deadline


def test_abort_throws_both_queues_away_and_resets_the_peer(
        pair: tuple[socket.socket, socket.socket]) -> None:
    ours, theirs = pair
    _queue_both_ways(ours, theirs)
    fd = ours.fileno()
    abort(ours)
    assert ours.fileno() == fd  # still ours to close
    with pytest.raises(ConnectionResetError):
        ours.recv(65536)  # nothing of what was queued is readable
    with pytest.raises(OSError) as info:
        ours.send(b"more")
    assert info.value.errno in (errno.EPIPE, errno.ENOTCONN)
    # the peer reads at most what reached its queue before the reset, then the reset
    got = 0
    with pytest.raises(ConnectionResetError):
        while data := theirs.recv(1 << 20):
            got += len(data)
    assert got <= QUEUED


def test_abort_wakes_a_waiter_and_takes_an_fd(
        pair: tuple[socket.socket, socket.socket]) -> None:
    ours, theirs = pair
    ep = select.epoll()
    try:
        ep.register(ours.fileno(), select.EPOLLIN | select.EPOLLRDHUP | select.EPOLLET)
        assert ep.poll(0) == []
        abort(ours.fileno())
        events = dict(ep.poll(5))
        assert events[ours.fileno()] & (select.EPOLLERR | select.EPOLLHUP)
    finally:
        ep.close()
    with pytest.raises(ConnectionResetError):
        theirs.recv(1)


def test_abort_refuses_what_is_not_tcp() -> None:
    a, b = socket.socketpair()
    with a, b, pytest.raises(OSError):
        abort(a)
