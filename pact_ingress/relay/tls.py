"""The relay host's TLS: the edge's memory-BIO engine, with OpenSSL reached via pyOpenSSL.

Why not the stdlib `ssl` object the terminate engine uses
---------------------------------------------------------
Every relay caller is a self-signed certificate whose key *is* its identity, and the
relay cannot know the keys in advance. The stdlib server can only accept a client
certificate that chains to a trust anchor it was given: with ``CERT_OPTIONAL`` (or
``CERT_REQUIRED``) and no CA the handshake fails with "self-signed certificate", and
``VERIFY_X509_PARTIAL_CHAIN`` changes nothing (the certificate must still be in the
store). It offers no verify callback, so there is no way to say "accept any key, I will
read it afterwards" — short of patching OpenSSL's context through ctypes, which would
tie the process to CPython's private struct layout. pyOpenSSL has exactly that callback
(`net.ossl_stream`: ``set_verify(VERIFY_PEER, accept-any)``), so OpenSSL stays reached
through it — but only as the TLS *object*. Everything around it is the terminate
engine's: `net.memory_tls.MemoryTLS` moves ciphertext straight between the
non-blocking socket and the BIOs, one read per wakeup, with trio asked to wait only when
a syscall would block. The adapters below give a pyOpenSSL `Connection` the shape of an
`ssl.SSLObject` and its two `MemoryBIO`s (same methods, same exceptions), so that engine
runs it unchanged.

The certificate is requested, not required, at the TLS layer: a caller without one
still completes the handshake and gets the relay's readable ``identity_required``
answer over HTTP instead of a bare alert.
"""

from __future__ import annotations

import socket
import ssl

import trio
from cryptography.hazmat.primitives.serialization import Encoding
from OpenSSL import SSL

from pact_ingress.net.memory_tls import ServerStream

#: Ciphertext taken out of OpenSSL's outgoing BIO per call.
_BIO_CHUNK = 64 * 1024
#: The most plaintext one TLS record carries.
_RECORD = 16 * 1024


def _translate(exc: SSL.Error) -> ssl.SSLError:
    """A pyOpenSSL failure as the stdlib exception `MemoryTLS` handles."""
    if isinstance(exc, SSL.WantReadError):
        return ssl.SSLWantReadError()
    if isinstance(exc, SSL.ZeroReturnError):
        return ssl.SSLZeroReturnError()
    if isinstance(exc, SSL.SysCallError) or "unexpected eof" in str(exc).lower():
        # the peer closed without close_notify: HTTP frames its own ends, so this is
        # an end of stream (a cut body is caught by the framing), as on the public side
        return ssl.SSLEOFError()
    return ssl.SSLError(str(exc))


class _Object:
    """A pyOpenSSL server `Connection` with the `ssl.SSLObject` methods `MemoryTLS` calls."""

    def __init__(self, conn: SSL.Connection, incoming: _Incoming) -> None:
        self.conn = conn
        self.incoming = incoming

    def pending(self) -> int:
        """Decrypted bytes OpenSSL holds (`SSL_pending`)."""
        return self.conn.pending()

    def do_handshake(self) -> None:
        try:
            self.conn.do_handshake()
        except SSL.Error as exc:
            raise _translate(exc) from None

    def read(self, size: int) -> bytes:
        try:
            # one record's plaintext at most comes back per call anyway; asking for
            # more only makes pyOpenSSL allocate a larger buffer every time
            return self.conn.recv(min(size, _RECORD))
        except SSL.WantReadError:
            self.incoming.drained()  # OpenSSL took every byte the BIO held
            raise ssl.SSLWantReadError() from None
        except SSL.Error as exc:
            raise _translate(exc) from None

    def write(self, data: bytes | bytearray | memoryview) -> int:
        try:
            return self.conn.sendall(bytes(data))
        except SSL.Error as exc:
            raise _translate(exc) from None

    def selected_alpn_protocol(self) -> str | None:
        proto = self.conn.get_alpn_proto_negotiated()
        return proto.decode("ascii") if proto else None

    def getpeercert(self, binary_form: bool = True) -> bytes | None:
        """DER of the client's certificate, None when it presented none."""
        cert = self.conn.get_peer_certificate(as_cryptography=True)
        return None if cert is None else cert.public_bytes(Encoding.DER)


class _Incoming:
    """OpenSSL's read BIO as an `ssl.MemoryBIO` to write ciphertext into.

    pyOpenSSL cannot say how many bytes the BIO holds, so `pending` is conservative: 1
    from a write until a read has asked OpenSSL for more than it holds (the engine then
    reads the transport before decrypting), never 0 while bytes may still be there — a
    record left in the BIO must be decrypted, not waited for."""

    def __init__(self, conn: SSL.Connection) -> None:
        self.conn = conn
        self.eof = False
        self._maybe = False

    @property
    def pending(self) -> int:
        return 1 if self._maybe else 0

    def drained(self) -> None:
        self._maybe = False

    def write(self, data: bytes) -> int:
        if data:
            self._maybe = True
        return self.conn.bio_write(data)

    def write_eof(self) -> None:
        self.eof = True
        self.conn.bio_shutdown()


class _Outgoing:
    """OpenSSL's write BIO as an `ssl.MemoryBIO` to read ciphertext from.

    pyOpenSSL has no public "bytes pending" call, so `pending` drains the BIO into a
    buffer that the next `read` hands out first."""

    def __init__(self, conn: SSL.Connection) -> None:
        self.conn = conn
        self._held = b""

    def _drain(self) -> bytes:
        parts = [self._held] if self._held else []
        self._held = b""
        while True:
            try:
                data = self.conn.bio_read(_BIO_CHUNK)
            except SSL.WantReadError:
                break
            parts.append(data)
            if len(data) < _BIO_CHUNK:  # a memory BIO hands out all it holds
                break
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def read(self) -> bytes:
        return self._drain()

    @property
    def pending(self) -> int:
        self._held = self._drain()
        return len(self._held)


class RelayTLS(ServerStream):
    """The server end of one relay connection, as a trio `Stream`.

    Over the socket the router accepted when it has one (the peeked ClientHello is
    written into the engine first), else over any stream (whose replayed bytes come
    through `receive_some` as usual). Failures are `trio.BrokenResourceError`."""

    def __init__(self, context: SSL.Context, *, sock: socket.socket | None = None,
                 initial: bytes = b"", stream: trio.abc.Stream | None = None) -> None:
        conn = SSL.Connection(context, None)  # no socket: memory BIOs
        conn.set_accept_state()
        incoming = _Incoming(conn)
        super().__init__(_Object(conn, incoming), incoming, _Outgoing(conn),  # type: ignore[arg-type]
                         raw=sock, stream=stream)
        if initial:
            incoming.write(initial)
        self._sock = sock
        self._stream_below = stream
        self._closed = False

    @property
    def socket(self) -> socket.socket | None:
        """The socket under the TLS, when there is one (the HTTP legs linger on it
        before the close: `net.linger`)."""
        return self._sock

    async def do_handshake(self) -> None:
        await self.handshake()

    def getpeercert(self, binary_form: bool = True) -> bytes | None:
        return self._ssl.getpeercert(binary_form)  # type: ignore[call-arg]

    async def wait_send_all_might_not_block(self) -> None:
        if self._sock is not None:
            await trio.lowlevel.wait_writable(self._sock)
        elif self._stream_below is not None:
            await self._stream_below.wait_send_all_might_not_block()

    async def aclose(self) -> None:
        """Close the transport; no close_notify (HTTP frames its own ends, and a close
        that could block on a slow peer has no place in cleanup)."""
        if self._closed:
            await trio.lowlevel.checkpoint()
            return
        self._closed = True
        if self._sock is not None:
            trio.lowlevel.notify_closing(self._sock)  # wake any task waiting on it
            self._sock.close()
            await trio.lowlevel.checkpoint()
        elif self._stream_below is not None:
            await trio.aclose_forcefully(self._stream_below)
