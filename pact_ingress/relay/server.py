"""The relay gateway: TLS with any client key, the edge's HTTP engine, the queue behind it.

Theory of operation
-------------------
The router hands us every connection whose SNI is `relay.host` (peeked bytes replayed);
with worker processes, the client's worker runs this server for it instead, over
`relay.remote.RemoteStore` (main's store: one writer), and main's server keeps the store,
the purge and the wakes. TLS ends here. Every caller presents a self-signed certificate
whose key *is* its identity (spec §2), read as the SPKI fingerprint after the
handshake; the stdlib `ssl` cannot accept an unknown self-signed client certificate, so
the TLS object is pyOpenSSL's, driven by the edge's own memory-BIO engine (`relay.tls`:
why, in detail). The certificate is requested, not required at the TLS layer, so a
caller without one gets a readable ``identity_required`` answer instead of a failed
handshake. The certificate we present is the relay host's (files or ACME, held by
`CertManager`, reloaded when its files change).

The relay's HTTP is the edge's HTTP: the relay host sits on the same hot path as the
terminate routes (every sender's hand-off to an offline node crosses it), so it runs on
the same engine — `net.http1` (llhttp) or `net.http2` (h2) by ALPN, each request an
`Exchange` — rather than on a general ASGI server. Hypercorn stays where generality
matters more than cost: the admin endpoint and the demo node. Each request is served by
`relay.http.RelayExchange` (paths, bounded bodies, JSON-RPC, the answers); the tools
are methods here:

* ``POST /relay/mcp`` — JSON-RPC: ``initialize``, ``ping``, ``tools/list``,
  ``tools/call`` of ``relay_call`` / ``fetch_queued`` / ``ack``. The rules are
  `proto.relay`'s; the queue is a `RelayStore`, chosen by the state backend (SQLite, or
  Redis: `state/relay_store.py`). A success answer to relay_call is sent only after the
  store's COMMIT returned, or Redis answered the write (see `relay/store.py`).
* ``GET|POST /relay/allowlist`` — the recipient's own allow-list.

A relay_call's checks (`proto.relay.check_relay_call`: header, signature under the
caller's key, time, allow-list) are a pure function of values nobody touches meanwhile
(the allow-lists are the store's snapshot). A usual call (a few KiB) is checked on the
event loop: the whole check costs less than one terminate request's handling, and
handing it to a thread and back cost more CPU than it moved off the loop (measured on
this engine: see README). A large one (over `INLINE_CHECK_BYTES`, up to 12 MiB) is
parsed and checked in a worker thread, one at a time, as the terminate engine does with
its large bodies. The queue write that follows is the store's writer thread's (group
commit: one fsync for every call that arrived meanwhile).

Only configured recipients (pins of ``relay: true`` tenants) have queues and lists. One
JSON log line per tool call names caller, recipient, msg_id, size and outcome, never a
body (relay_call's, the hot one, is buffered with the access lines: `log.access`).
When a call is queued (or answered as a duplicate) for a tenant with a live tunnel,
`wake(tenant)` asks the tunnel server to push a content-free WAKE (it rate-limits per
tenant).
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import trio
from cryptography import x509
from OpenSSL import SSL

from pact_ingress.identity import PublicKey, fingerprint_of_cert_der
from pact_ingress.logs import log
from pact_ingress.model import Config
from pact_ingress.net.http1 import H1Connection
from pact_ingress.net.http2 import H2Connection
from pact_ingress.net.http_exchange import ClientGone, Exchange
from pact_ingress.net.ossl_stream import files_server_context
from pact_ingress.net.replay import ReplayStream
from pact_ingress.proto import relay as rules
from pact_ingress.proto import tls_alert
from pact_ingress.proto.h2_guard import Flood
from pact_ingress.proto.ratelimit import Budget, client_bucket
from pact_ingress.proto.relay import Refusal
from pact_ingress.proto.shares import Shares
from pact_ingress.relay.http import (
    INLINE_CHECK_BYTES,
    MAX_BUFFERED_PER_CLIENT,
    MAX_BUFFERED_TOTAL,
    RelayExchange,
    in_thread,
)
from pact_ingress.relay.store import (
    MsgIdTaken,
    QueueFull,
    RelayStore,
    SqliteStore,
    StoreUnavailable,
)
from pact_ingress.relay.tls import RelayTLS
from pact_ingress.state import LocalState, StateBackend
from pact_ingress.stats import Stats

#: Expired items are purged this often (they are already invisible to fetch meanwhile).
PURGE_INTERVAL = 60.0
#: The TLS handshake must complete within this.
HANDSHAKE_TIMEOUT = 10.0
#: A keep-alive connection with no request open closes after this.
IDLE_TIMEOUT = 75.0
#: Once a request head has begun, all of it must arrive within this (else 408).
HEAD_TIMEOUT = 10.0
#: Each write of an answer must be taken by the client within this.
WRITE_TIMEOUT = 30.0


class RelayServer:
    """The relay host: `serve` takes connections from the router; `run` keeps the store."""

    def __init__(self, config: Config, *, stats: Stats, certs: Any,
                 wake: Callable[[str], bool] | None = None,
                 store: RelayStore | None = None, state: StateBackend | None = None,
                 limiter: Any = None,
                 clock: Callable[[], float] = time.time) -> None:
        assert config.relay is not None
        self.stats = stats
        self.certs = certs
        self.wake = wake
        self.clock = clock
        if store is not None and limiter is not None:  # a worker: main's store, own limiter
            self.store: RelayStore = store
            self.limiter = limiter
        else:
            # the queue lives where the state backend keeps shared state (SQLite or Redis)
            backend = state or LocalState()
            self.store = store or backend.relay_store(config.relay, stats, lambda: self.clock())
            # relay_call is charged like a terminate call: the caller's (IP, key) budget
            # and the IP ceiling, cluster-wide when the state backend is shared
            self.limiter = limiter or backend.limiter
        #: main with workers: answers their store operations, pushes allow-lists to them
        self.service: Any = None
        self._ctx: tuple[tuple[Any, ...], SSL.Context] | None = None
        self._conns: set[_Conn] = set()
        self._drain_event = trio.Event()  # the HTTP legs close (HTTP/2: GOAWAY) on it
        self._idle_scopes: set[trio.CancelScope] = set()  # keep-alive waits, for a drain
        self.large_slot = trio.CapacityLimiter(1)  # large relay_calls, one at a time
        #: fetch_queued answers in progress per caller (`relay.http.MAX_FETCHES_IN_FLIGHT`)
        self.fetching: dict[str, int] = {}
        self.buffers = Shares(MAX_BUFFERED_PER_CLIENT, MAX_BUFFERED_TOTAL)  # request bodies
        #: relay_enqueues by outcome, keyed by "was a duplicate" (looked up once)
        self._enqueued = {False: stats.relay_enqueues.labels("queued"),
                          True: stats.relay_enqueues.labels("duplicate")}
        #: `_allowlists`' last answer and the two mappings it was built from
        self._lists: tuple[object, object, dict[str, frozenset[str]]] | None = None
        self.update(config)

    def update(self, config: Config) -> None:
        """Host, bounds and served recipients of a (re)loaded config. The store file is
        opened once: a changed `relay.store` path takes effect on restart."""
        assert config.relay is not None
        self.relay = config.relay
        self.host = config.relay.host
        self.budget = Budget.from_limits(config.limits)
        self.recipients = config.relay_recipients()
        self.store.set_bounds(config.relay.max_items, config.relay.max_bytes)
        if isinstance(self.store, SqliteStore):
            if self.store.path != config.relay.store:
                log.warning("relay_store_path_unchanged", running=str(self.store.path),
                            configured=str(config.relay.store),
                            detail="the relay store moves only on restart")

    # --- lifecycle -----------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        """Open the store, then purge expired items every PURGE_INTERVAL until cancelled."""
        await self.store.open()
        task_status.started()
        try:
            while True:
                await trio.sleep(PURGE_INTERVAL)
                await self.purge()
        finally:
            with trio.CancelScope(shield=True):
                await self.store.aclose()

    async def purge(self) -> int:
        try:
            expired = await self.store.purge()
        except StoreUnavailable:
            return 0
        if expired:
            self.stats.relay_expiries.inc(expired)
            log.info("relay_expired", items=expired)
        return expired

    def status(self) -> dict[str, Any]:
        depths = self.store.depths()
        queues = [{"recipient": r, "tenant": self.recipients.get(r), "items": n, "bytes": b}
                  for r, (n, b) in sorted(depths.items()) if n]
        store = str(self.relay.store) if isinstance(self.store, SqliteStore) else str(self.store)
        out: dict[str, Any] = {"host": self.host, "store": store,
                               "healthy": self.store.healthy, "queues": queues}
        error = self.store.last_error
        if error:
            out["last_error"] = error
        warning = getattr(self.store, "persistence_warning", None)
        if warning:
            out["persistence_warning"] = warning
        return out

    # --- connections ---------------------------------------------------------------------

    def _context(self) -> SSL.Context | None:
        files = self.certs.cert_files(self.host) if self.certs is not None else None
        if files is None:
            return None
        try:
            key = (*files, *(os.stat(f).st_mtime_ns for f in files))
            if self._ctx is None or self._ctx[0] != key:
                self._ctx = (key, files_server_context(*files))
        except (OSError, SSL.Error) as exc:
            log.error("relay_cert_unusable", host=self.host, error=str(exc))
            return None
        return self._ctx[1]

    async def serve(self, stream: ReplayStream, client: tuple[str, int]) -> None:
        """Serve one connection the router gave us; closes it."""
        ctx = self._context()
        if ctx is None:
            self.stats.rejections.labels("no_certificate_yet").inc()
            log.warning("relay_no_cert", host=self.host)
            try:
                await stream.send_all(tls_alert.alert_record(tls_alert.INTERNAL_ERROR))
            except (trio.BrokenResourceError, OSError):
                pass
            await trio.aclose_forcefully(stream)
            return
        tls = _relay_tls(stream, ctx)
        conn = _Conn()
        self._conns.add(conn)
        try:
            with conn.scope:
                with trio.move_on_after(HANDSHAKE_TIMEOUT) as handshake:
                    await tls.do_handshake()
                if handshake.cancelled_caught:
                    return
                bucket = client_bucket(client[0]) or client[0]
                handle = partial(self._exchange, _caller(tls), client, bucket)
                # from here on a drain is the HTTP leg's to carry out: it closes the
                # connection once its answers are sent and lingers before the close;
                # cancelling it from outside would cut the linger short, and the
                # close would reset the tail of the last answer away
                conn.http = True
                if tls.selected_alpn_protocol() == "h2":
                    await H2Connection(tls, idle_timeout=IDLE_TIMEOUT,
                                       write_timeout=WRITE_TIMEOUT,
                                       idle_scopes=self._idle_scopes,
                                       draining=self._drain_event,
                                       on_flood=partial(self._flooded, client)).serve(handle)
                else:
                    await H1Connection(tls, idle_timeout=IDLE_TIMEOUT,
                                       head_timeout=HEAD_TIMEOUT, write_timeout=WRITE_TIMEOUT,
                                       idle_scopes=self._idle_scopes,
                                       draining=self._drain_event).serve(handle)
        except (trio.BrokenResourceError, trio.ClosedResourceError, ClientGone) as exc:
            log.debug("relay_connection_ended", client_ip=client[0], error=repr(exc))
        except Exception as exc:
            log.warning("relay_connection_error", client_ip=client[0], error=repr(exc))
        finally:
            self._conns.discard(conn)
            await trio.aclose_forcefully(tls)

    async def _exchange(self, caller: tuple[str, PublicKey] | None,
                        client: tuple[str, int], bucket: str, ex: Exchange) -> None:
        exchange = RelayExchange(self, caller, client, ex, bucket)
        try:
            await exchange.run()
        finally:
            exchange.release()

    def _flooded(self, client: tuple[str, int], kind: Flood) -> None:
        self.stats.h2_floods.labels(route=self.host, kind=kind.value).inc()
        log.warning("h2_flood", route=self.host, client=client[0], kind=kind.value)

    def drain(self) -> None:
        """Shutdown: close idle keep-alive connections now, busy ones after their
        requests (the router's drain deadline bounds those), as the terminate engine
        does: the HTTP legs see the drain event and their idle scopes cancelled, and
        linger before they close. A connection still in its handshake ends now."""
        self._drain_event.set()
        for scope in list(self._idle_scopes):
            scope.cancel()
        for conn in list(self._conns):
            if not conn.http:
                conn.scope.cancel()

    # --- the tools -----------------------------------------------------------------------

    def _allowlists(self) -> dict[str, frozenset[str]]:
        """The served recipients' lists. Built again only when the store's mapping or the
        served recipients changed (both are replaced, never mutated, on a change)."""
        lists, recipients = self.store.allowlists(), self.recipients
        cached = self._lists
        if cached is not None and cached[0] is lists and cached[1] is recipients:
            return cached[2]
        empty: frozenset[str] = frozenset()
        mine = {pin: lists.get(pin, empty) for pin in recipients}
        self._lists = (lists, recipients, mine)
        return mine

    async def _ensure_store(self) -> None:
        """A broken store says unavailable (before any permission answer, which would
        otherwise be computed from allow-lists we could not read)."""
        if not self.store.healthy:
            await self.store.probe()
            if not self.store.healthy:
                raise StoreUnavailable("relay store unavailable")
        await self.store.refresh()  # a shared store: what other instances changed

    async def relay_call(self, fp: str, key: PublicKey, arguments: object,
                         seen: dict[str, Any] | None = None, size: int = 0) -> str:
        """Check and queue one relay_call (`size`: its request body's length); returns
        the msg_id queued (the answer is `proto.relay.queued` of it)."""
        check = partial(rules.check_relay_call, arguments, caller=fp, caller_key=key,
                        now=self.clock(), allowlists=self._allowlists(), seen=seen)
        if size <= INLINE_CHECK_BYTES:
            accepted = check()
        else:
            # a pure function of values nobody touches meanwhile (the allow-lists are
            # the store's snapshot, `seen` is this call's own)
            accepted = await in_thread(check, limiter=self.large_slot)
        header = accepted.header
        if len(accepted.envelope) > rules.sender_share(self.relay.max_items,
                                                       self.relay.max_bytes)[1]:
            # no fetch or ack can ever make room for it (a sender holds at most its
            # share of the recipient's bytes): `rate_limited` would have the sender
            # retry until it expires
            raise Refusal(rules.TOO_LARGE, "envelope over a sender's share of the "
                          "recipient's queue bound")
        try:
            # once handed to the store the item may be stored whatever the caller does
            # (a reset stream, a closed connection): see it through, so what was stored
            # wakes its node even when its sender does not come back. Bounded by the
            # store's own deadline.
            with trio.CancelScope(shield=True):
                done = await self.store.enqueue(header.to, header.sender, header.msg_id,
                                                accepted.envelope, accepted.expires_at)
        except QueueFull as exc:
            raise Refusal(rules.RATE_LIMITED, "the recipient's queue is full",
                          exc.retry_after) from None
        except MsgIdTaken:
            raise Refusal(rules.BAD_REQUEST, "msg_id already used for this recipient by "
                          "another sender: send the call under a fresh msg_id") from None
        self._enqueued[done.duplicate].inc()
        # a duplicate wakes too: its first call may have been stored after its answer
        # gave up (unavailable), and then this retry is the only one left to wake the
        # node (a wake is content-free and capped per tenant: one for an item already
        # acked costs the node one empty fetch)
        self.woken(header.to)
        return header.msg_id

    def woken(self, recipient: str) -> None:
        """Something new was queued for `recipient`: wake its tenant's node (main only:
        it holds the tunnels; a worker's server has no `wake`)."""
        if self.wake is not None:
            tenant = self.recipients.get(recipient)
            if tenant is not None and self.wake(tenant):
                self.stats.relay_wakes.inc()

    async def set_allowlist(self, recipient: str, senders: tuple[str, ...]) -> None:
        """Replace the list; with workers, answered once every worker holds it."""
        await self.store.set_allowlist(recipient, senders)
        if self.service is not None:
            await self.service.push_if_changed()

    def has_mail(self, tenant: str) -> bool:
        """Does any of `tenant`'s served recipients have items waiting? (Asked when one
        of its tunnel links comes up, so mail queued while it was away wakes it.)"""
        if not self.store.depths_known:
            # a shared store not counted yet (Redis was away when we started): mail may
            # wait there; a wake for none costs the node one empty fetch
            return True
        depths = self.store.depths()
        return any(depths.get(fp, (0, 0))[0] > 0
                   for fp, owner in self.recipients.items() if owner == tenant)

    async def fetch_queued(self, fp: str, arguments: object) -> dict[str, Any]:
        limit = rules.fetch_limit(arguments)
        if fp not in self.recipients:
            raise rules.denied()
        items, more = await self.store.fetch(fp, limit)
        self.stats.relay_fetched.inc(len(items))
        return {"items": [{"id": i.id, "queued_at": i.queued_at,
                           "envelope": json.loads(i.envelope)} for i in items],
                "more": more}

    async def ack(self, fp: str, arguments: object) -> dict[str, Any]:
        ids = rules.ack_ids(arguments)
        if fp not in self.recipients:
            raise rules.denied()
        n = await self.store.ack(fp, ids)
        self.stats.relay_acks.inc(n)
        return {"acked": n}


class _Conn:
    """One relay connection: how a drain ends it before it speaks HTTP."""

    def __init__(self) -> None:
        self.http = False  # handshaken: the HTTP leg carries out a drain itself
        self.scope = trio.CancelScope()


def _relay_tls(stream: ReplayStream, ctx: SSL.Context) -> RelayTLS:
    """TLS over the socket itself when the router handed us one (the peeked ClientHello
    goes into the TLS engine first), else over the stream."""
    raw = getattr(getattr(stream, "socket", None), "_sock", None)  # the socket trio wraps
    if isinstance(raw, socket.socket):
        return RelayTLS(ctx, sock=raw, initial=stream.take_pending())
    return RelayTLS(ctx, stream=stream)


def _caller(tls: RelayTLS) -> tuple[str, PublicKey] | None:
    """The caller a connection speaks for: its certificate's key and that key's
    fingerprint, read once after the handshake (the key cannot change afterwards)."""
    der = tls.getpeercert(binary_form=True)
    if der is None:
        return None
    return (fingerprint_of_cert_der(der),
            x509.load_der_x509_certificate(der).public_key())  # type: ignore[return-value]
