"""Shared test utilities: identities, TLS contexts, loopback servers and clients.

Kept general on purpose (other test modules import it): nothing here knows about routes
or the Terminator. Everything binds to 127.0.0.1 only.
"""

from __future__ import annotations

import ssl
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

import httpcore
import trio
import trustme

from pact_ingress.identity import Identity, keygen

LOOPBACK = "127.0.0.1"


def make_identity(directory: Path, name: str, *, ed25519: bool = False) -> Identity:
    """A fresh PACT identity (key + self-signed cert) under `directory`."""
    return keygen(Path(directory) / f"{name}.key", ed25519_key=ed25519, common_name=name)


class WebPKI:
    """A throwaway CA (trustme) issuing certificates for public-looking hostnames."""

    def __init__(self) -> None:
        self.ca = trustme.CA()

    def server_context(self, *hosts: str, alpn: Iterable[str] = ("h2", "http/1.1")) -> ssl.SSLContext:
        """A stdlib server context with a cert for `hosts`, offering `alpn`."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.ca.issue_cert(*hosts).configure_cert(ctx)
        alpn = list(alpn)
        if alpn:
            ctx.set_alpn_protocols(alpn)
        return ctx

    def client_context(self, alpn: Iterable[str] = ("h2", "http/1.1")) -> ssl.SSLContext:
        """A stdlib client context trusting this CA (hostname checks on)."""
        ctx = ssl.create_default_context()
        self.ca.configure_trust(ctx)
        alpn = list(alpn)
        if alpn:
            ctx.set_alpn_protocols(alpn)
        return ctx

    def ca_file(self, directory: Path) -> Path:
        path = Path(directory) / "ca.pem"
        self.ca.cert_pem.write_to_path(str(path))
        return path


Handler = Callable[[trio.SocketStream], Awaitable[None]]


async def serve_loopback(
    handler: Handler, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED
) -> None:
    """Accept on 127.0.0.1:<free port> forever, one `handler` task per connection.

    Use with `port = await nursery.start(serve_loopback, handler)`.
    """
    listeners = await trio.open_tcp_listeners(0, host=LOOPBACK)
    port = listeners[0].socket.getsockname()[1]
    async with trio.open_nursery() as nursery:
        task_status.started(port)
        await trio.serve_listeners(handler, listeners, handler_nursery=nursery)


class StaticCerts:
    """The router's certificate source, standing in for `CertManager`: one context for
    every route, no ACME challenge."""

    def __init__(self, ctx: ssl.SSLContext) -> None:
        self.ctx = ctx

    def server_context(self, route: object) -> ssl.SSLContext | None:
        return self.ctx

    async def challenge_context(self, host: str) -> ssl.SSLContext | None:
        return None


class LoopbackBackend(httpcore.AsyncNetworkBackend):
    """An httpcore backend that sends every hostname to 127.0.0.1:`port`.

    Lets a client use real public-looking names (SNI, Host, :authority) in URLs while
    only ever connecting to loopback, like curl's `--resolve`.
    """

    def __init__(self, port: int) -> None:
        self.port = port
        self._inner = httpcore.TrioBackend()

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Any = None,
    ) -> httpcore.AsyncNetworkStream:
        return await self._inner.connect_tcp(LOOPBACK, self.port, timeout=timeout)

    async def sleep(self, seconds: float) -> None:
        await trio.sleep(seconds)


def http_client(
    port: int, ssl_context: ssl.SSLContext, *, http2: bool = True, http1: bool = True
) -> httpcore.AsyncConnectionPool:
    """An httpcore pool whose every connection goes to 127.0.0.1:`port`."""
    return httpcore.AsyncConnectionPool(
        ssl_context=ssl_context,
        http1=http1,
        http2=http2,
        network_backend=LoopbackBackend(port),
    )


def insecure_client_context(alpn: Iterable[str] = ("h2", "http/1.1")) -> ssl.SSLContext:
    """Like curl -k: no chain or name checks (the tests check pins themselves)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    alpn = list(alpn)
    if alpn:
        ctx.set_alpn_protocols(alpn)
    return ctx
