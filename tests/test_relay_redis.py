"""The relay queue on a real redis-server, what only the Redis store has: the persistence
check (what it says for each setting, and when CONFIG is not allowed), and a Redis that
goes away — every operation answers unavailable at once, nothing is acknowledged that
was not stored, and it works again by itself when Redis returns."""

from __future__ import annotations

import itertools
import logging
from pathlib import Path

import pytest
import trio

from pact_ingress.model import RedisSettings, Relay
from pact_ingress.relay.store import MsgIdTaken, QueueFull, StoreUnavailable
from pact_ingress.state.redis import RedisState
from pact_ingress.state.relay_store import RELAY_DEADLINE, RedisRelayStore
from pact_ingress.stats import Stats
from tests.redis_server import RedisServer

A, B = "sha256:" + "A" * 43, "sha256:" + "B" * 43
DURABLE = ("--save", "", "--appendonly", "yes", "--appendfsync", "always")
_prefixes = itertools.count()


async def open_store(nursery: trio.Nursery, server: RedisServer,
                     prefix: str | None = None) -> RedisRelayStore:
    """A Redis relay store under its own key prefix (`prefix`: a shared one, as every
    instance of a cluster has)."""
    state = RedisState(RedisSettings(
        host=server.host, port=server.port, db=0, encryption_key_file=Path("/nonexistent"),
        key_prefix=prefix or f"r{next(_prefixes)}:", deadline=2.0), Stats(),
        probe_interval=0.05)
    await nursery.start(state.run)
    store = state.relay_store(Relay(host="relay.test", cert="acme", store=Path("/unused"),
                                    max_items=100, max_bytes=10_000), Stats(), trio.current_time)
    assert isinstance(store, RedisRelayStore)
    await store.open()
    return store


async def _config_set(store: RedisRelayStore, name: str, value: str) -> None:
    await store.state.client.config_set({name: value})


async def test_persistence_check_says_what_can_be_lost(
    nursery: trio.Nursery, tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    server = RedisServer(tmp_path / "redis")  # appendonly no: the test default
    try:
        with caplog.at_level(logging.INFO, logger="pact_ingress"):
            store = await open_store(nursery, server)
            assert "appendonly is not yes" in (store.persistence_warning or "")
            assert "loses every acknowledged one" in (store.persistence_warning or "")
            await _config_set(store, "appendonly", "yes")
            await _config_set(store, "appendfsync", "everysec")
            assert "last second" in (await store.check_persistence() or "")
            await _config_set(store, "appendfsync", "always")
            assert await store.check_persistence() is None
            await _config_set(store, "maxmemory-policy", "allkeys-lru")
            assert "may evict" in (await store.check_persistence() or "")
            await _config_set(store, "maxmemory-policy", "noeviction")
            assert await store.check_persistence() is None
            assert await store.check_persistence() is None  # unchanged: no new line
        lines = [(r.levelname, r.getMessage()) for r in caplog.records
                 if r.getMessage().startswith("relay_store")]
        assert lines == [("WARNING", "relay_store_may_lose_items")] * 2 + [
            ("INFO", "relay_store_open"), ("WARNING", "relay_store_may_lose_items"),
            ("INFO", "relay_store_open")], lines
    finally:
        server.stop()


async def test_persistence_check_without_config(nursery: trio.Nursery, tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "redis", extra=(*DURABLE, "--rename-command", "CONFIG", ""))
    try:
        store = await open_store(nursery, server)
        assert "cannot read Redis's persistence settings" in (store.persistence_warning or "")
        assert store.healthy  # a refused CONFIG is not a lost Redis
        assert not (await store.enqueue(A, B, "m", b"x", 2_000_000_000)).duplicate
    finally:
        server.stop()


async def test_redis_gone_answers_unavailable_then_recovers(
    nursery: trio.Nursery, tmp_path: Path,
) -> None:
    server = RedisServer(tmp_path / "redis", extra=DURABLE)
    try:
        store = await open_store(nursery, server)
        assert store.persistence_warning is None
        await store.enqueue(A, B, "before", b"b", 2_000_000_000)
        server.stop()
        # every operation fails (none hangs past the relay deadline), whether the state
        # backend has noticed yet or not
        for attempt in range(3):
            with trio.fail_after(RELAY_DEADLINE + 1):
                with pytest.raises(StoreUnavailable):
                    await store.enqueue(A, B, f"during{attempt}", b"d", 2_000_000_000)
                with pytest.raises(StoreUnavailable):
                    await store.fetch(A, 10)
                with pytest.raises(StoreUnavailable):
                    await store.ack(A, [1])
        assert not store.healthy and store.last_error
        server.start()  # the AOF brings back what was acknowledged
        with trio.fail_after(10):
            while not store.healthy:
                await trio.sleep(0.05)
        await store.refresh()
        items, _ = await store.fetch(A, 10)
        assert [i.envelope for i in items] == [b"b"]  # nothing from the failed calls
        assert not (await store.enqueue(A, B, "after", b"a", 2_000_000_000)).duplicate
        assert (await store.enqueue(A, B, "before", b"b", 2_000_000_000)).duplicate
    finally:
        server.stop()


async def test_a_dedupe_entry_written_before_it_named_its_sender_stays_a_duplicate(
    nursery: trio.Nursery, tmp_path: Path,
) -> None:
    """Dedupe entries now carry the sender ("ID expires_at sender"), so another sender's
    call under a held msg_id is refused; one an older version wrote ("ID expires_at")
    cannot say whose it is, and answers every sender's retry as the duplicate it was."""
    server = RedisServer(tmp_path / "redis")
    try:
        store = await open_store(nursery, server)
        first = await store.enqueue(A, B, "new", b"n", 2_000_000_000)
        dedupe = store._keys(A, "d")[0]
        assert await store.state.client.hget(dedupe, "new") == (
            f"{first.id} 2000000000 {B}".encode())
        with pytest.raises(MsgIdTaken):
            await store.enqueue(A, A, "new", b"n", 2_000_000_000)
        await store.state.client.hset(dedupe, {"new": f"{first.id} 2000000000"})
        for sender in (A, B):
            again = await store.enqueue(A, sender, "new", b"n", 2_000_000_000)
            assert again.duplicate and again.id == first.id
    finally:
        server.stop()


async def test_sender_counters_follow_the_queue_and_are_built_for_an_older_store(
    nursery: trio.Nursery, tmp_path: Path,
) -> None:
    """The per-sender counters (``{r}:s``) are what the queue holds after every enqueue,
    ack and purge — a sender with nothing queued has no field left — and a store whose
    items were queued before the counters existed gets them counted from its queue by
    the first script that touches it, so the share holds for those items too; counts
    an older instance left wrong are reset when the queue is drained."""
    server = RedisServer(tmp_path / "redis")
    try:
        clock = [1_800_000_000.0]
        store = await open_store(nursery, server)
        store.clock = lambda: clock[0]
        store.set_bounds(4, 10_000)  # a share of 2 items, 5000 bytes
        t0 = int(clock[0])
        counters = store._keys(A, "s")[0]

        async def held() -> dict[bytes, bytes]:
            return dict(await store.state.client.hgetall(counters))

        first = await store.enqueue(A, B, "b1", b"12345", t0 + 3600)
        await store.enqueue(A, B, "b1", b"12345", t0 + 3600)  # a duplicate: not counted
        await store.enqueue(A, A, "a1", b"xy", t0 + 10)
        assert await held() == {b":built": b"1", f"{B}:n".encode(): b"1",
                                f"{B}:b".encode(): b"5", f"{A}:n".encode(): b"1",
                                f"{A}:b".encode(): b"2"}
        assert await store.ack(A, [first.id]) == 1
        clock[0] = t0 + 10
        assert await store.purge() == 1  # A's item expired
        assert await held() == {b":built": b"1"}
        # as an older version left it: two items of B's, no counters
        await store.enqueue(A, B, "b2", b"1", t0 + 3600)
        await store.enqueue(A, B, "b3", b"1", t0 + 3600)
        await store.state.client.delete([counters])
        with pytest.raises(QueueFull):
            await store.enqueue(A, B, "b4", b"1", t0 + 3600)
        assert await held() == {b":built": b"1", f"{B}:n".encode(): b"2",
                                f"{B}:b".encode(): b"2"}
        items, _ = await store.fetch(A, 10)
        await store.state.client.delete([counters])  # counted by the ack, then given back
        assert await store.ack(A, [items[0].id]) == 1
        assert (await store.enqueue(A, B, "b4", b"1", t0 + 3600)).duplicate is False
        with pytest.raises(QueueFull):
            await store.enqueue(A, B, "b5", b"1", t0 + 3600)
        # an older instance's acks did not give B's items back: wrong until the queue
        # is drained, which resets the counts to what the queue holds, nothing
        await store.state.client.hincrby(counters, f"{B}:n", 5)
        items, _ = await store.fetch(A, 10)
        assert await store.ack(A, [i.id for i in items]) == 2
        assert await held() == {b":built": b"1"}
        await store.enqueue(A, B, "b5", b"1", t0 + 3600)
        await store.enqueue(A, B, "b6", b"1", t0 + 3600)
    finally:
        server.stop()
