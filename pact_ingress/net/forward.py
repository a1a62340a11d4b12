"""Forwarding between instances: a caller reaches an instance without the tenant's
tunnel, and is carried to one that has it.

Theory of operation
-------------------
With several instances (`state.backend: redis`), the registry (`state/registry.py`)
says which instances hold a live tunnel for which tenant. When `Backends` finds no
tunnel of its own for a route, it asks `Forwarder.open(tenant)`: the live holders from
the registry, keeping only those named in `state.peers`, in random order (so the load
of one instance's callers spreads over the holders); for each, within one deadline
(FORWARD_CONNECT_TIMEOUT): TCP to the holder's `listen.tls` address, TLS 1.3 with SNI
`tunnel.hostname` and ALPN `pact-forward/1`, presenting our identity and accepting only
the key the registry names for that holder; then the request (`proto/forward.py`)
naming the tenant, at once followed by close_notify. The holder reads both, answers
close_notify, then one byte in the clear (OK or why not), and from then on the TCP
connection carries the caller's bytes raw: the result is a plain socket, which the
router splices like any backend. (The order matters: OpenSSL reads ciphertext in
chunks, and a caller byte arriving behind the last TLS record the holder reads would be
swallowed by its TLS buffer. Since the forwarder sends nothing between its close_notify
and the answer, nothing can be.) No holder, or none answers
OK → BackendError, and the caller gets today's answer (alert 80 / 503).

The receiving side (`handle`, from the router: SNI `tunnel.hostname`, ALPN
`pact-forward/1`) accepts only keys in `state.peers` (anyone else: the link is closed
after the handshake), reads the request, and opens a
stream on **its own** tunnel for the tenant (`TunnelServer.open_stream`, never
`Backends`): a forwarded connection is never forwarded again, so two instances whose
registry views disagree cannot bounce a caller between them.

Why `state.peers` and not the registry alone: the registry lives in Redis, and whoever
can write there (a leaked Redis password, a shared Redis another application uses) could
publish a member with its own key and address and claim every tenant. Trusting that
would hand callers' connections to an impostor (passthrough payload stays end-to-end
TLS, but the caller's address in a PROXY header and the traffic itself would go to it),
and would let any key that appears in Redis open streams into our tunnels. The registry
only says *where* a peer is and *which* of them holds a tenant; *who* counts as a peer
is the operator's list in the config. The forwarding side pins the key the registry
names for the holder, and that key must also be in `state.peers`.

Why the payload runs outside the link's TLS: the TLS handshake authenticates both
instances and carries the preamble; what follows is already end-to-end TLS — the
caller's own in passthrough (no instance has its keys), our pinned mutual TLS to the
home node in terminate. Re-encrypting it would cost CPU on both instances for nothing,
and would take half-close away (a TLS stream has none). The tunnel's raw data
connections rest on the same argument (`net/tunnel/server.py`); what an on-path
attacker between instances gains is the same: it can break a stream (or forge the
one-byte answer: the same), not read it; the one clear-text field of the payload is an
optional PROXY v2 header.
"""

from __future__ import annotations

import ipaddress
import random
import ssl
from collections.abc import Callable

import trio
from OpenSSL import SSL

from pact_ingress.errors import BackendError
from pact_ingress.identity import Identity, PinMismatch, check_pin, pinned_client_context
from pact_ingress.logs import log
from pact_ingress.model import Config
from pact_ingress.net.backends import TunnelPool
from pact_ingress.net.ossl_stream import OpenSSLStream, server_context
from pact_ingress.net.replay import ReplayStream
from pact_ingress.net.splice import relay
from pact_ingress.proto import forward as fw
from pact_ingress.proto.tunnel.constants import ALPN_FORWARD, HANDSHAKE_TIMEOUT
from pact_ingress.state.registry import Registry
from pact_ingress.stats import Stats

#: One attempt at a holder — TCP, TLS, preamble and answer — gives up after this. A
#: live peer answers in milliseconds; a dead one (killed, its registry keys not expired
#: yet) must not hold the caller long before the next holder is tried.
FORWARD_CONNECT_TIMEOUT = 2.0
#: Holders tried per connection at most: enough to step over one or two dead ones,
#: and bounding what one caller can make us dial.
MAX_ATTEMPTS = 3
#: A forwarded stream with nothing moving for this long is closed at the receiver, at
#: least (the largest route `idle_timeout` of the config counts if larger): the
#: forwarding instance applies the route's own; this is the backstop for a peer that
#: vanished without a FIN.
RECEIVE_IDLE_TIMEOUT = 300.0
#: Errors that mean the peer or the path went away.
_GONE = (trio.BrokenResourceError, trio.ClosedResourceError, OSError, ssl.SSLError)


class _Refused(Exception):
    """One attempt or one incoming link that ends with a counted outcome."""

    def __init__(self, outcome: str, detail: str) -> None:
        super().__init__(detail)
        self.outcome = outcome


class Forwarder:
    """Both ends of the forward link (see the module docstring)."""

    def __init__(self, *, identity: Identity, stats: Stats, registry: Registry,
                 tunnels: TunnelPool, config: Config) -> None:
        self.identity = identity
        self.stats = stats
        self.registry = registry
        self.tunnels = tunnels
        self._client_ctx = pinned_client_context(identity, [ALPN_FORWARD])
        self._client_ctx.minimum_version = ssl.TLSVersion.TLSv1_3  # both ends are ours
        self._server_ctx = server_context(identity, alpn=(ALPN_FORWARD,),
                                          require_client_cert=True)
        self._server_ctx.set_min_proto_version(SSL.TLS1_3_VERSION)
        # part of `state:`, which is read at start only (a reload says so)
        redis = config.state.redis
        self.peers: frozenset[str] = frozenset(redis.peers if redis is not None else ())
        self.update(config)

    def update(self, config: Config) -> None:
        self.hostname = config.tunnel_hostname
        self.idle_timeout = max([RECEIVE_IDLE_TIMEOUT]
                                + [r.limits.idle_timeout for r in config.routes()])

    def _count(self, side: str, outcome: str) -> None:
        self.stats.forwards.labels(side, outcome).inc()

    # --- the forwarding side -----------------------------------------------------------

    async def open(self, tenant: str) -> trio.SocketStream:
        """A raw stream to `tenant`'s tunnel on another instance, or BackendError."""
        holders = [fp for fp in self.registry.holders_of(tenant) if fp in self.peers]
        if not holders or self.hostname is None:
            self._count("out", "no_holder")
            raise BackendError(f"no live tunnel for tenant {tenant} on any instance")
        random.shuffle(holders)
        problems = []
        for fp in holders[:MAX_ATTEMPTS]:
            address = self.registry.address_of(fp)
            try:
                if address is None or _unspecified(address):
                    raise _Refused("no_address", f"the registry names no address peers can "
                                   f"dial ({address}): list a specific one first in that "
                                   "instance's listen.tls")
                with trio.fail_after(FORWARD_CONNECT_TIMEOUT):
                    stream = await self._dial(address, fp, tenant)
            except _Refused as exc:
                outcome, detail = exc.outcome, str(exc)
            except trio.TooSlowError:
                outcome, detail = "timeout", f"no answer within {FORWARD_CONNECT_TIMEOUT:g}s"
            except PinMismatch as exc:
                outcome, detail = "pin_mismatch", str(exc)
            except _GONE as exc:
                outcome, detail = "unreachable", f"{type(exc).__name__}: {exc}"
            else:
                self._count("out", "ok")
                return stream
            self._count("out", outcome)
            log.warning("forward_failed", tenant=tenant, peer=fp, address=address,
                        outcome=outcome, error=detail)
            problems.append(f"{address}: {outcome}")
        raise BackendError(f"no tunnel for tenant {tenant} here, and forwarding failed "
                           f"({'; '.join(problems)})")

    async def _dial(self, address: str, fp: str, tenant: str) -> trio.SocketStream:
        host, _, port = address.rpartition(":")
        tcp = await trio.open_tcp_stream(host.strip("[]"), int(port))
        try:
            tls = trio.SSLStream(tcp, self._client_ctx, server_hostname=self.hostname)
            await tls.do_handshake()
            check_pin(tls, (fp,))  # type: ignore[arg-type]
            await tls.send_all(fw.encode_request(tenant))
            try:
                raw, answer = await tls.unwrap()
            except _GONE:
                raise _Refused("refused", "the peer closed the link (are we its peer?)"
                               ) from None
            assert isinstance(raw, trio.SocketStream)
            if not answer:
                answer = await raw.receive_some(1)
            code = fw.decode_answer(bytes(answer))
            if code is fw.Answer.REFUSED:
                raise _Refused("refused", "the peer holds as many links from our address as "
                               "its limits.max_connections_per_ip allows")
            if code is not fw.Answer.OK:
                raise _Refused(code.name.lower(), f"the peer answered {code.name}")
        except fw.ForwardProtocolError as exc:
            await trio.aclose_forcefully(tcp)
            raise _Refused("protocol_error", str(exc)) from None
        except BaseException:
            await trio.aclose_forcefully(tcp)
            raise
        return raw

    # --- the receiving side ------------------------------------------------------------

    async def handle(self, stream: ReplayStream, client: tuple[str, int],
                     admit: Callable[[], bool] | None = None) -> None:
        """Serve one forward link the router gave us (it closes the socket after).
        `admit` is called once the peer's key is known to be a peer's (the router counts
        it as a tunnel connection from then on); False: refused, its address is at its
        cap of those."""
        tls = OpenSSLStream(stream, self._server_ctx, server_side=True)
        fingerprint: str | None = None
        tenant = "-"
        backend: trio.abc.Stream | None = None
        try:
            with trio.fail_after(HANDSHAKE_TIMEOUT):
                await tls.do_handshake()
                fingerprint = tls.peer_fingerprint
                if fingerprint not in self.peers:
                    raise _Refused("refused_peer", "key not in state.peers")
                tenant = await _read_request(tls)
            if admit is not None and not admit():
                # a peer: it is told (REFUSED), so its operator reads what to raise
                answer, refusal = fw.Answer.REFUSED, _Refused(
                    "over_capacity", "over the tunnel connections of its address")
            else:
                try:
                    backend = await self.tunnels.open_stream(tenant)  # ours, never forwarded
                except BackendError as exc:
                    answer, refusal = fw.Answer.NO_TUNNEL, _Refused("no_tunnel", str(exc))
                else:
                    answer, refusal = fw.Answer.OK, None
            with trio.fail_after(HANDSHAKE_TIMEOUT):
                # the forwarder sent close_notify right after its request and nothing
                # since, so no caller byte can be stuck in OpenSSL's buffer after this
                await _unwrap(tls)
                if stream.pending:
                    raise _Refused("protocol_error", "bytes before the TLS shutdown ended")
                await stream.inner.send_all(fw.encode_answer(answer))
            if refusal is not None:
                raise refusal
            assert backend is not None
            self._count("in", "ok")
            result = await relay(stream.inner, backend, idle_timeout=self.idle_timeout)
            log.info("forward_close", tenant=tenant, peer=fingerprint,
                     bytes_up=result.up, bytes_down=result.down, outcome=result.outcome)
        except _Refused as exc:
            self._refused(exc.outcome, str(exc), tenant, fingerprint, client)
        except fw.ForwardProtocolError as exc:
            self._refused("protocol_error", str(exc), tenant, fingerprint, client)
        except trio.TooSlowError:
            self._refused("timeout", "handshake or preamble too slow", tenant, fingerprint,
                          client)
        except _GONE as exc:
            self._refused("handshake_failed" if fingerprint is None else "reset", str(exc),
                          tenant, fingerprint, client)
        finally:
            if backend is not None:
                await trio.aclose_forcefully(backend)

    def _refused(self, outcome: str, detail: str, tenant: str, fingerprint: str | None,
                 client: tuple[str, int]) -> None:
        self._count("in", outcome)
        self.stats.refused("forward", client[0], outcome)
        log.warning("forward_refused", reason=outcome, detail=detail, tenant=tenant,
                    peer=fingerprint, client_ip=client[0])


def _unspecified(address: str) -> bool:
    """0.0.0.0 / [::]: what an instance listening on every address publishes; dialling
    it would reach this very host, not the peer."""
    host = address.rpartition(":")[0].strip("[]")
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False  # a name


async def _read_request(tls: OpenSSLStream) -> str:
    decoder = fw.RequestDecoder()
    while True:
        data = await tls.receive_some(fw.REQUEST_MAX)
        if not data:
            raise trio.BrokenResourceError("the peer closed before naming a tenant")
        tenant = decoder.feed(data)
        if tenant is not None:
            if decoder.rest:  # only close_notify may follow the request
                raise fw.ForwardProtocolError("bytes after the request")
            return tenant


async def _unwrap(tls: OpenSSLStream) -> None:
    """close_notify both ways; afterwards the TCP connection carries raw bytes (see
    `_unwrap` in `net/tunnel/server.py`: the same exchange for TLS data connections)."""
    for _ in range(8):
        if await tls._retry(tls._conn.shutdown):
            return
    raise _Refused("protocol_error", "TLS shutdown did not complete")

