"""The server side of public TLS for the terminate engine, as a trio `Stream`.

`MemoryTLS` (`net/memory_tls.py`) over the socket the router accepted: the peeked
ClientHello is simply the first thing written into the incoming BIO, so no replay stream
is needed. Failures are `trio.BrokenResourceError`, as `trio.SSLStream`'s would be.
"""

from __future__ import annotations

import math
import socket
import ssl

import trio

from pact_ingress.net import readiness
from pact_ingress.net.memory_tls import ServerStream


class ServerTLS(ServerStream):
    _hubbed = True  # `close` wakes the hub's waiters too
    def __init__(self, sock: socket.socket, context: ssl.SSLContext, initial: bytes) -> None:
        incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        super().__init__(context.wrap_bio(incoming, outgoing, server_side=True), incoming,
                         outgoing, raw=sock, stream=None)
        if initial:
            incoming.write(initial)
        self._sock = sock
        self._closed = False

    @classmethod
    def adopt(cls, sock: socket.socket, tls: ssl.SSLObject, incoming: ssl.MemoryBIO,
              outgoing: ssl.MemoryBIO, watch: readiness.Watch | None) -> ServerTLS:
        """A connection the keep-alive lane (`net/h1_lane.py`) ran so far, handshake
        done, handed over as it is: its TLS engine with what its BIOs hold, and its
        socket's place in the readiness hub."""
        self = cls.__new__(cls)
        ServerStream.__init__(self, tls, incoming, outgoing, raw=sock, stream=None)
        self._sock = sock
        self._closed = False
        self._watch = watch
        return self

    @property
    def socket(self) -> socket.socket:
        return self._sock

    async def do_handshake(self, deadline: float = math.inf) -> None:
        await self.handshake(deadline, hold_tail=True)

    async def wait_send_all_might_not_block(self) -> None:
        await trio.lowlevel.wait_writable(self._sock)

    async def aclose(self) -> None:
        """Close the socket; no close_notify (clients treat a close as the end, and a
        close that could block on a slow peer has no place in cleanup)."""
        self.close()
        await trio.lowlevel.checkpoint()

    def close(self) -> None:
        """`aclose` without the checkpoint: for the owner's cleanup, which has nothing
        to wait for."""
        if not self._closed:
            self._closed = True
            self._close_watch()  # wake any task waiting on it
            trio.lowlevel.notify_closing(self._sock)
            self._sock.close()

    def close_unwatched(self) -> None:
        """`close` for an owner whose every task using this stream has ended, so none
        can be waiting on the socket: trio keeps no registration for a socket nobody
        waits on, and the kernel drops the socket from trio's epoll set as it closes,
        so telling trio first (an epoll_ctl per connection) is skipped."""
        if not self._closed:
            self._closed = True
            self._sock.close()
