"""A stream that first replays the bytes the router already peeked, then reads live.

The router reads the ClientHello before it knows what to do with a connection; whoever
takes the connection next (the terminate engine via `trio.SSLStream`, the tunnel server,
the ACME TLS-ALPN responder) must see the connection from its first byte. `ReplayStream`
gives them exactly that without copying the socket or re-reading.

While replayed bytes remain it keeps the rules of a trio stream (a size below 1 is an
error, not an EOF-looking b""; a closed stream refuses to read); once they are used up
every call goes to the wrapped `SocketStream`. `trio.testing`'s conformance checks pass
(tests/test_replay.py). Like a `SocketStream` it exposes `.socket` and the sockopt
calls, so code that configures the TCP connection underneath can take either.
"""

from __future__ import annotations

import trio


class ReplayStream(trio.abc.HalfCloseableStream):
    """`peeked` bytes first, then `inner`'s. Sending goes straight to `inner`."""

    def __init__(self, peeked: bytes, inner: trio.SocketStream) -> None:
        self._peeked = memoryview(peeked) if peeked else None
        self._closed = False
        self.inner = inner
        self.socket = inner.socket

    @property
    def pending(self) -> bytes:
        """Replay bytes not yet consumed (the splicer forwards these before splicing)."""
        return bytes(self._peeked) if self._peeked is not None else b""

    def take_pending(self) -> bytes:
        data, self._peeked = self.pending, None
        return data

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        if self._peeked is not None:
            if max_bytes is not None and max_bytes < 1:
                raise ValueError("max_bytes must be >= 1")
            await trio.lowlevel.checkpoint()
            if self._closed:
                raise trio.ClosedResourceError("the stream was closed")
            n = len(self._peeked) if max_bytes is None else min(max_bytes, len(self._peeked))
            chunk, rest = bytes(self._peeked[:n]), self._peeked[n:]
            self._peeked = rest if len(rest) else None
            return chunk
        return await self.inner.receive_some(max_bytes)

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self.inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.inner.wait_send_all_might_not_block()

    async def send_eof(self) -> None:
        await self.inner.send_eof()

    async def aclose(self) -> None:
        self._closed = True
        await self.inner.aclose()

    def setsockopt(self, *args: object) -> None:
        self.inner.setsockopt(*args)  # type: ignore[arg-type]

    def getsockopt(self, *args: object) -> object:
        return self.inner.getsockopt(*args)  # type: ignore[arg-type]
