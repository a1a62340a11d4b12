"""CertManager: which certificate each terminate host serves, and keeping it valid.

Theory of operation
-------------------
`update(config)` (start and every reload) decides the host set: every terminate route gets
either its configured files (`CertFiles`) or ACME. ACME hosts are loaded from the store;
a host without a usable certificate is *due*. Only hosts in the config are ever ordered.

`run()` is the scheduler, one task in the app's nursery. Each round it starts an order for
every due host that is not already being ordered, then sleeps until the next host becomes
due (renewal time, retry time after backoff, or budget window), or until woken by
`update()`, `renew()` or a handshake for a host without a certificate. One `_Host.busy`
flag per host is the deduplication: however many handshakes, reloads or CLI calls ask at
once, one order runs per name.

An order runs the synchronous `acme` client in a worker thread (`issuer.issue`); trio can
abandon the thread on cancellation but the thread itself is bounded by the policy's order
deadline and per-request HTTP timeouts. Challenge answers are published into this object's
tables through `trio.from_thread.run_sync`, so every table is only mutated on the trio
thread, and the hot paths (`server_context`, `challenge_context`, `http01_response`) are
plain dict lookups.

A new certificate is written to the store (atomic; keys 0600), loaded into a fresh
`SSLContext` and swapped into the table: the very next handshake gets it, connections
already established keep the context they started with.

Several instances (the redis state backend) share one store (`state.acme`): an order
runs under the store's lease for its name — taken before, the store looked at again
right after (another instance may have just finished), so one order per name runs in
the cluster; an instance that does not get the lease retries after `ELSEWHERE_RETRY`
and meanwhile adopts what the holder stores (`store.watch` reports new serials within
seconds). Challenge answers are published to the store too, and a challenge this
instance has no answer for is looked up there, so whichever instance the CA reaches
answers. While the store is unreachable new orders wait (logged once per outage,
`cert_failures{reason="state_unavailable"}`), and the certificates in memory keep
serving. One instance's store shares nothing and these steps cost nothing. A failed order keeps the
previous certificate in service, backs off exponentially, counts a metric, and records the
error for `certs list`. Budgets (schedule.py) defer orders instead of hammering the CA.

Wall-clock time (certificate validity) comes from the injected `wall_clock`; waiting uses
trio's clock, so tests can drive both.
"""

from __future__ import annotations

import datetime
import functools
import math
import random
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import trio
from cryptography import x509

# `issuer`, `account`, `tlsalpn` and `dns01` (the `acme` client, requests, dnspython) are
# imported where an order, a challenge answer or a DNS-01 solver first needs them: most
# instances serve certificate files only, and those modules are most of a start-up.
from pact_ingress.acme.kinds import ALL_CHALLENGES, DNS_01, HTTP_01, TLS_ALPN_01
from pact_ingress.acme.schedule import Policy, SlidingWindow, backoff_delay, renewal_time
from pact_ingress.acme.store import (
    LEFTOVER_SWEEP,
    CertInfo,
    OrderElsewhere,
    SharedStateUnavailable,
    Store,
    StoredCert,
    issuer_name,
)
from pact_ingress.errors import AcmeError
from pact_ingress.logs import log
from pact_ingress.model import Acme, CertFiles, Config, Route, normalize_hostname
from pact_ingress.stats import Stats

if TYPE_CHECKING:
    from pact_ingress.acme.account import Account
    from pact_ingress.acme.dns01 import Dns01Solver
    from pact_ingress.acme.issuer import Issued
    from pact_ingress.state.acme import AcmeStore

#: ALPN protocols of served (terminate) contexts: the terminate engine speaks both
#: (`net.http2`, `net.http1`).
SERVED_ALPN = ["h2", "http/1.1"]
#: Another instance holds a name's order lease: look again this much later (by then its
#: certificate has usually been adopted and nothing is due).
ELSEWHERE_RETRY = 2.0
#: The shared store does not answer: try the next order this much later.
STATE_RETRY = 5.0


def served_context(chain_path: Path, key_path: Path) -> ssl.SSLContext:
    """A server context for a terminate host: its chain + key, ALPN h2 and http/1.1."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(chain_path, key_path)
    ctx.set_alpn_protocols(SERVED_ALPN)
    return ctx


@dataclass(eq=False)
class _Waiter:
    """One `renew()` caller waiting for the outcome of the next order of a host."""

    event: trio.Event = field(default_factory=trio.Event)
    error: str | None = None

    def done(self, error: str | None) -> None:
        self.error = error
        self.event.set()


@dataclass(eq=False)
class _Host:
    """Scheduler state of one ACME host."""

    name: str
    cert: StoredCert | None = None
    ctx: ssl.SSLContext | None = None
    next_renewal: float | None = None
    failures: int = 0
    retry_at: float = 0.0
    last_error: str | None = None
    busy: bool = False
    forced: bool = False
    deferred_until: float | None = None
    last_missing_log: float = -math.inf
    ari_check_at: float = 0.0  # when to ask the CA's renewalInfo next (if it offers ARI)
    ari_busy: bool = False
    waiters: list[_Waiter] = field(default_factory=list)


@dataclass(frozen=True)
class _FileCert:
    files: CertFiles
    ctx: ssl.SSLContext | None
    info: CertInfo


class CertManager:
    """Certificates for terminate hosts: files from config, or ACME (see module docstring)."""

    def __init__(self, *, state_dir: Path, stats: Stats,
                 wall_clock: Callable[[], float] = time.time,
                 policy: Policy | None = None, rng: random.Random | None = None,
                 store: AcmeStore | None = None) -> None:
        self.store: AcmeStore = store if store is not None else Store(state_dir)
        self.stats = stats
        self.policy = policy = policy or Policy()
        self._now = wall_clock
        self._rng = rng or random.Random()
        self._hosts: dict[str, _Host] = {}
        self._files: dict[str, _FileCert] = {}
        self._contexts: dict[str, ssl.SSLContext] = {}
        self._alpn: dict[str, ssl.SSLContext] = {}
        self._http01: dict[tuple[str, str], bytes] = {}
        self._acme: Acme | None = None
        self._kinds: tuple[str, ...] = ()
        self._dns01: Dns01Solver | None = None
        self._account: Account | None = None
        self._account_lock = trio.Lock()
        self._limiter = trio.CapacityLimiter(policy.max_concurrent_orders)
        self._orders = SlidingWindow(policy.orders_per_window, policy.order_window)
        self._failed: dict[str, SlidingWindow] = {}
        #: The reasons each host's failures were counted under (their series).
        self._failure_reasons: dict[str, set[str]] = {}
        #: Hosts a reload removed while their order was running, until it ends.
        self._leaving: dict[str, _Host] = {}
        self._wake = trio.Event()
        self._running = False
        self._alpn_shared: dict[tuple[str, str], ssl.SSLContext] = {}
        self._state_waiting = False  # orders wait for the shared store (logged once)
        #: New-order requests sent to the CA since start (tests, status page).
        self.orders_sent = 0

    # ---------------------------------------------------------------- configuration
    def update(self, config: Config) -> None:
        """Adopt the terminate hosts and ACME settings of `config`; schedule what is missing."""
        self._update_acme(config)
        acme_hosts: set[str] = set()
        files: dict[str, CertFiles] = {}
        for route in config.routes():
            if route.mode != "terminate":
                continue
            if isinstance(route.cert, CertFiles):
                files[route.host] = route.cert
            else:
                acme_hosts.add(route.host)
        if config.relay is not None:  # the relay host's certificate: chosen the same way
            if isinstance(config.relay.cert, CertFiles):
                files[config.relay.host] = config.relay.cert
            else:
                acme_hosts.add(config.relay.host)
        self._update_files(files)
        self._update_acme_hosts(acme_hosts)
        self._contexts = {h: f.ctx for h, f in self._files.items() if f.ctx is not None}
        self._contexts.update({h.name: h.ctx for h in self._hosts.values() if h.ctx is not None})
        self._wake.set()

    def _update_acme(self, config: Config) -> None:
        acme = config.acme
        if acme != self._acme:
            self._account = None  # other CA, key or trust: reopen on the next order
            self._dns01 = None
            if acme is not None and acme.dns01 is not None:
                from pact_ingress.acme.dns01 import Dns01Solver

                try:
                    self._dns01 = Dns01Solver(acme.dns01)
                except AcmeError as exc:
                    log.error("acme_dns01_unusable", error=str(exc))
        self._acme = acme
        kinds = []
        for kind in acme.challenges if acme else ():
            if kind == HTTP_01 and not config.listen.http:
                log.warning("acme_challenge_unusable", challenge=kind, why="no listen.http")
            elif kind == DNS_01 and self._dns01 is None:
                log.warning("acme_challenge_unusable", challenge=kind, why="no usable dns01")
            elif kind in ALL_CHALLENGES:
                kinds.append(kind)
        self._kinds = tuple(kinds)

    def _update_files(self, files: dict[str, CertFiles]) -> None:
        old = self._files
        self._files = {}
        for host, cf in files.items():
            prev = old.get(host)
            self._files[host] = prev if prev and prev.files == cf and prev.ctx else \
                self._load_files(host, cf)
        for host in old.keys() - files.keys():
            self._forget_metric(host)

    def _load_files(self, host: str, cf: CertFiles) -> _FileCert:
        try:
            ctx = served_context(cf.cert, cf.key)
            leaf = x509.load_pem_x509_certificate(Path(cf.cert).read_bytes())
        except (OSError, ssl.SSLError, ValueError) as exc:
            log.error("cert_files_unusable", host=host, cert=str(cf.cert), error=str(exc))
            return _FileCert(cf, None, CertInfo(host, "file", last_error=str(exc)))
        not_after = leaf.not_valid_after_utc.timestamp()
        self.stats.cert_expiry.labels(host=host).set(not_after)
        info = CertInfo(host, "file", issuer=issuer_name(leaf),
                        not_before=leaf.not_valid_before_utc.timestamp(), not_after=not_after)
        return _FileCert(cf, ctx, info)

    def _update_acme_hosts(self, hosts: set[str]) -> None:
        if hosts and self._acme is None:
            log.error("acme_not_configured", hosts=sorted(hosts),
                      why="terminate routes without cert files need the acme block")
        wildcards = sorted(h for h in hosts if h.startswith("*."))
        if wildcards and DNS_01 not in self._kinds:
            log.error("acme_wildcard_needs_dns01", hosts=wildcards,
                      why="CAs validate wildcard names only by DNS-01 (acme.dns01 block)")
        for name in self._hosts.keys() - hosts:
            h = self._hosts.pop(name)
            if h.busy:  # its order runs on; a reload that brings the name back takes it
                self._leaving[name] = h
            self._forget_metric(name)
        for name in sorted(hosts - self._hosts.keys()):
            h = self._leaving.pop(name, None)
            # Back while its order still runs: that order is the name's order. A fresh
            # entry would start a second one beside it, whose challenge answers and
            # store files the first one's would overwrite.
            self._hosts[name] = h if h is not None and h.busy else self._load_host(name)
        for h in self._hosts.values():
            self._replace_if_other_ca(h)

    def _load_host(self, name: str) -> _Host:
        h = _Host(name)
        try:
            stored = self.store.load_cert(name)
            meta = self.store.read_meta(name)
            ctx = served_context(stored.chain_path, stored.key_path) if stored else None
        except (AcmeError, OSError, ssl.SSLError) as exc:
            log.warning("cert_store_unreadable", host=name, error=str(exc))
            stored, meta, ctx = None, {}, None
        h.last_error = meta.get("last_error")
        if stored is None or ctx is None:
            log.info("cert_issuance_scheduled", host=name, why="no certificate yet")
            return h
        h.cert, h.ctx = stored, ctx
        self.stats.cert_expiry.labels(host=name).set(stored.not_after)
        renew_at = meta.get("next_renewal")
        h.next_renewal = renew_at if isinstance(renew_at, (int, float)) else renewal_time(
            stored.not_before, stored.not_after, self.policy, self._rng)
        if self._acme is not None and stored.directory != self._acme.directory:
            self._replace_if_other_ca(h)
        elif h.next_renewal <= self._now():
            log.info("cert_issuance_scheduled", host=name, why="renewal due")
        return h

    def _replace_if_other_ca(self, h: _Host) -> None:
        """A certificate from a CA other than the configured one (the operator moved
        `acme.directory`) is renewed now, as a restart would: it keeps serving until
        the new one is in."""
        c = h.cert
        if self._acme is None or c is None or c.directory == self._acme.directory or \
                h.next_renewal == 0.0:
            return
        h.next_renewal = 0.0
        log.info("cert_issuance_scheduled", host=h.name, why="issued by another ACME CA")

    def _forget_metric(self, host: str) -> None:
        """A host that left one source of certificates: its order failures go once it
        is no longer ordered by ACME, its expiry once it is not served at all (one that
        moved between ACME and certificate files keeps the expiry the new source set)."""
        if host not in self._files and host not in self._hosts:
            try:
                self.stats.cert_expiry.remove(host)
            except KeyError:
                pass
        if host in self._hosts:
            return
        for reason in self._failure_reasons.pop(host, ()):
            try:
                self.stats.cert_failures.remove(host, reason)
            except KeyError:
                pass

    def _count_failure(self, h: _Host, reason: str) -> None:
        """`cert_failures`, for a host still configured (an order a reload left running
        may fail after its name went: no series comes back for it)."""
        if self._hosts.get(h.name) is not h:
            return
        self._failure_reasons.setdefault(h.name, set()).add(reason)
        self.stats.cert_failures.labels(host=h.name, reason=reason).inc()

    # ---------------------------------------------------------------- hot paths
    def server_context(self, route: Route) -> ssl.SSLContext | None:
        """The served context for a terminate route, or None while none exists (logged)."""
        ctx = self._contexts.get(route.host)
        if ctx is None:
            self._missing(route.host)
        return ctx

    def cert_files(self, host: str) -> tuple[Path, Path] | None:
        """(chain, key) files of the certificate `host` serves now, for servers that load
        it into another TLS library (the relay's pyOpenSSL); None while there is none."""
        if host in self._files:
            f = self._files[host]
            return (f.files.cert, f.files.key) if f.ctx is not None else None
        h = self._hosts.get(host)
        if h is None or h.cert is None or h.ctx is None:
            if h is not None:
                self._missing(host)
            return None
        return (h.cert.chain_path, h.cert.key_path)

    async def challenge_context(self, host: str) -> ssl.SSLContext | None:
        """The TLS-ALPN-01 context for `host` while its challenge is pending: this
        instance's own order, or one another instance published in the shared store."""
        ctx = self._alpn.get(host)
        if ctx is not None or host not in self._hosts:
            return ctx
        key_authz = await self.store.find_challenge(TLS_ALPN_01, host, "")
        if key_authz is None:
            return None
        ctx = self._alpn_shared.get((host, key_authz))
        if ctx is None:
            from pact_ingress.acme import tlsalpn

            ctx = await trio.to_thread.run_sync(functools.partial(
                tlsalpn.challenge_context, host, key_authz,
                now=datetime.datetime.now(datetime.UTC)))
            # one pending challenge per name: an older answer is of no further use
            self._alpn_shared = {k: v for k, v in self._alpn_shared.items() if k[0] != host}
            self._alpn_shared[(host, key_authz)] = ctx
        return ctx

    def http01_response(self, host: str, token: str) -> bytes | None:
        """The HTTP-01 key authorization for (host, token) while pending."""
        return self._http01.get((host, token))

    async def find_http01(self, host: str, token: str) -> bytes | None:
        """`http01_response`, or the answer another instance published."""
        found = self._http01.get((host, token))
        if found is not None or host not in self._hosts:
            return found
        key_authz = await self.store.find_challenge(HTTP_01, host, token)
        return key_authz.encode("ascii") if key_authz is not None else None

    def _missing(self, host: str) -> None:
        now = self._now()
        h = self._hosts.get(host)
        if h is None:
            why = self._files[host].info.last_error if host in self._files else "not managed"
            log.warning("cert_missing", host=host, why=why)
            return
        if now - h.last_missing_log >= self.policy.missing_log_interval:
            h.last_missing_log = now
            log.info("cert_issuance_in_progress", host=host, **self._progress(h, now))
        if not h.busy:
            self._wake.set()

    def _progress(self, h: _Host, now: float) -> dict[str, object]:
        if h.busy:
            return {"state": "ordering"}
        if h.deferred_until is not None and h.deferred_until > now:
            return {"state": "deferred", "until": _iso(h.deferred_until)}
        if h.retry_at > now:
            return {"state": "backoff", "retry_at": _iso(h.retry_at), "error": h.last_error}
        return {"state": "queued"}

    # ---------------------------------------------------------------- scheduler
    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Order and renew certificates until cancelled."""
        async with trio.open_nursery() as nursery:
            self._running = True
            nursery.start_soon(self.store.watch, self._serials, self._picked_up)
            nursery.start_soon(self._remove_leftovers)
            task_status.started()
            try:
                while True:  # one round per wake-up; each round sleeps (bounded by max_sleep)
                    self._wake = trio.Event()
                    next_at = self._start_due(nursery)
                    delay = self.policy.max_sleep if next_at is None else \
                        min(max(next_at - self._now(), 0.0), self.policy.max_sleep)
                    with trio.move_on_after(delay):
                        await self._wake.wait()
            finally:
                self._running = False

    async def _remove_leftovers(self) -> None:
        """The temp files of store writes a killed process never finished, removed now
        and every `LEFTOVER_SWEEP` (a partial copy may hold a private key)."""
        while True:
            try:
                removed = await trio.to_thread.run_sync(self.store.remove_leftovers,
                                                        self._now())
            except OSError as exc:
                log.warning("acme_leftovers_not_removed", error=str(exc))
            else:
                if removed:
                    log.info("acme_leftovers_removed", count=len(removed))
            await trio.sleep(LEFTOVER_SWEEP)

    def _start_due(self, nursery: trio.Nursery) -> float | None:
        """Start orders for due hosts; return the wall time the next one becomes due."""
        now = self._now()
        next_at: float | None = None
        for h in list(self._hosts.values()):
            if h.busy or self._acme is None:
                continue
            if h.cert is not None and not h.ari_busy:
                if now >= h.ari_check_at and not self._needs_order(h, now):
                    h.ari_busy = True
                    nursery.start_soon(self._check_ari, h)
                else:
                    next_at = h.ari_check_at if next_at is None else min(next_at, h.ari_check_at)
            at = self._due_at(h, now)
            if at is None:
                continue
            if at <= now:
                h.busy = True
                self._orders.record(now)  # reserve budget now: a round may start several
                nursery.start_soon(self._order, h)
            else:
                next_at = at if next_at is None else min(next_at, at)
        return next_at

    def _needs_order(self, h: _Host, now: float) -> bool:
        if h.forced or h.cert is None or now >= h.cert.not_after:
            return True
        return h.next_renewal is not None and now >= h.next_renewal

    def _due_at(self, h: _Host, now: float) -> float | None:
        """When `h` may start an order: `now` or later, None when not needed."""
        if not self._needs_order(h, now):
            return h.next_renewal
        at = max(now, h.retry_at)
        budget = max(self._orders.available_at(now),
                     self._failed_window(h.name).available_at(now))
        if budget > at:
            self._defer(h, budget)
            return budget
        h.deferred_until = None
        return at

    def _defer(self, h: _Host, until: float) -> None:
        if h.deferred_until != until:
            h.deferred_until = until
            log.warning("cert_order_deferred", host=h.name, until=_iso(until),
                        why="issuance budget spent (orders per account or failed validations)")
        for w in h.waiters:
            w.done(f"deferred by the issuance budget until {_iso(until)}")
        h.waiters = []

    def _failed_window(self, host: str) -> SlidingWindow:
        if host not in self._failed:
            self._failed[host] = SlidingWindow(self.policy.failed_validations_per_host,
                                               self.policy.failed_validation_window)
        return self._failed[host]

    # ---------------------------------------------------------------- one order
    async def _order(self, h: _Host) -> None:
        waiters, h.waiters, forced, h.forced = h.waiters, [], h.forced, False
        started = trio.current_time()
        error: str | None = None
        try:
            async with self._limiter, self.store.order_lock(h.name):
                self._state_back()
                # Looked at again under the lease: another instance may have stored
                # this name's certificate while we waited for it.
                if await self._adopt_shared(h) and not forced and \
                        not self._needs_order(h, self._now()):
                    return
                account = await self._get_account()
                issued = await self._issue(account, h.name)
                stored, ctx, renew_at = await trio.to_thread.run_sync(
                    self._save, h.name, issued, account, abandon_on_cancel=True)
                self._install(h, stored, ctx, renew_at)
            log.info("cert_issued", host=h.name, issuer=stored.issuer,
                     challenge=issued.challenge, not_after=_iso(stored.not_after),
                     next_renewal=_iso(h.next_renewal or 0),
                     seconds=round(trio.current_time() - started, 3))
        except OrderElsewhere as exc:
            h.retry_at = self._now() + ELSEWHERE_RETRY
            log.info("cert_order_elsewhere", host=h.name, detail=str(exc))
            if forced:
                error = str(exc)
        except SharedStateUnavailable as exc:
            error = str(exc)
            self._state_lost(h, exc)
        except AcmeError as exc:
            error = str(exc)
            if self._hosts.get(h.name) is h:
                await self._failed_order(h, exc)
            else:  # a reload dropped the name: the operator's doing, no failure of the name
                log.info("cert_order_abandoned", host=h.name, error=error,
                         why="host left the config during the order")
        except Exception as exc:
            error = f"internal error: {type(exc).__name__}: {exc}"
            log.error("cert_order_crashed", host=h.name, error=error)
            await self._failed_order(h, AcmeError(error, reason="internal"))
        finally:
            self._not_busy(h)
            for w in waiters:
                w.done(error)
            self._wake.set()

    def _state_lost(self, h: _Host, exc: SharedStateUnavailable) -> None:
        h.retry_at = self._now() + STATE_RETRY
        self._count_failure(h, exc.reason)
        if not self._state_waiting:
            self._state_waiting = True
            log.warning("cert_orders_waiting", host=h.name, error=str(exc),
                        detail="new orders wait for the shared state; certificates "
                        "already loaded keep serving")

    def _state_back(self) -> None:
        if self._state_waiting:
            self._state_waiting = False
            log.info("cert_orders_resumed")

    def _serials(self) -> dict[str, str | None]:
        """The serial each ACME host serves now (None: nothing yet), for `store.watch`."""
        return {h.name: h.cert.serial if h.cert else None for h in self._hosts.values()}

    async def _picked_up(self, host: str) -> None:
        """`store.watch`: another instance stored a new certificate for `host`."""
        h = self._hosts.get(host)
        if h is None or h.busy:
            return  # not ours, or our own order is about to install one
        h.busy = True
        try:
            await self._adopt_shared(h)
        except AcmeError as exc:
            h.last_error = str(exc)
        finally:
            self._not_busy(h)
            self._wake.set()

    def _not_busy(self, h: _Host) -> None:
        h.busy = False
        if self._leaving.get(h.name) is h:  # removed by a reload meanwhile: gone now
            del self._leaving[h.name]

    async def _adopt_shared(self, h: _Host) -> bool:
        """Serve the certificate the shared store holds for `h` when it is not the one
        served now; True when one was adopted. (One instance's store holds none.)"""
        found = await self.store.fetch_shared(h.name, h.cert.serial if h.cert else None)
        if found is None:
            return False
        stored, renew_at = found
        ctx = await trio.to_thread.run_sync(served_context, stored.chain_path, stored.key_path)
        if renew_at is None:
            renew_at = renewal_time(stored.not_before, stored.not_after, self.policy, self._rng)
        self._install(h, stored, ctx, renew_at)
        log.info("cert_adopted", host=h.name, issuer=stored.issuer, serial=stored.serial,
                 not_after=_iso(stored.not_after), next_renewal=_iso(renew_at),
                 detail="stored by another instance")
        return True

    async def _check_ari(self, h: _Host) -> None:
        """Ask the CA (if it offers ARI) when to renew `h`; it may move the window."""
        interval = self.policy.ari_check_interval
        try:
            account = await self._get_account()
            if not account.offers_ari or h.cert is None:
                h.ari_check_at = self._now() + interval
                return
            when, next_check = await trio.to_thread.run_sync(
                account.client.renewal_time, h.cert.chain_pem, abandon_on_cancel=True)
            if when is not None and h.next_renewal != when.timestamp():
                # Store first, then publish: the live view (inventory, scheduler) never
                # runs ahead of what `certs list` and a restart would read.
                await trio.to_thread.run_sync(functools.partial(
                    self.store.write_meta, h.name, next_renewal=when.timestamp()))
                h.next_renewal = when.timestamp()
                log.info("cert_renewal_window", host=h.name, source="ari",
                         next_renewal=_iso(h.next_renewal))
            h.ari_check_at = max(next_check.timestamp(), self._now() + 60.0)
        except Exception as exc:
            log.info("acme_ari_unavailable", host=h.name, error=f"{type(exc).__name__}: {exc}")
            h.ari_check_at = self._now() + interval
        finally:
            h.ari_busy = False
            self._wake.set()

    async def _get_account(self) -> Account:
        async with self._account_lock:
            acme = self._acme
            if acme is None:
                raise AcmeError("acme is not configured", reason="config")
            if self._account is None or self._account.cfg != acme:
                from pact_ingress.acme.account import open_account

                self._account = await trio.to_thread.run_sync(
                    open_account, self.store, acme, abandon_on_cancel=True)
            return self._account

    async def _issue(self, account: Account, host: str) -> Issued:
        from pact_ingress.acme import issuer

        deadline = time.monotonic() + self.policy.order_timeout
        fn = functools.partial(issuer.issue, account, host, kinds=self._kinds,
                               hooks=_ThreadHooks(self), dns01=self._dns01,
                               deadline=deadline, on_order=self._order_sent_from_thread)
        return await trio.to_thread.run_sync(fn, abandon_on_cancel=True)

    def _order_sent_from_thread(self) -> None:
        trio.from_thread.run_sync(self._order_sent)

    def _order_sent(self) -> None:
        self.orders_sent += 1

    def _save(self, host: str, issued: Issued,
              account: Account) -> tuple[StoredCert, ssl.SSLContext, float]:
        """Worker thread: renewal time (ARI if offered), store, load the new context."""
        leaf = x509.load_pem_x509_certificates(issued.chain_pem)[0]
        nb, na = leaf.not_valid_before_utc.timestamp(), leaf.not_valid_after_utc.timestamp()
        renew_at = self._ari_time(account, issued.chain_pem) or \
            renewal_time(nb, na, self.policy, self._rng, issued_at=self._now())
        stored = self.store.save_cert(host, issued.chain_pem, issued.key_pem,
                                      directory=account.cfg.directory, next_renewal=renew_at)
        return stored, served_context(stored.chain_path, stored.key_path), renew_at

    @staticmethod
    def _ari_time(account: Account, chain_pem: bytes) -> float | None:
        if not account.offers_ari:
            return None
        try:
            when, _ = account.client.renewal_time(chain_pem)
        except Exception as exc:
            log.warning("acme_ari_failed", error=f"{type(exc).__name__}: {exc}")
            return None
        return when.timestamp() if when else None

    def _install(self, h: _Host, stored: StoredCert, ctx: ssl.SSLContext,
                 renew_at: float) -> None:
        if self._hosts.get(h.name) is not h:
            log.info("cert_discarded", host=h.name, why="host left the config during the order")
            return
        h.cert, h.ctx, h.next_renewal = stored, ctx, renew_at
        h.ari_check_at = self._now() + self.policy.ari_check_interval  # _save just asked
        h.failures, h.retry_at, h.last_error = 0, 0.0, None
        self._replace_if_other_ca(h)  # a reload moved the CA while this order ran
        self._contexts[h.name] = ctx
        self.stats.cert_expiry.labels(host=h.name).set(stored.not_after)

    async def _failed_order(self, h: _Host, exc: AcmeError) -> None:
        now = self._now()
        h.failures += 1
        delay = backoff_delay(h.failures, self.policy)
        h.retry_at, h.last_error = now + delay, str(exc)
        if exc.reason == "validation":
            self._failed_window(h.name).record(now)
        self._count_failure(h, exc.reason)
        serving = f"previous certificate until {_iso(h.cert.not_after)}" if h.cert else "none"
        log.warning("cert_order_failed", host=h.name, reason=exc.reason, error=str(exc),
                    failures=h.failures, retry_in=round(delay, 1), serving=serving)
        try:
            await trio.to_thread.run_sync(functools.partial(
                self.store.write_meta, h.name, last_error=str(exc)))
        except (OSError, AcmeError) as store_exc:
            log.warning("cert_store_unwritable", host=h.name, error=str(store_exc))

    # ---------------------------------------------------------------- CLI / admin
    def inventory(self) -> list[CertInfo]:
        """Every terminate host's certificate state (live view, for status and `certs list`)."""
        rows = [f.info for f in self._files.values()]
        for h in self._hosts.values():
            c = h.cert
            rows.append(CertInfo(
                host=h.name, source="acme", issuer=c.issuer if c else None,
                not_before=c.not_before if c else None, not_after=c.not_after if c else None,
                next_renewal=h.next_renewal if c else None, last_error=h.last_error,
                directory=c.directory if c else None))
        return sorted(rows, key=lambda r: r.host)

    async def renew(self, host: str | None = None,
                    progress: Callable[[str], None] = lambda line: None) -> None:
        """Order new certificates now (one host, or every ACME host); raises AcmeError."""
        if not self._running:
            raise AcmeError("the certificate manager is not running", reason="not_running")
        if host is not None:  # spelled as the operator likes: the config's names are canonical
            host = normalize_hostname(host, validate=False)
        if host is not None and host not in self._hosts:
            why = "uses certificate files from the config" if host in self._files else \
                "is not a terminate route with cert: acme in the config"
            raise AcmeError(f"{host} {why}", reason="not_managed")
        targets = [host] if host is not None else sorted(self._hosts)
        if not targets:  # nothing ordered must not read as "renewed"
            raise AcmeError("no host has cert: acme in the running config: nothing to renew",
                            reason="not_managed")
        failures: list[str] = []
        async with trio.open_nursery() as nursery:
            for name in targets:
                nursery.start_soon(self._renew_one, self._hosts[name], progress, failures)
        if failures:
            raise AcmeError("; ".join(failures), reason="renew")

    async def _renew_one(self, h: _Host, progress: Callable[[str], None],
                         failures: list[str]) -> None:
        waiter = _Waiter()
        h.waiters.append(waiter)
        h.forced, h.retry_at = True, 0.0
        progress(f"{h.name}: ordering a new certificate")
        self._wake.set()
        await waiter.event.wait()
        if waiter.error is not None:
            progress(f"{h.name}: failed: {waiter.error}")
            failures.append(f"{h.name}: {waiter.error}")
        elif h.cert is not None:
            progress(f"{h.name}: issued by {h.cert.issuer}, valid until "
                     f"{_iso(h.cert.not_after)}")


class _ThreadHooks:
    """`ChallengeHooks` for the worker thread: builds answers there, publishes on trio's."""

    def __init__(self, manager: CertManager) -> None:
        self.m = manager

    def offer(self, kind: str, host: str, token: str, key_authorization: str) -> None:
        # published for the other instances first: the CA may reach any of them
        trio.from_thread.run(self.m.store.publish_challenge, kind, host, token,
                             key_authorization)
        if kind == TLS_ALPN_01:
            from pact_ingress.acme import tlsalpn  # (the issuer has it loaded already)

            ctx = tlsalpn.challenge_context(
                host, key_authorization, now=datetime.datetime.now(datetime.UTC))
            trio.from_thread.run_sync(self.m._alpn.__setitem__, host, ctx)
        elif kind == HTTP_01:
            trio.from_thread.run_sync(self.m._http01.__setitem__, (host, token),
                                      key_authorization.encode("ascii"))

    def withdraw(self, kind: str, host: str, token: str) -> None:
        if kind == TLS_ALPN_01:
            trio.from_thread.run_sync(self.m._alpn.pop, host, None)
        elif kind == HTTP_01:
            trio.from_thread.run_sync(self.m._http01.pop, (host, token), None)
        trio.from_thread.run(self.m.store.withdraw_challenge, kind, host, token)


def _iso(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts, datetime.UTC).isoformat(
        timespec="seconds")
