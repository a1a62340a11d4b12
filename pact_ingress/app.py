"""The running ingress: one root nursery, components wired together, signals handled.

Start order: load config → identity (created on first start) → components → listeners →
READY. SIGHUP (or `POST /reload` on the admin endpoint) loads the config file again; a
config that fails validation is refused with its `FILE:LINE` messages logged and the
running config stays in force, as it does when applying a valid config fails (a cert
directory that cannot be created): one log line says why, the process keeps serving.
SIGTERM/SIGINT stop the listeners at once, tell tunnel connectors to go away, and give
open connections `DRAIN_DEADLINE` seconds to finish.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import trio

from pact_ingress import __version__, gctune, sdnotify, stopping
from pact_ingress.config import Address, CertFiles, Config, load_config, load_connector_config
from pact_ingress.errors import ConfigError, IdentityError, PactIngressError
from pact_ingress.identity import ensure_selfsigned_cert, key_fingerprint, load_identity
from pact_ingress.logs import log
from pact_ingress.logs import setup as setup_logs
from pact_ingress.net.backends import Backends, Resolver
from pact_ingress.net.router import Router, open_listeners
from pact_ingress.state import open_state
from pact_ingress.stats import Stats

#: Seconds open connections get to finish after SIGTERM before they are cancelled.
#: systemd's default TimeoutStopSec is 90 s; the unit sets 45 s, so stay below that.
DRAIN_DEADLINE = 30.0


def _addr(a: Address) -> tuple[str, int]:
    return (a.host, a.port)


class Ingress:
    """All components of one running ingress, built from one config."""

    def __init__(self, config: Config, *, stats: Stats | None = None, workers: int = 1,
                 log_format: str = "json", settle_gc: bool = False) -> None:
        from pact_ingress.acme.manager import CertManager
        from pact_ingress.net.terminate import Terminator
        from pact_ingress.net.tunnel.server import TunnelServer

        self.config = config
        #: `gctune.settle()` once serving (the `serve` process; not an in-process test)
        self.settle_gc = settle_gc
        self.started = time.time()
        self.stats = stats or Stats()
        self.identity = load_identity(config.identity_key, create=True)
        self.resolver = Resolver()
        self.tunnels = TunnelServer(identity=self.identity, stats=self.stats)
        self.backends = Backends(self.resolver, self.tunnels)
        # where shared state lives is chosen here, once; components get its objects
        self.state = open_state(config.state, self.stats)
        self.forwarder = None
        if config.state.redis is not None and config.state.redis.peers:
            from pact_ingress.net.forward import Forwarder

            self.forwarder = Forwarder(identity=self.identity, stats=self.stats,
                                       registry=self.state.registry, tunnels=self.tunnels,
                                       config=config)
            self.backends.forwarder = self.forwarder
        self.certs = CertManager(state_dir=config.state_dir, stats=self.stats,
                                 store=self.state.acme_store(config.state_dir))
        self.terminator = Terminator(identity=self.identity, backends=self.backends,
                                     stats=self.stats, limiter=self.state.limiter)
        self.relay: Any = None  # RelayServer, built when a config first has a relay block
        self._nursery: trio.Nursery | None = None
        self.router = Router(config, stats=self.stats, backends=self.backends,
                             terminator=self.terminator, certs=self.certs,
                             tunnels=self.tunnels)
        self.router.forward = self.forwarder
        #: Worker processes for terminate connections (`net/workers.py`); None with one
        #: worker: then this process is the whole ingress, exactly as without the option.
        self.workers: Any = None
        if workers > 1:
            from pact_ingress.net.workers import WorkerPool

            self.workers = WorkerPool(workers, config=config, identity=self.identity,
                                      stats=self.stats, backends=self.backends,
                                      certs=self.certs, log_format=log_format)
            self.router.handoff = self.workers
            self.workers.on_state_fallback = self._worker_fell_back
        self.bound: dict[str, list[tuple[str, int]]] = {}
        self._stopping = False
        self._ready = False  # READY said: a stop signal drains from now on
        #: The stop signal that ended the start-up before READY (its name), if one did.
        self.stopped_before_ready: str | None = None
        self._apply(config)

    def _apply(self, config: Config) -> None:
        self._prepare(config)
        self._switch(config)

    @staticmethod
    def _prepare(config: Config) -> None:
        """Everything that can fail on the file system, before any component changes."""
        for r in config.routes():
            if isinstance(r.cert, CertFiles) and ensure_selfsigned_cert(
                    r.host, r.cert.cert, r.cert.key):
                log.warning("selfsigned_cert_created", route=r.host, cert=str(r.cert.cert),
                            detail="no cert files existed; callers must not expect WebPKI trust")
        relay = config.relay
        if relay is not None and isinstance(relay.cert, CertFiles) and ensure_selfsigned_cert(
                relay.host, relay.cert.cert, relay.cert.key):
            log.warning("selfsigned_cert_created", route=relay.host, cert=str(relay.cert.cert),
                        detail="no cert files existed; callers must not expect WebPKI trust")

    def _switch(self, config: Config) -> None:
        self.config = config
        self.resolver.watch(r.backend.address.host for r in config.routes()
                            if r.backend.address is not None)
        self.tunnels.update(config)
        if self.forwarder is not None:
            self.forwarder.update(config)
        self.certs.update(config)
        self.terminator.update(config)
        self.router.update(config)
        self._switch_relay(config)
        if self.workers is not None:  # last: workers only ever see a config main applied
            self.workers.update(config)

    def _switch_relay(self, config: Config) -> None:
        if config.relay is None:
            self.router.relay = None  # the store stays open: a reload may bring it back
            return
        if self.relay is None:
            from pact_ingress.relay.server import RelayServer

            self.relay = RelayServer(config, stats=self.stats, certs=self.certs,
                                     wake=self._wake, state=self.state)
            # mail queued while a node was offline wakes it as its tunnel comes back
            self.tunnels.has_mail = self.relay.has_mail
            if self.workers is not None:  # workers serve the host; main keeps the store
                from pact_ingress.relay.remote import StoreService

                service = self.relay.service = StoreService(self.relay)
                service.broadcast = self.workers.broadcast_relay_state
                self.workers.relay_service = service
            if self._nursery is not None:  # added by a reload: start its store now
                self._nursery.start_soon(self._run_relay)
        else:
            self.relay.update(config)
        self.router.relay = self.relay

    async def reload(self) -> tuple[bool, str]:
        """Load the config file again; keep the running one when the new one is bad.

        Never raises: the process serves every tenant, so one file that cannot be
        applied must cost a log line, not the ingress. Once a drain began (a SIGHUP
        queued behind the SIGTERM, `POST /reload` while draining) systemd is not told:
        READY after STOPPING would make a stopping service look running again."""
        if self._stopping:
            return self._reload()
        sdnotify.reloading()
        try:
            return self._reload()
        finally:
            sdnotify.ready()

    def _reload(self) -> tuple[bool, str]:
        old = self.config
        try:
            new = load_config(old.path)
            self._prepare(new)
        except ConfigError as exc:
            return self._refused(exc.messages)
        except Exception as exc:
            return self._refused([f"{old.path}: cannot apply: {_reason(exc)}"])
        if new.listen != old.listen:
            log.warning("reload_listen_unchanged",
                        detail="listen addresses change only on restart")
        if new.state != old.state:
            log.warning("reload_state_unchanged",
                        detail="the state backend (state:) changes only on restart")
        if new.identity_key != old.identity_key or self._key_file_changed(new.identity_key):
            log.warning("reload_identity_unchanged",
                        detail="the identity key (identity.key) changes only on restart")
        try:
            self._switch(new)
        except Exception as exc:
            self._switch(old)  # the old config was applied before, so it applies again
            return self._refused([f"{old.path}: cannot apply: {_reason(exc)}"])
        self.stats.reloads.labels("ok").inc()
        log.info("reloaded", tenants=len(new.tenants), routes=len(new.routes()))
        return True, f"reloaded: {len(new.tenants)} tenants, {len(new.routes())} routes"

    def _key_file_changed(self, path: Path) -> bool:
        """Does the key file now hold another key than the running one? (A rotation
        prepared in place: the operator should hear it is not applied by a reload.)"""
        try:
            return key_fingerprint(path) != self.identity.fingerprint
        except (OSError, IdentityError):
            return False  # unreadable or gone: the restart will say so

    def _refused(self, messages: list[str]) -> tuple[bool, str]:
        self.stats.reloads.labels("error").inc()
        for line in messages:
            log.error("reload_refused", error=line)
        return False, "\n".join(messages)

    def _wake(self, tenant: str) -> bool:
        """Relay mail queued for `tenant`: wake its node through a link of ours, or ask
        an instance that holds one (the queue is shared; the links are not)."""
        return self.tunnels.wake(tenant) or self.state.registry.ask_wake(tenant)

    def _tunnels_held(self) -> dict[str, int]:
        """Live tunnel connections per tenant, for the cluster's registry."""
        return {t.name: self.tunnels.live_tunnels(t.name) for t in self.config.tenants}

    def status(self) -> dict[str, Any]:
        """The `/status` document (schema: pact_ingress.admin.schema.STATUS_SCHEMA)."""
        from pact_ingress.admin import schema

        cfg = self.config
        tunnels = [
            {"tenant": t.name, "state": "up" if self.tunnels.live_tunnels(t.name) else "down",
             "connections": self.tunnels.live_tunnels(t.name),
             "streams": self.tunnels.open_streams(t.name)}
            for t in cfg.tenants if any(r.backend.is_tunnel for r in t.routes)
        ]
        up = {t["tenant"]: t["connections"] for t in tunnels}
        return {
            "version": __version__,
            "uptime_s": round(time.time() - self.started, 1),
            "config": str(cfg.path),
            "identity": self.identity.fingerprint,
            "routes": schema.routes_from(cfg),
            "tenants": schema.tenants_from(cfg, up),
            "tunnels": tunnels,
            "certs": [
                {"host": c.host, "issuer": c.issuer, "not_after": schema.iso(c.not_after),
                 "next_renewal": schema.iso(c.next_renewal), "last_error": c.last_error}
                for c in self.certs.inventory()
            ],
            "counters": schema.counters_from_families(self._families()),
            "recent_refusals": self._refusals(),
            "state": self._state_status(),
            "cluster": self.state.registry.status(),
            **({"relay": self.relay.status()} if self.relay and cfg.relay else {}),
            **({"workers": self.workers.status()} if self.workers is not None else {}),
        }

    def _worker_fell_back(self, index: int, report: dict[str, Any]) -> None:
        """A worker's own Redis client fell back (its decision failed) after main's last
        switch, which main's probe did not see: that is the instance's switch too, so
        main's state says it (one `state_backend_lost` line, one count) and rejoins at
        its next probe. A worker still catching up on an older outage is not news."""
        since = report.get("state_since")
        lost = getattr(self.state, "lost", None)
        if lost is None or not isinstance(since, (int, float)):
            return
        if self.state.healthy and since > self.state.since:
            lost(f"worker {index}: {report.get('state_error') or 'unavailable'}")

    def _state_status(self) -> dict[str, Any]:
        """Main's state backend, unless a running worker (its own Redis connection) has
        not rejoined yet: the instance shares its budgets only when every process does."""
        status = self.state.status()
        if status["mode"] != "shared" or self.workers is None:
            return status
        alone = [w["index"] for w in self.workers.status()
                 if w["state"] == "ready" and w.get("state_mode") == "fallback"]
        if alone:
            status = {**status, "mode": "fallback",
                      "last_error": f"worker {', '.join(map(str, alone))} not rejoined yet"}
        return status

    def _families(self) -> list[Any]:
        """This instance's metric families: main's registry, plus (with workers) the last
        report of each worker folded in (`admin/merge.py`)."""
        families = list(self.stats.registry.collect())
        if self.workers is None:
            return families
        from pact_ingress.admin.merge import merge_families

        return merge_families(families, self.workers.reports())

    def _refusals(self) -> list[dict[str, Any]]:
        from pact_ingress.admin import schema
        from pact_ingress.stats import RECENT_REFUSALS

        mine = schema.refusals_from(self.stats)
        if self.workers is None:
            return mine
        theirs = [{"at": at, "route": route, "client_ip": ip, "reason": reason}
                  for at, route, ip, reason in self.workers.refusals()]
        return sorted(mine + theirs, key=lambda r: r["at"])[-RECENT_REFUSALS:]

    async def fresh_status(self) -> dict[str, Any]:
        """`status()` after asking every worker for its numbers (admin `/status`)."""
        if self.workers is not None:
            await self.workers.refresh()
        return self.status()

    async def metrics(self) -> bytes:
        """The instance's `/metrics` text: every process summed, plus per-worker series."""
        from pact_ingress.admin.merge import exposition

        if self.workers is not None:
            await self.workers.refresh()
        return exposition(self._families())

    async def run(self, *, handle_signals: bool = True,
                  task_status: trio.TaskStatus[Ingress] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until SIGTERM/SIGINT (or `stop()`); `task_status.started(self)` when bound.
        A stop signal before READY ends the start-up instead (`stopped_before_ready`)."""
        if not handle_signals:
            await self._run(task_status)
            return
        # the signals are ours from the first moment, so that one coming while the
        # workers, the state backend or the listeners are still starting stops the
        # start-up cleanly instead of killing the process (see `stopping`)
        with trio.open_signal_receiver(signal.SIGHUP, signal.SIGTERM, signal.SIGINT) as sigs:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._signals, sigs, nursery.cancel_scope)
                await self._run(task_status)
                nursery.cancel_scope.cancel()  # served and drained: the signals' task too

    async def _run(self, task_status: trio.TaskStatus[Ingress]) -> None:
        cfg = self.config
        listeners = await open_listeners([_addr(a) for a in cfg.listen.tls])
        self.bound["tls"] = [tuple(l.socket.getsockname()[:2]) for l in listeners]
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self.resolver.refresh_forever)
            if self.workers is not None:
                # first, and waited for: READY below only once the workers are, and the
                # CPU burst of N interpreters starting is over before main's own
                # startup work (the state backend's first probes have deadlines)
                await nursery.start(self.workers.run)
            await nursery.start(self.state.run)
            # peers would reach this instance where callers do: its first TLS address
            host, port = self.bound["tls"][0] if self.bound["tls"] else ("", 0)
            self.state.registry.attach(self.identity.fingerprint,
                                       str(Address(str(host), int(port))) if host else None,
                                       self._tunnels_held)
            # another instance's relay may ask us to wake a node whose link we hold
            self.state.registry.on_wake = self.tunnels.wake
            nursery.start_soon(self.state.registry.run)
            await nursery.start(self.certs.run)
            if self.relay is not None:
                await nursery.start(self._run_relay)
            if cfg.listen.http:
                from pact_ingress.net.http_listener import serve_http

                for a in cfg.listen.http:
                    await nursery.start(serve_http, a, self.certs)
            if cfg.listen.admin is not None:
                from pact_ingress.admin.server import serve_admin
                from pact_ingress.admin.token import read_admin_token

                token = read_admin_token(cfg)
                bound = await nursery.start(lambda task_status: serve_admin(
                    cfg.listen.admin, stats=self.stats, status=self.fresh_status,
                    metrics=self.metrics if self.workers is not None else None,
                    reload=self.reload, renew=self._renew, token=token,
                    allow_remote=token is not None, task_status=task_status))
                self.bound["admin"] = [bound]
            nursery.start_soon(sdnotify.watchdog_loop)
            nursery.start_soon(log.flush_forever)
            await nursery.start(self._serve_router, listeners)
            # a stop signal taken in the step that woke us has cancelled the start-up
            # already: no `serving` line, no READY after its STOPPING
            await trio.lowlevel.checkpoint_if_cancelled()
            log.info("serving", tls=[str(a) for a in cfg.listen.tls],
                     identity=self.identity.fingerprint, routes=len(cfg.routes()))
            if self.settle_gc:
                gctune.settle()  # what lives now lives for the process: out of collections
            self._ready = True
            sdnotify.ready()
            task_status.started(self)
            if stopping.take_hup():  # a SIGHUP came while starting: its config may be newer
                nursery.start_soon(self.reload)

    async def _run_relay(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                         ) -> None:
        """The relay's store; with workers, its allow-lists reach them before the router
        hands them any relay connection, and changes follow."""
        async with trio.open_nursery() as nursery:
            await nursery.start(self.relay.run)
            service = self.relay.service
            if service is not None:
                await service.push_if_changed()
                nursery.start_soon(service.run)
            task_status.started()

    async def _serve_router(self, listeners: list[trio.SocketListener],
                            task_status: trio.TaskStatus[None]) -> None:
        await self.router.serve(listeners, task_status=task_status)
        # every connection finished or was cancelled at the deadline: we are done
        if self.workers is not None:
            await self.workers.wait_exited()
        await self.terminator.aclose()
        self._nursery.cancel_scope.cancel()

    async def _renew(self, host: str | None) -> tuple[bool, str]:
        lines: list[str] = []
        try:
            await self.certs.renew(host, progress=lines.append)
        except PactIngressError as exc:
            return False, str(exc)
        return True, "\n".join(lines) or "renewed"

    async def stop(self, deadline: float = DRAIN_DEADLINE) -> None:
        if self._stopping:  # another SIGTERM: the drain is under way already
            return
        self._stopping = True
        stopping.draining()
        sdnotify.stopping()
        log.info("draining", open_connections=self.router.open_connections,
                 deadline_s=deadline)
        await self.router.drain(deadline)
        await self.terminator.drain()
        if self.workers is not None:
            self.workers.drain()
        if self.relay is not None:
            self.relay.drain()
        await self.tunnels.aclose()

    async def _signals(self, sigs: Any, starting: trio.CancelScope) -> None:
        """SIGHUP reloads and SIGTERM/SIGINT drain once READY; before, a SIGHUP is noted
        (the reload follows READY) and a stop signal cancels `starting`, the start-up
        and everything it began, which the process exits 0 from. The stop signals noted
        before this receiver was open come first."""
        early = stopping.take_early()
        if early:
            self._stop_before_ready(early[0], starting)
            return
        async for signum in sigs:
            if signum == signal.SIGHUP:
                if self._ready:
                    await self.reload()
                else:
                    stopping.note_hup()
            elif self._ready:
                await self.stop()
            else:
                self._stop_before_ready(signum, starting)
                return

    def _stop_before_ready(self, signum: int, starting: trio.CancelScope) -> None:
        self.stopped_before_ready = signal.Signals(signum).name
        stopping.draining()  # more stop signals ask for the exit under way
        sdnotify.stopping()
        starting.cancel()


def _reason(exc: BaseException) -> str:
    """An exception as one line for an operator: the message, or its type if empty."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def main_serve(path: Path, *, log_format: str = "json", workers: int | None = None) -> int:
    """Run `serve` until SIGTERM. `workers`: processes for terminate work; None = one per
    usable core, 1 = this process alone (no children), see `net/workers.py`."""
    from pact_ingress.net.workers import default_workers

    # SIGHUP's default action ends the process, and `Ingress.run`'s receiver is up only
    # once trio runs: until then a reload is noted, and done once serving (the command
    # line asked for both already, before importing this module; asking again is cheap)
    stopping.hold_hup()
    stopping.guard(note_early=True)  # a stop before READY: exit 0 (`Ingress._signals`)
    setup_logs(log_format)
    config = load_config(path)  # ConfigError → exit 2 in the CLI
    count = default_workers() if workers is None else workers

    ingress: Ingress | None = None

    async def run() -> None:
        nonlocal ingress
        ingress = Ingress(config, workers=count, log_format=log_format, settle_gc=True)
        await ingress.run()

    try:
        stopping.run(run)
    except BaseException as exc:
        fault = _operational_fault(exc)
        if fault is None or fault is exc:
            raise
        raise fault from exc
    stopping.exiting()
    if ingress is not None and ingress.stopped_before_ready is not None:
        log.info("stopped_before_ready", signal=ingress.stopped_before_ready,
                 detail="a stop signal came while starting: nothing was served")
    else:
        log.info("stopped")
    return 0


def _operational_fault(exc: BaseException) -> PactIngressError | None:
    """The error to report in one line when `exc` is an operational fault (a port in use,
    a file that cannot be written), also when it comes wrapped in the exception group of
    the nursery it was raised in; None for anything else, which stays a traceback."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    if isinstance(exc, PactIngressError):
        return exc
    if isinstance(exc, OSError):
        return PactIngressError(f"cannot serve: {_reason(exc)}")
    return None


def main_connect(path: Path, *, log_format: str = "json") -> int:
    """Run the connector until SIGTERM/SIGINT, then drain its open streams and exit 0."""
    from pact_ingress.identity import load_identity
    from pact_ingress.net.tunnel.connector import run_connector

    setup_logs(log_format)
    cfg = load_connector_config(path)
    # before trio: an unreadable key is one line from the CLI, not an exception group
    identity = load_identity(cfg.identity_key)

    async def run() -> None:
        stop = trio.Event()
        async with trio.open_nursery() as nursery:

            async def connector(task_status: trio.TaskStatus[Any]) -> None:
                # returns after `stop` once open streams drained (or the grace ran out)
                await run_connector(cfg, shutdown=stop, identity=identity,
                                    task_status=task_status)
                nursery.cancel_scope.cancel()

            nursery.start_soon(_stop_on_signal, stop)
            nursery.start_soon(sdnotify.watchdog_loop)
            await nursery.start(connector)
            sdnotify.ready()
            log.info("connector_started", ingress=[str(a) for a in cfg.ingress_addresses],
                     forward=str(cfg.forward),
                     connections=cfg.connections)

    stopping.guard()
    stopping.run(run)
    log.info("stopped")
    return 0


async def _stop_on_signal(stop: trio.Event) -> None:
    """SIGTERM/SIGINT: stop (once: later ones change nothing, see `stopping`). SIGHUP:
    the connector has nothing to reload in place (its config is one key and one address);
    say so instead of dying of the default action."""
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as sigs:
        async for signum in sigs:
            if signum == signal.SIGHUP:
                log.warning("reload_not_supported", detail="restart the connector to apply "
                            "a changed config: systemctl restart pact-connect")
                continue
            stopping.draining()  # more stop signals ask for what is under way
            sdnotify.stopping()
            stop.set()
            return
