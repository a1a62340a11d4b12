"""Re-origination to the home node: pinned mTLS, pooled, HTTP/2 when the node offers it.

Theory of operation
-------------------
A terminate route ends the caller's TLS at the edge; the request then travels to the
tenant's home node over a *new* TLS connection on which

* the edge presents its own PACT identity as client certificate (the node sees the
  ingress's fingerprint on the link, never the caller's — callers prove themselves in
  sealed envelopes, spec §13), and
* the node is accepted only if its SPKI fingerprint is one of the tenant's pins (two
  while a rotation runs, spec §2). No chain or hostname is checked: the pin is the whole
  of server authentication.

httpcore does the HTTP (pooling, HTTP/2 when ALPN says h2, HTTP/1.1 otherwise) over a
custom `AsyncNetworkBackend` (httpcore lets `connect_tcp` return any stream):

* `connect_tcp` ignores httpcore's host and port and calls `Backends.connect(route)` — the
  one way out of the edge (a configured address, or the tenant's tunnel);
* `start_tls` runs our pinned handshake with `trio.SSLStream` and checks the pin; a
  mismatch raises `UpstreamTLSError` carrying the expected and seen fingerprints.

One `AsyncConnectionPool` per (route host, backend, pins): a reload that changes a
route's backend or pins gets a fresh pool; the old one is retired and closed once its
last in-flight request ends, so a reload never cuts a running SSE stream.

Failures are typed for the front to answer: `NodeUnreachable` → 503,
`UpstreamTLSError`/`UpstreamProtocolError` → 502, `UpstreamTimeout` → 504.

Time: the wait for response headers is bounded by `header_timeout`, counted from the
moment the request body has been fully handed over (a slow upload is bounded by the
per-read idle timeout instead, not by the header budget). After the headers, each read of
a streaming body is bounded by the route's `idle_timeout`, so SSE streams can stay open
for as long as bytes keep flowing.
"""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterable, AsyncIterator, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import h2.errors
import h2.exceptions
import httpcore
import trio

from pact_ingress.errors import BackendError
from pact_ingress.identity import Identity, PinMismatch, check_pin, pinned_client_context
from pact_ingress.model import Route
from pact_ingress.net.backends import Backends

#: Time to response headers once the request body has been sent (→ 504 to the caller).
DEFAULT_HEADER_TIMEOUT = 30.0
#: Connecting to a backend (address or tunnel) and the pinned TLS handshake, each.
CONNECT_TIMEOUT = 10.0
#: Connections per pool (per route). HTTP/1.1 nodes need one per concurrent request
#: (an SSE stream holds one for its life); HTTP/2 nodes multiplex on one.
MAX_CONNECTIONS_PER_ROUTE = 100
#: Idle pooled connections are closed after this; home nodes drop idle peers too.
KEEPALIVE_EXPIRY = 60.0
#: Ciphertext read size on the upstream link.
READ_SIZE = 64 * 1024

ALPN = ("h2", "http/1.1")


class UpstreamError(BackendError):
    """Re-origination failed; `status` is the HTTP status the front answers with."""

    status = 502


class NodeUnreachable(UpstreamError):
    """The backend could not be reached (address down, tunnel not connected)."""

    status = 503


class UpstreamTLSError(UpstreamError):
    """The pinned TLS handshake failed or the node's key is not pinned."""

    status = 502

    def __init__(self, message: str, *, expected: Iterable[str] = (), seen: str | None = None):
        super().__init__(message)
        self.expected = tuple(expected)
        self.seen = seen


class UpstreamProtocolError(UpstreamError):
    """The node broke HTTP (closed early, sent garbage, refused our certificate)."""

    status = 502


class _StaleConnection(Exception):
    """The node connection failed before response headers (maybe a dead pooled one)."""


class UpstreamTimeout(UpstreamError):
    """No response headers within the header timeout."""

    status = 504


# --- httpcore network backend --------------------------------------------------------------


class _Stream(httpcore.AsyncNetworkStream):
    """An httpcore view of a trio Stream, with our pinned TLS as its start_tls."""

    def __init__(self, stream: trio.abc.Stream, tls: _PinnedTLS | None = None) -> None:
        self._stream = stream
        self._tls = tls

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        try:
            with trio.fail_after(_inf(timeout)):
                return await self._stream.receive_some(max_bytes)
        except trio.TooSlowError as exc:
            raise httpcore.ReadTimeout(str(exc)) from exc
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise httpcore.ReadError(str(exc)) from exc

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        if not buffer:
            return
        try:
            with trio.fail_after(_inf(timeout)):
                await self._stream.send_all(buffer)
        except trio.TooSlowError as exc:
            raise httpcore.WriteTimeout(str(exc)) from exc
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise httpcore.WriteError(str(exc)) from exc

    async def aclose(self) -> None:
        await trio.aclose_forcefully(self._stream)

    async def start_tls(
        self,
        ssl_context: ssl.SSLContext,
        server_hostname: str | None = None,
        timeout: float | None = None,
    ) -> httpcore.AsyncNetworkStream:
        assert self._tls is not None, "TLS on an already encrypted upstream stream"
        return _Stream(await self._tls.handshake(self._stream, server_hostname))

    def get_extra_info(self, info: str) -> Any:
        if info == "ssl_object" and isinstance(self._stream, trio.SSLStream):
            return self._stream._ssl_object  # type: ignore[attr-defined]
        if info == "is_readable":
            # httpcore asks before reusing an idle HTTP/1.1 connection: readable means
            # the node closed it. Only knowable for a plain socket underneath.
            inner = self._stream
            while isinstance(inner, trio.SSLStream):
                inner = inner.transport_stream
            if isinstance(inner, trio.SocketStream):
                return inner.socket.is_readable()
        return None


def _inf(timeout: float | None) -> float:
    return float("inf") if timeout is None else timeout


@dataclass(frozen=True)
class _PinnedTLS:
    """The client side of the edge → node link: our identity out, the tenant's pins in."""

    context: ssl.SSLContext
    pins: tuple[str, ...]

    async def handshake(self, stream: trio.abc.Stream, server_hostname: str | None) -> trio.SSLStream:
        tls = trio.SSLStream(stream, self.context, server_hostname=server_hostname,
                             https_compatible=True)
        try:
            with trio.fail_after(CONNECT_TIMEOUT):
                await tls.do_handshake()
            check_pin(tls._ssl_object, self.pins)  # type: ignore[attr-defined]
        except PinMismatch as exc:
            await trio.aclose_forcefully(tls)
            raise UpstreamTLSError(str(exc), expected=exc.expected, seen=exc.seen) from exc
        except (trio.BrokenResourceError, trio.TooSlowError) as exc:
            await trio.aclose_forcefully(tls)
            raise UpstreamTLSError(f"TLS handshake with the node failed: {exc.__cause__ or exc}",
                                   expected=self.pins) from exc
        return tls


class _RouteBackend(httpcore.AsyncNetworkBackend):
    """httpcore's way out: always `Backends.connect(route)`, whatever host it asks for."""

    def __init__(self, backends: Backends, route: Route, tls: _PinnedTLS) -> None:
        self._backends = backends
        self._route = route
        self._tls = tls

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Any = None,
    ) -> httpcore.AsyncNetworkStream:
        try:
            with trio.fail_after(_inf(timeout)):
                stream = await self._backends.connect(self._route)
        except trio.TooSlowError as exc:
            raise NodeUnreachable(f"backend {self._route.backend} did not answer") from exc
        except BackendError as exc:
            raise NodeUnreachable(str(exc)) from exc
        return _Stream(stream, self._tls)

    async def connect_unix_socket(self, *args: Any, **kwargs: Any) -> httpcore.AsyncNetworkStream:
        raise NodeUnreachable("unix sockets are not a backend")

    async def sleep(self, seconds: float) -> None:
        await trio.sleep(seconds)


# --- pools -------------------------------------------------------------------------------

PoolKey = tuple[str, str, tuple[str, ...]]


@dataclass
class _Pool:
    pool: httpcore.AsyncConnectionPool
    active: int = 0
    retired: bool = False


@dataclass
class UpstreamResponse:
    """Response headers from the node, and its body as an async iterator of chunks."""

    status: int
    headers: list[tuple[bytes, bytes]]
    http_version: str
    body: AsyncIterator[bytes] = field(repr=False)  # a _Body


class Upstream:
    """Pinned, pooled HTTP client toward home nodes (see module docstring)."""

    def __init__(
        self,
        identity: Identity,
        backends: Backends,
        *,
        header_timeout: float = DEFAULT_HEADER_TIMEOUT,
        connect_timeout: float = CONNECT_TIMEOUT,
    ) -> None:
        self.identity = identity
        self.backends = backends
        self.header_timeout = header_timeout
        self.connect_timeout = connect_timeout
        self._context = pinned_client_context(identity, alpn=ALPN)
        self._pools: dict[PoolKey, _Pool] = {}
        self._retired: list[_Pool] = []

    @staticmethod
    def _key(route: Route, pins: tuple[str, ...]) -> PoolKey:
        return (route.host, str(route.backend), tuple(sorted(pins)))

    def retain(self, live: Iterable[tuple[Route, tuple[str, ...]]]) -> None:
        """Keep pools for these (route, pins); retire the rest (closed when idle)."""
        keep = {self._key(r, p) for r, p in live}
        for key in [k for k in self._pools if k not in keep]:
            entry = self._pools.pop(key)
            entry.retired = True
            self._retired.append(entry)

    def _pool_for(self, route: Route, pins: tuple[str, ...]) -> _Pool:
        key = self._key(route, pins)
        entry = self._pools.get(key)
        if entry is None:
            tls = _PinnedTLS(self._context, tuple(pins))
            entry = self._pools[key] = _Pool(httpcore.AsyncConnectionPool(
                ssl_context=self._context,
                max_connections=MAX_CONNECTIONS_PER_ROUTE,
                keepalive_expiry=KEEPALIVE_EXPIRY,
                http1=True,
                http2=True,
                network_backend=_RouteBackend(self.backends, route, tls),
            ))
        return entry

    async def _reap(self) -> None:
        idle = [e for e in self._retired if e.active == 0]
        self._retired = [e for e in self._retired if e.active > 0]
        for entry in idle:
            with trio.CancelScope(shield=True):
                await entry.pool.aclose()

    @asynccontextmanager
    async def request(
        self,
        route: Route,
        pins: tuple[str, ...],
        *,
        method: str,
        host: str,
        target: bytes,
        headers: list[tuple[bytes, bytes]],
        body: bytes | AsyncIterable[bytes],
        idle_timeout: float,
    ) -> AsyncIterator[UpstreamResponse]:
        """Send one request to `route`'s node; yields once response headers arrived.

        `host` is the authority the caller asked for (also our SNI toward the node).
        Raises an `UpstreamError` subclass before yielding; after yielding, a broken or
        idle-timed-out body ends the body iterator with `UpstreamProtocolError`.
        """
        entry = self._pool_for(route, pins)
        entry.active += 1
        try:
            response = await self._send_retrying(entry.pool, method, host, target, headers,
                                                 body, idle_timeout)
            body = _Body(response)
            try:
                yield UpstreamResponse(
                    status=response.status,
                    headers=list(response.headers),
                    http_version=response.extensions.get("http_version", b"").decode(),
                    body=body,
                )
            finally:
                with trio.CancelScope(shield=True):
                    if not body.complete:
                        await _cancel_h2_stream(response)
                    await response.aclose()
        finally:
            entry.active -= 1
            if entry.retired:
                await self._reap()

    async def _send_retrying(
        self,
        pool: httpcore.AsyncConnectionPool,
        method: str,
        host: str,
        target: bytes,
        headers: list[tuple[bytes, bytes]],
        body: bytes | AsyncIterable[bytes],
        idle_timeout: float,
    ) -> httpcore.Response:
        """`_send`, retried once on a fresh connection when a reused one turns out dead.

        A pooled connection the node closed while idle (its keep-alive ran out first, or
        it restarted) fails on first use; httpcore checks HTTP/1.1 connections for that
        but not HTTP/2 ones. Only a replayable (bytes) body is retried, and only when the
        pool held an idle connection the request may have landed on.
        """
        reused = isinstance(body, bytes) and any(c.is_idle() for c in pool.connections)
        try:
            return await self._send(pool, method, host, target, headers, body, idle_timeout)
        except _StaleConnection as exc:
            if not reused:
                raise UpstreamProtocolError(str(exc)) from exc
        try:
            return await self._send(pool, method, host, target, headers, body, idle_timeout)
        except _StaleConnection as exc:
            raise UpstreamProtocolError(str(exc)) from exc

    async def _send(
        self,
        pool: httpcore.AsyncConnectionPool,
        method: str,
        host: str,
        target: bytes,
        headers: list[tuple[bytes, bytes]],
        body: bytes | AsyncIterable[bytes],
        idle_timeout: float,
    ) -> httpcore.Response:
        deadline = trio.CancelScope()
        if isinstance(body, bytes | bytearray):
            deadline.deadline = trio.current_time() + self.header_timeout
            content: bytes | AsyncIterable[bytes] = bytes(body)
        else:
            content = _arm_when_sent(body, deadline, self.header_timeout)
        request = httpcore.Request(
            method.encode("ascii"),
            httpcore.URL(scheme=b"https", host=host.encode("idna"), port=443, target=target),
            headers=headers,
            content=content,
            extensions={
                "timeout": {
                    "connect": self.connect_timeout,
                    "read": idle_timeout,
                    "write": idle_timeout,
                    "pool": self.header_timeout,
                },
                "sni_hostname": host,
            },
        )
        with deadline:
            try:
                return await pool.handle_async_request(request)
            except UpstreamError:
                raise
            except httpcore.TimeoutException as exc:
                raise UpstreamTimeout(f"node timed out: {exc!r}") from exc
            except httpcore.ConnectError as exc:
                raise NodeUnreachable(f"cannot connect to the node: {exc}") from exc
            except (httpcore.RemoteProtocolError, httpcore.ReadError, httpcore.WriteError) as exc:
                raise _StaleConnection(f"node connection failed: {exc!r}") from exc
            except httpcore.ProtocolError as exc:
                raise UpstreamProtocolError(f"node broke HTTP: {exc}") from exc
            except (httpcore.NetworkError, httpcore.UnsupportedProtocol) as exc:
                raise UpstreamProtocolError(f"node connection failed: {exc!r}") from exc
        raise UpstreamTimeout(f"no response headers within {self.header_timeout:g} s")

    async def aclose(self) -> None:
        """Close every pooled connection (shutdown)."""
        pools = [e.pool for e in self._pools.values()] + [e.pool for e in self._retired]
        self._pools.clear()
        self._retired.clear()
        with trio.CancelScope(shield=True):
            for pool in pools:
                await pool.aclose()


async def _arm_when_sent(
    body: AsyncIterable[bytes], deadline: trio.CancelScope, timeout: float
) -> AsyncIterator[bytes]:
    """Pass `body` through; start the header clock when its last chunk has been taken."""
    async for chunk in body:
        yield chunk
    deadline.deadline = trio.current_time() + timeout


class _Body:
    """The node's response body as an async iterator; `complete` once it ended normally."""

    def __init__(self, response: httpcore.Response) -> None:
        self._chunks = response.aiter_stream().__aiter__()
        self.complete = False

    def __aiter__(self) -> _Body:
        return self

    async def __anext__(self) -> bytes:
        try:
            return await self._chunks.__anext__()
        except StopAsyncIteration:
            self.complete = True
            raise
        except httpcore.TimeoutException as exc:
            raise UpstreamTimeout("node body idle too long") from exc
        except (httpcore.ProtocolError, httpcore.NetworkError) as exc:
            raise UpstreamProtocolError(f"node body broke: {exc}") from exc


#: How long we try to tell the node that we abandoned an HTTP/2 stream.
CANCEL_TIMEOUT = 1.0


async def _cancel_h2_stream(response: httpcore.Response) -> None:
    """RST_STREAM(CANCEL) an HTTP/2 response we stop reading before its end.

    httpcore (1.0.x) just forgets such a stream, so the node would go on producing it —
    an abandoned SSE stream would stay open at the node for the life of the pooled
    connection. This reaches into httpcore's HTTP/2 byte stream (pool stream → connection
    stream with `_connection`, `_stream_id`, `_request`); when the shape differs, or on
    HTTP/1.1 (where httpcore closes an unfinished connection itself), it does nothing.
    """
    inner = getattr(response.stream, "_stream", None)
    connection = getattr(inner, "_connection", None)
    stream_id = getattr(inner, "_stream_id", None)
    state = getattr(connection, "_h2_state", None)
    if state is None or stream_id is None:
        return
    with trio.move_on_after(CANCEL_TIMEOUT):
        try:
            state.reset_stream(stream_id, error_code=h2.errors.ErrorCodes.CANCEL)
            await connection._write_outgoing_data(inner._request)  # type: ignore[union-attr]
        except (h2.exceptions.ProtocolError, httpcore.NetworkError):
            pass  # the stream or the connection already ended
