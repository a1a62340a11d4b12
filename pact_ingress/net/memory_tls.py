"""TLS as an `ssl.SSLObject` on memory BIOs, its ciphertext moved by us.

Both TLS ends of the terminate engine use this: the public side (`net/tls_server.py`,
server) and the pinned pool toward nodes (`net/upstream.py`, client). Why not
`trio.SSLStream`: on this path every request paid for its generality (a retry loop with
conflict detection around each operation, trio's socket wrappers around each syscall).
Here ciphertext goes straight between a non-blocking stdlib socket and the BIOs
(`net/rawsock.py`), and trio is only asked to wait when a syscall would block; over any
other stream (a tunnel) it goes through `receive_some`/`send_all`.

Concurrency: one task reads and any task may write. `SSLObject` calls never await, so
they cannot interleave; moving ciphertext out can, so it happens under one lock and in
BIO order, and records leave in the order they were made.

Failures (transport or TLS) raise what `_broken` makes: `trio.BrokenResourceError`
here; a subclass names its own.
"""

from __future__ import annotations

import socket
import ssl

import trio

from pact_ingress.net import rawsock

#: Ciphertext read per syscall; a TLS record is at most ~16 KiB.
READ_SIZE = 64 * 1024
#: Plaintext handed to `SSLObject.write` at once: a few records, so a large body starts
#: leaving before all of it is encrypted.
WRITE_SLICE = 64 * 1024

_TRANSPORT_ERRORS = (OSError, trio.BrokenResourceError, trio.ClosedResourceError)


class MemoryTLS:
    def __init__(self, ssl_object: ssl.SSLObject, incoming: ssl.MemoryBIO,
                 outgoing: ssl.MemoryBIO, *, raw: socket.socket | None,
                 stream: trio.abc.Stream | None) -> None:
        assert raw is not None or stream is not None
        self._ssl = ssl_object
        self._in = incoming
        self._out = outgoing
        self._raw = raw
        self._stream = stream
        self._flush_lock = trio.Lock()

    def _broken(self, why: str) -> Exception:
        return trio.BrokenResourceError(why)

    @property
    def ssl_object(self) -> ssl.SSLObject:
        return self._ssl

    # -- ciphertext -----------------------------------------------------------------------

    async def _flush(self) -> None:
        async with self._flush_lock:
            while data := self._out.read():
                try:
                    if self._raw is not None:
                        await rawsock.send_all(self._raw, data)
                    else:
                        await self._stream.send_all(data)  # type: ignore[union-attr]
                except _TRANSPORT_ERRORS as exc:
                    raise self._broken(f"send failed: {exc!r}") from exc

    async def _fill(self) -> None:
        try:
            if self._raw is not None:
                data = await rawsock.recv(self._raw, READ_SIZE)
            else:
                data = await self._stream.receive_some(READ_SIZE)  # type: ignore[union-attr]
        except _TRANSPORT_ERRORS as exc:
            raise self._broken(f"receive failed: {exc!r}") from exc
        if data:
            self._in.write(data)
        else:
            self._in.write_eof()

    # -- TLS ------------------------------------------------------------------------------

    async def handshake(self) -> None:
        while True:
            try:
                self._ssl.do_handshake()
                break
            except ssl.SSLWantReadError:
                await self._flush()
                await self._fill()
            except ssl.SSLError as exc:
                try:
                    await self._flush()  # the alert, if any
                except Exception:  # noqa: BLE001 - the handshake's own failure is the news
                    pass
                raise self._broken(f"TLS handshake failed: {exc}") from exc
        await self._flush()

    async def read(self, size: int = READ_SIZE) -> bytes:
        """Plaintext (at most `size`), b"" when the peer closed (with or without
        close_notify: a body cut short is caught by the HTTP framing all the same)."""
        while True:
            try:
                data = self._ssl.read(size)
            except ssl.SSLWantReadError:
                if self._out.pending:  # post-handshake messages (tickets, key update)
                    await self._flush()
                await self._fill()
                continue
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                return b""
            except ssl.SSLError as exc:
                raise self._broken(f"TLS failed: {exc}") from exc
            if self._out.pending:
                await self._flush()
            return data

    async def write(self, data: bytes | bytearray | memoryview) -> None:
        try:
            if len(data) <= WRITE_SLICE:
                self._ssl.write(data)
                await self._flush()
                return
            view = memoryview(data)
            for start in range(0, len(view), WRITE_SLICE):
                self._ssl.write(view[start:start + WRITE_SLICE])
                await self._flush()
        except ssl.SSLError as exc:
            raise self._broken(f"TLS failed: {exc}") from exc
