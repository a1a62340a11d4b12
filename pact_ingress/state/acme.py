"""ACME as a cluster: what several instances share so that they act as one for the CA.

Theory of operation
-------------------
`AcmeStore` is what `acme.manager.CertManager` stores through. The local backend gives
it the file store (`acme.store.Store`: files under `state_dir`, nothing shared, exactly
what one instance always did). The redis backend gives it `RedisAcmeStore`, which keeps
the same files as this instance's cache (served contexts are loaded from them, and
`certs list` still works offline) and adds, in Redis:

* **the account**: one per CA directory for the whole cluster. The key is created with
  SET NX, so two instances starting together end up with the same one; the key is
  sealed (`state.seal`), the registration is public data and kept as JSON.
* **certificates**: chain, sealed key, serial and the renewal plan (`next_renewal`)
  of each host, written in one MSET so a reader never sees a new serial with an old key.
  Every instance polls the serials of its hosts every `PICKUP_INTERVAL` (one MGET) and
  adopts a serial it does not serve yet: new and renewed certificates reach every
  instance within about that long, without a restart. Polling instead of pub/sub: a
  message published while an instance was reconnecting would be lost, a serial is not.
* **one order per name**: a lease (`Lease`: SET NX PX with a random owner token) taken
  before an order. The holder renews it every `PICKUP_INTERVAL` while the order runs;
  only the holder can release it (compare-and-delete in Lua); a holder that dies stops
  renewing and the lease expires after `LOCK_TTL`. Whoever does not get it is told
  `OrderElsewhere` and looks again later, by then usually adopting the winner's
  certificate. The winner checks Redis again *after* taking the lease: an instance that
  finished the same order a moment earlier released the lease just before.
* **challenge answers**: the key authorization of a pending HTTP-01 or TLS-ALPN-01
  challenge, with a TTL (`CHALLENGE_TTL`, longer than any order) in case its orderer
  dies. Whichever instance the CA reaches looks there when its own tables have no
  answer. For TLS-ALPN-01 each instance builds the challenge certificate itself from the
  key authorization (the CA checks only the name and the digest it carries), so no key
  material of a challenge crosses Redis.

Faults: every Redis call goes through `RedisState.call` (deadline, health). While Redis
is unavailable nothing waits on it: an order is refused at the lease with
`SharedStateUnavailable` (the manager retries quietly), pick-up pauses, and the
certificates already loaded keep being served from memory. A blob that does not open
(another key, tampered) is refused with a `SealError` reason, never served.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol

import trio

from pact_ingress.acme.store import (
    AcmeError,
    OrderElsewhere,
    SharedStateUnavailable,
    Store,
    StoredCert,
    directory_slug,
    host_dir_name,
)
from pact_ingress.logs import log
from pact_ingress.state.redis import CONNECT_DEADLINE, RedisState, Unavailable
from pact_ingress.state.seal import Sealer, SealError

#: How often every instance looks for certificates stored by another, and renews the
#: leases of its running orders.
PICKUP_INTERVAL = 1.0
#: A lease not renewed for this long is free again (its holder died or lost Redis).
#: Many renewals long, so a busy instance never loses a lease it still uses.
LOCK_TTL = 20.0
#: A published challenge answer outlives any order (`issuer.ORDER_TIMEOUT`) by far.
CHALLENGE_TTL = 600.0
#: One ACME round trip to Redis (a few small keys) may take this long.
ACME_DEADLINE = CONNECT_DEADLINE

RENEW_SCRIPT = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""
RELEASE_SCRIPT = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


class AcmeStore(Protocol):
    """Where `CertManager` keeps accounts and certificates (see the module docstring).
    The synchronous methods run in worker threads, the async ones on the trio thread."""

    shared: bool

    def read_account(self, directory_url: str) -> tuple[bytes | None, dict[str, Any] | None]: ...
    def write_account_key(self, directory_url: str, key_pem: bytes) -> None: ...
    def write_registration(self, directory_url: str, registration: dict[str, Any]) -> None: ...
    def read_meta(self, host: str) -> dict[str, Any]: ...
    def write_meta(self, host: str, **changes: Any) -> None: ...
    def load_cert(self, host: str) -> StoredCert | None: ...
    def save_cert(self, host: str, chain_pem: bytes, key_pem: bytes, *, directory: str,
                  next_renewal: float | None) -> StoredCert: ...
    def remove_leftovers(self, now: float) -> list[Path]: ...

    def order_lock(self, host: str) -> contextlib.AbstractAsyncContextManager[None]: ...
    async def fetch_shared(self, host: str, known_serial: str | None
                           ) -> tuple[StoredCert, float | None] | None: ...
    async def publish_challenge(self, kind: str, host: str, token: str,
                                key_authorization: str) -> None: ...
    async def withdraw_challenge(self, kind: str, host: str, token: str) -> None: ...
    async def find_challenge(self, kind: str, host: str, token: str) -> str | None: ...
    async def watch(self, known: Callable[[], dict[str, str | None]],
                    changed: Callable[[str], Awaitable[None]]) -> None: ...


def owner_token() -> str:
    """Who holds a lease: readable in `redis-cli GET` (host, pid), unique by its tail."""
    return f"{socket.gethostname()}/{os.getpid()}/{secrets.token_hex(8)}"


class Lease:
    """A lock in Redis with an owner and an expiry (see the module docstring)."""

    def __init__(self, state: RedisState, name: str, ttl: float = LOCK_TTL,
                 owner: str | None = None) -> None:
        self.state = state
        self.name = name
        self.ttl_ms = max(1, round(ttl * 1000))
        self.owner = owner or owner_token()
        self._renew = state.client.register_script(RENEW_SCRIPT)
        self._release = state.client.register_script(RELEASE_SCRIPT)

    async def acquire(self) -> bool:
        """True when this owner holds the lease now; raises Unavailable."""
        got = await self.state.call("lock", lambda: self.state.client.set(
            self.name, self.owner, condition=_nx(), px=self.ttl_ms), ACME_DEADLINE)
        return bool(got)

    async def holder(self) -> str | None:
        raw = await self.state.call("lock", lambda: self.state.client.get(self.name),
                                    ACME_DEADLINE)
        return raw.decode(errors="replace") if raw else None

    async def renew(self) -> bool:
        """Push the expiry out again; False when this owner no longer holds it."""
        got = await self.state.call("lock", lambda: self._renew(
            keys=[self.name], args=[self.owner, str(self.ttl_ms)]), ACME_DEADLINE)
        return bool(got)

    async def release(self) -> bool:
        """Free it, only if this owner still holds it (never someone else's)."""
        got = await self.state.call("lock", lambda: self._release(
            keys=[self.name], args=[self.owner]), ACME_DEADLINE)
        return bool(got)


def _nx() -> Any:
    from coredis.tokens import PureToken

    return PureToken.NX


class RedisAcmeStore(Store):
    """The file store as a local cache, and the cluster's copy in Redis."""

    shared = True

    def __init__(self, state_dir: Path, state: RedisState, sealer: Sealer) -> None:
        super().__init__(state_dir)
        self.state = state
        self.sealer = sealer
        self._held: dict[str, Lease] = {}
        self._unreadable: set[tuple[str, str]] = set()

    def _key(self, *parts: str) -> str:
        return self.state.key("acme", *parts)

    async def _call(self, op: str, fn: Callable[[], Awaitable[Any]]) -> Any:
        if not self.state.healthy:  # known to be away: no waiting
            raise SharedStateUnavailable(f"shared state unavailable: {self.state.last_error}")
        try:
            return await self.state.call(op, fn, ACME_DEADLINE)
        except Unavailable as exc:
            raise SharedStateUnavailable(f"shared state unavailable: {exc}") from None

    def _in_trio(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        """From a worker thread: run `fn` on the trio thread and wait for it."""
        return trio.from_thread.run(fn, *args)

    # -- accounts (worker threads) ------------------------------------------------------
    def _account_keys(self, directory_url: str) -> tuple[str, str]:
        slug = directory_slug(directory_url)
        return self._key("account", slug, "key"), self._key("account", slug, "registration")

    def read_account(self, directory_url: str) -> tuple[bytes | None, dict[str, Any] | None]:
        key_name, reg_name = self._account_keys(directory_url)
        sealed, reg = self._in_trio(self._mget, [key_name, reg_name])
        key = self._open(sealed, key_name) if sealed else None
        return key, (json.loads(reg) if reg else None)

    def write_account_key(self, directory_url: str, key_pem: bytes) -> None:
        # NX: the first instance's key wins; the caller reads the account back
        key_name, _ = self._account_keys(directory_url)
        blob = self.sealer.seal(key_pem, key_name)
        self._in_trio(self._call, "acme", lambda: self.state.client.set(
            key_name, blob, condition=_nx()))

    def write_registration(self, directory_url: str, registration: dict[str, Any]) -> None:
        _, reg_name = self._account_keys(directory_url)
        data = json.dumps(registration, sort_keys=True)
        self._in_trio(self._call, "acme", lambda: self.state.client.set(reg_name, data))

    # -- certificates ---------------------------------------------------------------------
    def _cert_keys(self, host: str) -> list[str]:
        d = host_dir_name(host)
        return [self._key("cert", d, part) for part in ("serial", "chain", "key", "meta")]

    def save_cert(self, host: str, chain_pem: bytes, key_pem: bytes, *, directory: str,
                  next_renewal: float | None) -> StoredCert:
        """Worker thread: the local files first (this instance serves them), then the
        cluster's copy in one MSET (what every other instance picks up)."""
        stored = super().save_cert(host, chain_pem, key_pem, directory=directory,
                                   next_renewal=next_renewal)
        serial_k, chain_k, key_k, meta_k = self._cert_keys(host)
        meta = json.dumps({"directory": directory, "next_renewal": next_renewal})
        mapping = {serial_k: stored.serial, chain_k: chain_pem,
                   key_k: self.sealer.seal(key_pem, key_k), meta_k: meta}
        self._in_trio(self._call, "acme", lambda: self.state.client.mset(mapping))
        return stored

    async def fetch_shared(self, host: str, known_serial: str | None
                           ) -> tuple[StoredCert, float | None] | None:
        names = self._cert_keys(host)
        serial, chain, sealed, meta = await self._mget(names)
        if not serial or not chain or not sealed:
            return None
        serial_s = serial.decode()
        if serial_s == known_serial:
            return None
        try:
            key_pem = self._open(sealed, names[2])
        except AcmeError as exc:
            if (host, serial_s) not in self._unreadable:  # once per certificate
                self._unreadable.add((host, serial_s))
                log.error("cert_shared_unreadable", host=host, serial=serial_s, error=str(exc))
            raise
        plan = json.loads(meta) if meta else {}
        renew_at = plan.get("next_renewal")
        stored = await trio.to_thread.run_sync(lambda: Store.save_cert(
            self, host, chain, key_pem, directory=plan.get("directory") or "",
            next_renewal=renew_at))
        return stored, renew_at if isinstance(renew_at, (int, float)) else None

    async def _mget(self, names: list[str]) -> tuple[bytes | None, ...]:
        return tuple(await self._call("acme", lambda: self.state.client.mget(names)))

    def _open(self, blob: bytes, name: str) -> bytes:
        try:
            return self.sealer.open(blob, name)
        except SealError as exc:
            raise AcmeError(str(exc), reason="sealed") from exc

    # -- one order per name ---------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def order_lock(self, host: str) -> AsyncIterator[None]:
        lease = Lease(self.state, self._key("lock", host_dir_name(host)))
        if not await self._call("lock", lease.acquire):
            holder = await self._call("lock", lease.holder)
            raise OrderElsewhere(f"another instance orders {host} ({holder or 'just done'})")
        self._held[host] = lease  # renewed by `watch` while the order runs
        try:
            yield
        finally:
            self._held.pop(host, None)
            with trio.CancelScope(shield=True):
                try:
                    await self.state.call("lock", lease.release, ACME_DEADLINE)
                except Unavailable:
                    pass  # it expires by itself after LOCK_TTL

    async def _renew_leases(self) -> None:
        for host, lease in list(self._held.items()):
            try:
                still = await self.state.call("lock", lease.renew, ACME_DEADLINE)
            except Unavailable:
                continue  # logged by the state; the lease has LOCK_TTL to spare
            if not still and self._held.get(host) is lease:
                del self._held[host]
                log.warning("cert_order_lock_lost", host=host, detail="the lease expired "
                            "while Redis was away; another instance may order this name too")

    # -- challenge answers ----------------------------------------------------------------
    def _challenge_key(self, kind: str, host: str, token: str) -> str:
        # TLS-ALPN-01 has no token on the wire: one pending answer per name
        return self._key("challenge", kind, host_dir_name(host), token if kind == "http-01"
                         else "-")

    async def publish_challenge(self, kind: str, host: str, token: str,
                                key_authorization: str) -> None:
        name = self._challenge_key(kind, host, token)
        await self._call("acme", lambda: self.state.client.set(
            name, key_authorization, px=round(CHALLENGE_TTL * 1000)))

    async def withdraw_challenge(self, kind: str, host: str, token: str) -> None:
        name = self._challenge_key(kind, host, token)
        try:
            await self._call("acme", lambda: self.state.client.delete([name]))
        except SharedStateUnavailable:
            pass  # the TTL removes it

    async def find_challenge(self, kind: str, host: str, token: str) -> str | None:
        try:
            name = self._challenge_key(kind, host, token)
            raw = await self._call("acme", lambda: self.state.client.get(name))
        except AcmeError:
            return None
        return raw.decode("ascii", "replace") if raw else None

    # -- pick-up ----------------------------------------------------------------------------
    async def watch(self, known: Callable[[], dict[str, str | None]],
                    changed: Callable[[str], Awaitable[None]]) -> None:
        while True:
            await trio.sleep(PICKUP_INTERVAL)
            await self._renew_leases()
            serials = known()
            hosts = sorted(serials)
            if not hosts or not self.state.healthy:
                continue
            try:
                names = [self._cert_keys(h)[0] for h in hosts]
                found = await self._mget(names)
            except AcmeError:
                continue
            for host, serial in zip(hosts, found):
                if serial and serial.decode() != serials[host]:
                    await changed(host)


def open_acme_store(state_dir: Path, state: RedisState) -> RedisAcmeStore:
    from pact_ingress.state.seal import read_key_file

    return RedisAcmeStore(state_dir, state, Sealer(read_key_file(
        state.settings.encryption_key_file)))
