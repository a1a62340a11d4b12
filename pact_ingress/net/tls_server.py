"""The server side of public TLS for the terminate engine: `ssl.SSLObject` on memory BIOs.

Why not `trio.SSLStream`: it is correct and general, but on the terminate path every
request pays for its generality (a retry loop with conflict detection around each
operation, trio socket wrappers around each syscall). Here the ciphertext moves straight
between the stdlib socket under the connection and the BIOs, and trio is only asked to
wait when a syscall would block. The peeked ClientHello is simply the first thing written
into the incoming BIO, so no replay stream is needed.

Concurrency: one task receives and any task may send (HTTP/1.1 watches for a close while
it writes; HTTP/2 streams write while the connection reads). `SSLObject` calls never
await, so they cannot interleave; what can is moving ciphertext out, which happens under
one lock and in BIO order, so records leave in the order they were made.
"""

from __future__ import annotations

import socket
import ssl

import trio

from pact_ingress.net import rawsock

#: Ciphertext read per syscall; a TLS record is at most ~16 KiB.
READ_SIZE = 64 * 1024
#: Plaintext handed to `SSLObject.write` at once: a few records, so a large response
#: starts leaving before all of it is encrypted.
WRITE_SLICE = 64 * 1024


class ServerTLS(trio.abc.Stream):
    def __init__(self, sock: socket.socket, context: ssl.SSLContext, initial: bytes) -> None:
        self._sock = sock
        self._in = ssl.MemoryBIO()
        self._out = ssl.MemoryBIO()
        self._ssl = context.wrap_bio(self._in, self._out, server_side=True)
        if initial:
            self._in.write(initial)
        self._flush_lock = trio.Lock()
        self._closed = False

    # -- ciphertext ----------------------------------------------------------------------

    async def _flush(self) -> None:
        async with self._flush_lock:
            while data := self._out.read():
                try:
                    await rawsock.send_all(self._sock, data)
                except OSError as exc:
                    raise trio.BrokenResourceError(f"send failed: {exc!r}") from exc

    async def _fill(self) -> None:
        try:
            data = await rawsock.recv(self._sock, READ_SIZE)
        except OSError as exc:
            raise trio.BrokenResourceError(f"receive failed: {exc!r}") from exc
        if data:
            self._in.write(data)
        else:
            self._in.write_eof()

    # -- TLS ------------------------------------------------------------------------------

    async def do_handshake(self) -> None:
        while True:
            try:
                self._ssl.do_handshake()
                break
            except ssl.SSLWantReadError:
                await self._flush()
                await self._fill()
            except ssl.SSLError as exc:
                await self._flush_quietly()  # the alert, if any
                raise trio.BrokenResourceError(f"TLS handshake failed: {exc}") from exc
        await self._flush()

    def selected_alpn_protocol(self) -> str | None:
        return self._ssl.selected_alpn_protocol()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        if self._closed:
            raise trio.ClosedResourceError()
        size = READ_SIZE if max_bytes is None else max_bytes
        while True:
            try:
                data = self._ssl.read(size)
            except ssl.SSLWantReadError:
                if self._out.pending:  # post-handshake messages (tickets, key update)
                    await self._flush()
                await self._fill()
                continue
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                return b""  # close_notify, or a close without it: the end either way
            except ssl.SSLError as exc:
                raise trio.BrokenResourceError(f"TLS failed: {exc}") from exc
            if self._out.pending:
                await self._flush()
            return data

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        if self._closed:
            raise trio.ClosedResourceError()
        try:
            view = memoryview(data)
            for start in range(0, len(view), WRITE_SLICE):
                self._ssl.write(view[start:start + WRITE_SLICE])
                await self._flush()
        except ssl.SSLError as exc:
            raise trio.BrokenResourceError(f"TLS failed: {exc}") from exc

    async def wait_send_all_might_not_block(self) -> None:
        await trio.lowlevel.wait_writable(self._sock)

    async def _flush_quietly(self) -> None:
        try:
            await self._flush()
        except trio.BrokenResourceError:
            pass

    async def aclose(self) -> None:
        """Close the socket; no close_notify (clients treat a close as the end, and a
        close that could block on a slow peer has no place in cleanup)."""
        if not self._closed:
            self._closed = True
            trio.lowlevel.notify_closing(self._sock)  # wake any task waiting on it
            self._sock.close()
        await trio.lowlevel.checkpoint()
