"""Ciphertext on a stdlib socket under trio: try the syscall, wait only when it would block.

`net/memory_tls.py` (the terminate engine's TLS on both legs) moves its ciphertext with
these two functions instead of trio's socket wrappers, which cost more per call than the
syscall itself on this path. The socket must be non-blocking (trio
sockets' underlying sockets are). Errors are the caller's to name.

Deadlines are absolute (`trio.current_time()`) and only cost anything when the kernel
makes us wait: the wait arms its deadline with the sweeper (`net/deadlines.py`), never
around a syscall that completes at once, which is what almost every send and many reads
do. A deadline that passes raises `trio.TooSlowError`.
"""

from __future__ import annotations

import math
import socket

from pact_ingress.net import deadlines

# Deadlines on the waits are armed with the sweeper (`net/deadlines.py`): no cancel
# scope per wait.
wait_readable = deadlines.wait_readable
wait_writable = deadlines.wait_writable


async def send_all(sock: socket.socket, data: bytes, deadline: float = math.inf) -> None:
    """All of `data`, `OSError`, or `trio.TooSlowError` at `deadline`."""
    try:
        sent = sock.send(data)
    except BlockingIOError:
        sent = 0
    if sent == len(data):
        return
    view = memoryview(data)[sent:]
    while view:
        try:
            sent = sock.send(view)
        except BlockingIOError:
            await wait_writable(sock, deadline)
            continue
        view = view[sent:]


async def recv(sock: socket.socket, size: int, deadline: float = math.inf,
               wait_first: bool = False) -> bytes:
    """Up to `size` bytes, b"" at the peer's close, `OSError`, or `trio.TooSlowError`.
    `wait_first`: the caller just found the socket empty; skip the recv bound to fail."""
    if wait_first:
        await wait_readable(sock, deadline)
    while True:
        try:
            return sock.recv(size)
        except BlockingIOError:
            await wait_readable(sock, deadline)
