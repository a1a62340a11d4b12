"""The relay queue in Redis: `RedisRelayStore`, the `RelayStore` several instances share.

Theory of operation
-------------------
**Same rules as the embedded store** (`relay/store.py`): at least once, dedupe by
(recipient, msg_id) — the same sender's second call answers like the first, also after
the item was acked, until it would have expired; another sender's is refused —,
per-recipient `max_items` / `max_bytes` bounds and each sender's share of them (half of
each, rounded up, at least one item: `proto.relay.sender_share`), items visible until
`min(exp, 30 days)` (computed by `proto.relay`), oldest-first pages bounded by `limit`
and `MAX_PAGE_BYTES`, ack deletes, and an unacked item comes back on every fetch. Each
operation is one Lua script, so it is atomic and one round trip: an enqueue checks the
dedupe entry, the bounds (the whole queue's, then the sender's share) and appends in one
step, and two instances enqueueing the same msg_id at once store it once.

**A sender's share** is counted in ``{r}:s``: per sender, its unacked items and their
bytes, changed by the same scripts that change the queue (enqueue adds, ack and the
purge of expired items give back, a duplicate adds nothing), so it is always what the
queue holds. A store whose items were queued before these counters existed has no
``:built`` field there; the first script to touch the recipient counts them from the
queue once (every item's metadata names its size and sender). An instance of an older
version sharing the Redis (a rolling upgrade) queues and acks without them; an ack or
purge that leaves a queue empty resets them to nothing, which is then the truth, so
what it put wrong lasts at most until the node next drains its queue.

**Keys** (all under the state's `key_prefix`, then ``relay:``; the keys of one
recipient share the hash tag ``{RECIPIENT}``):

============  ======  ===========================================================
``{r}:seq``   string  the recipient's last item id (ids grow: id order is age order)
``{r}:q``     zset    unacked item ids, scored by id: the queue, oldest first
``{r}:x``     zset    unacked item ids, scored by expiry: what purge drops
``{r}:i``     hash    ``ID`` → envelope, ``ID:m`` → "queued_at expires_at size sender"
``{r}:b``     string  bytes of unacked envelopes (the byte bound; ZCARD q is the item one)
``{r}:d``     hash    msg_id → "ID expires_at sender": the dedupe entry, kept after ack
``{r}:dx``    zset    msg_ids scored by expiry: when their dedupe entries go
``{r}:s``     hash    ``SENDER:n`` / ``SENDER:b`` → its unacked items / bytes; ``:built``
``recipients`` set    recipients that ever had an item (what purge walks)
``allow``     hash    recipient → its allow-list, one fingerprint per line
``allow:ver`` string  bumped on every allow-list change
============  ======  ===========================================================

No key carries a Redis TTL: expiry is decided on the instance's clock (as the embedded
store does, so a test clock works) and applied by `purge`, and keys without a TTL are
never chosen by the `volatile-*` eviction policies the rate limiter's keys are meant for.

**No loss.** A success answer is sent only after Redis answered the script, and Redis
answers a write only after it is in the AOF — fsynced first when `appendfsync always`.
So the embedded store's promise (an acknowledged call survives `kill -9` and a power cut)
holds when Redis runs with ``appendonly yes`` and ``appendfsync always``. With
``everysec`` a Redis crash loses nothing but a power cut or kernel crash loses about the
last second of acknowledged items; with ``appendonly no`` a Redis restart loses them
all; an ``allkeys-*`` eviction policy may drop queued items when memory runs out.
`check_persistence` reads those settings (``CONFIG GET``) when the store opens and again
whenever Redis comes back, and says in one warning log line and on `/status` what they
can lose. Redis 7.2's ``WAITAOF`` could make ``everysec`` as safe per call, but it must
run on the connection that wrote, which a pooled client does not promise, and Debian
12's Redis is 7.0, which has no WAITAOF: ``appendfsync always`` is the requirement.

**Faults.** The store rides on the state backend's health (`RedisState`): while Redis is
unreachable or slow every operation fails at once with `StoreUnavailable` (the relay
answers ``unavailable``; nothing is acknowledged that was not stored), without waiting
on Redis; the state's probe notices Redis coming back within about a second, and the
next call goes through. A call that times out may still have been applied; the sender's
retry is then answered as a duplicate, which is at-least-once as promised.

**Mirrors.** `allowlists()` and `depths()` are read synchronously by the relay, so they
are in-process copies: allow-lists are re-read before each tool call when another
instance changed them (one GET of ``allow:ver``), depths are updated by every own
operation and recounted from Redis by `purge` (every minute).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

import trio
from coredis.exceptions import ResponseError

from pact_ingress.logs import log
from pact_ingress.proto.relay import FULL_RETRY_AFTER, MAX_PAGE_BYTES, sender_share
from pact_ingress.relay.store import Enqueued, Item, MsgIdTaken, QueueFull, StoreUnavailable
from pact_ingress.stats import Stats

if TYPE_CHECKING:
    from pact_ingress.state.redis import RedisState

T = TypeVar("T")

#: A relay operation waits at most this long for Redis (or the state's own deadline if
#: that is longer): a write fsyncs the AOF before Redis answers, and a page may carry
#: 16 MiB, so it gets far longer than a rate-limit decision does.
RELAY_DEADLINE = 2.0
#: Item ids the fetch script reads per step while it skips expired items.
SCAN_STEP = 100
#: What `check_persistence` wants, setting by setting.
REQUIRED = {"appendonly": "yes", "appendfsync": "always"}

#: Lua shared by the scripts that change a queue: the per-sender counters of ``{r}:s``.
#: `counted` makes them once from the queue itself when the hash has no ``:built`` field
#: (a store written before they existed; fingerprints never start with ":"), so every
#: script after it finds them equal to what is queued. `uncount` gives one item back; a
#: field that reaches 0 goes, so the hash holds only senders with something queued.
#: `settle` (after an ack or purge) empties them when the queue is empty, which is the
#: truth whatever they said: counts an instance of an older version left wrong (it
#: queues and acks without them) are mended the next time the node drains its queue.
SENDER_LUA = """
local function meta_of(meta)
  local size, by = string.match(meta, '^%d+ %d+ (%d+) ?(.*)$')
  return tonumber(size), by
end
local function counted(s, q, i)
  if redis.call('HEXISTS', s, ':built') == 1 then return end
  for _, id in ipairs(redis.call('ZRANGE', q, 0, -1)) do
    local meta = redis.call('HGET', i, id .. ':m')
    if meta then
      local size, by = meta_of(meta)
      redis.call('HINCRBY', s, by .. ':n', 1)
      redis.call('HINCRBY', s, by .. ':b', size)
    end
  end
  redis.call('HSET', s, ':built', '1')
end
local function uncount(s, by, size)
  if redis.call('HINCRBY', s, by .. ':n', -1) <= 0 then redis.call('HDEL', s, by .. ':n') end
  if redis.call('HINCRBY', s, by .. ':b', -size) <= 0 then redis.call('HDEL', s, by .. ':b') end
end
local function settle(s, q)
  if redis.call('ZCARD', q) == 0 and redis.call('HLEN', s) > 1 then
    redis.call('DEL', s)
    redis.call('HSET', s, ':built', '1')
  end
end
"""

#: KEYS: seq q x i b d dx recipients s. ARGV: now, expires_at, msg_id, sender, envelope,
#: max_items, max_bytes, recipient, the sender's share of max_items, of max_bytes
#: (`proto.relay.sender_share`). Returns {id, outcome, items, bytes}: outcome 0 is
#: queued, 1 a duplicate (id: the first one's), 2 full (the queue, or the sender's share
#: of it), 3 the msg_id is another sender's; items/bytes: the queue after. A dedupe entry
#: written before it named its sender ("ID expires_at") counts as this sender's.
ENQUEUE_SCRIPT = SENDER_LUA + """
local now, exp = tonumber(ARGV[1]), tonumber(ARGV[2])
local items = redis.call('ZCARD', KEYS[2])
local bytes = tonumber(redis.call('GET', KEYS[5]) or '0')
local seen = redis.call('HGET', KEYS[6], ARGV[3])
if seen then
  local id, until_, by = string.match(seen, '^(%d+) (%d+) ?(.*)$')
  if tonumber(until_) > now then
    if by ~= '' and by ~= ARGV[4] then return {tonumber(id), 3, items, bytes} end
    return {tonumber(id), 1, items, bytes}
  end
end
local size = string.len(ARGV[5])
if items + 1 > tonumber(ARGV[6]) or bytes + size > tonumber(ARGV[7]) then
  return {0, 2, items, bytes}
end
counted(KEYS[9], KEYS[2], KEYS[4])
local mine = tonumber(redis.call('HGET', KEYS[9], ARGV[4] .. ':n') or '0')
local mine_bytes = tonumber(redis.call('HGET', KEYS[9], ARGV[4] .. ':b') or '0')
if mine + 1 > tonumber(ARGV[9]) or mine_bytes + size > tonumber(ARGV[10]) then
  return {0, 2, items, bytes}
end
local id = redis.call('INCR', KEYS[1])
redis.call('ZADD', KEYS[2], id, id)
redis.call('ZADD', KEYS[3], exp, id)
redis.call('HSET', KEYS[4], id, ARGV[5],
           id .. ':m', ARGV[1] .. ' ' .. ARGV[2] .. ' ' .. size .. ' ' .. ARGV[4])
redis.call('INCRBY', KEYS[5], size)
redis.call('HINCRBY', KEYS[9], ARGV[4] .. ':n', 1)
redis.call('HINCRBY', KEYS[9], ARGV[4] .. ':b', size)
redis.call('HSET', KEYS[6], ARGV[3], id .. ' ' .. ARGV[2] .. ' ' .. ARGV[4])
redis.call('ZADD', KEYS[7], exp, ARGV[3])
redis.call('SADD', KEYS[8], ARGV[8])
return {id, 0, items + 1, bytes + size}
"""

#: KEYS: q i. ARGV: now, limit, page byte cap. Returns {more, {id, queued_at, envelope,
#: ...}}: the oldest unexpired items, at most `limit` and the byte cap (but always one).
FETCH_SCRIPT = f"""
local now, limit, cap = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local out, n, total, more, start = {{}}, 0, 0, 0, 0
while more == 0 do
  local ids = redis.call('ZRANGE', KEYS[1], start, start + {SCAN_STEP - 1})
  if #ids == 0 then break end
  for _, id in ipairs(ids) do
    local meta = redis.call('HGET', KEYS[2], id .. ':m')
    if meta then
      local queued, exp, size = string.match(meta, '^(%d+) (%d+) (%d+)')
      size = tonumber(size)
      if tonumber(exp) > now then
        if n == limit or (n > 0 and total + size > cap) then more = 1; break end
        out[#out + 1] = id
        out[#out + 1] = queued
        out[#out + 1] = redis.call('HGET', KEYS[2], id)
        n, total = n + 1, total + size
      end
    end
  end
  start = start + {SCAN_STEP}
end
return {{more, out}}
"""

#: KEYS: q x i b s. ARGV: item ids. Returns {acked, items, bytes} (the queue after).
ACK_SCRIPT = SENDER_LUA + """
counted(KEYS[5], KEYS[1], KEYS[3])
local acked, freed = 0, 0
for _, id in ipairs(ARGV) do
  if redis.call('ZREM', KEYS[1], id) == 1 then
    local meta = redis.call('HGET', KEYS[3], id .. ':m')
    if meta then
      local size, by = meta_of(meta)
      freed = freed + size
      uncount(KEYS[5], by, size)
    end
    redis.call('ZREM', KEYS[2], id)
    redis.call('HDEL', KEYS[3], id, id .. ':m')
    acked = acked + 1
  end
end
if freed > 0 then redis.call('DECRBY', KEYS[4], freed) end
settle(KEYS[5], KEYS[1])
return {acked, redis.call('ZCARD', KEYS[1]), tonumber(redis.call('GET', KEYS[4]) or '0')}
"""

#: KEYS: q x i b d dx s. ARGV: now. Drops items and dedupe entries whose expiry passed.
#: Returns {unacked items dropped, items, bytes} (the queue after).
PURGE_SCRIPT = SENDER_LUA + """
local now = ARGV[1]
counted(KEYS[7], KEYS[1], KEYS[3])
local ids = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now)
local freed = 0
for _, id in ipairs(ids) do
  local meta = redis.call('HGET', KEYS[3], id .. ':m')
  if meta then
    local size, by = meta_of(meta)
    freed = freed + size
    uncount(KEYS[7], by, size)
  end
  redis.call('ZREM', KEYS[1], id)
  redis.call('HDEL', KEYS[3], id, id .. ':m')
end
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
if freed > 0 then redis.call('DECRBY', KEYS[4], freed) end
for _, name in ipairs(redis.call('ZRANGEBYSCORE', KEYS[6], '-inf', now)) do
  redis.call('HDEL', KEYS[5], name)
end
redis.call('ZREMRANGEBYSCORE', KEYS[6], '-inf', now)
settle(KEYS[7], KEYS[1])
return {#ids, redis.call('ZCARD', KEYS[1]), tonumber(redis.call('GET', KEYS[4]) or '0')}
"""

#: KEYS: allow, allow:ver. ARGV: recipient, its list. Returns the new version.
ALLOW_SCRIPT = """
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return redis.call('INCR', KEYS[2])
"""


class RedisRelayStore:
    """The relay queue in the state backend's Redis, shared by every instance."""

    def __init__(self, state: RedisState, *, max_items: int, max_bytes: int,
                 stats: Stats | None = None, clock: Callable[[], float] = time.time) -> None:
        self.state = state
        self.max_items = max_items
        self.max_bytes = max_bytes
        self.stats = stats
        self.clock = clock
        self.deadline = max(RELAY_DEADLINE, state.deadline)
        client = state.client
        self._enqueue = client.register_script(ENQUEUE_SCRIPT)
        self._fetch = client.register_script(FETCH_SCRIPT)
        self._ack = client.register_script(ACK_SCRIPT)
        self._purge = client.register_script(PURGE_SCRIPT)
        self._allow = client.register_script(ALLOW_SCRIPT)
        self._depths: dict[str, tuple[int, int]] = {}
        #: whether `_depths` was ever counted from Redis: until then (Redis was not there
        #: when this instance started) they say nothing about what waits in it
        self.depths_known = False
        self._allowlists: dict[str, frozenset[str]] = {}
        self._allow_version: bytes | None = None
        #: What the last persistence check found wrong (None: nothing, or not checked).
        self.persistence_warning: str | None = None
        #: The state backend's (healthy, since) when persistence was last checked: a
        #: different pair means Redis came back, maybe restarted with other settings.
        self._checked: tuple[bool, float] | None = None
        self._reported = False

    def __str__(self) -> str:
        return f"{self.state.settings} ({self.state.key('relay', '')}*)"

    @property
    def healthy(self) -> bool:
        return self.state.healthy

    @property
    def last_error(self) -> str | None:
        return None if self.state.healthy else self.state.last_error

    # --- lifecycle ---------------------------------------------------------------------

    async def open(self) -> None:
        """Read what the mirrors need if Redis answers now; if not, the first call after
        it returns does (starting while Redis is down is not an error)."""
        if self.state.healthy:
            try:
                await self.refresh()  # the lists, and the depths (not counted yet)
            except StoreUnavailable:
                pass

    async def aclose(self) -> None:
        """Nothing to close: the connections are the state backend's."""

    def set_bounds(self, max_items: int, max_bytes: int) -> None:
        self.max_items, self.max_bytes = max_items, max_bytes

    async def probe(self) -> None:
        """Recovery is the state backend's probe (every second); a call must not wait."""

    async def refresh(self) -> None:
        """Before a tool call: re-check persistence if Redis came back since the last
        check, and re-read the allow-lists if any instance changed them."""
        if (self.state.healthy, self.state.since) != self._checked and self.state.healthy:
            await self.check_persistence()
        version = await self._call("relay_allow", lambda: self.state.client.get(
            self._global("allow:ver")))
        if version != self._allow_version:
            lists = await self._call("relay_allow", lambda: self.state.client.hgetall(
                self._global("allow")))
            self._allowlists = {k.decode(): frozenset(s for s in v.decode().split("\n") if s)
                                for k, v in lists.items()}
            self._allow_version = version
        if not self.depths_known:  # Redis was away at `open`: count what waits, once
            await self._recount(int(self.clock()), purge=False)

    # --- the operations ----------------------------------------------------------------

    async def enqueue(self, recipient: str, sender: str, msg_id: str, envelope: bytes,
                      expires_at: int) -> Enqueued:
        now = int(self.clock())
        keys = self._keys(recipient, "seq", "q", "x", "i", "b", "d", "dx")
        keys.append(self._global("recipients"))
        keys += self._keys(recipient, "s")
        share_items, share_bytes = sender_share(self.max_items, self.max_bytes)
        args = [str(now), str(int(expires_at)), msg_id, sender, envelope,
                str(self.max_items), str(self.max_bytes), recipient, str(share_items),
                str(share_bytes)]
        item_id, outcome, items, size = await self._call(
            "relay_enqueue", lambda: self._enqueue(keys=keys, args=args))
        self._set_depth(recipient, int(items), int(size))
        if outcome == 2:
            raise QueueFull(FULL_RETRY_AFTER)
        if outcome == 3:
            raise MsgIdTaken(msg_id)
        return Enqueued(int(item_id), outcome == 1)

    async def fetch(self, recipient: str, limit: int) -> tuple[list[Item], bool]:
        keys = self._keys(recipient, "q", "i")
        args = [str(int(self.clock())), str(limit), str(MAX_PAGE_BYTES)]
        more, flat = await self._call("relay_fetch", lambda: self._fetch(keys=keys, args=args))
        items = [Item(int(flat[n]), int(flat[n + 1]), bytes(flat[n + 2]))
                 for n in range(0, len(flat), 3)]
        return items, bool(more)

    async def ack(self, recipient: str, ids: list[int]) -> int:
        if not ids:
            return 0
        keys = self._keys(recipient, "q", "x", "i", "b", "s")
        args = [str(i) for i in ids]
        acked, items, size = await self._call("relay_ack",
                                              lambda: self._ack(keys=keys, args=args))
        self._set_depth(recipient, int(items), int(size))
        return int(acked)

    async def set_allowlist(self, recipient: str, senders: tuple[str, ...]) -> None:
        keys = [self._global("allow"), self._global("allow:ver")]
        version = await self._call("relay_allow", lambda: self._allow(
            keys=keys, args=[recipient, "\n".join(senders)]))
        self._allowlists = {**self._allowlists, recipient: frozenset(senders)}
        # our copy is Redis's only when no other instance changed a list since we read
        # it (the version moved by exactly our own bump); otherwise the next refresh
        # must read them all again, or another instance's change would stay unseen
        before = self._allow_version
        known = int(before) if before is not None and before.isdigit() else None
        self._allow_version = (str(version).encode()
                               if known is not None and int(version) == known + 1 else None)

    async def purge(self) -> int:
        """Drop what expired and recount every queue's depth from Redis."""
        if self.state.healthy and (self.state.healthy, self.state.since) != self._checked:
            await self.check_persistence()
        return await self._recount(int(self.clock()), purge=True)

    def allowlists(self) -> dict[str, frozenset[str]]:
        return self._allowlists

    def depths(self) -> dict[str, tuple[int, int]]:
        return self._depths

    # --- persistence -------------------------------------------------------------------

    async def check_persistence(self) -> str | None:
        """Read Redis's persistence settings; warn (once per finding) when they can lose
        acknowledged items. Returns the warning, None when the settings are safe."""
        self._checked = (self.state.healthy, self.state.since)
        found: dict[str, str] = {}
        try:
            with trio.fail_after(self.deadline):
                for name in (*REQUIRED, "maxmemory-policy"):
                    got = await self.state.client.config_get([name])
                    found[name] = next(iter(got.values()), b"?").decode()
        except ResponseError as exc:  # CONFIG renamed or refused by an ACL
            warning = (f"cannot read Redis's persistence settings (CONFIG GET answered: "
                       f"{' '.join(str(exc).split())[:120]}); acknowledged relay items are "
                       "safe only with appendonly yes and appendfsync always: check them "
                       "on the Redis host")
        except Exception:
            self._checked = None
            return self.persistence_warning
        else:
            warning = _persistence_warning(found)
        if warning != self.persistence_warning or not self._reported:
            settings = {k.replace("-", "_"): v for k, v in found.items()}
            if warning is not None:
                log.warning("relay_store_may_lose_items", backend=str(self.state.settings),
                            **settings, detail=warning)
            else:
                log.info("relay_store_open", backend=str(self.state.settings), **settings)
            self._reported = True
        self.persistence_warning = warning
        return warning

    # --- plumbing ----------------------------------------------------------------------

    async def _call(self, op: str, fn: Callable[[], Awaitable[T]]) -> T:
        if not self.state.healthy:
            raise StoreUnavailable(f"redis unavailable: {self.state.last_error}")
        from pact_ingress.state.redis import Unavailable

        try:
            return await self.state.call(op, fn, self.deadline)
        except Unavailable as exc:
            raise StoreUnavailable(f"redis unavailable: {exc}") from None

    async def _recount(self, now: int, *, purge: bool) -> int:
        """Per recipient: the purge script (with `purge`, else with now = -1, which drops
        nothing) for its depth after."""
        members = await self._call("relay_purge", lambda: self.state.client.smembers(
            self._global("recipients")))
        expired = 0
        depths: dict[str, tuple[int, int]] = {}
        for raw in sorted(members):
            recipient = raw.decode()
            keys = self._keys(recipient, "q", "x", "i", "b", "d", "dx", "s")
            n, items, size = await self._call("relay_purge", lambda: self._purge(
                keys=keys, args=[str(now if purge else -1)]))
            expired += int(n)
            depths[recipient] = (int(items), int(size))
        self._depths = depths
        self.depths_known = True
        self._publish_depths()
        return expired

    def _keys(self, recipient: str, *names: str) -> list[str]:
        # the hash tag keeps one recipient's keys in one Redis Cluster slot
        return [self.state.key("relay", f"{{{recipient}}}", name) for name in names]

    def _global(self, name: str) -> str:
        return self.state.key("relay", name)

    def _set_depth(self, recipient: str, items: int, size: int) -> None:
        self._depths = {**self._depths, recipient: (items, size)}
        if self.stats is not None:
            self.stats.relay_queued_items.labels(recipient).set(items)
            self.stats.relay_queued_bytes.labels(recipient).set(size)

    def _publish_depths(self) -> None:
        if self.stats is None:
            return
        for recipient, (items, size) in self._depths.items():
            self.stats.relay_queued_items.labels(recipient).set(items)
            self.stats.relay_queued_bytes.labels(recipient).set(size)


def _persistence_warning(found: dict[str, str]) -> str | None:
    """What Redis's settings can lose of acknowledged relay items, in one sentence."""
    fix = "set appendonly yes and appendfsync always in redis.conf"
    policy = found.get("maxmemory-policy", "")
    evicts = (f"; maxmemory-policy {policy} may evict queued items when memory runs out "
              "(use noeviction or volatile-ttl)") if policy.startswith("allkeys") else ""
    if found.get("appendonly") != "yes":
        return ("appendonly is not yes: Redis holds queued relay items in memory only, and "
                f"a Redis restart or crash loses every acknowledged one; {fix}{evicts}")
    fsync = found.get("appendfsync")
    if fsync == "everysec":
        return ("appendfsync everysec: a power cut or kernel crash loses about the last "
                "second of acknowledged relay items (up to 2 s on a slow disk; a Redis "
                f"crash alone loses none); {fix}{evicts}")
    if fsync != "always":
        return (f"appendfsync {fsync}: the kernel decides when the AOF reaches the disk, so "
                f"a power cut loses up to ~30 s of acknowledged relay items; {fix}{evicts}")
    return evicts[2:] or None
