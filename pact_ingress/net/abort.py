"""Abort a TCP connection in place: a reset both ways, without closing its descriptor.

`shutdown(SHUT_RDWR)` ends a connection politely: the peer gets a FIN after everything
already queued to it, and what the peer sent before still waits in our receive queue and
stays readable. To cut a connection someone else is using (a revoked key's tunnel
stream, spliced by another task), that is the wrong end: the holder would go on relaying
the receive queue (megabytes, with the kernel's autotuned buffers) before it saw the end,
and the peer's side would linger until its FIN timeout. Closing the descriptor with
`SO_LINGER` {on, 0} resets, but the holder still uses the descriptor's number, which the
next socket may be given.

On Linux, `connect(2)` with an `AF_UNSPEC` address disconnects a TCP socket
(`tcp_disconnect`): a connected one sends a RST, both queues are purged, the socket's
error becomes ECONNRESET (waiters in epoll wake with EPOLLERR | EPOLLHUP) and the
descriptor stays valid, closed by its holder as before. Python's `socket.connect` only
builds addresses of the socket's own family, so the call goes through ctypes.
"""

from __future__ import annotations

import ctypes
import os
import socket

_libc = ctypes.CDLL(None, use_errno=True)


class _Unspec(ctypes.Structure):
    _fields_ = [("family", ctypes.c_ushort), ("data", ctypes.c_char * 14)]


def abort(sock: socket.socket | int) -> None:
    """Reset the connected TCP socket `sock` (or fd) at once; OSError if the kernel
    refuses (e.g. not a TCP socket)."""
    fd = sock if isinstance(sock, int) else sock.fileno()
    address = _Unspec(socket.AF_UNSPEC)
    if _libc.connect(fd, ctypes.byref(address), ctypes.sizeof(address)) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))
