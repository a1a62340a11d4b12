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
all or nothing) and answers the names in the registry's **index**, a set every heartbeat
adds its keys to; one MGET reads their values, and the cluster's view is kept for
`/status` (and for whoever asks who holds a tenant). Names whose key expired are taken
out of the index by one more script, only when there are some.

Why an index and not SCAN over the prefix: SCAN walks the whole keyspace, and the
registry shares its Redis with every rate-limit bucket and relay queue. With a million
buckets (a busy day, or a flood from many addresses) one heartbeat took ~1,000 SCAN
calls and over a second: past its deadline, so the instance fell back to counting rate
limits alone every other second and never had a view to forward with. Through the index
a heartbeat's work depends on the registry's size only.

The heartbeat also carries relay **wakes** between instances: the relay queue is
shared, a node's control links may reach only some instances, and a WAKE can only go
out on a link. An instance that queued mail for a tenant it holds no link for
(`ask_wake`) writes a short-lived wake key at its next heartbeat; each holder's
heartbeat takes (DEL) the wake keys of the tenants it holds, and the one whose DEL
found it wakes the node (`on_wake`): one wake, by one holder.

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
#: A wake asked of the holders lives this long in Redis unless one takes it (at its next
#: heartbeat, normally within REGISTRY_INTERVAL): a holder that died meanwhile leaves it
#: to expire, and a node woken that late would fetch for nothing.
WAKE_TTL = 10.0

#: KEYS[1]: the index; KEYS[2]: the member key; then holder keys to set, holder keys to
#: delete, wake keys to set (tenants this instance asks a holder to wake) and wake keys to
#: take (one per tenant it holds). ARGV[1]: TTL in ms; ARGV[2]: the member value;
#: ARGV[3..6]: how many holder keys are set, how many index names to answer at most, how
#: many holder keys are deleted, how many wake keys are set; ARGV[7]: a wake key's TTL in
#: ms; then the values of the holder keys set. Answers the index's names (all, or that
#: many at random) and the wake keys taken (each by one holder only: DEL says who).
BEAT_SCRIPT = """
local ttl = tonumber(ARGV[1])
local set, most = tonumber(ARGV[3]), tonumber(ARGV[4])
local del, ask = tonumber(ARGV[5]), tonumber(ARGV[6])
redis.call('SET', KEYS[2], ARGV[2], 'PX', ttl)
redis.call('SADD', KEYS[1], KEYS[2])
local k = 2
for i = 1, set do
  k = k + 1
  redis.call('SET', KEYS[k], ARGV[7 + i], 'PX', ttl)
  redis.call('SADD', KEYS[1], KEYS[k])
end
for i = 1, del do
  k = k + 1
  redis.call('DEL', KEYS[k])
  redis.call('SREM', KEYS[1], KEYS[k])
end
for i = 1, ask do
  k = k + 1
  redis.call('SET', KEYS[k], '1', 'PX', tonumber(ARGV[7]))
end
local taken = {}
for i = k + 1, #KEYS do
  if redis.call('DEL', KEYS[i]) == 1 then
    taken[#taken + 1] = KEYS[i]
  end
end
-- the index outlives the last heartbeat by a TTL or so, then goes too
redis.call('PEXPIRE', KEYS[1], 2 * ttl)
local names
if redis.call('SCARD', KEYS[1]) > most then
  names = redis.call('SRANDMEMBER', KEYS[1], most)
else
  names = redis.call('SMEMBERS', KEYS[1])
end
return {names, taken}
"""
#: KEYS[1]: the index; KEYS[2..]: names read back as expired. Each is taken out of the
#: index only if its key is still gone (its instance may have written it again since).
PRUNE_SCRIPT = """
for i = 2, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 0 then
    redis.call('SREM', KEYS[1], KEYS[i])
  end
end
return 'ok'
"""

Held = Callable[[], dict[str, int]]


class Registry(Protocol):
    on_wake: Callable[[str], object] | None

    def attach(self, fingerprint: str, address: str | None, held: Held) -> None: ...

    async def run(self) -> None: ...

    def status(self) -> dict[str, Any]: ...

    def holders_of(self, tenant: str) -> list[str]: ...

    def address_of(self, fingerprint: str) -> str | None: ...

    def ask_wake(self, tenant: str) -> bool: ...


class LocalRegistry:
    """One instance: the registry is this process's own tunnels, and nothing to run."""

    def __init__(self) -> None:
        self.fingerprint = ""
        self.held: Held = dict
        self.on_wake: Callable[[str], object] | None = None

    def attach(self, fingerprint: str, address: str | None, held: Held) -> None:
        self.fingerprint, self.held = fingerprint, held

    async def run(self) -> None:
        return

    def holders_of(self, tenant: str) -> list[str]:
        return []  # nobody else

    def address_of(self, fingerprint: str) -> str | None:
        return None

    def ask_wake(self, tenant: str) -> bool:
        return False  # nobody else to ask

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
        self.prune = state.client.register_script(PRUNE_SCRIPT)
        self.fingerprint = ""
        self.address: str | None = None
        self.held: Held = dict
        #: Tenants whose holder key we wrote last; None until a beat went through: a
        #: previous life of this instance (same key, restarted within the TTL) may have
        #: written any of them, so the first beat deletes every one it does not hold.
        self._published: set[str] | None = None
        #: The last view read back: fingerprint → member doc; tenant → {fingerprint: n}.
        self.members: dict[str, dict[str, Any]] = {}
        self.holders: dict[str, dict[str, int]] = {}
        #: When the view was read, on the monotonic clock: its age must not move with
        #: the wall clock (a step back would keep an old view fresh).
        self.view_at: float | None = None
        #: Tenants whose node a holder should wake (relay mail queued here, where the
        #: tenant has no link): written at the next heartbeat.
        self._wakes: set[str] = set()
        #: Called with a tenant whose wake another instance asked of us (the app: the
        #: tunnel server's `wake`).
        self.on_wake: Callable[[str], object] | None = None

    def attach(self, fingerprint: str, address: str | None, held: Held) -> None:
        self.fingerprint, self.address, self.held = fingerprint, address, held

    def _index_key(self) -> str:
        return self.state.key("tun", "index")

    def _member_key(self, fingerprint: str) -> str:
        return self.state.key("tun", "member", fingerprint)

    def _holder_key(self, tenant: str, fingerprint: str) -> str:
        return self.state.key("tun", "holder", tenant, fingerprint)

    def _wake_key(self, tenant: str) -> str:
        return self.state.key("tun", "wake", tenant)

    def ask_wake(self, tenant: str) -> bool:
        """Relay mail was queued here for `tenant`, which has no link here: ask a holder
        to wake its node (False: the view names none). The wake key is written at the
        next heartbeat; the first holder to beat after it takes it and wakes its node,
        so a call queued through any instance wakes the node within about two
        heartbeats."""
        if not self.holders_of(tenant):
            return False
        self._wakes.add(tenant)
        return True

    @property
    def stale(self) -> bool:
        return self.view_at is None or time.monotonic() - self.view_at > self.ttl

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
        counts = self.held()
        held = {t: n for t, n in counts.items() if n}
        member = json.dumps({"address": self.address, "fingerprint": self.fingerprint,
                             "heartbeat": now})
        published = set(counts) if self._published is None else self._published
        gone = sorted(published - held.keys())
        keys = [self._index_key(), self._member_key(self.fingerprint)]
        keys += [self._holder_key(t, self.fingerprint) for t in held]
        keys += [self._holder_key(t, self.fingerprint) for t in gone]
        asked = sorted(self._wakes)
        keys += [self._wake_key(t) for t in asked]
        keys += [self._wake_key(t) for t in held]
        args = [str(int(self.ttl * 1000)), member, str(len(held)), str(MAX_REGISTRY_KEYS),
                str(len(gone)), str(len(asked)), str(int(WAKE_TTL * 1000))]
        args += [json.dumps({"tunnels": n, "heartbeat": now}) for n in held.values()]
        names, taken = await self.script(keys=keys, args=args)
        self._published = set(held)
        self._wakes.difference_update(asked)
        wake_prefix = self._wake_key("")
        for name in taken or ():
            name = name.decode() if isinstance(name, bytes) else str(name)
            if self.on_wake is not None and name.startswith(wake_prefix):
                self.on_wake(name[len(wake_prefix):])
        await self._read_view([n.decode() if isinstance(n, bytes) else str(n)
                               for n in names or ()])

    async def _read_view(self, names: list[str]) -> None:
        prefix = self.state.key("tun", "")
        # only registry keys are read: a name some other writer put in the index must
        # not make every heartbeat load whatever big value it names
        names = [n for n in names if n.startswith((prefix + "member:", prefix + "holder:"))]
        values = await self.state.client.mget(names) if names else ()
        members: dict[str, dict[str, Any]] = {}
        holders: dict[str, dict[str, int]] = {}
        expired: list[str] = []
        for name, raw in zip(names, values):
            if raw is None:
                expired.append(name)  # its instance stopped beating
                continue
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
        self.members, self.holders, self.view_at = members, holders, time.monotonic()
        if expired:
            await self.prune(keys=[self._index_key(), *expired], args=[])

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
