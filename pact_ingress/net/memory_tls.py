"""TLS as an `ssl.SSLObject` on memory BIOs, its ciphertext moved by us.

Both TLS ends of the terminate engine use this: the public side (`net/tls_server.py`,
server) and the pinned pool toward nodes (`net/upstream.py`, client). Why not
`trio.SSLStream`: on this path every request paid for its generality (a retry loop with
conflict detection around each operation, trio's socket wrappers around each syscall).
Here ciphertext goes straight between a non-blocking stdlib socket and the BIOs
(`net/rawsock.py`), and trio is only asked to wait when a syscall would block; over any
other stream (a tunnel) it goes through `receive_some`/`send_all`.

Concurrency: one task reads and any task may write. `SSLObject` calls never await, so
they cannot interleave; moving ciphertext out can, so one task at a time sends what the
outgoing BIO holds, in BIO order, and records leave in the order they were made. A task
that finds another mid-send waits for it (its records are sent by that task, in order).

Cost: nothing here awaits unless the kernel makes it (every operation tries the syscall
first), and a deadline costs a cancel scope only around an actual wait, never around an
operation that completes at once: on a keep-alive request that is most of them.

Failures (transport or TLS) raise what `_broken` makes: `trio.BrokenResourceError`
here; a subclass names its own.
"""

from __future__ import annotations

import math
import socket
import ssl

import trio

from pact_ingress.net import deadlines, rawsock, readiness

_wait_readable = deadlines.wait_readable

#: Ciphertext read per syscall; a TLS record is at most ~16 KiB.
READ_SIZE = 64 * 1024
#: Plaintext handed to `SSLObject.write` at once: a few records, so a large body starts
#: leaving before all of it is encrypted.
WRITE_SLICE = 64 * 1024

_TRANSPORT_ERRORS = (OSError, trio.BrokenResourceError, trio.ClosedResourceError)


class MemoryTLS:
    #: Waits on the socket go through this run's readiness hub (`net/readiness.py`)
    #: instead of trio's: a subclass sets it when every close of its socket while a task
    #: may wait on it goes through `_close_watch` first.
    _hubbed = False

    def __init__(self, ssl_object: ssl.SSLObject, incoming: ssl.MemoryBIO,
                 outgoing: ssl.MemoryBIO, *, raw: socket.socket | None,
                 stream: trio.abc.Stream | None) -> None:
        assert raw is not None or stream is not None
        self._ssl = ssl_object
        # the C object under `SSLObject` (same read/write/pending, same exceptions): the
        # data path skips the Python wrapper's frame on each call
        self._sslobj = getattr(ssl_object, "_sslobj", ssl_object)
        self._in = incoming
        self._out = outgoing
        self._raw = raw
        self._stream = stream
        self._sweeper: deadlines.Sweeper | None = None  # this run's, once a read waited
        self._watch: readiness.Watch | None = None  # in the hub, once a wait needed it
        self._sending = False  # a task is moving the outgoing BIO to the transport
        # ciphertext taken from the outgoing BIO by `write_nowait` that the kernel did
        # not take: it leaves before anything else, with the next `_flush`
        self._held = b""
        self._sent = trio.lowlevel.ParkingLot()  # tasks waiting for it to finish

    def _broken(self, why: str) -> Exception:
        return trio.BrokenResourceError(why)

    @property
    def ssl_object(self) -> ssl.SSLObject:
        return self._ssl

    def _watched(self) -> readiness.Watch | None:
        """The socket's Watch in this run's hub, joining it now if the process is busy
        enough for the hub to pay (`readiness.crowded`), leaving it when it is nearly
        idle (`readiness.sparse`); None: wait through trio."""
        watch = self._watch
        if watch is None:
            if self._hubbed and readiness.crowded():
                watch = self._watch = readiness.hub().watch(self._raw)  # type: ignore[arg-type]
        elif readiness.sparse() and watch.leave():
            watch = self._watch = None
        return watch

    def joined(self) -> readiness.Watch | None:
        """The socket's Watch in this run's hub, joining it now whatever the crowd, for
        a caller that needs the hub to see the socket's events while no task waits on
        it (`Watch.on_fail`; a Watch with it set does not leave). None when this
        stream's waits never go through the hub."""
        if not self._hubbed or self._raw is None:
            return None
        watch = self._watch
        if watch is None:
            watch = self._watch = readiness.hub().watch(self._raw)  # type: ignore[arg-type]
        return watch

    def _close_watch(self) -> None:
        """Before the socket closes under tasks that may wait on it: they are woken with
        `trio.ClosedResourceError` (trio's own waiters by `notify_closing`)."""
        if self._watch is not None:
            self._watch.close()

    async def _send_all(self, data: bytes | memoryview, deadline: float) -> None:
        """`rawsock.send_all` on our socket, its waits on the hub when `_hubbed`."""
        raw = self._raw
        watch = self._watched()
        if watch is None:
            await rawsock.send_all(raw, data, deadline)  # type: ignore[arg-type]
            return
        view = memoryview(data)
        while view:
            try:
                sent = raw.send(view)  # type: ignore[union-attr]
            except BlockingIOError:
                await watch.wait_writable(deadline)
                continue
            view = view[sent:]

    async def _recv_after_wait(self, deadline: float) -> bytes:
        """`rawsock.recv(wait_first=True)` on our socket, its waits on the hub when
        `_hubbed`."""
        raw = self._raw
        watch = self._watched()
        if watch is None:
            return await rawsock.recv(raw, READ_SIZE, deadline,  # type: ignore[arg-type]
                                      wait_first=True)
        tried = False
        while True:
            await watch.wait_readable(deadline, tried)
            try:
                data = raw.recv(READ_SIZE)  # type: ignore[union-attr]
            except BlockingIOError:
                tried = True
                continue
            if len(data) == READ_SIZE:
                watch.readable = True  # (see `read`)
            return data

    # -- ciphertext -----------------------------------------------------------------------

    async def _flush(self, deadline: float = math.inf, rest: bytes = b"") -> None:
        """Everything the outgoing BIO holds to the transport; `trio.TooSlowError` at
        `deadline` (the connection is then unusable: a record may be half sent).
        `rest`: bytes read from the BIO already, to go before what it still holds (the
        caller tried a send itself and could not send them all)."""
        out = self._out
        raw = self._raw
        if raw is not None and not self._sending and not rest and not self._held:
            # the usual case: one send takes it all, nothing awaited
            if not out.pending:
                return
            rest = self._send_out()  # sent before anything else: no await until we own sending
            if not rest and not out.pending:
                return
        while self._sending:  # another task is sending; it sends our records too
            with trio.move_on_at(deadline):
                await self._sent.park()
                continue
            raise trio.TooSlowError()
        if self._held:  # older than `rest` and all the BIO holds (see `write_nowait`)
            rest, self._held = self._held + rest, b""
        if not rest and not out.pending:
            return
        self._sending = True
        try:
            if rest:
                try:
                    await self._send_all(rest, deadline)
                except _TRANSPORT_ERRORS as exc:
                    raise self._broken(f"send failed: {exc!r}") from exc
            while data := out.read():
                try:
                    if self._raw is not None:
                        await self._send_all(data, deadline)
                    else:
                        with trio.fail_after(max(0.0, deadline - trio.current_time())
                                             if deadline != math.inf else math.inf):
                            await self._stream.send_all(data)  # type: ignore[union-attr]
                except _TRANSPORT_ERRORS as exc:
                    raise self._broken(f"send failed: {exc!r}") from exc
        finally:
            self._sending = False
            if self._sent:
                self._sent.unpark_all()

    async def _fill(self, deadline: float = math.inf, wait_first: bool = False) -> None:
        raw = self._raw
        try:
            if raw is not None:
                try:
                    data = b"" if wait_first else raw.recv(READ_SIZE)
                    if len(data) == READ_SIZE and self._watch is not None:
                        self._watch.readable = True  # (see `read`)
                except BlockingIOError:
                    wait_first = True
                if wait_first:
                    data = await self._recv_after_wait(deadline)
            elif deadline == math.inf:
                data = await self._stream.receive_some(READ_SIZE)  # type: ignore[union-attr]
            else:
                with trio.fail_after(max(0.0, deadline - trio.current_time())):
                    data = await self._stream.receive_some(  # type: ignore[union-attr]
                        READ_SIZE)
        except _TRANSPORT_ERRORS as exc:
            raise self._broken(f"receive failed: {exc!r}") from exc
        if data:
            self._in.write(data)
        else:
            self._in.write_eof()

    # -- TLS ------------------------------------------------------------------------------

    async def handshake(self, deadline: float = math.inf, *, hold_tail: bool = False) -> None:
        """The TLS handshake; `trio.TooSlowError` when it is not done by `deadline`.

        `hold_tail` (a server whose reads go through `read_buffered` first): when the
        peer's first application data came with its last flight, what the handshake
        left to send is held for the next write instead of sent now (below)."""
        while True:
            try:
                self._ssl.do_handshake()
                break
            except ssl.SSLWantReadError:
                # a flight just sent cannot have been answered yet: wait before reading
                answered_nothing = self._out.pending > 0
                await self._flush(deadline)
                await self._fill(deadline, wait_first=answered_nothing)
            except ssl.SSLError as exc:
                try:
                    await self._flush(deadline)  # the alert, if any
                except Exception:  # noqa: BLE001 - the handshake's own failure is the news
                    pass
                raise self._broken(f"TLS handshake failed: {exc}") from exc
        if hold_tail and self._in.pending:
            # The client's first request came with its Finished: the session tickets
            # the handshake left to send wait for our answer and leave with it in one
            # send (every write flushes, and so does every read before it waits).
            return
        await self._flush(deadline)

    async def read(self, size: int = READ_SIZE, deadline: float = math.inf,
                   wait_first: bool = False) -> bytes:
        """Plaintext (at most `size`), b"" when the peer closed (with or without
        close_notify: a body cut short is caught by the HTTP framing all the same);
        `trio.TooSlowError` when nothing came by `deadline`. `wait_first`: the caller
        knows the transport has nothing yet (it just looked, or it just sent a request)."""
        ssl_object, incoming, raw = self._sslobj, self._in, self._raw
        while True:
            if not incoming.pending and not incoming.eof and not ssl_object.pending():
                # nothing to decrypt: read the transport first rather than have
                # SSL_read tell us so by an exception
                if self._out.pending:  # post-handshake messages (tickets, key update)
                    await self._flush(deadline)
                if raw is None:
                    await self._fill(deadline, wait_first)
                else:  # `_fill` on a socket, inline: this is every read of a request
                    try:
                        tried = False  # a recv said it would block (else: no need to look)
                        while True:
                            if wait_first:
                                watch = self._watched() if self._hubbed else None
                                if watch is not None:
                                    await watch.wait_readable(deadline, tried)
                                else:
                                    if self._sweeper is None and deadline != math.inf:
                                        self._sweeper = deadlines.sweeper()
                                    await _wait_readable(raw, deadline, self._sweeper)
                            try:
                                data = raw.recv(READ_SIZE)
                            except BlockingIOError:
                                wait_first = tried = True
                                continue
                            if len(data) == READ_SIZE and self._watch is not None:
                                # the kernel may hold more, and an edge-triggered wait
                                # would not be told: the next wait must look first
                                self._watch.readable = True
                            break
                    except _TRANSPORT_ERRORS as exc:
                        raise self._broken(f"receive failed: {exc!r}") from exc
                    if data:
                        incoming.write(data)
                    else:
                        incoming.write_eof()
                wait_first = False
            try:
                data = ssl_object.read(size)
            except ssl.SSLWantReadError:
                continue
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                return b""
            except ssl.SSLError as exc:
                raise self._broken(f"TLS failed: {exc}") from exc
            if self._out.pending:
                await self._flush(deadline)
            return data

    def read_now(self, size: int = READ_SIZE) -> bytes | None:
        """`read` over our socket without waiting: plaintext (at most `size`; b"" when
        the peer closed), or None when the socket has nothing more now. A caller that
        finds `_out` pending afterwards (a post-handshake message to send) leaves it to
        `read`, which flushes it."""
        ssl_object, incoming, raw = self._sslobj, self._in, self._raw
        assert raw is not None
        while True:
            if not incoming.pending and not incoming.eof and not ssl_object.pending():
                try:
                    data = raw.recv(READ_SIZE)
                except BlockingIOError:
                    return None
                except OSError as exc:
                    raise self._broken(f"receive failed: {exc!r}") from exc
                if len(data) == READ_SIZE and self._watch is not None:
                    self._watch.readable = True  # (as `read`: the kernel may hold more)
                if data:
                    incoming.write(data)
                else:
                    incoming.write_eof()
            try:
                return ssl_object.read(size)  # type: ignore[no-any-return]
            except ssl.SSLWantReadError:
                continue
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                return b""
            except ssl.SSLError as exc:
                raise self._broken(f"TLS failed: {exc}") from exc

    def buffered(self) -> bool:
        """Bytes wait in the TLS engine (to decrypt, or to send)."""
        return bool(self._in.pending or self._in.eof or self._sslobj.pending()
                    or self._out.pending)

    def read_buffered(self, size: int = READ_SIZE) -> bytes | None:
        """Plaintext from what was already received (b"" at the peer's close), or None
        when that is nothing: the caller then waits in `read(wait_first=True)`. No
        syscall: a client that waits for each response has sent nothing more yet."""
        incoming, ssl_object = self._in, self._sslobj
        if not (incoming.pending or incoming.eof or ssl_object.pending()):
            return None
        try:
            return ssl_object.read(size)
        except ssl.SSLWantReadError:
            return None
        except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
            return b""
        except ssl.SSLError as exc:
            raise self._broken(f"TLS failed: {exc}") from exc

    async def write(self, data: bytes | bytearray | memoryview,
                    deadline: float = math.inf) -> None:
        """All of `data` handed to the transport; `trio.TooSlowError` at `deadline`."""
        try:
            if len(data) <= WRITE_SLICE:
                self._sslobj.write(data)
                if self._raw is not None and not self._sending and not self._held:
                    # `_flush`'s usual case: one send takes the records
                    rest = self._send_out()
                    if not rest and not self._out.pending:
                        return
                    await self._flush(deadline, rest)
                    return
                await self._flush(deadline)
                return
            view = memoryview(data)
            for start in range(0, len(view), WRITE_SLICE):
                self._ssl.write(view[start:start + WRITE_SLICE])
                await self._flush(deadline)
        except ssl.SSLError as exc:
            raise self._broken(f"TLS failed: {exc}") from exc

    def write_nowait(self, data: bytes | bytearray) -> bool | None:
        """`write` without ever awaiting, for a task that must not be the one to wait
        (its scope may be cancelled, and a record cut off mid-send cannot be resumed).
        None: not possible now (another task is sending, ciphertext is held, `data` is
        large, or there is no socket): use `write`. True: the kernel took it all. False:
        the rest is held and leaves first with the next `_flush` (`flush_by`), which the
        caller must see run."""
        if self._raw is None or self._sending or self._held or len(data) > WRITE_SLICE:
            return None
        try:
            self._sslobj.write(data)
        except ssl.SSLError as exc:
            raise self._broken(f"TLS failed: {exc}") from exc
        self._held = self._send_out()
        return not self._held

    def _send_out(self) -> bytes:
        """The records the outgoing BIO holds, to the socket in one non-blocking send
        (there must be a socket); what the kernel did not take (b"": all of it)."""
        records = self._out.read()
        try:
            sent = self._raw.send(records)  # type: ignore[union-attr]
        except BlockingIOError:
            return records
        except OSError as exc:
            raise self._broken(f"send failed: {exc!r}") from exc
        return records[sent:] if sent < len(records) else b""

    def send_held_nowait(self) -> None:
        """What the outgoing BIO holds (the session tickets a handshake kept back,
        `hold_tail`) to the socket now, without awaiting, when no task is sending and
        nothing is held already; what the kernel does not take is held for the next
        `_flush`. For a peer whose FIN came while no write of ours was due
        (`Watch.on_fin`): one that closed for good answers it with a reset. A send that
        fails is left for the next read or write to find."""
        if self._raw is None or self._sending or self._held or not self._out.pending:
            return
        try:
            self._held = self._send_out()
        except trio.BrokenResourceError:
            pass

    def discard_unsent(self) -> None:
        """Drop the ciphertext not sent yet (the outgoing BIO and what `write_nowait`
        held): after the peer closed, it can never be sent, and a later read must not
        try to flush it first."""
        self._out.read()
        self._held = b""

    @property
    def holding(self) -> bool:
        """Ciphertext `write_nowait` left to send."""
        return bool(self._held)

    async def flush_by(self, deadline: float) -> None:
        """Everything held or in the outgoing BIO to the transport (`TooSlowError` at
        `deadline`)."""
        await self._flush(deadline)


class ServerStream(MemoryTLS, trio.abc.Stream):
    """The server end of a connection as a trio `Stream`: what the public end
    (`net/tls_server.py`) and the relay's (`relay/tls.py`) have alike. A subclass sets
    `_closed` and closes its own transport."""

    _closed: bool

    def selected_alpn_protocol(self) -> str | None:
        return self._ssl.selected_alpn_protocol()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        if self._closed:
            raise trio.ClosedResourceError()
        return await self.read(READ_SIZE if max_bytes is None else max_bytes)

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        if self._closed:
            raise trio.ClosedResourceError()
        await self.write(data)

    # The HTTP legs' own calls: an absolute deadline instead of a cancel scope per call
    # (`trio.TooSlowError` when it passes), so an operation that completes at once costs
    # no scope at all.

    async def receive_by(self, max_bytes: int, deadline: float,
                         wait_first: bool = False) -> bytes:
        if self._closed:
            raise trio.ClosedResourceError()
        return await self.read(max_bytes, deadline, wait_first)

    async def send_by(self, data: bytes, deadline: float) -> None:
        if self._closed:
            raise trio.ClosedResourceError()
        await self.write(data, deadline)
