"""Opening a stream to a route's backend: a configured address, or the tenant's tunnel.

Both modes (passthrough and terminate) and both kinds of backend go through
`Backends.connect(route)`, so the router never connects anywhere a config did not name:
the only inputs are `route.backend` (an address from config) or `route.tenant` (whose
tunnel connector dials *us*).

Hostnames are resolved off the hot path: `Resolver` caches answers with a TTL and a
background task refreshes every configured name before it expires, so a new connection
costs a dict lookup, not a `getaddrinfo` in a worker thread. Only a cold miss (first
connection after start or reload) waits for a lookup, and concurrent misses for one
name share it.
"""

from __future__ import annotations

import errno
import os
import socket
from collections.abc import Iterable
from typing import Protocol

import trio

from pact_ingress.errors import BackendError, EdgeShortage
from pact_ingress.logs import log
from pact_ingress.model import Address, Route, is_ip_address
from pact_ingress.net.shortage import CAPACITY_ERRNOS

#: How long a resolved answer is used before it is refreshed. Home-node addresses change
#: rarely (dynamic DNS updates within minutes); 60 s bounds staleness cheaply.
DNS_TTL = 60.0
#: A lookup that has not answered by then counts as failed (resolver down).
DNS_TIMEOUT = 5.0
#: Connect attempts to one backend give up after this (a dead host is not waited on).
CONNECT_TIMEOUT = 5.0
#: TCP options every relayed socket gets — the ones `trio.SocketStream` sets: no Nagle
#: delay on relayed records, and at most 16 KiB unsent in the kernel per socket.
STREAM_OPTIONS = ((socket.TCP_NODELAY, 1), (socket.TCP_NOTSENT_LOWAT, 1 << 14))


class Resolver:
    """Hostname → addresses cache with TTL, refreshed in the background."""

    def __init__(self, ttl: float = DNS_TTL) -> None:
        self.ttl = ttl
        self._cache: dict[str, tuple[tuple[str, ...], float]] = {}
        self._inflight: dict[str, trio.Event] = {}
        self._names: set[str] = set()

    def watch(self, names: Iterable[str]) -> None:
        """Names to keep fresh (the configured backend hostnames); replaces the old set.

        IP literals are cached forever here, so the hot path never parses them again.
        """
        names = set(names)
        self._names = {n for n in names if not is_ip_address(n)}
        for stale in set(self._cache) - names:
            del self._cache[stale]
        for ip in names - self._names:
            self._cache[ip] = ((ip,), float("inf"))

    def cached(self, host: str) -> tuple[str, ...] | None:
        """The cached answer for `host` (stale ones too, as `resolve` serves them), or
        None when a lookup is needed: the epoll engine cannot wait for one."""
        hit = self._cache.get(host)
        if hit is not None:
            return hit[0]
        if is_ip_address(host):  # a literal needs no lookup: kept for next time
            self._cache[host] = ((host,), float("inf"))
            return (host,)
        return None

    async def resolve(self, host: str) -> tuple[str, ...]:
        hit = self._cache.get(host)
        if hit is not None and hit[1] > trio.current_time():
            return hit[0]
        if hit is not None:  # expired: serve the stale answer; refresh_forever renews it
            return hit[0]
        return await self._lookup(host)

    async def _lookup(self, host: str) -> tuple[str, ...]:
        if is_ip_address(host):
            return (host,)
        event = self._inflight.get(host)
        if event is not None:
            await event.wait()
            hit = self._cache.get(host)
            if hit is None:
                raise BackendError(f"cannot resolve {host}")
            return hit[0]
        event = self._inflight[host] = trio.Event()
        try:
            with trio.move_on_after(DNS_TIMEOUT):
                infos = await trio.socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
                addrs = tuple(dict.fromkeys(str(info[4][0]) for info in infos))
                self._cache[host] = (addrs, trio.current_time() + self.ttl)
                return addrs
            raise BackendError(f"resolving {host} timed out")
        except OSError as exc:
            raise BackendError(f"cannot resolve {host}: {exc}") from exc
        finally:
            del self._inflight[host]
            event.set()

    async def refresh_forever(self) -> None:
        """Re-resolve every watched name each TTL/2; failures keep the last answer."""
        while True:
            for name in sorted(self._names):
                try:
                    await self._lookup(name)
                except BackendError as exc:
                    log.warning("dns_refresh_failed", host=name, error=str(exc))
            await trio.sleep(self.ttl / 2)


class TunnelPool(Protocol):
    """What the tunnel server offers the router: a stream to a tenant's home node."""

    async def open_stream(self, tenant: str) -> trio.abc.Stream: ...


class Forwarding(Protocol):
    """Another instance's tunnel for a tenant (`net/forward.py`), or BackendError."""

    async def open(self, tenant: str) -> trio.abc.Stream: ...


class Backends:
    """Opens streams to route backends; the router's only way out."""

    def __init__(self, resolver: Resolver | None = None, tunnels: TunnelPool | None = None,
                 forwarder: Forwarding | None = None):
        self.resolver = resolver or Resolver()
        self.tunnels = tunnels
        #: Set by the app when instances share a registry and name their peers.
        self.forwarder = forwarder

    async def connect(self, route: Route) -> trio.abc.Stream:
        """A connected stream to `route`'s backend, or BackendError.

        A tunnel route tries this instance's own tunnel first, then (with several
        instances) an instance that holds one; only when neither works does the caller
        get the answer for a tunnel that is down."""
        if route.backend.address is None:
            if self.tunnels is None:
                raise BackendError(f"no tunnel for tenant {route.tenant}")
            try:
                return await self.tunnels.open_stream(route.tenant)
            except BackendError:
                if self.forwarder is None:
                    raise
            return await self.forwarder.open(route.tenant)
        return await self.connect_address(route.backend.address)

    async def connect_address(self, address: Address) -> trio.SocketStream:
        """A `SocketStream` to a configured address (see `connect_socket`)."""
        return trio.SocketStream(await self.connect_socket(address))

    async def connect_socket(self, address: Address) -> trio.socket.SocketType:
        """A connected bare socket to each resolved address in turn (a home node has one
        or two), with the options a `SocketStream` would set; or BackendError.

        A plain non-blocking connect, not `trio.open_tcp_stream`: its happy-eyeballs
        machinery (a nursery and a task per attempt) doubled the cost of a new connection
        in the benchmark, and backends here are a handful of known addresses.
        """
        addrs = await self.resolver.resolve(address.host)
        last: Exception | None = None
        for ip in addrs:
            try:
                return await _connect((ip, address.port))
            except OSError as exc:
                if exc.errno in CAPACITY_ERRNOS:  # ours: the next address fares no better
                    raise EdgeShortage(f"no connection to backend {address}: {exc}") from exc
                last = exc
            except trio.TooSlowError as exc:
                last = exc
        raise BackendError(f"backend {address} unreachable: {last}")


async def _connect(addr: tuple[str, int]) -> trio.socket.SocketType:
    """Connect without a scheduler round trip when the kernel completes it at once (it
    does on loopback and often on a LAN): one `getpeername` probe instead of an epoll
    registration, a wake-up and an `SO_ERROR` read. Only a pending connect waits, with
    `CONNECT_TIMEOUT`."""
    family = socket.AF_INET6 if ":" in addr[0] else socket.AF_INET
    raw = socket.socket(family, socket.SOCK_STREAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
    try:
        for option, value in STREAM_OPTIONS:
            raw.setsockopt(socket.IPPROTO_TCP, option, value)
        err = raw.connect_ex(addr)
        if err not in (0, errno.EINPROGRESS):
            raise OSError(err, os.strerror(err))
        sock = trio.socket.from_stdlib_socket(raw)
    except BaseException:
        raw.close()
        raise
    try:
        if err:
            try:
                raw.getpeername()
            except OSError:  # not connected yet (or failed): wait, then read the verdict
                with trio.fail_after(CONNECT_TIMEOUT):
                    await trio.lowlevel.wait_writable(sock)
                err = raw.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if err:
                    raise OSError(err, os.strerror(err)) from None
        return sock
    except BaseException:
        sock.close()
        raise
