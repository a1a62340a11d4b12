"""Ciphertext on a stdlib socket under trio: try the syscall, wait only when it would block.

`net/memory_tls.py` (the terminate engine's TLS on both legs) moves its ciphertext with
these two functions instead of trio's socket wrappers, which cost more per call than the
syscall itself on this path. The socket must be non-blocking (trio
sockets' underlying sockets are). Errors are the caller's to name.
"""

from __future__ import annotations

import socket

import trio


async def send_all(sock: socket.socket, data: bytes) -> None:
    """All of `data`, or `OSError`."""
    view = memoryview(data)
    while view:
        try:
            sent = sock.send(view)
        except BlockingIOError:
            await trio.lowlevel.wait_writable(sock)
            continue
        view = view[sent:]


async def recv(sock: socket.socket, size: int) -> bytes:
    """Up to `size` bytes, b"" at the peer's close, or `OSError`."""
    while True:
        try:
            return sock.recv(size)
        except BlockingIOError:
            await trio.lowlevel.wait_readable(sock)
