"""Shared state in Redis: the connection, its health, and the cluster-wide rate limiter.

Theory of operation
-------------------
**Client.** `coredis` (>= 6): a maintained, typed async Redis client whose I/O is built
on anyio, so it runs on trio natively — no asyncio bridge, no thread. Checked here: it
connects, reconnects after a Redis restart, and a call cancelled by a trio deadline
leaves the connection usable (the next reply is not the cancelled call's). redis-py's
asyncio client would need trio-asyncio. Retries are switched off: a decision has its
own short deadline, and a retry would only spend it.

The one exception is the rate-limit decision, on every request's path: through coredis
it cost ~400 µs of ingress CPU (more than a whole terminate request), nearly all of it
the library's per-call machinery. `RedisLimiter` sends its EVALSHA through
`state.resp_client` instead — a few persistent connections, one send and one receive per
decision — while everything else (and the health probe's write) stays on coredis. Both
connect with the same settings (AUTH, SELECT, TLS); the probe's `load` opens the
decision client's connections and loads the script there, so a Redis the decision
client cannot use (a wrong password) keeps the instance in fallback, as before.

**Health.** `RedisState` is either *shared* (Redis answers) or *fallback* (it does
not). Every call runs under a deadline; a failure or a timeout switches to fallback at
once, and while in fallback nothing waits on Redis at all. A probe task (`run`) checks
Redis every `PROBE_INTERVAL`; it switches back to shared when Redis connects and answers
a write within the decision deadline (a `SET … XX` that stores nothing), so a Redis
that is up but too slow, or answers PING but refuses writes (out of memory under
`noeviction`, a read-only replica), stays in fallback instead of flapping. While
shared, decisions themselves notice a slow Redis, so the probe then only looks for one
that is gone (`CONNECT_DEADLINE`): a flood that keeps this process's event loop busy
must not pass for a slow Redis. For the same reason a decision's deadline starts when
it has its turn for a connection (`RedisLimiter._turns`), and the probe keeps the
connections open (`RespClient.warm`) so that a decision does not connect. Each switch
is one log line, the `state_shared` gauge and `state_fallbacks` counter, and `/status`
(`state`). Starting while Redis is down is not an error: the instance starts in
fallback and joins when Redis comes.

**Rate limits** (`RedisLimiter`). The buckets and their arithmetic are
`proto.ratelimit`'s: the same demands (which buckets a call draws on, cost, emission
interval, burst) are computed here in Python by the pure limiter's own function, and
`GCRA_SCRIPT` runs its admission rule on them inside Redis — every bucket read, judged
and (all or nothing) charged in one script, so two instances deciding at once cannot
both spend the last call, and one round trip per decision. The script reads Redis's
own clock (`TIME`), so instances with skewed clocks agree. Tests may pass an explicit
`now` instead, to compare the script with the pure limiter decision by decision.

A bucket key expires (PX) when its theoretical arrival time passes: an expired bucket is
a full one, as in the pure limiter, so Redis forgets idle clients by itself. What Redis
may hold at most is the operator's `maxmemory` (with `volatile-ttl` eviction, an evicted
bucket errs towards admitting, like the pure limiter's LRU).

While in fallback, decisions go to this instance's own `LocalLimiter`: limits still
hold, per instance instead of cluster-wide. Its buckets start from what this instance
charged during earlier fallbacks, not from the shared counts.

**The relay queue** (`relay_store`) is `state.relay_store.RedisRelayStore`, on this
client and this health: while in fallback the relay answers ``unavailable``.
"""

from __future__ import annotations

import json
import math
import ssl
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import coredis
import trio
from coredis.retry import NoRetryPolicy
from coredis.tokens import PureToken

from pact_ingress.logs import log
from pact_ingress.model import RedisSettings, Relay
from pact_ingress.proto.ratelimit import (
    _EPSILON,
    ALLOWED,
    BucketId,
    Budget,
    Decision,
    Limited,
    RateLimiter,
    client_bucket,
)
from pact_ingress.state.limiter import LocalLimiter
from pact_ingress.state.registry import RedisRegistry
from pact_ingress.state.resp_client import RespClient, Script
from pact_ingress.stats import Stats

if TYPE_CHECKING:
    from pact_ingress.state.relay_store import RedisRelayStore

#: The default of `state.deadline`: a rate-limit decision waits at most this long for
#: Redis before this instance decides alone. A request must not feel a sick Redis, and a
#: healthy one answers in well under a millisecond on the same network (a Redis in
#: another data centre needs the setting raised above its round trip).
DECISION_DEADLINE = RedisSettings.deadline
#: How often the health probe checks Redis (in both states), so the status is current
#: without traffic and recovery is noticed within about this long.
PROBE_INTERVAL = 1.0
#: A probe may take this long to (re)connect — TCP, TLS, AUTH — before its timed PING.
CONNECT_DEADLINE = 2.0
#: The longest a decision waits for its turn on a connection, behind the decisions
#: queued before it (a flood makes that queue). Past it this one decision is made by
#: the instance alone and the state stays shared: the queue is this process's, not
#: Redis's, but a request must not wait on it without a bound.
TURN_WAIT = 1.0
#: Connections to Redis per instance: decisions are short, so a few carry a busy edge.
MAX_CONNECTIONS = 16

T = TypeVar("T")

if TYPE_CHECKING:
    from pact_ingress.state.acme import RedisAcmeStore

#: KEYS: the buckets. ARGV[1]: now in seconds, '' for Redis's own clock; ARGV[2]: the
#: float slack; then per bucket: cost, emission interval, burst, prepaid (`_demands`).
#: Returns 'ok' (every bucket charged) or the retry wait in seconds (nothing charged).
#: Numbers cross as '%.17g' text, which round-trips a double exactly, so the arithmetic
#: is bit for bit the pure limiter's (same operations, same order).
GCRA_SCRIPT = """
if redis.replicate_commands then redis.replicate_commands() end
local now
local own_clock = ARGV[1] == ''
if own_clock then
  local t = redis.call('TIME')
  now = tonumber(t[1]) + tonumber(t[2]) / 1000000
else
  now = tonumber(ARGV[1])
end
local eps = tonumber(ARGV[2])
local starts = {}
local worst = nil
local retry = nil
for i, key in ipairs(KEYS) do
  local at = 2 + (i - 1) * 4
  local cost, interval, burst, prepaid = tonumber(ARGV[at + 1]), tonumber(ARGV[at + 2]),
                                         tonumber(ARGV[at + 3]), tonumber(ARGV[at + 4])
  local start = math.max(tonumber(redis.call('GET', key)) or now, now)
  starts[i] = start
  local fit = math.min(cost, math.max(0, burst - prepaid))
  local wait = start + fit * interval - burst * interval - now
  if worst == nil or wait > worst then worst = wait end
  local again = wait + prepaid * interval
  if retry == nil or again > retry then retry = again end
end
if worst > eps then return string.format('%.17g', retry) end
for i, key in ipairs(KEYS) do
  local at = 2 + (i - 1) * 4
  local tat = starts[i] + tonumber(ARGV[at + 1]) * tonumber(ARGV[at + 2])
  if own_clock then
    redis.call('SET', key, string.format('%.17g', tat), 'PX', math.ceil((tat - now) * 1000))
  else
    -- an explicit clock is not Redis's: expiring by Redis's clock would be wrong
    redis.call('SET', key, string.format('%.17g', tat))
  end
end
return 'ok'
"""


class Unavailable(Exception):
    """Redis did not answer in time, or failed; `str()` says why in one line."""


def _reason(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _tls_context(settings: RedisSettings) -> ssl.SSLContext | None:
    if settings.tls is None:
        return None
    tls = settings.tls
    context = ssl.create_default_context(cafile=str(tls.ca_file) if tls.ca_file else None)
    if tls.cert_file is not None and tls.key_file is not None:
        context.load_cert_chain(str(tls.cert_file), str(tls.key_file))
    return context


class RedisState:
    """The redis backend: one client, its health, and the shared kinds of state."""

    def __init__(self, settings: RedisSettings, stats: Stats, *,
                 probe_interval: float = PROBE_INTERVAL) -> None:
        self.settings = settings
        self.stats = stats
        self.deadline = settings.deadline
        self.probe_interval = probe_interval
        self.client: coredis.Redis[bytes] = coredis.Redis(
            host=settings.host, port=settings.port, db=settings.db,
            username=settings.username,
            password=settings.password.reveal() if settings.password else None,
            ssl_context=_tls_context(settings), connect_timeout=CONNECT_DEADLINE,
            max_connections=MAX_CONNECTIONS, client_name="pact-ingress",
            retry_policy=NoRetryPolicy(), decode_responses=False)
        self.healthy = False
        self.since = time.time()
        self.last_error: str | None = "not connected yet"
        self._seconds: dict[str, Any] = {}  # state_seconds by op, looked up once
        self.limiter = RedisLimiter(self)
        self.registry = RedisRegistry(self)
        stats.state_shared.set(0)

    #: False in a worker process of `serve --workers`: main logs the instance's switches
    #: (one line each); a worker's own client switching with it says so at debug level,
    #: and main takes a switch only a worker saw from its report (`app.Ingress`).
    announce = True

    def _say(self, level: Callable[..., None]) -> Callable[..., None]:
        return level if self.announce else log.debug

    def key(self, *parts: str) -> str:
        return self.settings.key_prefix + ":".join(parts)

    # -- health -----------------------------------------------------------------------

    async def call(self, op: str, fn: Callable[[], Awaitable[T]], deadline: float) -> T:
        """`fn()` against Redis within `deadline`; Unavailable (and fallback) if not."""
        started = trio.current_time()
        try:
            with trio.fail_after(deadline):
                result = await fn()
        except trio.TooSlowError:
            self.lost(f"no answer within {deadline * 1000:.0f} ms")
            raise Unavailable("timeout") from None
        except Exception as exc:
            self.lost(_reason(exc))
            raise Unavailable(_reason(exc)) from exc
        seconds = self._seconds.get(op)
        if seconds is None:
            seconds = self._seconds[op] = self.stats.state_seconds.labels(op)
        seconds.observe(trio.current_time() - started)
        return result

    def lost(self, why: str) -> None:
        self.last_error = why
        if not self.healthy:
            return
        self.healthy = False
        self.since = time.time()
        self.stats.state_shared.set(0)
        self.stats.state_fallbacks.inc()
        self._say(log.warning)("state_backend_lost", backend=str(self.settings), error=why,
                    detail="rate limits are counted by this instance alone and new "
                    "certificate orders wait until it returns")

    def found(self) -> None:
        if self.healthy:
            return
        self.healthy = True
        self.since = time.time()
        self.last_error = None
        self.stats.state_shared.set(1)
        self._say(log.info)("state_backend_shared", backend=str(self.settings))

    async def probe(self) -> bool:
        """Connect if needed, load the scripts, and check Redis answers in time."""
        try:
            # (re)connecting and loading scripts may take longer than one decision...
            await self.call("connect", self.limiter.load, CONNECT_DEADLINE)
            # ...but shared mode needs a Redis that answers within the decision deadline,
            # and takes writes: every decision writes, and a Redis that is full under
            # `noeviction` (or a read-only replica) still answers PING, so a PING alone
            # would switch back to shared at every probe and lose it at the next decision
            # (while shared, decisions themselves notice a slow Redis: the probe only
            # looks for one that is gone, and must not take this process's own busy
            # event loop for a slow Redis)
            await self.call("ping", self._write_probe,
                            CONNECT_DEADLINE if self.healthy else self.deadline)
        except Unavailable:
            return False
        self.found()
        return True

    async def _write_probe(self) -> None:
        """A write Redis refuses when it refuses writes, which stores nothing: SET … XX
        of a key nobody creates (refused before it runs when Redis is out of memory)."""
        await self.client.set(self.key("probe"), b"", condition=PureToken.XX, px=1)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        """Hold the client's connections and probe Redis's health until cancelled."""
        self._say(log.info)("state_backend_connecting", backend=str(self.settings))
        async with self.client:
            try:
                if not await self.probe():
                    self._say(log.warning)("state_backend_unavailable", backend=str(self.settings),
                                error=self.last_error, detail="starting with this "
                                "instance's own rate-limit counts; joining when Redis "
                                "answers")
                task_status.started()
                while True:
                    await trio.sleep(self.probe_interval)
                    await self.probe()
            finally:
                self.limiter.resp.close()

    def acme_store(self, state_dir: Path) -> RedisAcmeStore:
        """Certificates shared by the cluster (reads the encryption key; raises SealError)."""
        from pact_ingress.state.acme import open_acme_store

        return open_acme_store(state_dir, self)
    def relay_store(self, relay: Relay, stats: Stats, clock: Callable[[], float]
                    ) -> RedisRelayStore:
        from pact_ingress.state.relay_store import RedisRelayStore

        return RedisRelayStore(self, max_items=relay.max_items, max_bytes=relay.max_bytes,
                               stats=stats, clock=clock)

    def status(self) -> dict[str, Any]:
        return {
            "backend": "redis",
            "mode": "shared" if self.healthy else "fallback",
            "since": self.since,
            "last_error": self.last_error,
        }


class RedisLimiter:
    """`proto.ratelimit` budgets kept in Redis, charged once across every instance."""

    def __init__(self, state: RedisState, fallback: LocalLimiter | None = None) -> None:
        self.state = state
        self.fallback = fallback or LocalLimiter()
        self.script = Script(GCRA_SCRIPT)
        # the hot path's own client (see state.resp_client for why not coredis)
        self.resp = RespClient(state.settings, ssl_context=_tls_context(state.settings))
        # Decisions take turns for the client's connections here, before the deadline
        # starts: the deadline measures Redis, and a flood that keeps this process's
        # event loop busy must not make its own queue look like a sick Redis (every
        # decision would then be made alone, the cluster's budget one per instance).
        # One connection is left to the probe's script load, which takes no turn.
        self._turns = trio.Semaphore(max(1, self.resp.max_connections - 1))
        self._prefix = state.key("rl", "")
        self._decided_shared = state.stats.rate_decisions.labels("shared")
        self._decided_alone = state.stats.rate_decisions.labels("fallback")

    async def load(self) -> None:
        """Put the script into Redis's cache (a restarted Redis has forgotten it), and
        open the decision connections, so that decisions do not connect."""
        await self.resp.script_load(self.script)
        await self.resp.warm()

    async def check_calls(
        self,
        ip: str | None,
        keys: Iterable[str | None],
        now: float,
        *,
        budget: Budget | None = None,
        scope: str = "",
        prepaid: int = 0,
    ) -> Decision:
        """`RateLimiter.check_calls` cluster-wide: Redis's clock, not `now`, unless Redis
        is unavailable — then this instance's own buckets decide, on `now`."""
        keys = list(keys)
        if self.state.healthy:
            try:
                decision = await self.decide(ip, keys, budget=budget, scope=scope,
                                             prepaid=prepaid)
            except Unavailable:
                pass
            else:
                self._decided_shared.inc()
                return decision
        self._decided_alone.inc()
        return await self.fallback.check_calls(ip, keys, now, budget=budget, scope=scope,
                                               prepaid=prepaid)

    async def decide(
        self,
        ip: str | None,
        keys: Iterable[str | None],
        *,
        budget: Budget | None = None,
        scope: str = "",
        prepaid: int = 0,
        now: float | None = None,
    ) -> Decision:
        """One decision in Redis (raises Unavailable); `now=None` is Redis's own clock."""
        budget = budget or self.fallback.default_budget
        client = client_bucket(ip)
        # the pure limiter's own function: which buckets, at what cost, interval, burst
        demands = RateLimiter._demands(client, Counter(keys), budget, scope, prepaid)
        if not demands:
            return ALLOWED
        names: list[str] = []
        args: list[str] = ["" if now is None else repr(float(now)), repr(_EPSILON)]
        for bucket, (cost, interval, burst, prepaid_here) in demands.items():
            names.append(self._name(scope, client, bucket))
            args += [str(cost), repr(interval), str(burst), str(prepaid_here)]
        turns = self._turns
        try:
            turns.acquire_nowait()  # the usual case: a turn is free, no scope to enter
        except trio.WouldBlock:
            with trio.move_on_after(TURN_WAIT) as waiting:
                await turns.acquire()
            if waiting.cancelled_caught:  # this process's queue, not Redis: state stands
                raise Unavailable(f"decisions queued for over {TURN_WAIT:g} s") from None
        try:
            if not self.state.healthy:  # lost while this decision waited for its turn
                raise Unavailable(self.state.last_error or "unavailable")
            answer = await self.state.call(
                "ratelimit", lambda: self.resp.evalsha(self.script, names, args),
                self.state.deadline)
        finally:
            turns.release()
        if answer == b"ok":
            return ALLOWED
        return Limited(max(1, math.ceil(float(answer) - _EPSILON)))

    def _name(self, scope: str, client: str | None, bucket: BucketId) -> str:
        # The {...} hash tag puts every bucket of one decision (same scope, same client)
        # in one Redis Cluster slot; the JSON tail makes the name unambiguous whatever
        # the caller key holds.
        return f"{self._prefix}{{{scope}/{client}}}{json.dumps(bucket, separators=(',', ':'))}"
