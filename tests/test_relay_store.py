"""The relay store in process: group commit, dedupe, bounds, expiry on an injected clock,
allow-lists across reopen, and a broken store that answers instead of crashing.

The contract tests run against both stores the state seam can give the relay: the
embedded SQLite one and the Redis one (a real redis-server, a fresh key prefix per test).

Also the sans-I/O rules of `proto/relay.py` that need no store.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from pact_ingress.identity import keygen
from pact_ingress.model import RedisSettings, Relay
from pact_ingress.proto import relay as rules
from pact_ingress.relay.store import (
    Enqueued,
    MsgIdTaken,
    QueueFull,
    RelayStore,
    SqliteStore,
    StoreUnavailable,
    inspect,
    purge_file,
)
from pact_ingress.state import LocalState, StateBackend
from pact_ingress.state.redis import RedisState
from pact_ingress.stats import Stats
from tests.redis_server import RedisServer
from tests.relay_env import envelope

A, B = "sha256:" + "A" * 43, "sha256:" + "B" * 43
C, D = "sha256:" + "C" * 43, "sha256:" + "D" * 43
_prefixes = itertools.count()


class Clock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


async def _store(path: Path, clock: Clock | None = None, **kw: int) -> SqliteStore:
    store = SqliteStore(path, max_items=kw.get("max_items", 100),
                        max_bytes=kw.get("max_bytes", 10_000), stats=Stats(),
                        clock=clock or Clock())
    await store.open()
    return store


@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture(params=["sqlite", "redis"])
def kind(request: pytest.FixtureRequest) -> str:
    if request.param == "redis":
        request.getfixturevalue("redis")  # started once per module
    return str(request.param)


Make = Callable[..., Awaitable[RelayStore]]


@pytest.fixture
async def make(kind: str, request: pytest.FixtureRequest, tmp_path: Path,
               nursery: trio.Nursery) -> Make:
    """Opens a store of `kind` through the state seam, as the app does; every store made
    in one test sees the same queue (the same file, or the same Redis key prefix)."""
    backend: StateBackend = LocalState()
    if kind == "redis":
        server: RedisServer = request.getfixturevalue("redis")
        state = RedisState(RedisSettings(
            host=server.host, port=server.port, db=0, encryption_key_file=Path("/nonexistent"),
            key_prefix=f"t{next(_prefixes)}:", deadline=2.0), Stats(), probe_interval=0.05)
        await nursery.start(state.run)
        backend = state

    async def open_store(clock: Clock | None = None, **kw: int) -> RelayStore:
        relay = Relay(host="relay.test", cert="acme", store=tmp_path / "q.sqlite",
                      max_items=kw.get("max_items", 100), max_bytes=kw.get("max_bytes", 10_000))
        store = backend.relay_store(relay, Stats(), clock or Clock())
        await store.open()
        return store

    return open_store


async def test_concurrent_enqueues_share_commits(make: Make) -> None:
    store = await make(max_items=1000, max_bytes=10**6)
    try:
        async with trio.open_nursery() as nursery:
            for i in range(200):
                nursery.start_soon(store.enqueue, A, B, f"m{i}", b"x" * 10, 2_000_000_000)
        assert await store.purge() == 0  # recounts
        assert store.depths()[A] == (200, 2000)
        if isinstance(store, SqliteStore):
            # 200 durable calls in far fewer fsyncs: that is the group commit
            assert 1 <= store.commits < 100, store.commits
        items, more = await store.fetch(A, 1000)
        assert [i.envelope for i in items] == [b"x" * 10] * 200 and not more
        assert [i.id for i in items] == sorted(i.id for i in items)  # oldest first
    finally:
        await store.aclose()


async def test_concurrent_enqueues_with_duplicates_and_a_bound(make: Make) -> None:
    """Concurrent enqueues (one transaction carries many, in one statement where they
    fit): each key stored once, every other call of that key told duplicate with its id,
    and the bound exact — as if the calls had come one by one."""
    store = await make(max_items=1000, max_bytes=10**6)
    results: dict[int, list[Any]] = {}

    async def one(key: int, sender: str = B) -> None:
        try:
            results.setdefault(key, []).append(
                await store.enqueue(A, sender, f"m{key}", b"y" * (key + 1), 2_000_000_000))
        except QueueFull:
            results.setdefault(key, []).append("full")

    try:
        async with trio.open_nursery() as nursery:
            for i in range(360):  # every key three times, all within the bounds
                nursery.start_soon(one, i % 120)
        items, more = await store.fetch(A, 1000)
        assert not more and len(items) == 120
        by_size = {len(i.envelope): i.id for i in items}
        for key, outcomes in results.items():
            assert "full" not in outcomes
            assert len([o for o in outcomes if not o.duplicate]) == 1, (key, outcomes)
            assert {o.id for o in outcomes} == {by_size[key + 1]}
        assert await store.purge() == 0  # recounts
        assert store.depths()[A] == (120, sum(range(1, 121)))
        results.clear()
        store.set_bounds(150, 10**6)
        # 40 new keys, 30 places left; from another sender (B's 120 are more than its
        # share of 150 now), which may take all 30: its share is 75
        async with trio.open_nursery() as nursery:
            for key in range(120, 160):
                nursery.start_soon(one, key, C)
        outcomes = [o for v in results.values() for o in v]
        assert sum(o == "full" for o in outcomes) == 10
        assert all(not o.duplicate for o in outcomes if o != "full")
        assert await store.purge() == 0
        assert store.depths()[A][0] == 150
    finally:
        await store.aclose()


async def test_dedupe_bounds_ack(make: Make) -> None:
    """The whole queue's bounds, met by three senders none of which is past its share
    (two items, 20 bytes of 4 and 40)."""
    store = await make(max_items=4, max_bytes=40)
    try:
        first = await store.enqueue(A, B, "m1", b"0123456789", 2_000_000_000)
        again = await store.enqueue(A, B, "m1", b"0123456789", 2_000_000_000)
        assert again.id == first.id and again.duplicate and not first.duplicate
        await store.enqueue(A, B, "m2", b"0123456789", 2_000_000_000)
        await store.enqueue(A, C, "c1", b"0123456789", 2_000_000_000)
        await store.enqueue(A, C, "c2", b"01234", 2_000_000_000)
        with pytest.raises(QueueFull) as full:
            await store.enqueue(A, D, "m3", b"0", 2_000_000_000)  # items bound
        assert full.value.retry_after == rules.FULL_RETRY_AFTER
        items, _ = await store.fetch(A, 10)
        assert await store.ack(A, [items[0].id, 424242]) == 1
        assert await store.ack(B, [items[1].id]) == 0  # not B's queue
        with pytest.raises(QueueFull):
            await store.enqueue(A, D, "m3", b"x" * 16, 2_000_000_000)  # bytes bound
        await store.enqueue(A, D, "m3", b"x" * 15, 2_000_000_000)
        assert (await store.enqueue(A, B, "m1", b"other", 2_000_000_000)).duplicate
    finally:
        await store.aclose()


async def test_a_msg_id_held_by_another_sender_is_refused_not_swallowed(make: Make) -> None:
    """A msg_id is the recipient's key whoever sends it: another sender's call under one
    that is held (queued, acked, at a full queue, or racing it in one batch) is refused
    with MsgIdTaken, never answered as a duplicate that stores nothing; the holder's own
    retry stays a duplicate."""
    store = await make(max_items=4, max_bytes=10_000)
    try:
        first = await store.enqueue(A, B, "m1", b"from B", 2_000_000_000)
        with pytest.raises(MsgIdTaken):
            await store.enqueue(A, C, "m1", b"from C", 2_000_000_000)
        assert (await store.enqueue(A, B, "m1", b"from B", 2_000_000_000)).id == first.id
        await store.enqueue(A, B, "m2", b"from B", 2_000_000_000)  # B's share is full
        await store.enqueue(A, C, "c1", b"from C", 2_000_000_000)
        await store.enqueue(A, C, "c2", b"from C", 2_000_000_000)  # the queue is full now
        with pytest.raises(MsgIdTaken):
            await store.enqueue(A, C, "m2", b"from C", 2_000_000_000)
        items, _ = await store.fetch(A, 10)
        assert await store.ack(A, [i.id for i in items]) == 4
        with pytest.raises(MsgIdTaken):  # acked, still remembered until it expires
            await store.enqueue(A, C, "m1", b"from C", 2_000_000_000)
        outcomes: list[object] = []

        async def race(sender: str) -> None:
            try:
                outcomes.append(await store.enqueue(A, sender, "m3", sender.encode(),
                                                    2_000_000_000))
            except MsgIdTaken:
                outcomes.append(sender)

        async with trio.open_nursery() as nursery:  # one batch for the SQLite writer
            for sender in (B, C, B, C):
                nursery.start_soon(race, sender)
        stored = [o for o in outcomes if isinstance(o, Enqueued)]
        refused = {o for o in outcomes if isinstance(o, str)}
        assert len(stored) == 2 and [o.duplicate for o in stored].count(False) == 1, outcomes
        assert len(refused) == 1 and len(outcomes) == 4, outcomes  # the loser's two calls
        winner = ({B, C} - refused).pop()
        items, _ = await store.fetch(A, 10)
        assert [i.envelope for i in items] == [winner.encode()], items
    finally:
        await store.aclose()


async def _refused(store: RelayStore, sender: str, msg_id: str, envelope: bytes,
                   expires_at: int = 2_000_000_000, recipient: str = A) -> int:
    """Enqueue that must be refused as full: its retry_after."""
    with pytest.raises(QueueFull) as full:
        await store.enqueue(recipient, sender, msg_id, envelope, expires_at)
    return full.value.retry_after


async def test_a_sender_holds_at_most_half_of_each_bound(make: Make) -> None:
    """Half of max_items (rounded up) and half of max_bytes per sender and recipient,
    refused as the whole queue's bound is; another sender still gets the rest, up to
    the whole bound, and a sender's share of one recipient is not of another's."""
    assert rules.sender_share(5, 1001) == (3, 501)
    assert rules.sender_share(1, 1) == (1, 1)
    store = await make(max_items=5, max_bytes=1000)
    try:
        for i in range(3):
            await store.enqueue(A, B, f"b{i}", b"x", 2_000_000_000)
        assert await _refused(store, B, "b3", b"x") == rules.FULL_RETRY_AFTER
        await store.enqueue(A, C, "c0", b"x", 2_000_000_000)
        await store.enqueue(A, C, "c1", b"x", 2_000_000_000)
        assert await _refused(store, C, "c2", b"x") == rules.FULL_RETRY_AFTER  # whole
        assert store.depths()[A] == (5, 5)
        await store.enqueue(B, B, "b3", b"x", 2_000_000_000)  # another recipient
        # bytes: 500 is B's share of recipient D's 1000
        await store.enqueue(D, B, "big", b"y" * 400, 2_000_000_000)
        assert await _refused(store, B, "more", b"y" * 101, recipient=D) > 0
        await store.enqueue(D, B, "more", b"y" * 100, 2_000_000_000)
        await store.enqueue(D, C, "c", b"y" * 500, 2_000_000_000)
        assert store.depths()[D] == (3, 1000)
    finally:
        await store.aclose()


async def test_a_duplicate_retry_is_not_counted_against_the_share(make: Make) -> None:
    """Retries of a queued call (the same msg_id) are answered as the duplicate and
    take nothing of the sender's share; one at a full share is still the duplicate."""
    store = await make(max_items=4, max_bytes=10_000)
    try:
        first = await store.enqueue(A, B, "m1", b"one", 2_000_000_000)
        for _ in range(3):
            assert (await store.enqueue(A, B, "m1", b"one", 2_000_000_000)).duplicate
        assert not (await store.enqueue(A, B, "m2", b"two", 2_000_000_000)).duplicate
        await _refused(store, B, "m3", b"three")
        again = await store.enqueue(A, B, "m1", b"one", 2_000_000_000)
        assert again.duplicate and again.id == first.id
        assert store.depths()[A] == (2, 6)
    finally:
        await store.aclose()


async def test_concurrent_calls_of_two_senders_stop_at_their_shares(make: Make) -> None:
    """Calls raced by two senders (one transaction of the SQLite writer carries many of
    them): each sender stops exactly at its share, both together at the whole bound."""
    store = await make(max_items=8, max_bytes=10_000)
    stored: dict[str, int] = {B: 0, C: 0}

    async def one(sender: str, i: int) -> None:
        try:
            await store.enqueue(A, sender, f"{sender[-1]}{i}", b"z", 2_000_000_000)
            stored[sender] += 1
        except QueueFull:
            pass

    try:
        async with trio.open_nursery() as nursery:
            for i in range(12):
                nursery.start_soon(one, B, i)
        assert stored == {B: 4, C: 0}
        async with trio.open_nursery() as nursery:
            for i in range(12, 24):
                for sender in (B, C):
                    nursery.start_soon(one, sender, i)
        assert stored == {B: 4, C: 4}
        assert await store.purge() == 0  # recounts
        assert store.depths()[A] == (8, 8)
    finally:
        await store.aclose()


async def test_a_senders_share_comes_back_after_acks_and_expiry(make: Make) -> None:
    """What a sender holds is counted from what is queued: once the node acks its items
    the sender can queue its whole share again, and once its items expired and were
    purged too (an expired item counts until the purge drops it, as it does for the
    whole queue's depth)."""
    clock = Clock()
    t0 = int(clock.now)
    store = await make(clock, max_items=4, max_bytes=10_000)
    try:
        for i in range(2):
            await store.enqueue(A, B, f"a{i}", b"x" * 10, t0 + 3600)
        await _refused(store, B, "a2", b"x")
        items, _ = await store.fetch(A, 10)
        assert await store.ack(A, [items[0].id]) == 1
        await store.enqueue(A, B, "a2", b"x" * 10, t0 + 3600)  # the acked one's place
        await _refused(store, B, "a3", b"x")
        items, _ = await store.fetch(A, 10)
        assert await store.ack(A, [i.id for i in items]) == 2
        for i in range(3, 5):  # expiring soon
            await store.enqueue(A, B, f"a{i}", b"x" * 10, t0 + 10)
        await _refused(store, B, "a5", b"x")
        clock.now = t0 + 10
        await _refused(store, B, "a5", b"x")  # expired, not purged: still held
        assert await store.purge() == 2
        for i in range(5, 7):
            await store.enqueue(A, B, f"a{i}", b"x" * 10, t0 + 3600)
        await _refused(store, B, "a7", b"x")
        assert store.depths()[A] == (2, 20)
    finally:
        await store.aclose()


async def test_pages_oldest_first_until_acked(make: Make) -> None:
    store = await make()
    try:
        for i in range(5):
            await store.enqueue(A, B, f"m{i}", f"e{i}".encode(), 2_000_000_000)
        items, more = await store.fetch(A, 2)
        assert [i.envelope for i in items] == [b"e0", b"e1"] and more
        again, _ = await store.fetch(A, 2)  # not acked: the same page again
        assert again == items
        assert await store.ack(A, [i.id for i in items]) == 2
        items, more = await store.fetch(A, 3)
        assert [i.envelope for i in items] == [b"e2", b"e3", b"e4"] and not more
        assert await store.ack(A, [i.id for i in items]) == 3
        assert await store.fetch(A, 3) == ([], False)
        assert store.depths()[A] == (0, 0)
    finally:
        await store.aclose()


async def test_expiry_and_purge_on_injected_clock(make: Make) -> None:
    clock = Clock()
    store = await make(clock)
    try:
        now = int(clock.now)
        await store.enqueue(A, B, "short", b"s", now + 60)
        await store.enqueue(A, B, "long", b"l", now + 3600)
        clock.now += 61
        items, _ = await store.fetch(A, 10)
        assert [i.envelope for i in items] == [b"l"]  # expired: invisible at once
        assert await store.purge() == 1
        assert store.depths()[A] == (1, 1)
        assert (await store.enqueue(A, B, "short", b"s", now + 7200)).duplicate is False
    finally:
        await store.aclose()


async def test_allowlists_and_depths_survive_reopen(make: Make, tmp_path: Path) -> None:
    path = tmp_path / "q.sqlite"
    store = await make()
    await store.set_allowlist(A, (B,))
    await store.enqueue(A, B, "m", b"abc", 2_000_000_000)
    await store.aclose()
    store = await make()
    try:
        assert store.allowlists() == {A: frozenset({B})}
        assert store.depths() == {A: (1, 3)}
        items, more = await store.fetch(A, 10)  # unacked: still there, again
        assert [i.envelope for i in items] == [b"abc"] and not more
    finally:
        await store.aclose()
    if not isinstance(store, SqliteStore):
        return  # the `relay` CLI reads the embedded store's file
    assert inspect(path, time.time())[0]["items"] == 1
    assert purge_file(path, time.time(), recipient=A, everything=True) == 1
    assert inspect(path, time.time())[0]["items"] == 0


async def test_corrupt_or_unwritable_store_is_unavailable(tmp_path: Path) -> None:
    bad = tmp_path / "bad.sqlite"
    bad.write_bytes(b"this is not a database" * 100)
    store = await _store(bad)
    try:
        assert not store.healthy and "not a database" in (store.last_error or "")
        with pytest.raises(StoreUnavailable):
            await store.enqueue(A, B, "m", b"x", 2_000_000_000)
        with pytest.raises(StoreUnavailable):
            await store.fetch(A, 1)
    finally:
        await store.aclose()
    if os.geteuid() == 0:
        return  # root writes anywhere: the unwritable case cannot be made here
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    store = await _store(locked / "q.sqlite")
    try:
        assert not store.healthy
    finally:
        await store.aclose()


# --- sans-I/O rules ----------------------------------------------------------------------


def test_check_relay_call_rules(tmp_path: Path) -> None:
    sender = keygen(tmp_path / "s.key", ed25519_key=True)
    recipient = keygen(tmp_path / "r.key")
    now = time.time()
    env = envelope(sender, recipient, msg_id="x", ts=int(now), exp=int(now) + 600)
    lists = {recipient.fingerprint: frozenset({sender.fingerprint})}
    ok = rules.check_relay_call(env, caller=sender.fingerprint,
                                caller_key=sender.key.public_key(),  # type: ignore[arg-type]
                                now=now, allowlists=lists)
    assert ok.header.msg_id == "x" and ok.expires_at == int(now) + 600
    # the retention cap: min(exp, now + 30 days)
    long = envelope(sender, recipient, msg_id="y", ts=int(now) - 86400,
                    exp=int(now) + 29 * 86400)
    capped = rules.check_relay_call(long, caller=sender.fingerprint,
                                    caller_key=sender.key.public_key(),  # type: ignore[arg-type]
                                    now=now + 2 * 86400, allowlists=lists)
    assert capped.expires_at == int(now) + 29 * 86400
    for allow in ({}, {recipient.fingerprint: frozenset()}):
        with pytest.raises(rules.Refusal) as denied:
            rules.check_relay_call(env, caller=sender.fingerprint,
                                   caller_key=sender.key.public_key(),  # type: ignore[arg-type]
                                   now=now, allowlists=allow)
        assert (denied.value.code, denied.value.reason) == (
            "permission_denied", rules.PERMISSION_DENIED_TEXT)
    assert rules.fetch_limit({}) == rules.DEFAULT_PAGE
    assert rules.fetch_limit({"limit": 10**6}) == rules.MAX_PAGE
    assert rules.ack_ids({"ids": [3, 1, 3, True, "2", -1]}) == [1, 3]
    assert rules.parse_allowlist(f'{{"senders": ["{A}", "{A}"]}}'.encode()) == (A,)
    error = rules.tool_error(rules.Refusal("rate_limited", "full", 7))
    assert error["structuredContent"] == {"code": "rate_limited", "retry_after": 7}


async def test_a_store_file_from_before_the_share_gets_its_index_and_counts_old_items(
    tmp_path: Path,
) -> None:
    """A file written before the sender share (no items_sender index, items queued):
    opening it adds the index, and the items already there count to their sender's
    share."""
    import sqlite3

    from pact_ingress.relay.store import _SCHEMA

    path = tmp_path / "q.sqlite"
    conn = sqlite3.connect(path)
    conn.executescript(_SCHEMA.replace(
        "CREATE INDEX IF NOT EXISTS items_sender ON items (recipient, sender, acked, size);",
        ""))
    conn.executemany("INSERT INTO items (recipient, sender, msg_id, queued_at, expires_at,"
                     " size, envelope) VALUES (?, ?, ?, 1800000000, 2000000000, 1, x'30')",
                     [(A, B, "old1"), (A, B, "old2")])
    conn.commit()
    assert not conn.execute("SELECT name FROM sqlite_master WHERE name = 'items_sender'"
                            ).fetchall()
    conn.close()
    store = await _store(path, max_items=4)
    try:
        with pytest.raises(QueueFull):
            await store.enqueue(A, B, "new", b"1", 2_000_000_000)
        await store.enqueue(A, C, "new", b"1", 2_000_000_000)
    finally:
        await store.aclose()
    conn = sqlite3.connect(path)
    try:
        assert conn.execute("SELECT name FROM sqlite_master WHERE name = 'items_sender'"
                            ).fetchall() == [("items_sender",)]
    finally:
        conn.close()
