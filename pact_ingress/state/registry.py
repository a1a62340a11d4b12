"""The tunnel registry: which ingress instances hold a tunnel for which tenant.

Theory of operation
-------------------
With one instance there is nothing to share: `LocalRegistry` says so and does nothing.

With Redis (`RedisRegistry`), every instance writes, every REGISTRY_INTERVAL, one
**member** key for itself (its identity fingerprint is its name; the value says its
inter-instance address, its fingerprint and the time of this heartbeat) and one
**holder** key per tenant it holds a live tunnel for (the value: how many control
connections). Every key carries a TTL of REGISTRY_TTL, so an instance that dies — `kill
-9`, a cut cable — drops out of the registry by itself within that time, with nobody
having to notice and clean up; a tenant whose tunnels went away on a live instance has
its key deleted at the next heartbeat. One script writes a heartbeat (one round trip,
all or nothing); the cluster's view is then read back with SCAN + MGET and kept for
`/status` (and for whoever asks who holds a tenant).

The registry is advisory: nothing on the data path waits for it. While Redis is
unreachable (`RedisState` in fallback) heartbeats are skipped and the view is marked
stale; each instance serves the tunnels dialled to it, as a single instance does, and
the next heartbeat after Redis returns republishes everything.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import trio

from pact_ingress.logs import log

if TYPE_CHECKING:
    from pact_ingress.state.redis import RedisState

#: How often an instance republishes what it holds.
REGISTRY_INTERVAL = 1.0
#: What a key lives without a heartbeat: a few missed beats, so a busy instance does not
#: flicker out, and still short enough that a dead one is forgotten within seconds.
REGISTRY_TTL = 5.0
#: One heartbeat (the write, then reading the view back) waits at most this long. It is
#: not a request's deadline: nobody waits for it but the registry task.
REGISTRY_DEADLINE = 1.0
#: Registry keys read back per heartbeat at most: members and holders of a sane cluster
#: are a handful per tenant; this bounds what a polluted prefix could make us load.
MAX_REGISTRY_KEYS = 10_000

#: KEYS[1]: the member key; KEYS[2..]: holder keys to set, then holder keys to delete.
#: ARGV[1]: TTL in ms; ARGV[2]: the member value; ARGV[3]: how many holder keys are set;
#: then their values.
BEAT_SCRIPT = """
local ttl = tonumber(ARGV[1])
redis.call('SET', KEYS[1], ARGV[2], 'PX', ttl)
local set = tonumber(ARGV[3])
for i = 2, #KEYS do
  if i - 1 <= set then
    redis.call('SET', KEYS[i], ARGV[3 + i - 1], 'PX', ttl)
  else
    redis.call('DEL', KEYS[i])
  end
end
return 'ok'
"""

Held = Callable[[], dict[str, int]]


class Registry(Protocol):
    def attach(self, fingerprint: str, address: str | None, held: Held) -> None: ...

    async def run(self) -> None: ...

    def status(self) -> dict[str, Any]: ...

    def holders_of(self, tenant: str) -> list[str]: ...

    def address_of(self, fingerprint: str) -> str | None: ...


class LocalRegistry:
    """One instance: the registry is this process's own tunnels, and nothing to run."""

    def __init__(self) -> None:
        self.fingerprint = ""
        self.held: Held = dict

    def attach(self, fingerprint: str, address: str | None, held: Held) -> None:
        self.fingerprint, self.held = fingerprint, held

    async def run(self) -> None:
        return

    def holders_of(self, tenant: str) -> list[str]:
        return []  # nobody else

    def address_of(self, fingerprint: str) -> str | None:
        return None

    def status(self) -> dict[str, Any]:
        return {"registry": "local", "stale": False, "members": [],
                "holders": {t: [self.fingerprint] for t, n in self.held().items() if n}}


class RedisRegistry:
    def __init__(self, state: RedisState, *, interval: float = REGISTRY_INTERVAL,
                 ttl: float = REGISTRY_TTL) -> None:
        self.state = state
        self.interval = interval
        self.ttl = ttl
        self.script = state.client.register_script(BEAT_SCRIPT)
        self.fingerprint = ""
        self.address: str | None = None
        self.held: Held = dict
        self._published: set[str] = set()  # tenants whose holder key we wrote last
        #: The last view read back: fingerprint → member doc; tenant → {fingerprint: n}.
        self.members: dict[str, dict[str, Any]] = {}
        self.holders: dict[str, dict[str, int]] = {}
        self.view_at: float | None = None

    def attach(self, fingerprint: str, address: str | None, held: Held) -> None:
        self.fingerprint, self.address, self.held = fingerprint, address, held

    def _member_key(self, fingerprint: str) -> str:
        return self.state.key("tun", "member", fingerprint)

    def _holder_key(self, tenant: str, fingerprint: str) -> str:
        return self.state.key("tun", "holder", tenant, fingerprint)

    @property
    def stale(self) -> bool:
        return self.view_at is None or time.time() - self.view_at > self.ttl

    def holders_of(self, tenant: str) -> list[str]:
        """Instances other than this one that hold `tenant`'s tunnel (empty when stale)."""
        if self.stale:
            return []
        return [fp for fp, n in self.holders.get(tenant, {}).items()
                if n and fp != self.fingerprint and fp in self.members]

    def address_of(self, fingerprint: str) -> str | None:
        """Where a member said peers reach it (its first `listen.tls` address)."""
        address = self.members.get(fingerprint, {}).get("address")
        return address if isinstance(address, str) else None

    async def run(self) -> None:
        while True:
            if self.state.healthy and self.fingerprint:
                try:
                    await self.state.call("registry", self.beat, REGISTRY_DEADLINE)
                except Exception as exc:
                    log.debug("tunnel_registry_beat_failed", error=repr(exc))
            await trio.sleep(self.interval)

    async def beat(self) -> None:
        """Publish what we hold, then read the cluster's view back."""
        now = time.time()
        held = {t: n for t, n in self.held().items() if n}
        member = json.dumps({"address": self.address, "fingerprint": self.fingerprint,
                             "heartbeat": now})
        gone = sorted(self._published - held.keys())
        keys = [self._member_key(self.fingerprint)]
        keys += [self._holder_key(t, self.fingerprint) for t in held]
        keys += [self._holder_key(t, self.fingerprint) for t in gone]
        args = [str(int(self.ttl * 1000)), member, str(len(held))]
        args += [json.dumps({"tunnels": n, "heartbeat": now}) for n in held.values()]
        await self.script(keys=keys, args=args)
        self._published = set(held)
        await self._read_view()

    async def _read_view(self) -> None:
        prefix = self.state.key("tun", "")
        names: list[str] = []
        async for name in self.state.client.scan_iter(match=prefix + "*", count=1000):
            names.append(name.decode() if isinstance(name, bytes) else name)
            if len(names) >= MAX_REGISTRY_KEYS:
                break
        values = await self.state.client.mget(names) if names else ()
        members: dict[str, dict[str, Any]] = {}
        holders: dict[str, dict[str, int]] = {}
        for name, raw in zip(names, values):
            if raw is None:
                continue  # expired between SCAN and MGET
            try:
                doc = json.loads(raw)
            except ValueError:
                continue
            if not isinstance(doc, dict):
                continue
            kind, _, rest = name[len(prefix):].partition(":")
            if kind == "member":
                members[rest] = doc
            elif kind == "holder":
                # a tenant name has no ':', a fingerprint does ("sha256:…"): the first
                # ':' of the rest is the one between them
                tenant, _, fp = rest.partition(":")
                tunnels = doc.get("tunnels", 0)
                holders.setdefault(tenant, {})[fp] = tunnels if isinstance(tunnels, int) else 0
        self.members, self.holders, self.view_at = members, holders, time.time()

    def status(self) -> dict[str, Any]:
        return {
            "registry": "redis",
            "stale": self.stale,
            "members": [
                {"fingerprint": fp, "address": doc.get("address"),
                 "last_heartbeat": doc.get("heartbeat"), "self": fp == self.fingerprint}
                for fp, doc in sorted(self.members.items())
            ],
            "holders": {t: sorted(fp for fp, n in h.items() if n)
                        for t, h in sorted(self.holders.items())},
        }
