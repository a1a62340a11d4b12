"""Closing a connection without throwing away the last answer.

When a socket is closed with bytes from the peer still unread, Linux answers the close
with a TCP reset instead of a FIN, and so it does to any byte the peer sends after the
close; the reset discards whatever our kernel had not delivered yet. A client that
reads slowly (a small receive window) and keeps talking (a pipelined request, the rest
of an upload, HTTP/2 WINDOW_UPDATEs and PINGs) would lose the tail of its last answer.
What already reached the client's kernel survives the reset, so it is enough to hold
the socket until the client has acknowledged everything sent, or closes itself.

`linger` does that: our sending side is shut (the client sees the end right after the
answer, which makes most clients close), and what the client still sends is read and
dropped (never decrypted or parsed) until then, bounded in time and bytes so that a
client cannot hold the connection or make us read for ever.
"""

from __future__ import annotations

import fcntl
import os
import socket
import sys
import termios
from typing import Protocol

import trio

#: Bytes per read of what is dropped.
READ_SIZE = 64 * 1024
#: How often a lingering connection asks whether the client has acknowledged it all.
POLL = 0.05


class _Socket(Protocol):
    """A stdlib or trio socket: all `linger` needs of one."""

    def fileno(self) -> int: ...

    def shutdown(self, how: int) -> None: ...


async def linger(sock: _Socket, seconds: float, max_bytes: int) -> None:
    """Shut our sending side of `sock` (non-blocking), then read and drop what the peer
    sends until it has acknowledged everything we sent, or it closes, for at most
    `seconds` and `max_bytes`. The caller closes the socket afterwards; at that point
    nothing it sent can be lost to a reset any more (unless a bound was reached).

    The usual case costs two syscalls and no wait: the client has acknowledged
    everything already (a prompt reader on a short path), so what it sent is dropped in
    one read and the close follows at once."""
    try:
        fd = sock.fileno()
        if not unacknowledged(fd):
            os.read(fd, READ_SIZE)  # drop what came, so the close sends no reset
            return
        sock.shutdown(socket.SHUT_WR)
    except OSError:  # BlockingIOError included: nothing came
        return  # or already reset, or closed: nothing left to protect
    left = max_bytes
    with trio.move_on_after(seconds):
        while left > 0:
            if not unacknowledged(fd):
                left = 0  # delivered: drop what is readable now, so no reset comes
            with trio.move_on_after(POLL if left else 0):
                await trio.lowlevel.wait_readable(fd)
            try:
                # `read` on the descriptor: the same for a stdlib and a trio socket,
                # whose descriptors are non-blocking alike
                data = os.read(fd, READ_SIZE)
            except BlockingIOError:
                continue
            except OSError:
                return
            if not data:
                return
            left -= len(data)


def unacknowledged(fd: int) -> int:
    """Bytes (and our FIN) sent on socket `fd` that the peer has not acknowledged yet;
    0 if the kernel cannot say."""
    try:
        return int.from_bytes(fcntl.ioctl(fd, termios.TIOCOUTQ, bytes(4)), sys.byteorder,
                              signed=True)
    except OSError:
        return 0


def unread(fd: int) -> int:
    """Bytes the peer sent on socket `fd` that nobody has read yet; 0 if the kernel
    cannot say."""
    try:
        return int.from_bytes(fcntl.ioctl(fd, termios.FIONREAD, bytes(4)), sys.byteorder,
                              signed=True)
    except OSError:
        return 0
