"""Reverse tunnel, home side, towards several ingress instances at once.

Theory of operation
-------------------
A cluster of ingress instances serves one family edge; a caller may reach any of them, so
each instance must hold at least one control connection of ours or it has no tunnel to
hand out. `ingress.address` is therefore a list of addresses, or one name whose every
A/AAAA record is an instance. Every address — each record of a name — is one **target**,
and each target gets a `Connector` of its own with the configured `connections` slots:
the spread is by construction, not by a balancing rule that could leave an instance empty
after reconnects. The connectors share nothing but the config, the pins and the `Stats`,
so one instance dying only makes its own slots reconnect with their back-off; the others
never notice.

Every target accepts any configured pin: behind a name we cannot know which instance
answers on which record, and an instance's key is its identity whichever address it has.

Names are resolved again every RESOLVE_INTERVAL: a record that appeared gets a connector,
one that disappeared has its connector drained (GOAWAY(DRAINING), running streams finish
within `grace`). A lookup that fails keeps the targets we have — a resolver hiccup must
not tear down working tunnels — and before the first answer is retried with back-off.
"""

from __future__ import annotations

import dataclasses
import socket
from dataclasses import dataclass, field

import trio

from pact_ingress.identity import Identity, load_identity
from pact_ingress.logs import log
from pact_ingress.model import Address, ConnectorConfig, is_ip_address
from pact_ingress.net.tunnel.connector import DRAIN_GRACE, Backoff, Connector
from pact_ingress.proto.tunnel.constants import HEARTBEAT_INTERVAL
from pact_ingress.stats import Stats

#: Names among the ingress addresses are looked up again this often.
RESOLVE_INTERVAL = 60.0
#: One lookup gives up after this (the resolver's own retries included).
RESOLVE_TIMEOUT = 10.0
#: Records one name may contribute: a runaway answer must not become hundreds of links.
MAX_RECORDS_PER_NAME = 16


@dataclass(eq=False)
class _Target:
    connector: Connector
    shutdown: trio.Event = field(default_factory=trio.Event)
    done: trio.Event = field(default_factory=trio.Event)


async def resolve_all(address: Address) -> list[Address] | None:
    """Every A/AAAA record of `address` (an IP literal is itself), in the resolver's
    order, or None when the lookup failed or timed out."""
    if is_ip_address(address.host):
        return [address]
    with trio.move_on_after(RESOLVE_TIMEOUT):
        try:
            infos = await trio.socket.getaddrinfo(address.host, address.port,
                                                  type=socket.SOCK_STREAM)
        except OSError as exc:
            log.warning("ingress_resolve_failed", name=address.host, error=repr(exc))
            return None
        out: list[Address] = []
        for _family, _type, _proto, _canon, sockaddr in infos:
            found = Address(str(sockaddr[0]), address.port)
            if found not in out:
                out.append(found)
        return out[:MAX_RECORDS_PER_NAME]
    log.warning("ingress_resolve_failed", name=address.host, error="timed out")
    return None


class ConnectorSet:
    """One `Connector` per ingress target; `run()` until cancelled or `shutdown` is set."""

    def __init__(self, cfg: ConnectorConfig, *, stats: Stats | None = None,
                 heartbeat: float = HEARTBEAT_INTERVAL,
                 data_transport: str | None = None, identity: Identity | None = None
                 ) -> None:
        self.cfg = cfg
        #: Loaded once and shared by every target's connector: a target that appears
        #: later (a new record of a name) must not fail on a key file changed meanwhile.
        self.identity = identity
        self.stats = stats or Stats()
        self.heartbeat = heartbeat
        self.data_transport = data_transport or cfg.data_transport
        self.targets: dict[Address, _Target] = {}
        self._known: dict[Address, list[Address]] = {}  # configured → last good answer
        self._nursery: trio.Nursery | None = None
        self.grace = DRAIN_GRACE

    # --- introspection (sums over the targets) -------------------------------------------

    @property
    def connectors(self) -> list[Connector]:
        return [t.connector for t in self.targets.values()]

    @property
    def live_links(self) -> int:
        return sum(c.live_links for c in self.connectors)

    @property
    def active_streams(self) -> int:
        return sum(c.active_streams for c in self.connectors)

    @property
    def idle_data(self) -> int:
        return sum(c.idle_data for c in self.connectors)

    def links_to(self, address: Address) -> int:
        target = self.targets.get(address)
        return 0 if target is None else target.connector.live_links

    # --- lifecycle ---------------------------------------------------------------------------

    async def run(self, *, shutdown: trio.Event | None = None, grace: float = DRAIN_GRACE,
                  task_status: trio.TaskStatus[ConnectorSet] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        self.grace = grace
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            await self._refresh(grace, first=True)
            nursery.start_soon(self._resolve_loop, grace)
            task_status.started(self)
            if shutdown is None:
                await trio.sleep_forever()
            await shutdown.wait()
            for target in self.targets.values():
                target.shutdown.set()
            for target in list(self.targets.values()):
                await target.done.wait()  # each bounded by its own grace
            nursery.cancel_scope.cancel()

    async def _resolve_loop(self, grace: float) -> None:
        names = [a for a in self.cfg.ingress_addresses if not is_ip_address(a.host)]
        if not names:
            return  # nothing can change
        backoff = Backoff()
        while True:
            if all(name in self._known for name in names):
                backoff.reset()
                await trio.sleep(RESOLVE_INTERVAL)
            else:
                await trio.sleep(backoff.next())
            await self._refresh(grace)

    async def _refresh(self, grace: float, *, first: bool = False) -> None:
        for configured in self.cfg.ingress_addresses:
            found = await resolve_all(configured)
            if found:  # None or empty: keep what we had
                self._known[configured] = found
        wanted: list[Address] = []
        for configured in self.cfg.ingress_addresses:
            for address in self._known.get(configured, ()):
                if address not in wanted:
                    wanted.append(address)
        for address in wanted:
            if address not in self.targets:
                self._start(address)
        for address in [a for a in self.targets if a not in wanted]:
            log.info("ingress_target_gone", ingress=str(address))
            self.targets.pop(address).shutdown.set()
        if first and not wanted:
            log.warning("ingress_unresolved", addresses=[str(a) for a in
                                                         self.cfg.ingress_addresses])

    def _start(self, address: Address) -> None:
        assert self._nursery is not None
        cfg = dataclasses.replace(self.cfg, ingress=address, ingresses=())
        if self.identity is None:
            self.identity = load_identity(cfg.identity_key)
        target = _Target(Connector(cfg, stats=self.stats, heartbeat=self.heartbeat,
                                   identity=self.identity,
                                   data_transport=self.data_transport))
        self.targets[address] = target
        if len(self.cfg.ingress_addresses) > 1 or address != self.cfg.ingress:
            log.info("ingress_target", ingress=str(address))

        async def run() -> None:
            try:
                await target.connector.run(shutdown=target.shutdown, grace=self.grace)
            finally:
                target.done.set()

        self._nursery.start_soon(run)
