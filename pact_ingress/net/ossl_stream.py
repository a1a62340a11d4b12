"""A trio Stream speaking TLS through pyOpenSSL, for servers that must accept any client key.

Why this exists
---------------
PACT servers authenticate callers by the SPKI fingerprint of a *self-signed* client
certificate (spec §2). The stdlib `ssl` module cannot accept an unknown self-signed client
certificate server-side (it has no verify callback: a client certificate must chain to a
CA it was given), so `trio.SSLStream` cannot be the server end of such a link. pyOpenSSL
can: `set_verify(VERIFY_PEER, lambda *a: True)` requests a certificate, accepts whatever
is presented, and leaves the pin decision to the application (which reads
`peer_fingerprint` after the handshake). No maintained trio/anyio pyOpenSSL stream exists,
hence this module. Its users are the servers that must take any key: the tunnel server
(connectors' keys, pinned per tenant) and the demo node; the relay gateway (any caller;
its key is who it is) takes only its contexts (`files_server_context`) and drives the
`SSL.Connection` with the terminate engine's memory-BIO loop (`relay/tls.py`). Every
client end — the tunnel connector, the terminate upstream — stays on stdlib `ssl`, which
can present a self-signed certificate and leaves the server's pin to `identity.check_pin`.

Theory of operation
-------------------
The `SSL.Connection` runs on memory BIOs: we feed it ciphertext received from the
transport (`bio_write`) and take out ciphertext to send (`bio_read`). Every TLS operation
(handshake, recv, send, shutdown) goes through `_retry`, which calls the synchronous
OpenSSL function and then

* moves whatever OpenSSL wrote into the BIO onto our FIFO `_outgoing` buffer (synchronously,
  so ciphertext order is the order OpenSSL produced it) and sends that buffer under
  `_send_lock` — whoever holds the lock sends everything queued so far;
* on `WantReadError`, receives one chunk from the transport under `_recv_lock` and feeds
  it in, then tries again. A counter of fed chunks lets a task that waited for the lock
  notice that another task already fed new data, so two tasks that both need input never
  read the transport at the same time (trio streams forbid that) and never wait for data
  that was already delivered.

A task only takes `_send_lock` when it has bytes queued, so a receiver is never held up
by a sender blocked on transport backpressure unless it has ciphertext of its own to send.

State is explicit (`_State`): an error from OpenSSL or from the transport, or a send
cancelled half way through a record, makes the stream BROKEN for good; `aclose` makes it
CLOSED. Every public method checkpoints first, then checks state, as trio's streams do
(`trio.testing.check_two_way_stream` passes; see tests/test_ossl_stream.py).

Renegotiation is disabled (TLS 1.3 has none; in TLS 1.2 it is an attack surface we do not
need), so sending never has to wait for input after the handshake.
"""

from __future__ import annotations

import enum
import operator
import os
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import trio
from cryptography.hazmat.primitives.serialization import Encoding
from OpenSSL import SSL, crypto

from pact_ingress.identity import Identity, fingerprint_of_cert_der

#: Ciphertext read from the transport per call (a few TLS records).
RECV_CHUNK = 64 * 1024
#: Default plaintext returned by one receive_some(None).
DEFAULT_RECEIVE_SIZE = 64 * 1024
#: Plaintext handed to OpenSSL per SSL_write: one maximal TLS record, so the outgoing
#: buffer stays bounded by roughly one record however large a send_all is.
SEND_CHUNK = 16 * 1024
#: How long aclose() spends trying to deliver close_notify before closing anyway.
CLOSE_NOTIFY_TIMEOUT = 1.0

T = TypeVar("T")


class _State(enum.Enum):
    OK = "ok"
    BROKEN = "broken"
    CLOSED = "closed"


def _alpn_selector(ours: tuple[bytes, ...]) -> Callable[[SSL.Connection, list[bytes]], Any]:
    def select(conn: SSL.Connection, offered: list[bytes]) -> Any:
        for proto in ours:
            if proto in offered:
                return proto
        return SSL.NO_OVERLAPPING_PROTOCOLS

    return select


def _accept_any_certificate(
    conn: SSL.Connection, cert: crypto.X509, errnum: int, depth: int, ok: int
) -> bool:
    """Chains and names are irrelevant for PACT: the key is the identity (spec §2)."""
    return True


def _base_context(identity: Identity | None) -> SSL.Context:
    ctx = SSL.Context(SSL.TLS_METHOD)
    ctx.set_min_proto_version(SSL.TLS1_2_VERSION)
    ctx.set_options(getattr(SSL, "OP_NO_RENEGOTIATION", 0) | SSL.OP_NO_COMPRESSION)
    if identity is not None:
        ctx.use_certificate(identity.cert)
        ctx.use_privatekey(identity.key)
        ctx.check_privatekey()
    return ctx


def server_context(
    identity: Identity | None,
    *,
    alpn: Iterable[str] = ("h2", "http/1.1"),
    request_client_cert: bool = True,
    require_client_cert: bool = False,
) -> SSL.Context:
    """A server context presenting `identity` that requests (and accepts any) client cert.

    With `require_client_cert` a handshake without a client certificate fails.
    """
    ctx = _base_context(identity)
    if request_client_cert:
        mode = SSL.VERIFY_PEER
        if require_client_cert:
            mode |= SSL.VERIFY_FAIL_IF_NO_PEER_CERT
        ctx.set_verify(mode, _accept_any_certificate)
    # Resumed sessions are not worth the complexity here: every handshake is full, so the
    # peer certificate is always the one just presented.
    ctx.set_session_cache_mode(SSL.SESS_CACHE_OFF)
    ctx.set_options(SSL.OP_NO_TICKET)
    protos = tuple(p.encode("ascii") for p in alpn)
    if protos:
        ctx.set_alpn_select_callback(_alpn_selector(protos))
    return ctx


def files_server_context(chain: str | os.PathLike[str], key: str | os.PathLike[str], *,
                         alpn: Iterable[str] = ("h2", "http/1.1")) -> SSL.Context:
    """A server context presenting a PEM chain + key (an ACME or operator certificate)
    that requests, and accepts, any client certificate: the relay pins callers itself."""
    ctx = server_context(None, alpn=alpn)
    ctx.use_certificate_chain_file(os.fspath(chain))
    ctx.use_privatekey_file(os.fspath(key))
    ctx.check_privatekey()
    return ctx


def client_context(identity: Identity | None, *, alpn: Iterable[str] = ()) -> SSL.Context:
    """A client context presenting `identity`, verifying nothing: check the pin after."""
    ctx = _base_context(identity)
    ctx.set_verify(SSL.VERIFY_NONE, _accept_any_certificate)
    protos = [p.encode("ascii") for p in alpn]
    if protos:
        ctx.set_alpn_protos(protos)
    return ctx


class OpenSSLStream(trio.abc.Stream):
    """TLS over any trio Stream via a memory-BIO `SSL.Connection` (see module docstring).

    The interface follows `trio.SSLStream` where hypercorn (demo node) and our code touch it:
    `transport_stream`, `do_handshake()`, `selected_alpn_protocol()`, plus
    `getpeercert(binary_form=True)` like `ssl.SSLObject` (so `identity.check_pin` works)
    and `peer_fingerprint`. It is not half-closeable (no `send_eof`), like TLS itself.
    """

    def __init__(
        self,
        transport_stream: trio.abc.Stream,
        context: SSL.Context,
        *,
        server_side: bool,
        server_hostname: str | None = None,
        https_compatible: bool = False,
    ) -> None:
        self.transport_stream = transport_stream
        self._https_compatible = https_compatible
        self._conn = SSL.Connection(context, None)
        if server_side:
            self._conn.set_accept_state()
        else:
            if server_hostname:
                self._conn.set_tlsext_host_name(server_hostname.encode("idna"))
            self._conn.set_connect_state()
        self._state = _State.OK
        self._handshake_done = False
        self._handshake_lock = trio.Lock()
        self._send_lock = trio.StrictFIFOLock()
        self._recv_lock = trio.Lock()
        self._outgoing = bytearray()
        self._fed = 0  # chunks of ciphertext fed to OpenSSL so far
        self._sending = False  # conflict detection for send_all / wait_send_all…
        self._receiving = False

    # --- introspection ---------------------------------------------------------------

    def selected_alpn_protocol(self) -> str | None:
        proto = self._conn.get_alpn_proto_negotiated()
        return proto.decode("ascii") if proto else None

    def getpeercert(self, binary_form: bool = True) -> bytes | None:
        """DER of the peer's certificate (only `binary_form=True` is supported)."""
        if not binary_form:
            raise ValueError("only binary_form=True is supported")
        cert = self._conn.get_peer_certificate(as_cryptography=True)
        return None if cert is None else cert.public_bytes(Encoding.DER)

    @property
    def peer_fingerprint(self) -> str | None:
        """The PACT fingerprint of the peer's key, or None when it presented no cert."""
        der = self.getpeercert(binary_form=True)
        return fingerprint_of_cert_der(der) if der else None

    @property
    def server_name(self) -> str | None:
        """Server side: the SNI the client sent, if any."""
        name = self._conn.get_servername()
        return name.decode("idna") if name else None

    # --- conflict detection and state ------------------------------------------------

    @contextmanager
    def _guard(self, attr: str, what: str) -> Iterator[None]:
        if getattr(self, attr):
            raise trio.BusyResourceError(f"another task is already {what}")
        setattr(self, attr, True)
        try:
            yield
        finally:
            setattr(self, attr, False)

    def _check_state(self) -> None:
        if self._state is _State.CLOSED:
            raise trio.ClosedResourceError("this TLS stream was closed")
        if self._state is _State.BROKEN:
            raise trio.BrokenResourceError("this TLS stream is broken")

    def _transport_failed(self, exc: BaseException) -> Exception:
        if self._state is _State.CLOSED:
            return trio.ClosedResourceError("this TLS stream was closed")
        self._state = _State.BROKEN
        return trio.BrokenResourceError(f"transport failed: {exc!r}")

    # --- the engine ------------------------------------------------------------------

    def _pull_outgoing(self) -> None:
        while True:
            try:
                self._outgoing += self._conn.bio_read(RECV_CHUNK)
            except SSL.WantReadError:
                return

    async def _flush(self) -> None:
        self._pull_outgoing()
        if not self._outgoing:
            return
        async with self._send_lock:
            if not self._outgoing:
                return
            data, self._outgoing = bytes(self._outgoing), bytearray()
            try:
                await self.transport_stream.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                raise self._transport_failed(exc) from exc
            except BaseException:
                # Part of a record may have gone out: the TLS stream cannot continue.
                if self._state is _State.OK:
                    self._state = _State.BROKEN
                raise

    async def _feed(self, seen: int) -> None:
        async with self._recv_lock:
            if self._fed != seen:  # another task fed data while we waited: retry first
                return
            try:
                data = await self.transport_stream.receive_some(RECV_CHUNK)
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                raise self._transport_failed(exc) from exc
            if data:
                self._conn.bio_write(data)
            else:
                self._conn.bio_shutdown()
            self._fed += 1

    async def _retry(self, fn: Callable[..., T], *args: Any) -> T:
        while True:
            self._check_state()
            seen = self._fed
            want_read = False
            try:
                result = fn(*args)
            except SSL.WantReadError:
                want_read = True
            except SSL.Error as exc:
                self._state = _State.BROKEN
                await self._flush_quietly()  # deliver the alert explaining the failure
                raise trio.BrokenResourceError(f"TLS error: {exc}") from exc
            await self._flush()
            if not want_read:
                return result
            await self._feed(seen)

    async def _flush_quietly(self) -> None:
        self._pull_outgoing()
        if not self._outgoing or self._send_lock.locked():
            return
        with trio.move_on_after(CLOSE_NOTIFY_TIMEOUT):
            async with self._send_lock:
                data, self._outgoing = bytes(self._outgoing), bytearray()
                try:
                    await self.transport_stream.send_all(data)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass

    # --- the Stream interface --------------------------------------------------------

    async def do_handshake(self) -> None:
        """Run the handshake if it has not run yet; BrokenResourceError if it fails."""
        await trio.lowlevel.checkpoint()
        self._check_state()
        if self._handshake_done:
            return
        async with self._handshake_lock:
            if not self._handshake_done:
                await self._retry(self._conn.do_handshake)
                self._handshake_done = True

    def _recv(self, max_bytes: int) -> bytes:
        try:
            return self._conn.recv(max_bytes)
        except SSL.ZeroReturnError:
            return b""  # close_notify: a clean end of stream
        except SSL.SysCallError as exc:
            # EOF without close_notify: a truncation attack unless the protocol above
            # frames its own ends (HTTP does), which is what https_compatible declares.
            if self._https_compatible:
                return b""
            raise SSL.Error(f"peer closed without close_notify: {exc}") from exc

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        with self._guard("_receiving", "receiving"):
            if max_bytes is None:
                max_bytes = DEFAULT_RECEIVE_SIZE
            max_bytes = operator.index(max_bytes)
            if max_bytes < 1:
                raise ValueError("max_bytes must be >= 1")
            await trio.lowlevel.checkpoint()
            self._check_state()
            await self.do_handshake()
            return await self._retry(self._recv, max_bytes)

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        with self._guard("_sending", "sending"):
            await trio.lowlevel.checkpoint()
            self._check_state()
            await self.do_handshake()
            view = memoryview(data).cast("B")
            offset = 0
            while offset < len(view):
                chunk = bytes(view[offset : offset + SEND_CHUNK])
                offset += await self._retry(self._conn.send, chunk)

    async def wait_send_all_might_not_block(self) -> None:
        with self._guard("_sending", "sending"):
            await trio.lowlevel.checkpoint()
            self._check_state()
            try:
                await self.transport_stream.wait_send_all_might_not_block()
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                raise self._transport_failed(exc) from exc

    async def aclose(self) -> None:
        if self._state is _State.CLOSED:
            await trio.lowlevel.checkpoint()
            return
        polite = self._state is _State.OK and self._handshake_done
        self._state = _State.CLOSED
        try:
            if polite:
                try:
                    self._conn.shutdown()
                except SSL.Error:
                    pass
                await self._flush_quietly()
        finally:
            await self.transport_stream.aclose()

